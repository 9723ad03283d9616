"""Predict each plan's speed for a search with the step-time model, and order the search's trials by it.

It holds each plan's predicted speed on the search's device, calibrated by the trials measured so far
(:class:`SearchSpeed`). It orders the first trials (:func:`ranked_candidates`: predicted to fit, the fastest
predicted first). It tries the dimensions the model does not rank one at a time around the first
(:func:`with_variations`). The model itself: :mod:`autotune._estimate.step_time`; the memory side of the search:
:mod:`autotune._search.memory`; which of two plans does less work: :mod:`autotune._search.cost`.
"""

from __future__ import annotations

import heapq
import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from autotune._plan.plan import Plan
from autotune._plan.space import AUTO, Dimension, SearchSpace, plan_for
from autotune._search.memory import shape_of
from autotune._search.residuals import Corrections

if TYPE_CHECKING:
    from autotune._estimate.devices import DeviceSpeed
    from autotune._estimate.speed import SpeedModel, SpeedPrediction
    from autotune._search.memory import SearchEstimator

__all__ = ["MODELLED", "SearchSpeed", "by_precision", "guided_trials", "modelled_dimensions", "ranked_candidates",
           "with_variations"]

log = logging.getLogger("autotune")

#: A plan predicted over the budget by less than this share of the room for its tensors (the budget less the process
#: baseline) is still tried: measuring settles what the estimate cannot.
FIT_SLACK = 0.02
#: Or, where it is more (on CPU), by this share of the process baseline, which scatters about that much between runs
#: (the GPT example's baseline run: 319.4-320.6 MiB).
BASELINE_SLACK = 0.01
#: The plan fields the step-time model ranks. ``compile`` and ``float8`` are modelled by guesses
#: (:mod:`autotune._estimate.step_time`), so they are tried one at a time instead, as the allocator and dataloader are.
MODELLED = ("precision", "strategy", "reshard_after_forward", "cpu_offload", "micro_batch_size",
            "activation_checkpointing", "activation_offload", "optimizer_offload", "optimizer_state")


class SearchSpeed:
    """The step-time model of a search's target on its device: each plan's predicted speed from the estimator's trace
    of its shape (:meth:`SearchEstimator.work`), calibrated by every trial measured (:meth:`observe`). This machine's
    device is measured at the first prediction (cached: :func:`autotune._estimate.local_speed.local_device_speed`).
    Any failure of the estimator leaves the plan unpredicted (None; ranked last)."""

    def __init__(self, estimator: SearchEstimator, *, batch_size: int, devices: int,
                 speed: DeviceSpeed | None = None) -> None:
        self.estimator, self.batch_size, self.devices = estimator, batch_size, devices
        self._speed = speed
        self._model: SpeedModel | None = None
        self._warned = False
        self.measured: list[tuple[Plan, float]] = []  # every trial observed: its plan and samples/s
        self.corrections = Corrections()  # the model's error by setting, refitted from ``measured`` when stale
        self._stale = False

    @property
    def model(self) -> SpeedModel:
        """The step-time model (the device measured on first use)."""
        if self._model is None:
            from autotune._estimate.speed import SpeedModel

            if self._speed is None:
                from autotune._estimate.local_speed import local_device_speed

                self._speed = local_device_speed(self.estimator.device)
            self._model = SpeedModel(self._speed, batch_size=self.batch_size)
        return self._model

    def predict(self, plan: Plan) -> SpeedPrediction | None:
        """``plan``'s predicted speed over the search's devices, with the efficiencies its trials have fitted and the
        corrections by setting they show (:mod:`autotune._search.residuals`); None when the estimator cannot trace it
        or the device cannot be measured."""
        import dataclasses

        raw = self._calibrated(plan)
        if raw is None:
            return None
        self._refit()
        factor = self.corrections.factor(plan.to_dict())
        error = self.corrections.error()
        return dataclasses.replace(raw, samples_per_second=raw.samples_per_second * factor,
                                   seconds_per_step=raw.seconds_per_step / factor,
                                   mfu=raw.mfu * factor if raw.mfu is not None else None,
                                   error=error if error is not None else raw.error)

    def _calibrated(self, plan: Plan) -> SpeedPrediction | None:
        """The calibrated model's prediction, without the corrections by setting."""
        work = self.estimator.work(plan)
        if work is None:
            return None
        try:
            return self.model.predict(work, plan, world_size=self.devices)
        except Exception as err:  # the model is an aid: a search goes on without it
            self._failed(err)
            return None

    def _refit(self) -> None:
        """The corrections by setting, fitted again from every trial against the model as calibrated now."""
        if not self._stale:
            return
        self._stale = False
        self.corrections.clear()
        for plan, rate in self.measured:
            raw = self._calibrated(plan)
            if raw is not None and raw.samples_per_second > 0:
                self.corrections.add(plan.to_dict(), measured_over_predicted=rate / raw.samples_per_second)

    def _failed(self, err: Exception) -> None:
        if not self._warned:
            self._warned = True
            log.warning("autotune: the step-time model cannot predict this search's plans (%s: %s); the first trials "
                        "are ordered without it", type(err).__name__, " ".join(str(err).split())[:200])

    def seconds_per_sample(self, plan: Plan) -> float:
        """Predicted seconds per sample of ``plan`` (over all ranks); ``inf`` when it cannot be predicted."""
        predicted = self.predict(plan)
        return math.inf if predicted is None else 1 / predicted.samples_per_second

    def observe(self, plan: Plan, samples_per_second: float) -> bool:
        """A trial of ``plan`` measured ``samples_per_second``: the calibration takes it in. Returns whether it
        could (the estimator traced the plan)."""
        work = self.estimator.work(plan)
        if work is None or not samples_per_second:
            return False
        try:
            self.model.observe(self.model.parts(work, plan, world_size=self.devices),
                               samples_per_second=samples_per_second, world_size=self.devices)
        except Exception as err:  # as in predict
            self._failed(err)
            return False
        self.measured.append((plan, samples_per_second))
        self._stale = True
        return True

    def error(self) -> float | None:
        """The model's relative error on this target so far (each measured trial predicted from the others: with the
        corrections by setting from two trials on, else the calibration's)."""
        if self._model is None:
            return None
        self._refit()
        corrected = self.corrections.error()
        return corrected if corrected is not None else self._model.calibration.error()


def modelled_dimensions(space: SearchSpace) -> list[str]:
    """The space's dimensions the step-time model ranks (:data:`MODELLED`), less any whose condition depends on a
    dimension it does not rank."""
    names = {d.name for d in space.dimensions if d.name in MODELLED}
    changed = True
    while changed:
        changed = False
        for dim in space.dimensions:
            if dim.name in names and any(parent not in names for parent in dim.when):
                names.discard(dim.name)
                changed = True
    return [d.name for d in space.dimensions if d.name in names]


def ranked_candidates(space: SearchSpace, *, limit: int, batch_size: int, devices: int,
                      cost: Callable[[Plan], float], resolve_micro: Callable[[dict[str, Any]], int],
                      peak: Callable[[Plan], int | None], budget_bytes: int,
                      tensor_room: int | None = None) -> list[dict[str, Any]]:
    """Up to ``limit`` points of ``space`` (its modelled dimensions only) predicted to fit ``budget_bytes`` (within
    ``FIT_SLACK``), the least ``cost`` first (predicted seconds per sample: :meth:`SearchSpeed.seconds_per_sample`;
    ties keep the space's order); ``auto`` stays ``auto`` (the trial resolves it the same way), ranked at the
    micro-batch it resolves to. Peaks are estimated in cost order and stop once ``limit`` candidates fit. A point
    the estimator cannot tell about counts as fitting. ``tensor_room``: the budget less the process baseline (None:
    the whole budget), of which ``FIT_SLACK`` is the slack (or ``BASELINE_SLACK`` of the baseline, if more). The peak
    grows with the micro-batch: a point whose shape (its plan without the micro-batch) fits at a larger micro-batch
    fits without an estimate of its own."""
    names = modelled_dimensions(space)
    if not names or limit <= 0:
        return []
    tensor_room = budget_bytes if tensor_room is None else max(tensor_room, 0)
    projected = list({repr(sorted((k, v) for k, v in p.items() if k in names)):
                      {k: v for k, v in p.items() if k in names} for p in space.points()}.values())
    queue = []
    for index, params in enumerate(projected):  # ``auto`` first at the whole batch (its best case), resolved if reached
        micro = batch_size if params.get("micro_batch_size") == AUTO else params.get("micro_batch_size")
        plan = plan_for(params, micro, devices)
        queue.append((cost(plan), index, plan, params))
    heapq.heapify(queue)  # cheapest first; ties keep the space's order
    chosen: list[dict[str, Any]] = []
    seen: set[str] = set()
    resolved: set[int] = set()
    limit_bytes = budget_bytes + max(FIT_SLACK * tensor_room, BASELINE_SLACK * (budget_bytes - tensor_room))
    fits_up_to: dict[str, int] = {}  # by shape: the largest micro-batch predicted to fit

    def fits(plan: Plan) -> bool:
        shape, micro = shape_of(plan).key(), plan.micro_batch_size or batch_size
        if micro <= fits_up_to.get(shape, 0):
            return True
        predicted = peak(plan)
        if predicted is None:  # the estimator cannot tell: tried
            return True
        fit = predicted <= limit_bytes
        if fit:
            fits_up_to[shape] = max(fits_up_to.get(shape, 0), micro)
        return fit

    while queue and len(chosen) < limit:
        _, index, plan, params = heapq.heappop(queue)
        if params.get("micro_batch_size") == AUTO and index not in resolved:
            resolved.add(index)  # back in the queue at its real cost
            plan = plan.replace(micro_batch_size=resolve_micro(params))
            heapq.heappush(queue, (cost(plan), index, plan, params))
            continue
        key = plan.key()
        if key in seen:
            continue  # ``auto`` that resolved to a listed micro-batch
        seen.add(key)
        if fits(plan):
            chosen.append(params)
    return chosen


def with_variations(space: SearchSpace, ranked: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Add to the ranked candidates the dimensions the cost model does not know, tried one at a time around the first.

    The first candidate comes with every other dimension at its first choice. Then comes that point with one
    dimension changed (each other choice of each dimension in turn), alternating with the next ranked candidates
    (whose other dimensions the sampler chooses).

    Example:
        >>> space = SearchSpace("s", "", (Dimension("micro_batch_size", (8, 4)), Dimension("num_workers", (0, 1))))
        >>> with_variations(space, [{"micro_batch_size": 8}, {"micro_batch_size": 4}])
        [{'micro_batch_size': 8, 'num_workers': 0}, {'micro_batch_size': 8, 'num_workers': 1}, {'micro_batch_size': 4}]
    """
    if not ranked:
        return []
    top = ranked[0]

    def point(changed: dict[str, Any]) -> dict[str, Any]:
        params: dict[str, Any] = {}
        for dim in space.dimensions:
            if dim.active(params):
                params[dim.name] = changed.get(dim.name, top.get(dim.name, dim.choices[0]))
        return params

    base = point({})
    variations = [point({dim.name: choice}) for dim in space.dimensions if dim.name not in top and dim.name in base
                  for choice in dim.choices[1:]]
    out = [base]
    for i in range(max(len(variations), len(ranked) - 1)):
        out += variations[i:i + 1] + ranked[i + 1:i + 2]
    return list({repr(sorted(p.items())): p for p in out}.values())


def by_precision(space: SearchSpace) -> list[SearchSpace]:
    """``space`` cut to each of its precisions in turn (none where it does not search the precision, or the model
    does not rank it)."""
    import dataclasses

    dim = next((d for d in space.dimensions if d.name == "precision"), None)
    if dim is None or "precision" not in modelled_dimensions(space) or len(dim.choices) < 2:
        return []
    return [dataclasses.replace(space, dimensions=tuple(dataclasses.replace(d, choices=(choice,)) if d is dim else d
                                                        for d in space.dimensions))
            for choice in dim.choices]


def guided_trials(trials: int, seeds: int) -> int:
    """How many of a search's first trials are given (the space's seeds, then ranked candidates): half of them,
    rounded up, and at least the seeds; the sampler proposes the rest.

    Example:
        >>> guided_trials(6, 2), guided_trials(30, 3)
        (3, 15)
    """
    return max(seeds, math.ceil(trials / 2))
