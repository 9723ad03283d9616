"""Fake-tensor rules the estimator adds to torch's for its traces: ``torch._grouped_mm`` (transformers' default
mixture-of-experts matmul) in every dtype its kernels take (:func:`allow_grouped_mm_in_any_dtype`)."""

from __future__ import annotations

import functools
from typing import Any

import torch

from autotune._compat.torch import grouped_mm_meta_kernels, has_grouped_mm, register_grouped_mm_fake

__all__ = ["allow_grouped_mm_in_any_dtype"]


@functools.cache
def allow_grouped_mm_in_any_dtype() -> None:
    """Give ``torch._grouped_mm`` a fake-tensor rule for every dtype its kernels take, registered once per process:
    torch's own meta kernel still answers bf16, and fp32/fp16 get the same output without its bf16-only check, which
    the CPU kernel and CUDA's (torch >= 2.10) do not make. Raises ImportError, registering nothing, where torch moved
    its meta helpers (:func:`~autotune._compat.torch.grouped_mm_meta_kernels`): the estimator's fake trace of an fp32
    MoE then fails at the meta check and the real-tensor path answers instead. The rule also serves any other fake
    trace in the process (torch.compile): it shapes what the kernels compute, so it makes such traces succeed where
    torch's check refused."""
    if not has_grouped_mm():
        return
    meta_grouped_mm, grouped_mm_output = grouped_mm_meta_kernels()

    def fake(mat_a: Any, mat_b: Any, offs: Any = None, bias: Any = None, out_dtype: Any = None) -> Any:
        if mat_a.dtype == torch.bfloat16 and mat_b.dtype == torch.bfloat16:
            return meta_grouped_mm(mat_a, mat_b, offs=offs, bias=bias, out_dtype=out_dtype)
        if mat_a.dtype != mat_b.dtype:
            raise RuntimeError(f"grouped_mm takes one dtype; got {mat_a.dtype} and {mat_b.dtype}")
        if mat_a.dim() not in (2, 3) or mat_b.dim() not in (2, 3):
            raise RuntimeError(f"grouped_mm multiplies 2D or 3D tensors; got {mat_a.dim()}D and {mat_b.dim()}D")
        if bias is not None:
            raise RuntimeError("grouped_mm takes no bias")
        return grouped_mm_output(mat_a, mat_b, offs, out_dtype)

    register_grouped_mm_fake(fake)
