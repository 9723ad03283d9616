"""What ElasticBatchSize reports: its events and the messages it warns and fails with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autotune._device.budget import format_bytes

_LATER = "Later ones are not warned about again: see the {metric} metric and ElasticBatchSize.events."
#: What the user is told once per kind and fit (rank zero), besides the INFO log line of every event.
_WARN_ONCE = {
    "oom": "ElasticBatchSize: out of memory at step {step} (in the {where}); the step was replayed at micro-batch "
           "{new} (was {previous}). " + _LATER.format(metric="autotune/oom_events"),
    "grow_failed": "ElasticBatchSize: growing the micro-batch to {previous} ran out of memory at step {step}; it "
                   "went back to {new} and waits twice as long before trying again. "
                   + _LATER.format(metric="autotune/oom_events"),
    "eval_oom": "ElasticBatchSize: out of memory in {where}; its batches are now split into micro-batches of {new}. "
                + _LATER.format(metric="autotune/oom_events"),
    "over_budget": "ElasticBatchSize: the step's peak {peak} went over the budget {budget} at micro-batch {previous} "
                   "(step {step}); the next step runs at {new}. "
                   + _LATER.format(metric="autotune/over_budget_events"),
}


_HALF_APPLIED = ("Out of memory inside the optimizer update after it had changed parameters or optimizer state: "
                 "the update is half-applied and cannot be replayed. {why}")
_WHY_STEADY = ("Updates that create optimizer state (the first one, parameters added later) are protected by a host "
               "copy; this one was not, its state already existed. Leave more room for the update's temporaries: "
               "raise the budget, or build the optimizer with foreach=False.")
_COUNTS_DIFFER = (
    "ElasticBatchSize: the ranks made different numbers of collectives inside a step's micro-batches although they ran "
    "equal counts of micro-batches (collectives that depend on the data: experts routed per batch, a layer skipped for "
    "some inputs); their out-of-memory errors cannot be kept in step, and the run stops on every rank.")
_DIFFERENT_SPLITS = (
    "ElasticBatchSize: the ranks got batches of different sizes this step; every rank must see the same batch size "
    "(Lightning's DistributedSampler pads the ranks to equal shares; keep use_distributed_sampler=True or pad a custom "
    "sampler).")
#: Under DDP and FSDP2 a steady-state update's OOM is not replayed, changed or not: the peers applied theirs.
_STEADY_OF_A_RANK = ("Out of memory inside the optimizer update of this rank in a steady-state step (its optimizer "
                     "state existed already, so no host copy protects it): under DDP and FSDP2 it is not replayed, "
                     "whether or not it changed anything here, because the other ranks have applied theirs; they stop "
                     "with it. {why}")
_SHARDED_EVAL_OOM = ("Out of memory in {stage} under FSDP2 (ModelParallelStrategy): evaluation batches are not split "
                     "under FSDP2 (one rank splitting alone would meet its peers' all-gathers out of order); the run "
                     "stops on every rank. Lower the {stage} batch size.")
_UNSEEN = ("Out of memory inside the update of {name}, an optimizer that is neither torch's nor torchao's (nor a "
           "subclass of one): such updates may write parameters through .data or raw pointers, which torch does not "
           "count as changes, so whether it changed anything before it failed cannot be told, and it is not "
           "replayed. {why}")
_NOT_SPLIT = ("ElasticBatchSize: a training batch holds no tensor and no list of numbers or strings to read its "
              "size from, so it is not split and an out-of-memory error in it is not replayed. Give the batch a "
              "tensor of one row per sample (labels, ids), or a list of one item per sample.")
_PASSED_WHOLE = ("ElasticBatchSize: the batch size is {n}, the first dimension of the batch's first tensor; tensors of "
                 "shape {shapes} have another first dimension and go whole into every micro-batch. If the batch is "
                 "sequence-first (length, batch, ...), make it batch-first in the dataloader; shared tensors (class "
                 "weights, one mask for all samples) are right as they are.")
_WHY_OFF = "protect_update=False: no update is protected. Use ElasticBatchSize(protect_update=True)."


@dataclass(frozen=True)
class ElasticEvent:
    """One decision of :class:`~autotune.callbacks.ElasticBatchSize` (its ``events`` list, oldest first).

    ``kind`` is one of:

    - "oom": an out-of-memory error of this rank; the step was replayed at ``micro_batch_size``.
    - "peer_oom": another rank's out-of-memory error; this rank replayed the step at its own micro-batch.
    - "grow": the micro-batch doubled after clean steps. With varying sample sizes, a micro-batch that ran before a
      failure tried again.
    - "grow_failed": the larger micro-batch ran out of memory and went back.
    - "over_budget": a step's peak passed the soft CPU budget; the next step runs smaller.
    - "eval_oom": an evaluation step was split.

    ``step`` is the global step and ``batch_size`` the effective batch. ``previous`` and ``micro_batch_size`` are the
    micro-batch before and after. ``where`` is the phase that failed ("closure": forward or backward, "update": the
    optimizer step; for "eval_oom" the stage). ``peak_bytes`` is the step's peak when known.

    Example:
        >>> ElasticEvent(kind="oom", step=3, batch_size=64, previous=32, micro_batch_size=16).micro_batch_size
        16"""

    kind: str
    step: int
    batch_size: int
    previous: int
    micro_batch_size: int
    where: str = ""
    peak_bytes: int = 0


def floor_message(verdict: Any, n: int, *, policy: Any, ranks: bool) -> str:
    """The error for an out-of-memory at the minimum micro-batch (``verdict``: the step's, naming the rank that
    failed under several ``ranks``), the same text on every rank."""
    who = f" on rank {verdict.floor_rank}" if ranks else ""
    return (f"Out of memory at the minimum micro-batch{who} (in the {verdict.floor_where or 'step'}): batch size "
            f"{n}, micro-batch {verdict.floor_micro} (min_micro_batch_size={policy.min_micro_batch_size}), "
            f"budget {policy.memory.budget_text or 'none (no cap)'}, peak {format_bytes(verdict.floor_peak)}. "
            "Reduce memory per sample (precision, activation checkpointing), lower min_micro_batch_size, or "
            "raise the budget.")
