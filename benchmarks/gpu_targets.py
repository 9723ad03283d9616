"""Targets sized for a GPU, for ``benchmarks/gpu_check.py``'s realistic search (``autotune search
benchmarks/gpu_targets.py:gpt_350m``): the example GPT at about 350M parameters, context 1024."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

_GPT = str(Path(__file__).resolve().parents[1] / "examples" / "gpt")


def gpt_350m() -> tuple[Any, Any]:
    """The example GPT with 24 blocks of width 1024 (16 heads), context 1024, vocabulary 8192: 310M parameters;
    batches of 32 samples.

    Example:
        >>> model, data = gpt_350m()  # doctest: +SKIP
        >>> round(sum(p.numel() for p in model.parameters()) / 1e6)  # doctest: +SKIP
        321
    """
    if _GPT not in sys.path:
        sys.path.insert(0, _GPT)
    from data import SyntheticTokens  # type: ignore[import-not-found]
    from model import GPT  # type: ignore[import-not-found]

    data = SyntheticTokens(vocab_size=8192, block_size=1024, batch_size=32, num_samples=32 * 64, val_samples=64)
    model = GPT(vocab_size=8192, block_size=1024, n_layer=24, n_head=16, n_embd=1024, dropout=0.0, lr=3e-4,
                warmup_steps=5)
    return model, data
