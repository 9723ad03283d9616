"""Private torchmetrics API that autotune uses: the attributes that hold a ``Metric``'s state, with what breaks if
they change."""

from __future__ import annotations

from typing import Any


def metric_state_names(metric: Any) -> tuple[str, ...]:
    """The attributes that hold a torchmetrics ``Metric``'s state: those of ``add_state`` (``Metric._defaults``) and
    the bookkeeping ``_update_count``, ``_computed`` and ``_forward_cache``. If they changed, a replayed step could
    count a failed attempt's updates (missing names are skipped by ``hasattr``). Public ``Metric.metric_state`` is
    not used: it leaves out the bookkeeping, so ``compute()`` could return a cached value."""
    return (*metric._defaults, "_update_count", "_computed", "_forward_cache")
