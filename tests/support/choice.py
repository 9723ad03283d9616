"""Spare a search's re-measurement of its contenders in tests whose subject is something else."""

from __future__ import annotations

import pytest

#: The settings of ``autotune._search.choose`` under which a search measures no contender again.
NO_REMEASUREMENT = {"MAX_RIVALS": 0, "EDGE_SHARE": 0.0}


def no_remeasurement(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the in-process searches choose from their trials' own runs, measuring no contender again.

    ``choose.MAX_RIVALS`` is set to 0 (no paired comparison) and ``choose.EDGE_SHARE`` to 0 (no second run of a
    leader on the budget's edge). Each run of a comparison is a trial process, and the plans of a search of 2 timed
    steps have wide intervals, so most of them would be compared. The choice is tested in
    tests/search/test_choice.py, test_paired.py, test_simplest.py and test_edge.py; the rest of it (figures, the
    simplest among equals) still runs here. A search in another process is not affected (run it through
    tests/support/search_without_remeasurement.py)."""
    import autotune._search.choose

    for name, value in NO_REMEASUREMENT.items():
        monkeypatch.setattr(autotune._search.choose, name, value)
