"""Resolving TARGET strings: factories by file and module path, LightningCLI configs, and every malformed target."""

from __future__ import annotations

import os
import re
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from autotune._target.target import Target, TargetError, load_target, target_factory

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "targets"
FACTORIES = "tests/fixtures/targets/factories.py"
EXPECTED = "(LightningModule, LightningDataModule) or a LightningModule with train_dataloader"
ACCEPTED = "'path/to/file.py:factory', 'package.module:factory' or a LightningCLI config .yaml"


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    """Relative targets resolve against the repository root; the fixture package is importable by name."""
    monkeypatch.chdir(REPO)
    monkeypatch.syspath_prepend(str(FIXTURES))


def _raises(spec: str | None, message: str, *, config: str | Path | None = None) -> TargetError:
    """Assert that loading raises TargetError with exactly ``message``, on one line."""
    with pytest.raises(TargetError, match=f"^{re.escape(message)}$") as info:
        load_target(spec, config=config)
    assert "\n" not in str(info.value)
    return info.value


def _write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


# ----------------------------------------------------------------------------------------------------- factories


def test_gpt_example_by_file_path() -> None:
    target = load_target("examples/gpt/train.py:make")
    assert isinstance(target, Target)
    assert target.spec == "examples/gpt/train.py:make"
    assert type(target.model).__name__ == "GPT"
    assert type(target.datamodule).__name__ == "SyntheticTokens"
    assert target.trainer_config == {}
    assert target.seed is None
    assert target.batch_size() == 32
    assert target.tokens_per_sample() == 32


def test_file_path_may_be_absolute_and_its_folder_leaves_sys_path(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # a fresh sibling pair, so the import cannot come from sys.modules
    _write(tmp_path / "autotune_tmp_sibling.py", """
        from autotune_target_fixtures.toy import ToyData, ToyModel
        WIDTH = 3
    """)
    _write(tmp_path / "entry.py", """
        from autotune_tmp_sibling import WIDTH, ToyData, ToyModel

        def make():
            return ToyModel(width=WIDTH), ToyData(width=WIDTH, batch_size=9)
    """)
    monkeypatch.chdir(tmp_path.parent)
    target = load_target(f"{tmp_path / 'entry.py'}:make")
    assert target.model.hparams.width == 3
    assert target.batch_size() == 9
    assert str(tmp_path) not in sys.path
    assert type(target.model).__module__ == "autotune_target_fixtures.toy"


def test_factory_runs_with_its_folder_on_sys_path(tmp_path: Path) -> None:
    _write(tmp_path / "autotune_tmp_lazy_sibling.py", "BATCH = 7\n")
    _write(tmp_path / "lazy.py", """
        from autotune_target_fixtures.toy import ToyData, ToyModel

        def make():
            from autotune_tmp_lazy_sibling import BATCH  # imported only when the factory runs

            return ToyModel(), ToyData(batch_size=BATCH)
    """)
    make = target_factory(f"{tmp_path / 'lazy.py'}:make")
    assert str(tmp_path) not in sys.path
    assert make().batch_size() == 7
    assert load_target(f"{FACTORIES}:make_lazy").batch_size() == 2


def test_module_path() -> None:
    target = load_target("autotune_target_fixtures.toy:make")
    assert type(target.model).__name__ == "ToyModel"
    assert target.batch_size() == 8
    assert target.tokens_per_sample() == 16
    assert target.trainer_config == {}


def test_module_with_its_own_dataloaders() -> None:
    target = load_target("autotune_target_fixtures.toy:make_loader_model")
    assert target.datamodule is None
    assert target.batch_size() == 5
    assert target.tokens_per_sample() is None


def test_batch_size_from_a_batch_sampler() -> None:
    assert load_target("autotune_target_fixtures.toy:make_sampler_model").batch_size() == 3


def test_batch_size_from_hparams_and_tokens_from_datamodule() -> None:
    target = load_target("autotune_target_fixtures.toy:make_hparams")
    assert target.batch_size() == 6
    assert target.tokens_per_sample() == 128


def test_batch_size_from_a_dataloader_after_setup() -> None:
    assert load_target("autotune_target_fixtures.toy:make_hidden_batch").batch_size() == 12


def test_model_and_none_needs_model_dataloaders() -> None:
    _raises(f"{FACTORIES}:returns_model_and_none",
            f"target '{FACTORIES}:returns_model_and_none': returns_model_and_none() returned a ToyModel without a "
            "LightningDataModule, and ToyModel does not define train_dataloader; return (model, datamodule) or give "
            "ToyModel a train_dataloader")


def test_target_factory_builds_fresh_targets() -> None:
    make = target_factory("autotune_target_fixtures.toy:make")
    first, second, third = make(), make(), make()
    assert len({id(first.model), id(second.model), id(third.model)}) == 3
    assert first.datamodule is not second.datamodule
    assert second.batch_size() == 8


def test_target_factory_checks_before_returning() -> None:
    with pytest.raises(TargetError, match=r"^target 'autotune_target_fixtures\.toy:make_no_batch': cannot find"):
        target_factory("autotune_target_fixtures.toy:make_no_batch")


# --------------------------------------------------------------------------------------------------- CLI configs


def _config(tmp_path: Path, text: str, name: str = "cli.yaml") -> Path:
    return _write(tmp_path / name, text)


def test_cli_config(tmp_path: Path) -> None:
    path = _config(tmp_path, """
        seed_everything: 7
        trainer:
          accelerator: cpu
          max_steps: 3
        model:
          class_path: autotune_target_fixtures.toy.ToyModel
          init_args:
            width: 8
            lr: 1e-3          # YAML reads this as a string; the class signature makes it a float
        data:
          class_path: autotune_target_fixtures.toy.ToyData
          init_args:
            width: 8
            batch_size: 12
    """)
    make = target_factory(str(path))
    target = make()
    assert target.spec == str(path)
    assert type(target.model).__name__ == "ToyModel"
    assert target.model.hparams.width == 8
    assert target.model.hparams.lr == 0.001
    assert target.batch_size() == 12
    assert target.trainer_config == {"accelerator": "cpu", "max_steps": 3}
    assert target.seed == 7
    again = make()
    assert again.model is not target.model
    assert torch.equal(again.model.layer.weight, target.model.layer.weight)  # seeded before each build
    again.trainer_config["max_steps"] = 99
    assert make().trainer_config["max_steps"] == 3  # each build has its own copy


def test_cli_config_given_as_config_and_short_class_forms(tmp_path: Path) -> None:
    path = _config(tmp_path, """
        model: autotune_target_fixtures.toy.LoaderModel
        optimizer:
          class_path: SGD
          init_args: {lr: 0.5}
        lr_scheduler: {class_path: torch.optim.lr_scheduler.StepLR, init_args: {step_size: 2}}
        ckpt_path: null
    """, name="cli.yml")
    target = load_target(None, config=path)
    assert target.spec == str(path)
    assert target.datamodule is None
    assert target.batch_size() == 5
    [optimizer], [scheduler] = target.model.configure_optimizers()
    assert isinstance(optimizer, torch.optim.SGD) and optimizer.param_groups[0]["lr"] == 0.5
    assert isinstance(scheduler, torch.optim.lr_scheduler.StepLR) and scheduler.step_size == 2


def test_cli_config_class_paths_import_from_the_config_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write(tmp_path / "autotune_tmp_cfg_models.py", """
        from autotune_target_fixtures.toy import ToyData, ToyModel

        class Model(ToyModel):
            pass
    """)
    path = _config(tmp_path, """
        model: {class_path: autotune_tmp_cfg_models.Model}
        data: {class_path: autotune_tmp_cfg_models.ToyData, init_args: {batch_size: 4}}
    """)
    monkeypatch.chdir(tmp_path.parent)
    target = load_target(str(path))
    assert type(target.model).__name__ == "Model"
    assert target.batch_size() == 4
    assert str(tmp_path) not in sys.path


def test_factory_with_a_config_takes_trainer_seed_and_optimizer(tmp_path: Path) -> None:
    path = _config(tmp_path, """
        seed_everything: 3
        trainer: {precision: bf16-mixed}
        optimizer: AdamW
        model:
          n_layer: 2        # read by LightningCLI, not by a factory target
    """)
    target = load_target("examples/gpt/train.py:make", config=path)
    assert target.spec == "examples/gpt/train.py:make"
    assert target.trainer_config == {"precision": "bf16-mixed"}
    assert target.seed == 3
    assert isinstance(target.model.configure_optimizers(), torch.optim.AdamW)
    assert target.batch_size() == 32


def test_seed_everything_true_is_fixed_once(tmp_path: Path) -> None:
    path = _config(tmp_path, """
        seed_everything: true
        model: autotune_target_fixtures.toy.LoaderModel
    """)
    make = target_factory(str(path))
    first, second = make(), make()
    assert first.seed == second.seed and isinstance(first.seed, int)
    assert torch.equal(first.model.layer.weight, second.model.layer.weight)


# ------------------------------------------------------------------------------------------------ malformed specs


def test_no_colon() -> None:
    _raises("foo", f"target 'foo' must be {ACCEPTED}")
    _raises("foo.py:", f"target 'foo.py:' must be {ACCEPTED}")


def test_no_target() -> None:
    _raises(None, f"no target given: give {ACCEPTED}")


def test_missing_file() -> None:
    _raises("x.py:make", "target 'x.py:make': file 'x.py' does not exist")
    _raises("missing.yaml", "target 'missing.yaml': file 'missing.yaml' does not exist")


def test_module_not_importable() -> None:
    _raises("no_such_pkg_xyz.mod:make",
            "target 'no_such_pkg_xyz.mod:make': cannot import module 'no_such_pkg_xyz.mod': "
            "ModuleNotFoundError: No module named 'no_such_pkg_xyz'")


def test_file_not_importable(tmp_path: Path) -> None:
    broken = _write(tmp_path / "broken.py", "import no_such_module_xyz\n")
    _raises(f"{broken}:make", f"target '{broken}:make': cannot import file '{broken}': "
            "ModuleNotFoundError: No module named 'no_such_module_xyz'")
    script = _write(tmp_path / "script.py", "raise SystemExit(2)\n")
    _raises(f"{script}:make", f"target '{script}:make': file '{script}' exited while being imported "
            "(SystemExit: 2); put its script code under `if __name__ == \"__main__\":`")


def test_missing_attribute() -> None:
    _raises(f"{FACTORIES}:mak", f"target '{FACTORIES}:mak': file '{FACTORIES}' has no attribute 'mak'; "
            "did you mean 'make'?")
    _raises("autotune_target_fixtures.toy:nothing_like_it",
            "target 'autotune_target_fixtures.toy:nothing_like_it': module 'autotune_target_fixtures.toy' has no "
            "attribute 'nothing_like_it'")


def test_attribute_not_callable() -> None:
    _raises(f"{FACTORIES}:NOT_CALLABLE", f"target '{FACTORIES}:NOT_CALLABLE': 'NOT_CALLABLE' in file '{FACTORIES}' "
            f"is not callable (it is a int); it must be a function returning {EXPECTED}")


def test_factory_raising_names_the_users_frame() -> None:
    from autotune._target.failure import TargetCodeError

    with pytest.raises(TargetCodeError) as info:
        load_target(f"{FACTORIES}:raises")
    assert info.value.lines == [f"target '{FACTORIES}:raises': raises() raised RuntimeError: no GPU found",
                                f"  {FACTORIES}:26, in raises: raise RuntimeError(\"no GPU\\nfound\")"]


def test_a_module_without_configure_optimizers_is_refused_at_load(tmp_path: Path) -> None:
    path = _write(tmp_path / "noopt.py", """\
        import lightning as L
        from torch import nn


        class NoOptimizer(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = nn.Linear(2, 1)
                self.batch_size = 4

            def training_step(self, batch, batch_idx):
                return self.net(batch).sum()

            def train_dataloader(self):
                return [__import__("torch").ones(4, 2)]


        def make():
            return NoOptimizer()
        """)
    _raises(f"{path}:make", f"target '{path}:make': NoOptimizer ({os.path.relpath(path)}:5) does not define "
            "configure_optimizers(), which Lightning's Trainer needs to train: define configure_optimizers() returning "
            "an optimizer, or give --config a LightningCLI config with an `optimizer:` section")


def test_wrong_return_type() -> None:
    _raises(f"{FACTORIES}:returns_int", f"target '{FACTORIES}:returns_int': returns_int() returned int; "
            f"expected {EXPECTED}")
    _raises(f"{FACTORIES}:returns_pair_of_wrong_types",
            f"target '{FACTORIES}:returns_pair_of_wrong_types': returns_pair_of_wrong_types() returned "
            f"(ToyModel, int); expected {EXPECTED}")


def test_module_without_dataloaders_and_no_datamodule() -> None:
    _raises(f"{FACTORIES}:returns_bare_model",
            f"target '{FACTORIES}:returns_bare_model': returns_bare_model() returned a ToyModel without a "
            "LightningDataModule, and ToyModel does not define train_dataloader; return (model, datamodule) or give "
            "ToyModel a train_dataloader")


def test_no_batch_size() -> None:
    _raises("autotune_target_fixtures.toy:make_no_batch",
            "target 'autotune_target_fixtures.toy:make_no_batch': cannot find the batch size: give the DataModule "
            "a `batch_size` attribute or the DataLoader a batch_size")


# ---------------------------------------------------------------------------------------------- malformed configs


def test_config_trainer_values_are_checked_as_lightning_cli_checks_them(tmp_path: Path) -> None:
    path = _config(tmp_path, """
        model: {class_path: autotune_target_fixtures.toy.ToyModel}
        data: {class_path: autotune_target_fixtures.toy.ToyData}
        trainer:
          gradient_clip_val: abc
    """)
    with pytest.raises(TargetError,
                       match=r'config error: ArgumentError: Parser key "trainer.gradient_clip_val": .*value: abc'):
        load_target(str(path))
    _config(tmp_path, """
        model: {class_path: autotune_target_fixtures.toy.ToyModel}
        data: {class_path: autotune_target_fixtures.toy.ToyData}
        trainer:
          callbacks: [{class_path: nope.Nope}]
    """)
    with pytest.raises(TargetError, match=r"Problem with given class_path 'nope.Nope': No module named 'nope'"):
        load_target(str(path))


def test_config_without_class_paths_reports_every_error(tmp_path: Path) -> None:
    path = _config(tmp_path, """
        model:
          n_layer: 2
        data:
          init_args: {batch_size: 4}
        trainer: {max_stepz: 3}
        fit: {}
        seed_everything: -1
    """)
    _raises(str(path), f"target '{path}': 6 config errors: "
            "unknown key 'fit' (accepted: model, data, trainer, seed_everything, optimizer, lr_scheduler, ckpt_path); "
            "model: unexpected keys 'n_layer' (accepted: class_path, init_args); "
            "model: needs a `class_path` naming a LightningModule subclass "
            "(LightningCLI's `model: {class_path: ..., init_args: ...}` form); "
            "data: needs a `class_path` naming a LightningDataModule subclass "
            "(LightningCLI's `data: {class_path: ..., init_args: ...}` form); "
            "trainer: unknown arguments 'max_stepz' (see lightning.pytorch.Trainer); "
            "seed_everything: must be an int in [0, 2**32 - 1], true or false; got -1")


def test_config_without_model_and_data(tmp_path: Path) -> None:
    path = _config(tmp_path, "trainer: {max_steps: 3}\n")
    _raises(str(path), f"target '{path}': 1 config error: model: missing; give `model: {{class_path: "
            "package.module.LightningModuleSubclass, init_args: {...}}`")


def test_config_without_data_needs_model_dataloaders(tmp_path: Path) -> None:
    path = _config(tmp_path, "model: {class_path: autotune_target_fixtures.toy.ToyModel}\n")
    _raises(str(path), f"target '{path}': the config has no `data` section, and ToyModel does not define "
            "train_dataloader; add `data: {class_path: ..., init_args: ...}` or give ToyModel a train_dataloader")


def test_config_bad_classes_and_arguments(tmp_path: Path) -> None:
    path = _config(tmp_path, """
        model:
          class_path: autotune_target_fixtures.toy.ToyData
        data:
          class_path: autotune_target_fixtures.toy.Nope
        optimizer:
          class_path: torch.optim.SGD
          init_args: {lrx: 1}
        lr_scheduler: NoSuchScheduler
    """)
    _raises(str(path), f"target '{path}': 4 config errors: "
            "model.class_path: 'autotune_target_fixtures.toy.ToyData' is not a LightningModule subclass; "
            "data.class_path: cannot import 'autotune_target_fixtures.toy.Nope': "
            "ImportError: module 'autotune_target_fixtures.toy' has no attribute 'Nope'; "
            "optimizer.init_args: Group 'optimizer' does not accept option 'lrx'; "
            "lr_scheduler.class_path: cannot import 'NoSuchScheduler': "
            "ImportError: module 'torch.optim.lr_scheduler' has no attribute 'NoSuchScheduler'")


def test_config_init_args_of_the_wrong_type(tmp_path: Path) -> None:
    path = _config(tmp_path, """
        model: {class_path: autotune_target_fixtures.toy.ToyModel, init_args: {width: wide}}
        data: {class_path: no_such_pkg_xyz.Data}
    """)
    _raises(str(path), f"target '{path}': 2 config errors: "
            "model.init_args: Parser key \"model.width\": Expected a <class 'int'>. Got value: wide; "
            "data.class_path: cannot import 'no_such_pkg_xyz.Data': ModuleNotFoundError: No module named "
            "'no_such_pkg_xyz'")


def test_config_constructor_raising(tmp_path: Path) -> None:
    path = _config(tmp_path, """
        model: {class_path: autotune_target_fixtures.toy.ToyModel, init_args: {width: -1}}
        data: autotune_target_fixtures.toy.ToyData
    """)
    error = _raises(str(path), f"target '{path}': building model 'ToyModel' raised RuntimeError: "
                    "Trying to create tensor with negative dimension -1: [1, -1]")
    assert isinstance(error.__cause__, RuntimeError)


def test_config_not_a_mapping_or_not_yaml(tmp_path: Path) -> None:
    listing = _config(tmp_path, "- model\n- data\n")
    _raises(str(listing), f"target '{listing}': a LightningCLI config must be a mapping with `model:` and `data:` "
            "sections; got list")
    broken = _config(tmp_path, "model: [unclosed\n", name="broken.yaml")
    with pytest.raises(TargetError, match=rf"^target '{re.escape(str(broken))}': cannot read the config: "
                       r"ParserError: while parsing a flow sequence .*$"):
        load_target(str(broken))


def test_config_named_twice(tmp_path: Path) -> None:
    one = _config(tmp_path, "model: autotune_target_fixtures.toy.LoaderModel\n", name="one.yaml")
    other = _config(tmp_path, "model: autotune_target_fixtures.toy.LoaderModel\n", name="other.yaml")
    assert load_target(str(one), config=one).batch_size() == 5
    _raises(str(one), f"target '{one}' is a LightningCLI config and `config` names another, '{other}'; "
            "give one of them", config=other)


def test_config_with_a_factory_is_checked_too(tmp_path: Path) -> None:
    path = _config(tmp_path, "trainer: [cpu]\n")
    _raises("autotune_target_fixtures.toy:make", f"target 'autotune_target_fixtures.toy:make': config '{path}': "
            "1 config error: trainer: must be a mapping of Trainer arguments; got list", config=path)
    missing = tmp_path / "absent.yaml"
    _raises("autotune_target_fixtures.toy:make", f"target 'autotune_target_fixtures.toy:make': config '{missing}': "
            f"file '{missing}' does not exist", config=missing)
