"""ApplyPlan: checkpointing and offload are exact, memory saved is visible, what cannot be applied is refused."""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from autotune._transforms.blocks import checkpoint_blocks, find_blocks, select_blocks
from autotune.callbacks import ApplyPlan, ElasticBatchSize, apply_plan
from tests.support.toy import trainer


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


def test_find_blocks_takes_stacked_layers_over_the_modules_inside_them() -> None:
    # torch.nn.Transformer: its encoder and decoder layers (items of ModuleLists), not the 8 attention modules inside
    model = nn.Transformer(d_model=32, nhead=4, num_encoder_layers=2, num_decoder_layers=3, dim_feedforward=64)
    assert find_blocks(model) == [*model.encoder.layers, *model.decoder.layers]

    class Layer(nn.Sequential):
        def __init__(self) -> None:
            super().__init__(nn.Linear(8, 8), nn.ReLU())

    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(Layer(), Layer(), Layer())

    staged = nn.ModuleList([Stage(), Stage()])  # stacked at two levels: the finer, more numerous layers win alone
    assert find_blocks(staged) == [layer for stage in staged for layer in stage.layers]


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


def test_expandable_segments_change_no_process_setting_off_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    cb = ApplyPlan(expandable_segments=True)  # a constructor changes nothing process-wide
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"
    trainer([cb], max_steps=1).fit(Stack(), datamodule=Data())
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"  # nor does a CPU run
    assert cb._undo == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_expandable_segments_are_set_at_setup_on_cuda_and_undone_at_teardown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    torch.cuda.init()  # CUDA already running: the setting still applies (to the segments made from now on)
    calls: list[str] = []
    real = torch.cuda.memory._set_allocator_settings
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", lambda s: (calls.append(s), real(s)))
    cb = ApplyPlan(expandable_segments=True)
    trainer([cb], max_steps=1, accelerator="cuda").fit(Stack(), datamodule=Data())
    assert calls == ["expandable_segments:True", "expandable_segments:False"]
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ


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
        x = torch.randn(16, 256, 8, device="cuda")  # 4096 tokens: about 1.3 GiB of saved activations
        if cb is not None:
            t = trainer([cb], accelerator="cuda")
            cb.setup(t, model, "fit")
        model(x).sum().backward()  # the gradients exist before the measured step, as in training
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


# ------------------------------------------------------------------------------------------- optimizer offload
# On CUDA with torchao (gpu marker); on the CPU with a stand-in of torchao's optimizer (its layout and behaviour,
# plain CPU copies), the offload check being the only thing bypassed, so the wiring runs without a GPU.


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("torchao") is None,
    reason="needs a CUDA device and torchao")])])
def offload_device(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "cpu":
        from tests.support.offload_standin import HostOffload

        optim = types.ModuleType("torchao.optim")
        optim.CPUOffloadOptimizer = HostOffload  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "torchao", types.ModuleType("torchao"))
        monkeypatch.setitem(sys.modules, "torchao.optim", optim)
        monkeypatch.setattr(apply_plan, "_check_optimizer_offload", lambda trainer: None)
    return request.param


class Scheduled(Stack):
    """AdamW with a per-step LR schedule; out of memory in forward or backward at one step for micro-batches over a
    limit."""

    fault: tuple[str, int, int] | None = None  # (where, step, limit)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        where, step, limit = self.fault or ("", -1, 0)
        if self.trainer.global_step == step and len(x) > limit:
            if where == "forward":
                raise torch.OutOfMemoryError("CUDA out of memory (simulated in forward)")
            # In backward, once the gradients of the last blocks exist (torchao has started copying them).
            hook = self.blocks[2].register_forward_hook(_raise_oom_in_its_backward)
            try:
                return nn.functional.mse_loss(self(x), y)
            finally:
                hook.remove()
        return nn.functional.mse_loss(self(x), y)


def _raise_oom_in_its_backward(module: nn.Module, args: Any, out: torch.Tensor) -> None:
    def raise_oom(grad: torch.Tensor) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory (simulated in backward)")

    out.register_hook(raise_oom)


def train_on(device: str, callbacks: list[Any], *, fault: tuple[str, int, int] | None = None,
             **trainer_kwargs: Any) -> Scheduled:
    L.seed_everything(0, verbose=False)
    model = Scheduled(width=64, dropout=0.0)  # 64 x 256 block weights: offloaded; norms and biases: not
    model.fault = fault
    ckpt_path = trainer_kwargs.pop("ckpt_path", None)
    options = {"accelerator": device, "max_epochs": 2, **trainer_kwargs}  # 8 steps
    trainer(callbacks, **options).fit(model, datamodule=Data(), ckpt_path=ckpt_path)
    return model


def elastic(micro: int = 16) -> ElasticBatchSize:
    return ElasticBatchSize(micro_batch_size=micro, grow=False)


def assert_same_weights(device: str, expected: nn.Module, actual: nn.Module) -> None:
    """Bit for bit on the CPU stand-in; on CUDA the offloaded update ran on the CPU: float rounding only."""
    for p, q in zip(expected.parameters(), actual.parameters()):
        if device == "cpu":
            assert torch.equal(p, q)
        else:
            torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("clip", [None, 0.05])
def test_optimizer_offload_trains_like_the_plain_optimizer(offload_device: str, clip: float | None) -> None:
    plain = train_on(offload_device, [elastic()], gradient_clip_val=clip)
    offloaded = train_on(offload_device, [elastic(), ApplyPlan(optimizer_offload=True)], gradient_clip_val=clip)
    assert_same_weights(offload_device, plain, offloaded)
    opt = offloaded.trainer.optimizers[0]
    assert type(opt).__name__ == "OffloadedOptimizer" and len(opt.offloaded_parameters) == 8
    assert opt.refresh_grads is (clip is not None)
    assert all(s["exp_avg"].device.type == "cpu" for o in opt.offload.optim_dict.values() for s in o.state.values())
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 / 9)  # the schedule went through the user's groups
    assert opt.optimizer is offloaded.lr_schedulers().optimizer  # what LearningRateMonitor unwraps to
    assert all(not (p._post_accumulate_grad_hooks or {}) for p in offloaded.parameters())  # removed at teardown
    host_lrs = {g["lr"] for o in opt.offload.optim_dict.values() for g in o.param_groups}
    assert host_lrs == {opt.param_groups[0]["initial_lr"] / 8}  # copied before each update: the 8th update's


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao")
def test_optimizer_offload_under_bf16_true_keeps_the_stochastic_rounding(monkeypatch: pytest.MonkeyPatch) -> None:
    # bf16-true puts torchao's AdamW (stochastic rounding) in the user's AdamW's place; the offload then runs that
    # update on the host copies (on an H200 the offload rebuilt the wrapper's class and every such trial crashed)
    import torchao.optim

    from tests.support.offload_standin import HostOffload

    monkeypatch.setattr(torchao.optim, "CPUOffloadOptimizer", HostOffload)
    monkeypatch.setattr(apply_plan, "_check_optimizer_offload", lambda trainer: None)
    untrained = Scheduled(width=64, dropout=0.0).to(torch.bfloat16)
    model = train_on("cpu", [elastic(), ApplyPlan(optimizer_offload=True)], precision="bf16-true")
    opt = model.trainer.optimizers[0]
    assert type(opt).__name__ == "OffloadedOptimizer" and len(opt.offloaded_parameters) == 8
    host = list(opt.offload.optim_dict.values())
    assert {type(o).__name__ for o in host} == {"_AdamW"}
    assert all(o.bf16_stochastic_round for o in host)
    assert all(s["exp_avg"].dtype == torch.bfloat16 for o in host for s in o.state.values())
    assert opt.optimizer is model.lr_schedulers().optimizer  # the user's AdamW, under both wrappers
    assert [float(g["lr"]) for o in host for g in o.param_groups] == [pytest.approx(1e-2 / 8)] * 8  # tensors, filled
    assert all(not torch.equal(p, q) for p, q in zip(model.parameters(), untrained.parameters()) if p.numel() >= 4096)


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_optimizer_offload_replays_an_oom_exactly(offload_device: str, where: str) -> None:
    reference = train_on(offload_device, [elastic(8), ApplyPlan(optimizer_offload=True)])
    cb = elastic(16)
    replayed = train_on(offload_device, [cb, ApplyPlan(optimizer_offload=True)], fault=(where, 0, 8))
    assert [(e.kind, e.previous, e.micro_batch_size) for e in cb.events] == [("oom", 16, 8)]
    for p, q in zip(reference.parameters(), replayed.parameters()):
        assert torch.equal(p, q)


class Detour(Scheduled):
    """Micro-batches over 8 samples go through an extra layer as well, and the second of them runs out of memory: the
    detour's gradient exists only in the failed attempt. ``on_fit_start`` rescales the first block's weights after
    the optimizer was offloaded."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.detour = nn.Linear(64, 64)
        self.large_parts = 0

    def on_fit_start(self) -> None:
        with torch.no_grad():
            self.blocks[0].mlp[0].weight.mul_(0.5)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if len(batch[0]) > 8:
            self.large_parts += 1
            if self.large_parts == 2:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated in forward)")
        return super().training_step(batch, batch_idx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        if len(x) > 8:
            h = h + self.detour(h)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def test_optimizer_offload_forgets_gradients_of_a_failed_attempt_and_sees_weights_set_in_hooks(
        offload_device: str) -> None:
    def run(callbacks: list[Any]) -> Detour:
        L.seed_everything(0, verbose=False)
        model = Detour(width=64, dropout=0.0)
        trainer(callbacks, accelerator=offload_device, max_epochs=2).fit(model, datamodule=Data())
        return model

    reference = run([elastic(8)])  # never uses the detour
    cb = elastic(16)
    replayed = run([cb, ApplyPlan(optimizer_offload=True)])  # the detour's gradient from the failed attempt is dropped
    assert [(e.kind, e.previous, e.micro_batch_size) for e in cb.events] == [("oom", 16, 8)]
    assert_same_weights(offload_device, reference, replayed)


def test_optimizer_offload_refuses_to_train_a_parameter_frozen_when_it_started(offload_device: str) -> None:
    class Unfreezes(Scheduled):
        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            self.blocks[0].mlp[0].weight.requires_grad_(batch_idx >= 1)

    L.seed_everything(0, verbose=False)
    model = Unfreezes(width=64, dropout=0.0)
    model.blocks[0].mlp[0].weight.requires_grad_(False)
    with pytest.raises(RuntimeError, match=r"frozen \(requires_grad=False\) when the optimizer was offloaded has a "
                       r"gradient now"):
        trainer([ApplyPlan(optimizer_offload=True)], accelerator=offload_device).fit(model, datamodule=Data())


def test_optimizer_offload_resumes_from_either_kind_of_checkpoint(offload_device: str, tmp_path: Any) -> None:
    plain = train_on(offload_device, [elastic()])
    offloaded = train_on(offload_device, [elastic(), ApplyPlan(optimizer_offload=True)])
    saved = ModelCheckpoint(dirpath=tmp_path)  # at the end of the first epoch
    train_on(offload_device, [elastic(), ApplyPlan(optimizer_offload=True), saved], max_epochs=1,
             enable_checkpointing=True)
    resumed = train_on(offload_device, [elastic(), ApplyPlan(optimizer_offload=True)], ckpt_path=saved.best_model_path)
    for p, q in zip(offloaded.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
    switched = train_on(offload_device, [elastic()], ckpt_path=saved.best_model_path)  # a plain optimizer's layout
    assert_same_weights(offload_device, plain, switched)
    plain_saved = ModelCheckpoint(dirpath=tmp_path / "plain")
    train_on(offload_device, [elastic(), plain_saved], max_epochs=1, enable_checkpointing=True)
    switched_on = train_on(offload_device, [elastic(), ApplyPlan(optimizer_offload=True)],
                           ckpt_path=plain_saved.best_model_path)
    assert_same_weights(offload_device, plain, switched_on)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("torchao") is None,
                    reason="needs a CUDA device and torchao")
def test_optimizer_offload_lowers_cuda_memory() -> None:
    class Peak(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            self.peak = torch.cuda.max_memory_allocated()
            self.kept = torch.cuda.memory_allocated()

    plain, offloaded = Peak(), Peak()
    train_on("cuda", [elastic(), plain])
    model = train_on("cuda", [elastic(), ApplyPlan(optimizer_offload=True), offloaded])
    state_bytes = 2 * sum(p.numel() * 4 for p in model.parameters() if p.numel() >= 4096)  # exp_avg, exp_avg_sq
    assert offloaded.kept <= plain.kept - 0.9 * state_bytes
    assert offloaded.peak <= plain.peak - 0.9 * state_bytes


def test_a_copy_of_a_checkpointed_model_computes_with_its_own_weights() -> None:
    """An EMA of the model (Lightning's EMAWeightAveraging deep-copies it) taken while blocks are checkpointed."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
    checkpoint_blocks([model[0], model[2]], model=model)
    copy = __import__("copy").deepcopy(model)
    x = torch.randn(2, 8, requires_grad=True)
    before = copy(x).detach().clone()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    assert torch.equal(copy(x).detach(), before)  # with and without grad: checkpointed and not
    with torch.no_grad():
        assert torch.equal(copy(x), before)

