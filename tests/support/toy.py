"""A small model, fault injection at the real places, and reference trainers for the elastic tests.

Faults model a memory limit: a step whose micro-batch is larger than ``limit`` raises ``torch.OutOfMemoryError``
where a real OOM would surface (forward, a backward hook, inside ``optimizer.step`` after a partial update, or in
``validation_step``), only at the steps the fault lists.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

IN, OUT = 8, 2


@dataclass
class Fault:
    where: str  # "forward" | "backward" | "mid_backward" (after the last layers' gradients) | "step" (after a partial
    # update) | "step_start" (before it) | "validation"
    limit: int  # micro-batches larger than this run out of memory
    steps: Callable[[int], bool] = lambda step: True  # at which global steps
    rank: int | None = None  # only on this rank (DDP)
    hits: list[tuple[int, int]] = field(default_factory=list)

    def fires(self, step: int, size: int, rank: int = 0) -> bool:
        if size > self.limit and self.steps(step) and (self.rank is None or self.rank == rank):
            self.hits.append((step, size))
            return True
        return False


def oom() -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")


class FaultyAdamW(torch.optim.AdamW):
    """AdamW whose update runs out of memory half-way: the first parameter is already changed when it raises."""

    fault: Fault | None = None
    module: L.LightningModule | None = None

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        module = self.module
        if self.fault is not None and module is not None:
            size = module.last_micro_size
            if self.fault.where == "step_start" and self.fault.fires(module.trainer.global_step, size,
                                                                     module.global_rank):
                raise oom()  # before the update changed anything
            if self.fault.where == "step" and self.fault.fires(module.trainer.global_step, size, module.global_rank):
                with torch.no_grad():
                    first = self.param_groups[0]["params"][0]
                    first.add_(1.0)  # a half-applied multi-tensor update
                    self.state[first]["exp_avg"] = torch.ones_like(first)
                raise oom()
        super().step()
        return loss


class SampleDataset(Dataset):
    """``n`` samples; each has an id so the tests can check which samples every step saw."""

    def __init__(self, n: int, kind: str = "tuple", seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, IN, generator=g)
        self.y = torch.randn(n, OUT, generator=g)
        self.kind = kind

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Any:
        if self.kind == "dict":
            return {"x": self.x[i], "y": self.y[i], "id": i, "name": f"s{i}"}
        if self.kind == "tensor":
            return torch.cat([self.x[i], self.y[i], torch.tensor([float(i)])])
        if self.kind == "lists":  # one target tensor per sample, NumPy ids, (h, w) sizes: kept as lists by collate
            return self.x[i], self.y[i], np.int64(i), (i, i + 1)
        return self.x[i], self.y[i], i


@dataclass
class ListsBatch:
    """A detection-style batch: stacked inputs, then per-sample lists; ``ids`` is set after construction."""

    x: torch.Tensor
    targets: list[torch.Tensor]
    sizes: list[tuple[int, int]]
    ids: list[Any] = field(init=False)


def collate_lists(items: list[Any]) -> ListsBatch:
    batch = ListsBatch(torch.stack([x for x, *_ in items]), [y for _, y, *_ in items], [s for *_, s in items])
    batch.ids = [i for _, _, i, _ in items]
    return batch


def unpack(batch: Any, kind: str) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    if kind == "dict":
        return batch["x"], batch["y"], batch["id"].tolist()
    if kind == "tensor":
        return batch[:, :IN], batch[:, IN : IN + OUT], batch[:, -1].long().tolist()
    if kind == "lists":
        if not len(batch.x) == len(batch.targets) == len(batch.ids) == len(batch.sizes):
            raise AssertionError(f"a micro-batch of {len(batch.x)} inputs got {len(batch.targets)} targets")
        if [h for h, _ in batch.sizes] != [int(i) for i in batch.ids]:
            raise AssertionError("sizes and ids of different samples")
        return batch.x, torch.stack(batch.targets), [int(i) for i in batch.ids]
    return batch[0], batch[1], batch[2].tolist()


class ToyModel(L.LightningModule):
    def __init__(
        self,
        *,
        fault: Fault | None = None,
        dropout: float = 0.0,
        kind: str = "tuple",
        batchnorm: bool = False,
        lr: float = 0.05,
        scheduler: bool = True,
        optimizer: str = "adamw",
        unfreeze_at: int | None = None,
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        norm: nn.Module = nn.BatchNorm1d(16) if batchnorm else nn.Identity()
        self.net = nn.Sequential(nn.Linear(IN, 16), norm, nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, OUT))
        self.fault = fault
        self.kind = kind
        self.lr = lr
        self.use_scheduler = scheduler
        self.optimizer_name = optimizer
        self.seen: list[tuple[int, list[int]]] = []  # (global_step, sample ids) per training micro-batch call
        self.val_seen: list[int] = []
        self.last_micro_size = 0
        self.lrs: list[float] = []
        self.unfreeze_at = unfreeze_at  # the first layer trains from this step on (its optimizer state starts there)
        self.net[0].requires_grad_(unfreeze_at is None)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(x), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, ids = unpack(batch, self.kind)
        step = self.trainer.global_step
        self.seen.append((step, ids))
        self.last_micro_size = len(ids)
        fault = self.fault
        if fault is not None and fault.where == "forward" and fault.fires(step, len(ids), self.global_rank):
            raise oom()
        hook = None
        if fault is not None and fault.where == "mid_backward" and fault.fires(step, len(ids), self.global_rank):
            # In the backward of the first layer's output: the layers after it have their gradients already
            def fail_in_its_backward(module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
                output.register_hook(lambda grad: (_ for _ in ()).throw(oom()))

            hook = self.net[0].register_forward_hook(fail_in_its_backward)
        out = self.net(x)
        if hook is not None:
            hook.remove()
        if fault is not None and fault.where == "backward" and fault.fires(step, len(ids), self.global_rank):
            out.register_hook(lambda grad: (_ for _ in ()).throw(oom()))
        loss = nn.functional.mse_loss(out, y)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.trainer.global_step == self.unfreeze_at:
            self.net[0].requires_grad_(True)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y, ids = unpack(batch, self.kind)
        self.val_seen.append(len(ids))
        fault = self.fault
        if fault is not None and fault.where == "validation" and fault.fires(self.trainer.global_step, len(ids)):
            raise oom()
        self.log("val_loss", self.loss(x, y))

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "sgd":
            optimizer: torch.optim.Optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        else:
            optimizer = FaultyAdamW(self.parameters(), lr=self.lr)
            optimizer.fault = self.fault if self.fault is not None and self.fault.where.startswith("step") else None
            optimizer.module = self
        if not self.use_scheduler:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def loader(n: int, batch_size: int, kind: str = "tuple", **kwargs: Any) -> DataLoader:
    if kind == "lists":
        kwargs.setdefault("collate_fn", collate_lists)
    return DataLoader(SampleDataset(n, kind), batch_size=batch_size, shuffle=False, **kwargs)


def trainer(callbacks: Iterable[Any] = (), **kwargs: Any) -> L.Trainer:
    options: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    options.update(kwargs)
    return L.Trainer(callbacks=list(callbacks), **options)


def fit(model: L.LightningModule, data: DataLoader, callbacks: Iterable[Any] = (), val: Any = None, **kw: Any) -> L.Trainer:
    L.seed_everything(0, verbose=False)
    t = trainer(callbacks, **kw)
    t.fit(model, data, val)
    return t


def max_weight_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def reference(
    data: DataLoader,
    micro_sizes: list[int],
    *,
    kind: str = "tuple",
    clip: float | None = None,
    lr: float = 0.05,
    unfreeze_at: int | None = None,
    batchnorm: bool = False,
) -> ToyModel:
    """Plain PyTorch: step ``s`` accumulates micro-batches of ``micro_sizes[s]`` and takes one AdamW step."""
    model = ToyModel(kind=kind, lr=lr, unfreeze_at=unfreeze_at, batchnorm=batchnorm)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    for step, batch in enumerate(data):
        if step == unfreeze_at:
            model.net[0].requires_grad_(True)
        x, y, _ = unpack(batch, kind)
        n = len(x)
        m = min(micro_sizes[step], n)
        sizes = [m] * (n // m) + ([n % m] if n % m else [])
        even = all(s == sizes[0] for s in sizes)
        optimizer.zero_grad()
        start = 0
        for size in sizes:
            loss = model.loss(x[start : start + size], y[start : start + size])
            if len(sizes) > 1:
                loss = loss / len(sizes) if even else loss * (size / n)
            loss.backward()
            start += size
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        scheduler.step()
    return model
