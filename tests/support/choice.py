"""Spare a search's re-measurement of its contenders in tests whose subject is something else."""

from __future__ import annotations

import pytest


def no_remeasurement(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the in-process searches choose from their trials' own runs, measuring no contender again.

    ``choose.REMEASURE_ROUNDS`` is set to 0; the edge check and the reopening of stopped trials are part of those
    rounds. Each re-measurement is a trial process, and the plans of a search of 2 timed steps have wide intervals,
    so most of them overlap and are measured again. The choice is tested in tests/search/test_choice.py,
    test_simplest.py and test_edge.py; the rest of it (figures, the simplest among equals) still runs here. A search
    in another process is not affected."""
    import autotune._search.choose

    monkeypatch.setattr(autotune._search.choose, "REMEASURE_ROUNDS", 0)
