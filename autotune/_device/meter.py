"""What a step used: the peak meter (CUDA allocator or CPU resident set) and the process's resident set size."""

from __future__ import annotations

import os

import torch

_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class MemoryMeter:
    """Peak memory of one step on one device.

    CUDA: the caching allocator's peak reserved bytes (what ``set_per_process_memory_fraction`` caps) and peak
    allocated bytes, reset at the start of each step. CPU: the process's peak resident set size (Linux ``VmHWM``),
    reset at the start of each step through ``/proc/self/clear_refs``; where that reset is not possible the peak
    is the process's lifetime peak RSS, which can only over-report.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        self._can_reset_rss = not self.is_cuda and os.access("/proc/self/clear_refs", os.W_OK)

    def start(self) -> int:
        """Reset the peak and return the bytes in use now (the step's static part)."""
        if self.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            return torch.cuda.memory_allocated(self.device)
        if self._can_reset_rss:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # 5: reset the peak RSS (VmHWM) to the current RSS
            except OSError:
                self._can_reset_rss = False
        return current_rss_bytes()

    def peak(self) -> int:
        """Peak bytes since :meth:`start` (CUDA: reserved; CPU: resident set)."""
        if self.is_cuda:
            return torch.cuda.max_memory_reserved(self.device)
        return peak_rss_bytes()

    def peak_allocated(self) -> int:
        """Peak bytes held by live tensors since :meth:`start` (CUDA); the resident set peak on CPU."""
        if self.is_cuda:
            return torch.cuda.max_memory_allocated(self.device)
        return peak_rss_bytes()


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
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
