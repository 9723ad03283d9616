"""What ``micro_batch_size: auto`` resolves to in a search, point by point: the largest micro-batch the estimator
predicts to fit, evened out, and held to half of one that ran out of memory. It aims at the budget itself: a plan
whose peak's noise reaches the budget is judged by its expected throughput when the search chooses (``edge.py``)."""

from __future__ import annotations

from typing import Any

from autotune._plan.space import AUTO, plan_for
from autotune._search.memory import SearchEstimator, even_micro_batches

__all__ = ["AutoMicro", "shape_key"]


def shape_key(params: dict[str, Any]) -> tuple[Any, ...]:
    """A point's settings but its micro-batch: what ``auto`` chooses the micro-batch of.

    Example:
        >>> shape_key({"precision": "bf16-mixed", "micro_batch_size": "auto"})
        (('precision', 'bf16-mixed'),)
    """
    return point_key({k: v for k, v in params.items() if k != "micro_batch_size"})


def point_key(params: dict[str, Any]) -> tuple[Any, ...]:
    """A point's settings, hashable (a list of block class names to checkpoint becomes a tuple).

    Example:
        >>> point_key({"activation_checkpointing": ["Block"], "precision": "bf16-mixed"})
        (('activation_checkpointing', ('Block',)), ('precision', 'bf16-mixed'))
    """
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in params.items()))


class AutoMicro:
    """The search's ``auto`` micro-batches and what each shape (:func:`shape_key`) has taught them.

    Example (``estimator`` a :class:`~autotune._search.memory.SearchEstimator` of the GPT example on the CPU):
        >>> auto = AutoMicro(estimator=estimator, budget_bytes=2 * 2**30, batch_size=32, devices=1)  # doctest: +SKIP
        >>> auto({"precision": "bf16-mixed", "activation_checkpointing": 0.0})  # all 32 fit 2 GiB  # doctest: +SKIP
        32
    """

    def __init__(self, *, estimator: SearchEstimator, budget_bytes: int, batch_size: int, devices: int) -> None:
        self.estimator, self.budget_bytes, self.batch_size, self.devices = estimator, budget_bytes, batch_size, devices
        self._cache: dict[tuple[Any, ...], int] = {}  # by shape, calibrations and room
        self._ceiling: dict[tuple[Any, ...], int] = {}  # by shape: half an 'auto' that ran out of memory

    def __call__(self, params: dict[str, Any]) -> int:
        """The largest micro-batch predicted to fit, evened out (the same number of micro-batches, of equal sizes: 8
        rather than 9 for a batch of 32, which both split in 4 passes, with less memory)."""
        plan = plan_for(params, None, self.devices)
        self.estimator.baseline_for(plan)  # takes in the shape's measurements kept until now
        # and by the calibrations: a measurement moves the baselines, and the choice with them
        shape = shape_key(params)
        key = (*shape, self.estimator.calibrations)
        if key not in self._cache:
            self._cache[key] = self.estimator.largest_micro(plan, self.budget_bytes, self.batch_size)
        return min(self._cache[key], self._ceiling.get(shape, self._cache[key]))

    def hold(self, params: dict[str, Any], ceiling: int) -> None:
        """This shape's ``auto`` is at most ``ceiling`` (a retry's, carried from whichever worker saw the OOM)."""
        shape = shape_key(params)
        self._ceiling[shape] = min(self._ceiling.get(shape, ceiling), ceiling)

    def ran_out(self, params: dict[str, Any], micro: int | None) -> int | None:
        """Lower the shape's ``auto`` ceiling after an ``auto`` micro-batch ran out of memory.

        The estimate fell short of the shape's need (on CUDA: compile, float8, kernels' scratch). As it knows nothing
        of why, the shape's ``auto`` is held to half of that micro-batch from now on (as the runtime halves after an
        OOM), evened out, down to 1. Returns the new ceiling when it is lower (the
        point is then to be tried again), else None."""
        if params.get("micro_batch_size") != AUTO or not micro or micro <= 1:
            return None
        shape = shape_key(params)
        ceiling = max(m for m in even_micro_batches(self.batch_size) if m <= max(1, micro // 2))
        if ceiling >= self._ceiling.get(shape, micro):
            return None
        self._ceiling[shape] = ceiling
        return ceiling
