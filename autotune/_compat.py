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
