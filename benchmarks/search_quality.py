"""Search quality: ``autotune.search`` against an exhaustive search of the same space, measured side by side.

For each example model and memory budget, two searches run on the same plan space with the same trial runner
(``autotune.measure_plan``, what a search trial runs: a fresh process per trial, ``warmup + steps`` optimizer
steps, end-to-end samples/s and the process's peak memory):

- **ours**: ``autotune.search`` as shipped (TPE, the space's seeds, the plan cache, early stop of slow trials,
  re-measuring the top plans) with ``--trials`` trials and sampler seed 0;
- **exhaustive**: every point of the space (``SearchSpace.points()``, in order) measured once with
  ``autotune.measure_plan``: no early stop, no cache, no estimate-based rejection (a plan met twice, like ``auto``
  resolving to the whole batch, is measured once). An ``auto`` micro-batch resolves as the search resolves it: the
  largest micro-batch whose ``autotune.estimate`` fits the budget less a baseline (on CPU this process's resident
  set with the target loaded, raised to the largest measured peak less its estimate as plans are measured; 0 on
  CUDA). Its optimum is the best feasible measured throughput.

Both winners are then measured again, interleaved, ``rounds`` times each with longer trials; the throughput ratio
is the ratio of the medians (goal >= 0.97). Also reported: the wall-time ratio (goal <= 0.20) and the number of
our trials until one measured >= 95% of the exhaustive optimum's re-measured median.

On CPU the budget is the trial process's peak resident set size (see docs/elastic.md), and a concrete plan's
measurement does not depend on the budget (the soft budget never changes a trial's fixed micro-batch), so the
exhaustive pass of a model's first budget carries over to the next, which only measures the plans new to it (an
``auto`` micro-batch resolves per budget); its wall time is charged in full to each budget. On CUDA (a hard cap)
the pass runs in full once per budget. Budgets come from the pass's peaks: ``loose`` fits every plan (a pure speed
search); ``tight`` is halfway between the smallest peak and the naive plan's (fp32, whole batch), so the naive plan
does not fit.

``--quick``: the GPT example, the ``tight`` budget, the shipped space without ``num_workers`` (30 plans), 20 trials,
4 timed steps per trial. Full: the GPT example and the memory-hungry test target, both budgets, the shipped space,
30 trials (the search's default), 8 timed steps. CPU trials run with one intra-op thread (``--threads``): with two
threads on a shared 2-core machine the same plan measured anywhere from 20 to 340 samples/s. Studies live in
temporary SQLite files. Results go to stdout (and ``--json PATH``) only.

Usage::

    python benchmarks/search_quality.py --quick --device cpu      # 3-5 minutes on a shared 2-core CPU
    python benchmarks/search_quality.py --device cuda --json search_quality.json
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:  # _common.py, also when this file is loaded by path
    sys.path.insert(0, _HERE)

from _common import (  # noqa: E402
    GPT_TARGET as GPT,
    HUNGRY_TARGET as HUNGRY,
    add_device,
    add_json,
    add_threads,
    current_rss_bytes,
    load_average,
    machine,
    machine_line,
    make_parser,
    markdown_table,
    quiet,
    threads_for,
    write_json,
)

#: Goals: our winner's throughput over the exhaustive one's, our wall time over the exhaustive one's.
GOAL_QUALITY, GOAL_WALL = 0.97, 0.20
#: "Reached the optimum" for the trials-to-optimum count: this share of the exhaustive optimum.
REACH_SHARE = 0.95
#: Dimensions left out of the shipped space with --quick, so that the exhaustive pass fits in the time.
QUICK_DROP = ("num_workers",)
#: The ``micro_batch_size`` choice the search resolves with the estimator.
AUTO = "auto"


@dataclass(frozen=True)
class Case:
    """One model: its target, the space searched, and the trial sizes."""

    name: str
    target: str
    space: str  # a shipped space name or a YAML path
    trials: int


@dataclass
class Exhaustive:
    """One exhaustive pass: every distinct plan's measurement, in the order measured."""

    wall_seconds: float
    points: int
    batch_size: int
    rows: list[dict[str, Any]] = field(default_factory=list)  # plan, params, status, samples_per_second, peak_bytes

    def best(self, budget_bytes: int) -> dict[str, Any] | None:
        fits = [r for r in self.rows if _fits(r, budget_bytes)]
        return max(fits, key=lambda r: r["samples_per_second"], default=None)


def _fits(row: dict[str, Any], budget_bytes: int) -> bool:
    return row["status"] == "ok" and row.get("peak_bytes") is not None and row["peak_bytes"] <= budget_bytes


# ------------------------------------------------------------------------------------------------ the searches


def plan_of(params: dict[str, Any], micro_batch_size: int | None) -> Any:
    """The plan of one point of a space (Optuna params); ``micro_batch_size`` replaces an ``auto`` choice."""
    from autotune import Plan

    values = dict(params)
    if values.get("micro_batch_size") == AUTO:
        values["micro_batch_size"] = micro_batch_size
    return Plan.from_dict(values)


class AutoMicro:
    """``micro_batch_size: auto`` resolved as the search resolves it, with public calls only: the largest
    micro-batch of the target's first batch whose ``autotune.estimate`` peak, plus a baseline, fits the budget.

    The baseline is what a trial's measured peak holds besides the tensors the estimator counts: on CPU this process's
    resident set with the target loaded until a plan is measured, then the largest measured peak less that plan's
    estimate; 0 on CUDA. Each choice is kept until the baseline changes. When the estimator fails the choice is the
    whole batch; when one sample does not fit, 1.
    """

    def __init__(self, target: Any, device: str) -> None:
        self.target, self.device = target, device
        self.baseline = current_rss_bytes() if device != "cuda" else 0
        self.calibrated = device == "cuda"  # on CPU, until a measured plan gives the baseline
        self._batch: Any = None
        self._choices: dict[str, int] = {}

    def _peak(self, plan: Any) -> int | None:
        """The predicted peak of ``plan`` in bytes (tensors only), or None when the estimator fails."""
        from autotune import estimate

        try:
            if self._batch is None:  # the first training batch, as a trial's first step sees it
                owner = self.target.datamodule if self.target.datamodule is not None else self.target.model
                if self.target.datamodule is not None:
                    self.target.datamodule.setup("fit")
                self._batch = next(iter(owner.train_dataloader()))
            return estimate(model=self.target.model, batch=self._batch, plan=plan,
                            device=self.device).predicted_peak_bytes
        except Exception as err:  # the estimator is an aid, as in the search: the point is still measured
            print(f"estimator failed on {plan.describe()}: {type(err).__name__}: {err}", file=sys.stderr)
            return None

    def calibrate(self, plan: Any, measured_peak: int) -> None:
        """On CPU, raise the baseline to ``measured_peak`` less ``plan``'s estimate (forgetting earlier choices)."""
        if self.device == "cuda":
            return
        predicted = self._peak(plan)
        if predicted is None:
            return
        baseline = measured_peak - predicted
        if not self.calibrated or baseline > self.baseline:
            self.baseline, self.calibrated = baseline, True
            self._choices.clear()

    def resolve(self, params: dict[str, Any], budget_bytes: int, batch_size: int) -> int:
        """The micro-batch for the ``auto`` point ``params``: bisection over 1..``batch_size`` (the peak grows with
        the micro-batch, so this is the largest that fits)."""
        plan = plan_of(params, None)
        key = plan.key()
        if key not in self._choices:
            self._choices[key] = self._largest(plan, budget_bytes - self.baseline, batch_size)
        return self._choices[key]

    def _largest(self, plan: Any, room: int, batch_size: int) -> int:
        if room <= 0:
            return 1
        peaks: dict[int, int | None] = {}

        def fits(micro: int) -> bool | None:
            if micro not in peaks:
                peaks[micro] = self._peak(plan.replace(micro_batch_size=micro))
            peak = peaks[micro]
            return None if peak is None else peak <= room

        first = fits(1)
        if first is None:
            return batch_size
        if not first:
            return 1
        lo, hi = 1, batch_size + 1  # lo fits, hi does not (batch_size + 1 stands for "none larger")
        while hi - lo > 1:
            mid = (lo + hi) // 2
            ok = fits(mid)
            if ok is None:
                return batch_size
            lo, hi = (mid, hi) if ok else (lo, mid)
        return lo


def run_exhaustive(case: Case, budget: str, device: str, steps: int, warmup: int,
                   base: Exhaustive | None = None) -> Exhaustive:
    """Every point of the space measured once with ``autotune.measure_plan`` (no early stop, no cache).

    With ``base`` (a pass under another budget, on CPU where a concrete plan's measurement does not depend on the
    budget) only plans ``base`` did not measure are run: ``auto`` micro-batches resolve per budget. The result's
    rows and wall time are ``base``'s plus the new ones.
    """
    import torch

    from autotune import Budget, load_space, load_target, measure_plan, probe_memory

    tgt = load_target(case.target)
    batch_size = tgt.batch_size()
    space = load_space(case.space).for_device(torch.device(device), batch_size=batch_size)
    probe = probe_memory(device)
    budget_bytes = Budget.parse(budget).resolve(total_bytes=probe.total_bytes, free_bytes=probe.free_bytes)
    auto = AutoMicro(tgt, device)
    known = {r["plan"] for r in base.rows} if base is not None else set()
    seen: set[str] = set()
    rows = list(base.rows) if base is not None else []
    start = time.perf_counter()
    for number, params in enumerate(space.points()):
        micro = params.get("micro_batch_size")
        if micro == AUTO:
            micro = auto.resolve(params, budget_bytes, batch_size)
        plan = plan_of(params, micro)
        if plan.key() in seen or plan.describe() in known:
            continue
        seen.add(plan.key())
        result = measure_plan(target=case.target, plan=plan, budget=budget, device=device, steps=steps,
                              warmup=warmup, timeout=600.0)
        if result.status == "ok" and result.peak_bytes:
            auto.calibrate(plan, result.peak_bytes)
        rows.append({"number": number, "plan": plan.describe(), "params": dict(params),
                     "micro_batch_size": plan.micro_batch_size, "status": result.status,
                     "samples_per_second": result.samples_per_second or 0.0, "peak_bytes": result.peak_bytes,
                     "wall_seconds": result.wall_seconds})
    wall = time.perf_counter() - start
    return Exhaustive(wall_seconds=wall + (base.wall_seconds if base is not None else 0.0), points=space.size(),
                      rows=rows, batch_size=batch_size)


def run_ours(case: Case, budget: str, device: str, steps: int, warmup: int, tmp: Path) -> dict[str, Any]:
    """``autotune.search`` as shipped; returns its plan, wall time and the trials in order."""
    from autotune import search

    start = time.perf_counter()
    result = search(target=case.target, budget=budget, space=case.space, trials=case.trials,
                    storage=f"sqlite:///{tmp / f'ours-{case.name}-{budget}.db'}", study=f"ours-{case.name}-{budget}",
                    out=None, seed=0, steps=steps, warmup=warmup, device=device)
    wall = time.perf_counter() - start
    trials = []
    for t in result.study.get_trials(deepcopy=False):
        attrs = t.user_attrs
        trials.append({"number": t.number, "state": t.state.name, "plan": attrs.get("plan"),
                       "status": attrs.get("status"), "source": attrs.get("source"),
                       "samples_per_second": attrs.get("samples_per_second") or 0.0,
                       "peak_bytes": attrs.get("peak_bytes")})
    chosen = result.study.trials[result.trial_number]
    return {"plan": result.plan.describe(), "params": dict(chosen.params),
            "micro_batch_size": result.plan.micro_batch_size, "wall_seconds": wall, "trials": trials,
            "remeasured": result.study.user_attrs.get("remeasured", {})}


def trials_to_reach(trials: list[dict[str, Any]], optimum: float, budget_bytes: int) -> int | None:
    """How many trials (1-based, in order) until a feasible one measured >= REACH_SHARE of ``optimum``."""
    for i, t in enumerate(trials, start=1):
        if _fits(t, budget_bytes) and t["samples_per_second"] >= REACH_SHARE * optimum:
            return i
    return None


def remeasure_side_by_side(case: Case, budget: str, device: str, steps: int, warmup: int, plans: list[dict[str, Any]],
                           rounds: int) -> list[dict[str, Any]]:
    """Measure each plan ``rounds`` times with ``steps`` timed steps, interleaved (round r runs them all, in an
    order rotated by r); the median throughput and the largest peak of each."""
    from autotune import measure_plan

    runs: list[list[Any]] = [[] for _ in plans]
    for r in range(rounds):
        order = list(range(len(plans)))
        order = order[r % len(order):] + order[: r % len(order)]
        for i in order:
            plan = plan_of(plans[i]["params"], plans[i]["micro_batch_size"])
            runs[i].append(measure_plan(target=case.target, plan=plan, budget=budget, device=device, steps=steps,
                                        warmup=warmup, timeout=600.0))
    out = []
    for result_runs in runs:
        ok = [x for x in result_runs if x.status == "ok"]
        out.append({"samples_per_second": statistics.median(x.samples_per_second for x in ok) if ok else 0.0,
                    "peak_bytes": max((x.peak_bytes or 0) for x in ok) if ok else None,
                    "runs": [round(x.samples_per_second or 0.0, 1) for x in result_runs]})
    return out


# ------------------------------------------------------------------------------------------------ budgets


def choose_budgets(ex: Exhaustive, batch_size: int) -> dict[str, int]:
    """Budgets in whole MiB from the exhaustive pass's peaks (peaks repeat within ~0.5 MiB; throughputs do not, so
    they play no part). ``loose``: every plan fits, a pure speed search. ``tight``: halfway between the smallest
    peak and the naive plan's (fp32, the whole batch at once), so the naive plan does not fit."""
    mib = 2**20
    ok = [r for r in ex.rows if r["status"] == "ok" and r.get("peak_bytes")]
    smallest = min(r["peak_bytes"] for r in ok)
    naive = [r["peak_bytes"] for r in ok if r["params"].get("precision", "32-true") == "32-true"
             and r["micro_batch_size"] in (None, batch_size) and not r["params"].get("activation_checkpointing")
             and not r["params"].get("num_workers")]
    budgets = {"loose": math.ceil(max(r["peak_bytes"] for r in ok) * 1.02 / mib)}
    if naive:
        budgets["tight"] = (smallest + naive[0]) // 2 // mib
    return budgets


# ------------------------------------------------------------------------------------------------ machine, output


def _mib(n: int | None) -> str:
    return f"{n / 2**20:.1f}" if n else "-"


def report(results: dict[str, Any]) -> str:
    head = machine_line(results["machine"])
    rows = [["model", "budget (MiB)", "plans fit", "ours: plan", "ours samples/s", "ours peak MiB",
             "exhaustive: plan", "exh. samples/s", "exh. peak MiB", "ratio", "wall ours / exh. (s)", "wall ratio",
             "our trials: measured / cached / rejected by estimate / pruned", f"trials to {REACH_SHARE:.0%}"]]
    for r in results["cases"]:
        rows.append([r["model"], f"{r['budget_name']} {r['budget_mib']}", f"{r['plans_fit']}/{r['plans']}",
                     r["ours_plan"], f"{r['ours_sps']:.1f}", _mib(r["ours_peak"]), r["exh_plan"],
                     f"{r['exh_sps']:.1f}", _mib(r["exh_peak"]),
                     f"{r['ratio']:.3f}" + (" (same plan)" if r["same_plan"] else ""),
                     f"{r['ours_wall']:.0f} / {r['exh_wall']:.0f}", f"{r['wall_ratio']:.2f}",
                     f"{r['measured']} / {r['cached']} / {r['estimated']} / {r['pruned']}",
                     f"{r['reach']} of {r['ours_trials']}" if r["reach"] else f"not in {r['ours_trials']}"])
    ratios = [r["ratio"] for r in results["cases"]]
    walls = [r["wall_ratio"] for r in results["cases"]]
    goals = (f"throughput ratio: min {min(ratios):.3f}, goal >= {GOAL_QUALITY} "
             f"({'met' if min(ratios) >= GOAL_QUALITY else 'NOT met'}); wall-time ratio: max {max(walls):.2f}, goal "
             f"<= {GOAL_WALL} ({'met' if max(walls) <= GOAL_WALL else 'NOT met'})")
    return "\n".join([head, "", markdown_table(rows[0], rows[1:], pad=True), "", goals, f"total wall time {results['wall_seconds']:.0f} s"])


# ------------------------------------------------------------------------------------------------ main


def reduced_space(name: str, drop: tuple[str, ...], folder: Path) -> str:
    """The shipped space ``name`` without the dimensions ``drop`` (and seeds without them), written to ``folder``."""
    import importlib.resources

    import yaml

    doc = yaml.safe_load((importlib.resources.files("autotune.search_spaces") / f"{name}.yaml").read_text())
    doc["description"] = f"{name} without {', '.join(drop)} (benchmarks/search_quality.py --quick)"
    doc["dimensions"] = {k: v for k, v in doc["dimensions"].items() if k not in drop}
    doc["seeds"] = [{k: v for k, v in seed.items() if k not in drop} for seed in doc.get("seeds", [])]
    path = folder / f"{name}-quick.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return str(path)


def cases(args: argparse.Namespace, tmp: Path) -> list[Case]:
    space = "cpu" if args.device == "cpu" else "default"
    if args.quick:  # DataLoader workers: a trial with a worker costs 2-4 s more on 2 cores, for no gain here
        return [Case("gpt", GPT, reduced_space(space, QUICK_DROP, tmp), trials=args.trials)]
    return [Case("gpt", GPT, space, trials=args.trials), Case("hungry", HUNGRY, space, trials=args.trials)]


def run_case(case: Case, args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    dev = args.device
    first_budget = "1024GiB" if dev == "cpu" else "0.95"
    print(f"[{case.name}] exhaustive pass over space '{case.space}' ...", file=sys.stderr, flush=True)
    base = run_exhaustive(case, first_budget, dev, args.steps, args.warmup)
    print(f"[{case.name}] {len(base.rows)} plans measured in {base.wall_seconds:.0f} s", file=sys.stderr, flush=True)
    out = []
    for name, mib in choose_budgets(base, base.batch_size).items():
        if name not in args.budgets:
            continue
        budget = f"{mib}MiB"
        budget_bytes = mib * 2**20
        if dev == "cpu":  # measurements carry over; only plans new under this budget (``auto``) are run
            ex = run_exhaustive(case, budget, dev, args.steps, args.warmup, base=base)
        else:
            ex = run_exhaustive(case, budget, dev, args.steps, args.warmup)
        best = ex.best(budget_bytes)
        if best is None:
            print(f"[{case.name}] no plan fits {budget}; skipped", file=sys.stderr)
            continue
        print(f"[{case.name}] budget {name} {budget}: ours ...", file=sys.stderr, flush=True)
        ours = run_ours(case, budget, dev, args.steps, args.warmup, tmp)
        same = ours["plan"] == best["plan"]
        plans = [ours] if same else [ours, best]
        again = remeasure_side_by_side(case, budget, dev, args.judge_steps, args.warmup, plans, args.remeasure)
        ours_m, exh_m = again[0], again[0 if same else 1]
        sources = [t.get("source") for t in ours["trials"]]
        out.append({
            "model": case.name, "budget_name": name, "budget_mib": mib, "plans": len(ex.rows),
            "plans_fit": sum(_fits(r, budget_bytes) for r in ex.rows), "ours_plan": ours["plan"],
            "exh_plan": best["plan"], "same_plan": same, "ours_sps": ours_m["samples_per_second"],
            "ours_peak": ours_m["peak_bytes"], "exh_sps": exh_m["samples_per_second"], "exh_peak": exh_m["peak_bytes"],
            "ours_runs": ours_m["runs"], "exh_runs": exh_m["runs"],
            "ratio": 1.0 if same else ours_m["samples_per_second"] / max(exh_m["samples_per_second"], 1e-9),
            "ours_wall": ours["wall_seconds"], "exh_wall": ex.wall_seconds,
            "wall_ratio": ours["wall_seconds"] / ex.wall_seconds,
            "measured": sources.count("measured"), "cached": sources.count("cache"),
            "estimated": sources.count("estimate"),
            "pruned": sum(t["status"] == "pruned" for t in ours["trials"]), "ours_trials": len(ours["trials"]),
            "reach": trials_to_reach(ours["trials"], exh_m["samples_per_second"], budget_bytes),
            "exh_optimum_in_pass": best["samples_per_second"], "ours_trial_log": ours["trials"],
            "exhaustive_rows": ex.rows, "ours_feasible_at_remeasure": (ours_m["peak_bytes"] or 0) <= budget_bytes,
        })
        print(f"[{case.name}] {name}: ours {ours['plan']} vs exhaustive {best['plan']}", file=sys.stderr, flush=True)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = make_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="the GPT example only, short trials (~4 min on 2 CPUs)")
    add_device(parser)
    add_threads(parser, "intra-op threads per trial (default: 1 on CPU, torch's default on CUDA)")
    parser.add_argument("--trials", type=int, default=None,
                        help="trials of our search (default: 20 with --quick, else 30, the search's default)")
    parser.add_argument("--budgets", nargs="+", choices=["loose", "tight"], default=None,
                        help="which budgets (default: tight with --quick, else both)")
    add_json(parser)
    args = parser.parse_args(argv)
    if args.budgets is None:
        args.budgets = ["tight"] if args.quick else ["loose", "tight"]
    # Timed steps per search trial (both searches), untimed warm-up, and the side-by-side re-measurement's
    # rounds and timed steps (longer, to judge the two winners with less noise).
    args.steps, args.warmup, args.remeasure, args.judge_steps = (4, 2, 5, 16) if args.quick else (8, 3, 5, 24)
    if args.trials is None:
        args.trials = 20 if args.quick else 30
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads = threads_for(args.device, args.threads)
    if threads:  # before torch starts (here and in the trial fork server, which inherits the environment)
        os.environ["OMP_NUM_THREADS"] = str(threads)
    quiet()
    start = time.perf_counter()
    results: dict[str, Any] = {"machine": machine(args.device, threads=threads), "quick": args.quick, "cases": []}
    with tempfile.TemporaryDirectory(prefix="autotune-search-quality-") as tmp:
        for case in cases(args, Path(tmp)):
            results["cases"] += run_case(case, args, Path(tmp))
    results["wall_seconds"] = time.perf_counter() - start
    results["machine"]["load_average_end"] = load_average()
    print(report(results))
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
