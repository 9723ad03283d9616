"""The CLI's speed side: ``--device-type`` (a device of the table, need not be here), the speed columns and ranking
of ``autotune estimate``, and ``autotune suggest`` (a tuned file from the step-time model alone, marked predicted)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from autotune._device.budget import format_bytes

__all__ = ["add_device_type", "build_suggest", "device_options", "ranked", "run_suggest", "speed_cells", "speed_notes"]


def add_device_type(parser: argparse.ArgumentParser) -> None:
    """``--device-type``: predict speed on a device of the table (its memory the default ``--device-memory``)."""
    from autotune._estimate.devices import ALIASES, KNOWN_DEVICES

    parser.add_argument("--device-type", default=None, metavar="TYPE",
                        help="predict speed (and memory, what-if where it is not here) on this GPU: "
                        f"{', '.join([*KNOWN_DEVICES, *ALIASES])} (default: this machine's device, measured once)")


def device_options(device: str | None, device_type: str | None,
                   memory: int | None) -> tuple[str | int | None, Any, int | None]:
    """The device to trace for, its table entry (None: this machine's, measured later) and its memory: a
    ``--device-type`` is a CUDA device (``--device`` must not say otherwise) whose memory defaults to the table's.

    Raises:
        ValueError: for an unknown type (one line listing the known) or a type with ``--device cpu``.
    """
    parsed: str | int | None = int(device) if device and device.isdigit() else device
    if device_type is None:
        return parsed, None, memory
    from autotune._estimate.devices import device_type as table_device

    entry = table_device(device_type)
    if parsed is not None and not (isinstance(parsed, int) or str(parsed).startswith("cuda")):
        raise ValueError(f"--device-type {device_type!r} is a GPU; it cannot be combined with --device {device!r}")
    return (parsed if parsed is not None else "cuda"), entry, memory if memory is not None else entry.memory_bytes


def ranked(rows: Sequence[Any]) -> list[Any]:
    """Rows that fit with a predicted speed first, the fastest first; then the others in their order."""
    fast = sorted((r for r in rows if r.fits and r.speed is not None), key=lambda r: -r.speed.samples_per_second)
    return fast + [r for r in rows if r not in fast]


def speed_cells(row: Any) -> tuple[str, str, str]:
    """The row's samples/s (``@ micro`` when predicted at the largest micro-batch that fits), MFU and bound."""
    speed = row.speed
    if speed is None:
        return "-", "-", "-"
    at = "" if speed.plan.micro_batch_size == row.estimate.micro_batch_size else f" @{speed.plan.micro_batch_size}"
    return (f"{speed.samples_per_second:,.1f}{at}", "-" if speed.mfu is None else f"{speed.mfu:.0%}", speed.bound)


def speed_notes(rows: Sequence[Any], device_speed: Any, *, what_if: bool) -> list[str]:
    """What the speed columns are, or why there are none."""
    if device_speed is None:
        return ["no speed: this device is not on this machine; name its kind with --device-type (h100, a100, l4, ...)"
                if what_if else "no speed: the estimator could not predict it"] if rows else []
    origin = ("measured on this machine (once, cached)" if device_speed.measured
              else f"datasheet figures ({device_speed.source})")
    first = next((r.speed for r in rows if r.speed is not None), None)
    ranks = f", per step on {first.world_size} ranks" if first is not None and first.world_size > 1 else ""
    return [f"samples/s, MFU and bound: predicted from the traced step on {device_speed.name}, {origin}{ranks}; not "
            "measured and not calibrated (a search calibrates with its trials): rows that fit ranked fastest first; "
            "'@N': at micro-batch N, the largest that fits"]


# -------------------------------------------------------------------------------------------------------- suggest


def build_suggest(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", nargs="?", default=None, metavar="TARGET",
                        help="path/to/file.py:factory, package.module:factory, or a LightningCLI config")
    parser.add_argument("--budget", default=None,
                        help="memory budget per rank: 20GiB, 0.8 (of the device), auto (default with --device-type "
                        "or --device-memory: the device's memory less the CUDA context)")
    parser.add_argument("--config", default=None, help="a LightningCLI config with the rest of a factory target")
    parser.add_argument("--space", default=None,
                        help="a shipped space (default, cpu, multi_gpu) or a YAML path (default: cpu on the CPU, "
                        "default on a GPU, multi_gpu with --devices > 1)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:N or N (default: cuda with --device-type or "
                        "when there is one)")
    add_device_type(parser)
    parser.add_argument("--device-memory", default=None, metavar="SIZE",
                        help="the memory of each device (default with --device-type: the table's)")
    parser.add_argument("--devices", default="1", metavar="N", help="ranks per run (DDP, FSDP2; default 1)")
    parser.add_argument("--out", default="tuned.yaml", help="where to write the tuned file (default tuned.yaml)")
    parser.add_argument("--top", default="5", metavar="N", help="how many of the best predicted plans to list")
    parser.add_argument("--json", action="store_true", help="print the ranked plans as JSON")


def run_suggest(args: argparse.Namespace) -> int:
    """Rank the space's plans predicted to fit by predicted speed and write the fastest as a tuned file."""
    from autotune._cli.options import int_option, size_option
    from autotune._device.budget import Budget

    memory = size_option("--device-memory", args.device_memory)
    devices = int_option("--devices", args.devices, "an int >= 1")
    top = int_option("--top", args.top, "a positive int")
    device, entry, memory = device_options(args.device, args.device_type, memory)
    if args.budget is None and memory is None:
        raise ValueError("give --budget (20GiB, 0.8, auto), --device-memory (80GiB) or --device-type")
    budget = Budget.parse(args.budget) if args.budget is not None else None
    if args.target is None and args.config is None:
        raise ValueError("give a TARGET (path/to/file.py:factory, package.module:factory, or a LightningCLI config) "
                         "or --config")
    from autotune._search.suggest import suggest

    command = " ".join(["autotune", *(sys.argv[1:] if sys.argv[1:2] == ["suggest"] else ["suggest"])])
    result = suggest(target=args.target or args.config, config=args.config if args.target else None,
                     budget=budget, device=device, device_speed=entry, device_memory=memory, space=args.space,
                     devices=devices or 1, out=args.out, top=top or 5, command=command)
    if args.json:
        print(json.dumps({"out": str(args.out), "plans": [r.as_dict() for r in result.ranked]}, indent=2))
        return 0
    head = (f"{result.device_name}{' (what-if)' if result.what_if else ''}, batch {result.batch_size} per rank"
            f"{f' on {devices} ranks' if devices and devices > 1 else ''}, budget {format_bytes(result.budget_bytes)}")
    table = [("plan", "samples/s", "MFU", "bound", "predicted peak")]
    for row in result.ranked:
        s = row.speed
        table.append((row.plan.describe(), f"{s.samples_per_second:,.1f}", "-" if s.mfu is None else f"{s.mfu:.0%}",
                      s.bound, "-" if row.peak_bytes is None else format_bytes(row.peak_bytes)))
    widths = [max(len(line[i]) for line in table) for i in range(5)]
    lines = [f"{a:<{widths[0]}}  {b:>{widths[1]}}  {c:>{widths[2]}}  {d:<{widths[3]}}  {e:>{widths[4]}}".rstrip()
             for a, b, c, d, e in table]
    print("\n".join([head, *lines, f"wrote {args.out}: {result.ranked[0].plan.describe()} (predicted, not measured: "
                     "`autotune search` measures)", f"how sure: {result.sureness}",
                     *(f"note: {n}" for n in result.notes)]))
    return 0
