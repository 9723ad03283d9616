"""Report each bad value of our callbacks or of a tuned file, and our callbacks' setup checks, under LightningCLI in one
line.

This replaces jsonargparse's usage text or a traceback, under any jsonargparse CLI. jsonargparse refuses a value it
cannot type-check (``precision: bf17-mixed``, a misspelt key, ``grow: maybe``) by printing the parser's whole usage
(dozens of lines for a ``Trainer``) and a nested report of the union it tried. A value our constructor refuses
(``micro_batch_size: 0``, ``budget: -1GiB``) surfaces as a long traceback. Either way the sentence that says what is
wrong sits in the middle. A type annotation cannot fix that: whatever refuses at parse time, jsonargparse prints its
usage first, and the Trainer's own arguments and the keys of a class are checked before any of our code runs.

So :func:`install` adds three narrow handlers. It runs when ``autotune.callbacks`` is imported, which jsonargparse
does when it resolves one of our class paths (a tuned file lists its callbacks first for that reason). The handlers:

- **A parse error**: a config file named on the command line (``--config``/``-c``) may be a tuned file that
  ``load_plan`` refuses, hold an entry of our callbacks whose constructor refuses its ``init_args``, or a top-level
  key the command does not take (``trainr:``, named with the nearest one). Those problems are printed, ``error: FILE:
  KEY: what is wrong`` one a line, with jsonargparse's exit status 2.
- **Before the classes are built** (``instantiate``): a tuned file that parsed but ``load_plan`` refuses (cut
  short, its ``precision:`` lost; ``accumulate_grad_batches: 4``), the same way, exit status 2.
- **An uncaught error**: a ``ValueError`` from one of our constructors called by jsonargparse (the same problems where
  the command line's files show them, else ``error: ClassName: sentence``), or one of our callbacks' setup checks
  refusing the run under LightningCLI (``MisconfigurationException``: ``accumulate_grad_batches=4``, a strategy it does
  not support; ``error: sentence``); exit status 1, as for any uncaught error.

Everything else is left to jsonargparse and Python as before; in plain Python a constructor's ``ValueError`` is raised
and shown exactly as it always was. Printing here is a CLI's error report (it replaces jsonargparse's and Python's),
not library output.
"""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from autotune._plan.plan import load_plan
from autotune._plan.config_text import callback_entries, did_you_mean, safe_load_unique
from autotune._plan.tuned import TUNED_HEADER

_CONFIG_OPTIONS = ("--config", "-c")


def config_paths(argv: Sequence[str]) -> list[Path]:
    """The config files named on a LightningCLI command line (``--config F``, ``--config=F``, ``-c F``), in order.

    Example:
        >>> [str(p) for p in config_paths(["fit", "-c", "a.yaml", "--config=b.yaml", "--trainer.max_steps=3"])]
        ['a.yaml', 'b.yaml']
    """
    paths = []
    for i, arg in enumerate(argv):
        if arg in _CONFIG_OPTIONS and i + 1 < len(argv):
            paths.append(Path(argv[i + 1]))
        elif arg.startswith("--config="):
            paths.append(Path(arg.partition("=")[2]))
    return paths


def config_problems(argv: Sequence[str], classes: Sequence[type], *, keys: Sequence[str] | None = None,
                    tuned_only: bool = False, paths: Sequence[Path] | None = None) -> list[str]:
    """The problems, one line each with file and key, of the tuned files and of the entries of ``classes`` in the
    config files named in ``argv`` (or ``paths``), and their top-level keys not among ``keys`` (the command's, with the
    nearest one); empty when they show none (or cannot be read: jsonargparse then reports them). ``tuned_only``: the
    tuned files' problems alone."""
    problems: list[str] = []
    for path in config_paths(argv) if paths is None else paths:
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError):  # jsonargparse's to report, as before
            continue
        tuned = text.startswith(TUNED_HEADER)
        if tuned:
            try:
                load_plan(path)
            except ValueError as err:
                lines = str(err).splitlines()
                problems += [line if line.startswith(f"{path}: ") else f"{path}: {line}" for line in lines]
                continue  # its entries' and keys' problems are in these lines already
        elif tuned_only:
            continue
        try:
            doc = safe_load_unique(text)
        except yaml.YAMLError:  # jsonargparse's to report, as before
            continue
        if keys is not None and isinstance(doc, dict) and not tuned:  # (a tuned file's: load_plan's)
            problems += [f"{path}: {key}: not a key of this command's config{did_you_mean(key, keys)} (its keys: "
                         f"{', '.join(keys)})" for key in doc if key not in keys]
        problems += [f"{path}: {problem}" for problem in _entry_problems(doc, classes)]
    return problems


def _entry_problems(doc: Any, classes: Sequence[type]) -> list[str]:
    """What the constructors of ``classes`` refuse among the ``trainer.callbacks`` entries of a config document."""
    by_path = {}
    for cls in classes:
        by_path[f"{cls.__module__}.{cls.__name__}"] = by_path[f"autotune.callbacks.{cls.__name__}"] = cls
    problems = []
    for key, class_path, init_args in callback_entries(doc):
        cls = by_path.get(class_path)
        if cls is None or not isinstance(init_args, dict):
            continue
        parameters = inspect.signature(cls).parameters
        unknown = [name for name in init_args if name not in parameters]
        problems += [f"{key}.init_args.{name}: not an argument of {cls.__name__} (its arguments: "
                     f"{', '.join(parameters)})" for name in unknown]
        if unknown:
            continue
        # a string for a function argument is an import path that jsonargparse resolves: not ours to check here
        checked = {name: value for name, value in init_args.items()
                   if not (isinstance(value, str) and "Callable" in str(parameters[name].annotation))}
        try:
            cls(**checked)
        except ValueError as err:
            problems.append(f"{key}.init_args: {_one_line(err)}")
    return problems


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())


def _report(lines: Sequence[str]) -> str:
    return "".join(f"error: {line}\n" for line in lines)


# ---------------------------------------------------------------------------------------------------- the handlers


def _refusal(error: BaseException | None, constructors: dict[Any, str]) -> tuple[str, BaseException] | None:
    """The class name and the ``ValueError`` raised inside one of ``constructors`` (code objects of ``__init__``)
    in the chain of ``error`` (its causes and contexts), or None."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, ValueError):
            for code in _codes(error.__traceback__):
                if code in constructors:
                    return constructors[code], error
        error = error.__cause__ or error.__context__
    return None


def _codes(tb: TracebackType | None) -> Iterator[Any]:
    while tb is not None:
        yield tb.tb_frame.f_code
        tb = tb.tb_next


def _through(tb: TracebackType | None, package: str) -> bool:
    """Whether a traceback passes through ``package`` (jsonargparse's instantiation of a config's classes,
    LightningCLI's run of a subcommand)."""
    while tb is not None:
        if str(tb.tb_frame.f_globals.get("__name__", "")).startswith(package):
            return True
        tb = tb.tb_next
    return False


def _our_check(error: BaseException) -> bool:
    """Whether ``error`` is one of our callbacks' setup checks refusing the run (``callbacks/_checks.py``,
    ``ApplyPlan``'s and ``ElasticBatchSize``'s own): a ``MisconfigurationException`` or ``ValueError`` raised in our
    code itself (an error raised deeper, in torch or Lightning, is not a check: its traceback stays)."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    name = str(tb.tb_frame.f_globals.get("__name__", "")) if tb is not None else ""
    return isinstance(error, (MisconfigurationException, ValueError)) and name.startswith("autotune.")


def _excepthook(previous: Callable[..., Any], classes: Sequence[type]) -> Callable[..., Any]:
    constructors = {cls.__init__.__code__: cls.__name__ for cls in classes}

    def excepthook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> Any:
        if _our_check(error) and _through(tb, "lightning.pytorch.cli"):  # a setup check of ours, under LightningCLI
            sys.stderr.write(_report([_one_line(error)]))
            return None
        refused = _refusal(error, constructors)
        if refused is None or not _through(tb, "jsonargparse"):
            return previous(kind, error, tb)
        name, cause = refused
        lines = _problems_or_none(classes) or [f"{name}: {_one_line(cause)}"]
        sys.stderr.write(_report(lines))
        return None

    excepthook.autotune_previous = previous  # type: ignore[attr-defined]
    return excepthook


def _problems_or_none(classes: Sequence[type], parser: Any = None, **kwargs: Any) -> list[str] | None:
    """:func:`config_problems` of this command line (the top-level keys checked against ``parser``'s); None where
    reading them fails in a way not foreseen (the error being reported is then shown as it would have been, not hidden
    behind one of ours)."""
    try:
        return config_problems(sys.argv[1:], classes, keys=_config_keys(parser), **kwargs)
    except Exception:  # noqa: BLE001 - see the docstring
        return None


def _config_keys(parser: Any) -> list[str] | None:
    """The top-level keys a config file may have for ``parser`` (with subcommands: the one on the command line's, else
    any subcommand's and their names); None when they cannot be told."""
    if parser is None:
        return None
    from autotune._compat.lightning import subcommand_parsers

    try:
        subcommands = subcommand_parsers(parser)
        named = [subcommands[arg] for arg in sys.argv[1:] if arg in subcommands][:1]
        parsers = named or [parser, *subcommands.values()]
        keys = {str(key).split(".")[0] for p in parsers for key in p.get_defaults().keys()} | (
            set() if named else set(subcommands))
    except Exception:  # noqa: BLE001 - jsonargparse's internals: without them, no keys are checked
        return None
    return sorted(keys - {"subcommand", "__default_config__"})


def _parsed_config_paths(cfg: Any) -> list[Path]:
    """The config files a parsed LightningCLI namespace was read from (``--config``, at the top or a subcommand's)."""
    paths = []
    for key in ("config", f"{cfg.get('subcommand')}.config"):
        for value in cfg.get(key) or []:
            paths.append(Path(getattr(value, "relative", None) or str(value)))  # as given, as argv's
    return paths


def _parse_error(original: Callable[..., Any], classes: Sequence[type]) -> Callable[..., Any]:
    def error(self: Any, *args: Any, **kwargs: Any) -> Any:
        # exit_on_error=False (a parser used as a library: autotune's own target reader) and jsonargparse's debug
        # mode want the exception: left to jsonargparse
        if getattr(self, "exit_on_error", False) and "JSONARGPARSE_DEBUG" not in os.environ:
            problems = _problems_or_none(classes, self)
            if problems:
                self.exit(2, _report(problems))
        return original(self, *args, **kwargs)

    error.autotune_original = original  # type: ignore[attr-defined]
    return error


def _checked_instantiation(original: Callable[..., Any], classes: Sequence[type]) -> Callable[..., Any]:
    def instantiate(self: Any, cfg: Any, *args: Any, **kwargs: Any) -> Any:
        # a tuned file that parsed but is not whole (cut short: its precision lost) or refused by load_plan: said
        # before anything is built, as a parse error is
        if getattr(self, "exit_on_error", False) and "JSONARGPARSE_DEBUG" not in os.environ:
            try:
                problems = config_problems((), classes, tuned_only=True, paths=_parsed_config_paths(cfg))
            except Exception:  # noqa: BLE001 - as _problems_or_none: not foreseen, not ours to hide
                problems = []
            if problems:
                self.exit(2, _report(problems))
        return original(self, cfg, *args, **kwargs)

    instantiate.autotune_original = original  # type: ignore[attr-defined]
    return instantiate


def install(classes: Sequence[type]) -> None:
    """Add the three handlers of this module for ``classes`` (once per process; a later call does nothing).

    The parse-error handler wraps ``jsonargparse.ArgumentParser.error``, the public method every parse error of
    jsonargparse goes through, and the tuned files' check ``ArgumentParser.instantiate`` (``instantiate_classes``
    before jsonargparse 4.49), which LightningCLI reaches once it has parsed (if jsonargparse stopped routing through them, its own report would show again:
    ``tests/callbacks/test_lightning_cli.py`` fails). The last wraps ``sys.excepthook``, which Python calls only for
    an exception nobody caught.
    """
    if not hasattr(sys.excepthook, "autotune_previous"):
        sys.excepthook = _excepthook(sys.excepthook, classes)
    try:
        from jsonargparse import ArgumentParser
    except ImportError:  # no jsonargparse, no LightningCLI
        return
    if not hasattr(ArgumentParser.error, "autotune_original"):
        ArgumentParser.error = _parse_error(ArgumentParser.error, classes)  # type: ignore[method-assign]
    # ``instantiate`` (jsonargparse >= 4.49: its deprecated ``instantiate_classes``, which LightningCLI calls, goes
    # through it), else ``instantiate_classes``
    name = "instantiate" if hasattr(ArgumentParser, "instantiate") else "instantiate_classes"
    if not hasattr(getattr(ArgumentParser, name), "autotune_original"):
        setattr(ArgumentParser, name, _checked_instantiation(getattr(ArgumentParser, name), classes))
