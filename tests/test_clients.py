"""Models we did not write: a transformers GPT-2 built from a small config (no download), trained and estimated with
activation checkpointing through the one wrapping ``ApplyPlan`` and the estimator share."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from autotune import Plan, estimate
from autotune._runtime.blocks import checkpoint_blocks, find_blocks
from autotune.callbacks import ApplyPlan

transformers = pytest.importorskip("transformers")


class HFLit(L.LightningModule):
    """A LightningModule as users write one around a transformers model: the model's own loss."""

    def __init__(self) -> None:
        super().__init__()
        config = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=64, n_positions=32)
        self.model = transformers.GPT2LMHeadModel(config)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _batches(n: int = 3, size: int = 8, length: int = 16) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(64, (size, length), generator=g)
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    return out


@pytest.fixture(scope="module")
def gpt2() -> HFLit:
    torch.manual_seed(0)
    return HFLit()


def test_checkpointed_gpt2_is_estimated_and_checkpointing_lowers_the_estimate(gpt2: HFLit) -> None:
    batch = _batches(1)[0]
    peaks = {c: estimate(model=gpt2, batch=batch, plan=Plan(activation_checkpointing=c), device="cpu")
             for c in (0.0, 0.5, 1.0)}
    assert peaks[1.0].activations_bytes < peaks[0.5].activations_bytes < peaks[0.0].activations_bytes
    assert gpt2.model.config.use_cache is True  # the user's model is not touched


def test_checkpointing_a_model_with_a_kv_cache_trains_the_same_weights() -> None:
    def fit(ckpt: float) -> tuple[list[torch.Tensor], HFLit]:
        torch.manual_seed(0)
        module = HFLit()
        trainer = L.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False,
                            callbacks=[ApplyPlan(activation_checkpointing=ckpt)] if ckpt else [])
        trainer.fit(module, DataLoader(_batches(), batch_size=None))
        return [p.detach().clone() for p in module.parameters()], module

    plain, _ = fit(0.0)
    checkpointed, module = fit(1.0)
    # Within fp32 rounding (the checkpointed run builds its masks without the cache: other kernels' order); with the
    # cache left on, a recompute appended the keys twice (the estimator's trace failed on the [L, 2L] scores).
    assert max(float((a - b).abs().max()) for a, b in zip(plain, checkpointed)) < 1e-5
    assert module.model.config.use_cache is True  # put back at teardown


def test_a_block_that_checkpoints_itself_is_not_checkpointed_twice(gpt2: HFLit) -> None:
    blocks = find_blocks(gpt2)
    assert [type(b).__name__ for b in blocks] == ["GPT2Block", "GPT2Block"]
    gpt2.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        undo = checkpoint_blocks(blocks, model=gpt2)
        assert all("forward" not in b.__dict__ for b in blocks)  # left to transformers' own checkpointing
        assert gpt2.model.config.use_cache is False
        undo()
        assert gpt2.model.config.use_cache is True
    finally:
        gpt2.model.gradient_checkpointing_disable()


_UNTRACEABLE = """
import torch, lightning as L
from autotune import Plan, estimate

class BadMask(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def training_step(self, batch, batch_idx):
        q = self.lin(batch).view(1, 1, 2, 4)  # attention whose mask does not fit its scores, as GPT-2's did
        mask = torch.ones(1, 1, 2, 3, dtype=torch.bool)
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

try:
    estimate(model=BadMask(), batch=torch.ones(2, 4), plan=Plan(), device="cpu")
except ValueError as error:
    print(error)
"""


def test_an_untraceable_step_is_one_line_without_torch_s_log_flood() -> None:
    # In a fresh process, as a user's script: torch's fake-tensor logger writes ~30 lines of stack to stderr there.
    proc = subprocess.run([sys.executable, "-c", _UNTRACEABLE], capture_output=True, text=True, timeout=120)
    assert re.fullmatch(r"cannot trace BadMask.training_step with plan \[32-true, micro all\] under FakeTensorMode "
                        r"\(RuntimeError: .*\)\n", proc.stdout), proc.stdout
    assert "fake_tensor" not in proc.stderr, proc.stderr[-2000:]


# ------------------------------------------------------------------------------------------------ the suite
def _tokens(vocab: int = 64, length: int = 12) -> Callable[[int, int], dict[str, torch.Tensor]]:
    def make(size: int, seed: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(vocab, (size, length), generator=torch.Generator().manual_seed(seed))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    return make


def _images(size_px: int = 32, classes: int = 5) -> Callable[[int, int], dict[str, torch.Tensor]]:
    def make(size: int, seed: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return {"pixel_values": torch.randn(size, 3, size_px, size_px, generator=g),
                "labels": torch.randint(classes, (size,), generator=g)}
    return make


#: Models people train with Lightning, each from a small config (no download), with a batch maker.
CLIENTS: dict[str, tuple[Callable[[], torch.nn.Module], Callable[[int, int], dict[str, torch.Tensor]]]] = {
    "gpt2": (lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_head=4, n_embd=32, vocab_size=64, n_positions=32)), _tokens()),
    "llama": (lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(  # rotary embeddings, grouped-query
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64)), _tokens()),
    "bert-mlm": (lambda: transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64)), _tokens()),
    "t5": (lambda: transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0)), _tokens()),
    "vit": (lambda: transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, num_labels=5)), _images()),
    "resnet": (lambda: transformers.ResNetForImageClassification(transformers.ResNetConfig(
        embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=5)), _images()),
    "convnext": (lambda: transformers.ConvNextForImageClassification(transformers.ConvNextConfig(
        hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, num_labels=5)), _images()),
}


class Client(L.LightningModule):
    """Any of the suite's models, trained on its own loss. At step 0, micro-batches larger than ``limit`` run out of
    memory ``where`` a real OOM surfaces: at the end of "forward" (dropout's masks drawn), in "backward" (a hook on
    the loss) or in the "update" once it changed everything (the first, which creates AdamW's state: the replay must
    put the weights and the state back); ``limit`` None: never."""

    def __init__(self, name: str, limit: int | None = None, where: str = "forward") -> None:
        super().__init__()
        self.model, self.limit, self.where, self.size = CLIENTS[name][0](), limit, where, 0

    def _faults(self) -> bool:
        return self.limit is not None and self.size > self.limit and self.trainer.global_step == 0

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.size = next(iter(batch.values())).shape[0]
        loss = self.model(**batch).loss  # dropout has drawn its masks: a replay must draw the same ones
        if self._faults() and self.where == "forward":
            raise torch.OutOfMemoryError("CUDA out of memory (simulated at the end of forward)")
        if self._faults() and self.where == "backward":
            loss.register_hook(lambda grad: _raise("backward"))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        module = self

        class FaultyAdamW(torch.optim.AdamW):
            def step(self, closure: Any = None) -> Any:  # type: ignore[override]
                loss = closure() if closure is not None else None
                super().step()
                if module._faults() and module.where == "update":
                    _raise("the update, after it changed the weights and made AdamW's state")
                return loss

        return FaultyAdamW(self.parameters(), lr=1e-3)


def _raise(where: str) -> None:
    raise torch.OutOfMemoryError(f"CUDA out of memory (simulated in {where})")


@pytest.mark.parametrize("name", sorted(CLIENTS))
def test_a_client_model_is_estimated_with_each_checkpointing_plan_and_what_if_on_cuda(name: str) -> None:
    torch.manual_seed(0)
    module = Client(name)
    batch = CLIENTS[name][1](8, 0)
    found = {c: estimate(model=module, batch=batch, plan=Plan(activation_checkpointing=c), device="cpu")
             for c in (0.0, 0.5, 1.0)}
    assert found[1.0].activations_bytes <= found[0.5].activations_bytes <= found[0.0].activations_bytes
    assert found[1.0].activations_bytes < found[0.0].activations_bytes, "checkpointing the blocks saved nothing"
    cuda = estimate(model=module, batch=batch, plan=Plan(precision="bf16-mixed", activation_checkpointing=1.0),
                    device="cuda")
    assert cuda.predicted_peak_bytes > 0


@pytest.mark.parametrize("where", ["forward", "backward", "update"])
@pytest.mark.parametrize("name", sorted(CLIENTS))
def test_a_client_model_replays_an_oom_exactly_as_lightning_accumulates(name: str, where: str) -> None:
    from autotune.callbacks import ElasticBatchSize

    batches = [CLIENTS[name][1](8, seed) for seed in range(2)]
    halves = [{k: v[i:i + 4] for k, v in b.items()} for b in batches for i in (0, 4)]

    def fit(module: Client, data: list[dict[str, torch.Tensor]], **kwargs: Any) -> list[torch.Tensor]:
        L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, **kwargs).fit(module, DataLoader(data, batch_size=None))
        return [p.detach().clone() for p in module.parameters()]

    torch.manual_seed(0)
    native = fit(Client(name), halves, accumulate_grad_batches=2)
    torch.manual_seed(0)
    elastic = ElasticBatchSize(grow=False)
    replayed = fit(Client(name, limit=4, where=where), batches, callbacks=[elastic])
    phase = "update" if where == "update" else "closure"
    assert [(e.kind, e.previous, e.micro_batch_size, e.where) for e in elastic.events] == [("oom", 8, 4, phase)]
    assert max(float((a - b).abs().max()) for a, b in zip(native, replayed)) == 0.0


#: The blocks checkpointing (and FSDP2 sharding, and regional compile) finds in each model: docs/plan.md's table.
BLOCKS = {"gpt2": ("GPT2Block", 2), "llama": ("LlamaDecoderLayer", 2), "bert-mlm": ("BertLayer", 2),
          "t5": ("T5Block", 4), "vit": ("ViTLayer", 2), "resnet": ("ResNetConvLayer", 7),
          "convnext": ("ConvNextStage", 2)}


@pytest.mark.parametrize("name", sorted(CLIENTS))
def test_the_blocks_found_are_the_model_s_own_unit(name: str) -> None:
    blocks = find_blocks(CLIENTS[name][0]())
    assert {type(b).__name__ for b in blocks} == {BLOCKS[name][0]} and len(blocks) == BLOCKS[name][1]


@pytest.mark.parametrize("name", sorted(CLIENTS))
def test_a_client_model_trains_the_same_with_checkpointing_and_activation_offload(name: str) -> None:
    batches = [CLIENTS[name][1](4, seed) for seed in range(2)]

    def fit(**plan: Any) -> list[torch.Tensor]:
        torch.manual_seed(0)
        module = Client(name)
        L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, callbacks=[ApplyPlan(**plan)] if plan else []).fit(
            module, DataLoader(batches, batch_size=None))
        return [p.detach().clone() for p in module.parameters()]

    plain = fit()
    applied = fit(activation_checkpointing=0.5, activation_offload=True)
    assert max(float((a - b).abs().max()) for a, b in zip(plain, applied)) < 1e-5  # fp32 rounding at most
    module = Client(name)
    offloaded = estimate(model=module, batch=batches[0], plan=Plan(activation_offload=True), device="cuda")
    kept = estimate(model=module, batch=batches[0], plan=Plan(), device="cuda")
    assert offloaded.activations_bytes < kept.activations_bytes  # what-if CUDA: saved tensors go to the host


def _accuracy_cases() -> list[Any]:
    cases = []
    for name in sorted(CLIENTS):
        for ckpt in (0.0, (BLOCKS[name][0],)):
            marks = []
            if name == "convnext":
                marks.append(pytest.mark.xfail(strict=True, reason="under-predicted by 56% (1.4 MiB of 2.4 MiB): a "
                                                                   "CPU convolution buffer the estimator does not see"))
            if name == "t5" and ckpt:
                continue  # the benchmark's own checkpointing of T5Block fails its recompute check (not ours: ApplyPlan
                # trains it, and the estimate is traced above)
            cases.append(pytest.param(name, ckpt, marks=marks, id=f"{name}-{'ckpt' if ckpt else 'none'}"))
    return cases


@pytest.mark.parametrize(("name", "ckpt"), _accuracy_cases())
def test_a_client_model_s_cpu_estimate_is_within_the_published_accuracy(name: str, ckpt: Any) -> None:
    from tests.test_estimate import bench  # the estimator benchmark's measured peak (profiler's allocator events)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        module = Client(name)
        if hasattr(module.model.config, "use_cache"):
            module.model.config.use_cache = False  # the benchmark's checkpointing does not switch it off itself
        batch = CLIENTS[name][1](8, 0)
        plan = Plan(activation_checkpointing=ckpt)
        predicted = estimate(model=module, batch=batch, plan=plan, device="cpu").predicted_peak_bytes
        measured = bench.measure_peak(model=module, batch=batch, plan=plan, device="cpu")
    finally:
        torch.set_num_threads(threads)
    assert abs(predicted - measured) <= 0.10 * measured, f"{predicted} vs {measured} bytes"  # docs: 10% on CPU
