"""The micro-batch policy alone (no Lightning, no collective): what it runs next after its own OOM, another rank's,
a clean step and a step over a soft budget."""

from __future__ import annotations

import pytest
import torch

from autotune._runtime.policy import Memory, MicroBatchPolicy, StepPeaks


def policy(**kwargs: object) -> MicroBatchPolicy:
    options: dict = {"micro_batch_size": 32, "min_micro_batch_size": 1, "grow": True, "grow_after": 2}
    options.update(kwargs)
    p = MicroBatchPolicy(**options)
    p.start_batch({"x": torch.zeros(64, 8)}, 64)
    return p


def test_its_own_oom_halves_and_another_ranks_changes_nothing() -> None:
    p = policy()
    assert p.micro_for(64) == 32
    assert p.after_oom(ran=32, n=64, own=False, step=0, where="closure") == 32  # a peer's: replay as it was
    assert p.oom_events == 0 and p.clean_steps == 0 and [e.kind for e in p.events] == ["peer_oom"]
    assert p.after_oom(ran=32, n=64, own=True, step=0, where="closure") == 16
    assert p.micro_batch_size == 16 and p.oom_events == 1


def test_another_ranks_oom_does_not_undo_a_grow_that_has_not_failed_here() -> None:
    p = policy(micro_batch_size=16)
    for step in range(2):
        p.after_success(n=64, ran=p.micro_for(64), clean=True, step=step, peaks=None)
    assert p.micro_batch_size == 32 and p.growing_from == 16  # growing is due: 32 is tried
    assert p.after_oom(ran=32, n=64, own=False, step=2, where="closure") == 32  # a peer failed: 32 again
    assert p.after_oom(ran=32, n=64, own=True, step=2, where="closure") == 16  # its own: back, and wait longer
    assert p.grow_wait == 4 and [e.kind for e in p.events] == ["peer_oom", "grow_failed"]


def test_only_this_ranks_oom_at_its_minimum_is_the_end() -> None:
    p = policy(micro_batch_size=2, min_micro_batch_size=2)
    assert p.at_floor(2)
    assert p.after_oom(ran=2, n=64, own=False, step=0, where="closure") == 2
    assert p.after_oom(ran=2, n=64, own=True, step=0, where="closure") is None


def test_a_grow_held_back_by_the_ranks_count_is_not_recorded_as_one() -> None:
    p = policy(micro_batch_size=16)
    for step in range(2):
        p.after_success(n=64, ran=16, clean=True, step=step, peaks=None)
    assert p.growing_from == 16
    p.after_success(n=64, ran=16, clean=True, step=2, peaks=None)  # the agreed count ran 16 after all
    assert [e.kind for e in p.events] == [] and p.growing_from is None


@pytest.mark.parametrize("over", [True, False])
def test_a_soft_budget_checks_this_ranks_own_peak_after_its_step(over: bool) -> None:
    p = policy(grow=False, memory=Memory(budget_bytes=100, limit_bytes=100, budget_text="100B"))
    p.after_success(n=64, ran=32, clean=True, step=0, peaks=StepPeaks(peak=101 if over else 100))
    assert p.micro_batch_size == (16 if over else 32)
    assert [e.kind for e in p.events] == (["over_budget"] if over else [])


def test_a_rank_held_to_the_ranks_count_keeps_its_own_micro_batch_and_does_not_grow_from_the_smaller_one() -> None:
    p = policy(micro_batch_size=64)  # its batches fit whole; the others' need 4 micro-batches (FSDP2: equal counts)
    for step in range(4):
        p.after_success(n=64, ran=16, clean=True, step=step, peaks=None)
    assert p.micro_batch_size == 64 and p.events == []  # growing from 16 would have set it to 32


def test_a_grow_that_goes_over_a_soft_budget_doubles_the_wait_as_a_failed_grow_does() -> None:
    p = policy(micro_batch_size=16, memory=Memory(budget_bytes=1000, limit_bytes=1000, budget_text="1000B"))
    fits, over = StepPeaks(peak=500, static=100, grows=500, load=500), StepPeaks(peak=1001)
    for step in range(2):
        p.after_success(n=64, ran=p.micro_for(64), clean=True, step=step, peaks=fits)
    assert p.micro_batch_size == 32 and p.growing_from == 16  # projected 900 B: growing is due
    p.after_success(n=64, ran=p.micro_for(64), clean=True, step=2, peaks=over)  # the grown step went over
    assert p.micro_batch_size == 16 and p.grow_wait == 4
    assert [e.kind for e in p.events] == ["grow", "over_budget"]
    for step in range(3, 6):  # three clean steps: not yet
        p.after_success(n=64, ran=p.micro_for(64), clean=True, step=step, peaks=fits)
        assert p.micro_batch_size == 16
    p.after_success(n=64, ran=p.micro_for(64), clean=True, step=6, peaks=fits)  # the fourth: grows again
    assert p.micro_batch_size == 32
