import contextlib
import importlib.util
import json
import re
import statistics
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn

import autotune
import autotune._estimate.fake_model as fake_model
import autotune._estimate.trace as estimator
from autotune import Estimate, Plan, estimate
from autotune._cli.main import main
from autotune._estimate.estimate import max_micro_batch_size

ROOT = Path(__file__).resolve().parents[2]


def _load_benchmark():
    """``benchmarks/estimator_accuracy.py``: its models and its measured peak (profiler on CPU), not estimator code."""
    spec = importlib.util.spec_from_file_location("estimator_accuracy", ROOT / "benchmarks" / "estimator_accuracy.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("estimator_accuracy", module)
    spec.loader.exec_module(module)
    return module


bench = _load_benchmark()


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(F.gelu(self.up(x)))


class TinyMLP(LightningModule):
    """Two residual blocks over (batch, 8 tokens, 16 features); activations outweigh the weights."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(16), Block(16))
        self.head = nn.Linear(16, 4)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.log("loss", 1.0)  # no trainer: must not break the trace
        return {"loss": F.cross_entropy(self.head(self.blocks(x)).flatten(0, 1), y.flatten())}

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def tiny_batch(n: int = 16):
    gen = torch.Generator().manual_seed(0)
    return torch.randn(n, 8, 16, generator=gen), torch.randint(0, 4, (n, 8), generator=gen)


@pytest.fixture(scope="module")
def gpt():
    return bench.build("gpt-2x64")


@pytest.fixture(scope="module")
def gpt_estimates(gpt):
    model, batch = gpt
    plans = {"base": Plan(), "ckpt": Plan(activation_checkpointing=1.0), "bf16": Plan(precision="bf16-mixed")}
    return {name: estimate(model=model, batch=batch, plan=plan, device="cpu") for name, plan in plans.items()}


# ------------------------------------------------------------------------------------------------------ accuracy


@pytest.mark.parametrize(
    ("name", "plan"),
    [
        ("gpt-2x64", Plan(micro_batch_size=16)),
        ("cnn", Plan(precision="bf16-mixed", activation_checkpointing=1.0, micro_batch_size=2)),
        ("tiny", Plan(precision="bf16-mixed", activation_offload=True, micro_batch_size=8)),
    ],
)
def test_cpu_prediction_is_within_10_percent_of_the_profiled_peak(name, plan):
    size = 4 if name == "cnn" else 16  # the real CNN step in bf16 is slow on a CPU
    model, batch = (TinyMLP(), tiny_batch()) if name == "tiny" else bench.build(name, batch_size=size)
    predicted = estimate(model=model, batch=batch, plan=plan, device="cpu").predicted_peak_bytes
    measured = bench.measure_peak(model=model, batch=batch, plan=plan, device="cpu")
    assert abs(predicted - measured) / measured <= 0.10, (predicted, measured)


_ISA_CHECK = """
import sys
sys.path.insert(0, {root!r})
from tests.estimate.test_estimate import TinyMLP, bench, tiny_batch
from autotune import Plan, estimate
plan = Plan(precision="bf16-mixed", micro_batch_size=8)
e = estimate(model=TinyMLP(), batch=tiny_batch(), plan=plan, device="cpu")
print(e.predicted_peak_bytes, bench.measure_peak(model=TinyMLP(), batch=tiny_batch(), plan=plan, device="cpu"))
print(e.notes[0])
"""


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["AVX2", "ALL"])  # no 16-bit instructions; all this machine has
def test_bf16_kernel_work_buffers_are_measured_for_the_instruction_set_in_use(isa: str) -> None:
    # oneDNN's bf16 kernels hold buffers that depend on the instruction set (AVX512-BF16 and AMX use more): the
    # estimator measures them on the machine. ONEDNN_MAX_CPU_ISA caps what oneDNN uses, as an older CPU would.
    import os
    import subprocess

    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": isa}
    proc = subprocess.run([sys.executable, "-c", _ISA_CHECK.format(root=str(ROOT))], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    numbers, note = proc.stdout.strip().splitlines()[-2:]
    predicted, measured = map(int, numbers.split())
    assert abs(predicted - measured) / measured <= 0.02, (isa, predicted, measured)
    assert note.startswith("CPU kernel work buffers of ") and "measured on this machine" in note


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_median_error_is_within_5_percent():
    # The benchmark's cases, measured its way (bench.run: a fresh process per CUDA case, so cuBLAS's workspaces count
    # in every case's peak as the estimate counts them; measured in this one process they counted in the first only,
    # which is how this test failed on an H100 while the benchmark met the goal).
    rows = bench.run(models=["gpt-4x128", "cnn"], plan_list=bench.plans(quick=True, device="cuda"), device="cuda")
    errors = [abs(row["error"]) for row in rows]
    assert statistics.median(errors) <= 0.05 and max(errors) <= 0.10, [(r["model"], r["plan"], r["error"]) for r in rows]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("torchao") is None,
                    reason="needs CUDA and torchao")
def test_cuda_optimizer_offload_prediction_is_within_10_percent():
    model, batch = bench.build("gpt-4x128")
    plan = Plan(optimizer_offload=True, micro_batch_size=16)
    predicted = estimate(model=model, batch=batch, plan=plan, device="cuda")
    (row,) = bench.run(models=["gpt-4x128"], plan_list=[plan], device="cuda")  # measured as the benchmark measures
    assert abs(row["error"]) <= 0.10, row
    kept = estimate(model=model, batch=batch, plan=plan.replace(optimizer_offload=False), device="cuda")
    assert predicted.optimizer_state_bytes < 0.1 * kept.optimizer_state_bytes
    assert predicted.host_bytes > kept.optimizer_state_bytes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_offload_moves_saved_activations_to_the_host(gpt):
    model, batch = gpt
    kept = estimate(model=model, batch=batch, plan=Plan(), device="cuda")
    offloaded = estimate(model=model, batch=batch, plan=Plan(activation_offload=True), device="cuda")
    assert offloaded.activations_bytes < kept.activations_bytes
    assert offloaded.host_bytes > kept.host_bytes


# ---------------------------------------------------------------------------------------------------- the plan


def test_checkpointing_lowers_the_prediction(gpt_estimates):
    base, ckpt = gpt_estimates["base"], gpt_estimates["ckpt"]
    assert ckpt.predicted_peak_bytes < 0.8 * base.predicted_peak_bytes
    assert ckpt.activations_bytes < base.activations_bytes


def test_bf16_mixed_lowers_activations_and_keeps_fp32_weights(gpt_estimates):
    base, bf16 = gpt_estimates["base"], gpt_estimates["bf16"]
    assert bf16.activations_bytes < 0.9 * base.activations_bytes
    assert bf16.parameters_bytes == base.parameters_bytes


def test_bf16_true_halves_parameters_and_optimizer_state(gpt, gpt_estimates):
    model, batch = gpt
    true = estimate(model=model, batch=batch, plan=Plan(precision="bf16-true"), device="cpu")
    assert true.parameters_bytes == gpt_estimates["base"].parameters_bytes // 2
    assert true.optimizer_state_bytes < 0.6 * gpt_estimates["base"].optimizer_state_bytes


def test_offload_on_cpu_is_applied_and_saves_nothing(monkeypatch):
    entered = []
    real = fake_model.offload_activations

    @contextlib.contextmanager
    def spy(*, pin_memory):
        entered.append(pin_memory)
        with real(pin_memory=pin_memory):
            yield

    monkeypatch.setattr(fake_model, "offload_activations", spy)
    model, batch = TinyMLP(), tiny_batch()
    kept = estimate(model=model, batch=batch, plan=Plan(), device="cpu")
    assert entered == []
    offloaded = estimate(model=model, batch=batch, plan=Plan(activation_offload=True), device="cpu")
    assert entered  # save_on_cpu wrapped the traced steps
    # on the CPU save_on_cpu keeps a CPU tensor where it is: the host is the device, nothing moves
    assert offloaded.predicted_peak_bytes == kept.predicted_peak_bytes
    assert offloaded.host_bytes == kept.host_bytes == 0


# ---------------------------------------------------------------------------------------------------- breakdown


def test_breakdown_adds_up_to_the_peak(gpt, gpt_estimates):
    model, _ = gpt
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for e in gpt_estimates.values():
        assert isinstance(e, Estimate)
        assert sum(e.breakdown().values()) == e.predicted_peak_bytes
        assert e.overhead_bytes == 0 and e.device == "cpu"
        assert e.parameters_bytes == param_bytes
        assert 2 * param_bytes <= e.optimizer_state_bytes <= 2 * param_bytes + 8 * len(list(model.parameters()))
        assert e.micro_batch_size == e.plan.micro_batch_size == 16
        assert e.fits(e.predicted_peak_bytes) and not e.fits(e.predicted_peak_bytes - 1)


@pytest.mark.parametrize(("plan", "device"), [
    (Plan(), "cpu"),
    (Plan(precision="bf16-mixed", activation_checkpointing=0.5), "cpu"),
    (Plan(precision="bf16-mixed", activation_checkpointing=1.0), "cuda"),  # what-if: CUDA autocast re-entered
    (Plan(optimizer_state="8bit"), "cpu"),
    (Plan(strategy="fsdp", devices=2), "cpu"),
], ids=["fp32", "bf16-ckpt", "whatif-bf16-ckpt", "8bit-state", "fsdp"])
def test_micro_batches_traced_one_after_another_match_fresh_traces(gpt, plan, device):
    """The warm-up step runs once per plan; each later micro-batch starts from the state the step before left."""
    model, batch = gpt
    shared = estimator.Traces(model=model, batch=batch, plan=plan, device=device, optimizer=None)
    first = shared.fake_step()
    for micro in (1, 5, 16, 8):  # accumulating, then the whole batch (zero_grad), then accumulating again
        fresh = estimator.Traces(model=model, batch=batch, plan=plan, device=device, optimizer=None).at(micro)
        assert shared.at(micro) == fresh, micro
    assert shared.fake_step() is first  # one fake model for every micro-batch traced


class FailsInBackwardAtTheWholeBatch(TinyMLP):
    """Its backward fails at the whole batch only: after ``zero_grad``."""

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        if batch[0].shape[0] == 16:
            out["loss"].register_hook(_fail)
        return out


def _fail(grad):
    raise RuntimeError("this backward fails")


def test_a_failed_trace_leaves_no_half_stepped_model_behind():
    traces = estimator.Traces(model=FailsInBackwardAtTheWholeBatch(), batch=tiny_batch(), plan=Plan(), device="cpu",
                              optimizer=None)
    assert traces.at(4) == estimator.Traces(model=TinyMLP(), batch=tiny_batch(), plan=Plan(), device="cpu",
                                            optimizer=None).at(4)
    with pytest.raises(ValueError, match=r"cannot trace FailsInBackwardAtTheWholeBatch\.training_step"):
        traces.at(16)  # fails after zero_grad: the gradients are gone
    fresh = estimator.Traces(model=TinyMLP(), batch=tiny_batch(), plan=Plan(), device="cpu", optimizer=None).at(8)
    assert traces.at(8) == fresh  # traced from a fresh copy, with the last step's gradients alive


def test_the_real_model_is_not_touched(gpt):
    model, batch = gpt
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    estimate(model=TinyMLP(), batch=tiny_batch(), plan=Plan(), device="cpu")
    estimate(model=model, batch=batch, plan=Plan(micro_batch_size=2), device="cpu")
    for name, p in model.named_parameters():
        assert type(p) is nn.Parameter and p.grad is None and torch.equal(p, before[name])


def test_max_micro_batch_size_is_monotone_in_the_budget_and_fits():
    model, batch = TinyMLP(), tiny_batch()
    one = estimate(model=model, batch=batch, plan=Plan(micro_batch_size=1), device="cpu").predicted_peak_bytes
    whole = estimate(model=model, batch=batch, plan=Plan(), device="cpu").predicted_peak_bytes
    budgets = [one - 1, one, (2 * one + whole) // 3, whole]
    found = [max_micro_batch_size(model=model, batch=batch, plan=Plan(), budget_bytes=b, device="cpu") for b in budgets]
    assert found[0] is None and found[-1] == 16
    assert found[1:] == sorted(found[1:]) and 1 <= found[2] < 16
    m = found[2]
    fits = estimate(model=model, batch=batch, plan=Plan(micro_batch_size=m), device="cpu")
    over = estimate(model=model, batch=batch, plan=Plan(micro_batch_size=m + 1), device="cpu")
    assert fits.fits(budgets[2]) and not over.fits(budgets[2])


# ------------------------------------------------------------------------------------------------------- errors


def test_bad_inputs_raise_value_errors():
    model, batch = TinyMLP(), tiny_batch()
    with pytest.raises(ValueError, match="micro_batch_size must be an int in 1..16"):
        estimate(model=model, batch=batch, plan=Plan(micro_batch_size=17), device="cpu")
    with pytest.raises(ValueError, match="traces precision .* got 'transformer-engine'"):
        estimate(model=model, batch=batch, plan=Plan(precision="transformer-engine"), device="cpu")
    with pytest.raises(ValueError, match="batch holds no tensor with a batch dimension nor a list"):
        estimate(model=model, batch={"ids": "a"}, plan=Plan(), device="cpu")
    with pytest.raises(ValueError, match="budget_bytes must be a positive int of bytes; got 0"):
        max_micro_batch_size(model=model, batch=batch, plan=Plan(), budget_bytes=0, device="cpu")
    model.automatic_optimization = False
    with pytest.raises(ValueError, match="manual optimization"):
        estimate(model=model, batch=batch, plan=Plan(), device="cpu")


def test_a_step_that_reads_values_is_traced_with_real_tensors():
    class Reads(TinyMLP):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)["loss"]
            return loss * 0 if loss.item() > 1e9 else loss

    got = estimate(model=Reads(), batch=tiny_batch(), plan=Plan(), device="cpu")
    fake = estimate(model=TinyMLP(), batch=tiny_batch(), plan=Plan(), device="cpu")
    assert got.method in ("real", "extrapolated") and fake.method == "fake"  # more: tests/estimate/test_reads_values.py
    assert abs(got.predicted_peak_bytes - fake.predicted_peak_bytes) <= 0.01 * fake.predicted_peak_bytes


# ---------------------------------------------------------------------------------------------------------- CLI

TINY_TARGET = '''
import sys
sys.path.insert(0, {gpt!r})
from data import SyntheticTokens
from model import GPT


def make():
    data = SyntheticTokens(vocab_size=32, block_size=8, batch_size=8, num_samples=16, val_samples=8)
    return GPT(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16), data
'''


@pytest.fixture
def target(tmp_path):
    path = tmp_path / "tiny_gpt.py"
    path.write_text(TINY_TARGET.format(gpt=str(ROOT / "examples" / "gpt")))
    return f"{path}:make"


def test_cli_prints_a_row_per_plan(capsys, target):
    assert main(["estimate", target, "--budget", "1GiB", "--device", "cpu", "--precision", "32-true"]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0] == "device cpu, batch 8, budget 1.00 GiB"
    assert lines[1].split() == ["plan", "micro", "predicted", "peak", "fits", "max", "micro", "state/param", "traced",
                                "samples/s", "MFU", "bound"]
    rows = [line for line in lines[2:] if not line.startswith("note: ")]
    # ranked by predicted speed: recomputation is slower
    assert [line.split("  ")[0] for line in rows] == ["32-true", "32-true, ckpt 1.0"]
    for line in rows:
        *_, micro, peak, unit, fits, best, per_param, _, no, data, rate, mfu, bound = line.split()
        # on CPU the peak is the process's: a measured baseline (a trial's resident set, 100s of MiB) + the tensors
        assert (micro, unit, fits, best) == ("8", "MiB", "yes", "8") and 100 < float(peak) < 1024
        assert 16.0 <= float(per_param) <= 16.1  # fp32 AdamW: 4 + 4 + 8 bytes, and Adam's 0-dim steps
        assert (no, data) == ("no", "data")  # traced on fake tensors
        assert float(rate.replace(",", "")) > 0 and mfu.endswith("%") and bound in ("compute", "memory", "launch")
    assert re.search(r"^note: the peaks include the process baseline measured here, \d+\.\d\d MiB ", out, re.M)


def test_a_cpu_row_near_the_budget_is_settled_by_a_short_run(capsys, target):
    # issue 29, finding 6: `autotune estimate` said "fits" for rows a run measured over the budget (the resident set
    # beside the tensors scatters by a few percent between micro-batches); such rows are now measured
    args = ["estimate", target, "--device", "cpu", "--precision", "32-true", "--json"]
    assert main([*args, "--budget", "8GiB"]) == 0
    far = json.loads(capsys.readouterr().out)
    assert all(row["measured_peak_bytes"] is None for row in far)  # nowhere near: the estimate decides
    budget = far[0]["peak_bytes"]  # the first row exactly at the budget: within the band
    assert main([*args, "--budget", str(budget)]) == 0
    near = json.loads(capsys.readouterr().out)
    settled = [row for row in near if row["measured_peak_bytes"] is not None]
    # the row at the budget is among them (rows are ranked by predicted speed, those that fit first)
    assert any(row["activation_checkpointing"] == far[0]["activation_checkpointing"] for row in settled)
    for row in settled:
        assert row["fits"] == (row["measured_peak_bytes"] <= budget)
        assert abs(row["peak_bytes"] - budget) <= 0.05 * budget
    assert main([*args[:-1], "--budget", str(budget)]) == 0
    out = capsys.readouterr().out
    assert re.search(r" (yes|no)\*  ", out) and "is predicted within 5% of the budget, so a short run settled it: " \
                                                  "measured peak " in out


def test_cpu_estimate_and_a_measured_trial_agree_on_the_peak(target) -> None:
    from autotune import measure_plan
    from autotune._estimate.estimate import estimate_target
    from autotune._search.memory import SearchEstimator
    from autotune._target.target import load_target

    loaded = load_target(target)
    estimator = SearchEstimator(target=loaded, device=torch.device("cpu"))
    estimator.measure_baseline(target=target, config=None, meanwhile=[Plan(micro_batch_size=8)])
    # traced while the short run measured memory: its own plan, and those asked for
    assert estimator.traced(Plan(micro_batch_size=1)) and estimator.traced(Plan(micro_batch_size=8))
    [row] = estimate_target(target=loaded, plans=[Plan(micro_batch_size=8)], budget="1GiB", device="cpu",
                            baseline_bytes=estimator.baseline)
    measured = measure_plan(target=target, plan=Plan(micro_batch_size=8), device="cpu", steps=3, warmup=1)
    assert row.baseline_bytes > 0 and row.peak_bytes == row.estimate.predicted_peak_bytes + row.baseline_bytes
    assert abs(row.peak_bytes - measured.peak_bytes) < 0.05 * measured.peak_bytes


def test_cli_json_rows_have_plan_fields_and_the_fit(capsys, target, tmp_path):
    tuned = Plan(precision="bf16-mixed", micro_batch_size=4).save(tmp_path / "tuned.yaml")
    assert main(["estimate", target, "--budget", "1GiB", "--device", "cpu", "--plan", str(tuned), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 1
    row = rows[0]
    assert {"precision", "activation_checkpointing", "activation_offload", "micro_batch_size",
            "predicted_peak_bytes", "fits", "max_micro_batch_size"} <= set(row)
    assert row["precision"] == "bf16-mixed" and row["micro_batch_size"] == 4 and row["fits"] is True
    parts = [row[f"{name}_bytes"] for name in ("parameters", "gradients", "optimizer_state", "activations",
                                               "temporaries", "overhead")]
    assert sum(parts) == row["predicted_peak_bytes"] > 0
    assert row["max_micro_batch_size"] == 8


def test_cli_micro_batch_overrides_the_plan_and_a_tight_budget_fits_nothing(capsys, target, tmp_path):
    tuned = Plan(precision="bf16-mixed", micro_batch_size=4).save(tmp_path / "tuned.yaml")
    assert main(["estimate", target, "--budget", "1KiB", "--device", "cpu", "--plan", str(tuned),
                 "--micro-batch-size", "2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["micro_batch_size"], r["fits"], r["max_micro_batch_size"]) for r in rows] == [(2, False, None)]


@pytest.mark.parametrize(
    ("args", "shown"),
    [
        (["--budget", "20XB"], "budget must be bytes like"),
        (["--budget", "1GiB", "--precision", "fp8"], "invalid plan: precision must be one of"),
        (["--budget", "1GiB", "--micro-batch-size", "x"], "--micro-batch-size must be a positive int; got 'x'"),
        (["--budget", "1GiB", "--micro-batch-size", "99"], "micro_batch_size must be an int in 1..8"),
    ],
)
def test_cli_bad_input_is_a_one_line_usage_error(capsys, target, args, shown):
    assert main(["estimate", target, "--device", "cpu", *args]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"autotune: error: {shown}")
    assert err.count("\n") == 1 and "Traceback" not in err


def test_cli_bad_target_is_a_one_line_usage_error(capsys, tmp_path):
    assert main(["estimate", str(tmp_path / "missing.py") + ":make", "--budget", "1GiB", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autotune: error: target ") and "does not exist" in err
    assert err.count("\n") == 1


def test_package_exports_the_estimator():
    assert autotune.estimate is estimate and autotune.Estimate is Estimate
    assert {"Estimate", "estimate"} <= set(autotune.__all__)


def test_a_model_with_a_frozen_backbone_is_estimated_with_the_head_s_gradients_and_state_only():
    class FineTuned(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.backbone, self.head = nn.Linear(64, 64), nn.Linear(64, 1)
            self.backbone.requires_grad_(False)

        def training_step(self, batch, batch_idx):
            return self.head(self.backbone(batch)).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad])

    for trace in ("auto", "real"):
        est = estimate(model=FineTuned(), batch=torch.randn(8, 64), plan=Plan(), device="cpu", trace=trace)
        assert est.parameters_bytes == (64 * 64 + 64 + 64 + 1) * 4
        assert est.gradients_bytes == (64 + 1) * 4  # two moments, and a step count per tensor:
        assert est.optimizer_state_bytes == 2 * (64 + 1) * 4 + 2 * 4
