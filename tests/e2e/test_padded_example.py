"""The padded-LM example (examples/padded): its docstrings' examples, and its config against ``make()``'s settings.

Run in a fresh process, as a user runs it from its folder.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "padded"


def _python(*args: str) -> str:
    proc = subprocess.run([sys.executable, *args], cwd=EXAMPLE, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_the_examples_in_the_docstrings_hold() -> None:
    _python("-m", "doctest", "padded_data.py", "padded_model.py", "train.py")


def test_config_yaml_is_make_settings_and_batches_vary_in_length() -> None:
    out = _python("-c", "import json, train; m, d = train.make(); d.setup('fit'); "
                  "lengths = sorted({b['input_ids'].shape[1] for b in d.train_dataloader()}); "
                  "print(json.dumps([train.SMALL_MODEL, train.SMALL_DATA, lengths]))")
    model, data, lengths = json.loads(out)
    config = yaml.safe_load((EXAMPLE / "config.yaml").read_text())
    assert {k: config["model"][k] for k in model} == model
    assert config["data"] == data
    assert len(lengths) > 10 and max(lengths) >= 4 * min(lengths)  # dynamic padding: the batches' lengths vary
