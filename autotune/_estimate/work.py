"""The work of one traced training step, op by op: FLOPs and bytes moved of every aten operator the estimator's fake
step dispatches (:mod:`autotune._estimate.trace`), by phase, for the step-time model
(:mod:`autotune._estimate.step_time`).

An operator's bytes are those of its tensor inputs and outputs (each read or written once; a broadcast input's
real elements only), its FLOPs torch's formulas (``torch.utils.flop_counter``: matrix products, convolutions,
attention), in the dtype of its output. A copy between devices
(an offloaded activation, to the host and back) is host-link traffic, not memory traffic. Views and allocations move
nothing and compute nothing, but cost the host an operator's dispatch like any other. The phases: ``forward``,
``backward``, ``recompute`` (operators run in the backward with gradients enabled: activation checkpointing running a
block's forward again) and ``update`` (the optimizer step). torchao's low-bit update is one fused kernel per parameter
that the trace does not run (:class:`~autotune._estimate.fake_step.LowBitStandIn`): its traffic is added in closed form
(:func:`low_bit_update`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import logging
import math

import torch

from autotune._compat.torch import flop_registry, sdpa_backward_flops, sdpa_flops

__all__ = ["OpWork", "StepWork", "WorkCounter", "low_bit_update"]

log = logging.getLogger(__name__)

PHASES = ("forward", "backward", "recompute", "update")
#: Operators that allocate or alias and run no kernel (besides every view: ``OpOverload.is_view``).
_FREE = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh",
                   "_local_scalar_dense", "set_", "resize_", "_unsafe_view", "alias", "detach"})
#: Pointwise operators whose math, not their bytes, can set their time on a CPU (a tanh costs 25 times an add there):
#: a measured device times each per value (:mod:`autotune._estimate.local_speed`).
POINTWISE_MATH = ("tanh", "exp", "log", "sigmoid", "gelu", "gelu_backward", "silu", "silu_backward", "erf", "_softmax",
                  "_log_softmax")
#: The host's cost of calling a compiled function (its guards, then its kernel), in eager operators.
COMPILED_CALL = 10.0
_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp32"}


@dataclass(frozen=True)
class OpWork:
    """One operator of the traced step, with the work the step-time model prices.

    It holds the operator's phase, FLOPs (0 for those without a formula) in ``dtype``, and bytes read and written. It
    also holds how many tensors a ``_foreach_`` operator works through (1 for others), whether it copies between
    devices (``host_link``: its bytes cross the host link), and whether it is an attention kernel."""

    phase: str
    flops: float
    bytes: float
    dtype: str
    tensors: int = 1
    host_link: bool = False
    attention: bool = False  # an attention kernel (its FLOPs at the device's attention rate)
    calls: float = 1.0  # the host's cost in operators (a compiled function's guards cost several)
    heads: int = 0  # an attention kernel's batch x heads (its fixed cost per head)
    elements: int = 0  # values an operator without FLOPs goes through (pointwise math's cost is per value)
    kernel: str = ""  # for pointwise math measured per kernel (``POINTWISE_MATH``): its name
    written: float = 0.0  # bytes of its outputs (a large one comes from fresh pages on a CPU)


@dataclass(frozen=True)
class StepWork:
    """The operators of one traced micro-batch (its forward, backward and recomputation) and of the update, and the
    model-state sizes the closed-form parts (collectives, offload) need.

    ``parameter_bytes``: the traced model's parameters (under FSDP2's bf16 policy, in the gathered dtype);
    ``gradient_bytes``: the trained parameters' gradients; ``units``: FSDP2's units (the repeated blocks and the root);
    ``offloaded_bytes``: under ``optimizer_offload``, the parameters whose update runs on the host, and
    ``host_update_bytes`` what that update reads and writes there.
    """

    ops: tuple[OpWork, ...]
    micro_batch_size: int
    parameter_bytes: int = 0
    gradient_bytes: int = 0
    units: int = 1
    offloaded_bytes: int = 0
    host_update_bytes: int = 0

    def phase(self, *names: str) -> Iterator[OpWork]:
        """The operators of the phases ``names``."""
        return (op for op in self.ops if op.phase in names)

    def flops(self, *names: str) -> float:
        """FLOPs of the phases ``names`` (all phases when none is named)."""
        return sum(op.flops for op in self.ops if not names or op.phase in names)

    def model_flops_per_sample(self) -> float:
        """FLOPs of the forward and backward per sample, without recomputation: what an MFU counts."""
        return self.flops("forward", "backward") / self.micro_batch_size


@functools.cache
def flop_formulas() -> dict[Any, Callable[..., int]]:
    """torch's FLOP formulas by aten op packet (:func:`~autotune._compat.torch.flop_registry`; each takes the op's
    arguments and ``out_val``), with the CPU flash-attention kernels, which it lacks, counted as the CUDA ones; built
    once per process."""
    aten = torch.ops.aten

    def cpu_flash(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
        return sdpa_flops(query.shape, key.shape, value.shape)

    def cpu_flash_backward(grad: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
        return sdpa_backward_flops(grad.shape, query.shape, key.shape, value.shape)

    formulas = flop_registry()
    for name, formula in (("_scaled_dot_product_flash_attention_for_cpu", cpu_flash),
                          ("_scaled_dot_product_flash_attention_for_cpu_backward", cpu_flash_backward)):
        if hasattr(aten, name):
            formulas[getattr(aten, name)] = formula
    return formulas


class WorkCounter:
    """Collects :class:`OpWork` records, called with each operator as the memory tracker dispatches it (see
    :func:`autotune._estimate.fake_step.step_tracker`). ``device_type``: where the step's tensors live (a copy to
    another device type is host-link traffic); ``phase`` is set by the step as it goes."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self.phase = "forward"
        self.ops: list[OpWork] = []
        self._formulas = flop_formulas()

    def record(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        """Count one operator (``func`` an ``OpOverload``) with its arguments and output."""
        if func.namespace == "prim":  # metadata (a tensor's device), which a run reads without the dispatcher
            return
        packet = func.overloadpacket
        name = packet.__name__
        if func.is_view or name in _FREE:  # no work on the device, the host's cost all the same
            self.ops.append(OpWork(self.phase, 0.0, 0.0, "fp32"))
            return
        inputs = list(_tensors((args, kwargs)))
        outputs = list(_tensors(out))
        devices = {t.device.type for t in (*inputs, *outputs)}
        host_link = len(devices) > 1  # a copy between the device and the host (meta: a what-if trace's host)
        if not host_link and "meta" in devices:
            return
        moved = sum(_moved_bytes(t) for t in (*inputs, *outputs))
        if host_link:  # the copy's payload crosses once
            moved = sum(_moved_bytes(t) for t in outputs)
        flops = 0.0
        formula = self._formulas.get(packet)
        if formula is not None:
            try:
                flops = float(formula(*args, **(kwargs or {}), out_val=out))
            except Exception as error:  # a formula that does not take these arguments: the op is memory traffic
                log.debug("autotune: no FLOPs counted for %s (%s: %s)", func, type(error).__name__, error)
        dtype = _DTYPES.get(outputs[0].dtype if outputs else inputs[0].dtype if inputs else torch.float32, "fp32")
        if not flops and any(t.dtype in (torch.bfloat16, torch.float16) for t in (*inputs, *outputs)):
            dtype = "bf16" if dtype == "fp32" else dtype  # pointwise work converting to or from 16 bits
        tensors = len(args[0]) if name.startswith("_foreach_") and args and isinstance(args[0], (list, tuple)) else 1
        phase = "recompute" if self.phase == "backward" and torch.is_grad_enabled() else self.phase
        attention = bool(flops) and "attention" in name
        heads = math.prod(inputs[0].shape[:-2]) if attention and inputs and inputs[0].dim() > 2 else 0
        # the values a pointwise operator (or a reduction, over its input) goes through
        elements = 0 if flops or host_link else max((t.numel() for t in (*inputs, *outputs)), default=0)
        self.ops.append(OpWork(phase, flops, float(moved), dtype, max(tensors, 1), host_link, attention, heads=heads,
                               elements=elements, kernel=name if name in POINTWISE_MATH else "",
                               written=float(sum(_moved_bytes(t) for t in outputs))))

    def work(self, *, micro_batch_size: int, model: torch.nn.Module, optimizers: list[Any],
             offloaded: list[torch.Tensor], host_state_bytes: int) -> StepWork:
        """The step's work: the operators recorded, the low-bit update's (:func:`low_bit_update`) and the sizes of the
        traced ``model`` (``offloaded``: the parameters ``optimizer_offload`` updates on the host, whose copies and
        optimizer state take ``host_state_bytes`` there)."""
        from autotune._transforms.shard import sharding_units

        params = list({id(p): p for p in model.parameters()}.values())
        trained = [p for p in params if p.requires_grad]
        blocks, _ = sharding_units(model)
        offloaded_bytes = sum(p.numel() * p.element_size() for p in offloaded)
        return StepWork(
            ops=(*self.ops, *low_bit_update(optimizers)), micro_batch_size=micro_batch_size,
            parameter_bytes=sum(p.numel() * p.element_size() for p in params),
            gradient_bytes=sum(p.numel() * p.element_size() for p in trained), units=len(blocks) + 1,
            offloaded_bytes=offloaded_bytes,
            # the host's update reads and writes its copies of the parameters and gradients, and the state
            host_update_bytes=2 * host_state_bytes if offloaded else 0)


def low_bit_update(optimizers: list[Any]) -> list[OpWork]:
    """The update of torchao's low-bit optimizers (stand-ins in the trace, which allocate their state and compute
    nothing): one compiled kernel per parameter (``COMPILED_CALL`` operators of the host's time), reading the
    parameter, its gradient and each moment's stored bytes, writing back the parameter and the moments."""
    ops = []
    for opt in optimizers:
        kind = getattr(opt, "kind", None)
        if kind not in ("8bit", "4bit"):
            continue
        for p, state in opt.state.items():
            moments = sum(t.numel() * t.element_size() for name, t in state.items()
                          if name != "step" and isinstance(t, torch.Tensor))
            weight = p.numel() * p.element_size()
            ops.append(OpWork("update", 0.0, float(3 * weight + 2 * moments), _DTYPES.get(p.dtype, "fp32"),
                              calls=COMPILED_CALL))
    return ops


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    """The tensors in nested lists, tuples and dicts."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            yield from _tensors(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _tensors(item)


def _moved_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements read or written once: a broadcast dimension (stride 0) counts one element."""
    if t.layout != torch.strided:  # sparse, nested: their values
        return t.numel() * t.element_size()
    count = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            count *= int(size)
    return count * t.element_size()
