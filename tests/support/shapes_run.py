"""Run by test_elastic_shapes.py: 2 CPU ranks (gloo) training the padded-LM example, whose batches have a different
padded length on each rank and step, under DDP or FSDP2, with a tokens rule raising ``torch.OutOfMemoryError`` in
forward (``--mode elastic``) or on whole batches without the callback (``--mode native``). Each rank saves its
(gathered) weights, the ids of the samples it ran per step, its lengths and its micro-batch counts."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples" / "padded"))

import lightning as L  # noqa: E402
from padded_data import PaddedTokens, pad_collate  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402
from padded_model import PaddedLM  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from autotune.callbacks import ElasticBatchSize  # noqa: E402
from tests.support.ranks import exit_rank  # noqa: E402

BATCH, CAPACITY = 16, 16 * 12  # tokens per micro-batch: batches padded past 12 tokens are split


class RankLM(PaddedLM):
    def __init__(self, *, rule: bool, shard: bool, fault_rank: int | None, from_step: int = 0) -> None:
        super().__init__(vocab_size=32, width=16, heads=2, layers=2, lr=1e-2, max_length=64)
        self.rule, self.shard, self.fault_rank, self.from_step = rule, shard, fault_rank, from_step
        self.attempts: list[list[int]] = []

    def configure_model(self) -> None:
        if self.shard:
            mesh = self.device_mesh["data_parallel"]
            for block in self.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self, mesh=mesh)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)  # float32 under FSDP2: no Adam amplification

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
        samples, length = batch["input_ids"].shape
        self.attempts.append(batch["ids"].tolist())
        if (self.rule and samples * length > CAPACITY and self.fault_rank in (None, self.global_rank)
                and self.trainer.global_step >= self.from_step):
            raise torch.OutOfMemoryError("CUDA out of memory (simulated: tokens rule, in forward)")
        return self.loss(batch)


class Record(L.Callback):
    def __init__(self, elastic: ElasticBatchSize | None) -> None:
        self.elastic, self.ran, self.lengths, self.counts = elastic, [], [], []

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        count = len(self.elastic.engine.sizes) if self.elastic is not None else 1
        self.ran.append([i for ids in module.attempts[-count:] for i in ids])
        self.lengths.append(int(batch["input_ids"].shape[1]))
        self.counts.append(count)
        module.attempts.clear()


def collate(items: list[tuple[int, torch.Tensor]]) -> dict[str, torch.Tensor]:
    batch = pad_collate([s for _, s in items])
    batch["ids"] = torch.tensor([i for i, _ in items])
    return batch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["elastic", "native"], required=True)
    parser.add_argument("--strategy", choices=["ddp", "fsdp"], required=True)
    parser.add_argument("--fault-rank", type=int, default=None, help="only this rank's memory is limited")
    parser.add_argument("--min-micro", type=int, default=1, help="the callback's min_micro_batch_size")
    parser.add_argument("--from-step", type=int, default=0, help="the memory rule holds from this step on")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    elastic = args.mode == "elastic"
    model = RankLM(rule=elastic, shard=args.strategy == "fsdp", fault_rank=args.fault_rank, from_step=args.from_step)
    data = PaddedTokens(vocab_size=32, batch_size=BATCH, short=8, longest=48, num_samples=BATCH * 2 * 8, seed=3)
    data.setup("fit")  # one group of lengths per step, shared by both ranks (each rank pads to its own longest)
    loader = DataLoader(list(enumerate(data.train.samples)), batch_size=BATCH, shuffle=False, collate_fn=collate)
    callback = ElasticBatchSize(min_micro_batch_size=args.min_micro) if elastic else None
    record = Record(callback)
    strategy: Any = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1) if args.strategy == "fsdp" \
        else "ddp"
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1,
                        precision="32-true" if args.strategy == "fsdp" else "64-true",  # FSDP2 refuses 64-true
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[c for c in (callback, record) if c is not None])
    trainer.fit(model, loader)
    state = {name: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
             for name, v in model.state_dict().items()}
    torch.save({"state": state, "ran": record.ran, "lengths": record.lengths, "counts": record.counts,
                "global_step": trainer.global_step, "ooms": callback.engine.oom_events if callback else 0,
                "varies": callback.engine.shapes.varies if callback else None},
               Path(args.out) / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
    exit_rank()
