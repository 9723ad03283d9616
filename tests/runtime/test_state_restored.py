"""What a replay puts back besides the weights: logged epoch means, an update whose changes cannot be seen, and
BatchNorm's running statistics (each found by an adversarial review; each guarded in ``tests/mutation_check.py``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from autotune import OutOfMemoryAtMinimumError
from autotune.callbacks import ElasticBatchSize
from tests.support.ranks import run_ranks
from tests.support.toy import Fault, ToyModel, fit, loader, max_weight_diff, reference, unpack

N = 64
STEPS = 4


class SizedLogs(ToyModel):
    """Also logs with ``batch_size=len(x)`` (the idiom for dict batches), and a key that only some micro-batches log."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        x, _, ids = unpack(batch, self.kind)
        self.log("sized", loss, on_step=False, on_epoch=True, batch_size=len(x))
        if ids[0] % 48 == 0:  # 2, 1, 1 and 2 of the 4 micro-batches of 16 of each step
            self.log("some", loss, on_step=False, on_epoch=True)
        return loss


def test_epoch_means_weigh_each_step_by_the_samples_that_logged() -> None:
    ref = fit(SizedLogs(), loader(N * STEPS, 16), accumulate_grad_batches=N // 16, gradient_clip_val=0.5)
    # Step 0 whole, steps 1-3 in micro-batches of 16 after an OOM: each step still weighs its 64 samples.
    once = fit(SizedLogs(fault=Fault("forward", limit=16, steps=lambda s: s == 1)), loader(N * STEPS, N),
               [ElasticBatchSize(grow=False)], gradient_clip_val=0.5)
    torch.testing.assert_close(once.callback_metrics["sized"], ref.callback_metrics["sized"], rtol=1e-5, atol=0)
    # Every step in micro-batches of 16: a step weighs the samples of the micro-batches that logged.
    split = fit(SizedLogs(fault=Fault("forward", limit=16)), loader(N * STEPS, N), [ElasticBatchSize(grow=False)],
                gradient_clip_val=0.5)
    torch.testing.assert_close(split.callback_metrics["some"], ref.callback_metrics["some"], rtol=1e-5, atol=0)


class DataSGD(torch.optim.Optimizer):
    """An optimizer of its own that writes ``p.data`` (as Lion's reference code does), which bumps no version counter;
    in step 2, a steady-state update, it runs out of memory after its weight decay changed the first parameter."""

    def __init__(self, params: Any, module: ToyModel) -> None:
        super().__init__(params, {"lr": 0.05})
        self.module = module

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        with torch.enable_grad():
            loss = closure()
        for i, p in enumerate(self.param_groups[0]["params"]):
            p.data.mul_(0.99)
            if i == 0 and self.module.trainer.global_step == 2:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
            momentum = self.state[p].setdefault("momentum", torch.zeros_like(p))  # state: step 2 is steady
            momentum.data.mul_(0.9).add_(p.grad)
            p.data.add_(momentum, alpha=-0.05)
        return loss


def test_an_update_oom_of_an_optimizer_whose_changes_cannot_be_seen_is_not_replayed() -> None:
    class Model(ToyModel):
        def configure_optimizers(self) -> Any:
            return DataSGD(self.parameters(), self)

    model = Model()
    with pytest.raises(OutOfMemoryAtMinimumError, match=r"inside the update of DataSGD, an optimizer that is neither "
                       r"torch's nor torchao's.*through \.data or raw pointers.*not replayed"):
        fit(model, loader(N * STEPS, N), [ElasticBatchSize(grow=False)])
    assert model.trainer.global_step == 2  # steps 0 and 1 ran


@pytest.mark.parametrize("where", ["mid_backward", "backward"])
def test_a_failed_attempt_leaves_no_trace_in_batchnorm_running_statistics(where: str) -> None:
    model = ToyModel(batchnorm=True, fault=Fault(where, limit=16))  # 64 and 32 fail at step 0 after their forward
    fit(model, loader(N * STEPS, N), [ElasticBatchSize(grow=False)], gradient_clip_val=0.5)
    ref = ToyModel(batchnorm=True)
    fit(ref, loader(N * STEPS, 16), accumulate_grad_batches=N // 16, gradient_clip_val=0.5)
    assert max_weight_diff(model, ref) == 0.0
    norm, ref_norm = model.net[1], ref.net[1]
    assert int(norm.num_batches_tracked) == int(ref_norm.num_batches_tracked) == STEPS * N // 16
    torch.testing.assert_close(norm.running_mean, ref_norm.running_mean, rtol=0, atol=0)
    torch.testing.assert_close(norm.running_var, ref_norm.running_var, rtol=0, atol=0)


def test_a_failed_attempt_in_a_later_step_leaves_no_trace_in_batchnorm_running_statistics() -> None:
    # BatchNorm's kernels update the running statistics without bumping their version counters: the buffers a step
    # changes are found by value after the first training step, so a replay at step 2 puts them back as well.
    model = ToyModel(batchnorm=True, fault=Fault("backward", limit=16, steps=lambda s: s == 2))
    data = loader(N * STEPS, N)
    fit(model, data, [ElasticBatchSize(grow=False)], gradient_clip_val=0.5)
    ref = reference(data, [64, 64, 16, 16], clip=0.5, batchnorm=True)
    assert max_weight_diff(model, ref) < 1e-6
    norm, ref_norm = model.net[1], ref.net[1]
    assert int(norm.num_batches_tracked) == int(ref_norm.num_batches_tracked) == 2 + 2 * N // 16
    torch.testing.assert_close(norm.running_mean, ref_norm.running_mean, rtol=0, atol=1e-6)
    torch.testing.assert_close(norm.running_var, ref_norm.running_var, rtol=0, atol=1e-6)


class CountsSamples(ToyModel):
    """Counts the samples its forward saw in a buffer written through ``.data`` (as code ported from older torch
    does), which bumps no version counter: only a comparison of values shows that the step changes it."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.register_buffer("samples_seen", torch.zeros(()))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.samples_seen.data.add_(len(unpack(batch, self.kind)[0]))
        return super().training_step(batch, batch_idx)


def test_a_buffer_changed_without_a_version_bump_is_put_back_after_a_failed_attempt() -> None:
    model = CountsSamples(fault=Fault("backward", limit=16, steps=lambda s: s == 2))  # 64 and 32 fail at step 2
    fit(model, loader(N * STEPS, N), [ElasticBatchSize(grow=False)])
    assert int(model.samples_seen) == N * STEPS  # each sample counted once: the failed attempts' 96 put back


def test_every_rank_resumes_with_its_own_state(tmp_path: Path) -> None:
    """Rank 1 learned a micro-batch of 4 (rank 0 runs the whole 16): each resumes at its own, with no OOM again
    (from rank 0's state, rank 1 resumed at 16 and ran out of memory at its first step)."""
    proc = run_ranks([str(Path(__file__).resolve().parents[1] / "support" / "resume_ranks_run.py"), str(tmp_path)],
                     timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["first"] for r in ranks] == [16, 4]
    assert [r["resumed_at"] for r in ranks] == [[16], [4]]
    assert [r["ooms_after_resume"] for r in ranks] == [0, 0]
