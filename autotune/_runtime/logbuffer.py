"""Buffer ``LightningModule.log`` calls made by micro-batches and commit one weighted value per key.

A failed attempt's calls are discarded, so a replay does not count twice in epoch means. A successful step logs
each key once, as if the whole batch had gone through at once. Means are weighted by micro-batch size (or by the
``batch_size`` the user passed), sums add up, max and min take the extreme. Metric objects (torchmetrics) are
passed through from the last call; the engine rolls their state back after a failed attempt (``MetricStates``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from autotune._compat.lightning import current_hook_name, set_current_hook_name

_MEAN = ("mean", "avg")


def _reduce_name(reduce_fx: Any) -> str:
    if isinstance(reduce_fx, str):
        return reduce_fx.lower()
    for name, fn in (("mean", torch.mean), ("sum", torch.sum), ("max", torch.max), ("min", torch.min)):
        if reduce_fx is fn:
            return name
    return "other"


def _combine(values: list[Any], weights: list[float], reduce_fx: Any) -> Any:
    last = values[-1]
    if not all(isinstance(v, (Tensor, int, float)) and not isinstance(v, bool) for v in values):
        return last  # Metric objects and anything else: the last call wins
    how = _reduce_name(reduce_fx)
    if how in _MEAN:
        total = sum(weights)
        combined = sum(v * (w / total) for v, w in zip(values, weights))
    elif how == "sum":
        combined = sum(values)
    elif how in ("max", "min"):
        tensors = [v for v in values if isinstance(v, Tensor)]
        if not tensors:
            return max(values) if how == "max" else min(values)
        if any(t.numel() != 1 for t in tensors):
            return last  # not a scalar: ``log`` itself says so
        # Compared on the values' device: reading each to the host would wait for the device once a step.
        dtype = tensors[0].dtype
        for v in values:  # every value, numbers too: 2.5 beside an int tensor is not cut to 2
            dtype = torch.promote_types(dtype, v.dtype if isinstance(v, Tensor) else torch.result_type(tensors[0], v))
        stacked = torch.stack([torch.as_tensor(v.detach() if isinstance(v, Tensor) else v, dtype=dtype,
                                               device=tensors[0].device).reshape(()) for v in values])
        combined = stacked.max() if how == "max" else stacked.min()
    else:
        return last
    return combined


def _weights(calls: list[dict[str, Any]]) -> tuple[list[float], Any]:
    """Weigh the micro-batches' calls of one key in their committed mean, and give that call's batch size.

    The batch size is what an epoch mean weighs the step by: the samples that logged, as if they had been one batch.
    A ``batch_size`` equal to each call's micro-batch size (``len(x)``), or none (Lightning's inference), is that.
    One that varies otherwise is the user's weight (a token count): it weighs and adds up. A constant one that is not
    the micro-batch size (a fixed figure of the user's) is kept as the step's, each call weighted by its samples.
    """
    samples = [float(c["_n"]) for c in calls]
    given = [samples[i] if c.get("batch_size") is None else float(c["batch_size"]) for i, c in enumerate(calls)]
    if given == samples:
        return samples, int(sum(samples))
    if len(set(given)) > 1:
        total = sum(given)
        return given, int(total) if total.is_integer() else total
    return samples, next(c["batch_size"] for c in calls if c.get("batch_size") is not None)


class LogBuffer:
    """Wraps a ``log`` function; between :meth:`start` and :meth:`flush` calls are recorded, not made."""

    def __init__(self, log_fn: Callable[..., Any], owner: Any = None) -> None:
        self.log_fn = log_fn
        self.owner = owner  # the LightningModule: its current hook name is recorded with each call
        self._signature = inspect.signature(log_fn)
        self._names = [name for name, p in self._signature.parameters.items()
                       if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        self.active = False
        self.n: int | None = 1
        self._records: dict[tuple[Any, str], list[dict[str, Any]]] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        if not self.active:
            self.log_fn(*args, **kwargs)
            return
        if len(args) <= len(self._names) and not kwargs.keys() & self._names[: len(args)]:
            arguments = dict(zip(self._names, args), **kwargs)  # what bind() gives, without its cost (~30 us a call)
        else:
            arguments = dict(self._signature.bind(*args, **kwargs).arguments)  # raises as log() itself would
        arguments["_n"] = self.n
        fx = current_hook_name(self.owner)
        self._records.setdefault((fx, arguments["name"]), []).append(arguments)

    def start(self) -> None:
        self.active = True
        self.n = None  # samples of the micro-batch running; None: a call stands for the whole step, made as it is
        self._records = {}

    def discard(self) -> None:
        self.active = False
        self._records = {}

    def flush(self, *, parts: int = 1) -> None:
        """Make the recorded calls, one per key and hook, each from the hook that made it; ``parts``: how many
        micro-batches the step ran (each committed call then carries the samples it stands for as its batch size)."""
        self.active = False
        records, self._records = self._records, {}
        if not records:
            return
        owner = self.owner
        previous = current_hook_name(owner)
        try:
            for (fx, _), calls in records.items():
                if owner is not None:
                    set_current_hook_name(owner, fx)
                arguments = {k: v for k, v in calls[-1].items() if k != "_n"}
                if (len(calls) > 1 or parts > 1) and all(c["_n"] is not None for c in calls):
                    weights, arguments["batch_size"] = _weights(calls)
                    if len(calls) > 1:
                        reduce_fx = arguments.get("reduce_fx", "mean")
                        arguments["value"] = _combine([c["value"] for c in calls], weights, reduce_fx)
                self.log_fn(**arguments)
        finally:
            if owner is not None:
                set_current_hook_name(owner, previous)
