"""Estimator accuracy: the predicted peak of one training step (``autotune.estimate``) against a measured one.

For each model and plan, the estimator traces the step without running it; then the same step runs for real on
fresh weights and its peak is measured by code that shares nothing with the estimator:

- CPU: ``torch.profiler`` with ``profile_memory=True`` records every allocation and free of the CPU allocator
  (tensors and kernels' internal buffers alike). The peak is the bytes alive before profiling (parameters,
  buffers, the batch) plus the highest running sum of those events inside the measured step.
- CUDA: ``torch.cuda.max_memory_allocated()`` over the measured step, after ``reset_peak_memory_stats()``, each case
  in a fresh process (cuBLAS's workspaces, kept once allocated, would otherwise be in every later case's base).

The real step is the one Lightning runs with the plan's callbacks: the plan's precision through Lightning's
precision plugins, checkpointing by non-reentrant ``torch.utils.checkpoint`` around each of the model's own blocks
(the first ``activation_checkpointing`` share of them, in module order, as ``ApplyPlan`` chooses them), offload
through ``torch.autograd.graph.save_on_cpu`` (pinned on CUDA), optimizer offload through torchao's
``CPUOffloadOptimizer``, and, when the micro-batch is smaller than the batch, one forward and backward per
micro-batch slice of the batch accumulating into the gradients (``ElasticBatchSize``), with ``zero_grad`` after
the first forward and one ``optimizer.step()`` at the end. None of it calls autotune's own runtime code, so the
reference is independent of the code it checks. One warm-up step comes first (it makes the optimizer state); the
second step is measured. Seeds are fixed.

Usage::

    python benchmarks/estimator_accuracy.py --device cpu              # about 2 minutes on a 2-core CPU
    python benchmarks/estimator_accuracy.py --device cpu --quick
    python benchmarks/estimator_accuracy.py --device cpu --paths      # the real-tensor paths beside each row
    python benchmarks/estimator_accuracy.py --device cuda --json estimator_accuracy_cuda.json

The table is printed as Markdown (for ``docs/benchmarks.md``), with the median absolute error last.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import importlib.util
import inspect
import itertools
import json
import math
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:  # _common.py, also when this file is loaded by path
    sys.path.insert(0, _HERE)

from _common import add_device, add_json, in_fresh_process, make_parser, markdown_table, use_paths  # noqa: E402

use_paths(gpt=True)

from model import GPT, Block  # noqa: E402

from autotune import Plan, estimate, probe_memory  # noqa: E402

#: The models measured: three sizes of the example GPT (the first is ``examples/gpt/train.py:make``), an MLP of
#: residual blocks, a small CNN with BatchNorm, and the two of ``READS_VALUES``. Each batch holds 16 samples.
GPT_SIZES = {
    "gpt-2x64": {"n_layer": 2, "n_head": 4, "n_embd": 64, "block_size": 32},
    "gpt-4x128": {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64},
    "gpt-6x192": {"n_layer": 6, "n_head": 6, "n_embd": 192, "block_size": 128},
}
#: Two whose step reads tensor values, so the estimator traces them with real tensors on the host: Lightning's
#: own demo Transformer (``torch.nn.Transformer`` checks whether its mask is causal) and a mixture of experts that
#: routes each token to its top expert (data-dependent shapes).
READS_VALUES = ("transformer", "moe")
MODELS = (*GPT_SIZES, "mlp", "cnn", *READS_VALUES)
BATCH = 16
#: Parameters with fewer elements keep their update on the device under optimizer offload (the value autotune's
#: runtime passes to torchao as ``minimal_size``).
OFFLOAD_MIN_NUMEL = 4096
#: Optimizer settings about how an update runs on its device, left to each side's default under offload.
_DEVICE_KEYS = frozenset({"fused", "foreach", "capturable", "differentiable"})


class MLPBlock(nn.Module):
    """Pre-norm residual MLP block."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class MLP(LightningModule):
    """A per-token classifier of ``depth`` residual MLP blocks on ``(batch, tokens, width)`` inputs, AdamW."""

    def __init__(self, *, width: int = 256, depth: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(MLPBlock(width) for _ in range(depth)))
        self.head = nn.Linear(width, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.blocks(x))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x).flatten(0, -2), y.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class ConvBlock(nn.Module):
    """Conv 3x3, BatchNorm, ReLU, with a residual connection."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(channels)

    def forward(self, x: Tensor) -> Tensor:
        return x + F.relu(self.norm(self.conv(x)))


class CNN(LightningModule):
    """A small image classifier: stem conv, ``depth`` residual conv blocks, pooling, linear head; SGD momentum."""

    def __init__(self, *, channels: int = 32, depth: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.Sequential(*(ConvBlock(channels) for _ in range(depth)))
        self.head = nn.Linear(channels, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.blocks(self.stem(x)).mean(dim=(2, 3)))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Experts(nn.Module):
    """Top-1 mixture of ``experts`` MLPs: each token goes to the expert its router scores highest, gathered by index
    (how many tokens each expert gets is known only from the router's values)."""

    def __init__(self, width: int, experts: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.router = nn.Linear(width, experts)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
                                     for _ in range(experts))

    def forward(self, x: Tensor) -> Tensor:
        tokens = self.norm(x).flatten(0, -2)
        gate = self.router(tokens).softmax(-1)
        weight, choice = gate.max(-1)
        out = torch.zeros_like(tokens)
        for index, expert in enumerate(self.experts):
            picked = (choice == index).nonzero().squeeze(-1)
            if picked.numel():
                out = out.index_add(0, picked, (expert(tokens[picked]) * weight[picked, None]).to(out.dtype))
        return x + out.view_as(x)


class MoE(LightningModule):
    """A per-token classifier of ``depth`` residual mixture-of-experts blocks, AdamW."""

    def __init__(self, *, width: int = 128, depth: int = 2, experts: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Experts(width, experts) for _ in range(depth)))
        self.head = nn.Linear(width, classes)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self.head(self.blocks(x)).flatten(0, -2), y.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def demo_transformer() -> LightningModule:
    """Lightning's demo ``LightningTransformer`` (vocabulary 500), its dataset's download left out."""
    from lightning.pytorch.demos import LightningTransformer

    class Demo(LightningTransformer):
        def prepare_data(self) -> None:  # the estimate needs no data set
            pass

    return Demo(vocab_size=500)


def build(name: str, *, batch_size: int = BATCH) -> tuple[LightningModule, Any]:
    """A fresh model (seeded) and one training batch for ``name`` in ``MODELS``."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    if name in GPT_SIZES:
        size = GPT_SIZES[name]
        model = GPT(vocab_size=256, **size)
        tokens = torch.randint(0, 256, (batch_size, size["block_size"] + 1), generator=gen)
        return model, (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    if name == "mlp":
        tokens = (batch_size, 32)
        return MLP(), (torch.randn(*tokens, 256, generator=gen), torch.randint(0, 10, tokens, generator=gen))
    if name == "cnn":
        images = torch.randn(batch_size, 3, 32, 32, generator=gen)
        return CNN(), (images, torch.randint(0, 10, (batch_size,), generator=gen))
    if name == "transformer":  # 35 tokens per sample, as Lightning's example
        tokens = torch.randint(0, 500, (batch_size, 36), generator=gen)
        return demo_transformer(), (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    if name == "moe":
        tokens = (batch_size, 32)
        return MoE(), (torch.randn(*tokens, 128, generator=gen), torch.randint(0, 10, tokens, generator=gen))
    raise ValueError(f"model must be one of {', '.join(MODELS)}; got {name!r}")


def plans(*, quick: bool = False, device: str = "cpu") -> list[Plan]:
    """The plans measured: precision x checkpointing x activation offload x micro-batch (fewer with ``quick``),
    and on CUDA with torchao each precision with optimizer offload."""
    grid = itertools.product(("32-true", "bf16-mixed"), (0.0, 1.0), (False, True), (4, 16))
    chosen = [Plan(precision=p, activation_checkpointing=c, activation_offload=o, micro_batch_size=m)
              for p, c, o, m in grid]
    if device.startswith("cuda") and importlib.util.find_spec("torchao") is not None:
        chosen += [Plan(precision=p, optimizer_offload=True, micro_batch_size=16) for p in ("32-true", "bf16-mixed")]
    return [p for p in chosen if not p.activation_offload] if quick else chosen


# ------------------------------------------------------------------------------------------------ the real step


def measure_peak(*, model: LightningModule, batch: Any, plan: Plan, device: str | torch.device = "cpu") -> int:
    """The measured peak of the second real training step of ``model`` (a copy) with ``plan`` on ``batch``.

    CPU: tensor bytes alive at the peak, from the profiler's allocator events; CUDA: ``max_memory_allocated``
    less what was allocated before the copy reached the device (earlier measurements' leftovers).
    """
    device = torch.device(device)
    base = 0
    if device.type == "cuda":
        gc.collect()  # checkpointed blocks of an earlier measurement sit in reference cycles
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
    model = copy.deepcopy(model).to(device).train()
    precision = _precision_plugin(plan.precision, device)
    if precision is not None and hasattr(precision, "convert_module") and plan.precision.endswith("-true"):
        model = precision.convert_module(model)
    if plan.activation_checkpointing == "auto":
        _checkpoint_levels([m for m in model.modules() if isinstance(m, BLOCKS) or type(m).__name__ in _HF_LAYERS],
                           plan.recompute or ())
    elif plan.activation_checkpointing:
        _checkpoint(_blocks(model, plan.activation_checkpointing))
    optimizer: Any = _optimizer(model)
    if plan.optimizer_offload:
        optimizer = _offloaded(optimizer)
    size = _tensors(batch)[0].shape[0]  # a tuple or a dict of tensors, samples first
    micro = plan.micro_batch_size or size
    parts = [_slice(batch, i, i + micro) for i in range(0, size, micro)]

    def step() -> None:
        offload = (torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda") if plan.activation_offload
                   else _nothing())
        with offload:
            for i, part in enumerate(parts):
                part = _to(part, device, precision)
                with precision.forward_context() if precision is not None else _nothing():
                    output = model.training_step(part, 0)
                loss = (output["loss"] if isinstance(output, dict) else output) / len(parts)
                if i == 0:
                    optimizer.zero_grad(set_to_none=True)
                loss.backward()
                del loss, output, part
        optimizer.step()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if device.type == "cuda":
            step()
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            step()
            torch.cuda.synchronize(device)
            return torch.cuda.max_memory_allocated(device) - base
        return _profiled_cpu_peak(model, batch, step)


#: The classes of the repeated blocks of the models measured: what checkpointing wraps.
#: (Lightning's demo Transformer: its encoder and decoder layers, as ``find_blocks`` picks them.)
BLOCKS: tuple[type[nn.Module], ...] = (Block, MLPBlock, ConvBlock, nn.TransformerEncoderLayer,
                                       nn.TransformerDecoderLayer, Experts)


def _blocks(model: nn.Module, share: float | tuple[str, ...]) -> list[nn.Module]:
    """The blocks a plan's ``activation_checkpointing`` names: the first ``share`` of the model's blocks (in module
    order, rounded up), or those whose class name is listed."""
    if isinstance(share, tuple):
        return [m for m in model.modules() if type(m).__name__ in share]
    blocks = [m for m in model.modules() if isinstance(m, BLOCKS)]
    return blocks[: math.ceil(share * len(blocks) - 1e-9)] if share > 0 else []


def _checkpoint(blocks: list[nn.Module]) -> None:
    """Recompute each of ``blocks`` in backward: its forward runs under non-reentrant ``checkpoint`` (the model is a
    throw-away copy, so nothing is undone)."""
    from torch.utils.checkpoint import checkpoint

    for block in blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)  # type: ignore[method-assign]


#: transformers' layers ``recompute.py`` measures (their models declare them as their unit of checkpointing).
_HF_LAYERS = ("GPT2Block", "LlamaDecoderLayer")
#: What this measurement's selective checkpointing saves (its own list, not the library's): matrix products and
#: attention.
_SAVED = ("mm", "addmm", "bmm", "baddbmm", "convolution", "_scaled_dot_product_flash_attention_for_cpu",
          "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
          "_scaled_dot_product_cudnn_attention")


def _checkpoint_levels(blocks: list[nn.Module], levels: tuple[str, ...]) -> None:
    """``activation_checkpointing="auto"``: each block at its level: ``none``, ``ops`` (torch's selective
    checkpointing saving matrix products and attention) or ``block`` (plain checkpoint)."""
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    saved = {getattr(torch.ops.aten, name).default for name in _SAVED if hasattr(torch.ops.aten, name)}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    assert len(levels) == len(blocks), (levels, len(blocks))
    for block, level in zip(blocks, levels):
        if level == "block":
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)  # type: ignore
        elif level == "ops":
            block.forward = functools.partial(  # type: ignore[method-assign]
                checkpoint, block.forward, use_reentrant=False,
                context_fn=functools.partial(create_selective_checkpoint_contexts, policy))


def _offloaded(optimizer: torch.optim.Optimizer) -> Any:
    """``optimizer`` (its class and settings) rebuilt as torchao's ``CPUOffloadOptimizer``: state and update on the
    host for parameters of at least ``OFFLOAD_MIN_NUMEL`` elements, gradients copied to the host during backward."""
    from torchao.optim import CPUOffloadOptimizer

    accepted = inspect.signature(type(optimizer)).parameters
    settings = {k: v for k, v in optimizer.defaults.items() if k in accepted and k not in _DEVICE_KEYS}
    groups = [{**{k: v for k, v in g.items() if k not in _DEVICE_KEYS}, "params": list(g["params"])}
              for g in optimizer.param_groups]
    return CPUOffloadOptimizer(groups, optimizer_class=type(optimizer), minimal_size=OFFLOAD_MIN_NUMEL, **settings)



def _optimizer(model: LightningModule) -> torch.optim.Optimizer:
    """The model's optimizer; a model asking its trainer for the schedule length gets an endless one."""
    from types import SimpleNamespace

    model._trainer = SimpleNamespace(estimated_stepping_batches=float("inf"))  # type: ignore[assignment]
    try:
        config = model.configure_optimizers()
    finally:
        model._trainer = None
    if isinstance(config, dict):
        config = config["optimizer"]
    return config


def _profiled_cpu_peak(model: nn.Module, batch: Any, step: Any) -> int:
    from torch.profiler import ProfilerActivity, profile, record_function

    before = _bytes_alive(*model.parameters(), *model.buffers(), *_tensors(batch))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()  # warm-up inside the profile, so the frees of its gradients are seen
        with record_function("measured_step"):
            step()
    events = prof.profiler.kineto_results.events()  # type: ignore[union-attr]
    window = next(e for e in events if e.name() == "measured_step")
    memory = sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns())
    alive = peak = 0
    for event in memory:
        alive += event.nbytes()
        if window.start_ns() <= event.start_ns() <= window.end_ns():
            peak = max(peak, alive)
    return before + peak


def _bytes_alive(*tensors: Tensor) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _tensors(batch: Any) -> list[Tensor]:
    from lightning.fabric.utilities.apply_func import apply_to_collection

    found: list[Tensor] = []
    apply_to_collection(batch, Tensor, found.append)
    return found


def _slice(batch: Any, start: int, stop: int) -> Any:
    if isinstance(batch, dict):
        return {k: v[start:stop] for k, v in batch.items()}
    return tuple(t[start:stop] for t in batch)


def _to(batch: Any, device: torch.device, precision: Any) -> Any:
    from lightning.fabric.utilities.apply_func import apply_to_collection

    moved = apply_to_collection(batch, Tensor, lambda t: t.to(device))
    return precision.convert_input(moved) if precision is not None else moved


def _precision_plugin(precision: str, device: torch.device) -> Any:
    from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision

    if precision.endswith("-mixed"):
        return MixedPrecision(precision, device=device.type)  # type: ignore[arg-type]
    if precision in ("bf16-true", "16-true"):
        return HalfPrecision(precision)  # type: ignore[arg-type]
    return None


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield


# ------------------------------------------------------------------------------------------------------- report


def _measure_case(name: str, plan: dict[str, Any], device: str) -> int:
    """One CUDA case, in a process of its own: cuBLAS keeps its workspaces allocated once a matrix product has run,
    so in a shared process every case after the first would count them in its base and leave them out of its peak,
    while the estimate counts them (``autotune/_estimate/workspace.py``)."""
    model, batch = build(name)
    return measure_peak(model=model, batch=batch, plan=Plan.from_dict(plan), device=device)


def _real_paths(model: LightningModule, batch: Any, plan: Plan, device: str) -> tuple[int, int]:
    """The real-tensor path's prediction traced at the micro-batch (``trace="real"``), and on the line through
    micro-batches 2 and 4 (``trace="line"``)."""
    real = estimate(model=model, batch=batch, plan=plan, device=device, trace="real").predicted_peak_bytes
    line = estimate(model=model, batch=batch, plan=plan, device=device, trace="line").predicted_peak_bytes
    return real, line


def run(*, models: list[str], plan_list: list[Plan], device: str, paths: bool = False) -> list[dict[str, Any]]:
    """Predict and measure every model x plan; one row per pair (``paths``: each real-tensor path's error too)."""
    rows = []
    for name in models:
        model, batch = build(name)
        for plan in plan_list:
            start = time.perf_counter()
            predicted = estimate(model=model, batch=batch, plan=plan, device=device)
            traced = time.perf_counter() - start
            if device.startswith("cuda"):  # a fresh process per case: see _measure_case
                measured = in_fresh_process(_measure_case, name, plan.to_dict(), device)
            else:
                measured = measure_peak(model=model, batch=batch, plan=plan, device=device)
            gc.collect()
            error = (predicted.predicted_peak_bytes - measured) / measured
            row = {"model": name, "plan": plan.describe(), "predicted_bytes": predicted.predicted_peak_bytes,
                   "measured_bytes": measured, "error": error, "trace_seconds": traced,
                   "overhead_bytes": predicted.overhead_bytes, "method": predicted.method}
            if paths:
                real, line = _real_paths(model, batch, plan, device)
                row.update(real_error=(real - measured) / measured, extrapolated_error=(line - measured) / measured)
            rows.append(row)
            print(f"{name:10} {plan.describe():40} predicted {predicted.predicted_peak_bytes:>12,} "
                  f"measured {measured:>12,} error {error:+.2%} ({predicted.method})", file=sys.stderr)
    return rows


def markdown(rows: list[dict[str, Any]], device: str) -> str:
    """The rows as a Markdown table, and the median absolute error (of each path, where measured)."""
    mib = 2**20
    paths = "real_error" in rows[0]
    cells = [[row["model"], row["plan"], row["method"], f"{row['predicted_bytes'] / mib:.2f}",
              f"{row['measured_bytes'] / mib:.2f}", f"{row['error']:+.1%}",
              *([f"{row['real_error']:+.1%}", f"{row['extrapolated_error']:+.1%}"] if paths else [])] for row in rows]
    header = ["model", "plan", "traced", "predicted (MiB)", "measured (MiB)", "error",
              *(["real tensors", "real, from micro 2 and 4"] if paths else [])]
    lines = [markdown_table(header, cells, right=tuple(range(3, len(header))))]
    errors = [abs(row["error"]) for row in rows]
    lines.append("")
    lines.append(f"Median absolute error on {device}: {statistics.median(errors):.1%} over {len(rows)} cases "
                 f"(max {max(errors):.1%}).")
    if paths:
        for key, label in (("real_error", "real tensors"), ("extrapolated_error", "real, from micro 2 and 4")):
            errs = [abs(row[key]) for row in rows]
            lines.append(f"{label}: median {statistics.median(errs):.1%}, max {max(errs):.1%}.")
    if device.startswith("cuda"):  # what the constant overhead should be: measured minus the tensors predicted
        residual = statistics.median(r["measured_bytes"] - r["predicted_bytes"] + r["overhead_bytes"] for r in rows)
        lines.append(f"Calibration: median of measured minus predicted tensors {residual / mib:.2f} MiB "
                     f"(the estimator's overhead: {rows[0]['overhead_bytes'] / mib:.2f} MiB).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__doc__, raw=False)
    add_device(parser, help="'cpu' or 'cuda' (default: cpu)", choices=None)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--quick", action="store_true", help="leave out the offload plans")
    parser.add_argument("--paths", action="store_true",
                        help="also each real-tensor path's error: traced at the micro-batch, and extrapolated")
    add_json(parser, "also write the rows to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = run(models=args.models, plan_list=plans(quick=args.quick, device=args.device), device=args.device,
               paths=args.paths)
    print(markdown(rows, args.device))
    if args.json is not None:
        meta = {"device": args.device, "torch": torch.__version__, "python": platform.python_version(),
                "device_name": probe_memory(args.device).name}
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
