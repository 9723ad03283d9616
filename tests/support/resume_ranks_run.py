"""One rank of ``test_state_restored.py``'s resume check (2 CPU ranks, gloo): rank 1 runs out of memory above 4 samples
in its first fit, which saves a checkpoint; a second fit resumes from it and each rank records the micro-batch it
resumed at and whether any OOM came again. Writes ``rank{r}.json`` in the folder given."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from typing import Any  # noqa: E402

from lightning.pytorch import Callback  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402

from autotune.callbacks import ElasticBatchSize  # noqa: E402
from tests.support.ranks import exit_rank  # noqa: E402
from tests.support.toy import Fault, ToyModel, loader, trainer  # noqa: E402


def main() -> None:
    out = Path(sys.argv[1])
    rank = int(os.environ["LOCAL_RANK"])
    first = ElasticBatchSize(grow=False)
    fault = Fault("forward", limit=4, rank=1)  # rank 1's memory holds 4 samples
    t = trainer([first], devices=2, strategy=DDPStrategy(), max_steps=2, use_distributed_sampler=False)
    t.fit(ToyModel(fault=fault), loader(64, 16))
    t.save_checkpoint(out / "last.ckpt")
    second = ElasticBatchSize(grow=False)
    again = Fault("forward", limit=4, rank=1)
    resumed_at: list[int | None] = []

    class Note(Callback):
        def on_train_start(self, trainer: Any, module: Any) -> None:
            resumed_at.append(second.micro_batch_size)

    t = trainer([second, Note()], devices=2, strategy=DDPStrategy(), max_steps=4, max_epochs=3,
                use_distributed_sampler=False)
    t.fit(ToyModel(fault=again), loader(64, 16), ckpt_path=out / "last.ckpt")
    (out / f"rank{rank}.json").write_text(json.dumps({
        "first": first.micro_batch_size, "resumed_at": resumed_at, "ooms_after_resume": len(again.hits),
        "events": [e.kind for e in second.events]}))


if __name__ == "__main__":
    main()
    exit_rank()
