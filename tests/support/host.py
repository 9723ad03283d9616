"""A shared host for the choice's tests: plans with true speeds, measured beside a neighbour that comes and goes.

``Host.remeasure`` stands for a search's ``Objective.remeasure``: each call is one run of a trial's plan, its
samples/s the plan's true rate times the host's share at that moment (a neighbour takes half of it while it runs),
times a small scatter; its load record says what the run ran beside, as a trial's meter records it."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any


class Host:
    """Runs plans at ``rates`` (plan description -> true samples/s); ``neighbour(i)`` says whether a neighbour runs
    during the ``i``-th run (0-based); ``peaks``: plan -> the peak its runs show (10 where not given)."""

    def __init__(self, rates: dict[str, float], *, neighbour: Callable[[int], bool] = lambda i: False,
                 scatter: float = 0.01, peaks: dict[str, int] | None = None, seed: int = 0) -> None:
        self.rates, self.neighbour, self.scatter = rates, neighbour, scatter
        self.peaks = peaks or {}
        self.rng = random.Random(seed)
        self.asked: list[str] = []

    def remeasure(self, trial: Any) -> dict[str, Any]:
        plan = trial.user_attrs["plan"]
        busy = self.neighbour(len(self.asked))
        self.asked.append(plan)
        rate = self.rates[plan] * (0.5 if busy else 1.0) * (1 + self.rng.uniform(-self.scatter, self.scatter))
        return {"status": "ok", "samples_per_second": rate, "interval": [0.98 * rate, 1.02 * rate],
                "peak_bytes": self.peaks.get(plan, 10),
                "load": {"neighbour_cores": 1.0 if busy else 0.0, "cores": 2, "steal": 0.0}}


def bursts(length: int) -> Callable[[int], bool]:
    """A neighbour on for ``length`` runs, off for ``length``, and so on (on first)."""
    return lambda i: (i // length) % 2 == 0
