"""Plan, its validation, and tuned files (save, load, LightningCLI and plain Python)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from autotune import Plan, PlanFileError, Provenance, load_plan
from autotune._plan.tuned import FORMAT_VERSION
from autotune.callbacks import ApplyPlan, ElasticBatchSize

ROOT = Path(__file__).resolve().parents[2]


def full_plan() -> Plan:
    return Plan(
        precision="bf16-mixed",
        micro_batch_size=8,
        budget="3GiB",
        activation_checkpointing=0.5,
        activation_offload=True,
        optimizer_offload=True,
        num_workers=0,
        pin_memory=False,
        provenance=Provenance.here(budget="3GiB", device_name="cpu", samples_per_second=812.5, peak_bytes=2**31,
                                   command="autotune search t.py:make --budget 3GiB", produced_by="search"),
    )


def test_invalid_plan_lists_every_problem_in_one_error() -> None:
    with pytest.raises(ValueError, match=r"invalid plan: precision must be one of .*; got 'fp8'; micro_batch_size "
                       r"must be a positive int or None; got 0; activation_checkpointing must be a fraction in "
                       r"\[0, 1\], a list of class names or .auto.; got 1.5; num_workers must be an int >= 0 or None; got -1"):
        Plan(precision="fp8", micro_batch_size=0, activation_checkpointing=1.5, num_workers=-1)
    with pytest.raises(ValueError, match=r"budget must be .*got '3XB'"):
        Plan(budget="3XB")


def test_plan_in_plain_python() -> None:
    plan = full_plan()
    assert plan.trainer_kwargs() == {"precision": "bf16-mixed", "accumulate_grad_batches": 1}
    elastic, apply = plan.callbacks()
    assert isinstance(elastic, ElasticBatchSize) and elastic.micro_batch_size == 8 and str(elastic.budget) == "3GiB"
    assert isinstance(apply, ApplyPlan) and apply.plan.activation_checkpointing == 0.5
    assert apply.plan.activation_offload is True and apply.plan.optimizer_offload is True
    assert plan.describe() == "bf16-mixed, micro 8, ckpt 0.5, offload, optimizer-offload, workers 0"
    assert plan.replace(micro_batch_size=4).micro_batch_size == 4


def test_round_trip_keeps_plan_and_provenance(tmp_path: Path) -> None:
    plan = full_plan()
    path = plan.save(tmp_path / "tuned.yaml")
    text = path.read_text()
    assert text.startswith("# Tuned by lightning-autotune")
    assert "# Produced by: autotune search t.py:make --budget 3GiB" in text
    assert "# Measured: 812.5 samples/s, peak 2.00 GiB, budget 3GiB, on cpu" in text
    assert "activation_checkpointing: 0.5  # share of repeated blocks recomputed in backward" in text
    loaded = load_plan(path)
    assert loaded == plan
    assert loaded.provenance == plan.provenance
    named = Plan(activation_checkpointing=("Block",))
    assert load_plan(named.save(tmp_path / "named.yaml")).activation_checkpointing == ("Block",)


def test_save_never_leaves_a_half_written_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"cannot write the tuned file '.*missing/t.yaml': folder '.*missing' does not"):
        full_plan().save(tmp_path / "missing" / "t.yaml")
    assert list(tmp_path.iterdir()) == []


def test_tuned_file_gets_the_mode_of_the_users_umask(tmp_path: Path) -> None:
    import os
    import stat

    old = os.umask(0o027)
    try:
        path = full_plan().save(tmp_path / "tuned.yaml")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640  # 0666 less 027, not mkstemp's 0600


def test_load_reports_every_problem_with_file_and_key(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(
        "trainer:\n"
        "  precision: fp8\n"
        "  callbacks:\n"
        "    - class_path: os.system\n"
        "    - class_path: autotune.callbacks.ElasticBatchSize\n"
        "      init_args: {micro_batch_size: -3}\n"
        "    - class_path: autotune.callbacks.ApplyPlan\n"
        "      init_args: {activation_checkpointing: 0.5, colour: red}\n"
    )
    with pytest.raises(PlanFileError) as info:
        load_plan(path)
    lines = str(info.value).splitlines()
    assert lines == [
        f"{path}: trainer.callbacks[0].class_path: 'os.system' is outside the autotune. and lightning. namespaces",
        f"{path}: trainer.callbacks[2].init_args.colour: unknown setting",
        f"{path}: trainer.precision: precision must be one of 32-true, bf16-mixed, 16-mixed, bf16-true, 16-true, "
        "transformer-engine; got 'fp8'",
        f"{path}: trainer.callbacks[1].init_args.micro_batch_size: micro_batch_size must be a positive int or None; "
        "got -3",
    ]


def test_load_refuses_newer_formats_missing_files_and_non_plans(tmp_path: Path) -> None:
    path = full_plan().save(tmp_path / "tuned.yaml")
    path.write_text(path.read_text().replace(f"format_version: {FORMAT_VERSION}", "format_version: 7"))
    with pytest.raises(PlanFileError, match=rf"format_version: 7 is newer than this lightning-autotune reads "
                       rf"\({FORMAT_VERSION}\); "
                       "upgrade lightning-autotune"):
        load_plan(path)
    with pytest.raises(PlanFileError, match=r"nope.yaml: the tuned file does not exist"):
        load_plan(tmp_path / "nope.yaml")
    (tmp_path / "x.yaml").write_text("model: {}\n")
    with pytest.raises(PlanFileError, match=r"trainer: missing; a tuned file is a LightningCLI config"):
        load_plan(tmp_path / "x.yaml")
    (tmp_path / "y.yaml").write_text("trainer: {precision: 32-true, callbacks: []}\n")
    with pytest.raises(PlanFileError, match=r"no autotune.callbacks.ElasticBatchSize entry"):
        load_plan(tmp_path / "y.yaml")


@pytest.mark.slow
def test_tuned_file_runs_through_lightning_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    sys.path.insert(0, str(ROOT / "examples" / "gpt"))
    try:
        import train  # the example's LightningCLI script
    finally:
        sys.path.remove(str(ROOT / "examples" / "gpt"))
    plan = Plan(precision="bf16-mixed", micro_batch_size=4, activation_checkpointing=1.0)
    tuned = plan.save(tmp_path / "tuned.yaml")
    cli = train.main(["fit", "--config", str(ROOT / "examples/gpt/config.yaml"), "--config", str(tuned),
                      "--trainer.max_steps=3"])
    trainer = cli.trainer
    assert trainer.global_step == 3
    assert trainer.precision == "bf16-mixed"
    # the example config's ElasticBatchSize (micro-batch 8) stays in the list, and the tuned file's, added after it,
    # is the one that runs
    users, elastic = [c for c in trainer.callbacks if isinstance(c, ElasticBatchSize)]
    [apply] = [c for c in trainer.callbacks if isinstance(c, ApplyPlan)]
    assert users.engine is None and elastic.micro_batch_size == 4 and elastic.engine.sizes
    assert len(apply.checkpointed) == 2 and type(apply.checkpointed[0]).__name__ == "Block"


def test_tuned_file_adds_its_callbacks_to_the_users(tmp_path: Path) -> None:
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

    user = tmp_path / "user.yaml"
    user.write_text("trainer:\n  callbacks:\n"
                    f"    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n      init_args: {{dirpath: {tmp_path}}}\n"
                    "    - class_path: lightning.pytorch.callbacks.EarlyStopping\n      init_args: {monitor: val_loss}\n")
    tuned = Plan(micro_batch_size=4).save(tmp_path / "tuned.yaml")
    cli = LightningCLI(BoringModel, BoringDataModule, run=False, save_config_callback=None,
                       args=["--config", str(user), "--config", str(tuned), "--trainer.logger=false"])
    kinds = {type(c) for c in cli.trainer.callbacks}
    assert {ModelCheckpoint, EarlyStopping, ElasticBatchSize, ApplyPlan} <= kinds
    [checkpoint] = [c for c in cli.trainer.callbacks if isinstance(c, ModelCheckpoint)]
    assert checkpoint.dirpath == str(tmp_path)  # the user's, not Lightning's default one
    # a format-1 file (`callbacks`, which replaced the user's) still loads
    old = tmp_path / "old.yaml"
    old.write_text(tuned.read_text().replace("callbacks+:", "callbacks:").replace(
        f"format_version: {FORMAT_VERSION}", "format_version: 1").replace(f"format {FORMAT_VERSION})", "format 1)"))
    assert load_plan(old) == load_plan(tuned)


def test_low_bit_and_compiler_fields_are_validated_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"^invalid plan: optimizer_state must be one of full, 8bit, 4bit; got '2bit'$"):
        Plan(optimizer_state="2bit")
    with pytest.raises(ValueError, match="compile_memory_budget is the compiler's; it needs compile=True"):
        Plan(compile_memory_budget=0.5)
    with pytest.raises(ValueError, match=r"compile_memory_budget must be a fraction in \[0, 1\] or None; got 1.5"):
        Plan(compile=True, compile_memory_budget=1.5)
    with pytest.raises(ValueError, match="optimizer_state '8bit' and optimizer_offload both replace the optimizer"):
        Plan(optimizer_state="8bit", optimizer_offload=True)
    plan = Plan(optimizer_state="8bit", compile=True, compile_memory_budget=0, float8=True)
    assert plan.compile_memory_budget == 0.0 and isinstance(plan.compile_memory_budget, float)
    assert plan.describe() == "32-true, micro all, compile, float8, 8bit state, compile budget 0"


def test_gpu_spaces_drop_fp8_and_low_bit_state_where_they_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    import torch

    from autotune import load_space

    def dims(space):
        return {d.name: d.choices for d in space.dimensions}

    cpu = torch.device("cpu")
    space = load_space("default").for_device(cpu, batch_size=32)
    assert dims(space)["float8"] == (False,)
    assert "float8=True dropped: FP8 needs a GPU of compute capability 8.9 or newer" in space.notes
    assert "bf16-true" in dims(space)["precision"] and dims(space)["compile_memory_budget"] == (None, 0.5, 0.0)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    without = load_space("multi_gpu").for_device(cpu, batch_size=32)
    assert dims(without)["optimizer_state"] == ("full",)
    assert "bf16-true" not in dims(load_space("default").for_device(cpu, batch_size=32))["precision"]  # every trial
    # of it would fail at fit: Adam and AdamW's bf16 updates need torchao's stochastic rounding
    assert ("optimizer_state='8bit' dropped: the torchao package is not installed "
            "(pip install 'lightning-autotune[torchao]')") in without.notes


def test_a_plan_carries_the_sample_size_its_micro_batch_fits_at(tmp_path) -> None:
    from autotune import load_plan
    from autotune.callbacks import ElasticBatchSize

    plan = Plan(micro_batch_size=8, micro_batch_sample_size=1537.0)
    plan.save(tmp_path / "tuned.yaml")
    text = (tmp_path / "tuned.yaml").read_text()
    assert "micro_batch_sample_size: 1537.0  # elements per sample where micro_batch_size fits" in text
    assert load_plan(tmp_path / "tuned.yaml") == plan
    (elastic,) = [c for c in plan.callbacks() if isinstance(c, ElasticBatchSize)]
    assert elastic.micro_batch_sample_size == 1537.0
    assert Plan(micro_batch_size=8).elastic_kwargs()["micro_batch_sample_size"] is None  # written: every key is
    with pytest.raises(ValueError, match="micro_batch_sample_size is where micro_batch_size fits; it needs "
                                         "micro_batch_size"):
        Plan(micro_batch_sample_size=1537.0)
    with pytest.raises(ValueError, match=r"micro_batch_sample_size must be a positive number or None; got 0"):
        Plan(micro_batch_size=8, micro_batch_sample_size=0)


#: A tuned file as the writer of format 2 wrote it (``autotune search examples/gpt/train.py:make --device cpu --budget
#: 2GiB --trials 6``, 2026-12-07; its provenance shortened): no ``grow``, no ``micro_batch_sample_size``.
FORMAT_2_FILE = """\
# Tuned by lightning-autotune (tuned-file format 2).
# Produced by: autotune search examples/gpt/train.py:make --device cpu --budget 2GiB --trials 6
trainer:
  callbacks+:
  - class_path: autotune.callbacks.ElasticBatchSize
    init_args:
      budget: 2GiB  # memory cap of the run (hard on CUDA, soft on CPU)
      micro_batch_size: 32  # samples per forward/backward; the effective batch is the dataloader's
  - class_path: autotune.callbacks.ApplyPlan
    init_args:
      reshard_after_forward: true  # fsdp: free gathered parameters after each block's forward (ZeRO-3; false: ZeRO-2)
      cpu_offload: false  # fsdp: parameters, gradients and optimizer state on the host (FSDP2 CPUOffloadPolicy)
      activation_checkpointing: 0.0  # share of repeated blocks recomputed in backward: less memory, more compute
      activation_offload: false  # keep saved activations on the host during backward: less device memory, more copies
      optimizer_offload: false  # optimizer state on the host, update on the CPU (torchao): less device memory, slower steps
      optimizer_state: full  # Adam's moments: full (as configured), 8bit or 4bit (torchao): 8 bytes per parameter -> ~2 or ~1
      compile: false  # torch.compile each repeated block: faster steps after a one-time compile
      compile_memory_budget: null  # share of activations the compiler keeps for backward, recomputing the rest (null: all)
      float8: false  # linear layers' matmuls in FP8 (torchao float8 training; GPUs of compute capability 8.9+)
      expandable_segments: false  # CUDA allocator grows segments in place: less fragmentation
      num_workers: 0  # DataModule dataloader worker processes (null: the DataModule's own)
      pin_memory: null  # DataModule page-locked host batches for faster copies (null: the DataModule's own)
      provenance:  # where this plan came from (read by ApplyPlan and load_plan)
        format_version: 2
        budget: 2GiB
        samples_per_second: 868.369083812651
        peak_bytes: 327712768
        produced_by: search (study 'autotune-gpt-train.py:make-2GiB-cpu-cpu', trial 10)
  precision: bf16-mixed  # numeric precision of weights/activations; *-mixed keeps fp32 weights, halves activations
  accumulate_grad_batches: 1  # must stay 1: ElasticBatchSize does the accumulation
"""


def test_a_tuned_file_missing_any_key_is_refused_in_one_line_naming_it(tmp_path: Path) -> None:
    path = Plan(precision="bf16-mixed", strategy="ddp", devices=2, micro_batch_size=16, budget="2GiB",
                activation_checkpointing=0.5, provenance=Provenance(budget="2GiB", peak_bytes=2**30)).save(
        tmp_path / "tuned.yaml")
    lines = path.read_text().splitlines(keepends=True)
    assert lines[0] == (f"# Tuned by lightning-autotune (tuned-file format {FORMAT_VERSION}; sets trainer.strategy, "
                        "trainer.devices).\n")
    inside_provenance = False
    checked = []
    for i, line in enumerate(lines):
        key = line.split(":")[0].strip().removeprefix("- ")
        inside_provenance = key == "provenance" or (inside_provenance and line.startswith(" " * 8))  # its keys
        if line.startswith("#") or key in ("trainer", "callbacks+", "class_path", "init_args", "provenance") or (
                inside_provenance and key != "format_version"):
            continue  # structure; what the provenance says
        path.write_text("".join(lines[:i] + lines[i + 1:]))
        with pytest.raises(PlanFileError) as info:
            load_plan(path)
        assert str(info.value).count("\n") == 0 and f".{key}" in str(info.value), (key, str(info.value))
        assert (f"missing; a tuned file (format {FORMAT_VERSION}) holds every plan setting, so this one was cut short "
                "or edited") in str(info.value)
        checked.append(key)
    assert {"precision", "accumulate_grad_batches", "strategy", "devices", "budget", "micro_batch_size",
            "micro_batch_sample_size", "grow", "activation_checkpointing", "compile", "pin_memory",
            "format_version"} <= set(checked)
    assert len(checked) == 4 + 4 + 12 + 1  # the trainer's four, ElasticBatchSize's four, ApplyPlan's twelve, the version


def test_a_format_3_file_without_the_strategy_line_loads_as_its_writer_wrote_it(tmp_path: Path) -> None:
    """Format 3 wrote ``trainer.strategy`` only where the plan set it and did not say so: its files load as before."""
    path = Plan(strategy="ddp", devices=2, micro_batch_size=16, budget="2GiB").save(tmp_path / "tuned.yaml")
    text = path.read_text().replace(f"format {FORMAT_VERSION}; sets trainer.strategy, trainer.devices)", "format 3)")
    path.write_text(text.replace(f"format_version: {FORMAT_VERSION}", "format_version: 3"))
    assert (load_plan(path).strategy, load_plan(path).devices) == ("ddp", 2)
    path.write_text("".join(line for line in path.read_text().splitlines(keepends=True)
                            if not line.lstrip().startswith("strategy:")))
    assert (load_plan(path).strategy, load_plan(path).devices) == ("auto", 2)


def test_a_tuned_file_cut_short_anywhere_is_refused(tmp_path: Path) -> None:
    path = Plan(precision="bf16-mixed", micro_batch_size=16, budget="2GiB").save(tmp_path / "tuned.yaml")
    lines = path.read_text().splitlines(keepends=True)
    for end in range(1, len(lines)):  # the file's first `end` lines: every cut from the header on
        path.write_text("".join(lines[:end]))
        with pytest.raises(PlanFileError):
            load_plan(path)
    path.write_text("".join(lines))
    assert load_plan(path).precision == "bf16-mixed"


def test_an_older_tuned_file_loads_when_whole_and_is_refused_cut(tmp_path: Path) -> None:
    path = tmp_path / "old.yaml"
    path.write_text(FORMAT_2_FILE)
    plan = load_plan(path)
    assert (plan.precision, plan.micro_batch_size, plan.budget) == ("bf16-mixed", 32, "2GiB")
    path.write_text(FORMAT_2_FILE.replace("  precision: bf16-mixed", "  # precision: bf16-mixed"))
    with pytest.raises(PlanFileError, match=r"^[^\n]*old.yaml: trainer.precision: missing; a tuned file \(format 2\) "
                                            r"holds every plan setting[^\n]*$"):
        load_plan(path)


def test_a_plan_file_written_by_hand_takes_the_defaults_it_leaves_out(tmp_path: Path) -> None:
    path = tmp_path / "mine.yaml"  # no first line of a tuned file: a config of the user's, read as it is
    path.write_text("trainer:\n  callbacks+:\n  - class_path: autotune.callbacks.ElasticBatchSize\n"
                    "    init_args: {micro_batch_size: 8}\n  - class_path: autotune.callbacks.ApplyPlan\n"
                    "    init_args: {activation_checkpointing: 1.0}\n")
    plan = load_plan(path)
    assert (plan.precision, plan.micro_batch_size, plan.activation_checkpointing, plan.budget) == ("32-true", 8, 1.0,
                                                                                                   None)


@pytest.mark.slow
def test_a_tuned_plan_trains_at_its_measured_micro_batch_unless_the_file_says_grow(tmp_path: Path) -> None:
    from tests.support.examples import load_example

    train = load_example("gpt")
    tuned = Plan(micro_batch_size=16, budget="2GiB").save(tmp_path / "tuned.yaml")
    text = tuned.read_text()
    assert "      grow: false  # false: stays at the measured micro_batch_size (an OOM still halves it)" in text

    def elastic_after(path: Path) -> ElasticBatchSize:
        cli = train.main(["fit", "--config", str(ROOT / "examples/gpt/config.yaml"), "--config", str(path),
                          "--trainer.max_steps=56", "--trainer.limit_train_batches=1.0", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
                          "--trainer.enable_model_summary=false", f"--trainer.default_root_dir={tmp_path}"])
        (elastic,) = [c for c in cli.trainer.callbacks if isinstance(c, ElasticBatchSize)][-1:]
        assert cli.trainer.global_step == 56
        return elastic

    kept = elastic_after(tuned)  # past grow_after (50 clean steps), with room to spare in 2GiB
    assert kept.micro_batch_size == 16 and not [e for e in kept.events if e.kind == "grow"]
    grows = tmp_path / "grows.yaml"
    grows.write_text(text.replace("      grow: false", "      grow: true"))  # the user asks for it
    grown = elastic_after(grows)
    assert grown.micro_batch_size == 32 and [(e.previous, e.micro_batch_size) for e in grown.events] == [(16, 32)]


def test_a_callback_a_later_one_replaces_says_so_in_a_sentence(caplog: pytest.LogCaptureFixture) -> None:
    import logging
    from types import SimpleNamespace

    users, tuned = ElasticBatchSize(micro_batch_size=8, grow_after=10), ElasticBatchSize(
        **Plan(micro_batch_size=32, budget="2GiB").elastic_kwargs())
    mine, theirs = ApplyPlan(), ApplyPlan(activation_checkpointing=0.5, compile=True)
    trainer = SimpleNamespace(callbacks=[users, mine, tuned, theirs])
    with caplog.at_level(logging.INFO):
        users.setup(trainer, None, "fit")  # type: ignore[arg-type]
        mine.setup(trainer, None, "fit")  # type: ignore[arg-type]
    assert [r.getMessage() for r in caplog.records] == [
        "ElasticBatchSize: the later one in the callbacks (budget 2GiB, micro-batch 32, no growing) runs in place of "
        "this one (no budget, micro-batch 8, growing after 10 clean steps).",
        "ApplyPlan: the later one in the callbacks (ckpt 0.5, compile) runs in place of this one (no settings)."]
    assert users.engine is None and not mine.active
