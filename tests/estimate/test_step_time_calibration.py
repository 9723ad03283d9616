"""Calibration of the step-time model by measured trials: an efficiency per bound recovered from trials of known
efficiencies, one trial as a common scale, and the model's error over the trials, each predicted from the others."""

from __future__ import annotations

import random

import pytest

from autotune._estimate.calibration import Calibration, Observation, fit_efficiency
from autotune._estimate.step_time import BOUNDS, StepParts

TRUE = {"compute": 0.5, "memory": 0.8, "host link": 0.3, "interconnect": 1.0, "launch": 2.0}
PRIOR = dict.fromkeys(BOUNDS, 1.0)


def _trials(count: int, *, seed: int = 0) -> list[Observation]:
    """Trials of plans whose parts vary (host-link traffic in every other one), timed at the true efficiencies."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        parts = StepParts({"compute": rng.uniform(0.1, 1), "memory": rng.uniform(0.1, 1),
                           "host link": rng.uniform(0.1, 0.5) if i % 2 else 0.0, "interconnect": 0.0,
                           "launch": rng.uniform(0.1, 1)})
        out.append(Observation(parts, parts.total(TRUE)))
    return out


def test_trials_of_known_efficiencies_give_them_back() -> None:
    fitted = fit_efficiency(_trials(8), PRIOR)
    for bound in ("compute", "memory", "host link", "launch"):
        assert fitted[bound] == pytest.approx(TRUE[bound], rel=0.05), bound
    # no trial had interconnect traffic: it keeps the prior's proportion to the common scale
    assert fitted["interconnect"] == pytest.approx(fit_efficiency(_trials(8), PRIOR)["interconnect"])
    assert fitted["interconnect"] != TRUE["interconnect"]


def test_one_trial_scales_every_bound_alike() -> None:
    [trial] = _trials(1)
    fitted = fit_efficiency([trial], PRIOR)
    scale = trial.parts.total(PRIOR) / trial.seconds
    assert all(fitted[b] == pytest.approx(scale, rel=0.02) for b in BOUNDS)  # the ranking stays the prior's
    assert trial.parts.total(fitted) == pytest.approx(trial.seconds, rel=0.02)
    assert fit_efficiency([], PRIOR) == PRIOR


def test_the_error_is_each_trial_predicted_from_the_others() -> None:
    calibration = Calibration(PRIOR)
    assert calibration.error() is None and calibration.efficiency == PRIOR
    trials = _trials(6)
    for trial in trials:
        calibration.add(trial.parts, measured_seconds=trial.seconds)
    calibration.add(trials[0].parts, measured_seconds=0.0)  # nothing measured: ignored
    assert calibration.trials == 6 and calibration.error() < 0.05
    noisy = Calibration(PRIOR)
    for i, trial in enumerate(trials):
        noisy.add(trial.parts, measured_seconds=trial.seconds * (1.3 if i % 2 else 0.7))
    assert noisy.error() > 0.1  # the others cannot predict a trial 30% off theirs
