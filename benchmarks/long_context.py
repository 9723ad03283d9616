"""The GPT example at a four times longer context (128 tokens, the same model and batch): a search target whose
plans' peaks lie MiBs apart on the CPU (about 2 MiB per sample of the micro-batch, against the example's 0.7), well
above the few hundred KiB by which one plan's resident set varies between runs. ``search_quality.py --target long``
uses it where the example's own plans sit too close to the budget to tell a fit from noise.

Target: ``benchmarks/long_context.py:make``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

_GPT = str(Path(__file__).resolve().parents[1] / "examples" / "gpt")
if _GPT not in sys.path:
    sys.path.insert(0, _GPT)

#: The example's context, four times longer; the rest as the example's ``make``.
BLOCK_SIZE = 128


def make() -> tuple[Any, Any]:
    """The GPT example's model and data at ``BLOCK_SIZE`` tokens per sample.

    Example:
        >>> model, data = make()
        >>> model.tokens_per_sample, data.batch_size
        (128, 32)
    """
    from data import SyntheticTokens  # type: ignore[import-not-found]
    from model import GPT  # type: ignore[import-not-found]
    from train import SMALL_DATA, SMALL_MODEL  # type: ignore[import-not-found]

    data = SyntheticTokens(**{**SMALL_DATA, "block_size": BLOCK_SIZE})
    return GPT(vocab_size=data.vocab_size, block_size=data.block_size, **SMALL_MODEL), data
