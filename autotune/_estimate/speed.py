"""Predict a plan's speed (samples/s, MFU and what bounds it) from the same fake step the memory estimate traces: the
public function (:func:`predict_speed`) and the model one search or table keeps for a target (:class:`SpeedModel`).
The model: :mod:`autotune._estimate.step_time`; the devices: :mod:`autotune._estimate.devices` (the table) and
:mod:`autotune._estimate.local_speed` (this machine's, measured); calibration by trials:
:mod:`autotune._estimate.calibration`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from autotune._device.probe import DeviceSpec
from autotune._estimate.calibration import Calibration
from autotune._estimate.devices import DATASHEET_EFFICIENCY, DeviceSpeed, device_type as table_device
from autotune._estimate.fake_step import OptimizerFactory
from autotune._estimate.result import estimate_device
from autotune._estimate.step_time import BOUNDS, SpeedPrediction, StepParts, predict, step_parts
from autotune._estimate.trace import Traces
from autotune._plan.plan import Plan

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule

    from autotune._estimate.work import StepWork

__all__ = ["SpeedModel", "SpeedPrediction", "predict_speed", "prior_efficiency", "speed_device"]


def speed_device(device: DeviceSpec = None, *, device_type: str | None = None) -> tuple[torch.device, DeviceSpeed]:
    """The device to trace for and its speeds: ``device_type`` from the table (a GPU: traced as CUDA, what-if where
    this machine has none), else this machine's ``device`` measured (:func:`local_device_speed`).

    Raises:
        ValueError: for an unknown ``device_type`` (listing the known), a ``device_type`` with a CPU ``device``, or a
            CUDA device this machine does not have without a ``device_type`` (whose speeds nothing tells).
    """
    if device_type is not None:
        speed = table_device(device_type)
        resolved, _ = estimate_device("cuda" if device is None else device)
        if resolved.type != "cuda":
            raise ValueError(f"--device-type {device_type!r} is a GPU; it cannot be combined with device {device!r}")
        return resolved, speed
    resolved, what_if = estimate_device(device)
    if what_if:
        raise ValueError(f"{resolved} is not on this machine, so its speed cannot be measured: name its kind with "
                         "--device-type (h100, a100, l4, ...) to predict speed")
    from autotune._estimate.local_speed import local_device_speed

    return resolved, local_device_speed(resolved)


def prior_efficiency(speed: DeviceSpeed) -> dict[str, float]:
    """What a step reaches of ``speed``'s figures before any trial: all of a measured device's, the share
    :data:`~autotune._estimate.devices.DATASHEET_EFFICIENCY` of a datasheet's."""
    return {b: 1.0 for b in BOUNDS} if speed.measured else dict(DATASHEET_EFFICIENCY)


def fp32_matmul() -> str:
    """The rate fp32 matrix products run at on CUDA in this process: TF32 where ``torch.set_float32_matmul_precision``
    allows it ("high", "medium"), else fp32."""
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


class SpeedModel:
    """The step-time model of one target on one device: the device's speeds, its batch, and the calibration its
    measured trials make (:meth:`observe`).

    Example:
        >>> model = SpeedModel(speed, batch_size=32)  # doctest: +SKIP
        >>> model.predict(traces.work(8), Plan(micro_batch_size=8)).samples_per_second  # doctest: +SKIP
    """

    def __init__(self, speed: DeviceSpeed, *, batch_size: int, calibration: Calibration | None = None) -> None:
        self.speed, self.batch_size = speed, batch_size
        self.calibration = calibration if calibration is not None else Calibration(prior_efficiency(speed))
        self.fp32 = fp32_matmul()
        # parts by (work, plan, world size): a search ranks its space's plans again after each trial, on the same
        # traces; the work is kept with its parts, so that its id is not reused while the entry lives
        self._parts: dict[tuple[int, str, int], tuple[StepWork, StepParts]] = {}

    def parts(self, work: StepWork, plan: Plan, *, world_size: int = 1) -> StepParts:
        """``plan``'s step by bound at efficiency 1 (operators sorted to their bound at the prior's efficiencies, so
        a trial's parts stay what calibration fitted)."""
        key = (id(work), plan.key(), world_size)
        if key not in self._parts:
            self._parts[key] = (work, step_parts(work, plan, device=self.speed, batch_size=self.batch_size,
                                                 world_size=world_size, efficiency=self.calibration.prior,
                                                 fp32_matmul=self.fp32))
        return self._parts[key][1]

    def predict(self, work: StepWork, plan: Plan, *, world_size: int = 1) -> SpeedPrediction:
        """``plan``'s predicted speed with the efficiencies fitted so far, and the model's error so far."""
        return predict(self.parts(work, plan, world_size=world_size), work=work, plan=plan, device=self.speed,
                       batch_size=self.batch_size, world_size=world_size, efficiency=self.calibration.efficiency,
                       calibrated_from=self.calibration.trials, error=self.calibration.error())

    def observe(self, parts: StepParts, *, samples_per_second: float, world_size: int = 1) -> None:
        """A measured trial of a plan whose parts are ``parts``: its samples/s over all ranks."""
        if samples_per_second > 0:
            self.calibration.add(parts, measured_seconds=world_size * self.batch_size / samples_per_second)


def predict_speed(
    *, model: LightningModule, batch: Any, plan: Plan, device: DeviceSpec = None, device_type: str | None = None,
    world_size: int | None = None, optimizer: OptimizerFactory | None = None,
) -> SpeedPrediction:
    """Predict the speed of training ``model`` with ``plan`` on batches like ``batch`` (one optimizer step each).

    The prediction gives samples/s over all ranks, MFU and the bound. It comes from the operators of the step the
    memory estimate traces, against ``device_type``'s datasheet (``"h100"``, ``"a100-40gb"``, ``"l4"``, ...: need not
    be on this machine) or this machine's ``device``, measured once (cached). It is uncalibrated: a search calibrates
    with its trials.

    Args:
        model: The LightningModule (automatic optimization).
        batch: One optimizer step's batch (the dataloader's: ``plan.micro_batch_size`` splits it).
        plan: Its precision, micro-batch, checkpointing, offload, strategy and optimizer state are modelled.
        device: As :func:`autotune.estimate`; with ``device_type``, a CUDA device (the default).
        device_type: A device of the table (:data:`autotune._estimate.devices.KNOWN_DEVICES`).
        world_size: Ranks (None: the plan's ``devices``, else 1); each runs ``batch``.
        optimizer: Builds the optimizer from the parameters; None: the model's ``configure_optimizers()``.

    Raises:
        ValueError: as :func:`autotune.estimate`, and for an unknown ``device_type`` or a CUDA device this machine
            lacks without one.

    Example:
        >>> predict_speed(model=model, batch=batch, plan=Plan(precision="bf16-mixed"),
        ...               device_type="h100").describe()  # doctest: +SKIP
        '5312.0 samples/s, MFU 38%, compute-bound'
    """
    resolved, speed = speed_device(device, device_type=device_type)
    traces = Traces(model=model, batch=batch, plan=plan, device=resolved, optimizer=optimizer, world_size=world_size)
    micro = min(plan.micro_batch_size or traces.size, traces.size)
    world = traces.world_size
    return SpeedModel(speed, batch_size=traces.size).predict(traces.work(micro), plan.replace(micro_batch_size=micro),
                                                             world_size=world)
