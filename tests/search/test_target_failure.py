"""A target whose own code fails (its dataloader, its training_step, a missing configure_optimizers): the search
stops at once, before more trials, in a few lines naming the exception and the user's frames; the study records why,
and the same command resumes it cleanly once the code is fixed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import torch
from optuna.trial import TrialState

from autotune import Plan
from autotune._cli.main import main
from autotune._search.memory import SearchEstimator
from autotune._search.stopping import STOPPED_BY_TARGET
from autotune._target.failure import TargetCodeError
from autotune._target.target import load_target

#: A small target; ``FAIL`` says where its code fails: "data" (its dataset), "step" (every training_step), "second"
#: (training steps from the second on: the estimator's trace has no Trainer to ask, the search's short first run does),
#: "late" (training steps from the sixth on: past the search's short runs of the process baseline, 5 steps at most),
#: "bf16" (training_step under autocast).
TARGET = '''\
import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

FAIL = {fail!r}


class Samples(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        if FAIL == "data":
            raise KeyError(f"sample {{i}} has no 'tokens' field")
        return torch.full((8,), float(i)), torch.ones(1)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
        self.batch_size = 16

    def train_dataloader(self):
        return DataLoader(Samples(), batch_size=16)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if FAIL == "step":
            raise ValueError("loss weights missing")
        if FAIL == "second" and self.trainer.global_step >= 1:
            raise ValueError("the second batch is bad")
        if FAIL == "late" and self.trainer.global_step >= 5:
            raise ValueError("the sixth batch is bad")
        if FAIL == "bf16" and torch.is_autocast_enabled("cpu"):
            raise ValueError("no bf16 here")
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def make():
    return Model()
'''


def _target(tmp_path: Path, fail: str | None) -> Path:
    path = tmp_path / "train_target.py"
    path.write_text(TARGET.format(fail=fail))
    for cached in tmp_path.glob("__pycache__/train_target*"):  # a rewrite within a second keeps the file's mtime
        cached.unlink()
    return path


def _line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def _argv(tmp_path: Path, target: Path, trials: int = 2, steps: int = 2) -> list[str]:
    space = tmp_path / "space.yaml"
    space.write_text("dimensions:\n  micro_batch_size: {choices: [4, 8]}\n")
    return ["search", f"{target}:make", "--budget", "2GiB", "--device", "cpu", "--space", str(space), "--trials",
            str(trials), "--storage", f"sqlite:///{tmp_path}/s.db", "--out", str(tmp_path / "tuned.yaml"),
            "--steps", str(steps), "--warmup", "1", "--no-progress", "--study", "s"]


def _study(tmp_path: Path) -> optuna.Study:
    return optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path}/s.db")


@pytest.mark.slow
def test_a_dataloader_that_raises_stops_the_search_in_three_lines_and_a_rerun_after_the_fix_resumes(
        tmp_path: Path) -> None:
    target = _target(tmp_path, "data")
    run = subprocess.run([sys.executable, "-m", "autotune", *_argv(tmp_path, target)], capture_output=True, text=True,
                         timeout=600, cwd=tmp_path)
    lines = run.stderr.splitlines()
    assert run.returncode == 2 and run.stdout == "", run.stderr[-3000:]
    assert lines == [
        f"autotune: error: target '{target}:make': cannot read a training batch (KeyError: \"sample 0 has no 'tokens' "
        "field\")",
        f"  train_target.py:{_line_of(target, 'raise KeyError')}, in __getitem__: raise KeyError(f\"sample {{i}} has "
        "no 'tokens' field\")",
        "the search stopped before its first trial; its study 's' is kept: fix the code and run the same command "
        "again to resume it"]
    study = _study(tmp_path)
    assert study.get_trials() == [] and study.user_attrs[STOPPED_BY_TARGET][:2] == [line.removeprefix(
        "autotune: error: ") for line in lines[:2]]
    assert not (tmp_path / "tuned.yaml").exists()
    _target(tmp_path, None)  # fixed
    assert main(_argv(tmp_path, target)) == 0
    study = _study(tmp_path)
    assert study.user_attrs[STOPPED_BY_TARGET] is None
    assert [t.state for t in study.get_trials() if t.user_attrs.get("source") == "measured"][:2] == [
        TrialState.COMPLETE] * 2
    assert (tmp_path / "tuned.yaml").exists()


@pytest.mark.slow
def test_a_training_step_that_raises_stops_the_search_before_its_first_trial(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # frames are shown relative to the current folder
    target = _target(tmp_path, "step")
    assert main(_argv(tmp_path, target)) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [
        f"autotune: error: target '{target}:make': the first training step raised ValueError: loss weights missing",
        f"  train_target.py:{_line_of(target, 'loss weights missing')}, in training_step: raise ValueError(\"loss "
        "weights missing\")",
        "the search stopped before its first trial; its study 's' is kept: fix the code and run the same command "
        "again to resume it"]
    assert _study(tmp_path).get_trials() == []


@pytest.mark.slow
def test_a_failure_the_estimator_cannot_see_is_caught_by_the_short_first_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    target = _target(tmp_path, "second")
    assert main(_argv(tmp_path, target)) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[:2] == [
        f"autotune: error: target '{target}:make': training step 2 raised ValueError: the second batch is bad",
        f"  train_target.py:{_line_of(target, 'the second batch')}, in training_step: raise ValueError(\"the second "
        "batch is bad\")"]
    assert err[2].startswith("the search stopped before its first trial") and len(err) == 3
    assert _study(tmp_path).get_trials() == []


@pytest.mark.slow
def test_a_failure_the_first_run_does_not_reach_stops_after_two_plans_fail_alike_and_resumes_after_the_fix(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    target = _target(tmp_path, "late")  # the short runs take 5 steps at most; trials of 5 timed steps, 7 or more
    run = subprocess.run([sys.executable, "-m", "autotune", *_argv(tmp_path, target, trials=4, steps=5)],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 2, run.stderr[-3000:]
    notes, err = run.stderr.splitlines()[:-4], run.stderr.splitlines()[-4:]
    assert "Traceback" not in run.stderr and "Trial 0 failed" not in run.stderr  # not Optuna's report, ours
    assert len(notes) == 3 and notes[0].startswith("autotune: the estimator cannot trace this target")
    assert sorted(line.split(" failed: ")[0][-8:] for line in notes[1:]) == ["micro 4)", "micro 8)"]
    assert all(line.startswith("autotune: trial ") and line.endswith("in training_step: raise ValueError(\"the sixth "
                                                                        "batch is bad\"))") for line in notes[1:])
    assert err[0] == (f"autotune: error: target '{target}:make': training step 6 raised ValueError: the sixth "
                      "batch is bad")
    assert err[1].startswith(f"  train_target.py:{_line_of(target, 'the sixth batch')}, in training_step:")
    assert err[2].startswith("(the same in trials of two plans: ")
    assert err[3].startswith("the search stopped after 2 trial(s); its study 's' is kept")
    failed = _study(tmp_path).get_trials()
    assert [t.state for t in failed] == [TrialState.FAIL] * 2  # not 5, not 4
    assert len({t.user_attrs["plan_key"] for t in failed}) == 2
    assert all(t.user_attrs["target_error"][1] == err[1] for t in failed)
    _target(tmp_path, None)
    assert main(_argv(tmp_path, target, trials=4, steps=5)) == 0
    retried = [t for t in _study(tmp_path).get_trials() if t.user_attrs.get("retry_of") is not None]
    assert sorted(t.user_attrs["retry_of"] for t in retried) == [t.number for t in failed]
    assert all(t.state == TrialState.COMPLETE for t in retried)


def test_the_estimator_stops_on_the_targets_failure_and_notes_one_plans_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cpu = torch.device("cpu")
    bf16 = SearchEstimator(target=load_target(f"{_target(tmp_path, 'bf16')}:make"), device=cpu)
    assert bf16.tensors(Plan(precision="bf16-mixed", micro_batch_size=2)) is None  # this plan's failure: a note
    assert bf16.tensors(Plan(micro_batch_size=2)) > 0
    (tmp_path / "always").mkdir()
    target = _target(tmp_path / "always", "step")
    always = SearchEstimator(target=load_target(f"{target}:make"), device=cpu)
    with pytest.raises(TargetCodeError) as info:  # the plainest step fails too: no plan can run it
        always.tensors(Plan(precision="bf16-mixed", micro_batch_size=2))
    assert info.value.lines == [
        f"target '{target}:make': the first training step raised ValueError: loss weights missing",
        f"  always/train_target.py:{_line_of(target, 'loss weights missing')}, in training_step: raise "
        "ValueError(\"loss weights missing\")"]
