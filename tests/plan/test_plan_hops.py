"""A plan survives every hop from a space's choice to the callbacks that apply it, unchanged: compared as the
plan's canonical dict form at each hop."""

from __future__ import annotations

import pickle
from pathlib import Path

import optuna
import pytest
import yaml
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel
from lightning.pytorch.strategies import ModelParallelStrategy

from autotune import Plan, load_plan, load_space
from autotune._plan.tuned import FORMAT_VERSION
from autotune._device.budget import resolve_budget
from autotune._plan.space import plan_from_params
from autotune._search.trial import TrialSpec
from autotune.callbacks import ApplyPlan, ElasticBatchSize

# Every field set away from its default; optimizer offload runs on one device, so the DDP plan leaves it off and a
# second plan sets it (and low-bit state, which replaces the optimizer too, goes in the others); the sharding fields
# need strategy fsdp (a third plan). The space writes the checkpointing
# fraction as 1 (an int) on purpose: it must become 1.0. ``devices`` is the search's argument, not a space dimension.
PLANS = {
    "fsdp": dict(precision="bf16-mixed", strategy="fsdp", devices=2, reshard_after_forward=False, cpu_offload=True,
                 micro_batch_size=8, activation_checkpointing=["Linear"], compile=True, num_workers=0,
                 optimizer_state="8bit"),
    "ddp": dict(precision="bf16-mixed", strategy="ddp", micro_batch_size=4, activation_checkpointing=1,
                activation_offload=True, optimizer_offload=False, compile=True, compile_memory_budget=0.5,
                float8=True, expandable_segments=True, num_workers=2, pin_memory=False, optimizer_state="4bit"),
    "one-device": dict(precision="16-mixed", strategy="auto", micro_batch_size=2, activation_checkpointing=0.5,
                       activation_offload=True, optimizer_offload=True, compile=True, expandable_segments=True,
                       num_workers=1, pin_memory=True),
}
BUDGET = "2GiB"


@pytest.mark.parametrize("name", sorted(PLANS))
def test_plan_survives_every_hop(name: str, tmp_path: Path) -> None:
    choices = PLANS[name]
    expected = Plan(**choices, budget=BUDGET).to_dict()
    ckpt = expected["activation_checkpointing"]
    assert ckpt == ["Linear"] or (ckpt in (1.0, 0.5) and isinstance(ckpt, float))

    # 1. a space whose only point is the plan, asked through Optuna as the search asks
    space_file = tmp_path / "space.yaml"
    dimensions = {k: {"choices": [v]} for k, v in choices.items() if k != "devices"}
    space_file.write_text(yaml.safe_dump({"dimensions": dimensions}))
    space = load_space(space_file)
    trial = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0)).ask()
    params = space.suggest(trial)
    from_space = plan_from_params(params, budget=BUDGET, **({"devices": choices["devices"]} if "devices" in choices
                                                            else {}))
    assert from_space.to_dict() == expected

    # 2. the trial: the spec crosses a process boundary (pickled) and the trial process reads the plan back
    spec = TrialSpec(target="t.py:make", config=None, plan=from_space.to_dict(), budget=resolve_budget(BUDGET, "cpu"),
                     device="cpu")
    crossed = pickle.loads(pickle.dumps(spec))
    in_trial = crossed.memory_plan()
    assert in_trial.to_dict() == expected
    assert (crossed.budget.text, crossed.budget.budget_bytes) == (BUDGET, 2 * 2**30)  # bytes, with the text

    # 3. the tuned file, read back by load_plan
    tuned = in_trial.replace(budget=BUDGET).save(tmp_path / "tuned.yaml")
    assert load_plan(tuned).to_dict() == expected

    # 4. LightningCLI instantiates the trainer and the callbacks from the tuned file
    cli = LightningCLI(BoringModel, BoringDataModule, run=False, save_config_callback=None,
                       args=["--config", str(tuned), "--trainer.accelerator=cpu", "--trainer.logger=false"])
    [elastic] = [c for c in cli.trainer.callbacks if isinstance(c, ElasticBatchSize)]
    [apply] = [c for c in cli.trainer.callbacks if isinstance(c, ApplyPlan)]
    trainer_config = cli.config["trainer"]
    strategy = trainer_config["strategy"]
    if not isinstance(strategy, str):  # a sharded plan's ModelParallelStrategy, data parallel over the plan's devices
        assert isinstance(cli.trainer.strategy, ModelParallelStrategy) and cli.trainer.num_devices == 2
        assert dict(strategy["init_args"])["data_parallel_size"] == 2 == trainer_config["devices"]
        assert dict(strategy["init_args"])["tensor_parallel_size"] == 1
        strategy = "fsdp"
    from_callbacks = apply.plan.replace(precision=trainer_config["precision"], strategy=strategy,
                                        devices=trainer_config["devices"] if strategy == "fsdp" else None,
                                        budget=str(elastic.budget), micro_batch_size=elastic.micro_batch_size)
    assert from_callbacks.to_dict() == expected


def test_equal_plans_have_equal_keys_and_distinct_plans_do_not() -> None:
    assert Plan(activation_checkpointing=1).key() == Plan(activation_checkpointing=1.0).key()
    assert Plan(budget=4 * 2**30).key() == Plan(budget="4294967296").key()
    assert Plan(budget="4 GiB").key() == Plan(budget="4GiB").key()
    assert Plan(activation_checkpointing=["Block"]).key() == Plan(activation_checkpointing=("Block",)).key()
    assert (Plan(micro_batch_size=8, micro_batch_sample_size=512).key()
            == Plan(micro_batch_size=8, micro_batch_sample_size=512.0).key())
    assert Plan(pin_memory=False).key() != Plan(pin_memory=None).key()  # the same describe() text, other plans


def test_from_dict_refuses_unknown_settings_and_newer_formats() -> None:
    with pytest.raises(ValueError, match=r"invalid plan: unknown plan settings colour \(known: activation_checkpoint"):
        Plan.from_dict({"colour": "red"})
    with pytest.raises(ValueError, match=rf"format_version: {FORMAT_VERSION + 1} is newer than this lightning-autotune "
                                         rf"reads \({FORMAT_VERSION}\)"):
        Plan.from_dict({"format_version": FORMAT_VERSION + 1})
    with pytest.raises(ValueError, match=r"a plan must be a mapping of its settings; got list"):
        Plan.from_dict([])  # type: ignore[arg-type]


def test_apply_plan_refuses_a_newer_tuned_file_on_the_lightning_cli_path() -> None:
    # LightningCLI builds ApplyPlan from the tuned file's init_args: the version is checked there too.
    with pytest.raises(ValueError, match=r"provenance.format_version: 9 is newer than this lightning-autotune reads"):
        ApplyPlan(provenance={"format_version": 9})


def test_a_command_with_a_newline_is_one_header_line_of_a_file_that_loads(tmp_path) -> None:
    path = Plan(micro_batch_size=8).save(tmp_path / "t.yaml", command="autotune search t.py:make --study 'run 1\nretry'")
    assert load_plan(path).micro_batch_size == 8
    assert "# Produced by: autotune search t.py:make --study 'run 1 retry'" in path.read_text().splitlines()

