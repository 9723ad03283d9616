"""``micro_batch_size: auto`` resolved as the search resolves it, with public calls only, for
``search_quality.py``'s random search (which must meet the same ``auto`` choices as ours)."""

from __future__ import annotations

import sys
from typing import Any

from _common import current_host_bytes, first_batch

#: The ``micro_batch_size`` choice the search resolves with the estimator.
AUTO = "auto"


def plan_of(params: dict[str, Any], micro_batch_size: int | None) -> Any:
    """The plan of one point of a space (Optuna params); ``micro_batch_size`` replaces an ``auto`` choice."""
    from autotune import Plan

    values = dict(params)
    if values.get("micro_batch_size") == AUTO:
        values["micro_batch_size"] = micro_batch_size
    return Plan.from_dict(values)


class AutoMicro:
    """``micro_batch_size: auto`` resolved as the search resolves it, with public calls only: the largest
    micro-batch of the target's first batch whose ``autotune.estimate`` peak, plus a baseline, fits the budget.

    The baseline is what a trial's measured peak holds besides the tensors the estimator counts: on CPU a short run's
    peak less its estimate (:meth:`measure_baseline`, as the search does before its first trial), raised to the largest
    measured peak less that plan's estimate; on CUDA the estimate's context (``Estimate.context_bytes``), where the
    search starts. Each choice is kept until the baseline changes. When the
    estimator fails the choice is the whole batch; when one sample does not fit, 1.
    """

    def __init__(self, target: Any, device: str) -> None:
        self.target, self.device = target, device
        self.baseline = current_host_bytes() if device != "cuda" else 0  # CUDA: the context, once estimated
        self.calibrated = device == "cuda"  # on CPU, until a measured plan gives the baseline
        self._batch: Any = None
        self._choices: dict[str, int] = {}

    def _peak(self, plan: Any) -> int | None:
        """The predicted peak of ``plan`` in bytes (tensors only), or None when the estimator fails."""
        from autotune import estimate

        try:
            if self._batch is None:
                self._batch = first_batch(self.target)
            found = estimate(model=self.target.model, batch=self._batch, plan=plan, device=self.device)
            if self.device == "cuda":
                self.baseline = found.context_bytes
            return found.predicted_peak_bytes
        except Exception as err:  # the estimator is an aid, as in the search: the point is still measured
            print(f"estimator failed on {plan.describe()}: {type(err).__name__}: {err}", file=sys.stderr)
            return None

    def measure_baseline(self, target: str) -> None:
        """As the search starts on CPU: one short run at micro-batch 1 gives the baseline (its peak less its
        estimate)."""
        if self.device == "cuda":
            return
        from autotune import Plan, measure_plan

        plan = Plan(micro_batch_size=1)
        result = measure_plan(target=target, plan=plan, device=self.device, steps=1, warmup=1)
        if result.status == "ok" and result.peak_bytes:
            self.calibrate(plan, result.peak_bytes)

    def calibrate(self, plan: Any, measured_peak: int) -> None:
        """On CPU, raise the baseline to ``measured_peak`` less ``plan``'s estimate (forgetting earlier choices)."""
        if self.device == "cuda":
            return
        predicted = self._peak(plan)
        if predicted is None:
            return
        baseline = measured_peak - predicted
        if not self.calibrated or baseline > self.baseline:
            self.baseline, self.calibrated = baseline, True
            self._choices.clear()

    def resolve(self, params: dict[str, Any], budget_bytes: int, batch_size: int) -> int:
        """The micro-batch for the ``auto`` point ``params``: bisection over 1..``batch_size`` (the peak grows with
        the micro-batch) for the largest that fits, evened out as the search does (the same number of micro-batches
        of equal sizes). The search also learns a baseline per plan shape as it measures, which this does not."""
        plan = plan_of(params, None)
        key = plan.key()
        if key not in self._choices:
            largest = self._largest(plan, budget_bytes, batch_size)
            self._choices[key] = -(-batch_size // -(-batch_size // largest))
        return self._choices[key]

    def _largest(self, plan: Any, budget_bytes: int, batch_size: int) -> int:
        peaks: dict[int, int | None] = {}

        def fits(micro: int) -> bool | None:  # the baseline read after the estimate (on CUDA, the estimate sets it)
            if micro not in peaks:
                peaks[micro] = self._peak(plan.replace(micro_batch_size=micro))
            peak = peaks[micro]
            return None if peak is None else peak + self.baseline <= budget_bytes

        first = fits(1)
        if first is None:
            return batch_size
        if not first:
            return 1
        lo, hi = 1, batch_size + 1  # lo fits, hi does not (batch_size + 1 stands for "none larger")
        while hi - lo > 1:
            mid = (lo + hi) // 2
            ok = fits(mid)
            if ok is None:
                return batch_size
            lo, hi = (mid, hi) if ok else (lo, mid)
        return lo
