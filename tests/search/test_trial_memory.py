"""What a search trial adds to a training run's memory: its tensors' peak, step by step, against a plain Lightning
run of the same plan and steps (docs/search.md, "What a trial measures")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from autotune import Plan, measure_plan
from tests.fixtures.step_peaks import in_trial_process

ROOT = Path(__file__).resolve().parents[2]
#: Per device: the target, the plan (on CUDA the H200's), and how far the trial's largest step may be from the plain
#: run's. CPU: a GPT whose step is mostly its logits (a kept tensor of their size would be a quarter of its peak);
#: CUDA: the 310M GPT on which an H200 trial measured 3.6 GiB (32%) more than the same plan fitted
#: (docs/benchmarks.md, "GPU check").
CASES = {
    "cpu": (f"{ROOT / 'tests/fixtures/logits_target.py'}:make", Plan(micro_batch_size=16, activation_checkpointing=1.0),
            0.01),
    "cuda": (f"{ROOT / 'benchmarks/gpu_targets.py'}:gpt_350m",
             Plan(precision="bf16-mixed", micro_batch_size=16, activation_checkpointing=1.0), 0.03),
}


def _peaks(path: Path) -> list[int]:
    return json.loads(path.read_text()) if path.exists() else []


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_a_trial_holds_the_tensors_of_a_plain_lightning_run_of_its_plan(device: str, tmp_path: Path) -> None:
    target, plan, tolerance = CASES[device]
    config = tmp_path / "probe.yaml"  # the probe comes in as a user's callback, which a trial keeps
    config.write_text(yaml.safe_dump({"trainer": {"callbacks": [{
        "class_path": "tests.fixtures.step_peaks.StepPeaks", "init_args": {"out": str(tmp_path / "trial.json")}}]}}))
    result = measure_plan(target=target, plan=plan, config=str(config), device=device, steps=1, warmup=1)
    assert result.status == "ok", result.reason
    trial = _peaks(tmp_path / "trial.json")
    assert len(trial) == result.warmup_steps + result.steps_timed >= 3
    in_trial_process(target, plan.to_dict(), len(trial), device, str(tmp_path / "plain.json"))
    plain = _peaks(tmp_path / "plain.json")
    assert len(plain) == len(trial)
    if abs(max(trial) - max(plain)) > tolerance * max(plain):
        # which part of the trial: the plain run again with the trial's meter, counting step 0's FLOPs and not
        for meter in ("flops", "no flops"):
            in_trial_process(target, plan.to_dict(), len(trial), device, str(tmp_path / f"{meter}.json"), meter)
        mib = [("trial", trial), ("plain", plain), ("plain + meter", _peaks(tmp_path / "flops.json")),
               ("plain + meter without the FLOP count", _peaks(tmp_path / "no flops.json"))]
        pytest.fail("each step's tensors' peak (MiB): " + "; ".join(
            f"{name} {[round(p / 2**20, 1) for p in peaks]}" for name, peaks in mib))


def test_the_longest_batch_a_trial_runs_is_not_kept_after_its_step(tmp_path: Path) -> None:
    import gc
    import types
    import weakref

    from autotune._search.trial import _run_long_batch

    torch.save((torch.ones(4, 8), torch.zeros(4, 8)), tmp_path / "long.pt")
    model = types.SimpleNamespace(trainer=types.SimpleNamespace(training=True),
                                  on_before_batch_transfer=lambda batch, dataloader_idx: batch)
    _run_long_batch(model, str(tmp_path / "long.pt"), at=1)
    given = [(torch.full((2, 8), float(i)),) for i in range(3)]
    first = model.on_before_batch_transfer(given[0], 0)
    long = model.on_before_batch_transfer(given[1], 0)  # the second batch is the long one, in its place
    assert first is given[0] and torch.equal(long[0], torch.ones(4, 8))
    kept = weakref.ref(long[0])
    del long
    gc.collect()
    assert kept() is None  # the trial's later steps hold no reference to it, as a plain run's do not
    assert model.on_before_batch_transfer(given[2], 0) is given[2]
