"""One measured trial of a plan, in a fresh process forked from a pre-imported server.

Each trial runs in its own process so that an OOM, a crash or a leak cannot poison the next one, and so that CUDA
context and allocator settings start fresh. Processes come from ``multiprocessing``'s fork server, which imports
torch and Lightning once: a trial starts in milliseconds instead of the seconds a cold import takes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import multiprocessing
import os
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autotune._device.oom import OutOfMemoryAtMinimumError, is_oom_error
from autotune._search.records import TRIAL_PID, TrialResult, TrialSpec
from autotune._search.settings import user_callbacks, user_trainer_settings

__all__ = ["TrialResult", "TrialSpec", "check_positive_int", "check_interval", "measure_plan", "run_trial"]

_PRELOAD = ["torch", "lightning", "lightning.pytorch", "autotune", "autotune.callbacks", "autotune._target.target"]
_CONTEXT: Any = None


def measure_plan(
    *,
    target: str,
    plan: Any,
    budget: str | int | float | None = None,
    config: str | None = None,
    device: str | None = None,
    devices: int = 1,
    steps: int = 20,
    warmup: int = 2,
    interval: float = 0.03,
    timeout: float = 600.0,
) -> TrialResult:
    """Measure one plan as a search trial does: ``target`` trained with ``plan`` applied, in a fresh process, timed
    end to end (data loading included) with the run's peak memory.

    After at least ``warmup`` steps, warm-up goes on until a step takes within 10% of the step before it (at most 5
    more steps, and no more than ``steps``); then steps are timed until the throughput's 95% interval is within
    ``interval`` of it (at least 5 steps) or ``steps`` steps have been timed. The result carries the interval.

    Args:
        target: ``path/to/file.py:factory``, ``package.module:factory`` or a LightningCLI config file.
        plan: the :class:`~autotune.Plan` to run (its micro-batch is kept fixed: no growing, no shrinking below it).
        budget: the memory the run may use (``"4GiB"``, bytes, a fraction, ``"auto"``), resolved to bytes here,
            against ``device``, before the run starts; None: no cap.
        config: a LightningCLI config giving the rest of a factory target (trainer settings).
        device: ``"cpu"`` or ``"cuda"`` (default: CUDA when there is one).
        devices: devices (DDP ranks) for the run.
        steps: timed optimizer steps at most.
        warmup: untimed optimizer steps at least (timing starts at the end of the last one).
        interval: stop timing once the 95% interval is within +- this share of the throughput (0 < interval < 1).
        timeout: seconds before the run is stopped and reported as an error.

    Returns:
        What was measured; an out-of-memory error is ``status="oom"``, never an exception.

    Raises:
        ValueError: for bad input, naming it.

    Example:
        >>> from autotune import Plan
        >>> result = measure_plan(target="examples/gpt/train.py:make", plan=Plan(micro_batch_size=8))  # doctest: +SKIP
        >>> result.status, result.samples_per_second  # doctest: +SKIP
    """
    import torch

    from autotune._device.budget import resolve_budget
    from autotune._device.probe import resolve_device
    from autotune._plan.plan import Plan

    if not isinstance(plan, Plan):
        raise ValueError(f"plan must be an autotune.Plan; got {type(plan).__name__}")
    check_positive_int("steps", steps)
    check_positive_int("warmup", warmup)
    check_positive_int("devices", devices)
    check_interval(interval)
    dev = resolve_device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    spec = TrialSpec(target=str(target), config=config, plan=plan.to_dict(),
                     budget=None if budget is None else resolve_budget(budget, dev), device=dev.type, devices=devices,
                     steps=steps, warmup=warmup, interval=interval)
    return run_trial(spec, timeout=timeout)


def check_positive_int(name: str, value: Any, *, minimum: int = 1) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is an int >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}; got {value!r}")


def check_interval(interval: Any) -> None:
    """Raise ``ValueError`` unless ``interval`` (a measurement's relative half-width) is a number in (0, 1)."""
    if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not 0 < interval < 1:
        raise ValueError(f"interval must be a number between 0 and 1 (0.03: +-3%); got {interval!r}")


def start_trial_server() -> None:
    """Start the process that trials are forked from, if it is not running: its import of torch and Lightning (some
    seconds) then overlaps the caller's own start-up (loading the target, the study, the estimator's first traces)
    instead of delaying the first trial."""
    _context()


def _context() -> Any:
    global _CONTEXT
    if _CONTEXT is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        _start_forkserver_deaf_to_ctrl_c()
        _CONTEXT = ctx
    return _CONTEXT


def _start_forkserver_deaf_to_ctrl_c() -> None:
    """Start the forkserver with SIGINT ignored, a disposition it keeps through its preload and hands to every
    trial it forks: Ctrl-C is the search's, which kills the running trial (``run_trial``), and no child prints its
    own traceback. The parent ignores SIGINT only while the server is spawned (it does not wait for the preload).

    The server starts with OpenMP's threads waiting passively (``OMP_WAIT_POLICY=PASSIVE`` in its environment, read
    when its preload loads torch; a policy the user set is kept): spinning threads take a busy neighbour's cores
    from it and from each other, so a trial beside other work ran at half its speed, or less, where a passive one
    loses its neighbour's share (docs/search.md, "How a verdict is protected")."""
    import threading
    from multiprocessing import forkserver

    with _passive_wait():
        if threading.current_thread() is not threading.main_thread():
            forkserver.ensure_running()  # signal dispositions are the main thread's to set: SIGINT is left as it is
            return
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            forkserver.ensure_running()
        finally:
            signal.signal(signal.SIGINT, previous)


#: The wait policy a trial's OpenMP threads get where the user set none.
WAIT_POLICY = "PASSIVE"


@contextlib.contextmanager
def _passive_wait() -> Any:
    """``OMP_WAIT_POLICY`` set to :data:`WAIT_POLICY` while the trial server starts (unless already set), then as it
    was: this process's own OpenMP has long read it."""
    given = os.environ.get("OMP_WAIT_POLICY")
    if given is None:
        os.environ["OMP_WAIT_POLICY"] = WAIT_POLICY
    try:
        yield
    finally:
        if given is None:
            os.environ.pop("OMP_WAIT_POLICY", None)


def run_trial(spec: TrialSpec, *, timeout: float = 600.0,
              while_running: Callable[[], Any] | None = None) -> TrialResult:
    """Run ``spec`` in a fresh process and return what it measured; never raises for the trial's own failures.
    ``while_running`` is called once the process has started (work of this process that does not disturb what the
    trial measures)."""
    ctx = _context()
    with tempfile.TemporaryDirectory(prefix="autotune-trial-") as tmp:
        out = Path(tmp) / "result.json"
        launched = time.time()
        proc = ctx.Process(target=_child, args=(spec, str(out), launched), daemon=False)
        try:
            proc.start()
            if while_running is not None:
                while_running()
            proc.join(max(0.0, timeout - (time.time() - launched)))
        except BaseException:  # Ctrl-C, or ``while_running`` failed: the trial (and its ranks) end with the caller
            if proc.pid is not None:
                _kill_tree(proc.pid)
                proc.join()
            raise
        timed_out = proc.is_alive()
        if timed_out:
            _kill_tree(proc.pid)  # the trial with its DDP ranks and dataloader workers, which would outlive it
            proc.join()
        if out.exists():
            data = json.loads(out.read_text())
            return TrialResult(**{**data, "interval": tuple(data["interval"]) if data.get("interval") else None})
        if timed_out:
            return TrialResult("error", reason=f"timed out after {timeout:.0f} s", wall_seconds=time.time() - launched)
        tail = _tail(Path(tmp) / "trial.log")
        code = proc.exitcode or 0
        if code == -signal.SIGKILL:
            return TrialResult("oom", reason="killed by SIGKILL (the kernel's out-of-memory killer)",
                               wall_seconds=time.time() - launched)
        name = signal.Signals(-code).name if code < 0 else f"exit code {code}"
        return TrialResult("error", reason=f"trial process died ({name}){tail}", wall_seconds=time.time() - launched)


def _kill_tree(pid: int) -> None:
    """Kill process ``pid`` and all its descendants (found before the first kill, so none is missed by reparenting)."""
    import psutil

    try:
        parent = psutil.Process(pid)
        procs = [parent, *parent.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(procs, timeout=10)


def _tail(path: Path) -> str:
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return f": {lines[-1][:300]}" if lines else ""


def _child(spec: TrialSpec, out: str, launched: float) -> None:
    try:
        log_fd = os.open(str(Path(out).with_name("trial.log")), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    except FileNotFoundError:  # the search was interrupted while this trial started, and took its folder along
        os._exit(1)
    os.dup2(log_fd, 1)  # the trial's own output (Lightning's banners, warnings) stays out of the search's
    os.dup2(log_fd, 2)
    # The trial's own processes (DataLoader workers) start as in the user's run, the platform's default way (fork on
    # Linux before Python 3.14), not as this fork server's child would (forkserver: slow worker starts, and
    # semaphores registered with the search's resource tracker that the trial's quick exit leaves behind).
    multiprocessing.set_start_method(multiprocessing.get_all_start_methods()[0], force=True)
    os.environ[TRIAL_PID] = str(os.getpid())  # the meter's load record counts this process tree as the run's own
    try:
        _measure(spec, launched, out)
    except BaseException as exc:  # the trial's own failure is its result, never the search's
        from autotune._target.failure import failure_lines

        oom, reason = _failure(exc)  # the target's own failure says where in its code (None: another failure)
        result = TrialResult("oom" if oom else "error", reason=reason, wall_seconds=time.time() - launched,
                             target_error=None if oom else failure_lines(exc, spec=spec.target))
        Path(out).write_text(json.dumps(dataclasses.asdict(result)))
    if not Path(out).exists():
        Path(out).write_text(json.dumps(dataclasses.asdict(TrialResult("error", reason="the run ended early"))))
    os._exit(0)  # leave without atexit hooks or CUDA teardown


def _failure(exc: BaseException) -> tuple[bool, str]:
    """Whether a trial's exception is an out-of-memory error, and a one-line reason (at most 500 characters).

    Under DDP (``ddp_fork``) a rank's failure reaches the trial process as one of torch's multiprocessing
    exceptions: ``ProcessRaisedException``, whose message is the rank's whole traceback (the error is its last
    line, so the reason keeps that line, not the first 500 characters of the traceback), or
    ``ProcessExitedException`` for a rank that died by a signal (SIGKILL: the kernel's out-of-memory killer, as for
    the trial process itself in :func:`run_trial`).
    """
    text = str(exc)
    oom = is_oom_error(exc) or isinstance(exc, OutOfMemoryAtMinimumError) or "OutOfMemory" in text
    kind = type(exc).__name__
    if kind == "ProcessRaisedException":
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        text = f"rank {getattr(exc, 'error_index', '?')} raised {lines[-1] if lines else 'an error'}"
    elif kind == "ProcessExitedException" and getattr(exc, "signal_name", None) == "SIGKILL":
        oom = True
        text = f"rank {getattr(exc, 'error_index', '?')} was killed by SIGKILL (the kernel's out-of-memory killer)"
    return oom, f"{kind}: {' '.join(text.split())}"[:500]


def _measure(spec: TrialSpec, launched: float, out: str) -> None:
    from autotune._search.meter import Meter
    from autotune._target.target import load_target

    plan = spec.memory_plan()
    if plan.expandable_segments:  # before anything touches CUDA in this fresh process
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    target = load_target(spec.target, config=spec.config)
    batch_size = target.batch_size()
    settings = user_trainer_settings(target.trainer_config)
    config = spec.config or (spec.target if spec.target.endswith((".yaml", ".yml")) else None)
    folders = (*((str(Path(config).resolve().parent),) if config else ()), os.getcwd())
    extra, names = user_callbacks(target.trainer_config, folders=folders)
    recorded = {**settings, "callbacks": names} if names else settings
    meter = Meter(spec=spec, batch_size=batch_size, tokens_per_sample=target.tokens_per_sample(),
                  launched=launched, out=out, trainer_settings=recorded)
    micro = plan.micro_batch_size or batch_size
    if plan.strategy == "fsdp":
        plan = plan.replace(devices=spec.devices)
    kwargs = plan.trainer_kwargs()
    kwargs.pop("devices", None)  # the trial's devices decide
    if kwargs.get("strategy") == "ddp":
        kwargs["strategy"] = "ddp_fork"  # the launcher must not re-run the search command
    if spec.long_batch is not None:
        _run_long_batch(target.model, spec.long_batch, at=min(1, spec.warmup - 1))

    def fit() -> None:
        trainer = _trainer(spec, plan, kwargs, [*extra, meter], micro, settings)
        trainer.fit(target.model, datamodule=target.datamodule)

    if plan.strategy == "fsdp" and spec.devices > 1:
        _start_ranks(spec.devices, fit)
    else:
        fit()


def _run_long_batch(model: Any, path: str, *, at: int) -> None:
    """Make the ``at``-th training batch (0-based; a warm-up step) the one saved at ``path``: the model's
    ``on_before_batch_transfer`` hands it over in place of the one the dataloader gave (every rank alike), and keeps
    no reference to it afterwards (a plain run holds no such batch in its later steps: on the CPU, where it would stay
    resident, it would count in every later step's peak)."""
    import torch

    batch = torch.load(path, weights_only=False)
    original = model.on_before_batch_transfer
    seen = 0

    def on_before_batch_transfer(given: Any, dataloader_idx: int) -> Any:
        nonlocal seen, batch
        if model.trainer.training:
            seen += 1
            if seen == at + 1:
                given, batch = batch, None
        return original(given, dataloader_idx)

    model.on_before_batch_transfer = on_before_batch_transfer


def _start_ranks(count: int, fit: Any) -> None:
    """Run ``fit`` in ``count`` forked rank processes, started the way torchrun starts them (rank variables in the
    environment): ModelParallelStrategy has no fork launcher, and its own launcher would re-run the search command.
    The model was built before the fork, so every rank starts from the same weights. A rank's failure is raised here
    as torch's ``ProcessRaisedException`` (see :func:`_failure`)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def rank_main(rank: int) -> None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(count), RANK=str(rank),
                          LOCAL_RANK=str(rank), NODE_RANK="0", LOCAL_WORLD_SIZE=str(count))
        fit()
        import torch.distributed as dist

        if dist.is_initialized():  # a live gloo group can abort the rank's exit (docs/troubleshooting.md)
            dist.destroy_process_group()

    mp.start_processes(rank_main, nprocs=count, start_method="fork")


def _trainer(spec: TrialSpec, plan: Any, kwargs: dict[str, Any], callbacks: list[Any], micro: int,
             settings: dict[str, Any]) -> Any:
    import lightning as L

    from autotune._search.meter import extra_warmup
    from autotune.callbacks import ApplyPlan, ElasticBatchSize

    return L.Trainer(
        accelerator="cuda" if spec.device.startswith("cuda") else "cpu",
        devices=spec.devices,
        max_steps=spec.warmup + extra_warmup(spec.steps) + spec.steps,  # the meter stops it when it knows enough
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[
            # the bytes the search resolved and judges this trial against, not a reading of this process's own
            ElasticBatchSize(budget=spec.budget, micro_batch_size=micro, min_micro_batch_size=micro, grow=False),
            ApplyPlan(**plan.apply_kwargs()),
            *callbacks,  # the user's, then the meter: it times what the user's callbacks cost
        ],
        **settings,
        **kwargs,
    )
