"""Run by test_elastic_fsdp.py: 2 CPU ranks (gloo) under ModelParallelStrategy (FSDP2, data parallel only); each
rank saves its gathered weights and what it saw. ``--gpt``: the GPT example, sharded by ApplyPlan (no
configure_model), each rank also saves how many elements of each parameter it holds."""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402

from autotune.callbacks import ApplyPlan, ElasticBatchSize  # noqa: E402
from tests.support.toy import Fault, ToyModel, loader, trainer  # noqa: E402
from tests.support.ddp_run import VotesPerStep  # noqa: E402


class ShardedToy(ToyModel):
    """The toy model with each linear layer sharded, then the root (as one shards each block of a transformer);
    ``reshard``: the layers' reshard_after_forward; ``bf16``: bf16 parameters, fp32 gradient reduction."""

    def __init__(self, *, reshard: bool = True, bf16: bool = False, one_unit: bool = False, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.reshard_layers, self.bf16, self.one_unit = reshard, bf16, one_unit

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if self.bf16 else None
        extra = {"mp_policy": policy} if policy is not None else {}
        if self.one_unit:  # the whole network one FSDP unit: its gradients stay unsharded through its backward
            fully_shard(self.net, mesh=mesh, **extra)
            return
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh, reshard_after_forward=self.reshard_layers, **extra)
        fully_shard(self, mesh=mesh, **extra)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["elastic", "native"], required=True)
    parser.add_argument("--where", default=None, help="forward | backward | step: an OOM there on --rank")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--at-step", type=int, default=None, help="the only step whose micro-batches fault")
    parser.add_argument("--micro", type=int, default=16, help="elastic: the micro-batch to start with; native: the "
                        "micro-batch accumulated (batch 64 per rank and step)")
    parser.add_argument("--grow-after", type=int, default=None, help="elastic: grow back after this many clean steps")
    parser.add_argument("--toy-reshard", choices=["true", "false"], default="true")
    parser.add_argument("--bf16-policy", action="store_true", help="bf16 parameters, fp32 reduction (FSDP2 policy)")
    parser.add_argument("--one-unit", action="store_true", help="shard the network as one FSDP unit")
    parser.add_argument("--out", required=True)
    parser.add_argument("--budget", default=None, help="elastic: ElasticBatchSize's budget (soft on the CPU)")
    parser.add_argument("--composed", action="store_true",
                        help="bf16-mixed, and ApplyPlan checkpointing every Linear (applied before fully_shard)")
    parser.add_argument("--gpt", action="store_true", help="the GPT example, sharded by ApplyPlan")
    parser.add_argument("--reshard", choices=["true", "false"], default="true", help="--gpt: reshard_after_forward")
    parser.add_argument("--compile", action="store_true", help="--gpt: ApplyPlan compiles each block (before sharding)")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.gpt:
        return gpt(args)
    toy = {"reshard": args.toy_reshard == "true", "bf16": args.bf16_policy, "one_unit": args.one_unit}
    if args.mode == "elastic":
        steps = (lambda s: True) if args.at_step is None else (lambda s: s == args.at_step)
        fault = Fault(args.where, limit=8, rank=args.rank, steps=steps) if args.where else None
        model = ShardedToy(fault=fault, **toy)
        grow = {"grow": False} if args.grow_after is None else {"grow": True, "grow_after": args.grow_after}
        callbacks, batch, accumulate = [ElasticBatchSize(micro_batch_size=args.micro, budget=args.budget, **grow)], 64, 1
    else:
        model, callbacks, batch, accumulate = ShardedToy(**toy), [], args.micro, 64 // args.micro
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    extra: dict = {}
    if args.composed:
        callbacks = [*callbacks, ApplyPlan(activation_checkpointing=["Linear"])]
        extra["precision"] = "bf16-mixed"
    votes = VotesPerStep(callbacks[0]) if args.mode == "elastic" else None
    t = trainer([*callbacks, *([votes] if votes else [])], strategy=strategy, devices=2,
                accumulate_grad_batches=accumulate, gradient_clip_val=0.5, **extra)
    t.fit(model, loader(64 * 2 * 3, batch), loader(32 * 2, 32) if args.where == "validation" else None)
    state = {name: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
             for name, v in model.state_dict().items()}
    elastic = callbacks[0] if args.mode == "elastic" else None
    events = [(e.kind, e.previous, e.micro_batch_size) for e in elastic.events] if elastic else []
    drain = elastic.engine.drain if elastic else None
    torch.save({"state": state, "seen": [len(ids) for _, ids in model.seen], "global_step": t.global_step,
                "ids": [i for _, ids in model.seen for i in ids], "lrs": model.lrs, "events": events, "calls": model.seen,
                "drained": (drain.drained, drain.followed) if drain else None,
                "votes_per_clean_step": votes.last if votes else None,
                "event_steps": [e.step for e in elastic.events] if elastic else []},
               Path(args.out) / f"rank{t.global_rank}.pt")


def gpt(args: argparse.Namespace) -> None:
    from examples.gpt.data import SyntheticTokens
    from examples.gpt.model import GPT

    model = GPT(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32, warmup_steps=2)
    elastic = args.mode == "elastic"
    data = SyntheticTokens(vocab_size=64, block_size=16, batch_size=32 if elastic else 8, num_samples=32 * 2 * 3)
    apply = ApplyPlan(activation_checkpointing=0.5 if args.composed else 0.0,
                      reshard_after_forward=args.reshard == "true", compile=args.compile)
    callbacks = [apply, *([ElasticBatchSize(grow=False, micro_batch_size=8)] if elastic else [])]
    t = trainer(callbacks, strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), devices=2,
                accumulate_grad_batches=1 if elastic else 4, gradient_clip_val=1.0, max_epochs=1,
                precision="bf16-mixed" if args.composed else "32-true")
    gathered: list[str] = []  # the dtype a block's layer sees in forward (after FSDP2 gathered its parameters)
    model.blocks[0].qkv.register_forward_hook(lambda m, i, o: gathered.append(str(m.weight.dtype)))
    t.fit(model, datamodule=data)
    state = {name: v.full_tensor().detach().clone() for name, v in model.state_dict().items()}
    local = {name: (p.to_local().numel(), p.numel()) for name, p in model.named_parameters()}
    torch.save({"state": state, "local": local, "global_step": t.global_step,
                "sharded": [type(m).__name__ for m in apply.sharded], "compiled": len(apply.compiled),
                "gathered_dtype": gathered[0]},
               Path(args.out) / f"rank{t.global_rank}.pt")


if __name__ == "__main__":
    main()
    # Gloo's worker threads can abort the interpreter's shutdown (SIGABRT, "terminate called without an active
    # exception") while the process group is alive at exit: end it first (docs/troubleshooting.md).
    if torch.distributed.is_initialized():
        gc.collect()  # collect cycles that hold gloo work (a replayed attempt's frames) while the group is alive
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # and skip C++ static destructors, where the abort still struck once with the group ended
