"""What-if CUDA estimates on a machine without CUDA (CUDA's rules on a CPU trace), and the capacity answer."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn

from autotune import Plan, estimate
from autotune._cli.main import main
from autotune._estimate.capacity import estimate_capacity, world_sizes
from autotune._estimate.cuda_rules import CUDA_CONTEXT_BYTES, CudaAutocast
from autotune._estimate.estimate import estimate_target
from autotune._target.target import load_target
from tests.estimate.test_estimate import TINY_TARGET, ROOT, TinyMLP, tiny_batch

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="what-if estimates are for machines without CUDA")


# ------------------------------------------------------------------------------------------- CUDA's autocast lists


def test_cuda_autocast_runs_matmuls_low_and_norms_softmax_and_reductions_in_fp32():
    x = torch.randn(4, 8)
    lin = nn.Linear(8, 8)
    with CudaAutocast(torch.bfloat16):
        h = lin(x)
        norm = F.layer_norm(h, (8,))
        probs = h.softmax(-1)
        total = h.sum()
        power = h.exp()
        act = F.gelu(h)  # not on CUDA's lists: the input's dtype
    assert h.dtype == torch.bfloat16
    assert (norm.dtype, probs.dtype, total.dtype, power.dtype, act.dtype) == (
        torch.float32, torch.float32, torch.float32, torch.float32, torch.bfloat16)
    torch.testing.assert_close(probs, h.float().softmax(-1))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # why CPU autocast cannot stand in: its lists differ
        assert F.layer_norm(lin(x), (8,)).dtype == torch.bfloat16


def test_cuda_autocast_cross_entropy_takes_fp32_log_probabilities_and_matches_the_reference():
    logits, target = torch.randn(6, 5).bfloat16(), torch.tensor([0, 1, 2, 3, 4, 0])
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.dtype) or t, lambda t: t):
        with CudaAutocast(torch.bfloat16):
            loss = F.cross_entropy(logits.requires_grad_(), target, ignore_index=4)
    assert loss.dtype == torch.float32 and torch.float32 in saved
    torch.testing.assert_close(loss, F.cross_entropy(logits.float(), target, ignore_index=4))


def test_cuda_autocast_caches_weight_casts_only_when_asked():
    lin, x = nn.Linear(8, 8), torch.randn(2, 8)
    cached, uncached = CudaAutocast(torch.bfloat16), CudaAutocast(torch.bfloat16, cache=False)
    for mode, entries in ((cached, 2), (uncached, 0)):  # weight and bias, each cast once for two calls
        with mode:
            lin(x), lin(x)
            assert len(mode._cache) == entries
    assert len(cached._cache) == 0  # cleared on exit, as autocast's cache is


# ------------------------------------------------------------------------------------------------ what-if estimates


class Odd(LightningModule):
    """Parameters whose byte sizes are not multiples of 512, and a softmax whose saved output CUDA keeps in fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(7, 5)
        self.proj = nn.Linear(5, 256, bias=False)

    def training_step(self, batch, batch_idx):
        return self.proj(self.inner(batch[0])).softmax(-1).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def odd_batch(n: int = 64):
    return (torch.randn(n, 7),)


@no_cuda
def test_what_if_rounds_every_storage_to_cudas_512_byte_blocks():
    model = Odd()
    cpu = estimate(model=model, batch=odd_batch(), plan=Plan(), device="cpu")
    cuda = estimate(model=model, batch=odd_batch(), plan=Plan(), device="cuda")
    sizes = [p.numel() * 4 for p in model.parameters()]  # 140, 20, 5120 bytes
    assert cpu.parameters_bytes == sum(sizes)
    assert cuda.parameters_bytes == sum(-(-s // 512) * 512 for s in sizes) == 512 + 512 + 5120
    assert cuda.device == "cuda:0" and cpu.device == "cpu"


@no_cuda
def test_what_if_keeps_softmax_outputs_in_fp32_under_bf16_mixed():
    # The step's peak is the end of the forward: the saved softmax output (64 x 256) is bf16 on CPU, fp32 on CUDA.
    model, plan = Odd(), Plan(precision="bf16-mixed")
    cpu = estimate(model=model, batch=odd_batch(), plan=plan, device="cpu")
    cuda = estimate(model=model, batch=odd_batch(), plan=plan, device="cuda")
    assert cuda.activations_bytes - cpu.activations_bytes >= 64 * 256 * 2


@no_cuda
def test_what_if_overhead_is_cublas_and_the_context_is_beside_the_peak(monkeypatch):
    cuda = estimate(model=TinyMLP(), batch=tiny_batch(), plan=Plan(), device="cuda")
    assert cuda.overhead_bytes == 2 * 32 * 2**20  # two handles, compute capability 9.x's workspace
    assert cuda.context_bytes == CUDA_CONTEXT_BYTES and sum(cuda.breakdown().values()) == cuda.predicted_peak_bytes
    assert any(note.startswith("no CUDA on this machine: estimated what-if") for note in cuda.notes)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    assert estimate(model=TinyMLP(), batch=tiny_batch(), plan=Plan(), device="cuda:1").overhead_bytes == \
        2 * 16 * 8 * 2**10


@no_cuda
def test_what_if_checkpointing_recomputes_under_cudas_autocast_and_saves_memory():
    model, batch = TinyMLP(), tiny_batch()
    full = estimate(model=model, batch=batch, plan=Plan(precision="bf16-mixed"), device="cuda")
    ckpt = estimate(model=model, batch=batch, plan=Plan(precision="bf16-mixed", activation_checkpointing=1.0),
                    device="cuda")
    assert ckpt.activations_bytes < full.activations_bytes


@no_cuda
def test_what_if_activation_offload_moves_saved_tensors_to_the_host():
    model, batch = TinyMLP(), tiny_batch()
    kept = estimate(model=model, batch=batch, plan=Plan(), device="cuda")
    moved = estimate(model=model, batch=batch, plan=Plan(activation_offload=True), device="cuda")
    assert kept.host_bytes == 0 < moved.host_bytes
    assert moved.activations_bytes < kept.activations_bytes


@no_cuda
def test_what_if_refuses_optimizer_offload_and_budget_shares_without_the_devices_memory(tmp_path):
    with pytest.raises(ValueError, match="optimizer_offload moves optimizer state from a CUDA GPU to the host; "
                                         "estimate it for a CUDA device on a machine that has one"):
        estimate(model=TinyMLP(), batch=tiny_batch(), plan=Plan(optimizer_offload=True), device="cuda")
    path = tmp_path / "tiny_gpt.py"
    path.write_text(TINY_TARGET.format(gpt=str(ROOT / "examples" / "gpt")))
    target = load_target(f"{path}:make")
    with pytest.raises(ValueError, match=r"budget '0.5' is a share of the device's memory, and cuda:0 is not on "
                                         r"this machine: give the budget in bytes \(80GiB\)"):
        estimate_target(target=target, plans=[Plan()], budget=0.5, device="cuda")
    rows = estimate_target(target=target, plans=[Plan()], budget=0.5, device="cuda", device_memory_bytes=2**31)
    assert rows[0].budget_bytes == 2**30


# ---------------------------------------------------------------------------------------------------------- capacity


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(512, 512)

    def forward(self, x):
        return torch.relu(self.linear(x))


class Wide(LightningModule):
    """Eight 512x512 blocks (8 MiB of fp32 weights, 32 MiB of model state with AdamW): whole on one rank it needs
    more than 24 MiB; sharded over two it needs less."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(8))

    def training_step(self, batch, batch_idx):
        x = batch[0]
        for block in self.blocks:
            x = block(x)
        return x.square().mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_world_sizes_double_up_to_the_most():
    assert world_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert world_sizes(12) == [1, 2, 4, 8, 12] and world_sizes(1) == [1]
    with pytest.raises(ValueError, match="max_world_size must be an int >= 1; got 0"):
        world_sizes(0)


def test_capacity_stops_at_the_smallest_world_size_whose_cheapest_plan_fits():
    model, batch = Wide(), (torch.randn(16, 512),)
    usable = 24 * 2**20
    rows = estimate_capacity(model=model, batch=batch, device="cpu", device_memory_bytes=2**30, budget_bytes=usable,
                             max_world_size=8, precisions=["32-true"])
    assert [(r.world_size, r.fits) for r in rows] == [(1, False), (2, True)]
    assert rows[0].plans_tried == 2 and rows[1].plans_tried == 4  # no/full checkpointing; and ddp, fsdp from 2
    chosen = rows[1]
    plan = chosen.estimate.plan
    assert (plan.strategy, plan.devices, plan.activation_checkpointing) == ("fsdp", 2, 0.0)
    assert chosen.estimate.predicted_peak_bytes <= usable
    # the same plan estimated on its own agrees, one more sample does not fit, and replicated does not fit at all
    best = chosen.max_micro_batch_size
    at = lambda m, p: estimate(model=model, batch=batch, plan=p.replace(micro_batch_size=m),  # noqa: E731
                               device="cpu").predicted_peak_bytes
    assert at(best, Plan(strategy="fsdp", devices=2)) == chosen.estimate.predicted_peak_bytes
    assert best == 16 or at(best + 1, Plan(strategy="fsdp", devices=2)) > usable
    assert at(1, Plan(strategy="ddp", devices=2)) > usable
    # the closest plan of a world size where nothing fits is reported at one sample
    assert rows[0].estimate.micro_batch_size == 1 and rows[0].estimate.predicted_peak_bytes > usable


@pytest.fixture
def target(tmp_path):
    path = tmp_path / "tiny_gpt.py"
    path.write_text(TINY_TARGET.format(gpt=str(ROOT / "examples" / "gpt")))
    return f"{path}:make"


@no_cuda
def test_cli_capacity_prints_the_smallest_world_size_and_json(capsys, target):
    assert main(["estimate", target, "--device", "cuda", "--device-memory", "1GiB", "--max-world-size", "8"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "devices of 1.00 GiB (cuda:0, what-if), 512.00 MiB usable per rank"
    assert out[1].split() == ["devices", "plan", "max", "micro", "peak", "per", "rank"]
    assert out[2].split()[:2] == ["1", "bf16-mixed"] and out[3].startswith("smallest: 1 device(s) of 1.00 GiB: ")
    assert main(["estimate", target, "--device", "cuda", "--device-memory", "1GiB", "--max-world-size", "8",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["what_if"] is True and data["usable_bytes"] == 2**30 - CUDA_CONTEXT_BYTES
    assert data["smallest"] == data["rows"][-1] and data["smallest"]["world_size"] == 1


@pytest.mark.parametrize(
    ("args", "shown"),
    [
        ([], "give --budget (20GiB, 0.8, auto) or --device-memory (80GiB)"),
        (["--device-memory", "0.5"], "--device-memory must be a size like 80GiB, 24GB or a number of bytes; got '0.5'"),
        (["--budget", "1GiB", "--max-world-size", "8"], "--max-world-size needs --device-memory"),
        (["--device-memory", "8GiB", "--max-world-size", "0"], "--max-world-size must be an int >= 1; got '0'"),
        (["--device-memory", "8GiB", "--max-world-size", "8", "--world-size", "2"],
         "--max-world-size chooses the world size, the plan and the micro-batch"),
        (["--device", "cuda", "--device-memory", "256MiB"], "the device's memory must exceed the CUDA context"),
    ],
)
def test_cli_capacity_bad_input_is_a_one_line_usage_error(capsys, target, args, shown):
    assert main(["estimate", target, *args]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"autotune: error: {shown}") and err.count("\n") == 1


# ------------------------------------------------------------------------------------------------------ meta models

META_TARGET = TINY_TARGET.replace(
    "    return GPT(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16), data",
    "    with torch.device('meta'):\n"
    "        model = GPT(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)\n"
    "    return model, data").replace("def make():", "import torch\n\n\ndef make():")


@pytest.fixture
def meta_target(tmp_path):
    path = tmp_path / "meta_gpt.py"
    path.write_text(META_TARGET.format(gpt=str(ROOT / "examples" / "gpt")))
    return f"{path}:make"


def test_a_meta_model_estimates_without_weights_and_matches_the_real_one(capsys, meta_target, target):
    rows = []
    for spec in (meta_target, target):
        assert main(["estimate", spec, "--budget", "1GiB", "--device", "cpu", "--precision", "32-true",
                     "--json"]) == 0
        rows.append(json.loads(capsys.readouterr().out))
    assert [r["predicted_peak_bytes"] for r in rows[0]] == [r["predicted_peak_bytes"] for r in rows[1]]
    assert all(not p.is_meta for p in load_target(target).model.parameters())
    assert all(p.is_meta for p in load_target(meta_target).model.parameters())  # nothing was materialised


def test_search_refuses_a_meta_model_for_plans_that_run_it_as_built(capsys, meta_target, tmp_path):
    out = tmp_path / "tuned.yaml"
    assert main(["search", meta_target, "--budget", "2GiB", "--space", "cpu", "--trials", "1", "--out", str(out),
                 "--device", "cpu", "--storage", f"sqlite:///{tmp_path / 'study.db'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"autotune: error: target '{meta_target}' builds its model on the meta device (no weights), "
                          "and plans with strategy 'auto' run it as built") and err.count("\n") == 1
    assert not out.exists()


def test_estimate_at_a_sequence_length_traces_the_batch_cut_or_filled_to_it(capsys: pytest.CaptureFixture) -> None:
    padded = str(ROOT / "examples" / "padded" / "train.py") + ":make"
    peaks = {}
    for seq_len in ("16", "256"):
        assert main(["estimate", padded, "--device", "cuda", "--device-memory", "80GiB", "--seq-len", seq_len,
                     "--precision", "32-true", "--json"]) == 0
        rows = json.loads(capsys.readouterr().out)
        peaks[seq_len] = rows[0]["predicted_peak_bytes"]
    # 16x the tokens, 256x the attention scores: 72 MiB (mostly CUDA's fixed terms and the model state) -> 243 MiB.
    assert peaks["256"] > 3 * peaks["16"]
    assert main(["estimate", padded, "--device", "cuda", "--device-memory", "80GiB", "--seq-len", "0"]) == 2
    assert "--seq-len must be a positive int; got '0'" in capsys.readouterr().err
    assert main(["estimate", padded, "--device", "cuda", "--device-memory", "80GiB", "--seq-len", str(10**15)]) == 2
    err = capsys.readouterr().err
    assert "its batch at that length does not fit in this machine's memory" in err and err.count("\n") == 1


def test_a_meta_model_s_cpu_estimate_says_once_where_its_baseline_came_from(capsys, meta_target):
    assert main(["estimate", meta_target, "--budget", "1GiB", "--device", "cpu", "--precision", "32-true"]) == 0
    out = capsys.readouterr().out
    assert "measured here" not in out  # its short training run cannot run without weights
    assert "in place of the process baseline, which could not be measured" in out
