"""Halving's floor (``autotune/_search/halving.py``, issue 47): wherever halving the micro-batch of the plain plan finds
one that fits, the search ends with that plan measured, so it finds a plan, at least as fast. The ladder's rules on
synthetic study records, then one CPU search whose only trial runs out of memory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
import pytest

from autotune import Plan
from autotune._plan.space import Dimension, SearchSpace, load_space, plan_from_params
from autotune._search.halving import RUNG, next_rung, plain_point, walk_ladder
from autotune._search.search import search
from tests.search.test_search import FAST, FIXTURE, one_point_space

BUDGET = 100


def test_the_plain_point_takes_each_dimension_s_plainest_choice() -> None:
    assert plain_point(load_space("default")) == {
        "precision": "32-true", "activation_checkpointing": 0.0, "activation_offload": False,
        "optimizer_offload": False, "optimizer_state": "full", "compile": False, "float8": False,
        "expandable_segments": False, "num_workers": 0}
    space = SearchSpace("s", "", (
        Dimension("precision", ("bf16-mixed", "16-mixed")), Dimension("micro_batch_size", (8, 16)),
        Dimension("activation_checkpointing", (1.0, 0.5, 0.0)), Dimension("num_workers", (2, 0)),
        Dimension("optimizer_state", ("8bit", "4bit")), Dimension("compile", (True, False))))
    # no plan default among the precisions: the first; otherwise the default, or the least work and features
    assert plain_point(space) == {"precision": "bf16-mixed", "activation_checkpointing": 0.0, "num_workers": 0,
                                  "optimizer_state": "8bit", "compile": False}


def _space(*micro: Any) -> SearchSpace:
    return SearchSpace("s", "", (Dimension("precision", ("32-true",)), Dimension("micro_batch_size", micro)))


def _record(study: Any, micro: int, status: str, peak: int | None, source: str = "measured", noise: int = 0) -> None:
    params = {"precision": "32-true", "micro_batch_size": micro}
    dists = {"precision": optuna.distributions.CategoricalDistribution(["32-true"]),
             "micro_batch_size": optuna.distributions.CategoricalDistribution(["auto", 1, 2, 4, 8, 16, 32, 64])}
    study.add_trial(optuna.trial.create_trial(
        params=params, distributions=dists, value=1.0,
        user_attrs={"plan_key": plan_from_params(params).key(), "status": status, "peak_bytes": peak,
                    "source": source, "peak_noise_bytes": noise}))


def test_the_ladder_halves_from_the_whole_batch_and_stops_where_a_rung_fits_or_fails() -> None:
    study = optuna.create_study()
    space = _space("auto", 4, 8, 16, 32)
    assert next_rung(study, space, batch_size=32, budget_bytes=BUDGET) == (
        {"precision": "32-true", "micro_batch_size": 32}, 32)
    _record(study, 32, "ok", BUDGET + 3, noise=2)  # every step over the budget: the next rung
    _record(study, 16, "oom", None, source="estimate")  # estimated far over: answered as over, not run
    assert next_rung(study, space, batch_size=32, budget_bytes=BUDGET) == (
        {"precision": "32-true", "micro_batch_size": 8}, 8)
    _record(study, 8, "pruned", BUDGET + 1, noise=2)  # a few steps over: fits, at a cost (stopped early: the
    assert next_rung(study, space, batch_size=32, budget_bytes=BUDGET) is None  # search holds faster plans)
    # a rung the space cannot name is resolved through 'auto' (the trial's RUNG), else the largest choice below it
    assert next_rung(optuna.create_study(), _space("auto", 8, 32), batch_size=24, budget_bytes=BUDGET) == (
        {"precision": "32-true", "micro_batch_size": "auto"}, 24)
    assert next_rung(optuna.create_study(), _space(2, 8, 32), batch_size=24, budget_bytes=BUDGET) == (
        {"precision": "32-true", "micro_batch_size": 8}, 8)
    crashed = optuna.create_study()
    _record(crashed, 16, "error", None)  # halving would crash on it too: the ladder ends
    assert next_rung(crashed, _space(16), batch_size=32, budget_bytes=BUDGET) is None


def test_walking_the_ladder_runs_one_trial_a_rung_behind_any_queued_and_queues_each_rung_once() -> None:
    """A soft budget of 100 "bytes" and peaks of 8 a sample: micro-batches 32 and 16 are over, 8 fits. A trial left
    queued by the search (an 'auto' retried) runs first; each rung is queued once."""
    space = _space("auto", 4, 8, 16, 32)
    study = optuna.create_study(direction="maximize")
    study.enqueue_trial({"precision": "32-true", "micro_batch_size": 4})
    ran: list[tuple[Any, Any]] = []

    def run_one() -> None:
        trial = study.ask()
        params = space.suggest(trial)
        micro = trial.user_attrs.get(RUNG) or params["micro_batch_size"]
        ran.append((params["micro_batch_size"], trial.user_attrs.get(RUNG)))
        plan = plan_from_params(params, micro_batch_size=micro)
        for key, value in {"plan_key": plan.key(), "status": "ok", "peak_bytes": 8 * micro,
                           "source": "measured"}.items():
            trial.set_user_attr(key, value)
        study.tell(trial, 1.0)

    walk_ladder(study, space, batch_size=32, budget_bytes=BUDGET, devices=1, run_one=run_one)
    assert ran == [(4, None), (32, 32), (16, 16), (8, 8)]
    assert not study.get_trials(states=(optuna.trial.TrialState.WAITING,))


@pytest.mark.slow
def test_a_search_whose_trials_all_run_out_finds_the_plan_halving_finds(tmp_path: Path) -> None:
    """Issue 47: under a tight budget the search's trials found nothing where halving found a micro-batch. Here the
    target runs out of memory above 4 samples and the search's one trial is the whole batch (16): halving's ladder,
    16 and 8 out of memory, finds 4, the plan halving finds; without the ladder, no plan."""
    space = one_point_space(tmp_path, seeds=({"micro_batch_size": 16},), micro_batch_size=[16, 8, 4, 2])
    result = search(target=f"{FIXTURE}:make_faulty_small", budget="2GiB", space=space, trials=1, device="cpu",
                    storage=f"sqlite:///{tmp_path}/s.db", study="tight", out=None, seed=0, **FAST)
    tried = [(t.user_attrs["micro_batch_size"], t.user_attrs["status"], t.user_attrs.get(RUNG))
             for t in result.study.get_trials()]
    assert tried == [(16, "oom", None), (8, "oom", 8), (4, "ok", 4)]
    assert result.plan == Plan(micro_batch_size=4, budget="2GiB").replace(provenance=result.plan.provenance)
