"""The per-rank estimate of a sharded plan (``Plan(strategy="fsdp", devices=2)``, FSDP2 by ApplyPlan) against the
peak each of 2 CPU ranks (gloo) measures in its own steady-state training step (tests/support/fsdp_peak_run.py: alive
tensors at the step's start plus the profiler's allocator events during it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from autotune import estimate
from tests.support.fsdp_peak_run import CASES, make_model, plan_of, rank_batch
from tests.support.ranks import run_ranks

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "fsdp_peak_run.py"
TOLERANCE = 0.10


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Each rank's measurements, one entry per case (both cases run in the same 2 processes)."""
    out = tmp_path_factory.mktemp("fsdp_peak")
    proc = run_ranks([str(SCRIPT), "--out", str(out)], timeout=120)  # a hang fails here
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_the_per_rank_estimate_matches_the_measured_peak_of_each_rank(measured: list[dict[str, Any]],
                                                                       case: str) -> None:
    predicted = estimate(model=make_model(), batch=rank_batch(), plan=plan_of(case), world_size=2, device="cpu")
    assert predicted.world_size == 2
    for rank, result in enumerate(measured):
        assert result[case]["global_step"] == 3
        peak = result[case]["peak_bytes"]
        # Frees the profiler misses (gloo's worker thread dropping a collective's buffer) are closed by the script;
        # one it could not place shows as unexplained bytes at the step's end (2.4 MB once in CI, after a forward
        # peak). A missed free only raises the measured running sum from where it happened on (a peak before it is
        # exact): it is reported in the message, not asserted.
        error = (predicted.predicted_peak_bytes - peak) / peak
        mib = {name: value / 2**20 for name, value in result[case].items() if name.endswith("_bytes")}
        parts = ", ".join(f"{name} {value / 2**20:.2f}" for name, value in predicted.breakdown().items())
        assert abs(error) <= TOLERANCE, (
            f"{case}, rank {rank}: predicted {predicted.predicted_peak_bytes / 2**20:.2f} MiB ({parts}; gathered "
            f"{predicted.gathered_bytes / 2**20:.2f}), measured {mib['peak_bytes']:.2f} MiB (forward "
            f"{mib['forward_peak_bytes']:.2f}, backward {mib['backward_peak_bytes']:.2f}, alive at the step's start "
            f"{mib['alive_at_start_bytes']:.2f}, unexplained at the end {mib['unexplained_end_bytes']:.2f}): "
            f"relative error {error:+.1%} (bound {TOLERANCE:.0%})")
