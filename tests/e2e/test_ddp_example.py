"""The DDP example (examples/ddp): data, model, factory, and the multi_gpu search on 2 CPU ranks end to end."""

from __future__ import annotations

import math
import os
import sys
import threading
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import optuna
import psutil
import pytest
import torch
import yaml
from lightning.pytorch.strategies import DDPStrategy
from optuna.trial import TrialState

from autotune import load_plan
from autotune._device.budget import resolve_budget
from autotune._search.confirm import GUIDED
from autotune._search.halving import RUNG
from autotune._search.twin import TWIN
from autotune._transforms.blocks import find_blocks
from autotune._search.trial import TrialSpec, run_trial
from autotune._transforms.blocks import find_blocks
from autotune.callbacks import ElasticBatchSize
from tests.support.docs import run_documented, scratch_folder
from tests.support.examples import load_example, one_thread  # noqa: F401 (one_thread: a fixture)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "ddp"
CONFIG = EXAMPLE / "config.yaml"
TARGET = f"{EXAMPLE / 'train.py'}:make"

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def train() -> ModuleType:
    return load_example("ddp")


def test_batches_have_documented_shape_and_are_deterministic(train: ModuleType) -> None:
    def first_batch(seed: int) -> list[torch.Tensor]:
        dm = train.SyntheticClasses(features=8, batch_size=16, num_samples=64, val_samples=16, seed=seed)
        dm.setup("fit")
        return next(iter(dm.train_dataloader()))

    x, y = first_batch(0)
    assert x.shape == (16, 8) and x.dtype == torch.float32 and float(x.abs().max()) < 1.0  # tanh
    assert y.shape == (16,) and y.dtype == torch.long and 0 <= int(y.min()) and int(y.max()) < 8
    x2, y2 = first_batch(0)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    x3, _ = first_batch(1)
    assert not torch.equal(x, x3)


@pytest.mark.parametrize(
    ("make", "kwargs", "match"),
    [
        ("SyntheticClasses", {"batch_size": 0}, "`batch_size` must be an int >= 1; got 0"),
        ("SyntheticClasses", {"separation": 0}, "`separation` must be a number > 0; got 0"),
        ("MLPClassifier", {"depth": 0}, "`depth` must be an int >= 1; got 0"),
        ("MLPClassifier", {"lr": -1.0}, "`lr` must be > 0; got -1.0"),
    ],
)
def test_rejects_bad_arguments(train: ModuleType, make: str, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        getattr(train, make)(**kwargs)


def test_make_matches_the_config_and_learns(train: ModuleType) -> None:
    config = yaml.safe_load(CONFIG.read_text())
    model, data = train.make()
    for key, value in config["model"].items():
        assert model.hparams[key] == value, key
    for key, value in config["data"].items():
        assert data.hparams[key] == value, key
    trainer = config["trainer"]
    assert (trainer["devices"], trainer["strategy"], trainer["accumulate_grad_batches"]) == (2, "ddp", 1)
    assert find_blocks(model) == list(model.blocks)  # what activation checkpointing recomputes

    torch.manual_seed(0)
    data.setup("fit")
    optimizer = torch.optim.AdamW(model.parameters(), lr=model.hparams.lr)
    losses = []
    for batch, _ in zip(data.train_dataloader(), range(40)):
        loss, _ = model.loss_and_accuracy(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(8), abs=0.3), losses  # an untrained model guesses uniformly
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, losses  # ~2.1 -> ~0.7 nats


@pytest.fixture(scope="module")
def searched(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[optuna.trial.FrozenTrial]]:
    """The README's commands as a reader runs them (tests/e2e/test_docs.py leaves this README to this file): the
    training run, the search (2 trials of at most 5 timed steps, each trial DDP on 2 CPU ranks) and the tuned run on 2
    ranks; the search's study and tuned file are what the tests here examine."""
    folder = scratch_folder(tmp_path_factory.mktemp("ddp_readme"))
    outputs = run_documented(EXAMPLE / "README.md", cwd=folder)
    assert [c.split()[:2] for c in outputs] == [["python", "examples/ddp/train.py"], ["autotune", "search"],
                                                 ["python", "examples/ddp/train.py"]], list(outputs)
    storage = f"sqlite:///{folder}/autotune.db"
    [study] = optuna.get_all_study_names(storage)
    return folder / "tuned.yaml", optuna.load_study(study_name=study, storage=storage).get_trials()


@pytest.mark.slow
def test_search_on_two_ranks_measures_ddp_and_fsdp_plans(searched: tuple[Path, list[Any]]) -> None:
    out, trials = searched
    finished = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    # no trial failed; a queued trial the model's contradiction dropped before it ran is the only FAIL Optuna allows
    assert not [t for t in trials if t.state == TrialState.FAIL and t.user_attrs.get("status") != "dropped"]
    # the step-time model's pick and the multi_gpu space's seeds (halving's rung and the leader's plain twin apart):
    # DDP, and FSDP2 sharding (ZeRO-3 style) on the same 2 ranks, each measured
    measured = [t for t in finished if not t.user_attrs.get(RUNG) and t.user_attrs.get(TWIN) is None]
    # at least --trials; at most the first trials queued (halving's ladder runs what the search left queued), those a
    # contradicted model dropped replaced one for one, not added to
    first = [t for t in trials if t.user_attrs.get(GUIDED, -1) >= 0]
    assert 2 <= len(measured) <= len(first)
    assert {t.params["strategy"] for t in measured if t.user_attrs["status"] == "ok"} == {"ddp", "fsdp"}
    for t in measured:
        assert t.user_attrs["plan"].startswith("ddp, " if t.params["strategy"] == "ddp" else "fsdp")
    for t in finished:
        assert t.user_attrs["source"] == "measured" and t.user_attrs["status"] in ("ok", "pruned")
        assert t.user_attrs["samples_per_second"] > 0 and t.user_attrs["steps_timed"] >= 1
        assert 0 < t.user_attrs["peak_bytes"] < 2 * 2**30  # the larger rank's peak, under the budget

    plan = load_plan(out)
    assert plan.strategy in ("ddp", "fsdp") and plan.budget == "2GiB"
    assert plan.devices == 2  # the ranks its figures were measured on, whatever the strategy
    assert plan.micro_batch_size in (1, 2, 4, 8, 16, 32, 64)
    assert plan.provenance.samples_per_second and plan.provenance.peak_bytes
    assert plan.provenance.produced_by.startswith("search (study 'autotune-ddp-train.py:make-2GiB-multi_gpu-cpu'")
    tuned = yaml.safe_load(out.read_text())
    assert tuned["trainer"]["accumulate_grad_batches"] == 1
    assert tuned["trainer"]["strategy"] == "ddp" if plan.strategy == "ddp" else \
        tuned["trainer"]["strategy"]["class_path"] == "lightning.pytorch.strategies.ModelParallelStrategy"


@pytest.mark.slow
def test_tuned_file_configures_ddp_on_two_cpu_ranks_through_the_cli(
    train: ModuleType, searched: tuple[Path, list[Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's tuned run up to the launch (``run=False``): with ``strategy: ddp`` Lightning starts rank 1 by
    running the script again, which an in-process test cannot let it do."""
    monkeypatch.setattr(sys, "argv", ["train.py"])
    out, _ = searched
    cli = train.MLPCLI(
        train.MLPClassifier, train.SyntheticClasses, run=False,
        args=["--config", str(CONFIG), "--config", str(out), "--trainer.devices=2", "--trainer.strategy=ddp",
              f"--trainer.default_root_dir={tmp_path}"],
    )
    trainer = cli.trainer
    assert isinstance(trainer.strategy, DDPStrategy) and type(trainer.strategy.launcher).__name__ == \
        "_SubprocessScriptLauncher"  # strategy "ddp": the script is run again for rank 1
    assert (trainer.num_devices, trainer.accelerator.__class__.__name__) == (2, "CPUAccelerator")
    plan = load_plan(out)
    # the config's ElasticBatchSize, then the tuned file's, appended after it: the later one runs
    users, elastic = [cb for cb in trainer.callbacks if isinstance(cb, ElasticBatchSize)]
    assert (elastic.micro_batch_size, str(elastic.budget)) == (plan.micro_batch_size, "2GiB")
    assert trainer.precision == plan.precision and trainer.accumulate_grad_batches == 1


@pytest.mark.slow
def test_a_ddp_trial_past_its_timeout_is_killed_with_its_ranks() -> None:
    """The timeout kills the trial process and the rank processes it forked, not the trial process alone."""
    plan = {"strategy": "ddp", "micro_batch_size": 1, "activation_checkpointing": 1.0, "num_workers": 0}
    spec = TrialSpec(target=TARGET, config=None, plan=plan, budget=resolve_budget("2GiB", "cpu"), device="cpu",
                     devices=2, steps=10_000, warmup=1,
                     interval=1e-9)  # never precise enough: it runs until the timeout
    seen: set[psutil.Process] = set()
    done = threading.Event()

    def watch() -> None:  # the trial and its ranks: descendants of ours below the fork server
        while not done.wait(0.2):
            try:
                seen.update(p for p in psutil.Process().children(recursive=True) if p.ppid() != os.getpid())
            except psutil.NoSuchProcess:
                pass

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        result = run_trial(spec, timeout=8)
    finally:
        done.set()
        watcher.join()
    assert result.status == "error" and result.reason == "timed out after 8 s"
    assert len(seen) >= 3  # the trial process and its 2 ranks were running
    alive = [p for p in seen if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert alive == []


@pytest.mark.parametrize("rank0_says", ["enough", "too slow"])
def test_every_rank_follows_rank_0s_timing_decisions(rank0_says: str, tmp_path: Path) -> None:
    """Warm-up's end and the stop are rank 0's decisions, broadcast to every rank: a rank that decided alone (its own
    step times differ a little) would stop while its peers wait in a collective."""
    from autotune._search import meter as meter_module

    codes = {"go on": meter_module._GO_ON, "starts": meter_module._TIMING_STARTS, "enough": meter_module._ENOUGH,
             "too slow": meter_module._TOO_SLOW}
    rank0 = ["go on", "starts", "go on", "go on", rank0_says]  # rank 0's decision after each of 5 steps

    class Strategy:  # this meter is rank 1's: broadcast(src=0) answers with rank 0's decision
        def __init__(self) -> None:
            self.own: list[int] = []

        def broadcast(self, obj: int, src: int = 0) -> int:
            assert src == 0
            self.own.append(obj)
            return codes[rank0[len(self.own) - 1]]

    spec = TrialSpec(target=TARGET, config=None, plan={}, budget=None, device="cpu", devices=2, steps=20, warmup=1)
    meter = meter_module.Meter(spec=spec, batch_size=64, tokens_per_sample=None, launched=0.0,
                               out=str(tmp_path / "r.json"))
    trainer = SimpleNamespace(global_step=0, should_stop=False, strategy=Strategy())
    module = SimpleNamespace(device=torch.device("cpu"))
    for step in range(5):
        meter.on_train_batch_start(trainer, module, None, step)
        assert not trainer.should_stop
        trainer.global_step = step + 1
        meter.on_train_batch_end(trainer, module, None, None, step)
    assert len(trainer.strategy.own) == 5  # one decision (one collective) per step
    assert len(meter.marks) == 4  # timing started where rank 0 said, after the second step
    assert trainer.should_stop and meter.pruned is (rank0_says == "too slow")
