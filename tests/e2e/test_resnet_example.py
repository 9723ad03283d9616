"""The ResNet example (examples/resnet): data, model, factory, and the LightningCLI run with ElasticBatchSize."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
import yaml

from autotune import Plan
from autotune._transforms.blocks import find_blocks
from autotune.callbacks import ApplyPlan, ElasticBatchSize
from tests.support.examples import load_example, one_thread  # noqa: F401 (one_thread: a fixture)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "resnet"
CONFIG = EXAMPLE / "config.yaml"

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def train() -> ModuleType:
    return load_example("resnet")


def test_batches_have_documented_shape_and_are_deterministic(train: ModuleType) -> None:
    def first_batches(seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        dm = train.SyntheticImages(image_size=8, batch_size=8, num_samples=64, val_samples=16, seed=seed)
        dm.setup("fit")
        return next(iter(dm.train_dataloader())), next(iter(dm.val_dataloader()))

    (x, y), (vx, vy) = first_batches(0)
    for images, labels in ((x, y), (vx, vy)):
        assert images.shape == (8, 3, 8, 8) and images.dtype == torch.float32
        assert labels.shape == (8,) and labels.dtype == torch.long
        assert 0 <= int(labels.min()) and int(labels.max()) < 10
    (x2, y2), (vx2, vy2) = first_batches(0)
    assert torch.equal(x, x2) and torch.equal(y, y2) and torch.equal(vx, vx2) and torch.equal(vy, vy2)
    (x3, _), (vx3, _) = first_batches(1)
    assert not torch.equal(x, x3) and not torch.equal(vx, vx3)


def test_images_are_shifted_class_patterns_plus_noise(train: ModuleType) -> None:
    clean = train.SyntheticImages(image_size=16, num_samples=256, val_samples=32, noise=0.0, max_shift=2)
    protos = clean.prototypes()
    assert protos.shape == (10, 3, 16, 16)
    images, labels = clean.images()
    for image, label in zip(images[:20], labels[:20].tolist()):  # without noise: the class pattern, shifted
        assert any(torch.equal(image, torch.roll(protos[label], (dy, dx), dims=(1, 2)))
                   for dy in range(-2, 3) for dx in range(-2, 3))
    noisy_images, noisy_labels = train.SyntheticImages(image_size=16, num_samples=256, val_samples=32,
                                                       max_shift=2).images()
    assert torch.equal(noisy_labels, labels)
    assert float((noisy_images - images).std()) == pytest.approx(1.0, abs=0.02)  # noise 1.0 on top


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"batch_size": 0}, "`batch_size` must be an int >= 1; got 0"),
        ({"image_size": 2}, "`image_size` must be an int >= 4; got 2"),
        ({"batch_size": 64, "num_samples": 32}, r"`num_samples` must be an int >= `batch_size` \(64\); got 32"),
        ({"noise": -0.5}, "`noise` must be a number >= 0; got -0.5"),
    ],
)
def test_datamodule_rejects_bad_arguments(train: ModuleType, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        train.SyntheticImages(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"widths": ()}, r"`widths` must be a non-empty list of ints >= 1; got \[\]"),
        ({"widths": (16, 0)}, r"`widths\[1\]` must be an int >= 1; got 0"),
        ({"blocks_per_stage": 0}, "`blocks_per_stage` must be an int >= 1; got 0"),
        ({"lr": 0.0}, "`lr` must be > 0; got 0.0"),
    ],
)
def test_model_rejects_bad_arguments(train: ModuleType, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        train.ResNet(**kwargs)


def test_model_stages_and_blocks(train: ModuleType) -> None:
    model = train.ResNet(num_classes=7, in_channels=1, widths=(8, 16, 24), blocks_per_stage=2)
    assert model(torch.zeros(2, 1, 16, 16)).shape == (2, 7)
    x = model.stem(torch.zeros(1, 1, 16, 16))
    sizes = []
    for block in model.blocks:
        x = block(x)
        sizes.append(tuple(x.shape[1:]))
    assert sizes == [(8, 16, 16), (8, 16, 16), (16, 8, 8), (16, 8, 8), (24, 4, 4), (24, 4, 4)]
    # Activation checkpointing (ApplyPlan, the search) finds the six blocks as the model's repeated blocks.
    assert find_blocks(model) == list(model.blocks)
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())


def test_micro_batches_give_the_whole_batch_gradient(train: ModuleType) -> None:
    """GroupNorm normalizes each sample alone: 4 micro-batches of 4, weighted 1/4, give the batch-of-16 gradient."""
    torch.manual_seed(0)
    model = train.ResNet(widths=(8, 16), blocks_per_stage=1)
    images, labels = torch.randn(16, 3, 8, 8), torch.randint(10, (16,))
    model.loss_and_accuracy((images, labels))[0].backward()
    whole = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    for part in range(4):
        sl = slice(4 * part, 4 * part + 4)
        (model.loss_and_accuracy((images[sl], labels[sl]))[0] / 4).backward()
    for full, accumulated in zip(whole, (p.grad for p in model.parameters())):
        torch.testing.assert_close(accumulated, full, rtol=1e-4, atol=1e-6)


def test_make_matches_the_config(train: ModuleType) -> None:
    config = yaml.safe_load(CONFIG.read_text())
    model, data = train.make()
    for key, value in config["model"].items():
        expected = tuple(value) if isinstance(value, list) else value
        assert model.hparams[key] == expected, key
    for key, value in config["data"].items():
        assert data.hparams[key] == value, key
    assert (model.hparams.num_classes, model.hparams.in_channels) == (data.num_classes, data.channels)
    assert config["trainer"]["accumulate_grad_batches"] == 1
    assert data.batch_size == 64 and data.num_workers == 0 and data.pin_memory is False  # what ApplyPlan sets
    assert len(find_blocks(model)) == 6


def test_loss_goes_down(train: ModuleType) -> None:
    torch.manual_seed(0)
    model, data = train.make()
    data.setup("fit")
    optimizer = torch.optim.AdamW(model.parameters(), lr=model.hparams.lr)
    losses = []
    batches = iter(data.train_dataloader())
    for _ in range(30):
        loss, _ = model.loss_and_accuracy(next(batches))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert first == pytest.approx(math.log(10), abs=0.2)  # an untrained model guesses uniformly
    assert last < first - 0.7, losses  # ~2.35 -> ~1.4 nats in 30 steps


def cli_args(tmp_path: Path, *extra: str) -> list[str]:
    return ["fit", "--config", str(CONFIG), *extra, f"--trainer.default_root_dir={tmp_path}",
            "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]


@pytest.mark.slow
def test_cli_trains_with_elastic_batch_size(train: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["train.py"])  # pytest's own arguments are not the CLI's
    cli = train.main(args=cli_args(tmp_path, "--trainer.max_steps=6"))
    trainer = cli.trainer
    assert trainer.global_step == 6
    elastic = [cb for cb in trainer.callbacks if isinstance(cb, ElasticBatchSize)]
    assert len(elastic) == 1
    assert elastic[0].micro_batch_size == 16
    assert elastic[0].engine is not None and elastic[0].engine.sizes == [16, 16, 16, 16]  # 64 cut into 4
    assert elastic[0].events == []
    assert (cli.model.hparams.num_classes, tuple(cli.model.hparams.widths)) == (10, (16, 32, 64))  # num_classes: linked
    assert math.isfinite(float(trainer.callback_metrics["train_loss"]))
    assert (tmp_path / "config.yaml").is_file()


@pytest.mark.slow
def test_cli_runs_a_tuned_file(train: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's tuned run: ``--config config.yaml --config tuned.yaml`` applies the plan's settings."""
    monkeypatch.setattr(sys, "argv", ["train.py"])
    tuned = Plan(micro_batch_size=32, activation_checkpointing=0.5, budget="4GiB", num_workers=0).save(
        tmp_path / "tuned.yaml")
    cli = train.main(args=cli_args(tmp_path, "--config", str(tuned), "--trainer.max_steps=3"))
    trainer = cli.trainer
    assert trainer.global_step == 3
    # the config's ElasticBatchSize, then the tuned file's, appended after it: only the later one runs
    users, elastic = [cb for cb in trainer.callbacks if isinstance(cb, ElasticBatchSize)]
    assert users.engine is None
    assert elastic.engine is not None and elastic.engine.sizes == [32, 32]
    assert elastic.budget_bytes == 4 * 2**30
    (apply,) = [cb for cb in trainer.callbacks if isinstance(cb, ApplyPlan)]
    assert apply.checkpointed == list(cli.model.blocks)[:3]  # half of the six BasicBlocks recompute in backward
