"""What a replay restores: random state, metric states, the update snapshot, and freeing memory after an OOM."""

from __future__ import annotations

import contextlib
import gc
import logging
import random
from collections.abc import Collection, Iterable
from typing import Any

import torch
from torch import Tensor

from autotune._compat.torch import (
    copy_tensors,
    is_norm_with_running_stats,
    module_tensor_slots,
    tensor_version,
    tensor_versions,
)
from autotune._compat.torchmetrics import metric_state_names

log = logging.getLogger("autotune")

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
    """The state of the torchmetrics ``Metric`` modules of a model and of its buffers, so a replay does not count a
    failed attempt's updates. Metrics are found among the model's submodules (attributes, ``MetricCollection``)."""

    def __init__(self, found: tuple[list[torch.nn.Module], BufferStates], *, training: bool = True) -> None:
        metrics, self.buffers = found
        self.saved = [(m, {name: _copy_state(getattr(m, name)) for name in metric_state_names(m)
                           if hasattr(m, name)}) for m in metrics]
        self.buffers.capture(training=training)

    @staticmethod
    def find(module: torch.nn.Module) -> tuple[list[torch.nn.Module], BufferStates]:
        """The torchmetrics metrics among ``module``'s submodules (none when torchmetrics is not installed), and its
        buffers."""
        try:
            from torchmetrics import Metric
        except ImportError:  # pragma: no cover - Lightning installs torchmetrics
            return [], BufferStates(module)
        return [m for m in module.modules() if isinstance(m, Metric)], BufferStates(module)

    def restore(self) -> None:
        for metric, state in self.saved:
            for name, value in state.items():
                setattr(metric, name, _copy_state(value))  # a copy: a second replay restores from here again
        self.buffers.restore()


class BufferStates:
    """Put the module's buffers back as a step found them after a failed attempt, so a replay sees each sample once.

    The buffers are norm layers' running statistics, a running normaliser's mean, a step counter, and what DDP broadcast
    into them. A buffer is copied (on its device, one ``foreach`` copy into tensors made once) only while it is known to
    change. Every buffer is copied until a training step has run. The copies are then compared with what the step left:
    its version counter, and its values (BatchNorm's kernels update the running statistics without bumping the counter).
    From then on only the buffers a step changed or replaced are copied, with those of norm layers in training mode.
    Buffers that never change (``position_ids``, rotary frequencies, masks) cost nothing after the first step. A buffer
    that changes for the first time in a later step that fails cannot be put back: a warning says so once, and it is
    copied from then on.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.learned = False  # whether a training step showed which buffers change
        self.changing: set[int] = set()  # ids of buffers seen changing
        self.slots: list[tuple[torch.nn.Module, str, Tensor, int]] = []  # (owner, name, tensor, version) at capture
        self.copied: list[Tensor] = []
        self.copies: list[Tensor] = []
        self.warned = False
        self.names: list[tuple[torch.nn.Module, str]] | None = None
        self._whole_training = False  # the last capture copied every buffer before a training step

    @torch.no_grad()
    def capture(self, *, training: bool = True) -> None:
        """Copy the buffers that may change; ``training``: a training step follows (evaluation changes no norm)."""
        from torch.nn.parameter import is_lazy

        self._note_changes()
        if self.names is None:  # the buffers' places, looked up once (again while lazy layers have not run)
            places = [(owner, name, buf) for owner in self.module.modules()
                      for name, buf in module_tensor_slots(owner)[1].items() if buf is not None]
            lazy = any(is_lazy(buf) for _, _, buf in places)
            self.names = None if lazy else [(owner, name) for owner, name, _ in places]
        else:
            places = [(owner, name, module_tensor_slots(owner)[1].get(name)) for owner, name in self.names]
        slots = [(owner, name, buf, tensor_version(buf)) for owner, name, buf in places
                 if buf is not None and not is_lazy(buf)]
        copied = [buf for owner, _, buf, _ in slots if not self.learned or id(buf) in self.changing
                  or (training and owner.training and is_norm_with_running_stats(owner))]
        if [id(b) for b in copied] != [id(b) for b in self.copied] or any(
                c.shape != b.shape or c.dtype != b.dtype for c, b in zip(self.copies, copied)):
            self.copies = [torch.empty_like(b) for b in copied]
        self.copied = copied
        if copied:
            copy_tensors(self.copies, copied)
        self.slots = slots
        self._whole_training = training and not self.learned

    def _note_changes(self) -> None:
        """Buffers the last step changed in place or replaced: copied from now on. After a training step that
        started with every buffer copied, the values are compared too (kernels that write without a version bump)."""
        copies = {id(b): c for b, c in zip(self.copied, self.copies)}
        for owner, name, buf, version in self.slots:
            now = module_tensor_slots(owner)[1].get(name)
            copy = copies.get(id(buf))
            if now is not buf or tensor_version(buf) != version or (
                    self._whole_training and copy is not None and not torch.equal(copy, buf)):
                self.changing.add(id(buf))
                if now is not None:
                    self.changing.add(id(now))
        if self._whole_training:
            self.learned = True
            self._whole_training = False

    @torch.no_grad()
    def restore(self) -> None:
        copies = {id(b) for b in self.copied}
        lost = []
        for owner, name, buf, version in self.slots:
            buffers = module_tensor_slots(owner)[1]
            if buffers.get(name) is not buf:
                buffers[name] = buf  # replaced by the failed attempt: the step's own tensor goes back
                self.changing.add(id(buf))
            if tensor_version(buf) != version:
                self.changing.add(id(buf))
                if id(buf) not in copies:
                    lost.append(name)
        if self.copied:
            copy_tensors(self.copied, self.copies)
        self.slots = [(owner, name, buf, tensor_version(buf)) for owner, name, buf, _ in self.slots]
        if lost and not self.warned:
            self.warned = True
            log.warning("ElasticBatchSize: the failed attempt changed buffers that no earlier step had changed (%s); "
                        "they keep its changes in the replay. They are copied before every step from now on.",
                        ", ".join(sorted(set(lost))))


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
        self._optimizer = None  # restorable only once the copy is whole
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
        """Put parameters, optimizer state and hyper-parameters back as they were at :meth:`capture` (nothing when
        the capture itself failed: the update had not run)."""
        optimizer = self._optimizer
        if optimizer is None:
            return
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
