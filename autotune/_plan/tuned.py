"""Tuned files: a plan written as a LightningCLI config, and read back with every error reported at once."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path
from typing import Any

import yaml

from autotune._device.budget import format_bytes
from autotune._plan.plan import Plan, Provenance, plan_problems

#: Bumped when the file layout changes; a file from a newer version is refused with a clear message.
FORMAT_VERSION = 1

_ELASTIC = "autotune.callbacks.ElasticBatchSize"
_APPLY = "autotune.callbacks.ApplyPlan"
_NAMESPACES = ("autotune.", "lightning.")

_COMMENTS = {
    "precision": "numeric precision of weights/activations; *-mixed keeps fp32 weights, halves activations",
    "accumulate_grad_batches": "must stay 1: ElasticBatchSize does the accumulation",
    "strategy": "data parallel: every rank runs the whole model on its share of the batch",
    "budget": "memory cap of the run (hard on CUDA, soft on CPU)",
    "micro_batch_size": "samples per forward/backward; the effective batch is the dataloader's",
    "activation_checkpointing": "share of repeated blocks recomputed in backward: less memory, more compute",
    "activation_offload": "keep saved activations on the host during backward: less device memory, more copies",
    "optimizer_offload": "optimizer state on the host, update on the CPU (torchao): less device memory, slower steps",
    "compile": "torch.compile each repeated block: faster steps after a one-time compile",
    "expandable_segments": "CUDA allocator grows segments in place: less fragmentation",
    "num_workers": "DataModule dataloader worker processes (null: the DataModule's own)",
    "pin_memory": "DataModule page-locked host batches for faster copies (null: the DataModule's own)",
}


class PlanFileError(ValueError):
    """A tuned file that cannot be read; the message lists every problem with its file and key."""


def _scalar(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("...").strip()


def render_plan(plan: Plan, *, command: str | None = None) -> str:
    """The text of the tuned file for ``plan`` (see :func:`save_plan`)."""
    prov = plan.provenance
    lines = [f"# Tuned by lightning-autotune (tuned-file format {FORMAT_VERSION})."]
    if command or prov.command:
        lines.append(f"# Produced by: {command or prov.command}")
    measured = []
    if prov.samples_per_second is not None:
        measured.append(f"{prov.samples_per_second:.1f} samples/s")
    if prov.tokens_per_second is not None:
        measured.append(f"{prov.tokens_per_second:.0f} tokens/s")
    if prov.peak_bytes is not None:
        measured.append(f"peak {format_bytes(prov.peak_bytes)}")
    if prov.predicted_peak_bytes is not None:
        measured.append(f"predicted peak {format_bytes(prov.predicted_peak_bytes)}")
    if prov.budget is not None:
        measured.append(f"budget {prov.budget}")
    if prov.device_name:
        total = f" ({format_bytes(prov.device_total_bytes)})" if prov.device_total_bytes else ""
        measured.append(f"on {prov.device_name}{total}")
    if measured:
        lines.append("# Measured: " + ", ".join(measured))
    lines += [
        "# Use: python train.py fit --config your_config.yaml --config THIS_FILE",
        "#   (this file sets trainer.callbacks; a later --config replaces lists, so keep your callbacks after it)",
        "# or in Python: Trainer(**plan.trainer_kwargs(), callbacks=[*plan.callbacks(), ...]) with",
        "#   plan = autotune.load_plan(THIS_FILE)",
        "trainer:",
    ]

    def setting(indent: int, key: str, value: Any, *, commented: bool = True) -> None:
        comment = _COMMENTS.get(key) if commented else None
        text = f"{' ' * indent}{key}: {_scalar(value)}"
        lines.append(f"{text}  # {comment}" if comment else text)

    for key, value in plan.trainer_kwargs().items():
        setting(2, key, value)
    lines += ["  callbacks:", f"    - class_path: {_ELASTIC}", "      init_args:"]
    setting(8, "budget", plan.budget)
    setting(8, "micro_batch_size", plan.micro_batch_size)
    lines += [f"    - class_path: {_APPLY}", "      init_args:"]
    kwargs = plan.apply_kwargs()
    provenance = {"format_version": FORMAT_VERSION, **kwargs.pop("provenance")}
    for key, value in kwargs.items():
        setting(8, key, value)
    lines.append("        provenance:  # where this plan came from (read by ApplyPlan and load_plan)")
    for key, value in provenance.items():
        setting(10, key, value, commented=False)
    return "\n".join(lines) + "\n"


def save_plan(plan: Plan, path: str | Path, *, command: str | None = None) -> Path:
    """Write ``plan`` to ``path`` atomically (a temporary file in the same folder, then a rename).

    Raises:
        ValueError: when the folder does not exist or cannot be written, naming the path.
    """
    path = Path(path)
    text = render_plan(plan, command=command)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise ValueError(f"cannot write the tuned file '{path}': folder '{folder}' does not exist")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    except OSError as err:
        raise ValueError(f"cannot write the tuned file '{path}': {err.strerror or err}") from None
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_plan(path: str | Path) -> Plan:
    """Read a tuned file written by :meth:`Plan.save` back into a :class:`Plan`.

    Only ``yaml.safe_load`` is used and only class paths in the ``autotune.`` and ``lightning.`` namespaces are
    accepted. Every problem is reported at once.

    Raises:
        PlanFileError: naming the file and the key of each problem.

    Example:
        >>> plan = load_plan("tuned.yaml")  # doctest: +SKIP
    """
    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise PlanFileError(f"{path}: the tuned file does not exist") from None
    except (OSError, yaml.YAMLError) as err:
        raise PlanFileError(f"{path}: cannot read the tuned file: {str(err).splitlines()[0]}") from None
    problems: list[str] = []
    where: dict[str, str] = {}
    fields = _collect_fields(doc, problems, where)
    if fields:
        raw = Plan.__new__(Plan)  # check field by field, so each problem can name its key in the file
        for f in dataclasses.fields(Plan):
            object.__setattr__(raw, f.name, fields.get(f.name, Plan.__dataclass_fields__[f.name].default))
        if raw.provenance is dataclasses.MISSING:
            object.__setattr__(raw, "provenance", Provenance())
        for problem in plan_problems(raw):
            name = problem.split(" ", 1)[0]
            problems.append(f"{where.get(name, name)}: {problem}")
    if problems:
        raise PlanFileError(f"{path}: " + f"\n{path}: ".join(problems))
    return Plan(**fields)


def _collect_fields(doc: Any, problems: list[str], where: dict[str, str]) -> dict[str, Any]:
    if not isinstance(doc, dict) or not isinstance(doc.get("trainer"), dict):
        problems.append("trainer: missing; a tuned file is a LightningCLI config with a 'trainer:' section")
        return {}
    trainer = doc["trainer"]
    fields: dict[str, Any] = {}
    for name in ("precision", "strategy"):
        if name in trainer:
            fields[name] = trainer[name]
            where[name] = f"trainer.{name}"
    if trainer.get("accumulate_grad_batches", 1) != 1:
        problems.append(f"trainer.accumulate_grad_batches: must be 1; got {trainer['accumulate_grad_batches']!r}")
    callbacks = trainer.get("callbacks")
    if not isinstance(callbacks, list):
        problems.append("trainer.callbacks: missing; expected ElasticBatchSize and ApplyPlan entries")
        return fields
    found = set()
    plan_keys = {f.name for f in dataclasses.fields(Plan)}
    for i, entry in enumerate(callbacks):
        key = f"trainer.callbacks[{i}]"
        class_path = entry.get("class_path") if isinstance(entry, dict) else None
        if not isinstance(class_path, str):
            problems.append(f"{key}.class_path: missing")
            continue
        if not class_path.startswith(_NAMESPACES):
            problems.append(f"{key}.class_path: '{class_path}' is outside the autotune. and lightning. namespaces")
            continue
        if class_path not in (_ELASTIC, _APPLY):
            continue  # another Lightning callback the user added: not part of the plan
        found.add(class_path)
        init_args = entry.get("init_args") or {}
        if not isinstance(init_args, dict):
            problems.append(f"{key}.init_args: must be a mapping")
            continue
        for name, value in init_args.items():
            if name == "provenance":
                fields["provenance"] = _provenance(value, f"{key}.init_args.provenance", problems)
            elif name in plan_keys and name not in ("precision", "strategy"):
                fields[name] = tuple(value) if isinstance(value, list) else value
                where[name] = f"{key}.init_args.{name}"
            elif class_path == _ELASTIC:
                continue  # other ElasticBatchSize options (grow, min_micro_batch_size, ...) are not plan fields
            else:
                problems.append(f"{key}.init_args.{name}: unknown setting")
    for required in (_ELASTIC, _APPLY):
        if required not in found:
            problems.append(f"trainer.callbacks: no {required} entry")
    return fields


def _provenance(value: Any, key: str, problems: list[str]) -> Provenance | None:
    if not isinstance(value, dict):
        problems.append(f"{key}: must be a mapping")
        return None
    value = dict(value)
    version = value.pop("format_version", FORMAT_VERSION)
    if not isinstance(version, int) or version > FORMAT_VERSION:
        problems.append(
            f"{key}.format_version: {version!r} is newer than this lightning-autotune reads ({FORMAT_VERSION}); "
            "upgrade lightning-autotune"
        )
        return None
    known = {f.name for f in dataclasses.fields(Provenance)}
    unknown = sorted(set(value) - known)
    if unknown:
        problems.append(f"{key}: unknown keys {', '.join(unknown)}")
        return None
    return Provenance(**value)
