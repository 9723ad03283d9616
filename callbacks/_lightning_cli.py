"""Report each bad value of our callbacks or of a tuned file under LightningCLI in one line.

This replaces jsonargparse's usage text or a traceback, under any jsonargparse CLI. jsonargparse refuses a value it
cannot type-check (``precision: bf17-mixed``, a misspelt key, ``grow: maybe``) by printing the parser's whole usage
(dozens of lines for a ``Trainer``) and a nested report of the union it tried. A value our constructor refuses
(``micro_batch_size: 0``, ``budget: -1GiB``) surfaces as a long traceback. Either way the sentence that says what is
wrong sits in the middle. A type annotation cannot fix that: whatever refuses at parse time, jsonargparse prints its
usage first, and the Trainer's own arguments and the keys of a class are checked before any of our code runs.

So :func:`install` adds two narrow handlers. It runs when ``autotune.callbacks`` is imported, which jsonargparse
does when it resolves one of our class paths (a tuned file lists its callbacks first for that reason). The handlers:

- **A parse error**: a config file named on the command line (``--config``/``-c``) may be a tuned file that
  ``load_plan`` refuses, or hold an entry of our callbacks whose constructor refuses its ``init_args``. Those
  problems are printed, ``error: FILE: KEY: what is wrong`` one a line, with jsonargparse's exit status 2.
- **An uncaught ``ValueError`` from one of our constructors called by jsonargparse**: the same problems where the
  command line's files show them, else ``error: ClassName: sentence``; exit status 1, as for any uncaught error.

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
from autotune._plan.tuned import TUNED_HEADER, callback_entries, safe_load_unique

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


def config_problems(argv: Sequence[str], classes: Sequence[type]) -> list[str]:
    """The problems, one line each with file and key, of the tuned files and of the entries of ``classes`` in the
    config files named in ``argv``; empty when they show none (or cannot be read: jsonargparse then reports them)."""
    problems: list[str] = []
    for path in config_paths(argv):
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError):  # jsonargparse's to report, as before
            continue
        if text.startswith(TUNED_HEADER):
            try:
                load_plan(path)
            except ValueError as err:
                lines = str(err).splitlines()
                problems += [line if line.startswith(f"{path}: ") else f"{path}: {line}" for line in lines]
                continue  # its entries' problems are in these lines already
        try:
            doc = safe_load_unique(text)
        except yaml.YAMLError:  # jsonargparse's to report, as before
            continue
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


def _through_jsonargparse(tb: TracebackType | None) -> bool:
    """Whether a traceback passes through jsonargparse (its instantiation of a config's classes)."""
    while tb is not None:
        if str(tb.tb_frame.f_globals.get("__name__", "")).startswith("jsonargparse"):
            return True
        tb = tb.tb_next
    return False


def _excepthook(previous: Callable[..., Any], classes: Sequence[type]) -> Callable[..., Any]:
    constructors = {cls.__init__.__code__: cls.__name__ for cls in classes}

    def excepthook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> Any:
        refused = _refusal(error, constructors)
        if refused is None or not _through_jsonargparse(tb):
            return previous(kind, error, tb)
        name, cause = refused
        lines = _problems_or_none(classes) or [f"{name}: {_one_line(cause)}"]
        sys.stderr.write(_report(lines))
        return None

    excepthook.autotune_previous = previous  # type: ignore[attr-defined]
    return excepthook


def _problems_or_none(classes: Sequence[type]) -> list[str] | None:
    """:func:`config_problems` of this command line; None where reading them fails in a way not foreseen (the error
    being reported is then shown as it would have been, not hidden behind one of ours)."""
    try:
        return config_problems(sys.argv[1:], classes)
    except Exception:  # noqa: BLE001 - see the docstring
        return None


def _parse_error(original: Callable[..., Any], classes: Sequence[type]) -> Callable[..., Any]:
    def error(self: Any, *args: Any, **kwargs: Any) -> Any:
        # exit_on_error=False (a parser used as a library: autotune's own target reader) and jsonargparse's debug
        # mode want the exception: left to jsonargparse
        if getattr(self, "exit_on_error", False) and "JSONARGPARSE_DEBUG" not in os.environ:
            problems = _problems_or_none(classes)
            if problems:
                self.exit(2, _report(problems))
        return original(self, *args, **kwargs)

    error.autotune_original = original  # type: ignore[attr-defined]
    return error


def install(classes: Sequence[type]) -> None:
    """Add the two handlers of this module for ``classes`` (once per process; a later call does nothing).

    The parse-error handler wraps ``jsonargparse.ArgumentParser.error``, the public method every parse error of
    jsonargparse goes through (if jsonargparse stopped routing errors through it, its own report would show again:
    ``tests/callbacks/test_lightning_cli.py`` fails). The other wraps ``sys.excepthook``, which Python calls only
    for an exception nobody caught.
    """
    if not hasattr(sys.excepthook, "autotune_previous"):
        sys.excepthook = _excepthook(sys.excepthook, classes)
    try:
        from jsonargparse import ArgumentParser
    except ImportError:  # no jsonargparse, no LightningCLI
        return
    if not hasattr(ArgumentParser.error, "autotune_original"):
        ArgumentParser.error = _parse_error(ArgumentParser.error, classes)  # type: ignore[method-assign]
