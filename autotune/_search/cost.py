"""Price what a plan's settings cost in time, in one place for the two uses the search makes of it.

- :func:`predicted_cost` orders the first trials (the plans predicted to fit, cheapest first) by relative seconds
  per sample.
- :func:`simplicity` orders plans by the work they add to a step and the features they depend on. Among plans whose
  measured throughputs cannot be told apart, the search chooses the simplest (``choose.py``). The plainest choice of
  each dimension makes the plan halving would find (``halving.py``).

The factors are what is known to cost time whatever the model:

- Recomputation: checkpointing a share ``c`` of the blocks runs that share of the forward again, about ``c / 3`` of
  a step's FLOPs (a backward costs about two forwards).
- Offload: activations over PCIe 1.25, the optimizer step on the host 1.5 (FSDP2's ``cpu_offload`` too: its update
  runs on the host). Low-bit optimizer state 1.05 (a slower update of the same bytes).
- Micro-batch ``m`` (first trials only): a step of ``B`` samples runs ``ceil(B / m)`` forward/backward passes. Each
  has a fixed cost (kernel launches, Python, hooks) of about one sample's compute: ``1 + ceil(B / m) / B``.
- Precision on CUDA (first trials only): 16-bit matmuls run on tensor cores at about twice TF32's rate (0.5;
  bf16-true also halves the optimizer's traffic, 0.45). On CPU precision is not modelled (most CPUs have no fast
  16-bit matmul, those with AMX do; autocast adds casts).

Work is what a plan adds to a plain step (:data:`WORK_FIELDS`). Features (:data:`FEATURES`) add no computation but
are one more thing a run depends on (a compiler, worker processes, FP8 kernels, an allocator mode, sharding). The
precision and the micro-batch are neither: every plan has one of each.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from autotune._plan.plan import Plan

__all__ = ["FEATURES", "WORK_FIELDS", "added_work", "features", "predicted_cost", "simplicity", "what_it_adds"]

#: Recomputing a share ``c`` of the blocks costs about ``c * RECOMPUTE`` of a step (one more forward of that share).
RECOMPUTE = 1 / 3
ACTIVATION_OFFLOAD = 1.25
OPTIMIZER_OFFLOAD = 1.5
LOW_BIT_STATE = 1.05
_CUDA_PRECISION = {"32-true": 1.0, "bf16-mixed": 0.5, "16-mixed": 0.5, "bf16-true": 0.45, "transformer-engine": 0.5}
#: The plan fields whose settings add work to a step.
WORK_FIELDS = ("activation_checkpointing", "activation_offload", "optimizer_offload", "cpu_offload", "optimizer_state")
#: The plan fields that add a feature when set (``num_workers``: above 0; ``strategy``: FSDP2's sharding).
FEATURES = ("compile", "compile_memory_budget", "float8", "expandable_segments", "num_workers", "pin_memory",
            "strategy")


def checkpointed_share(value: Any) -> float:
    """The share of blocks recomputed: the fraction, or 1.0 for a list of module class names (every match)."""
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    if isinstance(value, (int, float)):
        return float(value)
    return 1.0 if value else 0.0


def added_work(fields: Mapping[str, Any]) -> float:
    """How many times a plain step's time a plan's work costs (recomputation, offload, low-bit state): 1.0 for a
    plan that adds none. ``fields``: a plan's dict form (:meth:`Plan.to_dict`), or any of its fields.

    Example:
        >>> added_work({}), added_work({"activation_checkpointing": 1.0, "optimizer_state": "8bit"})
        (1.0, 1.4)
    """
    cost = 1 + checkpointed_share(fields.get("activation_checkpointing")) * RECOMPUTE
    if fields.get("activation_offload"):
        cost *= ACTIVATION_OFFLOAD
    if fields.get("optimizer_offload") or fields.get("cpu_offload"):
        cost *= OPTIMIZER_OFFLOAD
    if fields.get("optimizer_state") not in (None, "full"):
        cost *= LOW_BIT_STATE
    return round(cost, 6)  # equal work compares equal whatever the order of the factors


def features(fields: Mapping[str, Any]) -> tuple[str, ...]:
    """The :data:`FEATURES` a plan turns on.

    Example:
        >>> features({"compile": True, "num_workers": 0, "pin_memory": None, "strategy": "fsdp"})
        ('compile', 'strategy')
    """
    def on(name: str) -> bool:
        value = fields.get(name)
        if name == "num_workers":
            return bool(value)  # 0 or None: the main process loads
        if name == "strategy":
            return value == "fsdp"  # DDP is how a data-parallel run goes; FSDP2 adds the sharding's gathers
        return value is not None and value is not False

    return tuple(name for name in FEATURES if on(name))


def simplicity(fields: Mapping[str, Any]) -> tuple[float, int]:
    """The order of plans by what they do besides a plain step: the work they add (:func:`added_work`), then how
    many features they turn on; smaller is simpler.

    Example:
        >>> simplicity({"num_workers": 1}) < simplicity({"activation_checkpointing": 0.5}) < \\
        ...     simplicity({"activation_checkpointing": 1.0})
        True
    """
    return added_work(fields), len(features(fields))


def what_it_adds(fields: Mapping[str, Any], over: Mapping[str, Any]) -> list[str]:
    """The work and features ``fields`` has that ``over`` has not, in words (``ckpt 1.0``, ``compile``, ...).

    Example:
        >>> what_it_adds({"activation_checkpointing": 1.0, "num_workers": 1}, {"activation_checkpointing": 0.0})
        ['ckpt 1.0', 'num_workers 1']
    """
    out = []
    for name in (*WORK_FIELDS, *FEATURES):
        value = fields.get(name)
        if name in WORK_FIELDS and added_work({name: value}) > added_work({name: over.get(name)}):
            out.append(f"ckpt {value if not isinstance(value, (list, tuple)) else '+'.join(value)}"
                       if name == "activation_checkpointing" else
                       f"{value} state" if name == "optimizer_state" else name.replace("_", " "))
        elif name in FEATURES and name in features({name: value}) and name not in features({name: over.get(name)}):
            out.append(name if value is True else f"{name} {value}")
    return out


def predicted_cost(plan: Plan, *, batch_size: int, device_type: str) -> float:
    """Relative seconds per sample of ``plan`` (only comparisons between plans of one search mean anything).

    Example:
        >>> fast = predicted_cost(Plan(micro_batch_size=16), batch_size=32, device_type="cuda")
        >>> slow = predicted_cost(Plan(micro_batch_size=16, activation_checkpointing=1.0), batch_size=32,
        ...                       device_type="cuda")
        >>> fast < slow
        True
    """
    micro = min(plan.micro_batch_size or batch_size, batch_size)
    cost = added_work(plan.to_dict()) * (1 + -(-batch_size // micro) / batch_size)  # ceil(B / m) passes of B
    if device_type == "cuda":
        cost *= _CUDA_PRECISION.get(plan.precision, 1.0)
    return cost
