"""Every shell command shown in the README and the docs runs (in a scratch folder, in the order shown), and prints
our output and Lightning's without noise: no third-party tip, no deprecation warning, no progress bar without its
total, no raw settings dict, no traceback. An example's README whose test examines what its commands wrote is run by
that test (``RUN_BY_EXAMPLE_TESTS``), with the same helper (tests/support/docs.py)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tests.support.docs import commands, run_documented, scratch_folder

ROOT = Path(__file__).resolve().parents[2]
#: An example's README is run by that example's test, which then examines the study and tuned file its commands
#: wrote (running them here as well would run each search twice).
RUN_BY_EXAMPLE_TESTS = {ROOT / "examples" / "ddp" / "README.md": ROOT / "tests" / "e2e" / "test_ddp_example.py"}
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").glob("*/README.md"))]


def test_the_docs_show_commands() -> None:
    shown = {p.relative_to(ROOT).as_posix(): commands(p) for p in DOCS}
    assert shown["README.md"], "the README's main command is not found"
    assert any("autotune search" in c for cs in shown.values() for c in cs)


def test_an_example_readme_left_to_its_test_is_run_there() -> None:
    for doc, test in RUN_BY_EXAMPLE_TESTS.items():
        assert commands(doc) and f'run_documented(EXAMPLE / "README.md"' in test.read_text(), (doc, test)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, set[str]]:
    """One scratch folder for every doc, as a reader who follows them one after another has, and the commands that
    ran there: a command shown again in a later doc (the quickstart repeats the README's) is not run twice (what it
    wrote, a tuned file or a study, is there for the commands after it)."""
    return scratch_folder(tmp_path_factory.mktemp("docs")), set()


@pytest.mark.slow
@pytest.mark.parametrize("doc", [p for p in DOCS if commands(p) and p not in RUN_BY_EXAMPLE_TESTS],
                         ids=lambda p: p.relative_to(ROOT).as_posix())
def test_doc_commands_run(doc: Path, scratch: tuple[Path, set[str]]) -> None:
    folder, done = scratch
    outputs = run_documented(doc, cwd=folder, done=done)
    first = commands(doc)[0]
    if doc == ROOT / "README.md" and first in outputs:
        _review_first_run(outputs[first])


def _review_first_run(output: str) -> None:
    """The README's first command prints the search's lines, then Lightning's run with the tuned plan: the notice that
    the tuned file's ElasticBatchSize runs in place of the config's, as a sentence, and a progress bar with its total."""
    lines = output.splitlines()
    assert any(re.match(r"best plan \(trial \d+ of study 'autotune-gpt-train\.py:make-2GiB-cpu-cpu'\): ", x) for x in lines)
    assert "wrote tuned.yaml: python train.py fit --config your_config.yaml --config tuned.yaml" in lines
    assert ("ElasticBatchSize: the later one in the callbacks (budget 2GiB, micro-batch ") in output
    assert "runs in place of this one (no budget, micro-batch 8, growing after 10 clean steps)." in output
    assert re.search(r"Epoch 0/0 +\S+ 30/30 ", output), output[-2000:]
    assert "`Trainer.fit` stopped: `max_epochs=1` reached." in lines


def test_the_readme_starts_with_the_two_commands() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    block = lines[lines.index("```bash") + 1 : lines.index("```bash") + 3]
    assert block[0].startswith("pip install torch==2.13.0 -e . && ") and "autotune search" in block[0]
    assert block[1] == 'pip install torch==2.13.0 -e ".[test]" && python -m pytest -q'
    assert shlex.split(block[1])  # well-formed shell


def test_api_reference_is_current() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_api", ROOT / "docs" / "make_api.py")
    assert spec is not None and spec.loader is not None
    make_api = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_api)
    assert (ROOT / "docs" / "api.md").read_text() == make_api.render(), "run: python docs/make_api.py"
