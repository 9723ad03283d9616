"""MemoryMonitor: logged memory figures on CPU, OOM reports (recovered by ElasticBatchSize or fatal), CUDA snapshots."""

from __future__ import annotations

import csv
import logging
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from autotune import OutOfMemoryAtMinimumError
from autotune.callbacks import ElasticBatchSize, MemoryMonitor
from tests.support.toy import ToyModel, fit, loader, trainer

MB = 2**20
GIB = 2**30
CUDA_KEYS = ("memory/peak_allocated_gib", "memory/peak_reserved_gib", "memory/fragmentation_gib", "memory/alloc_retries")
steps_log = logging.getLogger("tests.monitor")


class OOMAbove(ToyModel):
    """Runs out of memory in ``training_step`` when the micro-batch has more than ``limit`` samples.

    ``error`` replaces the OOM (to check that other errors are not reported); ``huge`` makes the OOM a real CUDA
    allocation larger than the device instead of a simulated one.
    """

    def __init__(self, limit: int, *, error: BaseException | None = None, huge: bool = False) -> None:
        super().__init__(scheduler=False)
        self.limit = limit
        self.error = error
        self.huge = huge

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        steps_log.info("training_step %d size %d", self.trainer.global_step, len(batch[0]))
        if len(batch[0]) > self.limit:
            if self.error is not None:
                raise self.error
            if self.huge:
                too_much = 2 * torch.cuda.get_device_properties(self.device).total_memory
                torch.empty(too_much, dtype=torch.uint8, device=self.device)  # a real CUDA OOM
            raise torch.OutOfMemoryError("simulated")
        return super().training_step(batch, batch_idx)


def oom_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "autotune" and "out of memory" in r.getMessage()]


def read_metrics(logger: CSVLogger) -> list[dict[str, str]]:
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"snapshot_dir": 3}, r"`snapshot_dir` must be a non-empty path .*; got 3"),
        ({"snapshot_dir": ""}, r"`snapshot_dir` must be a non-empty path .*; got ''"),
        ({"record_history": "yes"}, r"`record_history` must be True or False; got 'yes'"),
        ({"max_entries": 0}, r"`max_entries` must be a positive int; got 0"),
        ({"max_entries": True}, r"`max_entries` must be a positive int; got True"),
        ({"max_snapshots": -1}, r"`max_snapshots` must be an int >= 0 \(0 writes none\); got -1"),
        ({"max_snapshots": 2.0}, r"`max_snapshots` must be an int >= 0 \(0 writes none\); got 2.0"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MemoryMonitor(**kwargs)


@pytest.mark.parametrize(("every", "logged_steps"), [(1, [0, 1, 2, 3]), (2, [1, 3])])
def test_cpu_figures_are_logged_on_the_steps_the_trainer_writes(
    tmp_path: Path, every: int, logged_steps: list[int]
) -> None:
    logger = CSVLogger(tmp_path, name="run")
    monitor = MemoryMonitor()
    fit(ToyModel(), loader(4 * 8, 8), [monitor], logger=logger, log_every_n_steps=every)

    rows = [r for r in read_metrics(logger) if r.get("memory/host_rss_gib")]
    assert [int(r["step"]) for r in rows] == logged_steps
    for row in rows:
        rss, peak = float(row["memory/host_rss_gib"]), float(row["memory/host_peak_rss_gib"])
        assert rss * GIB > 100 * MB  # torch alone keeps more than this resident
        assert peak >= rss
        net = float(row["memory/host_peak_gib"])  # the CPU budget's measure: the peak less file-backed pages
        assert 0 < net < peak
    header = rows[0].keys()
    assert not any(key in header for key in CUDA_KEYS)  # CUDA-only figures are skipped on CPU
    assert monitor.dump_snapshot("manual") is None  # no snapshot on CPU
    assert not (Path(logger.log_dir) / "memory_snapshots").exists()


class SpikeAtFirstStep(ToyModel):
    """Touches 256 MiB of host memory in the first step only, then frees it."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.trainer.global_step == 0:
            spike = torch.ones(256 * MB // 4)
            del spike
        return super().training_step(batch, batch_idx)


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs a resettable peak RSS (Linux)")
def test_cpu_peak_covers_the_steps_since_the_previous_write(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path, name="run")
    fit(SpikeAtFirstStep(), loader(4 * 8, 8), [MemoryMonitor()], logger=logger, log_every_n_steps=1)

    peaks = [float(r["memory/host_peak_rss_gib"]) * GIB for r in read_metrics(logger) if r.get("memory/host_rss_gib")]
    assert len(peaks) == 4
    assert peaks[0] - max(peaks[1:]) > 200 * MB  # the spike is in step 0's peak only: the peak is reset per write


def test_oom_recovered_by_elastic_is_reported_with_rss_at_the_end_of_that_step(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    monitor = MemoryMonitor()
    elastic = ElasticBatchSize(grow=False)
    fit(OOMAbove(16), loader(3 * 32, 32), [elastic, monitor])

    assert [(e.kind, e.step, e.previous, e.micro_batch_size) for e in elastic.events] == [("oom", 0, 32, 16)]
    warnings = oom_warnings(caplog)
    assert len(warnings) == 1  # reported once, not at every later batch end
    message = warnings[0].getMessage()
    assert "ElasticBatchSize recovered from 1 OOM(s) at step 0" in message
    assert "micro-batch 32 -> 16" in message
    assert "host RSS" in message and "net of file pages)" in message and "peak RSS net of file pages" in message
    # Noticed at the end of the step that recovered, before the next step began.
    order = [r.getMessage() for r in caplog.records if r.name in ("tests.monitor", "autotune")]
    at = order.index(message)
    assert order[at - 1] == "training_step 0 size 16"
    assert order[at + 1] == "training_step 1 size 16"
    assert monitor.snapshots == []  # CPU: the RSS is logged, no snapshot


@pytest.mark.parametrize(
    ("elastic", "error", "expected"),
    [
        (False, None, torch.OutOfMemoryError),
        (True, None, OutOfMemoryAtMinimumError),
        (False, ValueError("not memory"), ValueError),
    ],
    ids=["plain-oom", "elastic-at-minimum", "not-an-oom"],
)
def test_oom_that_ends_fit_is_reported_and_other_errors_are_not(
    caplog: pytest.LogCaptureFixture, elastic: bool, error: BaseException | None, expected: type
) -> None:
    caplog.set_level(logging.WARNING)
    callbacks = [ElasticBatchSize(min_micro_batch_size=32)] if elastic else []
    message = {ValueError: "not memory", OutOfMemoryAtMinimumError: "minimum micro-batch"}.get(expected, "")
    with pytest.raises(expected, match=message):
        fit(OOMAbove(16, error=error), loader(2 * 32, 32), [*callbacks, MemoryMonitor()])

    warnings = oom_warnings(caplog)
    if expected is ValueError:
        assert warnings == []
        return
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert f"{expected.__name__} at step 0, ending the run" in message
    assert "host RSS" in message


def test_events_restored_from_a_checkpoint_are_not_reported_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    elastic = ElasticBatchSize(grow=False)
    t = fit(OOMAbove(16), loader(2 * 32, 32), [elastic, MemoryMonitor()])
    ckpt = tmp_path / "last.ckpt"
    t.save_checkpoint(ckpt)
    assert len(oom_warnings(caplog)) == 1
    caplog.clear()

    resumed = ElasticBatchSize(grow=False)
    trainer([resumed, MemoryMonitor()], max_epochs=2).fit(OOMAbove(16), loader(2 * 32, 32), ckpt_path=ckpt)
    assert [e.kind for e in resumed.events] == ["oom"]  # restored, no new OOM
    assert oom_warnings(caplog) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("elastic", [False, True], ids=["fatal", "recovered-by-elastic"])
def test_real_cuda_oom_writes_a_memory_snapshot(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, elastic: bool
) -> None:
    caplog.set_level(logging.WARNING)
    logger = CSVLogger(tmp_path, name="run")
    monitor = MemoryMonitor(snapshot_dir=tmp_path / "snapshots", max_snapshots=1)
    model = OOMAbove(16, huge=True)
    kwargs: dict[str, Any] = dict(accelerator="gpu", devices=1, logger=logger, log_every_n_steps=1)
    if elastic:
        fit(model, loader(3 * 32, 32), [ElasticBatchSize(grow=False), monitor], **kwargs)
        rows = [r for r in read_metrics(logger) if r.get("memory/peak_reserved_gib")]
        assert len(rows) == 3
        assert all(float(r["memory/peak_reserved_gib"]) >= float(r["memory/peak_allocated_gib"]) > 0 for r in rows)
        assert all(float(r["memory/fragmentation_gib"]) >= 0 for r in rows)
        assert all(float(r["memory/host_rss_gib"]) * GIB > 100 * MB for r in rows)
    else:
        with pytest.raises(torch.OutOfMemoryError, match="out of memory"):
            fit(model, loader(2 * 32, 32), [monitor], **kwargs)

    assert len(monitor.snapshots) == 1
    path = monitor.snapshots[0]
    assert path.parent == tmp_path / "snapshots" and path.suffix == ".pickle"
    with open(path, "rb") as f:
        snapshot = pickle.load(f)
    assert "segments" in snapshot
    actions = {entry["action"] for trace in snapshot["device_traces"] for entry in trace}
    assert "oom" in actions  # the recorded history reaches the failed allocation
    warnings = oom_warnings(caplog)
    assert len(warnings) == 1 and str(path) in warnings[0].getMessage()
    assert monitor.dump_snapshot("again") is None  # max_snapshots=1 reached
