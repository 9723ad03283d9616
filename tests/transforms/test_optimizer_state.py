"""Low-bit optimizer state and bf16-true updates (torchao, on CPU): ApplyPlan swaps the update, keeps the
hyper-parameters and LR schedule, and the estimator predicts the state bytes torchao really stores."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from autotune import Plan, estimate
from autotune._estimate.cuda_rules import CUDA_BLOCK
from autotune._transforms.optim_state import LowBitOptimizer, real_state_bytes, state_tensor_bytes
from autotune.callbacks import ApplyPlan, ElasticBatchSize

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao")
STEPS = 12


class Net(L.LightningModule):
    """Three 128x128 blocks (16384 weights each: quantised) and small biases and head (kept full width)."""

    def __init__(self, optimizer: str = "adamw") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(128, 128), nn.Tanh()) for _ in range(3)))
        self.head = nn.Linear(128, 1)
        self.optimizer = optimizer
        self.lrs: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.head(self.blocks(x)), y)

    def configure_optimizers(self):
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)
        groups = [{"params": self.blocks.parameters(), "weight_decay": 0.1},
                  {"params": self.head.parameters(), "weight_decay": 0.0}]
        cls = torch.optim.AdamW if self.optimizer == "adamw" else torch.optim.Adam
        opt = cls(groups, lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5),
                                                   "interval": "step"}}


def data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 128, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).tanh()), batch_size=16)


class LRs(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        pl_module.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


def fit(*callbacks, optimizer: str = "adamw", precision: str = "32-true") -> tuple[Net, L.Trainer]:
    model = Net(optimizer)
    callbacks = (*callbacks, LRs())
    trainer = L.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks),
                        precision=precision)
    trainer.fit(model, data())
    return model, trainer


@pytest.fixture(scope="module")
def reference():
    model, trainer = fit()
    start = Net()
    return model, trainer, {n: p.detach().clone() for n, p in start.named_parameters()}


# 12 AdamW steps: 8-bit moments change each weight tensor's total update by under 2% (in norm) on this model, 4-bit
# ones by about 20% (16 levels per block of 128)
@pytest.mark.parametrize(("state", "tolerance", "max_share"), [("8bit", 0.05, 0.30), ("4bit", 0.30, 0.20)])
def test_low_bit_state_tracks_adamw_with_a_fraction_of_its_bytes(reference, state, tolerance, max_share):
    ref_model, ref_trainer, start = reference
    model, trainer = fit(ApplyPlan(optimizer_state=state))
    opt = trainer.strategy.optimizers[0]
    assert isinstance(opt, LowBitOptimizer) and state in opt.description
    assert trainer.global_step == ref_trainer.global_step == STEPS
    assert model.lrs == ref_model.lrs  # the same LR schedule: StepLR halves it every 4 steps
    assert model.lrs[0] == 1e-2 and model.lrs[-1] == 1e-2 / 4
    # within `tolerance` of the update the fp32 AdamW made to each tensor (in norm)
    for (name, p), ref in zip(model.named_parameters(), ref_model.parameters()):
        assert (p - ref).norm() <= tolerance * (ref - start[name]).norm(), name
    # measured on the state tensors torchao stores: codes, scales, code map
    full = real_state_bytes(ref_trainer.strategy.optimizers[0])
    assert real_state_bytes(opt) <= max_share * full


def test_the_estimator_predicts_each_states_bytes_within_2_percent():
    batch = next(iter(data()))
    for state in ("full", "8bit", "4bit"):
        model, trainer = fit(ApplyPlan(optimizer_state=state))
        predicted = estimate(model=Net(), batch=batch, plan=Plan(optimizer_state=state),
                             device="cpu").optimizer_state_bytes
        measured = real_state_bytes(trainer.strategy.optimizers[0])
        assert abs(predicted - measured) <= 0.02 * measured, (state, predicted, measured)


def test_closed_form_keeps_small_or_odd_tensors_full_width():
    assert state_tensor_bytes(4096, 4, "8bit") == 4096 + 16 * 4 + 256 * 4
    assert state_tensor_bytes(4096, 4, "4bit") == 2048 + 32 * 4 + 16 * 4
    assert state_tensor_bytes(4095, 4, "8bit") == 4095 * 4  # under torchao's 4096-value threshold
    assert state_tensor_bytes(4096 + 128, 2, "8bit") == (4096 + 128) * 2  # not a multiple of 256


def test_low_bit_composes_with_elastic_micro_batches(reference):
    _, ref_trainer, _ = reference
    model, trainer = fit(ApplyPlan(optimizer_state="8bit"), ElasticBatchSize(micro_batch_size=8))
    assert trainer.global_step == STEPS and isinstance(trainer.strategy.optimizers[0], LowBitOptimizer)


def test_an_optimizer_without_a_low_bit_version_is_refused_in_one_line():
    with pytest.raises(MisconfigurationException,
                       match=r"^ApplyPlan: optimizer_state '8bit' replaces Adam and AdamW with torchao's 8bit versions; "
                             r"SGD has no 8bit version there: use optimizer_state 'full'$"):
        fit(ApplyPlan(optimizer_state="8bit"), optimizer="sgd")
    with pytest.raises(ValueError, match="SGD has no 4bit version there"):
        estimate(model=Net("sgd"), batch=next(iter(data())), plan=Plan(optimizer_state="4bit"), device="cpu")


def test_bf16_true_updates_round_stochastically_and_other_optimizers_are_kept():
    model, trainer = fit(ApplyPlan(), precision="bf16-true")
    opt = trainer.strategy.optimizers[0]
    assert isinstance(opt, LowBitOptimizer) and opt.description == "AdamW (torchao, bf16 stochastic rounding)"
    assert opt.inner.bf16_stochastic_round and all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.lrs == fit()[0].lrs
    # Kept as written, and said once: SGD, and Adam with L2 decay (not decoupled), have no stochastic-rounding version
    with pytest.warns(UserWarning, match=r"precision bf16-true with SGD: its updates are plain bf16, so updates "
                                         r"smaller than a weight's bf16 resolution are lost"):
        _, sgd = fit(ApplyPlan(), optimizer="sgd", precision="bf16-true")
    assert type(sgd.strategy.optimizers[0]) is torch.optim.SGD
    with pytest.warns(UserWarning, match=r"precision bf16-true with Adam: its updates are plain bf16"):
        _, adam = fit(ApplyPlan(), optimizer="adam", precision="bf16-true")
    assert type(adam.strategy.optimizers[0]) is torch.optim.Adam


def test_float8_needs_a_recent_cuda_gpu():
    with pytest.raises(MisconfigurationException, match=r"ApplyPlan\(float8=True\) runs matrix products in FP8, which "
                                                        r"needs a CUDA GPU of compute capability 8.9 or newer"):
        fit(ApplyPlan(float8=True))


def test_compile_memory_budget_is_set_for_the_run_and_restored():
    import torch._functorch.config as functorch_config

    seen = []

    class Probe(L.Callback):
        def on_train_start(self, trainer, pl_module):
            seen.append(functorch_config.activation_memory_budget)

    before = functorch_config.activation_memory_budget
    fit(ApplyPlan(compile=True, compile_memory_budget=0.25), Probe())
    assert seen == [0.25] and functorch_config.activation_memory_budget == before


def _fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
@pytest.mark.skipif(not _fp8_gpu(), reason="needs a CUDA GPU of compute capability 8.9 or newer")
def test_float8_converts_the_linear_layers_and_trains_on_cuda():
    model = Net()
    trainer = L.Trainer(max_steps=4, accelerator="cuda", devices=1, precision="bf16-mixed", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[ApplyPlan(float8=True, optimizer_state="8bit")])
    trainer.fit(model, data())
    converted = [m for m in model.modules() if type(m).__name__ == "Float8Linear"]
    assert len(converted) == 3  # the 128x128 blocks; the head (out_features 1) stays a Linear
    assert trainer.global_step == 4 and all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_low_bit_state_on_cuda_matches_the_estimate():
    batch = next(iter(data()))
    for state in ("8bit", "4bit"):
        trainer = L.Trainer(max_steps=2, accelerator="cuda", devices=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False,
                            callbacks=[ApplyPlan(optimizer_state=state)])
        trainer.fit(Net(), data())
        # as the CUDA allocator holds it (each tensor in 512-byte blocks), which is what the CUDA estimate counts; on
        # an H200 the unrounded bytes were 6% under it for this small net (its 4-byte steps and head bias hold 512)
        measured = real_state_bytes(trainer.strategy.optimizers[0], block=CUDA_BLOCK)
        predicted = estimate(model=Net(), batch=batch, plan=Plan(optimizer_state=state), device="cuda")
        assert abs(predicted.optimizer_state_bytes - measured) <= 0.02 * measured, (state, predicted, measured)


def test_a_search_trial_runs_low_bit_state():
    # the trial counts FLOPs with a dispatch mode over its first micro-batch; torchao's compiled update refuses one,
    # so the count stops before the update
    from autotune import measure_plan

    gpt = Path(__file__).resolve().parents[2] / "examples" / "gpt" / "train.py"
    result = measure_plan(target=f"{gpt}:make", plan=Plan(optimizer_state="8bit"), device="cpu", steps=2, warmup=1,
                          timeout=300)
    assert result.status == "ok", result.reason
    assert result.flops_per_sample and result.samples_per_second
