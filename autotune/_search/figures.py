"""A plan's figure over all its runs: the measurements a search chooses from.

Every measurement of a plan (its trial, any re-measurement, its runs in paired comparisons) is combined into one
figure: the mean of the runs' throughputs, with an interval. The interval is +- the larger of the runs' own precision
(their 95% half-widths, combined) and half the spread between runs (two processes of the same plan scatter more than
one run's steps do). A plan fits when no run's projected peak over a training run (``growth.py``: the trial's peak
with the creep its steps show) is over the budget beyond its noise. One whose peak's noise reaches the budget is
ranked by the throughput a run of it can be expected to give (``edge.py``).
"""

from __future__ import annotations

import json
import math
import statistics
import time
import uuid
from dataclasses import dataclass
from typing import Any

from autotune._device.load import busy
from autotune._search.cost import simplicity
from autotune._search.edge import expected_throughput, fallback_micro, fallback_rate, overflow_chance

__all__ = ["CHOSEN", "REMEASURED", "Figure", "add_remeasured", "chosen", "combine", "figures", "over_budget_by",
           "peak_noise", "remeasured_runs", "run_of", "run_peak"]

#: Each re-measurement is a study user attribute of its own, ``remeasured:<trial number>:<when>-<id>``: workers that
#: choose at once add runs side by side (one attribute holding them all lost a worker's runs to the next one's
#: write). Studies of earlier versions hold them all in the attribute ``remeasured``: {"<trial number>": [run, ...]}.
REMEASURED = "remeasured"
#: The study's user attribute naming the chosen plan and its figures.
CHOSEN = "chosen"
_SIMPLEST_UNKNOWN = (math.inf, math.inf)  # a trial of an older version without its plan's key: never the simpler


@dataclass(frozen=True)
class Figure:
    """One plan's throughput over all its runs: the mean, a 95%-style interval, the runs, the largest peak; and what
    a run of it can be expected to give (``expected``: less than the mean where its peak's noise reaches the budget,
    which a run overflows with ``overflow_chance``)."""

    trial: int  # the trial that measured the plan first
    plan: str
    samples_per_second: float
    low: float
    high: float
    runs: tuple[float, ...]
    peak_bytes: int
    expected: float = math.nan  # nan: the mean
    overflow_chance: float = 0.0
    fallback: float | None = None  # samples/s at the fallback micro-batch, where it counts (overflow_chance > 0)
    fields: dict[str, Any] | None = None  # the plan's dict form (None: not recorded)
    busy: int = 0  # how many of its timed runs ran beside a busy host (autotune._device.load.busy)
    run_peak_bytes: int = 0  # the largest peak a training run of it is projected to reach (growth.py)

    @property
    def value(self) -> float:
        """What ranks the plan: the samples/s a run can be expected to give."""
        return self.samples_per_second if math.isnan(self.expected) else self.expected

    def band(self) -> tuple[float, float]:
        """The interval on the scale of :attr:`value`."""
        scale = self.value / self.samples_per_second if self.samples_per_second else 1.0
        return self.low * scale, self.high * scale

    def overlaps(self, other: Figure) -> bool:
        (low, high), (other_low, other_high) = self.band(), other.band()
        return high >= other_low and other_high >= low

    def simplicity(self) -> tuple[float, float]:
        return _simplicity(self.fields)

    def as_attrs(self) -> dict[str, Any]:
        return {"trial": self.trial, "plan": self.plan, "samples_per_second": self.samples_per_second,
                "interval": [self.low, self.high], "runs": list(self.runs), "peak_bytes": self.peak_bytes,
                "run_peak_bytes": self.run_peak_bytes or self.peak_bytes,
                "expected_samples_per_second": self.value, "overflow_chance": self.overflow_chance,
                "fallback_samples_per_second": self.fallback, "busy_runs": self.busy}

    def describe(self) -> str:
        """``"812.4/s (+-2.1%, 3 runs)"``."""
        half = (self.high - self.low) / 2 / self.samples_per_second if self.samples_per_second else math.inf
        runs = f", {len(self.runs)} runs" if len(self.runs) > 1 else ""
        return f"{self.samples_per_second:.1f}/s (+-{half:.1%}{runs})"


def run_of(attrs: dict[str, Any]) -> dict[str, Any]:
    """A run's record from a trial's (or a re-measurement's) attributes."""
    return {k: attrs.get(k) for k in ("status", "samples_per_second", "interval", "peak_bytes", "peak_noise_bytes",
                                      "run_peak_bytes", "run_noise_bytes", "load")}


def run_peak(run: dict[str, Any]) -> tuple[int, int | None]:
    """A run's peak as a training run of its plan is projected to reach it, and its noise (``growth.py``); a run
    recorded without the projection (an earlier version's) gives its own peak and its steps' spread.

    Example:
        >>> run_peak({"peak_bytes": 100, "peak_noise_bytes": 4}), run_peak({"peak_bytes": 100, "run_peak_bytes": 103})
        ((100, 4), (103, None))
    """
    if run.get("run_peak_bytes"):
        return int(run["run_peak_bytes"]), run.get("run_noise_bytes")
    return int(run.get("peak_bytes") or 0), run.get("peak_noise_bytes")


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
    """How much a plan's projected peak varies: the larger of its runs' spread and the largest scatter of the steps
    of one run (0 when unknown).

    Example:
        >>> peak_noise([{"peak_bytes": 100, "peak_noise_bytes": 3}, {"peak_bytes": 105}])
        5
    """
    projected = [run_peak(r) for r in runs if r.get("peak_bytes")]
    peaks = [p for p, _ in projected]
    spread = max(peaks) - min(peaks) if peaks else 0
    return max(spread, *(int(n or 0) for _, n in projected), 0)


def over_budget_by(peak: int, noise: int | None, budget_bytes: int) -> int:
    """Bytes a run's peak is over the budget beyond the spread of its steps' peaks (``noise``, None: unknown, 0); > 0:
    every timed step of the run was over, so the plan overflows at once, often, and does not fit. The one rule the
    choice, the trials' constraint, halving's ladder and the report share; a plan whose peak is within its noise of
    the budget, either side, fits at a cost (``edge.py``).

    Example:
        >>> over_budget_by(95, None, 100), over_budget_by(101, 2, 100), over_budget_by(101, None, 100)
        (-5, -1, 1)
    """
    return peak - (noise or 0) - budget_bytes


def remeasured_runs(study: Any) -> dict[str, list[dict[str, Any]]]:
    """Every re-measurement in ``study``, by trial number (as text), in the order they were made."""
    attrs = study.user_attrs
    # Studies of earlier versions held every run in one attribute, some as a bare samples/s.
    runs = {k: [r if isinstance(r, dict) else {"status": "ok", "samples_per_second": r} for r in v]
            for k, v in attrs.get(REMEASURED, {}).items()}
    for key in sorted(k for k in attrs if k.startswith(REMEASURED + ":")):
        runs.setdefault(key.split(":")[1], []).append(attrs[key])
    return runs


def add_remeasured(study: Any, trial: int, run: dict[str, Any]) -> None:
    """Store ``run``, one more measurement of trial ``trial``'s plan, beside any other worker's (:data:`REMEASURED`)."""
    study.set_user_attr(f"{REMEASURED}:{trial}:{time.time_ns():020d}-{uuid.uuid4().hex[:8]}", run)


def _measured_by_plan(study: Any) -> dict[str, list[Any]]:
    """The trials that ran each plan (stopped early ones included), by plan key."""
    from optuna.trial import TrialState

    by_plan: dict[str, list[Any]] = {}
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
        if t.user_attrs.get("source") not in ("cache", "estimate"):
            by_plan.setdefault(t.user_attrs.get("plan_key", t.user_attrs.get("plan", str(t.params))), []).append(t)
    return by_plan


def _simplicity(fields: dict[str, Any] | None) -> tuple[float, float]:
    return _SIMPLEST_UNKNOWN if fields is None else simplicity(fields)


def _fields(key: str) -> dict[str, Any] | None:
    try:
        fields = json.loads(key)
    except ValueError:
        return None  # a trial of an older version, keyed by its description
    return fields if isinstance(fields, dict) else None


def figures(study: Any, budget_bytes: int) -> list[Figure]:
    """Every distinct plan with a full measurement and no run over ``budget_bytes``, best first (by the samples/s a
    run can be expected to give). A run stopped early counts for its peak, not for its throughput."""
    extra = remeasured_runs(study)
    out = []
    for key, trials in _measured_by_plan(study).items():
        runs = [run for t in trials for run in (run_of(t.user_attrs), *extra.get(str(t.number), []))]
        if any(r.get("status") not in ("ok", "pruned") for r in runs):
            continue  # failed or out of memory in some run
        timed = [r for r in runs if r.get("status") == "ok" and r.get("samples_per_second")]
        peaks = [r.get("peak_bytes") for r in runs]
        if not timed or peaks[0] is None or any(over_budget_by(*run_peak(r), budget_bytes) > 0
                                                for r in runs if r.get("peak_bytes")):
            continue  # stopped early in every run, not known to fit, or a run projected over: overflows often
        mean, low, high = combine(timed)
        first = trials[0]
        peak = max(p or 0 for p in peaks)
        projected = max(run_peak(r)[0] for r in runs if r.get("peak_bytes"))
        out.append(Figure(first.number, first.user_attrs.get("plan", str(first.params)), mean, low, high,
                          tuple(float(r["samples_per_second"]) for r in timed), peak,
                          overflow_chance=overflow_chance(projected, peak_noise(runs), budget_bytes),
                          fields=_fields(key), busy=sum(busy(r.get("load")) for r in timed),
                          run_peak_bytes=projected))
    return sorted(_expected(out, study), key=lambda f: f.value, reverse=True)


def _expected(found: list[Figure], study: Any) -> list[Figure]:
    """``found`` with the samples/s a run can be expected to give, where a plan's peak's noise reaches the budget
    (``edge.py``): at half its micro-batch the runs' mean where the search measured it, else the cost model's."""
    from dataclasses import replace

    from autotune._plan.plan import Plan

    batch_size = int(study.user_attrs.get("batch_size") or 0)
    device = study.user_attrs.get("device", "cpu")
    by_key = {json.dumps(f.fields, sort_keys=True): f for f in found if f.fields is not None}
    out = []
    for f in found:
        if f.overflow_chance <= 0 or f.fields is None or not batch_size:
            out.append(f)
            continue
        plan = Plan.from_dict(f.fields)
        half = plan.replace(micro_batch_size=fallback_micro(plan.micro_batch_size, batch_size))
        if half.key() == plan.key():  # nothing smaller: a CUDA run that overflows at the minimum ends
            out.append(replace(f, expected=f.samples_per_second * (1 - f.overflow_chance) if device == "cuda"
                               else f.samples_per_second))
            continue
        measured = by_key.get(half.key())
        rate = fallback_rate(plan, f.samples_per_second, batch_size=batch_size, device_type=device,
                             measured=measured.samples_per_second if measured else None)
        out.append(replace(f, fallback=rate, expected=expected_throughput(
            f.samples_per_second, f.overflow_chance, rate, hard_cap=device == "cuda")))
    return out


def chosen(study: Any) -> dict[str, Any] | None:
    """What the search chose (``None`` before it has chosen): trial, plan, samples/s, interval, runs, peak, and where
    it was chosen over a faster-measured plan that adds work, that plan (``simpler_than``)."""
    return study.user_attrs.get(CHOSEN)
