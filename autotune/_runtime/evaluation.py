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


class EvalSteps:
    """The engine's evaluation steps (a part of :class:`autotune._runtime.microbatch.ElasticEngine`, which holds the
    state they use: the split per stage, the logs, the meter, the ranks' agreement)."""

    eval_micro_batch_size: dict[str, int]
    logs: Any
    meter: Any
    agree: Any
    sharded: bool
    budget_text: str | None
    device: torch.device
    _metric_states: Callable[[torch.nn.Module], Any]
    _record: Callable[..., None]

    def run_eval_step(self, stage: str, step: Callable[..., Any], batch: Any, args: tuple, kwargs: dict,
                      module: torch.nn.Module) -> Any:
        """Run an evaluation step, splitting its batch after an OOM; the training micro-batch is not touched."""
        n = batch_size_of(batch)
        rng = RNGState()
        metrics = self._metric_states(module)
        while True:
            micro = min(self.eval_micro_batch_size.get(stage, n or 1), n or 1)
            sizes = split_sizes(n, micro) if n else [1]
            self.logs.start()
            try:
                outputs, start = [], 0
                for size in sizes:
                    part = batch if len(sizes) == 1 else slice_batch(batch, start, start + size, n)
                    self.logs.n = size
                    outputs.append(step(part, *args, **kwargs))
                    start += size
            except BaseException as exc:
                self.logs.discard()
                if not is_oom_error(exc):
                    raise
                if self.sharded and self.agree.enabled:
                    raise OutOfMemoryAtMinimumError(_SHARDED_EVAL_OOM.format(stage=stage)) from exc
                if not n or micro <= 1:
                    raise OutOfMemoryAtMinimumError(
                        f"Out of memory in {stage} at the smallest evaluation split: batch size {n}, micro-batch "
                        f"{micro}, budget {self.budget_text or 'none (no cap)'}, peak "
                        f"{format_bytes(self.meter.peak())}."
                    ) from exc
                smaller = micro // 2
            else:
                self.logs.flush(parts=len(sizes))
                return combine_outputs(outputs, sizes)
            outputs = []
            release_memory((), self.device)
            rng.restore()
            metrics.restore()
            self.eval_micro_batch_size[stage] = smaller
            self._record("eval_oom", module.trainer.global_step, micro, smaller, where=stage, batch_size=n or 1)
