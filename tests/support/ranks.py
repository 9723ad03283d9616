"""Run a test script on several CPU ranks the way ``torchrun`` starts them: every rank its own process, started at
once, with the rank variables in its environment (Lightning then creates no processes of its own). Lightning's own
launcher starts rank 1 only once rank 0 reached ``fit``, so the two imports of torch and Lightning ran one after the
other: about 3 s more per run on a 2-core machine.

Every rank runs to its own end or the deadline: a rank that would wait forever for a failed peer is seen hanging. Past
``timeout`` every rank still running dumps its Python stacks (``faulthandler``, on SIGUSR2) and is killed, and
:class:`RanksHung` (an ``AssertionError``: a failed test, not one that stops the suite) says which ranks hung, their
last lines of output and where each waits. Lightning's launcher and ``torchrun`` kill the other ranks once one has
failed: ``stop_peers=True`` does that too. Each rank leads a process group of its own, and at the end every rank
still running is killed with its group (its dataloader workers); what a forked rank leaves of its group when it ends is
killed then.

A rank is forked from a server that imported torch and Lightning once per test session (``zygote.py``: a rank
starts in milliseconds, not the 4-5 s of CPU of those imports), made what a cold start would have made it (its
environment, files, ``sys.argv``, working folder, signal dispositions, the rank Lightning computed at import,
the random seeds), and imports ``autotune`` and the script afresh. A run whose environment sets a variable read when
a process starts (``OMP_NUM_THREADS``, ``MALLOC_*``, ``PYTHON*``, ``TORCH_*``: ``zygote.START_TIME``), or any run
under ``AUTOTUNE_TEST_COLD_RANKS=1``, starts cold: ``python -c _BOOT script ...`` per rank.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.support import zygote

#: Each rank starts through this: its stacks are dumped on SIGUSR2, then the script runs as ``__main__``.
_BOOT = ("import faulthandler, runpy, signal, sys; faulthandler.register(signal.SIGUSR2, all_threads=True); "
         "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")


class RanksHung(AssertionError):
    """Some ranks were still running at the deadline: a hang (their stacks are in the message)."""


def run_ranks(argv: list[str], *, ranks: int = 2, timeout: float = 180, stop_peers: bool = False,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python *argv`` on ``ranks`` ranks; the returned process's return code is the first failing rank's (0 when
    every rank succeeded), its stdout and stderr every rank's in turn.

    Every rank runs to its own end: a rank left waiting for a failed peer is a hang, and :class:`RanksHung` is raised
    at ``timeout`` with every hung rank's stacks. ``stop_peers``: kill the other ranks once one fails, as Lightning's
    launcher and torchrun do (a test of what a user sees, not of whether the ranks end by themselves)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="autotune-ranks-") as folder:
        logs = [(Path(folder) / f"{r}.out", Path(folder) / f"{r}.err") for r in range(ranks)]
        envs = [{**os.environ, **(env or {}), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                 "WORLD_SIZE": str(ranks), "NODE_RANK": "0", "LOCAL_RANK": str(rank)} for rank in range(ranks)]
        forked = zygote.can_fork(envs)
        procs: list[subprocess.Popen[str] | zygote.Rank] = []
        deadline, hung, killed = time.monotonic() + timeout, [], set()
        try:
            for rank, (out, err) in enumerate(logs):
                with out.open("w") as o, err.open("w") as e:
                    procs.append(zygote.fork(argv, index=rank, env=envs[rank], out=out, err=err) if forked
                                 else subprocess.Popen([sys.executable, "-c", _BOOT, *argv], env=envs[rank], stdout=o,
                                                       stderr=e, process_group=0))
            while any(p.poll() is None for p in procs):
                if stop_peers and any(p.returncode not in (None, 0) for p in procs):
                    break
                if time.monotonic() > deadline:
                    hung = [r for r, p in enumerate(procs) if p.poll() is None]
                    for r in hung:
                        procs[r].send_signal(signal.SIGUSR2)  # its stacks, to its stderr
                    time.sleep(2.0)
                    break
                time.sleep(0.05)
        finally:
            for rank, p in enumerate(procs):
                if p.poll() is None:
                    _kill_group(p)
                    killed.add(rank)
                p.wait()
        outs = [out.read_text() for out, _ in logs]
        errs = [err.read_text() for _, err in logs]
    stdout = "".join(outs)
    stderr = "".join(f"--- rank {r}\n{e}" for r, e in enumerate(errs))
    if hung:
        report = []
        for r in hung:
            last = [line for line in outs[r].splitlines() if line.strip()][-3:]
            report.append(f"rank {r} hung; its last output: {last}\n{_current_thread(errs[r])}")
        finished = [r for r in range(ranks) if r not in hung]
        raise RanksHung(f"{len(hung)} of {ranks} ranks still running after {timeout:.0f} s (finished: {finished}):\n"
                        + "\n".join(report) + "\n--- every rank's stderr (tail) ---\n" + stderr[-6000:])
    code = next((p.returncode for r, p in enumerate(procs) if p.returncode and r not in killed), 0)
    return subprocess.CompletedProcess([sys.executable, *argv], code, stdout, stderr)


def _kill_group(proc: subprocess.Popen[str] | zygote.Rank) -> None:
    """SIGKILL to a running rank and every process of its group (its dataloader workers)."""
    if isinstance(proc, zygote.Rank):
        proc.kill()  # through its server, which has not reaped it
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # not yet reaped here either: its number is still its group's


def _current_thread(dump: str) -> str:
    """The part of a faulthandler dump that shows where the main thread waits (its innermost frames first)."""
    lines = dump.splitlines()
    start = next((i for i in reversed(range(len(lines))) if lines[i].startswith("Current thread")), None)
    if start is None:
        return "\n".join(lines[-25:])
    frames = []
    for line in lines[start + 1:]:
        if not line.startswith("  "):
            break
        frames.append(line)
    return "\n".join([lines[start], *frames[:25]])


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
