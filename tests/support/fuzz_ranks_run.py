"""One rank of the fault fuzzer (``test_fuzz_ranks.py``): runs a list of scenarios one after another in this process,
each a short ``fit`` under ``ElasticBatchSize`` on 2 CPU ranks (gloo) with out-of-memory errors raised at the real
places, then the same steps as native accumulation (plain torch DDP or FSDP2, no callback) on the same samples with
the splits the elastic run ended with; saves, per scenario, what the test compares.

A scenario (a JSON object, made by ``test_fuzz_ranks.scenarios``): ``strategy`` ddp | fsdp, ``broadcast_buffers``,
``model`` (mlp | buffer | batchnorm | normaliser | collective | gather (an all-gather of the micro-batch's rows) | bert), ``optimizer`` adamw | sgd, ``steps``,
``batch``, ``lengths`` (per rank, per step: each rank pads its batches to lengths of its own), ``faults`` (each:
``rank``, ``phase`` forward | backward | step_pre (an optimizer pre-hook, before the closure) | update (inside the
update, first step only), ``step``, ``cap`` (tokens per micro-batch above which it fires) or ``once``), ``micro``
(the callback's start; with ``grow_after=2``) or ``elastic`` (the callback's arguments), ``eval`` (``batches``
validation batches whose ``validation_step`` all-gathers the rows' ids, and a ``fault``: ``rank``, ``batch``, ``cap``),
``setting`` (static_graph | comm_hook: a DDP option the runtime refuses), ``resume`` (the step at which a first fit
stops and saves a checkpoint that a second fit resumes from: each rank its own callback state).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import lightning as L  # noqa: E402

from tests.support.ranks import exit_rank  # noqa: E402

WIDTH, CLASSES, VOCAB = 6, 3, 32


# ------------------------------------------------------------------------------------------------------- models
class GatherNorm(nn.Module):
    """A stand-in for SyncBatchNorm on the CPU (torch's refuses CPU tensors): its forward all-gathers each rank's
    feature means (the global mean centres the input, and updates a running mean), its backward all-reduces the
    gradient's mean. The same collectives, in the same places, as SyncBatchNorm."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(width, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _GatherCentre.apply(x)
        if self.training:
            with torch.no_grad():
                self.running_mean.mul_(0.9).add_(0.1 * (x - out).reshape(-1, x.shape[-1])[0])
        return out


class _GatherCentre(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        local = x.detach().reshape(-1, x.shape[-1]).mean(0)
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, local)
        return x - torch.stack(parts).mean(0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        mean = grad.reshape(-1, grad.shape[-1]).mean(0)
        dist.all_reduce(mean)
        return grad - 0.1 * mean / dist.get_world_size()


class Core(nn.Module):
    """The model of a scenario: tokens embedded, one kind of layer under test, pooled, classified."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.mid = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES)
        if kind == "buffer":
            self.register_buffer("scale", torch.linspace(0.5, 1.5, WIDTH))
        elif kind == "batchnorm":
            self.norm = nn.BatchNorm1d(WIDTH)
        elif kind == "normaliser":
            self.register_buffer("mean", torch.zeros(WIDTH))
        elif kind == "collective":
            self.norm = GatherNorm(WIDTH)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        if self.kind == "gather":  # a contrastive loss's gather: every rank's rows of this micro-batch, with gradients
            h = torch.tanh(self.mid(x)).mean(1)  # (what LightningModule.all_gather(h, sync_grads=True) calls)
            rows = torch.cat(dist_nn.all_gather(h))
            return self.head(h - 0.5 * (h @ rows.T).softmax(-1) @ rows)
        if self.kind == "buffer":
            x = x * self.scale
        elif self.kind == "batchnorm":
            x = self.norm(x.transpose(1, 2)).transpose(1, 2)
        elif self.kind == "normaliser":  # a running input normaliser: updated and used by each forward
            if self.training:
                with torch.no_grad():
                    self.mean.mul_(0.8).add_(0.2 * x.detach().mean((0, 1)))
            x = x - self.mean
        elif self.kind == "collective":
            x = self.norm(x)
        return self.head(torch.tanh(self.mid(x)).mean(1))


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "bert":
        from transformers import BertConfig, BertForSequenceClassification

        config = BertConfig(vocab_size=VOCAB, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=16, max_position_embeddings=64, num_labels=CLASSES,
                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        return BertForSequenceClassification(config).double()
    return Core(kind).double()


def loss_of(model: nn.Module, kind: str, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    if kind == "bert":
        return model(input_ids=batch["ids_in"], attention_mask=batch["mask"], labels=batch["labels"]).loss
    return nn.functional.cross_entropy(model(batch["ids_in"]), batch["labels"])


def blocks(model: nn.Module, kind: str) -> list[nn.Module]:
    """The units FSDP2 shards before the root."""
    if kind == "bert":
        return list(model.bert.encoder.layer)
    return [model.mid, model.head]


class _FaultyUpdate:
    """An optimizer whose update can run out of memory after the closure ran, before it changes anything."""

    fires: Any = None

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.fires is not None and self.fires("update", 0):
            raise torch.OutOfMemoryError("CUDA out of memory (simulated, in the update)")
        super().step()  # type: ignore[misc]
        return loss


class FaultySGD(_FaultyUpdate, torch.optim.SGD):
    pass


class FaultyAdamW(_FaultyUpdate, torch.optim.AdamW):
    pass


def optimizer_of(model: nn.Module, name: str) -> torch.optim.Optimizer:
    if name == "sgd":
        return FaultySGD(model.parameters(), lr=0.05, momentum=0.9)
    return FaultyAdamW(model.parameters(), lr=0.01)


# --------------------------------------------------------------------------------------------------------- data
def batches(scenario: dict[str, Any], rank: int) -> list[dict[str, torch.Tensor]]:
    """This rank's batches: ``batch`` samples padded to this rank's length of each step; ids count the samples."""
    out = []
    g = torch.Generator().manual_seed(1000 * scenario["id"] + rank)
    n = scenario["batch"]
    for step, length in enumerate(scenario["lengths"][rank]):
        real = torch.randint(1, length + 1, (n,), generator=g)
        real[0] = length  # one sample as long as the batch
        ids_in = torch.randint(1, VOCAB, (n, length), generator=g)
        mask = (torch.arange(length)[None, :] < real[:, None]).long()
        out.append({"ids_in": ids_in * mask, "mask": mask, "labels": torch.randint(0, CLASSES, (n,), generator=g),
                    "ids": torch.arange(n) + 10000 * rank + 100 * step})
    return out


def val_batches(scenario: dict[str, Any], rank: int) -> list[dict[str, torch.Tensor]]:
    """This rank's validation batches (``test_fuzz_ranks.val_id`` numbers their samples)."""
    g = torch.Generator().manual_seed(5000 * scenario["id"] + rank)
    n = scenario["batch"]
    return [{"ids_in": torch.randint(1, VOCAB, (n, 4), generator=g), "labels": torch.randint(0, CLASSES, (n,), generator=g),
             "ids": torch.arange(n) + 50000 + 10000 * rank + 100 * b} for b in range(scenario["eval"]["batches"])]


# ---------------------------------------------------------------------------------------------- the elastic run
class FuzzModule(L.LightningModule):
    def __init__(self, scenario: dict[str, Any]) -> None:
        super().__init__()
        self.scenario = scenario
        self.kind = scenario["model"]
        self.model = build(self.kind)
        self.attempts: list[tuple[int, list[int]]] = []  # (global step, ids) of every micro-batch that ran
        self.fired: set[tuple[int, str]] = set()
        self.fired_at: list[int] = []  # the samples of the micro-batch running at each fault that fired
        self.samples = 0
        self.gathered: list[tuple[int, list[int]]] = []  # (validation batch, the ids its gather saw)

    def configure_model(self) -> None:
        if self.scenario["strategy"] == "fsdp":
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for block in blocks(self.model, self.kind):
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        fault = self.scenario["eval"]["fault"]
        if self.global_rank == fault["rank"] and batch_idx == fault["batch"] and len(batch["ids"]) > fault["cap"]:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated, in validation)")
        rows = self.all_gather(batch["ids"].double())  # the part's rows of every rank: equal parts or gloo fails
        self.gathered.append((batch_idx, sorted(int(i) for i in rows.flatten())))

    def faults(self, phase: str) -> list[dict[str, Any]]:
        rank, step = self.global_rank, self.trainer.global_step
        return [f for f in self.scenario["faults"] if f["rank"] == rank and f["phase"] == phase and
                (step == f["step"] if f.get("once") else step >= f["step"])]

    def fires(self, phase: str, tokens: int) -> bool:
        from autotune.callbacks import ElasticBatchSize

        elastic = next(c for c in self.trainer.callbacks if isinstance(c, ElasticBatchSize))
        if not elastic.engine.sizes:  # outside a step (torch's checkpoint API steps an optimizer with no state)
            return False
        self.samples = elastic.engine.sizes[0]  # the attempt's micro-batch (the largest of its split)
        for f in self.faults(phase):
            key = (self.trainer.global_step, phase)
            if f.get("once"):
                if key not in self.fired:
                    self.fired.add(key)
                    self.fired_at.append(self.samples)
                    return True
            elif tokens > f["cap"]:
                self.fired_at.append(self.samples)
                return True
        return False

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.attempts.append((self.trainer.global_step, batch["ids"].tolist()))
        tokens = batch["ids_in"].numel()
        if self.fires("forward", tokens):
            raise torch.OutOfMemoryError("CUDA out of memory (simulated, in forward)")
        loss = loss_of(self.model, self.kind, batch)
        if self.fires("backward", tokens):
            def fail(grad: torch.Tensor) -> torch.Tensor:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated, in backward)")
            loss.register_hook(fail)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = optimizer_of(self.model, self.scenario["optimizer"])
        module = self

        def pre_hook(opt: Any, args: Any, kwargs: Any) -> None:  # before the closure runs
            if module.fires("step_pre", 0):
                raise torch.OutOfMemoryError("CUDA out of memory (simulated, in an optimizer step pre-hook)")

        optimizer.register_step_pre_hook(pre_hook)
        optimizer.fires = self.fires
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Record(L.Callback):
    def __init__(self, elastic: Any) -> None:
        self.elastic, self.sizes, self.ran, self.trace = elastic, [], [], []
        self.trained: dict[str, torch.Tensor] | None = None  # the state training ended with (before validation)

    def on_validation_start(self, trainer: Any, module: Any) -> None:
        # Validation under DDP broadcasts rank 0's buffers in its forwards (broadcast_buffers), which native
        # accumulation, with no validation, does not: the comparison is of what training left.
        if self.trained is None:
            self.trained = state_of(module.model)

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        sizes = list(self.elastic.engine.sizes)
        self.sizes.append(sizes)
        self.ran.append([i for _, ids in module.attempts[-len(sizes):] for i in ids])
        module.attempts.clear()
        self.trace.append({n: b.detach().clone() for n, b in module.model.named_buffers()})


def elastic_run(scenario: dict[str, Any], rank: int, out: Path) -> dict[str, Any]:
    """The scenario under ``ElasticBatchSize``; with ``resume`` (a step), a first fit stops there and saves a
    checkpoint, and a second fit, of a new module and callback, resumes from it on the batches left."""
    from autotune.callbacks import ElasticBatchSize

    def new_trainer(elastic: Any, record: Record, max_steps: int) -> L.Trainer:
        from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

        if scenario["strategy"] == "fsdp":
            strategy: Any = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
        else:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

            setting = scenario.get("setting")
            strategy = DDPStrategy(broadcast_buffers=scenario["broadcast_buffers"],
                                   static_graph=setting == "static_graph",
                                   ddp_comm_hook=fp16_compress_hook if setting == "comm_hook" else None)
        return L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=max_steps,
                         logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False, num_sanity_val_steps=0, callbacks=[elastic, record])

    def new_elastic() -> Any:
        return ElasticBatchSize(**scenario.get("elastic", {"micro_batch_size": scenario.get("micro"), "grow_after": 2}))

    train, resume = batches(scenario, rank), scenario.get("resume")
    module, elastic = FuzzModule(scenario), new_elastic()
    record = Record(elastic)
    trainer = new_trainer(elastic, record, resume or scenario["steps"])
    val = torch.utils.data.DataLoader(val_batches(scenario, rank), batch_size=None) if "eval" in scenario else None
    error = None
    try:
        trainer.fit(module, torch.utils.data.DataLoader(train, batch_size=None), None if resume else val)
        if resume:
            checkpoint = out / f"{scenario['id']}.ckpt"
            trainer.save_checkpoint(checkpoint)
            fired, fired_at = module.fired, module.fired_at
            module, elastic = FuzzModule(scenario), new_elastic()
            module.fired, module.fired_at, record.elastic = fired, fired_at, elastic
            trainer = new_trainer(elastic, record, scenario["steps"])
            # A resume mid-epoch: Lightning goes on from the step it saved but takes a plain DataLoader from its
            # start (it cannot skip what the loader gave before), so the loader starts with the batches not yet run.
            trainer.fit(module, torch.utils.data.DataLoader(train[resume:] + train[:resume], batch_size=None), val,
                        ckpt_path=checkpoint)
    except Exception as exc:  # noqa: BLE001 - what every rank ended with is the result
        error = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    state = record.trained if record.trained is not None else state_of(module.model)
    events = [(e.kind, e.previous, e.micro_batch_size) for e in elastic.events]
    return {"error": error, "fired_at": module.fired_at, "state": state, "sizes": record.sizes, "ran": record.ran, "trace": record.trace,
            "global_step": trainer.global_step, "events": events, "gathered": module.gathered}


def state_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters (``p:``) and buffers (``b:``), whole (FSDP2's shards gathered)."""
    return {f"{kind}:{name}": (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for kind, items in (("p", model.named_parameters()), ("b", model.named_buffers())) for name, v in items}


# --------------------------------------------------------------------------------------------- the native run
def native_run(scenario: dict[str, Any], rank: int, sizes: list[list[int]]) -> dict[str, Any]:
    """The same steps as Lightning's own accumulation does them, with the splits the elastic run ended with: DDP's
    ``no_sync`` for all micro-batches but the last (buffers broadcast at each step's first forward), FSDP2 reducing in
    every backward; each micro-batch's loss weighted by its share of the batch."""
    kind = scenario["model"]
    model = build(kind)
    if scenario["strategy"] == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in blocks(model, kind):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        wrapped: nn.Module = model
    else:
        wrapped = nn.parallel.DistributedDataParallel(model, broadcast_buffers=scenario["broadcast_buffers"])
    optimizer = optimizer_of(model, scenario["optimizer"])
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    forward = wrapped if scenario["strategy"] == "ddp" else model
    trace: list[dict[str, torch.Tensor]] = []
    for batch, split in zip(batches(scenario, rank), sizes):
        optimizer.zero_grad(set_to_none=True)
        n, start = len(batch["ids"]), 0
        even = all(s == split[0] for s in split)
        for i, size in enumerate(split):
            part = {k: v[start:start + size] for k, v in batch.items()}
            start += size
            last = i == len(split) - 1
            sync = wrapped.no_sync() if scenario["strategy"] == "ddp" and not last else contextlib.nullcontext()
            with sync:
                loss = _Forward.apply(forward, kind, part)
                weight = 1 / len(split) if even else size / n
                (loss * weight if len(split) > 1 else loss).backward()
        optimizer.step()
        scheduler.step()
        trace.append({n: b.detach().clone() for n, b in model.named_buffers()})
    return {"state": state_of(model), "trace": trace}


class _Forward:
    @staticmethod
    def apply(forward: nn.Module, kind: str, part: dict[str, torch.Tensor]) -> torch.Tensor:
        if kind == "bert":
            return forward(input_ids=part["ids_in"], attention_mask=part["mask"], labels=part["labels"]).loss
        return nn.functional.cross_entropy(forward(part["ids_in"]), part["labels"])


def main() -> None:
    scenarios = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    for scenario in scenarios:
        rank = int(os.environ["LOCAL_RANK"])
        print(f"scenario {scenario['id']} starts", flush=True)
        result = elastic_run(scenario, rank, out)
        if result["error"] is None and len(result["sizes"]) == scenario["steps"]:
            native = native_run(scenario, rank, result["sizes"])
            result["native"], result["native_trace"] = native["state"], native["trace"]
        torch.save(result, out / f"{scenario['id']}.rank{rank}.pt")
        print(f"scenario {scenario['id']} ends", flush=True)
        dist.barrier()


if __name__ == "__main__":
    main()
    exit_rank()
