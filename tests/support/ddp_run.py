"""Run by test_elastic_ddp.py: 2 CPU ranks (gloo) with an OOM on one rank only; each rank saves what it saw."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from lightning.pytorch import Callback

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from autotune.callbacks import ElasticBatchSize  # noqa: E402
from tests.support.toy import Fault, ToyModel, loader, trainer  # noqa: E402


class VotesPerStep(Callback):
    """The agreement collectives of the last step (a clean one: the OOMs happen in the first step)."""

    def __init__(self, elastic: ElasticBatchSize) -> None:
        self.elastic, self.before, self.last = elastic, 0, -1

    def on_train_batch_start(self, *args: object) -> None:
        self.before = self.elastic.engine.agree.votes

    def on_train_batch_end(self, *args: object) -> None:
        self.last = self.elastic.engine.agree.votes - self.before


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["elastic", "native"], required=True)
    parser.add_argument("--where", default="forward")
    parser.add_argument("--rank", type=int, default=0, help="the only rank that runs out of memory")
    parser.add_argument("--out", required=True)
    parser.add_argument("--at-step", type=int, default=None, help="the only step whose micro-batches fault")
    parser.add_argument("--micro", type=int, default=None, help="the micro-batch to start with")
    parser.add_argument("--budget", default=None, help="ElasticBatchSize's budget (soft on the CPU)")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.mode == "elastic":
        steps = (lambda s: True) if args.at_step is None else (lambda s: s == args.at_step)
        model = ToyModel(fault=Fault(args.where, limit=16, rank=args.rank, steps=steps))
        callbacks, batch, accumulate = [ElasticBatchSize(grow=False, micro_batch_size=args.micro, budget=args.budget)], 64, 1
    else:
        model, callbacks, batch, accumulate = ToyModel(), [], 16, 4
    votes = VotesPerStep(callbacks[0]) if callbacks else None
    t = trainer([*callbacks, *([votes] if votes else [])], strategy="ddp", devices=2,
                accumulate_grad_batches=accumulate, gradient_clip_val=0.5)
    t.fit(model, loader(64 * 2 * 3, batch))
    events = [(e.kind, e.previous, e.micro_batch_size) for e in callbacks[0].events] if callbacks else []
    steps = [e.step for e in callbacks[0].events] if callbacks else []
    torch.save(
        {"state": model.state_dict(), "seen": [len(ids) for _, ids in model.seen], "events": events,
         "global_step": t.global_step, "ids": [i for _, ids in model.seen for i in ids],
         "votes_per_clean_step": votes.last if votes else None, "event_steps": steps},
        Path(args.out) / f"rank{t.global_rank}.pt",
    )


if __name__ == "__main__":
    main()
    # Gloo's worker threads can abort the interpreter's shutdown (SIGABRT, "terminate called without an active
    # exception") while the process group is alive at exit: end it first (docs/troubleshooting.md).
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # and skip C++ static destructors, where the abort still struck once with the group ended
