"""Options of the test suite: the fault fuzzer's scenario count and seed (tests/runtime/test_fuzz_ranks.py)."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fuzz-scenarios", type=int, default=0,
                     help="scenarios per strategy of the rank fault fuzzer (default: the CI's few)")
    parser.addoption("--fuzz-seed", type=int, default=0, help="the rank fault fuzzer's seed")
