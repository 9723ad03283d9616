"""Sharding a model with FSDP2 (``fully_shard``) the way a plan says: the repeated blocks, then one root."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from autotune._transforms.blocks import find_blocks

log = logging.getLogger("autotune")


class ShardingError(ValueError):
    """A model the automatic sharding cannot shard correctly; the message says why and what to do."""


def sharding_units(model: nn.Module) -> tuple[list[nn.Module], nn.Module]:
    """The modules to shard: the repeated blocks (as activation checkpointing finds them), then a root.

    The root holds every parameter outside the blocks: the one child of ``model`` that holds all of them (a
    LightningModule whose ``self.model`` is the network), else ``model`` itself (its forward must then be what the
    training step calls: ``self(x)``). FSDP2 gathers a unit's parameters in that unit's forward hooks, so each unit
    must be a module that is called.

    Example:
        >>> class Block(nn.Sequential): ...
        >>> net = nn.Sequential(nn.Embedding(10, 4), *[Block(nn.Linear(4, 4), nn.ReLU()) for _ in range(2)])
        >>> blocks, root = sharding_units(net)
        >>> len(blocks), root is net
        (2, True)
    """
    blocks = find_blocks(model)
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    rest = [name for name, p in model.named_parameters() if id(p) not in in_blocks]
    heads = {name.split(".", 1)[0] for name in rest}
    root = model
    if len(heads) == 1 and "." in rest[0]:
        child = getattr(model, rest[0].split(".", 1)[0])
        if all(b is child or any(m is b for m in child.modules()) for b in blocks):
            root = child  # the network inside the LightningModule holds the blocks and the other parameters
    return blocks, root


def shard_model(
    model: nn.Module, *, mesh: Any, reshard_after_forward: bool, param_dtype: torch.dtype | None, cpu_offload: bool
) -> list[nn.Module]:
    """``fully_shard`` each repeated block of ``model``, then its root (see :func:`sharding_units`); returns the
    sharded modules, root last. Already sharded: nothing is done (Lightning calls ``configure_model`` per stage).

    ``param_dtype`` (bf16 for ``bf16-mixed``) is FSDP2's mixed-precision policy: parameters are gathered and used in
    that dtype, gradients reduced in fp32, the sharded parameters and the optimizer stay fp32.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if any(isinstance(m, FSDPModule) for m in model.modules()):
        return [m for m in model.modules() if isinstance(m, FSDPModule)]
    blocks, root = sharding_units(model)
    options: dict[str, Any] = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype,
                                          reduce_dtype=torch.float32 if param_dtype is not None else None),
        "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
    }
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward, **options)
    # None for the root: FSDP2 then keeps the root's parameters gathered after forward (they are used first in
    # backward), and reshards the others (its default).
    fully_shard(root, reshard_after_forward=None if reshard_after_forward else False, **options)
    log.info("autotune: sharded %d block(s) of %s and the root %s with FSDP2", len(blocks),
             type(blocks[0]).__name__ if blocks else "-", type(root).__name__)
    return [*blocks, root]
