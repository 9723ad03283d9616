"""ApplyPlan's automatic FSDP2 sharding on 2 CPU ranks (gloo): the GPT example without configure_model, against
Lightning's own accumulation under the same sharding, and a tuned file with ``strategy: fsdp`` through LightningCLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.strategies import ModelParallelStrategy

from autotune import Plan
from autotune._transforms.shard import sharding_units
from autotune.callbacks import ApplyPlan
from tests.support.toy import ToyModel, trainer
from tests.support.ranks import run_ranks

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parents[1] / "support" / "fsdp_run.py"


def run_gpt(tmp: Path, mode: str, *args: str) -> list[dict]:
    tmp.mkdir(parents=True)
    proc = run_ranks([str(SCRIPT), "--out", str(tmp), "--mode", mode, "--gpt", *args], timeout=240)  # a hang fails
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [torch.load(tmp / f"rank{r}.pt") for r in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("options", [(), ("--composed", "--reshard", "false"), ("--composed", "--compile")],
                         ids=["fp32-zero3", "bf16-checkpointing-zero2", "bf16-checkpointing-compile-zero3"])
def test_apply_plan_shards_a_model_without_configure_model(tmp_path: Path, options: tuple[str, ...]) -> None:
    native = run_gpt(tmp_path / "native", "native", *options)
    elastic = run_gpt(tmp_path / "elastic", "elastic", *options)
    from examples.gpt.model import GPT

    unsharded = GPT(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32)
    for r in range(2):
        # the repeated blocks, then the root (GPT is the LightningModule and its forward is what the step calls)
        assert elastic[r]["sharded"] == ["FSDPBlock"] * 3 + ["FSDPGPT"]
        assert elastic[r]["compiled"] == (3 if "--compile" in options else 0)  # each block, compiled before sharding
        assert elastic[r]["global_step"] == native[r]["global_step"] == 3
        for name, value in elastic[r]["state"].items():
            assert (value - native[r]["state"][name]).abs().max().item() <= 1e-6, name
            assert torch.equal(value, elastic[0]["state"][name])  # ranks agree
    # the same parameters, each split over the two ranks
    full = {name: p.numel() for name, p in unsharded.named_parameters()}
    assert {name: numel for name, (_, numel) in elastic[0]["local"].items()} == full
    for name, numel in full.items():
        held = [elastic[r]["local"][name][0] for r in range(2)]
        assert sum(held) == numel and max(held) <= (numel + 1) // 2 + 1, (name, held)
    # bf16-mixed: FSDP2 gathers the parameters in bf16 for compute (its mixed-precision policy)
    assert elastic[0]["gathered_dtype"] == ("torch.bfloat16" if "--composed" in options else "torch.float32")


@pytest.mark.slow
def test_tuned_file_with_strategy_fsdp_trains_through_lightning_cli(tmp_path: Path) -> None:
    plan = Plan(strategy="fsdp", devices=2, micro_batch_size=8, reshard_after_forward=False)
    tuned = plan.save(tmp_path / "tuned.yaml")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "gpt" / "train.py"), "fit", "--config",
         str(ROOT / "examples" / "gpt" / "config.yaml"), "--config", str(tuned), "--trainer.max_steps=2",
         "--trainer.limit_val_batches=0", f"--trainer.default_root_dir={tmp_path}"],
        capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert_fit_finished(proc, steps=2)


def assert_fit_finished(proc: subprocess.CompletedProcess[str], *, steps: int) -> None:
    """Both ranks ran and fit ended at ``steps``. A SIGABRT after that, in gloo's C++ destructors at interpreter exit
    ("terminate called without an active exception": PyTorch's, pytorch/pytorch#179291, docs/troubleshooting.md) is
    not the run's failure; any other non-zero exit is."""
    assert "Starting with 2 processes" in proc.stderr, proc.stderr[-3000:]
    assert f"`Trainer.fit` stopped: `max_steps={steps}` reached" in proc.stderr, proc.stderr[-3000:]
    exit_abort = proc.returncode == -6 and proc.stderr.rstrip().endswith("terminate called without an active exception")
    assert proc.returncode == 0 or exit_abort, proc.stderr[-3000:]


def test_sharding_units_take_the_child_that_holds_the_network() -> None:
    # A LightningModule whose network is one child: that child is the root (its forward is called, not the module's)
    model = ToyModel()
    blocks, root = sharding_units(model)
    assert blocks == [] and root is model.net
    from examples.gpt.model import GPT

    gpt = GPT(vocab_size=16, block_size=4, n_layer=2, n_head=1, n_embd=8)
    blocks, root = sharding_units(gpt)
    assert blocks == list(gpt.blocks) and root is gpt  # embeddings and head live on the module itself


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"cpu_offload": True}, r"ApplyPlan\(cpu_offload=True\) configures FSDP2 sharding, but the run uses "
                            r"SingleDeviceStrategy\. Use ModelParallelStrategy"),
    ({"reshard_after_forward": False}, r"ApplyPlan\(reshard_after_forward=False\) configures FSDP2 sharding"),
])
def test_sharding_settings_without_fsdp2_are_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(MisconfigurationException, match=match):
        ApplyPlan(**kwargs).setup(trainer(), ToyModel(), "fit")


def test_cpu_offload_on_a_cpu_run_and_over_the_models_own_sharding_is_refused() -> None:
    t = trainer(strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1))
    with pytest.raises(MisconfigurationException, match=r"cpu_offload=True\) keeps a GPU's parameters, gradients and "
                                                        r"optimizer state on the host, but this run is on cpu"):
        ApplyPlan(cpu_offload=True).setup(t, ToyModel(), "fit")


def test_plan_fsdp_builds_model_parallel_strategy_and_needs_devices() -> None:
    kwargs = Plan(strategy="fsdp", devices=4, precision="bf16-mixed").trainer_kwargs()
    strategy = kwargs.pop("strategy")
    assert type(strategy) is ModelParallelStrategy
    assert (strategy._data_parallel_size, strategy._tensor_parallel_size) == (4, 1)
    assert kwargs == {"precision": "bf16-mixed", "accumulate_grad_batches": 1, "devices": 4}
    with pytest.raises(ValueError, match=r"Plan\(strategy='fsdp'\) needs devices=N, the ranks that share the model"):
        Plan(strategy="fsdp").trainer_kwargs()
    with pytest.raises(ValueError, match=r"cpu_offload=True configures FSDP2 sharding; it cannot be combined with "
                                         r"strategy 'ddp'"):
        Plan(strategy="ddp", cpu_offload=True)
    with pytest.raises(ValueError, match=r"cpu_offload \(FSDP2, sharded\) and optimizer_offload \(torchao, one GPU\)"):
        Plan(cpu_offload=True, optimizer_offload=True)
    assert Plan(strategy="fsdp", devices=8, reshard_after_forward=False, cpu_offload=True).describe() == \
        "fsdp (no reshard) x8, 32-true, micro all, cpu-offload"


def test_a_tuned_file_with_another_strategy_mapping_is_refused(tmp_path: Path) -> None:
    from autotune import load_plan
    from autotune._plan.tuned import PlanFileError

    path = Plan(strategy="fsdp", devices=2).save(tmp_path / "tuned.yaml")
    assert load_plan(path).to_dict() == Plan(strategy="fsdp", devices=2).to_dict()
    text = path.read_text().replace("tensor_parallel_size: 1", "tensor_parallel_size: 2")
    (tmp_path / "tp.yaml").write_text(text)
    with pytest.raises(PlanFileError, match=r"tp.yaml: trainer.strategy.init_args.tensor_parallel_size: must be 1"):
        load_plan(tmp_path / "tp.yaml")
    (tmp_path / "dp.yaml").write_text(path.read_text().replace("data_parallel_size: 2", "data_parallel_size: 4"))
    with pytest.raises(PlanFileError, match=r"data_parallel_size: must equal trainer.devices \(2\); got 4"):
        load_plan(tmp_path / "dp.yaml")
