"""Gradient synchronisation during micro-batches (DDP's ``no_sync``), and the FSDP2 units of a model."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


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
