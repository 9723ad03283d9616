"""The search report's trial table on CUDA: the peak beside the tensors' peak the estimator predicts."""

from __future__ import annotations

import optuna

from autotune._search.report import trial_table


def _study(cuda: bool) -> optuna.Study:
    study = optuna.create_study(study_name="r", direction="maximize")
    study.set_user_attr("budget_bytes", 16 * 2**30)
    micro = optuna.distributions.CategoricalDistribution([8, 16])
    for m, peak, allocated, context in ((16, 11 * 2**30, 9 * 2**30, 600 * 2**20), (8, 6 * 2**30, 5 * 2**30, 700 * 2**20)):
        attrs = {"plan": f"bf16-mixed, micro {m}", "status": "ok", "samples_per_second": 10.0 * m,
                 "peak_bytes": peak, "predicted_peak_bytes": allocated // 2}
        if cuda:
            attrs |= {"allocated_peak_bytes": allocated, "context_bytes": context}
        study.add_trial(optuna.trial.create_trial(params={"micro_batch_size": m}, distributions={"micro_batch_size": micro},
                                                  value=10.0 * m, user_attrs=attrs))
    return study


def test_a_cuda_study_shows_each_trials_tensor_peak_and_the_contexts() -> None:
    lines = trial_table(_study(cuda=True)).splitlines()
    header = lines[1].split()
    assert header[:8] == ["#", "state", "samples/s", "95%", "int.", "peak", "allocated", "predicted"]
    row = next(line for line in lines if line.split()[:1] == ["0"])
    assert "11.00 GiB    9.00 GiB      4.50 GiB" in row  # peak, allocated, predicted: the gap is in sight
    assert ("peak: the allocator's peak reserve plus the CUDA context (600.00 MiB-700.00 MiB); allocated: the "
            "tensors' peak, what 'predicted' estimates") in lines


def test_a_cpu_study_has_no_allocated_column() -> None:
    table = trial_table(_study(cuda=False))
    assert "allocated" not in table and "11.00 GiB      4.50 GiB" in table
