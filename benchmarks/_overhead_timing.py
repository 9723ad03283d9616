"""Timing helpers of ``benchmarks/elastic_overhead.py``: the step timer, the snapshot-bytes probe, and wrappers that
time the calls of public functions (the callback's hooks, ``LightningModule.log``, ``gc.collect``,
``torch.distributed.all_reduce``) to attribute the callback's cost."""

from __future__ import annotations

import bisect
import contextlib
import functools
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from autotune.callbacks import ElasticBatchSize


class StepTimer(Callback):
    """Seconds from the end of one optimizer step to the end of the next (the first from the start of training).

    ``times`` is wall-clock time (``time.perf_counter``); ``cpu_times`` is this process's CPU time over the same
    interval, which other processes on the machine barely change (meaningful on CPU only: GPU work is not in it).
    """

    def __init__(self, *, sync_cuda: bool) -> None:
        self.sync_cuda = sync_cuda
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self.marks: list[float] = []  # perf_counter at the end of each optimizer step
        self.snapshot_bytes: list[int] = []  # filled by fit_once for the callback's runs
        self._last = self._last_cpu = 0.0
        self._step = 0

    def _now(self) -> float:
        if self.sync_cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._step = trainer.global_step
        self._last, self._last_cpu = self._now(), time.process_time()

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step == self._step:  # an accumulating batch: the optimizer has not stepped yet
            return
        now, cpu = self._now(), time.process_time()
        self.times.append(now - self._last)
        self.cpu_times.append(cpu - self._last_cpu)
        self.marks.append(now)
        self._last, self._last_cpu = now, cpu
        self._step = trainer.global_step


class SnapshotBytes(Callback):
    """Host bytes the callback copied to protect each step's update (``ElasticBatchSize.update_snapshot_bytes``)."""

    def __init__(self, elastic: ElasticBatchSize) -> None:
        self.elastic = elastic
        self.per_step: list[int] = []

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.per_step.append(self.elastic.update_snapshot_bytes)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


Call = tuple[float, float, float]  # (perf_counter at the start, CPU seconds of the calling thread, wall seconds)


@contextlib.contextmanager
def timed_calls(targets: list[tuple[Any, str, str]], *,
                results: list[Any] | None = None) -> Iterator[dict[str, list[Call]]]:
    """Wrap ``owner.name`` for each ``(owner, name, label)`` and record its calls under ``label`` (and what they
    returned in ``results``); restore after."""
    calls: dict[str, list[Call]] = {label: [] for _, _, label in targets}
    saved = []
    for owner, name, label in targets:
        original = owner.__dict__[name]
        saved.append((owner, name, original))
        setattr(owner, name, _timed(original, calls[label], results))
    try:
        yield calls
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


def _timed(fn: Any, sink: list[Call], results: list[Any] | None = None) -> Any:
    @functools.wraps(fn)  # keeps the signature: the callback's log buffer binds the arguments of the log function
    def timed(*args: Any, **kwargs: Any) -> Any:
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            value = fn(*args, **kwargs)
            if results is not None:
                results.append(value)
            return value
        finally:
            sink.append((start, time.thread_time() - cpu, time.perf_counter() - start))

    return timed


def per_step(calls: list[Call], marks: list[float], warmup: int, *, cpu: bool) -> dict[str, float]:
    """Median over the timed steps of the time spent in ``calls`` started during the step, and calls per step."""
    spent, count = [0.0] * len(marks), [0] * len(marks)
    for start, cpu_s, wall_s in calls:
        i = bisect.bisect_left(marks, start)
        if i < len(marks):
            spent[i] += cpu_s if cpu else wall_s
            count[i] += 1
    timed = range(warmup, len(marks))
    return {"ms_per_step": 1e3 * median([spent[i] for i in timed]), "calls_per_step": median([count[i] for i in timed])}


@contextlib.contextmanager
def all_reduce_dtypes(sink: list[torch.dtype], active: bool) -> Iterator[None]:
    """Record the dtype of every ``torch.distributed.all_reduce`` (inside the timing wrapper, so in the same order)."""
    if not active:
        yield
        return
    timed = torch.distributed.all_reduce

    def record(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sink.append(tensor.dtype)
        return timed(tensor, *args, **kwargs)

    torch.distributed.all_reduce = record
    try:
        yield
    finally:
        torch.distributed.all_reduce = timed
