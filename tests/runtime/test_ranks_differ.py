"""Ranks that differ, as users meet them (2 CPU ranks, gloo): a model with buffers under DDP's default broadcast and
an OOM on one rank, ranks whose batches have shapes of their own, BatchNorm and a running normaliser without any OOM,
a layer that makes collectives in forward and backward with an OOM before or after them, under DDP and FSDP2, and
a collective whose size follows the micro-batch (a contrastive loss's all-gather of its rows).
Each runs as one scenario of the fault fuzzer's runner (``fuzz_ranks_run.py``) and is checked as the fuzzer checks:
no hang, weights and buffers equal native accumulation on the same samples, steps and samples exact."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.ranks import RanksHung, run_ranks
from tests.runtime.test_fuzz_ranks import check

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "fuzz_ranks_run.py"
DEFAULTS: dict[str, Any] = {}  # ElasticBatchSize() as a new user writes it


def scenario(k: int, model: str, *, strategy: str = "ddp", lengths: Any = None, faults: Any = (), steps: int = 3,
             elastic: Any = None, broadcast: bool = True, batch: int = 8) -> dict[str, Any]:
    return {"id": k, "strategy": strategy, "broadcast_buffers": broadcast, "model": model, "optimizer": "adamw",
            "steps": steps, "batch": batch, "lengths": lengths or [[8] * steps, [6] * steps], "faults": list(faults),
            "elastic": DEFAULTS if elastic is None else elastic}


def once(rank: int, phase: str, step: int) -> dict[str, Any]:
    return {"rank": rank, "phase": phase, "step": step, "once": True}


PADDED = [[6, 16, 9, 14, 5, 16, 12, 15], [4] * 8]
PLAN = [
    # 1. A registered buffer, DDP's default broadcast_buffers, no validation loader, an OOM in rank 0's first forward:
    # the failed forward left DDP's "broadcast at the next forward" set on rank 0 alone (it hung).
    scenario(0, "buffer", faults=[once(0, "forward", 0)]),
    # 2. Rank 0's padded batches run out of memory past 80 tokens; rank 1's short ones always fit: rank 1 replays,
    # never shrinks (it was halved to 1, then ended with "OutOfMemoryAtMinimumError: another rank").
    scenario(1, "mlp", lengths=PADDED, steps=8, faults=[{"rank": 0, "phase": "forward", "step": 0, "cap": 80}]),
    # 3. No OOM at all, micro-batches of 4: BatchNorm's statistics and a running normaliser's mean drifted apart from
    # Lightning's accumulation (DDP broadcast once per fit instead of once per step).
    scenario(2, "batchnorm", elastic={"micro_batch_size": 4}),
    scenario(3, "normaliser", elastic={"micro_batch_size": 4}),
    # 4. A layer with an all-gather in forward and an all-reduce in backward (SyncBatchNorm's), an OOM on one rank
    # before the forward's collective (first step, a later one), or after it (in backward): it hung, or crashed gloo.
    scenario(4, "collective", faults=[once(0, "forward", 0)]),
    scenario(5, "collective", faults=[once(1, "forward", 2)]),
    scenario(6, "collective", faults=[once(0, "backward", 1)]),
    # ... and under FSDP2, an OOM in an optimizer step pre-hook, before the step calls the closure (it hung).
    scenario(7, "mlp", strategy="fsdp", faults=[once(1, "step_pre", 1)]),
    scenario(8, "collective", strategy="fsdp", faults=[once(0, "forward", 1)]),
    # 5. A collective whose size follows the micro-batch (a contrastive loss's all-gather of its rows, with gradients),
    # batch 16: at micro-batch 5 the rank whose count was the largest kept 5, 5, 5, 1 while its peer split 4, 4, 4, 4
    # (gloo aborted); after a one-rank OOM at 6, 3, 3, 3, 3, 3, 1 against 3, 3, 3, 3, 2, 2; ranks of shapes of
    # their own meet at equal sizes too.
    scenario(9, "gather", batch=16, lengths=[[8] * 3] * 2, elastic={"micro_batch_size": 5}),
    scenario(10, "gather", batch=16, lengths=[[8] * 3] * 2, faults=[once(0, "forward", 1)],
             elastic={"micro_batch_size": 6}),
    scenario(11, "gather", strategy="fsdp", batch=16, lengths=[[8] * 3] * 2, faults=[once(0, "forward", 1)],
             elastic={"micro_batch_size": 6}),
    scenario(12, "gather", batch=16, lengths=[[6, 12, 9], [12, 5, 16]], elastic={"micro_batch_size": 5}),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict[str, Any]]]:
    """Every scenario's results per rank; a scenario whose ranks hung or failed has its report instead (every
    test of it then fails with it, rather than the fixture erroring)."""
    folder = tmp_path_factory.mktemp("differ")
    (folder / "plan.json").write_text(json.dumps(PLAN))
    try:
        proc = run_ranks([str(SCRIPT), str(folder / "plan.json"), str(folder)], timeout=300)
        problem = None if proc.returncode == 0 else proc.stderr[-4000:]
    except RanksHung as hung:
        problem = str(hung)
    found: dict[int, Any] = {}
    for s in PLAN:
        paths = [folder / f"{s['id']}.rank{r}.pt" for r in range(2)]
        found[s["id"]] = [torch.load(p, weights_only=False) for p in paths] if all(p.exists() for p in paths) \
            else f"scenario {s['id']} did not finish: {problem}"
    return found


def finished(results: dict[int, Any], k: int) -> list[dict[str, Any]]:
    assert not isinstance(results[k], str), results[k]
    return results[k]


@pytest.mark.slow
@pytest.mark.parametrize("k", [s["id"] for s in PLAN])
def test_ranks_that_differ_end_exact(results: dict[int, list[dict[str, Any]]], k: int) -> None:
    assert check(PLAN[k], finished(results, k)) == []


@pytest.mark.slow
def test_a_rank_whose_micro_batch_fits_is_not_shrunk_by_its_peers_ooms(results: dict[int, list[dict[str, Any]]]) -> None:
    padded, short = finished(results, 1)
    assert [e for e in padded["events"] if e[0] == "oom"]  # rank 0's own OOMs, replayed by both ranks
    assert short["sizes"] == [[8]] * 8  # rank 1 ran every batch whole
    assert {e[0] for e in short["events"]} == {"peer_oom"} and all(e[1] == e[2] == 8 for e in short["events"])


@pytest.mark.slow
def test_a_collective_that_follows_the_micro_batch_meets_equal_sizes_on_every_rank(
        results: dict[int, list[dict[str, Any]]]) -> None:
    for k, want in ((9, [[5, 5, 5, 1]] + [[4, 4, 4, 4]] * 2), (10, [[6, 6, 4]] + [[3, 3, 3, 3, 2, 2]] * 2),
                    (11, [[6, 5, 5]] + [[3, 3, 3, 3, 2, 2]] * 2)):
        assert [rank["sizes"] for rank in finished(results, k)] == [want, want], k  # (exact: above)
    first, second = (rank["sizes"] for rank in finished(results, 12))
    assert first == second


@pytest.mark.slow
def test_buffers_are_broadcast_once_per_step_as_in_lightnings_accumulation(
        results: dict[int, list[dict[str, Any]]]) -> None:
    for k in (2, 3):
        for rank in finished(results, k):
            assert rank["events"] == [] and rank["sizes"] == [[4, 4]] * 3  # no OOM: split, and exact (above)
