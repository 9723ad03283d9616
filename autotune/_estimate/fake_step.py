"""The parts of the estimator's fake training step: the memory tracker, the model, precision, optimizers, batch and
loss as a run has them, traced on fake tensors (see :mod:`autotune._estimate.estimate`, which runs the step)."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.flop_counter import flop_registry

from autotune._compat.lightning import optimizers_from_config, set_module_device_dtype, set_trainer_reference
from autotune._compat.torch import module_tensor_slots, storage_key
from autotune._estimate.cuda_rules import round_cuda
from autotune._estimate.peak_tracker import peak_tracker
from autotune._estimate.sharding import shard_numel
from autotune._estimate.work import WorkCounter
from autotune._estimate.workspace import Workspace
from autotune._transforms.offload import hyperparameters, is_offloaded, update_constructor
from autotune._transforms.optim_state import replaces, state_tensor_bytes

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule

OptimizerFactory = Callable[[Iterator[nn.Parameter]], torch.optim.Optimizer]

def step_tracker(*, cuda_rules: bool = False, work_on: str | None = None, counter: WorkCounter | None = None) -> Any:
    """torch's ``MemTracker``, keeping the step's peak only (each module's costs a loop per op), and counting the
    work buffers kernels allocate inside one call (:mod:`autotune._estimate.workspace`; see its ``workspace``).
    ``cuda_rules``: a CPU trace of a CUDA step (every storage rounded as CUDA's allocator does, no CPU work buffers).
    ``work_on``: a device type whose bytes alive after each op are kept (the tracker's ``timelines``), with the
    step's FLOPs (``flops``, of the ops torch's flop counter knows) and the bytes it allocated (``allocated_bytes``):
    the real-tensor path's measure of a step's work and its moments. ``counter``: also records each operator's FLOPs
    and bytes (the step-time model's work).
    """
    workspace = Workspace(cpu_kernels=not cuda_rules)
    count = [0]

    def extra(func: Any, args: Any, kwargs: Any, out: Any) -> int:
        if counter is not None:
            counter.record(func, args, kwargs, out)
        if work_on is not None:
            formula = flop_registry.get(getattr(func, "overloadpacket", None))
            if formula is not None:
                count[0] += int(formula(*args, **(kwargs or {}), out_val=out))
        return workspace.bytes_of(func, args, kwargs, out)

    tracker = peak_tracker(extra, round_cuda if cuda_rules else None, timeline_device=work_on)
    tracker.workspace = workspace
    tracker.flop_count = count
    return tracker


def convert_model(model: nn.Module, device: torch.device, dtype: torch.dtype | None) -> None:
    """``model.to(device, dtype)`` for a fake copy (``Module.to`` cannot swap fake parameters); ties are kept."""
    done: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for tensors in module_tensor_slots(module):
            for name, t in tensors.items():
                if t is not None and id(t) not in done:
                    new = t.to(device=device, dtype=dtype if dtype is not None and t.is_floating_point() else t.dtype)
                    is_param = isinstance(t, nn.Parameter)
                    done[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if is_param else new
                if t is not None:
                    tensors[name] = done[id(t)]
        set_module_device_dtype(module, device, dtype)  # what ``self.device`` and ``self.dtype`` answer


def precision_plugin(precision: str, device: torch.device) -> Any:
    """Lightning's plugin for ``precision`` (None for 32-true): the autocast or dtype the Trainer applies."""
    from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision

    if precision.endswith("-mixed"):  # a GradScaler only scales the loss: leave it out (it wants a real device)
        return MixedPrecision(precision, device=device.type, scaler=None if precision == "bf16-mixed" else object())
    return HalfPrecision(precision) if precision in ("bf16-true", "16-true") else None


def optimizers_of(model: LightningModule, factory: OptimizerFactory | None, device: torch.device) -> list[Any]:
    if factory is not None:
        optimizers = [factory(model.parameters())]
    else:
        set_trainer_reference(model, SimpleNamespace(  # the trainer of an endless run
            estimated_stepping_batches=math.inf, max_steps=-1, max_epochs=None, num_devices=1, world_size=1,
            global_rank=0, local_rank=0))
        try:
            config = model.configure_optimizers()
        except AttributeError as error:
            raise ValueError(f"{type(model).__name__}.configure_optimizers() needs a Trainer the estimator does not "
                             f"have ({error}); pass optimizer= to estimate()") from error
        finally:
            set_trainer_reference(model, None)
        optimizers = [getattr(opt, "optimizer", opt) for opt in optimizers_from_config(config)]
    if not optimizers:
        raise ValueError(f"{type(model).__name__}.configure_optimizers() returned no optimizer; nothing to estimate")
    return like_cuda_run(optimizers, device)


def like_cuda_run(optimizers: list[Any], device: torch.device) -> list[Any]:
    """torch picks foreach for real CUDA tensors, not for fake ones: pick what a run would."""
    for opt in optimizers:
        for group in opt.param_groups:
            if device.type == "cuda" and "foreach" in group and group["foreach"] is None and not group.get("fused"):
                group["foreach"] = True
    return optimizers


def offloaded_host_bytes(optimizers: list[Any]) -> int:
    """Host bytes of ``optimizer_offload``: pinned copies of each offloaded parameter and its gradient, and the
    optimizer state of the host-side update (made by one update of fake host copies)."""
    total = 0
    for opt in optimizers:
        groups = []
        for group in opt.param_groups:
            host = [nn.Parameter(torch.empty_like(p, device="cpu")) for p in group["params"] if is_offloaded(p)]
            for h in host:
                h.grad = torch.empty_like(h)
            if host:
                groups.append({**hyperparameters(group), "params": host})
                total += 2 * bytes_of(host, torch.device("cpu"))
        if groups:
            make, kwargs = update_constructor(opt)
            host_opt = make(groups, **kwargs)
            host_opt.step()
            total += bytes_of((t for s in host_opt.state.values() for t in s.values()), torch.device("cpu"))
    return total


def fake_batch(mode: Any, batch: Any, device: torch.device, precision: Any) -> tuple[Any, list[torch.Tensor]]:
    """The batch as fake tensors of ``mode`` on ``device`` in the plan's input dtype (``mode`` None: real copies), and
    its tensors."""
    from lightning.fabric.utilities.apply_func import apply_to_collection

    fake = apply_to_collection(batch, torch.Tensor, lambda t: t.detach().to(device, copy=True) if mode is None
                               else mode.from_tensor(t).to(device))
    fake = precision.convert_input(fake) if precision is not None else fake
    found: list[torch.Tensor] = []
    apply_to_collection(fake, torch.Tensor, found.append)
    return fake, found


class StepError(ValueError):
    """A training step the estimator cannot take whatever the tensors (it returns no loss): raised as it is, never
    sent to the real-tensor path."""


def loss_of(model: nn.Module, output: Any) -> torch.Tensor:
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if not isinstance(loss, torch.Tensor):
        raise StepError(f"{type(model).__name__}.training_step returned {type(output).__name__}, not a loss tensor "
                         "or a dict with 'loss'; the estimator traces steps that return a loss")
    return loss


def bytes_of(tensors: Iterable[Any], device: torch.device, *, cuda_rules: bool = False) -> int:
    """Bytes of the distinct storages of the tensors on ``device`` (the rest ignored), rounded to 512 B on CUDA (or
    with ``cuda_rules``, a CPU trace of a CUDA step)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type == device.type:
            nbytes = t.untyped_storage().nbytes()
            seen[storage_key(t)] = round_cuda(nbytes) if t.is_cuda or cuda_rules else nbytes
    return sum(seen.values())


class LowBitStandIn(torch.optim.Optimizer):
    """Stand in for torchao's update (low-bit Adam, or AdamW rounding bf16 stochastically) in the estimator's trace.

    It makes the state tensors torchao stores at the first update: per moment, codes, scales and code map, or a
    full-width buffer for small tensors (see :func:`autotune._transforms.optim_state.state_tensor_bytes`). Its update
    allocates nothing more, since torchao fuses each parameter's update into one compiled kernel."""

    def __init__(self, optimizer: torch.optim.Optimizer, state: str) -> None:
        super().__init__([{"params": list(g["params"]), "amsgrad": bool(g.get("amsgrad"))}
                          for g in optimizer.param_groups], {})
        self.kind = state

    def update_constructor(self) -> tuple[Callable[..., torch.optim.Optimizer], dict[str, Any]]:
        """The same update over other groups (``optimizer_offload``'s host copies, its device part)."""
        return (lambda groups: LowBitStandIn(SimpleNamespace(param_groups=groups), self.kind)), {}

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            moments = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")[: 3 if group["amsgrad"] else 2]
            for p in group["params"]:
                if p.grad is None or self.state[p]:
                    continue
                state = self.state[p]
                state["step"] = torch.zeros((), device=p.device)
                for name in moments:
                    state[name] = torch.empty(state_tensor_bytes(p.numel(), p.element_size(), self.kind),
                                              dtype=torch.uint8, device=p.device)

    def rank_state_bytes(self, param: torch.Tensor, world_size: int, master_dtype: torch.dtype | None) -> int:
        """One rank's bytes of ``param``'s state under FSDP2: the moments of its shard (dim 0 cut in padded chunks)."""
        width = torch.empty((), dtype=master_dtype).element_size() if master_dtype is not None else param.element_size()
        moments = sum(1 for name in self.state[param] if name != "step")
        return 4 + moments * state_tensor_bytes(shard_numel(param, world_size), width, self.kind)


def with_optimizer_state(optimizers: list[Any], state: str, bf16_weights: bool) -> list[Any]:
    """The optimizers a run with ``optimizer_state`` (and bf16 weights) steps: torchao's where it replaces one
    (:class:`LowBitStandIn`), else the user's; ValueError for an optimizer it refuses."""
    return [LowBitStandIn(opt, state) if replaces(opt, state=state, bf16_weights=bf16_weights) else opt
            for opt in optimizers]


#: torch's loggers that report a failing operation under FakeTensorMode at length (tens of lines of stack on stderr)
#: before the error reaches the estimator, which reports it in one line.
_TRACE_LOGGERS = ("torch._subclasses.fake_tensor", "torch._dynamo", "torch.fx.experimental.symbolic_shapes")


@contextlib.contextmanager
def quiet_torch_logs() -> Iterator[None]:
    """torch's tracing loggers silenced while a step is traced, their levels restored after."""
    loggers = [logging.getLogger(name) for name in _TRACE_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
