"""On a CPU the budget is the process's memory: the estimate's process peak is within 10% of a trial's (5% here on a
warm install; 7.7% low at micro-batch 16 in a fresh clone's first run), because the
process baseline is measured at micro-batch 1 and at a larger one (it grows with the micro-batch faster than the
tensors), and a shape that saves tensors keeps about half the saving resident (autotune/_search/memory.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from autotune import Plan, load_target, measure_plan  # noqa: E402
from autotune._search.memory import SearchEstimator  # noqa: E402

TARGET = str(Path(__file__).resolve().parents[1] / "fixtures" / "wide_llama.py") + ":make"


@pytest.mark.slow
def test_the_cpu_process_peak_of_plans_not_measured_is_within_10_percent_of_a_trial_s() -> None:
    estimator = SearchEstimator(target=load_target(TARGET), device=torch.device("cpu"))
    estimator.measure_baseline(target=TARGET, config=None, budget_bytes=2 * 2**30)
    assert estimator.second_micro(2 * 2**30) == 32  # the whole batch fits: the line's second point
    for plan in (Plan(micro_batch_size=16), Plan(precision="bf16-mixed", micro_batch_size=8),
                 Plan(micro_batch_size=16, activation_checkpointing=1.0)):
        measured = measure_plan(target=TARGET, plan=plan, device="cpu", steps=4, warmup=2)
        assert measured.status == "ok", measured.reason
        predicted = estimator.peak(plan)
        # one baseline at micro-batch 1 put micro-batch 16 11% low, full checkpointing 22% low (issue 54)
        assert abs(predicted / measured.peak_bytes - 1) < 0.10, (plan.describe(), predicted, measured.peak_bytes)
