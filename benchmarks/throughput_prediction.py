"""Throughput prediction: the step-time model's samples/s for every plan of the shipped ``cpu`` space against the
measured, on three targets, and the plan ``autotune search --trials 1`` runs against the exhaustive best.

Targets: ``gpt`` (the GPT example, under the README's 2 GiB: every plan fits), ``hungry`` (the test suite's
memory-bound target: a tanh over 128 x 2048 values per sample in each block, small matrix products) and ``llama`` (a
transformers Llama built from a config, ``benchmarks/_hf_llama.py``; ``llama-2gib``: the same plans under 2 GiB, where
every plan fits). For each:

- **measured**: every distinct plan of the space (``SearchSpace.points()``; each ``auto`` point is the largest
  micro-batch, evened out, whose measured peak fits the budget) trained through Lightning with the plan's callbacks in
  a fresh process (forked from a server that imported torch and Lightning, as a trial is), ``--rounds`` times, the
  rounds interleaved; a run's figure is the batch over the median step's **CPU time** of the main thread (one intra-op
  thread runs the whole step there; a dataloader worker's process is not counted, as it runs beside it), over 8 steps
  after 2; a plan's figure is the best of its runs, its peak the largest (resident set net of file pages). CPU time,
  not wall time: on this shared 2-core VM, where other sessions' test suites keep the load average at 6 to 12, the
  same plan's wall-clock samples/s moved by up to 6x between runs, its CPU-time figure by 6% at most (both are kept:
  ``wall_samples_per_second``). Not always: in a run (2026-11-27) whose load average rose from 2.5 to 10 between its
  two rounds, the GPT's 60 plans lost 12% of CPU-time samples/s in the median (16% apart, 45% at most; the rounds'
  Spearman 0.86): CPU time shields from the load's share of the cores, not from what it does to caches and clocks;
- **budget**: for ``hungry`` and ``llama`` the middle of the widest gap between the measured peaks in their middle 60%
  (about half the plans fit, none within a run's noise of the budget);
- **predicted**: ``autotune.predict_speed`` on this machine's CPU (measured once by the model's microbenchmark, with
  the same one thread), uncalibrated; the Spearman rank correlation (average ranks for ties) of predicted and measured
  samples/s among the plans that fit (goal >= 0.8), and the median error of the predictions after one calibrating
  trial (the predicted best's measurement fixes a common scale, all one trial can tell);
- **search**: ``autotune search TARGET --device cpu --budget B --trials 1`` in a fresh study; its plan and the
  exhaustive best measured side by side as above, alternately, ``--side-runs`` times each; the ratio of their best
  runs (goal >= 0.9).

Measurements can be kept (``--json``) and reused (``--measured``): predictions are made anew, the measurements not.

Usage::

    python benchmarks/throughput_prediction.py --json throughput.json
    python benchmarks/throughput_prediction.py --targets gpt --rounds 1
    python benchmarks/throughput_prediction.py --measured throughput.json --no-search
"""

from __future__ import annotations

import json
import math
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
    GPT_TARGET,
    HERE,
    HUNGRY_TARGET,
    add_json,
    add_threads,
    first_batch,
    in_fresh_process,
    machine,
    machine_line,
    make_parser,
    markdown_table,
    peak_host_bytes,
    quiet,
    threads_for,
    use_paths,
    write_json,
)

TARGETS = {"gpt": GPT_TARGET, "hungry": HUNGRY_TARGET, "llama": f"{HERE / '_hf_llama.py'}:make",
           "llama-2gib": f"{HERE / '_hf_llama.py'}:make"}
#: Budgets given (bytes); the others are taken from the measured peaks (:func:`budget_from`).
BUDGETS = {"gpt": 2 * 2**30, "llama-2gib": 2 * 2**30}
#: Targets measured as another (the same plans, another budget): their measurements are shared.
SAME_AS = {"llama-2gib": "llama"}


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation of two lists (average ranks for ties).

    Example:
        >>> spearman([1, 2, 3, 4], [10, 30, 20, 40])
        0.8
    """
    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return cov / var if var else 0.0


def even_micro_batches(batch_size: int) -> list[int]:
    """The micro-batches that split the batch in equal passes (what ``auto`` picks from), smallest first."""
    return sorted({-(-batch_size // passes) for passes in range(1, batch_size + 1)})


def _run_plan(target: str, plan: dict[str, Any], steps: int) -> dict[str, Any]:
    """In a fresh process: train ``target`` with ``plan`` for ``warmup + steps`` optimizer steps through Lightning
    (the plan's callbacks, as a trial); the median step's wall and CPU seconds (the main thread's, which runs the
    step: one intra-op thread) over the last ``steps``, and the process's peak in a CPU budget's measure."""
    import time

    import lightning as L

    from autotune import Plan, load_target

    quiet()
    parsed = Plan.from_dict(plan)
    tgt = load_target(target)
    marks: list[tuple[float, float]] = []

    class Timer(L.Callback):
        def on_train_batch_end(self, *args: Any) -> None:
            marks.append((time.perf_counter(), time.thread_time()))

    kwargs = {k: v for k, v in parsed.trainer_kwargs().items() if k != "devices"}
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=WARMUP + steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=[*parsed.callbacks(), Timer()], **kwargs)
    trainer.fit(tgt.model, datamodule=tgt.datamodule)
    timed = marks[WARMUP - 1:]
    wall = statistics.median(b[0] - a[0] for a, b in zip(timed, timed[1:]))
    cpu = statistics.median(b[1] - a[1] for a, b in zip(timed, timed[1:]))
    batch = tgt.batch_size()
    return {"status": "ok", "samples_per_second": batch / cpu, "wall_samples_per_second": batch / wall,
            "peak_bytes": peak_host_bytes()}


#: Untimed steps before the timed ones (the optimizer state made, the allocator settled).
WARMUP = 2
#: Timed steps per measurement (their CPU time scatters by a few percent: the median of 8 is steady).
STEPS = 8


def measure(target: str, plan: Any) -> dict[str, Any]:
    try:
        return in_fresh_process(_run_plan, target, plan.to_dict(), STEPS)
    except RuntimeError as error:
        return {"status": "error", "samples_per_second": None, "peak_bytes": None, "reason": str(error)[:300]}


def measure_all(name: str, target: str, rounds: int, known: dict[str, Any],
                save: Any = lambda data: None) -> dict[str, Any]:
    """Every plan of the cpu space but ``auto``, ``rounds`` times interleaved; ``known``: earlier measurements kept;
    ``save(data)`` after each measurement (an interrupted run goes on from there with ``--measured``)."""
    from autotune import Plan, load_space, load_target

    tgt = load_target(target)
    batch = tgt.batch_size()
    space = load_space("cpu").for_device(__import__("torch").device("cpu"), batch_size=batch)
    plans = {}
    for params in space.points():
        if params["micro_batch_size"] == "auto":
            continue
        plan = Plan(**params)
        plans[plan.key()] = plan
    runs: dict[str, list[dict[str, Any]]] = {k: list(known.get("runs", {}).get(k, [])) for k in plans}
    data = {"batch_size": batch, "plans": {k: p.to_dict() for k, p in plans.items()}, "runs": runs,
            "points": space.points(), "budget": known.get("budget")}
    for round_ in range(rounds):
        for key, plan in plans.items():
            if len(runs[key]) > round_:
                continue
            runs[key].append(measure(target, plan))
            print(f"  {name} round {round_ + 1}: {plan.describe()}: {runs[key][-1]['samples_per_second'] or 0:.1f}/s",
                  flush=True)
            save(data)
    return data


def figure(runs: list[dict[str, Any]]) -> tuple[float | None, int | None]:
    ok = [r for r in runs if r["status"] == "ok" and r["samples_per_second"]]
    if not ok:
        return None, None
    return max(r["samples_per_second"] for r in ok), max(r["peak_bytes"] or 0 for r in ok)


def budget_from(peaks: list[int]) -> int:
    """The middle of the widest gap between sorted peaks in their middle 60%."""
    peaks = sorted(set(peaks))
    lo, hi = int(len(peaks) * 0.2), max(int(len(peaks) * 0.8), int(len(peaks) * 0.2) + 1)
    middle = peaks[lo:hi + 1]
    gaps = [(b - a, (a + b) // 2) for a, b in zip(middle, middle[1:])]
    return max(gaps)[1] if gaps else peaks[len(peaks) // 2]


def resolve_autos(name: str, target: str, data: dict[str, Any], budget: int) -> dict[str, str]:
    """Each ``auto`` point's plan: the largest evened micro-batch whose measured peak fits. Between the largest listed
    micro-batch that fits and the next listed one, the evened ones are measured here, largest first, until one fits.
    Returns point -> plan key (none for a point where nothing fits)."""
    from autotune import Plan

    batch = data["batch_size"]
    resolved = {}
    for params in data["points"]:
        if params["micro_batch_size"] != "auto":
            continue

        def key_of(micro: int) -> str:
            return Plan(**{**params, "micro_batch_size": micro}).key()

        listed = sorted(m for m in even_micro_batches(batch) if key_of(m) in data["runs"])
        fits = [m for m in listed if (figure(data["runs"][key_of(m)])[1] or budget + 1) <= budget]
        low = max(fits, default=0)
        high = min((m for m in listed if m > low), default=batch + 1)
        chosen = key_of(low) if low else None
        for micro in sorted((m for m in even_micro_batches(batch) if low < m < high), reverse=True):
            plan = Plan(**{**params, "micro_batch_size": micro})
            data["plans"][plan.key()] = plan.to_dict()
            data["runs"][plan.key()] = data["runs"].get(plan.key()) or [measure(target, plan)]
            print(f"  {name} auto: {plan.describe()}: {data['runs'][plan.key()][-1]['samples_per_second'] or 0:.1f}/s",
                  flush=True)
            if (figure(data["runs"][plan.key()])[1] or budget + 1) <= budget:
                chosen = plan.key()
                break
        if chosen is not None:
            resolved[json.dumps(params, sort_keys=True)] = chosen
    return resolved


def predictions(target: str, plans: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    from autotune import Plan, load_target, predict_speed

    tgt = load_target(target)
    batch = first_batch(tgt)
    out = {}
    for key, data in plans.items():
        p = predict_speed(model=tgt.model, batch=batch, plan=Plan.from_dict(data), device="cpu")
        out[key] = {"samples_per_second": p.samples_per_second, "bound": p.bound, "mfu": p.mfu}
    return out


def search_once(target: str, budget: int, folder: Path) -> Any:
    from autotune import load_plan

    out = folder / "tuned.yaml"
    command = [sys.executable, "-m", "autotune", "search", target, "--device", "cpu", "--budget", str(budget),
               "--trials", "1", "--storage", f"sqlite:///{folder / 'study.db'}", "--out", str(out), "--no-progress"]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=os.environ.copy())
    if done.returncode != 0:
        raise RuntimeError(f"search failed: {done.stderr[-2000:]}")
    return load_plan(out), time.perf_counter() - start


def side_by_side(target: str, a: Any, b: Any, runs: int) -> tuple[float, float]:
    best_a, best_b = 0.0, 0.0
    for _ in range(runs):
        best_a = max(best_a, measure(target, a)["samples_per_second"] or 0.0)
        best_b = max(best_b, measure(target, b)["samples_per_second"] or 0.0)
    return best_a, best_b


def report(name: str, target: str, data: dict[str, Any], args: Any) -> dict[str, Any]:
    from autotune import Plan

    figures = {k: figure(v) for k, v in data["runs"].items()}
    budget = data.get("budget") or BUDGETS.get(name) or budget_from([p for _, p in figures.values() if p])
    data["budget"] = budget
    autos = resolve_autos(name, target, data, budget)
    figures = {k: figure(v) for k, v in data["runs"].items()}
    predicted = predictions(target, data["plans"])
    fit = [k for k, (rate, peak) in figures.items() if rate and peak is not None and peak <= budget]
    rho = spearman([predicted[k]["samples_per_second"] for k in fit], [figures[k][0] for k in fit])
    top = max(fit, key=lambda k: predicted[k]["samples_per_second"])
    best = max(fit, key=lambda k: figures[k][0])
    scale = figures[top][0] / predicted[top]["samples_per_second"]
    errors = [abs(scale * predicted[k]["samples_per_second"] - figures[k][0]) / figures[k][0] for k in fit]
    result = {"target": name, "budget_bytes": budget, "plans": len(figures), "fit": len(fit), "spearman": rho,
              "median_error_after_one_trial": statistics.median(errors),
              "predicted_best": Plan.from_dict(data["plans"][top]).describe(),
              "predicted_best_over_best": figures[top][0] / figures[best][0],
              "best": Plan.from_dict(data["plans"][best]).describe(), "autos": autos,
              "rows": {Plan.from_dict(data["plans"][k]).describe(): {"measured": figures[k][0], "peak": figures[k][1],
                                                                      **predicted[k]} for k in figures}}
    if args.search:
        with tempfile.TemporaryDirectory(prefix="autotune-tp-") as tmp:
            try:
                chosen, seconds = search_once(target, budget, Path(tmp))
            except RuntimeError as error:  # no plan fits: its one trial was over the budget
                result["search_failed"] = " ".join(str(error).split())[-400:]
                return result
        exhaustive = Plan.from_dict(data["plans"][best])
        ours, theirs = side_by_side(target, chosen, exhaustive, args.side_runs)
        result.update({"search_plan": chosen.describe(), "search_seconds": seconds, "search_measured": ours,
                       "best_measured_beside": theirs, "search_over_best": ours / theirs if theirs else None})
    return result


def main() -> None:
    parser = make_parser(__doc__)
    parser.add_argument("--targets", default="gpt,hungry,llama,llama-2gib",
                        help="comma-separated: gpt, hungry, llama, llama-2gib (llama's plans under 2 GiB: all fit)")
    parser.add_argument("--rounds", type=int, default=2, help="measurements of each plan, interleaved (default 2)")
    parser.add_argument("--side-runs", type=int, default=3, help="side-by-side runs of each plan (default 3)")
    parser.add_argument("--no-search", dest="search", action="store_false", help="skip the --trials 1 search")
    parser.add_argument("--measured", type=Path, default=None, help="reuse the measurements of an earlier --json")
    add_threads(parser, "intra-op threads of the trials and the prediction (default 1)")
    add_json(parser)
    args = parser.parse_args()
    names = [n.strip() for n in args.targets.split(",") if n.strip()]
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        parser.error(f"--targets: unknown {', '.join(unknown)}; choose from {', '.join(TARGETS)}")
    threads = threads_for("cpu", args.threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # before torch starts, here and in the trials (inherited)
    use_paths(gpt=True)
    quiet()
    import torch

    torch.set_num_threads(threads)
    known = json.loads(args.measured.read_text())["measured"] if args.measured else {}
    results: dict[str, Any] = {"machine": machine("cpu", threads=threads), "measured": dict(known), "targets": []}
    for name in names:
        print(f"{name}: measuring", flush=True)
        def save(data: dict[str, Any], name: str = name) -> None:
            results["measured"][name] = data
            write_json(args.json, results)

        # this run's measurements so far (those of --measured included); a target measured as another takes the
        # other's wherever there are some (the same plans; its own copy from an earlier run may have fewer rounds)
        done = results["measured"]
        earlier = done.get(SAME_AS[name]) or done.get(name, {}) if name in SAME_AS else done.get(name, {})
        if name in SAME_AS:  # its own budget and ``auto`` plans, the other's measurements
            earlier = {**earlier, "budget": None}
        data = measure_all(name, TARGETS[name], args.rounds, earlier, save)
        save(data)
        results["targets"].append(report(name, TARGETS[name], data, args))
        write_json(args.json, results)
    results["machine"]["load_average_end"] = os.getloadavg()
    write_json(args.json, results)
    print(machine_line(results["machine"]))
    rows = [[r["target"], f"{r['budget_bytes'] / 2**20:.0f} MiB", f"{r['fit']}/{r['plans']}", f"{r['spearman']:.2f}",
             f"{r['median_error_after_one_trial']:.0%}", r["predicted_best"], f"{r['predicted_best_over_best']:.2f}",
             r.get("search_plan", "failed" if r.get("search_failed") else "-"),
             f"{r['search_over_best']:.2f}" if r.get("search_over_best") else "-"] for r in results["targets"]]
    print(markdown_table(["target", "budget", "fit", "Spearman", "error after 1 trial", "predicted best",
                          "its measured / best", "search --trials 1", "search / best (side by side)"], rows))


if __name__ == "__main__":
    main()
