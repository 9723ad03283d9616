"""The search's use of the step-time model as it goes: the predicted best plan first, each measured trial recorded
against its prediction and calibrating the model, and the search stopped once the measurements confirm it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import optuna
import pytest
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

from autotune import Plan
from autotune._plan.space import Dimension, SearchSpace
from autotune._search.confirm import GUIDED, MIN_MEASURED, StopWhenConfirmed, observe_trial, predicted_best_first

SPACE = SearchSpace("t", "", (Dimension("micro_batch_size", (8, 16, 32)), Dimension("num_workers", (0, 1))))


def _study(measured: dict[int, float]) -> Any:
    """Measured trials of micro-batches at samples/s, every one fitting; ``study.stops`` records each stop."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize")
    study.stops = []
    study.stop = lambda: study.stops.append(True)  # type: ignore[method-assign]
    for micro, rate in measured.items():
        study.add_trial(optuna.trial.create_trial(
            params={"micro_batch_size": micro, "num_workers": 0},
            distributions={"micro_batch_size": CategoricalDistribution((8, 16, 32)),
                           "num_workers": CategoricalDistribution((0, 1))},
            value=rate, state=TrialState.COMPLETE,
            user_attrs={"plan": f"micro {micro}", "plan_key": str(micro), "status": "ok", "source": "measured",
                        "samples_per_second": rate, "interval": [rate * 0.98, rate * 1.02], "peak_bytes": 10}))
    return study


def _stopper(predicted: float, *, error: float | None, trials: int = 2,
             space: SearchSpace = SPACE) -> StopWhenConfirmed:
    """A stopper whose model predicts ``predicted`` samples/s for micro-batch 8 (the one point not measured)."""
    speed = SimpleNamespace(predict=lambda plan: SimpleNamespace(samples_per_second=predicted), error=lambda: error,
                            model=SimpleNamespace(calibration=SimpleNamespace(trials=trials)))

    def candidates(done: set[str]) -> list[tuple[dict[str, Any], Plan]]:
        return [] if "8" in done else [({"micro_batch_size": 8}, Plan(micro_batch_size=8))]

    def best(study: Any) -> float:
        return max(t.value for t in study.get_trials(states=(TrialState.COMPLETE,)))

    return StopWhenConfirmed(space=space, speed=speed, best=best, candidates=candidates,
                             key=lambda p: str(p.get("micro_batch_size")))  # type: ignore[arg-type]


def test_the_search_stops_once_no_unmeasured_plan_can_beat_the_best_by_the_models_error() -> None:
    study = _study({32: 100.0, 16: 90.0})
    _stopper(95.0, error=0.1)(study, None)  # 95 * 1.1 > 100: micro 8 may still win
    assert not study.stops
    stopper = _stopper(85.0, error=0.1)  # 85 * 1.1 < 100
    stopper(study, None)
    assert study.stops and stopper.stopped
    assert study.user_attrs["stopped_by_model"] == {"best_samples_per_second": 100.0, "model_error": 0.1,
                                                    "measured": 2}
    one = _study({32: 100.0})
    _stopper(10.0, error=0.1)(one, None)  # a single measurement confirms nothing
    assert MIN_MEASURED == 2 and not one.stops
    unknown = _study({32: 100.0, 16: 90.0})
    _stopper(85.0, error=None, trials=1)(unknown, None)  # before two trials tell the error, 25% is assumed
    assert not unknown.stops


def test_a_queued_variation_the_model_does_not_rank_keeps_the_search_going() -> None:
    study = _study({32: 100.0, 16: 90.0})
    study.enqueue_trial({"micro_batch_size": 32, "num_workers": 1})  # dataloader workers: not modelled
    _stopper(10.0, error=0.1)(study, None)
    assert not study.stops
    every = _study({32: 100.0, 16: 90.0, 8: 50.0})
    _stopper(10.0, error=0.1)(every, None)  # nothing left unmeasured
    assert every.stops


def test_a_queued_trial_of_a_precision_no_trial_measured_keeps_the_search_going() -> None:
    space = SearchSpace("t", "", (*SPACE.dimensions, Dimension("precision", ("32-true", "bf16-mixed"))))
    study = _study({32: 100.0, 16: 90.0})  # measured at the trial's default precision (no precision param: None)
    study.enqueue_trial({"micro_batch_size": 8, "precision": "bf16-mixed"})  # the model's least sure choice
    _stopper(10.0, error=0.1, space=space)(study, None)
    assert not study.stops
    study = _study({32: 100.0, 16: 90.0})
    study.enqueue_trial({"micro_batch_size": 8})  # the same point at a precision measured: ruled out by the model
    _stopper(10.0, error=0.1, space=space)(study, None)
    assert study.stops


def test_the_predicted_best_runs_before_the_seeds_and_each_trial_records_its_prediction() -> None:
    assert predicted_best_first([{"micro_batch_size": 8}], [{"micro_batch_size": 32}, {"micro_batch_size": 8},
                                                            {"micro_batch_size": 16}]) == [
        {"micro_batch_size": 32}, {"micro_batch_size": 8}, {"micro_batch_size": 16}]
    observed: list[tuple[Plan, float]] = []
    speed = SimpleNamespace(predict=lambda plan: SimpleNamespace(samples_per_second=120.0, bound="launch", error=0.2,
                                                                 calibrated_from=1),
                            observe=lambda plan, rate: observed.append((plan, rate)))
    trial = SimpleNamespace(attrs={}, set_user_attr=lambda k, v: trial.attrs.__setitem__(k, v))
    observe_trial(trial, Plan(micro_batch_size=32), speed, 100.0)  # type: ignore[arg-type]
    assert trial.attrs == {"predicted_samples_per_second": 120.0, "predicted_bound": "launch", "calibrated_from": 1,
                           "model_error": 0.2}
    assert observed == [(Plan(micro_batch_size=32), 100.0)]
    observe_trial(trial, Plan(micro_batch_size=16), speed, None)  # out of memory: nothing to calibrate with
    assert len(observed) == 1


def test_a_searchs_predictions_do_not_depend_on_what_was_traced_before() -> None:
    from pathlib import Path

    import torch

    from autotune import load_target
    from autotune._estimate.devices import KNOWN_DEVICES
    from autotune._search.memory import SearchEstimator
    from autotune._search.speed import SearchSpeed

    gpt = f"{Path(__file__).resolve().parents[2] / 'examples' / 'gpt' / 'train.py'}:make"

    def speed() -> SearchSpeed:
        return SearchSpeed(SearchEstimator(target=load_target(gpt), device=torch.device("cpu")), batch_size=32,
                           devices=1, speed=KNOWN_DEVICES["l4"])

    fresh, used = speed(), speed()
    used.estimator.tensors(Plan(micro_batch_size=2))  # the memory side traced micro-batch 2 first
    assert used.seconds_per_sample(Plan(micro_batch_size=32)) == fresh.seconds_per_sample(Plan(micro_batch_size=32))


def test_a_point_queued_once_the_model_was_contradicted_keeps_the_search_going() -> None:
    study = _study({32: 100.0, 16: 90.0})
    study.enqueue_trial({"micro_batch_size": 8}, user_attrs={GUIDED: -1})  # re-ranked by the corrected model
    _stopper(10.0, error=0.1)(study, None)  # the model rules it out: the model that was just shown wrong
    assert not study.stops
    first = _study({32: 100.0, 16: 90.0})
    first.enqueue_trial({"micro_batch_size": 8}, user_attrs={GUIDED: 2})  # the model's first order: ruled out
    _stopper(10.0, error=0.1)(first, None)
    assert first.stops
