"""FSDP2 (ModelParallelStrategy, data parallel) with 2 CPU ranks (gloo): ElasticBatchSize's micro-batches against
Lightning's own accumulation under the same sharding, and OOMs on one rank drained, voted and replayed (each run under
a hard timeout: a hang fails). The ranks start as torchrun starts them (tests/support/ranks.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException

from autotune.callbacks import ElasticBatchSize
from tests.support.toy import ToyModel, trainer
from tests.support.ranks import run_ranks

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "fsdp_run.py"


def run(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    tmp.mkdir(parents=True, exist_ok=True)
    return run_ranks([str(SCRIPT), "--out", str(tmp), *args], timeout=180)  # a hang fails here


def results(tmp: Path, proc: subprocess.CompletedProcess[str]) -> list[dict]:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [torch.load(tmp / f"rank{r}.pt") for r in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("composed", [False, True], ids=["fp32", "bf16-mixed+checkpointing"])
def test_micro_batches_under_fsdp2_match_native_accumulation(tmp_path: Path, composed: bool) -> None:
    # Composed: bf16-mixed (Lightning's autocast) and ApplyPlan's activation checkpointing, applied at setup, before
    # the model's configure_model shards it.
    extra = ("--composed",) if composed else ()
    native = results(tmp_path / "native", run(tmp_path / "native", "--mode", "native", *extra))
    elastic = results(tmp_path / "elastic", run(tmp_path / "elastic", "--mode", "elastic", *extra))
    for r in range(2):
        assert elastic[r]["global_step"] == native[r]["global_step"] == 3
        assert elastic[r]["seen"] == native[r]["seen"] == [16] * 12
        assert elastic[r]["ids"] == native[r]["ids"]  # the same samples on each rank, in the same order
        assert elastic[r]["lrs"] == native[r]["lrs"][3::4]  # one scheduler step per effective batch
        for name, value in elastic[r]["state"].items():
            assert (value - native[r]["state"][name]).abs().max().item() <= 1e-6, name
            assert torch.equal(value, elastic[0]["state"][name])  # ranks agree


@pytest.fixture(scope="module")
def native8(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """Lightning's own accumulation of micro-batches of 8 under the same sharding, per toy configuration."""
    cache: dict[str, list[dict]] = {}

    def get(*toy: str) -> list[dict]:
        key = " ".join(toy)
        if key not in cache:
            tmp = tmp_path_factory.mktemp("native8")
            cache[key] = results(tmp, run(tmp, "--mode", "native", "--micro", "8", *toy))
        return cache[key]

    return get  # type: ignore[return-value]


def last_attempts(calls: list[tuple[int, list[int]]]) -> list[int]:
    """The sample ids of the attempt that counted at each step (64 samples per rank and step)."""
    steps = sorted({step for step, _ in calls})
    return [i for s in steps for i in [i for step, ids in calls if step == s for i in ids][-64:]]


def check_replayed(elastic: list[dict], native: list[dict], events: list[tuple[str, int, int]], *, rank: int,
                   peer: list[tuple[str, int, int]] | None = None) -> None:
    """``rank`` failed with ``events``; its peer replayed at its own micro-batch (``peer``: one "peer_oom" each)."""
    peer_events = peer if peer is not None else [("peer_oom", e[1], e[1]) for e in events]
    for r in range(2):
        assert elastic[r]["events"] == (events if r == rank else peer_events), f"rank {r}"
        assert elastic[r]["global_step"] == native[r]["global_step"] == 3
        assert last_attempts(elastic[r]["calls"]) == native[r]["ids"]  # the same samples per rank and step
        assert elastic[r]["lrs"] == native[r]["lrs"][7::8]  # one scheduler step per effective batch
        for name, value in elastic[r]["state"].items():
            assert (value - native[r]["state"][name]).abs().max().item() <= 1e-6, name
            assert torch.equal(value, elastic[0]["state"][name])  # ranks agree


# An OOM on one rank only, in forward (before the first all-gather of the micro-batch), backward (in a tensor hook,
# after FSDP's pre-backward all-gather) or the update, at step 0 (no schedule recorded yet: the failing rank follows
# its peer's published collectives) or step 1 (the recorded schedule is drained); the step is replayed at 8.
@pytest.mark.slow
@pytest.mark.parametrize(("where", "rank", "step"), [  # the fault matrix: where x rank x first/steady step (a steady
    # update's OOM ends the run: test_a_half_applied_steady_state_update_under_fsdp2_ends_every_rank_without_a_hang)
    ("forward", 0, 0), ("forward", 1, 0), ("forward", 0, 1), ("forward", 1, 1),
    ("backward", 0, 0), ("backward", 1, 0), ("backward", 0, 1), ("backward", 1, 1), ("step", 0, 0), ("step", 1, 0),
])
def test_an_oom_on_one_rank_under_fsdp2_is_replayed_and_matches_native_accumulation(
        native8: Any, tmp_path: Path, where: str, rank: int, step: int) -> None:
    elastic = results(tmp_path, run(tmp_path, "--mode", "elastic", "--where", where, "--rank", str(rank),
                                    "--at-step", str(step)))
    check_replayed(elastic, native8(), [("oom", 16, 8)], rank=rank)  # the peer's 16 runs as 8 x 8: FSDP2's count
    drained, followed = elastic[rank]["drained"]
    if where != "step":  # the failed rank issued what its peer waited for
        assert drained > 0 and (followed > 0) == (step == 0)
    assert elastic[1 - rank]["drained"] == (0, 0)


@pytest.mark.slow
@pytest.mark.parametrize("step", [0, 1])
def test_an_oom_inside_a_units_backward_after_some_of_its_gradients_is_replayed_exactly(
        native8: Any, tmp_path: Path, step: int) -> None:
    # The network is one FSDP unit: its backward accumulates the last layer's gradient unsharded, then runs out of
    # memory at the first layer. The replay must drop that gradient (clear_fsdp_unsharded_grads): without it the
    # replayed step adds it to its own, 0.044 from Lightning's accumulation (issue 29, finding 3).
    elastic = results(tmp_path, run(tmp_path, "--mode", "elastic", "--where", "mid_backward", "--rank", "0",
                                    "--at-step", str(step), "--one-unit"))
    check_replayed(elastic, native8("--one-unit"), [("oom", 16, 8)], rank=0)


@pytest.mark.slow
@pytest.mark.parametrize("toy", [("--toy-reshard", "false"), ("--bf16-policy",)], ids=["zero2", "bf16-policy"])
def test_the_fsdp2_replay_holds_without_reshard_after_forward_and_with_a_bf16_policy(
        native8: Any, tmp_path: Path, toy: tuple[str, ...]) -> None:
    elastic = results(tmp_path, run(tmp_path, "--mode", "elastic", "--where", "backward", "--rank", "1", *toy))
    check_replayed(elastic, native8(*toy), [("oom", 16, 8)], rank=1)


@pytest.mark.slow
def test_the_micro_batch_grows_back_under_fsdp2_and_a_failed_grow_is_replayed(native8: Any, tmp_path: Path) -> None:
    # OOM at 16 in step 0; after one clean step it grows back to 16 at step 2, which runs out of memory again on rank
    # 1 mid-forward with the schedule recorded: drained, replayed at 8. Rank 0 kept 16 and ran 8 by the agreed count.
    elastic = results(tmp_path, run(tmp_path, "--mode", "elastic", "--where", "forward", "--rank", "1",
                                    "--grow-after", "1"))
    check_replayed(elastic, native8(), [("oom", 16, 8), ("grow_failed", 16, 8)], rank=1,
                   peer=[("peer_oom", 16, 16), ("peer_oom", 16, 16)])


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
def test_a_half_applied_steady_state_update_under_fsdp2_ends_every_rank_without_a_hang(tmp_path: Path,
                                                                                        rank: int) -> None:
    proc = run(tmp_path, "--mode", "elastic", "--where", "step", "--rank", str(rank), "--at-step", "1")
    assert proc.returncode != 0
    assert ("Out of memory inside the optimizer update of this rank in a steady-state step (its optimizer state "
            "existed already, so no host copy protects it): under DDP and FSDP2 it is not replayed") in proc.stderr
    assert not list(tmp_path.glob("rank*.pt"))


def test_tensor_parallelism_is_refused() -> None:
    from lightning.pytorch.strategies import ModelParallelStrategy

    t = trainer()
    strategy = ModelParallelStrategy.__new__(ModelParallelStrategy)
    strategy._device_mesh = {"tensor_parallel": SimpleNamespace(size=lambda: 2)}  # the mesh setup_environment makes
    t._accelerator_connector.strategy = strategy
    with pytest.raises(MisconfigurationException, match=r"supports ModelParallelStrategy with data parallelism only "
                       r"\(FSDP2\), but tensor_parallel_size is 2"):
        ElasticBatchSize().setup(t, ToyModel(), "fit")


@pytest.mark.slow
def test_an_evaluation_oom_under_fsdp2_stops_every_rank_with_one_clear_error(tmp_path: Path) -> None:
    # Evaluation batches are not split under FSDP2: a rank splitting alone would meet its peers' all-gathers out of
    # order. The run ends with one line instead, and the launcher stops the other rank (the timeout catches a hang).
    proc = run(tmp_path, "--mode", "elastic", "--where", "validation", "--rank", "0")
    assert proc.returncode != 0
    assert ("Out of memory in validate under FSDP2 (ModelParallelStrategy): evaluation batches are not split under "
            "FSDP2") in proc.stderr
    assert not list(tmp_path.glob("rank*.pt"))


@pytest.mark.slow
def test_a_soft_budget_under_fsdp2_adds_no_collective_and_each_rank_checks_its_own_peak(tmp_path: Path) -> None:
    # FSDP2 agrees twice per step (the micro-batch count at the start, the vote at the end); each rank checks its own
    # step's peak against a soft budget after the step, with no collective, and the count follows the largest.
    roomy = results(tmp_path / "roomy", run(tmp_path / "roomy", "--mode", "elastic", "--at-step", "99", "--micro",
                                            "16", "--budget", "4GiB"))
    assert [r["votes_per_clean_step"] for r in roomy] == [2, 2] and [r["events"] for r in roomy] == [[], []]
    tight = results(tmp_path / "tight", run(tmp_path / "tight", "--mode", "elastic", "--at-step", "99", "--micro",
                                            "32", "--budget", "1MiB"))
    for r in tight:  # every step is over 1 MiB: each halves the next one
        assert r["events"] == [("over_budget", 32, 16), ("over_budget", 16, 8), ("over_budget", 8, 4)]
        assert r["seen"] == [32] * 2 + [16] * 4 + [8] * 8 and r["votes_per_clean_step"] == 2 and r["global_step"] == 3
