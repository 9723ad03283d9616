"""The package's layout: stages import only downwards and no two modules import each other (directly or round a
loop). Walks every import statement, at module level and inside functions, with ``ast``."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: The stages from the bottom up; a module may import from its own stage and the ones below it.
STAGES = ("_compat", "_version", "_device", "_runtime", "_plan", "callbacks", "_target", "_estimate", "_search", "_cli")
#: Imports that go up on purpose, each with its reason.
ALLOWED_UPWARD = {
    # Plan.callbacks() is public API that builds the callbacks that apply the plan.
    ("autotune._plan.plan", "autotune.callbacks"),
}


def _modules() -> dict[str, Path]:
    found = {}
    for folder, package in ((ROOT / "autotune", "autotune"), (ROOT / "callbacks", "autotune.callbacks")):
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The autotune modules ``name`` imports (``from autotune.x import y`` counts ``autotune.x.y`` when that is a
    module, else ``autotune.x``)."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        out.update(t for t in targets if t == "autotune" or t.startswith("autotune."))
    return out - {name}


def _stage(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) < 2:
        return None  # the package itself: the public facade on top of everything
    return parts[1] if parts[1] != "__main__" else "_cli"


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def test_every_module_belongs_to_a_stage() -> None:
    strays = [m for m in _graph() if _stage(m) is not None and _stage(m) not in STAGES]
    assert strays == [], f"modules outside the stage folders {STAGES}: {strays}"


def test_stages_import_only_downwards() -> None:
    upward = []
    for module, targets in _graph().items():
        here = _stage(module)
        if here is None:
            continue
        for target in targets:
            there = _stage(target)
            if there is None:
                upward.append(f"{module} imports the package facade 'autotune' (import the module it needs)")
            elif STAGES.index(there) > STAGES.index(here) and (module, target) not in ALLOWED_UPWARD:
                upward.append(f"{module} ({here}) imports {target} ({there})")
    assert upward == []


def test_no_import_cycles() -> None:
    graph = _graph()
    # Package __init__ files that only re-export are not part of a cycle in practice; module-to-module edges are.
    edges = {m: {t for t in ts if t in graph and not graph_is_facade(t)} for m, ts in graph.items()}
    edges = {m: ts for m, ts in edges.items() if not graph_is_facade(m)}
    cycles = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if (node, nxt) in ALLOWED_UPWARD:
                continue
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*stack[stack.index(nxt):], nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)
    assert cycles == []


def graph_is_facade(module: str) -> bool:
    """``autotune`` and ``autotune.callbacks`` re-export the public API."""
    return module in ("autotune", "autotune.callbacks")


def test_the_walk_sees_lazy_and_relative_imports() -> None:
    # The checks above are only as good as the walk: it must see imports inside functions.
    graph = _graph()
    assert "autotune.callbacks" in graph["autotune._plan.plan"]  # lazy, inside Plan.callbacks()
    assert "autotune._device.probe" in graph["autotune.callbacks.apply_plan"]


def test_benchmarks_and_examples_use_public_api_only() -> None:
    private = []
    for folder in ("benchmarks", "examples"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                private += [f"{path.relative_to(ROOT)}: {name}" for name in names
                            if name.startswith("autotune.") and any(p.startswith("_") for p in name.split("."))]
    assert private == []
