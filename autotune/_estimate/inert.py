"""Find the plan settings that apply to nothing for a model while its step is traced.

They are: checkpointing that finds no blocks, or whose blocks never run their own forward (a model iterating its layers'
parts by hand); compile whose modules never run through their own call; activation offload on the CPU; optimizer offload
with no parameter large enough to move. The estimate names each in its notes (``Estimate.notes``); the search drops such
choices for its target.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from autotune._plan.plan import Plan
from autotune._transforms.offload import OFFLOAD_MIN_NUMEL, is_offloaded

__all__ = ["Watch"]


class Watch:
    """What a traced copy of a model with ``plan`` applied does with the plan's settings, over the steps traced: which
    checkpointed blocks ran their forward (:meth:`checkpointed`) and which modules compile would compile ran through
    their call (:meth:`compiled`). :meth:`inert` names the settings that applied to nothing."""

    def __init__(self, model: nn.Module, plan: Plan, *, device_type: str) -> None:
        self.model, self.plan, self.device_type = model, plan, device_type
        self._blocks: list[nn.Module] = []
        self._compiled: list[nn.Module] = []
        self._ran: set[int] = set()  # blocks whose (checkpointing) forward ran
        self._called: set[int] = set()  # compiled modules called

    def checkpointed(self, blocks: Sequence[nn.Module]) -> None:
        """Watch ``blocks``, whose forward checkpointing replaced: a call of that forward (through the module or
        directly) is what recomputes them."""
        self._blocks = list(blocks)
        for block in blocks:
            inner = block.forward

            def forward(*args: Any, __inner: Callable[..., Any] = inner, __id: int = id(block), **kwargs: Any) -> Any:
                self._ran.add(__id)
                return __inner(*args, **kwargs)

            block.forward = forward  # type: ignore[method-assign]

    def compiled(self, modules: Sequence[nn.Module]) -> None:
        """Watch the modules compile would compile (:func:`autotune._transforms.blocks.compile_targets`): a compiled
        module runs compiled only when it is called (``module(x)``), which a forward pre-hook sees."""
        self._compiled = list(modules)
        for module in modules:
            module.register_forward_pre_hook(lambda m, args: self._called.add(id(m)))

    def inert(self) -> dict[str, str]:
        """The plan's settings that applied to nothing in the steps traced so far, each with why (by field name)."""
        plan, name, found = self.plan, type(self.model).__name__, {}
        if plan.activation_checkpointing:
            if not self._blocks:
                found["activation_checkpointing"] = (f"it finds no repeated blocks in {name} (name the classes to "
                                                     "checkpoint: activation_checkpointing: [ClassName, ...])")
            elif not self._ran & {id(b) for b in self._blocks}:
                found["activation_checkpointing"] = (
                    f"the {_count(self._blocks)} it wraps never run their own forward in the step (their parts are "
                    "called by hand), so nothing is recomputed")
        if plan.compile and self._compiled and not self._called & {id(m) for m in self._compiled}:
            found["compile"] = (
                f"{name} has no repeated blocks, so compile takes the whole model, whose own call never runs in the "
                "step (training_step calls its parts)" if self._compiled == [self.model] else
                f"the {_count(self._compiled)} it compiles never run through their own call in the step")
        if plan.activation_offload and self.device_type == "cpu":
            found["activation_offload"] = "on the CPU the saved tensors are on the host already"
        if plan.optimizer_offload and not any(is_offloaded(p) for p in self.model.parameters()):
            found["optimizer_offload"] = (f"no trainable parameter has {OFFLOAD_MIN_NUMEL} elements or more, so every "
                                          "update stays on the device")
        return found

    def notes(self) -> tuple[str, ...]:
        """One note per inert setting: ``compile=True applies to nothing: ...``."""
        return tuple(f"{field}={getattr(self.plan, field)!r} applies to nothing: {why}"
                     for field, why in self.inert().items())


def _count(modules: Sequence[nn.Module]) -> str:
    """``4 Layer block(s)`` (an encoder's and a decoder's layers: ``4 DecoderLayer/EncoderLayer block(s)``)."""
    names = sorted({type(m).__name__ for m in modules})
    return f"{len(modules)} {'/'.join(names)} block(s)"
