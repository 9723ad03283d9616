"""Steer a search with the step-time model as it goes.

The predicted best plan runs first (:func:`predicted_best_first`). Every measured trial calibrates the model and
records what it predicted (:func:`observe_trial`). The search stops once its measurements confirm the prediction
(:class:`StopWhenConfirmed`): no plan left unmeasured is predicted, even by the model's own error, to beat the best
measured one."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from autotune._compat.optuna import enqueued_params, fail_waiting
from autotune._plan.plan import Plan
from autotune._search.speed import modelled_dimensions

if TYPE_CHECKING:
    from autotune._plan.space import SearchSpace
    from autotune._search.speed import SearchSpeed

__all__ = ["CONTRADICTS", "GUIDED", "FollowWhatIsMeasured", "StopWhenConfirmed", "contradiction", "observe_trial",
           "predicted_best_first"]

log = logging.getLogger("autotune")

#: The model's error taken before two measured trials can tell it (each predicted from the others).
PRIOR_ERROR = 0.25
#: Measured trials a search takes at least before the model may stop it.
MIN_MEASURED = 2
#: The measured order of two trials contradicts the predicted one when each side is ahead by more than this share:
#: the model put one ahead, the measurements the other.
CONTRADICTS = 0.15
#: A queued trial's user attribute: its place in the first trials, which the step-time model ordered.
GUIDED = "guided"


def predicted_best_first(seeds: list[dict[str, Any]], guided: list[dict[str, Any]],
                         covering: list[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """The first trials: the predicted best (``guided[0]``, the fastest point predicted to fit) before the space's
    seeds, then ``covering`` (the predicted best of each precision: the choice the model is least sure of, one trial
    each so that the study's own trials correct it: ``residuals.py``), then the rest of ``guided``; each point once.

    Example:
        >>> predicted_best_first([{"m": 8}], [{"m": 32}, {"m": 8}, {"m": 16}])
        [{'m': 32}, {'m': 8}, {'m': 16}]
        >>> predicted_best_first([], [{"p": 32, "m": 32}, {"p": 32, "m": 16}], [{"p": 32, "m": 32}, {"p": 16, "m": 8}])
        [{'p': 32, 'm': 32}, {'p': 16, 'm': 8}, {'p': 32, 'm': 16}]
    """
    ordered = guided[:1] + seeds + list(covering) + guided[1:]
    return [p for i, p in enumerate(ordered) if p not in ordered[:i]]


def contradiction(study: Any) -> tuple[int, int] | None:
    """Two measured trials ``(a, b)`` whose measured order contradicts the order the model predicted for them before
    each ran: ``a`` predicted faster than ``b`` by more than :data:`CONTRADICTS`, ``b`` measured faster than ``a`` by
    more than that, beyond both runs' intervals; None when there are none.

    Example:
        >>> contradiction(study)  # doctest: +SKIP
        (0, 2)
    """
    from optuna.trial import TrialState

    measured = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                if t.user_attrs.get("source") == "measured" and t.user_attrs.get("status") == "ok"
                and t.user_attrs.get("samples_per_second") and t.user_attrs.get("predicted_samples_per_second")]
    for a in measured:
        for b in measured:
            pa, pb = a.user_attrs["predicted_samples_per_second"], b.user_attrs["predicted_samples_per_second"]
            low_b = (b.user_attrs.get("interval") or [b.user_attrs["samples_per_second"]])[0]
            high_a = (a.user_attrs.get("interval") or [0, a.user_attrs["samples_per_second"]])[1]
            if pa > (1 + CONTRADICTS) * pb and low_b > (1 + CONTRADICTS) * high_a:
                return a.number, b.number
    return None


class FollowWhatIsMeasured:
    """Optuna callback: once the measured order of two trials contradicts the model's (:func:`contradiction`), the
    first trials still queued stop following the model's first order. They are dropped (failed, ``status:
    dropped``: Optuna cannot take a trial off its queue otherwise) and as many points queued in their place, or one
    of each precision if more, ranked by the model as the study's trials have corrected it (``candidates(n)``: the
    fastest unmeasured point of each precision, then of all, predicted to fit, :mod:`residuals`); more than were
    dropped only as far as the study has trials left to run (``room(study)``). Once per study;
    the study records ``model_contradicted`` (the two trials, the points dropped and queued)."""

    def __init__(self, candidates: Callable[[int], list[dict[str, Any]]], *,
                 room: Callable[[Any], int] | None = None) -> None:
        self.candidates, self.room = candidates, room

    def __call__(self, study: Any, trial: Any) -> None:
        from optuna.trial import TrialState

        if "model_contradicted" in study.user_attrs:
            return
        pair = contradiction(study)
        if pair is None:
            return
        waiting = [t for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
                   if GUIDED in t.user_attrs]
        dropped = [enqueued_params(t) for t in waiting]
        for t in waiting:
            fail_waiting(study, t, {"status": "dropped",
                                    "reason": f"the model's first order was contradicted by trials {pair[0]} and "
                                              f"{pair[1]}"})
        queued = self.candidates(len(waiting))  # as many, or one of each precision if more
        if self.room is not None:  # but no more than the trials left to run, where more than were dropped
            queued = queued[:max(len(waiting), self.room(study))]
        for params in queued:  # a dropped point the corrected model still ranks is queued again
            study.enqueue_trial(params, user_attrs={GUIDED: -1})
        log.info("autotune: trials %d and %d measured in the other order than predicted; %d queued trial(s) re-ranked "
                 "by the model as the trials corrected it", pair[0], pair[1], len(waiting))
        study.set_user_attr("model_contradicted", {"trials": list(pair), "dropped": dropped, "queued": queued})


def observe_trial(trial: Any, plan: Plan, speed: SearchSpeed, samples_per_second: float | None) -> None:
    """Record what the model predicted for ``plan`` before its measurement (``predicted_samples_per_second``,
    ``predicted_bound``, ``model_error``: the error so far), then let the measurement calibrate it."""
    predicted = speed.predict(plan)
    if predicted is not None:
        trial.set_user_attr("predicted_samples_per_second", predicted.samples_per_second)
        trial.set_user_attr("predicted_bound", predicted.bound)
        trial.set_user_attr("calibrated_from", predicted.calibrated_from)
        if predicted.error is not None:
            trial.set_user_attr("model_error", predicted.error)
    if samples_per_second:
        speed.observe(plan, samples_per_second)


class StopWhenConfirmed:
    """Optuna callback: stop the study once the measurements confirm the model's choice.

    That is once at least :data:`MIN_MEASURED` trials measured a plan that fits, and no point of the space left
    unmeasured (its modelled dimensions; ``auto`` as it resolves) is predicted to fit and beat the best measured
    plan's throughput. The prediction allows for the model's error so far (:data:`PRIOR_ERROR` until two trials tell
    it). Waiting trials the model cannot rule out (variations in dimensions it does not rank, a precision no trial
    has measured, plans it cannot trace, the points queued once it was contradicted) keep the study going."""

    def __init__(self, *, space: SearchSpace, speed: SearchSpeed, best: Callable[[Any], float | None],
                 candidates: Callable[[set[str]], list[tuple[dict[str, Any], Plan]]],
                 key: Callable[[dict[str, Any]], str]) -> None:
        self.space, self.speed, self.best, self.candidates, self.key = space, speed, best, candidates, key
        self.names = set(modelled_dimensions(space))
        self.stopped = False

    def projection(self, params: dict[str, Any]) -> str:
        """A point's modelled dimensions, as a key."""
        return self.key({k: v for k, v in params.items() if k in self.names})


    def __call__(self, study: Any, trial: Any) -> None:
        from optuna.trial import TrialState

        measured = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                    if t.user_attrs.get("source") == "measured" and t.user_attrs.get("status") == "ok"]
        best = self.best(study)
        if len(measured) < MIN_MEASURED or best is None or self.stopped:
            return
        error = self.speed.error()
        margin = 1 + (PRIOR_ERROR if error is None or self.speed.model.calibration.trials < 2 else error)
        done = {self.projection(t.params) for t in measured}
        for _, plan in self.candidates(done)[:1]:  # the fastest predicted unmeasured point that fits
            predicted = self.speed.predict(plan)
            if predicted is None or predicted.samples_per_second * margin >= best:
                return  # it may still win
        precisions = {t.params.get("precision") for t in measured}
        for waiting in study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
            params = enqueued_params(waiting)
            if self.projection(params) in done and any(k not in self.names for k in params):
                return  # a variation of a measured plan in a dimension the model does not rank
            if "precision" in params and params["precision"] not in precisions:
                return  # a precision no trial measured: the model's least sure choice, queued to be measured
            if waiting.user_attrs.get(GUIDED) == -1:
                return  # queued once the model was contradicted: what it may rank wrongly, to be measured
        self.stopped = True
        log.info("autotune: stopping the search: no unmeasured plan is predicted to beat %.1f samples/s (model "
                 "error %s over %d trials)", best, "unknown" if error is None else f"{error:.0%}", len(measured))
        study.set_user_attr("stopped_by_model", {"best_samples_per_second": best, "model_error": error,
                                                 "measured": len(measured)})
        study.stop()


def unmeasured_candidates(space: SearchSpace, speed: SearchSpeed, *, done: set[str],
                          project: Callable[[dict[str, Any]], str], batch_size: int, devices: int,
                          resolve_micro: Callable[[dict[str, Any]], int], peak: Callable[[Plan], int | None],
                          budget_bytes: int, tensor_room: int) -> list[tuple[dict[str, Any], Plan]]:
    """The fastest predicted point of ``space`` that fits and whose projection is not in ``done`` (none when every
    point that fits is), with its plan (``auto`` resolved)."""
    from autotune._plan.space import AUTO, plan_for
    from autotune._search.speed import ranked_candidates

    found = ranked_candidates(space, limit=len(done) + 1, batch_size=batch_size, devices=devices,
                              cost=speed.seconds_per_sample, resolve_micro=resolve_micro, peak=peak,
                              budget_bytes=budget_bytes, tensor_room=tensor_room)
    for params in found:
        if project(params) not in done:
            micro = resolve_micro(params) if params.get("micro_batch_size") == AUTO else params.get("micro_batch_size")
            return [(params, plan_for(params, micro, devices))]
    return []


def stop_when_confirmed(runner: Any, *, space: SearchSpace, budget_bytes: int) -> StopWhenConfirmed:
    """The callback for a search's objective (``runner``: its speed model, estimator, ``auto`` and devices)."""
    from autotune._search.auto import point_key
    from autotune._search.choose import figures

    def best(study: Any) -> float | None:
        ranked = figures(study, budget_bytes)
        return ranked[0].samples_per_second if ranked else None

    def key(params: dict[str, Any]) -> str:
        return repr(point_key(params))

    def candidates(done: set[str]) -> list[tuple[dict[str, Any], Plan]]:
        return unmeasured_candidates(space, runner.speed, done=done, project=key,
                                     batch_size=runner.target_obj.batch_size(), devices=runner.devices,
                                     resolve_micro=runner.auto, peak=runner.estimator.peak, budget_bytes=budget_bytes,
                                     tensor_room=budget_bytes - runner.estimator.baseline)

    return StopWhenConfirmed(space=space, speed=runner.speed, best=best, candidates=candidates, key=key)


def chosen_prediction(trial: Any, speed: SearchSpeed, plan: Plan) -> dict[str, Any]:
    """The step-time model's prediction for the chosen plan as its trial recorded it before it ran, with the model's
    error so far on the target (a tuned file's provenance); empty when it was not predicted."""
    attrs = trial.user_attrs
    if not attrs.get("predicted_samples_per_second"):
        return {}
    now = speed.predict(plan)
    return {"samples_per_second": attrs["predicted_samples_per_second"], "bound": attrs.get("predicted_bound"),
            "device": now.device if now is not None else None, "world_size": speed.devices,
            "calibrated_from": attrs.get("calibrated_from", 0), "error": speed.error()}


def learn_speed(study: Any, speed: SearchSpeed, devices: int) -> None:
    """A resumed study's measured trials calibrate the model, as they did when they ran."""
    from autotune._plan.space import plan_for

    for t in study.get_trials(deepcopy=False):
        attrs = t.user_attrs
        if attrs.get("source") == "measured" and attrs.get("status") == "ok" and attrs.get("samples_per_second"):
            plan = plan_for(t.params, attrs.get("micro_batch_size"), devices, attrs.get("recompute"))
            speed.observe(plan, attrs["samples_per_second"])
