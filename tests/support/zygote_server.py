"""The rank server of ``tests/support/zygote.py``: imports torch and Lightning once, then forks one rank per request.

Started as ``python -c`` (so ``sys.path`` is a fresh ``python -c``'s, as a cold rank's) with the number of the pipe it
answers on. Requests come as JSON lines on stdin: ``start`` (argv, env, cwd, the rank's stdout and stderr files),
``signal`` (a signal to one rank) and ``kill`` (SIGKILL to a rank's process group: the rank and its dataloader workers).
Answers and events go out as JSON lines: ``{"ready": ...}`` once imported, ``{"started": pid}`` per start, ``{"exit":
pid, "code": n}`` when a rank ends (``n`` as ``Popen.returncode`` has it). Each rank leads a process group of its own;
when a rank ends, what is left of its group (a worker it did not end) is killed before the rank is reaped, so the group
number is never one that the system gave to another process. At end of input (the test session ended) every rank's
group is killed and the server exits. Ctrl-C is ignored here: it is the test session's, which kills its ranks through
the server.

A forked rank leaves the server's loop and becomes what ``python -c BOOT script args`` would have been: its own files
on 1 and 2, /dev/null on 0, the server's pipes closed, the default signal dispositions, the caller's working folder and
environment (plus what the server's imports set in theirs), the import-time rank globals recomputed from that
environment, the process-wide random generators reseeded, faulthandler on SIGUSR2 (the imported objects stay frozen
in gc's permanent generation); then the script runs as ``__main__``, and the rank ends as any interpreter does (an
uncaught exception: its traceback and 1; ``sys.exit(n)``: n; a signal: killed by it).
"""

import faulthandler
import gc
import json
import os
import runpy
import select
import signal
import sys


def _serve(answers: int) -> dict:
    """Answer requests until one ``start`` forks a rank; return that request in the rank (the server never returns)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    before = dict(os.environ)
    import lightning  # noqa: F401
    import lightning.pytorch  # noqa: F401
    import torch

    if torch.cuda.is_initialized():  # a fork after CUDA's initialisation cannot use CUDA
        raise RuntimeError("the rank server initialised CUDA while importing")
    # What the imports made stays in the permanent generation: a rank's collections skip it (as a fork server should:
    # no copy of those pages for the collector's bookkeeping), and its exit is not a collection over the whole of
    # torch and Lightning (1.5 s of CPU). Import-time garbage was collected first.
    gc.collect()
    gc.freeze()
    set_by_imports = {k: v for k, v in os.environ.items() if before.get(k) != v}
    if any(k not in os.environ for k in before):
        raise RuntimeError("the rank server's imports removed environment variables; a fork cannot repeat that")
    _say(answers, {"ready": True, "set_by_imports": set_by_imports})
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the select below through the wakeup pipe
    ranks: set[int] = set()
    pending = b""
    while True:
        readable, _, _ = select.select([0, wake_read], [], [])
        if wake_read in readable:
            while True:
                try:
                    if not os.read(wake_read, 512):
                        break
                except BlockingIOError:
                    break
        _reap(ranks, answers, block=False)
        if 0 not in readable:
            continue
        data = os.read(0, 1 << 16)
        if not data:  # the test session ended: so do its ranks
            for pid in ranks:
                _kill_group(pid)
            _reap(ranks, answers, block=True)
            os._exit(0)
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            if request["op"] == "start":
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    os.close(wake_read)
                    os.close(wake_write)
                    os.close(answers)
                    return {**request, "set_by_imports": set_by_imports}
                try:
                    os.setpgid(pid, pid)  # also here: a kill that comes before the rank's own setpgid finds the group
                except OSError:
                    pass
                ranks.add(pid)
                _say(answers, {"started": pid})
            elif request["pid"] in ranks:  # a rank not yet reaped: its number (and group's) is still its own
                if request["op"] == "kill":
                    _kill_group(request["pid"])
                else:
                    os.kill(request["pid"], request["signal"])


def _reap(ranks: set[int], answers: int, *, block: bool) -> None:
    """Report every rank that ended, after killing what is left of its process group (it is still a zombie then)."""
    while ranks:
        info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT | (0 if block else os.WNOHANG))
        if info is None or info.si_pid == 0:
            return
        _kill_group(info.si_pid)
        _, status = os.waitpid(info.si_pid, 0)
        if info.si_pid in ranks:
            ranks.discard(info.si_pid)
            _say(answers, {"exit": info.si_pid, "code": os.waitstatus_to_exitcode(status)})


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _say(answers: int, message: dict) -> None:
    try:
        os.write(answers, (json.dumps(message) + "\n").encode())
    except BrokenPipeError:  # the session is gone: the end of its input follows, and ends the ranks
        pass


def _become_rank(request: dict) -> None:
    """Make this forked process what a cold start of the rank would have been (see the module docstring)."""
    os.setpgid(0, 0)
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, request["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ.update(request["set_by_imports"])  # as the imports of a cold rank would set them
    _recompute_rank_globals()
    _reseed()
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    sys.argv = list(request["argv"])


def _recompute_rank_globals() -> None:
    """The rank that modules computed from the environment when the server imported them, as this rank's environment
    gives it (each expression is its module's own import-time one)."""
    from lightning.fabric.utilities import rank_zero

    rank_zero.rank_zero_only.rank = rank_zero._get_rank() or 0  # lightning/fabric/utilities/rank_zero.py
    prints = sys.modules.get("torchmetrics.utilities.prints")
    if prints is not None:
        prints.rank_zero_only.rank = int(os.environ.get("LOCAL_RANK", 0))  # torchmetrics/utilities/prints.py


def _reseed() -> None:
    """Reseed the generators that each new process seeds from the system's entropy when it imports them (Python's
    ``random`` reseeds itself after a fork): torch's default CPU generator and numpy's global one."""
    import torch

    torch.default_generator.seed()
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()


_request = _serve(int(sys.argv[2]))
_become_rank(_request)
del _request
runpy.run_path(sys.argv[0], run_name="__main__")
