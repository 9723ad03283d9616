"""Every use of private upstream API (torch, Lightning, torchmetrics, torchao, Optuna), each with what breaks if it
changes.

This is the one place to look when upgrading an upstream package: no other module of autotune reaches into a private
module, class or attribute of theirs (``tests/test_layout.py`` checks it). Each access is one small function (or
constant) whose comment says what it does, what breaks if upstream changes it and, where one exists, the public
alternative and why it is not used. Checked against torch 2.13.0, lightning 2.6.6, torchmetrics 1.9.0, optuna 5.0.0
and torchao 0.18.0 (the source of its ``CPUOffloadOptimizer``; the tests run a stand-in with the same attributes).

Bottom layer: imports nothing from autotune, and upstream packages only inside the functions that need them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# ----------------------------------------------------------------------------------------------------------- torch


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


def fsdp_comms(module: Any) -> tuple[Any, Any] | None:
    """The all-gather and reduce-scatter an FSDP2 unit issues its collectives through (``FSDPParamGroup.
    _all_gather_comm`` / ``_reduce_scatter_comm`` of its ``_get_fsdp_state()._fsdp_param_groups``), or None for a
    unit without parameters. ``ElasticBatchSize`` wraps them to record each call (the public setters
    ``set_custom_all_gather`` / ``set_custom_reduce_scatter`` install the wrappers; torch has no public getter), so
    a communication the user installed keeps doing the work. If these moved, FSDP2 runs would fail at their first
    step with an AttributeError, and OOMs under FSDP2 could not be replayed."""
    groups = module._get_fsdp_state()._fsdp_param_groups
    if not groups:
        return None
    return groups[0]._all_gather_comm, groups[0]._reduce_scatter_comm


def fsdp_is_root(module: Any) -> bool:
    """Whether an FSDP2 unit is a root (``_get_fsdp_state()._is_root``: set at the first forward, True for the units
    forwarded first, which need not be the outermost: a LightningModule whose ``training_step`` calls a submodule is
    never forwarded). Public ``reset_iter_state()`` must be called on exactly these; torch has no public test. If it
    went away, the FSDP2 replay would fail at its first OOM with an AttributeError."""
    return module._get_fsdp_state()._is_root is True


def clear_fsdp_unsharded_grads(module: Any) -> None:
    """Drop the unsharded gradients an FSDP2 unit holds before its reduce-scatter: a backward that ran out of memory
    leaves them behind, and so does accumulation under ``set_requires_gradient_sync(False)``
    (``FSDPParam._unsharded_param.grad`` and ``FSDPParam.unsharded_accumulated_grad``, the latter when the reduce
    dtype differs from the parameter dtype). Public ``reset_iter_state()`` resets the iteration but keeps them, and
    ``zero_grad`` only reaches the sharded gradients. If they moved, a step replayed after an OOM would add the
    failed attempt's partial gradients to its own: ``test_an_oom_inside_a_units_backward_after_some_of_its_gradients_
    is_replayed_exactly`` (tests/runtime/test_fsdp.py) ends 0.002-0.057 from Lightning's accumulation
    without this, 1e-6 with it."""
    for group in module._get_fsdp_state()._fsdp_param_groups:
        for param in group.fsdp_params:
            unsharded = getattr(param, "_unsharded_param", None)  # absent before the first all-gather
            if unsharded is not None:
                unsharded.grad = None
            param.unsharded_accumulated_grad = None


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


def allow_grouped_mm_in_any_dtype() -> None:
    """Give ``torch._grouped_mm`` (transformers' default mixture-of-experts matmul) a fake-tensor rule for every dtype
    its kernels take, registered once per process through public ``torch.library.register_fake``: torch's own meta
    kernel (``torch._meta_registrations.meta_grouped_mm``) still answers bf16, and fp32/fp16 get the same output
    (``_create_grouped_mm_output_tensor``) without its bf16-only check, which the CPU kernel and CUDA's (torch >= 2.10)
    do not make. If either private function went away, this raises ImportError and nothing is registered: the
    estimator's fake trace of an fp32 MoE then fails at the meta check and the real-tensor path answers instead (slower,
    and not for meta-device models). The rule also serves any other fake trace in the process (torch.compile): it
    shapes what the kernels compute, so it makes such traces succeed where torch's check refused."""
    global _GROUPED_MM_RULE
    import torch

    if _GROUPED_MM_RULE or not hasattr(torch.ops.aten, "_grouped_mm"):
        return
    from torch._meta_registrations import _create_grouped_mm_output_tensor, meta_grouped_mm

    def fake(mat_a: Any, mat_b: Any, offs: Any = None, bias: Any = None, out_dtype: Any = None) -> Any:
        if mat_a.dtype == torch.bfloat16 and mat_b.dtype == torch.bfloat16:
            return meta_grouped_mm(mat_a, mat_b, offs=offs, bias=bias, out_dtype=out_dtype)
        torch._check(mat_a.dtype == mat_b.dtype,
                     lambda: f"grouped_mm takes one dtype; got {mat_a.dtype} and {mat_b.dtype}")
        torch._check(mat_a.dim() in (2, 3) and mat_b.dim() in (2, 3),
                     lambda: f"grouped_mm multiplies 2D or 3D tensors; got {mat_a.dim()}D and {mat_b.dim()}D")
        torch._check(bias is None, lambda: "grouped_mm takes no bias")
        return _create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype)

    torch.library.register_fake("aten::_grouped_mm", fake)
    _GROUPED_MM_RULE = True


_GROUPED_MM_RULE = False


def fake_copy_mode(mode: Any) -> Any:
    """A context in which ``copy.deepcopy`` makes fake copies of real tensors in ``mode``
    (``torch._subclasses.fake_tensor.FakeCopyMode``). If it moved, ``estimate`` could not copy the model onto fake
    tensors."""
    from torch._subclasses.fake_tensor import FakeCopyMode

    return FakeCopyMode(mode)


def flop_formulas() -> dict[Any, Callable[..., int]]:
    """torch's FLOP formulas by aten op packet (``torch.utils.flop_counter.flop_registry``, what ``FlopCounterMode``
    counts with; each takes the op's arguments and ``out_val``), with the CPU flash-attention kernels, which it lacks,
    counted as the CUDA ones (``sdpa_flop_count``, ``sdpa_backward_flop_count``). The registry is not in the module's
    ``__all__``; if it went away, the step-time model would count no FLOPs (every op memory-bound) and its tests of a
    known matmul's FLOPs fail. ``FlopCounterMode`` itself is not used: it counts totals per module, not per op."""
    global _FLOP_FORMULAS
    if _FLOP_FORMULAS is None:
        import torch
        from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

        aten = torch.ops.aten

        def cpu_flash(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
            return int(sdpa_flop_count(query.shape, key.shape, value.shape))

        def cpu_flash_backward(grad: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
            return int(sdpa_backward_flop_count(grad.shape, query.shape, key.shape, value.shape))

        formulas = dict(flop_registry)
        for name, formula in (("_scaled_dot_product_flash_attention_for_cpu", cpu_flash),
                              ("_scaled_dot_product_flash_attention_for_cpu_backward", cpu_flash_backward)):
            if hasattr(aten, name):
                formulas[getattr(aten, name)] = formula
        _FLOP_FORMULAS = formulas
    return _FLOP_FORMULAS


_FLOP_FORMULAS: dict[Any, Callable[..., int]] | None = None


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


def attention_flops(query_shape: Any, key_shape: Any, value_shape: Any) -> tuple[int, int]:
    """FLOPs of scaled dot-product attention's forward and backward for these shapes, as torch counts them
    (``torch.utils.flop_counter.sdpa_flop_count`` and ``sdpa_backward_flop_count``, not in the module's ``__all__``).
    If they went away, measuring this machine's attention rate would fail."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    return (int(sdpa_flop_count(query_shape, key_shape, value_shape)),
            int(sdpa_backward_flop_count(query_shape, query_shape, key_shape, value_shape)))


def mem_ref_types() -> Any:
    """The categories ``MemTracker`` sorts memory into (``torch.distributed._tools.mem_tracker._MemRefType``: PARAM,
    BUFFER, GRAD, ACT, TEMP, OPT, OTH). If they were renamed, the estimate's breakdown would fail to build."""
    from torch.distributed._tools.mem_tracker import _MemRefType

    return _MemRefType


def cuda_autocast_ops() -> frozenset[str]:
    """Names of the aten ops that have an ``AutocastCUDA`` kernel (any overload) in this build of torch, read from
    the dispatcher (``torch._C._dispatch_get_all_op_names`` and ``_dispatch_has_kernel_for_dispatch_key``): CPU
    builds register them too. If those were renamed, what-if CUDA estimates would fail."""
    global _CUDA_AUTOCAST_OPS
    if _CUDA_AUTOCAST_OPS is None:
        import torch

        names = (op for op in torch._C._dispatch_get_all_op_names()
                 if torch._C._dispatch_has_kernel_for_dispatch_key(op, "AutocastCUDA"))
        _CUDA_AUTOCAST_OPS = frozenset(op.removeprefix("aten::").split(".")[0] for op in names)
    return _CUDA_AUTOCAST_OPS


_CUDA_AUTOCAST_OPS: frozenset[str] | None = None


class _NoHook:
    """A hook handle for a hook never registered."""

    def remove(self) -> None:
        pass


_NO_HOOK = _NoHook()


def peak_memory_tracker(extra_bytes: Callable[[Any, Any, Any, Any], int],
                        round_bytes: Callable[[int], int] | None = None, timeline_device: str | None = None) -> Any:
    """torch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``) keeping the whole step's peak only, with
    ``extra_bytes(func, args, kwargs, out)`` bytes of kernel work buffers counted as temporaries while each op runs.

    The subclass overrides ``MemTracker._update_peak_stats`` (upstream's loops over every module per op) and reads
    and writes its ``_curr_mem_snap``, ``_peak_mem`` and ``_peak_mem_snap``. If those changed, ``estimate`` would
    fail or give wrong peaks (the estimator tests compare with profiled peaks); if ``_update_peak_stats`` were
    renamed, estimates would only get slower. Frozen parameters are entered in ``_param_to_grad_hook_handles`` (with
    no-op handles) before upstream's ``_track_module_params_and_buffers`` hooks every parameter: if either changed,
    estimating a model with a frozen parameter would fail again (a test estimates one).
    ``torch.cuda.max_memory_allocated`` is no alternative: nothing is
    allocated on fake tensors. ``round_bytes`` rounds every storage (CUDA's rules on a CPU trace): it sets the
    ``mem_consumed`` of upstream's ``_WeakRefInfo`` in ``_update_snap`` before each update counts it, which also
    adds up ``allocated_bytes`` (every storage the step made, at its making: upstream's ``_UpdateType.ADD``).
    ``timeline_device``: the device type whose bytes alive after each op (with its work buffers) are kept, one list per
    phase (``timelines``; :meth:`next_phase` starts the next): the real-tensor path lines up the same moments of two
    micro-batches (``timeline_ops``: the op of each of those moments).
    """
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    from torch.distributed._tools.mem_tracker import _UpdateType

    class StepTracker(MemTracker):
        allocated_bytes = 0
        timelines: list[list[int]]
        timeline_ops: list[list[Any]]

        def _update_snap(self, flag: Any, winfo: Any, *args: Any, **kwargs: Any) -> None:
            if round_bytes is not None:
                winfo.mem_consumed = round_bytes(winfo.size * winfo.element_size)
            if flag == _UpdateType.ADD:
                self.allocated_bytes += winfo.mem_consumed
            super()._update_snap(flag, winfo, *args, **kwargs)

        def _alive_on(self, device_type: str) -> int:
            return sum(snap["Total"] for dev, snap in self._curr_mem_snap.items() if dev.type == device_type)

        def _track_module_params_and_buffers(self, module: Any, install_grad_hooks: bool = True) -> Any:
            # A frozen parameter (a fine-tuned model's backbone) takes no gradient hook: upstream registers one on
            # every parameter, which raises for those; one entry with no-op handles makes it skip them.
            for param in module.parameters():
                if not param.requires_grad and param not in self._param_to_grad_hook_handles:
                    self._param_to_grad_hook_handles[param] = (_NO_HOOK, _NO_HOOK)
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

        def _update_peak_stats(self, peak_state: Any) -> None:
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap["Total"]:
                    self._peak_mem[dev] = snap["Total"]
                    self._peak_mem_snap[dev] = dict(snap)

        def next_phase(self) -> dict[Any, dict[Any, int]]:
            """The peak snapshot of the phase that ends now (per device); the next phase's peak starts from what is
            alive now."""
            ended = {dev: dict(snap) for dev, snap in self._peak_mem_snap.items()}
            self._peak_mem, self._peak_mem_snap = {}, {}
            self._update_peak_stats(None)
            if timeline_device is not None:
                self.timelines.append([self._alive_on(timeline_device)])
                self.timeline_ops.append([None])
            return ended

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = super().__torch_dispatch__(func, types, args, kwargs)
            extra = extra_bytes(func, args, kwargs, out)
            snap = self._curr_mem_snap.get(args[0].device) if extra else None
            if snap is not None:  # alive with the op's inputs and outputs, gone when it returns
                for key in (_MemRefType.TEMP, "Total"):
                    snap[key] += extra
                self._update_peak_stats(None)
                for key in (_MemRefType.TEMP, "Total"):
                    snap[key] -= extra
            if timeline_device is not None:
                on_it = snap is not None and args[0].device.type == timeline_device  # the work buffers' device
                self.timelines[-1].append(self._alive_on(timeline_device) + (extra if on_it else 0))
                self.timeline_ops[-1].append(func)
            return out

    tracker = StepTracker()
    tracker.timelines, tracker.timeline_ops = [[]], [[]]
    return tracker


# ------------------------------------------------------------------------------------------------------- Lightning

#: The ``LightningModule`` method that moves a batch to the device (``_apply_batch_transfer_handler``: runs the
#: ``transfer_batch_to_device`` and ``on_after_batch_transfer`` hooks). ``ElasticBatchSize`` replaces it for the
#: run, so the batch stays on the host and each micro-batch is moved alone. If it were renamed, the patch would
#: change nothing and whole batches would be moved to the device (more memory, same results). Patching the public
#: hooks is not done: they are the user's to override.
BATCH_TRANSFER_HANDLER = "_apply_batch_transfer_handler"


def batch_transfer_handler(module: Any) -> Callable[..., Any]:
    """The module's current batch transfer method (see :data:`BATCH_TRANSFER_HANDLER`); ``AttributeError`` at
    ``ElasticBatchSize`` setup if it is gone."""
    handler: Callable[..., Any] = getattr(module, BATCH_TRANSFER_HANDLER)
    return handler


def logs_written_this_step(trainer: Any) -> bool:
    """Whether the loggers write on this training step (``trainer._logger_connector.should_update_logs``, the gate
    of Lightning's own ``DeviceStatsMonitor`` and ``LearningRateMonitor``: every ``log_every_n_steps`` batches that
    stepped, and when ``should_stop``). If it went away, ``ElasticBatchSize`` and ``MemoryMonitor`` would fail on
    each batch end; recomputing it is not done, as that needs the fit loop's private step counter too."""
    return bool(trainer._logger_connector.should_update_logs)


def current_hook_name(module: Any) -> str | None:
    """The name of the hook the module is running, which ``self.log`` files values under
    (``LightningModule._current_fx_name``; None outside a hook or for other objects). If it went away, buffered
    micro-batch logs would not be told apart by hook."""
    return getattr(module, "_current_fx_name", None)


def set_current_hook_name(module: Any, name: str | None) -> None:
    """Set the hook name ``self.log`` files values under (``LightningModule._current_fx_name``), so logs buffered
    during micro-batches are committed from the hook that made them. If Lightning read another attribute, committed
    values would land under the wrong hook (or raise "You are trying to `self.log()`" outside one)."""
    module._current_fx_name = name


def set_closure_loss(closure: Any, total: Any, *, extra: Any = None) -> None:
    """Make Lightning's automatic-optimization closure report ``total``, the whole batch's loss (the sum of the
    weighted micro-batch losses), and ``extra`` (the other keys ``training_step`` returned, put together from the
    micro-batches; None: the last call's) to the loop: ``Closure._result`` (a ``ClosureResult``) is replaced by a new
    ``lightning.pytorch.loops.optimization.automatic.ClosureResult``; nothing where the closure has no result or
    ``total`` is None. If either changed, the progress bar and ``training_step`` outputs would show one micro-batch's
    loss, or fail."""
    from lightning.pytorch.loops.optimization.automatic import ClosureResult

    result = getattr(closure, "_result", None)
    if result is None or total is None or not hasattr(result, "closure_loss"):
        return
    closure._result = ClosureResult(closure_loss=total.detach(), extra=result.extra if extra is None else extra)


def closure_extra(closure: Any) -> Any:
    """What the closure's last call returned besides the loss (``Closure._result.extra``: the other keys of the dict
    ``training_step`` returned), or None. If it went away, ``on_train_batch_end`` would get the last micro-batch's
    outputs only."""
    result = getattr(closure, "_result", None)
    return getattr(result, "extra", None)


def wrap_zero_grad(closure: Any, wrap: Callable[[Callable[[], None]], Callable[[], None]]) -> None:
    """Replace the zero-grad function of Lightning's automatic-optimization closure (``Closure._zero_grad_fn``, run
    after ``training_step`` on each call: the ``on_before_zero_grad`` hooks, then ``optimizer_zero_grad``) by
    ``wrap(original)``; nothing where it has none (Lightning's accumulation skips it). If the attribute went away,
    this raises rather than let gradients be zeroed between micro-batches."""
    if not hasattr(closure, "_zero_grad_fn"):
        raise RuntimeError("ElasticBatchSize: this Lightning's optimizer closure has no `_zero_grad_fn`; this version "
                           "of lightning-autotune supports Lightning 2.6")
    if closure._zero_grad_fn is not None:
        closure._zero_grad_fn = wrap(closure._zero_grad_fn)


def set_trainer_reference(model: Any, trainer: Any) -> None:
    """Attach ``trainer`` (or None) to a ``LightningModule`` without touching its children
    (``LightningModule._trainer``). Public ``model.trainer = ...`` is not used: it also sets the trainer of nested
    LightningModules. If it went away, estimating a model whose ``configure_optimizers`` reads ``self.trainer`` would
    fail."""
    model._trainer = trainer


def trainer_reference(model: Any) -> Any:
    """The trainer attached to ``model``, or None (``LightningModule._trainer``; public ``model.trainer`` raises when
    none is attached). If it went away, the estimator would deep-copy an attached Trainer with the model."""
    return getattr(model, "_trainer", None)


def optimizers_from_config(config: Any) -> list[Any]:
    """The optimizers in whatever ``configure_optimizers`` returned (``lightning.pytorch.core.optimizer.
    _configure_optimizers``, which accepts every form Lightning does). If it went away, the estimator could not read
    a model's optimizers without a Trainer."""
    from lightning.pytorch.core.optimizer import _configure_optimizers

    return list(_configure_optimizers(config)[0])


def precision_input_dtype(precision: Any) -> Any:
    """The dtype a Lightning precision plugin converts the model to (``Precision._desired_input_dtype`` of
    ``HalfPrecision``; None for others). If it went away, ``bf16-true``/``16-true`` estimates would count fp32
    parameters."""
    return getattr(precision, "_desired_input_dtype", None)


def set_module_device_dtype(module: Any, device: Any, dtype: Any) -> None:
    """Make ``module.device``/``module.dtype`` of a Lightning module answer ``device`` and ``dtype`` (``_device`` and
    ``_dtype`` of ``lightning.fabric.utilities.device_dtype_mixin._DeviceDtypeModuleMixin``, which ``Module.to``
    sets there); other modules are left alone. If they changed, a fake model's ``self.device`` would still name the
    host, and steps that make tensors on ``self.device`` would be traced on the wrong device."""
    from lightning.fabric.utilities.device_dtype_mixin import _DeviceDtypeModuleMixin

    if isinstance(module, _DeviceDtypeModuleMixin):
        module._device = device
        module._dtype = dtype or module._dtype


# ---------------------------------------------------------------------------------------------------- torchmetrics


def metric_state_names(metric: Any) -> tuple[str, ...]:
    """The attributes that hold a torchmetrics ``Metric``'s state: those of ``add_state`` (``Metric._defaults``) and
    the bookkeeping ``_update_count``, ``_computed`` and ``_forward_cache``. If they changed, a replayed step could
    count a failed attempt's updates (missing names are skipped by ``hasattr``). Public ``Metric.metric_state`` is
    not used: it leaves out the bookkeeping, so ``compute()`` could return a cached value."""
    return (*metric._defaults, "_update_count", "_computed", "_forward_cache")


# --------------------------------------------------------------------------------------------------------- torchao
# torchao's ``CPUOffloadOptimizer`` documents its constructor, ``step`` and ``zero_grad`` only; these attributes are
# its internals. If one changed, ``OffloadedOptimizer`` would fail at construction or at its first step.


def offload_host_copies(offload: Any) -> dict[Any, Any]:
    """Device parameter -> its pinned host copy, for the parameters offloaded (``param_d2h_map``)."""
    return offload.param_d2h_map  # type: ignore[no-any-return]


def offload_host_optimizers(offload: Any) -> dict[Any, Any]:
    """Device parameter -> the host optimizer that updates its host copy (``optim_dict``)."""
    return offload.optim_dict  # type: ignore[no-any-return]


def offload_device_optimizer(offload: Any) -> Any:
    """The optimizer of the parameters too small to offload, which runs on the device, or None (``d_opt``)."""
    return offload.d_opt


def offload_grad_queue(offload: Any) -> dict[Any, Any]:
    """Device parameter -> the event of its gradient's copy to the host, for the parameters the next ``step``
    updates (``queue``)."""
    return offload.queue  # type: ignore[no-any-return]


def offload_stream(offload: Any) -> Any:
    """The side stream gradients are copied to the host on (``stream``)."""
    return offload.stream


def offload_device_type(offload: Any) -> str:
    """The device type torchao offloads from: "cuda" or "xpu" (``device``)."""
    return offload.device  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------------------------------------- Optuna


def study_storage(study: Any) -> Any:
    """The storage a ``Study`` reads and writes (``Study._storage``; Optuna has no public accessor). If it went away,
    dead-worker recovery on journal storage would fail."""
    return study._storage


def trial_id(trial: Any) -> int:
    """The storage's id of a ``FrozenTrial`` (``FrozenTrial._trial_id``, what storage methods take; ``number`` is
    per study). Public ``study.tell(number, state=FAIL)`` is not used: it would also run the sampler's
    ``after_trial`` for a trial this worker did not run. If it went away, dead-worker recovery would fail."""
    return int(trial._trial_id)


def enqueued_params(trial: Any) -> dict[str, Any]:
    """The parameters a waiting trial was enqueued with (its ``system_attrs["fixed_params"]``, where
    ``Study.enqueue_trial`` keeps them; a waiting trial's ``params`` are empty until it runs). If Optuna kept them
    elsewhere, a search would no longer see which queued plans its step-time model has ruled out, and would not stop
    early while any is queued."""
    return dict(trial.system_attrs.get("fixed_params") or {})


def journal_file_path(storage: Any) -> str | None:
    """The file of a ``JournalStorage`` on a ``JournalFileBackend`` (``JournalStorage._backend._file_path``), or
    None. If either changed, workers seeding one study through a journal file would not take the shared lock, and
    could enqueue the same seed trials twice."""
    return getattr(getattr(storage, "_backend", None), "_file_path", None)


# ------------------------------------------------------------------------------------------------------ torchao

def torchao_bf16_adamw() -> Any:
    """torchao's full-width AdamW that can round bf16 updates stochastically (``torchao.optim._AdamW``, exported
    under a private name). If it were removed, ``precision="bf16-true"`` runs would keep the user's optimizer."""
    import torchao.optim

    return torchao.optim._AdamW


def set_activation_memory_budget(budget: float) -> Any:
    """Set the compiler's activation-memory budget (``torch._functorch.config.activation_memory_budget``: the share
    of the activations the partitioner may save, recomputing the rest) for graphs compiled from now on; returns
    the previous value. If it were renamed, ``compile_memory_budget`` would fail at setup."""
    import torch._functorch.config as functorch_config

    previous = functorch_config.activation_memory_budget
    functorch_config.activation_memory_budget = budget
    return previous
