"""Every use of private upstream API (torch, Lightning, torchao, Optuna), each with what breaks if it changes."""

from __future__ import annotations

from typing import Any


def tensor_version(tensor: Any) -> int:
    """The tensor's version counter, bumped by every in-place change (``Tensor._version``, what autograd checks
    saved tensors with). If it went away, ``update_fingerprint`` could not tell an untouched update from a changed
    one: an OOM inside a steady-state update would then always end the run instead of replaying."""
    return int(tensor._version)
