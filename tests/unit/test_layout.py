"""The layout is the pipeline: imports only go downward, no private names cross modules, no cycles."""

import ast
from pathlib import Path

import dspark

ROOT = Path(dspark.__file__).parent
ORDER = [
    "paths",
    "prompts",
    "core",
    "models",
    "training",
    "export",
    "engines",
    "model_repository",
    "orchestrator",
    "serving",
    "perf",
    "deploy",
    "cli",
]


def _modules():
    for f in sorted(ROOT.rglob("*.py")):
        if "templates" in f.parts:  # Triton's model.py adapters, loaded by the server, not imported
            continue
        rel = f.relative_to(ROOT.parent).with_suffix("")
        name = ".".join(rel.parts).removesuffix(".__init__")
        yield name, ast.parse(f.read_text())


def _stage(module: str) -> int | None:
    parts = module.split(".")
    return ORDER.index(parts[1]) if parts[0] == "dspark" and len(parts) > 1 and parts[1] in ORDER else None


def _imports(tree, top_level_only=False):
    nodes = tree.body if top_level_only else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dspark"):
            yield node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("dspark"):
                    yield a.name, []


def test_every_module_imports_only_its_own_stage_and_earlier_ones():
    upward = []
    for name, tree in _modules():
        me = _stage(name)
        for mod, _ in _imports(tree):
            other = _stage(mod)
            if me is not None and other is not None and other > me:
                upward.append(f"{name} → {mod}")
    assert not upward, "imports against the pipeline order:\n" + "\n".join(upward)


def test_no_module_imports_a_private_name_from_another():
    private = [
        f"{name} imports {mod}.{n}"
        for name, tree in _modules()
        for mod, names in _imports(tree)
        for n in names
        if n.startswith("_")
    ]
    assert not private, "\n".join(private)


def test_module_level_imports_have_no_cycle():
    graph = {name: {mod for mod, _ in _imports(tree, top_level_only=True)} for name, tree in _modules()}
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in graph.get(node, ()):
            if state.get(nxt) == 1:
                return path + [nxt]
            if nxt in graph and not state.get(nxt) and (cycle := visit(nxt, path + [nxt])):
                return cycle
        state[node] = 2
        return None

    for start in graph:
        if not state.get(start):
            cycle = visit(start, [start])
            assert cycle is None, " → ".join(cycle)
