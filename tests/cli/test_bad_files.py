"""Bad files and inputs a review found: each gets one clear error naming the value, before anything is written."""

from __future__ import annotations

from pathlib import Path

import pytest

from autotune import Plan, PlanFileError, load_plan
from autotune._cli.main import main
from autotune._plan.space import SpaceError, load_space
from autotune._search.auto import shape_key
from autotune._search.search import search
from autotune._target.target import TargetError, load_target

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = str(ROOT / "tests" / "fixtures" / "search_target.py")
BINARY = bytes(range(128, 256)) * 4


def test_binary_space_and_tuned_files_name_the_file(tmp_path: Path) -> None:
    (tmp_path / "s.yaml").write_bytes(BINARY)
    with pytest.raises(SpaceError, match=r"space '.*s.yaml': cannot read it as a YAML text file"):
        load_space(str(tmp_path / "s.yaml"))
    (tmp_path / "t.yaml").write_bytes(BINARY)
    with pytest.raises(PlanFileError, match=r"t.yaml: cannot read the tuned file as YAML text"):
        load_plan(tmp_path / "t.yaml")


def test_malformed_yaml_in_a_space_or_a_tuned_file_is_placed_by_line_and_column(tmp_path: Path) -> None:
    (tmp_path / "s.yaml").write_text("dimensions:\n  precision: {choices: [32-true, bf16-mixed}\n")
    with pytest.raises(SpaceError, match=r"space '.*s.yaml': not valid YAML: .* at line 2, column \d+ \(while "):
        load_space(str(tmp_path / "s.yaml"))
    (tmp_path / "t.yaml").write_text("trainer:\n\tprecision: bf16-mixed\n")
    with pytest.raises(PlanFileError, match=r"t.yaml: cannot read the tuned file as YAML text: found character "
                                            r"'\\t' that cannot start any token at line 2, column 1"):
        load_plan(tmp_path / "t.yaml")


def test_a_tuned_file_with_keys_lightning_would_refuse_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    Plan(micro_batch_size=4).save(path)
    text = path.read_text().replace("trainer:\n", "colour: red\ntrainer:\n  max_stepz: 3\n", 1)
    text = text.replace("      micro_batch_size: 4", "      micro_batch_size: 4\n      grow_after: 5\n      colur: x")
    path.write_text(text)
    with pytest.raises(PlanFileError) as info:
        load_plan(path)
    message = str(info.value)
    assert "colour: unknown key (a tuned file is a LightningCLI config: model, data, trainer" in message
    assert "trainer.max_stepz: not an argument of lightning's Trainer" in message
    assert "trainer.callbacks+[0].init_args.colur: not an argument of ElasticBatchSize" in message
    assert "grow_after" not in message  # an ElasticBatchSize option that is not a plan setting is fine
    path.write_text("budget: 1GiB\nbudget: 2GiB\n")
    with pytest.raises(PlanFileError, match=r"key 'budget' appears twice \(line 2\)"):
        load_plan(path)


def test_a_factory_that_calls_sys_exit_is_a_target_error(tmp_path: Path) -> None:
    (tmp_path / "exits.py").write_text("import sys\n\ndef make():\n    sys.exit(3)\n")
    with pytest.raises(TargetError, match=r"exits.py:make': make\(\) called sys.exit\(3\)"):
        load_target(f"{tmp_path / 'exits.py'}:make")


def test_report_refuses_a_file_as_its_plot_folder_before_printing(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    (tmp_path / "taken.yaml").write_text("x: 1\n")
    code = main(["report", "--storage", f"sqlite:///{tmp_path}/none.db", "--out", str(tmp_path / "taken.yaml")])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert "taken.yaml' is a file; the report writes its plots into a folder" in err


def test_a_study_resumed_with_a_changed_space_is_refused(tmp_path: Path) -> None:
    space = tmp_path / "space.yaml"
    space.write_text("dimensions:\n  micro_batch_size: {choices: [8]}\n")
    kwargs = dict(device="cpu", target=f"{FIXTURE}:make", budget="2GiB", space=str(space), trials=1,
                  storage=f"sqlite:///{tmp_path}/s.db", out=None, steps=1, warmup=1)
    search(**kwargs)
    space.write_text("dimensions:\n  micro_batch_size: {choices: [8, 16]}\n")
    with pytest.raises(ValueError, match=r"was created for another search: space_content '[0-9a-f]{12}' \(now "):
        search(**kwargs)


def test_two_projects_train_py_searched_from_one_folder_get_two_studies(tmp_path: Path) -> None:
    import types

    import torch

    from autotune._search.storage import study_name

    space, cpu = types.SimpleNamespace(name="cpu"), torch.device("cpu")
    gpt, ddp = (study_name(f"examples/{p}/train.py:make", "2GiB", space, cpu) for p in ("gpt", "ddp"))
    assert (gpt, ddp) == ("autotune-gpt-train.py:make-2GiB-cpu-cpu", "autotune-ddp-train.py:make-2GiB-cpu-cpu")
    assert study_name("pkg.models:make", "2GiB", space, cpu) == "autotune-pkg.models:make-2GiB-cpu-cpu"
    assert study_name(f"{tmp_path}/my run/cfg.yaml", 0.8, space, cpu) == "autotune-my-run-cfg.yaml-0.8-cpu-cpu"


def test_a_list_of_block_classes_is_a_shape_key_part() -> None:
    assert shape_key({"activation_checkpointing": ["Block"], "micro_batch_size": 8}) == (
        ("activation_checkpointing", ("Block",)),)
    hash(shape_key({"activation_checkpointing": ["Block"]}))


def test_an_interrupted_search_says_whether_it_left_a_study(tmp_path: Path) -> None:
    import argparse

    from autotune._cli.main import _interrupted_search

    args = argparse.Namespace(storage=f"sqlite:///{tmp_path}/s.db")
    assert _interrupted_search(args) == " before the study was created; nothing was written"
    (tmp_path / "s.db").write_bytes(b"")
    assert "the study is kept, and the same command resumes it" in _interrupted_search(args)


def test_an_estimate_budget_above_the_devices_memory_is_refused() -> None:
    import torch

    from autotune._device.budget import resolve_budget

    with pytest.raises(ValueError, match=r"budget 200GiB \(200.00 GiB\) is more than cuda:0's memory \(80.00 GiB\)"):
        resolve_budget("200GiB", torch.device("cuda", 0), what_if=True, device_memory=80 * 2**30)
    assert resolve_budget("60GiB", torch.device("cuda"), what_if=True,
                          device_memory=80 * 2**30).budget_bytes == 60 * 2**30
    with pytest.raises(ValueError, match=r"budget 1000TiB \(1000.00 TiB\) is more than cpu's memory \("):
        resolve_budget("1000TiB", torch.device("cpu"))  # this host's memory, read


NO_OPTIMIZER = '''\
import lightning as L
import torch


class NoOptimizer(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.batch_size = 8

    def training_step(self, batch, batch_idx):
        return self.net(batch).sum()

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.ones(32, 4), batch_size=8)


def make():
    return NoOptimizer()
'''


@pytest.mark.parametrize("verb", [["estimate", "--budget", "2GiB"], ["suggest", "--budget", "2GiB"],
                                  ["search", "--budget", "2GiB", "--no-progress"]])
def test_a_module_without_configure_optimizers_is_one_line_for_every_verb(
        verb: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "noopt.py").write_text(NO_OPTIMIZER)
    assert main([verb[0], "noopt.py:make", "--device", "cpu", *verb[1:]]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (
        "autotune: error: target 'noopt.py:make': NoOptimizer (noopt.py:5) does not define configure_optimizers(), "
        "which Lightning's Trainer needs to train: define configure_optimizers() returning an optimizer, or give "
        "--config a LightningCLI config with an `optimizer:` section\n")
    assert not (tmp_path / "autotune.db").exists() and not (tmp_path / "tuned.yaml").exists()  # nothing written
