"""Which plan a search chooses, and the figures that chose it.

Every measurement of a plan (its trial, and any re-measurement) is combined into one figure: the mean of the runs'
throughputs, with an interval of +- the larger of the runs' own precision (their 95% half-widths, combined) and half
the spread between runs (two processes of the same plan scatter more than one run's steps do). Before a plan is
declared best, the plans whose interval overlaps the leader's and whose mean is within 15% of it are measured
again (with the leader), up to ``REMEASURE_ROUNDS`` times; a plan fits when every run of it fitted with room for
its peak's noise (:func:`peak_noise`: a peak within it of the budget may be over it in the next run). The progress
line, ``autotune report``, the plots and the tuned file's provenance all read the result from the study
(``chosen``), so they name the same plan.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: The leader and at most this many plans in all are measured again when their intervals overlap.
REMEASURE_TOP = 3
#: A contender's mean is within this share of the leader's (a plan clearly behind on its mean is not re-run, however
#: wide the interval of a short trial).
CONTENDER_WITHIN = 0.15
#: Rounds of re-measurement at most (each round measures every overlapping contender once more).
REMEASURE_ROUNDS = 2
#: A leader measured once whose peak is within this share of the budget is measured again before it is chosen: on
#: the budget's edge, one run cannot tell whether the next (the user's) fits; two runs' spread is noise it must clear.
EDGE_SHARE = 0.01
#: The study's user attribute holding re-measurements: {"<trial number>": [run, ...]}.
REMEASURED = "remeasured"
#: The study's user attribute naming the chosen plan and its figures.
CHOSEN = "chosen"


@dataclass(frozen=True)
class Figure:
    """One plan's throughput over all its runs: the mean, a 95%-style interval, the runs, the largest peak."""

    trial: int  # the trial that measured the plan first
    plan: str
    samples_per_second: float
    low: float
    high: float
    runs: tuple[float, ...]
    peak_bytes: int

    def overlaps(self, other: Figure) -> bool:
        return self.high >= other.low and other.high >= self.low

    def as_attrs(self) -> dict[str, Any]:
        return {"trial": self.trial, "plan": self.plan, "samples_per_second": self.samples_per_second,
                "interval": [self.low, self.high], "runs": list(self.runs), "peak_bytes": self.peak_bytes}

    def describe(self) -> str:
        """``"812.4/s (+-2.1%, 3 runs)"``."""
        half = (self.high - self.low) / 2 / self.samples_per_second if self.samples_per_second else math.inf
        runs = f", {len(self.runs)} runs" if len(self.runs) > 1 else ""
        return f"{self.samples_per_second:.1f}/s (+-{half:.1%}{runs})"


def run_of(attrs: dict[str, Any]) -> dict[str, Any]:
    """A run's record from a trial's (or a re-measurement's) attributes."""
    return {k: attrs.get(k) for k in ("status", "samples_per_second", "interval", "peak_bytes", "peak_noise_bytes")}


def combine(runs: list[dict[str, Any]]) -> tuple[float, float, float]:
    """``(mean, low, high)`` of runs' samples/s: +- the larger of their combined half-widths and half their spread.

    Example:
        >>> combine([{"samples_per_second": 100.0, "interval": [98.0, 102.0]},
        ...          {"samples_per_second": 110.0, "interval": [108.0, 112.0]}])
        (105.0, 100.0, 110.0)
    """
    rates = [float(r["samples_per_second"]) for r in runs]
    mean = statistics.fmean(rates)
    halves = [(r["interval"][1] - r["interval"][0]) / 2 if r.get("interval") else rate  # unknown: as wide as it is
              for r, rate in zip(runs, rates)]
    within = math.sqrt(sum(h * h for h in halves)) / len(runs)
    half = max(within, (max(rates) - min(rates)) / 2)
    return mean, max(0.0, mean - half), mean + half  # a throughput is never below 0, however noisy its runs


def peak_noise(runs: list[dict[str, Any]]) -> int:
    """How much a plan's peak varies: the larger of its runs' spread and the largest variation between the steps of
    one run (0 when unknown).

    Example:
        >>> peak_noise([{"peak_bytes": 100, "peak_noise_bytes": 3}, {"peak_bytes": 105}])
        5
    """
    peaks = [r["peak_bytes"] for r in runs if r.get("peak_bytes")]
    spread = max(peaks) - min(peaks) if peaks else 0
    return max(spread, *(int(r.get("peak_noise_bytes") or 0) for r in runs))


def over_budget_by(peak: int, noise: int | None, budget_bytes: int) -> int:
    """Bytes a peak is over the budget once its noise is counted (<= 0: it fits with room for its noise); the one rule
    the choice, the trials' constraint and the report share.

    Example:
        >>> over_budget_by(95, 10, 100)
        5
    """
    return peak + (noise or 0) - budget_bytes


def remeasured_runs(study: Any) -> dict[str, list[dict[str, Any]]]:
    stored = study.user_attrs.get(REMEASURED, {})
    # Studies of earlier versions stored a bare samples/s per re-measurement.
    return {k: [r if isinstance(r, dict) else {"status": "ok", "samples_per_second": r} for r in v]
            for k, v in stored.items()}


def figures(study: Any, budget_bytes: int) -> list[Figure]:
    """Every distinct plan measured with every run fitting ``budget_bytes``, best first."""
    from optuna.trial import TrialState

    extra = remeasured_runs(study)
    by_plan: dict[str, list[Any]] = {}
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        if t.user_attrs.get("source") not in ("cache", "estimate"):
            by_plan.setdefault(t.user_attrs.get("plan_key", t.user_attrs.get("plan", str(t.params))), []).append(t)
    out = []
    for trials in by_plan.values():
        runs = [run for t in trials for run in (run_of(t.user_attrs), *extra.get(str(t.number), []))]
        peaks = [r.get("peak_bytes") for r in runs]
        if any(r.get("status") != "ok" or not r.get("samples_per_second") for r in runs):
            continue  # pruned, failed or out of memory in some run
        if peaks[0] is None or any(p is not None and p > budget_bytes for p in peaks):
            continue  # not known to fit, or over the budget in some run
        if over_budget_by(max(p or 0 for p in peaks), peak_noise(runs), budget_bytes) > 0:
            continue  # within its peak's noise of the budget: another run (the user's) may well be over it
        mean, low, high = combine(runs)
        first = trials[0]
        out.append(Figure(first.number, first.user_attrs.get("plan", str(first.params)), mean, low, high,
                          tuple(float(r["samples_per_second"]) for r in runs), max((p or 0) for p in peaks)))
    return sorted(out, key=lambda f: f.samples_per_second, reverse=True)


def choose(study: Any, budget_bytes: int, remeasure: Callable[[Any], dict[str, Any]]) -> Figure | None:
    """The best plan after measuring again the contenders whose intervals overlap the leader's, and a leader measured
    once on the budget's edge (``EDGE_SHARE``); the choice and its figures are stored in the study (``chosen``).
    ``remeasure(trial)`` measures the trial's plan once more and returns the run (see :func:`run_of`). None when no
    plan fits."""
    stored = remeasured_runs(study)
    for round_ in range(REMEASURE_ROUNDS):
        ranked = figures(study, budget_bytes)
        if not ranked:
            return None
        lead = ranked[0]
        contenders = [f for f in ranked[:REMEASURE_TOP] if f is lead or (
            f.overlaps(lead) and f.samples_per_second >= (1 - CONTENDER_WITHIN) * lead.samples_per_second)]
        edge = len(lead.runs) == 1 and lead.peak_bytes > (1 - EDGE_SHARE) * budget_bytes
        if len(contenders) == 1 and not edge:
            break
        for figure in contenders:
            if len(figure.runs) <= round_ + 1:  # each contender gets one more run per round
                stored.setdefault(str(figure.trial), []).append(remeasure(study.trials[figure.trial]))
                study.set_user_attr(REMEASURED, stored)
    ranked = figures(study, budget_bytes)
    if not ranked:
        return None
    best = ranked[0]
    close = [f.plan for f in ranked[1:REMEASURE_TOP] if f.overlaps(best)]
    study.set_user_attr(CHOSEN, {**best.as_attrs(), "within_noise_of": close})
    return best


def chosen(study: Any) -> dict[str, Any] | None:
    """What the search chose (``None`` before it has chosen): trial, plan, samples/s, interval, runs, peak."""
    return study.user_attrs.get(CHOSEN)
