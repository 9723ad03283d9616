"""Runtime overhead of ``ElasticBatchSize`` against plain Lightning, measured side by side in one run.

Four measurements on the example GPT (``examples/gpt``), each against its own baseline:

1. no split: plain Lightning at batch N vs ``ElasticBatchSize(grow=False)`` at batch N (micro-batch N, no OOM);
   1b the same, with the callback's defaults, on a state-bound GPT (14 M parameters: weights and AdamW state over
   100 MB, small batches) whose step is dominated by the update, where a cost that grows with the model would show;
2. split k: Lightning's ``accumulate_grad_batches=k`` at batch N/k vs the callback with ``micro_batch_size=N/k``
   on batch N;
3. one OOM: ``torch.OutOfMemoryError`` raised once in forward (at the loss, after the logits are computed) when the
   micro-batch is larger than N/2 at step S; its cost is the OOM step's extra time in units of a normal step;
4. DDP: 2 processes (``strategy="ddp"``; gloo on CPU), native accumulation k vs the callback's split k. Each
   configuration is a separate launch of this file in worker mode (``--ddp-worker CONFIG --out FILE``), because
   Lightning's DDP launcher re-runs the script for rank 1.

1 and 2 run with ``protect_update=True`` (the default) and ``False``. The configurations of one measurement are
interleaved (repeat r fits them all, in an order rotated by r); a configuration's ms/step is the median of all its
timed steps over all repeats and its ratio is that over the baseline's, with the range of the per-repeat ratios.
Steps are timed by a small callback (``time.perf_counter``, after ``torch.cuda.synchronize()`` on CUDA) from the end
of one optimizer step to the end of the next; warm-up steps are dropped. On CPU the same callback also takes the
process's CPU time per step, a second figure that other processes sharing the cores barely move. Seeds are fixed.
Single-process CPU runs use one torch thread (``--threads``), as each DDP rank does.

After the table, extra runs (not in it) attribute the callback's time with public API only: its hooks are wrapped
with timers (CPU time of the training thread), ``gc.collect`` is timed on the OOM step (the recovery's collection),
``ElasticBatchSize.update_snapshot_bytes`` gives the host bytes copied per step for both models, and the DDP runs of
the callback count and time ``torch.distributed.all_reduce`` calls, votes (float64) apart from gradient buckets.
Runs log at Lightning's default interval (every 50 steps), as users have it. Results go to stdout (and
``--json PATH``) only.

Usage::

    python benchmarks/elastic_overhead.py --quick --device cpu      # under 4 minutes on a 2-core CPU
    python benchmarks/elastic_overhead.py --device cuda --json elastic_overhead.json
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from typing_extensions import override

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:  # _common.py and _overhead_parts.py, also when this file is loaded by path
    sys.path.insert(0, _HERE)

from _common import (  # noqa: E402
    add_device,
    add_json,
    add_threads,
    load_average,
    machine,
    make_parser,
    threads_for,
    use_paths,
)

use_paths(gpt=True)  # model.py and data.py import as train.py imports them

from _overhead_parts import (  # noqa: E402
    ATTRIBUTED_DDP,
    BATCH,
    BLOCK,
    DDP,
    FULL,
    MODEL,
    NATIVE,
    NO_SPLIT,
    OOM,
    PLAIN,
    QUICK,
    STATE_PLAIN,
    SPLIT_K,
    VOCAB,
    STATE_BLOCK,
    STATE_MODEL,
    STATE_NO_SPLIT,
    RunConfig,
    Sizing,
    report,
)
from autotune.callbacks import ElasticBatchSize  # noqa: E402
from _overhead_timing import SnapshotBytes, StepTimer, all_reduce_dtypes, per_step, timed_calls  # noqa: E402
from data import SyntheticTokens  # noqa: E402
from model import GPT  # noqa: E402


class OOMOnceGPT(GPT):
    """The example GPT whose forward runs out of memory once: at step ``oom_step`` for micro-batches over ``above``.

    The OOM is raised where the largest activation of a GPT forward is allocated, at the loss over the logits, after
    the blocks and the LM head have run (their activations are held by the traceback, as with a real OOM).
    """

    oom_step: int = -1
    above: int = 0

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.trainer.global_step == self.oom_step and batch[0].shape[0] > self.above:
            logits = self(batch[0])
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {logits.numel() * 4 / 2**20:.0f} MiB (simulated at the loss)"
            )
        return super().training_step(batch, batch_idx)


def _quiet() -> None:
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "autotune"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*smaller than the logging interval.*")
    warnings.filterwarnings("ignore", message=".*`isinstance\\(treespec, LeafSpec\\)` is deprecated.*")


def fit_once(cfg: RunConfig, *, steps: int, accelerator: str, oom_step: int = -1, strategy: str = "auto",
             devices: int = 1, log_every_step: bool = False) -> tuple[StepTimer, ElasticBatchSize | None]:
    """Train ``steps`` optimizer steps of ``cfg`` from fixed seeds; return the step timer and the callback."""
    seed_everything(0, verbose=False)
    world = devices if strategy == "ddp" else 1
    block, sizes = (STATE_BLOCK, STATE_MODEL) if cfg.state_bound else (BLOCK, MODEL)
    data = SyntheticTokens(vocab_size=VOCAB, block_size=block, batch_size=cfg.batch, val_samples=1, seed=0,
                           num_samples=cfg.batch * cfg.accumulate * steps * world, pin_memory=accelerator == "cuda")
    model_cls = OOMOnceGPT if cfg.oom else GPT
    model = model_cls(vocab_size=VOCAB, block_size=block, **sizes)
    if cfg.oom:
        model.oom_step, model.above = oom_step, BATCH // 2
    timer = StepTimer(sync_cuda=accelerator == "cuda")
    elastic = ElasticBatchSize(grow=False, micro_batch_size=cfg.micro, protect_update=cfg.protect) if cfg.elastic \
        else None
    snapshots = SnapshotBytes(elastic) if elastic else None
    trainer = Trainer(  # Lightning's default logging interval (every 50 steps), as users have it
        accelerator=accelerator, devices=devices, strategy=strategy, max_steps=steps,
        accumulate_grad_batches=cfg.accumulate,
        callbacks=[timer] + ([elastic, snapshots] if elastic and snapshots else []),
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, num_sanity_val_steps=0, **({"log_every_n_steps": 1} if log_every_step else {}),
    )
    trainer.fit(model, data)
    _check_run(cfg, trainer, timer, elastic, steps=steps, oom_step=oom_step)
    timer.snapshot_bytes = snapshots.per_step if snapshots else []
    return timer, elastic


def _check_run(cfg: RunConfig, trainer: Trainer, timer: StepTimer, elastic: ElasticBatchSize | None, *, steps: int,
               oom_step: int) -> None:
    """Fail loudly when a run did not measure what it claims (a wrong split, a missing or extra OOM)."""
    problems = []
    if trainer.global_step != steps or len(timer.times) != steps:
        problems.append(f"{trainer.global_step} steps and {len(timer.times)} timings, expected {steps}")
    if elastic is not None:
        want_micro = BATCH // 2 if cfg.oom else (cfg.micro or cfg.batch)
        want_events = [("oom", oom_step, BATCH, BATCH // 2)] if cfg.oom else []
        events = [(e.kind, e.step, e.previous, e.micro_batch_size) for e in elastic.events]
        if elastic.micro_batch_size != want_micro or events != want_events:
            problems.append(f"micro-batch {elastic.micro_batch_size} and events {events}, expected {want_micro} "
                            f"and {want_events}")
    if problems:
        raise RuntimeError(f"benchmark run {cfg.name!r} went wrong: " + "; ".join(problems))


# ------------------------------------------------------------------------------------------------ summaries
def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


Runs = dict[str, dict[str, list[list[float]]]]  # configuration -> clock ("wall", "cpu") -> repeats -> step times
CLOCKS = ("wall", "cpu")


def summarize(runs: Runs, warmup: int, baseline: str) -> dict[str, dict[str, Any]]:
    """Per configuration and clock: the median ms/step over all timed steps of all repeats; its ratio to the
    baseline, the median of the per-repeat ratios (each repeat's median over the baseline's in that repeat), and their
    range. The ratio compares runs of one repeat, which run side by side: on a machine whose speed drifts between
    repeats (an H200 host ran 5.2 and 7.0 ms steps in alternate repeats) the ratio of pooled medians compares one
    speed with another (it read 0.871 where every repeat's ratio was 1.001-1.058)."""
    out: dict[str, dict[str, Any]] = {}
    for name, clocks in runs.items():
        out[name] = {"timed_steps": sum(len(r[warmup:]) for r in clocks["wall"])}
        for clock in CLOCKS:
            timed = [r[warmup:] for r in clocks[clock]]
            base = [r[warmup:] for r in runs[baseline][clock]]
            per_repeat = [median(r) / median(b) for r, b in zip(timed, base)]
            ms = 1e3 * median([t for r in timed for t in r])
            out[name][clock] = {
                "ms_per_step": ms,
                "ratio": median(per_repeat),
                "ratio_min": min(per_repeat),
                "ratio_max": max(per_repeat),
            }
    return out


def summarize_oom(clocks: dict[str, list[list[float]]], sizing: Sizing) -> dict[str, Any]:
    """The OOM step against the same run's normal steps after it (at the replay's micro-batch, N/2), per clock."""
    s = sizing.oom_step
    out: dict[str, Any] = {"oom_step": s}
    for clock in CLOCKS:
        extra, normal_ms, oom_ms, before_ms = [], [], [], []
        for times in clocks[clock]:
            normal = median(times[s + 1:])
            extra.append((times[s] - normal) / normal)
            normal_ms.append(1e3 * normal)
            oom_ms.append(1e3 * times[s])
            before_ms.append(1e3 * median(times[sizing.warmup:s]))
        out[clock] = {
            "oom_step_ms": median(oom_ms),
            "normal_ms": median(normal_ms),
            "before_ms": median(before_ms),
            "extra_steps": median(extra),
            "extra_steps_min": min(extra),
            "extra_steps_max": max(extra),
        }
    return out


# ---------------------------------------------------------------------------------------------- attribution
def attribute(sizing: Sizing, accelerator: str) -> dict[str, Any]:
    """Where the callback's time goes, from extra runs that are not part of the table (CPU time of the thread), with
    public API only: the callback's hooks, ``LightningModule.log``, ``gc.collect`` (the OOM recovery's collection)
    and ``ElasticBatchSize.update_snapshot_bytes``."""
    targets = [
        (ElasticBatchSize, "on_train_batch_start", "callback hook on_train_batch_start (cuts the batch)"),
        (ElasticBatchSize, "on_train_batch_end", "callback hook on_train_batch_end (metrics on logging steps)"),
    ]
    out: dict[str, Any] = {}
    with timed_calls(targets) as calls:
        timer, _ = fit_once(NO_SPLIT[1], steps=sizing.steps, accelerator=accelerator)
    out["per_step"] = {label: per_step(c, timer.marks, sizing.warmup, cpu=True) for label, c in calls.items()}
    with timed_calls([(LightningModule, "log", "log")]) as calls:
        fit_once(PLAIN, steps=sizing.steps, accelerator=accelerator, log_every_step=True)
    out["log_call_ms"] = 1e3 * median([cpu_s for _, cpu_s, _ in calls["log"][sizing.warmup:]])
    collected: list[int] = []
    with timed_calls([(gc, "collect", "gc")], results=collected) as calls:
        fit_once(OOM, steps=sizing.steps, accelerator=accelerator, oom_step=sizing.oom_step)
    out["gc_calls"] = len(calls["gc"])
    out["gc_ms"] = 1e3 * sum(wall for _, _, wall in calls["gc"])
    out["gc_cpu_ms"] = 1e3 * sum(cpu for _, cpu, _ in calls["gc"])
    out["gc_collected"] = sum(collected)
    out["gc_objects"] = len(gc.get_objects())
    out["snapshot"] = {}
    for name, cfg, sizes, block in (("example GPT", NO_SPLIT[1], MODEL, BLOCK),
                                    ("state-bound GPT", STATE_NO_SPLIT[1], STATE_MODEL, STATE_BLOCK)):
        timer, _ = fit_once(cfg, steps=sizing.warmup + 2, accelerator=accelerator)
        params = sum(p.numel() for p in GPT(vocab_size=VOCAB, block_size=block, **sizes).parameters())
        out["snapshot"][name] = {"params": params, "first_mib": timer.snapshot_bytes[0] / 2**20,
                                 "steady_max_bytes": max(timer.snapshot_bytes[1:])}
    out["params"] = sum(p.numel() for p in GPT(vocab_size=VOCAB, block_size=BLOCK, **MODEL).parameters())
    out["profile"] = profile_diff(sizing, accelerator)
    return out


#: Profiler event names that wait for the device (a host that waits cannot queue the next kernels meanwhile): these
#: parts of a name, or ``cudaMemcpy`` itself (its ``Async`` form need not wait).
SYNCS = ("Synchronize", "_local_scalar_dense", "aten::item")


def profile_diff(sizing: Sizing, accelerator: str, *, top: int = 10) -> dict[str, Any]:
    """Where the no-split step's extra time goes, which the hooks' CPU time does not show (on an H200: +0.8-1.5 ms of
    wall time, 0.05 ms in the hooks): one profiled run of plain Lightning and one of the callback without a split
    (whole fits, counted per step), the profiler's events by name (CUDA runtime calls included on CUDA): the names
    whose self CPU time grew most, and the calls that wait for the device in each."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if accelerator == "cuda" else [])]
    per_step: dict[str, dict[str, tuple[float, float]]] = {}
    for cfg in (PLAIN, NO_SPLIT[1]):
        with profile(activities=activities) as prof:
            fit_once(cfg, steps=sizing.steps, accelerator=accelerator)
        per_step[cfg.name] = {e.key: (e.count / sizing.steps, e.self_cpu_time_total / 1e3 / sizing.steps)
                              for e in prof.key_averages()}
    plain, elastic = per_step[PLAIN.name], per_step[NO_SPLIT[1].name]
    rows = [(name, *plain.get(name, (0.0, 0.0)), *elastic[name]) for name in elastic]
    grew = sorted(rows, key=lambda r: r[4] - r[2], reverse=True)[:top]
    syncs = {cfg: {n: c for n, (c, _) in table.items() if n == "cudaMemcpy" or any(k in n for k in SYNCS)}
             for cfg, table in per_step.items()}
    return {"grew": [{"name": n, "plain_calls": pc, "plain_ms": pm, "elastic_calls": ec, "elastic_ms": em}
                     for n, pc, pm, ec, em in grew], "syncs": syncs}


def ddp_targets() -> list[tuple[Any, str, str]]:
    return [(torch.distributed, "all_reduce", "torch.distributed.all_reduce")]


# ------------------------------------------------------------------------------------------------ measuring
def interleave(configs: list[RunConfig], sizing: Sizing, accelerator: str) -> Runs:
    """Repeat r fits every configuration once, in an order rotated by r."""
    runs: Runs = {c.name: {clock: [] for clock in CLOCKS} for c in configs}
    for r in range(sizing.repeats):
        for cfg in configs[r % len(configs):] + configs[: r % len(configs)]:
            timer, _ = fit_once(cfg, steps=sizing.steps, accelerator=accelerator, oom_step=sizing.oom_step)
            runs[cfg.name]["wall"].append(timer.times)
            runs[cfg.name]["cpu"].append(timer.cpu_times)
            gc.collect()
            if accelerator == "cuda":
                torch.cuda.empty_cache()
    return runs


def ddp_accelerator(device: str) -> str:
    """DDP runs on 2 GPUs when there are 2, else on 2 CPU processes (gloo)."""
    return "cuda" if device == "cuda" and torch.cuda.device_count() >= 2 else "cpu"


def run_ddp(sizing: Sizing, device: str, quick: bool) -> tuple[Runs, dict[str, Any]]:
    """Each configuration in its own launch of this file in worker mode; rank 0's step times come back as JSON."""
    configs = list(DDP)
    runs: Runs = {name: {clock: [] for clock in CLOCKS} for name in configs}
    attributions: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="elastic_overhead_") as tmp:
        for r in range(sizing.ddp_repeats):
            for name in configs[r % len(configs):] + configs[: r % len(configs)]:
                out = Path(tmp) / f"{name}_{r}.json"
                _launch_worker(name, out, device, quick)
                result = json.loads(out.read_text())
                runs[name]["wall"].append(result["times_s"])
                runs[name]["cpu"].append(result["cpu_times_s"])
                if name == ATTRIBUTED_DDP:
                    attributions.append(result["attribution"])
    attribution = {label: {key: median([a[label][key] for a in attributions]) for key in attributions[0][label]}
                   for label in attributions[0]}
    return runs, attribution


def _launch_worker(name: str, out: Path, device: str, quick: bool) -> None:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--ddp-worker", name, "--out", str(out), "--device", device,
           *(["--quick"] if quick else [])]
    env = {k: v for k, v in os.environ.items()
           if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"DDP worker {name!r} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")


def ddp_worker(name: str, out: Path, sizing: Sizing, device: str) -> None:
    """One DDP configuration, 2 processes; Lightning re-runs this command for rank 1. Each rank writes its times.

    The runs of :data:`ATTRIBUTED_DDP` also time the callback's collectives (a few microseconds of wrapping per call).
    """
    attribute_calls = name == ATTRIBUTED_DDP
    accelerator = ddp_accelerator(device)
    if accelerator == "cpu":
        torch.set_num_threads(1)  # 2 processes on the cores there are; 1 thread each, as torchrun defaults to
    cfg = DDP[name]
    dtypes: list[torch.dtype] = []
    with timed_calls(ddp_targets() if attribute_calls else []) as calls, all_reduce_dtypes(dtypes, attribute_calls):
        timer, _ = fit_once(cfg, steps=sizing.ddp_steps, accelerator=accelerator, strategy="ddp", devices=2)
    result: dict[str, Any] = {"config": name, "times_s": timer.times, "cpu_times_s": timer.cpu_times}
    if attribute_calls:
        # The callback's votes reduce a float64 vector; gradients travel in the model's dtype (float32 here).
        reduced = calls.pop("torch.distributed.all_reduce")
        kinds = [dtype for dtype in dtypes]
        calls["agreement votes (float64 all-reduces)"] = [c for c, d in zip(reduced, kinds) if d == torch.float64]
        calls["gradient all-reduces (buckets)"] = [c for c, d in zip(reduced, kinds) if d != torch.float64]
        result["attribution"] = {label: per_step(c, timer.marks, sizing.ddp_warmup, cpu=False)
                                 for label, c in calls.items()}
        result["attribution"]["step"] = {"ms_per_step": 1e3 * median(timer.times[sizing.ddp_warmup:])}
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    path = out if rank == 0 else out.with_name(f"{out.name}.rank{rank}")
    path.write_text(json.dumps(result))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = make_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="few steps and repeats (< 4 min on a 2-core CPU)")
    add_device(parser, default="cuda" if torch.cuda.is_available() else "cpu")
    add_json(parser, "also write the raw timings and the summary here")
    parser.add_argument("--skip-ddp", action="store_true", help="leave out measurement 4")
    parser.add_argument("--ddp-worker", choices=sorted(DDP), help=argparse.SUPPRESS)
    add_threads(parser, "torch threads of the single-process runs (default: 1 on CPU, torch's default on CUDA); "
                        "DDP on CPU always runs 2 processes of 1 thread")
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available; use --device cpu")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be a positive int; got {args.threads}")
    if args.ddp_worker and args.out is None:
        parser.error("--ddp-worker needs --out FILE")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _quiet()
    sizing = QUICK if args.quick else FULL
    if args.ddp_worker:
        ddp_worker(args.ddp_worker, args.out, sizing, args.device)
        return 0
    threads = threads_for(args.device, args.threads)
    if threads:  # one thread: steadier when other processes share the cores, and no idle OpenMP spinning
        torch.set_num_threads(threads)
    start = time.perf_counter()
    results: dict[str, Any] = {
        "command": " ".join(["python", "benchmarks/elastic_overhead.py"] + sys.argv[1:]),
        "machine": machine(args.device),
        "device": args.device,
        "model": MODEL,
        "sizing": asdict(sizing),
    }
    raw: dict[str, Any] = {}
    phases = results["phase_s"] = {}
    raw["no_split"] = interleave(NO_SPLIT + [OOM], sizing, args.device)  # the OOM run has batch N too
    raw["oom"] = raw["no_split"].pop(OOM.name)
    results["no_split"] = summarize(raw["no_split"], sizing.warmup, PLAIN.name)
    raw["state_no_split"] = interleave(STATE_NO_SPLIT, sizing, args.device)
    results["state_no_split"] = summarize(raw["state_no_split"], sizing.warmup, STATE_PLAIN.name)
    raw["split"] = interleave(SPLIT_K, sizing, args.device)
    results["split"] = summarize(raw["split"], sizing.warmup, NATIVE.name)
    phases["single_process"] = time.perf_counter() - start
    results["oom"] = summarize_oom(raw["oom"], sizing)
    if not args.skip_ddp:
        results["ddp_accelerator"] = ddp_accelerator(args.device)
        raw["ddp"], results["ddp_attribution"] = run_ddp(sizing, args.device, args.quick)
        results["ddp"] = summarize(raw["ddp"], sizing.ddp_warmup, "ddp_native_acc")
        phases["ddp"] = time.perf_counter() - start - phases["single_process"]
    results["attribution"] = attribute(sizing, args.device)
    results["load_avg_at_end"] = load_average()
    results["wall_s"] = time.perf_counter() - start
    print(report(results))
    if args.json:
        args.json.write_text(json.dumps({"results": results, "raw_step_times_s": raw}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
