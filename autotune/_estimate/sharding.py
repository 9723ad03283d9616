"""A rank's model state under FSDP2 (``Plan(strategy="fsdp")``), in closed form from the traced model.

FSDP2 shards every parameter on dim 0 over the ranks, each rank holding ``ceil(rows / world_size)`` rows (the last
ranks' shards are padded to that size), and its gradient and optimizer state alike. On top of the shards a rank
holds the parameters of the units it has gathered: the root's (gathered for the whole step) and, ZeRO-3 style, the
running block's and the next one's (prefetched); ZeRO-2 style (``reshard_after_forward=False``) every block stays
gathered from its forward to its backward. Gathered parameters are in the compute dtype (bf16 under bf16-mixed, FSDP2's
mixed-precision policy). A backward makes the unsharded gradient of one unit at a time in fp32 and its reduce-scatter
input; both are counted for the largest unit. With ``cpu_offload`` the shards (parameters, gradients, state) are on
the host and the update runs there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autotune._runtime.shard import sharding_units


@dataclass(frozen=True)
class RankState:
    """One rank's bytes of each model-state category at the step's peak, and what of it is gathered units."""

    parameters: int  # shards, plus the gathered units' parameters
    gradients: int  # shards, plus one unit's unsharded gradient and its reduce-scatter input
    optimizer_state: int  # shards (0-dim state such as Adam's step is whole)
    gathered: int  # of parameters + gradients: the gathered units (not model state)
    host: int  # the shards cpu_offload keeps on the host


def shard_bytes(tensor: torch.Tensor, world_size: int) -> int:
    """Bytes of one rank's shard of ``tensor`` (dim 0 cut in ``world_size`` padded chunks; a 0-dim tensor whole)."""
    if tensor.dim() == 0:
        return tensor.element_size()
    rows = math.ceil(tensor.shape[0] / world_size)
    return rows * math.prod(tensor.shape[1:]) * tensor.element_size()


def rank_state(model: nn.Module, optimizers: list[Any], *, world_size: int, reshard_after_forward: bool,
               compute_dtype: torch.dtype | None, cpu_offload: bool) -> RankState:
    """The model state one of ``world_size`` ranks holds under FSDP2, from the traced model and optimizers."""
    params = list({id(p): p for p in model.parameters()}.values())  # tied parameters once
    trained = [p for p in params if p.requires_grad]
    by_param = {id(p): p for p in params}
    param_shards = sum(shard_bytes(p, world_size) for p in params)
    grad_shards = sum(shard_bytes(p, world_size) for p in trained)
    state_shards = 0
    for opt in optimizers:
        for p, state in opt.state.items():
            for t in state.values():
                if isinstance(t, torch.Tensor):
                    whole = t.dim() == 0 or id(p) not in by_param or t.shape != p.shape
                    state_shards += t.untyped_storage().nbytes() if whole else shard_bytes(t, world_size)
    blocks, root = sharding_units(model)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    width = torch.empty((), dtype=compute_dtype).element_size() if compute_dtype is not None else None

    def gathered_bytes(ps: list[nn.Parameter]) -> int:
        return sum(p.numel() * (width or p.element_size()) for p in ps)

    block_bytes = [gathered_bytes(list({id(p): p for p in b.parameters()}.values())) for b in blocks]
    root_bytes = gathered_bytes([p for p in params if id(p) not in in_blocks])
    if reshard_after_forward:
        gathered = root_bytes + sum(sorted(block_bytes, reverse=True)[:2])  # the running block and the prefetched
    else:
        gathered = root_bytes + sum(block_bytes)
    largest = max([root_bytes, *block_bytes]) if params else 0
    unit_grads = 2 * largest * 4 // (width or 4)  # the unit's unsharded fp32 gradient and the reduce-scatter input
    host = param_shards + grad_shards + state_shards if cpu_offload else 0
    if cpu_offload:
        param_shards = grad_shards = state_shards = 0
    return RankState(parameters=param_shards + gathered, gradients=grad_shards + unit_grads,
                     optimizer_state=state_shards, gathered=gathered + unit_grads, host=host)
