"""DDP with 2 CPU ranks (gloo): an OOM on one rank shrinks both, and replicas match native DDP accumulation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.ranks import run_ranks

SCRIPT = Path(__file__).with_name("ddp_run.py")


def run(tmp: Path, *args: str) -> list[dict]:
    tmp.mkdir(parents=True, exist_ok=True)
    proc = run_ranks([str(SCRIPT), "--out", str(tmp), *args], timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [torch.load(tmp / f"rank{r}.pt") for r in range(2)]


@pytest.fixture(scope="module")
def native(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run(tmp_path_factory.mktemp("native"), "--mode", "native")


@pytest.mark.slow
@pytest.mark.parametrize(("where", "rank"), [("forward", 0), ("backward", 1), ("step", 0)])
def test_oom_on_one_rank_shrinks_all_and_matches_native(native: list[dict], tmp_path: Path, where: str,
                                                         rank: int) -> None:
    ranks = run(tmp_path, "--mode", "elastic", "--where", where, "--rank", str(rank))
    for r, result in enumerate(ranks):
        assert result["events"] == [("oom", 64, 32), ("oom", 32, 16)], f"rank {r}"
        # No collective inside the micro-batches: the failing rank stops at its first OOM, its peer runs its
        # micro-batches to the step's one vote (a fault in the update comes after all micro-batches).
        tried = [64, 32] if where != "step" and r == rank else [64, 32, 32]
        assert result["seen"] == tried + [16] * 12, f"rank {r}"
        assert result["votes_per_clean_step"] == 1, f"rank {r}"
        assert result["global_step"] == native[r]["global_step"] == 3
        assert result["ids"][-48:] == native[r]["ids"][-48:]  # the same samples per rank
        for name, value in result["state"].items():
            assert torch.equal(value, ranks[0]["state"][name]), f"replicas drifted: {name} on rank {r}"
            assert torch.equal(value, native[r]["state"][name]), f"{name} differs from native DDP accumulation"


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
def test_a_half_applied_steady_state_update_on_one_rank_ends_every_rank_without_a_hang(tmp_path: Path,
                                                                                        rank: int) -> None:
    # Step 1's update is no longer protected (AdamW's state exists) and runs out of memory half-way on one rank;
    # there is no vote after a steady-state update, so that rank ends the run and the launcher ends the other.
    proc = run_ranks([str(SCRIPT), "--out", str(tmp_path), "--mode", "elastic", "--where", "step", "--rank", str(rank),
                      "--at-step", "1", "--micro", "32"], timeout=120)  # a hang fails here
    assert proc.returncode != 0
    assert ("Out of memory inside the optimizer update of this rank in a steady-state step (its optimizer state "
            "existed already, so no host copy protects it): under DDP and FSDP2 it is not replayed") in proc.stderr
    assert not list(tmp_path.glob("rank*.pt"))  # no rank finished training


def test_gradients_travel_in_buckets_cut_by_size_and_dtype() -> None:
    from autotune._runtime.agreement import make_buckets

    f32 = [torch.zeros(n) for n in (10, 20, 5, 40)]  # 40, 80, 20, 160 bytes
    half = torch.zeros(3, dtype=torch.bfloat16)
    buckets = make_buckets([f32[0], f32[1], f32[2], half, f32[3]], cap_bytes=128)
    assert [[t.numel() for t in b] for b in buckets] == [[10, 20], [5], [3], [40]]
    assert buckets[0][0] is f32[0] and buckets[2][0] is half


@pytest.mark.slow
def test_a_steady_state_update_oom_before_any_change_on_one_rank_is_not_called_half_applied(tmp_path: Path) -> None:
    # Issue 29, finding 1: OOM at the start of rank 1's update in step 1 (nothing changed there, but rank 0 has applied
    # its update): the step cannot be replayed under DDP, and the error says why instead of "half-applied".
    proc = run_ranks([str(SCRIPT), "--out", str(tmp_path), "--mode", "elastic", "--where", "step_start", "--rank", "1",
                      "--at-step", "1", "--micro", "32"], timeout=120)
    assert proc.returncode != 0
    assert "whether or not it changed anything here, because the other ranks have applied theirs" in proc.stderr
    assert "half-applied" not in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize(("where", "rank", "step"), [  # the rest of the fault matrix (where x rank x first/steady
    # step; a steady update's OOM ends the run: test_a_half_applied_steady_state_update_on_one_rank_ends_every_rank_...)
    ("forward", 1, 0), ("backward", 0, 0), ("step", 1, 0),
    ("forward", 0, 1), ("forward", 1, 1), ("backward", 0, 1), ("backward", 1, 1),
])
def test_the_ddp_fault_matrix_replays_every_rank_alike(native: list[dict], tmp_path: Path, where: str, rank: int,
                                                       step: int) -> None:
    ranks = run(tmp_path, "--mode", "elastic", "--where", where, "--rank", str(rank), "--at-step", str(step))
    for r, result in enumerate(ranks):
        assert result["events"] == [("oom", 64, 32), ("oom", 32, 16)] and result["event_steps"] == [step, step]
        assert result["global_step"] == native[r]["global_step"] == 3
        assert result["ids"][-16 * 4 * (3 - step):] == native[r]["ids"][-16 * 4 * (3 - step):]  # same samples
        for name, value in result["state"].items():
            assert torch.equal(value, ranks[0]["state"][name]), f"replicas drifted: {name} on rank {r}"
            if step == 0:  # every step at micro-batch 16, as native accumulation: to the bit
                assert torch.equal(value, native[r]["state"][name]), f"{name} differs from native accumulation"
            else:  # step 0 ran whole (one micro-batch of 64): fp32 summation order apart
                torch.testing.assert_close(value, native[r]["state"][name], rtol=0, atol=1e-6)


@pytest.mark.slow
def test_a_soft_budget_under_ddp_adds_no_collective_and_ranks_shrink_alike(tmp_path: Path) -> None:
    # The CPU budget is soft: each step's peak is checked against it on the worst rank's figure, which rides on the
    # next step's one vote (docs/elastic.md), so a clean step still makes one agreement collective.
    roomy = run(tmp_path / "roomy", "--mode", "elastic", "--at-step", "99", "--micro", "16", "--budget", "64GiB")
    assert [r["votes_per_clean_step"] for r in roomy] == [1, 1] and [r["events"] for r in roomy] == [[], []]
    # Over the budget at once: step 0's peak, agreed in step 1's vote, halves the micro-batch of step 2 on both
    # ranks (step 1's peak, at the old micro-batch, says nothing of the new one: no second halving).
    tight = run(tmp_path / "tight", "--mode", "elastic", "--at-step", "99", "--micro", "32", "--budget", "1MiB")
    for r in tight:
        assert r["events"] == [("over_budget", 32, 16)] and r["event_steps"] == [0]
        assert r["seen"] == [32] * 4 + [16] * 4 and r["votes_per_clean_step"] == 1 and r["global_step"] == 3
