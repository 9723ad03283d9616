"""Every use of private upstream API (torch, Lightning, torchao, Optuna), each with what breaks if it changes."""

from __future__ import annotations

from typing import Any


def tensor_version(tensor: Any) -> int:
    """The tensor's version counter, bumped by every in-place change (``Tensor._version``, what autograd checks
    saved tensors with). If it went away, ``update_fingerprint`` could not tell an untouched update from a changed
    one: an OOM inside a steady-state update would then always end the run instead of replaying."""
    return int(tensor._version)


def set_cuda_allocator_settings(settings: str) -> None:
    """Change the CUDA caching allocator's settings at run time (``torch.cuda.memory._set_allocator_settings``, the
    run-time form of ``PYTORCH_CUDA_ALLOC_CONF``; the allocator applies ``expandable_segments`` to the segments it
    makes afterwards). If it went away, ``ApplyPlan(expandable_segments=True)`` would fail at setup: the public
    alternative is the environment variable, read once when CUDA starts, before any callback runs."""
    import torch

    torch.cuda.memory._set_allocator_settings(settings)


def outside_dispatch_modes() -> Any:
    """A context where no Python dispatch mode (fake tensors, the estimator's memory tracker) is active, so real
    tensors can be made and real kernels run (``torch.utils._python_dispatch._disable_current_modes``). If it went
    away, the estimator could not measure kernel work buffers while it traces a step on fake tensors."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def conv_backend_name(x: Any, weight: Any, rest: Any) -> str:
    """The convolution backend ATen picks for these arguments (``torch._C._select_conv_backend``: "Slow2d",
    "Mkldnn", ...). If it went away or renamed its backends, CPU convolutions would count no work buffer."""
    import torch

    return str(getattr(torch._C._select_conv_backend(x, weight, None, *rest, None), "name", ""))
