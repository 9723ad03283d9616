"""Memory of the whole run: a trial's step peaks carried to a training run's length (autotune/_search/growth.py), and
the search judging fit, halving's ladder and the report by that run's peak, not the trial's."""

from __future__ import annotations

import math
from pathlib import Path

import optuna
import pytest

from autotune._plan.space import Dimension, SearchSpace, plan_from_params
from autotune._search.figures import figures, run_peak
from autotune._search.growth import RUN_STEPS, run_peak_of
from autotune._search.halving import halving_key, next_rung

ROOT = Path(__file__).resolve().parents[2]
GPT = f"{ROOT / 'examples' / 'gpt' / 'train.py'}:make"


def test_a_trial_whose_steps_creep_is_projected_over_the_run_not_held_at_its_own_peak() -> None:
    # steps 3..12 timed, each step's peak 1000 + 20 ln(step) (+-1): a creep that slows as caches fill
    peaks = [900, 950, *(round(1000 + 20 * math.log(t) + (-1) ** t) for t in range(3, 13))]
    projected, noise = run_peak_of(peaks, timed_from=2, peak=max(peaks))
    assert max(peaks) <= 1051 and projected == pytest.approx(1000 + 20 * math.log(RUN_STEPS) + 1, abs=3)
    assert noise <= 3  # the scatter about the trend, not the trend itself
    # peaks that fall after warm-up are not carried on (memory given back); a short trial keeps its own peak
    projected, noise = run_peak_of([500, 400, 300, 200, 100], timed_from=1, peak=500)
    assert projected == 500 and noise < 50  # the scatter about the falling trend, not the fall
    assert run_peak_of([100, 101], timed_from=1, peak=101) == (101, None)


def test_a_cpu_run_s_peak_is_at_least_its_creep_share_over_a_flat_trial() -> None:
    assert run_peak_of([100] * 10, timed_from=3, peak=1000, creep=0.01) == (1010, 0)  # the context counts: 1000
    assert run_peak_of([100] * 10, timed_from=3, peak=1000) == (1000, 0)  # on CUDA no floor


def _record(study: optuna.Study, micro: int, peak: int, run_peak_bytes: int) -> None:
    params = {"precision": "32-true", "micro_batch_size": micro}
    dists = {"precision": optuna.distributions.CategoricalDistribution(["32-true"]),
             "micro_batch_size": optuna.distributions.CategoricalDistribution([8, 16, 32])}
    plan = plan_from_params(params)
    study.add_trial(optuna.trial.create_trial(
        params=params, distributions=dists, value=100.0 / micro,
        user_attrs={"plan_key": plan.key(), "plan": plan.describe(), "status": "ok", "source": "measured",
                    "samples_per_second": 100.0, "interval": [99.0, 101.0], "peak_bytes": peak,
                    "peak_noise_bytes": 1, "run_peak_bytes": run_peak_bytes, "run_noise_bytes": 1}))


def test_a_plan_whose_trial_fits_but_whose_run_would_not_does_not_fit_and_halving_goes_on() -> None:
    """Issue 54: micro 32 peaked at 555 of 560 in its trial, its run would reach 568: it is not halving's plan (a
    run of it goes over) and not a figure that fits; the next rung is measured, and is halving's plan."""
    space = SearchSpace("s", "", (Dimension("precision", ("32-true",)), Dimension("micro_batch_size", (8, 16, 32))))
    study = optuna.create_study(direction="maximize")
    study.set_user_attr("device", "cpu")
    _record(study, 32, peak=555, run_peak_bytes=568)
    assert run_peak(study.trials[0].user_attrs) == (568, 1)
    assert figures(study, 560) == []
    assert next_rung(study, space, batch_size=32, budget_bytes=560) == (
        {"precision": "32-true", "micro_batch_size": 16}, 16)
    _record(study, 16, peak=530, run_peak_bytes=536)
    assert next_rung(study, space, batch_size=32, budget_bytes=560) is None
    assert halving_key(study, space, batch_size=32, budget_bytes=560) == study.trials[1].user_attrs["plan_key"]


@pytest.mark.slow
def test_a_tight_budget_search_s_plan_trains_as_written_for_100_steps(tmp_path: Path) -> None:
    """Issue 54: the plan a search chose under a tight CPU budget (half-way between the fp32 peaks at micro-batch 1
    and at the whole batch) trains 100 steps in a process of its own, as a user's run does, with no step over the
    budget and its micro-batch kept: the search judged it by the peak a run reaches, not its trial's."""
    import json
    import subprocess
    import sys

    from autotune import Plan, measure_plan, search

    low, high = (measure_plan(target=GPT, plan=Plan(micro_batch_size=m), device="cpu", steps=3, warmup=1).peak_bytes
                 for m in (1, 32))
    budget = f"{(low + (high - low) // 2) // 2**20}MiB"
    result = search(target=GPT, budget=budget, trials=4, steps=8, storage=f"sqlite:///{tmp_path}/s.db",
                    out=tmp_path / "tuned.yaml", device="cpu", seed=0)
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "support" / "train_plan_run.py"), GPT,
                           str(tmp_path / "tuned.yaml"), "100"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    trained = json.loads(done.stdout.strip().splitlines()[-1])
    assert trained["steps"] == 100 and trained["planned"] == result.plan.micro_batch_size
    assert [e for e in trained["events"] if e["kind"] in ("over_budget", "oom")] == [], (budget, trained["events"])
    assert trained["micro_batch_size"] >= trained["planned"]  # kept (or grown where the file lets it)
