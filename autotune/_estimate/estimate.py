"""Predict the peak memory of one training step for a plan, without running it on the device.

The model is copied under ``FakeTensorMode`` (tensors without data), the plan is applied as a run applies it
(:mod:`autotune._runtime.blocks`, Lightning's precision plugins), and one step runs under torch's ``MemTracker``, which files
every storage under parameters, gradients, optimizer state, activations or temporaries while it lives. The step is
Lightning's (forward with the last gradients alive, ``zero_grad``, backward, update) after a warm-up step that makes the
optimizer state; when the plan cuts the batch, the traced micro-batch adds to the gradients (as the later ones of
``ElasticBatchSize`` do). The peak is the most bytes alive at once plus ``overhead_bytes``; the categories are those at
that moment. Kernels add the work buffers they hold inside one call (:mod:`autotune._estimate.workspace`): derived for
CPU convolutions in fp32, measured once per machine for CPU matrix products and convolutions in bf16/fp16 (oneDNN's
buffers depend on the processor; ``Estimate.notes`` says so). On CUDA each allocation is rounded up to 512 B and the overhead is the cuBLAS workspaces
(:func:`cuda_overhead_bytes`; the CUDA context is outside ``max_memory_allocated``), plus DDP's gradient buckets and the
runtime's averaging buffers under ``strategy="ddp"``. Offloaded activations leave a CUDA device (``host_bytes``); on the
CPU ``save_on_cpu`` keeps a tensor where it is, so offload saves nothing there. Under ``optimizer_offload`` the update
of the parameters torchao offloads runs on the host: the device keeps their gradients, the host their pinned copies,
gradients and optimizer state (``host_bytes``). ``compile`` is not traced: the estimate is the eager step.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from autotune._compat import fake_copy_mode, fake_tensor_mode, mem_ref_types, precision_input_dtype, trainer_reference
from autotune._runtime.blocks import checkpoint_blocks, offload_activations, select_blocks
from autotune._runtime.batch import batch_size_of, slice_batch
from autotune._device.budget import Budget, BudgetSpec
from autotune._runtime.agreement import GRADIENT_BUCKET_BYTES
from autotune._estimate.sharding import rank_state
from autotune._estimate.fake_step import (
    OptimizerFactory,
    bytes_of,
    convert_model,
    fake_batch,
    like_cuda_run,
    loss_of,
    offloaded_host_bytes,
    optimizers_of,
    precision_plugin,
    step_tracker,
)
from autotune._runtime.offload import device_part, is_offloaded
from autotune._plan.plan import Plan
from autotune._device.probe import DeviceSpec, probe_memory, resolve_device

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule

    from autotune._target.target import Target

__all__ = ["Estimate", "TargetEstimate", "cuda_overhead_bytes", "default_plans", "estimate", "estimate_target",
           "first_batch", "max_micro_batch_size"]

_TRACEABLE_PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")
_CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "overhead")
#: cuBLAS's workspace per handle and stream (torch's CublasHandlePool defaults); a step uses two handles.
_CUBLAS_WORKSPACE_SM90 = 32 * 2**20
_CUBLAS_WORKSPACE_DEFAULT = 2 * 4096 * 2**10 + 8 * 16 * 2**10
_CUBLAS_HANDLES_PER_STEP = 2


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """The predicted peak memory of one training step with a plan on one micro-batch, and what it is made of.

    The six ``*_bytes`` categories are taken at the moment of the peak and add up to ``predicted_peak_bytes``.

    Attributes:
        plan: The plan traced, its ``micro_batch_size`` set to the micro-batch traced.
        micro_batch_size: Samples in the traced micro-batch (one rank's).
        device: The device estimated for (``"cpu"``, ``"cuda:0"``).
        world_size: The ranks the plan runs on; the figures are one rank's (see :mod:`autotune._estimate.sharding`).
        gathered_bytes: Under ``strategy="fsdp"``, the part of the parameter and gradient bytes that is gathered
            units (not model state): the rest of those two and the optimizer state are this rank's shards.
        parameters_bytes: Parameters and buffers.
        gradients_bytes: Gradients alive at the peak (this step's, or the previous step's during the forward).
        optimizer_state_bytes: The optimizer's state (Adam's moments, momentum buffers).
        activations_bytes: Tensors made in the forward and still alive (mostly saved for backward), and the batch.
        temporaries_bytes: Other tensors made in the backward and the update, and kernels' work buffers.
        overhead_bytes: What the runtime holds besides tensors and counts in its peak (see the module notes).
        predicted_peak_bytes: The peak: the sum of the six categories.
        host_bytes: Host memory the step uses at most for a CUDA device (offloaded activations, and the copies and
            optimizer state of ``optimizer_offload``); 0 on the CPU.
        notes: What the estimate measured on this machine or left out (kernel work buffers), one sentence each.

    Example:
        >>> e = estimate(model=model, batch=batch, plan=Plan(precision="bf16-mixed"))  # doctest: +SKIP
        >>> e.fits(8 * 2**30), sum(e.breakdown().values()) == e.predicted_peak_bytes  # doctest: +SKIP
        (True, True)
    """

    plan: Plan
    micro_batch_size: int
    device: str
    parameters_bytes: int
    gradients_bytes: int
    optimizer_state_bytes: int
    activations_bytes: int
    temporaries_bytes: int
    overhead_bytes: int
    predicted_peak_bytes: int
    host_bytes: int = 0
    notes: tuple[str, ...] = ()
    world_size: int = 1
    gathered_bytes: int = 0

    def fits(self, budget_bytes: int) -> bool:
        """Whether the predicted peak is at most ``budget_bytes``."""
        return self.predicted_peak_bytes <= budget_bytes

    def breakdown(self) -> dict[str, int]:
        """The six categories (``"parameters"`` ... ``"overhead"``) in bytes; they add up to the peak."""
        return {name: getattr(self, f"{name}_bytes") for name in _CATEGORIES}


@dataclass(frozen=True, kw_only=True)
class TargetEstimate:
    """One row of ``autotune estimate``: a plan's estimate at the row's micro-batch against ``budget_bytes``, and
    the largest micro-batch in 1..``batch_size`` (the target's batch) predicted to fit (None if none does)."""

    estimate: Estimate
    batch_size: int
    budget_bytes: int
    max_micro_batch_size: int | None

    @property
    def fits(self) -> bool:
        """Whether the row's micro-batch fits the budget."""
        return self.estimate.fits(self.budget_bytes)

    def as_dict(self) -> dict[str, Any]:
        """The row for JSON: the plan's fields (not its provenance), the estimate, the budget and the fit."""
        plan = {k: v for k, v in self.estimate.plan.to_dict().items() if k != "format_version"}
        return {**plan, "micro_batch_size": self.estimate.micro_batch_size, "device": self.estimate.device,
                "predicted_peak_bytes": self.estimate.predicted_peak_bytes,
                **{f"{name}_bytes": value for name, value in self.estimate.breakdown().items()},
                "host_bytes": self.estimate.host_bytes, "budget_bytes": self.budget_bytes, "fits": self.fits,
                "max_micro_batch_size": self.max_micro_batch_size, "world_size": self.estimate.world_size,
                "gathered_bytes": self.estimate.gathered_bytes, "notes": list(self.estimate.notes)}


def estimate(
    *, model: LightningModule, batch: Any, plan: Plan, device: DeviceSpec = None,
    optimizer: OptimizerFactory | None = None, world_size: int | None = None,
) -> Estimate:
    """Predict the peak memory of one training step of ``model`` with ``plan`` on one micro-batch of ``batch``.

    Nothing runs on the device and ``model`` is not touched: a copy without data is traced.

    Args:
        model: The LightningModule (automatic optimization).
        batch: A training batch; the micro-batch is its first ``plan.micro_batch_size`` samples (None: all).
        plan: Its precision, checkpointing, offload, strategy and micro-batch are applied.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or N; None: the current CUDA device, else the CPU.
        optimizer: Builds the optimizer from the parameters; None: the model's ``configure_optimizers()``.
        world_size: The ranks the plan runs on (None: the plan's ``devices``, else 1); the estimate is one rank's:
            replicated model state under DDP (plus its gradient buckets), sharded under ``strategy="fsdp"`` (the
            shards, plus the gathered units), and the rank's micro-batch of activations.

    Raises:
        ValueError: for a bad device, a batch without tensors, a micro-batch larger than the batch, a precision the
            estimator does not trace, manual optimization, a ``training_step`` that cannot be traced, or a bad
            ``world_size``.

    Example:
        >>> estimate(model=model, batch=batch, plan=Plan(micro_batch_size=8)).fits(2**30)  # doctest: +SKIP
        True
        >>> estimate(model=model, batch=batch, plan=Plan(strategy="fsdp"), world_size=8)  # doctest: +SKIP
    """
    traces = _Traces(model=model, batch=batch, plan=plan, device=device, optimizer=optimizer, world_size=world_size)
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
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be a positive int of bytes; got {budget_bytes!r}")
    return _Traces(model=model, batch=batch, plan=plan, device=device, optimizer=optimizer,
                   world_size=world_size).largest_fit(budget_bytes)


def default_plans(*, precisions: Sequence[str] | None = None, world_size: int = 1) -> list[Plan]:
    """Each precision (default 32-true and bf16-mixed) with no and full checkpointing, and over several ranks both
    replicated (ddp) and sharded (fsdp); ValueError for a bad precision."""
    layouts: list[dict[str, Any]] = [{}] if world_size <= 1 else [
        {"strategy": "ddp"}, {"strategy": "fsdp", "devices": world_size}]
    return [Plan(precision=p, activation_checkpointing=c, **layout) for p in precisions or ("32-true", "bf16-mixed")
            for layout in layouts for c in (0.0, 1.0)]


def estimate_target(
    *, target: Target, plans: Sequence[Plan], budget: BudgetSpec, device: DeviceSpec = None,
    micro_batch_size: int | None = None, world_size: int | None = None,
) -> list[TargetEstimate]:
    """Estimate each plan on a target's first training batch against a budget (the rows of ``autotune estimate``).

    ``budget`` is a spec (``"20GiB"``, ``0.8``, ``"auto"``) resolved against ``device``'s memory; every row uses
    ``micro_batch_size`` (None: the plan's own, else the whole batch), and is one rank's of ``world_size`` (see
    :func:`estimate`). Returns one row per plan, in order.

    Raises:
        ValueError: for a bad budget or micro-batch and as :func:`estimate`; ``TargetError`` for a target whose
            data gives no batch.
    """
    resolved = resolve_device(device)
    parsed = Budget.parse(budget)
    if parsed.kind == "bytes":
        budget_bytes = int(parsed.value)  # type: ignore[arg-type]
    else:
        probe = probe_memory(resolved)
        budget_bytes = parsed.resolve(total_bytes=probe.total_bytes, free_bytes=probe.free_bytes)
    batch = first_batch(target)
    rows = []
    for plan in plans:
        traces = _Traces(model=target.model, batch=batch, plan=plan, device=resolved, optimizer=None,
                         world_size=world_size)
        at_micro = traces.at(micro_batch_size or plan.micro_batch_size or traces.size)
        rows.append(TargetEstimate(estimate=at_micro, batch_size=traces.size, budget_bytes=budget_bytes,
                                   max_micro_batch_size=traces.largest_fit(budget_bytes)))
    return rows


def first_batch(target: Target) -> Any:
    """The first batch of the target's train dataloader (after ``datamodule.setup("fit")``); ``TargetError`` if none."""
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


def cuda_overhead_bytes(device: torch.device) -> int:
    """The cuBLAS workspaces a CUDA step holds in the caching allocator (counted by ``max_memory_allocated``).

    Two handles (the forward's thread, autograd's device thread) each get ``CUBLAS_WORKSPACE_CONFIG`` (``:4096:8``
    is 8 x 4096 KiB), else torch's default: 32 MiB on compute capability 9.x, 8.125 MiB before. Not yet calibrated
    on a GPU: ``benchmarks/estimator_accuracy.py --device cuda`` prints what to set.
    """
    pairs = re.findall(r":(\d+):(\d+)", os.environ.get("CUBLAS_WORKSPACE_CONFIG", ""))
    if pairs:
        workspace = sum(int(size) * int(count) for size, count in pairs) * 2**10
    else:
        hopper = torch.cuda.get_device_capability(device)[0] == 9
        workspace = _CUBLAS_WORKSPACE_SM90 if hopper else _CUBLAS_WORKSPACE_DEFAULT
    return _CUBLAS_HANDLES_PER_STEP * workspace


# ---------------------------------------------------------------------------------------------------------- tracing


class _Traces:
    """Estimates of one model, batch and plan at any micro-batch, each traced once."""

    def __init__(self, *, model: LightningModule, batch: Any, plan: Plan, device: DeviceSpec,
                 optimizer: OptimizerFactory | None, world_size: int | None = None) -> None:
        if plan.precision not in _TRACEABLE_PRECISIONS:
            raise ValueError(f"the estimator traces precision {', '.join(_TRACEABLE_PRECISIONS)}; "
                             f"got {plan.precision!r}")
        if not getattr(model, "automatic_optimization", True):
            raise ValueError(f"{type(model).__name__} uses manual optimization, which the estimator cannot trace")
        size = batch_size_of(batch)
        if not size:
            raise ValueError("batch holds no tensor with a batch dimension; the estimator needs a training batch")
        self.model, self.batch, self.plan, self.optimizer, self.size = model, batch, plan, optimizer, size
        self.device = resolve_device(device)
        if plan.optimizer_offload and self.device.type != "cuda":
            raise ValueError("optimizer_offload moves optimizer state from a CUDA GPU to the host; estimate it for a "
                             "CUDA device, or set optimizer_offload=False")
        self.world_size = _world_size(world_size, plan)
        self._done: dict[int, Estimate] = {}

    def at(self, micro: int) -> Estimate:
        if isinstance(micro, bool) or not isinstance(micro, int) or not 1 <= micro <= self.size:
            raise ValueError(f"micro_batch_size must be an int in 1..{self.size} (the batch size); got {micro!r}")
        if micro not in self._done:
            self._done[micro] = _trace(self, micro)
        return self._done[micro]

    def largest_fit(self, budget_bytes: int) -> int | None:
        """The largest m in 1..size whose peak fits, for a peak that grows with m."""
        peak: Callable[[int], int] = lambda m: self.at(m).predicted_peak_bytes  # noqa: E731
        if peak(1) > budget_bytes:
            return None
        lo, hi = 1, self.size  # lo fits, hi does not
        if peak(hi) <= budget_bytes:
            return hi
        bisect = False
        while hi - lo > 1:
            width = hi - lo
            slope = (peak(hi) - peak(lo)) / width
            guess = (lo + hi) // 2 if bisect or slope <= 0 else lo + int((budget_bytes - peak(lo)) / slope)
            guess = min(max(guess, lo + 1), hi - 1)
            lo, hi = (guess, hi) if peak(guess) <= budget_bytes else (lo, guess)
            bisect = not bisect and hi - lo > width // 2
        return lo


def _trace(traces: _Traces, micro: int) -> Estimate:
    plan, device, size = traces.plan, traces.device, traces.size
    precision = precision_plugin(plan.precision, device)
    part = slice_batch(traces.batch, 0, micro, size) if micro < size else traces.batch
    accumulate = micro < size  # a later micro-batch of the step adds to the gradients of the earlier ones
    mode = fake_tensor_mode(allow_non_fake_inputs=True)
    trainer = trainer_reference(traces.model)
    with fake_copy_mode(mode):
        fake = copy.deepcopy(traces.model, {id(trainer): None} if trainer is not None else {})
    with mode, warnings.catch_warnings():  # of a step outside a Trainer: `self.log` without a trainer, hooks
        warnings.filterwarnings("ignore", message=r".*`self\.log\(\)` but the `self\.trainer` reference")
        warnings.filterwarnings("ignore", message=r"Module is None\. Skipping")
        # FSDP2's bf16 policy gathers bf16 parameters, so autocast casts (and caches) no weights: trace in bf16, with
        # the fp32 master shards in closed form (rank_state)
        gathered_bf16 = plan.strategy == "fsdp" and plan.precision == "bf16-mixed"
        convert_model(fake, device, torch.bfloat16 if gathered_bf16 else precision_input_dtype(precision))
        fake.train()
        if plan.activation_checkpointing:
            checkpoint_blocks(select_blocks(fake, plan.activation_checkpointing))
        optimizers = optimizers_of(fake, traces.optimizer, device)
        offloaded = [p for p in fake.parameters() if is_offloaded(p)] if plan.optimizer_offload else []
        host_bytes = offloaded_host_bytes(optimizers) if offloaded else 0
        if offloaded:  # the device runs the update of the small parameters only
            optimizers = like_cuda_run([d for d in map(device_part, optimizers) if d is not None], device)
        inputs, input_tensors = fake_batch(mode, part, device, precision)

        def step(*, zero_grad: bool) -> None:  # forward (last gradients alive), zero_grad, backward, update
            with offload_activations(pin_memory=False) if plan.activation_offload else contextlib.nullcontext():
                with precision.forward_context() if precision is not None else contextlib.nullcontext():
                    loss = loss_of(fake, fake.training_step(inputs, 0))
                if zero_grad:
                    for opt in optimizers:
                        opt.zero_grad(set_to_none=True)
                    for p in offloaded:
                        p.grad = None
                loss.backward()
            del loss
            for opt in optimizers:
                opt.step()

        try:
            step(zero_grad=True)  # the first step makes the gradients and the optimizer state
            tracker = step_tracker()
            tracker.track_external(fake, *optimizers, *input_tensors)
            before = tracker.get_tracker_snapshot()
            with tracker:
                step(zero_grad=not accumulate)
        except (RuntimeError, NotImplementedError, TypeError) as error:
            message = " ".join(str(error).split())[:300]
            raise ValueError(f"cannot trace {type(traces.model).__name__}.training_step under FakeTensorMode "
                             f"({type(error).__name__}: {message}); the estimator cannot trace steps that read "
                             "tensor values (such as .item() or data-dependent shapes)") from error
        state_bytes = bytes_of((t for opt in optimizers for s in opt.state.values() for t in s.values()), device)
        trained = (p for p in fake.parameters() if p.requires_grad)
        replicated = plan.strategy == "ddp" or (plan.strategy == "auto" and traces.world_size > 1)
        grad_bytes = bytes_of(trained, device) if replicated else 0
        # DDP's own buckets (one more gradient) and the runtime's averaging buffers (up to two buckets).
        ddp_bytes = grad_bytes + min(grad_bytes, 2 * GRADIENT_BUCKET_BYTES)
        sharded = None
        if plan.strategy == "fsdp":
            master = torch.float32 if gathered_bf16 else None
            sharded = rank_state(fake, optimizers, world_size=traces.world_size, master_dtype=master,
                                 reshard_after_forward=plan.reshard_after_forward, cpu_offload=plan.cpu_offload)
    estimate = _estimate_from(tracker.get_tracker_snapshot("peak"), before, plan=plan, micro=micro, device=device,
                              state_bytes=state_bytes, extra_overhead=ddp_bytes, extra_host=host_bytes,
                              update_shards=traces.world_size if sharded is not None else 1)
    if sharded is not None:  # one rank's shards and gathered units in place of the whole model's state
        parts = {"parameters_bytes": sharded.parameters, "gradients_bytes": sharded.gradients,
                 "optimizer_state_bytes": sharded.optimizer_state}
        peak = estimate.predicted_peak_bytes + sum(v - getattr(estimate, k) for k, v in parts.items())
        estimate = dataclasses.replace(estimate, **parts, predicted_peak_bytes=peak, gathered_bytes=sharded.gathered,
                                       host_bytes=estimate.host_bytes + sharded.host)
    return dataclasses.replace(estimate, notes=tracker.workspace.notes(), world_size=traces.world_size)


def _world_size(world_size: int | None, plan: Plan) -> int:
    """The ranks to estimate for: ``world_size``, else the plan's devices, else 1; ValueError naming a bad one."""
    if world_size is None:
        world_size = plan.devices or 1
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1; got {world_size!r}")
    if plan.devices is not None and plan.devices != world_size:
        raise ValueError(f"world_size {world_size} differs from the plan's devices {plan.devices}; give one")
    if plan.strategy == "fsdp" and world_size == 1 and not plan.cpu_offload:
        raise ValueError("strategy 'fsdp' over world_size 1 shards nothing; estimate it with world_size >= 2 (or "
                         "cpu_offload=True), or use strategy 'auto'")
    return world_size


def _estimate_from(snapshot: Mapping[torch.device, Any], before: Mapping[torch.device, Any], *, plan: Plan, micro: int,
                   device: torch.device, state_bytes: int, extra_overhead: int, extra_host: int,
                   update_shards: int = 1) -> Estimate:
    Ref = mem_ref_types()

    here: Mapping[Any, int] = next((snap for dev, snap in snapshot.items() if dev.type == device.type), {})
    host = sum(max(0, snap.get("Total", 0) - before.get(dev, {}).get("Total", 0))  # what the step adds there
               for dev, snap in snapshot.items() if dev.type != device.type)
    made_in_update = int(here.get(Ref.OPT, 0))
    state = min(made_in_update, state_bytes)  # the rest of what the update made is its temporaries
    parts = {
        "parameters_bytes": int(here.get(Ref.PARAM, 0) + here.get(Ref.BUFFER, 0)),
        "gradients_bytes": int(here.get(Ref.GRAD, 0)),
        "optimizer_state_bytes": state,
        "activations_bytes": int(here.get(Ref.ACT, 0) + here.get(Ref.OTH, 0)),
        # the update's own temporaries (foreach optimizers: about one per state tensor); sharded, each rank updates
        # its shards only
        "temporaries_bytes": int(here.get(Ref.TEMP, 0)) + (made_in_update - state) // update_shards,
        "overhead_bytes": extra_overhead + (cuda_overhead_bytes(device) if device.type == "cuda" else 0),
    }
    return Estimate(plan=plan.replace(micro_batch_size=micro), micro_batch_size=micro, device=str(device),
                    predicted_peak_bytes=sum(parts.values()), host_bytes=host + extra_host, **parts)


