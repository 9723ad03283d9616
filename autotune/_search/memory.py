"""What the estimator tells a search about memory: predicted peaks in the search's own measure (the process baseline
on CPU, the CUDA context, each shape's measured error) calibrated by its trials, and ``auto`` micro-batches. The order
of the first trials and the plans' predicted speed: :mod:`autotune._search.speed`.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from autotune._plan.plan import Plan

if TYPE_CHECKING:
    from autotune._estimate.estimate import BatchSizes
    from autotune._estimate.work import StepWork

log = logging.getLogger("autotune")


#: On a CPU, the share of the tensors a plan saves against the default plan (recomputation, 16-bit activations) that
#: the process keeps resident anyway (the C allocator keeps what was freed): measured about half (memory.py notes).
KEPT_BACK = 0.5
_FAILED = object()  # the estimator could not tell
_TRACING = threading.RLock()  # the estimator's module hooks are process-wide: one trace at a time (searches in
# threads); re-entered where a plan's baseline needs another shape traced (``_kept_back`` inside ``largest_micro``)


class ShortRun(NamedTuple):
    """A short run of the process baseline's (:meth:`SearchEstimator.measure_baseline`): its plan and what it measured."""

    plan: Plan
    result: Any  # autotune._search.records.TrialResult


class SearchEstimator:
    """The estimator as the search uses it: predicted peaks in the search's own measure, and ``auto`` micro-batches.

    The search measures a CPU trial's peak as the process's resident set (net of file-backed pages), while the
    estimator counts tensor bytes. So on CPU the process baseline is added, measured by a short trial before the
    search (its peak less its estimate). Each measured trial then gives its plan's shape (the plan without its
    micro-batch and dataloader settings) a baseline of its own at that micro-batch. It is interpolated between the
    micro-batches measured (:func:`interpolated`; the short run measures the default shape at micro-batch 1). The
    estimator's error differs between shapes and grows with the micro-batch, and one shape's must not shrink
    another's micro-batches. (Checkpointing's recomputation leaves more behind in the resident set than its tensors
    say, and on CPU a micro-batch whose blocks fall under glibc's mmap threshold can leave far more resident.) A shape
    not measured yet takes the first baseline measured (the short run's).

    On CUDA a trial's peak is the caching allocator's peak reserve plus the CUDA context (what NVML counts for the
    process beyond the allocator); the estimator's is the bytes allocated. The baseline starts as the estimate's context
    (``CUDA_CONTEXT_BYTES``; no short run) until a trial measures the real one (:meth:`measured_context`). Each measured
    trial gives its shape a baseline of its own as on CPU. That baseline takes in the allocator's fragmentation, the
    real context and what the estimator does not trace (compile, float8, kernels' scratch). Each shape is traced once
    per micro-batch. Any failure of the estimator is logged and the search goes on without it.

    Example:
        >>> import torch
        >>> from autotune import Plan, load_target
        >>> estimator = SearchEstimator(target=load_target("examples/gpt/train.py:make"),  # doctest: +SKIP
        ...                             device=torch.device("cpu"))
        >>> estimator.peak(Plan(micro_batch_size=8))  # bytes, in the search's measure  # doctest: +SKIP
    """

    def __init__(self, *, target: Any, device: Any, trace: str = "auto",
                 unestimated: str = "trials run unestimated") -> None:
        from autotune._device.meter import current_host_bytes
        from autotune._estimate.cuda_rules import CUDA_CONTEXT_BYTES

        self.target, self.device, self.trace = target, device, trace
        self.unestimated = unestimated  # what goes on without the estimator, where it fails (its warning's end)
        cuda = device.type == "cuda"
        self.baseline = CUDA_CONTEXT_BYTES if cuda else current_host_bytes()  # CPU: until the short run measures one
        self.calibrated = cuda
        self._context_measured = False  # CUDA: whether a trial's context has replaced the estimate (measured_context)
        self._shape_baselines: dict[str, dict[int, int]] = {}  # shape: {micro-batch measured: its baseline}
        self.calibrations = 0  # how many measurements have changed a baseline (what 'auto' choices depend on)
        self._first_micro = 1  # the micro-batch of the first measurement (the short run's)
        self._pending: dict[str, list[tuple[Plan, int]]] = {}  # shape: measurements not calibrated from yet
        self._batch: Any = None
        self.batch_sizes: BatchSizes | None = None  # of the batches read, once the estimator first ran
        self._warned = False
        self._traces: dict[str, Any] = {}  # by plan without its micro-batch: each micro-batch traced once
        # activation_checkpointing="auto": the budget it chooses for and the device speeds it prices recompute on
        # (set by the search), and its choices by plan and calibrations
        self.recompute_budget: int | None = None
        self.recompute_speed: Callable[[], Any] | None = None
        self._chosen: dict[tuple[str, int], Plan] = {}
        self._recompute_traced: dict[Any, Any] = {}  # the choices' traces, kept across calibrations

    @property
    def batch(self) -> Any:
        """The batch every plan is estimated on (the one of the largest samples read), once the estimator first ran;
        None before."""
        return self._batch

    def measure_baseline(self, *, target: str, config: str | None, timeout: float = 600.0,
                         meanwhile: Sequence[Plan] = (), budget_bytes: int | None = None) -> ShortRun | None:
        """On CPU, measure what a trial's process holds besides the tensors the estimator counts: one short trial of
        ``target`` at micro-batch 1, its peak (resident set net of file pages) less its estimate; then a second at
        the largest micro-batch of the default plan predicted to fit ``budget_bytes`` and half the host's free
        memory (:meth:`second_micro`), which gives the default shape's baseline as it grows with the micro-batch:
        every shape not measured yet takes that line. Nothing on CUDA. While the first trial runs (only its memory
        counts, not its speed), its plan and then ``meanwhile`` are traced.

        Micro-batch 1 first, although it takes a pass per sample: its blocks are small, so the resident set is the
        process and its tensors. At a larger micro-batch glibc serves blocks under its mmap threshold (up to 32 MiB)
        from its heap and keeps them resident after they are freed: the process grows with the micro-batch faster
        than its tensors (a 4-layer Llama, batch 32: 319 MiB besides its tensors at micro-batch 1, 387 MiB at 32).
        A single baseline at micro-batch 1 put that run's peak 13% low; the line puts the plain shape within 4%.

        Returns the second run (its plan and result, samples/s too: a measurement of speed on this host, which a
        caller may calibrate the step-time model with), or None where there was none."""
        if self.device.type == "cuda":
            return None
        from autotune._search.trial import TrialSpec, run_trial

        def short_run(plan: Plan, steps: int, while_running: Callable[[], None] | None = None) -> ShortRun | None:
            result = run_trial(TrialSpec(target=target, config=config, plan=plan.to_dict(), budget=None,
                                         device="cpu", steps=steps, warmup=1), timeout=timeout,
                               while_running=while_running)
            if result.status == "ok" and result.peak_bytes:
                self.calibrate(plan, result.peak_bytes)
                return ShortRun(plan, result)
            if result.target_error:  # the target's own code failed in a plain run: no plan can run it
                from autotune._target.failure import TargetCodeError

                raise TargetCodeError(result.target_error)
            log.warning("autotune: the process baseline could not be measured at micro-batch %s (%s); %s",
                        plan.micro_batch_size, result.reason or result.status,
                        "using this process's memory now" if plan.micro_batch_size == 1 else
                        "every shape takes the baseline at micro-batch 1")
            return None

        plan = Plan(micro_batch_size=1)

        def trace() -> None:
            for each in (plan, *meanwhile):
                self.tensors(each)

        if short_run(plan, 1, trace) is None:
            return None
        second = self.second_micro(budget_bytes)
        return None if second is None else short_run(Plan(micro_batch_size=second), 2)  # the heap grows a step more

    def second_micro(self, budget_bytes: int | None) -> int | None:
        """The micro-batch of the baseline's second short run: the largest of the default plan's, evened out, predicted
        to fit ``budget_bytes`` (None: no cap) and half the host's free memory; None when that is micro-batch 1 or
        the estimator cannot tell."""
        import psutil

        room = psutil.virtual_memory().available // 2 + self.baseline
        if budget_bytes is not None:
            room = min(room, budget_bytes)
        micro = self.largest_micro(Plan(), room, self._size())
        return micro if micro > 1 else None

    def _size(self) -> int:
        result = self._call(lambda traces: traces.size, Plan())
        return 1 if result is _FAILED else int(result)

    def tensors(self, plan: Plan) -> int | None:
        """The estimator's peak of ``plan`` (tensor bytes); None when it cannot tell."""
        result = self._call(lambda traces: traces.at(plan.micro_batch_size or traces.size), plan)
        return None if result is _FAILED else result.predicted_peak_bytes

    def inert(self, plan: Plan) -> dict[str, str]:
        """The settings of ``plan`` that apply to nothing for the target (:mod:`autotune._estimate.inert`), each with
        why, from its step traced at one sample; empty when the estimator cannot tell. ``"auto"`` checkpointing is
        judged as checkpointing every block: whether recomputing could apply to anything."""
        if plan.activation_checkpointing == "auto" and plan.recompute is None:
            plan = plan.replace(activation_checkpointing=1.0)
        result = self._call(lambda traces: (traces.at(1), traces.inert)[1], plan)
        return {} if result is _FAILED else dict(result)

    def method(self, plan: Plan) -> str | None:
        """How ``plan``'s estimate was traced (``Estimate.method``), None when it cannot tell; costs nothing once
        :meth:`tensors` answered."""
        result = self._call(lambda traces: traces.at(plan.micro_batch_size or traces.size), plan)
        return None if result is _FAILED else result.method

    def work(self, plan: Plan) -> StepWork | None:
        """Return the FLOPs and bytes of ``plan``'s step, op by op (what its speed is predicted from).

        It is its shape's trace at the whole batch, whatever ``plan``'s micro-batch: the step-time model takes a
        pass's work in proportion to its samples. So every plan of every shape is predicted from a trace made alike.
        None when the estimator cannot tell."""
        result = self._call(lambda traces: traces.work(traces.size), plan)
        return None if result is _FAILED else result

    def traced(self, plan: Plan) -> bool:
        """Whether ``plan`` (its shape at its micro-batch) has been traced: its estimate costs nothing."""
        traces = self._traces.get(shape_of(plan).key())
        return traces is not None and traces.traced(plan.micro_batch_size or traces.size)

    def known_under(self, plan: Plan, limit_bytes: int) -> bool:
        """Whether ``plan``'s least peak (:meth:`least_peak`) is known to be at most ``limit_bytes`` without tracing
        it: a larger micro-batch of its shape, traced, is under the limit with the first baseline measured (CUDA: the
        context; the peak grows with the micro-batch; the least peak takes at most that baseline)."""
        traces = self._traces.get(shape_of(plan).key())
        if traces is None or plan.micro_batch_size is None:
            return False
        return any(traces.at(m).predicted_peak_bytes + self.baseline <= limit_bytes
                   for m in traces.traced_micro_batches() if m >= plan.micro_batch_size)

    def calibrate(self, plan: Plan, measured_peak: int, *, lazily: bool = False) -> bool:
        """Learn the baseline from a measured trial: its peak minus the tensor bytes predicted for it, for its
        shape at its micro-batch (the larger of two at one micro-batch). Returns whether a baseline changed.
        ``lazily``: a plan not traced yet is kept until its shape's baseline is asked for (:meth:`baseline_for`), and
        traced only then."""
        if lazily and self.calibrated and not self.traced(plan):
            self._pending.setdefault(shape_of(plan).key(), []).append((plan, measured_peak))
            return False
        predicted = self.tensors(plan)
        if predicted is None:
            return False
        key = shape_of(plan).key()
        baseline, micro = measured_peak - predicted, plan.micro_batch_size or self._traces[key].size  # traced above
        known = self._shape_baselines.setdefault(key, {})
        changed = baseline > known.get(micro, -math.inf)
        if changed:
            known[micro] = baseline
            self.calibrations += 1
        if not self.calibrated:  # the first measurement (the search's short run before its trials) speaks for all
            self.baseline, self.calibrated, self._first_micro = baseline, True, micro
        return changed

    def measured_context(self, context_bytes: int) -> bool:
        """Record a CUDA trial's context as NVML counted it.

        The smallest measured so far replaces the context estimate (``CUDA_CONTEXT_BYTES``) as the baseline of the
        shapes not measured yet. It is also the floor a plan is rejected unmeasured on: the context is the process's,
        not the plan's, and no trial holds less (docs/search.md gives a measured one). Returns whether the baseline
        changed."""
        if self.device.type != "cuda" or context_bytes <= 0:
            return False
        first = not self._context_measured
        self._context_measured = True
        if first or context_bytes < self.baseline:
            changed = context_bytes != self.baseline
            self.baseline = context_bytes
            self.calibrations += int(changed)
            return changed
        return False

    def baseline_for(self, plan: Plan) -> int:
        """The process baseline under ``plan``'s tensors: its shape's if measured (:func:`interpolated` over the
        micro-batches measured), else the first measured (CUDA: the smallest context a trial measured, or the context
        estimate before one has)."""
        key = shape_of(plan).key()
        for measured, peak in self._pending.pop(key, []):
            self.calibrate(measured, peak)
        return self._baseline_at(key, plan.micro_batch_size or math.inf, plan)  # None: the whole batch

    def _baseline_at(self, key: str, micro: float, plan: Plan | None = None) -> int:
        """Return shape ``key``'s baseline at ``micro``, interpolated between its own measurements.

        On CPU the points also hold the first baseline measured, at its micro-batch: the short run's at micro-batch 1,
        the process with few tensors, which any shape has below its own. A shape not measured takes the default
        shape's line (the baseline's two short runs, and its trials), the process growing with the micro-batch as
        the default's does. On CUDA the context is an estimate, not a measurement, so a shape's own points are used
        alone, beyond them the nearest below or above (much of a CUDA gap need not shrink with the micro-batch), and
        a shape not measured takes the first baseline."""
        own = self._shape_baselines.get(key)
        if self.device.type == "cuda":
            return interpolated(own, micro) if own else self.baseline
        if own:
            return interpolated({self._first_micro: self.baseline, **own}, micro)
        default = self._shape_baselines.get(shape_of(Plan()).key())
        line = interpolated({self._first_micro: self.baseline, **(default or {})}, micro)
        return line + self._kept_back(plan, micro) if default else line

    def _kept_back(self, plan: Plan | None, micro: float) -> int:
        """What the C allocator keeps resident of the tensors ``plan`` saves against the default plan at the same
        micro-batch: :data:`KEPT_BACK` of the saving (recomputation and 16-bit activations free the heap's blocks,
        glibc keeps them; a 4-layer Llama's and the example GPT's full checkpointing saved 80 and 5.9 MiB of tensors
        at micro-batch 32, their resident sets 41 and 3.1)."""
        if plan is None or not math.isfinite(micro):
            return 0
        mine, default = self.tensors(plan.replace(micro_batch_size=int(micro))), self.tensors(
            Plan(micro_batch_size=int(micro)))
        return int(KEPT_BACK * max(0, default - mine)) if mine is not None and default is not None else 0

    def resolved(self, plan: Plan) -> Plan:
        """``plan`` with ``activation_checkpointing="auto"`` chosen (:func:`autotune.choose_recompute`) for its
        micro-batch (None: the whole batch) in the search's budget less the plan's baseline, once per calibration;
        any other plan as it is. A choice of nothing or of every block whole is that plan (``0.0``, ``1.0``): one step,
        one plan, measured once. Without a budget set (outside a search), or for a model without repeated blocks, the
        plan with every block checkpointed stands in (the least memory ``auto`` can reach)."""
        if plan.activation_checkpointing != "auto" or plan.recompute is not None:
            return plan
        if self.recompute_budget is None or self.recompute_speed is None:
            return plan.replace(activation_checkpointing=1.0)
        key = (plan.key(), self.calibrations)
        if key not in self._chosen:
            from autotune._estimate.recompute import choose

            from autotune._transforms.blocks import find_blocks

            if self._call(lambda traces: traces.size, Plan()) is _FAILED:
                return plan
            if not find_blocks(self.target.model):  # nothing to choose among: as inert as checkpointing every block
                return plan.replace(activation_checkpointing=1.0)
            # the baseline of every block checkpointed (the choice's own depends on the choice)
            room = max(self.recompute_budget - self.baseline_for(plan.replace(activation_checkpointing=1.0)), 1)
            with _TRACING:
                self._chosen[key] = choose(model=self.target.model, batch=self._batch, plan=plan, budget_bytes=room,
                                           device=self.device, speed=self.recompute_speed(),
                                           traced_before=self._recompute_traced).plan.replace(
                    micro_batch_size=plan.micro_batch_size)
                levels = set(self._chosen[key].recompute or ())
                if levels in ({"none"}, {"block"}):  # the step of no checkpointing or of every block: that plan
                    self._chosen[key] = plan.replace(activation_checkpointing=0.0 if levels == {"none"} else 1.0)
        return self._chosen[key]

    def _call(self, fn: Callable[[Any], Any], plan: Plan) -> Any:
        """``fn(traces)`` with the traces of ``plan``'s shape (the plan without its micro-batch), made once (an
        ``"auto"`` checkpointing plan: its choice's, :meth:`resolved`)."""
        from autotune._estimate.estimate import longest_batch
        from autotune._estimate.trace import Traces

        plan = self.resolved(plan)
        try:
            with _TRACING:
                if self._batch is None:  # where lengths vary, micro-batches are estimated on the longest batch seen
                    self._batch, self.batch_sizes = longest_batch(self.target)
                shape = shape_of(plan)
                traces = self._traces.get(shape.key())
                if traces is None:
                    traces = self._traces[shape.key()] = Traces(model=self.target.model, batch=self._batch,
                                                                plan=shape, device=self.device, optimizer=None,
                                                                trace=self.trace)
                return fn(traces)
        except Exception as err:  # the estimator is an aid: a plan it cannot trace is still measured
            failure = self._target_failure(err, plan)
            if failure is not None:  # unless the target's own code fails: no plan can run it
                raise failure from err
            if not self._warned:
                self._warned = True
                log.warning("autotune: the estimator cannot trace this target (%s: %s); %s",
                            type(err).__name__, " ".join(str(err).split())[:200], self.unestimated)
            return _FAILED

    def _target_failure(self, err: Exception, plan: Plan) -> Exception | None:
        """``err`` as the target's own failure (:func:`autotune._target.failure.target_failure`): reading its batches,
        or its step at ``plan``'s shape where the plainest step fails too (traced here first: a failure of this plan
        alone is a note, and its trials are measured)."""
        from autotune._target.failure import target_failure

        failure = target_failure(err, spec=self.target.spec, traced=True)
        if failure is None or self._batch is None or shape_of(plan).key() == shape_of(Plan()).key():
            return failure
        self.tensors(Plan(micro_batch_size=1))  # raises the plain step's failure where it is the target's
        return None

    def peak(self, plan: Plan) -> int | None:
        """The predicted peak in the search's measure: tensors plus the baseline (CPU: the process's; CUDA: the
        context, then what the shape's trials measured)."""
        tensors = self.tensors(plan)
        return None if tensors is None else tensors + self.baseline_for(plan)

    def least_peak(self, plan: Plan) -> int | None:
        """The smallest peak ``plan`` may have: its tensors over the smaller of its shape's baseline and the first
        measured. What rejects a plan unmeasured: a shape's baseline measured at one micro-batch may hold a heap
        glibc kept there (on the test suite's hungry target, 300 MiB more at micro-batch 22 than at 32)."""
        tensors = self.tensors(plan)
        return None if tensors is None else tensors + min(self.baseline, self.baseline_for(plan))

    def largest_micro(self, plan: Plan, budget_bytes: int, batch_size: int) -> int:
        """The largest micro-batch predicted to fit, evened out (:func:`even_micro_batches`); 1 when none is, the
        whole batch when the estimator fails. An ``"auto"`` checkpointing plan not chosen yet: the largest that fits
        with every block recomputed (its choice at that micro-batch then recomputes no more than it needs)."""
        from autotune._estimate.result import largest_fitting

        if plan.activation_checkpointing == "auto" and plan.recompute is None:
            plan = plan.replace(activation_checkpointing=1.0)

        self.baseline_for(plan)  # calibrates from the shape's measurements kept until now, before tracing
        key = shape_of(plan).key()

        def peak(traces: Any, m: int) -> int:
            return traces.at(m).predicted_peak_bytes + self._baseline_at(key, m, plan.replace(micro_batch_size=m))

        micro = self._call(lambda traces: largest_fitting(even_micro_batches(traces.size),
                                                          lambda m: peak(traces, m), budget_bytes), plan)
        if micro is _FAILED:
            return batch_size
        return 1 if micro is None else int(micro)


def interpolated(points: dict[int, int], micro: float) -> int:
    """A shape's baseline at ``micro`` from those measured at other micro-batches (``points``): on the line between
    the two measured either side of it, else the nearest measured. The resident set grows faster with the
    micro-batch than the tensors do (the allocator keeps more), so a baseline measured at one micro-batch over-states
    smaller ones and under-states larger ones.

    Example:
        >>> interpolated({1: 100, 11: 110, 16: 120}, 8), interpolated({1: 100, 11: 110}, 32)
        (107, 110)
    """
    below = max((m for m in points if m <= micro), default=None)
    above = min((m for m in points if m >= micro), default=None)
    if below is None or above is None or below == above:
        return points[below if above is None else above]
    return round(points[below] + (points[above] - points[below]) * (micro - below) / (above - below))


def even_micro_batches(batch_size: int) -> list[int]:
    """The micro-batches that split ``batch_size`` into passes of equal sizes, smallest first: ``ceil(B / k)`` for
    ``k`` passes. The largest of them that fits is the largest micro-batch that fits, evened out (8 rather than 9 for
    a batch of 32: both take 4 passes, 8 with less memory).

    Example:
        >>> even_micro_batches(32)
        [1, 2, 3, 4, 5, 6, 7, 8, 11, 16, 32]
    """
    return sorted({-(-batch_size // passes) for passes in range(1, batch_size + 1)})


def shape_of(plan: Plan) -> Plan:
    """``plan`` without what leaves the step's tensors as they are: its micro-batch (traced apart), the dataloader's
    and the allocator's settings."""
    return plan.replace(micro_batch_size=None, num_workers=None, pin_memory=None, expandable_segments=False)
