"""Private torch API that autotune uses (tensors and modules, autograd hooks, the optimizer and the grad scaler,
CUDA's allocator, DDP and ``torch.distributed``, dispatch modes, fake tensors, the flop counter, ``MemTracker``,
functorch's config), each access with what breaks if it changes; FSDP2's is in :mod:`autotune._compat.fsdp`."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


def tensor_version(tensor: Any) -> int:
    """The tensor's version counter, bumped by every in-place change (``Tensor._version``, what autograd checks
    saved tensors with). If it went away, ``update_fingerprint`` could not tell an untouched update from a changed
    one: an OOM inside a steady-state update would then always end the run instead of replaying."""
    return int(tensor._version)


def tensor_versions(values: Any) -> list[Any]:
    """:func:`tensor_version` of each tensor in ``values`` and every other value as it is, in one comprehension (a
    per-step path: a function call per tensor costs about 0.25 us)."""
    from torch import Tensor

    return [v._version if isinstance(v, Tensor) else v for v in values]


def storage_key(tensor: Any) -> int:
    """A key that is the same for tensors sharing one storage, fake tensors included
    (``untyped_storage()._cdata``, the address of the C++ storage object). If it went away, ``bytes_of`` (estimator)
    could not count shared storages once. Public ``untyped_storage().data_ptr()`` is not used: fake tensors have no
    data, so it does not tell their storages apart."""
    return int(tensor.untyped_storage()._cdata)


def module_tensor_slots(module: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """A module's own parameter and buffer dicts (``Module._parameters``, ``Module._buffers``), for swapping tensors
    in place, as ``Module._apply`` itself does. If they went away, the estimator could not move a fake model to the
    plan's device and dtype. ``Module.to`` is not used because it cannot swap fake parameters; the slower public
    route (``named_parameters(recurse=False)`` and ``setattr`` through ``Module.__setattr__``) is not used so that
    the swap stays what it was."""
    return module._parameters, module._buffers


def post_accumulate_grad_hooks(param: Any) -> dict[int, Any]:
    """The post-accumulate-grad hooks of ``param`` by handle id (``Tensor._post_accumulate_grad_hooks``; torch keeps
    no public list of them, and the handle ``register_post_accumulate_grad_hook`` returns is torchao's, not ours).
    If it went away, ``OffloadedOptimizer.close`` would leave torchao's gradient-copy hooks on the parameters."""
    return getattr(param, "_post_accumulate_grad_hooks", None) or {}


def copy_tensors(destinations: list[Any], sources: list[Any]) -> None:
    """``d.copy_(s)`` for each pair, in one ``torch._foreach_copy_`` (a kernel launch per device and dtype, not per
    tensor). If it went away, running statistics would not be rolled back after a failed attempt (the BatchNorm test
    fails); a loop of ``copy_`` is its replacement."""
    import torch

    torch._foreach_copy_(destinations, sources)


def is_norm_with_running_stats(module: Any) -> bool:
    """Whether ``module`` is a BatchNorm or InstanceNorm layer of any dimension that keeps running statistics
    (``torch.nn.modules.batchnorm._NormBase``, their private base). If it went away, ``ElasticBatchSize`` would raise
    at its first step. Listing the public classes is not done: it would miss subclasses of the private base."""
    import torch

    return isinstance(module, torch.nn.modules.batchnorm._NormBase) and bool(module.track_running_stats)


def is_batch_norm(module: Any) -> bool:
    """Whether ``module`` is a batch norm layer of any dimension (``torch.nn.modules.batchnorm._BatchNorm``, the base
    of ``BatchNorm1d/2d/3d``, their lazy forms and user subclasses). If it went away, ``ElasticBatchSize`` would
    raise at setup. Listing the public classes is not done: it would miss subclasses of the private base."""
    import torch

    return isinstance(module, torch.nn.modules.batchnorm._BatchNorm)


def mark_optimizer_stepped(optimizer: Any) -> None:
    """Set the flag torch's LR schedulers read to warn about ``lr_scheduler.step()`` before ``optimizer.step()``
    (``Optimizer._opt_called``, set by the step wrapper the scheduler installs, which an offloaded optimizer bypasses).
    If the schedulers stopped reading it, nothing breaks; if they read another flag, offloaded runs would be warned
    that ``lr_scheduler.step()`` ran before ``optimizer.step()``."""
    optimizer._opt_called = True


def forget_scaler_steps(scaler: Any) -> None:
    """Make a ``GradScaler`` forget the ``unscale_``/inf checks of a failed attempt
    (``GradScaler._per_optimizer_states.clear()``). If it went away, a replayed step would fail with "unscale_() has
    already been called on this optimizer since the last update()". Public ``scaler.update()`` is not used: it also
    changes the loss scale."""
    scaler._per_optimizer_states.clear()


def set_cuda_allocator_settings(settings: str) -> None:
    """Change the CUDA caching allocator's settings at run time (``torch.cuda.memory._set_allocator_settings``, the
    run-time form of ``PYTORCH_CUDA_ALLOC_CONF``; the allocator applies ``expandable_segments`` to the segments it
    makes afterwards). If it went away, ``ApplyPlan(expandable_segments=True)`` would fail at setup: the public
    alternative is the environment variable, read once when CUDA starts, before any callback runs."""
    import torch

    torch.cuda.memory._set_allocator_settings(settings)


def record_cuda_memory_history(*, max_entries: int) -> None:
    """Start recording every CUDA allocation with its Python stack (``torch.cuda.memory._record_memory_history``,
    the documented entry point of torch's memory visualizer; it has no public name). If it changed, ``MemoryMonitor``
    would fail at setup on CUDA, or record without stacks."""
    import torch

    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python", max_entries=max_entries)


def stop_cuda_memory_history() -> None:
    """Stop recording CUDA allocations (``torch.cuda.memory._record_memory_history(enabled=None)``). If it changed,
    ``MemoryMonitor`` would fail at teardown on CUDA or leave the (costly) recording on."""
    import torch

    torch.cuda.memory._record_memory_history(enabled=None)


def dump_cuda_memory_snapshot(path: str) -> None:
    """Write the recorded CUDA allocations to ``path``, a pickle for https://pytorch.org/memory_viz
    (``torch.cuda.memory._dump_snapshot``; no public name). If it changed, ``MemoryMonitor`` would write no snapshot
    when a step runs out of memory."""
    import torch

    torch.cuda.memory._dump_snapshot(path)


def ddp_buffers_due(ddp: Any) -> bool:
    """Whether DDP's next forward would broadcast rank 0's buffers (``DistributedDataParallel.
    will_sync_module_buffers()``: its ``require_forward_param_sync`` flag, set by a forward with gradient sync on, and
    ``broadcast_buffers`` with buffers to send; undocumented). If it went away, ``ElasticBatchSize`` would fail at its
    first DDP step; if it changed meaning, buffers would be broadcast more or less often than in Lightning's own
    accumulation (``tests/runtime/test_ranks.py`` compares BatchNorm's statistics with it)."""
    return bool(ddp.will_sync_module_buffers())


def set_ddp_buffers_due(ddp: Any, due: bool) -> None:
    """Set whether DDP's next forward broadcasts buffers (``DistributedDataParallel.require_forward_param_sync``,
    which its ``_post_forward`` sets after each forward: a forward that raises skips it and leaves the flag as it
    was, on that rank only). If DDP read another flag, a replayed forward could broadcast on one rank alone and
    every rank would hang."""
    ddp.require_forward_param_sync = due


def sync_ddp_buffers(ddp: Any) -> None:
    """Broadcast rank 0's buffers as DDP's forward does (``DistributedDataParallel._sync_buffers``: its buffer
    hooks, join and bucket size included). If it went away, ``ElasticBatchSize`` would fail at its first DDP step of a
    model with buffers; the public route, a forward with sync on, would reduce gradients too."""
    ddp._sync_buffers()


def default_store() -> Any:
    """The key-value store of the default process group (``torch.distributed.distributed_c10d.
    _get_default_store``; the store ``init_process_group`` rendezvoused with). ``ElasticBatchSize`` publishes
    FSDP2 collectives there for a failing rank to follow. A new ``TCPStore`` is not made instead: it would need a
    free port agreed by all ranks. If it went away, an OOM in an FSDP2 step whose collective schedule is not yet
    known (the first step) would fail instead of replaying."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def process_group_named(name: str) -> Any:
    """The process group whose ``group_name`` is ``name`` (``torch.distributed.distributed_c10d.
    _resolve_process_group``, how torch's functional collectives find a group by name). If it went away, a rank
    following a peer's FSDP2 collectives through a group it had not used yet in the step would fail."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def outside_dispatch_modes() -> Any:
    """A context where no Python dispatch mode (fake tensors, the estimator's memory tracker) is active, so real
    tensors can be made and real kernels run (``torch.utils._python_dispatch._disable_current_modes``). If it went
    away, the estimator could not measure kernel work buffers while it traces a step on fake tensors."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def conv_backend_name(x: Any, weight: Any, rest: Any) -> str:
    """The convolution backend ATen picks for these arguments (``torch._C._select_conv_backend``: "Slow2d",
    "Mkldnn", ...). If it went away or renamed its backends, CPU convolutions would count no work buffer."""
    import torch

    return str(getattr(torch._C._select_conv_backend(x, weight, None, *rest, None), "name", ""))


def fake_tensor_mode(*, allow_non_fake_inputs: bool) -> Any:
    """torch's ``FakeTensorMode`` (``torch._subclasses.fake_tensor``): tensors with shapes, dtypes and devices but no
    data, which the estimator traces a training step on. There is no public home for it; if it moved, ``estimate``
    would fail at its first trace."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=allow_non_fake_inputs)


def fake_copy_mode(mode: Any) -> Any:
    """A context in which ``copy.deepcopy`` makes fake copies of real tensors in ``mode``
    (``torch._subclasses.fake_tensor.FakeCopyMode``). If it moved, ``estimate`` could not copy the model onto fake
    tensors."""
    from torch._subclasses.fake_tensor import FakeCopyMode

    return FakeCopyMode(mode)


def grouped_mm_meta_kernels() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """torch's meta kernel of ``torch._grouped_mm`` and the function it makes its output with
    (``torch._meta_registrations.meta_grouped_mm`` and ``_create_grouped_mm_output_tensor``), for the estimator's fake
    rule (:mod:`autotune._estimate.fake_rules`). If either went away, this raises ImportError and no rule is
    registered: the estimator's fake trace of an fp32 mixture of experts then fails at torch's bf16-only check and
    the real-tensor path answers instead (slower, and not for meta-device models)."""
    from torch._meta_registrations import _create_grouped_mm_output_tensor, meta_grouped_mm

    return meta_grouped_mm, _create_grouped_mm_output_tensor


def has_grouped_mm() -> bool:
    """Whether this torch has the aten operator ``_grouped_mm`` (transformers' default mixture-of-experts matmul,
    private to ATen). If it were renamed, the estimator would register no fake rule for it: see
    :func:`grouped_mm_meta_kernels` for what that costs."""
    import torch

    return hasattr(torch.ops.aten, "_grouped_mm")


def register_grouped_mm_fake(rule: Callable[..., Any]) -> None:
    """Make ``rule`` the fake-tensor rule of ``aten::_grouped_mm`` for the process (public
    ``torch.library.register_fake`` on a private operator), replacing torch's meta kernel in every fake trace,
    torch.compile's included. If the operator were renamed, this raises and the estimator goes on without it (see
    :func:`grouped_mm_meta_kernels`)."""
    import torch

    torch.library.register_fake("aten::_grouped_mm", rule)


def flop_registry() -> dict[Any, Callable[..., int]]:
    """torch's FLOP formulas by aten op packet (a copy of ``torch.utils.flop_counter.flop_registry``, what
    ``FlopCounterMode`` counts with; each takes the op's arguments and ``out_val``). The registry is not in the
    module's ``__all__``; if it went away, the step-time model would count no FLOPs (every op memory-bound) and its
    tests of a known matmul's FLOPs fail. ``FlopCounterMode`` itself is not used: it counts totals per module, not per
    op."""
    from torch.utils.flop_counter import flop_registry as registry

    return dict(registry)


def sdpa_flops(query_shape: Any, key_shape: Any, value_shape: Any) -> int:
    """FLOPs of scaled dot-product attention's forward for these shapes, as torch counts them
    (``torch.utils.flop_counter.sdpa_flop_count``, not in the module's ``__all__``). If it went away, the CPU
    flash-attention kernels would count no FLOPs and measuring this machine's attention rate would fail."""
    from torch.utils.flop_counter import sdpa_flop_count

    return int(sdpa_flop_count(query_shape, key_shape, value_shape))


def sdpa_backward_flops(grad_shape: Any, query_shape: Any, key_shape: Any, value_shape: Any) -> int:
    """FLOPs of scaled dot-product attention's backward for these shapes, as torch counts them
    (``torch.utils.flop_counter.sdpa_backward_flop_count``, not in the module's ``__all__``). If it went away, as
    :func:`sdpa_flops`."""
    from torch.utils.flop_counter import sdpa_backward_flop_count

    return int(sdpa_backward_flop_count(grad_shape, query_shape, key_shape, value_shape))


def operator_recorder(record: Callable[[Any, Any, Any, Any], None]) -> Any:
    """A dispatch mode calling ``record(func, args, kwargs, out)`` for each aten operator run under it
    (``torch.utils._python_dispatch.TorchDispatchMode``, the public base class of torch's own modes, in a private
    module). If it moved, measuring this machine's cost per operator would fail."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            record(func, args, kwargs, out)
            return out

    return Recorder()


def mem_ref_types() -> Any:
    """The categories ``MemTracker`` sorts memory into (``torch.distributed._tools.mem_tracker._MemRefType``: PARAM,
    BUFFER, GRAD, ACT, TEMP, OPT, OTH). If they were renamed, the estimate's breakdown would fail to build."""
    from torch.distributed._tools.mem_tracker import _MemRefType

    return _MemRefType


@functools.cache
def mem_tracker_base() -> type:
    """torch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``, a private module: it has no public home)
    with its private hooks handed to methods with public names, which the estimator's tracker
    (:mod:`autotune._estimate.peak_tracker`) overrides; each override below says what breaks if upstream changes.
    ``torch.cuda.max_memory_allocated`` is no alternative: nothing is allocated on fake tensors."""
    from torch.distributed._tools.mem_tracker import MemTracker, _UpdateType

    class HookedMemTracker(MemTracker):
        def storage_counted(self, nbytes: int, counted: int, *, added: bool) -> int:
            """The bytes to count for a storage of ``nbytes`` that upstream counts as ``counted``, as it is added
            (``added``) or updated; by default upstream's."""
            return counted

        def before_parameters_tracked(self, module: Any) -> None:
            """Called before ``module``'s parameters and buffers are tracked (and hooked for their gradients)."""

        def update_peak(self) -> None:
            """Called after each op to update the peaks; by default upstream's update, without module peaks."""
            MemTracker._update_peak_stats(self, None)

        def _update_snap(self, flag: Any, winfo: Any, *args: Any, **kwargs: Any) -> None:
            # Upstream counts each storage change here, from ``_WeakRefInfo.mem_consumed`` (set here first) and its
            # ``size``/``element_size``; ``_UpdateType.ADD`` is a storage's making. If this were renamed, CPU traces
            # of CUDA steps would count unrounded storages and ``allocated_bytes`` would stay 0 (the estimator's
            # tests of CUDA rounding and of the real-tensor path fail).
            winfo.mem_consumed = self.storage_counted(winfo.size * winfo.element_size, winfo.mem_consumed,
                                                      added=flag == _UpdateType.ADD)
            super()._update_snap(flag, winfo, *args, **kwargs)

        def _track_module_params_and_buffers(self, module: Any, install_grad_hooks: bool = True) -> Any:
            # Upstream tracks a module's parameters and hooks each for its gradient here. If this were renamed,
            # estimating a model with a frozen parameter would fail again (a test estimates one).
            self.before_parameters_tracked(module)
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

        def _update_peak_stats(self, peak_state: Any) -> None:
            # Upstream loops over every module per op here; if this were renamed, estimates would only get slower.
            self.update_peak()

    return HookedMemTracker


def memory_now(tracker: Any) -> dict[Any, dict[Any, int]]:
    """A ``MemTracker``'s bytes alive now, device -> {:func:`mem_ref_types` member or "Total": bytes}, the live
    dicts (``MemTracker._curr_mem_snap``). If it changed, ``estimate`` would fail at its first trace."""
    return tracker._curr_mem_snap  # type: ignore[no-any-return]


def peak_memory(tracker: Any) -> tuple[dict[Any, int], dict[Any, dict[Any, int]]]:
    """A ``MemTracker``'s peaks, device -> bytes, and the snapshot of each (``MemTracker._peak_mem`` and
    ``_peak_mem_snap``, what ``get_tracker_snapshot("peak")`` reads), the live dicts. If they changed, ``estimate``
    would fail or give wrong peaks (the estimator tests compare with profiled peaks)."""
    return tracker._peak_mem, tracker._peak_mem_snap


def reset_peak_memory(tracker: Any) -> None:
    """Forget a ``MemTracker``'s peaks (``MemTracker._peak_mem`` and ``_peak_mem_snap``). If they changed, as
    :func:`peak_memory`."""
    tracker._peak_mem, tracker._peak_mem_snap = {}, {}


def grad_hook_handles(tracker: Any) -> Any:
    """Parameter -> the two gradient hook handles a ``MemTracker`` installed on it (``MemTracker.
    _param_to_grad_hook_handles``; upstream hooks no parameter already in it). If it changed, estimating a model with
    a frozen parameter would fail again (a test estimates one)."""
    return tracker._param_to_grad_hook_handles


@functools.cache
def cuda_autocast_ops() -> frozenset[str]:
    """Names of the aten ops that have an ``AutocastCUDA`` kernel (any overload) in this build of torch, read from
    the dispatcher once per process (``torch._C._dispatch_get_all_op_names`` and
    ``_dispatch_has_kernel_for_dispatch_key``): CPU builds register them too. If those were renamed, what-if CUDA
    estimates would fail."""
    import torch

    names = (op for op in torch._C._dispatch_get_all_op_names()
             if torch._C._dispatch_has_kernel_for_dispatch_key(op, "AutocastCUDA"))
    return frozenset(op.removeprefix("aten::").split(".")[0] for op in names)


def set_activation_memory_budget(budget: float) -> Any:
    """Set the compiler's activation-memory budget (``torch._functorch.config.activation_memory_budget``: the share
    of the activations the partitioner may save, recomputing the rest) for graphs compiled from now on; returns
    the previous value. If it were renamed, ``compile_memory_budget`` would fail at setup."""
    import torch._functorch.config as functorch_config

    previous = functorch_config.activation_memory_budget
    functorch_config.activation_memory_budget = budget
    return previous


#: Where torch's fake tensors (``torch._subclasses``: ``FakeTensorMode``, the estimator's trace without data) keep
#: their code, as a path fragment: an error raised there is the trace's limit (a value read, an op without a fake
#: rule), not the traced code's mistake. If the package moved, such an error in the user's step would read as the
#: user's (:mod:`autotune._target.failure`): the search would stop where it now notes it.
FAKE_TENSOR_CODE = "/torch/_subclasses/"
