"""Predict the seconds of one optimizer step of a plan: the step-time model.

It sets the work the estimator's fake step traced (:mod:`autotune._estimate.work`) against a device's speeds
(:mod:`autotune._estimate.devices`).

A step of ``B`` samples at micro-batch ``m`` runs ``ceil(B / m)`` forward and backward passes (the last one of what is
left: its operators in proportion) and one update. Each operator is a roofline: the longer of its FLOPs at the peak of
its dtype and its bytes at the memory bandwidth, each over the bound's efficiency; the operators' times add up by the
bound that set them (``compute`` or ``memory``). On top:

- **host link**: copies between device and host the trace made (activation offload). In closed form, optimizer
  offload's copies (each offloaded gradient down, each parameter up, the update on the host at its memory's
  bandwidth) and FSDP2's ``cpu_offload`` (the shards up for each gather, the gradient shards down, the update on the
  host);
- **interconnect**: DDP's gradient all-reduce once per step, ``2 (N - 1) / N`` of the gradients per rank (the
  runtime averages after the micro-batches: nothing to hide it behind). FSDP2's all-gathers (twice per pass when
  blocks reshard after their forward) and reduce-scatter each pass, ``(N - 1) / N`` of the parameters and gradients,
  hidden behind the pass's work but for one unit's share;
- **launch**: the host's cost per operator. A ``_foreach_`` operator works through its tensors one by one on the CPU,
  about 32 per launch on CUDA. There is also a fixed cost per micro-batch and per step in operators' worth
  (:data:`MICRO_BATCH_LAUNCHES`, :data:`STEP_LAUNCHES`). On CUDA the host runs ahead of the device: the step takes
  the longer of the two; on the CPU they add up.

``compile`` is not traced (the trace is the eager step). Fusing a block's pointwise operators is taken to leave
:data:`COMPILE_BYTES` of their memory traffic and :data:`COMPILE_LAUNCHES` of their launches. A memory budget ``b < 1``
is taken to recompute ``1 - b`` of the forward's pointwise operators. ``float8`` runs matrix products at the FP8 peak
with a cast of their inputs (half their bytes again). Those three are guesses the calibration corrects.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from autotune._estimate.devices import FRESH_PAGES_FROM, DeviceSpeed, mfu_dtype
from autotune._estimate.work import OpWork, StepWork
from autotune._plan.plan import Plan

__all__ = ["BOUNDS", "SpeedPrediction", "StepParts", "predict", "step_parts"]

#: What can bound a step, in the order a tie is reported.
BOUNDS = ("compute", "memory", "host link", "interconnect", "launch")
#: The host's fixed cost of a micro-batch beyond its operators (Lightning's closure and hooks, the runtime's slicing
#: and loss scaling), and of an optimizer step (the loop, ``zero_grad``, fetching the batch), in operators' worth:
#: a one-layer model trained through Lightning with ``ElasticBatchSize`` took 0.68 ms more per micro-batch than its
#: 13 operators (about 120 operators of that CPU's 5.5 us) and 0.58 ms for a whole step at one micro-batch.
MICRO_BATCH_LAUNCHES = 120
STEP_LAUNCHES = 100
#: CUDA's multi-tensor kernels take about this many tensors per launch.
FOREACH_TENSORS_PER_LAUNCH = 32
#: ``compile``: what fusing pointwise operators leaves of their bytes and launches.
COMPILE_BYTES, COMPILE_LAUNCHES = 0.5, 0.2
_PASS_PHASES = ("forward", "backward", "recompute")


@dataclass(frozen=True)
class StepParts:
    """Seconds of one optimizer step by bound at efficiency 1 (the device's figures as they are), what calibration
    fits: ``seconds`` has a key per bound of :data:`BOUNDS`; ``asynchronous``: the host runs ahead of the device."""

    seconds: dict[str, float]
    asynchronous: bool = False

    def total(self, efficiency: Mapping[str, float]) -> float:
        """The step's seconds with ``efficiency`` per bound."""
        return sum(self.effective(efficiency).values()) if not self.asynchronous else max(
            sum(v for b, v in self.effective(efficiency).items() if b != "launch"),
            self.effective(efficiency)["launch"])

    def effective(self, efficiency: Mapping[str, float]) -> dict[str, float]:
        """Each bound's seconds over its efficiency."""
        return {b: self.seconds.get(b, 0.0) / efficiency.get(b, 1.0) for b in BOUNDS}

    def active(self, efficiency: Mapping[str, float]) -> dict[str, float]:
        """The parts that make the step's time (at efficiency 1): all of them on a synchronous device; on CUDA the
        host's launches or the device's work, whichever is longer."""
        if not self.asynchronous:
            return dict(self.seconds)
        eff = self.effective(efficiency)
        host = eff["launch"] > sum(v for b, v in eff.items() if b != "launch")
        return {b: (v if (b == "launch") == host else 0.0) for b, v in self.seconds.items()}

    def bound(self, efficiency: Mapping[str, float]) -> str:
        """The bound that takes the most of the step's time."""
        eff = self.effective(efficiency)
        if self.asynchronous:
            device = {b: v for b, v in eff.items() if b != "launch"}
            if eff["launch"] > sum(device.values()):
                return "launch"
            eff = device
        return max(BOUNDS, key=lambda b: (eff.get(b, 0.0), -BOUNDS.index(b)))


@dataclass(frozen=True, kw_only=True)
class SpeedPrediction:
    """A plan's predicted speed and how far the model has been off on this target so far.

    Attributes:
        plan: The plan (its micro-batch set).
        device: The device's name (:attr:`DeviceSpeed.name`).
        world_size: Ranks the step runs on (each with the batch).
        seconds_per_step: One optimizer step.
        samples_per_second: ``world_size * batch_size / seconds_per_step``.
        mfu: Model FLOPs (forward and backward, no recomputation) per second per rank over the device's dense peak in
            the precision's dtype (:func:`~autotune._estimate.devices.mfu_dtype`); None where the peak is not known.
        bound: ``compute``, ``memory``, ``host link``, ``interconnect`` or ``launch``: what takes most of the step.
        seconds: Each bound's seconds per step (over its efficiency).
        parts: The same at efficiency 1 (what calibration fits).
        model_flops_per_sample: Forward and backward FLOPs per sample.
        calibrated_from: Measured trials the efficiencies were fitted from (0: the device's prior).
        error: The model's relative error on this target so far (the median over measured trials, each predicted
            from the others), None before a trial measured one.
    """

    plan: Plan
    device: str
    world_size: int
    seconds_per_step: float
    samples_per_second: float
    mfu: float | None
    bound: str
    seconds: dict[str, float]
    parts: StepParts = field(repr=False)
    model_flops_per_sample: float
    calibrated_from: int = 0
    error: float | None = None

    def describe(self) -> str:
        """``"812.4 samples/s, MFU 41%, compute-bound"``."""
        mfu = f", MFU {self.mfu:.0%}" if self.mfu is not None else ""
        return f"{self.samples_per_second:.1f} samples/s{mfu}, {self.bound}-bound"

    def as_dict(self) -> dict[str, Any]:
        """For JSON and a tuned file's provenance."""
        return {"samples_per_second": self.samples_per_second, "seconds_per_step": self.seconds_per_step,
                "mfu": self.mfu, "bound": self.bound, "device": self.device, "world_size": self.world_size,
                "calibrated_from": self.calibrated_from, "error": self.error,
                "seconds": {b: v for b, v in self.seconds.items() if v}}


def step_parts(work: StepWork, plan: Plan, *, device: DeviceSpeed, batch_size: int, world_size: int = 1,
               efficiency: Mapping[str, float], fp32_matmul: str = "fp32") -> StepParts:
    """The seconds of one step of ``plan`` by bound at efficiency 1, from ``work`` traced at some micro-batch.

    ``batch_size``: one rank's samples per step; ``efficiency``: what each operator's roofline compares its compute
    and memory times with (its bound), and what hides FSDP2's collectives; ``fp32_matmul``: the rate of fp32 matrix
    products on CUDA (``"tf32"`` where the process allows TF32, torch's ``set_float32_matmul_precision``).
    """
    micro = min(plan.micro_batch_size or batch_size, batch_size)
    passes = math.ceil(batch_size / micro)
    sizes = [micro] * (passes - 1) + [batch_size - micro * (passes - 1)]
    acc = _Accumulator(device, efficiency, fp32_matmul if device.kind == "cuda" else "fp32", plan)
    pass_ops = [op for op in work.ops if op.phase in _PASS_PHASES]
    if plan.compile and plan.compile_memory_budget is not None and plan.compile_memory_budget < 1:
        share = 1 - plan.compile_memory_budget  # the partitioner recomputes cheap pointwise work in the backward
        pass_ops += [OpWork("recompute", 0.0, op.bytes * share, op.dtype) for op in pass_ops
                     if op.phase == "forward" and not op.flops and not op.host_link]
    sharded = plan.strategy == "fsdp" and world_size > 1
    per_pass = []
    for size in dict.fromkeys(sizes):  # passes of one size cost the same: each size's pass is added up once
        one = _Accumulator(device, efficiency, acc.fp32, plan)
        for op in pass_ops:
            one.add(op, size / work.micro_batch_size)
        count = sizes.count(size)
        for bound, seconds in one.parts.items():
            acc.parts[bound] += count * seconds
        per_pass += [one.device_seconds()] * count
    for op in work.phase("update"):
        acc.add(op, 1 / world_size if sharded else 1.0)
    acc.parts["launch"] += (MICRO_BATCH_LAUNCHES * passes + STEP_LAUNCHES) * device.launch_seconds
    _offload(acc.parts, work, plan, device, passes=passes, world_size=world_size)
    _collectives(acc.parts, work, plan, device, per_pass=per_pass, world_size=world_size, efficiency=efficiency)
    return StepParts(acc.parts, asynchronous=device.asynchronous)


def predict(parts: StepParts, *, work: StepWork, plan: Plan, device: DeviceSpeed, batch_size: int,
            world_size: int = 1, efficiency: Mapping[str, float], calibrated_from: int = 0,
            error: float | None = None) -> SpeedPrediction:
    """The prediction of a step whose parts are ``parts``, with ``efficiency`` per bound."""
    seconds = parts.total(efficiency)
    per_sample = work.model_flops_per_sample()
    peak = device.flops.get(mfu_dtype(plan.precision)) or device.flops.get("fp32")
    rate = batch_size / seconds
    micro = min(plan.micro_batch_size or batch_size, batch_size)
    return SpeedPrediction(
        plan=plan.replace(micro_batch_size=micro), device=device.name, world_size=world_size,
        seconds_per_step=seconds, samples_per_second=world_size * rate,
        mfu=per_sample * rate / peak if peak and per_sample else None, bound=parts.bound(efficiency),
        seconds=parts.effective(efficiency), parts=parts, model_flops_per_sample=per_sample,
        calibrated_from=calibrated_from, error=error)


class _Accumulator:
    """Adds operators' rooflines into the parts, by the bound that sets each."""

    def __init__(self, device: DeviceSpeed, efficiency: Mapping[str, float], fp32: str, plan: Plan) -> None:
        self.device, self.efficiency, self.fp32, self.plan = device, efficiency, fp32, plan
        self.parts = dict.fromkeys(BOUNDS, 0.0)
        self.fp8 = plan.float8 and "fp8" in device.flops

    def device_seconds(self) -> float:
        """What the device has been given so far, with the efficiencies (FSDP2 hides its collectives behind it)."""
        return sum(self.parts[b] / self.efficiency.get(b, 1.0) for b in ("compute", "memory", "host link"))

    def add(self, op: OpWork, factor: float) -> None:
        device, flops, moved = self.device, op.flops * factor, op.bytes * factor
        launches = op.calls * (op.tensors if device.kind != "cuda" else
                               math.ceil(op.tensors / FOREACH_TENSORS_PER_LAUNCH))
        if op.host_link:
            self.parts["host link"] += moved / device.host_link_bandwidth
            self.parts["launch"] += launches * device.launch_seconds
            return
        dtype = self.fp32 if op.dtype == "fp32" else op.dtype
        if self.fp8 and flops and op.phase in _PASS_PHASES:
            dtype, moved = "fp8", moved * 1.5  # the inputs cast to FP8 (read, scaled, written) before the product
        if self.plan.compile and not flops and op.phase in _PASS_PHASES:
            moved, launches = moved * COMPILE_BYTES, launches * COMPILE_LAUNCHES
        kernel = ("backward" if op.phase == "backward" else "forward") if op.attention else None
        rate = device.matmul_flops(dtype, attention=kernel)
        key = dtype if kernel == "forward" else f"{dtype} backward"
        fixed = (op.heads * factor * device.attention_seconds.get(key, 0.0) if op.attention
                 else device.matmul_seconds.get(dtype, 0.0) if flops else 0.0)
        compute = flops / rate + fixed
        if op.elements and device.pointwise_seconds:  # pointwise math: a CPU's per value cost
            per_value = device.pointwise_seconds.get(f"{op.kernel}|{dtype}") if op.kernel else None
            compute = op.elements * factor * (per_value or device.pointwise_seconds.get(f"add|{dtype}", 0.0))
        memory = moved / device.bandwidth(moved)
        written = op.written * factor
        if device.fresh_page_bandwidth and written >= FRESH_PAGES_FROM:  # faulted in, each time it is made
            memory += written / device.fresh_page_bandwidth
        if compute > 0 and compute / self.efficiency.get("compute", 1.0) >= memory / self.efficiency.get("memory", 1.0):
            self.parts["compute"] += compute
        else:
            self.parts["memory"] += memory
        self.parts["launch"] += launches * device.launch_seconds


def _offload(parts: dict[str, float], work: StepWork, plan: Plan, device: DeviceSpeed, *, passes: int,
             world_size: int) -> None:
    """Optimizer offload's and FSDP2 ``cpu_offload``'s host-link traffic and host-side update (activation offload's
    copies are in the trace)."""
    if plan.optimizer_offload and work.offloaded_bytes:
        parts["host link"] += 2 * work.offloaded_bytes / device.host_link_bandwidth  # gradients down, parameters up
        parts["host link"] += work.host_update_bytes / device.host_memory_bandwidth
    if plan.strategy == "fsdp" and plan.cpu_offload:
        master = work.parameter_bytes * (2 if plan.precision == "bf16-mixed" else 1) / world_size
        gathers = 2 if plan.reshard_after_forward else 1
        parts["host link"] += passes * (gathers * master + master) / device.host_link_bandwidth
        # the host's update: Adam reads and writes the shard, its gradient and two moments
        parts["host link"] += 8 * master / device.host_memory_bandwidth


def _collectives(parts: dict[str, float], work: StepWork, plan: Plan, device: DeviceSpeed, *, per_pass: list[float],
                 world_size: int, efficiency: Mapping[str, float]) -> None:
    """DDP's all-reduce once per step; FSDP2's gathers and reduce-scatters each pass, hidden behind the pass's work
    but for one unit's share (at the prior efficiencies)."""
    if world_size <= 1:
        return
    share = (world_size - 1) / world_size
    bandwidth = device.interconnect_bandwidth
    if plan.strategy != "fsdp":
        parts["interconnect"] += 2 * share * work.gradient_bytes / bandwidth
        parts["memory"] += 4 * work.gradient_bytes / device.memory_bandwidth  # into the flat buckets and back
        return
    gathers = 2 if plan.reshard_after_forward else 1
    reduce_bytes = work.gradient_bytes * (2 if plan.precision == "bf16-mixed" else 1)  # reduced in fp32
    comm = share * (gathers * work.parameter_bytes + reduce_bytes) / bandwidth
    for busy in per_pass:
        exposed = max(comm / work.units, comm / efficiency.get("interconnect", 1.0) - busy)
        parts["interconnect"] += exposed * efficiency.get("interconnect", 1.0)
