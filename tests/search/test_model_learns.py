"""The step-time model learns from the study: its error by setting fitted from the trials, each precision measured
early, and first trials re-ranked once the measured order contradicts the predicted one. No trial process."""

from __future__ import annotations

from typing import Any

import optuna
import pytest
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

from autotune import Plan
from autotune._plan.space import Dimension, SearchSpace
from autotune._search.confirm import GUIDED, FollowWhatIsMeasured, contradiction, predicted_best_first
from autotune._search.residuals import Corrections
from autotune._search.speed import by_precision


def test_corrections_follow_the_setting_the_model_misprices_and_leave_the_rest() -> None:
    corrections = Corrections()
    # bf16 twice as fast as predicted at micro-batches 8 and 16; fp32 as predicted at both
    for precision, ratio in (("bf16-mixed", 2.0), ("32-true", 1.0)):
        for micro in (8, 16):
            corrections.add({"precision": precision, "micro_batch_size": micro}, measured_over_predicted=ratio)
    bf16 = corrections.factor({"precision": "bf16-mixed", "micro_batch_size": 32})
    fp32 = corrections.factor({"precision": "32-true", "micro_batch_size": 32})
    # shrunk towards none by two trials' evidence (and part of it taken as the micro-batches', which both had)
    assert 1.3 < bf16 < 2.0 and 0.8 < fp32 < 1.1 and bf16 / fp32 > 1.4
    assert corrections.factor({"precision": "16-true"}) == 1.0  # a choice no trial measured is not moved
    assert corrections.error() is not None and corrections.error() < 0.35  # each trial predicted from the others


def _space() -> SearchSpace:
    return SearchSpace("t", "", (Dimension("precision", ("32-true", "bf16-mixed")),
                                 Dimension("micro_batch_size", (8, 16, 32))))


def test_the_first_trials_measure_each_precision_s_predicted_best_after_the_predicted_best() -> None:
    subs = by_precision(_space())
    assert [next(d.choices for d in s.dimensions if d.name == "precision") for s in subs] == [
        ("32-true",), ("bf16-mixed",)]
    guided = [{"precision": "32-true", "micro_batch_size": 32}, {"precision": "32-true", "micro_batch_size": 16}]
    covering = [{"precision": "32-true", "micro_batch_size": 32}, {"precision": "bf16-mixed", "micro_batch_size": 32}]
    assert predicted_best_first([], guided, covering) == [guided[0], covering[1], guided[1]]
    one = SearchSpace("t", "", (Dimension("precision", ("bf16-mixed",)), Dimension("micro_batch_size", (8, 16))))
    assert by_precision(one) == []  # nothing to cover


def _study(rows: list[tuple[dict[str, Any], float, float]], waiting: list[dict[str, Any]]) -> Any:
    """Measured guided trials (params, predicted, measured samples/s) and guided trials still queued."""
    study = optuna.create_study(direction="maximize")
    dists = {"precision": CategoricalDistribution(["32-true", "bf16-mixed"]),
             "micro_batch_size": CategoricalDistribution([8, 16, 32])}
    for i, (params, predicted, measured) in enumerate(rows):
        study.add_trial(optuna.trial.create_trial(
            params=params, distributions=dists, state=TrialState.COMPLETE, value=measured,
            user_attrs={GUIDED: i, "source": "measured", "status": "ok", "samples_per_second": measured,
                        "interval": [0.97 * measured, 1.03 * measured], "predicted_samples_per_second": predicted,
                        "plan": Plan(**params).describe()}))
    for i, params in enumerate(waiting, start=len(rows)):
        study.enqueue_trial(params, user_attrs={GUIDED: i})
    return study


def test_a_contradicted_model_s_queued_first_trials_are_re_ranked_by_what_the_trials_taught_it() -> None:
    fp32_16 = {"precision": "32-true", "micro_batch_size": 16}
    bf16_16 = {"precision": "bf16-mixed", "micro_batch_size": 16}
    # predicted: fp32 at 500/s, bf16 at 200/s; measured the other way round, clear of both intervals
    study = _study([(fp32_16, 500.0, 450.0), (bf16_16, 200.0, 620.0)],
                   waiting=[{"precision": "32-true", "micro_batch_size": 8},
                            {"precision": "32-true", "micro_batch_size": 32}])
    assert contradiction(study) == (0, 1)
    asked: list[int] = []

    def candidates(count: int) -> list[dict[str, Any]]:
        asked.append(count)
        return [{"precision": "bf16-mixed", "micro_batch_size": 32}, {"precision": "bf16-mixed", "micro_batch_size": 8}]

    callback = FollowWhatIsMeasured(candidates)
    callback(study, study.trials[1])
    dropped = [t for t in study.get_trials() if t.state == TrialState.FAIL]
    assert [t.user_attrs["status"] for t in dropped] == ["dropped", "dropped"] and asked == [2]
    waiting = [t.system_attrs["fixed_params"] for t in study.get_trials(states=(TrialState.WAITING,))]
    assert waiting == candidates(2)
    record = study.user_attrs["model_contradicted"]
    assert record["trials"] == [0, 1] and len(record["dropped"]) == 2
    callback(study, study.trials[1])  # once per study
    assert len(study.get_trials(states=(TrialState.WAITING,))) == 2


@pytest.mark.parametrize(("room", "queued"), [(0, 0), (1, 1), (5, 2)])
def test_a_contradiction_with_nothing_queued_queues_no_more_than_the_trials_left(room: int, queued: int) -> None:
    study = _study([({"precision": "32-true", "micro_batch_size": 16}, 500.0, 450.0),
                    ({"precision": "bf16-mixed", "micro_batch_size": 16}, 200.0, 620.0)], waiting=[])
    points = [{"precision": "bf16-mixed", "micro_batch_size": 32}, {"precision": "32-true", "micro_batch_size": 8}]
    FollowWhatIsMeasured(lambda count: points, room=lambda s: room)(study, study.trials[1])
    waiting = [t.system_attrs["fixed_params"] for t in study.get_trials(states=(TrialState.WAITING,))]
    assert waiting == points[:queued]  # the search's --trials hold: halving's ladder runs what is left queued
    assert study.user_attrs["model_contradicted"]["queued"] == points[:queued]


@pytest.mark.parametrize("measured", [480.0, 210.0])
def test_an_order_the_measurements_confirm_or_cannot_tell_apart_is_no_contradiction(measured: float) -> None:
    study = _study([({"precision": "32-true", "micro_batch_size": 16}, 500.0, 450.0),
                    ({"precision": "bf16-mixed", "micro_batch_size": 16}, 200.0, measured)], waiting=[])
    assert contradiction(study) is None  # 480 vs 450: within 15%; 210: as predicted


def test_points_queued_after_a_contradiction_cover_each_precision_before_the_overall_ranking() -> None:
    from types import SimpleNamespace

    from autotune._search.search import _unmeasured

    def rate(p: dict[str, Any]) -> float:  # the corrected model: fp32 still ahead of every bf16 plan
        return (2.0 if p["precision"] == "32-true" else 1.0) * p["micro_batch_size"]

    def ranked(space: SearchSpace, limit: int) -> list[dict[str, Any]]:
        dims = {d.name: d.choices for d in space.dimensions}
        points = [{"precision": p, "micro_batch_size": m} for p in dims["precision"] for m in dims["micro_batch_size"]]
        return sorted(points, key=rate, reverse=True)[:limit]

    study = _study([({"precision": "32-true", "micro_batch_size": 32}, 500.0, 450.0),
                    ({"precision": "bf16-mixed", "micro_batch_size": 32}, 200.0, 620.0)], waiting=[])
    runner = SimpleNamespace(ranked=ranked)
    fp32_16, bf16_16 = {"precision": "32-true", "micro_batch_size": 16}, {"precision": "bf16-mixed", "micro_batch_size": 16}
    assert _unmeasured(study, runner, _space(), 1) == [fp32_16, bf16_16]  # one of each, though one was asked
    assert _unmeasured(study, runner, _space(), 3) == [fp32_16, bf16_16, {"precision": "32-true", "micro_batch_size": 8}]
    assert _unmeasured(study, runner, _space(), 0) == [fp32_16, bf16_16]
