"""Resolve a TARGET string into a model and its data: what ``autotune estimate`` and ``autotune search`` take.

A TARGET is one of:

- ``path/to/file.py:factory``: a Python file (relative to the current directory or absolute). It is imported under
  a unique module name with its folder on ``sys.path`` while it imports and while ``factory`` runs, so sibling
  imports work.
- ``package.module:factory``: an importable module (the current directory is on ``sys.path``, as for
  ``python -m``).
- ``path/to/cli.yaml``: a LightningCLI config whose ``model:`` and ``data:`` sections name a ``class_path`` (and
  optional ``init_args``). Class paths import with the current directory and the config's folder on ``sys.path``.

``factory()`` returns ``(LightningModule, LightningDataModule)`` or a ``LightningModule`` with its own
``train_dataloader``. A config may also hold ``trainer:`` (returned as a dict), ``seed_everything:`` (applied
before each build), and ``optimizer:``/``lr_scheduler:`` (installed as the model's ``configure_optimizers``, as
LightningCLI does). A config can also come with a factory target (``--config``). Then the factory builds the model
and data, the config gives the rest, and its ``model:``/``data:`` sections are not read.

Every malformed target raises :class:`TargetError` with one line that names the target and what is accepted.
Reading a config, and the helpers both kinds of target share, live in :mod:`autotune._target.config`.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import hashlib
import importlib
import importlib.util
import inspect
import os
import re
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune._target.config import (
    TargetError,
    _CliConfig,
    _install_optimizers,
    _load_config,
    on_sys_path,
    _one_line,
    _parts_from_config,
    _require_train_dataloader,
    _seed,
)

if TYPE_CHECKING:
    from lightning.pytorch import LightningDataModule, LightningModule

__all__ = ["Target", "TargetError", "load_target", "target_factory"]

_ACCEPTED = "'path/to/file.py:factory', 'package.module:factory' or a LightningCLI config .yaml"
_FACTORY_RETURNS = "(LightningModule, LightningDataModule) or a LightningModule with train_dataloader"
_NO_BATCH_SIZE = "cannot find the batch size: give the {owner} a `batch_size` attribute or the DataLoader a batch_size"
_CONFIG_SUFFIXES = (".yaml", ".yml")
_MODULE_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*\Z")


@dataclass(frozen=True)
class Target:
    """A model and its data, resolved from a TARGET string.

    Args:
        spec: The TARGET as given (the config path when only ``config`` was given).
        model: The LightningModule.
        datamodule: Its LightningDataModule, or None when the model has its own ``train_dataloader``.
        trainer_config: The ``trainer:`` section of a LightningCLI config (a copy per build); ``{}`` otherwise.
        seed: The ``seed_everything`` applied before building, or None.
    """

    spec: str
    model: LightningModule
    datamodule: LightningDataModule | None
    trainer_config: dict[str, Any] = field(default_factory=dict)
    seed: int | None = None

    def check_runnable(self, strategies: tuple[str, ...] | list[str]) -> None:
        """Refuse, in one line, to run a model built on the meta device (no weights) under plan strategies that need
        its weights: only ``fsdp`` (``ModelParallelStrategy``) materialises a meta model (``to_empty`` and each
        module's ``reset_parameters``). Estimates need no weights.

        Raises:
            TargetError: naming the strategies that cannot run the model.
        """
        tensors = [*self.model.parameters(), *self.model.buffers()]
        needs_weights = sorted(set(strategies) - {"fsdp"})
        if needs_weights and any(t.is_meta for t in tensors):
            raise TargetError(
                f"target '{self.spec}' builds its model on the meta device (no weights), and plans with strategy "
                f"{', '.join(repr(s) for s in needs_weights)} run it as built: search a space whose plans shard "
                "(strategy 'fsdp', under which Lightning materialises meta modules with reset_parameters), build the "
                "weights, or use `autotune estimate`, which needs none")

    def batch_size(self) -> int:
        """The effective batch size: ``batch_size`` of the datamodule, of the model, or of the train dataloader.

        Looks at ``datamodule.batch_size``, ``datamodule.hparams.batch_size``, then the same on the model, then
        calls ``train_dataloader()`` (after ``datamodule.setup("fit")``) and reads the DataLoader's ``batch_size``
        or its batch sampler's.

        Returns:
            A positive int.

        Raises:
            TargetError: when no source gives a batch size, or one gives something other than a positive int.
        """
        for owner_name, owner in (("datamodule", self.datamodule), ("model", self.model)):
            if owner is None:
                continue
            hparams = getattr(owner, "hparams", None)
            from_hparams = hparams.get("batch_size") if isinstance(hparams, Mapping) else None
            for where, value in ((f"{owner_name}.batch_size", getattr(owner, "batch_size", None)),
                                 (f"{owner_name}.hparams.batch_size", from_hparams)):
                if value is not None:
                    return self._positive_int(where, value)
        owner_label = "DataModule" if self.datamodule is not None else "LightningModule"
        loader = self._train_dataloader(_NO_BATCH_SIZE.format(owner=owner_label))
        size = getattr(loader, "batch_size", None)
        if size is None:
            size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
        if size is None:
            raise TargetError(f"target '{self.spec}': {_NO_BATCH_SIZE.format(owner=owner_label)}")
        return self._positive_int("the train DataLoader's batch_size", size)

    def tokens_per_sample(self) -> int | None:
        """Tokens in one sample (``tokens_per_sample`` of the model, else of the datamodule), or None if neither has it.

        Raises:
            TargetError: when the attribute is there but not a positive int.
        """
        for owner_name, owner in (("model", self.model), ("datamodule", self.datamodule)):
            value = getattr(owner, "tokens_per_sample", None) if owner is not None else None
            if value is not None:
                return self._positive_int(f"{owner_name}.tokens_per_sample", value)
        return None

    def _positive_int(self, where: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise TargetError(f"target '{self.spec}': {where} must be a positive int; got {value!r}")
        return value

    def _train_dataloader(self, failure: str) -> Any:
        owner: Any = self.datamodule if self.datamodule is not None else self.model
        try:
            if self.datamodule is not None:
                self.datamodule.setup("fit")  # what the Trainer does before asking for the loader
            return owner.train_dataloader()
        except Exception as error:
            raise TargetError(
                f"target '{self.spec}': {failure} ({type(owner).__name__}.train_dataloader() raised {_one_line(error)})"
            ) from error


def load_target(spec: str | os.PathLike[str] | None = None, *, config: str | os.PathLike[str] | None = None) -> Target:
    """Resolve ``spec`` (and an optional LightningCLI ``config``) into a model and its data, checked.

    Args:
        spec: ``path/to/file.py:factory``, ``package.module:factory`` or a LightningCLI config ``.yaml``; may be
            None when ``config`` is given.
        config: A LightningCLI config: the target itself when ``spec`` is None, else the source of ``trainer:``,
            ``seed_everything:``, ``optimizer:`` and ``lr_scheduler:`` for the factory's model.

    Returns:
        The Target, whose ``batch_size()`` is known to work.

    Raises:
        TargetError: one line naming the target and what is wrong, for each kind of malformed target.

    Example:
        >>> target = load_target("examples/gpt/train.py:make")
        >>> target.batch_size(), target.tokens_per_sample()
        (32, 32)
    """
    return target_factory(spec, config=config)()


def target_factory(
    spec: str | os.PathLike[str] | None = None, *, config: str | os.PathLike[str] | None = None
) -> Callable[[], Target]:
    """Check a target once and return a callable that builds a fresh Target (new model and data) on each call.

    The target is resolved and built once here, so every error surfaces now; that first build is what the first
    call returns, and later calls build anew (a search trial needs an untouched model).

    Args:
        spec: As for :func:`load_target`.
        config: As for :func:`load_target`.

    Returns:
        A callable taking no arguments and returning a new :class:`Target`.

    Raises:
        TargetError: as for :func:`load_target`.

    Example:
        >>> make = target_factory("examples/gpt/train.py:make")
        >>> make().model is not make().model
        True
    """
    build = _resolve(spec, config)
    first = build()
    first.batch_size()
    pending = [first]

    def make() -> Target:
        return pending.pop() if pending else build()

    return make


# --------------------------------------------------------------------------------------------------- resolution


def _resolve(spec: str | os.PathLike[str] | None, config: str | os.PathLike[str] | None) -> Callable[[], Target]:
    """Check everything that can be checked without building, and return the builder."""
    if spec is None or str(spec) == "":
        if config is None:
            raise TargetError(f"no target given: give {_ACCEPTED}")
        label = str(config)
        cli = _load_config(label, Path(label), with_model=True)
        return lambda: _build_from_config(label, cli)
    label = str(spec)
    if label.lower().endswith(_CONFIG_SUFFIXES):
        if config is not None and Path(config).resolve() != Path(label).resolve():
            raise TargetError(f"target '{label}' is a LightningCLI config and `config` names another, '{config}'; "
                              "give one of them")
        cli = _load_config(label, Path(label), with_model=True)
        return lambda: _build_from_config(label, cli)
    factory = _load_factory(label)
    cli = None if config is None else _load_config(label, Path(config), with_model=False)
    return lambda: _build_from_factory(label, factory, cli)


def _build_from_config(spec: str, cli: _CliConfig) -> Target:
    parts = _parts_from_config(spec, cli)
    _require_training_methods(spec, parts.model, config=True)
    return Target(spec=spec, model=parts.model, datamodule=parts.datamodule, trainer_config=parts.trainer_config,
                  seed=parts.seed)


@dataclass(frozen=True)
class _Factory:
    """A callable found in an imported module, and the folders its imports need on ``sys.path``."""

    name: str
    function: Callable[[], Any]
    folders: tuple[str, ...]


def _load_factory(spec: str) -> _Factory:
    location, _, name = spec.rpartition(":")
    if not location or not name:
        raise TargetError(f"target '{spec}' must be {_ACCEPTED}")
    cwd = os.getcwd()
    if location.endswith(".py") or "/" in location or os.sep in location or not _MODULE_NAME.match(location):
        path = Path(location)
        if not path.is_file():
            raise TargetError(f"target '{spec}': file '{location}' does not exist")
        if path.suffix != ".py":
            raise TargetError(f"target '{spec}': file '{location}' is not a .py file; {_ACCEPTED} are accepted")
        folders: tuple[str, ...] = (str(path.resolve().parent), cwd)
        module = _import_file(spec, path, folders)
        where = f"file '{location}'"
    else:
        folders = (cwd,)
        try:
            with on_sys_path(folders):
                module = importlib.import_module(location)
        except (Exception, SystemExit) as error:
            raise TargetError(f"target '{spec}': cannot import module '{location}': {_one_line(error)}") from error
        where = f"module '{location}'"
    if not hasattr(module, name):
        public = [n for n in vars(module) if not n.startswith("_")]
        close = difflib.get_close_matches(name, public, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise TargetError(f"target '{spec}': {where} has no attribute '{name}'{hint}")
    function = getattr(module, name)
    if not callable(function):
        raise TargetError(f"target '{spec}': '{name}' in {where} is not callable (it is a {type(function).__name__}); "
                          f"it must be a function returning {_FACTORY_RETURNS}")
    return _Factory(name=name, function=function, folders=folders)


def _import_file(spec: str, path: Path, folders: Sequence[str]) -> types.ModuleType:
    """Import ``path`` under a name unique to its resolved location (never ``__main__``)."""
    resolved = path.resolve()
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:12]
    name = f"_autotune_target_{re.sub(r'[^0-9A-Za-z_]', '_', resolved.stem)}_{digest}"
    module_spec = importlib.util.spec_from_file_location(name, resolved)
    if module_spec is None or module_spec.loader is None:
        raise TargetError(f"target '{spec}': cannot import file '{path}' as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses, pickling and typing look classes up here
    try:
        with on_sys_path(folders):
            module_spec.loader.exec_module(module)
    except SystemExit as error:
        del sys.modules[name]
        raise TargetError(f"target '{spec}': file '{path}' exited while being imported ({_one_line(error)}); "
                          "put its script code under `if __name__ == \"__main__\":`") from error
    except Exception as error:
        del sys.modules[name]
        raise TargetError(f"target '{spec}': cannot import file '{path}': {_one_line(error)}") from error
    return module


def _build_from_factory(spec: str, factory: _Factory, cli: _CliConfig | None) -> Target:
    from lightning.pytorch import LightningDataModule, LightningModule

    seed = None if cli is None else cli.seed
    _seed(seed)
    try:
        with on_sys_path(factory.folders):
            result = factory.function()
    except Exception as error:
        from autotune._target.failure import TargetCodeError, failure_lines

        refused = TargetError(f"target '{spec}': {factory.name}() raised {_one_line(error)}")
        refused.__cause__ = error
        raise TargetCodeError(failure_lines(refused, spec=spec) or [str(refused)]) from error
    except SystemExit as error:  # a factory that ends the process (argparse inside it, sys.exit) ends only itself
        raise TargetError(f"target '{spec}': {factory.name}() called sys.exit({error.code!r}); a factory returns "
                          "a LightningModule or (LightningModule, LightningDataModule)") from None
    if isinstance(result, LightningModule):
        model, datamodule = result, None
    elif (isinstance(result, (tuple, list)) and len(result) == 2 and isinstance(result[0], LightningModule)
          and (result[1] is None or isinstance(result[1], LightningDataModule))):
        model, datamodule = result
    else:
        raise TargetError(
            f"target '{spec}': {factory.name}() returned {_describe(result)}; expected {_FACTORY_RETURNS}"
        )
    if datamodule is None:
        _require_train_dataloader(spec, model, f"{factory.name}() returned a {type(model).__name__} without a "
                                  "LightningDataModule", "return (model, datamodule)")
    trainer_config: dict[str, Any] = {}
    if cli is not None:
        _install_optimizers(model, cli)
        trainer_config = copy.deepcopy(cli.trainer)
    _require_training_methods(spec, model, config=cli is not None)
    return Target(spec=spec, model=model, datamodule=datamodule, trainer_config=trainer_config, seed=seed)


# ---------------------------------------------------------------------------------------------------- helpers


def _require_training_methods(spec: str, model: LightningModule, *, config: bool) -> None:
    """Refuse, as Lightning's Trainer (or ElasticBatchSize) would at its first step, a module without
    ``training_step`` or ``configure_optimizers`` (a config's ``optimizer:`` section installs one), or with manual
    optimization, naming the class and its file."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    missing = [name for name in ("training_step", "configure_optimizers") if not is_overridden(name, model)]
    manual = not getattr(model, "automatic_optimization", True)
    if not missing and not manual:
        return
    cls, where = type(model), ""
    with contextlib.suppress(TypeError, OSError):
        cls_file, cls_line = inspect.getsourcefile(cls), inspect.getsourcelines(cls)[1]
        where = f" ({os.path.relpath(cls_file) if cls_file else '?'}:{cls_line})"
    if not missing:
        raise TargetError(f"target '{spec}': {cls.__name__}{where} sets automatic_optimization = False; autotune's "
                          "runtime (ElasticBatchSize) splits the steps of automatic optimization only")
    fixes = {"training_step": "define training_step(batch, batch_idx) returning the loss",
             "configure_optimizers": "define configure_optimizers() returning an optimizer" + (
                 ", or give the config an `optimizer:` section" if config else
                 ", or give --config a LightningCLI config with an `optimizer:` section")}
    raise TargetError(f"target '{spec}': {cls.__name__}{where} does not define "
                      f"{' or '.join(f'{m}()' for m in missing)}, which Lightning's Trainer needs to train: "
                      + "; ".join(fixes[m] for m in missing))


def _describe(value: Any) -> str:
    """``int``, or ``(GPT, int)`` for a tuple: the types a factory returned."""
    if isinstance(value, (tuple, list)):
        inner = ", ".join(type(item).__name__ for item in value)
        return f"({inner})" if isinstance(value, tuple) else f"[{inner}]"
    return type(value).__name__
