"""Choose the plan a search ends with, by paired comparisons, and keep the figures and ratios that chose it.

The leader by its trials' figures (``figures.py``: each plan's mean over its runs) is not simply taken: figures
measured minutes apart on a shared host compare the host's moments as much as the plans. The leader is compared in
paired rounds (``paired.py``: A B, B A, ... back to back, judged by each round's ratio) with each of its rivals: its
plain twin, halving's plan, the plans within reach, the fastest plan doing less work, trials stopped early that may
not be behind, and a plan measured only beside a busy host (:func:`rivals`). The winner of each comparison takes on
the next rival (:func:`_verdict`): a plan that adds work (recomputation, offload, low-bit state, features:
``cost.py``) wins only when its paired ratio says it is faster beyond noise. The progress line, ``autotune report``,
the plots and the tuned file's provenance all read the result from the study (``chosen``, with every decisive ratio
in ``paired``), so they name the same plan.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from autotune._device.budget import format_bytes
from autotune._search.cost import what_it_adds
from autotune._search.figures import (
    CHOSEN, REMEASURED, Figure, _fields, _simplicity, add_remeasured, chosen, combine, figures, over_budget_by,
    peak_noise, remeasured_runs, run_of, run_peak,
)
from autotune._search.paired import Ratio, compare

__all__ = ["CHOSEN", "REMEASURED", "Figure", "add_remeasured", "choose", "chosen", "combine", "figures",
           "no_fit_message", "over_budget_by", "peak_noise", "remeasured_runs", "rivals", "run_of", "run_peak",
           "simplest"]

#: The leader is compared with at most this many plans within reach, itself included.
REMEASURE_TOP = 3
#: A plan is within reach when its mean is within this share of the leader's (or their intervals overlap).
CONTENDER_WITHIN = 0.15
#: Rivals the leader (or the plan that beat it) is compared with at most: the search ends in bounded time.
MAX_RIVALS = 4
#: A leader with no rival measured once whose peak is within this share of the budget is measured again before it is
#: chosen: on the budget's edge, one run cannot tell how much the next (the user's) differs.
EDGE_SHARE = 0.01


def simplest(ranked: list[Figure]) -> Figure:
    """Of the plans that cannot be told apart from the best (``ranked[0]``: their intervals overlap its), the one that
    does the least work, then has the fewest features (``cost.simplicity``), then the best value: the choice where
    no paired comparison could be made."""
    best = ranked[0]
    equals = [f for f in ranked if f is best or f.overlaps(best)]
    return min(equals, key=lambda f: (f.simplicity(), -f.value))


def _stopped_early(study: Any, lead: Figure, budget_bytes: int) -> list[Any]:
    """Trials stopped early, within the budget, whose plan has no full run: those whose interval (their rate, if they
    have none) reaches the leader's, and the fastest that does less work than the leader (a busy host can slow every
    step of a short run, so a plan that adds work is chosen only over a comparison with the simpler one)."""
    from optuna.trial import TrialState

    full = {f.trial for f in figures(study, budget_bytes)}
    stopped = [t for t in study.get_trials(deepcopy=False, states=(TrialState.PRUNED,))
               if t.user_attrs.get("source") == "measured" and t.number not in full
               and t.user_attrs.get("samples_per_second")
               and (t.user_attrs.get("peak_bytes") or math.inf) <= budget_bytes]
    out = [t for t in stopped if (t.user_attrs.get("interval") or [None, math.inf])[1] >= lead.band()[0]]
    simpler = [t for t in stopped if t not in out
               and _simplicity(_fields(t.user_attrs.get("plan_key", ""))) < lead.simplicity()]
    if simpler:
        out.append(max(simpler, key=lambda t: t.user_attrs["samples_per_second"]))
    return out


def _by_key(ranked: list[Figure], key: str | None) -> Figure | None:
    fields = _fields(key) if key else None
    return next((f for f in ranked if fields is not None and f.fields == fields), None)


def rivals(study: Any, ranked: list[Figure], budget_bytes: int, *, twin: str | None = None,
           halving: str | None = None) -> list[tuple[str, Any]]:
    """The trials the leader (``ranked[0]``) is compared with in pairs, each with why, at most :data:`MAX_RIVALS`:
    its plain twin (the plan key ``twin``: the same plan without its work and features), halving's plan (``halving``),
    the plans within reach (mean within :data:`CONTENDER_WITHIN` of the leader's, or an interval that overlaps it),
    the fastest plan doing less work, trials stopped early that may not be behind, and the fastest plan measured only
    beside a busy host where the leader was not (its figure is the host's as much as its own)."""
    lead = ranked[0]
    found: list[tuple[str, Any]] = []
    for why, figure in (("its plain twin", _by_key(ranked, twin)), ("halving's plan", _by_key(ranked, halving))):
        if figure is not None:
            found.append((why, study.trials[figure.trial]))
    near = [f for f in ranked[1:] if f.overlaps(lead) or f.samples_per_second >= (1 - CONTENDER_WITHIN) * lead.value]
    found += [("within reach", study.trials[f.trial]) for f in near[:REMEASURE_TOP - 1]]
    simpler = [f for f in ranked if f.simplicity() < lead.simplicity()]
    if simpler:
        found.append(("does less work", study.trials[simpler[0].trial]))
    found += [("stopped early", t) for t in _stopped_early(study, lead, budget_bytes)]
    if not lead.busy:
        busy = [f for f in ranked[1:] if f.busy == len(f.runs)]
        if busy:
            found.append(("measured beside a busy host", study.trials[busy[0].trial]))
    seen, out = {lead.trial}, []
    for why, trial in found:
        if trial.number not in seen:
            seen.add(trial.number)
            out.append((why, trial))
    return out[:MAX_RIVALS]


def _verdict(incumbent: Figure, rival: Figure, ratio: Ratio, *, halving: int | None = None) -> tuple[bool, str]:
    """Whether ``rival`` replaces ``incumbent`` after their paired comparison (``ratio``: the rival's samples/s over
    the incumbent's, each scaled by what the budget's edge takes off), and why. A plan that adds work (or features)
    to the other wins only when faster beyond the comparison's noise; between plans that add the same (they differ
    in precision or micro-batch), the faster by the ratio, except against halving's plan (trial ``halving``: what the
    user has without a search), which another plan beats only when faster beyond noise."""
    mine, theirs = incumbent.simplicity(), rival.simplicity()
    if theirs < mine:
        if ratio.slower():
            return False, f"kept: it adds {', '.join(what_it_adds(incumbent.fields or {}, rival.fields or {})) or 'work'} and is faster beyond noise"
        return True, "replaced: as fast within noise or faster, and it does less work"
    if theirs > mine:
        if ratio.faster():
            return True, "replaced: it adds work or features and is faster beyond noise"
        return False, "kept: the other adds work or features and is not faster beyond noise"
    if not ratio.faster() and not ratio.slower() and halving in (incumbent.trial, rival.trial):
        if rival.trial == halving:
            return True, "replaced: halving's plan, and the other is not faster beyond noise"
        return False, "kept: halving's plan, and the other is not faster beyond noise"
    if ratio.ratio > 1:
        return True, "replaced: faster" + ("" if ratio.faster() else " (within noise)")
    return False, "kept: faster" + ("" if ratio.slower() else " (within noise)")


def choose(study: Any, budget_bytes: int, remeasure: Callable[[Any], dict[str, Any]], *, twin: str | None = None,
           halving: str | None = None) -> Figure | None:
    """The plan to choose: the leader by its trials' figures, compared in pairs with its rivals (:func:`rivals`;
    ``twin`` and ``halving`` are the plan keys of the leader's plain twin and of halving's plan), each comparison's
    winner (:func:`_verdict`) taking on the next rival; a leader with no rival measured once on the budget's edge
    (``EDGE_SHARE``) is measured again. The choice, its figures and every decisive ratio are stored in the study
    (``chosen``). ``remeasure(trial)`` measures the trial's plan once more and returns the run (:func:`run_of`).
    None when no plan fits."""
    ranked = figures(study, budget_bytes)
    if not ranked:
        return None
    lead = ranked[0]
    contest = rivals(study, ranked, budget_bytes, twin=twin, halving=halving)
    halving_figure = _by_key(ranked, halving)
    halving_trial = halving_figure.trial if halving_figure is not None else None
    if not contest and len(lead.runs) == 1 and lead.peak_bytes > (1 - EDGE_SHARE) * budget_bytes:
        add_remeasured(study, lead.trial, remeasure(study.trials[lead.trial]))  # two runs' spread is noise too
    champion, verdicts = lead.trial, []
    for why, trial in contest:
        if trial.number == champion:
            continue
        ratio = compare(study, study.trials[champion], trial, remeasure, keep=add_remeasured,
                        fits=lambda run: over_budget_by(*run_peak(run), budget_bytes) <= 0)
        now = {f.trial: f for f in figures(study, budget_bytes)}
        mine, theirs = now.get(champion), now.get(trial.number)
        if theirs is None:
            replaced, reason = False, "kept: the other did not fit or did not run in a comparison run"
        elif mine is None:
            replaced, reason = True, "replaced: it did not fit or did not run in a comparison run"
        else:
            ratio = ratio.scaled((theirs.value / theirs.samples_per_second) / (mine.value / mine.samples_per_second))
            replaced, reason = _verdict(mine, theirs, ratio, halving=halving_trial)
        verdicts.append({**ratio.as_attrs(), "why": why, "against": trial.user_attrs.get("plan", str(trial.params)),
                         "incumbent_plan": study.trials[champion].user_attrs.get("plan", "?"), "verdict": reason})
        champion = trial.number if replaced else champion
    ranked = figures(study, budget_bytes)
    if not ranked:
        return None
    final = {f.trial: f for f in ranked}
    chosen_figure = final[champion] if champion in final and verdicts else simplest(ranked)
    best = ranked[0]
    close = [v["against"] for v in verdicts if not Ratio.from_attrs(v).faster() and not Ratio.from_attrs(v).slower()
             and v["challenger"] != chosen_figure.trial and v["incumbent"] == chosen_figure.trial]
    attrs: dict[str, Any] = {**chosen_figure.as_attrs(), "within_noise_of": close, "paired": verdicts}
    if chosen_figure is not best:
        attrs["simpler_than"] = {**best.as_attrs(), "adds": what_it_adds(best.fields or {}, chosen_figure.fields or {})}
    study.set_user_attr(CHOSEN, attrs)
    return chosen_figure


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
