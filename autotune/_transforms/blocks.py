"""Applying a plan to a model: find the repeated blocks, checkpoint or compile them, offload saved activations."""

from __future__ import annotations

import contextlib
import functools
import math
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from autotune._compat.torch import is_norm_with_running_stats
from autotune._transforms.recompute import levelled_blocks, selective_contexts


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: the largest set of same-class submodules, none inside another.

    Like FSDP's transformer auto-wrap policy, but found automatically: every class with at least two instances that
    hold parameters is a candidate (instances nested in another instance of the same class are skipped); the class
    with the most instances wins, ties going to the class holding more parameters. Leaf layers (``nn.Linear`` and
    other modules without submodules) are not blocks. Where the model's layers declare their own checkpointing switch
    (a class-level ``gradient_checkpointing`` flag, as transformers' ``GradientCheckpointingLayer`` subclasses do),
    only those classes are candidates: the model's authors' unit of recomputation. Else, where some classes are
    *stacked* (their instances are the items of an ``nn.ModuleList`` or ``nn.Sequential``, as layers are), only
    those are: ``torch.nn.Transformer``'s encoder and decoder layers, not the six attention modules inside them that
    the count alone would pick. The other candidate classes whose instances lie apart from the winner's join it
    (the encoder's layers beside the decoder's, stacked or declaring their own switch).

    Example:
        >>> class Block(nn.Sequential): ...
        >>> net = nn.Sequential(*[Block(nn.Linear(4, 4), nn.ReLU()) for _ in range(3)])
        >>> len(find_blocks(net))
        3
    """
    by_class: dict[type, list[nn.Module]] = {}
    own: dict[type, list[nn.Module]] = {}  # layers that declare their own checkpointing switch
    stacked: set[type] = set()  # classes with an instance that is an item of a ModuleList or Sequential
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            stacked.update(type(child) for child in module.children())
        if module is model or not any(True for _ in module.children()):
            continue
        if not any(True for _ in module.parameters()):
            continue
        by_class.setdefault(type(module), []).append(module)
        if isinstance(getattr(type(module), "gradient_checkpointing", None), bool):
            own.setdefault(type(module), []).append(module)
    authors = any(len(m) > 1 for m in own.values())  # the model's own unit of recomputation decides
    candidates = {}
    for cls, modules in (own if authors else by_class).items():
        if cls in (nn.Sequential, nn.ModuleList, nn.ModuleDict):
            continue  # containers are not blocks; the blocks are inside them
        inner = {id(m) for outer in modules for m in outer.modules() if m is not outer and isinstance(m, cls)}
        top = [m for m in modules if id(m) not in inner]
        if len(top) > 1:
            candidates[cls] = top
    if not authors and any(cls in stacked for cls in candidates):
        candidates = {cls: top for cls, top in candidates.items() if cls in stacked}
    if not candidates:
        return []
    ranked = sorted(candidates, key=lambda c: (len(candidates[c]), sum(p.numel() for m in candidates[c]
                                                                      for p in m.parameters())), reverse=True)
    chosen = list(candidates[ranked[0]])
    # Other candidate classes apart from the chosen blocks (neither inside nor around them) join them: an encoder's
    # layers beside the decoder's (Bart's, Whisper's), stacked or declaring their own switch.
    for cls in ranked[1:]:
        if (authors or cls in stacked) and all(_apart(m, b) for m in candidates[cls] for b in chosen):
            chosen += candidates[cls]
    order = {id(m): i for i, m in enumerate(model.modules())}
    chosen.sort(key=lambda m: order[id(m)])
    return chosen


def _apart(a: nn.Module, b: nn.Module) -> bool:
    """Whether neither module is inside the other."""
    return not any(m is b for m in a.modules()) and not any(m is a for m in b.modules())


def select_blocks(model: nn.Module, spec: float | Sequence[str] | str,
                  recompute: Sequence[str] | None = None) -> list[nn.Module]:
    """The blocks a plan's ``activation_checkpointing`` names: a fraction of :func:`find_blocks` (the first ones),
    every module whose class name is listed, or (``"auto"``) the blocks its ``recompute`` levels checkpoint (see
    :func:`ops_only_blocks` for those that recompute their pointwise operators only).

    Raises:
        ValueError: when class names match no module, naming them and the classes that are there; for ``"auto"``
            not chosen yet (no ``recompute``) or chosen for another number of blocks.
    """
    if spec == "auto":
        return levelled_blocks(find_blocks(model), _levels(recompute))[0]
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        blocks = find_blocks(model)
        return blocks[: math.ceil(spec * len(blocks) - 1e-9)] if spec > 0 else []
    names = set(spec)
    chosen = [m for m in model.modules() if type(m).__name__ in names]
    missing = names - {type(m).__name__ for m in chosen}
    if missing:
        present = sorted({type(m).__name__ for m in model.modules() if any(True for _ in m.children())})
        raise ValueError(
            f"activation_checkpointing names {sorted(missing)} but the model has no such modules; "
            f"classes with submodules: {', '.join(present)}"
        )
    return chosen


def ops_only_blocks(model: nn.Module, spec: float | Sequence[str] | str,
                    recompute: Sequence[str] | None = None) -> list[nn.Module]:
    """Of :func:`select_blocks`, those that recompute their pointwise operators only (``recompute`` level ``"ops"``;
    none but under ``"auto"``)."""
    return levelled_blocks(find_blocks(model), _levels(recompute))[1] if spec == "auto" else []


def _levels(recompute: Sequence[str] | None) -> Sequence[str]:
    if recompute is None:
        raise ValueError("activation_checkpointing='auto' has not been chosen for a micro-batch and budget yet (no "
                         "recompute levels): run `autotune estimate` or a search with activation_checkpointing: auto, "
                         "or call autotune.choose_recompute, and use the plan it gives")
    return recompute


def checkpoint_blocks(blocks: Sequence[nn.Module], *, model: nn.Module,
                      ops_only: Sequence[nn.Module] = ()) -> Callable[[], None]:
    """Recompute ``blocks`` of ``model`` in backward (non-reentrant ``torch.utils.checkpoint``); returns a function
    undoing it. ``ApplyPlan`` and the estimator both checkpoint through here. The blocks also in ``ops_only`` save
    their matrix products and attention and recompute the rest (torch's selective checkpointing with
    :func:`~autotune._transforms.recompute.save_products`).

    The random state is preserved by ``checkpoint``, so dropout inside a block recomputes identically. A block that
    checkpoints itself already (a ``gradient_checkpointing`` flag that is on, as transformers' layers have after
    ``gradient_checkpointing_enable()``) is left to its own, not checkpointed twice. A model that keeps a key/value
    cache in training (``config.use_cache``, transformers' default) has it off while blocks are checkpointed: a
    recompute would append the block's keys to the cache a second time, as transformers' own checkpointing knows.
    The running statistics of a block's BatchNorm and InstanceNorm layers are put back after its recompute, so each
    training forward counts once in them (as without checkpointing).
    """
    undo: list[tuple[nn.Module, bool, Any]] = []
    configs = {id(c): c for m in model.modules() if getattr(c := getattr(m, "config", None), "use_cache", False)
               is True}
    for config in configs.values():
        config.use_cache = False
    selective = {id(b) for b in ops_only}
    for block in blocks:
        if getattr(block, "gradient_checkpointing", False) is True:
            continue  # its own checkpointing is on
        had = "forward" in block.__dict__
        original = block.forward
        # Bound to the block, calling its class's forward on it: a deep copy (an EMA of the model) computes with its
        # own weights, not with this block's.
        bound = isinstance(original, types.MethodType) and original.__self__ is block

        def forward(self: nn.Module, *args: object, __original: Callable[..., object] = (
                original.__func__ if bound else original), __bound: bool = bound,
                __ops: bool = id(block) in selective, **kwargs: object) -> object:
            run = functools.partial(__original, self) if __bound else __original
            if not torch.is_grad_enabled():
                return run(*args, **kwargs)
            norms = [m for m in self.modules() if is_norm_with_running_stats(m)]
            contexts = {"context_fn": functools.partial(_recompute_keeping_stats, norms, __ops)} if norms or __ops \
                else {}
            return checkpoint(run, *args, use_reentrant=False, **contexts, **kwargs)

        block.forward = types.MethodType(functools.wraps(original)(forward), block)  # type: ignore[method-assign]
        undo.append((block, had, original))

    def restore() -> None:
        for config in configs.values():
            config.use_cache = True
        for block, had, original in undo:
            if had:
                block.forward = original  # type: ignore[method-assign]
            else:
                block.__dict__.pop("forward", None)

    return restore


def _recompute_keeping_stats(norms: list[nn.Module], selective: bool = False) -> tuple[Any, Any]:
    """``checkpoint``'s ``context_fn``: nothing around the forward (``selective``: the selective policy's); around
    the recompute, the norm layers' running statistics kept as they were (a recompute is not a second training
    forward), and the selective policy's context."""
    if not selective:
        return contextlib.nullcontext(), _stats_kept(norms)
    forward, recompute = selective_contexts()
    return forward, _both(recompute, _stats_kept(norms))


@contextlib.contextmanager
def _both(first: Any, second: Any) -> Iterator[None]:
    with first, second:
        yield


@contextlib.contextmanager
def _stats_kept(norms: list[nn.Module]) -> Iterator[None]:
    stats = [b for m in norms if m.training for b in m.buffers(recurse=False)]
    saved = [b.detach().clone() for b in stats]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, s in zip(stats, saved):
                b.copy_(s)


def compile_targets(model: nn.Module) -> list[nn.Module]:
    """What ``compile`` compiles: each repeated block (regional compilation), or the whole model where none is
    found."""
    return find_blocks(model) or [model]


def compile_blocks(model: nn.Module) -> list[nn.Module]:
    """Compile each of :func:`compile_targets` in place."""
    blocks = compile_targets(model)
    for block in blocks:
        block.compile()
    return blocks


@contextlib.contextmanager
def offload_activations(*, pin_memory: bool) -> Iterator[None]:
    """Keep the tensors autograd saves for backward on the host (``torch.autograd.graph.save_on_cpu``)."""
    with torch.autograd.graph.save_on_cpu(pin_memory=pin_memory):
        yield
