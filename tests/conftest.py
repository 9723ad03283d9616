"""Options of the test suite (the fault fuzzer's scenario count and seed: tests/runtime/test_fuzz_ranks.py), how it
shares the CPU, and shared fixtures.

The suite runs on two pytest-xdist workers (pyproject's ``addopts``: ``-n 2 --dist loadfile``, a file's tests on one
worker; ``-n 0`` runs it in one process). So that two processes share 2 cores without waste, OpenMP's threads wait
passively (``OMP_WAIT_POLICY``, set here for the workers and every process they start, unless already set): spinning
threads burn the core the other worker needs (with them spinning the suite took longer on two workers than on one).
A test marked ``alone`` runs while no other test does: its figures (a paced step's time, a trial's throughput) are
what a busy neighbour skews.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP, here and in the workers

import pytest  # noqa: E402

from tests.support.choice import no_remeasurement  # noqa: E402


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fuzz-scenarios", type=int, default=0,
                     help="scenarios per strategy of the rank fault fuzzer (default: the CI's few)")
    parser.addoption("--fuzz-seed", type=int, default=0, help="the rank fault fuzzer's seed")


@pytest.fixture
def choice_without_remeasurement(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test's searches choose from their trials' own runs (:func:`tests.support.choice.no_remeasurement`)."""
    no_remeasurement(monkeypatch)


@pytest.fixture(autouse=True)
def _alone_where_marked(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Under pytest-xdist, a test marked ``alone`` holds the run's lock exclusively, every other test shared (the
    lock is a file in the folder above the workers' temporary folders).

    A turnstile keeps the exclusive one from waiting forever: every test passes it on its way in, and the exclusive
    one holds it while it waits for the tests running to end (no new one starts meanwhile)."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:  # one process: nothing else runs
        yield
        return
    folder = tmp_path_factory.getbasetemp().parent
    with open(folder / "autotune-tests.gate", "a") as gate, open(folder / "autotune-tests.lock", "a") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if request.node.get_closest_marker("alone") else fcntl.LOCK_SH)
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
