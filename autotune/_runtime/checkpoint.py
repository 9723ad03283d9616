"""The elastic callback's checkpointed state under several ranks: every rank's own (micro-batch, shape model,
events), gathered when Lightning saves (on every rank at once; rank 0 writes) and each rank's part restored."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn


def gathered(state: dict[str, Any], *, several: bool) -> dict[str, Any]:
    """``state``, or under ``several`` ranks every rank's, as ``{"per_rank": [...]}`` (a collective: every rank)."""
    if not several:
        return state
    import torch.distributed as dist

    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, state)
    return {"per_rank": states}


def own(state: dict[str, Any], *, rank: int, world: int) -> dict[str, Any]:
    """This rank's part of a saved state; a checkpoint of another world size starts every rank fresh, saying so
    (an old checkpoint, rank 0's state only, is every rank's as before)."""
    if "per_rank" not in state:
        return state
    states = state["per_rank"]
    if len(states) != world:
        rank_zero_warn(f"ElasticBatchSize: the checkpoint holds the state of {len(states)} ranks and this run has "
                       f"{world}; every rank starts fresh (its micro-batch from the settings, no learned shapes).")
        return {}
    return dict(states[rank])
