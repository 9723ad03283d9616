"""Judge a plan whose peak's spread reaches the budget by the throughput a run of it can be expected to give.

Such a plan is not thrown away: its expected throughput counts what the runtime does when it overflows.

A plan's measured runs give its largest peak ``P`` and how much its peaks varied, ``noise`` (the larger of the spread
between its runs and the spread of one run's timed steps: ``choose.peak_noise``). The next run's peak is taken as
anywhere in ``[P - noise, P + noise]``, so a run overflows the budget ``B`` with chance
``(P + noise - B) / (2 noise)`` (:func:`overflow_chance`): 0 with room for the noise, 1/2 at ``P = B``, more above.
A run whose every timed step was over the budget (its peak over it by more than its steps' spread,
``choose.over_budget_by``) overflows at once: such a plan overflows often and does not fit. One whose peak is over
the budget within that spread overflowed in a few of a trial's steps, and is judged like the others.

When a run overflows, ``ElasticBatchSize`` halves the micro-batch. On a CUDA cap that happens after replaying the
step that ran out, the failed attempt lost. On CPU's soft budget the step that went over has finished and the next
ones are smaller. It grows back only when the step's peak scaled to the larger micro-batch is under 90% of the
budget, which a plan on the edge is not, so the rest of the run goes at the smaller micro-batch.

An overflow comes anywhere in a run, on average half-way. So a plan's expected time per sample is
``(1 - q/2) / r + (q/2) / r_half``, plus, on a CUDA cap, the failed attempt: ``q / RUN_STEPS`` of a step at ``r``.
Here ``r`` is its measured samples/s and ``r_half`` the samples/s at half its micro-batch. ``r_half`` is measured
where the search measured that plan, else it is ``r`` scaled by the cost model
(:func:`autotune._search.cost.predicted_cost`). The same rule holds on CPU and on CUDA.
"""

from __future__ import annotations

from autotune._plan.plan import Plan
from autotune._search.cost import predicted_cost

__all__ = ["expected_throughput", "fallback_micro", "fallback_rate", "overflow_chance"]

#: The run an overflow is judged over: a replay's lost attempt is one step of this many (the goal: at most one replay
#: in 100 steps).
RUN_STEPS = 100
#: The share of a run still to go when it overflows, on average (an overflow is as likely at any step).
LEFT_AFTER = 0.5


def overflow_chance(peak_bytes: int, noise_bytes: int | None, budget_bytes: int) -> float:
    """The chance that a run of a plan overflows ``budget_bytes``: its next peak taken as anywhere within its noise
    of ``peak_bytes``, the largest measured.

    Example:
        >>> overflow_chance(95, 10, 100), overflow_chance(90, 10, 100), overflow_chance(105, 10, 100)
        (0.25, 0.0, 0.75)
        >>> overflow_chance(99, 0, 100), overflow_chance(101, None, 100)
        (0.0, 1.0)
    """
    noise = noise_bytes or 0
    if noise <= 0:
        return 1.0 if peak_bytes > budget_bytes else 0.0
    return min(1.0, max(0.0, (peak_bytes + noise - budget_bytes) / (2 * noise)))


def fallback_micro(micro_batch_size: int | None, batch_size: int) -> int:
    """The micro-batch the runtime falls back to after an overflow at ``micro_batch_size`` (None: the whole batch):
    half of it, at least 1.

    Example:
        >>> fallback_micro(16, 32), fallback_micro(None, 32), fallback_micro(1, 32)
        (8, 16, 1)
    """
    return max(1, min(micro_batch_size or batch_size, batch_size) // 2)


def fallback_rate(plan: Plan, rate: float, *, batch_size: int, device_type: str,
                  measured: float | None = None) -> float:
    """Samples/s of ``plan`` at its fallback micro-batch: ``measured`` when the search measured it, else ``rate``
    scaled by the cost model's ratio of the two micro-batches' costs.

    Example:
        >>> round(fallback_rate(Plan(micro_batch_size=16), 100.0, batch_size=32, device_type="cpu"), 2)
        94.44
    """
    if measured is not None:
        return measured
    half = plan.replace(micro_batch_size=fallback_micro(plan.micro_batch_size, batch_size))
    return rate * predicted_cost(plan, batch_size=batch_size, device_type=device_type) / predicted_cost(
        half, batch_size=batch_size, device_type=device_type)


def expected_throughput(rate: float, chance: float, fallback: float, *, hard_cap: bool) -> float:
    """Samples/s a run can be expected to give: ``rate`` until it overflows (with ``chance``, half-way on average),
    ``fallback`` after; on a ``hard_cap`` (CUDA) also the lost attempt of the step that ran out.

    Example:
        >>> expected_throughput(100.0, 0.0, 50.0, hard_cap=True)
        100.0
        >>> round(expected_throughput(100.0, 0.5, 50.0, hard_cap=False), 1), \\
        ...     round(expected_throughput(100.0, 0.5, 50.0, hard_cap=True), 1)
        (80.0, 79.7)
    """
    if chance <= 0 or rate <= 0 or fallback <= 0:
        return rate
    left = chance * LEFT_AFTER
    lost = chance / RUN_STEPS if hard_cap else 0.0
    return 1 / ((1 - left + lost) / rate + left / fallback)
