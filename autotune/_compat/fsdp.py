"""Private FSDP2 API (``torch.distributed.fsdp``'s ``fully_shard`` state) that autotune uses, each access with what
breaks if it changes: its collectives, its roots and its unsharded gradients, for replaying an FSDP2 step after an
OOM."""

from __future__ import annotations

from typing import Any


def fsdp_comms(module: Any) -> tuple[Any, Any] | None:
    """The all-gather and reduce-scatter an FSDP2 unit issues its collectives through (``FSDPParamGroup.
    _all_gather_comm`` / ``_reduce_scatter_comm`` of its ``_get_fsdp_state()._fsdp_param_groups``), or None for a
    unit without parameters. ``ElasticBatchSize`` wraps them to record each call (the public setters
    ``set_custom_all_gather`` / ``set_custom_reduce_scatter`` install the wrappers; torch has no public getter), so
    a communication the user installed keeps doing the work. If these moved, FSDP2 runs would fail at their first
    step with an AttributeError, and OOMs under FSDP2 could not be replayed."""
    groups = module._get_fsdp_state()._fsdp_param_groups
    if not groups:
        return None
    return groups[0]._all_gather_comm, groups[0]._reduce_scatter_comm


def fsdp_is_root(module: Any) -> bool:
    """Whether an FSDP2 unit is a root (``_get_fsdp_state()._is_root``: set at the first forward, True for the units
    forwarded first, which need not be the outermost: a LightningModule whose ``training_step`` calls a submodule is
    never forwarded). Public ``reset_iter_state()`` must be called on exactly these; torch has no public test. If it
    went away, the FSDP2 replay would fail at its first OOM with an AttributeError."""
    return module._get_fsdp_state()._is_root is True


def clear_fsdp_unsharded_grads(module: Any) -> None:
    """Drop the unsharded gradients an FSDP2 unit holds before its reduce-scatter: a backward that ran out of memory
    leaves them behind, and so does accumulation under ``set_requires_gradient_sync(False)``
    (``FSDPParam._unsharded_param.grad`` and ``FSDPParam.unsharded_accumulated_grad``, the latter when the reduce
    dtype differs from the parameter dtype). Public ``reset_iter_state()`` resets the iteration but keeps them, and
    ``zero_grad`` only reaches the sharded gradients. If they moved, a step replayed after an OOM would add the
    failed attempt's partial gradients to its own: ``test_an_oom_inside_a_units_backward_after_some_of_its_gradients_
    is_replayed_exactly`` (tests/runtime/test_fsdp.py) ends 0.002-0.057 from Lightning's accumulation
    without this, 1e-6 with it."""
    for group in module._get_fsdp_state()._fsdp_param_groups:
        for param in group.fsdp_params:
            unsharded = getattr(param, "_unsharded_param", None)  # absent before the first all-gather
            if unsharded is not None:
                unsharded.grad = None
            param.unsharded_accumulated_grad = None
