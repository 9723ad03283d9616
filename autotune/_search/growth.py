"""The peak a training run reaches, from the peaks a trial's steps showed: a trial's few steps are not a run's many.

A process's memory creeps over a run's steps: on a CPU the C allocator keeps what a step frees and its arenas grow
(the resident set of a 7-12-step trial read up to ~1.5% under a 60-step run's), on CUDA the caching allocator's
reserve grows with fragmentation. A plan whose trial peaked just under the budget can then go over it in training.

So each trial's step peaks are split into a trend and a scatter about it. The trend is fitted over the timed steps
(warm-up's growth, the optimizer state appearing, is over by then) as ``a + b ln(step)``: a creep that slows as the
caches fill, the shape a running maximum of a step's peak takes, and one that does not run away from a short trial
as a straight line would. The run's peak is the trend carried to a run of :data:`RUN_STEPS` steps, plus the largest
scatter above it a step showed; the scatter is the spread of the steps about the trend (:func:`run_peak_of`).

A CPU process's heap grows in jumps a few tens of steps apart that a 10-step trial often does not see (the GPT
example, 150-step runs beside a busy neighbour, 2026-12-07: 0 to 2.4 MiB over a 10-step trial's ~300 MiB peak in 7
of 8 runs, 6.4 MiB in one): there a run's peak is at least :data:`CPU_CREEP` of the trial's above it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["CPU_CREEP", "MIN_STEPS", "RUN_STEPS", "run_peak_of"]

#: The training run a plan is judged over: its peak over this many steps must fit the budget.
RUN_STEPS = 100
#: Timed steps a trend is fitted over at least; with fewer the run's peak is the trial's.
MIN_STEPS = 3
#: On a CPU a run's peak is at least this share of its trial's above it: the heap's jumps a short trial misses.
CPU_CREEP = 0.01


def run_peak_of(step_peaks: Sequence[int], *, timed_from: int | None, peak: int | None,
                run_steps: int = RUN_STEPS, creep: float = 0.0) -> tuple[int | None, int | None]:
    """The peak a run of ``run_steps`` steps is projected to reach and the scatter of a step's peak about its trend
    (``(run_peak, noise)``), from each step's peak in order (``step_peaks``; the timed ones from ``timed_from``) and
    the trial's measured ``peak`` (which may hold more than the steps', the CUDA context), at least ``creep`` of the
    peak above it (:data:`CPU_CREEP` on a CPU). Fewer than :data:`MIN_STEPS` timed steps: the trial's peak (with its
    ``creep``) and no noise.

    Example:
        >>> run_peak_of([900, 100, 101, 100, 101, 100], timed_from=2, peak=900)  # flat: the trial's peak stands
        (900, 1)
        >>> run, noise = run_peak_of([50, 100, 110, 115, 119, 122], timed_from=1, peak=122)
        >>> run > 122 and noise < 5  # creeping: the trend goes on after the trial's steps
        True
        >>> run_peak_of([900, 100, 101, 100, 101, 100], timed_from=2, peak=900, creep=0.01)
        (909, 1)
    """
    if peak is None:
        return None, None
    floor = int(math.ceil(peak * (1 + creep)))
    timed = [(i + 1, p) for i, p in enumerate(step_peaks) if timed_from is not None and i >= timed_from]
    if len(timed) < MIN_STEPS:
        return floor, None
    xs = [math.log(t) for t, _ in timed]
    ys = [float(p) for _, p in timed]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    residuals = [y - slope * x for x, y in zip(xs, ys)]
    top = max(residuals)
    noise = int(round(top - min(residuals)))
    if slope <= 0:  # memory given back over the steps is not carried on: the run's peak is the trial's
        return floor, noise
    offset = peak - max(step_peaks)  # what the trial's peak holds besides its steps' (the CUDA context)
    projected = top + slope * math.log(max(run_steps, timed[-1][0])) + offset
    return max(floor, int(math.ceil(projected))), noise
