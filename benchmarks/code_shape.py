"""The package's shape, for a refactor's before and after: module sizes, the longest functions, and the imports
between its parts (subpackages and top-level modules).

    python -m benchmarks.code_shape [--root hf_dspark] [--out benchmarks/results/code_shape/after.json]

It reads the source (``ast``), imports nothing of it, so it runs on any commit's checkout (``--root`` a worktree's
``hf_dspark``). ``tests/test_imports.py`` holds the package to its layering with :func:`import_graph`,
:func:`part_imports` and :func:`cycles`.
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "hf_dspark"


def module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path = PACKAGE_DIR) -> dict[str, set[str]]:
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


def part_of(module: str) -> str:
    """The part a module belongs to: its subpackage (``decoding``), or a top-level module's own name (``settings``,
    ``__init__`` for the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def part_imports(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph collapsed to parts: {part: the other parts its modules import}."""
    parts: dict[str, set[str]] = {part_of(m): set() for m in graph}
    for module, imports in graph.items():
        parts[part_of(module)] |= {part_of(m) for m in imports} - {part_of(module)}
    return parts


def functions(path: Path) -> list[tuple[str, int]]:
    """Every function and method in a file with its length in lines (decorators and docstring included)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            out.append((node.name, node.end_lineno - start + 1))
    return out


def shape(root: Path) -> dict:
    """Module sizes, the 10 longest functions, the parts' imports and their cycles."""
    mods = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    sizes = {m: len(p.read_text().splitlines()) for m, p in mods.items()}
    longest = sorted(((f"{m}.{name}", n) for m, p in mods.items() for name, n in functions(p)), key=lambda x: -x[1])[
        :10
    ]
    graph = part_imports(import_graph(root))
    return {
        "modules_over_300_lines": {m: n for m, n in sorted(sizes.items(), key=lambda x: -x[1]) if n > 300},
        "largest_module_lines": max(sizes.values()),
        "longest_functions": dict(longest),
        "part_imports": {part: sorted(deps) for part, deps in sorted(graph.items())},
        "cycles": cycles(graph),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", type=Path, default=PACKAGE_DIR)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    result = shape(args.root)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
