"""A rank's model state under FSDP2 (``Plan(strategy="fsdp")``), in closed form from the traced model.

FSDP2 shards every parameter on dim 0 over the ranks, each rank holding ``ceil(rows / world_size)`` rows (the last
ranks' shards are padded to that size), and its gradient and optimizer state alike. On top of the shards a rank
holds the parameters of the units it has gathered. These are the root's (gathered for the whole step) and, ZeRO-3
style, the running block's and the next one's (prefetched). ZeRO-2 style (``reshard_after_forward=False``) every
block stays gathered from its forward to its backward.

Gathered parameters are in the dtype the step was traced in: bf16 under bf16-mixed, FSDP2's mixed-precision policy.
The shards (parameters, gradients, state) keep the fp32 master dtype given as ``master_dtype``. Under that policy each
unit also casts its floating-point inputs to bf16 (``cast_forward_inputs``, :func:`cast_unit_inputs`), so what passes
between units is bf16.

A backward makes the unsharded gradient of one unit at a time (in the reduce dtype) and its reduce-scatter input. Both
are counted for the largest unit, at a peak in the backward only. The gradient shards alive at a peak are the traced
share of the whole model's gradients (:meth:`RankState.at_peak`). That is all of the last step's in the forward, none at
the start of a backward (Lightning's ``zero_grad`` sits between the two). With ``cpu_offload`` the shards (parameters,
gradients, state) are on the host and the update runs there.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autotune._transforms.shard import sharding_units


@dataclass(frozen=True)
class RankState:
    """One rank's bytes of each model-state category at the step's peak, and what of it is gathered units."""

    parameters: int  # shards, plus the gathered units' parameters
    gradients: int  # shards, plus one unit's unsharded gradient and its reduce-scatter input (in a backward)
    optimizer_state: int  # shards (0-dim state such as Adam's step is whole)
    gathered: int  # of parameters + gradients: the gathered units (not model state)
    host: int  # the shards cpu_offload keeps on the host
    unit_gradients: int = 0  # of gradients and gathered: the unsharded gradient and reduce-scatter input

    def at_peak(self, *, traced_gradients: int, whole_gradients: int, backward: bool) -> RankState:
        """This state at a peak of the trace: of the gradient shards, the share of the whole model's gradients the
        trace held then (the last step's in the forward, those made so far in a backward), and one unit's unsharded
        gradient and reduce-scatter input in a backward only."""
        shards = self.gradients - self.unit_gradients
        held = round(shards * min(1.0, traced_gradients / whole_gradients)) if whole_gradients else 0
        units = self.unit_gradients if backward else 0
        return dataclasses.replace(self, gradients=held + units, gathered=self.gathered - self.unit_gradients + units,
                                   unit_gradients=units)


def shard_numel(tensor: torch.Tensor, world_size: int) -> int:
    """Values in one rank's shard of ``tensor``: dim 0 cut in ``world_size`` padded chunks; a 0-dim tensor whole."""
    if tensor.dim() == 0:
        return 1
    return math.ceil(tensor.shape[0] / world_size) * math.prod(tensor.shape[1:])


def shard_bytes(tensor: torch.Tensor, world_size: int, dtype: torch.dtype | None = None) -> int:
    """Bytes of one rank's shard of ``tensor`` in ``dtype`` (default its own) (see :func:`shard_numel`)."""
    width = torch.empty((), dtype=dtype).element_size() if dtype is not None else tensor.element_size()
    return shard_numel(tensor, world_size) * width


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
                     optimizer_state=state_shards, gathered=gathered + unit_grads, host=host,
                     unit_gradients=unit_grads)


def cast_unit_inputs(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast the floating-point inputs of each unit FSDP2 shards (the blocks and the root) to ``dtype`` when it is
    called, as ``MixedPrecisionPolicy(param_dtype=dtype)`` does (its ``cast_forward_inputs``); for a traced copy."""
    from lightning.fabric.utilities.apply_func import apply_to_collection

    def cast(module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        def to(t: torch.Tensor) -> torch.Tensor:
            return t.to(dtype) if t.is_floating_point() else t

        return apply_to_collection(args, torch.Tensor, to), apply_to_collection(kwargs, torch.Tensor, to)

    blocks, root = sharding_units(model)
    for unit in (*blocks, root):
        unit.register_forward_pre_hook(cast, with_kwargs=True)
