"""Gradient synchronisation during micro-batches: DDP's ``no_sync``, FSDP2's ``set_requires_gradient_sync``."""

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
def gradient_sync(model: torch.nn.Module | None, *, sync: bool) -> Iterator[None]:
    """Run a forward and backward with the data-parallel gradient reduction on or off.

    DDP (a model with ``no_sync``): off is ``no_sync()``, on changes nothing. FSDP2: off sets every wrapped module's
    ``set_requires_gradient_sync(False)`` (gradients accumulate unsharded, no reduce-scatter) and puts it back on
    after; on leaves the reduce-scatter of the backward in place. Anything else: nothing to do.
    """
    if model is None or sync:
        yield
        return
    if hasattr(model, "no_sync"):
        with model.no_sync():
            yield
        return
    sharded = fsdp_modules(model)
    for module in sharded:
        module.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for module in sharded:
            module.set_requires_gradient_sync(True, recurse=False)
