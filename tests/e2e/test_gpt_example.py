"""The GPT example (examples/gpt): data, model, factory, and the LightningCLI run with ElasticBatchSize."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
import yaml

from autotune.callbacks import ElasticBatchSize
from tests.support.examples import load_example, one_thread  # noqa: F401 (one_thread: a fixture)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gpt"
CONFIG = EXAMPLE / "config.yaml"

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def train() -> ModuleType:
    return load_example("gpt")


def test_batches_have_documented_shape_and_are_deterministic(train: ModuleType) -> None:
    def first_batches(seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        dm = train.SyntheticTokens(block_size=16, batch_size=8, num_samples=64, val_samples=16, seed=seed)
        dm.setup("fit")
        return next(iter(dm.train_dataloader())), next(iter(dm.val_dataloader()))

    (x, y), (vx, vy) = first_batches(0)
    for t in (x, y, vx, vy):
        assert t.shape == (8, 16) and t.dtype == torch.long
        assert 0 <= int(t.min()) and int(t.max()) < 256
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one token
    (x2, y2), (vx2, vy2) = first_batches(0)
    assert torch.equal(x, x2) and torch.equal(y, y2) and torch.equal(vx, vx2) and torch.equal(vy, vy2)
    (x3, _), (vx3, _) = first_batches(1)
    assert not torch.equal(x, x3) and not torch.equal(vx, vx3)


def test_corpus_follows_its_chain(train: ModuleType) -> None:
    dm = train.SyntheticTokens(block_size=32, num_samples=256, val_samples=32, noise=0.1)
    tokens = dm.corpus()
    assert tokens.shape == (288, 33)
    # With noise 0.1 the most frequent successor of a token follows it ~90% of the time: learnable.
    pairs = tokens[:, :-1] * 256 + tokens[:, 1:]
    counts = torch.bincount(pairs.flatten(), minlength=256 * 256).view(256, 256)
    top_share = counts.max(dim=1).values.sum() / counts.sum()
    assert 0.85 < float(top_share) < 0.95


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"batch_size": 0}, "`batch_size` must be an int >= 1; got 0"),
        ({"batch_size": 64, "num_samples": 32}, r"`num_samples` must be an int >= `batch_size` \(64\); got 32"),
        ({"noise": 1.5}, r"`noise` must be in \[0, 1\]; got 1.5"),
    ],
)
def test_datamodule_rejects_bad_arguments(train: ModuleType, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        train.SyntheticTokens(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n_embd": 65, "n_head": 4}, r"`n_embd` must be a multiple of `n_head` \(4\); got 65"),
        ({"dropout": 1.0}, r"`dropout` must be in \[0, 1\); got 1.0"),
        ({"n_layer": 0}, "`n_layer` must be an int >= 1; got 0"),
    ],
)
def test_model_rejects_bad_arguments(train: ModuleType, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        train.GPT(**kwargs)


def test_model_shapes_and_tied_head(train: ModuleType) -> None:
    tied = train.GPT(n_layer=2, n_embd=32, block_size=16)
    assert tied.tokens_per_sample == 16
    assert len(tied.blocks) == 2 and all(type(b).__name__ == "Block" for b in tied.blocks)
    assert tied.head.weight is tied.tok_emb.weight
    assert tied(torch.zeros(3, 16, dtype=torch.long)).shape == (3, 16, 256)
    untied = train.GPT(n_layer=2, n_embd=32, block_size=16, tie_weights=False)
    assert untied.head.weight is not untied.tok_emb.weight
    with pytest.raises(ValueError, match=r"sequence length 17 is longer than `block_size` \(16\)"):
        tied(torch.zeros(1, 17, dtype=torch.long))


def test_attention_is_causal(train: ModuleType) -> None:
    model = train.GPT(n_layer=2, n_embd=32, block_size=16).eval()
    x = torch.randint(256, (1, 16), generator=torch.Generator().manual_seed(0))
    changed = x.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 256
    with torch.no_grad():
        a, b = model(x), model(changed)
    torch.testing.assert_close(a[0, :10], b[0, :10])  # earlier positions never see later tokens
    assert not torch.allclose(a[0, 10:], b[0, 10:])


def test_warmup_then_cosine_schedule(train: ModuleType) -> None:
    from model import warmup_cosine

    factors = [warmup_cosine(s, warmup_steps=4, total_steps=20, min_ratio=0.1) for s in range(25)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(factors[4:], factors[5:]))  # never rises after the warmup
    assert factors[20] == pytest.approx(0.1) and factors[24] == pytest.approx(0.1)
    assert warmup_cosine(100, warmup_steps=4, total_steps=None, min_ratio=0.1) == 1.0


def test_make_matches_the_config(train: ModuleType) -> None:
    config = yaml.safe_load(CONFIG.read_text())
    model, data = train.make()
    for key, value in config["model"].items():
        assert model.hparams[key] == value, key
    for key, value in config["data"].items():
        assert data.hparams[key] == value, key
    assert (model.hparams.vocab_size, model.hparams.block_size) == (data.vocab_size, data.block_size)
    assert config["trainer"]["accumulate_grad_batches"] == 1


def test_loss_goes_down(train: ModuleType) -> None:
    torch.manual_seed(0)
    model, data = train.make()
    data.setup("fit")
    optimizer = torch.optim.AdamW(model.parameters(), lr=model.hparams.lr)
    losses = []
    batches = iter(data.train_dataloader())
    for _ in range(40):
        loss = model.loss(next(batches))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert first == pytest.approx(math.log(256), abs=0.3)  # an untrained model guesses uniformly
    assert last < first - 2.0, losses  # ~5.5 -> ~1.7 nats in 40 steps


@pytest.mark.slow
def test_cli_trains_with_elastic_batch_size(train: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["train.py"])  # pytest's own arguments are not the CLI's
    cli = train.main(
        args=[
            "fit",
            "--config", str(CONFIG),
            "--trainer.max_steps=6",
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
        ]
    )
    trainer = cli.trainer
    assert trainer.global_step == 6
    elastic = [cb for cb in trainer.callbacks if isinstance(cb, ElasticBatchSize)]
    assert len(elastic) == 1
    assert elastic[0].micro_batch_size == 8
    assert elastic[0].engine is not None and elastic[0].engine.sizes == [8, 8, 8, 8]  # 32 cut into 4 micro-batches
    assert elastic[0].events == []
    assert (cli.model.hparams.block_size, cli.model.hparams.n_layer) == (32, 2)  # block_size linked from data
    assert math.isfinite(float(trainer.callback_metrics["train_loss"]))
    assert (tmp_path / "config.yaml").is_file()
