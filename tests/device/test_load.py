"""What a measurement ran beside: this run's own process tree counts as its own CPU, other processes as its
neighbours' (autotune/_device/load.py)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from autotune._device.load import LoadWindow, busy, load_differs

_SPIN = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end: pass\n"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_spinning_child_is_this_run_s_own_work_and_another_process_a_neighbour() -> None:
    # our child spins while we sleep: its CPU is the run's own (the trial's DataLoader workers, its ranks), while it
    # runs and once it has ended and been waited for
    for alive in (True, False):
        window = LoadWindow()
        window.start()
        child = subprocess.Popen([sys.executable, "-c", _SPIN.format(seconds=3.0 if alive else 1.5)])
        if alive:
            time.sleep(1.5)
        else:
            child.wait()
        own = window.stop()
        child.kill()
        child.wait()
        assert own.cpu_per_wall is not None and own.cpu_per_wall > 0.3, (alive, own)  # a share of a core, at least
        assert own.cores >= 1 and own.neighbour_cores is not None and own.runnable is not None

    # the same spinning process, now outside the measured tree (another root: a process that is not our parent)
    other = subprocess.Popen([sys.executable, "-c", _SPIN.format(seconds=2.0)])
    try:
        time.sleep(0.3)  # its interpreter has started
        window = LoadWindow(root=other.pid + 10**7)  # a root that is no process: nothing of this host is "own"
        window.start()
        time.sleep(1.0)
        seen = window.stop()
    finally:
        other.wait()
    assert seen.cpu_per_wall is None  # no own process could be read
    assert seen.neighbour_cores is not None and seen.neighbour_cores > 0.3, seen  # the spinner, at least


def test_a_busy_host_and_unlike_loads_are_told_by_the_neighbours_share_of_the_cores() -> None:
    quiet, busy_ = {"neighbour_cores": 0.1, "cores": 4}, {"neighbour_cores": 1.6, "cores": 4}
    assert busy(busy_) and not busy(quiet) and not busy(None)
    assert busy({"neighbour_cores": 0.0, "cores": 4, "steal": 0.3})  # a hypervisor taking as much
    assert load_differs(quiet, busy_) and not load_differs(quiet, {"neighbour_cores": 0.5, "cores": 4})
    assert not load_differs(quiet, None)  # unknown: taken as alike
