"""``activation_checkpointing="auto"``: the choice of what each block recomputes fits its estimate on the CPU, is
minimal by the estimate, deterministic, and trains to the same weights as no checkpointing."""

import copy
import json
import re

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

from autotune import Plan, estimate
from autotune._estimate.devices import DeviceSpeed
from autotune._estimate.recompute import _pruned, choose
from autotune._transforms.blocks import checkpoint_blocks, ops_only_blocks, select_blocks
from autotune._transforms.recompute import save_products
from tests.estimate.test_estimate import bench, target  # noqa: F401 (a fixture)
from tests.fixtures.clients import CLIENTS

#: A fixed device to price recompute on (no measurement in tests).
SPEED = DeviceSpeed(name="cpu", kind="cpu", flops={"fp32": 1e11}, memory_bandwidth=1e10, host_link_bandwidth=1e10,
                    interconnect_bandwidth=1e9, launch_seconds=1e-6, measured=True)
MICRO = 16


@pytest.fixture(scope="module")
def gpt():
    return bench.build("gpt-2x64", batch_size=MICRO)


@pytest.fixture(scope="module")
def bounds(gpt):
    """The predicted peak without checkpointing and with every block checkpointed."""
    model, batch = gpt
    return tuple(estimate(model=model, batch=batch, plan=Plan(micro_batch_size=MICRO, activation_checkpointing=c),
                          device="cpu").predicted_peak_bytes for c in (0.0, 1.0))


def _choice(gpt, budget):
    model, batch = gpt
    return choose(model=model, batch=batch, plan=Plan(micro_batch_size=MICRO), budget_bytes=budget, device="cpu",
                  speed=SPEED)


@pytest.mark.parametrize("share", [0.3, 0.9])
def test_the_choice_fits_the_budget_and_its_estimate_on_cpu_and_is_minimal(gpt, bounds, share):
    plain, full = bounds
    budget = int(full + share * (plain - full))  # no checkpointing does not fit; checkpointing every block does
    choice = _choice(gpt, budget)
    levels = choice.plan.recompute
    assert choice.fits and choice.predicted_peak_bytes <= budget < plain
    assert levels != ("block",) * len(levels) and levels != ("none",) * len(levels)  # neither extreme was needed
    assert "ops" in levels if share == 0.9 else True  # just short of fitting: pointwise recompute in one block does
    model, batch = gpt
    measured = bench.measure_peak(model=model, batch=batch, plan=choice.plan, device="cpu")
    assert abs(choice.predicted_peak_bytes - measured) <= 0.05 * measured, (choice.predicted_peak_bytes, measured)
    # minimal: any block taken down a level (a recomputed op or block saved instead) breaks the budget
    order = ("none", "ops", "block")
    for i, level in enumerate(levels):
        for lower in order[:order.index(level)]:
            fewer = choice.plan.replace(recompute=(*levels[:i], lower, *levels[i + 1:]))
            assert estimate(model=model, batch=batch, plan=fewer, device="cpu").predicted_peak_bytes > budget, fewer
    if share == 0.9:  # deterministic
        assert _choice(gpt, budget).plan == choice.plan
    assert choice.recompute_seconds == pytest.approx(sum(b.recompute_seconds for b in choice.blocks), rel=0.5)
    assert choice.recompute_seconds > 0 and choice.seconds > choice.plain_seconds
    assert [line.split()[:2] for line in choice.describe()[:-1]] == [
        [b.name, b.level] for b in choice.blocks if b.level != "none"]


def test_a_budget_that_fits_without_checkpointing_recomputes_nothing_and_one_below_everything_fails(gpt, bounds):
    plain, full = bounds
    assert _choice(gpt, plain).plan.recompute == ("none", "none")
    low = _choice(gpt, full // 2)
    assert not low.fits and low.plan.recompute == ("block", "block")
    with pytest.raises(ValueError, match="budget_bytes must be a positive int of bytes; got 0"):
        _choice(gpt, 0)


def _trained(model, batch, levels, steps=2):
    """``model`` (a copy) after ``steps`` AdamW steps on ``batch`` with its blocks at ``levels`` (None: no
    checkpointing), the seed fixed: dropout draws the same masks in both runs only if checkpointing preserves them."""
    model = copy.deepcopy(model).train()
    if levels is not None:
        checkpoint_blocks(select_blocks(model, "auto", levels), model=model,
                          ops_only=ops_only_blocks(model, "auto", levels))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(1)
    for _ in range(steps):
        out = model.training_step(batch, 0)
        loss = out["loss"] if isinstance(out, dict) else out
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("name", ["gpt", "gpt2", "llama"])
def test_training_with_the_chosen_levels_gives_the_weights_of_no_checkpointing(name):
    if name == "gpt":
        torch.manual_seed(0)
        model, batch = bench.GPT(vocab_size=256, n_layer=2, n_head=4, n_embd=32, block_size=16, dropout=0.2), None
        tokens = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(0))
        batch = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    else:
        from tests.fixtures.clients import ClientModel

        torch.manual_seed(0)
        model, batch = ClientModel(name), CLIENTS[name][1](4, 0)
        model.model.config.use_cache = False  # as checkpointing has it (its cache path rounds differently)
    reference = _trained(model, batch, None)
    for levels in (("ops", "block"), ("block", "ops")):
        assert all(torch.equal(a, b) for a, b in zip(_trained(model, batch, levels), reference)), (name, levels)
    # the check bites: a checkpoint that loses dropout's random state gives other weights
    if name == "gpt":
        assert not all(torch.equal(a, b) for a, b in zip(_trained(model, batch, None, steps=3), reference))


def test_pruning_takes_down_what_the_greedy_took_needlessly_dearest_first():
    # peaks by levels: the greedy's first step (block 0 whole) is needless once block 1 recomputes whole
    peaks = {(2, 2): 50, (1, 2): 60, (0, 2): 90, (2, 1): 120, (2, 0): 130, (1, 1): 150, (0, 1): 170, (1, 0): 180, (0, 0): 200}
    added = [[0.0, 1.0, 3.0], [0.0, 1.0, 2.0]]
    assert _pruned([2, 2], lambda levels: (peaks[levels], 0.0), added, 100) == [0, 2]
    assert _pruned([2, 2], lambda levels: (peaks[levels], 0.0), added, 55) == [2, 2]  # nothing can go down


def test_the_ops_policy_saves_products_and_attention_without_dropout_and_recomputes_the_rest():
    aten = torch.ops.aten
    attention = aten._scaled_dot_product_flash_attention.default
    q = torch.empty(0)
    assert save_products(None, aten.mm.default, q, q) is CheckpointPolicy.MUST_SAVE
    assert save_products(None, attention, q, q, q, 0.0) is CheckpointPolicy.MUST_SAVE
    # with dropout (a random operator), attention recomputes: the random state stays in the forward's order
    assert save_products(None, attention, q, q, q, 0.1) is CheckpointPolicy.PREFER_RECOMPUTE
    assert save_products(None, attention, q, q, q, dropout_p=0.1) is CheckpointPolicy.PREFER_RECOMPUTE
    for op in (aten.gelu.default, aten.native_layer_norm.default, aten.native_dropout.default, aten.add.Tensor):
        assert save_products(None, op, q) is CheckpointPolicy.PREFER_RECOMPUTE


def test_autotune_estimate_shows_the_choice_per_block_and_the_tuned_file_keeps_it(capsys, target, tmp_path):
    from autotune import load_plan
    from autotune._cli.main import main
    from autotune._estimate.estimate import first_batch
    from autotune._target.target import load_target

    loaded = load_target(target)
    batch = first_batch(loaded)
    plain, full = (estimate(model=loaded.model, batch=batch, plan=Plan(activation_checkpointing=c),
                            device="cuda").predicted_peak_bytes for c in (0.0, 1.0))
    budget = (plain + full) // 2
    args = ["estimate", target, "--device", "cuda", "--device-type", "h100", "--budget", str(budget),
            "--precision", "32-true", "--auto-checkpointing"]
    assert main([*args, "--json"]) == 0
    rows = {json.dumps(r["activation_checkpointing"]): r for r in json.loads(capsys.readouterr().out)}
    auto = rows['"auto"']
    assert [r["fits"] for r in (rows["0.0"], rows["1.0"], auto)] == [False, True, True]
    assert [b["level"] for b in auto["recompute_blocks"]] == auto["recompute"] != ["block", "block"]
    assert all(b["saved_bytes"] > 0 and b["recompute_seconds"] > 0 for b in auto["recompute_blocks"]
               if b["level"] != "none")
    assert main(args) == 0
    out = capsys.readouterr().out
    chosen = [b for b in auto["recompute_blocks"] if b["level"] != "none"]
    assert re.search(rf"ckpt auto \w+: recompute chosen per block\n  {chosen[0]['name']}  {chosen[0]['level']} +saves "
                     r"[\d.]+ MiB for \+[\d.]+ ms per step\n", out), out
    assert f"{len(chosen)} of 2 blocks recompute: peak " in out
    # the tuned file writes the choice out, commented, and reads it back
    plan = Plan.from_dict({k: auto[k] for k in ("precision", "activation_checkpointing", "recompute")})
    text = plan.save(tmp_path / "tuned.yaml").read_text()
    assert "activation_checkpointing: auto  #" in text and "recompute:  # per repeated block: none, ops" in text
    assert load_plan(tmp_path / "tuned.yaml") == plan


def test_a_search_runs_what_auto_chose_and_writes_it(target, tmp_path, monkeypatch):
    import autotune._search.objective as objective_module
    import autotune._search.search as search_module
    import autotune._search.trial as trial_module
    from autotune import load_plan
    from autotune._search.records import TrialResult

    ran = []

    def played(spec, timeout, while_running=None):  # every trial measured alike: what each one runs is tested
        if while_running is not None:
            while_running()
        ran.append(Plan.from_dict(spec.plan))
        return TrialResult("ok", samples_per_second=100.0, interval=(99.0, 101.0), peak_bytes=400 * 2**20,
                           peak_noise_bytes=0, steps_timed=3)

    monkeypatch.setattr(objective_module, "run_trial", played)
    monkeypatch.setattr(trial_module, "run_trial", played)  # the CPU baseline's short run
    space = tmp_path / "space.yaml"
    space.write_text("dimensions:\n  micro_batch_size: {choices: [4]}\n  activation_checkpointing: {choices: [auto]}\n"
                     "seeds:\n  - {micro_batch_size: 4, activation_checkpointing: auto}\n")
    result = search_module.search(target=target, budget="2GiB", space=str(space), trials=1, seed=0, device="cpu",
                                  storage=f"sqlite:///{tmp_path}/s.db", out=tmp_path / "tuned.yaml")
    # 2 GiB: nothing needs recomputing, and 'auto' is that plan: no checkpointing, measured once, written as such
    assert [p.activation_checkpointing for p in ran if p.micro_batch_size == 4] == [0.0]
    assert load_plan(tmp_path / "tuned.yaml").activation_checkpointing == 0.0
    trial = next(t for t in result.study.get_trials() if t.params)
    assert trial.user_attrs["recompute"] == 0.0 and trial.user_attrs["plan"] == "32-true, micro 4"


def test_the_search_estimator_chooses_auto_in_its_budget_less_the_baseline(gpt, bounds):
    from autotune._search.memory import SearchEstimator
    from autotune._target.target import Target

    plain, full = bounds
    model, batch = gpt
    estimator = SearchEstimator(target=Target(model=model, datamodule=None, spec="gpt"), device=torch.device("cpu"))
    estimator._batch = batch
    auto = Plan(micro_batch_size=MICRO, activation_checkpointing="auto")
    assert estimator.resolved(auto) == auto.replace(activation_checkpointing=1.0)  # no budget: every block stands in
    budget = int(full + 0.5 * (plain - full))
    estimator.recompute_budget, estimator.recompute_speed = budget + estimator.baseline, lambda: SPEED
    choice = _choice(gpt, budget)
    assert estimator.resolved(auto) == choice.plan and estimator.tensors(auto) == choice.predicted_peak_bytes


def test_auto_without_a_choice_or_for_another_model_is_refused_saying_how_to_choose(gpt):
    model, _ = gpt
    with pytest.raises(ValueError, match=r"activation_checkpointing='auto' has not been chosen .* run `autotune "
                                         r"estimate` or a search"):
        select_blocks(model, "auto", None)
    with pytest.raises(ValueError, match="recompute has 3 levels but the model has 2 repeated blocks"):
        select_blocks(model, "auto", ("ops", "none", "block"))
    with pytest.raises(ValueError, match="recompute is what activation_checkpointing='auto' chose; it needs"):
        Plan(recompute=("ops", "none"))
    assert ops_only_blocks(model, "auto", ("ops", "block")) == select_blocks(model, "auto", ("ops", "block"))[:1]


def test_apply_plan_trains_a_chosen_plan_to_the_weights_of_no_checkpointing():
    from torch.utils.data import DataLoader, TensorDataset

    from autotune.callbacks import ApplyPlan
    from tests.support.toy import fit

    tokens = torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()), batch_size=4)

    def trained(callback):
        torch.manual_seed(0)
        model = bench.GPT(vocab_size=256, n_layer=2, n_head=4, n_embd=32, block_size=16, dropout=0.2)
        fit(model, data, [callback], max_steps=2)
        return model, callback

    chosen, applied = trained(ApplyPlan(activation_checkpointing="auto", recompute=["ops", "block"]))
    plain, _ = trained(ApplyPlan())
    assert len(applied.checkpointed) == 2
    assert all(torch.equal(a, b) for a, b in zip(chosen.parameters(), plain.parameters()))
    torch.manual_seed(0)
    untrained = bench.GPT(vocab_size=256, n_layer=2, n_head=4, n_embd=32, block_size=16, dropout=0.2)
    assert not all(torch.equal(a, b) for a, b in zip(untrained.parameters(), chosen.parameters()))  # it trained
