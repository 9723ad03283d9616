"""Precede each collective the model makes inside a micro-batch with the ranks' guard (see
:mod:`autotune._runtime.agreement`).

A model may make collectives of its own in forward or backward: SyncBatchNorm's all-gather and all-reduce, a
torchmetrics metric synced on step, expert-parallel all-to-alls. A rank that runs out of memory before one of them
never joins it, and its peers would wait inside it forever. While the callback runs (``install`` to ``remove``), the
collectives of ``torch.distributed`` are wrapped. Inside the step's micro-batches, on whichever thread makes it (on
CUDA, autograd runs backward on a thread of its own per device: SyncBatchNorm's backward all-reduce is made there),
each call is first announced to the other ranks in one small all-reduce (the guard). A peer that failed meets it there
with its vote, and the collective is not entered. Calls outside the micro-batches pass straight through (one
attribute check).

Collectives that do not go through ``torch.distributed``'s functions are not seen: functional collectives and DTensor
redistribution (tensor parallelism, refused at setup), calls bound before the callback was set up
(``from torch.distributed import all_reduce`` at import), and a process group's own methods.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

#: The collectives of ``torch.distributed`` that are guarded (point-to-point calls are not: they pair two ranks).
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_gather_single", "reduce_scatter",
    "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single", "broadcast",
    "broadcast_object_list", "reduce", "gather", "gather_object", "scatter", "scatter_object_list", "barrier",
    "monitored_barrier", "all_reduce_coalesced", "all_gather_coalesced",
)


class CollectiveGuard:
    """Wraps ``torch.distributed``'s collectives while installed; ``window(before)`` guards the calls made inside it.

    ``before()`` runs before each guarded call, on any thread (the ranks' guard, which raises when a peer failed);
    calls made on a thread while one is in progress there (``all_gather_object`` calls ``all_gather``; the guard's
    own all-reduce), or inside ``passing()`` on that thread (the FSDP2 units' own collectives, which the drain
    handles), are not guarded.
    """

    def __init__(self) -> None:
        self.calls = 0  # guarded calls so far (for tests)
        self._before: Callable[[], None] | None = None
        self._local = threading.local()  # ``depth``: this thread's guarded calls in progress and passing() blocks
        self._restore: list[tuple[Any, str, Any]] = []

    def install(self) -> None:
        """Wrap the collectives (once; :meth:`remove` puts them back)."""
        if self._restore:
            return
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for name in COLLECTIVES:
            for module in (dist, c10d):
                original = getattr(module, name, None)
                if original is None:
                    continue
                self._restore.append((module, name, original))
                setattr(module, name, self._wrap(original))

    def remove(self) -> None:
        for module, name, original in reversed(self._restore):
            setattr(module, name, original)
        self._restore = []

    @contextmanager
    def window(self, before: Callable[[], None]) -> Iterator[None]:
        """Guard the collectives made while the block runs, on any thread, with ``before``."""
        self._before, self._local.depth = before, 0
        try:
            yield
        finally:
            self._before = None

    @contextmanager
    def passing(self) -> Iterator[None]:
        """Let the collectives this thread makes inside the block through unguarded."""
        local = self._local
        local.depth = getattr(local, "depth", 0) + 1
        try:
            yield
        finally:
            local.depth -= 1

    def _wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        guard = self

        @functools.wraps(original)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            before, local = guard._before, guard._local
            if before is None or getattr(local, "depth", 0):
                return original(*args, **kwargs)
            local.depth = 1
            try:
                guard.calls += 1
                before()
                return original(*args, **kwargs)
            finally:
                local.depth = 0

        return guarded
