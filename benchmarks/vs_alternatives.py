"""Against the alternatives: what each way of choosing a batch setup gives under the same memory budget.

For each model, with the model's effective batch ``B`` (its dataloader's batch size) and a budget that binds:

- **naive**: fp32, the whole batch in one forward/backward (micro-batch ``B``). Does it fit, and at what peak?
- **Lightning BatchSizeFinder**: ``Tuner(trainer).scale_batch_size(model, datamodule=dm)`` (mode ``power``, its
  defaults) in a fresh process. It knows nothing of a budget and changes the *effective* batch (the optimizer's
  math), so we report the batch it chose, the peak of its own search, and the throughput and peak of training at
  that batch; its samples/s are not comparable with the others (a different effective batch).
- **halving**: the ``find_executable_batch_size`` recipe with the effective batch kept: start with micro-batch
  ``B``, halve it on "OOM" until a run fits. On CPU an "OOM" is a measured peak over the budget (what the
  soft CPU budget of ``ElasticBatchSize`` reacts to); on CUDA it is a real OOM under the hard cap.
- **autotune**: the plan of a short ``autotune.search`` (``--trials`` trials: 6 with ``--quick``, as in the README,
  else 12; the device's shipped space; sampler seed 0; trials measured as the search does by default).

Every candidate is then measured side by side as a search trial measures a plan (``autotune.measure_plan``: a
fresh process, end-to-end samples/s after warm-up, the process's peak memory) in interleaved rounds (3 with
``--quick``, else 5; the BatchSizeFinder's batch 1 or 3 times, as its samples/s compare with nothing), medians
reported; "vs halving" is a candidate's median samples/s over the halving one's. Then halving's and the search's
plans train as a user's run does (``Plan.callbacks()``: ``ElasticBatchSize`` with the budget and its growing,
``ApplyPlan``) for ``--train-steps`` optimizer steps (100) in a fresh process each: "trained samples/s" over the
run, and "replays", the steps it overflowed (an OOM replayed, on CPU a step over the soft budget) or failed to grow
(goal: at most 1 in 100 steps). "Budget use" is the chosen
setup's peak over the budget (goal 0.85-1.00 where the budget binds). On CPU the peak is the whole process's
memory in a CPU budget's measure, its resident set net of file-backed pages (Python, torch, Lightning: well over
100 MiB before the first step), so the table also shows the use of the budget above that floor ("above floor":
(peak - floor) / (budget - floor), the floor being a trial process's memory after building the model and data).

Models: the GPT example (``examples/gpt/train.py:make``) and the test suite's memory-hungry target
(``tests/fixtures/search_target.py:make``, about 1 MiB of activations per sample and block). Budget: halfway
(``BUDGET_SHARE``) between the peaks of fp32 runs at micro-batch 1 and at the whole batch, so the naive run does
not fit and the smallest fp32 run does. CPU processes run with one intra-op thread (``--threads``); the machine is
shared, so only ratios within one run mean anything. Results go to stdout (and ``--json PATH``) only.

Usage::

    python benchmarks/vs_alternatives.py --quick --device cpu      # 4-5 minutes on a shared 2-core CPU
    python benchmarks/vs_alternatives.py --quick --neighbour 12    # beside a neighbour on 12 s, off 12 s (issue 54)
    python benchmarks/vs_alternatives.py --device cuda --json vs_alternatives.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:  # _common.py, also when this file is loaded by path
    sys.path.insert(0, _HERE)

from _common import (  # noqa: E402
    GPT_TARGET as GPT,
    HUNGRY_TARGET as HUNGRY,
    add_device,
    add_neighbour,
    add_json,
    add_threads,
    current_host_bytes,
    in_fresh_process,
    load_average,
    machine,
    machine_line,
    make_parser,
    neighbour,
    markdown_table,
    peak_host_bytes,
    quiet,
    threads_for,
    write_json,
)

#: The budget: the peak at micro-batch 1 (fp32) plus this share of the way to the naive run's peak.
BUDGET_SHARE = 0.5
#: Goal for the budget use of the chosen plan where the budget binds.
GOAL_USE = (0.85, 1.00)


@dataclass(frozen=True)
class Case:
    """One model: its name in the table and its target."""

    name: str
    target: str


#: The models, in the order they run.
CASES = (Case("gpt", GPT), Case("hungry", HUNGRY))


# ------------------------------------------------------------------------------------------------ fresh processes
# Each worker runs in a fresh process of ``_common.fresh_context()`` (so its memory floor is a trial's).


def floor_worker(target: str) -> dict[str, Any]:
    """The process's memory (a CPU budget's measure) after building the model and data, before any training."""
    from autotune import load_target

    tgt = load_target(target)
    if tgt.datamodule is not None:
        tgt.datamodule.setup("fit")
    return {"floor_bytes": current_host_bytes(), "batch_size": tgt.batch_size()}


def trained_worker(target: str, fields: dict[str, Any], budget: str, device: str, steps: int) -> dict[str, Any]:
    """Train ``steps`` optimizer steps with the plan applied as a user's run applies it (``Plan.callbacks()``: the
    budget, growing on); its samples/s over the run and its ``ElasticBatchSize`` events."""
    import logging

    import lightning as L

    from autotune import Plan, load_target

    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("autotune").setLevel(logging.ERROR)
    plan = Plan.from_dict({**fields, "budget": budget})
    tgt = load_target(target)
    callbacks = plan.callbacks()
    trainer = L.Trainer(accelerator="cuda" if device == "cuda" else "cpu", devices=1, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, callbacks=callbacks, **plan.trainer_kwargs())
    start = time.perf_counter()
    trainer.fit(tgt.model, datamodule=tgt.datamodule)
    wall = time.perf_counter() - start
    events = [(e.kind, e.step, e.previous, e.micro_batch_size) for e in callbacks[0].events]
    return {"steps": trainer.global_step, "samples_per_second": trainer.global_step * tgt.batch_size() / wall,
            "replays": sum(kind in ("oom", "over_budget", "grow_failed") for kind, *_ in events), "events": events}


def batch_size_finder_worker(target: str, device: str) -> dict[str, Any]:
    """Lightning's ``Tuner.scale_batch_size`` with its defaults; the batch it picks and the peak of its search."""
    import logging

    import lightning as L
    from lightning.pytorch.tuner import Tuner

    from autotune import load_target

    logging.getLogger("lightning").setLevel(logging.ERROR)
    tgt = load_target(target)
    trainer = L.Trainer(accelerator="cuda" if device == "cuda" else "cpu", devices=1, max_steps=10, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0)
    start = time.perf_counter()
    chosen = Tuner(trainer).scale_batch_size(tgt.model, datamodule=tgt.datamodule, mode="power")
    wall = time.perf_counter() - start
    if device == "cuda":
        import torch

        peak = torch.cuda.max_memory_reserved()
    else:
        peak = peak_host_bytes()  # the lifetime peak of this process: the scaling search included
    return {"batch_size": chosen, "search_peak_bytes": peak, "wall_seconds": wall}


# ------------------------------------------------------------------------------------------------ measurements


def batch_target(target: str, batch_size: int, folder: Path) -> str:
    """A target file that builds ``target`` with the dataloader's batch size set to ``batch_size``."""
    path = folder / f"batch_{batch_size}.py"
    path.write_text(
        "from autotune import load_target\n\n\n"
        "def make():\n"
        f"    t = load_target({target!r})\n"
        f"    t.datamodule.batch_size = {batch_size}\n"
        "    return t.model, t.datamodule\n"
    )
    return f"{path}:make"


def measure(target: str, plan: dict[str, Any], budget: str | None, device: str, *, steps: int, warmup: int) -> Any:
    """One run of the plan with settings ``plan`` (see :func:`plan_fields`), as a search trial measures it."""
    from autotune import Plan, measure_plan

    return measure_plan(target=target, plan=Plan.from_dict(plan), budget=budget, device=device, steps=steps,
                        warmup=warmup)


def plan_fields(plan: Any) -> dict[str, Any]:
    """A plan's settings without its provenance and budget (the budget a run gets is the benchmark's)."""
    return {k: v for k, v in vars(plan).items() if k not in ("provenance", "budget")}


def halving(target: str, batch: int, budget: str, budget_bytes: int, device: str, steps: int, warmup: int,
            first: Any) -> dict[str, Any]:
    """Micro-batch ``batch``, halved while a run is over the budget (fp32, no other change). ``first`` is the run
    at micro-batch ``batch`` already made (the naive run), counted in the time."""
    from autotune import Plan

    tried = []
    micro = batch
    start = time.perf_counter() - (first.wall_seconds or 0.0)
    while True:
        result = first if micro == batch else measure(target, plan_fields(Plan(micro_batch_size=micro)), budget,
                                                      device, steps=steps, warmup=warmup)
        fits = result.status == "ok" and (result.peak_bytes or 0) <= budget_bytes
        tried.append({"micro": micro, "status": result.status, "peak_bytes": result.peak_bytes,
                      "samples_per_second": result.samples_per_second, "fits": fits})
        if fits or micro == 1:
            break
        micro //= 2
    return {"micro": micro, "fits": tried[-1]["fits"], "tried": tried, "wall_seconds": time.perf_counter() - start}


def tuned(case: Case, budget: str, device: str, trials: int, steps: int, warmup: int, folder: Path) -> dict[str, Any]:
    """The plan of a short ``autotune.search`` under ``budget`` and how long choosing it took."""
    from autotune import NoFeasiblePlanError, search

    start = time.perf_counter()
    storage, name = f"sqlite:///{folder / 'tuned.db'}", f"vs-{case.name}-{budget}"
    try:
        result = search(target=case.target, budget=budget, trials=trials, storage=storage, study=name, out=None,
                        seed=0, device=device, steps=steps, warmup=warmup)
    except NoFeasiblePlanError as err:
        import optuna

        found = trials_log(optuna.load_study(study_name=name, storage=storage))
        print(f"[{case.name}] autotune search: {err}; its trials (number, plan, status, source, samples/s, peak MiB, "
              "predicted MiB):", file=sys.stderr)
        for number, plan, status, source, rate, peak, predicted in found:  # why nothing fit, in the report
            print(f"[{case.name}]   trial {number}: {plan}, {status}, {source}, {rate}, "
                  f"{peak and round(peak / 2**20, 1)}, {predicted and round(predicted / 2**20, 1)}", file=sys.stderr)
        return {"plan": "no plan found", "fields": None, "wall_seconds": time.perf_counter() - start,
                "trials": found}
    wall = time.perf_counter() - start
    return {"plan": result.plan.describe(), "fields": plan_fields(result.plan), "wall_seconds": wall,
            "trials": trials_log(result.study)}


def trials_log(study: Any) -> list[tuple[Any, ...]]:
    """Each trial of a search's study: number, plan, status, source, samples/s, peak bytes, predicted bytes."""
    return [(t.number, t.user_attrs.get("plan"), t.user_attrs.get("status"), t.user_attrs.get("source"),
             t.user_attrs.get("samples_per_second"), t.user_attrs.get("peak_bytes"),
             t.user_attrs.get("predicted_peak_bytes"))
            for t in study.get_trials(deepcopy=False)]


def side_by_side(candidates: list[dict[str, Any]], budget: str, device: str, rounds: int) -> None:
    """Measure every candidate ``rounds`` times, interleaved (round r in an order rotated by r); fills medians."""
    runs: list[list[Any]] = [[] for _ in candidates]
    live = [i for i, c in enumerate(candidates) if c["fields"] is not None]  # a search that found no plan: nothing
    for r in range(rounds):
        now = [i for i in live if r < candidates[i].get("rounds", rounds)]
        order = now[r % len(now):] + now[: r % len(now)]
        for i in order:
            c = candidates[i]
            runs[i].append(measure(c["target"], c["fields"], budget, device, steps=c["steps"], warmup=c["warmup"]))
    for c, results in zip(candidates, runs):
        ok = [x for x in results if x.status in ("ok",)]
        c["samples_per_second"] = statistics.median(x.samples_per_second for x in ok) if ok else None
        c["peak_bytes"] = statistics.median(x.peak_bytes for x in ok if x.peak_bytes) if ok else None
        c["runs"] = [(x.status, round(x.samples_per_second or 0.0, 1), x.peak_bytes) for x in results]


# ------------------------------------------------------------------------------------------------ one model


def run_case(case: Case, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """Budget, every method's choice and the side-by-side measurement for one model."""
    dev, mib = args.device, 2**20
    log = lambda text: print(f"[{case.name}] {text}", file=sys.stderr, flush=True)  # noqa: E731
    base = in_fresh_process(floor_worker, case.target)
    floor, batch = base["floor_bytes"], base["batch_size"]
    # The naive run is also the halving's first try; the run at micro-batch 1 only sets the budget (its peak).
    naive = measure(case.target, plan_fields(_plan(micro_batch_size=batch)), None, dev, steps=args.steps,
                    warmup=args.warmup)
    smallest = measure(case.target, plan_fields(_plan(micro_batch_size=1)), None, dev, steps=2, warmup=1)
    for name, run in (("naive", naive), ("micro-batch 1", smallest)):
        if run.status != "ok" or not run.peak_bytes:
            raise RuntimeError(f"{case.name}: the {name} run did not finish: {run.status} {run.reason}")
    budget_bytes = int(smallest.peak_bytes + BUDGET_SHARE * (naive.peak_bytes - smallest.peak_bytes)) // mib * mib
    budget = f"{budget_bytes // mib}MiB"
    log(f"floor {floor / mib:.1f} MiB, peak at micro-batch 1 {smallest.peak_bytes / mib:.1f} MiB, naive peak "
        f"{naive.peak_bytes / mib:.1f} MiB -> budget {budget}")

    log("Lightning BatchSizeFinder ...")
    bsf = in_fresh_process(batch_size_finder_worker, case.target, dev)
    log(f"BatchSizeFinder chose batch {bsf['batch_size']}; halving ...")
    halve = halving(case.target, batch, budget, budget_bytes, dev, args.steps, args.warmup, naive)
    log(f"halving chose micro {halve['micro']} after {len(halve['tried'])} runs; autotune search ...")
    tune = tuned(case, budget, dev, args.trials, args.steps, args.warmup, folder)
    log(f"autotune chose {tune['plan']}; side by side ...")

    bsf_batch = bsf["batch_size"]
    bsf_steps = max(2, args.judge_steps * batch // bsf_batch)  # about the same samples as the others' runs
    candidates = [
        {"method": "naive (fp32, whole batch)", "target": case.target, "batch": batch,
         "fields": plan_fields(_plan(micro_batch_size=batch)), "setup": f"micro {batch}", "choose_seconds": 0.0,
         "steps": args.judge_steps, "warmup": args.warmup},
        {"method": "Lightning BatchSizeFinder", "target": batch_target(case.target, bsf_batch, folder),
         "batch": bsf_batch, "fields": plan_fields(_plan(micro_batch_size=bsf_batch)),
         "setup": f"batch {bsf_batch}", "choose_seconds": bsf["wall_seconds"],
         "search_peak_bytes": bsf["search_peak_bytes"], "steps": bsf_steps, "warmup": 1,
         "rounds": args.bsf_rounds},
        {"method": "halving on OOM", "target": case.target, "batch": batch,
         "fields": plan_fields(_plan(micro_batch_size=halve["micro"])), "setup": f"micro {halve['micro']}",
         "choose_seconds": halve["wall_seconds"], "steps": args.judge_steps, "warmup": args.warmup},
        {"method": f"autotune search ({args.trials} trials)", "target": case.target, "batch": batch,
         "fields": tune["fields"], "setup": tune["plan"], "choose_seconds": tune["wall_seconds"],
         "steps": args.judge_steps, "warmup": args.warmup},
    ]
    side_by_side(candidates, budget, dev, args.rounds)
    for c in candidates:  # halving's and the search's plans, trained as a user's run is (budget, growing)
        if c["method"].startswith(("halving", "autotune")) and c["fields"] is not None:
            c["trained"] = in_fresh_process(trained_worker, case.target, c["fields"], budget, dev, args.train_steps)
            log(f"{c['method']}: {c['trained']['steps']} steps trained at {c['trained']['samples_per_second']:.1f}/s, "
                f"{c['trained']['replays']} replays {c['trained']['events']}")
    for c in candidates:
        peak = c["peak_bytes"]
        c["fits"] = peak is not None and peak <= budget_bytes
        c["budget_use"] = peak / budget_bytes if peak else None
        c["use_above_floor"] = (peak - floor) / (budget_bytes - floor) if peak else None
        del c["target"]
    return {"model": case.name, "batch": batch, "floor_bytes": floor, "budget": budget, "budget_bytes": budget_bytes,
            "naive_first_peak_bytes": naive.peak_bytes, "micro1_peak_bytes": smallest.peak_bytes,
            "bsf": bsf, "tuned_trials": tune.get("trials"), "halving_tried": halve["tried"], "candidates": candidates}


def _plan(**fields: Any) -> Any:
    from autotune import Plan

    return Plan(**fields)


# ------------------------------------------------------------------------------------------------ output


def report(results: dict[str, Any]) -> str:
    """The Markdown report: the machine, the table, and a line per model."""
    rows = [["model", "budget", "method", "effective batch", "setup", "samples/s", "peak MiB", "fits",
             "budget use", "above floor", "vs halving", "time to choose (s)", "trained samples/s", "replays"]]
    lines = []
    for case in results["cases"]:
        by = {c["method"].split(" (")[0]: c for c in case["candidates"]}
        halve = by["halving on OOM"]["samples_per_second"]
        for c in case["candidates"]:
            sps = c["samples_per_second"]
            rows.append([case["model"], f"{case['budget']} (floor {case['floor_bytes'] / 2**20:.0f} MiB)",
                         c["method"], str(c["batch"]), c["setup"], f"{sps:.1f}" if sps else "-",
                         f"{c['peak_bytes'] / 2**20:.1f}" if c["peak_bytes"] else "-", "yes" if c["fits"] else "NO",
                         f"{c['budget_use']:.3f}" if c["budget_use"] else "-",
                         f"{c['use_above_floor']:.2f}" if c["use_above_floor"] is not None else "-",
                         f"{sps / halve:.2f}" if sps and halve and c["batch"] == case["batch"] else "n/a",
                         f"{c['choose_seconds']:.0f}",
                         f"{c['trained']['samples_per_second']:.1f}" if c.get("trained") else "-",
                         f"{c['trained']['replays']} in {c['trained']['steps']}" if c.get("trained") else "-"])
        bsf = by["Lightning BatchSizeFinder"]
        tuned_c = next(c for c in case["candidates"] if c["method"].startswith("autotune"))
        lo, hi = GOAL_USE
        use = tuned_c["budget_use"]
        lines.append(
            f"{case['model']}: BatchSizeFinder chose batch {bsf['batch']} (effective batch {case['batch']} asked), "
            f"peak of its own search {bsf['search_peak_bytes'] / 2**20:.1f} MiB; halving tried micro "
            f"{', '.join(str(t['micro']) for t in case['halving_tried'])}; autotune budget use "
            + (f"{use:.3f} (goal {lo}-{hi}: {'met' if lo <= use <= hi else 'NOT met'}), above the floor "
               f"{tuned_c['use_above_floor']:.2f}" if use else "- (no plan)"))
    return "\n".join([machine_line(results["machine"]), "", markdown_table(rows[0], rows[1:], pad=True), "", *lines,
                      f"total wall time {results['wall_seconds']:.0f} s"])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = make_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="short runs (4-5 min on a shared 2-core CPU)")
    add_device(parser)
    add_threads(parser, "intra-op threads per process (default: 1 on CPU, torch's default on CUDA)")
    parser.add_argument("--cases", nargs="+", choices=[c.name for c in CASES], default=[c.name for c in CASES],
                        help="the models to run (default: all; each case's table is printed as it ends)")
    parser.add_argument("--train-steps", type=int, default=100,
                        help="optimizer steps of the trained runs of halving's and the search's plans (default 100)")
    parser.add_argument("--trials", type=int, default=None,
                        help="trials of the autotune search (default: 6 with --quick, else 12)")
    add_neighbour(parser)
    add_json(parser)
    args = parser.parse_args(argv)
    # Timed steps at most (a trial stops once its 95% interval is within +-3%) and warm-up steps at least of the
    # search's and the halving's trials, as a search has them by default; timed steps at most, rounds (and rounds for
    # the BatchSizeFinder's batch, whose samples/s compare with nothing) of the side-by-side measurement.
    args.steps, args.warmup, args.judge_steps, args.rounds, args.bsf_rounds = (
        (20, 2, 20, 3, 1) if args.quick else (20, 2, 40, 5, 3))
    if args.trials is None:
        args.trials = 6 if args.quick else 12
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads = threads_for(args.device, args.threads)
    if threads:  # before torch starts (here and in the fork server, which inherits the environment)
        os.environ["OMP_NUM_THREADS"] = str(threads)
    quiet()
    start = time.perf_counter()
    results: dict[str, Any] = {"machine": machine(args.device, threads=threads), "quick": args.quick, "cases": []}
    with tempfile.TemporaryDirectory(prefix="autotune-vs-") as tmp, neighbour(args.neighbour) as comings:
        results["neighbour"] = comings
        for case in (c for c in CASES if c.name in args.cases):
            folder = Path(tmp) / case.name
            folder.mkdir()
            results["cases"].append(run_case(case, args, folder))
            results["wall_seconds"] = time.perf_counter() - start
            if len(args.cases) > 1:  # kept if a later case is cut at a time limit
                print(report({**results, "cases": results["cases"][-1:]}) + "\n", flush=True)
                write_json(args.json, results)
    results["machine"]["load_average_end"] = load_average()
    print(report(results))
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
