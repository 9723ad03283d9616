"""Trace one training step of a plan for the estimator (:mod:`autotune._estimate.estimate` is the public side).

The model is copied under ``FakeTensorMode`` (tensors without data). A step that reads tensor values is traced on a
copy with real tensors on the host instead, at small micro-batches and along their line beyond (see
:meth:`Traces._traced`). The plan is applied as a run applies it (:mod:`autotune._transforms.blocks`, Lightning's
precision plugins). One step runs under torch's ``MemTracker``, which files every storage under parameters,
gradients, optimizer state, activations or temporaries while it lives.

The step is Lightning's (forward with the last gradients alive, ``zero_grad``, backward, update). It runs after a
warm-up step that makes the optimizer state, once per plan: every micro-batch traced starts from the state the step
before left, which is the same at any micro-batch. When the plan cuts the batch, the traced micro-batch adds to the
gradients (as the later ones of ``ElasticBatchSize`` do). The peak is the most bytes alive at once plus
``overhead_bytes``. The categories are those at that moment (the forward's and the backward's peaks are kept apart
for the sharded closed form).

Kernels add the work buffers they hold inside one call (:mod:`autotune._estimate.workspace`). These are derived for
CPU convolutions in fp32, and measured once per machine for CPU matrix products and convolutions in bf16/fp16
(oneDNN's buffers depend on the processor; ``Estimate.notes`` says so). On CUDA the rules of
:mod:`autotune._estimate.cuda_rules` apply: each allocation rounded up to 512 B, the cuBLAS workspaces in the
overhead, the CUDA context beside the peak (``context_bytes``). A CUDA device this machine does not have
(``device="cuda"`` without CUDA) is estimated *what-if*: traced on the CPU with those rules and CUDA's autocast op
lists. The overhead also holds DDP's gradient buckets and the runtime's averaging buffers under ``strategy="ddp"``.
Offloaded activations leave a CUDA device (``host_bytes``); on the CPU ``save_on_cpu`` keeps a tensor where it is, so
offload saves nothing there. Under ``optimizer_offload`` the update of the parameters torchao offloads runs on the
host: the device keeps their gradients, the host their pinned copies, gradients and optimizer state
(``host_bytes``). Low-bit optimizer state is torchao's stored layout
(:class:`autotune._estimate.fake_step.LowBitStandIn`). ``compile`` and ``float8`` are not traced: the estimate is the
eager step, and says so.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import psutil
import torch

from autotune._compat.torch import mem_ref_types
from autotune._device.budget import format_bytes
from autotune._device.probe import DeviceSpec
from autotune._estimate import real_path
from autotune._estimate.cuda_rules import CUDA_CONTEXT_BYTES, cublas_workspace_bytes
from autotune._estimate.fake_model import FakeStep
from autotune._estimate.fake_step import OptimizerFactory, StepError, bytes_of, fake_batch, quiet_torch_logs, step_tracker
from autotune._estimate.real_path import REAL_NOTE, extrapolated
from autotune._estimate.result import Estimate, Phase, Traced, estimate_device, largest_fitting
from autotune._plan.plan import Plan
from autotune._runtime.batch import batch_size_of, slice_batch
from autotune._estimate.work import WorkCounter

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule


__all__ = ["TRACES", "Traces"]

log = logging.getLogger(__name__)

#: How a step may be traced (``estimate(trace=...)``): without data, falling back to real tensors on the host where
#: that fails; without data only; with real tensors at the micro-batch asked; with real tensors at micro-batches up to
#: 4 and from 2 and 4 beyond (a check of the extrapolation).
TRACES = ("auto", "fake", "real", "line")
_TRACEABLE_PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")



# ---------------------------------------------------------------------------------------------------------- tracing


class Traces:
    """Estimates of one model, batch and plan at any micro-batch and world size, each micro-batch traced once (the
    world size changes the closed-form parts only)."""

    def __init__(self, *, model: LightningModule, batch: Any, plan: Plan, device: DeviceSpec,
                 optimizer: OptimizerFactory | None, world_size: int | None = None, trace: str = "auto") -> None:
        if trace not in TRACES:
            raise ValueError(f"trace must be one of {', '.join(map(repr, TRACES))}; got {trace!r}")
        if plan.precision not in _TRACEABLE_PRECISIONS:
            raise ValueError(f"the estimator traces precision {', '.join(_TRACEABLE_PRECISIONS)}; "
                             f"got {plan.precision!r}")
        if not getattr(model, "automatic_optimization", True):
            raise ValueError(f"{type(model).__name__} uses manual optimization, which the estimator cannot trace")
        size = batch_size_of(batch)
        if not size:
            raise ValueError("batch holds no tensor with a batch dimension nor a list of numbers or strings; the "
                             "estimator needs a training batch")
        self.model, self.batch, self.plan, self.optimizer, self.size = model, batch, plan, optimizer, size
        self.device, self.what_if = estimate_device(device)
        self.trace_device = torch.device("cpu") if self.what_if else self.device  # where the fake step runs
        if plan.optimizer_offload and (self.device.type != "cuda" or self.what_if):
            raise ValueError("optimizer_offload moves optimizer state from a CUDA GPU to the host; estimate it for a "
                             "CUDA device on a machine that has one, or set optimizer_offload=False")
        self.world_size = _world_size(world_size, plan)
        self._done: dict[int, Traced] = {}
        self._fake: FakeStep | None = None
        self._real_done: dict[tuple[int, bool], Traced] = {}  # real traces by (micro-batch, accumulating)
        self.how = trace  # "auto", "fake", "real" (at the micro-batch asked), "line" (beyond 4 from 2 and 4)
        self.real = trace in ("real", "line")  # traced with real tensors on the host (asked, or the fake trace failed)
        self.why_real = f"asked for (trace={trace!r})"  # the real path's reason, its notes' first words
        self.fake_failure: str | None = None  # why the trace without data failed, where it did
        self.inert: dict[str, str] = {}  # the plan's settings that applied to nothing in the steps traced, and why
        if self.real:
            self._check_real_path(f"trace={trace!r} runs the step with real tensors")

    def fake_step(self) -> FakeStep:
        """The fake model and step every micro-batch of this plan is traced with (made at the first); real tensors
        on the host once the trace without data failed (or when asked)."""
        if self._fake is None:
            self._fake = FakeStep(self, real=self.real)
        return self._fake

    def forget_fake_step(self) -> None:
        """Drop the fake model (after a failed trace), so that the next micro-batch makes a fresh one."""
        self._fake = None

    def at(self, micro: int, world_size: int | None = None) -> Estimate:
        """The estimate at ``micro`` samples per rank over ``world_size`` ranks (None: the one given at creation)."""
        if isinstance(micro, bool) or not isinstance(micro, int) or not 1 <= micro <= self.size:
            raise ValueError(f"micro_batch_size must be an int in 1..{self.size} (the batch size); got {micro!r}")
        world = self.world_size if world_size is None else _world_size(world_size, self.plan)
        if micro not in self._done:
            self._done[micro] = self._traced(micro)
        return self._done[micro].over(world, self.plan)

    def _traced(self, micro: int) -> Traced:
        """``micro`` traced with fake tensors; where that fails for any reason (a step that reads tensor values, an
        op without a fake rule), with real ones on the host: directly up to ``REAL_DIRECT`` and where its work is
        within the real path's limits, else from two smaller micro-batches (:mod:`autotune._estimate.real_path`)."""
        if not self.real:
            try:
                return _trace(self, micro)
            except _FakeFailed as failure:
                if self.how == "fake":
                    raise ValueError(str(failure)) from failure.__cause__
                self._go_real(failure)
                try:
                    return self._traced_real(micro)
                except ValueError:  # real tensors fail too: the next micro-batch tries without data again
                    self.real, self.fake_failure = False, None
                    raise
        return self._traced_real(micro)

    def _traced_real(self, micro: int) -> Traced:
        """``micro`` with real tensors: directly up to ``REAL_DIRECT``, where its work is within the real path's
        limits and when asked (``trace="real"``), else from two smaller micro-batches."""
        if micro <= real_path.REAL_DIRECT or self.how == "real":
            return self._real(micro)
        # the small micro-batches traced as the asked one runs: adding to the last gradients (a later micro-batch of
        # a cut batch) or not (the whole batch at once: zero_grad before backward)
        accumulate = micro < self.size
        if self.how == "line":
            b, why = real_path.REAL_DIRECT, "trace='line'"
        else:
            b, why = real_path.choose(micro=micro, one=self._real(1, accumulate), two=self._real(2, accumulate),
                                      host_total_bytes=psutil.virtual_memory().total)
            if b is None:
                return self._real(micro)
        return extrapolated(self._real(b // 2, accumulate), self._real(b, accumulate), b // 2, b, micro,
                            check=(3 * b // 4, self._real(3 * b // 4, accumulate)), accumulate=accumulate, why=why)

    def _real(self, micro: int, accumulate: bool | None = None) -> Traced:
        """``micro`` traced with real tensors (``accumulate``: as a later micro-batch of a cut batch; None: as
        ``micro`` runs), kept."""
        key = (micro, micro < self.size if accumulate is None else accumulate)
        if key not in self._real_done:
            self._real_done[key] = _trace(self, micro, accumulate=key[1])
        return self._real_done[key]

    def _go_real(self, failure: _FakeFailed) -> None:
        """Trace with real tensors from now on, or one line saying why that cannot be done (weights on the meta
        device, a model too large for the host)."""
        name = type(self.model).__name__
        why = ("its training_step reads tensor values" if failure.reads
               else "its step cannot be traced without data") + f" ({failure.detail})"
        self._check_real_path(why + (", which a trace without data cannot follow" if failure.reads else ""))
        log.info("autotune: %s: %s; estimating with real tensors on the host", name, why)
        self.real = True
        self.why_real = ("the step reads tensor values" if failure.reads
                         else f"the trace without data failed ({failure.detail})")
        self.fake_failure = failure.detail
        self.forget_fake_step()

    def _check_real_path(self, why: str) -> None:
        """One line (ValueError) when the real-tensor path cannot trace this model: its weights are on the meta device
        (none to trace with), or its model state would take more than ``REAL_HOST_SHARE`` of the host's memory."""
        tensors = {id(t): t for t in (*self.model.parameters(), *self.model.buffers())}.values()
        name = type(self.model).__name__
        if any(t.is_meta for t in tensors):
            raise ValueError(
                f"cannot estimate {name}: {why}, and its weights are on the meta device, so "
                "there are none to trace with; estimate the same architecture with real weights at a size the host "
                "holds (fewer layers or a narrower width) and scale the per-layer bytes") from None
        state = sum(t.numel() * t.element_size() * (4 if t.requires_grad else 1)  # gradients and two moments
                    for t in tensors)
        total = psutil.virtual_memory().total
        if state > real_path.REAL_HOST_SHARE * total:
            raise ValueError(
                f"cannot estimate {name}: {why}, and a copy with real tensors would hold about "
                f"{format_bytes(state)} of model state on this host (weights, gradients and optimizer state), more "
                f"than {real_path.REAL_HOST_SHARE:.0%} of its {format_bytes(total)}; estimate the same architecture "
                "at a size the host holds (fewer layers or a narrower width) and scale the per-layer bytes") from None

    def work(self, micro: int) -> Any:
        """The step's work at ``micro`` (FLOPs and bytes op by op, :class:`~autotune._estimate.work.StepWork`; on the
        real-tensor path's line, the larger micro-batch traced's), traced if it was not."""
        self.at(micro)
        return self._done[micro].work

    def traced(self, micro: int) -> bool:
        """Whether ``micro`` has been traced (its estimate at any world size costs nothing)."""
        return micro in self._done

    def traced_micro_batches(self) -> list[int]:
        """The micro-batches traced so far."""
        return list(self._done)

    def largest_fit(self, budget_bytes: int, world_size: int | None = None) -> int | None:
        """The largest micro-batch (1..size) whose peak fits, for a peak growing with it (:func:`largest_fitting`)."""
        return largest_fitting(range(1, self.size + 1),
                               lambda m: self.at(m, world_size).predicted_peak_bytes, budget_bytes)


class _FakeFailed(ValueError):
    """The trace without data failed (``reads``: at a read of a tensor's value, ``.item()``, a mask checked with
    ``.all()``, data-dependent routing; else any other error: an op without a fake rule): the real-tensor path can
    answer."""

    def __init__(self, message: str, detail: str, reads: bool) -> None:
        super().__init__(message)
        self.detail, self.reads = detail, reads


#: What torch's fake tensors raise at a value read (``.item()``) or an output whose shape depends on values
#: (``nonzero``, boolean masks).
_READS_VALUES = ("DataDependent", "DynamicOutputShape")
_READ_CALLS = ("_local_scalar_dense", "numpy() is not supported")


def _trace(traces: Traces, micro: int, *, accumulate: bool | None = None) -> Traced:
    """One step at ``micro`` samples; ``accumulate``: adding to the gradients of an earlier micro-batch (None: when
    ``micro`` cuts the batch)."""
    fake = traces.fake_step()
    plan, device, size, what_if = traces.plan, fake.device, traces.size, fake.what_if
    part = slice_batch(traces.batch, 0, micro, size) if micro < size else traces.batch
    if accumulate is None:  # a later micro-batch of the step adds to the gradients of the earlier ones
        accumulate = micro < size
    with fake.entered(), quiet_torch_logs():
        inputs, input_tensors = fake_batch(None if fake.real else fake.mode, part, device, fake.precision)
        try:
            if not fake.warm:
                fake.step(inputs, zero_grad=True, warm_up=True)  # makes the gradients and the optimizer state
                fake.warm = True
            if fake.real:  # the last step's gradients, of every parameter (see fill_grads)
                fake.fill_grads()
            counter = WorkCounter(device.type)  # the step-time model's work, op by op
            tracker = step_tracker(cuda_rules=what_if, work_on=device.type if fake.real else None, counter=counter)
            tracker.track_external(fake.model, *fake.optimizers, *input_tensors)
            before = tracker.get_tracker_snapshot()
            snapshots = []  # each phase's peak: the forward (and zero_grad), then the backward and update

            def backward_starts() -> None:
                snapshots.append(tracker.next_phase())
                counter.phase = "backward"

            with tracker:  # a small micro-batch standing in for a whole batch updates every parameter, as a large
                # batch does (routing that leaves experts without tokens in 2 samples leaves none in 32)
                fake.step(inputs, zero_grad=not accumulate, fill=not accumulate and micro < size,
                          before_backward=backward_starts, before_update=lambda: setattr(counter, "phase", "update"))
            snapshots.append(tracker.get_tracker_snapshot("peak"))
        except BaseException as error:
            traces.forget_fake_step()  # half a step may have run: the next micro-batch starts from a fresh copy
            if not isinstance(error, Exception) or isinstance(error, StepError):
                raise
            message = " ".join(str(error).split())[:300]
            detail = f"{type(error).__name__}: {message}"
            name, where = type(traces.model).__name__, "under FakeTensorMode"
            if fake.real:
                failed = f"under FakeTensorMode ({traces.fake_failure}) nor " if traces.fake_failure else ""
                where = f"{failed}with real tensors on the host"
            text = f"cannot trace {name}.training_step with plan [{plan.describe()}] {where} ({detail})"
            if not fake.real:
                reads = any(k in type(error).__name__ for k in _READS_VALUES) or any(k in message for k in _READ_CALLS)
                raise _FakeFailed(text, detail, reads) from error
            raise ValueError(text) from error
        optimizers = fake.optimizers
        state_bytes = bytes_of((t for opt in optimizers for s in opt.state.values() for t in s.values()), device,
                               cuda_rules=what_if)
        grad_bytes = bytes_of((p for p in fake.model.parameters() if p.requires_grad), device, cuda_rules=what_if)
    real = (f"{traces.why_real}: {REAL_NOTE} {micro}",) if fake.real else ()
    traces.inert = fake.watch.inert()
    notes = (real + tracker.workspace.notes() + ((_WHAT_IF_NOTE,) if traces.what_if else ()) + _untraced(plan)
             + fake.watch.notes())
    phases = []
    for backward, snapshot in enumerate(snapshots):
        estimate, update_temporaries = _estimate_from(
            snapshot, before, plan=plan, micro=micro, device=device, target=traces.device, what_if=traces.what_if,
            state_bytes=state_bytes, extra_host=fake.host_bytes)
        estimate = dataclasses.replace(estimate, notes=notes, method="real" if fake.real else "fake")
        timeline, ops = (tuple(tracker.timelines[backward]), tuple(tracker.timeline_ops[backward])) if fake.real \
            else ((), ())
        phases.append(Phase(estimate, update_temporaries, bool(backward), timeline, ops))
    work = counter.work(micro_batch_size=micro, model=fake.model, optimizers=optimizers, offloaded=fake.offloaded,
                        host_state_bytes=fake.host_bytes)
    return Traced(tuple(phases), grad_bytes, fake.model, optimizers, torch.float32 if fake.gathered_bf16 else None,
                  flops=tracker.flop_count[0], allocated_bytes=tracker.allocated_bytes, work=work)


_WHAT_IF_NOTE = ("no CUDA on this machine: estimated what-if, traced on the CPU with CUDA's allocator rounding, "
                 "autocast op lists and cuBLAS workspaces (compute capability 9.x); CUDA kernels' own scratch and "
                 "the allocator's fragmentation are not counted")


def _untraced(plan: Plan) -> tuple[str, ...]:
    notes = []
    if plan.compile:
        budget = plan.compile_memory_budget
        notes.append("compile is not traced: this is the eager step" + (
            f"; with compile_memory_budget {budget:g} the compiler recomputes activations to keep a share of them, so "
            "the eager activations are an upper bound" if budget is not None and budget < 1 else ""))
    if plan.float8:
        notes.append("float8 is not traced: this is the step without FP8 matrix products")
    return tuple(notes)


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
                   device: torch.device, target: torch.device, what_if: bool, state_bytes: int,
                   extra_host: int) -> tuple[Estimate, int]:
    """The estimate from the tracker's peak snapshot, and the update's temporaries in it."""
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
        # with the update's own temporaries (foreach optimizers: about one per state tensor)
        "temporaries_bytes": int(here.get(Ref.TEMP, 0)) + made_in_update - state,
        "overhead_bytes": 0,
    }
    context = 0
    if target.type == "cuda":
        parts["overhead_bytes"] += cublas_workspace_bytes(None if what_if else torch.cuda.get_device_capability(target))
        context = CUDA_CONTEXT_BYTES
    return Estimate(plan=plan.replace(micro_batch_size=micro), micro_batch_size=micro, device=str(target),
                    predicted_peak_bytes=sum(parts.values()), host_bytes=host + extra_host, context_bytes=context,
                    **parts), made_in_update - state


