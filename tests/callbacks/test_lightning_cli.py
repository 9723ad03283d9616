"""Our callbacks' bad values under LightningCLI: one line naming the file, the key and what is accepted, not
jsonargparse's usage text or a traceback (callbacks/_lightning_cli.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from autotune._plan.tuned import FORMAT_VERSION
import yaml

from autotune import Plan
from autotune.callbacks import ApplyPlan, ElasticBatchSize, MemoryMonitor
from autotune.callbacks._lightning_cli import config_problems

ROOT = Path(__file__).resolve().parents[2]
GPT = ROOT / "examples" / "gpt"
CLASSES = (ElasticBatchSize, ApplyPlan, MemoryMonitor)

#: (entry, key, bad value, what the one line must say): every argument of the three callbacks, and the trainer's
#: plan setting; entry 0 and 1 are the tuned file's ElasticBatchSize and ApplyPlan, "monitor" a MemoryMonitor.
BAD_VALUES = [
    (0, "micro_batch_size", 0, "micro_batch_size must be a positive int or None; got 0"),
    (0, "budget", "-1GiB", "budget must be bytes like '20GiB', '512MiB' or 4294967296, a fraction of total memory in "
                           "(0, 1] like 0.8, or 'auto'; got '-1GiB'"),
    (1, "activation_checkpointing", 1.7, "activation_checkpointing must be a fraction in [0, 1], a list of class "
                                         "names or 'auto'; got 1.7"),
    ("trainer", "precision", "bf17-mixed", "trainer.precision: precision must be one of 32-true, bf16-mixed, "
                                           "16-mixed, bf16-true, 16-true, transformer-engine; got 'bf17-mixed'"),
    (1, "optimizer_state", "3bit", "optimizer_state must be one of full, 8bit, 4bit; got '3bit'"),
    (1, "compil", False, "trainer.callbacks+[1].init_args.compil: unknown setting"),
    (0, "micro_batch_sise", 4, "trainer.callbacks+[0].init_args.micro_batch_sise: not an argument of ElasticBatchSize"),
    (0, "micro_batch_size", "abc", "micro_batch_size must be a positive int or None; got 'abc'"),
    (0, "micro_batch_sample_size", -5, "micro_batch_sample_size must be"),
    (0, "min_micro_batch_size", 0, "`min_micro_batch_size` must be a positive int; got 0"),
    (0, "grow", "maybe", "`grow` must be True or False; got 'maybe'"),
    (0, "grow_after", 0, "`grow_after` must be a positive int; got 0"),
    (0, "protect_update", "always", "`protect_update` must be True or False; got 'always'"),
    (0, "sample_size", 3, "`sample_size` must be a function of the batch returning its size per sample"),
    (1, "activation_offload", "later", "activation_offload must be true or false; got 'later'"),
    (1, "optimizer_offload", 3, "optimizer_offload must be true or false; got 3"),
    (1, "compile", "sometimes", "compile must be true or false; got 'sometimes'"),
    (1, "compile_memory_budget", 1.5, "compile_memory_budget"),
    (1, "float8", 2, "float8 must be true or false; got 2"),
    (1, "reshard_after_forward", "nope", "reshard_after_forward must be true or false; got 'nope'"),
    (1, "cpu_offload", [], "cpu_offload must be true or false; got []"),
    (1, "expandable_segments", 5, "expandable_segments must be true or false; got 5"),
    (1, "num_workers", -1, "num_workers must be"),
    (1, "pin_memory", "x", "pin_memory must be"),
    (1, "provenance", {"format_version": 9}, "format_version: 9 is newer than this lightning-autotune reads"),
    ("monitor", "snapshot_dir", "", "`snapshot_dir` must be a non-empty path"),
    ("monitor", "record_history", "maybe", "`record_history` must be True or False; got 'maybe'"),
    ("monitor", "max_entries", 0, "`max_entries` must be a positive int; got 0"),
    ("monitor", "max_snapshots", -1, "`max_snapshots` must be an int >= 0 (0 writes none); got -1"),
    ("monitor", "snapshot_dirr", "x", "snapshot_dirr: not an argument of MemoryMonitor (its arguments: "
                                      "snapshot_dir, record_history, max_entries, max_snapshots)"),
]


def _user_config(tmp_path: Path) -> Path:
    """The example's config without its own ElasticBatchSize: the tuned file's callbacks are the first of ours."""
    config = yaml.safe_load((GPT / "config.yaml").read_text())
    del config["trainer"]["callbacks"]
    path = tmp_path / "user.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _bad_file(tmp_path: Path, case: int, entry: int | str, key: str, value: object) -> Path:
    if entry == "monitor":
        path = tmp_path / f"monitor{case}.yaml"
        path.write_text(yaml.safe_dump({"trainer": {"callbacks+": [
            {"class_path": "autotune.callbacks.MemoryMonitor", "init_args": {key: value}}]}}))
        return path
    tuned = Plan(precision="bf16-mixed", micro_batch_size=4, activation_checkpointing=1.0, budget="1GiB").save(
        tmp_path / f"tuned{case}.yaml")
    header = "".join(line for line in tuned.read_text().splitlines(keepends=True) if line.startswith("#"))
    doc = yaml.safe_load(tuned.read_text())
    if entry == "trainer":
        doc["trainer"][key] = value
    else:
        doc["trainer"]["callbacks+"][entry]["init_args"][key] = value
    tuned.write_text(header + yaml.safe_dump(doc, sort_keys=False))  # a hand-edited tuned file keeps its header
    return tuned


def test_config_problems_name_each_bad_value_of_every_argument_in_one_line(tmp_path: Path) -> None:
    for case, (entry, key, value, expected) in enumerate(BAD_VALUES):
        path = _bad_file(tmp_path, case, entry, key, value)
        problems = config_problems(["fit", "--config", str(path)], CLASSES)
        assert any(expected in problem for problem in problems), (key, problems)
        # one line per problem: one, or two for a budget the compiler cannot take without compile=True
        assert len(problems) == 1 + (key == "compile_memory_budget"), (key, problems)
        assert all(problem.startswith(f"{path}: ") and "\n" not in problem for problem in problems)
    good = Plan(micro_batch_size=4).save(tmp_path / "good.yaml")
    user = _user_config(tmp_path)
    assert config_problems(["fit", "-c", str(user), f"--config={good}"], CLASSES) == []


def test_a_string_for_a_function_argument_is_left_to_jsonargparse(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"trainer": {"callbacks": {
        "class_path": "autotune.callbacks.ElasticBatchSize",
        "init_args": {"sample_size": "mypackage.lengths", "micro_batch_size": 4}}}}))
    assert config_problems(["--config", str(path)], CLASSES) == []  # an import path jsonargparse resolves
    path.write_text(path.read_text().replace("micro_batch_size: 4", "micro_batch_size: -4"))
    assert config_problems(["--config", str(path)], CLASSES) == [
        f"{path}: trainer.callbacks[0].init_args: `micro_batch_size` must be a positive int or None; got -4"]


#: The values the end-to-end run tries: the issue's six, and one of each other route (a type jsonargparse refuses in
#: our class, a constructor's own refusal of a setting a tuned file leaves out, a misspelt key of ours, MemoryMonitor).
CLI_KEYS = ("micro_batch_size", "budget", "activation_checkpointing", "precision", "optimizer_state", "compil", "grow",
            "max_snapshots", "snapshot_dirr", "grow_after")


@pytest.mark.slow
def test_each_bad_value_under_lightning_cli_is_at_most_three_lines(tmp_path: Path) -> None:
    user = _user_config(tmp_path)
    chosen = [next((i, case) for i, case in enumerate(BAD_VALUES) if case[1] == key) for key in CLI_KEYS]
    cases = [["fit", "--config", str(user), "--config", str(_bad_file(tmp_path, i, entry, key, value)),
              "--trainer.max_steps=1", f"--trainer.default_root_dir={tmp_path}"]
             for i, (entry, key, value, _) in chosen]
    # the last one, a user config's own ElasticBatchSize with a value its constructor refuses, runs unforked: the
    # interpreter's own top level reports it
    bad = tmp_path / "bad.yaml"
    bad.write_text((GPT / "config.yaml").read_text().replace("grow_after: 10", "grow_after: 0"))
    cases[-1] = ["fit", "--config", str(bad), "--trainer.max_steps=1", f"--trainer.default_root_dir={tmp_path}"]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    run = subprocess.run([sys.executable, str(ROOT / "tests/support/cli_errors_run.py"), str(GPT / "train.py"),
                          str(tmp_path / "cases.json")], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    first, *rest = run.stdout.splitlines()
    results = [*json.loads(first), {"status": run.returncode, "output": "\n".join(rest) + run.stderr}]
    for (_, (entry, key, value, expected)), result in zip(chosen, results):
        lines = result["output"].splitlines()
        assert result["status"] in (1, 2) and len(lines) <= 3, (key, value, result["output"][-3000:])
        assert lines[-1].startswith("error: ") and any(expected in line for line in lines), (key, lines)
    assert results[-1]["output"].splitlines()[-1] == (
        f"error: {bad}: trainer.callbacks[0].init_args: `grow_after` must be a positive int; got 0")
    assert results[-1]["status"] == 1


def test_plain_python_still_raises_the_constructors_value_error(capsys: pytest.CaptureFixture[str]) -> None:
    # the same message as ever; uncaught, outside jsonargparse, Python's own traceback (the excepthook passes it on)
    with pytest.raises(ValueError, match=r"^`micro_batch_size` must be a positive int or None; got 0$"):
        ElasticBatchSize(micro_batch_size=0)
    try:
        MemoryMonitor(max_entries=0)
    except ValueError:
        sys.excepthook(*sys.exc_info())
    shown = capsys.readouterr().err
    assert "Traceback (most recent call last)" in shown
    assert shown.splitlines()[-1] == "ValueError: `max_entries` must be a positive int; got 0"


@pytest.mark.slow
def test_a_cut_tuned_file_a_setup_check_and_a_misspelt_key_are_one_line_under_lightning_cli(tmp_path: Path) -> None:
    user = _user_config(tmp_path)
    tuned = Plan(precision="bf16-mixed", micro_batch_size=4, budget="1GiB").save(tmp_path / "tuned.yaml")
    text = tuned.read_text()
    cut = tmp_path / "cut.yaml"  # its last lines lost: it would train in fp32
    cut.write_text(text[:text.index("  precision: bf16-mixed")])
    four = tmp_path / "four.yaml"
    four.write_text(text.replace("accumulate_grad_batches: 1", "accumulate_grad_batches: 4"))
    misspelt = tmp_path / "misspelt.yaml"
    misspelt.write_text(text.replace("\ntrainer:\n", "\ntrainr:\n"))
    model_typo = tmp_path / "model_typo.yaml"  # a config of the user's, not a tuned file
    model_typo.write_text((GPT / "config.yaml").read_text().replace("\nmodel:", "\nmodle:"))
    accumulates = tmp_path / "accumulates.yaml"  # ElasticBatchSize's setup check, at fit
    accumulates.write_text((GPT / "config.yaml").read_text().replace("accumulate_grad_batches: 1 ",
                                                                     "accumulate_grad_batches: 4 "))
    run_args = ["--trainer.max_steps=1", f"--trainer.default_root_dir={tmp_path}"]
    cases = [["fit", "--config", str(GPT / "config.yaml"), "--config", str(cut), *run_args],
             ["fit", "--config", str(user), "--config", str(four), *run_args],
             ["fit", "--config", str(GPT / "config.yaml"), "--config", str(misspelt), *run_args],
             ["fit", "--config", str(model_typo), *run_args],
             ["fit", "--config", str(accumulates), *run_args]]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    run = subprocess.run([sys.executable, str(ROOT / "tests/support/cli_errors_run.py"), str(GPT / "train.py"),
                          str(tmp_path / "cases.json")], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    first, *rest = run.stdout.splitlines()
    results = [*json.loads(first), {"status": run.returncode, "output": "\n".join(rest) + run.stderr}]
    expected = [
        (2, f"error: {cut}: trainer.precision, trainer.accumulate_grad_batches: missing; a tuned file (format "
            f"{FORMAT_VERSION}) holds every plan setting, so this one was cut short or edited: write it again "
            "(autotune search or suggest), or delete its first line to use it as a config of your own"),
        (2, f"error: {four}: trainer.accumulate_grad_batches: must be 1; got 4"),
        (2, f"error: {misspelt}: trainr: unknown key; did you mean 'trainer'? (a tuned file is a LightningCLI config: "
            "model, data, trainer, seed_everything, optimizer, lr_scheduler, ckpt_path)"),
        (2, f"error: {model_typo}: modle: not a key of this command's config; did you mean 'model'? (its keys: "
            "ckpt_path, config, data, lr_scheduler, model, optimizer, seed_everything, trainer, weights_only)"),
        (1, "error: ElasticBatchSize does the gradient accumulation itself, but the Trainer has "
            "accumulate_grad_batches=4. Set Trainer(accumulate_grad_batches=1) and let the dataloader yield the "
            "effective batch (e.g. batch_size=16 x 4 = 64)."),
    ]
    for (status, line), result in zip(expected, results):
        lines = [x for x in result["output"].splitlines() if x.startswith("error: ")]
        assert (result["status"], lines) == (status, [line]), result["output"][-3000:]
        assert "Traceback" not in result["output"] and "usage:" not in result["output"]
