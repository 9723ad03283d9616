"""Dynamic padding on 2 ranks: each rank pads its own batches, ElasticBatchSize splits each by its own shape.

The padded-LM example and the memory rules of ``dynamic_padding.py`` (tokens in forward, length squared in backward),
on 2 CPU ranks (gloo) under DDP or FSDP2: every rank reads batches of lengths of its own (its own seed), or, in the
``one fixed`` rows, rank 1's batches all have one short length that always fits while rank 0's vary. Per rank it
reports its own OOMs, the micro-batches it ran against the fewest that fit its batches, whether every sample ran
once per step, and the largest weight difference to the same steps on whole batches by plain Lightning under the same
strategy (float64). Under FSDP2 the ranks run equal counts (the largest any needs), so its rows also give the fewest
of the step (the largest of the ranks' fewest, summed): the count no split could go below.

    python benchmarks/dynamic_padding_ranks.py            # 240 steps, seeds 0-2, DDP and FSDP2
    python benchmarks/dynamic_padding_ranks.py --quick    # 60 steps, seed 0

Each configuration runs on 2 processes started by ``torch.distributed.run`` (torchrun).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from _common import ROOT, add_json, machine, machine_line, make_parser, markdown_table, quiet, write_json  # noqa: E402
from dynamic_padding import BATCH, CAPACITY, GOAL_OOMS, GOAL_RATIO, LONGEST, MODEL, SHORT, _cost, _imports, fewest  # noqa: E402,E501

RULES = ("tokens", "length2")
STRATEGIES = ("ddp", "fsdp")
VARIANTS = ("own lengths", "one fixed")


def _rank_batches(variant: str, rank: int, steps: int, seed: int) -> list[dict[str, Any]]:
    """This rank's batches: ``BATCH`` samples per step, padded to their own longest (rank 1 of ``one fixed``: every
    sample ``SHORT`` tokens long), each carrying its samples' ids."""
    import torch

    PaddedTokens, _, pad_collate = _imports()
    data = PaddedTokens(vocab_size=MODEL["vocab_size"], batch_size=BATCH, short=SHORT, longest=LONGEST,
                        num_samples=steps * BATCH, seed=1000 * seed + rank)
    data.setup("fit")
    samples = data.train.samples
    if variant == "one fixed" and rank == 1:
        samples = [s.repeat(SHORT // len(s) + 1)[:SHORT] for s in samples]
    out = []
    for step in range(steps):
        part = samples[step * BATCH:(step + 1) * BATCH]
        batch = pad_collate(part)
        batch["ids"] = torch.arange(step * BATCH, (step + 1) * BATCH)
        out.append(batch)
    return out


def rank_run(config: dict[str, Any]) -> dict[str, Any]:
    """One configuration on this rank: ``config`` has rule, policy ("shape" or "reference"), strategy, variant,
    steps, seed."""
    import lightning as L
    import torch
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    from autotune.callbacks import ElasticBatchSize

    _, PaddedLM, _ = _imports()
    rank = int(os.environ["LOCAL_RANK"])
    rule, elastic = config["rule"], config["policy"] == "shape"

    class Faulty(PaddedLM):  # type: ignore[misc, valid-type]
        def configure_model(self) -> None:
            if config["strategy"] == "fsdp":
                mesh = self.device_mesh["data_parallel"]
                for block in self.blocks:
                    fully_shard(block, mesh=mesh)
                fully_shard(self, mesh=mesh)

        def training_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
            samples, length = batch["input_ids"].shape
            self.attempts.append(batch["ids"].tolist())
            if elastic and rule == "tokens" and _cost(rule, samples, length) > CAPACITY[rule]:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated: tokens rule, in forward)")
            loss = self.loss(batch)
            if elastic and rule == "length2" and _cost(rule, samples, length) > CAPACITY[rule]:
                def fail(grad: Any) -> Any:
                    raise torch.OutOfMemoryError("CUDA out of memory (simulated: length-squared rule, in backward)")
                loss.register_hook(fail)
            return loss

    class Record(L.Callback):
        def __init__(self) -> None:
            self.lengths: list[int] = []
            self.counts: list[int] = []
            self.exact = True

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            count = len(callback.engine.sizes) if callback is not None else 1
            self.lengths.append(int(batch["input_ids"].shape[1]))
            self.counts.append(count)
            ran = [i for ids in module.attempts[-count:] for i in ids]
            self.exact = self.exact and ran == batch["ids"].tolist()
            module.attempts.clear()

    L.seed_everything(config["seed"], verbose=False)
    model = Faulty(**MODEL, max_length=LONGEST).double()
    model.attempts = []
    callback = ElasticBatchSize() if elastic else None
    record = Record()
    strategy: Any = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1) \
        if config["strategy"] == "fsdp" else DDPStrategy()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=config["steps"], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, callbacks=[c for c in (callback, record) if c is not None])
    data = torch.utils.data.DataLoader(_rank_batches(config["variant"], rank, config["steps"], config["seed"]),
                                       batch_size=None)
    start = time.perf_counter()
    trainer.fit(model, data)
    weights = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()
               for p in model.parameters()]
    return {"rank": rank, "lengths": record.lengths, "counts": record.counts, "exact": record.exact,
            "ooms": callback.engine.oom_events if callback is not None else 0, "global_step": trainer.global_step,
            "wall_s": time.perf_counter() - start, "weights": weights}


def as_rank(plan_path: str, out: str) -> None:
    """Inside a rank (started by torchrun): every configuration of the plan, results saved per rank."""
    import torch

    quiet()
    torch.set_num_threads(1)
    for k, config in enumerate(json.loads(Path(plan_path).read_text())):
        result = rank_run(config)
        torch.save(result, Path(out) / f"{k}.rank{result['rank']}.pt")


def launch(plan: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Run the plan on 2 ranks (torchrun) and return each configuration's per-rank results."""
    import torch

    with tempfile.TemporaryDirectory(prefix="autotune-padding-ranks-") as folder:
        (Path(folder) / "plan.json").write_text(json.dumps(plan))
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   __file__, "--as-rank", str(Path(folder) / "plan.json"), folder]
        proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
        if proc.returncode != 0:
            raise RuntimeError(f"the ranks failed:\n{proc.stderr[-4000:]}")
        return [[torch.load(Path(folder) / f"{k}.rank{r}.pt", weights_only=False) for r in range(2)]
                for k in range(len(plan))]


def rows_of(plan: list[dict[str, Any]], results: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per configuration and rank, beside the reference of its strategy, variant and seed."""
    references = {(c["strategy"], c["variant"], c["seed"]): r for c, r in zip(plan, results) if c["policy"] != "shape"}
    rows = []
    for config, ranks in zip(plan, results):
        if config["policy"] != "shape":
            continue
        reference = references[(config["strategy"], config["variant"], config["seed"])]
        step_fewest = [max(fewest(config["rule"], n) for n in lengths) for lengths in
                       zip(*(r["lengths"] for r in ranks))]
        for result, ref in zip(ranks, reference):
            own = sum(fewest(config["rule"], n) for n in result["lengths"])
            rows.append({**{k: config[k] for k in ("rule", "strategy", "variant", "seed", "steps")},
                         "rank": result["rank"], "ooms": result["ooms"], "micro_batches": sum(result["counts"]),
                         "fewest": own, "ratio": sum(result["counts"]) / own,
                         "step_fewest": sum(step_fewest), "step_ratio": sum(result["counts"]) / sum(step_fewest),
                         "exact": result["exact"], "global_step": result["global_step"],
                         "lengths": f"{min(result['lengths'])}-{max(result['lengths'])}",
                         "max_weight_diff": max(float((a - b).abs().max())
                                                for a, b in zip(result["weights"], ref["weights"])),
                         "wall_s": result["wall_s"]})
    return rows


def report(rows: list[dict[str, Any]], info: dict[str, Any]) -> str:
    header = ["rule", "strategy", "ranks' lengths", "seed", "rank", "steps", "OOMs", "micro-batches", "fewest",
              "ratio", "step's fewest", "ratio to it", "every sample once", "global_step", "max weight diff",
              "padded lengths"]
    body = [[r["rule"], r["strategy"], r["variant"], str(r["seed"]), str(r["rank"]), str(r["steps"]), str(r["ooms"]),
             str(r["micro_batches"]), str(r["fewest"]), f"{r['ratio']:.3f}", str(r["step_fewest"]),
             f"{r['step_ratio']:.3f}", "yes" if r["exact"] else "NO", str(r["global_step"]),
             f"{r['max_weight_diff']:.1e}", r["lengths"]] for r in rows]
    ddp = [r["ratio"] for r in rows if r["strategy"] == "ddp"]
    fsdp = [r["step_ratio"] for r in rows if r["strategy"] == "fsdp"]
    lines = [machine_line(info), "", markdown_table(header, body), "",
             f"per rank: OOMs at most {max(r['ooms'] for r in rows)} (goal <= {GOAL_OOMS} over 240 steps); DDP: at "
             f"most {max(ddp, default=math.nan):.3f}x its own fewest micro-batches; FSDP2: at most "
             f"{max(fsdp, default=math.nan):.3f}x the step's fewest (goal <= {GOAL_RATIO}); largest weight difference "
             f"{max(r['max_weight_diff'] for r in rows):.1e}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--as-rank"]:
        as_rank(argv[1], argv[2])
        return 0
    parser = make_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="60 steps, seed 0")
    parser.add_argument("--strategy", action="append", choices=STRATEGIES, help="default: both")
    add_json(parser)
    args = parser.parse_args(argv)
    steps, seeds = (60, [0]) if args.quick else (240, [0, 1, 2])
    plan = [{"rule": rule, "policy": policy, "strategy": strategy, "variant": variant, "steps": steps, "seed": seed}
            for seed in seeds for strategy in (args.strategy or STRATEGIES) for variant in VARIANTS
            for policy, rules in (("reference", ("none",)), ("shape", RULES)) for rule in rules]
    info = machine("cpu", threads=1)
    rows = rows_of(plan, launch(plan))
    print(report(rows, info))
    write_json(args.json, {"machine": info, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
