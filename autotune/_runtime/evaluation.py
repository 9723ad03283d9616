"""Evaluation steps under :class:`autotune.callbacks.ElasticBatchSize`: a validation, test or predict batch that runs
out of memory is split and run again; the training micro-batch is not touched.

Under DDP, where every rank runs the same number of steps in the loop (Lightning's DistributedSampler pads the ranks
to equal shares; the ranks agree on it once as the loop starts), each attempt at an evaluation step ends in the ranks'
vote (:mod:`autotune._runtime.agreement`) and a collective the step makes (``self.all_gather`` in
``validation_step``, a metric synced on step) is preceded by the guard, as in training. A rank that runs out of memory
is then never alone in running its step again: every rank does, the failed one at a smaller split, so their
collectives meet (they run equal counts of parts once a step is seen to make collectives); without the vote the peer
waited in the loop's end until the process group's timeout. Where the ranks' counts differ (a loader of each rank's
own), the loop runs as before: a step is split on its own rank only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from autotune._device.budget import format_bytes
from autotune._device.oom import OutOfMemoryAtMinimumError, is_oom_error
from autotune._runtime.agreement import HEADER, Failure, PeerOutOfMemory
from autotune._runtime.batch import batch_size_of, combine_outputs, slice_batch, split_even, split_sizes
from autotune._runtime.events import _COUNTS_DIFFER, _DIFFERENT_SPLITS, _SHARDED_EVAL_OOM
from autotune._runtime.state import RNGState, release_memory


def loop_votes(engine: Any, batches: list[float]) -> bool:
    """Whether the evaluation loop that starts, of ``batches`` steps per dataloader on this rank, votes its steps:
    under DDP where every rank's loop has the same number of steps (one small all-reduce, on every rank alike)."""
    if not engine.agree.enabled or engine.sharded:
        return False
    total = float(sum(batches)) if all(b != float("inf") for b in batches) else -1.0  # -1: no length
    high, negated_low = engine.agree.max(total, -total)
    return total >= 0 and high == -negated_low


def run_eval_step(engine: Any, stage: str, step: Callable[..., Any], batch: Any, args: tuple, kwargs: dict,
                  module: torch.nn.Module) -> Any:
    """Run an evaluation step of ``engine``'s fit, splitting its batch after an OOM (the split sticks for the
    ``stage``: the policy keeps it); the training micro-batch is not touched. Where the loop votes
    (``engine.eval_votes``) every rank runs each attempt and learns the others' failures. Under FSDP2 an OOM ends
    the run."""
    policy, agree = engine.policy, engine.agree
    voted = engine.eval_votes
    n = batch_size_of(batch)
    rng = RNGState()
    states = engine._metric_states(module, training=False)
    left_before = False
    while True:
        micro = policy.eval_micro(stage, n) if n else 1
        sizes = _split(engine, n, micro) if voted else split_sizes(n, micro) if n else [1]
        engine.logs.start()
        outputs: list[Any] = []
        own, left = False, False
        window = engine.guard.window(lambda: agree.guard(engine.logs.n or 0)) if voted else contextlib.nullcontext()
        try:
            with window:
                start = 0
                for size in sizes:
                    part = batch if len(sizes) == 1 else slice_batch(batch, start, start + size, n)
                    engine.logs.n = size
                    outputs.append(step(part, *args, **kwargs))
                    start += size
        except PeerOutOfMemory as exc:  # at a guard: a peer failed (or left its parts), and will not join
            left = exc.left
        except BaseException as exc:
            if not is_oom_error(exc):
                engine.logs.discard()
                raise
            if engine.sharded and agree.enabled:
                engine.logs.discard()
                raise OutOfMemoryAtMinimumError(_SHARDED_EVAL_OOM.format(stage=stage)) from exc
            own = True
        # Out of the except blocks: their tracebacks hold the failed attempt's activations.
        at_floor = own and micro <= 1
        peak = engine.meter.peak() if own else 0
        if voted:
            verdict = agree.vote(Failure(own, at_floor, micro, "", peak), left=left, batch_size=n)
            engine.eval_counts_agree = engine.eval_counts_agree or verdict.collectives
            replay, floor_rank = verdict.replay, verdict.floor_rank
            if floor_rank is None and verdict.left:
                if left_before:
                    engine.logs.discard()
                    raise RuntimeError(_COUNTS_DIFFER)
                left_before = True
        else:
            replay, floor_rank = own, (0 if at_floor else None)
        if not replay and floor_rank is None:
            engine.logs.flush(parts=len(sizes))
            return combine_outputs(outputs, sizes)
        engine.logs.discard()
        outputs = []
        if floor_rank is not None:
            where = f" on rank {floor_rank}" if voted else ""
            floor_micro, floor_peak = (micro, peak) if own else (verdict.floor_micro, verdict.floor_peak)
            raise OutOfMemoryAtMinimumError(
                f"Out of memory in {stage}{where} at the smallest evaluation split: batch size {n}, micro-batch "
                f"{floor_micro}, budget {policy.memory.budget_text or 'none (no cap)'}, peak "
                f"{format_bytes(floor_peak)}.")
        if own:
            policy.after_eval_oom(stage, micro, step=module.trainer.global_step, n=n or 1)
        release_memory((), engine.device)
        rng.restore()
        states.restore()


def _split(engine: Any, n: int, micro: int) -> list[int]:
    """A voted attempt's parts: ``micro`` at a time, or, once a step was seen to make collectives, the largest count
    any rank wants, this rank's batch split evenly into it (a collective whose size follows the part agrees)."""
    engine.agree.start_attempt(HEADER)
    sizes = split_sizes(n, micro) if n else [1]
    if not engine.eval_counts_agree:
        return sizes
    count = int(engine.agree.max(float(len(sizes)))[0])
    if count > max(n, 1):
        raise RuntimeError(_DIFFERENT_SPLITS)
    return split_even(n, count) if n else [1]
