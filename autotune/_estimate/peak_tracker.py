"""The estimator's memory tracker: torch's ``MemTracker`` keeping the whole step's peak only, with the work buffers
kernels allocate inside one call counted while it runs, CUDA's rounding on a CPU trace, and the bytes alive after
each op where the real-tensor path needs them (:func:`peak_tracker`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from autotune._compat.torch import (
    grad_hook_handles,
    mem_ref_types,
    mem_tracker_base,
    memory_now,
    peak_memory,
    reset_peak_memory,
)

__all__ = ["peak_tracker"]


class _NoHook:
    """A hook handle for a hook never registered."""

    def remove(self) -> None:
        pass


_NO_HOOK = _NoHook()


def peak_tracker(extra_bytes: Callable[[Any, Any, Any, Any], int],
                 round_bytes: Callable[[int], int] | None = None, timeline_device: str | None = None) -> Any:
    """torch's ``MemTracker`` keeping the whole step's peak only (upstream's loops over every module per op), with
    ``extra_bytes(func, args, kwargs, out)`` bytes of kernel work buffers counted as temporaries while each op runs.

    Frozen parameters take no gradient hook (upstream hooks every parameter, which raises for those).
    ``round_bytes`` rounds every storage (CUDA's rules on a CPU trace) before it is counted; ``allocated_bytes``
    adds up every storage the step made, at its making. ``timeline_device``: the device type whose bytes alive after
    each op (with its work buffers) are kept, one list per phase (``timelines``; :meth:`next_phase` starts the next):
    the real-tensor path lines up the same moments of two micro-batches (``timeline_ops``: the op of each of those
    moments). The private accesses it builds on are in :mod:`autotune._compat.torch` (``mem_tracker_base``).
    """
    Ref = mem_ref_types()

    class StepTracker(mem_tracker_base()):  # type: ignore[misc]
        allocated_bytes = 0
        timelines: list[list[int]]
        timeline_ops: list[list[Any]]

        def storage_counted(self, nbytes: int, counted: int, *, added: bool) -> int:
            if round_bytes is not None:
                counted = round_bytes(nbytes)
            if added:
                self.allocated_bytes += counted
            return counted

        def before_parameters_tracked(self, module: Any) -> None:
            # A frozen parameter (a fine-tuned model's backbone) takes no gradient hook: one entry with no-op
            # handles makes upstream skip it.
            handles = grad_hook_handles(self)
            for param in module.parameters():
                if not param.requires_grad and param not in handles:
                    handles[param] = (_NO_HOOK, _NO_HOOK)

        def update_peak(self) -> None:
            peaks, snaps = peak_memory(self)
            for dev, snap in memory_now(self).items():
                if peaks.get(dev, 0) < snap["Total"]:
                    peaks[dev] = snap["Total"]
                    snaps[dev] = dict(snap)

        def _alive_on(self, device_type: str) -> int:
            return sum(snap["Total"] for dev, snap in memory_now(self).items() if dev.type == device_type)

        def next_phase(self) -> dict[Any, dict[Any, int]]:
            """The peak snapshot of the phase that ends now (per device); the next phase's peak starts from what is
            alive now."""
            ended = {dev: dict(snap) for dev, snap in peak_memory(self)[1].items()}
            reset_peak_memory(self)
            self.update_peak()
            if timeline_device is not None:
                self.timelines.append([self._alive_on(timeline_device)])
                self.timeline_ops.append([None])
            return ended

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = super().__torch_dispatch__(func, types, args, kwargs)
            extra = extra_bytes(func, args, kwargs, out)
            snap = memory_now(self).get(args[0].device) if extra else None
            if snap is not None:  # alive with the op's inputs and outputs, gone when it returns
                for key in (Ref.TEMP, "Total"):
                    snap[key] += extra
                self.update_peak()
                for key in (Ref.TEMP, "Total"):
                    snap[key] -= extra
            if timeline_device is not None:
                on_it = snap is not None and args[0].device.type == timeline_device  # the work buffers' device
                self.timelines[-1].append(self._alive_on(timeline_device) + (extra if on_it else 0))
                self.timeline_ops[-1].append(func)
            return out

    tracker = StepTracker()
    tracker.timelines, tracker.timeline_ops = [[]], [[]]
    return tracker
