"""Search spaces: YAML files of plan dimensions, validated as a whole and fitted to the device before a search."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.resources
import importlib.util
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from autotune._plan.plan import Plan, field_problems
from autotune._plan.config_text import safe_load_unique, yaml_problem

#: Plan fields a space may search (the budget is the search's constraint, the devices its argument, the provenance
#: its record).
SEARCHABLE = tuple(f.name for f in dataclasses.fields(Plan) if f.name not in ("budget", "devices", "provenance"))
AUTO = "auto"  # micro_batch_size choice: the largest micro-batch predicted to fit, evened out (equal micro-batches)


@contextlib.contextmanager
def quiet_list_choices() -> Iterator[None]:
    """Without Optuna's warning that a list (block class names to checkpoint) is a categorical choice it cannot
    persist: it stores each choice by its index, so such a study saves, resumes and reports as any other."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Choices for a categorical distribution should be")
        yield


class SpaceError(ValueError):
    """A search space that cannot be used; the message lists every problem."""


@dataclass(frozen=True)
class Dimension:
    """One searched plan field: its ``choices``, searched only when every ``when`` condition holds."""

    name: str
    choices: tuple[Any, ...]
    when: dict[str, tuple[Any, ...]] = field(default_factory=dict)

    def active(self, params: dict[str, Any]) -> bool:
        return all(params.get(parent) in values for parent, values in self.when.items())


@dataclass(frozen=True)
class SearchSpace:
    """A validated search space. ``notes`` say what was dropped for the device and why."""

    name: str
    description: str
    dimensions: tuple[Dimension, ...]
    seeds: tuple[dict[str, Any], ...] = ()
    notes: tuple[str, ...] = ()

    def suggest(self, trial: Any) -> dict[str, Any]:
        """Ask an Optuna trial for one point of the space (conditional dimensions only when active)."""
        params: dict[str, Any] = {}
        for dim in self.dimensions:
            if dim.active(params):
                params[dim.name] = trial.suggest_categorical(dim.name, list(dim.choices))
        return params

    def points(self) -> list[dict[str, Any]]:
        """Every distinct point of the space as Optuna params (conditional dimensions only where active), in the
        order of the choices.

        Example:
            >>> len(load_space("cpu").points()) == load_space("cpu").size()
            True
        """
        points: list[dict[str, Any]] = [{}]
        for dim in self.dimensions:
            points = [{**p, dim.name: c} for p in points for c in dim.choices]
            points = [p if dim.active(p) else {k: v for k, v in p.items() if k != dim.name} for p in points]
            points = list({repr(sorted(p.items())): p for p in points}.values())
        return points

    def size(self) -> int:
        """The number of distinct points (conditional dimensions counted only where active)."""
        return len(self.points())

    def for_device(self, device: torch.device, *, batch_size: int, capability: tuple[int, int] | None = None,
                   gpus: int | None = None) -> SearchSpace:
        """The space without the choices this device cannot run, each drop explained in ``notes``. ``capability``
        and ``gpus``: a CUDA device's compute capability and count where it is not on this machine (what-if), in
        place of asking CUDA."""
        notes = list(self.notes)
        dims = []
        for dim in self.dimensions:
            kept = []
            for choice in dim.choices:
                reason = _unrunnable(dim.name, choice, device, batch_size, capability, gpus)
                if reason:
                    notes.append(f"{dim.name}={choice!r} dropped: {reason}")
                else:
                    kept.append(choice)
            if not kept:
                raise SpaceError(f"space '{self.name}': no choice of {dim.name} can run on {device.type}")
            dims.append(dataclasses.replace(dim, choices=tuple(kept)))
        by_name = {d.name: d for d in dims}
        seeds = []
        for seed in self.seeds:
            if all(value in by_name[name].choices for name, value in seed.items()):
                seeds.append(seed)
            else:
                notes.append(f"seed {seed} dropped: it uses a choice this device cannot run")
        return dataclasses.replace(self, dimensions=tuple(dims), seeds=tuple(seeds), notes=tuple(notes))


def _unrunnable(name: str, choice: Any, device: torch.device, batch_size: int, capability: tuple[int, int] | None,
                gpus: int | None) -> str | None:
    cuda = device.type == "cuda"

    def compute_capability() -> tuple[int, int]:
        return capability if capability is not None else torch.cuda.get_device_capability(device)

    if name == "micro_batch_size" and choice != AUTO and choice > batch_size:
        return f"larger than the effective batch {batch_size}"
    if name == "precision":
        if choice == "16-mixed" and not cuda:
            return "Lightning runs 16-mixed as bf16-mixed on CPU"
        if choice.startswith("bf16") and cuda and not (compute_capability() >= (8, 0) if capability is not None
                                                        else torch.cuda.is_bf16_supported()):
            return "this GPU has no bf16 support"
        if choice == "transformer-engine":
            if importlib.util.find_spec("transformer_engine") is None:
                return "the transformer_engine package is not installed"
            if not cuda or compute_capability() < (8, 9):
                return "FP8 needs a GPU of compute capability 8.9 or newer"
    if not cuda and choice is True and name in ("activation_offload", "optimizer_offload", "cpu_offload",
                                                "expandable_segments", "pin_memory"):
        return "it only has an effect on CUDA"
    torchao_needed = ((name == "optimizer_offload" and choice is True)
                      or (name == "optimizer_state" and choice != "full")
                      or (name == "precision" and choice == "bf16-true"))  # bf16 weights: torchao's rounded AdamW
    if name == "float8" and choice is True and (not cuda or compute_capability() < (8, 9)):
        return "FP8 needs a GPU of compute capability 8.9 or newer"
    if (torchao_needed or (name == "float8" and choice is True)) and importlib.util.find_spec("torchao") is None:
        return "the torchao package is not installed (pip install 'lightning-autotune[torchao]')"
    if name == "strategy" and choice == "ddp" and cuda and (torch.cuda.device_count() if gpus is None else gpus) < 2:
        return "DDP needs at least 2 GPUs"
    return None


def available_spaces() -> list[str]:
    """Names of the spaces shipped in ``autotune.search_spaces``."""
    folder = importlib.resources.files("autotune.search_spaces")
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def default_space_name(device: torch.device) -> str:
    """The shipped space for a device: ``cpu`` on the host, ``default`` on one GPU."""
    return "cpu" if device.type != "cuda" else "default"


def load_space(spec: str | Path) -> SearchSpace:
    """Load a shipped space by name (``default``, ``cpu``, ``multi_gpu``) or a YAML file by path.

    Raises:
        SpaceError: naming the space and listing every problem (unknown dimensions or keys, bad choices, bad
            conditions, seeds outside the choices).

    Example:
        >>> load_space("cpu").name
        'cpu'
    """
    text_spec = str(spec)
    if text_spec in available_spaces():
        resource = importlib.resources.files("autotune.search_spaces") / f"{text_spec}.yaml"
        name, text = text_spec, resource.read_text()
    else:
        path = Path(text_spec)
        if not (path.suffix in (".yaml", ".yml") and path.is_file()):
            raise SpaceError(
                f"unknown search space '{text_spec}': use one of {', '.join(available_spaces())} or a path to a "
                ".yaml file"
            )
        try:
            name, text = str(path), path.read_text()
        except (OSError, UnicodeDecodeError) as err:
            raise SpaceError(f"space '{path}': cannot read it as a YAML text file ({err})") from None
    try:
        doc = safe_load_unique(text)
    except yaml.YAMLError as err:
        raise SpaceError(f"space '{name}': not valid YAML: {yaml_problem(err)}") from None
    problems: list[str] = []
    space = _parse(name, doc, problems)
    if problems or space is None:
        raise SpaceError(f"space '{name}': " + "; ".join(problems))
    return space


def _parse(name: str, doc: Any, problems: list[str]) -> SearchSpace | None:
    if not isinstance(doc, dict):
        problems.append("expected a mapping with 'dimensions'")
        return None
    for key in sorted(set(doc) - {"description", "dimensions", "seeds"}):
        problems.append(f"unknown key '{key}' (expected description, dimensions, seeds)")
    raw_dims = doc.get("dimensions")
    if not isinstance(raw_dims, dict) or not raw_dims:
        problems.append("'dimensions' must be a non-empty mapping of plan fields")
        return None
    dims: list[Dimension] = []
    for dim_name, spec in raw_dims.items():
        where = f"dimensions.{dim_name}"
        if dim_name not in SEARCHABLE:
            problems.append(f"{where}: unknown dimension '{dim_name}' (known: {', '.join(SEARCHABLE)})")
            continue
        if not isinstance(spec, dict) or set(spec) - {"choices", "when"}:
            problems.append(f"{where}: expected 'choices' and optionally 'when'")
            continue
        choices = spec.get("choices")
        if not isinstance(choices, list) or not choices:
            problems.append(f"{where}.choices: must be a non-empty list")
            continue
        if len(set(map(repr, choices))) < len(choices):
            problems.append(f"{where}.choices: {choices!r} lists a value twice")
            continue
        for choice in choices:
            if dim_name == "micro_batch_size" and choice == AUTO:
                continue
            problems += [f"{where}.choices: {message}" for _, message in field_problems({dim_name: choice})]
        when = spec.get("when") or {}
        known = {d.name: d for d in dims}
        if not isinstance(when, dict):
            problems.append(f"{where}.when: must map earlier dimensions to lists of their values")
            when = {}
        for parent, values in when.items():
            if parent not in known:
                problems.append(f"{where}.when: '{parent}' is not an earlier dimension")
            elif not isinstance(values, list) or any(v not in known[parent].choices for v in values):
                problems.append(f"{where}.when.{parent}: {values!r} must be a list of {parent}'s choices")
        dims.append(Dimension(dim_name, tuple(choices), {k: tuple(v) for k, v in when.items() if isinstance(v, list)}))
    seeds = doc.get("seeds") or []
    by_name = {d.name: d for d in dims}
    if not isinstance(seeds, list):
        problems.append("'seeds' must be a list of mappings")
        seeds = []
    for i, seed in enumerate(seeds):
        if not isinstance(seed, dict):
            problems.append(f"seeds[{i}]: must be a mapping of dimension to choice")
            continue
        for key, value in seed.items():
            if key not in by_name:
                problems.append(f"seeds[{i}].{key}: not a dimension of this space")
            elif value not in by_name[key].choices:
                problems.append(f"seeds[{i}].{key}: {value!r} is not one of its choices {list(by_name[key].choices)}")
    return SearchSpace(name=Path(name).stem, description=str(doc.get("description", "")), dimensions=tuple(dims),
                       seeds=tuple(seeds))


def plan_from_params(params: dict[str, Any], *, micro_batch_size: int | None = None, **fields: Any) -> Plan:
    """The plan of one point of a space (Optuna's params, the plan's dict form); ``micro_batch_size`` replaces an
    ``auto`` choice, ``fields`` (budget, provenance) complete it."""
    values = {**params, **{k: v for k, v in fields.items() if k != "provenance"}}
    if values.get("micro_batch_size") == AUTO:
        values["micro_batch_size"] = micro_batch_size
    return Plan.from_dict(values, provenance=fields.get("provenance"))


def plan_for(params: dict[str, Any], micro: int | None, devices: int,
             recompute: Sequence[str] | float | None = None) -> Plan:
    """The plan a search runs for one point of its space: ``micro`` replaces an ``auto`` micro-batch, ``recompute``
    is what an ``auto`` checkpointing chose (a trial's: its levels, or 0.0 / 1.0 where it chose nothing or every block), and a sharded plan carries the search's ``devices`` (its
    strategy and per-rank memory depend on it)."""
    plan = plan_from_params(params, micro_batch_size=micro, **({"devices": devices} if params.get("strategy") == "fsdp"
                                                               else {}))
    if recompute is None or plan.activation_checkpointing != "auto":
        return plan
    if isinstance(recompute, (int, float)):  # 'auto' that chose nothing or every block: that plan
        return plan.replace(activation_checkpointing=float(recompute))
    return plan.replace(recompute=tuple(recompute))
