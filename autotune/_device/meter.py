"""What a step used: the peak meter (CUDA allocator, or the host process's memory) and the process's resident set.

On the host the budget's measure is the process's memory net of file-backed pages: its resident set (RSS) less the pages
of the files it has mapped (torch's shared libraries above all). Those pages are shared with every other process mapping
the same files, and the kernel drops them under pressure. How many of them a process has mapped depends on the page
cache rather than on the plan (docs/elastic.md gives a measured example). What is left, anonymous and shared-memory
pages, is what the process allocated: the interpreter's objects, tensors, the C allocator's heap, DataLoader batches in
shared memory. The kernel keeps no peak of those alone: :func:`peak_host_bytes` says how close the peak read here comes.
"""

from __future__ import annotations

import os
from typing import Any

import torch

_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class MemoryMeter:
    """Peak memory of one step on one device.

    CUDA: the caching allocator's peak reserved bytes (what ``set_per_process_memory_fraction`` caps) and peak
    allocated bytes, reset at the start of each step. CPU: the process's peak memory net of file-backed pages (see
    :func:`peak_host_bytes`), its peak reset at the start of each step through ``/proc/self/clear_refs``; where that
    reset is not possible the peak is the process's lifetime peak.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        self._can_reset_rss = not self.is_cuda and os.access("/proc/self/clear_refs", os.W_OK)

    def start(self) -> int:
        """Reset the peak and return the bytes in use now (the step's static part)."""
        if self.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            return cuda_stat(self.device, "allocated_bytes", "current")
        if self._can_reset_rss:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # 5: reset the peak RSS (VmHWM) to the current RSS
            except OSError:
                self._can_reset_rss = False
        return current_host_bytes()

    def peak(self) -> int:
        """Peak bytes since :meth:`start` (CUDA: reserved; CPU: the resident set net of file-backed pages)."""
        if self.is_cuda:
            return cuda_stat(self.device, "reserved_bytes", "peak")
        return peak_host_bytes()

    def peaks(self) -> tuple[int, int]:
        """:meth:`peak` and :meth:`peak_allocated` from one read of the statistics (CUDA; both the host peak on CPU)."""
        if self.is_cuda:
            stats = torch.cuda.memory_stats_as_nested_dict(self.device)
            return _figure(stats, "reserved_bytes", "peak"), _figure(stats, "allocated_bytes", "peak")
        peak = peak_host_bytes()
        return peak, peak

    def peak_allocated(self) -> int:
        """Peak bytes held by live tensors since :meth:`start` (CUDA); :meth:`peak` on CPU."""
        if self.is_cuda:
            return cuda_stat(self.device, "allocated_bytes", "peak")
        return peak_host_bytes()


def cuda_stat(device: torch.device | int, name: str, field: str) -> int:
    """One figure of the CUDA caching allocator's statistics for all pools, e.g. ``("reserved_bytes", "peak")`` (what
    ``torch.cuda.max_memory_reserved`` returns); 0 before CUDA is initialised. Read from the nested statistics:
    ``torch.cuda.memory_stats`` flattens and sorts all of them (about 130) in Python for every figure, about 50 us a
    call on a server CPU, which the meter would pay twice a step (benchmarks/elastic_overhead.py)."""
    return _figure(torch.cuda.memory_stats_as_nested_dict(device), name, field)


def _figure(stats: dict, name: str, field: str) -> int:
    """One figure of the allocator's nested statistics, all pools (0 where absent)."""
    return int(stats.get(name, {}).get("all", {}).get(field, 0))


def _status(*keys: str) -> list[int] | None:
    """The fields of ``/proc/self/status`` named ``keys`` in bytes, in that order; None where one is missing."""
    found: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in keys:
                    found[key] = int(value.split()[0]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return [found[k] for k in keys] if len(found) == len(keys) else None


def current_host_bytes() -> int:
    """This process's memory now, net of file-backed pages: anonymous plus shared-memory resident pages (Linux
    ``RssAnon + RssShmem``); the resident set size where the kernel does not split it."""
    fields = _status("RssAnon", "RssShmem")
    return sum(fields) if fields is not None else current_rss_bytes()


def release_host_memory() -> bool:
    """Give the C allocator's free memory back to the system.

    It calls glibc's ``malloc_trim(0)``, which also releases free pages inside the heap. glibc keeps freed blocks under
    its mmap threshold (which rises as large blocks are freed) resident for the next allocation, so a process's resident
    set never shrinks by itself. Without this, after a step over a CPU budget, the next and smaller step would be
    measured at what the larger one left, over the budget again. Returns whether it could (False where the C library has
    no ``malloc_trim``: not glibc)."""
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        import ctypes

        try:
            _MALLOC_TRIM = ctypes.CDLL(None).malloc_trim
        except (AttributeError, OSError):
            _MALLOC_TRIM = False
    if _MALLOC_TRIM is False:
        return False
    _MALLOC_TRIM(0)
    return True


_MALLOC_TRIM: Any = None  # glibc's malloc_trim once looked up; False where there is none


def peak_host_bytes() -> int:
    """This process's peak memory net of file-backed pages, since the peak's last reset: Linux ``VmHWM - RssFile``.

    ``VmHWM`` is the peak resident set, file pages included; the file pages resident now are subtracted. Its error is
    the change in resident file pages between the moment of the peak and now. Pages mapped after the peak (code run
    for the first time, the pages of a memory-mapped dataset read later in the step) make it report that much less.
    Pages unmapped or reclaimed after the peak make it report that much more (never more than the peak resident set).
    A process keeps its libraries' code mapped once it has run it. So, with the peak reset at each step's start, after
    the first steps and with data that is not memory-mapped, this is the peak of the anonymous and shared-memory
    pages. The peak resident set
    size where the kernel does not split it.
    """
    fields = _status("VmHWM", "RssFile")
    return max(0, fields[0] - fields[1]) if fields is not None else peak_rss_bytes()


def current_rss_bytes() -> int:
    """This process's resident set size in bytes."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE_SIZE
    except OSError:
        import psutil

        return int(psutil.Process().memory_info().rss)


def peak_rss_bytes() -> int:
    """This process's peak resident set size in bytes (since the last reset where supported)."""
    fields = _status("VmHWM")
    if fields is not None:
        return fields[0]
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
