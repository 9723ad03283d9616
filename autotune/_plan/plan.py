"""``Plan``: the one type that flows through the product (probe -> estimate -> search -> tuned file -> callbacks)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune._device.budget import Budget
from autotune._plan.config_text import did_you_mean
from autotune._plan.tuned import (
    APPLY,
    ELASTIC,
    FORMAT_VERSION,
    MODEL_PARALLEL,
    PlanFileError,
    read_tuned_file,
    render_tuned_file,
    write_tuned_file,
)
from autotune._plan.provenance import Provenance, provenance_problems, version_problems
from autotune._transforms.optim_state import OPTIMIZER_STATES
from autotune._transforms.recompute import RECOMPUTE_LEVELS

if TYPE_CHECKING:
    from lightning.pytorch import Callback

#: Lightning precision strings a plan may choose.
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "transformer-engine")
#: Strategies a plan may choose ("auto": Lightning's choice for the devices, or the strategy the user configured;
#: "ddp": every rank holds the whole model; "fsdp": FSDP2, ``fully_shard`` through Lightning's ModelParallelStrategy).
STRATEGIES = ("auto", "ddp", "fsdp")
_FLAGS = ("activation_offload", "optimizer_offload", "cpu_offload", "compile", "float8", "expandable_segments")



@dataclass(frozen=True, kw_only=True)
class Plan:
    """A memory plan: every setting the search may choose, applied to a run by the callbacks.

    A plan has one canonical, JSON-safe form, :meth:`to_dict` (read back by :meth:`from_dict`): the search's
    trials, the tuned file, :class:`~autotune.callbacks.ApplyPlan` and the search's cache all speak it. Values are
    normalised on construction (a whole-number checkpointing fraction becomes a float, class names a tuple, a budget
    its canonical text), so equal plans have equal dicts.

    Args:
        precision: a Lightning precision string (see ``PRECISIONS``); goes to ``Trainer(precision=...)``.
        strategy: ``"auto"``, ``"ddp"`` or ``"fsdp"`` (see ``STRATEGIES``); goes to ``Trainer(strategy=...)``.
            ``"fsdp"`` is FSDP2 through ``ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)``;
            :class:`~autotune.callbacks.ApplyPlan` shards the model unless it defines ``configure_model``.
        devices: the number of devices (ranks) on the node the plan runs with (None: the trainer's own). Required by
            ``"fsdp"``, whose strategy needs the data-parallel size and whose per-rank memory depends on it.
        reshard_after_forward: with ``"fsdp"``, free each block's gathered parameters after its forward (True: ZeRO-3
            style) or keep them until its backward (False: ZeRO-2 style, more memory, one all-gather less per block).
        cpu_offload: with ``"fsdp"``, keep the parameters, gradients and optimizer state on the host and run the update
            there (FSDP2's ``CPUOffloadPolicy``; CUDA only).
        micro_batch_size: the micro-batch :class:`~autotune.callbacks.ElasticBatchSize` starts with (None: the
            whole batch).
        micro_batch_sample_size: where batches vary in shape (dynamic padding), the elements per sample at which
            ``micro_batch_size`` fits: the longest batch a search saw. ``ElasticBatchSize`` starts its split there,
            so shorter batches take larger micro-batches from the first step (None: the first batch's).
        budget: the memory budget the run keeps (``"20GiB"``, ``0.8``, ``"auto"``; None: react to OOM only).
        activation_checkpointing: the fraction in [0, 1] of the model's repeated blocks to checkpoint, the class
            names of the modules to checkpoint, or ``"auto"``: the estimator chooses, for the micro-batch and the
            budget, what each block recomputes (``recompute``; :func:`autotune.choose_recompute`).
        recompute: with ``activation_checkpointing="auto"``, one level per repeated block (in module order, see
            ``RECOMPUTE_LEVELS``): ``"none"``, ``"ops"`` (its matrix products and attention saved, its pointwise
            operators, norms and dropout recomputed: torch's selective checkpointing) or ``"block"`` (all of it
            recomputed). None: not chosen yet (a search or ``autotune estimate`` chooses).
        activation_offload: keep the tensors saved for backward on the host (``save_on_cpu``).
        optimizer_offload: keep the optimizer state on the host and run the update on the CPU (torchao's
            ``CPUOffloadOptimizer``; one CUDA GPU, ``pip install 'lightning-autotune[torchao]'``).
        optimizer_state: ``"full"`` (the user's optimizer), ``"8bit"`` or ``"4bit"``: Adam and AdamW replaced by
            torchao's low-bit versions (same hyper-parameters, groups and schedulers); other optimizers are refused.
            Under ``precision="bf16-true"`` Adam and AdamW update the bf16 weights with stochastic rounding (torchao).
        compile: compile each repeated block with ``torch.compile`` (regional compilation).
        compile_memory_budget: with ``compile``, the share in [0, 1] of the activations the compiler's partitioner
            may keep for backward, recomputing the rest as it chooses (None: the compiler's default, 1.0).
        float8: run linear layers' matrix products in FP8 (torchao's float8 training; CUDA compute capability 8.9+).
        expandable_segments: CUDA allocator setting ``expandable_segments:True``, on from ``setup`` to teardown.
        num_workers: DataModule ``num_workers`` (None: leave as is).
        pin_memory: DataModule ``pin_memory`` (None: leave as is).
        provenance: where the plan came from and what was measured.

    Raises:
        ValueError: one error listing every invalid field.

    Example:
        >>> plan = Plan(precision="bf16-mixed", micro_batch_size=8, activation_checkpointing=0.5)
        >>> plan.trainer_kwargs()
        {'precision': 'bf16-mixed', 'accumulate_grad_batches': 1}
        >>> Plan.from_dict(plan.to_dict()) == plan
        True
    """

    precision: str = "32-true"
    strategy: str = "auto"
    devices: int | None = None
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    micro_batch_size: int | None = None
    micro_batch_sample_size: float | None = None
    budget: str | None = None
    activation_checkpointing: float | tuple[str, ...] | str = 0.0
    recompute: tuple[str, ...] | None = None
    activation_offload: bool = False
    optimizer_offload: bool = False
    optimizer_state: str = "full"
    compile: bool = False
    compile_memory_budget: float | None = None
    float8: bool = False
    expandable_segments: bool = False
    num_workers: int | None = None
    pin_memory: bool | None = None
    provenance: Provenance = field(default_factory=Provenance, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.provenance, Mapping):
            object.__setattr__(self, "provenance", Provenance.from_dict(self.provenance))
        problems = [message for _, message in field_problems(vars(self))]
        if problems:
            raise ValueError("invalid plan: " + "; ".join(problems))
        ckpt = self.activation_checkpointing
        object.__setattr__(self, "activation_checkpointing", ckpt if ckpt == "auto" else
                           tuple(ckpt) if isinstance(ckpt, (list, tuple)) else float(ckpt))
        if self.recompute is not None:
            object.__setattr__(self, "recompute", tuple(self.recompute))
        if self.budget is not None:
            object.__setattr__(self, "budget", str(Budget.parse(self.budget)))
        for name in ("compile_memory_budget", "micro_batch_sample_size"):  # 512 and 512.0: one plan, one key
            if getattr(self, name) is not None:
                object.__setattr__(self, name, float(getattr(self, name)))

    # ------------------------------------------------------------------------------------------ canonical form
    def to_dict(self) -> dict[str, Any]:
        """The plan's settings as one JSON-safe dict with its ``format_version`` (the provenance is not part of it:
        two plans with the same settings are the same plan).

        Example:
            >>> Plan(activation_checkpointing=1).to_dict()["activation_checkpointing"]
            1.0
        """
        data: dict[str, Any] = {"format_version": FORMAT_VERSION}
        for f in dataclasses.fields(self):
            if f.name != "provenance":
                value = getattr(self, f.name)
                data[f.name] = list(value) if isinstance(value, tuple) else value
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, provenance: Provenance | Mapping[str, Any] | None = None) -> Plan:
        """Read a plan's dict form (:meth:`to_dict`); missing settings take their defaults.

        Raises:
            ValueError: one error listing every problem: unknown keys, a newer ``format_version``, invalid values.

        Example:
            >>> Plan.from_dict({"precision": "bf16-mixed", "micro_batch_size": 4}).describe()
            'bf16-mixed, micro 4'
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"a plan must be a mapping of its settings; got {type(data).__name__}")
        settings = {f.name for f in dataclasses.fields(cls)} - {"provenance"}
        problems = version_problems(data)
        unknown = sorted(set(data) - settings - {"format_version"}, key=str)
        if unknown:
            problems.append(f"unknown plan settings {', '.join(map(str, unknown))} (known: {', '.join(sorted(settings))})")
        values = {k: v for k, v in data.items() if k in settings}
        problems += [message for _, message in field_problems(values)]
        if problems:
            raise ValueError("invalid plan: " + "; ".join(problems))
        return cls(**values, provenance=provenance if provenance is not None else Provenance())

    def key(self) -> str:
        """The plan's identity as text (its dict form as sorted JSON): equal plans, equal keys."""
        return json.dumps(self.to_dict(), sort_keys=True)

    # ------------------------------------------------------------------------------------------------ use
    def trainer_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``Trainer`` (precision, strategy, devices, and the accumulation the runtime requires).

        ``"fsdp"`` gives a ``ModelParallelStrategy`` object (data parallel over ``devices`` ranks, no tensor
        parallelism).

        Raises:
            ValueError: for ``"fsdp"`` without ``devices``.

        Example:
            >>> Plan(strategy="fsdp", devices=8).trainer_kwargs()["strategy"]  # doctest: +ELLIPSIS
            <lightning.pytorch.strategies.model_parallel.ModelParallelStrategy object at ...>
        """
        kwargs: dict[str, Any] = {"precision": self.precision, "accumulate_grad_batches": 1}
        if self.strategy == "fsdp":
            from lightning.pytorch.strategies import ModelParallelStrategy

            kwargs["strategy"] = ModelParallelStrategy(**self._model_parallel_args())
        elif self.strategy != "auto":
            kwargs["strategy"] = self.strategy
        if self.devices is not None:
            kwargs["devices"] = self.devices
        return kwargs

    def _model_parallel_args(self) -> dict[str, Any]:
        if self.devices is None:
            raise ValueError("Plan(strategy='fsdp') needs devices=N, the ranks that share the model: its strategy is "
                             "ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1)")
        return {"data_parallel_size": self.devices, "tensor_parallel_size": 1}

    def callbacks(self) -> list[Callback]:
        """The callbacks that apply the plan: ``ElasticBatchSize`` and ``ApplyPlan``.

        Example:
            >>> from lightning.pytorch import Trainer
            >>> plan = Plan(micro_batch_size=8)
            >>> trainer = Trainer(**plan.trainer_kwargs(), callbacks=[*plan.callbacks()])  # doctest: +SKIP
        """
        from autotune.callbacks import ApplyPlan, ElasticBatchSize

        return [
            ElasticBatchSize(**self.elastic_kwargs()),
            ApplyPlan(**self.apply_kwargs()),
        ]

    def elastic_kwargs(self) -> dict[str, Any]:
        """The ``ElasticBatchSize`` keyword arguments of this plan.

        A plan with a micro-batch runs at it, the micro-batch its search measured (or ``autotune suggest``
        predicted): ``grow=False``, so that clean steps do not take it to larger ones the search found slower or
        over the budget (an out-of-memory error still halves it; batches whose shape varies still take the micro-batch
        their shape allows). Pass ``grow=True`` to ``ElasticBatchSize`` (``grow: true`` in the tuned file) to let it try
        larger ones. Without a micro-batch it starts at the whole batch and grows back after a halving.

        Example:
            >>> Plan(micro_batch_size=16).elastic_kwargs()
            {'budget': None, 'micro_batch_size': 16, 'micro_batch_sample_size': None, 'grow': False}
        """
        return {"budget": self.budget, "micro_batch_size": self.micro_batch_size,
                "micro_batch_sample_size": self.micro_batch_sample_size, "grow": self.micro_batch_size is None}

    def apply_kwargs(self) -> dict[str, Any]:
        """The ``ApplyPlan`` keyword arguments of this plan: the rest of its dict form, and its provenance."""
        data = self.to_dict()
        for name in ("format_version", "precision", "accumulate_grad_batches", "strategy", "devices",
                     *self.elastic_kwargs()):
            data.pop(name, None)
        if self.recompute is None:  # written only where 'auto' checkpointing chose it
            data.pop("recompute")
        return {**data, "provenance": self.provenance.as_dict()}

    def replace(self, **changes: Any) -> Plan:
        """A copy with ``changes`` applied (validated)."""
        return dataclasses.replace(self, **changes)

    def save(self, path: str | Path, *, command: str | None = None) -> Path:
        """Write the plan as a LightningCLI config (``--config tuned.yaml``); see :func:`autotune.load_plan`."""
        text = render_tuned_file(self.tuned_document(), provenance=self.provenance.as_dict(), command=command)
        return write_tuned_file(text, path)

    def tuned_document(self) -> dict[str, Any]:
        """The tuned file's content: a LightningCLI config whose trainer section applies the plan."""
        apply = self.apply_kwargs()
        apply["provenance"] = {"format_version": FORMAT_VERSION, **apply["provenance"]}
        trainer: dict[str, Any] = {}
        if self.strategy == "fsdp":
            trainer["strategy"] = {"class_path": MODEL_PARALLEL, "init_args": self._model_parallel_args()}
        elif self.strategy != "auto":
            trainer["strategy"] = self.strategy
        if self.devices is not None:
            trainer["devices"] = self.devices
        trainer.update(precision=self.precision, accumulate_grad_batches=1)  # last: a file cut short lacks them
        # The callbacks come first: resolving their class paths imports autotune.callbacks, whose LightningCLI error
        # handler then reports a bad value of any key below in one line (callbacks/_lightning_cli.py).
        return {"trainer": {
            "callbacks+": [  # jsonargparse appends these to the callbacks of the configs before this one
                {"class_path": ELASTIC, "init_args": self.elastic_kwargs()},
                {"class_path": APPLY, "init_args": apply},
            ],
            **trainer,
        }}

    def describe(self) -> str:
        """A one-line summary, e.g. ``bf16-mixed, micro 8, ckpt 0.5``."""
        parts = [self.precision, f"micro {self.micro_batch_size or 'all'}"]
        if self.strategy != "auto":
            sharding = "" if self.strategy != "fsdp" or self.reshard_after_forward else " (no reshard)"
            parts.insert(0, f"{self.strategy}{sharding}" + (f" x{self.devices}" if self.devices else ""))
        ckpt = self.activation_checkpointing
        if ckpt == "auto":
            parts.append("ckpt auto" + (f" {''.join(level[0] for level in self.recompute)}" if self.recompute else ""))
        elif ckpt:
            parts.append(f"ckpt {ckpt if not isinstance(ckpt, tuple) else '+'.join(ckpt)}")
        for flag in _FLAGS:
            if getattr(self, flag):
                parts.append(flag.replace("activation_", "").replace("_", "-"))
        if self.optimizer_state != "full":
            parts.append(f"{self.optimizer_state} state")
        if self.compile_memory_budget is not None:
            parts.append(f"compile budget {self.compile_memory_budget:g}")
        if self.num_workers is not None:
            parts.append(f"workers {self.num_workers}")
        if self.pin_memory:
            parts.append("pinned")
        return ", ".join(parts)


def field_problems(fields: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(field, message)`` for every problem with the plan settings in ``fields`` (only those present are checked;
    rules between two fields when both are). Each message names the field, the value and what is accepted."""
    problems: list[tuple[str, str]] = []

    def check(name: str, ok: Any, accepted: str) -> None:
        if name in fields and not ok(fields[name]):
            problems.append((name, f"{name} must be {accepted}; got {fields[name]!r}"))

    check("precision", lambda v: isinstance(v, str) and v in PRECISIONS, f"one of {', '.join(PRECISIONS)}")
    check("strategy", lambda v: isinstance(v, str) and v in STRATEGIES, f"one of {', '.join(STRATEGIES)}")
    check("devices", lambda v: v is None or (_is_int(v) and v >= 1), "a positive int or None")
    check("reshard_after_forward", lambda v: isinstance(v, bool), "true or false")
    check("micro_batch_size", lambda v: v is None or (_is_int(v) and v >= 1), "a positive int or None")
    check("micro_batch_sample_size", lambda v: v is None or (not isinstance(v, bool) and isinstance(v, (int, float))
                                                             and 0 < v < math.inf), "a positive number or None")
    if fields.get("micro_batch_sample_size") is not None and fields.get("micro_batch_size") is None:
        problems.append(("micro_batch_sample_size", "micro_batch_sample_size is where micro_batch_size fits; it needs "
                                                    "micro_batch_size"))
    if fields.get("budget") is not None:
        try:
            Budget.parse(fields["budget"])
        except ValueError as err:
            problems.append(("budget", str(err)))
    ckpt = fields.get("activation_checkpointing")
    if isinstance(ckpt, (list, tuple)):
        if not all(isinstance(name, str) and name.isidentifier() for name in ckpt):
            problems.append(("activation_checkpointing",
                             f"activation_checkpointing class names must be identifiers; got {list(ckpt)!r}"))
    else:
        check("activation_checkpointing",
              lambda v: v == "auto" or (not isinstance(v, bool) and isinstance(v, (int, float)) and not math.isnan(v)
                                        and 0 <= v <= 1),
              "a fraction in [0, 1], a list of class names or 'auto'")
    levels = fields.get("recompute")
    if levels is not None:
        if not isinstance(levels, (list, tuple)) or not levels or not all(
                isinstance(v, str) and v in RECOMPUTE_LEVELS for v in levels):
            problems.append(("recompute", f"recompute must be a list of {', '.join(RECOMPUTE_LEVELS)} (one per repeated "
                                          f"block) or None; got {levels!r}"))
        elif fields.get("activation_checkpointing", 0.0) != "auto":
            problems.append(("recompute", "recompute is what activation_checkpointing='auto' chose; it needs "
                                          "activation_checkpointing: auto"))
    for flag in _FLAGS:
        check(flag, lambda v: isinstance(v, bool), "true or false")
    if fields.get("optimizer_offload") is True and fields.get("strategy", "auto") != "auto":
        problems.append(("optimizer_offload", "optimizer_offload runs on one GPU; it cannot be combined with strategy "
                                              f"{fields['strategy']!r}"))
    if fields.get("strategy") == "ddp":  # "auto" may be a strategy the user configured: ApplyPlan checks at setup
        for name, value in (("cpu_offload", True), ("reshard_after_forward", False)):
            if fields.get(name) is value:
                problems.append((name, f"{name}={value} configures FSDP2 sharding; it cannot be combined with "
                                       "strategy 'ddp' (use strategy 'fsdp')"))
    if fields.get("cpu_offload") is True and fields.get("optimizer_offload") is True:
        problems.append(("cpu_offload", "cpu_offload (FSDP2, sharded) and optimizer_offload (torchao, one GPU) both move "
                                        "the optimizer state to the host; choose one"))
    check("optimizer_state", lambda v: isinstance(v, str) and v in OPTIMIZER_STATES,
          f"one of {', '.join(OPTIMIZER_STATES)}")
    check("compile_memory_budget", lambda v: v is None or (not isinstance(v, bool) and isinstance(v, (int, float))
                                                           and not math.isnan(v) and 0 <= v <= 1),
          "a fraction in [0, 1] or None")
    if fields.get("compile_memory_budget") is not None and fields.get("compile", True) is not True:
        problems.append(("compile_memory_budget", "compile_memory_budget is the compiler's; it needs compile=True"))
    if fields.get("optimizer_state") in ("8bit", "4bit") and fields.get("optimizer_offload") is True:
        problems.append(("optimizer_state", f"optimizer_state {fields['optimizer_state']!r} and optimizer_offload both "
                                            "replace the optimizer; choose one"))
    check("num_workers", lambda v: v is None or (_is_int(v) and v >= 0), "an int >= 0 or None")
    check("pin_memory", lambda v: v is None or isinstance(v, bool), "true, false or None")
    if "provenance" in fields and not isinstance(fields["provenance"], Provenance):
        problems.append(("provenance", "provenance must be a Provenance or a mapping; got "
                                       f"{type(fields['provenance']).__name__}"))
    return problems


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def load_plan(path: str | Path) -> Plan:
    """Read a tuned file written by :meth:`Plan.save` back into a :class:`Plan`.

    Only ``yaml.safe_load`` is used and only class paths in the ``autotune.`` and ``lightning.`` namespaces are
    accepted. Every problem is reported at once.

    Raises:
        PlanFileError: naming the file and the key of each problem.

    Example:
        >>> plan = load_plan("tuned.yaml")  # doctest: +SKIP
    """
    fields, where, problems = read_tuned_file(path)
    provenance = fields.pop("provenance", None)
    if provenance is not None:
        problems += provenance_problems(provenance, where=where["provenance"])
    settings = {f.name for f in dataclasses.fields(Plan)} - {"provenance"}
    problems += [f"{where[name]}: unknown setting{did_you_mean(name, sorted(settings))}" for name in fields
                 if name not in settings]
    values = {k: v for k, v in fields.items() if k in settings}
    problems += [f"{where.get(name, name)}: {message}" for name, message in field_problems(values)]
    if problems:
        raise PlanFileError(f"{path}: " + f"\n{path}: ".join(problems))
    return Plan.from_dict(values, provenance=provenance)
