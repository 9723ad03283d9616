"""What the estimator answers: :class:`Estimate` (one micro-batch's predicted peak and its parts), a traced
micro-batch's phases and their estimate per rank (:class:`Traced`), the device an estimate is for
(:func:`estimate_device`), and the largest micro-batch under a budget (:func:`largest_fitting`).
How a step is traced: :mod:`autotune._estimate.trace`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autotune._device.probe import DeviceSpec, resolve_device
from autotune._estimate.sharding import rank_state
from autotune._plan.plan import Plan
from autotune._runtime.gradients import GRADIENT_BUCKET_BYTES

__all__ = ["CATEGORIES", "Estimate", "Phase", "Traced", "estimate_device", "largest_fitting"]

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "overhead")


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
        model_state_bytes: The rank's model state through the step (weights, all gradients, optimizer state; not the
            gathered units), whatever of it is alive at the peak.
        context_bytes: On CUDA, device memory the process holds outside the caching allocator (the CUDA context,
            :data:`autotune._estimate.cuda_rules.CUDA_CONTEXT_BYTES`): not in the peak, which is what
            ``max_memory_allocated`` reports, but not free for it either; 0 on the CPU.
        notes: What the estimate measured on this machine or left out (kernel work buffers), and the plan's settings
            that apply to nothing for this model, one sentence each; for a ``method`` other than ``"fake"``, the first
            says why the step was traced with real tensors, at which micro-batches, and (extrapolated) which limit
            of the real path the asked one passed.
        method: How the step was traced: ``"fake"`` (tensors without data, at this micro-batch), ``"real"`` (real
            tensors on the host, at this micro-batch: the trace without data failed, or ``trace="real"``) or
            ``"extrapolated"`` (real tensors at two smaller micro-batches, each moment of the step taken along its
            line to this one).

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
    context_bytes: int = 0
    model_state_bytes: int = 0
    method: str = "fake"

    def fits(self, budget_bytes: int) -> bool:
        """Whether the predicted peak is at most ``budget_bytes``."""
        return self.predicted_peak_bytes <= budget_bytes

    def breakdown(self) -> dict[str, int]:
        """The six categories (``"parameters"`` ... ``"overhead"``) in bytes; they add up to the peak."""
        return {name: getattr(self, f"{name}_bytes") for name in CATEGORIES}


def estimate_device(device: DeviceSpec) -> tuple[torch.device, bool]:
    """The device to estimate for, and whether it is what-if (a CUDA device on a machine without CUDA); ValueError
    for a spec that is not a device (see :func:`autotune._device.probe.resolve_device`)."""
    if not torch.cuda.is_available() and not isinstance(device, bool):
        if isinstance(device, int) and device >= 0:
            return torch.device("cuda", device), True
        if isinstance(device, (str, torch.device)):
            try:
                parsed = torch.device(device)
            except RuntimeError:
                parsed = None
            if parsed is not None and parsed.type == "cuda":
                return torch.device("cuda", parsed.index or 0), True
    return resolve_device(device), False


def largest_fitting(sizes: Sequence[int], peak: Callable[[int], int], budget_bytes: int) -> int | None:
    """The largest of ``sizes`` (ascending) whose ``peak`` fits ``budget_bytes``, or None, for a peak that grows with
    the size; each size's peak is asked for once at most. The largest size first, then the smallest; then a guess on
    the line through the two nearest sizes asked and its neighbour (where the peak is a line, these two settle it),
    alternating with halving where they did not halve the interval."""
    known: dict[int, int] = {}

    def at(i: int) -> int:
        if i not in known:
            known[i] = peak(sizes[i])
        return known[i]

    lo, hi = 0, len(sizes) - 1  # indices: lo fits, hi does not
    if at(hi) <= budget_bytes:
        return sizes[hi]
    if at(lo) > budget_bytes:
        return None
    bisect = False
    while hi - lo > 1:
        width = hi - lo
        slope = (at(hi) - at(lo)) / (sizes[hi] - sizes[lo])
        if bisect or slope <= 0:
            guess = (lo + hi) // 2
        else:  # the largest size at or below the line's crossing of the budget
            crossing = sizes[lo] + (budget_bytes - at(lo)) / slope
            guess = max((i for i in range(lo + 1, hi) if sizes[i] <= crossing), default=lo + 1)
        lo, hi, beside = (guess, hi, guess + 1) if at(guess) <= budget_bytes else (lo, guess, guess - 1)
        if not bisect and lo < beside < hi:
            lo, hi = (beside, hi) if at(beside) <= budget_bytes else (lo, beside)
        bisect = not bisect and hi - lo > width // 2
    return sizes[lo]


@dataclass(frozen=True)
class Phase:
    """The peak of one phase of the traced step: the forward (the last gradients alive), or the backward and
    update (after ``zero_grad``)."""

    estimate: Estimate  # one rank alone: the whole model state, no DDP buffers
    update_temporaries: int  # of temporaries: the update's, made per state tensor (sharded with it)
    backward: bool
    timeline: tuple[int, ...] = ()  # real tensors: the device's bytes alive after each op (no overhead)
    ops: tuple[Any, ...] = ()  # and those ops


@dataclass(frozen=True)
class Traced:
    """One traced micro-batch: the peak of each phase on one rank, and what the ranks change (``over``)."""

    phases: tuple[Phase, ...]
    gradient_bytes: int  # of the trained parameters (DDP's buckets)
    model: Any  # the fake model and optimizers, for the shards' closed form
    optimizers: list[Any]
    master_dtype: torch.dtype | None
    flops: int = 0  # real tensors: the step's work (FLOPs of the ops torch counts, bytes allocated)
    allocated_bytes: int = 0
    work: Any = None  # the step's FLOPs and bytes, op by op (autotune._estimate.work.StepWork)

    def over(self, world_size: int, plan: Plan) -> Estimate:
        """Return the estimate of one of ``world_size`` ranks.

        Under DDP the state is replicated, with DDP's buckets and the runtime's averaging buffers (up to two buckets).
        Under FSDP2 it is the rank's shards and gathered units (:mod:`autotune._estimate.sharding`). The peak is the
        higher of the two phases' peaks, since sharding moves state between them: the last step's gradient shards in
        the forward, one unit's unsharded gradient in the backward."""
        sharded, shards = None, 0
        if plan.strategy == "fsdp":
            sharded = rank_state(self.model, self.optimizers, world_size=world_size, master_dtype=self.master_dtype,
                                 reshard_after_forward=plan.reshard_after_forward, cpu_offload=plan.cpu_offload)
            # all the shards, whatever of them a phase's peak holds
            shards = sharded.parameters + sharded.gradients + sharded.optimizer_state - sharded.gathered + sharded.host
        estimates = []
        for phase in self.phases:
            e = phase.estimate
            if sharded is None:
                replicated = plan.strategy == "ddp" or world_size > 1
                extra = self.gradient_bytes + min(self.gradient_bytes, 2 * GRADIENT_BUCKET_BYTES) if replicated else 0
                state_bytes = e.parameters_bytes + self.gradient_bytes + e.optimizer_state_bytes
                estimates.append(dataclasses.replace(e, overhead_bytes=e.overhead_bytes + extra,
                                                     model_state_bytes=state_bytes,
                                                     predicted_peak_bytes=e.predicted_peak_bytes + extra,
                                                     world_size=world_size))
                continue
            state = sharded.at_peak(traced_gradients=e.gradients_bytes, whole_gradients=self.gradient_bytes,
                                    backward=phase.backward)
            parts = {"parameters_bytes": state.parameters, "gradients_bytes": state.gradients,
                     "optimizer_state_bytes": state.optimizer_state,  # each rank updates its shards only
                     "temporaries_bytes": e.temporaries_bytes - phase.update_temporaries
                     + phase.update_temporaries // world_size}
            peak = e.predicted_peak_bytes + sum(v - getattr(e, k) for k, v in parts.items())
            estimates.append(dataclasses.replace(e, **parts, predicted_peak_bytes=peak, gathered_bytes=state.gathered,
                                                 host_bytes=e.host_bytes + state.host, world_size=world_size,
                                                 model_state_bytes=shards))
        top = max(estimates, key=lambda e: e.predicted_peak_bytes)
        return dataclasses.replace(top, host_bytes=max(e.host_bytes for e in estimates))
