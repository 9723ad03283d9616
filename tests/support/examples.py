"""The bundled examples' ``train.py`` loaded by path in a test, and the one-thread setting their tests run under."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_example(name: str) -> ModuleType:
    """``examples/<name>/train.py`` loaded by path, as ``autotune search examples/<name>/train.py:make`` would."""
    spec = importlib.util.spec_from_file_location(f"{name}_example_train", EXAMPLES / name / "train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny models run fastest on one thread, and timing stays steady when other processes share the CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
