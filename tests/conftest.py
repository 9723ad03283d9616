"""Options of the test suite (the fault fuzzer's scenario count and seed: tests/runtime/test_fuzz_ranks.py) and
shared fixtures."""

from __future__ import annotations

import pytest

from tests.support.choice import no_remeasurement


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fuzz-scenarios", type=int, default=0,
                     help="scenarios per strategy of the rank fault fuzzer (default: the CI's few)")
    parser.addoption("--fuzz-seed", type=int, default=0, help="the rank fault fuzzer's seed")


@pytest.fixture
def choice_without_remeasurement(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test's searches choose from their trials' own runs (:func:`tests.support.choice.no_remeasurement`)."""
    no_remeasurement(monkeypatch)
