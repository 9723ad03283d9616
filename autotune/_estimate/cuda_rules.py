"""Apply CUDA's memory rules to an estimate of a CUDA device, made with or without one (a *what-if* estimate).

A what-if estimate (``device="cuda"`` on a machine without CUDA) traces the step on fake CPU tensors and applies what
a CUDA run does differently:

- **Allocator rounding**: the caching allocator rounds every allocation up to a 512-byte block; the tracker rounds
  each storage (:func:`round_cuda`), as it does for CUDA tensors. The estimate is of what
  ``torch.cuda.max_memory_allocated`` reports. The allocator's *reserve* is larger by the free space of its segments
  (2 MiB segments for requests up to 1 MiB, 20 MiB or the request rounded to 2 MiB above). That fragmentation
  depends on the order of allocations and is not estimated; ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``
  (the plan's ``allocator``) removes most of it.
- **Autocast's CUDA op lists** (:class:`CudaAutocast`): which dtype each op runs in decides what the forward saves for
  backward. Under ``*-mixed``, CUDA runs matrix products, convolutions and attention in the low dtype. It runs norms,
  softmax, losses and pointwise ``exp``/``pow``/``rsqrt``... in fp32. CPU autocast's lists differ (it keeps
  ``layer_norm`` and ``softmax`` in bf16), so they are replaced by CUDA's, read from the dispatcher's ``AutocastCUDA``
  registrations.
- **Kernel workspace**: cuBLAS's workspaces (:func:`cublas_workspace_bytes`) are in the overhead; the CPU's oneDNN
  work buffers are not measured. Other CUDA kernels' scratch (cuDNN convolution workspaces) is not counted.
- **The CUDA context** (:data:`CUDA_CONTEXT_BYTES`) is device memory outside the caching allocator, so outside the
  peak: ``Estimate.context_bytes`` reports it beside the peak, and a device's capacity is its memory less the context.
- **Optimizers** pick ``foreach`` as on real CUDA tensors (one temporary per state tensor in the update).
- **Activation offload** moves saved tensors to the host: in a what-if trace they go to the meta device, which the
  estimate counts as host memory.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from autotune._compat.torch import cuda_autocast_ops
from autotune._device.budget import CUDA_CONTEXT_BYTES  # defined with the budget, which takes it off a device's memory

__all__ = ["CUDA_CONTEXT_BYTES", "CudaAutocast", "cublas_workspace_bytes", "round_cuda"]

CUDA_BLOCK = 512
#: cuBLAS's workspace per handle and stream (torch's CublasHandlePool defaults); a training step uses two handles.
_CUBLAS_WORKSPACE_SM90 = 32 * 2**20
_CUBLAS_WORKSPACE_DEFAULT = 2 * 4096 * 2**10 + 8 * 16 * 2**10
_CUBLAS_HANDLES_PER_STEP = 2

# Autocast's CUDA policies by op name (the rest of the ops registered for AutocastCUDA run in fp32).
_LOW = frozenset("""_convolution conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d conv_transpose3d
    convolution prelu addmm addmv addr matmul einsum mm mv linalg_vecdot linear addbmm baddbmm bmm chain_matmul
    linalg_multi_dot _thnn_fused_lstm_cell _thnn_fused_gru_cell lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell
    _scaled_dot_product_flash_attention scaled_dot_product_attention cudnn_convolution
    cudnn_convolution_transpose""".split())
_PROMOTE = frozenset("addcdiv addcmul atan2 bilinear cross dot grid_sampler index_put scatter_add tensordot vdot "
                     "stack cat index_copy".split())
_OUT_DTYPE = frozenset("prod softmax log_softmax cumprod cumsum sum".split())  # fp32 output, inputs not copied


def round_cuda(nbytes: int) -> int:
    """``nbytes`` rounded up to the caching allocator's 512-byte block."""
    return math.ceil(nbytes / CUDA_BLOCK) * CUDA_BLOCK


def cublas_workspace_bytes(capability: tuple[int, int] | None) -> int:
    """The cuBLAS workspaces a CUDA step holds in the caching allocator (counted by ``max_memory_allocated``).

    Two handles (the forward's thread, autograd's device thread) each get ``CUBLAS_WORKSPACE_CONFIG`` (``:4096:8``
    is 8 x 4096 KiB), else torch's default: 32 MiB on compute capability 9.x, 8.125 MiB before. ``capability`` None
    (a what-if estimate, no GPU to ask) takes 9.x's, the larger.
    """
    pairs = re.findall(r":(\d+):(\d+)", os.environ.get("CUBLAS_WORKSPACE_CONFIG", ""))
    if pairs:
        workspace = sum(int(size) * int(count) for size, count in pairs) * 2**10
    else:
        hopper = capability is None or capability[0] == 9
        workspace = _CUBLAS_WORKSPACE_SM90 if hopper else _CUBLAS_WORKSPACE_DEFAULT
    return _CUBLAS_HANDLES_PER_STEP * workspace


def _policy(func: Any) -> str | None:
    name = getattr(func, "__name__", "")
    name = name.strip("_") if name.startswith("__") else name  # Tensor.__matmul__, __pow__
    if name == "cross_entropy":  # composite: its log_softmax runs with an fp32 output on CUDA
        return "cross_entropy"
    if name not in cuda_autocast_ops():
        return None
    if name in _LOW:
        return "low"
    if name in _PROMOTE:
        return "promote"
    return "out_fp32" if name in _OUT_DTYPE else "fp32"


class CudaAutocast(TorchFunctionMode):
    """Autocast with CUDA's op policies, for tensors on any device (a what-if trace runs on the CPU).

    Each call of a listed op gets its floating arguments cast as ``torch.autocast("cuda", dtype)`` casts them: to
    ``dtype`` for matrix products, to fp32 for the fp32 list (ops with a ``dtype`` argument get ``dtype=float32``
    instead, as autocast does), to the widest for the promote list. Casts of leaf tensors that require grad (the
    weights) are cached until the context exits, as autocast's cast cache does (``cache=False``: not cached).

    Example:
        >>> with CudaAutocast(torch.bfloat16):  # doctest: +SKIP
        ...     loss = model(x).softmax(-1).sum()  # linear in bf16, softmax and sum with fp32 outputs
    """

    def __init__(self, dtype: torch.dtype, *, cache: bool = True) -> None:
        super().__init__()
        self.dtype, self.cache = dtype, cache
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __exit__(self, *exc: Any) -> None:
        self._cache.clear()
        return super().__exit__(*exc)

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        policy = _policy(func)
        if policy is None:
            return func(*args, **kwargs)
        if policy == "cross_entropy":
            return self._cross_entropy(func, args, kwargs)
        if policy == "out_fp32":
            first = args[0] if args else None
            if isinstance(first, torch.Tensor) and first.is_floating_point() and "dtype" not in kwargs \
                    and first.dtype != torch.float64 and not any(isinstance(a, torch.dtype) for a in args):
                kwargs["dtype"] = torch.float32
            return func(*args, **kwargs)
        if policy == "promote":
            from lightning.fabric.utilities.apply_func import apply_to_collection

            floats: list[torch.dtype] = []
            apply_to_collection((args, kwargs), torch.Tensor, lambda t: floats.append(t.dtype))
            floats = [d for d in floats if d.is_floating_point and d != torch.float64]
            to = torch.float32 if torch.float32 in floats or not floats else self.dtype
        else:
            to = self.dtype if policy == "low" else torch.float32
        return func(*self._cast(args, to), **self._cast(kwargs, to))

    def _cross_entropy(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        import inspect

        import torch.nn.functional as F

        bound = inspect.signature(F.cross_entropy).bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        logits, target = a["input"], a["target"]
        legacy = a["size_average"] is not None or a["reduce"] is not None
        if legacy or a["label_smoothing"] or target.is_floating_point() or not logits.is_floating_point():
            return func(*self._cast(args, torch.float32), **self._cast(kwargs, torch.float32))
        log_probs = F.log_softmax(logits, 1 if logits.dim() > 1 else 0, dtype=torch.float32)
        return F.nll_loss(log_probs, target, weight=a["weight"], ignore_index=a["ignore_index"],
                          reduction=a["reduction"])

    def _cast(self, value: Any, to: torch.dtype) -> Any:
        """The tensors in ``value`` (any nesting) cast to ``to``; weights' casts from the cache."""
        from lightning.fabric.utilities.apply_func import apply_to_collection

        return apply_to_collection(value, torch.Tensor, self._cast_tensor, to)

    def _cast_tensor(self, t: torch.Tensor, to: torch.dtype) -> torch.Tensor:
        if not t.is_floating_point() or t.dtype in (to, torch.float64):
            return t
        if not (self.cache and t.is_leaf and t.requires_grad):
            return t.to(to)
        hit = self._cache.get(id(t))
        if hit is None or hit[0] is not t or hit[1].dtype != to:
            hit = (t, t.to(to))
            self._cache[id(t)] = hit
        return hit[1]
