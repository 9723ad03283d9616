"""Start test ranks by forking them from servers that imported torch and Lightning once per test session
(``zygote_server.py``), instead of a cold ``python`` that imports them again (4-5 s of CPU per rank).

One server per rank index, started at the first run that needs it and ended with the session (its input closes), so
ranks of one run differ in what a process draws once at its start (the hash seed of ``str``, as under torchrun).
``autotune`` and the test scripts are never imported in a server: each rank imports them from the files as they are.
A run whose environment differs from the server's in a variable read when a process starts (:data:`START_TIME`)
cannot be forked from it: :func:`can_fork` says so, and the caller starts that run cold.
``AUTOTUNE_TEST_COLD_RANKS=1`` starts every run cold (to compare).

What still differs from a cold start: a rank's parent is its server, not the test session; its command line and
``sys.orig_argv`` are the server's; its stdin is /dev/null (a cold rank has the session's, /dev/null under pytest's
capture); an uncaught exception's traceback shows the server's frames above runpy's; what the imports print or warn
went to the server's log, once; the imported objects sit in gc's permanent generation (``gc.freeze``: a rank's
collections skip them, and its exit does not collect them); rank r has the same hash seed in every run of a session.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import tempfile
from pathlib import Path

SERVER = Path(__file__).with_name("zygote_server.py")
#: Runs the server file as ``python -c`` runs a command (``sys.path`` starts with ``''``, as a cold rank's).
_START = "import sys; exec(compile(open(sys.argv[1]).read(), sys.argv[1], 'exec'))"
#: A rank's own variables (run_ranks sets them): the server never had them, and what its imports computed from
#: them is recomputed in the rank (``zygote_server._recompute_rank_globals``).
RANK_VARIABLES = frozenset({"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "NODE_RANK", "LOCAL_RANK"})
#: Prefixes of variables that take effect when a process starts, not when it runs: the interpreter's (PYTHON*),
#: glibc's (MALLOC_*, GLIBC_TUNABLES, LD_*), OpenMP's and BLAS's thread pools, torch's (read by its C++ side and by
#: its modules at import), CUDA's, the locale, and the folders that libraries resolve once at import (tempfile's
#: TMPDIR, HOME, XDG_*).
START_TIME = ("PYTHON", "MALLOC_", "GLIBC_TUNABLES", "LD_", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "TORCH",
              "PYTORCH_", "CUDA_", "CUBLAS_", "NVIDIA_", "LANG", "LC_", "TMPDIR", "TEMP", "TMP", "HOME", "XDG_")

_servers: dict[int, _Server] = {}  # by rank index; used from one thread (the test session's)


def can_fork(envs: list[dict[str, str]]) -> bool:
    """Whether ranks with environments ``envs`` (rank 0's first) can be forked from their servers (started here, all
    at once, where not yet running): each differs from its server's only in rank variables and in variables read
    after a process started. False when ``AUTOTUNE_TEST_COLD_RANKS=1``."""
    if os.environ.get("AUTOTUNE_TEST_COLD_RANKS", "") not in ("", "0"):
        return False
    for index in range(len(envs)):
        if index not in _servers:
            _servers[index] = _Server()
    return all(_servers[index].takes(env) for index, env in enumerate(envs))


def fork(argv: list[str], *, index: int, env: dict[str, str], out: Path, err: Path) -> Rank:
    """Rank ``index``: ``python *argv`` forked from its server, with ``env`` and its output in ``out`` and ``err``
    (:func:`can_fork` said yes)."""
    server = _servers[index]
    request = {"op": "start", "argv": [os.fspath(a) for a in argv], "env": env, "cwd": os.getcwd(),
               "out": str(out), "err": str(err)}
    return Rank(server, server.start(request))


class Rank:
    """A forked rank, with the part of ``subprocess.Popen`` that run_ranks uses (its server reaps it)."""

    def __init__(self, server: _Server, pid: int) -> None:
        self.server, self.pid, self.returncode = server, pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid, block=False)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid, block=True)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            self.server.send({"op": "signal", "pid": self.pid, "signal": int(sig)})

    def kill(self) -> None:
        """SIGKILL to the rank and every process of its group (its dataloader workers)."""
        if self.poll() is None:
            self.server.send({"op": "kill", "pid": self.pid})


class _Server:
    """One running ``zygote_server.py``: requests on its stdin, answers read from a pipe of ours."""

    def __init__(self) -> None:
        self.owner, self.env = os.getpid(), dict(os.environ)
        self.log = tempfile.NamedTemporaryFile(prefix="autotune-zygote-", suffix=".log")  # the server's own output
        answers, theirs = os.pipe()
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", _START, str(SERVER), str(theirs)], env=self.env,
                                         stdin=subprocess.PIPE, stdout=self.log, stderr=self.log, pass_fds=(theirs,))
        finally:
            os.close(theirs)
        self.answers, self.pending, self.started, self.exits = answers, b"", [], {}
        self.set_by_imports: dict[str, str] | None = None  # once the server has imported

    def takes(self, env: dict[str, str]) -> bool:
        """Whether a rank with environment ``env`` started from this server is as one started cold (see
        :func:`can_fork`); waits for the server's imports."""
        while self.set_by_imports is None:
            message = self._next(block=True)
            if "ready" in message:
                self.set_by_imports = message["set_by_imports"]
        for name in set(env) | set(self.env):
            value = env.get(name)
            if name in RANK_VARIABLES or value == self.env.get(name) or value == self.set_by_imports.get(name):
                continue
            if name.startswith(START_TIME):
                return False
        return True

    def start(self, request: dict) -> int:
        self.send(request)
        while not self.started:
            self._dispatch(self._next(block=True))
        return self.started.pop(0)

    def exit_code(self, pid: int, *, block: bool) -> int | None:
        while pid not in self.exits:
            message = self._next(block=block)
            if message is None:
                return None
            self._dispatch(message)
        return self.exits.pop(pid)

    def send(self, request: dict) -> None:
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise self._died() from None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # the server kills what is left of its ranks and exits
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        os.close(self.answers)
        self.log.close()

    def _dispatch(self, message: dict) -> None:
        if "started" in message:
            self.started.append(message["started"])
        elif "exit" in message:
            self.exits[message["exit"]] = message["code"]

    def _next(self, *, block: bool) -> dict | None:
        """The next message from the server; None when none is there and ``block`` is false."""
        while b"\n" not in self.pending:
            if not select.select([self.answers], [], [], None if block else 0)[0]:
                return None
            data = os.read(self.answers, 1 << 16)
            if not data:
                raise self._died()
            self.pending += data
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def _died(self) -> RuntimeError:
        for index, server in list(_servers.items()):
            if server is self:
                del _servers[index]  # the next run starts a new one
        self.log.flush()
        tail = Path(self.log.name).read_text(errors="replace")[-3000:]
        return RuntimeError(f"the rank server (pid {self.proc.pid}) ended; its output:\n{tail}")


@atexit.register
def _close_all() -> None:
    """End the servers with the session (not in a process forked from it, where they are not its own)."""
    for server in _servers.values():
        if server.owner == os.getpid():
            server.close()
    _servers.clear()

