"""Run a test script on several CPU ranks the way ``torchrun`` starts them: every rank its own process, started at
once, with the rank variables in its environment (Lightning then creates no processes of its own). Lightning's own
launcher starts rank 1 only once rank 0 reached ``fit``, so the two imports of torch and Lightning ran one after the
other: about 3 s more per run on a 2-core machine.

Every rank runs to its own end (a rank that would wait forever for a failed peer is seen hanging); past ``timeout`` all
are killed and ``subprocess.TimeoutExpired`` is raised (a hang fails the test). Lightning's launcher and ``torchrun``
kill the other ranks once one has failed: ``stop_peers=True`` does that too.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_ranks(argv: list[str], *, ranks: int = 2, timeout: float = 180,
              stop_peers: bool = False) -> subprocess.CompletedProcess[str]:
    """``python *argv`` on ``ranks`` ranks; the returned process's return code is the first failing rank's (0 when
    every rank succeeded), its stdout and stderr every rank's in turn.

    Every rank runs to its own end: a rank left waiting for a failed peer is a hang, and fails the test at ``timeout``
    (``subprocess.TimeoutExpired``). ``stop_peers``: kill the other ranks once one fails, as Lightning's launcher and
    torchrun do (a test of what a user sees, not of whether the ranks end by themselves)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="autotune-ranks-") as folder:
        logs = [(Path(folder) / f"{r}.out", Path(folder) / f"{r}.err") for r in range(ranks)]
        procs = []
        for rank, (out, err) in enumerate(logs):
            env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(ranks),
                   "NODE_RANK": "0", "LOCAL_RANK": str(rank)}
            with out.open("w") as o, err.open("w") as e:
                procs.append(subprocess.Popen([sys.executable, *argv], env=env, stdout=o, stderr=e))
        deadline, timed_out, killed = time.monotonic() + timeout, False, set()
        try:
            while any(p.poll() is None for p in procs):
                if stop_peers and any(p.returncode not in (None, 0) for p in procs):
                    break
                if time.monotonic() > deadline:
                    timed_out = True
                    break
                time.sleep(0.05)
        finally:
            for rank, p in enumerate(procs):
                if p.poll() is None:
                    p.kill()
                    killed.add(rank)
                p.wait()
        stdout = "".join(out.read_text() for out, _ in logs)
        stderr = "".join(f"--- rank {r}\n{err.read_text()}" for r, (_, err) in enumerate(logs))
    if timed_out:
        raise subprocess.TimeoutExpired([sys.executable, *argv], timeout, output=stdout, stderr=stderr)
    code = next((p.returncode for r, p in enumerate(procs) if p.returncode and r not in killed), 0)
    return subprocess.CompletedProcess([sys.executable, *argv], code, stdout, stderr)


def exit_rank() -> None:
    """End a rank's process after its work: the process group first (gloo's worker threads can abort the interpreter's
    shutdown while it is alive), then exit without C++ static destructors, where the abort still struck once with the
    group ended (docs/troubleshooting.md)."""
    import gc

    import torch

    if torch.distributed.is_initialized():
        gc.collect()  # cycles that hold gloo work (a replayed attempt's frames) go while the group is alive
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
