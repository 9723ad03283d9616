"""Tuned files: a plan's document written as a self-documenting LightningCLI config, and read back into raw
settings with every problem reported at once. This module knows the file, not the ``Plan`` type (which builds the
document and validates what is read: see :mod:`autotune._plan.plan`)."""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from autotune._device.budget import format_bytes
from autotune._plan.config_text import (
    CLI_CONFIG_KEYS, constructor_arguments, did_you_mean, safe_load_unique, yaml_problem,
)

#: Version of the file and of a plan's dict form (``Plan.to_dict``); a newer one is refused.
#: 2: new plan settings (optimizer_state, compile_memory_budget, float8) and ``callbacks+`` (appended to the user's
#: callbacks); files of format 1 (``callbacks``, replacing them) still load.
#: 3: every key written (ElasticBatchSize's ``grow`` and ``micro_batch_sample_size`` too), the trainer's settings
#: after the callbacks, and a file that lacks any of them refused (:func:`missing_keys`); files of formats 1 and 2 load
#: when they hold what their writers always wrote.
#: 4: the first line names the trainer settings the plan sets only where it has them (``strategy``, ``devices``), so a
#: file that lost one of those lines is refused too; files of format 3 load as before.
FORMAT_VERSION = 4
ELASTIC = "autotune.callbacks.ElasticBatchSize"
APPLY = "autotune.callbacks.ApplyPlan"
#: The trainer settings and ``ElasticBatchSize`` arguments that are plan settings (every ``ApplyPlan`` one is).
TRAINER_SETTINGS = ("precision", "strategy", "devices")
#: The trainer settings a file holds only where its plan sets them: the first line names those it holds (format 4).
_TRAINER_WHERE_SET = ("strategy", "devices")
#: The class path a sharded plan's strategy is written with (``strategy: fsdp`` in the plan's dict form).
MODEL_PARALLEL = "lightning.pytorch.strategies.ModelParallelStrategy"
ELASTIC_SETTINGS = ("budget", "micro_batch_size", "micro_batch_sample_size")
#: What every tuned file of a format holds, by the name it is kept under in ``where`` (:func:`read_tuned_file`); a
#: sharded plan's strategy and the plan's devices are written only where the plan sets them. Format 3 also holds every
#: ``ApplyPlan`` argument (:func:`missing_keys`).
_ALWAYS = {1: ("precision", "accumulate_grad_batches", "budget", "micro_batch_size", "provenance"),
           3: ("precision", "accumulate_grad_batches", *ELASTIC_SETTINGS, "grow", "provenance.format_version")}
_NAMESPACES = ("autotune.", "lightning.")
#: ``ApplyPlan`` arguments written only where the plan sets them (``recompute``: what ``activation_checkpointing:
#: auto`` chose), so files of format 3 written before them still hold every key.
_WHERE_SET = ("recompute",)

_COMMENTS = {
    "precision": "numeric precision of weights/activations; *-mixed keeps fp32 weights, halves activations",
    "accumulate_grad_batches": "must stay 1: ElasticBatchSize does the accumulation",
    "strategy": "how ranks share the work: ddp replicates the model, ModelParallelStrategy (fsdp) shards it",
    "devices": "ranks on this node the plan was tuned for (a sharded plan's memory per rank depends on it)",
    "reshard_after_forward": "fsdp: free gathered parameters after each block's forward (ZeRO-3; false: ZeRO-2)",
    "cpu_offload": "fsdp: parameters, gradients and optimizer state on the host (FSDP2 CPUOffloadPolicy)",
    "budget": "memory cap of the run (hard on CUDA, soft on CPU)",
    "grow": "false: stays at the measured micro_batch_size (an OOM still halves it); true: tries larger ones",
    "micro_batch_size": "samples per forward/backward; the effective batch is the dataloader's",
    "micro_batch_sample_size": "elements per sample where micro_batch_size fits (longest batch seen): shorter take more",
    "activation_checkpointing": "share of repeated blocks recomputed in backward (auto: chosen per block below)",
    "recompute": "per repeated block: none, ops (matmuls and attention saved, the rest recomputed) or block",
    "activation_offload": "keep saved activations on the host during backward: less device memory, more copies",
    "optimizer_offload": "optimizer state on the host, update on the CPU (torchao): less device memory, slower steps",
    "optimizer_state": "Adam's moments: full (as configured), 8bit or 4bit (torchao): 8 bytes per parameter -> ~2 or ~1",
    "compile": "torch.compile each repeated block: faster steps after a one-time compile",
    "compile_memory_budget": "share of activations the compiler keeps for backward, recomputing the rest (null: all)",
    "float8": "linear layers' matmuls in FP8 (torchao float8 training; GPUs of compute capability 8.9+)",
    "expandable_segments": "CUDA allocator grows segments in place: less fragmentation",
    "num_workers": "DataModule dataloader worker processes (null: the DataModule's own)",
    "pin_memory": "DataModule page-locked host batches for faster copies (null: the DataModule's own)",
    "provenance": "where this plan came from (read by ApplyPlan and load_plan)",
}
#: How every tuned file begins: what tells one from a user's config.
TUNED_HEADER = "# Tuned by lightning-autotune"
_KEY_LINE = re.compile(r"^(?P<indent>\s*(?:- )?)(?P<key>\w+):")


class PlanFileError(ValueError):
    """A tuned file that cannot be read; the message lists every problem with its file and key."""


def render_tuned_file(document: Mapping[str, Any], *, provenance: Mapping[str, Any], command: str | None) -> str:
    """The text of a tuned file: a header saying what was measured, then ``document`` dumped as YAML with a short
    comment on each setting (none inside the provenance)."""
    trainer = document.get("trainer") or {}
    sets = [f"trainer.{name}" for name in _TRAINER_WHERE_SET if name in trainer]
    lines = [f"{TUNED_HEADER} (tuned-file format {FORMAT_VERSION}" + (f"; sets {', '.join(sets)}" if sets else "") + ")."]
    if command or provenance.get("command"):
        produced = " ".join(str(command or provenance["command"]).splitlines())  # one comment line, whatever argv held
        lines.append(f"# Produced by: {produced}")
    measured = _measured(provenance)
    if provenance.get("samples_per_second") is None and provenance.get("prediction"):
        lines.append("# Predicted, not measured: " + ", ".join(
            [_predicted(provenance["prediction"], device=not provenance.get("device_name")), *measured]))
    elif measured:
        lines.append("# Measured: " + ", ".join(measured))
        if provenance.get("prediction"):
            lines.append("# Predicted before it ran: " + _predicted(provenance["prediction"]))
    for v in provenance.get("paired") or []:  # the decisive paired comparisons (docs/search.md)
        low, high = v["interval"]
        lines.append(f"# Paired with {v['against']} ({v['why']}): {v['ratio']:.2f}x [{low:.2f}, "
                     f"{'inf' if high is None else format(high, '.2f')}] the samples/s of {v['incumbent_plan']} over "
                     f"{len(v['rounds'])} rounds; {v['verdict']}")
    lines += [
        "# Use: python train.py fit --config your_config.yaml --config THIS_FILE",
        "#   (this file adds its callbacks to yours: `callbacks+` appends; a later --config's list replaces both)",
        "# or in Python: Trainer(**plan.trainer_kwargs(), callbacks=[*plan.callbacks(), ...]) with",
        "#   plan = autotune.load_plan(THIS_FILE)",
    ]
    in_provenance: int | None = None  # the indent of the provenance mapping while inside it
    for line in yaml.safe_dump(dict(document), sort_keys=False, default_flow_style=False, width=10_000).splitlines():
        match = _KEY_LINE.match(line)
        if match and in_provenance is not None and len(match["indent"]) <= in_provenance:
            in_provenance = None
        comment = _COMMENTS.get(match["key"]) if match and in_provenance is None else None
        if match and match["key"] == "provenance":
            in_provenance = len(match["indent"])
        lines.append(f"{line}  # {comment}" if comment else line)
    return "\n".join(lines) + "\n"


def _measured(prov: Mapping[str, Any]) -> list[str]:
    measured = []
    if prov.get("samples_per_second") is not None:
        interval = prov.get("samples_per_second_interval")
        spread = f" [{interval[0]:.1f}, {interval[1]:.1f}]" if interval else ""
        runs = f" over {prov['measurements']} runs" if (prov.get("measurements") or 1) > 1 else ""
        measured.append(f"{prov['samples_per_second']:.1f} samples/s{spread}{runs}")
    if prov.get("tokens_per_second") is not None:
        measured.append(f"{prov['tokens_per_second']:.0f} tokens/s")
    if prov.get("peak_bytes") is not None:
        measured.append(f"peak {format_bytes(prov['peak_bytes'])}")
    if prov.get("predicted_peak_bytes") is not None:
        measured.append(f"predicted peak {format_bytes(prov['predicted_peak_bytes'])}")
    if prov.get("budget") is not None:
        measured.append(f"budget {prov['budget']}")
    if prov.get("device_name"):
        total = f" ({format_bytes(prov['device_total_bytes'])})" if prov.get("device_total_bytes") else ""
        measured.append(f"on {prov['device_name']}{total}")
    return measured


def _predicted(prediction: Mapping[str, Any], *, device: bool = True) -> str:
    """The step-time model's figures, ``"812.4 samples/s (compute-bound, MFU 41%) on NVIDIA H100 SXM5 80GB"``."""
    rate = prediction.get("samples_per_second")
    parts = [f"{prediction.get('bound')}-bound"] if prediction.get("bound") else []
    if prediction.get("mfu") is not None:
        parts.append(f"MFU {prediction['mfu']:.0%}")
    if prediction.get("error") is not None:
        parts.append(f"model error so far {prediction['error']:.0%}")
    text = f"{rate:.1f} samples/s" if isinstance(rate, (int, float)) else "speed unknown"
    text += f" ({', '.join(parts)})" if parts else ""
    return text + (f" on {prediction['device']}" if device and prediction.get("device") else "")


def write_tuned_file(text: str, path: str | Path) -> Path:
    """Write ``text`` to ``path`` atomically (a temporary file in the same folder, then a rename), with the mode a
    plain ``open()`` would give it (0666 less the umask).

    Raises:
        ValueError: when the folder does not exist or cannot be written, naming the path.
    """
    path = Path(path)
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
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it 0600: give it the mode a plain open() would
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _umask() -> int:
    mask = os.umask(0)  # reading the umask means setting it: put it back at once
    os.umask(mask)
    return mask


def read_tuned_file(path: str | Path) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """The raw plan settings of a tuned file (``provenance`` included, unvalidated), where each was found in the
    file (``trainer.callbacks[1].init_args.compile``), and the problems with the file's structure.

    Only ``yaml.safe_load`` is used and only class paths in the ``autotune.`` and ``lightning.`` namespaces are
    accepted.

    Raises:
        PlanFileError: when the file is missing or is not YAML.
    """
    path = Path(path)
    try:
        text = path.read_text()
        doc = safe_load_unique(text)
    except FileNotFoundError:
        raise PlanFileError(f"{path}: the tuned file does not exist") from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise PlanFileError(f"{path}: cannot read the tuned file as YAML text: {yaml_problem(err)}") from None
    problems: list[str] = []
    where: dict[str, str] = {}
    version, sets = claimed_format(text)
    return _collect_fields(doc, problems, where, version=version, sets=sets), where, problems


def claimed_format(text: str) -> tuple[int | None, tuple[str, ...]]:
    """The format a file's first line claims (``# Tuned by lightning-autotune (tuned-file format 3).``), None for a
    file that does not claim to be a tuned file (a config of the user's, a plan written by hand), and the trainer
    settings it says it sets where its plan has them (format 4: ``; sets trainer.strategy, trainer.devices``).

    Example:
        >>> claimed_format("# Tuned by lightning-autotune (tuned-file format 2).\ntrainer: {}"), claimed_format("a: 1")
        ((2, ()), (None, ()))
        >>> claimed_format("# Tuned by lightning-autotune (tuned-file format 4; sets trainer.devices).")
        (4, ('devices',))
    """
    if not text.startswith(TUNED_HEADER):
        return None, ()
    match = re.match(re.escape(TUNED_HEADER) + r" \(tuned-file format (\d+)(?:; sets ([\w., ]+))?\)", text)
    if not match:
        return FORMAT_VERSION, ()
    sets = tuple(name.strip().removeprefix("trainer.") for name in (match[2] or "").split(",") if name.strip())
    return int(match[1]), sets


def missing_keys(version: int | None, present: set[str], elastic: str, apply: str, *,
                 sets: tuple[str, ...] = ()) -> list[str]:
    """One problem naming every key a tuned file of format ``version`` always holds and this one lacks (a file cut
    short, a line lost in a merge), from the keys ``present`` (``precision``, ``grow``, ``provenance.format_version``)
    and where its two entries are; none for a file that does not claim to be a tuned file (``version`` None), whose
    settings default.

    A file of format 3 holds every plan setting the writer knows; one of format 4 also the trainer settings its first
    line says it ``sets`` (a sharded or replicated plan's strategy, the devices where the plan sets them); one of
    formats 1 and 2 the keys their writers always wrote (precision, the accumulation, the budget, the micro-batch, the
    provenance)."""
    if version is None:
        return []
    wanted = [*(name for name in sets if name in _TRAINER_WHERE_SET), *_ALWAYS[3 if version >= 3 else 1]]
    if version >= 3:
        wanted += [name for name in sorted(constructor_arguments(APPLY)) if name not in ("provenance", *_WHERE_SET)]
    entry = dict.fromkeys((*ELASTIC_SETTINGS, "grow"), elastic)
    missing = [f"trainer.{name}" if name in ("precision", "accumulate_grad_batches")
               or name in _TRAINER_WHERE_SET else f"{entry.get(name, apply)}.init_args.{name}"
               for name in wanted if name not in present]
    if not missing:
        return []
    return [f"{', '.join(missing)}: missing; a tuned file (format {version}) holds every plan setting, so this one was "
            "cut short or edited: write it again (autotune search or suggest), or delete its first line to use it as a "
            "config of your own"]


def _collect_fields(doc: Any, problems: list[str], where: dict[str, str], *, version: int | None,
                    sets: tuple[str, ...]) -> dict[str, Any]:
    problems += [f"{key}: unknown key{did_you_mean(key, CLI_CONFIG_KEYS)} (a tuned file is a LightningCLI config: "
                 f"{', '.join(CLI_CONFIG_KEYS)})" for key in (doc if isinstance(doc, dict) else ())
                 if key not in CLI_CONFIG_KEYS]
    if not isinstance(doc, dict) or not isinstance(doc.get("trainer"), dict):
        if not problems:  # a misspelt 'trainer' says it already
            problems.append("trainer: missing; a tuned file is a LightningCLI config with a 'trainer:' section")
        return {}
    trainer = doc["trainer"]
    trainer_arguments = constructor_arguments("lightning.pytorch.Trainer")
    problems += [f"trainer.{key}: not an argument of lightning's Trainer{did_you_mean(key, sorted(trainer_arguments))}"
                 for key in trainer if key.rstrip("+") not in trainer_arguments]
    fields: dict[str, Any] = {}
    for name in TRAINER_SETTINGS:
        if name in trainer:
            fields[name] = trainer[name]
            where[name] = f"trainer.{name}"
    present = {name for name in (*TRAINER_SETTINGS, "accumulate_grad_batches") if name in trainer}
    if isinstance(fields.get("strategy"), dict):
        fields["strategy"] = _sharded_strategy(fields["strategy"], trainer.get("devices"), problems)
    if trainer.get("accumulate_grad_batches", 1) != 1:
        problems.append(f"trainer.accumulate_grad_batches: must be 1; got {trainer['accumulate_grad_batches']!r}")
    key_name = "callbacks+" if "callbacks+" in trainer else "callbacks"  # format 1 wrote `callbacks`
    callbacks = trainer.get(key_name)
    if not isinstance(callbacks, list):
        problems.append(f"trainer.{key_name}: missing; expected ElasticBatchSize and ApplyPlan entries")
        return fields
    found = set()
    entries: dict[str, str] = {}
    for i, entry in enumerate(callbacks):
        key = f"trainer.{key_name}[{i}]"
        class_path = entry.get("class_path") if isinstance(entry, dict) else None
        if not isinstance(class_path, str):
            problems.append(f"{key}.class_path: missing")
            continue
        if not class_path.startswith(_NAMESPACES):
            problems.append(f"{key}.class_path: '{class_path}' is outside the autotune. and lightning. namespaces")
            continue
        if class_path not in (ELASTIC, APPLY):
            continue  # another Lightning callback the user added: not part of the plan
        found.add(class_path)
        entries[class_path] = key
        init_args = entry.get("init_args") or {}
        if not isinstance(init_args, dict):
            problems.append(f"{key}.init_args: must be a mapping")
            continue
        for name, value in init_args.items():
            if class_path == ELASTIC and name not in constructor_arguments(ELASTIC):
                problems.append(f"{key}.init_args.{name}: not an argument of ElasticBatchSize"
                                f"{did_you_mean(name, sorted(constructor_arguments(ELASTIC)))}")
                continue
            present.add(name)
            if class_path == ELASTIC and name not in ELASTIC_SETTINGS:
                continue  # other ElasticBatchSize options (grow, min_micro_batch_size, ...) are not plan settings
            fields[name] = value
            where[name] = f"{key}.init_args.{name}"
            if name == "provenance" and isinstance(value, dict) and "format_version" in value:
                present.add("provenance.format_version")
    for required in (ELASTIC, APPLY):
        if required not in found:
            problems.append(f"trainer.{key_name}: no {required} entry")
    if len(found) == 2:  # (an entry missing is a problem of its own)
        problems += missing_keys(version, present, entries[ELASTIC], entries[APPLY], sets=sets)
    return fields


def _sharded_strategy(entry: dict[str, Any], devices: Any, problems: list[str]) -> Any:
    """``"fsdp"`` for the ModelParallelStrategy entry a sharded plan writes (data parallel over ``devices``);
    anything else is a problem (the entry is returned as is, so the plan's check names it too)."""
    args = entry.get("init_args") or {}
    if entry.get("class_path") != MODEL_PARALLEL or not isinstance(args, dict):
        problems.append(f"trainer.strategy: a plan's strategy mapping must be class_path {MODEL_PARALLEL} with "
                        f"init_args; got {entry!r}")
        return None
    if args.get("tensor_parallel_size") != 1:
        problems.append("trainer.strategy.init_args.tensor_parallel_size: must be 1 (a plan shards with FSDP2, data "
                        f"parallel only); got {args.get('tensor_parallel_size')!r}")
    if args.get("data_parallel_size") != devices:
        problems.append(f"trainer.strategy.init_args.data_parallel_size: must equal trainer.devices ({devices!r}); "
                        f"got {args.get('data_parallel_size')!r}")
    return "fsdp"
