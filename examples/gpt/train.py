"""Train the example GPT on synthetic tokens with LightningCLI and ``ElasticBatchSize``.

Run from the repository root::

    python examples/gpt/train.py fit --config examples/gpt/config.yaml

``make()`` builds the same small model and data in Python, for ``autotune search examples/gpt/train.py:make``.
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:  # so model.py and data.py import when this file is loaded by path, from anywhere
    sys.path.insert(0, _HERE)

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI  # noqa: E402
from typing_extensions import override  # noqa: E402

from data import SyntheticTokens  # noqa: E402
from model import GPT  # noqa: E402

#: The small configuration of ``config.yaml`` (kept equal to it by a test).
SMALL_MODEL = {"n_layer": 2, "n_head": 4, "n_embd": 64, "dropout": 0.0, "lr": 3e-3, "warmup_steps": 5}
SMALL_DATA = {"vocab_size": 256, "block_size": 32, "batch_size": 32, "seed": 0}


class GPTCLI(LightningCLI):
    """LightningCLI whose model takes ``vocab_size`` and ``block_size`` from the data, so the two cannot disagree."""

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.vocab_size", "model.vocab_size")
        parser.link_arguments("data.block_size", "model.block_size")


def make() -> tuple[GPT, SyntheticTokens]:
    """The small model and data of ``config.yaml``: the target of ``autotune search examples/gpt/train.py:make``.

    Example:
        >>> model, data = make()
        >>> model.tokens_per_sample, data.batch_size
        (32, 32)
    """
    data = SyntheticTokens(**SMALL_DATA)
    model = GPT(vocab_size=data.vocab_size, block_size=data.block_size, **SMALL_MODEL)
    return model, data


def main(args: list[str] | None = None) -> LightningCLI:
    """Run the CLI on ``args`` (``sys.argv[1:]`` when None) and return it, trainer and model included."""
    return GPTCLI(GPT, SyntheticTokens, args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
    import torch.distributed as dist

    if dist.is_initialized():  # several ranks on CPU (gloo): end the group before exit (docs/troubleshooting.md)
        dist.destroy_process_group()
