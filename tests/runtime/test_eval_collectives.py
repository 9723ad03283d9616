"""An out-of-memory error in evaluation under DDP when ``validation_step`` makes a collective (``self.all_gather``
of its rows): the failing rank used to run its step again in parts, making more collectives than its peer, which
waited in the loop's end until gloo's timeout. Now every rank runs each attempt and votes, the guard stops a peer
before a collective the failed rank will not join, and the ranks run equal parts once the step is seen to gather;
2 CPU ranks (gloo)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.support.ranks import run_ranks

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "eval_collective_run.py"


def run(tmp: Path, fault: dict[str, Any]) -> list[dict[str, Any]]:
    proc = run_ranks([str(SCRIPT), str(tmp), json.dumps(fault)], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run(tmp_path_factory.mktemp("clean"), {"rank": -1, "batch": None, "cap": 0})


@pytest.mark.slow
@pytest.mark.parametrize(("fault", "parts"), [
    # mid-loop, once the gather is known: the peer stops at its guard; the failed rank's split stays for the stage
    ({"rank": 1, "batch": 1, "cap": 4}, {1: 2, 2: 2}),
    ({"rank": 0, "batch": 0, "cap": 4}, {0: 2, 1: 2, 2: 2}),  # the first batch, before it is known; the split stays
    ({"rank": 1, "batch": 1, "cap": 4, "after": True}, {1: 2, 2: 2}),  # after the gather: both ranks gather again
    ({"rank": 1, "batch": None, "cap": 2}, {0: 4, 1: 4, 2: 4}),  # every batch: halved twice, then kept
])
def test_an_eval_oom_on_one_rank_with_a_gather_in_validation_step_replays_every_rank_in_equal_parts(
        clean: list[dict[str, Any]], tmp_path: Path, fault: dict[str, Any], parts: dict[int, int]) -> None:
    ranks = run(tmp_path, fault)
    assert [r["error"] for r in ranks] == [None, None]
    for rank, result in enumerate(ranks):
        by_batch: dict[int, list[list[int]]] = {}
        for batch, ids in result["gathered"]:
            by_batch.setdefault(batch, []).append(ids)
        assert sorted(by_batch) == [0, 1, 2]
        for batch, gathers in by_batch.items():
            want = list(range(16 * batch, 16 * batch + 16))  # both ranks' rows (the sampler deals them in turn)
            attempts = 2 if fault.get("after") and batch == fault["batch"] else 1
            ran = gathers[1:] if attempts == 2 else gathers
            if attempts == 2:
                assert gathers[0] == want  # the failed attempt gathered the whole batch, then failed after it
            # the last attempt: each rank's rows once, in as many equal parts on both ranks (8 samples a rank)
            assert Counter(i for ids in ran for i in ids) == Counter(want), (rank, batch, gathers)
            assert len(ran) == parts.get(batch, 1) and {len(ids) for ids in ran} == {16 // len(ran)}, (batch, ran)
        own = [(kind, previous, micro) for kind, previous, micro, _ in result["events"]]
        halvings = [(8, 4)] if fault["cap"] == 4 else [(8, 4), (4, 2)]
        assert own == ([("eval_oom", p, m) for p, m in halvings] if rank == fault["rank"] else [])
        # what validation logged (sync_dist) is what it logged without the error
        assert result["val_loss"] == pytest.approx(clean[rank]["val_loss"], rel=1e-6, abs=1e-9)


@pytest.mark.slow
def test_an_eval_oom_at_one_sample_on_one_rank_ends_every_rank_naming_it(tmp_path: Path) -> None:
    ranks = run(tmp_path, {"rank": 0, "batch": 2, "cap": 0})
    errors = [r["error"] for r in ranks]
    assert all(e and e.startswith("OutOfMemoryAtMinimumError: Out of memory in validate on rank 0 at the smallest "
                                  "evaluation split: batch size 8, micro-batch 1,") for e in errors), errors


@pytest.mark.slow
def test_ranks_whose_loops_differ_in_length_do_not_vote_and_split_on_their_own(tmp_path: Path) -> None:
    """Each rank its own validation loader (rank 1's a batch longer, no collective in the step): a vote per step would
    leave rank 1 waiting for a peer whose loop had ended; the loop runs as without voting, split on the failing rank."""
    ranks = run(tmp_path, {"rank": 1, "batch": 3, "cap": 4, "uneven": True})
    assert [r["error"] for r in ranks] == [None, None]
    assert [[(kind, previous, micro) for kind, previous, micro, _ in r["events"]] for r in ranks] == \
        [[], [("eval_oom", 8, 4)]]
