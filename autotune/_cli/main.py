"""The ``autotune`` command line: one parser builder and one action per subcommand, listed in ``_SUBCOMMANDS``."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, NoReturn

from autotune._version import __version__
from autotune._cli import estimate as _cli_estimate
from autotune._cli import search as _cli_search
from autotune._cli import speed as _cli_speed
from autotune._device.budget import format_bytes

if TYPE_CHECKING:
    from autotune._device.probe import MemoryProbe

__all__ = ["main"]

_PROG = "autotune"
_EXIT_OK = 0
_EXIT_USAGE = 2
_EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it


@dataclass(frozen=True, kw_only=True)
class _Subcommand:
    """One subcommand: ``build`` adds its arguments to its parser, ``action`` runs it and returns the exit code."""

    name: str
    help: str
    build: Callable[[argparse.ArgumentParser], None]
    action: Callable[[argparse.Namespace], int]


# ---------------------------------------------------------------------------------------------------------- probe


def _build_probe(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        default=None,
        help="'cpu', 'cuda', 'cuda:N' or N (default: the current CUDA device, or 'cpu' without CUDA)",
    )
    parser.add_argument("--json", action="store_true", help="print the reading as JSON, with bytes as integers")


def _run_probe(args: argparse.Namespace) -> int:
    from autotune._device.probe import probe_memory

    device: str | int | None = args.device
    if isinstance(device, str) and device.isdigit():
        device = int(device)  # `--device 1` means cuda:1, as for torch.cuda
    probe = probe_memory(device)
    print(json.dumps(probe.as_dict(), indent=2) if args.json else format_probe_table(probe))
    return _EXIT_OK


def format_probe_table(probe: MemoryProbe) -> str:
    """A two-column table of a probe, with byte fields in human units.

    Args:
        probe: The reading to show.

    Returns:
        One line per field, the labels left-aligned; no trailing newline.

    Example:
        >>> print(format_probe_table(probe_memory(device="cpu")))  # doctest: +SKIP
        device                  cpu
        name                    AMD EPYC
        total                   62.79 GiB
        ...
    """
    rows: list[tuple[str, str]] = []
    for item in fields(probe):
        value = getattr(probe, item.name)
        if item.name.endswith("_bytes"):
            rows.append((item.name.removesuffix("_bytes").replace("_", " "), format_bytes(value)))
        else:
            rows.append((item.name.replace("_", " "), str(value)))
    width = max(len(label) for label, _ in rows) + 2
    return "\n".join(f"{label:<{width}}{value}" for label, value in rows)


# --------------------------------------------------------------------------------------------------------- parser

_SUBCOMMANDS: tuple[_Subcommand, ...] = (
    _Subcommand(
        name="probe",
        help="show a device's total and free memory, this process's use and other processes' use",
        build=_build_probe,
        action=_run_probe,
    ),
    _Subcommand(
        name="estimate",
        help="predict the peak memory of a training step for plans, and the largest micro-batch that fits a budget",
        build=_cli_estimate.build_estimate,
        action=_cli_estimate.run_estimate,
    ),
    _Subcommand(
        name="suggest",
        help="write a tuned file from the models alone (no trial): the plan predicted fastest of those predicted to "
        "fit, for this machine or a --device-type",
        build=_cli_speed.build_suggest,
        action=_cli_speed.run_suggest,
    ),
    _Subcommand(
        name="search",
        help="search the plan space for the fastest plan that fits the budget, and write it as a tuned file",
        build=_cli_search.build_search,
        action=_cli_search.run_search,
    ),
    _Subcommand(
        name="report",
        help="print a search's trials and write its plots (throughput vs memory, history, importance)",
        build=_cli_search.build_report,
        action=_cli_search.run_report,
    ),
)


def build_parser() -> argparse.ArgumentParser:
    """The ``autotune`` argument parser, with one subparser per entry of ``_SUBCOMMANDS``.

    Returns:
        The parser; a parsed namespace carries the chosen subcommand's action as ``action``.

    Example:
        >>> build_parser().parse_args(["probe", "--json"]).json
        True
    """
    parser = _Parser(
        prog=_PROG, description="Memory-elastic auto-tuning for PyTorch Lightning: probe, estimate and search."
    )
    parser.add_argument("--version", action="version", version=f"{_PROG} {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for subcommand in _SUBCOMMANDS:
        subparser = subparsers.add_parser(subcommand.name, help=subcommand.help, description=subcommand.help)
        subcommand.build(subparser)
        subparser.set_defaults(action=subcommand.action)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``autotune`` command line.

    Args:
        argv: The arguments after the program name; ``None`` reads ``sys.argv[1:]``.

    Returns:
        The exit code: 0 on success, 2 on a usage error (bad arguments, no subcommand, a ``ValueError`` raised for a
        bad value or a setting Lightning refuses (``MisconfigurationException``), shown as ``autotune: error:
        <message>`` on stderr in one line without a traceback; the target's own code failing: a few lines naming the
        exception and the user's frames), 130 on Ctrl-C (one line).

    Example:
        >>> main(["probe", "--device", "cpu", "--json"])  # doctest: +SKIP
        0
    """
    parser = build_parser()
    try:
        args = parser.parse_args(_attach_dash_values(sys.argv[1:] if argv is None else argv))
    except SystemExit as exc:  # argparse exits on --help, --version and bad arguments; return its code instead
        return exc.code if isinstance(exc.code, int) else _EXIT_USAGE
    if args.command is None:
        parser.print_help(sys.stderr)
        return _EXIT_USAGE
    try:
        return args.action(args)
    except Exception as exc:
        if not isinstance(exc, ValueError) and not _is_configuration_error(exc):
            raise  # our bug: its traceback
        # one line, whatever the message holds; the target's own failure: its lines (what failed, the user's frames)
        lines = getattr(exc, "lines", None) or [" ".join(str(exc).split())]
        print("\n".join([f"{_PROG}: error: {lines[0]}", *lines[1:]]), file=sys.stderr)
        return _EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{_PROG}: interrupted" + (_interrupted_search(args) if args.command == "search" else ""),
              file=sys.stderr)
        return _EXIT_INTERRUPTED


def _is_configuration_error(exc: BaseException) -> bool:
    """Lightning's ``MisconfigurationException`` (a setting Lightning refuses: the user's, as a ``ValueError`` is),
    told without importing Lightning."""
    module = sys.modules.get("lightning.fabric.utilities.exceptions")
    return module is not None and isinstance(exc, module.MisconfigurationException)


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line: the bad value with what is accepted, and where to read the rest
    (argparse prints its usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(_EXIT_USAGE, f"{_PROG}: error: {message}; see {self.prog} --help\n")


def _attach_dash_values(argv: Sequence[str]) -> list[str]:
    """``--budget -1GiB`` as ``--budget=-1GiB``, so that our own check of the value names what is wrong with it.

    argparse reads a token that starts with '-' and is not a plain number as an option, and answers "expected one
    argument"; no option of ours starts with '-' and a digit, so such a token after an option is that option's value.

    Example:
        >>> _attach_dash_values(["search", "t.py:make", "--budget", "-1GiB", "--trials", "3"])
        ['search', 't.py:make', '--budget=-1GiB', '--trials', '3']
    """
    joined: list[str] = []
    for arg in argv:
        if joined and joined[-1].startswith("--") and "=" not in joined[-1] and _DASH_VALUE.match(arg):
            joined[-1] = f"{joined[-1]}={arg}"
        else:
            joined.append(arg)
    return joined


_DASH_VALUE = re.compile(r"-\.?\d")


def _interrupted_search(args: argparse.Namespace) -> str:
    """What an interrupted search leaves: its study, unless it was stopped before the study's file was made."""
    import os

    from autotune._search.storage import storage_file

    path = storage_file(args.storage)
    if path is not None and not os.path.exists(path):
        return " before the study was created; nothing was written"
    return "; the study is kept, and the same command resumes it (the interrupted trial runs again)"
