"""Measure the leader's plain twin: before a plan that adds work or features is chosen, the same plan without them.

A search's best plan may add recomputation, offload, low-bit state or a feature (compile, dataloader workers, ...)
while its trials never measured it without them. Then the choice among equals may fall on a plainer, slower plan
while the leader without its additions was likely the fastest (docs/search.md gives an example). The twin keeps the
leader's precision and micro-batch (and any setting the cost model counts neither as work nor as a feature). It
takes each other searched dimension's plainest choice (``halving.plainest``). Measured once, it lets the choice among
equals (``choose.py``) weigh what the additions buy: a plan that adds them is chosen only when it is faster than its
twin beyond noise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from autotune._plan.space import AUTO, SearchSpace, plan_for
from autotune._search.choose import figures
from autotune._search.cost import FEATURES, WORK_FIELDS, simplicity
from autotune._search.halving import PINNED, plainest

__all__ = ["TWIN", "measure_twin", "twin_key", "twin_params"]

#: A trial's user attribute: the trial whose plain twin it measures.
TWIN = "plain_twin_of"


def twin_params(space: SearchSpace, params: dict[str, Any]) -> dict[str, Any]:
    """``params`` (a point of ``space``) with every searched work and feature dimension at its plainest choice.

    Example:
        >>> from autotune._plan.space import load_space
        >>> twin_params(load_space("cpu"), {"precision": "bf16-mixed", "micro_batch_size": "auto",
        ...                                 "activation_checkpointing": 0.5, "num_workers": 1})
        {'precision': 'bf16-mixed', 'micro_batch_size': 'auto', 'activation_checkpointing': 0.0, 'num_workers': 0}
    """
    out: dict[str, Any] = {}
    for dim in space.dimensions:
        if not dim.active(out):
            continue
        plain = dim.name in WORK_FIELDS or dim.name in FEATURES or dim.name not in params
        out[dim.name] = plainest(dim) if plain else params[dim.name]
    return out


def twin_key(study: Any, space: SearchSpace, *, budget_bytes: int, devices: int) -> str | None:
    """The plan key of the plain twin of the best plan so far (None when there is no plan, or it is plain): the plan
    the leader is compared with first (``choose.rivals``)."""
    ranked = figures(study, budget_bytes)
    if not ranked or ranked[0].fields is None or ranked[0].simplicity() == simplicity({}):
        return None
    lead = study.trials[ranked[0].trial]
    return plan_for(twin_params(space, lead.params), lead.user_attrs.get("micro_batch_size"), devices).key()


def measure_twin(study: Any, space: SearchSpace, *, budget_bytes: int, devices: int,
                 run_one: Callable[[], None], wait_seconds: float = 600.0) -> None:
    """Measure the plain twin of the best plan so far, where it adds work or features and the twin was not measured:
    one trial, ``run_one()`` after it is queued (trials queued before it run first). A twin another worker queued or
    runs is waited for (up to ``wait_seconds``), not measured twice."""
    import time

    from optuna.trial import TrialState

    ranked = figures(study, budget_bytes)
    if not ranked or ranked[0].fields is None or ranked[0].simplicity() == simplicity({}):
        return
    lead = study.trials[ranked[0].trial]
    micro = lead.user_attrs.get("micro_batch_size")
    params = twin_params(space, lead.params)
    key = plan_for(params, micro, devices).key()
    known = {t.user_attrs.get("plan_key") for t in study.get_trials(deepcopy=False)}
    def pending() -> bool:
        return any(t.user_attrs.get(TWIN) is not None
                   for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING, TrialState.RUNNING)))

    if key in known or key == lead.user_attrs.get("plan_key"):
        return
    if pending():  # another worker's: its figure comes with the study
        deadline = time.monotonic() + wait_seconds
        while pending() and time.monotonic() < deadline:
            time.sleep(0.5)
        return
    attrs: dict[str, Any] = {TWIN: lead.number}
    if params.get("micro_batch_size") == AUTO:
        attrs[PINNED] = micro  # the leader's own micro-batch, whatever 'auto' would resolve to now
    study.enqueue_trial(params, user_attrs=attrs)
    for _ in range(len(study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))):
        run_one()
        if not any(t.user_attrs.get(TWIN) is not None
                   for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,))):
            return
