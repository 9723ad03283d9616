"""How many devices of one size a model needs, and with which plan: ``autotune estimate --max-world-size N``
(:func:`estimate_capacity`).

For each world size 1, 2, 4, ... up to ``max_world_size`` (and ``max_world_size`` itself), every plan of the given
precisions with no and full activation checkpointing is estimated per rank, replicated (DDP) and sharded (FSDP2,
from 2 ranks), and the largest micro-batch of the target's batch that fits is found. A world size's answer is the
plan that fits and costs least compute, in this order: no recomputation before checkpointing, replicated before
sharded (less communication), the precisions in the order given, then the larger micro-batch. The search stops at
the first world size where a plan fits: the smallest number of devices. Each micro-batch of each plan is traced
once; another world size changes only the closed-form parts (shards, DDP buffers), so the whole answer costs about
what four plans' estimates do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from autotune._device.budget import check_bytes, resolve_budget
from autotune._device.probe import DeviceSpec
from autotune._estimate.result import Estimate, estimate_device
from autotune._estimate.trace import Traces
from autotune._plan.plan import Plan

__all__ = ["CapacityRow", "estimate_capacity", "world_sizes"]

#: Precisions tried when none are given: what a GPU run uses first.
DEFAULT_PRECISIONS = ("bf16-mixed", "32-true")


@dataclass(frozen=True, kw_only=True)
class CapacityRow:
    """One world size of the capacity answer.

    Attributes:
        world_size: The number of devices.
        fits: Whether some plan fits one rank's budget at a micro-batch of 1 or more.
        estimate: The chosen plan's per-rank estimate at its largest micro-batch that fits; where nothing fits, the
            plan with the lowest peak at a micro-batch of 1 (how far off it is).
        max_micro_batch_size: The chosen plan's largest micro-batch that fits (None where nothing fits).
        plans_tried: Plans estimated at this world size.
    """

    world_size: int
    fits: bool
    estimate: Estimate
    max_micro_batch_size: int | None
    plans_tried: int

    def as_dict(self) -> dict[str, Any]:
        """The row for JSON: the world size, the fit, the plan's fields and its per-rank estimate."""
        plan = {k: v for k, v in self.estimate.plan.to_dict().items() if k != "format_version"}
        return {"world_size": self.world_size, "fits": self.fits, "max_micro_batch_size": self.max_micro_batch_size,
                "plans_tried": self.plans_tried, **plan,
                "predicted_peak_bytes": self.estimate.predicted_peak_bytes,
                **{f"{name}_bytes": value for name, value in self.estimate.breakdown().items()},
                "gathered_bytes": self.estimate.gathered_bytes, "context_bytes": self.estimate.context_bytes,
                "host_bytes": self.estimate.host_bytes, "method": self.estimate.method}


def world_sizes(max_world_size: int) -> list[int]:
    """1, 2, 4, ... below ``max_world_size``, then ``max_world_size``; ValueError for a bad one."""
    if isinstance(max_world_size, bool) or not isinstance(max_world_size, int) or max_world_size < 1:
        raise ValueError(f"max_world_size must be an int >= 1; got {max_world_size!r}")
    sizes, n = [], 1
    while n < max_world_size:
        sizes.append(n)
        n *= 2
    return [*sizes, max_world_size]


def estimate_capacity(*, model: Any, batch: Any, device: DeviceSpec, device_memory_bytes: int, max_world_size: int,
                      precisions: Sequence[str] | None = None, budget_bytes: int | None = None,
                      trace: str = "auto") -> list[CapacityRow]:
    """The rows of the capacity answer, one per world size up to the first where a plan fits (the last row).

    Args:
        model: The LightningModule (on any device, the meta device included: nothing is materialised).
        batch: One rank's training batch (micro-batches are cut from it).
        device: The device kind estimated for (``"cuda"``: what-if without CUDA).
        device_memory_bytes: Each device's memory.
        budget_bytes: What one rank's step may hold at its peak (None: the device's memory less the CUDA context).
        max_world_size: The most devices to consider.
        precisions: Precisions to try, in order of preference (default bf16-mixed, then 32-true).
        trace: How each step is traced, as for :func:`autotune._estimate.estimate.estimate` (``"auto"``, ``"fake"``,
            ``"real"``).

    Raises:
        ValueError: for a bad world size or budget, and as :func:`autotune._estimate.estimate.estimate`.

    Example:
        >>> rows = estimate_capacity(model=model, batch=batch, device="cuda",  # doctest: +SKIP
        ...                          device_memory_bytes=80 * 2**30, max_world_size=64)
        >>> rows[-1].fits, rows[-1].world_size, rows[-1].estimate.plan.describe()  # doctest: +SKIP
        (True, 2, 'fsdp x2, bf16-mixed, micro 4')
    """
    for name, value in (("device_memory_bytes", device_memory_bytes), ("budget_bytes", budget_bytes)):
        if value is not None:
            check_bytes(name, value)
    resolved, what_if = estimate_device(device)
    usable_bytes = budget_bytes if budget_bytes is not None else resolve_budget(
        None, resolved, what_if=what_if, device_memory=device_memory_bytes).budget_bytes
    order = list(precisions or DEFAULT_PRECISIONS)
    sizes = world_sizes(max_world_size)
    shapes = [(p, c, sharded) for p in order for c in (0.0, 1.0) for sharded in (False, True)]
    traces = {shape: Traces(model=model, batch=batch, optimizer=None, device=resolved,
                            plan=Plan(precision=shape[0], activation_checkpointing=shape[1],
                                      strategy="fsdp" if shape[2] else "auto"),
                            world_size=2 if shape[2] else 1, trace=trace)
              for shape in shapes}
    rows = []
    for world in sizes:
        fitting: list[tuple[tuple[Any, ...], Estimate, int]] = []
        closest: Estimate | None = None
        tried = 0
        for (precision, ckpt, sharded), trace in traces.items():
            if sharded and world == 1:
                continue
            tried += 1
            best = trace.largest_fit(usable_bytes, world)
            if best is None:
                one = trace.at(1, world)
                if closest is None or one.predicted_peak_bytes < closest.predicted_peak_bytes:
                    closest = one
                continue
            key = (ckpt > 0, sharded, order.index(precision), -best)
            fitting.append((key, trace.at(best, world), best))
        if fitting:
            _, chosen, best = min(fitting, key=lambda item: item[0])
            rows.append(CapacityRow(world_size=world, fits=True, estimate=_as_run(chosen, world),
                                    max_micro_batch_size=best, plans_tried=tried))
            break
        assert closest is not None  # every world size tries at least one plan
        rows.append(CapacityRow(world_size=world, fits=False, estimate=_as_run(closest, world),
                                max_micro_batch_size=None, plans_tried=tried))
    return rows


def _as_run(estimate: Estimate, world: int) -> Estimate:
    """The estimate with the plan a run over ``world`` devices uses (its strategy and devices spelled out)."""
    plan = estimate.plan
    if world > 1:
        plan = plan.replace(strategy=plan.strategy if plan.strategy == "fsdp" else "ddp", devices=world)
    return dataclasses.replace(estimate, plan=plan)
