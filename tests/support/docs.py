"""The shell commands a Markdown file shows, run as a reader runs them: in a scratch folder, in the order shown, each
printing our output and Lightning's without noise (tests/e2e/test_docs.py runs the README's and the docs'; an
example's README is run by that example's own test, which then examines what its commands wrote)."""

from __future__ import annotations

import functools
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
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


def scratch_folder(folder: Path) -> Path:
    """``folder`` made a reader's working copy: the repository's examples, tests and benchmarks linked into it."""
    for name in ("examples", "tests", "benchmarks"):
        (folder / name).symlink_to(ROOT / name)
    return folder


def run_documented(doc: Path, *, cwd: Path, done: set[str] | None = None) -> dict[str, str]:
    """Run ``doc``'s commands in ``cwd`` (a :func:`scratch_folder`), skipping those in ``done`` (a command shown
    again in a later doc is not run twice: what it wrote is there for the commands after it) and adding the ones run.
    A benchmark's command is checked against its ``--help`` (a run takes minutes); a PostgreSQL one runs where
    ``AUTOTUNE_TEST_POSTGRES`` names a server. Asserts each exits 0 without noise; returns each one's output."""
    done = set() if done is None else done
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    outputs = {}
    for shown in commands(doc):
        if shown in done:
            continue
        command = shown
        if command.startswith("python benchmarks/"):
            _check_benchmark_options(doc, command)
            done.add(shown)
            continue
        if "postgresql://" in command:
            if POSTGRES is None:
                continue  # needs a server; .ci/run starts one
            command = re.sub(r"postgresql://\S+", POSTGRES, command).replace("--study gpt-2gib",
                                                                              f"--study docs-{os.getpid()}")
        code, out, err = _run(command, cwd=cwd, env=env)
        if code is None:  # hung: once again, see _run
            code, out, err = _run(command, cwd=cwd, env=env)
        assert code == 0, f"{doc.name}: `{command}` failed:\n{err[-3000:]}"
        noise = [f"{what}: {line.strip()}" for line in (out + err).splitlines() for what, pattern in NOISE.items()
                 if pattern.search(line)]
        assert not noise, f"{doc.name}: `{command}` printed noise:\n" + "\n".join(noise)
        outputs[shown] = out + err
        done.add(shown)
    return outputs


def _check_benchmark_options(doc: Path, command: str) -> None:
    script, *args = shlex.split(command)[1:]
    flags = {a.split("=")[0] for a in args if a.startswith("--")}
    taken = set(re.findall(r"(--[a-z][a-z0-9-]*)", _usage(script)))
    assert flags <= taken, f"{doc.name}: `{command}`: {script} does not take {sorted(flags - taken)}"
    choices = {f: c.split(",") for f, c in re.findall(r"(--[a-z][a-z0-9-]*) \{([^}]*)\}", _usage(script))}
    for flag, value in zip(args, args[1:]):
        assert value in choices.get(flag, [value]), f"{doc.name}: `{command}`: {flag} takes {choices[flag]}"


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
