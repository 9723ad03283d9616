"""The suite's ``alone`` marker (tests/conftest.py): under pytest-xdist a marked test runs while no other test does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CONFTEST = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
from tests.conftest import _alone_where_marked  # noqa: F401
"""
_TIMED = """
import time, pytest
from pathlib import Path

def _spend(name):
    start = time.monotonic()
    time.sleep({seconds})
    with open(Path(__file__).with_name("spans.txt"), "a") as f:
        f.write(f"{{name}} {{start}} {{time.monotonic()}}\\n")
"""


def test_an_alone_test_overlaps_no_other_test_on_two_workers(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(_CONFTEST)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    alone: runs while no other test does\n")
    (tmp_path / "test_busy.py").write_text(_TIMED.format(seconds=0.3) + "".join(
        f"\ndef test_busy_{i}():\n    _spend('busy')\n" for i in range(8)))
    (tmp_path / "test_quiet.py").write_text(_TIMED.format(seconds=0.5) + (
        "\ndef test_before():\n    _spend('quiet')\n"
        "\n@pytest.mark.alone\ndef test_alone():\n    _spend('alone')\n"))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "-p",
                           "no:cacheprovider", "-c", str(tmp_path / "pytest.ini"), str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    spans = [(name, float(a), float(b)) for name, a, b in
             (line.split() for line in (tmp_path / "spans.txt").read_text().splitlines())]
    assert sorted(name for name, _, _ in spans) == ["alone", *["busy"] * 8, "quiet"]
    [(_, start, end)] = [s for s in spans if s[0] == "alone"]
    others = [s for s in spans if s[0] != "alone"]
    assert all(b <= start or a >= end for _, a, b in others), spans  # nothing ran beside it
    assert any(a < e and s < b for _, a, b in others for _, s, e in others if (a, b) != (s, e)), spans  # in parallel
