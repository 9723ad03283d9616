"""What a measurement ran beside: the host's other work over a window, read from ``/proc`` (Linux).

A throughput measured on a shared host is the plan's speed and its neighbours' load together. A window's record
says how much of that load there was:

- ``cpu_per_wall``: the CPU seconds this run's own processes (the trial process, its ranks, its DataLoader workers)
  used per wall second; a quiet 2-thread run uses about 2, one that waits on busy cores less;
- ``neighbour_cores``: the cores the host's other processes kept busy on average (the host's busy time, from
  ``/proc/stat``, less this run's own), the figure that says whether a neighbour came or went;
- ``steal``: the share of the host's time a hypervisor gave to other guests (``/proc/stat``'s steal);
- ``runnable``: the most runnable tasks ``/proc/loadavg`` showed at the window's ends, this run's own included;
- ``cores``: the cores this process may run on.

Where ``/proc`` cannot be read (another OS), the host's side is None and only the process's own figures are kept.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["BUSY_SHARE", "LoadRecord", "LoadWindow", "busy", "load_differs"]

#: A host is busy while its other processes keep at least this share of its cores busy.
BUSY_SHARE = 0.25
#: Two windows ran under unlike loads when their neighbours' cores differ by at least this share of the cores.
UNLIKE_SHARE = 0.25
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class LoadRecord:
    """The load a measurement window ran beside (see the module's notes); figures None where not known."""

    wall_seconds: float
    cpu_per_wall: float | None
    neighbour_cores: float | None
    steal: float | None
    runnable: int | None
    cores: int
    wait_policy: str | None  # OMP_WAIT_POLICY in the measured process

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def busy(load: dict[str, Any] | None) -> bool:
    """Whether a window's record (:meth:`LoadRecord.as_dict`) shows a busy host: neighbours on at least
    :data:`BUSY_SHARE` of the cores, or a hypervisor taking as much.

    Example:
        >>> busy({"neighbour_cores": 1.2, "cores": 2}), busy({"neighbour_cores": 0.1, "cores": 2}), busy(None)
        (True, False, False)
    """
    if not load:
        return False
    cores = max(1, int(load.get("cores") or 1))
    others = (load.get("neighbour_cores") or 0.0) / cores
    return others >= BUSY_SHARE or (load.get("steal") or 0.0) >= BUSY_SHARE


def load_differs(first: dict[str, Any] | None, second: dict[str, Any] | None) -> bool:
    """Whether two windows ran under unlike loads: their neighbours' cores (or steal) differ by at least
    :data:`UNLIKE_SHARE` of the cores. Unknown loads are taken as alike.

    Example:
        >>> load_differs({"neighbour_cores": 1.0, "cores": 2}, {"neighbour_cores": 0.1, "cores": 2})
        True
        >>> load_differs({"neighbour_cores": 0.2, "cores": 2}, {"neighbour_cores": 0.1, "cores": 2})
        False
    """
    if not first or not second:
        return False
    cores = max(1, int(first.get("cores") or 1), int(second.get("cores") or 1))
    for key in ("neighbour_cores", "steal"):
        a, b = first.get(key), second.get(key)
        scale = cores if key == "neighbour_cores" else 1.0
        if a is not None and b is not None and abs(a - b) / scale >= UNLIKE_SHARE:
            return True
    return False


class LoadWindow:
    """Measures the load over a window: :meth:`start` at its beginning, :meth:`stop` at its end.

    ``root``: the pid whose process tree is this run's own (the trial process, with its ranks and workers); the
    current process where None.

    Example:
        >>> window = LoadWindow()
        >>> window.start()
        >>> record = window.stop()
        >>> record.cores >= 1
        True
    """

    def __init__(self, root: int | None = None) -> None:
        self.root = root if root is not None else os.getpid()
        self._begin: tuple[float, float | None, tuple[int, int, int] | None, int | None] | None = None

    def start(self) -> None:
        self._begin = (time.monotonic(), _own_cpu_seconds(self.root), _host_ticks(), _runnable())

    def stop(self) -> LoadRecord:
        if self._begin is None:
            raise RuntimeError("LoadWindow.stop() before start()")
        wall0, own0, host0, runnable0 = self._begin
        wall = time.monotonic() - wall0
        own1, host1, runnable1 = _own_cpu_seconds(self.root), _host_ticks(), _runnable()
        own = own1 - own0 if own0 is not None and own1 is not None else None
        neighbours = steal = None
        if host0 is not None and host1 is not None and wall > 0:
            busy_s = (host1[0] - host0[0]) / _TICKS
            total = host1[2] - host0[2]
            neighbours = max(0.0, (busy_s - (own or 0.0)) / wall)
            steal = (host1[1] - host0[1]) / total if total > 0 else 0.0
        runnable = max((r for r in (runnable0, runnable1) if r is not None), default=None)
        return LoadRecord(wall_seconds=wall, cpu_per_wall=own / wall if own is not None and wall > 0 else None,
                          neighbour_cores=neighbours, steal=steal, runnable=runnable, cores=_cores(),
                          wait_policy=os.environ.get("OMP_WAIT_POLICY"))


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _own_cpu_seconds(root: int) -> float | None:
    """CPU seconds (user + system) of ``root`` and every live descendant, with those of the descendants each has
    reaped (a process that ended and was waited for counts in its parent's; each once)."""
    import psutil

    try:
        parent = psutil.Process(root)
        procs = [parent, *parent.children(recursive=True)]
    except psutil.Error:
        return None
    total = 0.0
    for proc in procs:
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system + getattr(times, "children_user", 0.0) + getattr(times, "children_system", 0.0)
    return total


def _host_ticks() -> tuple[int, int, int] | None:
    """The host's (busy, steal, total) clock ticks since boot, from ``/proc/stat``'s ``cpu`` line; None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    values = [int(x) for x in fields[1:]]
    values += [0] * (8 - len(values))
    user, nice, system, idle, iowait, irq, softirq, steal = values[:8]
    busy_ticks = user + nice + system + irq + softirq  # guest time is inside user already
    return busy_ticks, steal, busy_ticks + idle + iowait + steal


def _runnable() -> int | None:
    """Runnable tasks now (``/proc/loadavg``'s fourth field, before the slash); None off Linux."""
    try:
        with open("/proc/loadavg") as f:
            return int(f.read().split()[3].split("/")[0])
    except (OSError, IndexError, ValueError):
        return None
