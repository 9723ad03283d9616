"""Optimizer offload: what stays on the device, and the state and hyper-parameters between the user's optimizer and
the per-parameter optimizers that update it (torchao's layout, built here from plain CPU optimizers)."""

from __future__ import annotations

import copy
import importlib.util

import lightning as L
import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.demos.boring_classes import BoringModel
from torch import nn

from autotune import Plan
from autotune._estimate.estimate import estimate
from autotune._estimate.trace import Traces
from autotune._plan.space import _unrunnable
from autotune._transforms.offload import OFFLOAD_MIN_NUMEL, _Owners, device_part, hyperparameters, is_offloaded
from autotune.callbacks import ApplyPlan
from autotune.callbacks.apply_plan import _grads_change_after_backward
from tests.support.toy import trainer


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.LayerNorm(128), nn.Linear(128, 64), nn.Linear(64, 1))


def two_groups(net: nn.Module, cls: type[torch.optim.Optimizer] = torch.optim.AdamW) -> torch.optim.Optimizer:
    decay = [p for p in net.parameters() if p.ndim == 2]
    no_decay = [p for p in net.parameters() if p.ndim < 2]
    return cls([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-2)


def torchao_layout(opt: torch.optim.Optimizer) -> tuple[_Owners, list[tuple[nn.Parameter, torch.Tensor]]]:
    """What torchao builds: one optimizer per offloaded parameter over a host copy, one for the small ones."""
    owner: dict[torch.Tensor, tuple[torch.optim.Optimizer, torch.Tensor]] = {}
    copies = []
    for group in opt.param_groups:
        for p in group["params"]:
            if is_offloaded(p):
                host = p.detach().clone().requires_grad_()
                owner[p] = (type(opt)([{**hyperparameters(group), "params": [host]}]), host)
                copies.append((p, host))
    small = device_part(opt)
    if small is not None:
        owner.update({p: (small, p) for g in small.param_groups for p in g["params"]})
    return _Owners(opt.param_groups, owner), copies


def run_step(net: nn.Module, x: torch.Tensor) -> None:
    net.zero_grad(set_to_none=True)
    net(x).pow(2).mean().backward()


def layout_step(owners: _Owners, copies: list[tuple[nn.Parameter, torch.Tensor]]) -> None:
    """One update the way the offloaded optimizer runs it: gradients to the host, every owner steps, copies back."""
    owners.sync()
    for p, host in copies:
        host.grad = p.grad.clone()
    for opt in owners.optimizers():
        opt.step()
    with torch.no_grad():
        for p, host in copies:
            p.copy_(host)


def test_only_parameters_of_4096_elements_or_more_are_offloaded() -> None:
    net = model()
    sizes = {tuple(p.shape): is_offloaded(p) for p in net.parameters()}
    assert sizes == {(128, 64): True, (128,): False, (64, 128): True, (64,): False, (1, 64): False, (1,): False}
    assert OFFLOAD_MIN_NUMEL == 4096
    net[0].weight.requires_grad_(False)
    assert not is_offloaded(net[0].weight)


def test_device_part_keeps_the_small_parameters_and_their_groups() -> None:
    net = model()
    opt = two_groups(net)
    small = device_part(opt)
    assert type(small) is torch.optim.AdamW
    assert [[tuple(p.shape) for p in g["params"]] for g in small.param_groups] == [[(1, 64)], [(128,)] * 3 + [(64,),
                                                                                                              (1,)]]
    assert [(g["lr"], g["weight_decay"]) for g in small.param_groups] == [(1e-2, 0.1), (1e-2, 0.0)]
    assert device_part(torch.optim.SGD([net[0].weight], lr=0.1)) is None


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad])
def test_the_offloaded_layout_trains_like_the_optimizer_and_keeps_its_state_layout(cls) -> None:
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    net, ref_net = model(), model()
    ref = two_groups(ref_net, cls)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref, lambda s: 1.0 / (1 + s))
    for _ in range(3):  # the reference trains first; its state is then loaded into the layout
        run_step(ref_net, x)
        ref.step()
        ref_sched.step()
    net.load_state_dict(ref_net.state_dict())
    opt = two_groups(net, cls)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    sched.load_state_dict(ref_sched.state_dict())
    owners, copies = torchao_layout(opt)
    owners.load_state_dict(copy.deepcopy(ref.state_dict()))  # as from a checkpoint file: tensors of its own
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref.param_groups] == [2.5e-3, 2.5e-3]
    for p, host in copies:
        host.data.copy_(p)
    for _ in range(3):  # the LR schedule goes on through the user's groups
        run_step(ref_net, x)
        ref.step()
        ref_sched.step()
        run_step(net, x)
        layout_step(owners, copies)
        sched.step()
    for p, q in zip(ref_net.parameters(), net.parameters()):
        assert torch.equal(p, q)
    saved, expected = owners.state_dict(), ref.state_dict()
    assert saved["param_groups"] == expected["param_groups"]
    assert saved["state"].keys() == expected["state"].keys()
    for index, state in expected["state"].items():
        assert saved["state"][index].keys() == state.keys()
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(saved["state"][index][key]), torch.as_tensor(value)), (index, key)


def test_hyperparameters_reach_every_owner_after_a_load() -> None:
    net = model()
    opt = two_groups(net)
    owners, _ = torchao_layout(opt)
    owners.load_state_dict(opt.state_dict())  # Optimizer.load_state_dict replaces the owners' group dicts
    opt.param_groups[1]["lr"] = 0.5
    owners.sync()
    for p, (o, key) in owners.owner.items():
        (group,) = [g for g in o.param_groups if any(t is key for t in g["params"])]
        assert group["lr"] == (0.5 if p.ndim < 2 else 1e-2)


def test_a_state_of_another_shape_is_refused() -> None:
    owners, _ = torchao_layout(two_groups(model()))
    with pytest.raises(ValueError, match="different number of parameter groups"):
        owners.load_state_dict({"state": {}, "param_groups": [{"params": [0]}]})
    with pytest.raises(ValueError, match=r"must be a torch.optim.Optimizer.state_dict\(\).*got keys \['offloaded'\]"):
        owners.load_state_dict({"offloaded": []})


def test_optimizer_offload_is_refused_off_cuda_and_with_ddp() -> None:
    with pytest.raises(MisconfigurationException, match=r"optimizer_offload=True\) moves optimizer state from a CUDA "
                       r"GPU to the host, but this run is on cpu"):
        trainer([ApplyPlan(optimizer_offload=True)], max_steps=1).fit(BoringModel())
    with pytest.raises(ValueError, match="optimizer_offload runs on one GPU; it cannot be combined with strategy "
                       "'ddp'"):
        Plan(strategy="ddp", optimizer_offload=True)
    assert _unrunnable("optimizer_offload", True, torch.device("cpu"), 8, None, None) == "it only has an effect on CUDA"
    assert _unrunnable("optimizer_offload", False, torch.device("cpu"), 8, None, None) is None


def test_grads_are_copied_again_only_when_something_may_change_them() -> None:
    class Hooked(BoringModel):
        def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
            pass

    class Watcher(L.Callback):
        def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            pass

    boring = BoringModel()
    assert not _grads_change_after_backward(trainer([ApplyPlan()]), boring)
    assert _grads_change_after_backward(trainer([], gradient_clip_val=1.0), boring)
    assert _grads_change_after_backward(trainer([]), Hooked())
    assert _grads_change_after_backward(trainer([Watcher()]), boring)


class Wide(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 2))  # 8192 weights offloaded, the rest not

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_the_estimate_moves_offloaded_state_to_the_host() -> None:
    net, batch = Wide(), torch.randn(8, 64)
    with pytest.raises(ValueError, match="optimizer_offload moves optimizer state from a CUDA GPU to the host; "
                       "estimate it for a CUDA device"):
        estimate(model=net, batch=batch, plan=Plan(optimizer_offload=True), device="cpu")
    plain = estimate(model=net, batch=batch, plan=Plan(), device="cpu")
    traces = Traces(model=net, batch=batch, plan=Plan(), device="cpu", optimizer=None)
    traces.plan = Plan(optimizer_offload=True)  # the CPU stands in for the GPU here (the public API refuses it)
    offloaded = traces.at(8)
    big_bytes = net.layer[0].weight.numel() * 4
    assert plain.optimizer_state_bytes - offloaded.optimizer_state_bytes == 2 * big_bytes + 4  # exp_avgs, step
    assert offloaded.gradients_bytes == plain.gradients_bytes  # gradients stay on the device
    assert offloaded.host_bytes == 4 * big_bytes + 4  # pinned weight, gradient, exp_avg, exp_avg_sq; step


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao")
def test_the_estimate_of_offload_under_bf16_true_keeps_bf16_moments_on_the_host() -> None:
    net, batch = Wide(), torch.randn(8, 64)
    traces = Traces(model=net, batch=batch, plan=Plan(precision="bf16-true"), device="cpu", optimizer=None)
    traces.plan = Plan(precision="bf16-true", optimizer_offload=True)  # the CPU stands in for the GPU, as above
    offloaded = traces.at(8)
    big = net.layer[0].weight.numel()
    # pinned bf16 weight and gradient, torchao's bf16 moments (exp_avg, exp_avg_sq) and its fp32 step
    assert offloaded.host_bytes == 4 * 2 * big + 4
