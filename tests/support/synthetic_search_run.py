"""Runs searches (or plain measurements) of the synthetic target for tests/search/test_quality.py, in a process of
its own: glibc's malloc must be told before the process starts to return large blocks at once
(``MALLOC_MMAP_THRESHOLD_``), or a CPU trial's peak resident set depends on its allocation history, and the target's
noise is set in the environment the trials inherit. The output also says how many paced steps overran their time
(``pace``), which breaks the target's known ranking: per search, and in all. A search whose steps did not keep their
pace (another process took the CPU the target's sleeps leave) says nothing of the search's quality, so ``search
SEEDS`` runs further seeds, up to ``EXTRA`` more, until ``SEEDS`` searches kept pace.

With ``--misleading``, the step-time model is wrong the way it is on a CPU whose 16-bit matmuls it misprices (an
AMX or avx512_bf16 CPU read as one without, or the other way round): every bf16-mixed plan is predicted at 0.4 of what
it would be, so the model's first order puts every 32-true plan first while bf16-mixed is faster here.

Usage: python tests/support/synthetic_search_run.py {search SEEDS | interval RUNS} [--misleading] OUT.json
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

TARGET = str(Path(__file__).resolve().parents[1] / "fixtures" / "synthetic_target.py") + ":make"
SPACE = """dimensions:
  precision: {choices: [32-true, bf16-mixed]}
  micro_batch_size: {choices: [8, 16, 32]}
  activation_checkpointing: {choices: [0.0, 1.0]}
"""
TRIALS = 6
MEASURE = {"steps": 8, "warmup": 1, "interval": 0.05}  # 8 timed steps at most per trial, +-5%
EXTRA = 3  # seeds run beyond SEEDS at most, where searches did not keep pace
KEPT_PACE = 0.02  # a search kept pace when at most this share of its paced steps overran


def kept_pace(pace: dict) -> bool:
    return pace["overruns"] <= KEPT_PACE * pace["steps"]


def budget_bytes() -> int:
    """A budget where 16 MiB of ballast fits and 32 MiB does not: half-way between the largest peak of the plans
    that keep 16 MiB (micro-batch 16 with nothing recomputed, 32 with every block recomputed) and the peak of
    micro-batch 32 with nothing recomputed, measured here after one run to warm the fork server. The process's
    floor, and how much of the ballast shows in its resident set, differ between machines (here 28 MiB between 4 and
    32 MiB of ballast, 17 MiB on a CI machine)."""
    from autotune import Plan, measure_plan

    def peak(precision: str, micro: int, checkpointing: float) -> int:
        plan = Plan(precision=precision, micro_batch_size=micro, activation_checkpointing=checkpointing)
        result = measure_plan(target=TARGET, plan=plan, device="cpu", **MEASURE)
        assert result.status == "ok" and result.peak_bytes, result
        return result.peak_bytes

    peak("32-true", 8, 1.0)
    fits = max(peak("bf16-mixed", 16, 0.0), peak("bf16-mixed", 32, 1.0))
    over = peak("32-true", 32, 0.0)
    assert over - fits > 4 * 2**20, (fits, over)  # the memory model holds: a clear gap for the budget
    return (fits + over) // 2


def searches(seeds: int, log: Path) -> dict:
    from autotune import search
    from autotune._search.choose import remeasured_runs
    from autotune._search.halving import RUNG
    from autotune._search.twin import TWIN

    budget = budget_bytes()
    folder = Path(tempfile.mkdtemp(prefix="autotune-synthetic-"))
    space = folder / "space.yaml"
    space.write_text(SPACE)

    def one(seed: int) -> dict:
        before = len(_lines(log))
        result = search(target=TARGET, budget=budget, space=str(space), trials=TRIALS, seed=seed,
                        storage=f"sqlite:///{folder}/s{seed}.db", study="synthetic", out=None, device="cpu", **MEASURE)
        trials = [{"number": t.number, "params": t.params, "state": t.state.name, **{
                   k: t.user_attrs.get(k) for k in ("status", "source", "samples_per_second", "peak_bytes",
                                                    "predicted_peak_bytes", RUNG, TWIN)}}
                  for t in result.study.get_trials()]
        return {"seed": seed, "chosen": dict(result.study.trials[result.trial_number].params),
                "figure": result.figure.as_attrs() if result.figure else None, "trials": trials,
                "remeasured": remeasured_runs(result.study), "pace": _sum(_lines(log)[before:])}

    runs: list[dict] = []
    for seed in range(seeds + EXTRA):  # one at a time: a paced step must not wait for a CPU
        if sum(kept_pace(run["pace"]) for run in runs) == seeds:
            break
        runs.append(one(seed))
    return {"budget_bytes": budget, "runs": runs}


def intervals(runs: int) -> dict:
    from autotune import Plan, measure_plan

    plan = Plan(precision="bf16-mixed", micro_batch_size=16)
    out = []
    for _ in range(runs):
        result = measure_plan(target=TARGET, plan=plan, device="cpu", steps=20, warmup=1, interval=0.03)
        out.append({"status": result.status, "samples_per_second": result.samples_per_second,
                    "interval": result.interval, "steps_timed": result.steps_timed})
    return {"runs": out}


def _lines(log: Path) -> list[tuple[int, int]]:
    """Each training run's "steps overruns", in the order the runs ended."""
    return [tuple(map(int, line.split())) for line in log.read_text().splitlines()] if log.exists() else []


def _sum(lines: list[tuple[int, int]]) -> dict:
    return {"runs": len(lines), "steps": sum(s for s, _ in lines), "overruns": sum(o for _, o in lines)}


def mislead() -> None:
    """The model's predictions of bf16-mixed plans at 0.4 of what it would say (see the module's notes)."""
    import dataclasses

    from autotune._search.speed import SearchSpeed

    calibrated = SearchSpeed._calibrated

    def misprices_bf16(self, plan):  # type: ignore[no-untyped-def]
        predicted = calibrated(self, plan)
        if predicted is None or plan.precision != "bf16-mixed":
            return predicted
        return dataclasses.replace(predicted, samples_per_second=0.4 * predicted.samples_per_second,
                                   seconds_per_step=predicted.seconds_per_step / 0.4)

    SearchSpeed._calibrated = misprices_bf16


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--misleading"]
    if "--misleading" in sys.argv[1:]:
        mislead()
    mode, count, path = args[0], int(args[1]), args[2]
    log = Path(tempfile.mkdtemp(prefix="autotune-pace-")) / "pace.log"
    os.environ["AUTOTUNE_SYNTHETIC_PACE_LOG"] = str(log)  # before the first trial: trials inherit it
    out = searches(count, log) if mode == "search" else intervals(count)
    Path(path).write_text(json.dumps({**out, "pace": _sum(_lines(log))}))
