"""The statistics a search's figures rest on: Student's t quantile and the interval of a mean of ratios."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

__all__ = ["ratio_interval", "t95"]

# Two-sided 95% quantiles of Student's t by degrees of freedom 1..30 (normal beyond).
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t95(df: int) -> float:
    """The two-sided 95% quantile of Student's t with ``df`` degrees of freedom (``df >= 1``)."""
    return _T95[df - 1] if df <= len(_T95) else (2.0 if df <= 60 else 1.96)


def ratio_interval(ratios: Sequence[float]) -> tuple[float, float, float]:
    """The geometric mean of ``ratios`` (each round's B/A) and its 95% interval ``(ratio, low, high)``: Student's t
    on their logarithms (a ratio and its inverse are equally far from 1); unbounded below two ratios.

    Example:
        >>> ratio, low, high = ratio_interval([0.9, 0.92, 0.88])
        >>> round(ratio, 3), low < ratio < high < 1
        (0.9, True)
        >>> ratio_interval([1.1])
        (1.1, 0.0, inf)
    """
    logs = [math.log(r) for r in ratios if r > 0]
    if not logs:
        raise ValueError("ratio_interval needs at least one positive ratio")
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mean), 0.0, math.inf
    half = t95(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)
