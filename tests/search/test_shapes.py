"""The search on batches whose memory follows their shape (issue 27, item 4): it reads the target's first batches,
estimates every plan on the one of the largest samples (so an ``auto`` micro-batch holds for it), and says so."""

from __future__ import annotations

from pathlib import Path

import optuna
import torch

from autotune import Plan, estimate
from autotune._estimate.estimate import BatchSizes, longest_batch
from autotune._search.memory import SearchEstimator
from autotune._search.search import _shape_notes
from autotune._target.target import load_target

ROOT = Path(__file__).resolve().parents[2]
PADDED = f"{ROOT / 'examples' / 'padded' / 'train.py'}:make"
GPT = f"{ROOT / 'examples' / 'gpt' / 'train.py'}:make"


def lengths(target: str, count: int) -> list[int]:
    """The padded lengths of the target's first ``count`` batches, read as a user would."""
    loaded = load_target(target)
    loaded.datamodule.setup("fit")
    out = []
    for batch in loaded.datamodule.train_dataloader():
        out.append(batch["input_ids"].shape[1])
        if len(out) == count:
            return out
    return out


def test_the_batch_of_the_largest_samples_is_found_and_sizes_are_reported() -> None:
    batch, sizes = longest_batch(load_target(PADDED), batches=32)
    seen = lengths(PADDED, 32)
    assert sizes.batches == 32 and sizes.varies
    assert batch["input_ids"].shape[1] == max(seen)  # three tensors of the padded length per sample
    assert (sizes.smallest, sizes.largest) == (3.0 * min(seen), 3.0 * max(seen))
    assert sizes.describe().startswith(f"elements per sample {3 * min(seen)}-{3 * max(seen)} (median ")


def test_a_fixed_shape_target_does_not_vary() -> None:
    _, sizes = longest_batch(load_target(GPT), batches=8)
    assert sizes.batches == 8 and not sizes.varies and sizes.smallest == sizes.largest


def test_the_search_estimates_on_the_largest_batch(tmp_path) -> None:
    loaded = load_target(PADDED)
    estimator = SearchEstimator(target=loaded, device=torch.device("cpu"))
    plan = Plan(micro_batch_size=8)
    got = estimator.tensors(plan)
    longest, _ = longest_batch(load_target(PADDED))
    first = next(iter(loaded.datamodule.train_dataloader()))
    assert longest["input_ids"].shape[1] > first["input_ids"].shape[1]  # the first batch is not the longest
    assert got == estimate(model=loaded.model, batch=longest, plan=plan, device="cpu").predicted_peak_bytes
    assert got > estimate(model=loaded.model, batch=first, plan=plan, device="cpu").predicted_peak_bytes
    assert estimator.batch_sizes is not None and estimator.batch_sizes.varies


def test_the_search_says_when_batches_vary(tmp_path) -> None:
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 's.db'}")
    plan = Plan(micro_batch_size=8)
    assert _shape_notes(study, BatchSizes(32, 96.0, 96.0, 96.0), plan) == ()
    assert _shape_notes(study, None, plan) == () and "batch_sizes" not in study.user_attrs
    (note,) = _shape_notes(study, BatchSizes(32, 48.0, 60.0, 384.0), plan)
    assert note.startswith("batches vary in shape (elements per sample 48-384 (median 60) over the first 32 batches): "
                           "each plan was estimated on the batch of the largest samples, so micro-batch 8 is "
                           "predicted to fit it")
    assert study.user_attrs["batch_sizes"] == {"batches": 32, "smallest": 48.0, "median": 60.0, "largest": 384.0}


def test_the_tuned_plan_says_at_which_sample_size_its_micro_batch_fits() -> None:
    from autotune._search.search import _at_largest_samples

    sizes, plan = BatchSizes(32, 48.0, 60.0, 384.0), Plan(micro_batch_size=8)
    assert _at_largest_samples(plan, sizes, 900, 1000).micro_batch_sample_size == 384.0  # predicted to fit there
    assert _at_largest_samples(plan, sizes, 1100, 1000) == plan  # predicted over: no claim
    assert _at_largest_samples(plan, sizes, None, 1000) == plan  # unestimated: none
    assert _at_largest_samples(plan, BatchSizes(32, 96.0, 96.0, 96.0), 900, 1000) == plan  # one shape
    assert _at_largest_samples(Plan(), sizes, 900, 1000) == Plan()  # the whole batch: nothing to start from


def test_each_trial_runs_the_longest_batch_so_a_plan_that_cannot_hold_it_is_infeasible(tmp_path: Path) -> None:
    # The one long batch (8 x 64 tokens) comes at index 30, past any trial's steps: a trial that ran the data as it
    # comes would find micro-batch 8 fits (8 x 8 tokens) and choose it; the user's run would then fail at step 30.
    from optuna.trial import TrialState

    from autotune._search.search import search

    space = tmp_path / "space.yaml"
    space.write_text("dimensions:\n  micro_batch_size: {choices: [2, 8]}\n")
    result = search(target=f"{ROOT / 'tests' / 'fixtures' / 'long_tail_target.py'}:make", budget="8GiB",
                    space=str(space), trials=2, steps=2, warmup=1, seed=0, out=None, device="cpu",
                    storage=f"sqlite:///{tmp_path / 's.db'}")
    ran = [t for t in result.study.get_trials(states=(TrialState.COMPLETE,)) if t.user_attrs.get("source") == "measured"]
    assert {t.params["micro_batch_size"]: t.user_attrs["status"] for t in ran} == {8: "oom", 2: "ok"}
    assert result.plan.micro_batch_size == 2
    assert result.study.user_attrs["batch_sizes"]["largest"] == 64.0
