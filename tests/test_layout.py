"""The package's layout: stages import only downwards and no two modules import each other (directly or round a
loop). Walks every import statement, at module level and inside functions, with ``ast``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: The stages from the bottom up; a module may import from its own stage and the ones below it.
STAGES = (
    "_compat", "_version", "_device", "_runtime", "_transforms", "_plan", "callbacks", "_target", "_estimate",
    "_search", "_cli",
)
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
                         else [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
                         if isinstance(node, ast.ImportFrom) else [])  # `from autotune import _x` too
                private += [f"{path.relative_to(ROOT)}: {name}" for name in names
                            if name.startswith("autotune.") and any(p.startswith("_") for p in name.split("."))]
    assert private == []


#: The folder whose modules alone may use private upstream API (one module per upstream).
COMPAT = ROOT / "autotune" / "_compat"
#: Upstream packages whose private API only ``autotune/_compat/`` may use.
UPSTREAM = ("torch", "lightning", "lightning_fabric", "pytorch_lightning", "torchmetrics", "torchao", "optuna")
#: Private names of upstream objects that autotune uses, all behind functions in ``autotune/_compat/``: elsewhere,
#: ``<expr>.<name>`` on anything but ``self``/``cls`` (our own classes have private attributes too), a string that is
#: exactly ``<name>`` (``getattr``, patching) and an import of ``<name>`` are flagged. Add a name here when
#: ``_compat/`` gets a new access.
UPSTREAM_PRIVATE_NAMES = frozenset({
    # torch
    "_version", "_cdata", "_parameters", "_buffers", "_post_accumulate_grad_hooks", "_BatchNorm", "_opt_called",
    "_per_optimizer_states", "_set_allocator_settings", "_record_memory_history", "_dump_snapshot",
    "_disable_current_modes", "_C", "_select_conv_backend", "_subclasses", "_tools", "_MemRefType",
    "_get_fsdp_state", "_fsdp_param_groups", "_all_gather_comm", "_reduce_scatter_comm", "_unsharded_param",
    "_get_default_store", "_resolve_process_group", "_is_root",
    # Lightning
    "_apply_batch_transfer_handler", "_logger_connector", "_current_fx_name", "_result", "_trainer",
    "_configure_optimizers", "_desired_input_dtype", "_DeviceDtypeModuleMixin", "_device", "_dtype",
    # torchmetrics
    "_defaults", "_update_count", "_computed", "_forward_cache",
    # Optuna
    "_storage", "_trial_id", "_backend", "_file_path",
})
#: Upstream internals reached through ``self`` (a subclass of an upstream class): flagged on ``self`` too.
UPSTREAM_SUBCLASS_INTERNALS = frozenset({"_curr_mem_snap", "_peak_mem", "_peak_mem_snap", "_update_peak_stats",
                                         "_update_snap", "_track_module_params_and_buffers",
                                         "_param_to_grad_hook_handles"})
#: Undocumented attributes of torchao's ``CPUOffloadOptimizer`` (not underscored; distinctive enough to flag).
UPSTREAM_INTERNALS = frozenset({"param_d2h_map", "optim_dict", "d_opt"})


def _private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def _own_private_names() -> frozenset[str]:
    """The private names autotune defines itself (functions, classes, module constants, attributes it assigns): an
    access to any other private attribute, on anything but ``self``/``cls``, is someone else's private API."""
    names: set[str] = set()
    for path in _modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    for part in ast.walk(target):
                        if isinstance(part, ast.Name):
                            names.add(part.id)
                        elif isinstance(part, ast.Attribute):
                            names.add(part.attr)
    return (frozenset(n for n in names if _private(n)) | DOCUMENTED_UNDERSCORED) - UPSTREAM_PRIVATE_NAMES \
        - UPSTREAM_SUBCLASS_INTERNALS


#: Names public despite their underscore: ``os._exit``, namedtuples' documented methods.
DOCUMENTED_UNDERSCORED = frozenset({"_exit", "_replace", "_asdict", "_fields", "_make"})


def _private_upstream_uses(path: Path, own: frozenset[str] = frozenset()) -> list[str]:
    """Where ``path`` reaches into private upstream API: private upstream modules or names imported, attribute
    chains from an upstream package with a private part, the known private names of upstream objects, and (given
    ``own``, the private names autotune defines) any other private attribute of an object that is not ``self``."""
    found = []
    private = _private

    for node in ast.walk(ast.parse(path.read_text())):
        where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            names = [a.name for a in node.names] if isinstance(node, ast.ImportFrom) and not node.level else []
            for module in modules:
                if module.split(".")[0] in UPSTREAM and (any(map(private, module.split(".")))
                                                          or any(map(private, names))):
                    found.append(f"{where}: import from {module}: {names or module}")
        elif isinstance(node, ast.Attribute):
            chain, base = [node.attr], node.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            on_self = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            upstream_chain = isinstance(base, ast.Name) and base.id in UPSTREAM and any(map(private, chain))
            unknown = bool(own) and not on_self and private(node.attr) and node.attr not in own
            if (upstream_chain or unknown or node.attr in UPSTREAM_SUBCLASS_INTERNALS
                    or (not on_self and node.attr in UPSTREAM_PRIVATE_NAMES | UPSTREAM_INTERNALS)):
                found.append(f"{where}: {ast.unparse(node)}")
        elif isinstance(node, ast.Constant) and node.value in UPSTREAM_PRIVATE_NAMES | UPSTREAM_SUBCLASS_INTERNALS:
            found.append(f"{where}: string {node.value!r}")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in UPSTREAM_SUBCLASS_INTERNALS:
            found.append(f"{where}: overrides {node.name}")
    return found


def test_only_compat_reaches_into_private_upstream_api() -> None:
    own = _own_private_names()
    found = [use for path in _modules().values() if not path.is_relative_to(COMPAT)
             for use in _private_upstream_uses(path, own)]
    assert found == [], "private upstream API outside autotune/_compat/ (add a function there): " + "; ".join(found)


def test_the_private_api_check_sees_what_compat_does() -> None:
    # The check above is only as good as its lists: run on each module of _compat/, it must see every kind of access.
    found = {path.stem: "\n".join(_private_upstream_uses(path)) for path in sorted(COMPAT.glob("*.py"))}
    for module, expected in (
            ("torch", "import from torch.distributed._tools.mem_tracker"), ("lightning", "trainer._logger_connector"),
            ("torch", "torch.nn.modules.batchnorm._BatchNorm"), ("lightning", "string '_current_fx_name'"),
            ("optuna", "study._storage"), ("torch", "overrides _update_peak_stats"),
            ("torch", "overrides _update_snap"), ("torch", "tracker._curr_mem_snap"),
            ("torchao", "offload.param_d2h_map"), ("torchao", "torchao.optim._AdamW"),
            ("torchmetrics", "metric._defaults"), ("fsdp", "module._get_fsdp_state"),
            ("torch", "import from torch._meta_registrations")):
        assert expected in found[module], (module, expected)


def test_the_private_api_check_sees_a_subclass_of_memtracker_outside_compat(tmp_path: Path) -> None:
    module = tmp_path / "estimate_module.py"
    module.write_text("class Tracker(Base):\n    def _update_snap(self, flag, winfo):\n"
                      "        return self._param_to_grad_hook_handles\n")
    uses = _private_upstream_uses(module, _own_private_names())
    assert [use.split(": ", 1)[1] for use in uses] == ["overrides _update_snap", "self._param_to_grad_hook_handles"]


@pytest.mark.parametrize("access", ["trainer.fit_loop._data_fetcher", "trainer.strategy._launcher"])
def test_the_private_api_check_sees_a_private_name_it_was_never_told_of(tmp_path: Path, access: str) -> None:
    module = tmp_path / "runtime_module.py"
    module.write_text(f"def peek(trainer):\n    return {access}\n")
    uses = _private_upstream_uses(module, _own_private_names())
    assert [use.split(": ", 1)[1] for use in uses] == [access]
