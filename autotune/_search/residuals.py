"""The step-time model's error on one study, by the plan's settings, fitted from the study's own trials.

The calibration (``autotune._estimate.calibration``) fits the model's efficiencies per bound: a scale common to
every plan and what the bounds can tell apart. What it cannot see is an error that follows one setting: a CPU whose
16-bit matmuls are fast (AMX) or slow, a target whose recomputation costs more than a forward of its blocks, passes
that cost more than their launches. So after it, each measured trial's log error (measured over predicted
samples/s) is split over the settings the model ranks most (:data:`GROUPS`): one multiplicative correction per
choice of each, fitted by backfitting, each shrunk towards none by :data:`SHRINK` trials' worth of evidence
(``n / (n + SHRINK)`` of its trials' mean): one trial of bf16 moves bf16's prediction half-way to it, a choice no
trial measured is not moved.

Example:
    >>> corrections = Corrections()
    >>> for micro in (8, 16, 32):  # three bf16 trials, each twice as fast as predicted
    ...     corrections.add({"precision": "bf16-mixed", "micro_batch_size": micro}, measured_over_predicted=2.0)
    >>> round(corrections.factor({"precision": "bf16-mixed", "micro_batch_size": 4}), 2)  # bf16 at any micro-batch
    1.52
    >>> corrections.factor({"precision": "32-true", "micro_batch_size": 4})  # nothing known of fp32
    1.0
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from typing import Any

__all__ = ["GROUPS", "SHRINK", "Corrections"]

#: The plan fields whose choices get a correction of their own.
GROUPS = ("precision", "micro_batch_size", "activation_checkpointing")
#: A choice's correction is its trials' mean log error times ``n / (n + SHRINK)``.
SHRINK = 1.0
_PASSES = 5  # backfitting passes (three settings: converged well before)


def _key(fields: Mapping[str, Any], name: str) -> tuple[str, str] | None:
    return (name, repr(fields[name])) if name in fields else None


class Corrections:
    """Multiplicative corrections of the model's samples/s by the choices of :data:`GROUPS`, from the trials added."""

    def __init__(self) -> None:
        self.observed: list[tuple[dict[str, Any], float]] = []  # (the plan's fields, log of measured / predicted)
        self._offsets: dict[tuple[str, str], float] | None = None

    @property
    def trials(self) -> int:
        return len(self.observed)

    def add(self, fields: Mapping[str, Any], *, measured_over_predicted: float) -> None:
        """A measured trial of a plan (``fields``: its dict form, or the fields of :data:`GROUPS`) and how far the
        calibrated model was off on it."""
        if measured_over_predicted > 0 and math.isfinite(measured_over_predicted):
            self.observed.append(({k: fields[k] for k in GROUPS if k in fields}, math.log(measured_over_predicted)))
            self._offsets = None

    def clear(self) -> None:
        self.observed.clear()
        self._offsets = None

    def factor(self, fields: Mapping[str, Any]) -> float:
        """What to multiply the model's samples/s for a plan of ``fields`` by (1.0 where nothing is known)."""
        if self._offsets is None:
            self._offsets = _fit(self.observed)
        return math.exp(sum(self._offsets.get(k, 0.0) for k in (_key(fields, g) for g in GROUPS) if k))

    def error(self) -> float | None:
        """The median relative error in samples/s of each trial predicted with the corrections fitted from the
        others (None before two trials)."""
        if len(self.observed) < 2:
            return None
        errors = []
        for i, (fields, log_error) in enumerate(self.observed):
            offsets = _fit(self.observed[:i] + self.observed[i + 1:])
            predicted = sum(offsets.get(k, 0.0) for k in (_key(fields, g) for g in GROUPS) if k)
            errors.append(abs(math.exp(log_error - predicted) - 1))
        return statistics.median(errors)


def _fit(observed: list[tuple[dict[str, Any], float]]) -> dict[tuple[str, str], float]:
    offsets: dict[tuple[str, str], float] = {}
    for _ in range(_PASSES):
        for group in GROUPS:
            sums: dict[tuple[str, str], list[float]] = {}
            for fields, log_error in observed:
                key = _key(fields, group)
                if key is None:
                    continue
                others = sum(offsets.get(k, 0.0) for k in (_key(fields, g) for g in GROUPS if g != group) if k)
                sums.setdefault(key, []).append(log_error - others)
            for key, residuals in sums.items():
                offsets[key] = sum(residuals) / (len(residuals) + SHRINK)
    return offsets
