"""``benchmarks/gpu_check.py``: the one command a session with a GPU runs; its plumbing on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_runs_every_step_and_writes_its_report_on_the_cpu(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--quick", "--out",
                           str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    names = [s["name"] for s in report["steps"]]
    assert names == ["gpu tests", "whole suite with CUDA visible", "estimator accuracy",
                     "elastic overhead and one real OOM", "dynamic padding", "realistic search",
                     "against the alternatives"]
    assert all(s["status"] == "ok" for s in report["steps"]), [(s["name"], s["status"]) for s in report["steps"]]
    text = (tmp_path / "report.md").read_text()
    assert "driver: none (no NVIDIA driver)" in text and "| gpu tests | ok | 0 |" in text
    assert (tmp_path / "gpu-tests.xml").exists() and (tmp_path / "tuned.yaml").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the check would run for real")
def test_gpu_check_refuses_cuda_without_a_gpu_in_one_line() -> None:
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("gpu_check: --device cuda but torch sees no CUDA device; use --device cpu --quick "
                                   "for the plumbing")
