"""One rank of ``test_eval_collectives.py``: a short fit on 2 CPU ranks (gloo) whose ``validation_step`` all-gathers
its rows (``self.all_gather``: a collective whose size follows the part of the batch that runs), with an
out-of-memory error raised on one rank in validation. Saves what each rank's gathers saw and its events.

``argv``: the output folder, then the fault as JSON: ``rank``, ``batch`` (the validation batch index it strikes, or
null for every one), ``cap`` (parts above this many samples fail), ``after`` (true: after the step's gather),
``uneven`` (true: no gather, and each rank its own validation loader, rank 1's a batch longer).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from autotune.callbacks import ElasticBatchSize  # noqa: E402
from tests.support.ranks import exit_rank  # noqa: E402
from tests.support.toy import ToyModel, loader, oom, trainer, unpack  # noqa: E402


class Gathering(ToyModel):
    def __init__(self, fault: dict[str, Any]) -> None:
        super().__init__(scheduler=False)
        self.val_fault = fault
        self.gathered: list[tuple[int, list[int]]] = []  # (validation batch, ids gathered from every rank)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y, ids = unpack(batch, self.kind)
        fault = self.val_fault
        fires = (self.global_rank == fault["rank"] and fault["batch"] in (None, batch_idx) and len(ids) > fault["cap"]
                 and not self.trainer.sanity_checking)
        if fires and not fault.get("after"):
            raise oom()
        if fault.get("uneven"):
            if fires:
                raise oom()
            return
        rows = self.all_gather(torch.tensor(ids, dtype=torch.float64))  # (ranks, part): equal parts on every rank
        if not self.trainer.sanity_checking:
            self.gathered.append((batch_idx, sorted(int(i) for i in rows.flatten())))
        if fires:
            raise oom()
        self.log("val_loss", self.loss(x, y), sync_dist=True)


def main() -> None:
    out, fault = Path(sys.argv[1]), json.loads(sys.argv[2])
    torch.manual_seed(0)
    model = Gathering(fault)
    elastic = ElasticBatchSize(grow=False)
    uneven = bool(fault.get("uneven"))
    t = trainer([elastic], strategy="ddp", devices=2, max_epochs=1, limit_train_batches=2, num_sanity_val_steps=1,
                use_distributed_sampler=not uneven)
    error = None
    try:
        t.fit(model, loader(64, 8), loader(24 + 8 * t.global_rank if uneven else 48, 8))
    except Exception as exc:  # noqa: BLE001 (the test compares every rank's error)
        error = f"{type(exc).__name__}: {exc}"
    (out / f"rank{t.global_rank}.json").write_text(json.dumps({
        "gathered": model.gathered, "error": error,
        "events": [(e.kind, e.previous, e.micro_batch_size, e.where) for e in elastic.events],
        "val_loss": float(t.callback_metrics["val_loss"]) if "val_loss" in t.callback_metrics else None}))


if __name__ == "__main__":
    main()
    exit_rank()
