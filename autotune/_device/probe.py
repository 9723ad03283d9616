"""What memory a device has, what this process holds on it, and what other processes hold."""

from __future__ import annotations

import dataclasses
import logging
import os
import platform
from dataclasses import dataclass
from typing import Any, Union

import psutil
import torch

__all__ = ["DeviceSpec", "MemoryProbe", "probe_memory", "resolve_device"]

log = logging.getLogger(__name__)

DeviceSpec = Union[str, int, torch.device, None]

_ACCEPTED_DEVICES = "'cpu', 'cuda', 'cuda:N' or a CUDA index N"


@dataclass(frozen=True, kw_only=True)
class MemoryProbe:
    """One reading of a device's memory.

    Attributes:
        device: The device probed, like ``"cpu"`` or ``"cuda:0"``.
        name: The device's name: the GPU model, or the CPU model for ``"cpu"``.
        total_bytes: The device's total memory (for ``"cpu"``, the machine's RAM).
        free_bytes: Memory free for new allocations (for ``"cpu"``, psutil's ``available``).
        process_reserved_bytes: Memory this process holds: the CUDA caching allocator's reserve, or the RSS on CPU.
        process_allocated_bytes: Memory in this process's live tensors on CUDA; the RSS on CPU.
        other_processes_bytes: Memory used on the device by everything but this process.

    Example:
        >>> probe = probe_memory(device="cpu")
        >>> probe.free_bytes <= probe.total_bytes
        True
    """

    device: str
    name: str
    total_bytes: int
    free_bytes: int
    process_reserved_bytes: int
    process_allocated_bytes: int
    other_processes_bytes: int

    def as_dict(self) -> dict[str, str | int]:
        """The reading as a plain dict (bytes as ints), for JSON.

        Returns:
            One key per field, in field order.

        Example:
            >>> sorted(probe_memory(device="cpu").as_dict())[:2]
            ['device', 'free_bytes']
        """
        return dataclasses.asdict(self)


def resolve_device(device: DeviceSpec = None) -> torch.device:
    """Validate a device spec and turn it into a ``torch.device`` with an index for CUDA.

    Args:
        device: ``"cpu"``, ``"cuda"`` (the current CUDA device), ``"cuda:N"``, a CUDA index ``N``, a
            ``torch.device`` of type cpu or cuda, or ``None`` for the current CUDA device when CUDA is
            available, else the CPU.

    Returns:
        ``torch.device("cpu")`` or ``torch.device("cuda", N)`` for a visible device ``N``.

    Raises:
        ValueError: If the spec is not a device string torch knows, names a device type other than cpu and
            cuda, names a CUDA device while CUDA is not available, or names a CUDA index that is not visible.

    Example:
        >>> resolve_device("cpu")
        device(type='cpu')
    """
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    shown = repr(str(device)) if isinstance(device, torch.device) else repr(device)
    if isinstance(device, str) and device.isdigit():  # "--device 0" on a command line: a CUDA index
        device = int(device)
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise ValueError(f"device must be {_ACCEPTED_DEVICES}; got {shown}")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"device must be {_ACCEPTED_DEVICES}; got {shown}")
        parsed = torch.device("cuda", device)
        index: int | None = device
    else:
        try:
            parsed = torch.device(device)
        except RuntimeError:
            raise ValueError(f"device must be {_ACCEPTED_DEVICES}; got {shown}") from None
        index = parsed.index
    if parsed.type == "cpu":
        return torch.device("cpu")
    if parsed.type != "cuda":
        raise ValueError(f"device {shown} is not supported: use {_ACCEPTED_DEVICES}")
    if not torch.cuda.is_available():
        raise ValueError(f"device {shown} does not exist: CUDA is not available on this machine; use 'cpu'")
    count = torch.cuda.device_count()
    if index is None:
        index = torch.cuda.current_device()
    if index >= count:
        visible = ", ".join(f"cuda:{i}" for i in range(count))
        raise ValueError(f"device {shown} does not exist: {count} CUDA device(s) visible ({visible})")
    return torch.device("cuda", index)


def probe_memory(device: DeviceSpec = None) -> MemoryProbe:
    """Read a device's memory now.

    On CUDA, this process's reserve and allocation come from torch, and the device's name, total, free memory and
    process list from NVML, matched to the torch device by UUID. If NVML cannot be used, total and free come from
    ``torch.cuda.mem_get_info`` and a warning is logged. On CPU, psutil gives RAM and this process's RSS.

    Args:
        device: See :func:`resolve_device`; ``None`` probes the current CUDA device, or the CPU without CUDA.

    Returns:
        The reading.

    Raises:
        ValueError: If ``device`` is not a valid, visible device (see :func:`resolve_device`).

    Example:
        >>> probe = probe_memory(device="cpu")
        >>> probe.device, probe.total_bytes > 0
        ('cpu', True)
    """
    resolved = resolve_device(device)
    if resolved.type == "cpu":
        return _probe_cpu()
    return _probe_cuda(resolved.index if resolved.index is not None else torch.cuda.current_device())


def _probe_cpu() -> MemoryProbe:
    memory = psutil.virtual_memory()
    rss = psutil.Process().memory_info().rss
    return MemoryProbe(
        device="cpu",
        name=_cpu_name(),
        total_bytes=memory.total,
        free_bytes=memory.available,
        process_reserved_bytes=rss,
        process_allocated_bytes=rss,
        other_processes_bytes=max(0, memory.total - memory.available - rss),
    )


def _cpu_name() -> str:
    """The CPU model from /proc/cpuinfo (Linux), else ``platform.processor()``, else ``"cpu"``."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:
        pass  # not Linux: fall through to platform
    return platform.processor().strip() or "cpu"


def _probe_cuda(index: int) -> MemoryProbe:
    reserved = torch.cuda.memory_reserved(index)
    allocated = torch.cuda.memory_allocated(index)
    properties = torch.cuda.get_device_properties(index)
    try:
        name, total, free, used, own = _nvml_reading(str(properties.uuid))
    except _NvmlUnavailable as exc:
        log.warning(
            "NVML could not be used for cuda:%d (%s); reading total and free memory from torch.cuda.mem_get_info "
            "and counting everything this process does not reserve through torch (its CUDA context included) "
            "as other processes",
            index,
            exc,
        )
        free, total = torch.cuda.mem_get_info(index)
        name, used, own = properties.name, total - free, None
    if own is None:  # this pid is not in NVML's list (another PID namespace, or no context yet)
        own = reserved
    return MemoryProbe(
        device=f"cuda:{index}",
        name=name,
        total_bytes=int(total),
        free_bytes=int(free),
        process_reserved_bytes=int(reserved),
        process_allocated_bytes=int(allocated),
        other_processes_bytes=max(0, int(used) - int(own)),
    )


def process_device_bytes(index: int) -> int | None:
    """What NVML counts for this process on CUDA device ``index`` (its CUDA context included); None where NVML is
    unavailable or does not list the process (another PID namespace, no context yet)."""
    try:
        return _nvml_reading(str(torch.cuda.get_device_properties(index).uuid))[4]
    except _NvmlUnavailable:
        return None


class _NvmlUnavailable(Exception):
    """NVML is not installed, does not start, or does not know the device."""


def _nvml_reading(uuid: str) -> tuple[str, int, int, int, int | None]:
    """Name, total, free and used memory of the GPU with ``uuid``, and this process's use (``None`` if not listed).

    Raises:
        _NvmlUnavailable: If pynvml is missing or any NVML call fails; the cause is chained.
    """
    try:
        import pynvml
    except ImportError as exc:
        raise _NvmlUnavailable(f"pynvml is not installed: {exc}") from exc
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise _NvmlUnavailable(f"nvmlInit failed: {exc}") from exc
    try:
        handle = _nvml_handle(pynvml, uuid)
        name = pynvml.nvmlDeviceGetName(handle)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        processes = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except pynvml.NVMLError as exc:
        raise _NvmlUnavailable(f"NVML query for GPU {uuid} failed: {exc}") from exc
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as exc:
            log.debug("nvmlShutdown failed: %s", exc)
    if isinstance(name, bytes):  # old pynvml returns bytes
        name = name.decode("utf-8", errors="replace")
    pid = os.getpid()
    own_entries = [p.usedGpuMemory for p in processes if p.pid == pid and p.usedGpuMemory is not None]
    own = sum(own_entries) if own_entries else None
    return str(name), int(memory.total), int(memory.free), int(memory.used), own


def _nvml_handle(pynvml: Any, uuid: str) -> Any:
    """NVML's handle for torch's UUID: NVML wants ``GPU-<uuid>`` (``MIG-<uuid>`` for a MIG slice)."""
    if uuid.startswith(("GPU-", "MIG-")):
        return pynvml.nvmlDeviceGetHandleByUUID(uuid)
    try:
        return pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
    except pynvml.NVMLError_NotFound:
        return pynvml.nvmlDeviceGetHandleByUUID(f"MIG-{uuid}")
