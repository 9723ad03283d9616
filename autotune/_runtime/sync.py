"""Synchronisation around micro-batches: DDP's ``no_sync``, DDP's buffer broadcast, and the FSDP2 units of a model."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from autotune._compat.torch import ddp_buffers_due, set_ddp_buffers_due, sync_ddp_buffers


def fsdp_modules(model: torch.nn.Module | None) -> list[Any]:
    """The modules of ``model`` that FSDP2's ``fully_shard`` wrapped (none when it is not sharded)."""
    if model is None:
        return []
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def no_sync(model: torch.nn.Module | None) -> Iterator[None]:
    """Run a forward and backward without DDP's gradient reduction (``model.no_sync()``); a model without
    ``no_sync`` (None, one device, FSDP2, whose every backward reduce-scatters) is left as it is."""
    if model is None or not hasattr(model, "no_sync"):
        yield
        return
    with model.no_sync():
        yield


class DDPBuffers:
    """DDP's buffer broadcast, made at the start of each attempt at a step rather than inside a micro-batch's forward.

    DDP broadcasts rank 0's buffers in the forward that follows a forward with gradient sync on. With Lightning's own
    accumulation that is the first forward of each step (its last micro-batch runs with sync on). The micro-batches
    here all run under ``no_sync``, so left alone DDP would broadcast once per fit, and buffers would drift apart
    between ranks. And a forward that runs out of memory skips DDP's post-forward, so the failed rank alone would
    broadcast again in its replay while its peers wait elsewhere.

    So the broadcast is due when DDP says it is at the step's start (the same on every rank). It is made at the start
    of every attempt, before anything of the step can fail, so every rank takes part. DDP's own is off inside the
    micro-batches, and a step that succeeds leaves DDP as Lightning's last micro-batch would.
    Nothing for a model that is not DDP-wrapped or has no buffers to broadcast (``broadcast_buffers=False``).
    """

    def __init__(self, model: Any) -> None:
        from torch.nn.parallel import DistributedDataParallel

        self.ddp = model if isinstance(model, DistributedDataParallel) else None
        self.due = self.ddp is not None and ddp_buffers_due(self.ddp)

    def before_attempt(self) -> None:
        if self.ddp is None:
            return
        if self.due:
            sync_ddp_buffers(self.ddp)
        set_ddp_buffers_due(self.ddp, False)

    def after_step(self) -> None:
        if self.ddp is not None:
            set_ddp_buffers_due(self.ddp, True)
