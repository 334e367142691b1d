"""The package's modules import each other without a circle, deferred (function-level) imports included.

A circle held together by imports inside functions works until someone moves one to the top of a file; the graph
below is read from the source (every ``import``/``from … import`` anywhere in a module), so such a circle fails here
whether or not it fails at run time. ``python tests/test_imports.py`` prints the graph.
"""

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hf_dspark"


def module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """{module: the package modules it imports}, read from the source of every module under ``package``."""
    modules = {module_name(p, package): p for p in package.rglob("*.py")}
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = here.split(".")
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                # `from pkg import name` imports the submodule pkg.name when there is one
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                while target and target not in modules:  # `import a.b.c` of a non-module attribute path
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_circle():
    graph = import_graph()
    assert "hf_dspark.decoding.loop" in graph["hf_dspark.integration.generate"]  # the reader sees real edges
    assert cycles(graph) == []


def test_the_model_does_not_import_the_decoding_loop():
    graph = import_graph()
    reached, todo = set(), ["hf_dspark.model.modeling_dspark"]
    while todo:
        for w in graph[todo.pop()] - reached:
            reached.add(w)
            todo.append(w)
    assert not reached & {
        "hf_dspark.decoding.loop",
        "hf_dspark.decoding.drafting",
        "hf_dspark.scheduling.costs",
        "hf_dspark",
    }


def test_the_checker_finds_a_circle_made_of_deferred_imports(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "model.py").write_text("def f():\n    from .loop import g\n")
    (package / "loop.py").write_text("from .model import f\n")
    (package / "other.py").write_text("from . import model\n")
    graph = import_graph(package)
    assert graph["pkg.other"] == {"pkg.model"}
    assert cycles(graph) == [["pkg.loop", "pkg.model"]]


if __name__ == "__main__":
    for module, imports in sorted(import_graph().items()):
        print(f"{module} -> {', '.join(sorted(imports)) or '-'}")
    found = cycles(import_graph())
    print("circles:", found or "none")
    sys.exit(1 if found else 0)
