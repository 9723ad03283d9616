"""A search's verdict against the host it runs on: the chosen plan against halving's and against itself without its
extras, in paired ratios, quiet and beside a neighbour that comes and goes.

For each target and budget, in each mode (``quiet``; ``neighbour``: one spinning process per core, on for
``--period`` seconds, off for as long, beside the whole mode), ``--runs`` times:

- **search**: ``autotune.search`` as shipped (6 trials, a fresh study, the device's space), its chosen plan and the
  search's wall time;
- **vs halving**: the chosen plan against halving's plan (fp32, nothing else, the micro-batch halved from the whole
  batch while a measured peak is over the budget: found once per target and budget, quiet), compared in paired
  rounds (``autotune.compare_plans``: A B, B A, ... back to back, the geometric mean of the rounds' ratios with its
  95% interval; 1.00 where the search chose halving's plan);
- **vs its twin**: the chosen plan against the same precision and micro-batch without its extras (checkpointing,
  offload, low-bit state, workers, compile: the plan's defaults), likewise; 1.00 where it has none.

Then, once per mode on the first budget, ``--trials 1`` against 12 trials: both searched in fresh studies, their
plans compared in pairs. Goals (issue 54): every paired ratio of the chosen plan >= 0.97, no recomputation or offload
chosen where the budget is loose, and ``--trials 1`` >= 0.90 of the 12-trial plan.

Targets: ``gpt`` (the GPT example) and ``llama`` (``benchmarks/_hf_llama.py``, a transformers Llama). Budgets:
``loose`` (2 GiB: every plan fits) and ``tight`` (half-way between the fp32 peaks at micro-batch 1 and at the whole
batch, so the naive plan does not fit). CPU trials keep torch's threads (the search's default). Results go to stdout
(and ``--json PATH``).

Usage::

    python benchmarks/verdict.py --quick                      # gpt, both budgets, 2 runs a mode (~6 min here)
    python benchmarks/verdict.py --json verdict.json          # gpt and llama, 3 runs a mode
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:  # _common.py, also when this file is loaded by path
    sys.path.insert(0, _HERE)

from _common import (  # noqa: E402
    GPT_TARGET,
    HERE,
    add_device,
    add_json,
    load_average,
    machine,
    machine_line,
    make_parser,
    markdown_table,
    neighbour,
    quiet,
    write_json,
)

TARGETS = {"gpt": GPT_TARGET, "llama": f"{HERE / '_hf_llama.py'}:make"}
#: Goals: the chosen plan's paired ratio to halving's and to its twin, and --trials 1's to 12 trials'.
GOAL_RATIO, GOAL_ONE_TRIAL = 0.97, 0.90
#: The plan fields that add work or a feature (their defaults are the plain plan's).
EXTRAS = ("activation_checkpointing", "activation_offload", "optimizer_offload", "optimizer_state", "cpu_offload",
          "compile", "compile_memory_budget", "float8", "expandable_segments", "num_workers", "pin_memory")
#: Work a loose budget should not buy: recomputation and offload.
COSTLY = ("activation_checkpointing", "activation_offload", "optimizer_offload", "cpu_offload")


def plain(plan: Any) -> Any:
    """The plan's precision and micro-batch, nothing else."""
    from autotune import Plan

    return Plan(precision=plan.precision, micro_batch_size=plan.micro_batch_size)


def adds(plan: Any, fields: tuple[str, ...] = EXTRAS) -> list[str]:
    """The extras ``plan`` sets (against the plan's defaults)."""
    from autotune import Plan

    base = Plan()
    return [f for f in fields if getattr(plan, f, None) != getattr(base, f, None)]


def budgets(target: str, device: str) -> dict[str, str]:
    """``loose`` and ``tight`` (see the module's notes)."""
    from autotune import Plan, load_target, measure_plan

    batch = load_target(target).batch_size()
    peaks = [measure_plan(target=target, plan=Plan(micro_batch_size=m), device=device, steps=3, warmup=1).peak_bytes
             for m in (1, batch)]
    tight = (peaks[0] + (peaks[1] - peaks[0]) // 2) // 2**20
    return {"loose": "2GiB", "tight": f"{tight}MiB"}


def halving(target: str, budget: str, device: str) -> Any:
    """Halving's plan: fp32, the micro-batch halved from the whole batch while a run's peak is over the budget."""
    from autotune import Budget, Plan, load_target, measure_plan

    limit = Budget.parse(budget).value  # bytes: the budgets here are sizes
    micro = load_target(target).batch_size()
    while True:
        plan = Plan(micro_batch_size=micro)
        run = measure_plan(target=target, plan=plan, device=device, steps=5, warmup=2)
        if (run.status == "ok" and run.peak_bytes and run.peak_bytes <= limit) or micro == 1:
            return plan
        micro //= 2


def searched(target: str, budget: str, device: str, trials: int, folder: Path, name: str) -> tuple[Any, float]:
    from autotune import search

    start = time.perf_counter()
    result = search(target=target, budget=budget, trials=trials, storage=f"sqlite:///{folder / (name + '.db')}",
                    study=name, out=None, device=device)
    return result.plan, time.perf_counter() - start


def paired(target: str, a: Any, b: Any, budget: str, device: str) -> dict[str, Any]:
    """``b`` against ``a`` in paired rounds (1.0, no rounds, where they are the same plan)."""
    from autotune import compare_plans

    if plain_fields(a, target) == plain_fields(b, target):
        return {"ratio": 1.0, "low": 1.0, "high": 1.0, "rounds": 0, "busy_rounds": 0, "rerun_rounds": 0}
    ratio, _, _ = compare_plans(target=target, a=a, b=b, budget=budget, device=device)
    return {"ratio": ratio.ratio, "low": ratio.low, "high": ratio.high, "rounds": len(ratio.rounds),
            "busy_rounds": ratio.busy_rounds, "rerun_rounds": ratio.rerun_rounds, "stopped": ratio.stopped}


def plain_fields(plan: Any, target: str) -> dict[str, Any]:
    """What the plan trains with: a setting it leaves as the target has it (dataloader workers) is the target's."""
    fields = {k: v for k, v in plan.to_dict().items() if k not in ("provenance", "budget", "format_version")}
    if fields.get("num_workers") is None:
        fields["num_workers"] = loader_workers(target)
    return fields


@functools.cache
def loader_workers(target: str) -> int:
    from autotune import load_target

    datamodule = load_target(target).datamodule
    datamodule.setup("fit")
    return datamodule.train_dataloader().num_workers


def run_mode(args: argparse.Namespace, mode: str, folder: Path, halvings: dict[tuple[str, str], Any],
             budget_of: dict[str, dict[str, str]]) -> list[dict[str, Any]]:
    rows = []
    with neighbour(args.period if mode == "neighbour" else 0.0) as comings:
        for target_name in args.targets:
            target = TARGETS[target_name]
            for budget_name in args.budgets:
                budget = budget_of[target_name][budget_name]
                halve = halvings[(target_name, budget_name)]
                for run in range(args.runs):
                    name = f"{mode}-{target_name}-{budget_name}-{run}"
                    plan, seconds = searched(target, budget, args.device, 6, folder, name)
                    row = {"mode": mode, "target": target_name, "budget": f"{budget_name} ({budget})", "run": run,
                           "chosen": plan.describe(), "search_seconds": seconds, "adds": adds(plan),
                           "costly": adds(plan, COSTLY), "halving": halve.describe(),
                           "vs_halving": paired(target, halve, plan, budget, args.device),
                           "vs_twin": paired(target, plain(plan), plan, budget, args.device)}
                    print(f"[{name}] {row['chosen']} in {seconds:.0f} s; vs halving {row['vs_halving']['ratio']:.2f}, "
                          f"vs twin {row['vs_twin']['ratio']:.2f}", file=sys.stderr, flush=True)
                    rows.append(row)
            if args.one_trial:
                budget = budget_of[target_name][args.budgets[0]]
                one, one_s = searched(target, budget, args.device, 1, folder, f"{mode}-{target_name}-one")
                twelve, twelve_s = searched(target, budget, args.device, 12, folder, f"{mode}-{target_name}-twelve")
                rows.append({"mode": mode, "target": target_name, "budget": f"{args.budgets[0]} ({budget})",
                             "one_trial": one.describe(), "twelve_trials": twelve.describe(),
                             "search_seconds": [one_s, twelve_s],
                             "one_vs_twelve": paired(target, twelve, one, budget, args.device)})
                print(f"[{mode}-{target_name}] --trials 1: {one.describe()}, 12: {twelve.describe()}: "
                      f"{rows[-1]['one_vs_twelve']['ratio']:.2f}", file=sys.stderr, flush=True)
    for row in rows:
        row["neighbour_on_share"] = comings["on_seconds"] / comings["seconds"] if comings["seconds"] else 0.0
    return rows


def _ratio(r: dict[str, Any]) -> str:
    if not r["rounds"]:
        return "1.00 (same plan)"
    extra = f", {r['busy_rounds']} busy" if r["busy_rounds"] else ""
    extra += f", {r['rerun_rounds']} rerun" if r["rerun_rounds"] else ""
    return f"{r['ratio']:.2f} [{r['low']:.2f}, {r['high']:.2f}] ({r['rounds']} rounds{extra})"


def report(results: dict[str, Any]) -> str:
    rows, ones, verdicts = [], [], []
    for r in results["rows"]:
        if "one_trial" in r:
            ones.append([r["mode"], r["target"], r["budget"], r["one_trial"], r["twelve_trials"],
                         _ratio(r["one_vs_twelve"])])
            verdicts.append(r["one_vs_twelve"]["ratio"] >= GOAL_ONE_TRIAL)
            continue
        loose_costly = r["budget"].startswith("loose") and r["costly"]
        rows.append([r["mode"], r["target"], r["budget"], str(r["run"]), r["chosen"], f"{r['search_seconds']:.0f}",
                     _ratio(r["vs_halving"]), _ratio(r["vs_twin"]),
                     ("COSTLY: " if loose_costly else "") + (", ".join(r["adds"]) or "-")])
        verdicts += [r["vs_halving"]["ratio"] >= GOAL_RATIO, r["vs_twin"]["ratio"] >= GOAL_RATIO, not loose_costly]
    out = [machine_line(results["machine"]), "",
           markdown_table(["mode", "target", "budget", "run", "chosen", "search s", "vs halving (paired)",
                           "vs its twin (paired)", "extras"], rows)]
    if ones:
        out += ["", markdown_table(["mode", "target", "budget", "--trials 1", "12 trials", "1 vs 12 (paired)"], ones)]
    out += ["", f"goals (every ratio >= {GOAL_RATIO}, no recomputation or offload under a loose budget, --trials 1 >= "
                f"{GOAL_ONE_TRIAL} of 12): {sum(verdicts)} of {len(verdicts)} met; total {results['wall_seconds']:.0f} s"]
    return "\n".join(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = make_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="gpt only, 2 runs a mode")
    add_device(parser)
    parser.add_argument("--targets", nargs="+", choices=list(TARGETS), default=None)
    parser.add_argument("--budgets", nargs="+", choices=["loose", "tight"], default=["loose", "tight"])
    parser.add_argument("--modes", nargs="+", choices=["quiet", "neighbour"], default=["quiet", "neighbour"])
    parser.add_argument("--runs", type=int, default=None, help="searches per target, budget and mode (default 3)")
    parser.add_argument("--period", type=float, default=12.0, help="the neighbour's on (and off) seconds")
    parser.add_argument("--no-one-trial", dest="one_trial", action="store_false",
                        help="skip --trials 1 against 12 trials")
    add_json(parser)
    args = parser.parse_args(argv)
    args.targets = args.targets or (["gpt"] if args.quick else list(TARGETS))
    args.runs = args.runs or (2 if args.quick else 3)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quiet()
    start = time.perf_counter()
    results: dict[str, Any] = {"machine": machine(args.device), "args": vars(args) | {"json": None}, "rows": []}
    budget_of = {t: budgets(TARGETS[t], args.device) for t in args.targets}
    halvings = {(t, b): halving(TARGETS[t], budget_of[t][b], args.device) for t in args.targets for b in args.budgets}
    with tempfile.TemporaryDirectory(prefix="autotune-verdict-") as tmp:
        for mode in args.modes:
            results["rows"] += run_mode(args, mode, Path(tmp), halvings, budget_of)
            results["wall_seconds"] = time.perf_counter() - start
            write_json(args.json, results)
    results["machine"]["load_average_end"] = load_average()
    print(report(results))
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
