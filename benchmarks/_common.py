"""What every benchmark script shares: paths, the machine description, argument parsing, Markdown tables, fresh
processes and the process's resident set.

Private to ``benchmarks/``: each script imports it as a sibling (``from _common import ...``). A script run as
``python benchmarks/<name>.py`` has ``benchmarks/`` on ``sys.path`` already; :func:`use_paths` adds it (and the
repository root, and ``examples/gpt`` where asked) for a script loaded by path some other way. Nothing here
imports a private module of ``autotune``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib.metadata
import json
import logging
import multiprocessing
import os
import platform
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

#: The repository root, the example GPT's folder and this folder.
ROOT = Path(__file__).resolve().parents[1]
GPT_DIR = ROOT / "examples" / "gpt"
HERE = ROOT / "benchmarks"
#: Targets of the search benchmarks: the GPT example and the test suite's memory-hungry target.
GPT_TARGET = f"{GPT_DIR / 'train.py'}:make"
HUNGRY_TARGET = f"{ROOT / 'tests' / 'fixtures' / 'search_target.py'}:make"
#: What a fresh process imports once, in the fork server, before forking (what a search trial preloads, public).
FRESH_PRELOAD = ["torch", "lightning", "lightning.pytorch", "autotune", "autotune.callbacks"]


def use_paths(*, gpt: bool = False) -> None:
    """Put ``examples/gpt`` (with ``gpt``), the repository root and ``benchmarks/`` on ``sys.path`` if missing.

    ``examples/gpt`` comes first so that ``model`` and ``data`` import as ``examples/gpt/train.py`` imports them.
    """
    for folder in ([str(GPT_DIR)] if gpt else []) + [str(ROOT), str(HERE)]:
        if folder not in sys.path:
            sys.path.insert(0, folder)


# ------------------------------------------------------------------------------------------------ the machine


def cpu_name() -> str:
    """The CPU's model name from ``/proc/cpuinfo``, else what :mod:`platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine() or "unknown CPU"


def load_average() -> tuple[float, float, float] | None:
    """The 1, 5 and 15 minute load averages, or None where the platform has none."""
    return os.getloadavg() if hasattr(os, "getloadavg") else None


def machine(device: str, *, threads: int | None = None) -> dict[str, Any]:
    """The machine and library versions a result was measured with.

    Args:
        device: ``"cpu"`` or ``"cuda"`` (then ``gpu`` names device 0).
        threads: the intra-op threads the measured processes use; None: this process's torch threads.

    Returns:
        ``cpu``, ``cores``, ``torch_threads``, ``gpu`` (None on CPU), ``device``, ``python``, ``torch``,
        ``lightning``, ``optuna`` (None when not installed), ``date`` (UTC) and ``load_average`` (at the call).
    """
    import lightning
    import torch

    try:
        optuna_version: str | None = importlib.metadata.version("optuna")
    except importlib.metadata.PackageNotFoundError:
        optuna_version = None
    return {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "torch_threads": threads or torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
        "device": device,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "optuna": optuna_version,
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "load_average": load_average(),
    }


def machine_line(m: dict[str, Any]) -> str:
    """One line naming the machine, the library versions, the date and the load at the start (and end, if set)."""
    return (f"machine: {m['cpu']}, {m['cores']} cores, torch threads {m['torch_threads']}; python {m['python']}, "
            f"torch {m['torch']}, lightning {m['lightning']}, optuna {m['optuna']}; device {m['device']}"
            + (f" ({m['gpu']})" if m.get("gpu") else "") + f"; {m['date']}; load average (1, 5, 15 min) at start "
            f"{', '.join(f'{x:.1f}' for x in m['load_average'])}"
            + (f", at end {', '.join(f'{x:.1f}' for x in m['load_average_end'])}" if m.get("load_average_end") else ""))


# ------------------------------------------------------------------------------------------------ arguments


def make_parser(doc: str, *, raw: bool = True) -> argparse.ArgumentParser:
    """A parser described by the first paragraph of a script's docstring (kept as written with ``raw``)."""
    formatter = argparse.RawDescriptionHelpFormatter if raw else argparse.HelpFormatter
    return argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=formatter)


def add_device(parser: argparse.ArgumentParser, *, default: str = "cpu", help: str | None = None,
               choices: Sequence[str] | None = ("cpu", "cuda")) -> None:
    """``--device``: ``cpu`` or ``cuda`` (``choices=None`` takes any device string)."""
    parser.add_argument("--device", default=default, choices=list(choices) if choices else None, help=help)


def add_threads(parser: argparse.ArgumentParser, help: str) -> None:
    """``--threads N``: intra-op threads (see :func:`threads_for`)."""
    parser.add_argument("--threads", type=int, default=None, help=help)


def add_neighbour(parser: argparse.ArgumentParser) -> None:
    """``--neighbour SECONDS``: a busy neighbour beside the whole run, on for that long, off for as long (see
    :func:`neighbour`; 0, the default: none)."""
    parser.add_argument("--neighbour", type=float, default=0.0, metavar="SECONDS",
                        help="a busy neighbour (a spinning process per core) on for SECONDS, off for SECONDS, beside "
                             "the whole run (12: issue 54's load; default 0: none)")


def add_json(parser: argparse.ArgumentParser, help: str = "also write every measurement here") -> None:
    """``--json PATH``: where to write the raw results as well."""
    parser.add_argument("--json", type=Path, default=None, help=help)


def threads_for(device: str, threads: int | None) -> int | None:
    """The intra-op threads to use: ``threads`` if given, else 1 on CPU (steadier on a shared machine) and None
    (torch's default) on CUDA."""
    return threads if threads is not None else (1 if device == "cpu" else None)


def quiet() -> None:
    """Silence warnings and Lightning's info logging (the benchmarks print their own summaries)."""
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)


def write_json(path: Path | None, data: Any) -> None:
    """Write ``data`` to ``path`` as indented JSON (anything else as ``str``); nothing when ``path`` is None."""
    if path is not None:
        path.write_text(json.dumps(data, indent=1, default=str))


# ------------------------------------------------------------------------------------------------ tables


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]], *, pad: bool = False,
                   right: Sequence[int] = ()) -> str:
    """A Markdown table of ``header`` and ``rows`` (cells are strings).

    Args:
        header: the column names.
        rows: the cells, one list per row.
        pad: pad every column to its widest cell (readable as plain text too); else cells are not padded.
        right: indices of right-aligned columns (``---:``; without ``pad`` only).
    """
    table = [list(header), *map(list, rows)]
    if pad:
        widths = [max(len(r[i]) for r in table) for i in range(len(header))]
        lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in table]
        lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
        return "\n".join(lines)
    lines = ["| " + " | ".join(r) + " |" for r in table]
    lines.insert(1, "|" + "|".join("---:" if i in right else "---" for i in range(len(header))) + "|")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ processes


@contextlib.contextmanager
def neighbour(period: float) -> Iterator[dict[str, float]]:
    """A busy neighbour coming and going beside the block: one process per core spinning a pure-Python loop for
    ``period`` seconds, then none for ``period`` seconds, and so on, from the block's start (on first); nothing with
    ``period`` 0. Yields a record of how long the neighbour ran (``on_seconds``) over the block (``seconds``)."""
    import subprocess
    import threading
    import time

    record = {"period": period, "on_seconds": 0.0, "seconds": 0.0}
    if period <= 0:
        yield record
        return
    done = threading.Event()
    start = time.monotonic()

    def toggle() -> None:
        while not done.is_set():
            procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
            began = time.monotonic()
            done.wait(period)
            for proc in procs:
                proc.kill()
                proc.wait()
            record["on_seconds"] += time.monotonic() - began
            done.wait(period)

    thread = threading.Thread(target=toggle, daemon=True)
    thread.start()
    try:
        yield record
    finally:
        done.set()
        thread.join()
        record["seconds"] = time.monotonic() - start


_FRESH: Any = None


def fresh_context() -> Any:
    """A ``forkserver`` multiprocessing context whose server has torch, Lightning and autotune imported, so that
    each process forked from it starts with a search trial's memory floor and without its import time."""
    global _FRESH
    if _FRESH is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(FRESH_PRELOAD)
        _FRESH = ctx
    return _FRESH


def _fresh_child(fn: Callable[..., Any], args: tuple[Any, ...], out: str) -> None:
    """In the fresh process: ``fn(*args)``, its JSON-safe result written to ``out``."""
    warnings.filterwarnings("ignore")
    # its own processes start the platform's default way, as a search trial's do (autotune/_search/trial.py): a
    # forkserver child's queues register semaphores with this benchmark's resource tracker, which the quick exit
    # below leaves behind ("leaked semaphore objects" at the end of the run)
    multiprocessing.set_start_method(multiprocessing.get_all_start_methods()[0], force=True)
    result = fn(*args)
    Path(out).write_text(json.dumps(result))
    os._exit(0)


def in_fresh_process(fn: Callable[..., Any], *args: Any, timeout: float = 900.0) -> Any:
    """Run ``fn(*args)`` (a module-level function returning JSON-safe data) in a process of :func:`fresh_context`.

    Raises:
        RuntimeError: when the process ends (or is killed after ``timeout`` seconds) without a result.
    """
    with tempfile.TemporaryDirectory(prefix="autotune-bench-") as tmp:
        out = Path(tmp) / "out.json"
        proc = fresh_context().Process(target=_fresh_child, args=(fn, args, str(out)))
        proc.start()
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
        if not out.exists():
            raise RuntimeError(f"{fn.__name__}{args} ended without a result (exit code {proc.exitcode})")
        return json.loads(out.read_text())


def _status(*keys: str) -> list[int] | None:
    """Fields of Linux's ``/proc/self/status`` in bytes, in the order asked; None elsewhere."""
    found: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in keys:
                    found[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return [found[k] for k in keys] if len(found) == len(keys) else None


def first_batch(target: Any) -> Any:
    """The first training batch of a loaded target (``autotune.load_target``): its DataModule set up for fit, or the
    model's own ``train_dataloader``; what a trial's first step and the search's estimate of a fixed-shape target
    see."""
    owner = target.datamodule if target.datamodule is not None else target.model
    if target.datamodule is not None:
        target.datamodule.setup("fit")
    return next(iter(owner.train_dataloader()))


def current_host_bytes() -> int:
    """This process's memory in a CPU budget's measure (docs/elastic.md): the resident set net of file-backed pages,
    Linux ``RssAnon + RssShmem``; psutil's RSS elsewhere."""
    fields = _status("RssAnon", "RssShmem")
    if fields is not None:
        return sum(fields)
    import psutil

    return int(psutil.Process().memory_info().rss)


def peak_rss_bytes() -> int:
    """This process's peak resident set size in bytes: Linux's ``VmHWM``, else ``getrusage``'s ``ru_maxrss``."""
    fields = _status("VmHWM")
    if fields is not None:
        return fields[0]
    import resource

    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB elsewhere
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * scale


def peak_host_bytes() -> int:
    """This process's peak in a CPU budget's measure: Linux ``VmHWM - RssFile`` (the peak resident set less the
    file-backed pages resident now); the peak resident set elsewhere."""
    fields = _status("VmHWM", "RssFile")
    return max(0, fields[0] - fields[1]) if fields is not None else peak_rss_bytes()
