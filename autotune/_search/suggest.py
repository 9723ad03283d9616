"""``autotune suggest``: a tuned file from the models alone, no trial: the space's plans predicted to fit the budget
(the memory estimate, in the search's own measure) ranked by predicted speed (the step-time model), the fastest
written, marked predicted in its header and provenance. For this machine's device or one of the table
(``--device-type``), which need not be here."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune._device.budget import Budget, format_bytes, resolve_budget
from autotune._device.load import busy
from autotune._plan.plan import Plan
from autotune._plan.provenance import Provenance
from autotune._plan.space import AUTO, default_space_name, load_space, plan_for
from autotune._search.memory import SearchEstimator
from autotune._search.speed import SearchSpeed, modelled_dimensions, ranked_candidates

if TYPE_CHECKING:
    from autotune._estimate.devices import DeviceSpeed
    from autotune._estimate.step_time import SpeedPrediction

__all__ = ["SuggestResult", "Suggested", "suggest"]

#: The provenance's ``produced_by`` of a suggested plan.
PRODUCED_BY = "suggest: predicted by the step-time and memory models, not measured"


@dataclass(frozen=True)
class Suggested:
    """One plan predicted to fit: its predicted speed and peak (in the search's measure; None: not estimated)."""

    plan: Plan
    speed: SpeedPrediction
    peak_bytes: int | None

    def as_dict(self) -> dict[str, Any]:
        return {"plan": {k: v for k, v in self.plan.to_dict().items() if k != "format_version"},
                "predicted_peak_bytes": self.peak_bytes, **self.speed.as_dict()}


@dataclass(frozen=True)
class SuggestResult:
    """What ``suggest`` ranked (the fastest first, the one written first) and on what."""

    ranked: list[Suggested]
    device_name: str
    what_if: bool
    batch_size: int
    budget_bytes: int
    notes: tuple[str, ...] = ()
    sureness: str = ""  # how sure the ranking is, from what calibrated it (:func:`sureness`)


def suggest(*, target: str, config: str | None, budget: Budget | None, device: Any, device_speed: DeviceSpeed | None,
            device_memory: int | None, space: str | None, devices: int, out: str | Path | None, top: int = 5,
            command: str | None = None) -> SuggestResult:
    """Rank ``space``'s plans predicted to fit ``budget`` by predicted samples/s and write the fastest to ``out``.

    ``device``: where to trace (``"cuda"`` without CUDA here: what-if); ``device_speed``: the table's entry (None:
    this machine's device, measured once); ``devices``: ranks per run. The dimensions the step-time model does not
    rank (compile, FP8, the allocator, the dataloader) take their space's first choice. On CPU the budget is the
    process's resident set: a short run at micro-batch 1 measures the process's own memory (as ``autotune estimate``
    does), nothing of speed.

    Raises:
        ValueError: for bad input, or when no plan is predicted to fit.
    """
    import torch

    from autotune._estimate.result import estimate_device
    from autotune._search.auto import AutoMicro
    from autotune._target.target import load_target

    resolved, what_if = estimate_device(device if device is not None else
                                        ("cuda" if torch.cuda.is_available() or device_speed else "cpu"))
    if what_if and device_speed is None:
        raise ValueError(f"{resolved} is not on this machine: name its kind with --device-type (h100, a100, l4, ...)")
    budget_bytes = resolve_budget(budget, resolved, what_if=what_if, device_memory=device_memory).budget_bytes
    if resolved.type == "cpu":  # the baseline's short run: its server imports while the target loads
        from autotune._search.trial import start_trial_server

        start_trial_server()
    tgt = load_target(target, config=config)
    batch_size = tgt.batch_size()
    name = space or ("multi_gpu" if devices > 1 else default_space_name(resolved))
    space_obj = load_space(name).for_device(
        resolved, batch_size=batch_size, capability=device_speed.capability if what_if and device_speed else None,
        gpus=devices if what_if else None)
    estimator = SearchEstimator(target=tgt, device=resolved)
    speed = SearchSpeed(estimator, batch_size=batch_size, devices=devices, speed=device_speed)
    calibrated_by: dict[str, Any] = {}
    if resolved.type == "cpu":
        run = estimator.measure_baseline(target=target, config=config, budget_bytes=budget_bytes)
        if run is not None and run.result.samples_per_second:  # the baseline's second run: a speed on this host
            predicted = speed.predict(run.plan)
            if speed.observe(run.plan, run.result.samples_per_second):
                calibrated_by = {"plan": run.plan.describe(), "samples_per_second": run.result.samples_per_second,
                                 "predicted_before": predicted.samples_per_second if predicted else None,
                                 "busy": busy(run.result.load)}
    auto = AutoMicro(estimator=estimator, budget_bytes=budget_bytes, batch_size=batch_size, devices=devices)
    # activation_checkpointing="auto" chooses for the budget, its recompute priced on the device ranked for
    estimator.recompute_budget, estimator.recompute_speed = budget_bytes, lambda: speed.model.speed
    candidates = ranked_candidates(space_obj, limit=top, batch_size=batch_size, devices=devices,
                                   cost=speed.seconds_per_sample, resolve_micro=auto, peak=estimator.peak,
                                   budget_bytes=budget_bytes, tensor_room=budget_bytes - estimator.baseline)
    ranked = []
    for params in candidates:
        full = _with_first_choices(space_obj, params)
        micro = auto(full) if full.get("micro_batch_size") == AUTO else full.get("micro_batch_size")
        plan = estimator.resolved(plan_for(full, micro, devices))  # the levels an 'auto' checkpointing chose
        if devices > 1:
            plan = plan.replace(devices=devices)
        predicted = speed.predict(plan)
        if predicted is not None and math.isfinite(predicted.samples_per_second):
            ranked.append(Suggested(plan, predicted, estimator.peak(plan)))
    if not ranked:
        raise ValueError(f"no plan of space '{space_obj.name}' is predicted to fit {format_bytes(budget_bytes)} on "
                         f"{speed.model.speed.name}: raise the budget, or try a space with offload or sharding")
    best = ranked[0]
    plan = best.plan.replace(budget=str(budget if budget is not None else Budget.parse(budget_bytes)),
                             provenance=Provenance.here(
                                 budget=str(budget) if budget is not None else None,
                                 device_name=speed.model.speed.name + (" (what-if)" if what_if else ""),
                                 device_total_bytes=device_memory, predicted_peak_bytes=best.peak_bytes,
                                 command=command, produced_by=PRODUCED_BY,
                                 prediction={**best.speed.as_dict(), **({"calibrated_by": calibrated_by}
                                                                        if calibrated_by else {})}))
    if out is not None:
        plan.save(out, command=command)
    unranked = [d.name for d in space_obj.dimensions if d.name not in modelled_dimensions(space_obj)]
    notes = space_obj.notes + ((f"not ranked by the model, so at the space's first choice: {', '.join(unranked)}",)
                               if unranked else ())
    return SuggestResult([Suggested(plan, best.speed, best.peak_bytes), *ranked[1:]], speed.model.speed.name,
                         what_if, batch_size, budget_bytes, notes, sureness(calibrated_by, best.speed))


#: How far an uncalibrated prediction may be off (a datasheet's device, or this CPU before any run of the target):
#: a factor of 3 either way was seen on CPU targets (issue 54: 1,590.6/s predicted, 508/s measured).
UNCALIBRATED = "uncalibrated: the device's speeds alone (seen off by up to 3x); `autotune search` measures"


def sureness(calibrated_by: dict[str, Any], speed: SpeedPrediction) -> str:
    """How sure a suggestion is, from what its model was calibrated by: a sentence for the CLI."""
    if not calibrated_by:
        return UNCALIBRATED
    before = calibrated_by.get("predicted_before")
    off = f" (the model said {before:.1f}/s before it)" if before else ""
    host = (" beside a busy host, so every figure reads low by as much as the neighbours took"
            if calibrated_by.get("busy") else "")
    return (f"calibrated by one short run on this host: {calibrated_by['plan']} measured "
            f"{calibrated_by['samples_per_second']:.1f}/s{host}{off}; the other plans are predicted from it by the "
            "model's structure: one calibrating run put its predictions within 10-15% in the median on the CPU targets "
            "of docs/benchmarks.md (\"Throughput prediction\"); `autotune search` measures")



def _with_first_choices(space: Any, params: dict[str, Any]) -> dict[str, Any]:
    """``params`` with every other active dimension of ``space`` at its first choice."""
    out: dict[str, Any] = {}
    for dim in space.dimensions:
        if dim.active(out):
            out[dim.name] = params.get(dim.name, dim.choices[0])
    return out
