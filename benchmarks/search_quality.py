"""Search quality: ``autotune.search`` against exhaustive search and random search over the same space.

One model and budget at a time (the GPT example, or with ``--target long`` the same at a 4x longer context; budgets
from its plans' peaks: ``loose`` fits every plan, a pure speed search; ``tight`` is the middle of the widest gap
between plans' peaks below the naive plan's, fp32 with the whole batch, so that the plans that fit do not change with
a MiB of resident-set noise):

- **exhaustive**: every distinct plan of the space (``SearchSpace.points()``; ``auto`` resolved as the search
  resolves it) measured once with ``autotune.measure_plan``, the search's own noise-aware trial (warm-up until step
  time is stable, timed until the 95% interval is within +-3% or 20 steps). Then the **oracle**: every plan whose
  interval reaches within 10% of the best one is measured ``--oracle-runs`` more times, interleaved; a plan's oracle
  figure is the mean of its runs. "best" is the largest oracle figure of a plan that fits with room for its peak's
  noise (its steps' and runs' spread, the search's own rule: a plan a MiB under the budget whose peaks scatter by
  more is no fit).
- **ours**: ``autotune.search`` as shipped, a fresh study per sampler seed, with 6 and with 12 trials;
- **random**: the same number of trials, each a uniform draw from the space's points (seeded), measured with
  ``autotune.measure_plan``; its answer is its fastest measurement that fits.

For each: "tuned / best" is the oracle figure of the plan chosen over the best plan's (median, min and max over
seeds; goal: median >= 0.97 for ours with 6 and with 12 trials), "trials to 95%" the first trial whose plan's oracle
figure is >= 95% of the best, and the wall time over the exhaustive pass's (goal <= 0.25; the oracle's extra runs
are not charged to it). Also: the search's own time per trial in its process (sampler, estimator, storage; the
trial's process apart; goal <= 0.2 s) and how many re-measurements it made before choosing.

On CPU the budget is the trial process's peak resident set net of file-backed pages (docs/elastic.md#budget) and a
concrete plan's measurement does not depend on it, so the exhaustive pass and the oracle carry over from one budget to
the next (only plans new to a budget, ``auto`` resolving differently, are measured). CPU trials run with one intra-op
thread (``--threads``). Studies live in temporary SQLite files. Results go to stdout (and ``--json PATH``) only.

Usage::

    python benchmarks/search_quality.py --quick               # the tight budget, 3 seeds, 6 trials
    python benchmarks/search_quality.py --quick --load 1      # the same beside one busy process (a noisy machine)
    python benchmarks/search_quality.py --quick --neighbour 12  # beside a neighbour on 12 s, off 12 s (issue 54)
    python benchmarks/search_quality.py --quick --target long # the GPT at a 4x longer context: fits clear the noise
    python benchmarks/search_quality.py                       # both budgets, 5 seeds, 6 and 12 trials
    python benchmarks/search_quality.py --device cuda --json search_quality.json
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:  # _common.py, also when this file is loaded by path
    sys.path.insert(0, _HERE)

from _common import (  # noqa: E402
    GPT_TARGET,
    HERE,
    add_device,
    add_neighbour,
    add_json,
    add_threads,
    load_average,
    machine,
    machine_line,
    make_parser,
    neighbour,
    markdown_table,
    quiet,
    threads_for,
    write_json,
)

#: Goals: the median of our "tuned / best", and our wall time over the exhaustive pass's.
GOAL_QUALITY, GOAL_WALL = 0.97, 0.25
#: "Reached the optimum" for the trials-to-optimum count: this share of the best oracle figure.
REACH_SHARE = 0.95
#: Plans whose interval reaches within this share of the best measurement get the oracle's extra runs.
ORACLE_WITHIN = 0.10
#: ``--target``: the GPT example, and the same at a 4x longer context, whose plans' peaks lie MiBs apart.
TARGETS = {"gpt": GPT_TARGET, "long": f"{HERE / 'long_context.py'}:make"}
#: The ``micro_batch_size`` choice the search resolves with the estimator.
AUTO = "auto"


def _remeasured(study: Any) -> int:
    """How many re-measurements the search made: one study attribute each, named ``remeasured:<trial>:...``."""
    return sum(key.startswith("remeasured:") for key in study.user_attrs)


def plan_of(params: dict[str, Any], micro_batch_size: int | None) -> Any:
    """The plan of one point of a space (Optuna params); ``micro_batch_size`` replaces an ``auto`` choice."""
    from autotune import Plan

    values = dict(params)
    if values.get("micro_batch_size") == AUTO:
        values["micro_batch_size"] = micro_batch_size
    return Plan.from_dict(values)


def _fits(row: dict[str, Any], budget_bytes: int) -> bool:
    """Whether a plan fits with room for its peak's noise (the search's own rule: autotune/_search/choose.py)."""
    return (row["status"] == "ok" and row.get("peak_bytes") is not None
            and row["peak_bytes"] + row.get("peak_noise_bytes", 0) <= budget_bytes)


# ------------------------------------------------------------------------------------------------ budgets


def choose_budgets(rows: list[dict[str, Any]], batch_size: int) -> dict[str, int]:
    """Budgets in whole MiB from the exhaustive pass's peaks. ``loose``: every plan fits, a pure speed search.
    ``tight``: the middle of the widest gap between two plans' peaks below the naive plan's (fp32, the whole batch at
    once), so that which plans fit does not hang on a MiB of resident-set noise, and the naive plan does not fit."""
    mib = 2**20
    ok = [r for r in rows if r["status"] == "ok" and r.get("peak_bytes")]
    budgets = {"loose": math.ceil(max(r["peak_bytes"] for r in ok) * 1.02 / mib)}
    naive = [r["peak_bytes"] for r in ok if r["params"].get("precision", "32-true") == "32-true"
             and r["micro_batch_size"] in (None, batch_size) and not r["params"].get("activation_checkpointing")
             and not r["params"].get("num_workers")]
    peaks = sorted({r["peak_bytes"] for r in ok if not naive or r["peak_bytes"] < naive[0]})
    if len(peaks) >= 2:
        low, high = max(zip(peaks, peaks[1:]), key=lambda pair: pair[1] - pair[0])
        budgets["tight"] = (low + high) // 2 // mib
    return budgets


class Table:
    """Every distinct plan measured so far: its runs (samples/s, interval, peak), by ``Plan.describe()``."""

    def __init__(self) -> None:
        self.rows: dict[str, dict[str, Any]] = {}
        self.wall_seconds = 0.0

    def measure(self, target: str, plan: Any, params: dict[str, Any], device: str) -> dict[str, Any]:
        from autotune import measure_plan

        result = measure_plan(target=target, plan=plan, device=device)
        row = self.rows.setdefault(plan.describe(), {"plan": plan.describe(), "params": dict(params),
                                                     "micro_batch_size": plan.micro_batch_size, "runs": []})
        row["runs"].append({"status": result.status, "samples_per_second": result.samples_per_second or 0.0,
                            "interval": list(result.interval) if result.interval else None,
                            "peak_bytes": result.peak_bytes, "peak_noise_bytes": result.peak_noise_bytes,
                            "context_bytes": result.context_bytes})
        return row

    def view(self, name: str) -> dict[str, Any]:
        """A plan's figure over its runs: mean samples/s, largest peak and its noise (the larger of a run's steps'
        spread and the runs' spread, as the search counts it), status "ok" only if every run was."""
        row = self.rows[name]
        runs = row["runs"]
        ok = all(r["status"] == "ok" for r in runs)
        peaks = [r["peak_bytes"] for r in runs if r["peak_bytes"]]
        return {**row, "status": "ok" if ok else runs[-1]["status"],
                "samples_per_second": statistics.fmean(r["samples_per_second"] for r in runs) if ok else 0.0,
                "peak_bytes": max(peaks) if peaks else None, "count": len(runs),
                "peak_noise_bytes": max([max(peaks) - min(peaks) if peaks else 0,
                                         *(r.get("peak_noise_bytes") or 0 for r in runs)])}

    def views(self) -> list[dict[str, Any]]:
        return [self.view(name) for name in self.rows]


def exhaustive(table: Table, target: str, space: Any, budget: str, budget_bytes: int, device: str,
               batch_size: int) -> tuple[list[str], float, dict[str, int]]:
    """Measure every distinct plan of ``space`` not in ``table`` yet; the plans of this budget, the seconds spent
    on the new ones, and what each ``auto`` point resolved to."""
    import torch

    from autotune import AutoMicro, SearchEstimator, load_target

    # the search's own ``auto``: its estimator, the CPU baseline measured by a short run before the first trial, each
    # measured plan's peak (and CUDA context) calibrating its shape as a search's trials do
    estimator = SearchEstimator(target=load_target(target), device=torch.device(device))
    estimator.measure_baseline(target=target, config=None)
    auto = AutoMicro(estimator=estimator, budget_bytes=budget_bytes, batch_size=batch_size, devices=1)
    names: list[str] = []
    choices: dict[str, int] = {}
    start = time.perf_counter()
    for params in space.points():
        micro = params.get("micro_batch_size")
        if micro == AUTO:
            micro = choices[repr(sorted(params.items()))] = auto(params)
        plan = plan_of(params, micro)
        if plan.describe() not in table.rows:
            run = table.measure(target, plan, params, device)["runs"][-1]
            if run["context_bytes"]:
                estimator.measured_context(run["context_bytes"])
            if run["status"] == "ok" and run["peak_bytes"]:
                estimator.calibrate(plan, run["peak_bytes"], lazily=True)
        if plan.describe() not in names:
            names.append(plan.describe())
    return names, time.perf_counter() - start, choices


def oracle(table: Table, target: str, names: list[str], budget_bytes: int, device: str, runs: int) -> None:
    """Measure the plans near the top ``runs`` more times each, interleaved (round r rotated by r)."""
    from autotune import Plan

    fitting = [v for v in (table.view(n) for n in names) if _fits(v, budget_bytes)]
    if not fitting:
        return
    top = max(fitting, key=lambda v: v["samples_per_second"])
    bar = (1 - ORACLE_WITHIN) * top["samples_per_second"]
    near = [v for v in fitting if (v["runs"][0]["interval"] or [0, math.inf])[1] >= bar and v["count"] < 1 + runs]
    for r in range(runs):
        order = near[r % len(near):] + near[: r % len(near)] if near else []
        for v in order:
            plan = Plan.from_dict({**{k: x for k, x in v["params"].items() if k != "micro_batch_size"},
                                   "micro_batch_size": v["micro_batch_size"]})
            table.measure(target, plan, v["params"], device)


def run_ours(target: str, space: str, budget: str, device: str, trials: int, seed: int, tmp: Path) -> dict[str, Any]:
    """``autotune.search`` as shipped on a fresh study; its plan, wall time and measured trials in order."""
    import optuna

    from autotune import NoFeasiblePlanError, search

    start = time.perf_counter()
    storage = f"sqlite:///{tmp / f'ours-{budget}-{trials}-{seed}.db'}"
    try:
        result = search(target=target, budget=budget, space=space, trials=trials, seed=seed, out=None, device=device,
                        storage=storage, study="ours")
    except NoFeasiblePlanError:  # no plan it measured fits (with room for its noise): no answer, ratio 0
        study = optuna.load_study(study_name="ours", storage=storage)
        ran = [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get("source") == "measured"]
        return {"plan": None, "params": {}, "micro_batch_size": None, "wall_seconds": time.perf_counter() - start,
                "measured": [t.user_attrs.get("plan") for t in ran],
                "trial_seconds": sum(t.user_attrs.get("wall_seconds") or 0.0 for t in ran),
                "parent_seconds": [t.user_attrs.get("parent_seconds") or 0.0 for t in ran],
                "remeasured": _remeasured(study)}
    wall = time.perf_counter() - start
    ran = [t for t in result.study.get_trials(deepcopy=False) if t.user_attrs.get("source") == "measured"]
    return {"plan": result.plan.describe(), "params": dict(result.study.trials[result.trial_number].params),
            "micro_batch_size": result.plan.micro_batch_size, "wall_seconds": wall,
            "measured": [t.user_attrs.get("plan") for t in ran],
            "trial_seconds": sum(t.user_attrs.get("wall_seconds") or 0.0 for t in ran),
            "parent_seconds": [t.user_attrs.get("parent_seconds") or 0.0 for t in ran],
            "remeasured": _remeasured(result.study)}


def run_random(table: Table, target: str, space: Any, budget_bytes: int, device: str, trials: int, seed: int,
               auto: dict[str, int]) -> dict[str, Any]:
    """Random search: ``trials`` uniform draws of the space's points, each measured; the fastest that fits."""
    from autotune import measure_plan

    rng = random.Random(seed)
    points = space.points()
    start = time.perf_counter()
    measured, best = [], None
    for _ in range(trials):
        params = rng.choice(points)
        plan = plan_of(params, auto[repr(sorted(params.items()))] if params.get("micro_batch_size") == AUTO
                       else params["micro_batch_size"])
        result = measure_plan(target=target, plan=plan, device=device)
        row = {"plan": plan.describe(), "status": result.status, "samples_per_second": result.samples_per_second or 0,
               "peak_bytes": result.peak_bytes, "params": dict(params), "micro_batch_size": plan.micro_batch_size}
        measured.append(plan.describe())
        if _fits(row, budget_bytes) and (best is None or row["samples_per_second"] > best["samples_per_second"]):
            best = row
    return {"plan": best["plan"] if best else None, "wall_seconds": time.perf_counter() - start, "measured": measured,
            "params": best["params"] if best else None, "micro_batch_size": best["micro_batch_size"] if best else None}


def figure_of(table: Table, target: str, answer: dict[str, Any], device: str, runs: int) -> float:
    """The oracle figure of a chosen plan (measured ``1 + runs`` times if the table has it fewer times)."""
    from autotune import Plan

    if answer["plan"] is None:
        return 0.0
    if answer["plan"] not in table.rows or table.view(answer["plan"])["count"] < 1 + runs:
        plan = Plan.from_dict({**{k: x for k, x in answer["params"].items() if k != "micro_batch_size"},
                               "micro_batch_size": answer["micro_batch_size"]})
        for _ in range(1 + runs - (table.view(answer["plan"])["count"] if answer["plan"] in table.rows else 0)):
            table.measure(target, plan, answer["params"], device)
    return table.view(answer["plan"])["samples_per_second"]


def reach(table: Table, measured: list[str], best: float) -> int | None:
    """Trials (1-based) until one measured a plan whose oracle figure is >= REACH_SHARE of the best."""
    for i, name in enumerate(measured, start=1):
        if name in table.rows and table.view(name)["samples_per_second"] >= REACH_SHARE * best:
            return i
    return None


def run_budget(args: argparse.Namespace, table: Table, name: str, budget_mib: int, space_path: str, tmp: Path,
               pass_wall: dict[str, float]) -> dict[str, Any]:
    import torch

    from autotune import load_space, load_target

    target, dev = TARGETS[args.target], args.device
    budget, budget_bytes = f"{budget_mib}MiB", budget_mib * 2**20
    batch_size = load_target(target).batch_size()
    space = load_space(space_path).for_device(torch.device(dev), batch_size=batch_size)
    names, wall, auto = exhaustive(table, target, space, budget, budget_bytes, dev, batch_size)
    pass_wall[name] = pass_wall.get("first", 0.0) + wall  # each budget is charged the whole pass
    pass_wall.setdefault("first", wall)
    oracle(table, target, names, budget_bytes, dev, args.oracle_runs)
    fitting = [table.view(n) for n in names if _fits(table.view(n), budget_bytes)]
    best = max(fitting, key=lambda v: v["samples_per_second"])
    out: dict[str, Any] = {"budget_name": name, "budget_mib": budget_mib, "budget_bytes": budget_bytes, "plans": len(names),
                           "plans_fit": len(fitting), "best_plan": best["plan"],
                           "best_sps": best["samples_per_second"], "exhaustive_wall": pass_wall[name], "by_trials": {}}
    for trials in args.trials:
        ours, rand = [], []
        for seed in range(args.seeds):
            print(f"[{name}] {trials} trials, seed {seed} ...", file=sys.stderr, flush=True)
            o = run_ours(target, space_path, budget, dev, trials, seed, tmp)
            o["figure"] = figure_of(table, target, o, dev, args.oracle_runs)
            o["oracle_peak"] = table.view(o["plan"])["peak_bytes"] if o["plan"] in table.rows else None  # None: no plan
            r = run_random(table, target, space, budget_bytes, dev, trials, seed, auto)
            r["figure"] = figure_of(table, target, r, dev, args.oracle_runs)
            ours.append(o)
            rand.append(r)
        out["by_trials"][str(trials)] = {"ours": ours, "random": rand}
    best = max((table.view(n) for n in names if _fits(table.view(n), budget_bytes)),
               key=lambda v: v["samples_per_second"])  # the oracle may have grown
    out["best_plan"], out["best_sps"] = best["plan"], best["samples_per_second"]
    for cell in out["by_trials"].values():
        for answer in (*cell["ours"], *cell["random"]):
            answer["ratio"] = answer["figure"] / best["samples_per_second"]
            answer["reach"] = reach(table, answer["measured"], best["samples_per_second"])
    return out


# ------------------------------------------------------------------------------------------------ output


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def _reach(values: list[int | None], trials: int) -> str:
    hit = [v for v in values if v is not None]
    missed = len(values) - len(hit)
    text = f"{statistics.median(hit):.0f}" if hit else "-"
    return text + (f" ({missed} of {len(values)} never)" if missed else "")


def report(results: dict[str, Any]) -> str:
    rows = [["budget (MiB)", "plans fit", "best plan (oracle samples/s)", "trials",
             "ours: tuned / best, median (min-max)", "random: tuned / best", "ours: trials to 95%",
             "random: trials to 95%",
             "wall ours / exhaustive (median)", "ours: parent s per trial (median)", "ours: re-measurements",
             "ours: chosen over the budget in an oracle run", "ours: least room under the budget (MiB)",
             "ours: plans chosen"]]
    verdicts = []
    for b in results["budgets"]:
        for trials, cell in b["by_trials"].items():
            ours, rand = cell["ours"], cell["random"]
            wall = statistics.median(o["wall_seconds"] for o in ours) / b["exhaustive_wall"]
            chosen = sorted({o["plan"] or "none (no plan fit)" for o in ours})
            rows.append([f"{b['budget_name']} {b['budget_mib']}", f"{b['plans_fit']}/{b['plans']}",
                         f"{b['best_plan']} ({b['best_sps']:.0f})", trials, _spread([o["ratio"] for o in ours]),
                         _spread([r["ratio"] for r in rand]), _reach([o["reach"] for o in ours], int(trials)),
                         _reach([r["reach"] for r in rand], int(trials)), f"{wall:.2f}",
                         f"{statistics.median(x for o in ours for x in o['parent_seconds']):.2f}",
                         f"{statistics.median(o['remeasured'] for o in ours):.0f}",
                         f"{sum(1 for o in ours if (o.get('oracle_peak') or 0) > b['budget_bytes'])} of {len(ours)}",
                         f"{min((b['budget_bytes'] - o['oracle_peak']) / 2**20 for o in ours if o.get('oracle_peak')):.2f}"
                         if any(o.get("oracle_peak") for o in ours) else "-",
                         "; ".join(chosen)])
            median = statistics.median(o["ratio"] for o in ours)
            verdicts.append(f"{b['budget_name']}, {trials} trials: median {median:.3f} "
                            f"({'met' if median >= GOAL_QUALITY else 'NOT met'}), wall {wall:.2f} "
                            f"({'met' if wall <= GOAL_WALL else 'NOT met'})")
    goals = f"goals: median tuned/best >= {GOAL_QUALITY}, wall ratio <= {GOAL_WALL}: " + "; ".join(verdicts)
    load = (f"load generator: {results['load']} busy process(es) beside the benchmark for its whole run"
            if results.get("load") else "no load generator")
    target = f"target: {TARGETS[results.get('target', 'gpt')]}"
    return "\n".join([machine_line(results["machine"]), f"commit {results['commit']}", target, load, "",
                      markdown_table(rows[0], rows[1:], pad=True), "", goals,
                      f"total wall time {results['wall_seconds']:.0f} s"])


# ------------------------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = make_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="the tight budget, 3 seeds, 6 trials")
    parser.add_argument("--target", choices=sorted(TARGETS), default="gpt",
                        help="the GPT example (default), or the same at a 4x longer context (long_context.py)")
    add_device(parser)
    add_threads(parser, "intra-op threads per trial (default: 1 on CPU, torch's default on CUDA)")
    parser.add_argument("--seeds", type=int, default=None, help="sampler seeds (default 5, 3 with --quick)")
    parser.add_argument("--trials", type=int, nargs="+", default=None, help="trials per search (default 6 12)")
    parser.add_argument("--budgets", nargs="+", choices=["loose", "tight"], default=None,
                        help="which budgets (default: both, tight with --quick)")
    parser.add_argument("--oracle-runs", type=int, default=3, help="extra runs of the plans near the top (default 3)")
    parser.add_argument("--load", type=int, default=0, metavar="N",
                        help="a CPU-load generator: N busy processes beside the whole run (noise; default 0)")
    add_neighbour(parser)
    add_json(parser)
    args = parser.parse_args(argv)
    args.seeds = args.seeds or (3 if args.quick else 5)
    args.trials = args.trials or ([6] if args.quick else [6, 12])
    args.budgets = args.budgets or (["tight"] if args.quick else ["loose", "tight"])
    return args


def _commit() -> str:
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=_HERE, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=_HERE,
                               capture_output=True, text=True, check=True).stdout.strip()
        return head + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


@contextlib.contextmanager
def busy_processes(count: int) -> Iterator[None]:
    """``count`` processes that each keep one core busy (a pure-Python loop) while the block runs: the noise of a
    shared machine, for the search to be judged under."""
    import subprocess

    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads = threads_for(args.device, args.threads)
    if threads:  # before torch starts (here and in the trial fork server, which inherits the environment)
        os.environ["OMP_NUM_THREADS"] = str(threads)
    quiet()
    start = time.perf_counter()
    results: dict[str, Any] = {"machine": machine(args.device, threads=threads), "commit": _commit(),
                               "budgets": [], "load": args.load, "target": args.target}
    table = Table()
    with tempfile.TemporaryDirectory(prefix="autotune-search-quality-") as tmp, busy_processes(args.load), \
            neighbour(args.neighbour) as comings:
        import torch

        from autotune import load_space, load_target

        space_name = "cpu" if args.device == "cpu" else "default"
        batch_size = load_target(TARGETS[args.target]).batch_size()
        space = load_space(space_name).for_device(torch.device(args.device), batch_size=batch_size)
        pass_wall: dict[str, float] = {}
        print("exhaustive pass (loose budget) ...", file=sys.stderr, flush=True)
        exhaustive(table, TARGETS[args.target], space, "1024GiB", 1024 * 2**30, args.device, batch_size)
        budgets = choose_budgets([table.view(n) for n in table.rows], batch_size)
        for name in args.budgets:
            results["budgets"].append(run_budget(args, table, name, budgets[name], space_name, Path(tmp), pass_wall))
    results["wall_seconds"] = time.perf_counter() - start
    results["neighbour"] = comings
    results["machine"]["load_average_end"] = load_average()
    results["plans"] = table.views()
    print(report(results))
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
