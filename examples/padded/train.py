"""Train a small LM on dynamically padded batches with ``ElasticBatchSize`` splitting each step by its shape.

Run from the repository root::

    python examples/padded/train.py fit --config examples/padded/config.yaml

``make()`` builds the same model and data in Python, for ``autotune search examples/padded/train.py:make``.
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:  # so padded_model.py and padded_data.py import when this file is loaded by path
    sys.path.insert(0, _HERE)

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI  # noqa: E402
from typing_extensions import override  # noqa: E402

from padded_data import PaddedTokens  # noqa: E402
from padded_model import PaddedLM  # noqa: E402

#: The configuration of ``config.yaml`` (kept equal to it by a test).
SMALL_MODEL = {"width": 64, "heads": 4, "layers": 2, "dropout": 0.0, "lr": 3e-3}
SMALL_DATA = {"vocab_size": 256, "batch_size": 32, "short": 16, "longest": 128, "num_samples": 1024, "seed": 0}


class PaddedCLI(LightningCLI):
    """LightningCLI whose model takes ``vocab_size`` from the data."""

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.vocab_size", "model.vocab_size")


def make() -> tuple[PaddedLM, PaddedTokens]:
    """The model and data of ``config.yaml``.

    Example:
        >>> model, data = make()
        >>> data.batch_size, data.longest // data.short
        (32, 8)
    """
    data = PaddedTokens(**SMALL_DATA)
    return PaddedLM(vocab_size=data.vocab_size, **SMALL_MODEL), data


def main(args: list[str] | None = None) -> LightningCLI:
    """Run the CLI on ``args`` (``sys.argv[1:]`` when None) and return it, trainer and model included."""
    return PaddedCLI(PaddedLM, PaddedTokens, args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
    import torch.distributed as dist

    if dist.is_initialized():  # several ranks on CPU (gloo): end the group before exit (docs/troubleshooting.md)
        dist.destroy_process_group()
