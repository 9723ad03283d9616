"""Measure this machine's device for the step-time model, once per device, torch version and thread count.

The figures are kept in a JSON file under the user's cache folder (``$AUTOTUNE_CACHE_DIR``, else
``$XDG_CACHE_HOME/lightning-autotune``, else ``~/.cache/lightning-autotune``); measuring takes a few seconds on a CPU.

What is measured:

- matrix products per dtype at two sizes: the larger one's FLOP/s is the peak; what the smaller took beyond its share
  of that is a fixed cost per product (``DeviceSpeed.matmul_seconds``);
- attention forward and backward at a short sequence over many heads and a long one over few (a rate and a fixed
  cost per head);
- copies of 64 MiB (the memory's bandwidth) and, on a CPU, of 1 to 16 MiB (data that stays in the caches);
- on a CPU, pointwise kernels per value and a 64 MiB tensor written to fresh pages (page faults);
- a training step of tiny modules (the host's cost per operator);
- on CUDA, pinned copies to and from the host (the host link).

A CPU has no interconnect to measure: its
collectives (gloo) copy through memory, taken at a quarter of its bandwidth. A GPU that is in the table
(:data:`~autotune._estimate.devices.KNOWN_DEVICES`) keeps its datasheet peaks for MFU.

Each figure is the best of a few repetitions, timed on a CPU by the process's CPU time over its threads: other
processes' load on a shared machine does not stretch it, as it stretches the wall clock.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from autotune._estimate.devices import FRESH_PAGES_FROM, DeviceSpeed, matching_device

__all__ = ["cache_dir", "local_device_speed", "measure_device"]

log = logging.getLogger(__name__)

_CACHE_FILE = "device-speed.json"
#: The version of what is measured: a cache entry of another is measured anew (it lacks figures the model reads).
_MEASURES = 1
#: Matrix sizes (square) timed per dtype, by device kind: the smaller gives the fixed cost, the larger the peak.
_MATMUL_SIZES = {"cpu": (64, 512), "cuda": (1024, 8192)}
_COPY_BYTES = {"cpu": 64 * 2**20, "cuda": 512 * 2**20}
#: Smaller copies (bytes of each tensor): how much faster data that stays in the caches moves (a CPU's L2 and L3).
_CACHED_COPIES = {"cpu": (2**20, 4 * 2**20, 16 * 2**20)}
#: Values a pointwise kernel is timed over (4 MiB in fp32: in the caches, so its math is what is timed).
_POINTWISE_VALUES = 2**20
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def cache_dir() -> Path:
    """Where lightning-autotune keeps what it measured of this machine."""
    if os.environ.get("AUTOTUNE_CACHE_DIR"):
        return Path(os.environ["AUTOTUNE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lightning-autotune"


def _key(device: torch.device) -> str:
    """The cache's key: the device's name, torch's version, the threads (a CPU's speed depends on them) and what is
    measured (``_MEASURES``)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        from autotune._device.probe import probe_memory

        name = probe_memory(device).name
    return f"{device.type}|{name}|torch {torch.__version__}|threads {torch.get_num_threads()}|measures {_MEASURES}"


def local_device_speed(device: torch.device, *, refresh: bool = False) -> DeviceSpeed:
    """This machine's ``device`` (``cpu`` or a CUDA device) as the step-time model sees it: read from the cache, else
    measured (:func:`measure_device`) and kept there. ``refresh``: measure again. An unwritable cache is logged and
    the figures are used all the same."""
    key = _key(device)
    path = cache_dir() / _CACHE_FILE
    cached = _read(path)
    if key in cached and not refresh:
        try:
            return _from_json(cached[key])
        except (TypeError, KeyError, ValueError):
            log.info("autotune: the cached speeds of %s in %s are unreadable; measuring again", key, path)
    speed = measure_device(device)
    cached[key] = _to_json(speed)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cached, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError as error:
        log.warning("autotune: cannot keep the measured speeds of this device in %s (%s)", path, error)
    return speed


class _Clock:
    """Wait for the device (calling it) and read the time (:meth:`now`) for a measurement.

    On CUDA it reads the wall clock after a synchronize. On the CPU it reads the process's CPU time over its threads,
    which other processes' load on a shared machine does not stretch (docs/speed.md)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __call__(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def now(self) -> float:
        if self.device.type == "cuda":
            return time.perf_counter()
        return time.process_time() / max(1, torch.get_num_threads())


def measure_device(device: torch.device) -> DeviceSpeed:
    """Measure ``device`` now (see the module's notes)."""
    cuda = device.type == "cuda"
    kind = "cuda" if cuda else "cpu"
    sync = _Clock(device)
    flops, fixed = {}, {}
    for name, dtype in _DTYPES.items():
        flops[name], fixed[name] = _matmul(device, dtype, _MATMUL_SIZES[kind], sync)
    if cuda:  # fp32 products at TF32 where the process allows it
        allowed = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            flops["tf32"], fixed["tf32"] = _matmul(device, torch.float32, _MATMUL_SIZES[kind], sync)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = allowed
    attention, attention_seconds = {}, {}
    for name in ("fp32", "bf16"):
        for phase, (rate, per_head) in _attention(device, _DTYPES[name], sync).items():
            key = name if phase == "forward" else f"{name} backward"
            attention[key], attention_seconds[key] = rate, per_head
    size = _COPY_BYTES[kind] // 4
    memory = _copy_bandwidth(device, size, sync)
    by_size = tuple((2 * n, _copy_bandwidth(device, n // 4, sync)) for n in _CACHED_COPIES.get(kind, ()))
    launch = _host_seconds_per_operator(device, sync)
    pointwise = _pointwise_seconds(device, sync) if not cuda else {}  # a GPU's are bound by their bytes
    fresh = None if cuda else _fresh_page_bandwidth(sync)
    host_memory = memory if not cuda else _host_copy_bandwidth()
    if cuda:
        host = torch.empty(size, pin_memory=True)
        here = torch.empty(size, device=device)
        link = min(size * 4 / _best(lambda: here.copy_(host, non_blocking=True), sync),
                   size * 4 / _best(lambda: host.copy_(here, non_blocking=True), sync))
        del host, here
        props = torch.cuda.get_device_properties(device)
        known = matching_device(props.name, (props.major, props.minor), props.multi_processor_count)
        name = props.name
        interconnect = known.interconnect_bandwidth if known is not None else link
        memory_bytes = props.total_memory
    else:
        from autotune._device.probe import probe_memory

        probe = probe_memory(device)
        name, link, interconnect, memory_bytes = probe.name, memory, memory / 4, probe.total_bytes
        known = None
    return DeviceSpeed(
        name=name, kind=kind, flops=flops, memory_bandwidth=memory, host_link_bandwidth=link,
        bandwidth_by_size=tuple((n, bw) for n, bw in by_size if bw > memory), pointwise_seconds=pointwise,
        fresh_page_bandwidth=fresh,
        interconnect_bandwidth=interconnect, launch_seconds=launch, matmul_seconds=fixed, attention_flops=attention,
        attention_seconds=attention_seconds,
        host_memory_bandwidth=host_memory,
        memory_bytes=memory_bytes, capability=known.capability if known else None,
        sm_count=known.sm_count if known else None, nvml_name=known.nvml_name if known else None, measured=True,
        source=f"measured on this machine ({torch.get_num_threads()} threads, torch {torch.__version__}), "
               f"{time.strftime('%Y-%m-%d')}")


def _matmul(device: torch.device, dtype: torch.dtype, sizes: tuple[int, int],
            sync: Callable[[], None]) -> tuple[float, float]:
    """FLOP/s of a square matrix product at the larger size, and the seconds a product at the smaller size took beyond
    its FLOPs at that rate (its fixed cost, at least 0); each per product, the best of several runs of a few."""
    timed = []
    for n, calls in zip(sizes, (8, 2)):
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        now = getattr(sync, "now", time.perf_counter)
        torch.mm(a, b)  # the first call sets kernels up
        sync()
        start = now()
        torch.mm(a, b)
        sync()
        if now() - start > 0.05:  # a dtype without fast kernels here (fp16 on most CPUs): once will do
            timed.append(now() - start)
            continue

        def run(a: torch.Tensor = a, b: torch.Tensor = b, calls: int = calls) -> None:
            for _ in range(calls):
                torch.mm(a, b)

        timed.append(_best(run, sync, repeats=15) / calls)
    small, large = sizes
    rate = 2 * large**3 / timed[1]
    return rate, max(0.0, timed[0] - 2 * small**3 / rate)


#: Attention timed per device kind: (batch x heads, positions, head width) of a short and a long sequence.
_ATTENTION_SHAPES = {"cpu": ((64, 32, 16), (4, 512, 64)), "cuda": ((256, 128, 64), (16, 2048, 128))}


def _attention(device: torch.device, dtype: torch.dtype, sync: Callable[[], None]) -> dict[str, tuple[float, float]]:
    """Measure causal scaled dot-product attention at a short sequence over many heads and a long one over few.

    For its forward and its backward apart, it returns the FLOP/s (torch's FLOP formulas, halved for the causal mask)
    and the fixed seconds per head that fit both shapes. A CPU's bf16 backward takes far longer per head than its
    FLOPs say."""
    from torch.nn.functional import scaled_dot_product_attention

    from autotune._compat.torch import sdpa_backward_flops, sdpa_flops

    timed: dict[str, list[tuple[int, float, float]]] = {"forward": [], "backward": []}
    for heads, length, width in _ATTENTION_SHAPES["cuda" if device.type == "cuda" else "cpu"]:
        q, k, v = (torch.randn(1, heads, length, width, device=device).to(dtype).requires_grad_() for _ in range(3))

        def forward(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v) -> None:
            with torch.no_grad():
                scaled_dot_product_attention(q, k, v, is_causal=True)

        def both(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v) -> None:
            scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

        flops = (sdpa_flops(q.shape, k.shape, v.shape), sdpa_backward_flops(q.shape, q.shape, k.shape, v.shape))
        seconds = _best(forward, sync, repeats=3)
        timed["forward"].append((heads, flops[0] / 2, seconds))
        timed["backward"].append((heads, flops[1] / 2, max(_best(both, sync, repeats=3) - seconds, 1e-9)))
    return {phase: _rate_and_fixed(points) for phase, points in timed.items()}


def _rate_and_fixed(points: list[tuple[int, float, float]]) -> tuple[float, float]:
    """The FLOP/s and fixed seconds per head through two timings ``(heads, flops, seconds)``:
    ``seconds = heads * fixed + flops / rate`` (all rate where the second is no slower per FLOP)."""
    (n_short, f_short, t_short), (n_long, f_long, t_long) = points
    per_flop = (t_long - t_short * n_long / n_short) / (f_long - f_short * n_long / n_short)
    if per_flop <= 0:
        return f_long / t_long, 0.0
    return 1 / per_flop, max(0.0, (t_short - f_short * per_flop) / n_short)


def _host_seconds_per_operator(device: torch.device, sync: Callable[[], None]) -> float:
    """Measure the host's cost per operator of a training step without work.

    A stack of tiny modules (linear, layer norm, GELU) runs forward, backward and its update. Its time is divided by
    the operators it dispatches, counted as the step-time model counts a traced step's (views and allocations too).
    So the modules' Python and autograd's bookkeeping are in the figure."""
    from torch import nn

    from autotune._compat.torch import operator_recorder
    from autotune._estimate.work import WorkCounter

    model = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.GELU()) for _ in range(6)))
    model = model.to(device)
    x = torch.ones(2, 16, device=device)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    counter = WorkCounter(device.type)
    with operator_recorder(counter.record):
        step()
    return _best(step, sync, repeats=25) / max(1, len(counter.ops))  # many: a busy host preempts some


def _best(fn: Callable[[], Any], sync: Callable[[], None], *, repeats: int = 7) -> float:
    """The shortest of ``repeats`` timed calls of ``fn`` (after one untimed), by ``sync``'s clock (:class:`_Clock`;
    the wall clock for a plain function)."""
    now = getattr(sync, "now", time.perf_counter)
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = now()
        fn()
        sync()
        best = min(best, now() - start)
    return max(best, 1e-9)


def _pointwise_seconds(device: torch.device, sync: Callable[[], None]) -> dict[str, float]:
    """Seconds per value of each pointwise kernel of ``POINTWISE_MATH`` and of an add, in fp32 and bf16, over
    ``_POINTWISE_VALUES`` values."""
    from autotune._estimate.work import POINTWISE_MATH

    aten = torch.ops.aten
    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        x = (torch.rand(_POINTWISE_VALUES, device=device) + 0.5).to(dtype)  # positive: log's fast path
        calls = {kernel: (lambda op=getattr(aten, kernel): op(x)) for kernel in POINTWISE_MATH
                 if kernel not in ("gelu_backward", "silu_backward", "_softmax", "_log_softmax")}
        calls.update({"gelu_backward": lambda: aten.gelu_backward(x, x),
                      "silu_backward": lambda: aten.silu_backward(x, x),
                      "_softmax": lambda: getattr(aten, "_softmax")(x.view(-1, 1024), -1, False),
                      "_log_softmax": lambda: getattr(aten, "_log_softmax")(x.view(-1, 1024), -1, False),
                      "add": lambda: aten.add(x, x)})
        for kernel, call in calls.items():
            out[f"{kernel}|{name}"] = _best(call, sync) / x.numel()
    return out


def _fresh_page_bandwidth(sync: Callable[[], None]) -> float:
    """Bytes/s of faulting in fresh pages: a new 64 MiB tensor written, less the same write to a reused one."""
    numel = 2 * FRESH_PAGES_FROM // 4
    reused = torch.empty(numel)
    reused.fill_(1.0)
    again = _best(lambda: reused.fill_(1.0), sync)
    fresh = _best(lambda: torch.empty(numel).fill_(1.0), sync)
    return 4 * numel / max(fresh - again, 1e-9)


def _copy_bandwidth(device: torch.device, numel: int, sync: Callable[[], None]) -> float:
    """Bytes/s read and written by copying ``numel`` floats (the best of several)."""
    source, target = torch.empty(numel, device=device), torch.empty(numel, device=device)
    calls = max(1, 2**24 // numel)  # about 64 MiB a run, so small copies are timed over many

    def run() -> None:
        for _ in range(calls):
            target.copy_(source)

    return 2 * numel * 4 * calls / _best(run, sync)


def _host_copy_bandwidth() -> float:
    """The host's memory bandwidth (a 64 MiB copy), for updates that run on the host."""
    size = _COPY_BYTES["cpu"] // 4
    source, target = torch.empty(size), torch.empty(size)
    return 2 * size * 4 / _best(lambda: target.copy_(source), _Clock(torch.device("cpu")))


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _to_json(speed: DeviceSpeed) -> dict[str, Any]:
    data = dataclasses.asdict(speed)
    data["capability"] = list(speed.capability) if speed.capability else None
    return data


def _from_json(data: dict[str, Any]) -> DeviceSpeed:
    fields = dict(data)
    if fields.get("capability") is not None:
        fields["capability"] = tuple(fields["capability"])
    fields["bandwidth_by_size"] = tuple(tuple(point) for point in fields.get("bandwidth_by_size") or ())
    return DeviceSpeed(**fields)
