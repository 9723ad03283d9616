"""Count the work buffers that kernels allocate and free inside one call, unseen by any dispatch mode.

They are derived where the rule is known, measured once per machine where it is not.

- CPU convolutions in the im2col kernel (``Slow2d``) follow a rule measured with the profiler
  (:func:`cpu_conv_workspace`).
- CPU convolutions in oneDNN (any dtype), and matrix products in bf16 or fp16 (oneDNN too), hold buffers: weights
  reordered for the ISA, AMX tile layouts, per-thread scratchpads, a channels-last depthwise backward's accumulators.
  These depend on the processor's instruction set, the layout and the thread count, so none is derived. Each
  distinct call (op, shapes, strides, dtypes) is run once on uninitialised tensors of the traced shapes, on
  this machine, and the bytes it held above its inputs and outputs are kept for the process
  (:func:`measured_workspace`). Calls with operands above ``CALIBRATE_MAX_BYTES`` are not run: they count what the
  rule knows (convolutions) or nothing (matrix products), and the estimate says so.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import torch

#: Operand bytes above which a call is not run to measure its workspace (it would cost about what the step does).
CALIBRATE_MAX_BYTES = 256 * 2**20
_LOW_PRECISION = (torch.bfloat16, torch.float16)
_MEASURED: dict[tuple[Any, ...], int] = {}  # per process: a call's key -> its workspace bytes


def _calibrated_ops() -> tuple[Any, ...]:
    aten = torch.ops.aten
    return (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.convolution.default,
            aten.convolution_backward.default)


class Workspace:
    """The kernel work buffers of one traced step: bytes per call, and what was measured or left out."""

    def __init__(self, *, cpu_kernels: bool = True) -> None:
        self.cpu_kernels = cpu_kernels  # False: a CPU trace of a CUDA step, whose kernels are not the CPU's
        self.measured_calls: set[tuple[Any, ...]] = set()
        self.skipped_calls: set[tuple[Any, ...]] = set()

    def bytes_of(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any] | None, out: Any) -> int:
        """Bytes ``func(*args)`` holds inside its kernel on top of its inputs and outputs."""
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if not self.cpu_kernels or not tensors or tensors[0].device.type != "cpu":
            return 0
        if func in _calibrated_ops() and (any(t.dtype in _LOW_PRECISION for t in tensors) or _onednn_conv(func, args)):
            key = _key(func, args, kwargs)
            if sum(t.numel() * t.element_size() for t in tensors) > CALIBRATE_MAX_BYTES:
                self.skipped_calls.add(key)
                return cpu_conv_workspace(func, args, out)  # the part of the buffers a rule knows
            self.measured_calls.add(key)
            if key not in _MEASURED:
                _MEASURED[key] = measured_workspace(func, args, kwargs)
            return _MEASURED[key]
        return cpu_conv_workspace(func, args, out)

    def notes(self) -> tuple[str, ...]:
        notes = []
        if self.measured_calls:
            notes.append(f"CPU kernel work buffers of {len(self.measured_calls)} oneDNN call(s) (convolutions, bf16/fp16 "
                         f"matrix products) measured on this machine (they depend on its instruction set and "
                         f"{torch.get_num_threads()} thread(s))")
        if self.skipped_calls:
            notes.append(f"{len(self.skipped_calls)} oneDNN call(s) too large to measure count only the work buffers "
                         "a rule knows: the peak may be a little higher")
        return tuple(notes)


def _onednn_conv(func: Any, args: Sequence[Any]) -> bool:
    """Whether a CPU convolution (forward or backward) runs in oneDNN, whose scratchpads depend on the kernel it
    picks for the ISA and layout (a channels-last 7x7 depthwise backward holds about 50 KiB per channel here)."""
    from autotune._compat.torch import conv_backend_name

    aten = torch.ops.aten
    if func is aten.convolution.default:
        return conv_backend_name(args[0], args[1], args[3:9]) == "Mkldnn"
    if func is aten.convolution_backward.default:
        return conv_backend_name(args[1], args[2], args[4:10]) == "Mkldnn"
    return False


def _key(func: Any, args: Sequence[Any], kwargs: dict[str, Any] | None) -> tuple[Any, ...]:
    def describe(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return ("T", tuple(a.shape), tuple(a.stride()), a.dtype)
        if isinstance(a, (list, tuple)):
            return tuple(describe(x) for x in a)
        return a

    return (str(func), describe(tuple(args)), describe(tuple(sorted((kwargs or {}).items()))),
            torch.get_num_threads())


def measured_workspace(func: Any, args: Sequence[Any], kwargs: dict[str, Any] | None) -> int:
    """Run ``func`` on uninitialised CPU tensors shaped like ``args`` (fake or real) and return the most bytes it
    held above what it returned, read from the profiler's allocation events. The call is made twice and the second
    measured: the first may fill caches (oneDNN's primitives) that every later call reuses."""
    from torch.profiler import ProfilerActivity, profile

    from autotune._compat.torch import outside_dispatch_modes

    with outside_dispatch_modes():
        real = [_real_like(a) for a in args]
        func(*real, **(kwargs or {}))
        with _stderr_silenced(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = func(*real, **(kwargs or {}))
        del out
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),  # type: ignore[union-attr]
                    key=lambda e: e.start_ns())
    alive = peak = 0
    for event in events:
        alive += event.nbytes()
        peak = max(peak, alive)
    return max(0, peak - alive)  # what is still alive at the end is what the call returned (freed after profiling)


@contextlib.contextmanager
def _stderr_silenced() -> Iterator[None]:
    """The profiler's C++ side prints a line to the process's stderr each time it stops: keep it out of the user's
    terminal (file descriptor 2 goes to /dev/null for the length of one kernel call)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _real_like(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return torch.empty_strided(tuple(a.shape), tuple(a.stride()), dtype=a.dtype, device="cpu")
    if isinstance(a, (list, tuple)):
        return type(a)(_real_like(x) for x in a)
    return a


def cpu_conv_workspace(func: Any, args: Sequence[Any], out: Any) -> int:
    """Bytes a CPU convolution allocates and frees inside its kernel, unseen by any dispatch mode.

    Measured with the profiler: the im2col kernel (``Slow2d``, e.g. bf16 without AVX512-BF16) holds a column buffer
    of ``batch x C_in x kh x kw x H_out x W_out`` in forward and in backward; oneDNN (``Mkldnn``) holds a copy of
    the output in forward, and of the output's gradient and the input's gradient in backward.
    """
    from autotune._compat.torch import conv_backend_name

    aten = torch.ops.aten
    if func not in (aten.convolution.default, aten.convolution_backward.default) or args[0].device.type != "cpu":
        return 0
    backward = func is aten.convolution_backward.default
    grad_out, (x, weight), rest = (args[0], args[1:3], args[4:10]) if backward else (None, args[:2], args[3:9])
    backend = conv_backend_name(x, weight, rest)
    if backend == "Slow2d":
        out_hw = (grad_out if backward else out).shape[2:]
        return x.shape[0] * x.shape[1] * math.prod(weight.shape[2:]) * math.prod(out_hw) * x.element_size()
    if backend == "Mkldnn":
        if not backward:
            return out.numel() * out.element_size()
        return grad_out.numel() * grad_out.element_size() + (x.numel() * x.element_size() if args[-1][0] else 0)
    return 0
