"""``Plan``: the one type that flows through the product (probe -> estimate -> search -> tuned file -> callbacks)."""

from __future__ import annotations

import dataclasses
import datetime
import math
import platform
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune._device.budget import Budget

if TYPE_CHECKING:
    from lightning.pytorch import Callback

#: Lightning precision strings a plan may choose.
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "transformer-engine")
#: Strategies a plan may choose ("auto": Lightning's choice for the devices; the elastic runtime supports DDP).
STRATEGIES = ("auto", "ddp")


@dataclass(frozen=True, kw_only=True)
class Provenance:
    """Where a plan came from and what was measured with it (all optional; kept through the tuned file).

    Example:
        >>> Provenance(budget="4GiB", device_name="NVIDIA H100", samples_per_second=812.5).budget
        '4GiB'
    """

    budget: str | None = None
    device_name: str | None = None
    device_total_bytes: int | None = None
    samples_per_second: float | None = None
    tokens_per_second: float | None = None
    peak_bytes: int | None = None
    predicted_peak_bytes: int | None = None
    versions: dict[str, str] = field(default_factory=dict)
    created: str | None = None
    command: str | None = None
    produced_by: str | None = None  # "search", "estimate", "hand"

    @classmethod
    def here(cls, **fields: Any) -> Provenance:
        """A provenance stamped with the library versions and today's date, plus ``fields``."""
        import lightning
        import torch

        from autotune._version import __version__

        versions = {"autotune": __version__, "torch": str(torch.__version__), "lightning": str(lightning.__version__),
                    "python": platform.python_version()}
        created = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        return cls(versions=versions, created=created, **fields)

    def as_dict(self) -> dict[str, Any]:
        """Only the fields that are set, for the tuned file."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v not in (None, {})}


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A memory plan: every setting the search may choose, applied to a run by the callbacks.

    Args:
        precision: a Lightning precision string (see ``PRECISIONS``); goes to ``Trainer(precision=...)``.
        strategy: ``"auto"`` or ``"ddp"`` (see ``STRATEGIES``); goes to ``Trainer(strategy=...)``.
        micro_batch_size: the micro-batch :class:`~autotune.callbacks.ElasticBatchSize` starts with (None: the
            whole batch).
        budget: the memory budget the run keeps (``"20GiB"``, ``0.8``, ``"auto"``; None: react to OOM only).
        activation_checkpointing: the fraction in [0, 1] of the model's repeated blocks to checkpoint, or the
            class names of the modules to checkpoint.
        activation_offload: keep the tensors saved for backward on the host (``save_on_cpu``).
        optimizer_offload: keep the optimizer state on the host and run the update on the CPU (torchao's
            ``CPUOffloadOptimizer``; one CUDA GPU, ``pip install 'lightning-autotune[offload]'``).
        compile: compile each repeated block with ``torch.compile`` (regional compilation).
        expandable_segments: CUDA allocator setting ``expandable_segments:True``; must be set before CUDA starts.
        num_workers: DataModule ``num_workers`` (None: leave as is).
        pin_memory: DataModule ``pin_memory`` (None: leave as is).
        provenance: where the plan came from and what was measured.

    Raises:
        ValueError: one error listing every invalid field.

    Example:
        >>> plan = Plan(precision="bf16-mixed", micro_batch_size=8, activation_checkpointing=0.5)
        >>> plan.trainer_kwargs()
        {'precision': 'bf16-mixed', 'accumulate_grad_batches': 1}
    """

    precision: str = "32-true"
    strategy: str = "auto"
    micro_batch_size: int | None = None
    budget: str | None = None
    activation_checkpointing: float | tuple[str, ...] = 0.0
    activation_offload: bool = False
    optimizer_offload: bool = False
    compile: bool = False
    expandable_segments: bool = False
    num_workers: int | None = None
    pin_memory: bool | None = None
    provenance: Provenance = field(default_factory=Provenance, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.activation_checkpointing, list):
            object.__setattr__(self, "activation_checkpointing", tuple(self.activation_checkpointing))
        if isinstance(self.budget, (int, float)) and not isinstance(self.budget, bool):
            object.__setattr__(self, "budget", str(Budget.parse(self.budget)))
        if isinstance(self.provenance, Mapping):
            object.__setattr__(self, "provenance", Provenance(**self.provenance))
        problems = plan_problems(self)
        if problems:
            raise ValueError("invalid plan: " + "; ".join(problems))

    # ------------------------------------------------------------------------------------------------ use
    def trainer_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``Trainer`` (precision, strategy, and the accumulation the runtime requires)."""
        kwargs: dict[str, Any] = {"precision": self.precision, "accumulate_grad_batches": 1}
        if self.strategy != "auto":
            kwargs["strategy"] = self.strategy
        return kwargs

    def callbacks(self) -> list[Callback]:
        """The callbacks that apply the plan: ``ElasticBatchSize`` and ``ApplyPlan``.

        Example:
            >>> from lightning.pytorch import Trainer
            >>> plan = Plan(micro_batch_size=8)
            >>> trainer = Trainer(**plan.trainer_kwargs(), callbacks=[*plan.callbacks()])  # doctest: +SKIP
        """
        from autotune.callbacks import ApplyPlan, ElasticBatchSize

        return [
            ElasticBatchSize(budget=self.budget, micro_batch_size=self.micro_batch_size),
            ApplyPlan(**self.apply_kwargs()),
        ]

    def apply_kwargs(self) -> dict[str, Any]:
        """The ``ApplyPlan`` keyword arguments of this plan."""
        checkpointing = self.activation_checkpointing
        return {
            "activation_checkpointing": list(checkpointing) if isinstance(checkpointing, tuple) else checkpointing,
            "activation_offload": self.activation_offload,
            "optimizer_offload": self.optimizer_offload,
            "compile": self.compile,
            "expandable_segments": self.expandable_segments,
            "num_workers": self.num_workers,
            "pin_memory": self.pin_memory,
            "provenance": self.provenance.as_dict(),
        }

    def replace(self, **changes: Any) -> Plan:
        """A copy with ``changes`` applied (validated)."""
        return dataclasses.replace(self, **changes)

    def save(self, path: str | Path, *, command: str | None = None) -> Path:
        """Write the plan as a LightningCLI config (``--config tuned.yaml``); see :func:`autotune.load_plan`."""
        from autotune._plan.tuned import save_plan

        return save_plan(self, path, command=command)

    def describe(self) -> str:
        """A one-line summary, e.g. ``bf16-mixed, micro 8, ckpt 0.5``."""
        parts = [self.precision, f"micro {self.micro_batch_size or 'all'}"]
        if self.strategy != "auto":
            parts.insert(0, self.strategy)
        ckpt = self.activation_checkpointing
        if ckpt:
            parts.append(f"ckpt {ckpt if not isinstance(ckpt, tuple) else '+'.join(ckpt)}")
        for flag in ("activation_offload", "optimizer_offload", "compile", "expandable_segments"):
            if getattr(self, flag):
                parts.append(flag.replace("activation_", "").replace("_", "-"))
        if self.num_workers is not None:
            parts.append(f"workers {self.num_workers}")
        if self.pin_memory:
            parts.append("pinned")
        return ", ".join(parts)


def plan_problems(plan: Plan) -> list[str]:
    """Every problem with the plan's fields, each naming the field, the value and what is accepted."""
    problems = []
    if plan.precision not in PRECISIONS:
        problems.append(f"precision must be one of {', '.join(PRECISIONS)}; got {plan.precision!r}")
    if plan.strategy not in STRATEGIES:
        problems.append(f"strategy must be one of {', '.join(STRATEGIES)}; got {plan.strategy!r}")
    mbs = plan.micro_batch_size
    if mbs is not None and (isinstance(mbs, bool) or not isinstance(mbs, int) or mbs < 1):
        problems.append(f"micro_batch_size must be a positive int or None; got {mbs!r}")
    if plan.budget is not None:
        try:
            Budget.parse(plan.budget)
        except ValueError as err:
            problems.append(str(err))
    ckpt = plan.activation_checkpointing
    if isinstance(ckpt, tuple):
        if not all(isinstance(name, str) and name.isidentifier() for name in ckpt):
            problems.append(f"activation_checkpointing class names must be identifiers; got {list(ckpt)!r}")
    elif isinstance(ckpt, bool) or not isinstance(ckpt, (int, float)) or not 0 <= ckpt <= 1 or math.isnan(ckpt):
        problems.append(f"activation_checkpointing must be a fraction in [0, 1] or a list of class names; got {ckpt!r}")
    for flag in ("activation_offload", "optimizer_offload", "compile", "expandable_segments"):
        if not isinstance(getattr(plan, flag), bool):
            problems.append(f"{flag} must be true or false; got {getattr(plan, flag)!r}")
    if plan.optimizer_offload is True and plan.strategy != "auto":
        problems.append(f"optimizer_offload runs on one GPU; it cannot be combined with strategy {plan.strategy!r}")
    workers = plan.num_workers
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 0):
        problems.append(f"num_workers must be an int >= 0 or None; got {workers!r}")
    if plan.pin_memory is not None and not isinstance(plan.pin_memory, bool):
        problems.append(f"pin_memory must be true, false or None; got {plan.pin_memory!r}")
    if not isinstance(plan.provenance, Provenance):
        problems.append(f"provenance must be a Provenance or a mapping; got {type(plan.provenance).__name__}")
    return problems
