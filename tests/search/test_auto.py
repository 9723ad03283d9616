"""`micro_batch_size: auto` in a search: an 'auto' that runs out of memory is halved and tried again (also across a
resume), and a small space counts as covered by the points answered."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from autotune._search.search import search
from tests.search.test_search import FAST, FIXTURE, one_point_space


def stopped_after_one_trial(**kwargs: str) -> None:
    """A search of 2GiB stopped after its first trial (as by Ctrl-C), what it queued left in its study (a search that
    ends by itself goes on down halving's ladder)."""
    def stop(study: object, trial: object) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        search(device="cpu", budget="2GiB", trials=1, out=None, seed=0, callbacks=[stop], **kwargs, **FAST)


@pytest.mark.slow
def test_an_auto_micro_batch_that_runs_out_of_memory_is_halved_and_tried_again(tmp_path: Path) -> None:
    """The estimate cannot see this target's limit (it runs out of memory above 16 samples, whatever the budget):
    'auto' first takes the whole batch, runs out, and the same point is tried again at half, down to what runs."""
    storage = f"sqlite:///{tmp_path}/s.db"
    space = one_point_space(tmp_path, precision=["32-true"], micro_batch_size=["auto"])
    result = search(target=f"{FIXTURE}:make_faulty", budget="2GiB", space=space, trials=3, storage=storage,
                    device="cpu", study="auto-oom", out=None, seed=0, **FAST)
    tried = [(t.user_attrs["micro_batch_size"], t.user_attrs["status"], t.user_attrs.get("auto_again_of"))
             for t in result.study.get_trials()]
    assert tried == [(64, "oom", None), (32, "oom", 0), (16, "ok", 1)]
    assert result.plan.micro_batch_size == 16

    # Stopped after the first (its retry queued with its ceiling), then resumed by another process, which knows
    # nothing of the first's halving: the queued retry carries it (32), so 64 is not run or looked up again.
    storage = f"sqlite:///{tmp_path}/resumed.db"
    stopped_after_one_trial(target=f"{FIXTURE}:make_faulty", space=space, storage=storage, study="auto-oom")
    result = search(target=f"{FIXTURE}:make_faulty", budget="2GiB", space=space, trials=3, storage=storage,
                    device="cpu", study="auto-oom", out=None, seed=0, **FAST)
    tried = [(t.user_attrs["micro_batch_size"], t.user_attrs["source"]) for t in result.study.get_trials()]
    assert tried == [(64, "measured"), (32, "measured"), (16, "measured")]
    assert result.plan.micro_batch_size == 16



def test_a_small_space_is_covered_when_every_point_has_an_answer_not_when_as_many_plans_ran() -> None:
    """Two points, 'auto' and 8: 'auto' ran out at 64 and 32 and ran at 16, three plans of one point; the search goes
    on (to the other point), and stops once that point has an answer, a cache hit included."""
    from optuna.distributions import CategoricalDistribution

    from autotune._search.stopping import MaxMeasured

    study = optuna.create_study()
    stops: list[bool] = []
    study.stop = lambda: stops.append(True)  # type: ignore[method-assign]
    micro = {"micro_batch_size": CategoricalDistribution(["auto", 8])}

    def add(choice: object, plan: str, source: str) -> None:
        study.add_trial(optuna.trial.create_trial(params={"micro_batch_size": choice}, distributions=micro, value=1.0,
                                                  user_attrs={"plan_key": plan, "source": source}))

    for plan in ("micro 64", "micro 32", "micro 16"):
        add("auto", plan, "measured")
    MaxMeasured(trials=10, space_size=2)(study, None)
    assert not stops
    add(8, "micro 8", "cache")
    MaxMeasured(trials=10, space_size=2)(study, None)
    assert stops == [True]


@pytest.mark.slow
def test_a_resumed_search_meets_its_earlier_out_of_memory_auto_in_the_cache_and_halves_from_there(
        tmp_path: Path) -> None:
    """A study whose 'auto' ran out of memory but whose retry was lost (a process killed between recording the OOM
    and queueing its retry, or a study of an older version): the resumed search's 'auto' resolves to the whole batch
    again, finds that OOM in the study, and halves from there instead of stopping at the cached OOM."""
    storage = f"sqlite:///{tmp_path}/s.db"
    space = one_point_space(tmp_path, precision=["32-true"], micro_batch_size=["auto"])
    stopped_after_one_trial(target=f"{FIXTURE}:make_faulty", space=space, storage=storage, study="lost-retry")
    study = optuna.load_study(study_name="lost-retry", storage=storage)
    [queued] = study.get_trials(states=(TrialState.WAITING,))
    assert queued.user_attrs["auto_ceiling"] == 32
    study.tell(study.ask(), state=TrialState.FAIL)  # the retry is lost
    result = search(target=f"{FIXTURE}:make_faulty", budget="2GiB", space=space, trials=3, storage=storage,
                    device="cpu", study="lost-retry", out=None, seed=0, **FAST)
    tried = [(t.user_attrs["micro_batch_size"], t.user_attrs["source"], t.user_attrs["status"])
             for t in result.study.get_trials(states=(TrialState.COMPLETE,))]
    assert tried == [(64, "measured", "oom"), (64, "cache", "oom"), (32, "measured", "oom"), (16, "measured", "ok")]
    assert result.plan.micro_batch_size == 16
