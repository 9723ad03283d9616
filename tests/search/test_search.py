"""`autotune search` end to end on CPU: isolated trials, the budget as a constraint, resume, workers, bad input."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from autotune import load_plan
from autotune._cli.main import main
from autotune._search.confirm import GUIDED
from autotune._search.halving import RUNG
from autotune._search.twin import TWIN
from autotune._search.search import NoFeasiblePlanError, search

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = str(ROOT / "tests" / "fixtures" / "search_target.py")
GPT = str(ROOT / "examples" / "gpt" / "train.py")
FAST = {"steps": 2, "warmup": 1}
#: ``python -m autotune`` choosing from the trials' own runs (the subject of the tests using it is elsewhere)
NO_REMEASUREMENT = str(ROOT / "tests" / "support" / "search_without_remeasurement.py")


def one_point_space(tmp_path: Path, seeds: tuple[dict, ...] = (), **dims: list) -> str:
    """A small space file; ``seeds`` are tried first."""
    lines = ["dimensions:"] + [f"  {name}: {{choices: {choices!r}}}" for name, choices in dims.items()]
    lines += ["seeds:"] + [f"  - {seed!r}" for seed in seeds] if seeds else []
    path = tmp_path / "space.yaml"
    path.write_text("\n".join(lines).replace("'", "") + "\n")
    return str(path)


def trials_of(storage: str, study: str) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name=study, storage=storage).get_trials()


@pytest.mark.slow
def test_search_on_the_bundled_example_writes_a_tuned_file_that_runs(tmp_path: Path) -> None:
    out = tmp_path / "tuned.yaml"
    storage = f"sqlite:///{tmp_path}/s.db"
    result = search(target=f"{GPT}:make", budget="3GiB", trials=2, storage=storage, out=out, seed=0, device="cpu",
                    **FAST)
    plan = load_plan(out)
    assert plan == result.plan
    assert plan.budget == "3GiB" and plan.micro_batch_size in (2, 4, 8, 16, 32)
    assert plan.provenance.samples_per_second and plan.provenance.peak_bytes
    assert plan.provenance.produced_by.startswith("search (study 'autotune-gpt-train.py:make-3GiB-cpu-cpu'")
    finished = [t for t in result.study.get_trials() if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    rungs = [t for t in finished if t.user_attrs.get(RUNG)]  # halving's plan, where the trials did not measure it
    twins = [t for t in finished if t.user_attrs.get(TWIN) is not None]  # the leader's, without its worker
    measured = len([t for t in finished if t.user_attrs["source"] != "cache" and t not in rungs + twins])
    # its 2 trials, and at most what it left queued of its first trials (halving's ladder runs them)
    first = [t for t in result.study.get_trials() if t.user_attrs.get(GUIDED, -1) >= 0]
    assert 2 <= measured <= max(2, len(first)), measured
    assert [t.user_attrs["plan"] for t in rungs] in ([], ["32-true, micro 32, workers 0"])  # it fits 3GiB
    assert len(twins) <= 1
    # the predicted best first (the largest micro-batch, no recomputation: 0.0, or 'auto' choosing none, which the
    # model prices the same under a loose budget), then the cpu space's seeds
    first = finished[0]
    assert first.params["micro_batch_size"] == "auto"
    assert first.params["activation_checkpointing"] == 0.0 or (
        first.params["activation_checkpointing"] == "auto" and set(first.user_attrs["recompute"]) == {"none"})
    assert first.user_attrs["predicted_samples_per_second"] > 0 and first.user_attrs["predicted_bound"]
    assert plan.provenance.prediction["samples_per_second"] > 0

    import lightning as L

    sys.path.insert(0, str(ROOT / "examples" / "gpt"))
    try:
        import train
    finally:
        sys.path.remove(str(ROOT / "examples" / "gpt"))
    model, data = train.make()
    trainer = L.Trainer(**plan.trainer_kwargs(), callbacks=[*plan.callbacks()], max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, accelerator="cpu", devices=1)
    trainer.fit(model, datamodule=data)
    assert trainer.global_step == 2
    cli = train.main(["fit", "--config", str(ROOT / "examples/gpt/config.yaml"), "--config", str(out),
                      "--trainer.max_steps=2", f"--trainer.default_root_dir={tmp_path}"])
    assert cli.trainer.global_step == 2


@pytest.mark.slow
def test_budget_binds_oom_is_infeasible_and_crash_is_failed(tmp_path: Path) -> None:
    storage = f"sqlite:///{tmp_path}/s.db"
    space = one_point_space(tmp_path, seeds=({"precision": "32-true", "micro_batch_size": 8},),
                            precision=["32-true", "bf16-mixed"], micro_batch_size=[8, 32, 64])
    result = search(target=f"{FIXTURE}:make_faulty", budget="2GiB", space=space, trials=6, storage=storage,
                    device="cpu", study="faulty", out=None, seed=1, **FAST)
    by_plan: dict[str, optuna.trial.FrozenTrial] = {}
    for t in result.study.get_trials():
        by_plan.setdefault(t.user_attrs["plan"], t)
        if t.params["micro_batch_size"] > 16:  # the target runs out of memory before it reaches its bug
            assert t.state == TrialState.COMPLETE and t.user_attrs["status"] == "oom"  # infeasible, not failed
            assert "OutOfMemory" in t.user_attrs["reason"]
            assert t.value == 0.0
        elif t.params["precision"] == "bf16-mixed":
            assert t.state == TrialState.FAIL  # unrelated to memory
            assert "RuntimeError: an unrelated bug in this plan" in t.user_attrs["reason"]
        else:
            assert t.state == TrialState.COMPLETE and t.user_attrs["status"] == "ok"
    assert {t.state for t in result.study.get_trials()} >= {TrialState.COMPLETE}
    assert result.plan.micro_batch_size == 8 and result.plan.precision == "32-true"
    cached = [t for t in result.study.get_trials() if t.user_attrs.get("source") == "cache"]
    assert all(t.user_attrs["cached_from"] < t.number for t in cached)


def test_a_trials_peak_is_its_largest_steps_not_its_last() -> None:
    from autotune import Plan, measure_plan

    # ElasticBatchSize resets the peak at each step's start, as a run measures its budget: the trial keeps the largest
    plain, spike = (measure_plan(target=f"{FIXTURE}:{name}", plan=Plan(micro_batch_size=8), device="cpu", **FAST)
                    for name in ("make", "make_first_step_spike"))
    assert plain.status == spike.status == "ok" and spike.warmup_steps + spike.steps_timed >= 3
    # the first step's 1 GiB, freed before the last, less how far a plain step peaks above the process at the
    # spike's moment (58 MiB in a CI run)
    assert spike.peak_bytes - plain.peak_bytes > 512 * 2**20


@pytest.mark.slow
def test_cpu_budget_excludes_plans_whose_peak_is_over(tmp_path: Path) -> None:
    from autotune import Plan, measure_plan

    # The budget sits half-way between the two plans' peaks measured here. A process's peak moved by up to ~400 MiB
    # between runs of the same plan (the C allocator's retained heap; measured as resident set, two clean-clone CI
    # runs saw 832 and 846 MiB where 464 is usual), so the plans differ by far more than that: 16 MiB of activations
    # per sample and block, micro-batch 2 against 16 (of batches of 16: a step's time is its samples' page faults).
    small, large = (measure_plan(target=f"{FIXTURE}:make_huge_half", plan=Plan(micro_batch_size=m), device="cpu",
                                 **FAST) for m in (2, 16))
    assert large.peak_bytes - small.peak_bytes > 640 * 2**20  # 787 to over 900 MiB in CI runs: half of it each side
    budget = (small.peak_bytes + large.peak_bytes) // 2
    space = one_point_space(tmp_path, seeds=({"micro_batch_size": 2}, {"micro_batch_size": 16}), micro_batch_size=[2, 16])
    result = search(device="cpu", target=f"{FIXTURE}:make_huge_half", budget=budget, space=space, trials=2,
                    storage=f"sqlite:///{tmp_path}/s.db", out=None, seed=0, **FAST)
    trials = {t.params["micro_batch_size"]: t for t in result.study.get_trials()}
    assert trials[16].user_attrs["peak_bytes"] > budget  # measured, the whole process's peak (net of file pages)
    assert trials[2].user_attrs["peak_bytes"] <= budget
    assert result.plan.micro_batch_size == 2


@pytest.mark.slow
def test_estimator_rejects_far_over_budget_plans_and_picks_auto_micro_batches(
        tmp_path: Path, choice_without_remeasurement: None) -> None:
    # make_huge's trials take about 11 s each: the choice picks from their runs (auto's and 16 overlap, and each
    # re-measurement would be one more such trial)
    space = one_point_space(tmp_path, seeds=({"micro_batch_size": 32}, {"micro_batch_size": "auto"}),
                            micro_batch_size=["auto", 32])
    result = search(device="cpu", target=f"{FIXTURE}:make_huge", budget="1.5GiB", space=space, trials=2,
                    storage=f"sqlite:///{tmp_path}/s.db", out=None, **FAST)
    by_micro = {t.params["micro_batch_size"]: t for t in result.study.get_trials()[:2]}
    whole, auto = by_micro[32], by_micro["auto"]  # the predicted best (auto: 32 is predicted not to fit) ran first
    assert whole.state == TrialState.COMPLETE and whole.user_attrs["source"] == "estimate"  # never ran
    assert whole.user_attrs["status"] == "oom" and whole.user_attrs["predicted_peak_bytes"] > 1.5 * 1.5 * 2**30
    # the prediction in the peak's measure is the estimator's tensors plus the process baseline (on CPU, measured)
    assert 0 < whole.user_attrs["predicted_tensor_bytes"] < whole.user_attrs["predicted_peak_bytes"]
    chosen = auto.user_attrs["auto_micro_batch_size"]
    assert 2 <= chosen < 32 and auto.user_attrs["source"] == "measured"
    assert auto.user_attrs["peak_bytes"] <= 1.5 * 2**30  # the estimator's choice fits when measured
    # halving's ladder: 32 answered by the estimate (far over), 16 measured (by 'auto' tried again or by the ladder);
    # the faster of the plans is chosen, and nothing is left queued
    trials = result.study.get_trials()
    assert [t.user_attrs["source"] for t in trials if t.user_attrs.get("micro_batch_size") == 16] == ["measured"]
    # (auto tried again lower where its measured peak went over: a loaded host moves a CPU peak)
    autos = {t.user_attrs.get("auto_micro_batch_size") for t in trials} - {None}
    assert result.plan.micro_batch_size in autos | {16} and all(t.state.is_finished() for t in trials)


@pytest.mark.slow
@pytest.mark.alone  # a loaded CPU skews what it measures
def test_a_clearly_slower_plan_stops_early(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           choice_without_remeasurement: None) -> None:
    import autotune._search.confirm

    monkeypatch.setattr(autotune._search.confirm, "MIN_MEASURED", 10)  # the step-time model would skip micro 2
    seeds = ({"micro_batch_size": 16}, {"micro_batch_size": 8}, {"micro_batch_size": 2})
    space = one_point_space(tmp_path, seeds=seeds, micro_batch_size=[16, 8, 2])
    result = search(target=f"{FIXTURE}:make_fixed_cost", budget="2GiB", space=space, trials=3, steps=10, warmup=1,
                    device="cpu", storage=f"sqlite:///{tmp_path}/s.db", out=None)
    fast, second, slow = result.study.get_trials()[:3]
    assert fast.params["micro_batch_size"] == 16 and fast.state == TrialState.COMPLETE
    # Timed until its interval was within 3% (a steady 0.1 s per call: the first 5 steps) or the cap.
    assert 5 <= fast.user_attrs["steps_timed"] <= 10
    low, high = fast.user_attrs["interval"]
    assert low <= fast.user_attrs["samples_per_second"] <= high
    assert second.state == TrialState.COMPLETE  # the bar is 90% of the second best's bottom: two must have run
    assert slow.params["micro_batch_size"] == 2 and slow.state == TrialState.PRUNED
    # 20/s at most (eight 0.1 s calls a step of 16), a quarter of the second's 80/s: under the bar (90% of the bottom
    # of the second's interval, which a busy host widens) and stopped once its interval is clear of it, after at least
    # 5 timed steps, not its 10
    assert 5 <= slow.user_attrs["steps_timed"] < 10
    assert slow.user_attrs["interval"][1] < fast.user_attrs["samples_per_second"]
    assert "clearly slower" in slow.user_attrs["reason"]
    assert result.plan.micro_batch_size in (16, 8)  # the pruned plan is never chosen


def test_no_feasible_plan_names_the_smallest_peak(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    space = one_point_space(tmp_path, micro_batch_size=[32, 64])
    code = main(["search", f"{FIXTURE}:make_faulty", "--budget", "2GiB", "--space", space, "--trials", "2",
                 "--storage", f"sqlite:///{tmp_path}/s.db", "--out", str(tmp_path / "t.yaml"), "--steps", "2",
                 "--device", "cpu", "--warmup", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1
    assert "autotune: no plan fits in 2GiB (2.00 GiB); no trial measured a peak" in err
    assert not (tmp_path / "t.yaml").exists()
    with pytest.raises(NoFeasiblePlanError, match=r"no plan fits in 2GiB"):
        search(device="cpu", target=f"{FIXTURE}:make_faulty", budget="2GiB", space=space, trials=2,
               storage=f"sqlite:///{tmp_path}/s.db", out=None, **FAST)


def test_a_target_that_fails_in_every_plan_stops_before_its_first_trial(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    space = one_point_space(tmp_path, micro_batch_size=[8, 16])
    code = main(["search", f"{FIXTURE}:make_broken", "--budget", "2GiB", "--space", space, "--trials", "20",
                 "--storage", f"sqlite:///{tmp_path}/s.db", "--steps", "1", "--warmup", "1", "--no-progress",
                 "--device", "cpu", "--out", str(tmp_path / "t.yaml")])
    assert code == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].endswith("make_broken': the first training step raised RuntimeError: an unrelated bug in this plan")
    assert "search_target.py:" in err[1] and "in training_step: raise RuntimeError" in err[1] and len(err) == 3
    trials = trials_of(f"sqlite:///{tmp_path}/s.db", optuna.get_all_study_names(f"sqlite:///{tmp_path}/s.db")[0])
    assert trials == []  # its short first run failed: no trial ran


def test_a_search_whose_trials_keep_failing_stops_after_five(tmp_path: Path) -> None:
    space = tmp_path / "space.yaml"  # every plan names blocks the model does not have: our refusal, not its code's
    space.write_text("dimensions:\n  micro_batch_size: {choices: [8, 16]}\n"
                     "  activation_checkpointing: {choices: [[NoSuchBlock]]}\n")
    with pytest.raises(NoFeasiblePlanError, match=r"no plan could be measured: 5 trial\(s\) failed, none for memory, "
                                                  r"the last with ValueError: activation_checkpointing names "
                                                  r"\['NoSuchBlock'\] but the model has no such modules"):
        search(target=f"{FIXTURE}:make", budget="2GiB", space=str(space), trials=20, device="cpu", out=None,
               storage=f"sqlite:///{tmp_path}/s.db", study="s", **FAST)
    trials = trials_of(f"sqlite:///{tmp_path}/s.db", "s")
    assert [t.state for t in trials] == [TrialState.FAIL] * 5  # stopped after 5 failures in a row, not 20
    assert not any(t.user_attrs.get("target_error") for t in trials)  # none of them the target's own code


def test_block_class_names_as_choices_are_searched_without_optuna_s_warning(
        tmp_path: Path, choice_without_remeasurement: None) -> None:
    space = tmp_path / "space.yaml"
    space.write_text("dimensions:\n  activation_checkpointing: {choices: [[Fan], 0.0]}\n")
    storage = f"sqlite:///{tmp_path}/s.db"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = main(["search", f"{FIXTURE}:make", "--budget", "2GiB", "--space", str(space), "--trials", "2",
                     "--storage", storage, "--steps", "2", "--warmup", "1", "--no-progress", "--device", "cpu",
                     "--out", str(tmp_path / "t.yaml")])
    assert code == 0
    assert not [w for w in caught if "categorical distribution" in str(w.message)]
    trials = trials_of(storage, optuna.get_all_study_names(storage)[0])
    assert {repr(t.params["activation_checkpointing"]) for t in trials} == {"0.0", "['Fan']"}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--space", "nope"], "unknown search space 'nope': use one of cpu, default, multi_gpu or a path"),
        (["--space", "{typo}"], "space '.*typo.yaml': dimensions.precison: unknown dimension 'precison'"),
        (["--budget", "1KiB"], r"budget 1KiB \(1.00 KiB\) is below the model's weights alone"),
        (["--budget", "12XB"], "budget must be bytes like"),
        (["--target", "nope.py:make"], "target 'nope.py:make': file 'nope.py' does not exist"),
        (["--out", "{missing}/t.yaml"], "--out '.*missing/t.yaml': folder '.*missing' does not exist"),
        (["--storage", "mysql:/x"], "storage 'mysql:/x' is not a storage URL; expected sqlite:///PATH"),
        (["--trials", "0"], "trials must be an int >= 1; got 0"),
        (["--warmup", "0"], "warmup must be an int >= 1; got 0"),
        (["--out", "s.db"], "--out 's.db' is the search's storage file; give another path"),
        (["--space", "{typo}", "--out", "{typo}"], "--out '.*typo.yaml' is the search's space file"),
        (["--timeout", "0"], r"timeout 0.0 is not a positive number of seconds"),
        (["--timeout", "nan"], r"timeout nan is not a positive number of seconds"),
        (["--seed", "-1"], r"seed -1 is not an integer from 0 to 2\*\*32 - 1"),
        (["--storage", "sqlite:///:memory:"], "storage 'sqlite:///:memory:' keeps nothing once the search ends"),
        (["--storage", "journal:{typo}"], "storage 'journal:.*typo.yaml': .* is not an Optuna journal file"),
        (["--storage", "journal:{notes}"], "storage 'journal:.*notes.txt': .* is not an Optuna journal file"),
        (["--storage", "sqlite:///{notes}"], "storage 'sqlite:///.*notes.txt': .* is not a SQLite database"),
        (["--budget", "1000TiB"], r"budget 1000TiB \(1000.00 TiB\) is more than cpu's memory"),
        (["--space", "{twice}"], "space '.*twice.yaml': not valid YAML: key 'precision' appears twice \\(line 3\\)"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch, args: list[str],
                                                         message: str) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "typo.yaml").write_text("dimensions:\n  precison: {choices: [32-true]}\n")
    (tmp_path / "twice.yaml").write_text("dimensions:\n  precision: {choices: [32-true]}\n  precision: {choices: []}\n")
    (tmp_path / "notes.txt").write_text("a user's notes, not a study\n")
    options = {"--target": f"{FIXTURE}:make", "--budget": "2GiB", "--space": "cpu", "--out": "t.yaml",
               "--storage": f"sqlite:///{tmp_path}/s.db", "--trials": "2"}
    for key, value in zip(args[::2], args[1::2]):
        options[key] = value.format(typo=tmp_path / "typo.yaml", missing=tmp_path / "missing",
                                    twice=tmp_path / "twice.yaml", notes=tmp_path / "notes.txt")
    argv = ["search", options.pop("--target")] + [x for kv in options.items() for x in kv]
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    import re

    assert re.search(message, err), err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no database, no tuned file
    assert (tmp_path / "notes.txt").read_text() == "a user's notes, not a study\n"  # a file that is no study: untouched


@pytest.mark.slow
def test_sigkill_then_resume_retries_the_interrupted_trial_once(tmp_path: Path) -> None:
    mark = tmp_path / "mark"
    storage = f"sqlite:///{tmp_path}/s.db"
    space = one_point_space(tmp_path, micro_batch_size=[8, 16, 32])
    cmd = [sys.executable, NO_REMEASUREMENT, "search", f"{FIXTURE}:make_slow_start", "--budget", "2GiB", "--space",
           space, "--trials", "2", "--storage", storage, "--study", "killed", "--out", str(tmp_path / "t.yaml"),
           "--device", "cpu", "--steps", "2", "--warmup", "1", "--no-progress", "--seed", "0"]
    env = {**os.environ, "AUTOTUNE_TEST_MARK": str(mark)}
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    # The target is loaded by the search, by the two short runs that measure the CPU baseline (at micro-batch 1 and
    # at the largest predicted to fit), then by each trial.
    while time.time() < deadline and (not mark.exists() or len(mark.read_text().split()) < 4):
        time.sleep(0.05)  # polling for a file another process writes; the assertion below does not rely on timing
    assert mark.exists() and len(mark.read_text().split()) >= 4, "the first trial never started"
    os.killpg(proc.pid, signal.SIGKILL)  # the search, its fork server and the running trial
    proc.wait()
    [running] = [t for t in trials_of(storage, "killed") if t.state == TrialState.RUNNING]
    time.sleep(8.5)  # the storage's grace period: the killed trial's heartbeat must go stale
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    trials = trials_of(storage, "killed")
    assert trials[running.number].state == TrialState.FAIL
    from optuna.storages import RetryHeartbeatStaleTrialCallback

    retries = [t for t in trials if t.number != running.number
               and RetryHeartbeatStaleTrialCallback.retried_trial_number(t) == running.number]
    assert len(retries) == 1 and retries[0].params == running.params
    measured = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)
                and t.user_attrs.get("source") != "cache"]
    assert len({t.user_attrs["plan"] for t in measured}) == len(measured) >= 2  # no plan measured twice
    assert retries[0] in measured  # the retried trial counted once; re-proposals were served from the cache
    assert not [t for t in trials if t.state == TrialState.RUNNING]


@pytest.mark.slow
def test_two_workers_share_a_journal_study_without_duplicates(tmp_path: Path) -> None:
    journal = tmp_path / "study.log"
    seeds = ({"micro_batch_size": 8, "activation_checkpointing": 0.0},
             {"micro_batch_size": 16, "activation_checkpointing": 1.0})
    space = one_point_space(tmp_path, seeds=seeds, micro_batch_size=[4, 8, 16, 32, 64],
                            activation_checkpointing=[0.0, 1.0])
    cmd = [sys.executable, NO_REMEASUREMENT, "search", f"{FIXTURE}:make", "--budget", "2GiB", "--space", space,
           "--trials", "3", "--storage", f"journal:{journal}", "--study", "shared", "--steps", "2", "--warmup", "1",
           "--device", "cpu", "--no-progress"]
    # two workers on one machine: each trial one thread, as docs/search.md says (two trials of 2 threads each on 2
    # cores spin against each other: 10x slower)
    workers = [subprocess.Popen([*cmd, "--out", str(tmp_path / f"t{i}.yaml"), "--seed", str(i)],
                                env={**os.environ, "OMP_NUM_THREADS": "1"},
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for i in range(2)]
    for w in workers:
        assert w.wait(timeout=600) == 0, w.stderr.read()[-2000:] if w.stderr else ""
    study = optuna.load_study(study_name="shared",
                              storage=optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(
                                  str(journal))))
    trials = study.get_trials()
    finished = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)
                and t.user_attrs.get("source") != "cache" and not t.user_attrs.get(RUNG)
                and t.user_attrs.get(TWIN) is None]
    # each worker stops once the study has 3 measured (at most one runs past), or once the model is confirmed (at
    # least 2 measured, the study says so): which of the two depends on the host's speed
    assert 3 <= len(finished) <= 4 or (len(finished) == 2 and "stopped_by_model" in study.user_attrs)
    rungs = [t.user_attrs[RUNG] for t in trials if t.user_attrs.get(RUNG)]
    assert rungs in ([], [64])  # halving's plan (micro-batch 64 fits 2GiB) measured once if the trials had not
    assert len([t for t in trials if t.user_attrs.get(TWIN) is not None]) <= 1  # the leader's plain twin, once
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING, TrialState.FAIL)]
    workers_seen = {t.user_attrs["worker"] for t in trials}
    assert len(workers_seen) == 2  # both took part
    for seed in seeds:  # both workers queue the seeds; each runs once
        assert len([t for t in trials if t.system_attrs.get("fixed_params") == seed]) == 1


def postgres_url() -> str | None:
    return os.environ.get("AUTOTUNE_TEST_POSTGRES")


@pytest.mark.slow
@pytest.mark.skipif(postgres_url() is None, reason="no PostgreSQL server: .ci/run starts one and sets "
                    "AUTOTUNE_TEST_POSTGRES")
def test_postgresql_storage(tmp_path: Path, choice_without_remeasurement: None) -> None:
    url = postgres_url()
    assert url is not None
    name = f"pg-{os.getpid()}-{time.time_ns()}"
    space = one_point_space(tmp_path, micro_batch_size=[8, 16])
    result = search(target=f"{FIXTURE}:make", budget="2GiB", space=space, trials=2, storage=url, study=name,
                    device="cpu", out=tmp_path / "t.yaml", **FAST)
    again = optuna.load_study(study_name=name, storage=url)
    assert len(again.get_trials()) == len(result.study.get_trials()) >= 2
    assert load_plan(tmp_path / "t.yaml").micro_batch_size in (8, 16)


@pytest.mark.slow
def test_measure_plan_runs_one_plan_as_a_trial_does() -> None:
    from autotune import Plan, TrialResult, measure_plan

    ok = measure_plan(target=f"{FIXTURE}:make_faulty", plan=Plan(micro_batch_size=8), device="cpu", steps=2, warmup=1)
    assert isinstance(ok, TrialResult) and ok.status == "ok" and ok.steps_timed == 2
    assert ok.samples_per_second > 0 and ok.peak_bytes > 0
    oom = measure_plan(target=f"{FIXTURE}:make_faulty", plan=Plan(micro_batch_size=32), device="cpu", steps=2,
                       warmup=1)
    assert oom.status == "oom" and "Out of memory at the minimum micro-batch" in oom.reason  # a result, not raised


def test_a_trial_ends_with_the_parents_work_when_that_work_fails() -> None:
    import multiprocessing

    from autotune._search.trial import TrialSpec, run_trial

    started: list[multiprocessing.process.BaseProcess] = []

    def trace() -> None:  # the parent's work beside the trial (the search traces while the short run measures)
        started.extend(multiprocessing.active_children())
        raise RuntimeError("tracing broke")

    spec = TrialSpec(target=f"{FIXTURE}:make", config=None, plan={"micro_batch_size": 8}, budget=None, device="cpu",
                     steps=10_000, warmup=1)  # would run for minutes
    with pytest.raises(RuntimeError, match="tracing broke"):
        run_trial(spec, timeout=300, while_running=trace)
    assert len(started) == 1 and not started[0].is_alive()  # the trial was running, and was ended before the raise


@pytest.mark.slow
def test_a_trials_flops_per_sample_are_a_whole_steps_over_its_samples() -> None:
    from torch.utils.flop_counter import FlopCounterMode

    from autotune import Plan, load_target, measure_plan

    target = load_target(f"{GPT}:make")
    target.datamodule.setup("fit")
    batch = next(iter(target.datamodule.train_dataloader()))
    with FlopCounterMode(display=False) as counter:  # the whole batch's forward and backward, in this process
        target.model.training_step(batch, 0).backward()
    result = measure_plan(target=f"{GPT}:make", plan=Plan(micro_batch_size=8), device="cpu", steps=2, warmup=1)
    assert result.status == "ok", result.reason
    # the trial counts its first micro-batch of 8 (the counter's cost is per call: not the 4 of a step)
    assert result.flops_per_sample == pytest.approx(counter.get_total_flops() / batch[0].shape[0])


def test_measure_plan_refuses_bad_input() -> None:
    from autotune import Plan, measure_plan

    with pytest.raises(ValueError, match=r"plan must be an autotune.Plan; got dict"):
        measure_plan(target="t.py:make", plan={"micro_batch_size": 8})
    with pytest.raises(ValueError, match=r"warmup must be an int >= 1; got 0"):
        measure_plan(target="t.py:make", plan=Plan(), warmup=0)
    with pytest.raises(ValueError, match=r"interval must be a number between 0 and 1 \(0.03: \+-3%\); got 3"):
        measure_plan(target="t.py:make", plan=Plan(), interval=3)


def test_search_gives_back_optuna_s_log_level(tmp_path: Path) -> None:
    optuna.logging.set_verbosity(optuna.logging.DEBUG)
    try:
        # every plan is over a tiny budget; the level comes back anyway
        with pytest.raises(NoFeasiblePlanError, match=r"no plan fits in 100MiB"):
            search(device="cpu", target=f"{FIXTURE}:make", budget="100MiB", trials=1,
                   space=one_point_space(tmp_path, micro_batch_size=[8, 16]),
                   storage=f"sqlite:///{tmp_path}/s.db", out=None, seed=0, **FAST)
        assert optuna.logging.get_verbosity() == optuna.logging.DEBUG
    finally:
        optuna.logging.set_verbosity(optuna.logging.WARNING)


@pytest.mark.slow
def test_ctrl_c_ends_in_one_line_and_the_interrupted_trial_runs_again_on_resume(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import os
    import signal
    import time

    storage = f"sqlite:///{tmp_path}/s.db"
    space = one_point_space(tmp_path, micro_batch_size=[4, 16])
    command = [sys.executable, "-m", "autotune", "search", f"{FIXTURE}:make_fixed_cost", "--budget", "2GiB",
               "--space", space, "--trials", "1", "--warmup", "1", "--storage", storage, "--study", "s",
               "--device", "cpu", "--out", str(tmp_path / "t.yaml"), "--no-progress", "--seed", "0"]
    # One trial, the one Ctrl-C stops: the resumed search runs it again and is done (a second plan would add its
    # run and the re-measurement of the two, which this test does not look at).
    # A slow trial, so that Ctrl-C reaches it while it runs: 40 steps of 0.1 s per micro-batch, timed to the cap (its
    # steady steps would reach +-3% in 5 and the search could end first). SIGINT at its default, as a terminal's
    # foreground process has it: a pytest started in the background by a shell without job control ignores it, and an
    # ignored signal stays ignored across exec (a handled one is at its default there).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen([*command, "--steps", "40", "--interval", "0.0001"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True, cwd=tmp_path)
    finally:
        signal.signal(signal.SIGINT, previous)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if any(t.state == TrialState.RUNNING for t in trials_of(storage, "s")):
                break
        except KeyError:  # the study does not exist yet
            pass
        time.sleep(0.2)
    time.sleep(1.0)  # into the trial
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal sends the foreground process group
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert err.strip() == ("autotune: interrupted; the study is kept, and the same command resumes it (the "
                           "interrupted trial runs again)")
    [stopped] = [t for t in trials_of(storage, "s") if t.user_attrs.get("status") == "interrupted"]
    assert stopped.state == TrialState.FAIL
    assert main(["report", "--storage", storage, "--study", "s"]) == 0  # says why it failed
    assert "interrupted (Ctrl-C or a lost worker); a resumed search runs it again" in capsys.readouterr().out

    done = subprocess.run([*command, "--steps", "2"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    [again] = [t for t in trials_of(storage, "s") if t.user_attrs.get("retry_of") == stopped.number]
    assert again.state == TrialState.COMPLETE and again.params == stopped.params


@pytest.mark.slow
def test_trials_run_with_the_users_trainer_settings_and_the_tuned_file_records_them(tmp_path: Path) -> None:
    from autotune._search.settings import user_trainer_settings

    config = tmp_path / "config.yaml"
    steps = tmp_path / "steps.txt"
    (tmp_path / "counter.py").write_text(  # a module beside the config, as a user's project has it
        "import lightning as L\n\n\nclass StepCounter(L.Callback):\n    def __init__(self, path):\n"
        "        self.path = path\n\n    def on_train_batch_end(self, *args):\n"
        "        with open(self.path, 'a') as f:\n            f.write('step\\n')\n")
    config.write_text("trainer:\n  gradient_clip_val: 0.5\n  deterministic: true\n  detect_anomaly: false\n"
                      "  max_steps: 1000\n  logger: false\n  callbacks:\n"
                      "    - class_path: lightning.pytorch.callbacks.LearningRateMonitor\n"
                      "    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n"
                      "    - class_path: counter.StepCounter\n"
                      f"      init_args: {{path: {steps}}}\n")
    expected = {"gradient_clip_val": 0.5, "deterministic": True, "detect_anomaly": False}
    # the trial's own settings (max_steps, logger) are not taken; callbacks are built apart
    assert user_trainer_settings({"max_steps": 1000, "logger": False, "callbacks": [{}], **expected}) == expected
    result = search(device="cpu", target=f"{FIXTURE}:make", config=str(config), budget="2GiB", trials=1, seed=0,
                    space=one_point_space(tmp_path, micro_batch_size=[32]), storage=f"sqlite:///{tmp_path}/s.db",
                    out=tmp_path / "t.yaml", **FAST)
    [trial] = [t for t in result.study.get_trials() if t.state == TrialState.COMPLETE]
    # the user's own callback ran in the trial (and in the baseline run); a logger's, a checkpoint's did not
    recorded = {**expected, "callbacks": ["StepCounter"]}
    assert trial.user_attrs["trainer_settings"] == recorded
    assert steps.read_text().count("step") >= trial.user_attrs["steps_timed"]
    assert load_plan(tmp_path / "t.yaml").provenance.trainer_settings == recorded
