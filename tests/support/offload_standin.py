"""A CPU stand-in for torchao's ``CPUOffloadOptimizer``, so the offload wiring runs in tests without a GPU.

It keeps torchao's layout and behaviour where the wiring depends on them: host copies of the parameters of
``minimal_size`` elements or more, each with its own optimizer (``optim_dict``, ``param_d2h_map``), the small ones
in one optimizer (``d_opt``), gradients copied to the host by a post-accumulate-grad hook as backward produces them
(``queue``), ``step`` running any closure under ``no_grad``, and ``zero_grad`` only setting gradients to None. Only
the copies differ: they are plain CPU copies instead of copies between a GPU and pinned host memory.
"""

from __future__ import annotations

from typing import Any

import torch


class HostOffload(torch.optim.Optimizer):
    def __init__(self, params: Any, optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW, *,
                 offload_gradients: bool = False, minimal_size: int = 4096, **kwargs: Any) -> None:
        groups = list(params)
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.device = "cpu"
        self.stream = torch.cpu.Stream()
        self.queue: dict[torch.Tensor, Any] = {}
        self.param_d2h_map: dict[torch.Tensor, torch.Tensor] = {}
        self.optim_dict: dict[torch.Tensor, torch.optim.Optimizer] = {}
        self.d_opt: torch.optim.Optimizer | None = None
        kept_groups = []
        for group in groups:
            params_ = group.pop("params")
            kept = []
            for p in params_:
                if not p.requires_grad:
                    continue
                if p.numel() < minimal_size:
                    kept.append(p)
                    continue
                host = p.detach().clone()
                host.grad = torch.zeros_like(host)
                self.param_d2h_map[p] = host
                p.register_post_accumulate_grad_hook(self._copy_grad)
                self.optim_dict[p] = optimizer_class([{"params": host, **group}], **kwargs)
            if kept:
                kept_groups.append({"params": kept, **group})
        if kept_groups:
            self.d_opt = optimizer_class(kept_groups, **kwargs)

    def _copy_grad(self, p: torch.Tensor) -> None:
        self.param_d2h_map[p].grad.copy_(p.grad)
        self.queue.pop(p, None)
        self.queue[p] = None  # torchao keeps the copy's event here

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        if self.d_opt is not None:
            self.d_opt.step()
        for p in self.queue:
            self.optim_dict[p].step()
            p.copy_(self.param_d2h_map[p])
        self.queue.clear()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not set_to_none:
            raise AssertionError("torchao's CPUOffloadOptimizer only sets gradients to None")
        for p in self.param_d2h_map:
            p.grad = None
        if self.d_opt is not None:
            self.d_opt.zero_grad(set_to_none=True)
