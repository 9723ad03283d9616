"""Sharding on 2 ranks: per-rank peak memory of DDP vs the FSDP2 plans, and elastic vs native FSDP2 step time.

1. For the example GPT at two sizes, each plan (ddp; fsdp, ZeRO-3 style; fsdp with reshard_after_forward=False,
   ZeRO-2 style) trains 2 ranks with ElasticBatchSize (4 micro-batches of 8 per step, ApplyPlan's sharding): the
   model state one rank holds at the end (its parameters, gradients and optimizer state, measured on the real
   tensors: the shards under FSDP2), its ratio to DDP's, and the largest rank's peak resident set (which also holds
   about 0.3 GiB of libraries and whatever the allocator kept), with glibc's default allocator settings and with its
   mmap threshold fixed at 64 KiB (``MALLOC_MMAP_THRESHOLD_``): by default glibc raises the threshold after large
   frees, so FSDP2's per-block gather buffers, freed and made again many times a step, stay in the heap.
2. Step time of ElasticBatchSize under FSDP2 (4 micro-batches per step) vs Lightning's own accumulation of 4
   (same sharding by ApplyPlan, same samples), in alternating fresh 2-rank runs; goal <= 1.02x.

    python benchmarks/sharding.py            # 3 to 10 minutes on a 2-core CPU
    python benchmarks/sharding.py --quick    # the small size only, 1 repeat
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:  # _common.py, also when this file is loaded by path
    sys.path.insert(0, _HERE)

from _common import (  # noqa: E402
    add_json,
    peak_rss_bytes,
    machine,
    machine_line,
    make_parser,
    markdown_table,
    quiet,
    use_paths,
    write_json,
)

#: The two GPT sizes (on top of the example's vocabulary 256 and context 32).
SIZES = {"small": {"n_layer": 4, "n_head": 4, "n_embd": 128}, "large": {"n_layer": 8, "n_head": 8, "n_embd": 512}}
GOAL_STEP = 1.02
STEPS, WARMUP = 6, 2


def _make(size: dict[str, int]) -> Any:
    use_paths(gpt=True)
    from data import SyntheticTokens
    from model import GPT

    data = SyntheticTokens(vocab_size=256, block_size=32, batch_size=32, num_samples=32 * 2 * (STEPS + WARMUP + 2))
    return GPT(vocab_size=256, block_size=32, dropout=0.0, **size), data


PLANS = {"ddp": "ddp", "fsdp (ZeRO-3)": "fsdp", "fsdp, no reshard (ZeRO-2)": "fsdp-noreshard"}


def memory_rows(sizes: list[str]) -> list[dict[str, Any]]:
    rows = []
    for size in sizes:
        model, _ = _make(SIZES[size])
        params = sum(p.numel() for p in model.parameters())
        for label, strategy in PLANS.items():
            result = _launch("elastic", size, strategy)
            fixed = _launch("elastic", size, strategy, env={"MALLOC_MMAP_THRESHOLD_": str(64 * 2**10)})
            rows.append({"size": size, "params": params, "plan": label, **result,
                         "peak_bytes_fixed_mmap": fixed["peak_bytes"]})
    return rows


def _launch(mode: str, size: str, strategy: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        proc = subprocess.run([sys.executable, __file__, "--rank-run", mode, "--size", size, "--strategy", strategy,
                               "--out", str(out)], capture_output=True, text=True, timeout=900,
                              env={**os.environ, **(env or {})})
        if proc.returncode != 0 or not out.exists():
            raise SystemExit(f"{mode} {size} {strategy} run failed:\n{proc.stderr[-2000:]}")
        return json.loads(out.read_text())


def run_ranks(mode: str, size: str, strategy: str, out: Path) -> None:
    """One 2-rank run (Lightning starts rank 1 by running this command again); rank 0 writes the step times, one
    rank's model-state bytes and the largest rank's peak resident set."""
    quiet()
    import lightning as L
    import torch
    import torch.distributed as dist
    from lightning.pytorch.strategies import ModelParallelStrategy

    from autotune.callbacks import ApplyPlan, ElasticBatchSize

    class StepTimes(L.Callback):
        """The time at the end of each optimizer step (native accumulation ends several batches per step)."""

        def __init__(self) -> None:
            self.marks: list[float] = []
            self.seen = 0

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step > self.seen:
                self.seen = trainer.global_step
                self.marks.append(time.perf_counter())

    L.seed_everything(0, verbose=False)
    model, data = _make(SIZES[size])
    elastic = mode == "elastic"
    data.batch_size = 32 if elastic else 8
    timer = StepTimes()
    apply = ApplyPlan(reshard_after_forward=strategy != "fsdp-noreshard")
    callbacks = [apply, timer, *([ElasticBatchSize(micro_batch_size=8, grow=False)] if elastic else [])]
    sharded = strategy.startswith("fsdp")
    trainer = L.Trainer(accelerator="cpu", devices=2,
                        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1) if sharded
                        else "ddp",
                        max_steps=STEPS + WARMUP, accumulate_grad_batches=1 if elastic else 4, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, callbacks=callbacks)
    trainer.fit(model, datamodule=data)
    local = [t.to_local() if hasattr(t, "to_local") else t for t in _state_tensors(model, trainer.optimizers[0])]
    state_bytes = sum(t.untyped_storage().nbytes() for t in {t.untyped_storage().data_ptr(): t for t in local}.values())
    peak = trainer.strategy.reduce(torch.tensor(peak_rss_bytes(), dtype=torch.float64), reduce_op="max")
    if trainer.global_rank == 0:
        marks = timer.marks[WARMUP - 1:]
        out.write_text(json.dumps({"step_seconds": [b - a for a, b in zip(marks, marks[1:])],
                                   "state_bytes": state_bytes, "peak_bytes": int(peak.item())}))
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo can still abort in C++ static destructors at exit (docs/troubleshooting.md)


def _state_tensors(model: Any, optimizer: Any) -> list[Any]:
    tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters() if p.grad is not None]
    return tensors + [t for s in optimizer.state.values() for t in s.values() if hasattr(t, "untyped_storage")]


def step_rows(sizes: list[str], repeats: int) -> list[dict[str, Any]]:
    rows = []
    for size in sizes:
        medians: dict[str, list[float]] = {"native": [], "elastic": []}
        for _ in range(repeats):
            for mode in ("native", "elastic"):  # alternating: drift of the machine hits both alike
                medians[mode].append(statistics.median(_launch(mode, size, "fsdp")["step_seconds"]))
        native, elastic = statistics.median(medians["native"]), statistics.median(medians["elastic"])
        rows.append({"size": size, "native_s": native, "elastic_s": elastic, "ratio": elastic / native,
                     "repeats": repeats})
    return rows


def main() -> None:
    parser = make_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="the small size only, 1 repeat of the step timing")
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs per mode for the step time")
    # What the benchmark passes to its own 2-rank runs (hidden from --help).
    parser.add_argument("--rank-run", choices=["native", "elastic"], help=argparse.SUPPRESS)
    parser.add_argument("--size", choices=sorted(SIZES), default="small", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", choices=sorted(PLANS.values()), default="fsdp", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    add_json(parser)
    args = parser.parse_args()
    if args.rank_run:
        return run_ranks(args.rank_run, args.size, args.strategy, args.out)
    quiet()
    sizes = ["small"] if args.quick else ["small", "large"]
    repeats = 1 if args.quick else args.repeats
    m = machine("cpu")
    print(machine_line(m))
    memory = memory_rows(sizes)
    ddp = {row["size"]: row for row in memory if row["plan"] == "ddp"}
    print("\nPer rank on 2 ranks, AdamW, 32-true, ElasticBatchSize 4 x 8: model state held (parameters, gradients, "
          "optimizer state) and the largest rank's peak resident set\n")
    print(markdown_table(
        ["size", "params", "plan", "model state per rank", "vs ddp", "peak RSS per rank", "vs ddp",
         "peak RSS, mmap threshold fixed", "vs ddp", "step"],
        [[r["size"], f"{r['params'] / 1e6:.1f} M", r["plan"], f"{r['state_bytes'] / 2**20:.1f} MiB",
          f"{r['state_bytes'] / ddp[r['size']]['state_bytes']:.2f}x", f"{r['peak_bytes'] / 2**20:.0f} MiB",
          f"{r['peak_bytes'] / ddp[r['size']]['peak_bytes']:.2f}x", f"{r['peak_bytes_fixed_mmap'] / 2**20:.0f} MiB",
          f"{r['peak_bytes_fixed_mmap'] / ddp[r['size']]['peak_bytes_fixed_mmap']:.2f}x",
          f"{statistics.median(r['step_seconds']) * 1e3:.0f} ms"] for r in memory],
        right=(1, 3, 4, 5, 6, 7, 8, 9)))
    steps = step_rows(sizes, repeats)
    print(f"\nStep time under FSDP2 (ApplyPlan's sharding, 2 ranks): ElasticBatchSize 4 x 8 vs Lightning's "
          f"accumulate_grad_batches=4, median of {repeats} alternating run(s) of {STEPS} timed steps; goal <= "
          f"{GOAL_STEP:.2f}x\n")
    print(markdown_table(["size", "native step", "elastic step", "ratio"],
                         [[r["size"], f"{r['native_s'] * 1e3:.1f} ms", f"{r['elastic_s'] * 1e3:.1f} ms",
                           f"{r['ratio']:.3f}x"] for r in steps], right=(1, 2, 3)))
    write_json(args.json, {"machine": m, "memory": memory, "steps": steps})


if __name__ == "__main__":
    main()
