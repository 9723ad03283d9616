"""Run the user's optimizer through torchao's ``CPUOffloadOptimizer`` inside Lightning: optimizer-state offload.

torchao does the offload itself (pinned host copies of the parameters, gradient copies on a side stream as backward
produces them, the update on the CPU, parameters copied back). This module makes it a drop-in for the optimizer
``configure_optimizers`` returned:

- The user's optimizer stays the holder of the hyper-parameters. Its ``param_groups`` are the ones LR schedulers,
  ``LearningRateMonitor`` and gradient clipping see. They are copied into torchao's per-parameter groups before
  every update.
- The closure Lightning passes to ``step`` runs with gradients enabled (torchao's ``step`` runs under ``no_grad``).
- Gradients changed after backward (clipping, GradScaler unscaling, ``on_before_optimizer_step``) are copied to the
  host again before the update, since torchao copied them as backward produced them.
- Checkpoints hold the optimizer's ordinary ``state_dict`` layout, so a run can switch offload on or off on resume.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from autotune._compat.torch import mark_optimizer_stepped, post_accumulate_grad_hooks
from autotune._compat.torchao import (
    offload_device_optimizer,
    offload_device_type,
    offload_grad_queue,
    offload_host_copies,
    offload_host_optimizers,
    offload_stream,
)

#: Parameters with fewer elements keep their optimizer on the device (many small transfers cost more than they save).
OFFLOAD_MIN_NUMEL = 4096
#: Group keys that describe how an update runs on its device, not what it computes: left to each side's default.
_DEVICE_KEYS = frozenset({"fused", "foreach", "capturable", "differentiable"})
#: How to get torchao, for messages.
INSTALL_HINT = "pip install 'lightning-autotune[torchao]'"


def is_offloaded(param: Tensor) -> bool:
    """Whether torchao keeps this parameter's optimizer state on the host (trainable, ``OFFLOAD_MIN_NUMEL`` or more)."""
    return param.requires_grad and param.numel() >= OFFLOAD_MIN_NUMEL


def hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """A parameter group's hyper-parameters, without its parameters and device-specific switches."""
    return {k: v for k, v in group.items() if k != "params" and k not in _DEVICE_KEYS}


def set_hyperparameters(group: dict[str, Any], values: dict[str, Any]) -> None:
    """Set ``values`` in an optimizer's ``group``; a value the group keeps as a tensor (torchao's ``lr``) is filled in
    place, as torchao requires."""
    for key, value in values.items():
        held = group.get(key)
        if isinstance(held, Tensor) and not isinstance(value, Tensor):
            held.fill_(float(value))
        else:
            group[key] = value


def constructor_defaults(optimizer: Optimizer) -> dict[str, Any]:
    """``optimizer``'s defaults that its class's constructor takes (device-specific switches left out)."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return {k: v for k, v in optimizer.defaults.items() if k in accepted and k not in _DEVICE_KEYS}


def update_constructor(optimizer: Optimizer) -> tuple[Callable[..., Optimizer], dict[str, Any]]:
    """What builds ``optimizer``'s update over other parameter groups: a constructor taking the groups, and its keyword
    arguments. An optimizer that runs another's update (:class:`~autotune._transforms.optim_state.LowBitOptimizer`:
    torchao's) says so with an ``update_constructor()`` method; else its class and the defaults its constructor
    takes."""
    own = getattr(optimizer, "update_constructor", None)
    if callable(own):
        return own()
    return type(optimizer), constructor_defaults(optimizer)


def device_part(optimizer: Optimizer) -> Optimizer | None:
    """The part of ``optimizer`` that stays on the device under offload: its groups over the parameters that are not
    offloaded (None when every parameter is)."""
    groups = []
    for group in optimizer.param_groups:
        kept = [p for p in group["params"] if not is_offloaded(p)]
        if kept:
            groups.append({**hyperparameters(group), "params": kept})
    if not groups:
        return None
    make, kwargs = update_constructor(optimizer)
    return make(groups, **kwargs)


class _Owners:
    """Where each parameter's optimizer state lives, and the copy of hyper-parameters into those places.

    ``owner`` maps each parameter of ``groups`` that has an optimizer to ``(optimizer, key)``: the optimizer that
    updates it and the tensor its state is keyed by there (a host copy for offloaded parameters).
    """

    def __init__(self, groups: list[dict[str, Any]], owner: dict[Tensor, tuple[Optimizer, Tensor]]) -> None:
        self.groups = groups
        self.owner = owner
        self.pairs = self._pairs()

    def optimizers(self) -> list[Optimizer]:
        """Each optimizer that updates some parameter, once."""
        return list({id(opt): opt for opt, _ in self.owner.values()}.values())

    def _pairs(self) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """(user group, group that updates some of its parameters), each target once. Recomputed after a load:
        ``Optimizer.load_state_dict`` replaces the group dicts."""
        group_of: dict[int, dict[str, Any]] = {}  # id(key tensor) -> the group of its optimizer that holds it
        for opt in self.optimizers():
            group_of.update({id(t): g for g in opt.param_groups for t in g["params"]})
        targets: dict[int, tuple[int, dict[str, Any]]] = {}
        for index, group in enumerate(self.groups):
            for p in group["params"]:
                if p in self.owner:
                    target = group_of[id(self.owner[p][1])]
                    targets.setdefault(id(target), (index, target))
        return [(self.groups[index], target) for index, target in targets.values()]

    def sync(self) -> None:
        """Copy the hyper-parameters of each user group into the groups that update its parameters."""
        values = {id(group): hyperparameters(group) for group in self.groups}
        for group, target in self.pairs:
            set_hyperparameters(target, values[id(group)])

    def state_dict(self) -> dict[str, Any]:
        """The state in ``torch.optim.Optimizer.state_dict``'s layout, indexed over the user's groups."""
        state: dict[int, Any] = {}
        groups = []
        index = 0
        for group in self.groups:
            ids = []
            for p in group["params"]:
                if p in self.owner:
                    opt, key = self.owner[p]
                    if opt.state.get(key):
                        state[index] = opt.state[key]
                ids.append(index)
                index += 1
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state in ``torch.optim.Optimizer.state_dict``'s layout (with or without offload when saved)."""
        saved_groups = state_dict.get("param_groups")
        if not isinstance(saved_groups, list) or "state" not in state_dict:
            raise ValueError("optimizer state must be a torch.optim.Optimizer.state_dict() (keys 'state' and "
                             f"'param_groups'); got keys {sorted(state_dict)!r}")
        if len(saved_groups) != len(self.groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        if any(len(g["params"]) != len(s["params"]) for g, s in zip(self.groups, saved_groups)):
            raise ValueError("loaded state dict contains a parameter group that doesn't match the size of optimizer's "
                             "group")
        saved_state = state_dict["state"]
        by_key: dict[int, tuple[Tensor, Any]] = {}  # id(key tensor) -> (parameter, its saved state)
        for group, saved in zip(self.groups, saved_groups):
            for p, index in zip(group["params"], saved["params"]):
                if p in self.owner and index in saved_state:
                    by_key[id(self.owner[p][1])] = (p, saved_state[index])
            group.update({k: v for k, v in saved.items() if k != "params"})
        for opt in self.optimizers():
            state: dict[int, Any] = {}
            layout = []
            index = 0
            for g in opt.param_groups:
                ids = []
                for key in g["params"]:
                    if id(key) in by_key:
                        state[index] = by_key[id(key)][1]
                    ids.append(index)
                    index += 1
                layout.append({**{k: v for k, v in g.items() if k != "params"}, "params": ids})
            opt.load_state_dict({"state": state, "param_groups": layout})
        self.pairs = self._pairs()
        self.sync()


class OffloadedOptimizer(Optimizer):
    """``optimizer`` with its state on the host and its update on the CPU, by torchao's ``CPUOffloadOptimizer``.

    One GPU only. Parameters with fewer than ``OFFLOAD_MIN_NUMEL`` elements keep their update on the device. The
    given optimizer keeps the hyper-parameters (LR schedulers built on it keep working); its own state stays empty.

    Args:
        optimizer: the optimizer to offload (any ``torch.optim.Optimizer`` whose update needs no closure).
        refresh_grads: copy gradients to the host again right before the update, for runs that change gradients
            after backward (clipping, GradScaler, hooks); False trusts the copies torchao made during backward.

    Raises:
        ValueError: for an optimizer whose update evaluates the closure itself (LBFGS).
        ImportError: when torchao is not installed.
    """

    def __init__(self, optimizer: Optimizer, *, refresh_grads: bool = True) -> None:  # no Optimizer.__init__: torchao's
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError("optimizer_offload cannot run LBFGS: its update re-evaluates the closure, and the "
                             "offloaded update runs without one. Use another optimizer or optimizer_offload=False.")
        try:
            from torchao.optim import CPUOffloadOptimizer
        except ImportError as error:
            raise ImportError(f"optimizer_offload needs torchao: {INSTALL_HINT}") from error
        groups = [{**hyperparameters(g), "params": list(g["params"])} for g in optimizer.param_groups]
        params = [p for g in groups for p in g["params"]]
        hooks_before = {id(p): set(post_accumulate_grad_hooks(p)) for p in params}
        make, kwargs = update_constructor(optimizer)
        # the optimizer whose hyper-parameters LR schedulers change: the user's, also under a LowBitOptimizer
        self.user_optimizer = getattr(optimizer, "user_optimizer", optimizer)
        self.offload = CPUOffloadOptimizer(groups, optimizer_class=make, minimal_size=OFFLOAD_MIN_NUMEL, **kwargs)
        host_copies = offload_host_copies(self.offload)
        self._hooks = [(p, set(post_accumulate_grad_hooks(p)) - hooks_before[id(p)]) for p in host_copies]
        host_optimizers = offload_host_optimizers(self.offload)
        owner: dict[Tensor, tuple[Optimizer, Tensor]] = {
            p: (host_optimizers[p], host) for p, host in host_copies.items()}
        device_opt = offload_device_optimizer(self.offload)
        if device_opt is not None:
            owner.update({p: (device_opt, p) for g in device_opt.param_groups for p in g["params"]})
        self.defaults = optimizer.defaults
        self.param_groups = optimizer.param_groups  # the same list: what schedulers and clipping change
        self.refresh_grads = refresh_grads
        self._unowned = [p for p in params if p not in owner]  # frozen when offloaded: torchao leaves them out
        self._owners = _Owners(self.param_groups, owner)
        self._owners.sync()

    @property
    def optimizer(self) -> Optimizer:
        """The offloaded optimizer, which holds the hyper-parameters (as wrapping optimizers expose it)."""
        return self.user_optimizer

    @property
    def state(self) -> Any:  # type: ignore[override]
        """The optimizer state that stays on the device (of the parameters too small to offload).

        It is all that ``ElasticBatchSize``'s update snapshot saves and restores, and all it needs to: torchao runs
        this device update before any host update, and only the device can run out of memory."""
        device_opt = offload_device_optimizer(self.offload)
        return device_opt.state if device_opt is not None else {}

    @property
    def offloaded_parameters(self) -> list[Tensor]:
        """The parameters whose optimizer state is on the host."""
        return list(offload_host_copies(self.offload))

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if any(p.grad is not None for p in self._unowned):
            raise RuntimeError(
                "a parameter that was frozen (requires_grad=False) when the optimizer was offloaded has a gradient "
                "now; the offloaded optimizer cannot update it. Unfreeze parameters before fit starts, or set "
                "optimizer_offload=False.")
        self._owners.sync()
        self._prepare_host_grads()
        self.offload.step()
        mark_optimizer_stepped(self.user_optimizer)  # what LR schedulers check
        return loss

    def _prepare_host_grads(self) -> None:
        """Forget copies of gradients that no longer exist (a replayed step, an unused parameter) and, with
        ``refresh_grads``, copy the final gradients to the host."""
        ao = self.offload
        queue = offload_grad_queue(ao)
        if not self.refresh_grads:
            for p in [p for p in queue if p.grad is None]:
                del queue[p]
            return
        streams = getattr(torch, offload_device_type(ao))
        stream = offload_stream(ao)
        stream.wait_stream(streams.current_stream())
        with streams.stream(stream):
            for p, host in offload_host_copies(ao).items():
                queue.pop(p, None)
                if p.grad is not None:
                    host.grad.copy_(p.grad, non_blocking=True)
                    queue[p] = stream.record_event()

    def copy_weights_to_host(self) -> None:
        """Copy the device weights into torchao's host copies, which each update writes back to the device (for
        weights changed outside the optimizer, e.g. re-initialised in ``on_fit_start``)."""
        with torch.no_grad():
            for p, host in offload_host_copies(self.offload).items():
                host.copy_(p)

    def close(self) -> None:
        """Remove torchao's gradient hooks from the parameters (they would copy gradients to the host for good)."""
        for p, keys in self._hooks:
            for key in keys:
                post_accumulate_grad_hooks(p).pop(key, None)
        self._hooks = []

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the device gradients (always to None: the host copies are overwritten by the next backward)."""
        self.offload.zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, Any]:
        return self._owners.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._owners.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError("OffloadedOptimizer cannot add parameter groups: add them before offloading")

    def __repr__(self) -> str:
        return (f"OffloadedOptimizer({type(self.user_optimizer).__name__}, "
                f"{len(offload_host_copies(self.offload))} parameter tensors updated on the host)")


def offload_optimizers(optimizers: Iterable[Optimizer], *, refresh_grads: bool) -> list[Optimizer]:
    """Each optimizer offloaded (those already offloaded are kept)."""
    return [opt if isinstance(opt, OffloadedOptimizer) else OffloadedOptimizer(opt, refresh_grads=refresh_grads)
            for opt in optimizers]
