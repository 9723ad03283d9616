"""Make sure a search ends with the plan that halving the micro-batch would find, measured: halving's floor.

So a search never ends with no plan, or with only slower ones, where halving finds one.

Halving (``find_executable_batch_size``'s recipe, with the effective batch kept) runs the plain plan at the whole
batch and halves the micro-batch while a run does not fit. The search's plain plan is its space's plainest point
(:func:`plain_point`). That is each dimension at the plan's default where the space offers it, else at the choice
that adds the least work and the fewest features (``cost.simplicity``), the first listed among equals.

After its trials the search walks that ladder (:func:`walk_ladder`). A rung its trials measured is answered: it
fits, done; over the budget or out of memory, the next rung; a crash, halving would crash too, done. The first rung
not answered is run as a trial, until a rung fits or micro-batch 1 does not. A rung the estimator predicts far over
the budget (more than 1.5x) is answered without running, as any plan is: on CPU nothing would stop it from taking
the host's memory. Which plan is chosen is the search's own rule (``choose.py``): halving's plan is one more candidate.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any

from autotune._plan.plan import Plan
from autotune._plan.space import AUTO, Dimension, SearchSpace, plan_for
from autotune._search.figures import over_budget_by, run_peak
from autotune._search.cost import simplicity

__all__ = ["PINNED", "RUNG", "halving_key", "ladder", "next_rung", "plain_point", "plainest", "walk_ladder"]

#: A trial's user attribute: the micro-batch of halving's ladder it measures.
RUNG = "halving_rung"
#: A trial's user attribute: the micro-batch its point's ``auto`` resolves to (a rung's, a plain twin's: twin.py).
PINNED = "pinned_micro_batch_size"
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Plan)}


def plainest(dim: Dimension) -> Any:
    """The dimension's plainest choice: the plan's default where the space offers it, else the choice that adds the
    least work and the fewest features (the first listed among equals)."""
    if _DEFAULTS.get(dim.name, object()) in dim.choices:
        return _DEFAULTS[dim.name]
    return min(dim.choices, key=lambda choice: simplicity({dim.name: choice}))  # min keeps the first of equals


def plain_point(space: SearchSpace) -> dict[str, Any]:
    """The space's plainest point, its micro-batch left out (the ladder sets it).

    Example:
        >>> from autotune._plan.space import load_space
        >>> plain_point(load_space("cpu"))
        {'precision': '32-true', 'activation_checkpointing': 0.0, 'num_workers': 0}
    """
    params: dict[str, Any] = {}
    for dim in space.dimensions:
        if dim.active(params) and dim.name != "micro_batch_size":
            params[dim.name] = plainest(dim)
    return params


def ladder(batch_size: int) -> list[int]:
    """Halving's micro-batches: the whole batch, halved down to 1.

    Example:
        >>> ladder(32), ladder(24)
        ([32, 16, 8, 4, 2, 1], [24, 12, 6, 3, 1])
    """
    rungs = [batch_size]
    while rungs[-1] > 1:
        rungs.append(rungs[-1] // 2)
    return rungs


def rung_params(space: SearchSpace, point: dict[str, Any], micro: int) -> tuple[dict[str, Any], int] | None:
    """The point's params at ``micro`` as the space can say it (the choice itself, else ``auto`` resolved to it),
    else at the largest micro-batch choice below it; None when the space has no micro-batch dimension."""
    dim = next((d for d in space.dimensions if d.name == "micro_batch_size"), None)
    if dim is None:
        return None
    if micro in dim.choices or AUTO in dim.choices:
        return {**point, "micro_batch_size": micro if micro in dim.choices else AUTO}, micro
    below = [c for c in dim.choices if isinstance(c, int) and c <= micro]
    return ({**point, "micro_batch_size": max(below)}, max(below)) if below else None


def _answers(study: Any, budget_bytes: int) -> dict[str, str]:
    """By plan key, what the study's trials measured: "fits", "over" (over the budget, out of memory) or "error"."""
    from optuna.trial import TrialState

    out: dict[str, str] = {}
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)):
        attrs = t.user_attrs
        key, status, peak = attrs.get("plan_key"), attrs.get("status"), attrs.get("peak_bytes")
        if key is None or status == "interrupted":
            continue
        if status == "error":
            out.setdefault(key, "error")
        elif status == "oom" or (peak is not None and over_budget_by(*run_peak(attrs), budget_bytes) > 0):
            # a run's projected peak over the budget (halving's run would land below it), or estimated far over
            out[key] = "over"
        elif status in ("ok", "pruned") and peak is not None:
            out.setdefault(key, "fits")
    return out


def _rungs(space: SearchSpace, batch_size: int, devices: int) -> Iterator[tuple[tuple[dict[str, Any], int], str]]:
    """Halving's ladder as rungs of the space (each micro-batch once) and their plans' keys, largest first."""
    point, seen = plain_point(space), set()
    for micro in ladder(batch_size):
        rung = rung_params(space, point, micro)
        if rung is None or rung[1] in seen:
            continue
        seen.add(rung[1])
        yield rung, plan_for(rung[0], rung[1], devices).key()


def next_rung(study: Any, space: SearchSpace, *, batch_size: int, budget_bytes: int,
              devices: int = 1) -> tuple[dict[str, Any], int] | None:
    """The params and micro-batch of the first rung of halving's ladder not measured yet; None once the ladder is
    answered. ``devices``: the ranks of each trial (a sharded plan carries them)."""
    answers = _answers(study, budget_bytes)
    for rung, key in _rungs(space, batch_size, devices):
        answer = answers.get(key)
        if answer is None:
            return rung
        if answer != "over":
            return None
    return None


def halving_key(study: Any, space: SearchSpace, *, batch_size: int, budget_bytes: int,
                devices: int = 1) -> str | None:
    """The plan key of halving's plan: the first rung of the ladder that fits (None when none was measured to fit)."""
    answers = _answers(study, budget_bytes)
    for _, key in _rungs(space, batch_size, devices):
        if answers.get(key) != "over":
            return key if answers.get(key) == "fits" else None
    return None


def walk_ladder(study: Any, space: SearchSpace, *, batch_size: int, budget_bytes: int, devices: int,
                run_one: Callable[[], None], wait_seconds: float = 600.0) -> None:
    """Measure halving's ladder until it is answered: ``run_one()`` trial at a time, the trials the search left queued
    first (in order: one may answer a rung), then the next rung, queued; at most as many times as there were trials
    queued and rungs. A rung another worker is running is waited for (up to ``wait_seconds``), not run twice."""
    from optuna.trial import TrialState

    queued = len(study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))
    for _ in range(queued + len(ladder(batch_size))):
        rung = next_rung(study, space, batch_size=batch_size, budget_bytes=budget_bytes, devices=devices)
        if rung is None:
            return
        params, micro = rung
        deadline = time.monotonic() + wait_seconds
        while _with_rung(study, micro, TrialState.RUNNING) and time.monotonic() < deadline:
            time.sleep(0.5)  # another worker's: its answer comes with the study
        if _with_rung(study, micro, TrialState.RUNNING, TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL):
            continue
        if not study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):  # a queue is run first, in order
            study.enqueue_trial(params, user_attrs={RUNG: micro, PINNED: micro})
        run_one()


def _with_rung(study: Any, micro: int, *states: Any) -> bool:
    return any(t.user_attrs.get(RUNG) == micro for t in study.get_trials(deepcopy=False, states=states))
