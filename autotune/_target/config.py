"""Read a LightningCLI config into a target's parts: the config half of :mod:`autotune._target.target`.

It reads and checks a config as a whole: ``model:``, ``data:``, ``optimizer:`` and ``lr_scheduler:`` sections checked
with jsonargparse, ``trainer:`` and ``seed_everything:``. It builds the parts of a target from a config (model, data,
trainer arguments, seed: :mod:`autotune._target.target` makes the ``Target`` of them). It installs a config's
optimizer and scheduler as a model's ``configure_optimizers``. It also holds :class:`TargetError` and the small helpers
that factory targets use too (``sys.path`` handling, seeding, one-line errors). The dependency goes one way:
:mod:`autotune._target.target` imports from here, and this module never imports it.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import os
import random
import sys
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune._plan.config_text import (  # a target reads ckpt_path and does not use it
    CLI_CONFIG_KEYS, constructor_arguments, did_you_mean, safe_load_unique,
)

if TYPE_CHECKING:
    from lightning.pytorch import LightningDataModule, LightningModule

_CLASS_KEYS = ("class_path", "init_args")
#: Where a bare class name (``optimizer: AdamW``) is looked up, as LightningCLI's registries do.
_SHORT_NAME_MODULES = {
    "optimizer": ("torch.optim",),
    "lr_scheduler": ("lightning.pytorch.cli", "torch.optim.lr_scheduler"),  # Lightning's ReduceLROnPlateau first
}
#: The first constructor argument of an optimizer or scheduler, given at build time rather than by the config.
_BOUND_ARGUMENT = {"optimizer": "params", "lr_scheduler": "optimizer"}
_MAX_SEED = 2**32 - 1


class TargetError(ValueError):
    """A TARGET that cannot be resolved; the message is one line naming the target and what is accepted."""


# ------------------------------------------------------------------------------------------------ CLI configs


@dataclass(frozen=True)
class _ClassSection:
    """One ``class_path``/``init_args`` section of a config, its class imported and its arguments checked."""

    key: str
    cls: type
    init_args: dict[str, Any]
    parser: Any  # a jsonargparse ArgumentParser for ``cls`` under ``key``

    def parse(self) -> Any:
        """The checked, type-converted arguments (a jsonargparse Namespace)."""
        return self.parser.parse_object({self.key: self.init_args})

    def instantiate(self) -> Any:
        """A new instance built by jsonargparse (nested ``class_path`` arguments included)."""
        instantiate = getattr(self.parser, "instantiate", None) or self.parser.instantiate_classes
        return getattr(instantiate(self.parse()), self.key)

    def kwargs(self) -> dict[str, Any]:
        """The arguments as a dict, for classes built with a leading argument (optimizers, schedulers)."""
        return getattr(self.parse(), self.key).as_dict()


@dataclass(frozen=True)
class _CliConfig:
    """The parts of a LightningCLI config that a target uses."""

    model: _ClassSection | None
    data: _ClassSection | None
    optimizer: _ClassSection | None
    lr_scheduler: _ClassSection | None
    trainer: dict[str, Any]
    seed: int | None
    folders: tuple[str, ...]


def _load_config(spec: str, path: Path, *, with_model: bool) -> _CliConfig:
    """Read and check a config as a whole: every problem is reported in the one error."""
    prefix = f"target '{spec}'" if Path(spec) == path else f"target '{spec}': config '{path}'"
    if not path.is_file():
        raise TargetError(f"{prefix}: file '{path}' does not exist")
    import yaml

    try:
        raw = safe_load_unique(path.read_text())
    except (yaml.YAMLError, OSError, UnicodeDecodeError) as error:
        raise TargetError(f"{prefix}: cannot read the config: {_one_line(error)}") from error
    if not isinstance(raw, dict):
        raise TargetError(f"{prefix}: a LightningCLI config must be a mapping with `model:` and `data:` sections; "
                          f"got {type(raw).__name__}")
    errors = [f"unknown key '{key}'{did_you_mean(key, CLI_CONFIG_KEYS)} (accepted: {', '.join(CLI_CONFIG_KEYS)})"
              for key in raw if key not in CLI_CONFIG_KEYS]
    folders = (str(path.resolve().parent), os.getcwd())
    sections: dict[str, _ClassSection | None] = {}
    from lightning.pytorch import LightningDataModule, LightningModule
    from torch.optim import Optimizer
    from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

    wanted: list[tuple[str, tuple[type, ...], bool]] = [("optimizer", (Optimizer,), False),
                                                        ("lr_scheduler", (LRScheduler, ReduceLROnPlateau), False)]
    if with_model:
        wanted[:0] = [("model", (LightningModule,), True), ("data", (LightningDataModule,), False)]
    with on_sys_path(folders):
        for key, bases, required in wanted:
            sections[key] = _class_section(key, raw.get(key), bases, required=required, errors=errors)
    if sections.get("lr_scheduler") is not None and sections.get("optimizer") is None:
        errors.append("lr_scheduler: needs an `optimizer` section")
    trainer = raw.get("trainer") or {}
    if not isinstance(trainer, dict):
        errors.append(f"trainer: must be a mapping of Trainer arguments; got {type(trainer).__name__}")
        trainer = {}
    else:
        known = constructor_arguments("lightning.pytorch.Trainer")
        unknown = sorted(str(key) for key in trainer if key not in known)
        if unknown:
            errors.append(f"trainer: unknown arguments {', '.join(map(repr, unknown))} (see lightning.pytorch.Trainer)")
        elif trainer:
            with on_sys_path(folders):  # callbacks' class paths import as LightningCLI's would, beside the config
                errors += _trainer_value_errors(trainer)
    seed = raw.get("seed_everything")
    if seed is True:
        seed = random.SystemRandom().randint(0, _MAX_SEED)  # fixed once, so that every build has the same weights
    elif seed is False:
        seed = None
    elif seed is not None and not (isinstance(seed, int) and 0 <= seed <= _MAX_SEED):
        errors.append(f"seed_everything: must be an int in [0, 2**32 - 1], true or false; got {seed!r}")
    if errors:
        raise TargetError(f"{prefix}: {len(errors)} config error{'s' if len(errors) > 1 else ''}: {'; '.join(errors)}")
    return _CliConfig(model=sections.get("model"), data=sections.get("data"),
                      optimizer=sections.get("optimizer"), lr_scheduler=sections.get("lr_scheduler"),
                      trainer=trainer, seed=seed, folders=folders)


def _trainer_value_errors(trainer: dict[str, Any]) -> list[str]:
    """The trainer section's values checked against ``Trainer``'s type hints as LightningCLI checks them (a
    ``gradient_clip_val: abc``, a callback class that does not import), so that they fail here, in one line, rather
    than in every trial."""
    from jsonargparse import ArgumentParser
    from lightning.pytorch import Trainer

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(Trainer, "trainer", fail_untyped=False)
    try:
        parser.parse_object({"trainer": trainer})
    except Exception as error:  # jsonargparse's ArgumentError, and whatever a class_path's import raises
        return [_one_line(error)[:400]]
    return []


def _class_section(
    key: str, value: Any, bases: tuple[type, ...], *, required: bool, errors: list[str]
) -> _ClassSection | None:
    """Check one section (``{class_path, init_args}`` or a class path string); append problems to ``errors``."""
    base_names = " or ".join(base.__name__ for base in bases)
    if value is None:
        if required:
            errors.append(f"{key}: missing; give `{key}: {{class_path: package.module.{base_names}Subclass, "
                          "init_args: {...}}`")
        return None
    if isinstance(value, str):
        value = {"class_path": value}
    if not isinstance(value, dict):
        errors.append(f"{key}: must be a mapping with `class_path` and `init_args`; got {type(value).__name__}")
        return None
    extra = [str(k) for k in value if k not in _CLASS_KEYS]
    if extra:
        errors.append(f"{key}: unexpected keys {', '.join(map(repr, extra))} (accepted: class_path, init_args)")
    class_path, init_args = value.get("class_path"), value.get("init_args") or {}
    if not isinstance(init_args, dict):
        errors.append(f"{key}.init_args: must be a mapping; got {type(init_args).__name__}")
        return None
    if not isinstance(class_path, str) or not class_path:
        errors.append(f"{key}: needs a `class_path` naming a {base_names} subclass "
                      f"(LightningCLI's `{key}: {{class_path: ..., init_args: ...}}` form)")
        return None
    candidates = [class_path] if "." in class_path else [
        f"{module}.{class_path}" for module in _SHORT_NAME_MODULES.get(key, ())]
    if not candidates:
        errors.append(f"{key}.class_path: '{class_path}' must be a dotted import path like 'package.module.Class'")
        return None
    cls: Any = None
    failure = ""
    for candidate in candidates:
        try:
            cls = _import_object(candidate)
            break
        except (Exception, SystemExit) as error:
            failure = _one_line(error)
    if cls is None:
        errors.append(f"{key}.class_path: cannot import '{class_path}': {failure}")
        return None
    if not (isinstance(cls, type) and issubclass(cls, bases)):
        errors.append(f"{key}.class_path: '{class_path}' is not a {base_names} subclass")
        return None
    try:
        from jsonargparse import ArgumentParser
    except ImportError as error:
        raise TargetError(f"reading a LightningCLI config needs jsonargparse: pip install 'jsonargparse[signatures]' "
                          f"({_one_line(error)})") from error
    parser = ArgumentParser(exit_on_error=False)
    skip = {_BOUND_ARGUMENT[key]} if key in _BOUND_ARGUMENT else None
    parser.add_class_arguments(cls, key, skip=skip, fail_untyped=False)
    section = _ClassSection(key=key, cls=cls, init_args=init_args, parser=parser)
    try:
        section.parse()
    except Exception as error:
        errors.append(f"{key}.init_args: {' '.join(str(error).split())}")
        return None
    return section


@dataclass(frozen=True)
class _ConfigParts:
    """What a config target builds: the fields of a :class:`~autotune._target.target.Target` but its ``spec``."""

    model: LightningModule
    datamodule: LightningDataModule | None
    trainer_config: dict[str, Any]
    seed: int | None


def _parts_from_config(spec: str, cli: _CliConfig) -> _ConfigParts:
    """Seed, then build the config's model and data, and install its optimizer and scheduler on the model."""
    if cli.model is None:  # _load_config(with_model=True) requires it
        raise TargetError(f"target '{spec}': the config has no `model` section")
    _seed(cli.seed)
    with on_sys_path(cli.folders):
        model = _instantiate(spec, cli.model)
        datamodule = None if cli.data is None else _instantiate(spec, cli.data)
    if datamodule is None:
        _require_train_dataloader(spec, model, "the config has no `data` section",
                                  "add `data: {class_path: ..., init_args: ...}`")
    _install_optimizers(model, cli)
    return _ConfigParts(model=model, datamodule=datamodule, trainer_config=copy.deepcopy(cli.trainer), seed=cli.seed)


def _instantiate(spec: str, section: _ClassSection) -> Any:
    try:
        return section.instantiate()
    except Exception as error:
        raise TargetError(f"target '{spec}': building {section.key} '{section.cls.__qualname__}' raised "
                          f"{_one_line(error)}") from error


def _install_optimizers(model: LightningModule, cli: _CliConfig) -> None:
    """Replace ``model.configure_optimizers`` by the config's optimizer and scheduler, as LightningCLI does."""
    if cli.optimizer is None:
        return
    from lightning.pytorch.cli import LightningCLI

    optimizer_section, scheduler_section = cli.optimizer, cli.lr_scheduler
    optimizer_kwargs = optimizer_section.kwargs()
    scheduler_kwargs = None if scheduler_section is None else scheduler_section.kwargs()

    def configure_optimizers(self: LightningModule) -> Any:
        optimizer = optimizer_section.cls(self.parameters(), **optimizer_kwargs)
        scheduler = None if scheduler_section is None else scheduler_section.cls(optimizer, **scheduler_kwargs)
        return LightningCLI.configure_optimizers(self, optimizer, scheduler)

    model.configure_optimizers = types.MethodType(configure_optimizers, model)  # type: ignore[method-assign]


# ---------------------------------------------------------------------------------------------------- helpers


def _require_train_dataloader(spec: str, model: LightningModule, what: str, fix: str) -> None:
    from lightning.pytorch.utilities.model_helpers import is_overridden

    if not is_overridden("train_dataloader", model):
        name = type(model).__name__
        raise TargetError(f"target '{spec}': {what}, and {name} does not define train_dataloader; "
                          f"{fix} or give {name} a train_dataloader")


@contextlib.contextmanager
def on_sys_path(folders: Sequence[str]) -> Iterator[None]:
    """Put ``folders`` first on ``sys.path`` for the block, then take back the ones that were not there."""
    added = [folder for folder in dict.fromkeys(folders) if folder not in sys.path]
    sys.path[:0] = added
    try:
        yield
    finally:
        for folder in added:
            with contextlib.suppress(ValueError):
                sys.path.remove(folder)


def _import_object(dotted: str) -> Any:
    module_name, _, attribute = dotted.rpartition(".")
    module = importlib.import_module(module_name)
    try:
        return getattr(module, attribute)
    except AttributeError:
        raise ImportError(f"module '{module_name}' has no attribute '{attribute}'") from None


def _seed(seed: int | None) -> None:
    if seed is not None:
        from lightning.pytorch import seed_everything

        seed_everything(seed, verbose=False)


def _one_line(error: BaseException) -> str:
    """``Type: message`` with all whitespace (newlines included) collapsed."""
    message = " ".join(str(error).split())
    return f"{type(error).__name__}: {message}" if message else type(error).__name__
