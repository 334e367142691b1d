"""The package's modules import each other without a circle, deferred (function-level) imports included.

A circle held together by imports inside functions works until someone moves one to the top of a file; the graph
below is read from the source (every ``import``/``from … import`` anywhere in a module), so such a circle fails here
whether or not it fails at run time. ``python tests/test_imports.py`` prints the graph.
"""

import sys

from benchmarks.code_shape import cycles, import_graph, part_imports


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
        "hf_dspark.decoding.costs",
        "hf_dspark",
    }


# The parts of the package, lowest first: each may import only parts before it. "model" is what the weights
# compute and imports nothing above "settings"; the policy ("scheduling") imports nothing of the package at all.
LAYERS = [
    "scheduling",
    "settings",
    "model",
    "plotting",
    "compat",
    "decoding",
    "integration",
    "training",
    "evaluation",
    "cards",
    "embedded",
    "testing",
    "cli_arguments",
    "__init__",
    "cli",
    "__main__",
]


def test_each_part_imports_only_the_parts_below_it():
    parts = part_imports(import_graph())
    assert set(parts) == set(LAYERS), "a new part of the package needs its place in LAYERS"
    upward = {
        part: sorted(dep for dep in deps if LAYERS.index(dep) > LAYERS.index(part)) for part, deps in parts.items()
    }
    assert {part: deps for part, deps in upward.items() if deps} == {}
    assert parts["model"] <= {"settings", "scheduling"}
    assert parts["scheduling"] == set()
    assert cycles(parts) == []


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
