"""FSDP2 (ModelParallelStrategy, data parallel) with 2 CPU ranks (gloo): ElasticBatchSize's micro-batches against
Lightning's own accumulation under the same sharding, and a clear stop on every rank after an OOM (no replay yet)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException

from autotune.callbacks import ElasticBatchSize
from tests.callbacks.toy import ToyModel, trainer

SCRIPT = Path(__file__).with_name("fsdp_run.py")


def run(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    tmp.mkdir(parents=True, exist_ok=True)
    return subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp), *args], capture_output=True, text=True,
                          timeout=180)  # a hang fails here


def results(tmp: Path, proc: subprocess.CompletedProcess[str]) -> list[dict]:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [torch.load(tmp / f"rank{r}.pt") for r in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("composed", [False, True], ids=["fp32", "bf16-mixed+checkpointing"])
def test_micro_batches_under_fsdp2_match_native_accumulation(tmp_path: Path, composed: bool) -> None:
    # Composed: bf16-mixed (Lightning's autocast) and ApplyPlan's activation checkpointing, applied at setup, before
    # the model's configure_model shards it.
    extra = ("--composed",) if composed else ()
    native = results(tmp_path / "native", run(tmp_path / "native", "--mode", "native", *extra))
    elastic = results(tmp_path / "elastic", run(tmp_path / "elastic", "--mode", "elastic", *extra))
    for r in range(2):
        assert elastic[r]["global_step"] == native[r]["global_step"] == 3
        assert elastic[r]["seen"] == native[r]["seen"] == [16] * 12
        assert elastic[r]["ids"] == native[r]["ids"]  # the same samples on each rank, in the same order
        assert elastic[r]["lrs"] == native[r]["lrs"][3::4]  # one scheduler step per effective batch
        for name, value in elastic[r]["state"].items():
            assert (value - native[r]["state"][name]).abs().max().item() <= 1e-6, name
            assert torch.equal(value, elastic[0]["state"][name])  # ranks agree


@pytest.mark.slow
@pytest.mark.parametrize(("where", "rank"), [("forward", 1), ("step", 0)])
def test_an_oom_under_fsdp2_stops_every_rank_with_one_clear_error(tmp_path: Path, where: str, rank: int) -> None:
    proc = run(tmp_path, "--mode", "elastic", "--where", where, "--rank", str(rank))
    assert proc.returncode != 0
    phase = "update" if where == "step" else "closure"
    assert (f"Out of memory in the {phase} under FSDP2 (ModelParallelStrategy): ElasticBatchSize cannot replay it "
            "yet") in proc.stderr
    assert not list(tmp_path.glob("rank*.pt"))


def test_tensor_parallelism_is_refused() -> None:
    from lightning.pytorch.strategies import ModelParallelStrategy

    t = trainer()
    strategy = ModelParallelStrategy.__new__(ModelParallelStrategy)
    strategy._device_mesh = {"tensor_parallel": SimpleNamespace(size=lambda: 2)}  # the mesh setup_environment makes
    t._accelerator_connector.strategy = strategy
    with pytest.raises(MisconfigurationException, match=r"supports ModelParallelStrategy with data parallelism only "
                       r"\(FSDP2\), but tensor_parallel_size is 2"):
        ElasticBatchSize().setup(t, ToyModel(), "fit")
