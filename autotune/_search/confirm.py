"""Steer a search with the step-time model as it goes.

The predicted best plan runs first (:func:`predicted_best_first`). Every measured trial calibrates the model and
records what it predicted (:func:`observe_trial`). The search stops once its measurements confirm the prediction
(:class:`StopWhenConfirmed`): no plan left unmeasured is predicted, even by the model's own error, to beat the best
measured one."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from autotune._compat.optuna import enqueued_params
from autotune._plan.plan import Plan
from autotune._search.speed import modelled_dimensions

if TYPE_CHECKING:
    from autotune._plan.space import SearchSpace
    from autotune._search.speed import SearchSpeed

__all__ = ["StopWhenConfirmed", "observe_trial", "predicted_best_first"]

log = logging.getLogger("autotune")

#: The model's error taken before two measured trials can tell it (each predicted from the others).
PRIOR_ERROR = 0.25
#: Measured trials a search takes at least before the model may stop it.
MIN_MEASURED = 2


def predicted_best_first(seeds: list[dict[str, Any]], guided: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The first trials: the predicted best (``guided[0]``, the fastest point predicted to fit) before the space's
    seeds, then the rest of ``guided``; each point once.

    Example:
        >>> predicted_best_first([{"m": 8}], [{"m": 32}, {"m": 8}, {"m": 16}])
        [{'m': 32}, {'m': 8}, {'m': 16}]
    """
    ordered = guided[:1] + seeds + guided[1:]
    return [p for i, p in enumerate(ordered) if p not in ordered[:i]]


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
    it). Waiting trials the model cannot rule out (variations in dimensions it does not rank, plans it cannot
    trace) keep the study going."""

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
        for waiting in study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
            params = enqueued_params(waiting)
            if self.projection(params) in done and any(k not in self.names for k in params):
                return  # a variation of a measured plan in a dimension the model does not rank
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
            plan = plan_for(t.params, attrs.get("micro_batch_size"), devices)
            speed.observe(plan, attrs["samples_per_second"])
