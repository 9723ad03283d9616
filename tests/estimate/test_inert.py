"""Plan settings that apply to nothing for a model (checkpointing or compile of layers whose own forward never runs,
checkpointing that finds no blocks, activation offload on the CPU) are named in the estimate's notes, and the search
drops those choices for its target, in one line (issue 44)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule
from torch import nn

from autotune import Plan, estimate
from autotune._plan.space import load_space
from autotune._search.inert import without_inert
from autotune._search.memory import SearchEstimator
from autotune._target.target import load_target
from tests.fixtures.by_hand_target import ByHand

TARGET = str(Path(__file__).resolve().parents[1] / "fixtures" / "by_hand_target.py")
BATCH = [torch.randn(16, 16, generator=torch.Generator().manual_seed(1))]


def _inert_notes(got) -> list[str]:
    return [note for note in got.notes if "applies to nothing" in note]


def test_checkpointing_layers_whose_own_forward_never_runs_is_named() -> None:
    got = estimate(model=ByHand(), batch=BATCH, plan=Plan(activation_checkpointing=1.0), device="cpu")
    assert _inert_notes(got) == ["activation_checkpointing=1.0 applies to nothing: the 4 Parts block(s) it wraps never "
                                 "run their own forward in the step (their parts are called by hand), so nothing is "
                                 "recomputed"]
    assert got.predicted_peak_bytes == estimate(model=ByHand(), batch=BATCH, plan=Plan(), device="cpu"
                                                ).predicted_peak_bytes
    called = estimate(model=ByHand(by_hand=False), batch=BATCH, plan=Plan(activation_checkpointing=1.0), device="cpu")
    assert _inert_notes(called) == []  # the same layers, called: checkpointed
    assert called.activations_bytes < estimate(model=ByHand(by_hand=False), batch=BATCH, plan=Plan(),
                                               device="cpu").activations_bytes


class Dicts(LightningModule):
    """Repeated layers that are ``ModuleDict``s (containers, never blocks), iterated by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict({"mix": nn.Linear(8, 8), "out": nn.Linear(8, 8)}) for _ in range(3))

    def training_step(self, batch, batch_idx):
        x = batch[0]
        for layer in self.layers:
            x = x + layer["out"](torch.relu(layer["mix"](x)))
        return x.pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_checkpointing_that_finds_no_blocks_and_compiling_a_model_whose_call_never_runs_are_named() -> None:
    batch = [torch.randn(4, 8)]
    got = estimate(model=Dicts(), batch=batch, plan=Plan(activation_checkpointing=0.5, compile=True), device="cpu")
    assert _inert_notes(got) == [
        "activation_checkpointing=0.5 applies to nothing: it finds no repeated blocks in Dicts (name the classes to "
        "checkpoint: activation_checkpointing: [ClassName, ...])",
        "compile=True applies to nothing: Dicts has no repeated blocks, so compile takes the whole model, whose own "
        "call never runs in the step (training_step calls its parts)"]


def test_compiling_layers_that_never_run_and_offloading_on_the_cpu_are_named() -> None:
    got = estimate(model=ByHand(), batch=BATCH, plan=Plan(compile=True, activation_offload=True), device="cpu")
    assert _inert_notes(got) == [
        "compile=True applies to nothing: the 4 Parts block(s) it compiles never run through their own call in the step",
        "activation_offload=True applies to nothing: on the CPU the saved tensors are on the host already"]
    what_if = estimate(model=ByHand(by_hand=False), batch=BATCH, plan=Plan(compile=True, activation_offload=True),
                       device="cuda")
    assert _inert_notes(what_if) == []  # called layers; saved tensors leave a CUDA device


@pytest.fixture(scope="module")
def by_hand() -> SearchEstimator:
    return SearchEstimator(target=load_target(f"{TARGET}:make"), device=torch.device("cpu"))


def test_the_search_s_space_loses_the_choices_that_do_nothing_for_its_target(by_hand: SearchEstimator) -> None:
    space = load_space("cpu").for_device(torch.device("cpu"), batch_size=16)
    cut = without_inert(space, by_hand.inert)
    assert [d.choices for d in cut.dimensions if d.name == "activation_checkpointing"] == [(0.0,)]
    assert cut.seeds == tuple(s for s in space.seeds if not s["activation_checkpointing"])
    assert cut.notes[len(space.notes):] == (
        "activation_checkpointing=0.5, 1.0, 'auto' dropped for this target: it applies to nothing (the 4 Parts block(s) it "
        "wraps never run their own forward in the step (their parts are called by hand), so nothing is recomputed); "
        "1 seed(s) with it left out",)
    called = SearchEstimator(target=load_target(f"{TARGET}:make_called"), device=torch.device("cpu"))
    assert without_inert(space, called.inert) == space


def test_a_search_of_such_a_target_tries_no_checkpointing_and_says_so_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import autotune._search.objective as objective_module
    import autotune._search.search as search_module
    import autotune._search.trial as trial_module
    from autotune._search.records import TrialResult

    def played(spec, timeout, while_running=None):  # every trial measured alike: the space is what is tested
        if while_running is not None:
            while_running()
        return TrialResult("ok", samples_per_second=100.0, interval=(99.0, 101.0), peak_bytes=400 * 2**20,
                           peak_noise_bytes=0, steps_timed=3)

    monkeypatch.setattr(objective_module, "run_trial", played)
    monkeypatch.setattr(trial_module, "run_trial", played)  # the CPU baseline's short run
    result = search_module.search(target=f"{TARGET}:make", budget="2GiB", space="cpu", trials=2, seed=0,
                                  device="cpu", storage=f"sqlite:///{tmp_path}/s.db", out=tmp_path / "tuned.yaml")
    assert [n for n in result.notes if "for this target" in n] == [
        "activation_checkpointing=0.5, 1.0, 'auto' dropped for this target: it applies to nothing (the 4 Parts block(s) it "
        "wraps never run their own forward in the step (their parts are called by hand), so nothing is recomputed); "
        "1 seed(s) with it left out"]
    tried = [t.params for t in result.study.get_trials()]
    assert tried and all(p["activation_checkpointing"] == 0.0 for p in tried)
