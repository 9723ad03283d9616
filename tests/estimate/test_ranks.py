"""Per-rank estimates (``world_size``): the model state of a sharded plan is the closed form to the byte."""

from __future__ import annotations

import pytest

from autotune import Plan, estimate
from autotune._cli.main import main
from tests.estimate.test_estimate import TinyMLP, tiny_batch

#: TinyMLP: two blocks of Linear(16, 64) + Linear(64, 16), then Linear(16, 4); every dim 0 divides by 4.
BLOCK = 64 * 16 + 64 + 16 * 64 + 16
HEAD = 4 * 16 + 4
PARAMS = 2 * BLOCK + HEAD
TENSORS = 10  # parameter tensors: AdamW keeps one 0-dim `step` (4 bytes) for each, whole on every rank
UNIT_GRADS = 2 * BLOCK * 4  # a backward: the largest unit's unsharded fp32 gradient and its reduce-scatter input


def rank(plan: Plan, world_size: int):
    return estimate(model=TinyMLP(), batch=tiny_batch(), plan=plan, world_size=world_size, device="cpu")


@pytest.mark.parametrize("world_size", [2, 4])
def test_sharded_model_state_per_rank_is_the_closed_form(world_size: int) -> None:
    assert PARAMS == sum(p.numel() for p in TinyMLP().parameters())
    e = rank(Plan(strategy="fsdp"), world_size)
    # fp32 weights and AdamW's two fp32 moments, split over the ranks
    assert e.parameters_bytes - (e.gathered_bytes - UNIT_GRADS) == 4 * PARAMS // world_size
    assert e.optimizer_state_bytes == 8 * PARAMS // world_size + 4 * TENSORS
    # the activations outweigh the weights: the peak is early in the backward, which holds one unit's unsharded
    # gradient and reduce-scatter input, and of the gradient shards only those made so far (the head's)
    assert UNIT_GRADS <= e.gradients_bytes < UNIT_GRADS + 4 * PARAMS // world_size // 2
    assert e.world_size == world_size


def test_gathered_units_follow_the_reshard_setting_and_the_compute_dtype() -> None:
    # ZeRO-3: the root's parameters (the head) and two blocks (running, prefetched) gathered, plus one unit's
    # unsharded fp32 gradient and its reduce-scatter input; bf16-mixed gathers in bf16 (FSDP2's policy).
    unit_grads = UNIT_GRADS
    assert rank(Plan(strategy="fsdp"), 4).gathered_bytes == 4 * (HEAD + 2 * BLOCK) + unit_grads
    assert rank(Plan(strategy="fsdp", precision="bf16-mixed"), 4).gathered_bytes == 2 * (HEAD + 2 * BLOCK) + unit_grads
    assert rank(Plan(strategy="fsdp", reshard_after_forward=False), 4).gathered_bytes == \
        4 * (HEAD + 2 * BLOCK) + unit_grads  # every block gathered: two here


def test_replicated_state_does_not_shrink_with_ranks_and_adds_ddp_buckets() -> None:
    one, ddp = rank(Plan(), 1), rank(Plan(strategy="ddp"), 4)
    assert (ddp.parameters_bytes, ddp.optimizer_state_bytes) == (one.parameters_bytes, one.optimizer_state_bytes)
    assert ddp.overhead_bytes == 2 * 4 * PARAMS  # DDP's bucket copy and the runtime's averaging buffer


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"plan": Plan(), "world_size": 0}, r"world_size must be an int >= 1; got 0"),
    ({"plan": Plan(strategy="fsdp"), "world_size": 1}, r"strategy 'fsdp' over world_size 1 shards nothing"),
    ({"plan": Plan(strategy="fsdp", devices=2), "world_size": 8}, r"world_size 8 differs from the plan's devices 2"),
])
def test_bad_world_sizes_are_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        estimate(model=TinyMLP(), batch=tiny_batch(), device="cpu", **kwargs)


def test_cli_refuses_a_bad_world_size_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "tests/fixtures/search_target.py:make", "--budget", "1GiB", "--world-size", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "autotune: error: --world-size must be an int >= 1; got '0'"


def test_cli_rows_per_rank_are_replicated_and_sharded(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["estimate", "tests/fixtures/search_target.py:make", "--budget", "1GiB", "--device", "cpu",
                 "--precision", "32-true", "--world-size", "2", "--micro-batch-size", "4"])
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "device cpu, batch 64, budget 1.00 GiB, per rank of 2"
    assert sorted(line.split("  ")[0].strip() for line in lines[2:6]) == [  # ranked by predicted speed
        "ddp, 32-true", "ddp, 32-true, ckpt 1.0", "fsdp x2, 32-true", "fsdp x2, 32-true, ckpt 1.0"]
