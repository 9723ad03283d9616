"""A rank's model state under FSDP2 (``Plan(strategy="fsdp")``), in closed form from the traced model.

FSDP2 shards every parameter on dim 0 over the ranks, each rank holding ``ceil(rows / world_size)`` rows (the last
ranks' shards are padded to that size), and its gradient and optimizer state alike. On top of the shards a rank
holds the parameters of the units it has gathered: the root's (gathered for the whole step) and, ZeRO-3 style, the
running block's and the next one's (prefetched); ZeRO-2 style (``reshard_after_forward=False``) every block stays
gathered from its forward to its backward. Gathered parameters are in the dtype the step was traced in: bf16 under
bf16-mixed, FSDP2's mixed-precision policy, while the shards (parameters, gradients, state) keep the fp32 master
dtype given as ``master_dtype``. A backward makes the unsharded gradient of one unit at a time (in the reduce dtype)
and its reduce-scatter input; both are counted for the largest unit. With ``cpu_offload`` the shards (parameters, gradients, state) are on
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


def shard_bytes(tensor: torch.Tensor, world_size: int, dtype: torch.dtype | None = None) -> int:
    """Bytes of one rank's shard of ``tensor`` in ``dtype`` (default its own): dim 0 cut in ``world_size`` padded
    chunks; a 0-dim tensor whole."""
    width = torch.empty((), dtype=dtype).element_size() if dtype is not None else tensor.element_size()
    if tensor.dim() == 0:
        return width
    rows = math.ceil(tensor.shape[0] / world_size)
    return rows * math.prod(tensor.shape[1:]) * width


def rank_state(model: nn.Module, optimizers: list[Any], *, world_size: int, reshard_after_forward: bool,
               master_dtype: torch.dtype | None, cpu_offload: bool) -> RankState:
    """The model state one of ``world_size`` ranks holds under FSDP2, from the traced model and optimizers (traced in
    the gathered dtype; ``master_dtype``: the shards' dtype when it differs)."""
    params = list({id(p): p for p in model.parameters()}.values())  # tied parameters once
    trained = [p for p in params if p.requires_grad]
    by_param = {id(p): p for p in params}
    param_shards = sum(shard_bytes(p, world_size, master_dtype) for p in params)
    grad_shards = sum(shard_bytes(p, world_size, master_dtype) for p in trained)
    state_shards = 0
    for opt in optimizers:
        per_rank = getattr(opt, "rank_state_bytes", None)  # state not shaped like the parameter (low-bit)
        for p, state in opt.state.items():
            if per_rank is not None:
                state_shards += per_rank(p, world_size, master_dtype)
                continue
            for t in state.values():
                if isinstance(t, torch.Tensor):
                    whole = t.dim() == 0 or id(p) not in by_param or t.shape != p.shape
                    state_shards += t.untyped_storage().nbytes() if whole else shard_bytes(t, world_size, master_dtype)
    blocks, _ = sharding_units(model)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    block_numels = [sum({id(p): p.numel() for p in b.parameters()}.values()) for b in blocks]
    root_numel = sum(p.numel() for p in params if id(p) not in in_blocks)
    width = params[0].element_size() if params else 4  # gathered: the traced dtype
    grad_width = torch.empty((), dtype=master_dtype).element_size() if master_dtype is not None else width
    ordered = sorted(block_numels, reverse=True)
    gathered_numel = root_numel + (sum(ordered[:2]) if reshard_after_forward else sum(ordered))  # running + prefetched
    gathered = gathered_numel * width
    # one unit's unsharded gradient (in the reduce dtype, the master's) and its reduce-scatter input
    unit_grads = 2 * max([root_numel, *block_numels]) * grad_width
    host = param_shards + grad_shards + state_shards if cpu_offload else 0
    if cpu_offload:
        param_shards = grad_shards = state_shards = 0
    return RankState(parameters=param_shards + gathered, gradients=grad_shards + unit_grads,
                     optimizer_state=state_shards, gathered=gathered + unit_grads, host=host)
