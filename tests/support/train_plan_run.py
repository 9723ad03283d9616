"""Trains a target with a tuned file's plan (``Plan.callbacks()``: ``ElasticBatchSize`` with its budget, ``ApplyPlan``)
in a process of its own, as a user's run is, and prints what the runtime did: each event, the micro-batch at the end,
the steps trained. For tests/search/test_growth.py.

Usage: python tests/support/train_plan_run.py TARGET TUNED.yaml STEPS
"""

from __future__ import annotations

import dataclasses
import json
import sys
import warnings


def main(target: str, tuned: str, steps: int) -> dict:
    import lightning as L

    from autotune import load_plan, load_target
    from autotune.callbacks import ElasticBatchSize

    warnings.filterwarnings("ignore")
    plan = load_plan(tuned)
    loaded = load_target(target)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, **{k: v for k, v in plan.trainer_kwargs().items() if k != "devices"},
                        callbacks=plan.callbacks())
    trainer.fit(loaded.model, datamodule=loaded.datamodule)
    elastic = next(c for c in trainer.callbacks if isinstance(c, ElasticBatchSize))
    return {"steps": trainer.global_step, "micro_batch_size": elastic.micro_batch_size,
            "planned": plan.micro_batch_size, "events": [dataclasses.asdict(e) for e in elastic.events]}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], int(sys.argv[3]))))
