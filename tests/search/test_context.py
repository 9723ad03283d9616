"""The CUDA context in a search: what its trials measure replaces the estimate for the plan shapes not measured yet
(played on this machine: what-if CUDA estimates, trials' results given)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import optuna
import pytest
import torch

from autotune import Plan, load_target
from autotune._search.memory import SearchEstimator

GPT = Path(__file__).resolve().parents[2] / "examples" / "gpt" / "train.py"
MIB = 2**20


def test_on_cuda_the_context_a_trial_measured_replaces_the_estimate_for_shapes_not_measured() -> None:
    """An H200's trial processes held 828 MiB of context against the 512 MiB estimated: a shape not measured yet
    starts from the smallest context a trial measured, for its prediction and for rejecting it unmeasured; a shape
    measured keeps its own gap; a CPU search has no context to learn."""
    estimator = SearchEstimator(target=load_target(f"{GPT}:make"), device=torch.device("cuda"))
    ckpt, plain = Plan(micro_batch_size=16, activation_checkpointing=1.0), Plan(micro_batch_size=16)
    measured = estimator.tensors(plain) + 900 * MIB
    assert estimator.calibrate(plain, measured)  # the plain shape's own gap: 900 MiB
    before = estimator.calibrations
    assert estimator.measured_context(828 * MIB)  # larger than the estimate: the first measurement replaces it
    assert estimator.calibrations == before + 1  # 'auto' choices made before are made again
    assert estimator.peak(ckpt) == estimator.tensors(ckpt) + 828 * MIB
    assert estimator.least_peak(ckpt) == estimator.tensors(ckpt) + 828 * MIB
    assert estimator.peak(plain) == measured  # measured: its own
    assert not estimator.measured_context(900 * MIB)  # a compiled plan's larger context is that plan's
    assert estimator.measured_context(800 * MIB) and estimator.peak(ckpt) == estimator.tensors(ckpt) + 800 * MIB
    assert not estimator.measured_context(0)
    cpu = SearchEstimator(target=load_target(f"{GPT}:make"), device=torch.device("cpu"))
    baseline = cpu.baseline
    assert not cpu.measured_context(828 * MIB) and cpu.baseline == baseline


def test_a_cuda_search_learns_the_context_from_its_trials_and_from_a_resumed_study(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The search's side of the test above: each measured trial's context reaches the estimator, and a resumed
    search (or a worker joining one) starts from the contexts its study's measured trials recorded."""
    import autotune._search.objective as objective_module
    from autotune._device.budget import resolve_budget
    from autotune._estimate.cuda_rules import CUDA_CONTEXT_BYTES
    from autotune._estimate.devices import KNOWN_DEVICES
    from autotune._search.records import TrialResult
    from autotune._search.speed import SearchSpeed

    def objective() -> Any:  # a CUDA search's objective, what-if on this machine, its trials played
        runner = object.__new__(objective_module.Objective)
        runner.target, runner.config, runner.devices, runner.steps, runner.warmup = f"{GPT}:make", None, 1, 3, 1
        runner.interval, runner.trial_timeout, runner._long_dir = 0.03, 60.0, None
        runner.device, runner.budget = torch.device("cuda"), resolve_budget("2GiB", "cuda", what_if=True)
        runner.space = SimpleNamespace(suggest=lambda trial: {"micro_batch_size": 8})
        runner.estimator = SearchEstimator(target=load_target(f"{GPT}:make"), device=torch.device("cuda"))
        runner.speed = SearchSpeed(runner.estimator, batch_size=32, devices=1, speed=KNOWN_DEVICES["h200"])
        return runner

    study = optuna.create_study(direction="maximize")
    runner = objective()
    assert runner.estimator.baseline == CUDA_CONTEXT_BYTES
    monkeypatch.setattr(objective_module, "run_trial", lambda spec, timeout: TrialResult(
        "ok", samples_per_second=10.0, peak_bytes=900 * MIB, context_bytes=828 * MIB))
    study.optimize(runner, n_trials=1)
    assert runner.estimator.baseline == 828 * MIB  # measured by the trial
    assert study.trials[0].user_attrs["context_bytes"] == 828 * MIB
    # the trial recorded what the step-time model predicted, then calibrated it (a what-if H200 here)
    assert study.trials[0].user_attrs["predicted_samples_per_second"] > 0
    assert runner.speed.model.calibration.trials == 1
    resumed = objective()
    resumed.learn_context(study)
    assert resumed.estimator.baseline == 828 * MIB
