"""How the estimator traces one training step of a plan (:mod:`autotune._estimate.estimate` is the public side).

The model is copied under ``FakeTensorMode`` (tensors without data; a step that reads tensor values is traced on a copy
with real tensors on the host instead, at small micro-batches and along their line beyond: see
:meth:`Traces._traced`), the plan is applied as a run applies it
(:mod:`autotune._runtime.blocks`, Lightning's precision plugins), and one step runs under torch's ``MemTracker``,
which files every storage under parameters, gradients, optimizer state, activations or temporaries while it lives.
The step is Lightning's (forward with the last gradients alive, ``zero_grad``, backward, update) after a warm-up step
that makes the optimizer state (once per plan: every micro-batch traced starts from the state the step before left,
which is the same at any micro-batch); when the plan cuts the batch, the traced micro-batch adds to the gradients (as
the later ones of ``ElasticBatchSize`` do). The peak is the most bytes alive at once plus ``overhead_bytes``; the
categories are those at that moment (the forward's and the backward's peaks are kept apart for the sharded closed
form). Kernels add the work buffers they hold inside one call (:mod:`autotune._estimate.workspace`): derived for CPU
convolutions in fp32, measured once per machine for CPU matrix products and convolutions in bf16/fp16 (oneDNN's
buffers depend on the processor; ``Estimate.notes`` says so). On CUDA the rules of
:mod:`autotune._estimate.cuda_rules` apply: each allocation rounded up to 512 B, the cuBLAS workspaces in the
overhead, the CUDA context beside the peak (``context_bytes``); a CUDA device this machine does not have
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

import contextlib
import copy
import dataclasses
import logging
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import psutil
import torch
from torch import nn

from autotune._compat import fake_copy_mode, fake_tensor_mode, mem_ref_types, precision_input_dtype, trainer_reference
from autotune._runtime.blocks import checkpoint_blocks, offload_activations, select_blocks
from autotune._runtime.batch import batch_size_of, slice_batch
from autotune._estimate.sharding import cast_unit_inputs
from autotune._estimate import real_path
from autotune._estimate.real_path import REAL_NOTE, extrapolated, from_bytes, peak_of, to_bytes
from autotune._estimate.cuda_rules import CUDA_CONTEXT_BYTES, CudaAutocast, cublas_workspace_bytes
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
    quiet_torch_logs,
    step_tracker,
    with_optimizer_state,
)
from autotune._runtime.offload import device_part, is_offloaded
from autotune._runtime.state import RNGState
from autotune._plan.plan import Plan
from autotune._device.probe import DeviceSpec
from autotune._estimate.result import Estimate, Phase, Traced, estimate_device, largest_fitting
from autotune._estimate.work import WorkCounter

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule


__all__ = ["Traces"]

log = logging.getLogger(__name__)

_TRACEABLE_PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")



# ---------------------------------------------------------------------------------------------------------- tracing


class Traces:
    """Estimates of one model, batch and plan at any micro-batch and world size, each micro-batch traced once (the
    world size changes the closed-form parts only)."""

    def __init__(self, *, model: LightningModule, batch: Any, plan: Plan, device: DeviceSpec,
                 optimizer: OptimizerFactory | None, world_size: int | None = None, trace: str = "auto") -> None:
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
        self._fake: _FakeStep | None = None
        self._real_done: dict[tuple[int, bool], Traced] = {}  # real traces by (micro-batch, accumulating)
        self._seconds: dict[tuple[int, bool], float] = {}  # and the host time each took
        self.real = trace != "auto"  # traced with real tensors on the host (the step reads tensor values, or asked)
        self.how = trace  # "real": at the micro-batch asked; "line": beyond 4, on the line through 2 and 4
        if self.real:
            self._check_weights(f"trace={trace!r} runs the step with real tensors")

    def fake_step(self) -> _FakeStep:
        """The fake model and step every micro-batch of this plan is traced with (made at the first); real tensors
        on the host once the step was found to read values."""
        if self._fake is None:
            self._fake = _FakeStep(self, real=self.real)
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
        """``micro`` traced with fake tensors; for a step that reads tensor values, with real ones on the host: at
        ``micro`` itself up to 4 or where the host runs it within ``REAL_SECONDS`` and ``REAL_HOST_SHARE`` of its free
        memory (judged from micro-batches 1 and 2), else along the line through the two largest powers of two it can
        (4 at least), a quarter of the larger checking the line."""
        if not self.real:
            try:
                return _trace(self, micro)
            except _ReadsValues as error:
                self._go_real(error)
        if micro <= 4 or self.how == "real":
            return self._real(micro)
        # the small micro-batches traced as the asked one runs: adding to the last gradients (a later micro-batch of
        # a cut batch) or not (the whole batch at once: zero_grad before backward)
        accumulate = micro < self.size
        one, two = self._real(1, accumulate), self._real(2, accumulate)
        seconds = self._seconds[2, accumulate] / 2  # per sample, the fixed part in (micro 1 made the copy: not it)
        slope = peak_of(two) - peak_of(one)
        free = psutil.virtual_memory().available

        def affordable(m: int) -> bool:
            within_time = seconds * m <= real_path.REAL_SECONDS
            return within_time and peak_of(one) + slope * (m - 1) <= real_path.REAL_HOST_SHARE * free

        if self.how == "auto" and affordable(micro):
            return self._real(micro)
        b = 4  # lines from micro-batches 1 and 2 missed by up to 70% (a peak set by fixed-size buffers there)
        while 2 * b < micro and self.how == "auto" and affordable(2 * b):
            b *= 2
        return extrapolated(self._real(b // 2, accumulate), self._real(b, accumulate), b // 2, b, micro,
                             check=(b // 4, self._real(b // 4, accumulate)))

    def _real(self, micro: int, accumulate: bool | None = None) -> Traced:
        """``micro`` traced with real tensors (``accumulate``: as a later micro-batch of a cut batch; None: as
        ``micro`` runs), kept."""
        key = (micro, micro < self.size if accumulate is None else accumulate)
        if key not in self._real_done:
            start = time.perf_counter()
            self._real_done[key] = _trace(self, micro, accumulate=key[1])
            self._seconds[key] = time.perf_counter() - start
        return self._real_done[key]

    def _go_real(self, error: _ReadsValues) -> None:
        """Trace with real tensors from now on, or one line saying why that cannot be done (weights on the meta
        device)."""
        name = type(self.model).__name__
        self._check_weights(f"its training_step reads tensor values ({error.detail}), which a trace without data "
                            "cannot follow")
        log.info("autotune: %s.training_step reads tensor values (%s); estimating with real tensors on the host",
                 name, error.detail)
        self.real = True
        self.forget_fake_step()

    def _check_weights(self, why: str) -> None:
        """One line (ValueError) when the real-tensor path has no weights to trace with: a meta-device model."""
        if any(t.is_meta for t in (*self.model.parameters(), *self.model.buffers())):
            raise ValueError(
                f"cannot estimate {type(self.model).__name__}: {why}, and its weights are on the meta device, so "
                "there are none to trace with; estimate the same architecture with real weights at a size the host "
                "holds (fewer layers or a narrower width) and scale the per-layer bytes") from None

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


class _FakeStep:
    """A shape's model and optimizers copied under one ``FakeTensorMode`` with the plan applied, and its training step,
    kept for every micro-batch traced: the warm-up step that makes the gradients and the optimizer state runs once
    (a step leaves the same state at any micro-batch: the gradients and the optimizer state of every parameter). A
    model that keeps Python state from step to step (a step counter, a list it appends to) is traced after as many
    steps as micro-batches were traced before; a step whose trace fails drops the copy."""

    def __init__(self, traces: Traces, *, real: bool = False) -> None:
        # real tensors run on the host, under CUDA's rules for a CUDA target (as a what-if trace does)
        self.real = real
        self.device = device = torch.device("cpu") if real else traces.trace_device
        self.what_if = traces.device.type == "cuda" if real else traces.what_if
        plan = traces.plan
        self.precision = precision = precision_plugin(plan.precision, device)
        if self.what_if and plan.precision.endswith("-mixed"):  # CUDA's op lists, on CPU tensors
            low = torch.bfloat16 if plan.precision == "bf16-mixed" else torch.float16
            self.autocast: Callable[[], Any] = lambda: CudaAutocast(low)
        else:  # CPU autocast: checkpointing re-enters it to recompute
            low = None
            self.autocast = precision.forward_context if precision is not None else contextlib.nullcontext
        self.in_backward = [False]
        self.warm = False
        self.mode = contextlib.nullcontext() if real else fake_tensor_mode(allow_non_fake_inputs=True)
        trainer = trainer_reference(traces.model)
        memo: dict[int, Any] = {id(trainer): None} if trainer is not None else {}
        if real:  # the copy is made on the host, whatever device the model is on
            for t in (*traces.model.parameters(), *traces.model.buffers()):
                if t.device.type != "cpu":
                    host = t.detach().to("cpu", copy=True)
                    memo[id(t)] = nn.Parameter(host, requires_grad=t.requires_grad) if isinstance(
                        t, nn.Parameter) else host
        with contextlib.nullcontext() if real else fake_copy_mode(self.mode):
            self.model = fake = copy.deepcopy(traces.model, memo)
        with self.entered():
            # FSDP2's bf16 policy gathers bf16 parameters, so autocast casts (and caches) no weights: trace in bf16,
            # with the fp32 master shards in closed form (rank_state)
            self.gathered_bf16 = plan.strategy == "fsdp" and plan.precision == "bf16-mixed"
            convert_model(fake, device, torch.bfloat16 if self.gathered_bf16 else precision_input_dtype(precision))
            fake.train()
            if plan.activation_checkpointing:
                blocks = select_blocks(fake, plan.activation_checkpointing)
                if low is not None:
                    _recompute_under(blocks, low, self.in_backward)
                checkpoint_blocks(blocks, model=fake)
            if self.gathered_bf16:  # FSDP2's policy: each unit casts its inputs, so what passes between units is bf16
                cast_unit_inputs(fake, torch.bfloat16)
            optimizers = with_optimizer_state(optimizers_of(fake, traces.optimizer, traces.device),
                                              plan.optimizer_state, bf16_weights=plan.precision == "bf16-true")
            self.offloaded = [p for p in fake.parameters() if is_offloaded(p)] if plan.optimizer_offload else []
            self.host_bytes = offloaded_host_bytes(optimizers) if self.offloaded else 0
            if self.offloaded:  # the device runs the update of the small parameters only
                optimizers = like_cuda_run([d for d in map(device_part, optimizers) if d is not None], device)
            self.optimizers = optimizers
        self.plan = plan

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """The fake mode, and quiet about a step outside a Trainer (``self.log`` without a trainer, hooks)."""
        rng = _kept_random_state() if self.real else contextlib.nullcontext()  # the user's RNG untouched
        with self.mode, rng, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*`self\.log\(\)` but the `self\.trainer` reference")
            warnings.filterwarnings("ignore", message=r"Module is None\. Skipping")
            yield

    def step(self, inputs: Any, *, zero_grad: bool, before_backward: Callable[[], Any] = lambda: None,
             before_update: Callable[[], Any] = lambda: None, warm_up: bool = False, fill: bool = False) -> None:
        """Forward (the last gradients alive), ``zero_grad``, backward, update (``fill``: of every parameter, those
        this step's data left without a gradient given zeros; real tensors only)."""
        with _offload(self.plan, self.what_if, self.real):
            with self.autocast():
                loss = loss_of(self.model, self.model.training_step(inputs, 0))
            if zero_grad:
                for opt in self.optimizers:
                    opt.zero_grad(set_to_none=True)
                for p in self.offloaded:
                    p.grad = None
            before_backward()
            self.in_backward[0] = True
            try:
                loss.backward()
            finally:
                self.in_backward[0] = False
        del loss
        if (warm_up or fill) and self.real:  # every parameter updated, as the fake path has it
            self.fill_grads()
        before_update()
        for opt in self.optimizers:
            opt.step()

    def fill_grads(self) -> None:
        """Real tensors: zeros for the trainable parameters this step left without a gradient (an expert no token
        was routed to), as the fake path has them: a run's steady state holds every parameter's gradient (the last
        step's, during the forward) and optimizer state, whichever data each micro-batch routed where."""
        with torch.no_grad():
            for p in self.model.parameters():
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)


@contextlib.contextmanager
def _kept_random_state() -> Iterator[None]:
    """torch's (and CUDA's), Python's and NumPy's random state as they were, whatever the real step draws."""
    state = RNGState()
    try:
        yield
    finally:
        state.restore()


class _ReadsValues(ValueError):
    """A fake trace met a step that reads a tensor's value (``.item()``, a mask checked with ``.all()``, data-dependent
    routing): the real-tensor path can answer."""

    def __init__(self, message: str, detail: str) -> None:
        super().__init__(message)
        self.detail = detail


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
            tracker = step_tracker(cuda_rules=what_if, counter=counter)
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
            if not isinstance(error, (RuntimeError, NotImplementedError, TypeError)):
                raise
            message = " ".join(str(error).split())[:300]
            detail = f"{type(error).__name__}: {message}"
            where = "with real tensors on the host" if fake.real else "under FakeTensorMode"
            text = (f"cannot trace {type(traces.model).__name__}.training_step with plan [{plan.describe()}] {where} "
                    f"({detail})")
            reads = any(k in type(error).__name__ for k in _READS_VALUES) or any(k in message for k in _READ_CALLS)
            if reads and not fake.real:
                raise _ReadsValues(text, detail) from error
            raise ValueError(text) from error
        optimizers = fake.optimizers
        state_bytes = bytes_of((t for opt in optimizers for s in opt.state.values() for t in s.values()), device,
                               cuda_rules=what_if)
        grad_bytes = bytes_of((p for p in fake.model.parameters() if p.requires_grad), device, cuda_rules=what_if)
    real = (f"{REAL_NOTE} {micro}",) if fake.real else ()
    notes = real + tracker.workspace.notes() + ((_WHAT_IF_NOTE,) if traces.what_if else ()) + _untraced(plan)
    phases = []
    for backward, snapshot in enumerate(snapshots):
        estimate, update_temporaries = _estimate_from(
            snapshot, before, plan=plan, micro=micro, device=device, target=traces.device, what_if=traces.what_if,
            state_bytes=state_bytes, extra_host=fake.host_bytes)
        estimate = dataclasses.replace(estimate, notes=notes, method="real" if fake.real else "fake")
        phases.append(Phase(estimate, update_temporaries, bool(backward)))
    work = counter.work(micro_batch_size=micro, model=fake.model, optimizers=optimizers, offloaded=fake.offloaded,
                        host_state_bytes=fake.host_bytes)
    return Traced(tuple(phases), grad_bytes, fake.model, optimizers, torch.float32 if fake.gathered_bf16 else None,
                  work)


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


def _recompute_under(blocks: list[Any], low: torch.dtype, in_backward: list[bool]) -> None:
    """Checkpointing recomputes a block in backward under the forward's autocast state, which it re-enters for
    ``torch.autocast`` but not for a function mode: each block's forward enters CUDA's autocast itself while
    ``in_backward[0]`` (casts not cached: each recomputation makes its own)."""
    for block in blocks:
        original = block.forward

        def forward(*args: Any, __original: Callable[..., Any] = original, **kwargs: Any) -> Any:
            if not in_backward[0]:
                return __original(*args, **kwargs)
            with CudaAutocast(low, cache=False):
                return __original(*args, **kwargs)

        block.forward = forward


def _offload(plan: Plan, what_if: bool, real: bool) -> Any:
    """Activation offload as a run does it; in a what-if trace, saved tensors go to the meta device (the host), or,
    holding data (the real-tensor path), to bytes outside torch, which the tracker does not see either."""
    if not plan.activation_offload:
        return contextlib.nullcontext()
    if not what_if:
        return offload_activations(pin_memory=False)
    if real:
        return torch.autograd.graph.saved_tensors_hooks(to_bytes, from_bytes)
    return torch.autograd.graph.saved_tensors_hooks(lambda t: (t.device, t.to("meta")),
                                                    lambda packed: packed[1].to(packed[0]))


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


