"""``benchmarks/gpu_check.py``: the one command a session with a GPU runs; its plumbing on the CPU."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_check_runs_every_step_and_writes_its_report_on_the_cpu(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--quick", "--out",
                           str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    names = [s["name"] for s in report["steps"]]
    assert names == ["trial against a plain run", "trial against estimate", "against the alternatives",
                     "realistic search", "gpu tests", "estimator accuracy", "elastic overhead and one real OOM",
                     "dynamic padding", "whole suite with CUDA visible"]
    assert all(s["status"] == "ok" for s in report["steps"]), [(s["name"], s["status"]) for s in report["steps"]]
    text = (tmp_path / "report.md").read_text()
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_check import driver

    assert ("driver: none (no NVIDIA driver)" in text) == (driver() is None)  # NVML's driver, whatever torch sees
    assert "| gpu tests | ok | 0 |" in text
    assert (tmp_path / "gpu-tests.xml").exists() and (tmp_path / "tuned.yaml").exists()
    assert (tmp_path / "trial-memory.xml").exists()
    [row] = json.loads((tmp_path / "trial_vs_estimate.json").read_text())["rows"]  # a trial and its estimate
    assert row["status"] == "ok" and row["peak_bytes"] > row["predicted_bytes"] > 0
    assert row["allocated_peak_bytes"] is None  # a CPU trial has no allocator figures


def test_gpu_check_refuses_an_unknown_step_in_one_line(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--quick", "--out",
                           str(tmp_path), "--only", "gpu tests", "dynamic paddin"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "" and list(tmp_path.iterdir()) == []
    assert proc.stderr.startswith("gpu_check: --only 'dynamic paddin' is not a step; the steps: 'trial against a "
                                  "plain run', ")
    assert proc.stderr.count("\n") == 1 and "'whole suite with CUDA visible'" in proc.stderr


def test_gpu_check_refuses_a_suite_path_that_is_not_there_in_one_line(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--quick", "--out",
                           str(tmp_path), "--suite-paths", "tests/test_layout.py", "tests/test_serch.py"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "" and list(tmp_path.iterdir()) == []
    assert proc.stderr == f"gpu_check: --suite-paths 'tests/test_serch.py' is not a test file or folder of {ROOT}\n"


def test_gpu_check_refuses_a_machine_without_what_its_steps_import_in_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A fresh GPU machine without the carried wheels ran a whole-suite step into 37 import errors (4.5 minutes of
    an H200): the check now stops before any step, naming what is missing."""
    import importlib.util
    import signal

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_check

    real = importlib.util.find_spec
    hidden = {"optuna", "jsonargparse"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in hidden else real(name, *a))
    monkeypatch.setattr(signal, "signal", lambda *args: None)  # the check's SIGTERM handler, not in pytest's process
    assert gpu_check.main(["--device", "cpu", "--quick", "--out", str(tmp_path / "report")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and not (tmp_path / "report").exists()
    assert err == ("gpu_check: cannot import optuna, jsonargparse: install the package and its test dependencies "
                   "first (pip install -e '.[test]'; on a machine without network, from carried wheels)\n")
    hidden.clear()
    assert gpu_check.missing_modules() == []  # this machine (CI's) has them all


@functools.cache
def _usage(script: str) -> str:
    """``script --help``, run once for both cases of the test below (a few seconds each: the scripts import torch)."""
    return subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120).stdout


@pytest.mark.parametrize("quick", [True, False], ids=["quick", "full"])
def test_every_option_a_gpu_step_passes_is_one_its_script_takes(monkeypatch: pytest.MonkeyPatch, quick: bool) -> None:
    """The GPU steps run only on a lent GPU (a CPU runs their ``--help``), so an option a script does not take would
    cost a GPU run its step: each option of each benchmark step is checked against the script's own parser."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_check import steps

    for step in steps("cuda", quick, ROOT):
        script = next((c for c in step.command if c.startswith("benchmarks/") and c.endswith(".py")), None)
        if script is None:
            continue  # pytest, or the autotune CLI (the realistic search: tested with the CLI)
        flags = {c.split("=")[0] for c in step.command if c.startswith("--")}
        taken = set(re.findall(r"(--[a-z][a-z0-9-]*)", _usage(script)))
        assert flags <= taken, f"{step.name}: {script} does not take {sorted(flags - taken)}"


def test_the_whole_suite_step_leaves_out_the_gpu_tests_and_runs_on_half_the_cores(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_check import steps

    def suite(device: str, quick: bool, paths: list[str] | None = None) -> list[str]:
        monkeypatch.setattr("os.cpu_count", lambda: 16)
        command = next(s.command for s in steps(device, quick, ROOT, paths)
                       if s.name == "whole suite with CUDA visible")
        return command[command.index("-q"):]

    assert suite("cuda", False) == ["-q", "-m", "not gpu", "-n", "8"]
    assert suite("cuda", True) == ["-q", "-m", "not gpu and not slow", "-n", "8"]  # quick: no slow tests
    assert suite("cpu", True) == ["-q", "-m", "not gpu and not slow", "tests/test_layout.py"]  # one process
    # the rest of a suite an earlier run cut: only those files
    assert suite("cuda", True, ["tests/search/test_search.py", "tests/plan/test_plan.py"]) == [
        "-q", "-m", "not gpu and not slow", "tests/search/test_search.py", "tests/plan/test_plan.py", "-n", "8"]
    for step in steps("cuda", True, ROOT):  # the gpu tests one at a time: they share the device
        if step.command[1:3] == ["-m", "pytest"] and step.name != "whole suite with CUDA visible":
            assert step.command[step.command.index("-n") + 1] == "0", step.name


def test_a_step_cut_at_its_limit_keeps_pytests_summary_and_junit(monkeypatch: pytest.MonkeyPatch, tmp_path: Path
                                                                  ) -> None:
    """A step over its limit gets Ctrl-C first: pytest stops and still names what failed before the cut (on an H200
    the whole suite was cut with 5 failures whose names were lost)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_check

    suite = tmp_path / "test_cut.py"
    suite.write_text("import time\n\ndef test_fails():\n    assert 1 == 2\n\n"
                     "def test_lingers():\n    time.sleep(120)\n")
    monkeypatch.setattr(gpu_check, "INTERRUPT_GRACE_S", 15.0)
    step = gpu_check.Step("cut", [sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider",
                                  f"--junitxml={tmp_path / 'cut.xml'}", str(suite)], 20.0)
    start = time.monotonic()
    gpu_check.run_step(step, tmp_path)
    assert step.status == "timed out" and time.monotonic() - start < 30
    log = (tmp_path / "cut.log").read_text()
    assert "FAILED" in log and "test_cut.py::test_fails" in log and "KeyboardInterrupt" in log
    assert 'name="test_fails"' in (tmp_path / "cut.xml").read_text()


def test_nothing_of_a_cut_step_outlives_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A child that ignores Ctrl-C (a worker, a rank) is killed with its step, though the step itself stopped."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_check

    monkeypatch.setattr(gpu_check, "INTERRUPT_GRACE_S", 1.0)
    step = gpu_check.Step("cut", ["sh", "-c", "(trap '' INT; exec sleep 123) & echo $!; sleep 300"], 3.0)
    gpu_check.run_step(step, tmp_path)
    child = int((tmp_path / "cut.log").read_text().split()[0])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # gone, or a zombie its new parent has not reaped yet
        status = Path(f"/proc/{child}/status")
        if not status.exists() or "\nState:\tZ" in status.read_text():
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the step's child {child} outlived it")
    assert step.status == "timed out"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the check would run for real")
def test_gpu_check_refuses_cuda_without_a_gpu_in_one_line() -> None:
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("gpu_check: --device cuda but torch sees no CUDA device; use --device cpu --quick "
                                   "for the plumbing")


def test_the_quick_check_runs_dynamic_padding_on_real_memory_on_a_gpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_check import steps

    def padding(device: str) -> list[str]:
        return next(s.command for s in steps(device, True, ROOT) if s.name == "dynamic padding")

    assert padding("cuda")[-4:-2] == ["--rule", "memory"] and "--quick" not in padding("cuda")  # its goal's 240 steps
    assert padding("cpu")[-1] == "--help"  # the CPU's rules run in tests/runtime/test_shapes.py


def test_dynamic_paddings_memory_rule_refuses_the_cpu_in_one_line() -> None:
    proc = subprocess.run([sys.executable, "benchmarks/dynamic_padding.py", "--rule", "memory"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == ("dynamic_padding.py: error: --rule memory needs --device cuda (a "
                                                    "real allocator cap); on a CPU use tokens or length2")


def test_dynamic_paddings_memory_rule_end_to_end_with_the_allocator_played_on_the_cpu(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The real-memory rule's plumbing (probe, cap, capped runs, the fewest micro-batches) on a CPU, the CUDA allocator's
    calls played by a fake cap: a micro-batch over 700 tokens raises torch.OutOfMemoryError in the model's loss while
    the cap is set, as the caching allocator would. On a GPU the same code meets the real allocator."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import dynamic_padding as dp

    cap = {"fraction": 1.0}

    def get_fraction(device: object) -> float:
        assert isinstance(device, int), device  # torch refuses a device without an index here
        return cap["fraction"]

    def set_fraction(fraction: float, device: object) -> None:
        assert isinstance(device, int) and isinstance(fraction, float), (fraction, device)
        cap["fraction"] = fraction

    for name, fake in (("empty_cache", lambda: None), ("reset_peak_memory_stats", lambda device=None: None),
                       ("max_memory_reserved", lambda device=None: 300 * 2**20),
                       ("mem_get_info", lambda device=None: (10 * 2**30, 10 * 2**30)),
                       ("get_per_process_memory_fraction", get_fraction),
                       ("set_per_process_memory_fraction", set_fraction)):
        monkeypatch.setattr(torch.cuda, name, fake)
    _, padded_lm, _ = dp._imports()
    loss = padded_lm.loss

    def capped_loss(self: object, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if cap["fraction"] < 1.0 and batch["input_ids"].numel() > 700:
            raise torch.OutOfMemoryError("CUDA out of memory (played)")
        return loss(self, batch)

    monkeypatch.setattr(padded_lm, "loss", capped_loss)
    monkeypatch.setattr(dp, "MEMORY_MODEL", dict(dp.MODEL))  # the small model: this is about the plumbing
    memory = dp.RealMemory("cpu")
    assert memory.cap == int(dp.MEMORY_ROOM * 300 * 2**20) and cap["fraction"] == 1.0  # set only while probing
    assert [memory.largest[n] for n in (16, 32, 64, 128)] == [32, 21, 10, 5]  # 700 // length, at most 32
    rows = dp.measure(rules=["memory"], steps=20, seeds=[0], device="cpu", memory=memory)
    (shape,) = [r for r in rows if r["policy"] == "shape"]
    assert shape["ooms"] >= 1 and shape["every_sample_once"] and shape["global_step"] == 20
    assert shape["micro_batches"] >= shape["fewest"] > 20  # the long batches need several micro-batches
    assert shape["max_weight_diff"] < 1e-9 and cap["fraction"] == 1.0
    # each step's split beside the probe's, for the report's lines on what bound the splits beyond the fewest
    assert len(shape["trace"]) == 20
    over = sum(t["count"] > dp.fewest("memory", t["length"], memory) for t in shape["trace"])
    assert sum(t["count"] for t in shape["trace"]) == shape["micro_batches"]
    text = dp.report(rows, dp.machine("cpu"), memory)
    assert f"split beyond the fewest: {over} of 20 steps (shape)" in text
    assert "split beyond the fewest: " in text.split("(shape)")[1]  # the fixed policy's line too


def test_the_peak_is_taken_apart_by_the_lines_that_allocated_what_is_alive_at_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """trial_vs_estimate's allocator-trace reading (CUDA only, so played here): the peak of bytes requested, and the
    tensors alive at that moment (not later, not freed ones) by the innermost frame outside torch."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from trial_vs_estimate import peak_sites

    def frames(*where: tuple[str, int, str]) -> list[dict]:
        return [{"filename": f, "line": n, "name": name} for f, n, name in where]

    block = frames(("/site-packages/torch/nn/modules/linear.py", 125, "forward"), ("/x/gpt/model.py", 46, "forward"))
    head = frames(("/x/gpt/model.py", 140, "forward"))
    events = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": block},
        {"action": "alloc", "addr": 2, "size": 50, "frames": head},
        {"action": "alloc", "addr": 3, "size": 30, "frames": block},  # 180 alive
        {"action": "free_requested", "addr": 1, "size": 100, "frames": block},  # allocated_bytes drops here
        {"action": "free_completed", "addr": 1, "size": 100, "frames": block},  # (the block reusable: no change)
        {"action": "alloc", "addr": 4, "size": 120, "frames": frames(("/torch/autograd/graph.py", 8, "run"))},  # 200
        {"action": "free_requested", "addr": 4, "size": 120, "frames": []},
        {"action": "alloc", "addr": 5, "size": 10, "frames": []},
    ]
    assert peak_sites(events) == (200, [("(torch only)", 120), ("gpt/model.py:140 forward", 50),
                                        ("gpt/model.py:46 forward", 30)], 0)
    assert peak_sites(events[:4]) == (180, [("gpt/model.py:46 forward", 130), ("gpt/model.py:140 forward", 50)], 0)
    # a free whose allocation the trace lacks (made before it, or a ring buffer that wrapped): counted, not fatal
    assert peak_sites([*events, {"action": "free_requested", "addr": 99, "size": 5, "frames": []}])[2] == 1
    assert peak_sites(events, top=1)[1] == [("(torch only)", 120)]


def test_the_peak_is_placed_in_its_phase_by_the_markers_and_its_tensors_grouped_by_size(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without stacks (their recording failed on an H200) the trace still says where the peak lies, from the markers
    allocated at each phase of a step, and what is alive at it by size."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from trial_vs_estimate import MARKER_BLOCKS, peak_phase, sizes_at_peak

    def marker(phase: str) -> list[dict]:
        size = 512 * MARKER_BLOCKS[phase]
        return [{"action": "alloc", "addr": 1000, "size": size},
                {"action": "free_requested", "addr": 1000, "size": size}]

    def alloc(addr: int, size: int) -> dict:
        return {"action": "alloc", "addr": addr, "size": size}

    def free(addr: int, size: int) -> dict:
        return {"action": "free_requested", "addr": addr, "size": size}

    mib = 2**20
    steps = [*marker("step"), *marker("forward"), alloc(1, 100 * mib), *marker("backward"), free(1, 100 * mib),
             *marker("forward"), alloc(2, 100 * mib), alloc(3, 100 * mib), *marker("backward"), alloc(4, 64 * mib),
             free(2, 100 * mib), free(3, 100 * mib), free(4, 64 * mib), *marker("update"), alloc(5, 50 * mib),
             free(5, 50 * mib)]
    assert peak_phase(steps) == "step 1, backward of micro-batch 2"
    assert sizes_at_peak(steps) == [(100 * mib, 2), (64 * mib, 1)]
    # a larger update in the second step: the peak moves there
    second = [*steps, *marker("step"), *marker("forward"), alloc(6, 10 * mib), *marker("update"), alloc(7, 300 * mib)]
    assert peak_phase(second) == "step 2, update"
    assert peak_phase([alloc(1, 10)]) == "before the first marker"


def test_the_overhead_benchmark_profiles_both_runs_and_names_what_waits_for_the_device(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """elastic_overhead's profile of the no-split step (the CPU here: its plumbing): both runs profiled, the names
    that grew with the callback, and each run's calls that wait for the device."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from _overhead_parts import NO_SPLIT, PLAIN, Sizing
    from elastic_overhead import profile_diff

    found = profile_diff(Sizing(steps=4, warmup=1, repeats=1, ddp_steps=2, ddp_warmup=1, ddp_repeats=1), "cpu", top=5)
    assert set(found["syncs"]) == {PLAIN.name, NO_SPLIT[1].name} and len(found["grew"]) == 5
    assert all(row["elastic_calls"] > 0 for row in found["grew"])  # each a name the callback's run has
    grew = [row["elastic_ms"] - row["plain_ms"] for row in found["grew"]]
    assert grew == sorted(grew, reverse=True)


def test_the_overhead_ratio_compares_runs_of_one_repeat_not_pooled_medians(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the H200 the host alternated between 5.2 and 7.0 ms steps from one repeat to the next: the callback was
    slower in every repeat, yet the pooled medians put it at 0.871x. The ratio is the median of per-repeat ratios."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from elastic_overhead import summarize

    def repeats(*medians: float) -> dict[str, list[list[float]]]:
        steps = [[m / 1e3] * 9 for m in medians]  # 9 timed steps per repeat (1 warm-up)
        return {"wall": steps, "cpu": steps}

    runs = {"plain": repeats(7.10, 5.32, 6.96, 5.18), "elastic": repeats(7.40, 5.49, 6.97, 5.48)}
    wall = summarize(runs, 1, "plain")["elastic"]["wall"]
    assert wall["ratio"] == pytest.approx((5.49 / 5.32 + 7.40 / 7.10) / 2)  # the middle two of four per-repeat ratios
    assert (round(wall["ratio_min"], 3), round(wall["ratio_max"], 3)) == (1.001, 1.058)
    assert wall["ratio"] > 1.01 and summarize(runs, 1, "plain")["plain"]["wall"]["ratio"] == 1.0


def test_the_where_report_sets_each_step_of_the_trial_like_fit_beside_the_fit_without_its_flop_count(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On an H200 a fit in the benchmark's process peaked at the estimate and the trial 3.6 GiB above it: the report
    puts each step's peak of a fit as the trial ran (fresh process, its steps, step 0's FLOPs counted) beside the
    same fit without the FLOP count, so one GPU run says whether the trial's own measuring adds to its peak."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from trial_vs_estimate import where_lines

    gib = 2**30
    where = {"steps": 3, "stacks": False, "failures": ["with stacks: SystemError: x"], "frees_without_alloc": 0,
             "trace_full": False, "peak_requested_bytes": 11 * gib, "max_memory_allocated": 11 * gib,
             "phase": "step 1, backward of micro-batch 1", "step_peaks": [11 * gib, 7 * gib, 7 * gib],
             "untraced_step_peaks": [7 * gib, 7 * gib, 7 * gib], "sites": [], "sizes": [(64 * 2**20, 25)],
             "floor_bytes": gib // 2, "untraced_floor_bytes": 0}
    text = where_lines("eager", where)
    assert "fitted as its trial: a fresh process, 3 steps, step 0's FLOPs counted, recorded without stacks" in text
    assert "lies in step 1, backward of micro-batch 1" in text
    assert "each step's max_memory_allocated (GiB): 11.00 7.00 7.00 (allocated before the fit: 0.50)\n" in text
    assert "without the FLOP count, untraced (GiB): 7.00 7.00 7.00 (allocated before the fit: 0.00)\n" in text
    assert "(recording with stacks: SystemError: x)" in text and "25 x 64.0 MiB" in text
    failed = {**where, "untraced_failure": "OutOfMemoryError: y"}
    del failed["untraced_step_peaks"]
    assert "without the FLOP count, untraced (GiB): failed: OutOfMemoryError: y\n" in where_lines("eager", failed)


def test_quick_on_a_gpu_runs_issue_47s_steps_first_inside_12_minutes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_check import TRIAL_MEMORY_TEST, steps

    quick = steps("cuda", True, ROOT)
    assert [s.name for s in quick[:3]] == ["trial against a plain run", "trial against estimate",
                                           "against the alternatives"]
    assert sum(s.timeout_s for s in quick[:3]) <= 12 * 60
    assert quick[0].command[-3:] == ["-m", "gpu", TRIAL_MEMORY_TEST]
    gpu_tests = next(s for s in quick if s.name == "gpu tests")
    assert f"--ignore={TRIAL_MEMORY_TEST}" in gpu_tests.command  # the first step ran it


def test_wheels_are_installed_into_the_site_and_the_checkout_editable_at_every_call(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A call may land on a fresh machine, where an earlier call's install is gone: ``--wheels`` installs at every
    call, before the check of what the steps import."""
    import subprocess as sp

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_check

    ran: list[list[str]] = []
    monkeypatch.setattr(sp, "run", lambda command, **kw: ran.append(command) or sp.CompletedProcess(command, 0, "", ""))
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.setattr(sys, "path", list(sys.path))
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    assert gpu_check.install_wheels(wheels, tmp_path / "site") == f"--wheels {wheels}: no .whl files there"
    for name in ("b-1.0-py3-none-any.whl", "a-2.0-py3-none-any.whl"):
        (wheels / name).write_bytes(b"")
    assert gpu_check.install_wheels(wheels, tmp_path / "site") is None
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-cache-dir"]
    assert ran == [[*pip, "--no-compile", "--upgrade", "--target", str(tmp_path / "site"),
                    str(wheels / "a-2.0-py3-none-any.whl"), str(wheels / "b-1.0-py3-none-any.whl")],
                   [*pip, "--no-build-isolation", "-e", str(ROOT)]]
    assert sys.path[0] == str(tmp_path / "site")
    assert os.environ["PYTHONPATH"] == f"{tmp_path / 'site'}{os.pathsep}/elsewhere"  # the steps see it too
    monkeypatch.setattr(sp, "run", lambda command, **kw: sp.CompletedProcess(command, 1, "", "ERROR: No matching "
                                                                             "distribution found for setuptools>=69"))
    assert gpu_check.install_wheels(wheels, tmp_path / "site") == (
        f"installing the 2 wheels of {wheels} failed: ERROR: No matching distribution found for setuptools>=69")
