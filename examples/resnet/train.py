"""Train the example ResNet on synthetic images with LightningCLI and ``ElasticBatchSize``.

Run from the repository root::

    python examples/resnet/train.py fit --config examples/resnet/config.yaml

``make()`` builds the same small model and data in Python, for ``autotune search examples/resnet/train.py:make``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from typing_extensions import override


def _sibling(name: str) -> ModuleType:
    """``name``.py next to this file, imported under the unique name ``autotune_example_resnet_<name>``.

    Not a plain ``import model``: examples/gpt has a ``model.py`` and a ``data.py`` too, and a process that loads
    both examples (a test session, a search over several targets) would get the first one's modules for both.
    """
    qualified = f"autotune_example_resnet_{name}"
    if qualified not in sys.modules:
        spec = importlib.util.spec_from_file_location(qualified, Path(__file__).resolve().with_name(f"{name}.py"))
        assert spec is not None and spec.loader is not None  # the file ships next to this one
        module = importlib.util.module_from_spec(spec)
        sys.modules[qualified] = module  # before running it, as ``import`` does (typing and pickling look it up)
        spec.loader.exec_module(module)
    return sys.modules[qualified]


SyntheticImages = _sibling("data").SyntheticImages
ResNet = _sibling("model").ResNet

#: The small configuration of ``config.yaml`` (kept equal to it by a test).
SMALL_MODEL = {"widths": (16, 32, 64), "blocks_per_stage": 2, "groups": 8, "lr": 1e-2, "warmup_steps": 5}
SMALL_DATA = {"num_classes": 10, "channels": 3, "image_size": 16, "batch_size": 64, "max_shift": 2, "seed": 0}


class ResNetCLI(LightningCLI):
    """LightningCLI whose model takes ``num_classes`` and ``in_channels`` from the data, so they cannot disagree."""

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.num_classes", "model.num_classes")
        parser.link_arguments("data.channels", "model.in_channels")


def make() -> tuple[ResNet, SyntheticImages]:
    """The small model and data of ``config.yaml``: the target of ``autotune search examples/resnet/train.py:make``.

    Example:
        >>> model, data = make()
        >>> len(model.blocks), data.batch_size
        (6, 64)
    """
    data = SyntheticImages(**SMALL_DATA)
    model = ResNet(num_classes=data.num_classes, in_channels=data.channels, **SMALL_MODEL)
    return model, data


def main(args: list[str] | None = None) -> LightningCLI:
    """Run the CLI on ``args`` (``sys.argv[1:]`` when None) and return it, trainer and model included."""
    return ResNetCLI(ResNet, SyntheticImages, args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
