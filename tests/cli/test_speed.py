"""The CLI's speed side: ``autotune estimate`` ranked by predicted samples/s on a device of the table,
``autotune suggest`` writing a tuned file from the models alone, and a bad ``--device-type`` refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autotune import load_plan
from autotune._cli.main import main

ROOT = Path(__file__).resolve().parents[2]
GPT = f"{ROOT / 'examples' / 'gpt' / 'train.py'}:make"


@pytest.mark.parametrize("command", ["estimate", "suggest"])
def test_a_bad_device_type_is_refused_in_one_line_naming_the_known(command: str,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main([command, "no/such/file.py:make", "--device-type", "h900", "--budget", "1GiB"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("autotune: error: --device-type 'h900' is not a known device; known:")
    assert "h100-sxm" in err and "rtx4090" in err
    assert main([command, GPT, "--device-type", "h100", "--device", "cpu", "--budget", "1GiB"]) == 2
    assert "is a GPU; it cannot be combined with --device 'cpu'" in capsys.readouterr().err


def test_estimate_ranks_the_plans_that_fit_by_predicted_speed_on_a_device_not_here(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", GPT, "--device-type", "l4", "--budget", "8GiB", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    speeds = [row["speed"]["samples_per_second"] for row in rows]
    assert len(rows) == 4 and all(row["fits"] for row in rows) and speeds == sorted(speeds, reverse=True)
    assert {row["speed"]["device"] for row in rows} == {"NVIDIA L4"}
    assert all(row["speed"]["bound"] in ("compute", "memory", "launch") for row in rows)
    plain = next(r for r in rows if r["precision"] == "32-true" and not r["activation_checkpointing"])
    recomputed = next(r for r in rows if r["precision"] == "32-true" and r["activation_checkpointing"])
    assert plain["speed"]["samples_per_second"] > recomputed["speed"]["samples_per_second"]


def test_suggest_writes_a_tuned_file_marked_predicted_that_loads_and_runs_under_lightning_cli(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    space = tmp_path / "space.yaml"
    space.write_text("description: two precisions, two micro-batches\ndimensions:\n"
                     "  precision: {choices: [32-true, bf16-mixed]}\n  micro_batch_size: {choices: [8, 32]}\n"
                     "  num_workers: {choices: [0, 1]}\n")
    out = tmp_path / "tuned.yaml"
    assert main(["suggest", GPT, "--device-type", "a100", "--budget", "20GiB", "--space", str(space),
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and "predicted, not measured" in printed
    plan = load_plan(out)
    assert plan.micro_batch_size == 32 and plan.num_workers == 0  # fewer passes; workers at the first choice
    assert plan.provenance.produced_by.startswith("suggest: predicted") and plan.provenance.samples_per_second is None
    assert plan.provenance.prediction["device"] == "NVIDIA A100 SXM4 80GB"
    assert plan.provenance.prediction["samples_per_second"] > 0
    header = out.read_text().splitlines()[2]
    assert header.startswith("# Predicted, not measured: ") and "samples/s" in header
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

    from autotune.callbacks import ApplyPlan, ElasticBatchSize

    cli = LightningCLI(BoringModel, BoringDataModule, run=False, save_config_callback=None,
                       args=["--config", str(out), "--trainer.logger=false"])
    [apply] = [c for c in cli.trainer.callbacks if isinstance(c, ApplyPlan)]
    [elastic] = [c for c in cli.trainer.callbacks if isinstance(c, ElasticBatchSize)]
    assert apply.plan.provenance.prediction == plan.provenance.prediction and elastic.micro_batch_size == 32
