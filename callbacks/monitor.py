"""``MemoryMonitor``: log the memory each step uses, and leave a trace of where it went when a step runs out."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from autotune._compat.lightning import logs_written_this_step
from autotune._compat.torch import dump_cuda_memory_snapshot, record_cuda_memory_history, stop_cuda_memory_history
from autotune._device.budget import format_bytes
from autotune._device.meter import MemoryMeter, current_host_bytes, current_rss_bytes, peak_rss_bytes
from autotune._device.oom import OutOfMemoryAtMinimumError, is_oom_error
from autotune.callbacks.elastic import ElasticBatchSize

log = logging.getLogger("autotune")

_GIB = 2**30


class MemoryMonitor(Callback):
    """Log per-step memory figures, and write a CUDA memory snapshot when a step runs out of memory.

    Metrics are logged with ``pl_module.log(..., on_step=True, on_epoch=False)`` on the steps the Trainer writes
    (``Trainer(log_every_n_steps=...)``, as Lightning's ``DeviceStatsMonitor`` does); nothing is measured on the
    other steps. Peaks are reset at the start of the first step after each write. So a logged peak covers every
    step since the previous write (one step with ``log_every_n_steps=1``), and a spike in an unlogged step is not
    lost. An :class:`ElasticBatchSize` resets the same peak counters at each attempt of its steps, so with it the
    peak is that of the logged step's last (successful) attempt.

    - CUDA: ``memory/peak_allocated_gib`` and ``memory/peak_reserved_gib`` (caching allocator peaks).
      ``memory/fragmentation_gib``: peak reserved minus peak allocated, what the cache held beyond the live
      tensors' high-water mark, i.e. memory lost to fragmentation and caching at the peak.
      ``memory/alloc_retries``: ``num_alloc_retries`` since the process started, cudaMalloc failures that forced a
      cache flush; a rising count means the step runs at the edge. And ``memory/host_rss_gib``.
    - CPU: ``memory/host_rss_gib`` (now), ``memory/host_peak_rss_gib`` (peak resident set since the reset) and
      ``memory/host_peak_gib`` (that peak net of file-backed pages: what a CPU budget measures).

    Out-of-memory errors are reported with a warning on the ``"autotune"`` logger, whether they end ``fit``
    (``on_exception``) or are recovered by an :class:`ElasticBatchSize` in the same Trainer (noticed at the end of
    the batch from its ``events``). The warning gives the host RSS and, on CUDA, the allocator figures and the path
    of a snapshot pickle to open at https://pytorch.org/memory_viz. Allocation history is
    recorded from ``setup`` to ``teardown`` so the snapshot shows the allocations that led to the OOM.

    Its cost is in docs/elastic.md; most of it is Lightning's ``self.log``.

    Args:
        snapshot_dir: where CUDA snapshots go; None: ``<trainer.log_dir or default_root_dir>/memory_snapshots``.
        record_history: record the CUDA allocation history (Python stacks of the last ``max_entries`` allocs and
            frees) so snapshots show how memory got there; with False they hold the segments only.
        max_entries: allocation events kept in the history ring buffer; torch estimates a few KB of host memory
            each, so the default may hold a few hundred MB once full: lower it where host memory is tight.
        max_snapshots: snapshot files written at most by this callback (0: none); further OOMs are still logged.

    Raises:
        ValueError: for a bad argument, naming it and what is accepted.

    Example:
        >>> from lightning.pytorch import Trainer
        >>> from autotune.callbacks import ElasticBatchSize, MemoryMonitor
        >>> trainer = Trainer(callbacks=[ElasticBatchSize(), MemoryMonitor()], log_every_n_steps=10)  # doctest: +SKIP
    """

    OOM_EVENT_KINDS = frozenset({"oom", "grow_failed", "eval_oom"})
    MEMORY_VIZ_URL = "https://pytorch.org/memory_viz"

    def __init__(
        self,
        *,
        snapshot_dir: str | os.PathLike[str] | None = None,
        record_history: bool = True,
        max_entries: int = 100_000,
        max_snapshots: int = 5,
    ) -> None:
        if snapshot_dir is not None and (not isinstance(snapshot_dir, (str, os.PathLike)) or str(snapshot_dir) == ""):
            raise ValueError(f"`snapshot_dir` must be a non-empty path (str or os.PathLike) or None; got {snapshot_dir!r}")
        if not isinstance(record_history, bool):
            raise ValueError(f"`record_history` must be True or False; got {record_history!r}")
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
            raise ValueError(f"`max_entries` must be a positive int; got {max_entries!r}")
        if isinstance(max_snapshots, bool) or not isinstance(max_snapshots, int) or max_snapshots < 0:
            raise ValueError(f"`max_snapshots` must be an int >= 0 (0 writes none); got {max_snapshots!r}")
        self.snapshot_dir = None if snapshot_dir is None else Path(snapshot_dir)
        self.record_history = record_history
        self.max_entries = max_entries
        self.max_snapshots = max_snapshots
        self.snapshots: list[Path] = []  # files written so far, oldest first
        self._meter: MemoryMeter | None = None
        self._dir: Path | None = None
        self._rank = 0
        self._recording = False
        self._window_open = False
        self._elastic: list[ElasticBatchSize] = []
        self._seen: list[Any] = []  # per ElasticBatchSize: the last event already looked at
        self._armed = False
        self._told_max = False

    # ----------------------------------------------------------------------------------------------- set up
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        device = trainer.strategy.root_device
        self._meter = MemoryMeter(device)
        self._rank = trainer.global_rank
        self._window_open = False
        self._elastic = [cb for cb in trainer.callbacks if isinstance(cb, ElasticBatchSize)]
        self._seen = [None] * len(self._elastic)
        self._armed = False
        if device.type != "cuda":
            return
        root = trainer.log_dir or trainer.default_root_dir  # log_dir is a collective: every rank runs setup
        self._dir = self.snapshot_dir or Path(root) / "memory_snapshots"
        if self.record_history and not self._recording:
            record_cuda_memory_history(max_entries=self.max_entries)
            self._recording = True

    def _arm(self) -> None:
        """Take the events ElasticBatchSize already has (restored from a checkpoint after ``setup``) as seen."""
        if not self._armed:
            self._seen = [next(iter(reversed(cb.events)), None) for cb in self._elastic]
            self._armed = True

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._arm()

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._arm()

    @override
    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._arm()

    @override
    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._arm()

    # -------------------------------------------------------------------------------------------- per batch
    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if not self._window_open and self._meter is not None:
            self._meter.start()
            self._window_open = True

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._poll_elastic(trainer)
        # The same gate as Lightning's DeviceStatsMonitor and LearningRateMonitor: the steps the loggers write.
        if self._meter is None or not logs_written_this_step(trainer):
            return
        for name, value in self.measure().items():
            pl_module.log(name, value, on_step=True, on_epoch=False, batch_size=1)
        self._window_open = False

    @override
    def on_validation_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._poll_elastic(trainer)

    @override
    def on_test_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._poll_elastic(trainer)

    @override
    def on_predict_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._poll_elastic(trainer)

    def measure(self) -> dict[str, float]:
        """The figures logged at a write, in GiB (``alloc_retries``: a count); empty before ``setup``."""
        meter = self._meter
        if meter is None:
            return {}
        rss = current_rss_bytes()  # read before the peak, so the peak (which never drops) is >= it
        if not meter.is_cuda:
            return {"memory/host_rss_gib": rss / _GIB, "memory/host_peak_rss_gib": peak_rss_bytes() / _GIB,
                    "memory/host_peak_gib": meter.peak() / _GIB}
        allocated, reserved = meter.peak_allocated(), meter.peak()
        retries = torch.cuda.memory_stats_as_nested_dict(meter.device).get("num_alloc_retries", 0)
        return {
            "memory/peak_allocated_gib": allocated / _GIB,
            "memory/peak_reserved_gib": reserved / _GIB,
            "memory/fragmentation_gib": (reserved - allocated) / _GIB,
            "memory/alloc_retries": float(retries),
            "memory/host_rss_gib": rss / _GIB,
        }

    # ------------------------------------------------------------------------------------------ out of memory
    def _poll_elastic(self, trainer: Trainer) -> None:
        """Report the OOMs an ElasticBatchSize recovered from since the last look (they never reach on_exception)."""
        if not self._elastic:
            return
        self._arm()
        for i, cb in enumerate(self._elastic):
            events, last = cb.events, self._seen[i]
            if not events or events[-1] is last:
                continue
            new = []
            for event in reversed(events):
                if event is last:
                    break
                new.append(event)
            self._seen[i] = events[-1]
            ooms = [e for e in reversed(new) if e.kind in self.OOM_EVENT_KINDS]
            if not ooms:
                continue
            e = ooms[-1]
            where = f", in the {e.where}" if e.where else ""
            what = (
                f"ElasticBatchSize recovered from {len(ooms)} OOM(s) at step {e.step} ({e.kind}{where}: "
                f"micro-batch {ooms[0].previous} -> {e.micro_batch_size})"
            )
            self._report(tag=f"step{e.step}_{e.kind}", what=what, peak_bytes=max(x.peak_bytes for x in ooms))

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if _caused_by_oom(exception):
            step = trainer.global_step
            self._report(tag=f"step{step}_{type(exception).__name__}",
                         what=f"{type(exception).__name__} at step {step}, ending the run", peak_bytes=None)
        self._stop_recording()  # Lightning does not call teardown after an exception

    def _report(self, *, tag: str, what: str, peak_bytes: int | None) -> None:
        """Warn with the memory figures now; ``peak_bytes``: the failed attempt's peak, when ElasticBatchSize has it."""
        meter = self._meter
        figures = [f"host RSS {format_bytes(current_rss_bytes())}"]
        if meter is not None:
            peak = f"peak {'reserved' if meter.is_cuda else 'RSS net of file pages'}"
            if peak_bytes is not None:
                peak = f"{peak} in the failed attempt {format_bytes(peak_bytes)}"
            else:
                peak = f"{peak} {format_bytes(meter.peak())}"
            if meter.is_cuda:
                allocated = format_bytes(torch.cuda.memory_allocated(meter.device))
                reserved = format_bytes(torch.cuda.memory_reserved(meter.device))
                figures.append(f"CUDA allocated {allocated}, reserved {reserved}, {peak}")
                path = self.dump_snapshot(tag)
                if path is not None:
                    figures.append(f"memory snapshot written to {path} (open it at {self.MEMORY_VIZ_URL})")
            else:  # the peak is in the CPU budget's measure: say where the process is now in it too
                figures[0] += f" ({format_bytes(current_host_bytes())} net of file pages)"
                figures.append(peak)
        log.warning("autotune: out of memory on rank %d: %s; %s", self._rank, what, "; ".join(figures))

    def dump_snapshot(self, reason: str) -> Path | None:
        """Write a CUDA memory snapshot (allocator segments and recorded history) for https://pytorch.org/memory_viz.

        Args:
            reason: a short label, part of the file name (``rank0_00_<reason>.pickle``).

        Returns:
            The file written, or None: not on CUDA (or before ``setup``), ``max_snapshots`` files already written,
            or the write failed (logged).
        """
        if self._dir is None or self._meter is None or not self._meter.is_cuda:
            return None
        if len(self.snapshots) >= self.max_snapshots:
            if not self._told_max:
                log.warning("autotune: not writing more memory snapshots (max_snapshots=%d reached)", self.max_snapshots)
                self._told_max = True
            return None
        slug = re.sub(r"[^A-Za-z0-9]+", "_", reason).strip("_")[:60] or "snapshot"
        path = self._dir / f"rank{self._rank}_{len(self.snapshots):02d}_{slug}.pickle"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            dump_cuda_memory_snapshot(str(path))
        except OSError as exc:
            log.warning("autotune: could not write the memory snapshot %s: %s", path, exc)
            return None
        self.snapshots.append(path)
        return path

    # ------------------------------------------------------------------------------------------- tear down
    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._stop_recording()

    def _stop_recording(self) -> None:
        if self._recording:
            stop_cuda_memory_history()
            self._recording = False


def _caused_by_oom(exc: BaseException) -> bool:
    """Whether ``exc`` or an error it was raised from (as the traceback shows them) is an out-of-memory error."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if is_oom_error(current) or isinstance(current, OutOfMemoryAtMinimumError):
            return True
        seen.add(id(current))
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)
    return False
