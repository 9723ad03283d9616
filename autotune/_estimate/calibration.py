"""Fit the step-time model to one target on one device from the trials measured so far.

The fit gives an efficiency per bound (compute, memory, host link, interconnect, launch) and how far the model has
been off. A step's predicted time is linear in the inverse efficiencies: ``T = sum_k x_k / e_k`` over the bounds'
seconds at efficiency 1. On CUDA the sum runs over the host's launches or the device's work, whichever is longer at
the prior efficiencies (:meth:`~autotune._estimate.step_time.StepParts.active`).

The fit first takes one common scale, which is what a single trial can say: this target runs at ``s`` times the
prediction. It then lets each bound depart from that scale as far as the trials tell bounds apart: least squares on
the relative errors, with a pull of weight :data:`PULL` towards the common scale. So a bound no trial exercised keeps
the prior's proportion to the others. Each efficiency stays within a factor of :data:`LIMIT` of the prior's scaled
value.

The error reported is what the next prediction may be off by. It is the median, over the measured trials, of each
one's relative error in samples/s when predicted from the others (the first trial's from the prior).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from autotune._estimate.step_time import BOUNDS, StepParts

__all__ = ["Calibration", "Observation", "fit_efficiency"]

#: Weight of the pull towards the common scale, against one trial's squared relative error.
PULL = 0.001
#: How far a fitted efficiency may move from the prior's value at the common scale (either way).
LIMIT = 10.0


@dataclass(frozen=True)
class Observation:
    """A measured trial: its plan's parts at efficiency 1, and the seconds one optimizer step took."""

    parts: StepParts
    seconds: float


def fit_efficiency(observations: Sequence[Observation], prior: Mapping[str, float]) -> dict[str, float]:
    """The efficiency per bound that best explains ``observations`` (see the module's notes); ``prior`` when there
    is none.

    Example:
        >>> parts = StepParts({"compute": 1.0, "memory": 0.0, "host link": 0.0, "interconnect": 0.0, "launch": 0.0})
        >>> round(fit_efficiency([Observation(parts, 2.0)], {b: 1.0 for b in BOUNDS})["compute"], 3)
        0.5
    """
    efficiency = {b: float(prior.get(b, 1.0)) for b in BOUNDS}
    usable = [o for o in observations if o.seconds > 0 and math.isfinite(o.seconds)]
    if not usable:
        return efficiency
    # x[i, k]: trial i's seconds of bound k at the prior's efficiency, over its measured seconds
    x = np.array([[o.parts.active(efficiency).get(b, 0.0) / efficiency[b] / o.seconds for b in BOUNDS]
                  for o in usable])
    predicted = x.sum(axis=1)
    keep = predicted > 0
    if not keep.any():
        return efficiency
    x, predicted = x[keep], predicted[keep]
    scale = float(predicted.sum() / (predicted**2).sum())  # the common factor making predictions right on average
    used = [k for k in range(len(BOUNDS)) if x[:, k].any()]
    z = scale * x[:, used]
    # least squares on relative errors, pulled towards u = 1 (the common scale): (Z'Z + PULL I) u = Z'1 + PULL 1
    lhs = z.T @ z + PULL * np.eye(len(used))
    rhs = z.T @ np.ones(len(z)) + PULL * np.ones(len(used))
    u = np.clip(np.linalg.solve(lhs, rhs), 1 / LIMIT, LIMIT)
    out = {b: efficiency[b] / scale for b in BOUNDS}
    for k, value in zip(used, u):
        out[BOUNDS[k]] = efficiency[BOUNDS[k]] / (scale * float(value))
    return out


class Calibration:
    """The step-time model's efficiencies for one target on one device, refitted as trials are measured.

    Example:
        >>> calibration = Calibration({b: 1.0 for b in BOUNDS})
        >>> calibration.add(parts, measured_seconds=0.12)  # doctest: +SKIP
        >>> calibration.efficiency, calibration.error()  # doctest: +SKIP
    """

    def __init__(self, prior: Mapping[str, float]) -> None:
        self.prior = {b: float(prior.get(b, 1.0)) for b in BOUNDS}
        self.observations: list[Observation] = []
        self._efficiency: dict[str, float] | None = None
        self._error: float | None = None

    @property
    def trials(self) -> int:
        """Measured trials fitted."""
        return len(self.observations)

    def add(self, parts: StepParts, *, measured_seconds: float) -> None:
        """One measured trial: its plan's parts and its seconds per optimizer step."""
        if measured_seconds > 0 and math.isfinite(measured_seconds):
            self.observations.append(Observation(parts, float(measured_seconds)))
            self._efficiency = self._error = None

    @property
    def efficiency(self) -> dict[str, float]:
        """The efficiency per bound fitted from the trials so far (the prior before any)."""
        if self._efficiency is None:
            self._efficiency = fit_efficiency(self.observations, self.prior)
        return dict(self._efficiency)

    def error(self) -> float | None:
        """The median relative error in samples/s (``|predicted / measured - 1|``) of each measured trial predicted
        from the others (the first from the prior); None before any trial."""
        if not self.observations:
            return None
        if self._error is not None:
            return self._error
        errors = []
        for i, observation in enumerate(self.observations):
            others = fit_efficiency(self.observations[:i] + self.observations[i + 1:], self.prior)
            # in samples/s: predicted over measured throughput, less one (the seconds' ratio the other way round)
            errors.append(abs(observation.seconds / observation.parts.total(others) - 1))
        self._error = statistics.median(errors)
        return self._error
