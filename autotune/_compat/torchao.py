"""Private torchao API that autotune uses, each access with what breaks if it changes: the bf16 AdamW exported under
a private name and the internals of ``CPUOffloadOptimizer`` (checked against torchao 0.18.0; the tests run a
stand-in with the same attributes)."""

from __future__ import annotations

from typing import Any


def torchao_bf16_adamw() -> Any:
    """torchao's full-width AdamW that can round bf16 updates stochastically (``torchao.optim._AdamW``, exported
    under a private name). If it were removed, ``precision="bf16-true"`` runs would keep the user's optimizer."""
    import torchao.optim

    return torchao.optim._AdamW


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
