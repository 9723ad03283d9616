"""Predict the peak memory of one training step for a plan, without running it on the device: the public functions
(one plan, the largest micro-batch that fits, a target's rows for ``autotune estimate``). How a step is traced:
:mod:`autotune._estimate.trace`; a rank's share under sharding: :mod:`autotune._estimate.sharding`; CUDA's rules,
with or without a GPU: :mod:`autotune._estimate.cuda_rules`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autotune._device.budget import BudgetSpec, ResolvedBudget, check_bytes, resolve_budget
from autotune._device.probe import DeviceSpec
from autotune._estimate.fake_step import OptimizerFactory
from autotune._estimate.result import Estimate, estimate_device
from autotune._estimate.trace import Traces
from autotune._plan.plan import Plan

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule

    from autotune._estimate.devices import DeviceSpeed
    from autotune._estimate.recompute import RecomputeChoice
    from autotune._estimate.step_time import SpeedPrediction

    from autotune._target.target import Target

__all__ = ["BatchSizes", "Estimate", "TargetEstimate", "default_plans", "estimate", "estimate_device",
           "estimate_target", "first_batch", "longest_batch", "max_micro_batch_size"]


@dataclass(frozen=True, kw_only=True)
class TargetEstimate:
    """One row of ``autotune estimate``: a plan's estimate at the row's micro-batch against ``budget_bytes``.

    It also holds the largest micro-batch in 1..``batch_size`` (the target's batch) predicted to fit (None if none
    does). ``baseline_bytes`` is what the process holds besides the step's tensors, in the budget's measure. On CPU,
    where the budget is the process's resident set net of file pages, it is a measured baseline (see ``autotune
    estimate``). On CUDA it is 0: the budget caps the allocator as ``ElasticBatchSize`` caps it, the context outside.
    (A search's trials count the context in their peaks, and its predictions add it: docs/search.md.)
    ``peak_bytes`` is the estimate plus the baseline, what the budget is compared with."""

    estimate: Estimate
    batch_size: int
    budget_bytes: int
    max_micro_batch_size: int | None
    parameter_count: int = 0
    baseline_bytes: int = 0
    measured_peak_bytes: int | None = None  # a short run's peak where one settled the fit (``autotune estimate``)
    speed: SpeedPrediction | None = None  # at the row's micro-batch if it fits, else at the largest that does
    recompute: RecomputeChoice | None = None  # what activation_checkpointing="auto" chose for the row, per block

    @property
    def peak_bytes(self) -> int:
        """The predicted peak in the budget's measure: the step's tensors plus the process baseline."""
        return self.estimate.predicted_peak_bytes + self.baseline_bytes

    @property
    def state_bytes_per_parameter(self) -> float:
        """One rank's model state (``Estimate.model_state_bytes``) per parameter of the model: 16 for fp32 AdamW,
        about 10 with 8-bit moments, 16 / N sharded over N ranks."""
        return self.estimate.model_state_bytes / self.parameter_count if self.parameter_count else 0.0

    @property
    def fits(self) -> bool:
        """Whether the row's micro-batch fits the budget (with the process baseline); a measured peak, where a short
        run took one, decides."""
        if self.measured_peak_bytes is not None:
            return self.measured_peak_bytes <= self.budget_bytes
        return self.peak_bytes <= self.budget_bytes

    def as_dict(self) -> dict[str, Any]:
        """The row for JSON: the plan's fields (not its provenance), the estimate, the budget and the fit."""
        plan = {k: v for k, v in self.estimate.plan.to_dict().items() if k != "format_version"}
        return {**plan, "micro_batch_size": self.estimate.micro_batch_size, "device": self.estimate.device,
                "predicted_peak_bytes": self.estimate.predicted_peak_bytes,
                **{f"{name}_bytes": value for name, value in self.estimate.breakdown().items()},
                "host_bytes": self.estimate.host_bytes, "baseline_bytes": self.baseline_bytes,
                "peak_bytes": self.peak_bytes, "budget_bytes": self.budget_bytes, "fits": self.fits,
                "max_micro_batch_size": self.max_micro_batch_size, "world_size": self.estimate.world_size,
                "gathered_bytes": self.estimate.gathered_bytes, "context_bytes": self.estimate.context_bytes,
                "state_bytes_per_parameter": self.state_bytes_per_parameter,
                "method": self.estimate.method, "measured_peak_bytes": self.measured_peak_bytes,
                "notes": list(self.estimate.notes),
                "recompute_blocks": None if self.recompute is None else [
                    {"name": b.name, "level": b.level, "saved_bytes": b.saved_bytes,
                     "recompute_seconds": b.recompute_seconds} for b in self.recompute.blocks],
                "speed": None if self.speed is None else {"micro_batch_size": self.speed.plan.micro_batch_size,
                                                          **self.speed.as_dict()}}


def estimate(
    *, model: LightningModule, batch: Any, plan: Plan, device: DeviceSpec = None,
    optimizer: OptimizerFactory | None = None, world_size: int | None = None, trace: str = "auto",
) -> Estimate:
    """Predict the peak memory of one training step of ``model`` with ``plan`` on one micro-batch of ``batch``.

    Nothing runs on the device and ``model`` is not touched: a copy without data is traced. That trace fails on a step
    that reads tensor values (``.item()``, a mask checked with ``.all()``, data-dependent routing) or on an op without a
    fake rule. Then a copy with real weights runs on the host instead. It runs at the micro-batch asked up to 4, and
    where the work of its step is within the real path's limits (FLOPs, bytes allocated, host memory held: on the line
    through micro-batches 1 and 2). Else each moment of the step is taken from two smaller powers of two to it. The rule
    is the work's, never the clock's: the same answer on a busy host. ``Estimate.method`` and the first of
    ``Estimate.notes`` say which and why. CUDA's rules (allocator rounding, workspaces, autocast op lists) apply on
    either path. A checkpointing, compile or offload setting that applies to nothing (blocks whose own forward never
    runs) is named in the notes.

    Args:
        model: The LightningModule (automatic optimization).
        batch: A training batch; the micro-batch is its first ``plan.micro_batch_size`` samples (None: all).
        plan: Its precision, checkpointing, offload, strategy and micro-batch are applied.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or N; None: the current CUDA device, else the CPU. A CUDA device
            on a machine without CUDA is estimated what-if (see :mod:`autotune._estimate.cuda_rules`).
        optimizer: Builds the optimizer from the parameters; None: the model's ``configure_optimizers()``.
        world_size: The ranks the plan runs on (None: the plan's ``devices``, else 1); the estimate is one rank's:
            replicated model state under DDP (plus its gradient buckets), sharded under ``strategy="fsdp"`` (the
            shards, plus the gathered units), and the rank's micro-batch of activations.
        trace: ``"auto"`` (without data; with real tensors on the host where that fails), ``"fake"`` (without data
            only: a failure is a ``ValueError``), ``"real"`` (with real tensors on the host at the micro-batch asked,
            whatever the step does and however much work it is: a cross-check of the first path) or ``"line"`` (real
            tensors at micro-batches up to 4, larger ones from the moments of 2 and 4, whatever their work: a check of
            the extrapolation that steps too costly for the host get).

    Raises:
        ValueError: for a bad device, a batch without tensors, a micro-batch larger than the batch, a precision the
            estimator does not trace, manual optimization, a ``training_step`` that cannot be traced (on either path),
            a bad ``world_size`` or ``trace``, or a step that needs real tensors of a model on the meta device or too
            large for the host.

    Example:
        >>> estimate(model=model, batch=batch, plan=Plan(micro_batch_size=8)).fits(2**30)  # doctest: +SKIP
        True
        >>> estimate(model=model, batch=batch, plan=Plan(strategy="fsdp"), world_size=8)  # doctest: +SKIP
    """
    traces = Traces(model=model, batch=batch, plan=plan, device=device, optimizer=optimizer, world_size=world_size,
                    trace=trace)
    return traces.at(plan.micro_batch_size or traces.size)


def max_micro_batch_size(
    *, model: LightningModule, batch: Any, plan: Plan, budget_bytes: int, device: DeviceSpec = None,
    optimizer: OptimizerFactory | None = None, world_size: int | None = None,
) -> int | None:
    """The largest micro-batch of ``batch`` (1..its size) whose predicted step peak fits ``budget_bytes``.

    The peak is close to affine in the micro-batch: the search interpolates between a size that fits and one that
    does not and traces each guess (halving when a guess gains little). Returns None when one sample does not fit.

    Raises:
        ValueError: as :func:`estimate`, and for ``budget_bytes`` not a positive int.

    Example:
        >>> max_micro_batch_size(model=model, batch=batch, plan=Plan(), budget_bytes=2**30)  # doctest: +SKIP
        24
    """
    check_bytes("budget_bytes", budget_bytes)
    return Traces(model=model, batch=batch, plan=plan, device=device, optimizer=optimizer,
                   world_size=world_size).largest_fit(budget_bytes)


def default_plans(*, precisions: Sequence[str] | None = None, world_size: int = 1,
                  optimizer_states: Sequence[str] = ("full",)) -> list[Plan]:
    """Each precision (default 32-true and bf16-mixed) and optimizer state with no and full checkpointing, and over
    several ranks both replicated (ddp) and sharded (fsdp); ValueError for a bad precision or state."""
    layouts: list[dict[str, Any]] = [{}] if world_size <= 1 else [
        {"strategy": "ddp"}, {"strategy": "fsdp", "devices": world_size}]
    return [Plan(precision=p, optimizer_state=o, activation_checkpointing=c, **layout)
            for p in precisions or ("32-true", "bf16-mixed") for o in optimizer_states for layout in layouts
            for c in (0.0, 1.0)]


def estimate_target(
    *, target: Target, plans: Sequence[Plan], budget: BudgetSpec | ResolvedBudget, device: DeviceSpec = None,
    micro_batch_size: int | None = None, world_size: int | None = None, device_memory_bytes: int | None = None,
    baseline_bytes: int | Callable[[Plan], int] = 0, seq_len: int | None = None, trace: str = "auto",
    device_speed: DeviceSpeed | None = None,
) -> list[TargetEstimate]:
    """Estimate each plan on a target's first training batch against a budget (the rows of ``autotune estimate``).

    ``budget`` is a spec (``"20GiB"``, ``0.8``, ``"auto"``) resolved against ``device``'s memory
    (:func:`~autotune._device.budget.resolve_budget`; a budget it resolved already is used as it is); every row uses
    ``micro_batch_size`` (None: the plan's own, else the whole batch), and is one rank's of ``world_size`` (see
    :func:`estimate`). ``device_memory_bytes`` is the device's memory for shares of it (``0.8``) in place of a
    reading of the device (needed for a what-if device). ``baseline_bytes`` is added to every peak before it is
    compared with the budget (the process's own memory on CPU, see :class:`TargetEstimate`), or is a function of a
    row's plan at its micro-batch giving it (the process grows with the micro-batch). ``seq_len``: estimate
    the batch at this sequence length (its token ids, masks and labels cut or filled, see ``with_sequence_length``;
    None: the batch's own). ``trace``: how each step is traced, as for :func:`estimate`. ``device_speed``: also
    predict each row's speed on that device (at the row's micro-batch where it fits, else at the largest that does;
    none where nothing fits), uncalibrated. A plan with ``activation_checkpointing="auto"`` not chosen yet is chosen
    for the row's micro-batch and the budget less the baseline (:func:`autotune.choose_recompute`, its recompute
    priced on ``device_speed``), and the row holds the choice. Returns one row per plan, in order.

    Raises:
        ValueError: for a bad budget or micro-batch and as :func:`estimate`, for an ``"auto"`` plan without
            ``device_speed``; ``TargetError`` for a target whose data gives no batch.
    """
    resolved, what_if = estimate_device(device)
    budget_bytes = resolve_budget(budget, resolved, what_if=what_if, device_memory=device_memory_bytes).budget_bytes
    batch = first_batch(target, seq_len=seq_len)
    count = sum({id(p): p.numel() for p in target.model.parameters()}.values())
    rows = []
    for plan in plans:
        choice = None
        if plan.activation_checkpointing == "auto" and plan.recompute is None:
            choice = _choose_for_row(target=target, batch=batch, plan=plan, budget_bytes=budget_bytes, device=resolved,
                                     micro_batch_size=micro_batch_size, world_size=world_size,
                                     baseline_bytes=baseline_bytes, device_speed=device_speed)
            plan = choice.plan.replace(micro_batch_size=plan.micro_batch_size)
        traces = Traces(model=target.model, batch=batch, plan=plan, device=resolved, optimizer=None,
                        world_size=world_size, trace=trace)
        at_micro = traces.at(micro_batch_size or plan.micro_batch_size or traces.size)
        baseline = baseline_bytes(plan.replace(micro_batch_size=at_micro.micro_batch_size)) if callable(
            baseline_bytes) else baseline_bytes
        room = budget_bytes - baseline
        largest = traces.largest_fit(room) if room > 0 else None
        fast = at_micro.micro_batch_size if at_micro.predicted_peak_bytes <= room else largest
        speed = None
        if device_speed is not None and fast is not None:
            from autotune._estimate.speed import SpeedModel

            speed = SpeedModel(device_speed, batch_size=traces.size).predict(
                traces.work(fast), plan.replace(micro_batch_size=fast), world_size=traces.world_size)
        rows.append(TargetEstimate(estimate=at_micro, batch_size=traces.size, budget_bytes=budget_bytes,
                                   max_micro_batch_size=largest, parameter_count=count, baseline_bytes=baseline,
                                   speed=speed, recompute=choice))
    return rows


def _choose_for_row(*, target: Target, batch: Any, plan: Plan, budget_bytes: int, device: Any,
                    micro_batch_size: int | None, world_size: int | None,
                    baseline_bytes: int | Callable[[Plan], int], device_speed: DeviceSpeed | None) -> RecomputeChoice:
    """``activation_checkpointing="auto"`` chosen for a row: at its micro-batch, in the budget less the baseline."""
    from autotune._estimate.recompute import choose
    from autotune._runtime.batch import batch_size_of

    if device_speed is None:
        raise ValueError("activation_checkpointing='auto' prices each block's recompute on the device: give its "
                         "speeds (device_speed; `autotune estimate --device-type` for a GPU this machine lacks)")
    micro = micro_batch_size or plan.micro_batch_size or batch_size_of(batch)
    at = plan.replace(micro_batch_size=micro)
    baseline = baseline_bytes(at) if callable(baseline_bytes) else baseline_bytes
    return choose(model=target.model, batch=batch, plan=at, budget_bytes=max(budget_bytes - baseline, 1),
                  device=device, speed=device_speed, world_size=world_size)


def first_batch(target: Target, *, seq_len: int | None = None) -> Any:
    """The first batch of the target's train dataloader (after ``datamodule.setup("fit")``), at sequence length
    ``seq_len`` when given (ValueError for a batch without one); ``TargetError`` if there is no batch."""
    batch = _first_batch(target)
    if seq_len is None:
        return batch
    from autotune._runtime.batch import batch_size_of, with_sequence_length

    size = batch_size_of(batch)
    if size is None:
        raise ValueError(f"target '{target.spec}': its batch has no tensor, so no sequence length to set")
    try:
        return with_sequence_length(batch, size, seq_len)
    except ValueError as error:
        raise ValueError(f"--seq-len {seq_len}: target '{target.spec}': {error}") from None
    except RuntimeError as error:
        from autotune._device.oom import is_oom_error

        if not is_oom_error(error):
            raise
        raise ValueError(f"--seq-len {seq_len}: target '{target.spec}': its batch at that length does not fit in "
                         f"this machine's memory") from None


@dataclass(frozen=True)
class BatchSizes:
    """Elements per sample (:func:`autotune._runtime.batch.sample_size_of`: padded length x tensors, image size) of
    the batches read from a target's train dataloader."""

    batches: int
    smallest: float
    median: float
    largest: float

    @property
    def varies(self) -> bool:
        """Whether the batches' memory follows their shape: the largest sample is over 5% above the smallest."""
        return self.largest > 1.05 * self.smallest

    def describe(self) -> str:
        return (f"elements per sample {self.smallest:g}-{self.largest:g} (median {self.median:g}) over the first "
                f"{self.batches} batches")


def longest_batch(target: Target, *, batches: int = 32, seconds: float = 10.0) -> tuple[Any, BatchSizes]:
    """Find the batch with the largest samples among the first batches of the target's train dataloader.

    It reads up to ``batches`` batches, as many as ``seconds`` allow, one at least. Where batches are padded to their
    longest sequence, or mix resolutions, the largest is the one whose micro-batches need the most memory. Returns it
    and the sizes seen; ``TargetError`` if there is no batch."""
    import statistics
    import time

    from autotune._runtime.batch import batch_size_of, sample_size_of

    first = _first_batch(target)
    owner: Any = target.datamodule if target.datamodule is not None else target.model
    start, seen, best, best_size = time.perf_counter(), [], first, -1.0
    loader = iter(owner.train_dataloader())
    for batch in loader:
        size = sample_size_of(batch, batch_size_of(batch) or 1)
        seen.append(size)
        if size > best_size:
            best, best_size = batch, size
        if len(seen) >= batches or time.perf_counter() - start > seconds:
            break
    if not seen:
        return first, BatchSizes(0, 0.0, 0.0, 0.0)
    return best, BatchSizes(len(seen), min(seen), statistics.median(seen), max(seen))


def _first_batch(target: Target) -> Any:
    from autotune._target.target import TargetError

    owner: Any = target.datamodule if target.datamodule is not None else target.model
    try:
        if target.datamodule is not None:
            target.datamodule.setup("fit")
        return next(iter(owner.train_dataloader()))
    except StopIteration:
        raise TargetError(f"target '{target.spec}': the train dataloader yields no batch") from None
    except Exception as error:
        message = " ".join(f"{type(error).__name__}: {error}".split())
        raise TargetError(f"target '{target.spec}': cannot read a training batch ({message})") from error
