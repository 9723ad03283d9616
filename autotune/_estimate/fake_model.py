"""The model and training step the estimator traces (:class:`FakeStep`): a copy of the user's model under
``FakeTensorMode`` (or with real tensors on the host) with the plan applied as a run applies it, and one Lightning
step of it (see :mod:`autotune._estimate.trace`)."""

from __future__ import annotations

import contextlib
import copy
import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from autotune._compat.lightning import precision_input_dtype, trainer_reference
from autotune._compat.torch import fake_copy_mode, fake_tensor_mode
from autotune._estimate.cuda_rules import CudaAutocast
from autotune._estimate.fake_rules import allow_grouped_mm_in_any_dtype
from autotune._estimate.fake_step import (
    convert_model,
    like_cuda_run,
    loss_of,
    offloaded_host_bytes,
    optimizers_of,
    precision_plugin,
    with_optimizer_state,
)
from autotune._estimate.inert import Watch
from autotune._estimate.real_path import from_bytes, to_bytes
from autotune._estimate.sharding import cast_unit_inputs
from autotune._plan.plan import Plan
from autotune._runtime.state import RNGState
from autotune._transforms.blocks import (
    checkpoint_blocks,
    compile_targets,
    offload_activations,
    ops_only_blocks,
    select_blocks,
)
from autotune._transforms.offload import device_part, is_offloaded

__all__ = ["FakeStep"]

log = logging.getLogger(__name__)


class FakeStep:
    """A shape's model and optimizers copied under one ``FakeTensorMode`` with the plan applied, and its training step.

    The copy is kept for every micro-batch traced, so the warm-up step that makes the gradients and the optimizer state
    runs once: a step leaves the same state at any micro-batch, the gradients and the optimizer state of every
    parameter. A model that keeps Python state from step to step (a step counter, a list it appends to) is traced
    after as many steps as micro-batches were traced before. A step whose trace fails drops the copy. ``traces``: the
    :class:`~autotune._estimate.trace.Traces` it is made for (its model, batch, plan, device and optimizer)."""

    def __init__(self, traces: Any, *, real: bool = False) -> None:
        # real tensors run on the host, under CUDA's rules for a CUDA target (as a what-if trace does)
        self.real = real
        self.device = device = torch.device("cpu") if real else traces.trace_device
        self.what_if = traces.device.type == "cuda" if real else traces.what_if
        plan = traces.plan
        self.precision = precision = precision_plugin(plan.precision, device)
        if self.what_if and plan.precision.endswith("-mixed"):  # CUDA's op lists, on CPU tensors
            low = torch.bfloat16 if plan.precision == "bf16-mixed" else torch.float16
            self.autocast: Callable[[], Any] = lambda: CudaAutocast(low)
        else:  # CPU autocast: checkpointing re-enters it to recompute
            low = None
            self.autocast = precision.forward_context if precision is not None else contextlib.nullcontext
        self.in_backward = [False]
        self.warm = False
        self.mode = contextlib.nullcontext() if real else fake_tensor_mode(allow_non_fake_inputs=True)
        if not real:
            try:  # transformers' MoE experts in fp32 (torch's meta kernel takes bf16 only)
                allow_grouped_mm_in_any_dtype()
            except ImportError as error:  # torch moved its meta helpers: such a step goes to the real-tensor path
                log.debug("autotune: no fake rule for fp32 grouped matmuls (%s)", error)
        trainer = trainer_reference(traces.model)
        memo: dict[int, Any] = {id(trainer): None} if trainer is not None else {}
        if real:  # the copy is made on the host, whatever device the model is on
            for t in (*traces.model.parameters(), *traces.model.buffers()):
                if t.device.type != "cpu":
                    host = t.detach().to("cpu", copy=True)
                    memo[id(t)] = nn.Parameter(host, requires_grad=t.requires_grad) if isinstance(
                        t, nn.Parameter) else host
        with contextlib.nullcontext() if real else fake_copy_mode(self.mode):
            self.model = fake = copy.deepcopy(traces.model, memo)
        with self.entered():
            # FSDP2's bf16 policy gathers bf16 parameters, so autocast casts (and caches) no weights: trace in bf16,
            # with the fp32 master shards in closed form (rank_state)
            self.gathered_bf16 = plan.strategy == "fsdp" and plan.precision == "bf16-mixed"
            convert_model(fake, device, torch.bfloat16 if self.gathered_bf16 else precision_input_dtype(precision))
            fake.train()
            self.watch = Watch(fake, plan, device_type=traces.device.type)  # settings that apply to nothing
            if plan.activation_checkpointing:
                blocks = select_blocks(fake, plan.activation_checkpointing, plan.recompute)
                if low is not None:
                    _recompute_under(blocks, low, self.in_backward)
                checkpoint_blocks(blocks, model=fake,
                                  ops_only=ops_only_blocks(fake, plan.activation_checkpointing, plan.recompute))
                self.watch.checkpointed(blocks)
            if plan.compile:  # not traced (the eager step), but whether the modules it compiles run is
                self.watch.compiled(compile_targets(fake))
            if self.gathered_bf16:  # FSDP2's policy: each unit casts its inputs, so what passes between units is bf16
                cast_unit_inputs(fake, torch.bfloat16)
            optimizers = with_optimizer_state(optimizers_of(fake, traces.optimizer, traces.device),
                                              plan.optimizer_state, bf16_weights=plan.precision == "bf16-true")
            self.offloaded = [p for p in fake.parameters() if is_offloaded(p)] if plan.optimizer_offload else []
            self.host_bytes = offloaded_host_bytes(optimizers) if self.offloaded else 0
            if self.offloaded:  # the device runs the update of the small parameters only
                optimizers = like_cuda_run([d for d in map(device_part, optimizers) if d is not None], device)
            self.optimizers = optimizers
        self.plan = plan

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """The fake mode, and quiet about a step outside a Trainer (``self.log`` without a trainer, hooks)."""
        rng = _kept_random_state() if self.real else contextlib.nullcontext()  # the user's RNG untouched
        with self.mode, rng, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*`self\.log\(\)` but the `self\.trainer` reference")
            warnings.filterwarnings("ignore", message=r"Module is None\. Skipping")
            yield

    def step(self, inputs: Any, *, zero_grad: bool, before_backward: Callable[[], Any] = lambda: None,
             before_update: Callable[[], Any] = lambda: None, warm_up: bool = False, fill: bool = False) -> None:
        """Forward (the last gradients alive), ``zero_grad``, backward, update (``fill``: of every parameter, those
        this step's data left without a gradient given zeros; real tensors only)."""
        with _offload(self.plan, self.what_if, self.real):
            with self.autocast():
                loss = loss_of(self.model, self.model.training_step(inputs, 0))
            if zero_grad:
                for opt in self.optimizers:
                    opt.zero_grad(set_to_none=True)
                for p in self.offloaded:
                    p.grad = None
            before_backward()
            self.in_backward[0] = True
            try:
                loss.backward()
            finally:
                self.in_backward[0] = False
        del loss
        if (warm_up or fill) and self.real:  # every parameter updated, as the fake path has it
            self.fill_grads()
        before_update()
        for opt in self.optimizers:
            opt.step()

    def fill_grads(self) -> None:
        """Real tensors: zeros for the trainable parameters this step left without a gradient (an expert no token
        was routed to), as the fake path has them: a run's steady state holds every parameter's gradient (the last
        step's, during the forward) and optimizer state, whichever data each micro-batch routed where."""
        with torch.no_grad():
            for p in self.model.parameters():
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)


@contextlib.contextmanager
def _kept_random_state() -> Iterator[None]:
    """torch's (and CUDA's), Python's and NumPy's random state as they were, whatever the real step draws."""
    state = RNGState()
    try:
        yield
    finally:
        state.restore()


def _recompute_under(blocks: list[Any], low: torch.dtype, in_backward: list[bool]) -> None:
    """Checkpointing recomputes a block in backward under the forward's autocast state, which it re-enters for
    ``torch.autocast`` but not for a function mode: each block's forward enters CUDA's autocast itself while
    ``in_backward[0]`` (casts not cached: each recomputation makes its own)."""
    for block in blocks:
        original = block.forward

        def forward(*args: Any, __original: Callable[..., Any] = original, **kwargs: Any) -> Any:
            if not in_backward[0]:
                return __original(*args, **kwargs)
            with CudaAutocast(low, cache=False):
                return __original(*args, **kwargs)

        block.forward = forward


def _offload(plan: Plan, what_if: bool, real: bool) -> Any:
    """Activation offload as a run does it; in a what-if trace, saved tensors go to the meta device (the host), or,
    holding data (the real-tensor path), to bytes outside torch, which the tracker does not see either."""
    if not plan.activation_offload:
        return contextlib.nullcontext()
    if not what_if:
        return offload_activations(pin_memory=False)
    if real:
        return torch.autograd.graph.saved_tensors_hooks(to_bytes, from_bytes)
    return torch.autograd.graph.saved_tensors_hooks(lambda t: (t.device, t.to("meta")),
                                                    lambda packed: packed[1].to(packed[0]))
