"""Run by test_estimate_fsdp_measured.py: 2 CPU ranks (gloo) train a residual MLP that ApplyPlan shards with FSDP2
under ModelParallelStrategy (``Plan(strategy="fsdp", devices=2)``), and each rank measures the peak tensor bytes of
one steady-state training step.

What is measured, per rank, for step ``MEASURED`` (``on_train_batch_start`` .. ``on_train_batch_end``; the optimizer
state exists from step 0 on, step 1 is a warm-up):

- the bytes alive when the step starts: the distinct storages of every CPU tensor the process can reach (``gc``),
  at their full (padded) size: the local shards of the parameters, of the last step's gradients and of the optimizer
  state, the batch, and anything else alive, except the data set the DataLoader reads from (host data, not the
  step's). The categories are written too, to check the sum.
- what the step adds on top, at its highest: the running sum of the CPU allocator's events seen by torch's profiler
  (``profile_memory=True``). The profiler runs from before the model is built, so the frees of tensors made earlier
  (the last step's gradients at ``zero_grad``) are seen. The highest points before ``zero_grad`` (the forward) and
  after it (backward and update) are written apart.

The profiler only reports the allocations and frees made on its own thread, and gloo's worker thread sometimes drops
the last reference to a collective's buffer (the copy gloo's reduce-scatter makes of its input), so that free goes
unreported: see :func:`step_peaks` for how such blocks are closed, and ``unexplained_end_bytes`` for what would be
left over.

Both cases (``fp32``: 32-true; ``bf16``: bf16-mixed, FSDP2's bf16 policy) run in the same two processes, one after
the other; each rank writes ``rank{r}.json``, one entry per case.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from autotune import Plan  # noqa: E402
from autotune.callbacks import ApplyPlan  # noqa: E402
from tests.support.ranks import exit_rank  # noqa: E402

#: 6 blocks of 1.18 M parameters (4.7 MB in fp32), a root holding the head; one rank's batch is 8 x 64 tokens.
WIDTH, DEPTH, CLASSES, TOKENS, BATCH = 384, 6, 16, 64, 8
#: The step measured (0-based).
MEASURED = 2
CASES = {"fp32": "32-true", "bf16": "bf16-mixed"}


class Block(nn.Module):
    """Pre-norm residual MLP block."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class PeakMLP(L.LightningModule):
    """A per-token classifier: ``DEPTH`` residual blocks and a linear head; AdamW. FSDP2's units are the blocks and
    the module itself (the root, holding the head)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(WIDTH) for _ in range(DEPTH)))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.blocks(x))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def make_model() -> PeakMLP:
    torch.manual_seed(0)
    return PeakMLP()


def make_samples(n: int) -> tuple[Tensor, Tensor]:
    """``n`` samples: (n, TOKENS, WIDTH) inputs and (n, TOKENS) labels."""
    gen = torch.Generator().manual_seed(0)
    return torch.randn(n, TOKENS, WIDTH, generator=gen), torch.randint(0, CLASSES, (n, TOKENS), generator=gen)


def rank_batch() -> tuple[Tensor, Tensor]:
    """A batch shaped like one rank's, in tensors of its own as the DataLoader collates them (not views of the data
    set, whose whole storage the estimator would count)."""
    return make_samples(BATCH)


def plan_of(case: str) -> Plan:
    return Plan(strategy="fsdp", devices=2, precision=CASES[case])


# ---------------------------------------------------------------------------------------------------- measuring


class StepPeak(L.Callback):
    """At step ``MEASURED``: counts the tensors alive when it starts (less ``excluded``: the data set) and marks the
    step and its ``zero_grad`` in the running profile."""

    def __init__(self, excluded: tuple[Tensor, ...] = ()) -> None:
        self.excluded = excluded
        self.alive_at_start: dict[int, int] = {}
        self.alive_at_end: dict[int, int] = {}
        self.categories: dict[str, int] = {}
        self._window: Any = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if trainer.global_step == MEASURED:
            gc.collect()  # garbage is not alive: nothing the count includes is left to be freed by a collection
            self.alive_at_start = self._alive()
            self.categories = category_bytes(pl_module, trainer.optimizers, batch)
            self._window = torch.autograd.profiler.record_function("measured_step")
            self._window.__enter__()

    def on_before_zero_grad(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if self._window is not None:
            with torch.autograd.profiler.record_function("zero_grad_mark"):
                pass

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._window is not None:
            self._window.__exit__(None, None, None)
            self._window = None
            self.alive_at_end = self._alive()

    def _alive(self) -> dict[int, int]:
        """The distinct CPU storages (address: bytes) of every tensor the process can reach, but the data set's."""
        alive = storages(o for o in gc.get_objects() if isinstance(o, Tensor))
        for ptr in storages(self.excluded):
            alive.pop(ptr, None)
        return alive


def storages(tensors: Any) -> dict[int, int]:
    """Address and bytes of the distinct CPU storages of ``tensors`` (a DTensor's local shard, padding included)."""
    out: dict[int, int] = {}
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        if not isinstance(local, Tensor) or local.device.type != "cpu" or local.is_meta:
            continue
        storage = local.untyped_storage()
        if storage.nbytes():
            out[storage.data_ptr()] = storage.nbytes()
    return out


def category_bytes(model: nn.Module, optimizers: list[Any], batch: Any) -> dict[str, int]:
    """Storage bytes of the rank's local shards by category, and of the batch (a storage counted once)."""
    params = [*model.parameters(), *model.buffers()]
    groups = {
        "parameters": storages(params),
        "gradients": storages(p.grad for p in params if p.grad is not None),
        "optimizer_state": storages(t for opt in optimizers for s in opt.state.values() for t in s.values()
                                    if isinstance(t, Tensor)),
        "batch": storages(batch),
    }
    seen: set[int] = set()
    out = {}
    for name, found in groups.items():
        out[name] = sum(n for ptr, n in found.items() if ptr not in seen)
        seen.update(found)
    return out


def step_peaks(prof: Any, meter: StepPeak) -> dict[str, Any]:
    """The measured step's peaks: the bytes alive at its start, plus the most the allocator events add on top.

    The profiler reports only the allocations and frees made on its own thread: gloo's worker thread sometimes
    drops the last reference to a collective's buffer, and that free goes unreported. Such a block (an allocation
    whose address is allocated again, or never freed, with no free seen) made inside a collective is taken as freed
    when the collective returned (its work object is what held it); any other is freed where its address is reused,
    and at the step's start every block that is not a live tensor's storage is dropped.
    """
    allocations: list[tuple[int, int, int, int | None]] = []  # time, bytes (< 0: a free), address, collective's end
    marks: dict[str, int] = {}

    def walk(events: Any, collective_end: int | None) -> None:
        for e in events:
            fields = e.extra_fields
            if type(fields).__name__ == "_ExtraFields_Allocation":
                if fields.device.type == "cpu":
                    allocations.append((e.start_time_ns, fields.alloc_size, fields.ptr, collective_end))
                continue
            if e.name in ("measured_step", "zero_grad_mark"):
                marks[e.name] = e.start_time_ns
                marks[e.name + "_end"] = e.end_time_ns
            inside = e.name.startswith(("c10d::", "gloo:"))
            walk(e.children, collective_end if collective_end is not None or not inside else e.end_time_ns)

    walk(prof.profiler.kineto_results.experimental_event_tree(), None)
    allocations.sort(key=lambda a: a[0])
    # Pair each allocation with its free; give the unpaired ones the free their lifetime implies.
    events: list[tuple[int, int, int]] = []  # time, bytes, allocation index
    open_at: dict[int, int] = {}  # address -> index of the allocation there
    unseen = 0

    def close_unseen(index: int, reused_at: int | None) -> None:
        nonlocal unseen
        time, size, _, collective_end = allocations[index]
        free_at = collective_end if collective_end is not None else reused_at
        if free_at is not None:
            events.append((max(free_at, time), -size, index))
        unseen += 1

    for i, (time, size, ptr, _) in enumerate(allocations):
        if size > 0:
            if ptr in open_at:
                close_unseen(open_at.pop(ptr), time)
            open_at[ptr] = i
            events.append((time, size, i))
        elif ptr in open_at:
            events.append((time, size, open_at.pop(ptr)))
    for index in open_at.values():
        if allocations[index][2] not in meter.alive_at_end:
            close_unseen(index, None)
    events.sort(key=lambda e: e[0])
    start, zero_grad, end = marks["measured_step"], marks["zero_grad_mark"], marks["measured_step_end"]
    held: dict[int, int] = {}  # allocation index -> bytes
    total = 0
    base = forward = backward = None
    for time, size, index in events:
        if base is None and time >= start:
            for j in [j for j in held if allocations[j][2] not in meter.alive_at_start]:
                total -= held.pop(j)  # freed before the step without a trace
            base, forward, backward = total, 0, 0
        if time > end:
            break
        if size > 0:
            held[index] = size
        elif held.pop(index, None) is None:
            continue
        total += size
        if base is not None:
            if time < zero_grad:
                forward = max(forward, total - base)
            else:
                backward = max(backward, total - base)
    if base is None or forward is None or backward is None:
        raise RuntimeError("the profile holds no allocation after the measured step began")
    alive = sum(meter.alive_at_start.values())
    return {
        "peak_bytes": alive + max(forward, backward),
        "forward_peak_bytes": alive + forward,
        "backward_peak_bytes": alive + backward,
        "alive_at_start_bytes": alive,
        "categories_at_start": meter.categories,
        "unseen_frees": unseen,
        # what the events hold at the step's end beyond what is alive then (0 when every free was accounted for)
        "unexplained_end_bytes": (total - base) - (sum(meter.alive_at_end.values()) - alive),
    }


def measure(case: str) -> dict[str, Any]:
    """Train ``MEASURED + 1`` steps of ``case`` on this rank and return what step ``MEASURED`` peaked at."""
    from torch.profiler import ProfilerActivity, profile

    plan = plan_of(case)
    samples = make_samples(2 * BATCH * (MEASURED + 1))
    meter = StepPeak(excluded=samples)
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model = make_model()
        trainer = L.Trainer(**plan.trainer_kwargs(), accelerator="cpu", max_steps=MEASURED + 1,
                            callbacks=[ApplyPlan(**plan.apply_kwargs()), meter], logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            limit_val_batches=0, num_sanity_val_steps=0)
        trainer.fit(model, DataLoader(TensorDataset(*samples), batch_size=BATCH, shuffle=False))
    return {**step_peaks(prof, meter), "global_step": trainer.global_step, "rank": trainer.global_rank}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    args = parser.parse_args()
    results = {}
    for case in args.cases:
        results[case] = measure(case)
        gc.collect()
    (Path(args.out) / f"rank{torch.distributed.get_rank()}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
    exit_rank()
