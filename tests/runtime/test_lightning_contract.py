"""ElasticBatchSize's contract at its edges: optimizers that call the closure several times, hooks that run once per
step, outputs of the whole batch, batches without tensors, and the errors it recognises as out of memory."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from autotune.callbacks import ElasticBatchSize
from tests.support.toy import ToyModel, fit, loader, max_weight_diff, oom


def _data(n: int = 64, batch: int = 16) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    return DataLoader(TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 2, generator=g)), batch_size=batch)


class Net(L.LightningModule):
    """A small regression model; ``fail`` decides, per training_step call, whether it runs out of memory."""

    def __init__(self, *, optimizer: str = "adamw", fail: Any = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
        self.optimizer_name, self.fail = optimizer, fail
        self.calls = 0
        self.zero_grad_hooks: dict[int, int] = {}
        self.ema = [p.detach().clone() for p in self.net.parameters()]
        self.outputs: list[Any] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        self.calls += 1
        if self.fail is not None and self.fail(self, len(x)):
            raise oom()
        out = self.net(x)
        return {"loss": nn.functional.mse_loss(out, y), "preds": out.detach(), "first": x[:, 0]}

    def on_before_zero_grad(self, optimizer: Any) -> None:  # an EMA of the weights, as users keep one
        step = self.trainer.global_step
        self.zero_grad_hooks[step] = self.zero_grad_hooks.get(step, 0) + 1
        with torch.no_grad():
            for e, p in zip(self.ema, self.net.parameters()):
                e.mul_(0.9).add_(p, alpha=0.1)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.outputs.append((outputs, batch))

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "lbfgs":
            return torch.optim.LBFGS(self.parameters(), lr=0.5, max_iter=4)
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.1)
        return torch.optim.AdamW(self.parameters(), lr=0.05)


def _fit(model: L.LightningModule, callbacks: list[Any], data: Any = None, **kwargs: Any) -> L.Trainer:
    return fit(model, data if data is not None else _data(), callbacks, **kwargs)


@pytest.mark.parametrize("fail_at", [1, 3, 7])  # step 0's first and third closure evaluation; step 1's third
def test_lbfgs_recovers_from_an_oom_in_any_closure_evaluation(fail_at: int) -> None:
    """L-BFGS calls the closure several times per step and moves the parameters between the calls: the host copy is
    taken once, before the first, and the step is replayed from it."""
    cb = ElasticBatchSize(grow=False, micro_batch_size=8)
    evaluations = []

    def fail(model: Net, size: int) -> bool:
        if cb.engine.index != 0:
            return False
        evaluations.append(size)
        return len(evaluations) == fail_at and size > 4

    ref = Net(optimizer="lbfgs")
    _fit(ref, [])
    model = Net(optimizer="lbfgs", fail=fail)
    _fit(model, [cb])
    assert [(e.kind, e.previous, e.micro_batch_size) for e in cb.events] == [("oom", 8, 4)]
    assert max_weight_diff(model, ref) < 1e-5  # the sum of micro-batch losses, not bit-identical to the whole one


def test_on_before_zero_grad_runs_once_per_step_and_not_again_on_a_replay() -> None:
    ref = Net()
    _fit(ref, [])
    cb = ElasticBatchSize(grow=False, micro_batch_size=8)  # the second micro-batch fails: the hooks had run
    model = Net(fail=lambda m, size: m.trainer.global_step == 1 and size > 4 and cb.engine.index == 1)
    _fit(model, [cb])
    assert [(e.step, e.micro_batch_size) for e in cb.events] == [(1, 4)]
    assert model.zero_grad_hooks == ref.zero_grad_hooks == {0: 1, 1: 1, 2: 1, 3: 1}
    assert max(float((a - b).abs().max()) for a, b in zip(model.ema, ref.ema)) < 1e-6
    assert max_weight_diff(model, ref) < 1e-6


def test_training_step_outputs_are_those_of_the_whole_batch() -> None:
    model = Net(fail=lambda m, size: m.trainer.global_step == 2 and size > 4)
    _fit(model, [ElasticBatchSize(grow=False, micro_batch_size=8)])
    assert len(model.outputs) == 4
    for outputs, (x, _) in model.outputs:
        assert torch.equal(outputs["first"], x[:, 0])  # every sample's, in order
        assert outputs["preds"].shape == (16, 2)


def test_a_stateless_update_is_copied_once_and_an_lbfgs_update_every_step() -> None:
    copied: dict[str, list[int]] = {}

    class Copied(L.Callback):
        def __init__(self, name: str) -> None:
            self.name = name

        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            copied.setdefault(self.name, []).append(trainer.callbacks[0].update_snapshot_bytes)

    for name in ("sgd", "lbfgs", "adamw"):
        _fit(Net(optimizer=name), [ElasticBatchSize(grow=False, micro_batch_size=8), Copied(name)])
    params = sum(p.numel() * 4 for p in Net().parameters())
    assert copied["sgd"] == [params, 0, 0, 0]  # SGD without momentum keeps no state: its updates are steady
    assert copied["adamw"] == [params, 0, 0, 0]
    assert copied["lbfgs"][0] == params and all(c > params for c in copied["lbfgs"][1:])  # its state on top


def test_a_steady_stateless_update_that_fails_before_changing_anything_is_replayed() -> None:
    class FailingSGD(torch.optim.SGD):
        failed = False

        def step(self, closure: Any = None) -> Any:  # type: ignore[override]
            loss = closure()
            if not FailingSGD.failed and model.trainer.global_step == 2:  # before it changed anything
                FailingSGD.failed = True
                raise oom()
            super().step()
            return loss

    model = Net(optimizer="sgd")
    model.configure_optimizers = lambda: FailingSGD(model.parameters(), lr=0.1)  # type: ignore[method-assign]
    cb = ElasticBatchSize(grow=False, micro_batch_size=8)
    _fit(model, [cb])
    ref = Net(optimizer="sgd")
    _fit(ref, [])
    assert [(e.step, e.where, e.micro_batch_size) for e in cb.events] == [(2, "update", 4)]
    assert max_weight_diff(model, ref) < 1e-6


def test_a_gradient_accumulation_scheduler_is_refused() -> None:
    scheduler = GradientAccumulationScheduler({0: 1, 1: 2})
    with pytest.raises(MisconfigurationException, match=r"GradientAccumulationScheduler sets accumulate_grad_batches "
                                                        r"to \{0: 1, 1: 2\}"):
        _fit(Net(), [ElasticBatchSize(micro_batch_size=8), scheduler], max_epochs=2)


def _texts(items: list[tuple[str, int]]) -> dict[str, list[Any]]:
    return {"text": [t for t, _ in items], "id": [i for _, i in items]}


class Texts(L.LightningModule):
    """Tokenizes in training_step: its batches hold lists only."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.EmbeddingBag(100, 2)
        self.limit, self.seen = limit, []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen.append(list(batch["id"]))
        if len(batch["id"]) > self.limit:
            raise oom()
        tokens = torch.tensor([[int(w) % 100 for w in t.split()] for t in batch["text"]])
        return self.emb(tokens).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_batch_without_tensors_is_split_by_its_per_sample_lists() -> None:
    items = [(f"{i} {i + 1} {i + 2}", i) for i in range(32)]
    model = Texts(limit=4)
    cb = ElasticBatchSize(grow=False, micro_batch_size=8)
    _fit(model, [cb], DataLoader(items, batch_size=16, collate_fn=_texts))
    assert [len(ids) for ids in model.seen] == [8, 4, 4, 4, 4] + [4] * 4
    assert [i for ids in model.seen[1:5] for i in ids] == list(range(16))
    assert [(e.kind, e.micro_batch_size) for e in cb.events] == [("oom", 4)]


def test_a_batch_with_nothing_to_split_says_so_once() -> None:
    class Whole(Texts):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return super().training_step({"text": batch["text"].split("|"), "id": [0]}, batch_idx)

    data = DataLoader([f"{i} {i + 1}" for i in range(8)], batch_size=4, collate_fn=lambda b: {"text": "|".join(b)})
    with pytest.warns(UserWarning, match="holds no tensor and no list of numbers or strings") as caught:
        _fit(Whole(limit=8), [ElasticBatchSize(micro_batch_size=2)], data)
    assert sum("holds no tensor" in str(w.message) for w in caught) == 1


def test_tensors_passed_whole_are_named_once_sequence_first_in_mind() -> None:
    class SequenceFirst(ToyModel):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch  # x: (length 5, batch 16, 8), y: (16, 2)
            return nn.functional.mse_loss(self.net(x).mean(0), y)

    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(5, 16, 8, generator=g), torch.randn(16, 2, generator=g)) for _ in range(3)]
    with pytest.warns(UserWarning, match=r"the batch size is 5, .* tensors of shape \(16, 2\) .* sequence-first") as w:
        _fit(SequenceFirst(scheduler=False), [ElasticBatchSize(micro_batch_size=2)], DataLoader(data, batch_size=None))
    assert sum("go whole into every micro-batch" in str(m.message) for m in w) == 1


def test_per_sample_prediction_lists_come_back_whole_and_in_order_after_a_split() -> None:
    class Predict(ToyModel):
        def predict_step(self, batch: Any, batch_idx: int) -> list[dict[str, Any]]:
            x, _, ids = batch
            if len(ids) > 4:
                raise oom()
            return [{"id": int(i), "out": o} for i, o in zip(ids, self.net(x))]

    model, cb = Predict(), ElasticBatchSize()
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, callbacks=[cb])
    predictions = trainer.predict(model, loader(30, 15))
    assert [[p["id"] for p in batch] for batch in predictions] == [list(range(15)), list(range(15, 30))]
    assert [(e.kind, e.step, e.batch_size, e.previous, e.micro_batch_size, e.where) for e in cb.events] == [
        ("eval_oom", 0, 15, 15, 7, "predict"), ("eval_oom", 0, 15, 7, 3, "predict")]


@pytest.mark.parametrize("error", [
    torch.AcceleratorError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"),
    RuntimeError("cuSOLVER error: CUSOLVER_STATUS_ALLOC_FAILED, when calling `cusolverDnCreate(handle)`"),
    RuntimeError("cuFFT error: CUFFT_ALLOC_FAILED"),
    RuntimeError("HIP error: out of memory"),
    RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
], ids=["cuda-raw", "cusolver", "cufft", "hip-raw", "cublas"])
def test_every_backend_out_of_memory_message_is_replayed(error: RuntimeError) -> None:
    model = Net()
    original = model.net.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        if len(x) > 4:
            raise error
        return original(x)

    model.net.forward = forward  # type: ignore[method-assign]
    cb = ElasticBatchSize(grow=False, micro_batch_size=8)
    _fit(model, [cb])
    assert [(e.kind, e.micro_batch_size) for e in cb.events] == [("oom", 4)]


def test_an_error_that_is_not_out_of_memory_is_not_replayed() -> None:
    model = Net(fail=None)
    model.net.forward = lambda x: (_ for _ in ()).throw(RuntimeError("CUDA error: an illegal memory access"))
    with pytest.raises(RuntimeError, match="illegal memory access"):
        _fit(model, [ElasticBatchSize(grow=False, micro_batch_size=8)])


def test_a_batch_without_tensors_is_estimated_by_its_lists_too() -> None:
    import autotune

    batch = _texts([(f"{i} {i + 1} {i + 2}", i) for i in range(16)])
    small, whole = (autotune.estimate(model=Texts(limit=16), batch=batch, plan=autotune.Plan(micro_batch_size=m),
                                      device="cpu") for m in (4, 16))
    assert small.micro_batch_size == 4 and whole.micro_batch_size == 16
    assert 0 < small.activations_bytes < whole.activations_bytes
