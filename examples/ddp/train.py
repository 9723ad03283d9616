"""Train the example MLP with DDP on 2 CPU processes (or GPUs), LightningCLI and ``ElasticBatchSize``.

Run from the repository root::

    python examples/ddp/train.py fit --config examples/ddp/config.yaml

``make()`` builds the same small model and data in Python, for
``autotune search examples/ddp/train.py:make --space multi_gpu --devices 2``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from typing_extensions import override


def _sibling(name: str) -> ModuleType:
    """``name``.py next to this file, imported under the unique name ``autotune_example_ddp_<name>``.

    Not a plain ``import model``: examples/gpt has a ``model.py`` and a ``data.py`` too, and a process that loads
    both examples (a test session, a search over several targets) would get the first one's modules for both.
    """
    qualified = f"autotune_example_ddp_{name}"
    if qualified not in sys.modules:
        spec = importlib.util.spec_from_file_location(qualified, Path(__file__).resolve().with_name(f"{name}.py"))
        assert spec is not None and spec.loader is not None  # the file ships next to this one
        module = importlib.util.module_from_spec(spec)
        sys.modules[qualified] = module  # before running it, as ``import`` does (typing and pickling look it up)
        spec.loader.exec_module(module)
    return sys.modules[qualified]


SyntheticClasses = _sibling("data").SyntheticClasses
MLPClassifier = _sibling("model").MLPClassifier

#: The small configuration of ``config.yaml`` (kept equal to it by a test).
SMALL_MODEL = {"width": 128, "depth": 4, "expansion": 4, "lr": 3e-3}
SMALL_DATA = {"features": 32, "num_classes": 8, "batch_size": 64, "seed": 0}


class MLPCLI(LightningCLI):
    """LightningCLI whose model takes ``in_features`` and ``num_classes`` from the data, so they cannot disagree."""

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.features", "model.in_features")
        parser.link_arguments("data.num_classes", "model.num_classes")


def make() -> tuple[MLPClassifier, SyntheticClasses]:
    """The small model and data of ``config.yaml``: the target of ``autotune search examples/ddp/train.py:make``.

    Example:
        >>> model, data = make()
        >>> len(model.blocks), data.batch_size
        (4, 64)
    """
    data = SyntheticClasses(**SMALL_DATA)
    model = MLPClassifier(in_features=data.features, num_classes=data.num_classes, **SMALL_MODEL)
    return model, data


def main(args: list[str] | None = None) -> LightningCLI:
    """Run the CLI on ``args`` (``sys.argv[1:]`` when None) and return it, trainer and model included.

    With ``strategy: ddp`` Lightning starts the other ranks by running this script again with the same arguments,
    so call it from a script (``python examples/ddp/train.py ...``), not from an interactive session.
    """
    return MLPCLI(MLPClassifier, SyntheticClasses, args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
