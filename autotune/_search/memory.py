"""What the estimator tells a search about memory: predicted peaks in the search's own measure (the process baseline
on CPU, the CUDA context, each shape's measured error) calibrated by its trials, and ``auto`` micro-batches. The order
of the first trials and the plans' predicted speed: :mod:`autotune._search.speed`.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from autotune._plan.plan import Plan

if TYPE_CHECKING:
    from autotune._estimate.estimate import BatchSizes
    from autotune._estimate.work import StepWork

log = logging.getLogger("autotune")


_FAILED = object()  # the estimator could not tell
_TRACING = threading.Lock()  # the estimator's module hooks are process-wide: one trace at a time (searches in threads)


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

    @property
    def batch(self) -> Any:
        """The batch every plan is estimated on (the one of the largest samples read), once the estimator first ran;
        None before."""
        return self._batch

    def measure_baseline(self, *, target: str, config: str | None, timeout: float = 600.0,
                         meanwhile: Sequence[Plan] = ()) -> None:
        """On CPU, measure what a trial's process holds besides the tensors the estimator counts: one short trial of
        ``target`` at micro-batch 1, its peak (resident set net of file pages) less its estimate. Nothing on CUDA.
        While that trial runs (only its memory counts, not its speed), its plan and then ``meanwhile`` are traced.

        Micro-batch 1, although it takes a pass per sample: its blocks are small, so the resident set is the process
        and its tensors. At a middling micro-batch glibc serves blocks under its mmap threshold (up to 32 MiB) from
        its heap and keeps them resident after they are freed: a baseline measured there (123 MiB more on the test
        suite's hungry target at micro-batch 13) would shrink every plan's predicted room."""
        if self.device.type == "cuda":
            return
        from autotune._search.trial import TrialSpec, run_trial

        plan = Plan(micro_batch_size=1)

        def trace() -> None:
            for each in (plan, *meanwhile):
                self.tensors(each)

        result = run_trial(TrialSpec(target=target, config=config, plan=plan.to_dict(), budget=None, device="cpu",
                                     steps=1, warmup=1), timeout=timeout, while_running=trace)
        if result.status == "ok" and result.peak_bytes:
            self.calibrate(plan, result.peak_bytes)
        else:
            log.warning("autotune: the process baseline could not be measured (%s); using this process's memory "
                        "now", result.reason or result.status)

    def tensors(self, plan: Plan) -> int | None:
        """The estimator's peak of ``plan`` (tensor bytes); None when it cannot tell."""
        result = self._call(lambda traces: traces.at(plan.micro_batch_size or traces.size), plan)
        return None if result is _FAILED else result.predicted_peak_bytes

    def inert(self, plan: Plan) -> dict[str, str]:
        """The settings of ``plan`` that apply to nothing for the target (:mod:`autotune._estimate.inert`), each with
        why, from its step traced at one sample; empty when the estimator cannot tell."""
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
        return self._baseline_at(key, plan.micro_batch_size or math.inf)  # None: the whole batch

    def _baseline_at(self, key: str, micro: float) -> int:
        """Return shape ``key``'s baseline at ``micro``, interpolated between its own measurements.

        On CPU the points also hold the first baseline measured, at its micro-batch: the short run's at micro-batch 1,
        the process with few tensors, which any shape has below its own. On CUDA the context is an estimate, not a
        measurement, so a shape's own points are used alone. Beyond them the nearest below or above is taken, since
        much of a CUDA gap need not shrink with the micro-batch. A shape not measured takes the first baseline."""
        own = self._shape_baselines.get(key)
        if not own:
            return self.baseline
        return interpolated(own if self.device.type == "cuda" else {self._first_micro: self.baseline, **own}, micro)

    def _call(self, fn: Callable[[Any], Any], plan: Plan) -> Any:
        """``fn(traces)`` with the traces of ``plan``'s shape (the plan without its micro-batch), made once."""
        from autotune._estimate.estimate import longest_batch
        from autotune._estimate.trace import Traces

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
            if not self._warned:
                self._warned = True
                log.warning("autotune: the estimator cannot trace this target (%s: %s); %s",
                            type(err).__name__, " ".join(str(err).split())[:200], self.unestimated)
            return _FAILED

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
        whole batch when the estimator fails."""
        from autotune._estimate.result import largest_fitting

        self.baseline_for(plan)  # calibrates from the shape's measurements kept until now, before tracing
        key = shape_of(plan).key()

        def peak(traces: Any, m: int) -> int:
            return traces.at(m).predicted_peak_bytes + self._baseline_at(key, m)

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
