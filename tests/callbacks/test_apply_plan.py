"""ApplyPlan: checkpointing and offload are exact, memory saved is visible, what cannot be applied is refused."""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from autotune._apply import find_blocks, select_blocks
from autotune.callbacks import ApplyPlan, ElasticBatchSize
from tests.callbacks.toy import trainer


class Block(nn.Module):
    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Dropout(dropout), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Stack(L.LightningModule):
    def __init__(self, *, width: int = 32, depth: int = 4, dropout: float = 0.1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width, dropout) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.saved_hooks_active = torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Data(L.LightningDataModule):
    def __init__(self) -> None:
        super().__init__()
        self.num_workers = 0
        self.pin_memory = False
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(256, 8, generator=g), torch.randn(256, 1, generator=g)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x, self.y), batch_size=64, num_workers=self.num_workers,
                          pin_memory=self.pin_memory)


def train(callbacks: list[Any], **model_kwargs: Any) -> Stack:
    L.seed_everything(0, verbose=False)
    model = Stack(**model_kwargs)
    trainer(callbacks).fit(model, datamodule=Data())
    return model


def saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes autograd keeps for backward after one forward (what checkpointing and offload reduce)."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).sum().backward()
    return total


def test_find_blocks_picks_the_repeated_blocks() -> None:
    model = Stack(depth=6)
    assert find_blocks(model) == list(model.blocks)
    assert select_blocks(model, 0.5) == list(model.blocks[:3])
    assert select_blocks(model, 0.0) == []
    assert select_blocks(model, ["LayerNorm"]) == [b.norm for b in model.blocks]
    with pytest.raises(ValueError, match=r"names \['Attention'\] but the model has no such modules; classes with "
                       r"submodules: Block, ModuleList, Sequential, Stack"):
        select_blocks(model, ["Attention"])


@pytest.mark.parametrize("settings", [{"activation_checkpointing": 1.0}, {"activation_checkpointing": ["Block"]},
                                      {"activation_offload": True},
                                      {"activation_checkpointing": 0.5, "activation_offload": True}])
def test_applied_plan_trains_to_the_same_weights(settings: dict[str, Any]) -> None:
    plain = train([ElasticBatchSize(micro_batch_size=16, grow=False)])
    cb = ApplyPlan(**settings)
    applied = train([ElasticBatchSize(micro_batch_size=16, grow=False), cb])  # dropout 0.1 inside the blocks
    for p, q in zip(plain.parameters(), applied.parameters()):
        assert torch.equal(p, q)
    assert all("forward" not in b.__dict__ for b in applied.blocks)  # undone at teardown
    assert applied.saved_hooks_active is settings.get("activation_offload", False)  # save_on_cpu was on
    assert plain.saved_hooks_active is False


def test_checkpointing_saves_activation_memory() -> None:
    model = Stack(width=64, depth=4, dropout=0.0)
    x = torch.randn(32, 8)
    plain = saved_bytes(model, x)
    cb = ApplyPlan(activation_checkpointing=1.0)
    t = trainer([cb])
    t.strategy.connect(model)
    cb.setup(t, model, "fit")
    checkpointed = saved_bytes(model, x)
    cb.teardown(t, model, "fit")
    assert saved_bytes(model, x) == plain
    per_block_input = 32 * 64 * 4
    assert checkpointed <= plain - 4 * 5 * per_block_input  # each block kept ~6 tensors of its width, now 1


def test_dataloader_settings_go_to_the_datamodule() -> None:
    data = Data()
    cb = ApplyPlan(num_workers=2, pin_memory=True)
    L.seed_everything(0, verbose=False)
    t = trainer([cb], max_steps=1)
    t.fit(Stack(), datamodule=data)
    assert (data.num_workers, data.pin_memory) == (2, True)
    loader = t.train_dataloader
    assert loader.num_workers == 2 and loader.pin_memory is True


def test_warns_without_datamodule_attribute_and_on_other_device() -> None:
    x = torch.randn(64, 8)
    loader = DataLoader(TensorDataset(x, x[:, :1]), batch_size=64)
    cb = ApplyPlan(num_workers=2, provenance={"device_name": "NVIDIA H100 80GB HBM3"})
    with pytest.warns(UserWarning, match="measured on 'NVIDIA H100 80GB HBM3' but runs on"):
        with pytest.warns(UserWarning, match=r"sets num_workers=2, but the DataModule has no `num_workers`"):
            trainer([cb], max_steps=1).fit(Stack(), loader)


def test_expandable_segments_is_set_before_cuda_and_refused_after(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    ApplyPlan(expandable_segments=True)
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(MisconfigurationException, match=r"must act before CUDA starts, but CUDA is already "
                       r"initialized\. Start the run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"):
        ApplyPlan(expandable_segments=True)


def test_bad_settings_are_refused_together() -> None:
    with pytest.raises(ValueError, match=r"activation_checkpointing must be a fraction in \[0, 1\].*got -0.5; "
                       r"num_workers must be an int >= 0 or None; got -1"):
        ApplyPlan(activation_checkpointing=-0.5, num_workers=-1)


@pytest.mark.slow
def test_compile_blocks_keeps_the_loss() -> None:
    model = Stack(dropout=0.0)
    x = torch.randn(16, 8)
    expected = model(x)
    cb = ApplyPlan(compile=True)
    t = trainer([cb])
    cb.setup(t, model, "fit")
    assert cb.compiled == list(model.blocks)
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_checkpointing_and_offload_save_cuda_memory() -> None:
    def peak(cb: ApplyPlan | None) -> int:
        model = Stack(width=1024, depth=8, dropout=0.0).cuda()
        x = torch.randn(256, 8, device="cuda").requires_grad_()
        if cb is not None:
            t = trainer([cb], accelerator="cuda")
            cb.setup(t, model, "fit")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with (torch.autograd.graph.save_on_cpu(pin_memory=True) if cb and cb.plan.activation_offload
              else torch.enable_grad()):
            model(x).sum().backward()
        return torch.cuda.max_memory_allocated() - base

    plain = peak(None)
    assert peak(ApplyPlan(activation_checkpointing=1.0)) < 0.6 * plain
    assert peak(ApplyPlan(activation_offload=True)) < 0.6 * plain
