import json
import subprocess
import sys

import psutil
import pytest
import torch

import autotune
from autotune._device.budget import format_bytes
from autotune._cli.main import main

KEYS = {
    "device",
    "name",
    "total_bytes",
    "free_bytes",
    "process_reserved_bytes",
    "process_allocated_bytes",
    "other_processes_bytes",
}


def test_probe_prints_an_aligned_table(capsys):
    assert main(["probe", "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    lines = out.splitlines()
    labels = [line.split("  ")[0] for line in lines]
    assert labels == ["device", "name", "total", "free", "process reserved", "process allocated", "other processes"]
    values = {label: line[len(label) :] for label, line in zip(labels, lines)}
    assert len({len(line) - len(value.lstrip()) for line, value in zip(lines, values.values())}) == 1  # one column
    assert values["device"].strip() == "cpu"
    assert values["total"].strip() == format_bytes(psutil.virtual_memory().total)
    assert values["free"].strip().endswith("iB")


def test_probe_json_has_every_field_with_bytes_as_ints(capsys):
    assert main(["probe", "--device", "cpu", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) == KEYS
    assert data["device"] == "cpu"
    assert data["total_bytes"] == psutil.virtual_memory().total
    assert all(isinstance(data[key], int) for key in KEYS if key.endswith("_bytes"))


@pytest.mark.parametrize(
    ("device", "shown"),
    [("gpu", "device must be 'cpu', 'cuda', 'cuda:N' or a CUDA index N; got 'gpu'"), ("mps", "device 'mps' is not")],
)
def test_bad_device_is_a_one_line_usage_error(capsys, device, shown):
    assert main(["probe", "--device", device]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"autotune: error: {shown}")
    assert err.count("\n") == 1
    assert "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_without_cuda_is_a_usage_error(capsys):
    assert main(["probe", "--device", "cuda:0", "--json"]) == 2
    err = capsys.readouterr().err
    assert err == "autotune: error: device 'cuda:0' does not exist: CUDA is not available on this machine; use 'cpu'\n"


def test_digit_device_means_a_cuda_index(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert main(["probe", "--device", "4"]) == 2
    assert capsys.readouterr().err.startswith("autotune: error: device 4 does not exist: 1 CUDA device(s) visible")


def test_no_subcommand_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("usage: autotune")
    assert "probe" in err


def test_unknown_option_exits_2(capsys):
    assert main(["probe", "--bogus"]) == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"autotune {autotune.__version__}\n"


def test_python_dash_m_autotune_runs_the_cli():
    result = subprocess.run(
        [sys.executable, "-m", "autotune", "probe", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert set(data) == KEYS
    if torch.cuda.is_available():  # the default device; a fresh process has reserved nothing on it yet
        assert data["device"].startswith("cuda:") and data["total_bytes"] >= data["free_bytes"] > 0
    else:  # the host: the process's own memory
        assert data["device"] == "cpu" and data["process_reserved_bytes"] > 0


def test_python_dash_m_autotune_reports_errors_without_traceback():
    result = subprocess.run(
        [sys.executable, "-m", "autotune", "probe", "--device", "gpu"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith("autotune: error: device must be")
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["estimate", "--help"], ["estimate"],
                                  ["search", "x.py:make", "--budget", "2XB"], ["report", "--help"]])
def test_help_version_and_argument_errors_import_neither_torch_nor_optuna(argv):
    # they answer at once: torch, Lightning and Optuna are imported only where a command needs them
    code = ("import sys; from autotune._cli.main import main; code = main(sys.argv[1:]); "
            "print(sorted(m for m in ('torch', 'lightning', 'optuna') if m in sys.modules), code)")
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60)
    assert proc.stdout.splitlines()[-1].startswith("[] "), (proc.stdout[-500:], proc.stderr[-500:])


@pytest.mark.parametrize("width", [60, 80, 110])
def test_the_search_progress_line_keeps_its_counter_and_fits_the_terminal(width):
    import io

    from rich.console import Console

    from autotune._cli.search import _Progress

    buf = io.StringIO()
    progress = _Progress(10, console=Console(file=buf, width=width, force_terminal=False))
    progress.progress.update(progress.task, completed=3, description="2 feasible | best 1125.3/s (32-true, micro 16, "
                             "ckpt 0.5, workers 1) | last bf16-mixed, micro 8: ok")
    progress.progress.start()
    progress.progress.refresh()
    progress.progress.stop()
    line = buf.getvalue().splitlines()[-1]
    assert line.startswith("trial  3/10 ") and len(line) <= width and line.endswith("…")


@pytest.mark.parametrize("argv, message", [
    (["search", "x.py:make", "--budget", "-1GiB"], "budget must be bytes like '20GiB', '512MiB' or 4294967296, a "
     "fraction of total memory in (0, 1] like 0.8, or 'auto'; got '-1GiB'"),
    (["estimate", "x.py:make", "--device-memory", "-3GiB"], "--device-memory must be a size like 80GiB, 24GB or a "
     "number of bytes; got '-3GiB'"),
    (["search", "x.py:make", "--budget", "1GiB", "--trials", "-3"], "trials must be an int >= 1; got -3"),
])
def test_a_value_that_starts_with_a_dash_gets_our_message_not_argparses(argv, message, capsys):
    # argparse alone reads '-1GiB' as an option and answers "expected one argument"
    assert main(argv) == 2
    assert capsys.readouterr().err == f"autotune: error: {message}\n"


@pytest.mark.parametrize("argv, message", [
    (["search", "x.py:make", "--budget", "2GiB", "--interval", "1.5"],
     "argument --interval: must be a number between 0 and 1 (0.03: +-3%); got '1.5'; see autotune search --help"),
    (["estimate", "x.py:make", "--trace", "bogus"],
     "argument --trace: invalid choice: 'bogus' (choose from 'auto', 'fake', 'real'); see autotune estimate --help"),
    (["search", "x.py:make", "--budget", "2GiB", "--trials", "many"],
     "argument --trials: invalid int value: 'many'; see autotune search --help"),
    (["search", "x.py:make"], "the following arguments are required: --budget; see autotune search --help"),
])
def test_an_argument_argparse_refuses_is_one_line_with_what_is_accepted(argv, message, capsys):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"autotune: error: {message}\n"  # no usage text


@pytest.mark.parametrize("argv, patched", [
    (["probe", "--device", "cpu"], "autotune._device.probe.probe_memory"),
    (["estimate", "x.py:make", "--device", "cpu", "--budget", "2GiB"], "autotune._target.target.load_target"),
    (["suggest", "x.py:make", "--device", "cpu", "--budget", "2GiB"], "autotune._target.target.load_target"),
    (["search", "x.py:make", "--device", "cpu", "--budget", "2GiB"], "autotune._target.target.load_target"),
    (["report", "--storage", "sqlite:///none.db"], "autotune._search.report.load_study"),
])
def test_every_verb_reports_a_setting_lightning_refuses_in_one_line(argv, patched, capsys, monkeypatch, tmp_path):
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    def refuses(*args, **kwargs):
        raise MisconfigurationException("`Trainer(strategy='fsdp')` requires a GPU\naccelerator")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(patched, refuses)
    assert main(argv) == 2
    assert capsys.readouterr().err.splitlines()[-1] == ("autotune: error: `Trainer(strategy='fsdp')` requires a GPU "
                                                        "accelerator")
