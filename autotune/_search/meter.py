"""How a trial measures: warm-up until step time is stable, then timed steps until the throughput is known to a stated
precision (a 95% interval) or a step cap; the run's peak memory; FLOPs and MFU where the device's peak is known.

Step times are end to end (data loading included), one per optimizer step. The interval is Student's t interval of
the mean step time, turned into samples/s: it says how well *this run* knows its throughput. Runs of the same plan in
other processes scatter more than that (CPU frequency, neighbours, page cache); the search measures its contenders
again for that reason (``autotune/_search/choose.py``).

The meter is a Lightning callback, so this module imports Lightning: only the trial process (and tests) import it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback

from autotune._search.growth import CPU_CREEP, run_peak_of
from autotune._search.records import TRIAL_PID, TrialResult, TrialSpec
from autotune._search.stats import t95

__all__ = ["Meter", "extra_warmup", "peak_flops_per_second", "relative_half_width", "throughput", "warmed_up"]


#: Timed steps a trial takes at least before its interval may stop it, for speed or for precision (below 5, a lucky
#: run of similar steps gives a narrow interval that misses: optional stopping). A trial is stopped as too slow only
#: on its interval, never on a step or a few: on a busy host every step of a few seconds can be slow together.
MIN_TIMED = 5
#: Warm-up ends when a step's time is within this share of the step before it.
STABLE_WITHIN = 0.10
#: Warm-up steps a trial may add to its minimum while the step time has not settled (no more than its timed steps).
EXTRA_WARMUP = 5


def extra_warmup(steps: int) -> int:
    """Warm-up steps a trial of at most ``steps`` timed steps may add: ``EXTRA_WARMUP``, or ``steps`` if fewer (a
    short measurement asked for is not made long by its warm-up)."""
    return min(EXTRA_WARMUP, steps)

def throughput(durations: Sequence[float], samples_per_step: float) -> tuple[float, float, float]:
    """Samples/s over ``durations`` (seconds per step) and its 95% interval ``(rate, low, high)``.

    The interval is the t interval of the mean step time, inverted; with fewer than two steps it is unbounded.

    Example:
        >>> rate, low, high = throughput([0.10, 0.11, 0.09, 0.10], 32)
        >>> round(rate), low < rate < high
        (320, True)
    """
    mean = statistics.fmean(durations)
    rate = samples_per_step / mean
    if len(durations) < 2:
        return rate, 0.0, math.inf
    half = t95(len(durations) - 1) * statistics.stdev(durations) / math.sqrt(len(durations))
    return rate, samples_per_step / (mean + half), (samples_per_step / (mean - half) if mean > half else math.inf)


def relative_half_width(durations: Sequence[float]) -> float:
    """Half the 95% interval of the mean step time over the mean (``inf`` below two steps)."""
    if len(durations) < 2:
        return math.inf
    half = t95(len(durations) - 1) * statistics.stdev(durations) / math.sqrt(len(durations))
    return half / statistics.fmean(durations)


def warmed_up(durations: Sequence[float], *, minimum: int, extra: int = EXTRA_WARMUP) -> bool:
    """Whether warm-up may end after the steps ``durations`` timed: at least ``minimum`` steps, and the last step's
    time within ``STABLE_WITHIN`` of the one before (or ``extra`` steps past the minimum)."""
    done = len(durations)
    if done < minimum:
        return False
    if done >= minimum + extra:
        return True
    return done >= 2 and abs(durations[-1] - durations[-2]) <= STABLE_WITHIN * durations[-2]


# What rank 0 decides after a step; every rank follows (a rank deciding alone would leave its peers in a collective).
_GO_ON, _TIMING_STARTS, _ENOUGH, _TOO_SLOW = range(4)


class Meter(Callback):
    """Times optimizer steps (warm-up until stable, then until the interval is narrow enough or the cap), counts
    FLOPs of one step, and writes the trial's result at the end of training."""

    def __init__(self, *, spec: TrialSpec, batch_size: int, tokens_per_sample: int | None, launched: float,
                 out: str, trainer_settings: dict[str, Any] | None = None) -> None:
        self.spec, self.batch_size, self.tokens = spec, batch_size, tokens_per_sample
        self.trainer_settings = trainer_settings or {}
        self.out, self.launched = out, launched
        self.first_step: float | None = None
        self.step_start: float | None = None
        self.warmup_durations: list[float] = []
        self.marks: list[float] = []  # step ends from the end of warm-up on
        self.pruned = False
        # FLOPs of one micro-batch's forward and backward, counted in the first step (untimed and never judged
        # for warm-up: the counter's dispatch costs do not lengthen warm-up); with compile in the minimum
        # warm-up's last step, once the compiler has traced the step (not under a dispatch mode)
        self.flops: float | None = None
        self.count_at = spec.warmup - 1 if spec.plan.get("compile") else 0
        self.counted_samples = min(spec.plan.get("micro_batch_size") or batch_size, batch_size)
        # ElasticBatchSize resets the peak at each step's start (as a run measures its budget): the largest step's
        self.step_peak = 0
        self.step_peaks: list[int] = []  # each step's (the meter is reset at each step's start)
        self.timed_from: int | None = None
        self.memory: Any = None  # the budget's MemoryMeter, read only (ElasticBatchSize resets it)
        self.allocated_peak: int | None = None  # CUDA: the largest step's tensor peak
        self.allocated_steps: list[int] = []  # CUDA: each step's tensor peak
        self.context: int | None = None
        self.window: Any = None  # the load the timed steps ran beside (autotune._device.load.LoadWindow)
        self.load: dict[str, Any] | None = None

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.first_step is None:
            self.first_step, self.step_start = time.time(), time.perf_counter()
        if trainer.global_step == self.count_at and self.flops is None:
            from torch.utils.flop_counter import FlopCounterMode

            self.counter = FlopCounterMode(display=False)
            self.counter.__enter__()

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        self._count_done()  # the first micro-batch's: FLOPs grow with the samples, the counter's costs per call

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._count_done()  # forward and backward only: a compiled update (torchao's) refuses dispatch modes

    def _count_done(self) -> None:
        counter = getattr(self, "counter", None)
        if counter is not None and self.flops is None:
            counter.__exit__(None, None, None)
            self.flops = float(counter.get_total_flops())

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._count_done()
        _sync(pl_module.device)
        now = time.perf_counter()
        self.step_peaks.append(self._peak(pl_module))
        self.step_peak = max(self.step_peak, self.step_peaks[-1])
        if pl_module.device.type == "cuda":
            self.allocated_steps.append(self.memory.peak_allocated())
            self.allocated_peak = max(self.allocated_peak or 0, self.allocated_steps[-1])
        if self.marks:
            self.marks.append(now)
        else:
            self.warmup_durations.append(now - (now if self.step_start is None else self.step_start))
            self.step_start = now
        decision = trainer.strategy.broadcast(self._decide(), src=0)  # rank 0's timing decides for all
        if decision == _TIMING_STARTS and not self.marks:
            self.marks = [now]
            self.timed_from = len(self.step_peaks)  # the peaks of the timed steps are the steady ones
            self._watch_load()
        elif decision in (_ENOUGH, _TOO_SLOW):
            self.pruned = decision == _TOO_SLOW
            trainer.should_stop = True
            self._load_seen()

    def _watch_load(self) -> None:
        import os

        from autotune._device.load import LoadWindow

        root = os.environ.get(TRIAL_PID)  # the trial's process: its ranks and workers are this run's own work
        self.window = LoadWindow(int(root) if root else None)
        self.window.start()

    def _load_seen(self) -> None:
        if self.window is not None and self.load is None:
            self.load = self.window.stop().as_dict()

    def _decide(self) -> int:
        if not self.marks:
            stable = warmed_up(self.warmup_durations, minimum=self.spec.warmup, extra=extra_warmup(self.spec.steps))
            return _TIMING_STARTS if stable else _GO_ON
        durations = self.durations()
        if len(durations) >= self.spec.steps:
            return _ENOUGH
        if len(durations) < MIN_TIMED:
            return _GO_ON
        if self.spec.stop_below and self.interval()[1] < self.spec.stop_below:
            return _TOO_SLOW  # even the top of this run's interval is clearly below the contenders
        return _ENOUGH if relative_half_width(durations) <= self.spec.interval else _GO_ON

    def _peak(self, pl_module: Any) -> int:
        if self.memory is None:
            from autotune._device.meter import MemoryMeter

            self.memory = MemoryMeter(pl_module.device)
        return self.memory.peak()

    def durations(self) -> list[float]:
        return [b - a for a, b in zip(self.marks, self.marks[1:])]

    def samples_per_step(self) -> int:
        return self.batch_size * max(1, self.spec.devices)

    def rate(self) -> float:
        return throughput(self.durations(), self.samples_per_step())[0]

    def interval(self) -> tuple[float, float]:
        _, low, high = throughput(self.durations(), self.samples_per_step())
        return low, high

    def peak_noise(self) -> int | None:
        """How much the timed (steady) steps' peaks varied, largest less smallest; None with fewer than two. The
        warm-up's steps are left out: their growth (optimizer state, allocator, workers) is a trend, not noise,
        and the largest of them is in the peak anyway."""
        steady = self.step_peaks[self.timed_from:] if self.timed_from is not None else []
        return max(steady) - min(steady) if len(steady) > 1 else None

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._load_seen()  # the data ran out before the meter stopped the run
        cuda = pl_module.device.type == "cuda"
        context = _context_bytes(pl_module.device)  # CUDA: None where NVML does not list the process
        self.peak = max(self.step_peak, self._peak(pl_module)) + (context or 0)
        if cuda:
            self.allocated_peak = max(self.allocated_peak or 0, self.memory.peak_allocated())
            self.context = context
        if trainer.world_size > 1:  # the worst rank's peak (the budget is per device), with that rank's parts
            import torch

            mine = self.peak
            self.peak = int(trainer.strategy.reduce(torch.tensor(mine, dtype=torch.int64, device=pl_module.device),
                                                    reduce_op="max"))
            if cuda:  # every rank's device is CUDA or none is: all take part in this second collective or none
                worst = mine == self.peak
                # -1: not the worst rank's parts, or not known (NVML does not list the process)
                parts = [x if worst and x is not None else -1 for x in (self.allocated_peak, self.context)]
                reduced = trainer.strategy.reduce(torch.tensor(parts, dtype=torch.int64, device=pl_module.device),
                                                  reduce_op="max")
                self.allocated_peak, self.context = (int(x) if x >= 0 else None for x in reduced.tolist())
        if trainer.global_rank == 0:  # under DDP this runs in the rank processes, not in the trial's own
            Path(self.out).write_text(json.dumps(dataclasses.asdict(self.result())))

    def result(self) -> TrialResult:
        durations = self.durations()
        if not durations:
            return TrialResult("error", reason="no timed step: the data ran out before warm-up ended")
        rate, low, high = throughput(durations, self.samples_per_step())
        per_sample = self.flops / self.counted_samples if self.flops else None
        peak = getattr(self, "peak", None)
        run_peak, run_noise = run_peak_of(self.step_peaks, timed_from=self.timed_from, peak=peak,
                                          creep=0.0 if self.spec.device.startswith("cuda") else CPU_CREEP)
        peak_flops = peak_flops_per_second(self.spec.device, self.spec.plan.get("precision", "32-true"))
        return TrialResult(
            "pruned" if self.pruned else "ok",
            samples_per_second=rate,
            interval=(low, high) if math.isfinite(high) and self.marks else None,
            tokens_per_second=rate * self.tokens if self.tokens else None,
            peak_bytes=peak,
            peak_noise_bytes=self.peak_noise(),
            step_peaks=list(self.step_peaks) or None,
            timed_from=self.timed_from,
            run_peak_bytes=run_peak,
            run_noise_bytes=run_noise,
            load=self.load,
            allocated_peak_bytes=self.allocated_peak,
            context_bytes=self.context,
            allocated_step_peaks=self.allocated_steps or None,
            flops_per_sample=per_sample,
            mfu=per_sample * rate / peak_flops if per_sample and peak_flops else None,
            steps_timed=len(self.durations()),
            warmup_steps=len(self.warmup_durations),
            startup_seconds=(self.first_step or time.time()) - self.launched,
            wall_seconds=time.time() - self.launched,
            reason=(f"stopped early: clearly slower than the best plans so far (its 95% interval tops out at "
                    f"{high:.1f}/s, under {self.spec.stop_below:.1f}/s)") if self.pruned else "",
            trainer_settings=self.trainer_settings,
        )


def peak_flops_per_second(device: str, precision: str) -> float | None:
    """The trial device's dense peak FLOP/s for the precision, or None (CPUs, GPUs not known exactly: no MFU); the
    figures are the step-time model's table (:data:`autotune._estimate.devices.KNOWN_DEVICES`)."""
    if not device.startswith("cuda"):
        return None
    import torch

    from autotune._estimate.devices import peak_flops_for

    props = torch.cuda.get_device_properties(0)
    return peak_flops_for(props.name, (props.major, props.minor), props.multi_processor_count, precision)


def _sync(device: Any) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def _context_bytes(device: Any) -> int | None:
    """CUDA: what NVML counts for this process beyond the allocator's reserve (the CUDA context; None where NVML does
    not list the process, e.g. in a container); 0 on CPU."""
    if device.type != "cuda":
        return 0
    import torch

    from autotune._device.probe import process_device_bytes

    process_now = process_device_bytes(device.index or 0)
    return max(0, process_now - torch.cuda.memory_reserved(device)) if process_now is not None else None
