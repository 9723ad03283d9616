"""Evaluation steps under :class:`autotune.callbacks.ElasticBatchSize`: a validation, test or predict batch that runs
out of memory is split and run again; the training micro-batch is not touched."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from autotune._device.budget import format_bytes
from autotune._device.oom import OutOfMemoryAtMinimumError, is_oom_error
from autotune._runtime.batch import batch_size_of, combine_outputs, slice_batch, split_sizes
from autotune._runtime.events import _SHARDED_EVAL_OOM
from autotune._runtime.state import RNGState, release_memory


def run_eval_step(engine: Any, stage: str, step: Callable[..., Any], batch: Any, args: tuple, kwargs: dict,
                  module: torch.nn.Module) -> Any:
    """Run an evaluation step of ``engine``'s fit, splitting its batch after an OOM (the split sticks for the
    ``stage``: the policy keeps it); the training micro-batch is not touched. Under FSDP2 an OOM ends the run."""
    policy = engine.policy
    n = batch_size_of(batch)
    rng = RNGState()
    states = engine._metric_states(module, training=False)
    while True:
        micro = policy.eval_micro(stage, n) if n else 1
        sizes = split_sizes(n, micro) if n else [1]
        engine.logs.start()
        try:
            outputs, start = [], 0
            for size in sizes:
                part = batch if len(sizes) == 1 else slice_batch(batch, start, start + size, n)
                engine.logs.n = size
                outputs.append(step(part, *args, **kwargs))
                start += size
        except BaseException as exc:
            engine.logs.discard()
            if not is_oom_error(exc):
                raise
            if engine.sharded and engine.agree.enabled:
                raise OutOfMemoryAtMinimumError(_SHARDED_EVAL_OOM.format(stage=stage)) from exc
            smaller = policy.after_eval_oom(stage, micro, step=module.trainer.global_step, n=n or 1) if n else None
            if smaller is None:
                raise OutOfMemoryAtMinimumError(
                    f"Out of memory in {stage} at the smallest evaluation split: batch size {n}, micro-batch "
                    f"{micro}, budget {policy.memory.budget_text or 'none (no cap)'}, peak "
                    f"{format_bytes(engine.meter.peak())}."
                ) from exc
        else:
            engine.logs.flush(parts=len(sizes))
            return combine_outputs(outputs, sizes)
        outputs = []
        release_memory((), engine.device)
        rng.restore()
        states.restore()
