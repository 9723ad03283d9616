"""What each repeated block recomputes under ``activation_checkpointing="auto"``: the levels, and the selective
policy of the ``"ops"`` level (torch's ``create_selective_checkpoint_contexts``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

__all__ = ["RECOMPUTE_LEVELS", "SAVED_OPS", "levelled_blocks", "save_products", "selective_contexts"]

#: What a block recomputes, least first: nothing, its pointwise operators (matrix products and attention saved),
#: all of it.
RECOMPUTE_LEVELS = ("none", "ops", "block")


def _saved_ops() -> frozenset[Any]:
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "convolution", "_convolution",
             "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward",
             "_efficient_attention_forward", "_grouped_mm")
    return frozenset(getattr(aten, name).default for name in names if hasattr(aten, name))


#: The operators the ``"ops"`` level saves: matrix products, convolutions and fused attention (the costly ones per
#: byte they make); everything else a block runs (norms, activations, dropout, residual adds, reshapes) recomputes.
#: Dropout and other random operators always recompute: ``checkpoint`` restores the random state before the
#: recompute, and the saved operators draw no random numbers, so each random operator draws what it drew forward.
SAVED_OPS = _saved_ops()


def save_products(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The ``"ops"`` level's policy: save the outputs of :data:`SAVED_OPS`, recompute the rest. Fused attention with
    dropout (a random operator) recomputes too, so that the random state it draws stays in order."""
    if op in SAVED_OPS and not (op in _ATTENTION and _dropout(args, kwargs)):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


_ATTENTION = frozenset(op for op in SAVED_OPS if "attention" in str(op))


def _dropout(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    p = kwargs.get("dropout_p", args[3] if len(args) > 3 and isinstance(args[3], float) else 0.0)
    return bool(p)


def selective_contexts() -> tuple[Any, Any]:
    """``checkpoint``'s ``context_fn`` for the ``"ops"`` level: the forward's and the recompute's contexts."""
    return create_selective_checkpoint_contexts(save_products)


def levelled_blocks(blocks: Sequence[nn.Module], levels: Sequence[str]) -> tuple[list[nn.Module], list[nn.Module]]:
    """The blocks a plan's ``recompute`` levels checkpoint, and those of them that recompute their pointwise operators
    only (level ``"ops"``). ``blocks``: the model's repeated blocks in module order, one per level.

    Raises:
        ValueError: when the levels are not one per block (a tuned file for another model, or a changed model).

    Example:
        >>> a, b, c = nn.Linear(1, 1), nn.Linear(1, 1), nn.Linear(1, 1)
        >>> levelled_blocks([a, b, c], ["block", "none", "ops"]) == ([a, c], [c])
        True
    """
    if len(levels) != len(blocks):
        raise ValueError(f"recompute has {len(levels)} levels but the model has {len(blocks)} repeated blocks; "
                         "choose again for this model (autotune estimate, or a search with activation_checkpointing: "
                         "auto)")
    chosen = [b for b, level in zip(blocks, levels) if level != "none"]
    return chosen, [b for b, level in zip(blocks, levels) if level == "ops"]
