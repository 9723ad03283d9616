"""Every shell command shown in the README and the docs runs (in a scratch folder, in the order shown), and prints
our output and Lightning's without noise: no third-party tip, no deprecation warning, no progress bar without its
total, no raw settings dict, no traceback."""

from __future__ import annotations

import functools
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").glob("*/README.md"))]
POSTGRES = os.environ.get("AUTOTUNE_TEST_POSTGRES")
#: What a documented command must not print (the first run of the README printed each of these once).
NOISE = {
    "a third-party tip (Lightning's litlogger advertisement)": re.compile(r"💡 Tip|litlogger"),
    "a deprecation warning": re.compile(r"(Future|Deprecation)Warning|is deprecated|will be removed"),
    "a progress bar without its total (Lightning's 'Epoch 0/-2' for max_epochs=-1)": re.compile(r"Epoch \d+/-\d"),
    "settings as a raw dict (a notice that is not a sentence)": re.compile(r"\w\{'\w+': "),
    "a traceback": re.compile(r"Traceback \(most recent call last\)"),
    "Optuna's report of a failed trial": re.compile(r"Trial \d+ failed"),
}


def commands(path: Path) -> list[str]:
    """The lines of the file's ```bash blocks; an install step before `&&` is what the test environment did."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.S):
        for line in block.splitlines():
            line = line.split("  #", 1)[0].strip()
            if not line or line.startswith("#"):
                continue
            parts = [p.strip() for p in line.split("&&")]
            parts = [p for p in parts if not p.startswith("pip install")]
            if parts and not any("pytest" in p for p in parts):
                found.append(" && ".join(parts))
    return found


def test_the_docs_show_commands() -> None:
    shown = {p.relative_to(ROOT).as_posix(): commands(p) for p in DOCS}
    assert shown["README.md"], "the README's main command is not found"
    assert any("autotune search" in c for cs in shown.values() for c in cs)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, set[str]]:
    """One scratch folder for every doc, as a reader who follows them one after another has, and the commands that
    ran there: a command shown again in a later doc (the quickstart repeats the README's) is not run twice (what it
    wrote, a tuned file or a study, is there for the commands after it)."""
    folder = tmp_path_factory.mktemp("docs")
    for name in ("examples", "tests", "benchmarks"):
        (folder / name).symlink_to(ROOT / name)
    return folder, set()


@pytest.mark.slow
@pytest.mark.parametrize("doc", [p for p in DOCS if commands(p)], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_doc_commands_run(doc: Path, scratch: tuple[Path, set[str]]) -> None:
    tmp_path, done = scratch
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    for shown in commands(doc):
        if shown in done:
            continue
        command = shown
        if command.startswith("python benchmarks/"):  # a run takes minutes: the script and its options are there
            script, *args = shlex.split(command)[1:]
            flags = {a.split("=")[0] for a in args if a.startswith("--")}
            taken = set(re.findall(r"(--[a-z][a-z0-9-]*)", _usage(script)))
            assert flags <= taken, f"{doc.name}: `{command}`: {script} does not take {sorted(flags - taken)}"
            choices = {f: c.split(",") for f, c in re.findall(r"(--[a-z][a-z0-9-]*) \{([^}]*)\}", _usage(script))}
            for flag, value in zip(args, args[1:]):
                assert value in choices.get(flag, [value]), f"{doc.name}: `{command}`: {flag} takes {choices[flag]}"
            done.add(shown)
            continue
        if "postgresql://" in command:
            if POSTGRES is None:
                continue  # needs a server; .ci/run starts one
            command = re.sub(r"postgresql://\S+", POSTGRES, command).replace("--study gpt-2gib",
                                                                              f"--study docs-{os.getpid()}")
        code, out, err = _run(command, cwd=tmp_path, env=env)
        if code is None:  # hung: once again, see _run
            code, out, err = _run(command, cwd=tmp_path, env=env)
        assert code == 0, f"{doc.name}: `{command}` failed:\n{err[-3000:]}"
        noise = [f"{what}: {line.strip()}" for line in (out + err).splitlines() for what, pattern in NOISE.items()
                 if pattern.search(line)]
        assert not noise, f"{doc.name}: `{command}` printed noise:\n" + "\n".join(noise)
        if doc == ROOT / "README.md" and command == commands(doc)[0]:
            _review_first_run(out + err)
        done.add(shown)


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


@functools.cache
def _usage(script: str) -> str:
    """``python script --help`` (once per script: several docs' commands show one script with other options)."""
    proc = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{script} --help failed:\n{proc.stderr[-3000:]}"
    return proc.stdout


def _run(command: str, *, cwd: Path, env: dict[str, str], timeout: float = 300) -> tuple[int | None, str, str]:
    """Run a shell command in a session of its own; past ``timeout`` kill the whole session (the shell's children
    too: killing the shell alone leaves them holding its pipes) and return ``(None, stderr)``. A command that hangs
    is run once more by the caller: before Python 3.12 a dataloader worker forked from a DDP rank can hang for good
    at its start when a gloo thread of the rank held the interpreter's thread-list lock at that moment (CPython
    gh-112275; seen once here, in the DDP example's tuned run with 2 workers, in about twenty full runs). Returns the
    exit status, stdout and stderr."""
    proc = subprocess.Popen(command, shell=True, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return None, out, f"timed out after {timeout:.0f} s\n{err}"


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
