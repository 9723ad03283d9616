"""The fault fuzzer: seeded scenarios on 2 CPU ranks (gloo), each a few steps of ``ElasticBatchSize`` under DDP
(buffers broadcast or not) or FSDP2, on models with and without buffers, BatchNorm, a buffer the forward updates and
uses, a layer with collectives in forward and backward (a SyncBatchNorm stand-in), an all-gather of each micro-batch's rows
(a contrastive loss's), a transformers BERT; each rank pads
its batches to lengths of its own; out-of-memory errors raised in forward, in backward, in an optimizer pre-hook or
inside the first update, on some ranks, at the first step or a later one, once or at every micro-batch above a size;
some split from each rank's own shapes (``micro_batch_sample_size``), some validate with an all-gather of the rows
and an OOM there on one rank, some stop mid-run and resume from a checkpoint (every rank's own callback state), some
set a DDP option the runtime refuses (a static graph, a communication hook).

Each scenario asserts: no rank hangs (every rank runs to its own end or the deadline, then its stacks are shown),
every rank's weights and buffers equal native accumulation on the same samples with the same splits (within 1e-6, in
float64), ``global_step`` and the samples of every step exact, every validation batch's rows gathered once; or, where
a rank's limit leaves no micro-batch that fits, every rank ends with the same error naming that rank; a refused
setting ends every rank at setup with its one line. Each CI run tries three seeds (``--fuzz-seed S``: S, S+1, S+2);
``--fuzz-scenarios N`` runs more scenarios a seed.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.ranks import run_ranks

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "fuzz_ranks_run.py"
MODELS = ("mlp", "buffer", "batchnorm", "normaliser", "collective", "gather", "bert")
#: Scenarios per strategy and seed in one CI run (``--fuzz-scenarios`` overrides).
DEFAULT_SCENARIOS = {"ddp": 6, "fsdp": 3}


def scenarios(seed: int, count: int, strategy: str) -> list[dict[str, Any]]:
    """``count`` random scenarios for ``strategy``, the same for the same seed."""
    rng = random.Random(f"{seed}/{strategy}")
    out = []
    for k in range(count):
        steps, batch = rng.choice((3, 4)), 8
        lengths = [[rng.randint(3, 16) for _ in range(steps)] for _ in range(2)]
        if rng.random() < 0.25:  # one rank's shape never changes (short batches that always fit)
            lengths[1] = [4] * steps
        faults: list[dict[str, Any]] = []
        for rank in rng.sample((0, 1), rng.choice((1, 1, 2))):
            step = rng.choice((0, 0, rng.randrange(steps)))
            if rng.random() < 0.5:  # a memory limit: every micro-batch above ``cap`` tokens fails, from ``step`` on
                floor = rng.random() < 0.1  # not even one sample fits: the run ends on every rank
                cap = 2 if floor else rng.randint(2 * max(lengths[rank]), 6 * max(lengths[rank]))
                faults.append({"rank": rank, "phase": rng.choice(("forward", "backward")), "step": step, "cap": cap})
            else:  # a single failure
                phase = rng.choice(("forward", "backward", "step_pre", "update"))
                faults.append({"rank": rank, "phase": phase, "step": 0 if phase == "update" else step, "once": True})
        scenario = {"id": k, "strategy": strategy, "broadcast_buffers": rng.random() < 0.6,
                    "model": rng.choice(MODELS), "optimizer": rng.choice(("adamw", "sgd")), "steps": steps,
                    "batch": batch, "lengths": lengths, "faults": faults, "micro": rng.choice((None, None, 4))}
        if rng.random() < 0.25:  # each rank's split from its own shapes: its lengths against a known-fitting load
            scenario["elastic"] = {"micro_batch_size": 4, "micro_batch_sample_size": rng.choice((24, 48)),
                                   "grow_after": 2}
        if strategy == "ddp" and rng.random() < 0.3:  # validation all-gathers its rows; an OOM there on one rank
            scenario["eval"] = {"batches": 2, "fault": {"rank": rng.choice((0, 1)), "batch": rng.choice((0, 1)),
                                                        "cap": rng.choice((1, 2, 4, 8))}}
        if rng.random() < 0.25:  # stopped after this step, saved and resumed: each rank with its own callback state
            scenario["resume"] = rng.randrange(1, steps)
        if strategy == "ddp" and rng.random() < 0.1:  # refused at setup, in one line naming the fix
            scenario["setting"] = rng.choice(("static_graph", "comm_hook"))
        out.append(scenario)
    return out


def expected_floor(scenario: dict[str, Any]) -> int | None:
    """The rank whose limit leaves no micro-batch that fits (a sample alone is above its cap), if one."""
    for fault in scenario["faults"]:
        if "cap" in fault and any(length > fault["cap"] for length in
                                  scenario["lengths"][fault["rank"]][fault["step"]:]):
            return int(fault["rank"])
    return None


def check(scenario: dict[str, Any], ranks: list[dict[str, Any]]) -> list[str]:
    """What is wrong with one scenario's results (nothing: an empty list)."""
    problems = []
    floor = expected_floor(scenario)
    errors = [r["error"] for r in ranks]
    setting = scenario.get("setting")
    if setting is not None:
        says = "static_graph=True" if setting == "static_graph" else "hook fp16_compress_hook"
        if not all(e and e.startswith("MisconfigurationException") and says in e for e in errors):
            problems.append(f"expected every rank to refuse {setting} at setup; got {errors}")
        return problems
    if floor is None:  # a single failure that struck a rank already at one sample ends the run too
        floor = next((r for r, result in enumerate(ranks) if 1 in result["fired_at"]), None)
    if floor is not None:
        if not all(e and e.startswith("OutOfMemoryAtMinimumError") and f"on rank {floor}" in e for e in errors):
            problems.append(f"expected every rank to stop at rank {floor}'s minimum; got {errors}")
        elif len(set(errors)) != 1:
            problems.append(f"the ranks ended with different errors: {errors}")
        return problems
    if any(errors):
        return [f"a rank failed: {errors}"]
    for rank, result in enumerate(ranks):
        if result["global_step"] != scenario["steps"]:
            problems.append(f"rank {rank}: global_step {result['global_step']} != {scenario['steps']}")
        want = [[i + 10000 * rank + 100 * step for i in range(scenario["batch"])] for step in range(scenario["steps"])]
        if result["ran"] != want:
            problems.append(f"rank {rank}: the samples run {result['ran']} are not each step's once, in order")
        worst, where = 0.0, ""
        for name, value in result["state"].items():
            diff = float((value.double() - result["native"][name].double()).abs().max()) if value.numel() else 0.0
            if diff > worst:
                worst, where = diff, name
        if worst > 1e-6:
            problems.append(f"rank {rank}: {where} is {worst:.2e} from native accumulation (splits {result['sizes']}, "
                            f"events {result['events']})")
        evaluation = scenario.get("eval")
        if evaluation is not None:  # every validation batch's rows gathered once, from both ranks, in equal parts
            gathered: dict[int, list[int]] = {}
            for batch, ids in result["gathered"]:
                gathered.setdefault(batch, []).extend(ids)
            want = {b: sorted(val_id(r, b, i) for r in range(2) for i in range(scenario["batch"]))
                    for b in range(evaluation["batches"])}
            if {b: sorted(ids) for b, ids in gathered.items()} != want:
                problems.append(f"rank {rank}: validation gathered {gathered}, not each batch's rows once")
    return problems


def val_id(rank: int, batch: int, index: int) -> int:
    """The id of a validation sample (as fuzz_ranks_run.val_batches numbers them)."""
    return 50000 + 10000 * rank + 100 * batch + index


@pytest.mark.slow
@pytest.mark.parametrize("offset", [0, 1, 2])
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_random_faults_on_ranks_that_differ_end_exact_or_together(strategy: str, offset: int, tmp_path: Path,
                                                                   request: pytest.FixtureRequest) -> None:
    count = request.config.getoption("--fuzz-scenarios") or DEFAULT_SCENARIOS[strategy]
    seed = request.config.getoption("--fuzz-seed") + offset
    plan = scenarios(seed, count, strategy)
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    proc = run_ranks([str(SCRIPT), str(tmp_path / "plan.json"), str(tmp_path)], timeout=60 + 25 * count)
    assert proc.returncode == 0, proc.stderr[-4000:]
    problems = []
    for scenario in plan:
        ranks = [torch.load(tmp_path / f"{scenario['id']}.rank{r}.pt", weights_only=False) for r in range(2)]
        problems += [f"scenario {scenario['id']} (seed {seed}: {json.dumps(scenario)}): {p}"
                     for p in check(scenario, ranks)]
    assert not problems, "\n".join(problems)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_ranks_split_by_their_own_shapes_gather_in_equal_parts(strategy: str, tmp_path: Path) -> None:
    """Issue 55, item 1: each rank's split from its own lengths (``micro_batch_sample_size``; rank 0's samples five
    times longer at the first step) and an all-gather of each micro-batch's rows, a collective not known at setup.
    The first step's splits differ ([6, 2] against [8]): the guard before the gather sees the sizes differ, every rank
    runs the step again in the agreed count of equal parts, and the rest of the run splits alike (it crashed gloo)."""
    plan = [{"id": 0, "strategy": strategy, "broadcast_buffers": False, "model": "gather", "optimizer": "sgd",
             "steps": 3, "batch": 8, "lengths": [[16, 16, 4], [3, 3, 12]], "faults": [], "micro": None,
             "elastic": {"micro_batch_size": 4, "micro_batch_sample_size": 24, "grow_after": 2}}]
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    proc = run_ranks([str(SCRIPT), str(tmp_path / "plan.json"), str(tmp_path)], timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [torch.load(tmp_path / f"0.rank{r}.pt", weights_only=False) for r in range(2)]
    assert check(plan[0], ranks) == []
    assert ranks[0]["sizes"] == ranks[1]["sizes"]  # equal parts at every step
