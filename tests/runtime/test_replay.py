"""ElasticBatchSize on CPU: simulated OOM at the real places, compared to Lightning's own accumulation."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
import lightning as L
from lightning.pytorch import Callback

from autotune import OutOfMemoryAtMinimumError
from autotune.callbacks import ElasticBatchSize
from tests.support.toy import Fault, ToyModel, fit, loader, max_weight_diff, reference, trainer, unpack

N = 64
STEPS = 4


def native(*, micro: int, n: int = N * STEPS, **model_kwargs: object) -> tuple[ToyModel, object]:
    """Lightning-native accumulation: batches of ``micro`` samples, accumulate N / micro of them."""
    model = ToyModel(**model_kwargs)  # type: ignore[arg-type]
    t = fit(model, loader(n, micro), accumulate_grad_batches=N // micro, gradient_clip_val=0.5)
    return model, t


def elastic(fault: Fault | None, *, n: int = N * STEPS, batch: int = N, cb: ElasticBatchSize | None = None,
            kind: str = "tuple", extra: tuple[Callback, ...] = (),
            **kwargs: object) -> tuple[ToyModel, object, ElasticBatchSize]:
    cb = cb or ElasticBatchSize(grow=False)
    model_kwargs = {k: kwargs.pop(k) for k in ("dropout", "optimizer", "scheduler") if k in kwargs}
    model = ToyModel(fault=fault, kind=kind, **model_kwargs)  # type: ignore[arg-type]
    t = fit(model, loader(n, batch, kind), [cb, *extra], gradient_clip_val=0.5, **kwargs)
    return model, t, cb


def micro_sizes(model: ToyModel) -> list[int]:
    return [len(ids) for _, ids in model.seen]


@pytest.mark.parametrize("where", ["forward", "backward", "step"])
def test_oom_at_first_step_replays_and_matches_native_accumulation(where: str) -> None:
    fault = Fault(where, limit=16)
    model, t, cb = elastic(fault, dropout=0.2)
    ref, ref_t = native(micro=16, dropout=0.2)

    tried = [64, 32] if where != "step" else [64, 32, 32]  # a step fault fires after all micro-batches ran
    seen = micro_sizes(model)
    assert seen[: len(tried)] == tried
    assert seen[len(tried):] == [16] * (4 * STEPS)
    assert [(e.kind, e.previous, e.micro_batch_size) for e in cb.events] == [("oom", 64, 32), ("oom", 32, 16)]
    assert cb.micro_batch_size == 16
    assert max_weight_diff(model, ref) == 0.0
    assert t.global_step == ref_t.global_step == STEPS
    assert model.lrs == ref.lrs[3::4] == [0.05, 0.025, 0.025, 0.0125]  # native: one batch-end per micro-batch


def test_every_sample_is_seen_once_per_step_after_replay() -> None:
    model, _, _ = elastic(Fault("backward", limit=16))
    by_step: dict[int, list[int]] = {}
    for step, ids in model.seen:
        by_step.setdefault(step, []).append(ids)
    for step in range(STEPS):
        successful = by_step[step][-4:]  # the last attempt of each step is the one that counted
        assert [i for ids in successful for i in ids] == list(range(step * N, (step + 1) * N))


def test_mid_epoch_oom_matches_reference_with_the_same_micro_batches() -> None:
    fault = Fault("forward", limit=16, steps=lambda s: s >= 2)
    model, t, cb = elastic(fault, cb=ElasticBatchSize(grow=False, micro_batch_size=32))
    assert [len(ids) for s, ids in model.seen if s == 2] == [32, 16, 16, 16, 16]
    ref = reference(loader(N * STEPS, N), [32, 32, 16, 16], clip=0.5)
    assert max_weight_diff(model, ref) == 0.0
    assert t.global_step == STEPS


def test_last_short_batch_oom_and_uneven_split() -> None:
    n = N * 3 + 20  # the last batch has 20 samples
    fault = Fault("forward", limit=12, steps=lambda s: s == 3)
    model, t, cb = elastic(fault, n=n, cb=ElasticBatchSize(grow=False, micro_batch_size=24))
    assert [len(ids) for s, ids in model.seen if s == 0] == [24, 24, 16]  # uneven: weighted by n_i / N
    assert [len(ids) for s, ids in model.seen if s == 3] == [20, 10, 10]  # halves what the short batch used
    ref = reference(loader(n, N), [24, 24, 24, 10], clip=0.5)
    assert max_weight_diff(model, ref) == 0.0
    assert t.global_step == 4


@pytest.mark.parametrize("kind", ["dict", "tensor", "lists"])
def test_batch_structures(kind: str) -> None:
    model, _, cb = elastic(Fault("forward", limit=16), kind=kind)
    assert micro_sizes(model)[:3] == [64, 32, 16]
    ref = reference(loader(N * STEPS, N, kind), [16] * STEPS, kind=kind, clip=0.5)
    assert max_weight_diff(model, ref) == 0.0


def test_num_workers_and_sgd() -> None:
    sgd, _, _ = elastic(Fault("backward", limit=32), optimizer="sgd")
    ref_sgd, _ = native(micro=32, optimizer="sgd")
    assert max_weight_diff(sgd, ref_sgd) == 0.0
    workers = ToyModel(fault=Fault("forward", limit=16))
    fit(workers, loader(N * STEPS, N, num_workers=2), [ElasticBatchSize(grow=False)], gradient_clip_val=0.5)
    ref, _ = native(micro=16)
    assert max_weight_diff(workers, ref) == 0.0


def test_bf16_mixed_matches_native() -> None:
    model, _, _ = elastic(Fault("backward", limit=16), precision="bf16-mixed")
    ref = ToyModel()
    fit(ref, loader(N * STEPS, 16), accumulate_grad_batches=4, gradient_clip_val=0.5, precision="bf16-mixed")
    assert max_weight_diff(model, ref) == 0.0


def test_fp16_grad_scaler_state_is_correct_after_replay() -> None:
    from lightning.pytorch.plugins import MixedPrecision

    def plugin() -> MixedPrecision:
        return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8))

    fault = Fault("step", limit=16)  # fires after the scaler has unscaled the gradients
    model, t, cb = elastic(fault, plugins=[plugin()])
    ref = ToyModel()
    ref_t = fit(ref, loader(N * STEPS, 16), accumulate_grad_batches=4, gradient_clip_val=0.5, plugins=[plugin()])
    assert len(fault.hits) == 2
    assert max_weight_diff(model, ref) == 0.0
    assert t.precision_plugin.scaler.get_scale() == ref_t.precision_plugin.scaler.get_scale()


def test_protect_update_false_refuses_to_replay_a_half_applied_update() -> None:
    with pytest.raises(OutOfMemoryAtMinimumError, match=r"inside the optimizer update after it had changed parameters "
                       r"or optimizer state: the update is half-applied and cannot be replayed. "
                       r"protect_update=False: no update is protected"):
        elastic(Fault("step", limit=16), cb=ElasticBatchSize(grow=False, protect_update=False))


class SnapshotBytes(Callback):
    """Host bytes each step's update snapshot copied, and what the snapshot still holds after the step."""

    def __init__(self, elastic: ElasticBatchSize) -> None:
        self.elastic, self.copied, self.held = elastic, [], []

    def on_train_batch_end(self, *args: object) -> None:
        self.copied.append(self.elastic.update_snapshot_bytes)
        self.held.append(self.elastic.engine.update.snapshot.held_bytes)


def test_only_updates_that_create_state_are_copied_and_steady_state_copies_nothing() -> None:
    cb = ElasticBatchSize(grow=False)
    probe = SnapshotBytes(cb)
    model, _, _ = elastic(Fault("step", limit=16), cb=cb, extra=(probe,))
    params = sum(p.numel() * 4 for p in model.parameters())
    assert probe.copied[0] == params  # the first update creates AdamW's state: its parameters are copied
    assert probe.copied[1:] == [0] * (STEPS - 1)  # steady state: nothing copied to the host
    assert probe.held == [0] * STEPS  # and nothing held between steps
    assert max_weight_diff(model, native(micro=16)[0]) == 0.0


def test_a_later_update_that_creates_state_is_replayed_exactly() -> None:
    # The first layer is unfrozen at step 2: that update creates its AdamW state, and runs out of memory half-way.
    fault = Fault("step", limit=16, steps=lambda s: s == 2)
    cb = ElasticBatchSize(grow=False, micro_batch_size=32)
    probe = SnapshotBytes(cb)
    model = ToyModel(fault=fault, unfreeze_at=2)
    fit(model, loader(N * STEPS, N), [cb, probe], gradient_clip_val=0.5)
    assert fault.hits == [(2, 32)]
    assert [(e.kind, e.step, e.where) for e in cb.events] == [("oom", 2, "update")]
    ref = reference(loader(N * STEPS, N), [32, 32, 16, 16], clip=0.5, unfreeze_at=2)
    assert max_weight_diff(model, ref) == 0.0
    first_layer = sum(p.numel() * 4 for p in model.net[0].parameters())
    assert probe.copied[2] > first_layer and probe.copied[3] == 0


def test_a_steady_state_update_oom_before_any_change_replays_without_a_copy() -> None:
    fault = Fault("step_start", limit=16, steps=lambda s: s == 2)
    cb = ElasticBatchSize(grow=False, micro_batch_size=32)
    probe = SnapshotBytes(cb)
    model, _, _ = elastic(fault, cb=cb, extra=(probe,))
    assert fault.hits == [(2, 32)] and [(e.kind, e.step) for e in cb.events] == [("oom", 2)]
    assert probe.copied[1:] == [0] * (STEPS - 1)
    ref = reference(loader(N * STEPS, N), [32, 32, 16, 16], clip=0.5)
    assert max_weight_diff(model, ref) == 0.0


def test_a_half_applied_steady_state_update_ends_fit_with_a_clear_error() -> None:
    with pytest.raises(OutOfMemoryAtMinimumError, match=r"half-applied and cannot be replayed. Updates that create "
                       r"optimizer state \(the first one, parameters added later\) are protected by a host copy; this "
                       r"one was not, its state already existed.*foreach=False"):
        elastic(Fault("step", limit=16, steps=lambda s: s == 2), cb=ElasticBatchSize(grow=False, micro_batch_size=32))


def test_minimum_reached_ends_fit_with_a_clear_chained_error() -> None:
    cb = ElasticBatchSize(grow=False, min_micro_batch_size=8)
    with pytest.raises(OutOfMemoryAtMinimumError, match=r"batch size 64, micro-batch 8 \(min_micro_batch_size=8\), "
                       r"budget none \(no cap\), peak [0-9.]+ [KMG]iB") as info:
        elastic(Fault("forward", limit=4), cb=cb)
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)


def test_validation_oom_splits_the_eval_batch_only() -> None:
    val = loader(N * 2, N)
    clean = ToyModel()
    fit(clean, loader(N * STEPS, N), [ElasticBatchSize(grow=False)], val=val, gradient_clip_val=0.5)
    faulty = ToyModel(fault=Fault("validation", limit=16))
    cb = ElasticBatchSize(grow=False)
    t = fit(faulty, loader(N * STEPS, N), [cb], val=val, gradient_clip_val=0.5)
    assert faulty.val_seen == [64, 32, 16, 16, 16, 16] + [16] * 4  # the split size sticks for the stage
    assert micro_sizes(faulty) == [64] * STEPS  # training micro-batch untouched
    assert cb.micro_batch_size == 64
    assert [(e.kind, e.where) for e in cb.events] == [("eval_oom", "validate"), ("eval_oom", "validate")]
    assert max_weight_diff(faulty, clean) == 0.0
    expected = trainer().validate(clean, val, verbose=False)[0]["val_loss"]  # whole batches, no split
    torch.testing.assert_close(t.callback_metrics["val_loss"].item(), expected, rtol=1e-6, atol=0)


def test_logged_training_loss_is_the_whole_batch_mean() -> None:
    _, t_split, _ = elastic(None, cb=ElasticBatchSize(grow=False, micro_batch_size=24))  # 24, 24, 16: uneven
    _, t_whole, _ = elastic(None, cb=ElasticBatchSize(grow=False))
    for key in ("train_loss_step", "train_loss_epoch"):
        torch.testing.assert_close(t_split.callback_metrics[key], t_whole.callback_metrics[key], rtol=1e-5, atol=0)


def test_grow_back_after_pressure_passes_and_backoff_after_failed_grow() -> None:
    # Pressure at steps 1-2 only: shrink to 16, then grow back 16 -> 32 -> 64 after 2 clean steps each.
    fault = Fault("forward", limit=16, steps=lambda s: s in (1, 2))
    model, _, cb = elastic(fault, n=N * 10, cb=ElasticBatchSize(grow_after=2))
    kinds = [(e.kind, e.step, e.previous, e.micro_batch_size) for e in cb.events]
    assert kinds == [("oom", 1, 64, 32), ("oom", 1, 32, 16), ("grow", 4, 16, 32), ("grow", 6, 32, 64)]
    assert cb.micro_batch_size == 64

    # Pressure that stays: the grow fails, goes back to 16 and waits twice as long (4 clean steps) to try again.
    fault = Fault("forward", limit=16, steps=lambda s: s >= 1)
    model, _, cb = elastic(fault, n=N * 10, cb=ElasticBatchSize(grow_after=2))
    kinds = [(e.kind, e.step, e.previous, e.micro_batch_size) for e in cb.events]
    assert kinds == [("oom", 1, 64, 32), ("oom", 1, 32, 16), ("grow_failed", 4, 32, 16), ("grow_failed", 9, 32, 16)]
    ref = reference(loader(N * 10, N), [64] + [16] * 9, clip=0.5)
    assert max_weight_diff(model, ref) == 0.0


def test_resume_keeps_the_micro_batch(tmp_path: object) -> None:
    _, t, _ = elastic(Fault("forward", limit=16), enable_checkpointing=True, default_root_dir=str(tmp_path))
    ckpt = t.checkpoint_callback.best_model_path  # type: ignore[attr-defined]
    resumed_cb = ElasticBatchSize(grow=False)
    resumed = ToyModel()
    t2 = trainer([resumed_cb], max_epochs=2, gradient_clip_val=0.5, default_root_dir=str(tmp_path))
    t2.fit(resumed, loader(N * STEPS, N), ckpt_path=ckpt)
    assert micro_sizes(resumed) == [16] * (4 * STEPS)  # no new OOM needed: the size came back with the checkpoint
    assert resumed_cb.micro_batch_size == 16
    assert [e.kind for e in resumed_cb.events] == ["oom", "oom"]
    assert t2.global_step == 2 * STEPS


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match=r"budget must be .*got '20XB'"):
        ElasticBatchSize(budget="20XB")
    with pytest.raises(ValueError, match=r"`micro_batch_size` must be a positive int or None; got -4"):
        ElasticBatchSize(micro_batch_size=-4)
    with pytest.raises(ValueError, match=r"`min_micro_batch_size` must be a positive int; got 0"):
        ElasticBatchSize(min_micro_batch_size=0)
    with pytest.raises(ValueError, match=r"`micro_batch_size` \(2\) must be >= `min_micro_batch_size` \(4\)"):
        ElasticBatchSize(micro_batch_size=2, min_micro_batch_size=4)


def test_setup_refuses_accumulation_and_manual_optimization() -> None:
    with pytest.raises(MisconfigurationException, match=r"accumulate_grad_batches=4\. Set Trainer\(accumulate_grad_batches=1\)"):
        elastic(None, accumulate_grad_batches=4)

    class Manual(ToyModel):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

    with pytest.raises(MisconfigurationException, match="needs automatic optimization"):
        fit(Manual(), loader(N, N), [ElasticBatchSize()])


def test_batchnorm_warns() -> None:
    with pytest.warns(UserWarning, match="BatchNorm layers"):
        fit(ToyModel(batchnorm=True), loader(N, N), [ElasticBatchSize()])


class HungryModel(ToyModel):
    """Each sample needs 8 MiB of scratch memory during its step, so the step's peak grows with the micro-batch."""

    def training_step(self, batch: object, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        scratch = torch.ones(self.last_micro_size, 2 * 2**20)  # written, so resident
        loss = loss + scratch[0, 0] * 0
        del scratch
        return loss


def test_cpu_soft_budget_shrinks_the_next_step_after_an_overshoot() -> None:
    from autotune._device.meter import current_host_bytes

    budget = current_host_bytes() + 400 * 2**20  # room for about 48 samples of scratch, not 64
    model = HungryModel()
    cb = ElasticBatchSize(budget=budget, grow=False)
    with pytest.warns(UserWarning, match=r"ElasticBatchSize: the step's peak .* went over the budget \d+ at "
                      r"micro-batch 64 \(step 0\); the next step runs at 32\. .*autotune/over_budget_events"):
        fit(model, loader(N * STEPS, N), [cb], gradient_clip_val=0.5)
    assert [(e.kind, e.step, e.previous, e.micro_batch_size) for e in cb.events] == [("over_budget", 0, 64, 32)]
    assert micro_sizes(model) == [64] + [32] * 2 * (STEPS - 1)  # no replay: the CPU budget is soft
    assert cb.budget_bytes == budget
    assert cb.events[0].peak_bytes > budget


class HeapModel(ToyModel):
    """Each sample needs 5 MiB of scratch in blocks of 64 KiB during its step: blocks the C allocator (glibc) keeps
    resident once freed, below a block that outlives the step (so they are not trimmed off the heap's top)."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: list[torch.Tensor] = []

    def training_step(self, batch: object, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        scratch = [torch.ones(16 * 1024) for _ in range(80 * self.last_micro_size)]  # written, so resident
        self.kept.append(torch.ones(16 * 1024))
        loss = loss + scratch[0][0] * 0
        del scratch
        return loss


def test_a_cpu_soft_budget_overshoot_shrinks_once_not_down_to_the_minimum() -> None:
    """The heap the larger step left resident is given back (glibc's malloc_trim) when the micro-batch shrinks, so the
    next step is measured at its own need: without it every later step read the old peak and halved again (on the
    GPT example 16, 8, 4, 2, 1 in 4 steps)."""
    from autotune._device.meter import current_host_bytes, release_host_memory

    if not release_host_memory():
        pytest.skip("the C library has no malloc_trim (not glibc): freed blocks stay resident")
    budget = current_host_bytes() + 240 * 2**20  # 32 samples of scratch fit (160 MiB), 64 do not (320 MiB)
    model = HeapModel()
    cb = ElasticBatchSize(budget=budget, grow=False)
    with pytest.warns(UserWarning, match="went over the budget"):
        fit(model, loader(N * STEPS, N), [cb])
    assert [(e.kind, e.step, e.previous, e.micro_batch_size) for e in cb.events] == [("over_budget", 0, 64, 32)]
    assert micro_sizes(model) == [64] + [32] * 2 * (STEPS - 1)


def test_autotune_metrics_reach_the_logger(tmp_path: object) -> None:
    import csv

    from lightning.pytorch.loggers import CSVLogger

    logger = CSVLogger(str(tmp_path), name="run")
    elastic(Fault("forward", limit=16), logger=logger, log_every_n_steps=1)
    with open(f"{logger.log_dir}/metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("autotune/micro_batch_size")]
    assert [float(r["autotune/micro_batch_size"]) for r in rows] == [16.0] * STEPS
    assert [float(r["autotune/num_micro_batches"]) for r in rows] == [4.0] * STEPS
    assert [float(r["autotune/oom_events"]) for r in rows] == [2.0] * STEPS
    assert [float(r["autotune/over_budget_events"]) for r in rows] == [0.0] * STEPS
    assert all(float(r["autotune/peak_memory_gib"]) > 0 for r in rows)


def test_a_handled_oom_is_warned_once_per_kind() -> None:
    with pytest.warns(UserWarning) as record:
        _, _, cb = elastic(Fault("forward", limit=16))  # two OOMs: 64 -> 32 -> 16
    assert [e.kind for e in cb.events] == ["oom", "oom"]
    ooms = [str(w.message) for w in record if "out of memory" in str(w.message)]
    assert ooms == ["ElasticBatchSize: out of memory at step 0 (in the closure); the step was replayed at micro-batch "
                    "32 (was 64). Later ones are not warned about again: see the autotune/oom_events metric and "
                    "ElasticBatchSize.events."]


@pytest.mark.parametrize("name", ["FSDPStrategy", "DeepSpeedStrategy", "XLAStrategy", "SingleDeviceXLAStrategy"])
@pytest.mark.parametrize("stage", ["fit", "validate", "test", "predict"])
def test_setup_refuses_every_strategy_but_single_device_ddp_and_fsdp2_exactly(name: str, stage: str) -> None:
    import lightning.pytorch.strategies as strategies

    cls = getattr(strategies, name)
    t = trainer()
    # These strategies need a GPU, deepspeed or torch_xla to be built; the check looks at the type only. DeepSpeed's
    # and XLA's derive from DDPStrategy, XLA's single-device one from SingleDeviceStrategy: an exact check refuses them.
    t._accelerator_connector.strategy = cls.__new__(cls)
    with pytest.raises(MisconfigurationException, match=rf"ElasticBatchSize does not support {name}: it runs with "
                       r"SingleDeviceStrategy, DDPStrategy, ModelParallelStrategy exactly"):
        ElasticBatchSize().setup(t, ToyModel(), stage)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_real_cuda_oom_under_a_hard_cap_recovers() -> None:
    import lightning as L
    from torch import nn

    class Wide(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(1024, 8192), nn.ReLU(), nn.Linear(8192, 8192), nn.ReLU(),
                                     nn.Linear(8192, 1))
            self.sizes: list[int] = []

        def training_step(self, batch: object, batch_idx: int) -> torch.Tensor:
            x, y = batch  # type: ignore[misc]
            self.sizes.append(len(x))
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    from torch.utils.data import DataLoader, TensorDataset

    # Estimated step peak (fp32, SGD): 2.34 GiB at 16384 samples (over the cap), 1.63 GiB at micro-batch 8192.
    data = DataLoader(TensorDataset(torch.randn(16384 * 2, 1024), torch.randn(16384 * 2, 1)), batch_size=16384)
    model = Wide()
    cb = ElasticBatchSize(budget="2GiB", grow=False)
    t = trainer([cb], accelerator="cuda", max_steps=2)
    t.fit(model, data)
    assert t.global_step == 2
    assert cb.events and all(e.kind == "oom" for e in cb.events)
    assert model.sizes[-1] == cb.micro_batch_size < 16384
    assert torch.cuda.max_memory_reserved() <= 2 * 2**30


def test_without_a_budget_a_cuda_cap_set_before_fit_is_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """No budget on CUDA: the limit that growth and the shape model work to is the device's memory, or the allocator's
    per-process cap where one is set (read from torch, as the callback reads it on a GPU)."""
    from autotune.callbacks import elastic as installed

    total = 80 * 2**30
    probe = types.SimpleNamespace(total_bytes=total, free_bytes=total)
    monkeypatch.setattr(installed, "probe_memory", lambda device: probe)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total, total))
    cuda = torch.device("cuda", 0)
    for fraction, limit in ((1.0, total), (0.25, total // 4), (0.0, total)):  # 0: a plugged-in allocator's "none"
        monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None, f=fraction: f)
        assert ElasticBatchSize()._resolve_budget(cuda) == (None, limit)

    def unsupported(device: object = None) -> float:
        raise RuntimeError("CUDAPluggableAllocator does not yet support getMemoryFraction")

    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", unsupported)
    assert ElasticBatchSize()._resolve_budget(cuda) == (None, total)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_cap_set_before_fit_is_the_default_callbacks_limit() -> None:
    total = torch.cuda.mem_get_info(0)[1]
    before = torch.cuda.get_per_process_memory_fraction(0)
    torch.cuda.set_per_process_memory_fraction(0.25, 0)
    try:
        cb = ElasticBatchSize()
        t = trainer([cb], accelerator="cuda", max_steps=1)
        t.fit(ToyModel(), loader(16, 8))
        assert cb.engine.limit_bytes == int(0.25 * total)
    finally:
        torch.cuda.set_per_process_memory_fraction(before, 0)


class Counted(ToyModel):
    """Counts the samples each stage sees in torchmetrics metrics (updated in the steps, where a replay repeats)."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        import torchmetrics

        self.train_count = torchmetrics.SumMetric()
        self.val_metrics = torchmetrics.MetricCollection({"count": torchmetrics.SumMetric(),
                                                          "mean_y": torchmetrics.MeanMetric()})
        self.train_ys = torchmetrics.CatMetric()

    def training_step(self, batch: object, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)  # raises first when the fault fires in forward
        x, y, _ = unpack(batch, self.kind)
        self.train_count.update(torch.ones(len(x)))
        self.train_ys.update(y[:, 0])
        return loss

    def validation_step(self, batch: object, batch_idx: int) -> None:
        x, y, _ = unpack(batch, self.kind)
        self.val_metrics["count"].update(torch.ones(len(x)))
        self.val_metrics["mean_y"].update(y[:, 0])
        super().validation_step(batch, batch_idx)  # raises after the updates when the fault fires


@pytest.mark.parametrize("where", ["backward", "validation"])
def test_a_replay_does_not_count_twice_in_torchmetrics(where: str) -> None:
    model = Counted(fault=Fault(where, limit=16, steps=lambda s: where == "validation" or s in (0, 1)))
    data = loader(N * STEPS, N)
    fit(model, data, [ElasticBatchSize(grow=False)], val=loader(N, N), max_epochs=1, limit_val_batches=1)
    assert model.fault is not None and model.fault.hits  # the fault fired
    assert model.train_count.compute().item() == N * STEPS
    ys = torch.cat([unpack(b, "tuple")[1][:, 0] for b in data])
    assert torch.equal(model.train_ys.compute(), ys)  # each sample once, in order
    assert model.val_metrics["count"].compute().item() == N


def test_max_and_min_logs_are_combined_on_the_values_device_without_reading_them() -> None:
    """``reduce_fx`` max/min over micro-batches takes the extreme, compared on the values' device: on a meta device
    (where reading a value to the host is impossible, as it would be a wait on a GPU) the combination still works."""
    from autotune._runtime.logbuffer import _combine

    for device in ("cpu", "meta"):
        values = [torch.tensor(1.5, device=device), torch.tensor(3.0, device=device), 2.0]
        for fx, expected in (("max", 3.0), ("min", 1.5), (torch.max, 3.0), ("MIN", 1.5)):
            combined = _combine(values, [8.0, 8.0, 8.0], fx)
            assert combined.device.type == device and combined.shape == ()
            if device == "cpu":
                assert float(combined) == expected
    assert _combine([2, 5, 3], [1.0, 1.0, 1.0], "max") == 5  # plain numbers stay numbers
    for values in ([torch.tensor(2), 2.5], [2.5, torch.tensor(3)]):  # an int tensor and a float: promoted, not cut
        assert _combine(values, [1.0, 1.0], "max").dtype == torch.float32
    assert float(_combine([torch.tensor(2), 2.5], [1.0, 1.0], "max")) == 2.5
    assert float(_combine([2.5, torch.tensor(3)], [1.0, 1.0], "min")) == 2.5


class _CountsHooks(L.Callback):
    def __init__(self) -> None:
        self.before_step = 0

    def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
        self.before_step += 1


def test_hooks_and_clipping_run_once_per_step_after_an_oom_in_the_first_update() -> None:
    class Clipped(ToyModel):
        clips: list[int] = []

        def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None,
                                        gradient_clip_algorithm: Any = None) -> None:
            self.clips.append(self.trainer.global_step)
            self.clip_gradients(optimizer, gradient_clip_val=gradient_clip_val,
                                gradient_clip_algorithm=gradient_clip_algorithm)

    fault = Fault("step_start", limit=8, steps=lambda s: s == 0)  # the protected first update, once
    model = Clipped(fault=fault)
    counts = _CountsHooks()
    cb = ElasticBatchSize()
    trainer(callbacks=[cb, counts], max_steps=4, gradient_clip_val=0.5).fit(model, loader(64, 16))
    assert fault.hits == [(0, 16)] and [(e.kind, e.step) for e in cb.events] == [("oom", 0)]
    assert counts.before_step == 4  # 4 optimizer steps: not 5 (the failed attempt's hooks and the replay's)
    assert model.clips == [0, 0, 1, 2, 3]  # clipping acts on the gradients the update uses: the replay's too
