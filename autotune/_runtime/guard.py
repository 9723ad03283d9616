"""Precede each collective the model makes inside a micro-batch with the ranks' guard (see
:mod:`autotune._runtime.agreement`).

A model may make collectives of its own in forward or backward: SyncBatchNorm's all-gather and all-reduce, a
torchmetrics metric synced on step, expert-parallel all-to-alls. A rank that runs out of memory before one of them
never joins it, and its peers would wait inside it forever. While the callback runs (``install`` to ``remove``), the
collectives of ``torch.distributed`` are wrapped. Inside the step's micro-batches, on the thread that runs them, each
call is first announced to the other ranks in one small all-reduce (the guard). A peer that failed meets it there
with its vote, and the collective is not entered. Calls from anywhere else pass straight through (one attribute check).

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

    ``before()`` runs before each guarded call (the ranks' guard, which raises when a peer failed); calls made while
    one is in progress (``all_gather_object`` calls ``all_gather``), or ``passing()`` (the FSDP2 units' own
    collectives, which the drain handles), or on another thread, are not guarded.
    """

    def __init__(self) -> None:
        self.calls = 0  # guarded calls so far (for tests)
        self._before: Callable[[], None] | None = None
        self._thread: int | None = None
        self._depth = 0
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
        """Guard the collectives this thread makes inside the block with ``before``."""
        self._before, self._thread, self._depth = before, threading.get_ident(), 0
        try:
            yield
        finally:
            self._before, self._thread = None, None

    @contextmanager
    def passing(self) -> Iterator[None]:
        """Let the collectives made inside the block through unguarded."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1

    def _wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        guard = self

        @functools.wraps(original)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            before = guard._before
            if before is None or guard._depth or guard._thread != threading.get_ident():
                return original(*args, **kwargs)
            guard._depth += 1
            try:
                guard.calls += 1
                before()
                return original(*args, **kwargs)
            finally:
                guard._depth -= 1

        return guarded
