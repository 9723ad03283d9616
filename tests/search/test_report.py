"""`autotune report`: the trial table (on CUDA with the tensors' peak beside the peak), the plots, a storage only
read, bad input."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest

from autotune._cli.main import main
from autotune._search.report import trial_table


def test_report_prints_the_trials_and_writes_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    storage = f"sqlite:///{tmp_path}/s.db"
    study = optuna.create_study(study_name="r", storage=storage, direction="maximize")
    study.set_user_attr("budget_bytes", 2**30)
    study.set_user_attr("budget", "1GiB")
    rows = [(4, 10.0, 2**29, "ok"), (32, 20.0, 2**31, "oom"), (16, 15.0, 3 * 2**28, "ok"), (8, 12.0, 2**28, "ok")]
    for micro, sps, peak, status in rows:  # set, not sampled: four equal draws would leave nothing to rank
        study.enqueue_trial({"micro_batch_size": micro})
        trial = study.ask({"micro_batch_size": optuna.distributions.CategoricalDistribution([4, 8, 16, 32])})
        trial.set_user_attr("plan", f"32-true, micro {trial.params['micro_batch_size']}")
        trial.set_user_attr("samples_per_second", sps)
        trial.set_user_attr("peak_bytes", peak)
        trial.set_user_attr("status", status)
        trial.set_user_attr("interval", [0.9 * sps, 1.1 * sps])
        if micro in (4, 16, 8):  # how the estimator traced them: with real tensors, on their line, without data
            trial.set_user_attr("predicted_peak_bytes", micro * 2**26)
            trial.set_user_attr("estimate_method", {4: "real", 16: "extrapolated", 8: "fake"}[micro])
        trial.set_constraint("memory", (peak - 2**30) / 2**30)
        study.tell(trial, sps if status == "ok" else 0.0)
    # what a search stores when it chooses: trial 3 (12/s), measured again twice, over trial 2's single 15/s
    study.set_user_attr("remeasured", {"3": [{"status": "ok", "samples_per_second": 13.0, "interval": [12.5, 13.5],
                                              "peak_bytes": 2**28}]})
    study.set_user_attr("chosen", {"trial": 3, "plan": "32-true, micro 8", "samples_per_second": 12.5,
                                   "interval": [12.0, 13.0], "runs": [12.0, 13.0], "peak_bytes": 2**28,
                                   "within_noise_of": ["32-true, micro 16"]})
    assert main(["report", "--storage", storage, "--out", str(tmp_path / "rep")]) == 0
    out = capsys.readouterr().out
    assert "study 'r'" in out and "budget 1GiB" in out
    assert out.count(" yes  ") == 3 and out.count(" no  ") == 1
    [row] = [line for line in out.splitlines() if line.startswith("*   3 ")]  # the chosen trial is marked
    assert "+-10.0%" in row and row.endswith("(measured again: 13.0)")
    predicted = {line.split()[0]: line for line in out.splitlines() if line[1:5].strip().isdigit()}
    assert " 256.00 MiB r " in predicted["0"] and " 1.00 GiB x " in predicted["2"] and " 512.00 MiB " in row
    assert not any(m in row for m in (" MiB r ", " MiB x ")) and "       - no " in predicted["1"]  # unestimated: -
    assert ("predicted: 'x' on the line through two such traces at smaller micro-batches; 'r' traced with real "
            "tensors on the host (the step reads tensor values)") in out
    assert ("* chosen: trial 3, 32-true, micro 8: 12.5 samples/s (mean of 2 runs, interval [12.0, 13.0]), peak "
            "256.00 MiB") in out and "within measurement noise of: 32-true, micro 16" in out
    for name in ("tradeoff.png", "history.png", "importance.png"):
        assert (tmp_path / "rep" / name).stat().st_size > 1000
    assert main(["report", "--storage", storage, "--study", "nope"]) == 2
    assert "no study 'nope' in the storage; studies there: r" in capsys.readouterr().err


def test_report_never_creates_or_writes_a_storage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for url, name in ((f"sqlite:///{tmp_path}/nosuch.db", "nosuch.db"), (f"journal:{tmp_path}/nosuch.log", "nosuch.log")):
        assert main(["report", "--storage", url, "--study", "nope"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"file '{tmp_path}/{name}' does not exist (no search has used it)" in err
    not_a_study = tmp_path / "other.db"
    not_a_study.write_bytes(b"not a database")
    assert main(["report", "--storage", f"sqlite:///{not_a_study}"]) == 2
    assert f"storage 'sqlite:///{not_a_study}': '{not_a_study}' is not a SQLite database" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.db"]
    assert not_a_study.read_bytes() == b"not a database"


def test_report_checks_for_matplotlib_before_printing_anything(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert main(["report", "--storage", f"sqlite:///{tmp_path}/s.db", "--out", str(tmp_path / "r")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == ("autotune: error: the report's plots (--out) need matplotlib: pip install "
                                 "'lightning-autotune[report]'\n")
    assert list(tmp_path.iterdir()) == []



def _study(cuda: bool, context: bool = True) -> optuna.Study:
    study = optuna.create_study(study_name="r", direction="maximize")
    study.set_user_attr("budget_bytes", 16 * 2**30)
    micro = optuna.distributions.CategoricalDistribution([8, 16])
    # micro, peak, tensors' peak, context; predicted: est. tensors (half the tensors' peak) plus the context estimate
    trials = ((16, 11 * 2**30, 9 * 2**30, 600 * 2**20), (8, 6 * 2**30, 5 * 2**30, 700 * 2**20))
    for m, peak, allocated, measured_context in trials:
        attrs = {"plan": f"bf16-mixed, micro {m}", "status": "ok", "samples_per_second": 10.0 * m,
                 "peak_bytes": peak, "predicted_peak_bytes": allocated // 2 + 2**29,
                 "predicted_tensor_bytes": allocated // 2}
        if cuda:
            attrs |= {"allocated_peak_bytes": allocated, "context_bytes": measured_context if context else None}
        study.add_trial(optuna.trial.create_trial(params={"micro_batch_size": m},
                                                  distributions={"micro_batch_size": micro}, value=10.0 * m,
                                                  user_attrs=attrs))
    return study


def test_a_cuda_study_shows_each_trials_tensor_peak_beside_the_estimators() -> None:
    lines = trial_table(_study(cuda=True)).splitlines()
    header = lines[1].split()
    assert header[:10] == ["#", "state", "samples/s", "95%", "int.", "peak", "predicted", "tensors", "est.",
                           "tensors"]
    row = next(line for line in lines if line.split()[:1] == ["0"])
    # peak, predicted (in the peak's measure), the trial's tensors' peak and the estimator's: the gap is in sight
    assert "11.00 GiB      5.00 GiB    9.00 GiB     4.50 GiB yes" in row
    assert lines[-1] == ("peak: the allocator's peak reserve plus the CUDA context (600.00 MiB-700.00 MiB); predicted: "
                         "the estimator's tensors plus the context estimate and its plan shape's gap measured by "
                         "earlier trials; tensors: the trial's peak of bytes allocated, est. tensors: the estimator's")
    unlisted = trial_table(_study(cuda=True, context=False)).splitlines()[-1]
    assert "(not measured: NVML does not list the process)" in unlisted


def test_a_cpu_study_has_no_tensor_columns() -> None:
    table = trial_table(_study(cuda=False))
    assert "tensors" not in table and "11.00 GiB      5.00 GiB yes" in table


def test_the_table_says_how_far_the_step_time_model_was_from_each_trial_and_that_it_stopped_the_search() -> None:
    study = optuna.create_study(study_name="r", direction="maximize")
    micro = optuna.distributions.CategoricalDistribution([8, 16, 32])
    for m, measured, predicted in ((32, 100.0, 80.0), (16, 90.0, 99.0), (8, 50.0, 55.0)):
        study.add_trial(optuna.trial.create_trial(
            params={"micro_batch_size": m}, distributions={"micro_batch_size": micro}, value=measured,
            user_attrs={"plan": f"32-true, micro {m}", "status": "ok", "source": "measured",
                        "samples_per_second": measured, "predicted_samples_per_second": predicted}))
    study.set_user_attr("stopped_by_model", {"best_samples_per_second": 100.0, "model_error": 0.1, "measured": 3})
    lines = trial_table(study).splitlines()
    assert lines[-2] == ("step-time model: each measured trial predicted before it ran, off by 10% to 20% (median 10%) "
                         "over 3 trials")
    assert lines[-1] == ("the search stopped early: no plan left unmeasured was predicted to beat 100.0 samples/s by "
                         "the model's error")


def test_the_report_says_why_the_chosen_micro_batch_is_not_grown_past() -> None:
    from autotune._search.report import micro_batch_lines

    study = optuna.create_study(direction="maximize")
    study.set_user_attr("budget_bytes", 2**30)
    study.set_user_attr("batch_size", 64)
    dists = {"micro_batch_size": optuna.distributions.CategoricalDistribution([8, 16, 32, 64]),
             "precision": optuna.distributions.CategoricalDistribution(["32-true", "bf16-mixed"])}
    for micro, precision, sps, peak, status in [(16, "32-true", 100.0, 2**29, "ok"), (32, "32-true", 87.0, 2**29, "ok"),
                                                (64, "32-true", 0.0, 2**31, "oom"), (64, "bf16-mixed", 120.0, 2**29, "ok")]:
        study.enqueue_trial({"micro_batch_size": micro, "precision": precision})
        trial = study.ask(dists)
        for key, value in (("micro_batch_size", micro), ("samples_per_second", sps), ("peak_bytes", peak),
                           ("status", status), ("source", "measured")):
            trial.set_user_attr(key, value)
        study.tell(trial, sps)
    choice = {"trial": 0, "samples_per_second": 100.0}
    assert micro_batch_lines(study, choice) == [
        "  runs at micro 16 (its tuned file's ElasticBatchSize: grow false): micro 32 measured 13% slower (trial 1); "
        "micro 64 did not fit (trial 2); grow: true lets it try larger ones when memory allows"]  # not bf16's 64
    assert micro_batch_lines(study, {"trial": 3, "samples_per_second": 120.0}) == []  # the whole batch
    assert micro_batch_lines(study, {"trial": 1, "samples_per_second": 87.0})[0].endswith(
        "micro 64 did not fit (trial 2); grow: true lets it try larger ones when memory allows")


def test_the_report_says_why_a_search_stopped_when_the_targets_code_failed() -> None:
    study = optuna.create_study(direction="maximize")
    study.set_user_attr("stopped_by_target", ["target 't.py:make': the first training step raised KeyError: 'x'",
                                              "  t.py:9, in training_step: return batch['x']"])
    assert trial_table(study).splitlines()[-3:] == [
        "the search stopped: the target's own code failed:",
        "  target 't.py:make': the first training step raised KeyError: 'x'",
        "  t.py:9, in training_step: return batch['x']"]
