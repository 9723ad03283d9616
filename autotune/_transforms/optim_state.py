"""Low-bit optimizer state (``Plan(optimizer_state="8bit" | "4bit")``) and trainable bf16 weights, by torchao.

torchao's ``Adam8bit``/``AdamW8bit`` and ``Adam4bit``/``AdamW4bit`` keep Adam's two moments block-quantised: 8-bit
codes with one fp32 scale per 256 values, or 4-bit codes (two per byte) with one per 128, plus a 256- or 16-entry
fp32 code map per state tensor. Tensors under 4096 values, or whose size is not a multiple of the block, keep
full-width moments (as bitsandbytes does). The update runs parameter by parameter in one compiled kernel.

Under bf16-true weights (``precision="bf16-true"``) an update smaller than a weight's bf16 resolution is lost when
rounded to nearest: torchao's AdamW (and its low-bit ones) round stochastically instead
(``bf16_stochastic_round=True``), which keeps the expected update. The accuracy caveat stays: each weight keeps 8
bits of mantissa, so training is noisier than with fp32 master weights (bf16-mixed).

The user's optimizer is kept for its hyper-parameters: :class:`LowBitOptimizer` shares its ``param_groups`` (LR
schedulers and clipping change them there) and copies them into torchao's before each update.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from autotune._compat.torch import mark_optimizer_stepped
from autotune._compat.torchao import torchao_bf16_adamw
from autotune._transforms.offload import INSTALL_HINT, set_hyperparameters

__all__ = ["OPTIMIZER_STATES", "LowBitOptimizer", "low_bit_optimizers", "real_state_bytes", "replacement", "replaces",
           "state_tensor_bytes"]

#: ``Plan.optimizer_state`` values: the user's optimizer as written, or Adam's moments in 8 or 4 bits.
OPTIMIZER_STATES = ("full", "8bit", "4bit")
_BLOCK = {"8bit": 256, "4bit": 128}
_CODE_MAP_ENTRIES = {"8bit": 256, "4bit": 16}
_MIN_NUMEL = 4096  # torchao (as bitsandbytes) quantises tensors of at least this many values only
_CLASSES = {("8bit", False): "Adam8bit", ("8bit", True): "AdamW8bit", ("4bit", False): "Adam4bit",
            ("4bit", True): "AdamW4bit"}


def state_tensor_bytes(numel: int, element_size: int, state: str) -> int:
    """Bytes of one of Adam's moments for a (local) parameter of ``numel`` values under ``state``."""
    block = _BLOCK.get(state)
    if block is None or numel < _MIN_NUMEL or numel % block:
        return numel * element_size
    codes = numel if state == "8bit" else numel // 2
    return codes + numel // block * 4 + _CODE_MAP_ENTRIES[state] * 4


def replaces(optimizer: Optimizer, *, state: str, bf16_weights: bool) -> bool:
    """Whether torchao runs ``optimizer``'s update under ``state`` (and bf16 weights); nothing is imported.

    Raises:
        ValueError: for a low-bit ``state`` and an optimizer torchao has no low-bit version of, or an Adam setting
            it does not support (``maximize``); naming the optimizer and what is accepted.
    """
    if state not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer_state must be one of {', '.join(OPTIMIZER_STATES)}; got {state!r}")
    name = type(optimizer).__name__
    adam = type(optimizer) in (torch.optim.Adam, torch.optim.AdamW)
    if state == "full":  # bf16 weights with another optimizer: kept, updates below bf16's resolution are lost
        no_decay = all(not g.get("weight_decay") for g in optimizer.param_groups)
        return bf16_weights and adam and (_decoupled(optimizer) or no_decay) and not optimizer.defaults.get("maximize")
    if not adam:
        raise ValueError(f"optimizer_state {state!r} replaces Adam and AdamW with torchao's {state} versions; "
                         f"{name} has no {state} version there: use optimizer_state 'full'")
    if optimizer.defaults.get("maximize"):
        raise ValueError(f"optimizer_state {state!r}: torchao's {state} {name} cannot maximize; use "
                         "optimizer_state 'full'")
    return True


def _decoupled(optimizer: Optimizer) -> bool:
    return type(optimizer) is torch.optim.AdamW or bool(optimizer.defaults.get("decoupled_weight_decay"))


def replacement(optimizer: Optimizer, *, state: str, bf16_weights: bool) -> tuple[Callable[..., Optimizer], str] | None:
    """The torchao optimizer that replaces ``optimizer`` (a constructor taking its groups, and a description), or
    None to keep it.

    Raises:
        ValueError: as :func:`replaces`.
        ImportError: when torchao is not installed and a replacement is needed.
    """
    if not replaces(optimizer, state=state, bf16_weights=bf16_weights):
        return None
    torchao_optim = _import_torchao()
    if state == "full":
        return _stochastic_rounding, "AdamW (torchao, bf16 stochastic rounding)"
    cls = getattr(torchao_optim, _CLASSES[(state, _decoupled(optimizer))])
    if not bf16_weights:
        return cls, cls.__name__
    rounding = f"{cls.__name__} (bf16 stochastic rounding)"
    return (lambda groups, **kw: cls(groups, bf16_stochastic_round=True, **kw)), rounding


def _stochastic_rounding(groups: list[dict[str, Any]], **defaults: Any) -> Optimizer:
    return torchao_bf16_adamw()(groups, bf16_stochastic_round=True, **defaults)


def _import_torchao() -> Any:
    try:
        import torchao.optim
    except ImportError as error:
        raise ImportError(f"low-bit optimizer state and bf16-true updates need torchao: {INSTALL_HINT}") from error
    return torchao.optim


_HYPER = ("lr", "betas", "eps", "weight_decay", "amsgrad")


class LowBitOptimizer(Optimizer):
    """``optimizer``'s update run by a torchao optimizer (low-bit state, or bf16 stochastic rounding).

    The given optimizer keeps the hyper-parameters: this one shares its ``param_groups`` (what LR schedulers and
    clipping change) and copies ``lr``, ``betas``, ``eps`` and ``weight_decay`` into torchao's groups before each
    update; the given optimizer's own state stays empty. ``state`` is torchao's.

    Args:
        optimizer: an Adam or AdamW (see :func:`replacement`).
        state: ``"full"``, ``"8bit"`` or ``"4bit"``.
        bf16_weights: the weights are bf16 (``precision="bf16-true"``): round updates stochastically.

    Raises:
        ValueError, ImportError: as :func:`replacement`, and ValueError when it keeps the optimizer.
    """

    def __init__(self, optimizer: Optimizer, *, state: str, bf16_weights: bool) -> None:  # no Optimizer.__init__
        found = replacement(optimizer, state=state, bf16_weights=bf16_weights)
        if found is None:
            raise ValueError(f"optimizer_state {state!r} keeps {type(optimizer).__name__} as it is")
        self._make, self.description = found
        self.user_optimizer = optimizer
        groups = [{**{k: v for k, v in g.items() if k in _HYPER}, "params": list(g["params"])}
                  for g in optimizer.param_groups]
        self.inner = self._make(groups)
        self.defaults = optimizer.defaults
        self.param_groups = optimizer.param_groups  # the same list: what schedulers and clipping change

    @property
    def optimizer(self) -> Optimizer:
        """The user's optimizer, which holds the hyper-parameters (as wrapping optimizers expose it)."""
        return self.user_optimizer

    def update_constructor(self) -> tuple[Callable[..., Optimizer], dict[str, Any]]:
        """torchao's update over other groups (what ``optimizer_offload`` runs on the host copies under bf16-true:
        the stochastic rounding is kept)."""
        return self._make, {}

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.inner.state

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for mine, theirs in zip(self.param_groups, self.inner.param_groups):
            set_hyperparameters(theirs, {key: mine[key] for key in _HYPER if key in mine and key in theirs})
        self.inner.step()
        mark_optimizer_stepped(self.user_optimizer)  # what LR schedulers check
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.user_optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError("LowBitOptimizer cannot add parameter groups: add them before fit starts")

    def __repr__(self) -> str:
        return f"LowBitOptimizer({type(self.user_optimizer).__name__} -> {self.description})"


def low_bit_optimizers(optimizers: Iterable[Optimizer], *, state: str, bf16_weights: bool) -> list[Optimizer]:
    """Each optimizer that ``state`` (or bf16 weights) replaces, wrapped in :class:`LowBitOptimizer`; the rest kept."""
    out = []
    for opt in optimizers:
        if isinstance(opt, LowBitOptimizer) or not replaces(opt, state=state, bf16_weights=bf16_weights):
            out.append(opt)
        else:
            out.append(LowBitOptimizer(opt, state=state, bf16_weights=bf16_weights))
    return out


def real_state_bytes(optimizer: Optimizer, *, block: int = 1) -> int:
    """Bytes of an optimizer's state as stored: a torchao low-bit tensor counts its codes, scales and code map; each
    stored tensor rounded up to ``block`` bytes (512: what the CUDA caching allocator holds for it)."""
    total = 0
    for per_param in optimizer.state.values():
        for value in per_param.values():
            if isinstance(value, Tensor):
                total += _stored_bytes(value, block)
    return total


def _stored_bytes(t: Tensor, block: int) -> int:
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is not None and type(t) is not Tensor:
        names, _ = flatten()
        return sum(_stored_bytes(getattr(t, n), block) for n in names)
    local = t.to_local() if hasattr(t, "to_local") else t
    return -(-math.prod(local.shape) * local.element_size() // block) * block
