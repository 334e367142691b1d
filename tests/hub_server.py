"""A Hub-compatible HTTP endpoint on 127.0.0.1 (just what huggingface_hub's create/upload/download calls use),
so push/pull tests run the real client code without a network."""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class HubState:
    def __init__(self):
        self.repos: dict[str, dict[str, bytes]] = {}
        self.lock = threading.Lock()

    def sha(self, repo: str) -> str:
        h = hashlib.sha1()
        for path, data in sorted(self.repos[repo].items()):
            h.update(path.encode() + hashlib.sha1(data).digest())
        return h.hexdigest()


def make_handler(state: HubState, endpoint: list[str]):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # keep test output quiet
            pass

        def _json(self, obj, code=200, head=False):
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length", 0)))

        def do_POST(self):
            path = self.path.split("?")[0]
            if path == "/api/repos/create":
                data = json.loads(self._body())
                repo = f"{data['organization']}/{data['name']}" if data.get("organization") else data["name"]
                with state.lock:
                    if repo in state.repos:
                        return self._json({"error": "already exists", "url": f"{endpoint[0]}/{repo}"}, 409)
                    state.repos[repo] = {}
                return self._json({"url": f"{endpoint[0]}/{repo}", "name": repo})
            if path == "/api/validate-yaml":
                self._body()
                return self._json({"errors": [], "warnings": []})
            if path.startswith("/api/models/") and "/preupload/" in path:
                repo = path[len("/api/models/") :].split("/preupload/")[0]
                files = json.loads(self._body())["files"]
                return self._json(
                    {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]}
                )
            if path.startswith("/api/models/") and "/commit/" in path:
                repo = path[len("/api/models/") :].split("/commit/")[0]
                with state.lock:
                    for line in self._body().decode().splitlines():
                        item = json.loads(line)
                        if item["key"] == "file":
                            value = item["value"]
                            state.repos[repo][value["path"]] = base64.b64decode(value["content"])
                    sha = state.sha(repo)
                return self._json({"commitUrl": f"{endpoint[0]}/{repo}/commit/{sha}", "commitOid": sha})
            return self._json({"error": f"unsupported POST {path}"}, 404)

        def _serve_file(self, head: bool):
            path = self.path.split("?")[0]
            repo_part, _, rest = path.lstrip("/").partition("/resolve/")
            _revision, _, filename = rest.partition("/")
            files = state.repos.get(repo_part)
            if files is None:
                self.send_response(404)
                self.send_header("X-Error-Code", "RepoNotFound")
                self.end_headers()
                return
            if filename not in files:
                self.send_response(404)
                self.send_header("X-Error-Code", "EntryNotFound")
                self.send_header("X-Repo-Commit", state.sha(repo_part))
                self.end_headers()
                return
            data = files[filename]
            self.send_response(200)
            self.send_header("X-Repo-Commit", state.sha(repo_part))
            self.send_header("ETag", '"' + hashlib.sha1(data).hexdigest() + '"')
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if not head:
                self.wfile.write(data)

        def do_HEAD(self):
            if "/resolve/" in self.path:
                return self._serve_file(head=True)
            self.send_response(404)
            self.end_headers()

        def do_GET(self):
            path = self.path.split("?")[0]
            if "/resolve/" in path and not path.startswith("/api/"):
                return self._serve_file(head=False)
            if path.startswith("/api/models/") and "/tree/" in path:
                repo = path[len("/api/models/") :].split("/tree/")[0]
                files = state.repos.get(repo, {})
                return self._json(
                    [
                        {"type": "file", "path": f, "size": len(d), "oid": hashlib.sha1(d).hexdigest()}
                        for f, d in sorted(files.items())
                    ]
                )
            if path.startswith("/api/models/"):
                repo = path[len("/api/models/") :].split("/revision/")[0]
                if repo not in state.repos:
                    self.send_response(404)
                    self.send_header("X-Error-Code", "RepoNotFound")
                    self.end_headers()
                    return
                files = state.repos[repo]
                return self._json(
                    {
                        "id": repo,
                        "modelId": repo,
                        "sha": state.sha(repo),
                        "private": False,
                        "siblings": [{"rfilename": f} for f in sorted(files)],
                    }
                )
            return self._json({"error": f"unsupported GET {path}"}, 404)

    return Handler


def start_hub():
    """Start the endpoint on a free loopback port -> (server, state, url). Call server.shutdown() when done."""
    state, endpoint = HubState(), [""]
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(state, endpoint))
    endpoint[0] = f"http://127.0.0.1:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, state, endpoint[0]
