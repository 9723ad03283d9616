"""Search quality on a target whose true ranking is known (tests/fixtures/synthetic_target.py): the search finds the
best plan in 6 trials even where the step-time model misranks it, random search with the same trials does worse, and
a trial's interval holds the truth.

The runs happen in a process of their own (tests/support/synthetic_search_run.py): its malloc returns large blocks at once,
so that a CPU trial's peak is its plan's, and the target's noise is set before its trials start. A failure message
carries ``pace``: how many of the target's paced steps overran their time (the known ranking holds only while they do
not; a machine more than about twice slower than the target's margin, or heavily loaded, breaks it).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.synthetic_search_run import kept_pace

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS / "fixtures"))
from synthetic_target import true_throughput  # noqa: E402

sys.path.remove(str(TESTS / "fixtures"))

SEEDS = 5
POINTS = [{"precision": p, "micro_batch_size": m, "activation_checkpointing": c}
          for p in ("32-true", "bf16-mixed") for m in (8, 16, 32) for c in (0.0, 1.0)]


def _run(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> dict:
    out = tmp_path / "out.json"
    done = subprocess.run([sys.executable, str(TESTS / "support" / "synthetic_search_run.py"), *args, str(out)],
                          env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", **(env or {})},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def _fits(point: dict) -> bool:
    """512 KiB per sample and kept block: 16 MiB and less fits the budget, 32 MiB does not."""
    kept_blocks = 2 if point["activation_checkpointing"] == 0.0 else 1
    return point["micro_batch_size"] * kept_blocks * 0.5 <= 16


def _truth(point: dict) -> float:
    return true_throughput(**point)


def _random_search_rate(best: dict, seeds: int = 2000) -> float:
    """The share of random searches with the same 6 trials (each a uniform draw from the space's points, as Optuna's
    RandomSampler makes them, measured exactly: random search's best case) that choose ``best``."""
    found = 0
    for seed in range(seeds):
        rng = random.Random(seed)
        feasible = [p for p in (rng.choice(POINTS) for _ in range(6)) if _fits(p)]
        found += bool(feasible) and max(feasible, key=_truth) == best
    return found / seeds


@pytest.mark.slow
def test_the_search_finds_the_known_best_plan_in_6_trials_where_the_model_misleads_and_random_search_does_worse(
        tmp_path: Path) -> None:
    """The model prices bf16-mixed at 0.4 of what it would say (``--misleading``: as on a CPU whose 16-bit matmuls
    it misreads), so its first order puts every 32-true plan first while bf16-mixed is faster here. The search still
    finds the best: its first trials measure each precision's predicted best (the choice the model is least sure of),
    the study's trials correct the model by setting, and paired comparisons decide between the close plans."""
    feasible = [p for p in POINTS if _fits(p)]
    best = max(feasible, key=_truth)
    assert best == {"precision": "bf16-mixed", "micro_batch_size": 16, "activation_checkpointing": 0.0}
    second = max((p for p in feasible if p != best), key=_truth)
    assert _truth(second) < 0.9 * _truth(best)  # a clear best: 13% ahead of the second

    result = _run(tmp_path, "search", str(SEEDS), "--misleading")
    budget = result["budget_bytes"]
    for run in result["runs"]:
        measured = [t for t in run["trials"] if t["source"] == "measured"]
        # 6 trials of the search's own; halving's rung and the leader's plain twin, where due, come after them
        own = [t for t in measured if not t.get("halving_rung") and t.get("plain_twin_of") is None]
        assert len(own) <= 6 and len(measured) - len(own) <= 2, [(t["number"], t["params"]) for t in measured]
        for t in measured:  # the budget splits the plans as the memory model says (the truth is well defined)
            point = {k: t["params"][k] for k in ("precision", "micro_batch_size", "activation_checkpointing")}
            if t["status"] in ("ok", "pruned"):
                assert (t["peak_bytes"] <= budget) is _fits(point), (point, t["peak_bytes"], budget)
    # CPU peaks are measured net of file-backed pages: the resident set also counts the pages of torch's libraries a
    # process has mapped, which depend on the page cache (in a clean clone's freshly installed venv a process mapped
    # 157 MiB of them against 93 MiB once the cache was dropped, and recomputation 16 MiB over its estimate), and
    # the budget then split the plans 2.6 MiB away from a prediction (7 of 10 in CI). Net of them, every prediction
    # is within 1 MiB of its peak and the budget sits 8 MiB from the nearest plan.
    # Only a search whose paced steps kept their pace is judged: where another process took the CPU the target's
    # sleeps leave, its known ranking no longer holds (in CI the other test worker's load overran 4% of the steps).
    # The runner runs further seeds until SEEDS searches kept pace, so a busy host costs time, not the verdict.
    chosen = [(f"{c['precision']} m{c['micro_batch_size']} c{c['activation_checkpointing']}", run["pace"])
              for c, run in ((run["chosen"], run) for run in result["runs"])]
    judged = [run for run in result["runs"] if kept_pace(run["pace"])]
    assert len(judged) >= 3, (result["pace"], chosen)  # a host busy beyond that tells nothing of the search
    found = sum(run["chosen"] == best for run in judged)
    assert found >= len(judged) - 1, (result["budget_bytes"], chosen)
    random_rate = _random_search_rate(best)  # 0.4
    assert found / len(judged) >= random_rate + 0.25, (found, len(judged), random_rate)  # random's best case


@pytest.mark.slow
@pytest.mark.alone  # a loaded CPU skews what it measures
def test_a_trials_interval_holds_the_true_throughput(tmp_path: Path) -> None:
    # Steps scatter by 5% around the truth (no run-to-run offset here): a 95% interval holds the truth in about 19
    # runs of 20; 7 of 10 leaves room for chance (a miss in 4 of 10 has probability 0.1%).
    result = _run(tmp_path, "interval", "10", env={"AUTOTUNE_SYNTHETIC_RUN_NOISE": "0"})
    truth = _truth({"precision": "bf16-mixed", "micro_batch_size": 16, "activation_checkpointing": 0.0})
    runs = result["runs"]
    assert all(r["status"] == "ok" and r["steps_timed"] >= 5 for r in runs)
    held = [r["interval"][0] <= truth <= r["interval"][1] for r in runs]
    assert sum(held) >= 7, (result["pace"], [(round(r["samples_per_second"]), r["interval"]) for r in runs])
    assert all(r["interval"][1] - r["interval"][0] < 0.3 * truth for r in runs)  # not vacuous: within +-15%


def test_the_long_context_benchmark_target_spaces_its_plans_mibs_apart() -> None:
    """``search_quality.py --target long`` rests on this: the target's plans differ by MiBs per sample, far more than
    the few hundred KiB a CPU peak moves between runs (docs/benchmarks.md, "Under noise")."""
    from autotune import Plan, estimate, load_target

    target = load_target(f"{TESTS.parent / 'benchmarks' / 'long_context.py'}:make")
    assert (target.model.tokens_per_sample, target.batch_size()) == (128, 32)
    target.datamodule.setup("fit")
    batch = next(iter(target.datamodule.train_dataloader()))
    peaks = [estimate(model=target.model, batch=batch, plan=Plan(micro_batch_size=m), device="cpu").predicted_peak_bytes
             for m in (8, 16)]
    assert (peaks[1] - peaks[0]) / 8 > 2**20, peaks  # 1.5 MiB per sample (the example: 0.4)
