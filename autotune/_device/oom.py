"""The one out-of-memory predicate of the package, and the error raised when no smaller micro-batch is left."""

from __future__ import annotations

import re

import torch

# One pattern per backend, matched against the message of errors that are not `torch.OutOfMemoryError` itself
# (older extensions and some backends raise a plain RuntimeError).
_OOM_PATTERNS = re.compile(
    "|".join(
        [
            r"CUDA out of memory",  # CUDA caching allocator (older torch raised RuntimeError)
            r"CUDA error: out of memory",  # a raw cudaMalloc outside the caching allocator (torch.AcceleratorError)
            r"CUBLAS_STATUS_ALLOC_FAILED",  # cuBLAS workspace allocation
            r"CUSOLVER_STATUS_ALLOC_FAILED",  # cuSOLVER workspace allocation (linalg)
            r"CUFFT_ALLOC_FAILED",  # cuFFT plan allocation (torch.fft)
            r"CUDNN_STATUS_NOT_SUPPORTED\. This error may appear if you passed in a non-contiguous input",  # cuDNN
            r"cuDNN error: CUDNN_STATUS_ALLOC_FAILED",  # cuDNN workspace allocation
            r"HIP out of memory",  # ROCm
            r"HIP error: out of memory",  # ROCm, a raw hipMalloc
            r"XPU out of memory",  # Intel XPU
            r"MPS backend out of memory",  # Apple MPS
            r"DefaultCPUAllocator: can't allocate memory",  # CPU allocator
            r"DefaultCPUAllocator: not enough memory",  # CPU allocator (Windows)
        ]
    )
)


def is_oom_error(exc: BaseException) -> bool:
    """Whether ``exc`` is an out-of-memory error from any torch backend.

    Checks the type first (``torch.OutOfMemoryError``, whatever its message), then one message pattern per backend.

    Example:
        >>> is_oom_error(torch.OutOfMemoryError("boom"))
        True
        >>> is_oom_error(ValueError("CUDA out of memory"))
        False
    """
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and bool(_OOM_PATTERNS.search(str(exc)))


class OutOfMemoryAtMinimumError(RuntimeError):
    """Raised when a step runs out of memory at the smallest micro-batch allowed; the original OOM is chained."""
