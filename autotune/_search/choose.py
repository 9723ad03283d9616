"""Choose the plan a search ends with, and keep the figures that chose it.

Every measurement of a plan (its trial, and any re-measurement) is combined into one figure: the mean of the runs'
throughputs, with an interval. The interval is +- the larger of the runs' own precision (their 95% half-widths,
combined) and half the spread between runs (two processes of the same plan scatter more than one run's steps do). A
plan fits when no run of it peaked over the budget. One whose peak's noise reaches the budget is ranked by the
throughput a run of it can be expected to give (``edge.py``).

Before a plan is declared best, some plans are measured again, up to ``REMEASURE_ROUNDS`` times. These are the plans
whose interval overlaps the leader's and whose mean is within 15% of it (with the leader). So is the fastest plan
that does less work than a leader which adds work (recomputation, offload, low-bit state, features: ``cost.py``). A
trial stopped early whose interval is not clear of the leader's is measured in full.
Of the plans that cannot be told apart from the best (their intervals overlap), the simplest is chosen
(:func:`simplest`): a plan that adds work is chosen only when it is faster beyond noise. The progress line,
``autotune report``, the plots and the tuned file's provenance all read the result from the study (``chosen``), so
they name the same plan.
"""

from __future__ import annotations

import json
import math
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autotune._device.budget import format_bytes
from autotune._search.cost import simplicity, what_it_adds
from autotune._search.edge import expected_throughput, fallback_micro, fallback_rate, overflow_chance

#: The leader and at most this many plans in all are measured again when their intervals overlap.
REMEASURE_TOP = 3
#: A contender's mean is within this share of the leader's (a plan clearly behind on its mean is not re-run, however
#: wide the interval of a short trial).
CONTENDER_WITHIN = 0.15
#: Rounds of re-measurement at most (each round measures every overlapping contender once more).
REMEASURE_ROUNDS = 2
#: A leader measured once whose peak is within this share of the budget is measured again before it is chosen: on
#: the budget's edge, one run cannot tell how much the next (the user's) differs; two runs' spread is noise too.
EDGE_SHARE = 0.01
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
                "expected_samples_per_second": self.value, "overflow_chance": self.overflow_chance,
                "fallback_samples_per_second": self.fallback}

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
        if not timed or peaks[0] is None or any(over_budget_by(r["peak_bytes"], r.get("peak_noise_bytes"),
                                                               budget_bytes) > 0 for r in runs if r.get("peak_bytes")):
            continue  # stopped early in every run, not known to fit, or every step of a run over: overflows often
        mean, low, high = combine(timed)
        first = trials[0]
        peak = max(p or 0 for p in peaks)
        out.append(Figure(first.number, first.user_attrs.get("plan", str(first.params)), mean, low, high,
                          tuple(float(r["samples_per_second"]) for r in timed), peak,
                          overflow_chance=overflow_chance(peak, peak_noise(runs), budget_bytes), fields=_fields(key)))
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


def simplest(ranked: list[Figure]) -> Figure:
    """Of the plans that cannot be told apart from the best (``ranked[0]``: their intervals overlap its), the one that
    does the least work, then has the fewest features (``cost.simplicity``), then the best value."""
    best = ranked[0]
    equals = [f for f in ranked if f is best or f.overlaps(best)]
    return min(equals, key=lambda f: (f.simplicity(), -f.value))


def _reopened(study: Any, lead: Figure, budget_bytes: int, stored: dict[str, list[Any]]) -> list[Any]:
    """Pick the trials stopped early, within the budget and never measured again, to measure in full.

    These are the trials whose interval (their rate, if they have none) is not clear of the leader's: the picture
    that stopped them has changed. Also the fastest that does less work than the leader: a busy host can slow every
    step of a short run, so a plan that adds work is chosen only over a full measurement of the simpler one. At most
    ``REMEASURE_TOP``."""
    from optuna.trial import TrialState

    stopped = [t for t in study.get_trials(deepcopy=False, states=(TrialState.PRUNED,))
               if t.user_attrs.get("source") == "measured" and str(t.number) not in stored
               and t.user_attrs.get("samples_per_second")
               and (t.user_attrs.get("peak_bytes") or math.inf) <= budget_bytes]
    out = [t for t in stopped if (t.user_attrs.get("interval") or [None, math.inf])[1] >= lead.band()[0]]
    simpler = [t for t in stopped if t not in out
               and _simplicity(_fields(t.user_attrs.get("plan_key", ""))) < lead.simplicity()]
    if simpler:
        out.append(max(simpler, key=lambda t: t.user_attrs["samples_per_second"]))
    return out[:REMEASURE_TOP]


def choose(study: Any, budget_bytes: int, remeasure: Callable[[Any], dict[str, Any]]) -> Figure | None:
    """The plan to choose after measuring again the contenders (see the module's docstring) and a leader measured
    once on the budget's edge (``EDGE_SHARE``); the choice and its figures are stored in the study (``chosen``).
    ``remeasure(trial)`` measures the trial's plan once more and returns the run (see :func:`run_of`). None when no
    plan fits."""
    for round_ in range(REMEASURE_ROUNDS):
        ranked = figures(study, budget_bytes)
        if not ranked:
            return None
        lead = ranked[0]
        contenders = [f for f in ranked[:REMEASURE_TOP] if f is lead or (
            f.overlaps(lead) and f.samples_per_second >= (1 - CONTENDER_WITHIN) * lead.samples_per_second)]
        # a leader that adds work must beat the fastest plan doing less by more than two runs' noise
        simpler = [f for f in ranked if f.simplicity() < lead.simplicity()]
        if simpler and simpler[0] not in contenders and min(len(lead.runs), len(simpler[0].runs)) < 2:
            contenders.append(simpler[0])
        reopened = [] if round_ else _reopened(study, lead, budget_bytes, remeasured_runs(study))
        edge = len(lead.runs) == 1 and lead.peak_bytes > (1 - EDGE_SHARE) * budget_bytes
        if len(contenders) == 1 and not edge and not reopened:
            break
        for trial in [study.trials[f.trial] for f in contenders if len(f.runs) <= round_ + 1] + reopened:
            if _measured_this_round(study, trial, round_, reopened=trial in reopened):
                continue  # another worker choosing at the same time has measured it
            add_remeasured(study, trial.number, remeasure(trial))  # one more run a round
    ranked = figures(study, budget_bytes)
    if not ranked:
        return None
    best, chosen_figure = ranked[0], simplest(ranked)
    close = [f.plan for f in ranked[:REMEASURE_TOP]  # the best, where it is not the choice, is named on its own
             if f is not chosen_figure and f is not best and f.overlaps(chosen_figure)]
    attrs: dict[str, Any] = {**chosen_figure.as_attrs(), "within_noise_of": close}
    if chosen_figure is not best:
        attrs["simpler_than"] = {**best.as_attrs(), "adds": what_it_adds(best.fields or {}, chosen_figure.fields or {})}
    study.set_user_attr(CHOSEN, attrs)
    return chosen_figure


def _measured_this_round(study: Any, trial: Any, round_: int, *, reopened: bool) -> bool:
    """Whether the study already holds this round's run of ``trial``'s plan (a re-measured contender has more than
    ``round_ + 1`` runs; a reopened trial any re-measurement), as another worker's choice adds them."""
    extra = remeasured_runs(study).get(str(trial.number), [])
    timed = [r for r in extra if r.get("status") == "ok" and r.get("samples_per_second")]
    return bool(extra) if reopened else 1 + len(timed) > round_ + 1


def chosen(study: Any) -> dict[str, Any] | None:
    """What the search chose (``None`` before it has chosen): trial, plan, samples/s, interval, runs, peak, and where
    it was chosen over a faster-measured plan that adds work, that plan (``simpler_than``)."""
    return study.user_attrs.get(CHOSEN)


def no_fit_message(study: Any, budget: str, budget_bytes: int) -> str:
    """Why no plan was chosen: the smallest peak seen and its plan, or why nothing was measured."""
    from optuna.trial import TrialState

    seen = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
            if t.user_attrs.get("peak_bytes")]
    head = f"no plan fits in {budget} ({format_bytes(budget_bytes)})"
    if not seen:
        failed = study.get_trials(deepcopy=False, states=(TrialState.FAIL,))
        if failed:
            last = failed[-1].user_attrs.get("reason", "no reason recorded")
            if not any(t.user_attrs.get("status") == "oom" for t in study.get_trials(deepcopy=False)):
                return (f"no plan could be measured: {len(failed)} trial(s) failed, none for memory, the last with "
                        f"{last}")
            return f"{head}; no trial measured a peak: {len(failed)} failed, the last with {last}"
        return f"{head}; no trial measured a peak (see `autotune report` for the reasons)"
    smallest = min(seen, key=lambda t: t.user_attrs["peak_bytes"])
    return (f"{head}; smallest peak seen {format_bytes(smallest.user_attrs['peak_bytes'])} with "
            f"{smallest.user_attrs.get('plan', smallest.params)} (trial {smallest.number})")
