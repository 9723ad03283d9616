"""What a replay restores: random state, metric states, the update snapshot, and freeing memory after an OOM."""

from __future__ import annotations

import contextlib
import gc
import random
from collections.abc import Collection, Iterable
from typing import Any

import torch
from torch import Tensor

from autotune._compat import copy_tensors, is_norm_with_running_stats, metric_state_names, tensor_versions

try:  # NumPy's global generator (augmentations, mixup); torch wheels ship with NumPy
    import numpy.random as _np_random
except ImportError:  # pragma: no cover
    _np_random = None


class RNGState:
    """The random state that dropout, augmentations and friends draw from (torch, CUDA, Python, NumPy), so a
    replay draws the same numbers."""

    def __init__(self) -> None:
        self.torch = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self.python = random.getstate()
        self.numpy = _np_random.get_state() if _np_random is not None else None

    def restore(self) -> None:
        torch.set_rng_state(self.torch)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        random.setstate(self.python)
        if self.numpy is not None and _np_random is not None:
            _np_random.set_state(self.numpy)


class MetricStates:
    """The state of the torchmetrics ``Metric`` modules of a model and the running statistics of its norm layers, so a
    replay does not count a failed attempt's updates. Metrics are found among the model's submodules (attributes,
    ``MetricCollection``)."""

    def __init__(self, found: tuple[list[torch.nn.Module], RunningStats]) -> None:
        metrics, self.running = found
        self.saved = [(m, {name: _copy_state(getattr(m, name)) for name in metric_state_names(m)
                           if hasattr(m, name)}) for m in metrics]
        self.running.capture()

    @staticmethod
    def find(module: torch.nn.Module) -> tuple[list[torch.nn.Module], RunningStats]:
        """The torchmetrics metrics among ``module``'s submodules (none when torchmetrics is not installed), and its
        norm layers' running statistics."""
        try:
            from torchmetrics import Metric
        except ImportError:  # pragma: no cover - Lightning installs torchmetrics
            return [], RunningStats(module)
        return [m for m in module.modules() if isinstance(m, Metric)], RunningStats(module)

    def restore(self) -> None:
        for metric, state in self.saved:
            for name, value in state.items():
                setattr(metric, name, _copy_state(value))  # a copy: a second replay restores from here again
        self.running.restore()


class RunningStats:
    """The running statistics a training forward updates in place: ``running_mean``, ``running_var`` and
    ``num_batches_tracked`` of BatchNorm and InstanceNorm layers (``track_running_stats``), copied on their device
    at each step's start (one ``foreach`` copy into buffers made once) and put back after a failed attempt, so a
    replay counts each sample once in them too. Nothing is copied for a model without such layers or in eval mode."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.layers = [m for m in module.modules() if is_norm_with_running_stats(m)]
        self.stats: list[Tensor] = []
        self.copies: list[Tensor] = []
        self.captured = False
        self.pending = True

    @torch.no_grad()
    def capture(self) -> None:
        from torch.nn.parameter import is_lazy

        self.captured = any(m.training for m in self.layers)
        if not self.captured:
            return
        if self.pending:  # the first step, and until lazy layers have run
            buffers = [b for m in self.layers for b in m.buffers(recurse=False)]
            self.stats = [b for b in buffers if not is_lazy(b)]
            self.copies = [torch.empty_like(b) for b in self.stats]
            self.pending = len(self.stats) < len(buffers)
        copy_tensors(self.copies, self.stats)

    @torch.no_grad()
    def restore(self) -> None:
        if self.captured and self.stats:
            copy_tensors(self.stats, self.copies)


class UpdateSnapshot:
    """A host copy of parameters and optimizer state, taken before an update so a failed update can be undone.

    Taken only before updates that create optimizer state (see ``ElasticEngine``); its host buffers are kept while
    that update may be replayed and freed by :meth:`release` once it succeeded, so steady-state training holds none.
    On CUDA the copies go to pinned memory on a side stream, and :meth:`wait` makes the update wait for them.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[int, str], Tensor] = {}
        self._params: list[tuple[Tensor, Tensor]] = []
        self._state: dict[Tensor, dict[str, Any]] = {}
        self._layouts: dict[tuple[int, str], Any] = {}  # a DTensor state's mesh, placements, shape and stride
        self._groups: list[dict[str, Any]] = []
        self._optimizer: torch.optim.Optimizer | None = None
        self._stream: Any = None

    def _host_copy(self, tensor: Tensor, key: tuple[int, str]) -> Tensor:
        tensor = _local(tensor)  # a DTensor (FSDP2): this rank's shard
        buf = self._buffers.get(key)
        if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
            pin = tensor.is_cuda
            buf = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
            self._buffers[key] = buf
        buf.copy_(tensor.detach(), non_blocking=tensor.is_cuda)
        return buf

    def capture(self, optimizer: torch.optim.Optimizer) -> None:
        """Copy every parameter of ``optimizer`` and its state to the host."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        on_cuda = any(p.is_cuda for p in params)
        if on_cuda:
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            self._stream.wait_stream(torch.cuda.current_stream())
            ctx: Any = torch.cuda.stream(self._stream)
        else:
            ctx = contextlib.nullcontext()
        with ctx:
            self._params = [(p, self._host_copy(p, (id(p), "param"))) for p in params]
            self._state, self._layouts = {}, {}
            for p, state in optimizer.state.items():
                saved: dict[str, Any] = {}
                for k, v in state.items():
                    saved[k] = self._host_copy(v, (id(p), k)) if isinstance(v, Tensor) else _copy_value(v)
                    if _is_dtensor(v):
                        self._layouts[(id(p), k)] = (v.device_mesh, v.placements, v.shape, v.stride())
                self._state[p] = saved
        self._groups = [{k: _copy_value(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        self._optimizer = optimizer

    @property
    def held_bytes(self) -> int:
        """Host bytes the snapshot holds now (0 after :meth:`release`)."""
        return sum(buf.numel() * buf.element_size() for buf in self._buffers.values())

    def release(self) -> None:
        """Free the host buffers (the next :meth:`capture` allocates them again)."""
        self.wait()
        self._buffers, self._params, self._state, self._groups, self._layouts = {}, [], {}, [], {}
        self._optimizer = None

    def wait(self) -> None:
        """Make the current CUDA stream wait until the capture is complete (no-op on CPU)."""
        if self._stream is not None:
            torch.cuda.current_stream().wait_stream(self._stream)

    def restore(self) -> None:
        """Put parameters, optimizer state and hyper-parameters back as they were at :meth:`capture`."""
        optimizer = self._optimizer
        if optimizer is None:
            raise RuntimeError("UpdateSnapshot.restore() called before capture()")
        self.wait()
        with torch.no_grad():
            for p, saved in self._params:
                _local(p).copy_(saved)
            for p in list(optimizer.state):
                if p not in self._state:
                    del optimizer.state[p]  # state created lazily by the failed update
            for p, saved_state in self._state.items():
                state = optimizer.state[p]
                for k in list(state):
                    if k not in saved_state:
                        del state[k]
                for k, v in saved_state.items():
                    current = state.get(k)
                    if isinstance(v, Tensor):
                        local = _local(current) if isinstance(current, Tensor) else None
                        if local is not None and local.shape == v.shape and local.dtype == v.dtype:
                            local.copy_(v)
                        else:
                            state[k] = _like(self._layouts.get((id(p), k)), v, p if current is None else current)
                    else:
                        state[k] = _copy_value(v)
        for group, saved_group in zip(optimizer.param_groups, self._groups):
            group.update({k: _copy_value(v) for k, v in saved_group.items()})


def _is_dtensor(tensor: Any) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _local(tensor: Tensor) -> Tensor:
    """This rank's part of a DTensor (FSDP2's sharded parameters and optimizer state); any other tensor itself."""
    return tensor.to_local() if _is_dtensor(tensor) else tensor


def _like(layout: Any, saved: Tensor, where: Tensor) -> Tensor:
    """A device copy of ``saved`` on ``where``'s device, rebuilt as a DTensor when ``layout`` says it was one."""
    local = saved.to(_local(where).device, copy=True)
    if layout is None:
        return local
    from torch.distributed.tensor import DTensor

    mesh, placements, shape, stride = layout
    return DTensor.from_local(local, mesh, placements, shape=shape, stride=stride)


def update_parameters(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """The parameters the next update will change: those with a gradient, less those whose update runs on the host
    (an offloaded optimizer's ``offloaded_parameters``: the device cannot run out of memory in their update)."""
    host = {id(p) for p in getattr(optimizer, "offloaded_parameters", ())}
    return [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None and id(p) not in host]


def creates_state(optimizer: torch.optim.Optimizer, *, stateless: Collection[int] = ()) -> bool:
    """Whether the next update creates optimizer state: some parameter it changes has none yet (the first update,
    parameters added or unfrozen later), the ids in ``stateless`` aside (parameters a completed update left without
    state: SGD without momentum keeps none). Such updates allocate the most, so they are the ones that run out of
    memory in practice."""
    state = optimizer.state
    return any(not state.get(p) and id(p) not in stateless for p in update_parameters(optimizer))


def update_fingerprint(optimizer: torch.optim.Optimizer) -> list[Any] | None:
    """What an update may change, cheaply: the version counter of every parameter and state tensor (bumped by every
    in-place change), the other state values, and the state's keys. Equal before and after a failed update means the
    update changed nothing and can simply run again. The cost is a few Python objects per parameter, whatever the
    model's size.

    None for an optimizer whose update the counters may not see: one that is neither torch's nor torchao's (nor a
    subclass of one), as those that write ``p.data`` (Lion's reference code, transformers' Adafactor) or pass raw
    pointers to their kernels (bitsandbytes, apex) do.
    """
    if not _counts_its_changes(optimizer):
        return None

    def marks() -> Any:
        for group in optimizer.param_groups:
            yield from group["params"]
        for p, state in optimizer.state.items():
            yield id(p)
            yield from state.keys()
            yield from state.values()

    return tensor_versions(marks())


#: Modules whose optimizers change tensors only in ways that bump their version counters (torchao's compiled update
#: writes back with ``copy_``), and autotune's own (the offloaded optimizer).
_COUNTED = ("torch.optim.", "torchao.optim.", "autotune.")


def _counts_its_changes(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a class in the optimizer's MRO that defines its own ``step`` is torch's, torchao's or autotune's: a
    subclass of ``AdamW`` that wraps ``step`` and calls ``super().step`` counts; an optimizer written on
    ``torch.optim.Optimizer`` does not."""
    base_step = torch.optim.Optimizer.step
    for cls in type(optimizer).__mro__:
        step = vars(cls).get("step")
        if step is not None and step is not base_step and cls.__module__.startswith(_COUNTED):
            return True
    return False


def _copy_state(value: Any) -> Any:
    """A metric state's copy: tensors cloned; list states (appended to, their items never changed) copied shallowly,
    so the cost per step stays that of a pointer per item."""
    return list(value) if isinstance(value, list) else _copy_value(value)


def _copy_value(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_copy_value(v) for v in value)
    if isinstance(value, dict):
        return {k: _copy_value(v) for k, v in value.items()}
    return value


def release_memory(grads_of: Iterable[Tensor], device: torch.device, *, static_bytes: int | None = None) -> None:
    """Drop gradients and cached blocks after an OOM so the replay starts from the step's static memory.

    The failed attempt's frames are young objects: a collection of the young generations frees them. A full
    collection (a tenth of a second or more with torch and Lightning loaded) runs only on CUDA, and only when
    memory is still above ``static_bytes``, the step's memory before its first attempt.
    """
    for p in grads_of:
        p.grad = None
    gc.collect(1)
    if device.type == "cuda":
        if static_bytes is None or torch.cuda.memory_allocated(device) > static_bytes:
            gc.collect()
        torch.cuda.empty_cache()
