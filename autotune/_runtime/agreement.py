"""The few collectives that keep ranks in step under DDP: votes, and gradients averaged in flat buckets."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from autotune._device.oom import is_oom_error


class PeerOutOfMemory(RuntimeError):
    """Raised on ranks that did not run out of memory themselves when another rank did."""

    def __init__(self) -> None:
        super().__init__("another rank ran out of memory in this step")


class Agreement:
    """The few collectives that keep ranks in step; everything is local when there is one process."""

    def __init__(self, device: torch.device, world_size: int) -> None:
        self.enabled = world_size > 1 and dist.is_available() and dist.is_initialized()
        self.device = device
        self._buffers: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on any rank."""
        if not self.enabled:
            return flag
        return self.max(1.0 if flag else 0.0)[0] > 0

    def max(self, *values: float) -> list[float]:
        """The element-wise maximum of ``values`` over ranks."""
        if not self.enabled:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64 if self.device.type != "mps" else torch.float32)
        t = t.to(self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def average_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Average gradients over ranks as DDP does (divide by world size, then sum), once per step.

        Like DDP, gradients travel in flat buckets of about ``GRADIENT_BUCKET_BYTES``, two in flight, through
        buffers kept from step to step (allocated, like any gradient, before the ranks agree that none ran out of
        memory, so no rank is left alone in a collective).
        """
        if not self.enabled:
            return
        has_grad = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=self.device)
        dist.all_reduce(has_grad, op=dist.ReduceOp.MAX)  # a parameter used on any rank is reduced on all
        used = [bool(u) for u in has_grad.tolist()]
        failed = False
        try:
            for p, needed in zip(params, used):
                if needed and p.grad is None:
                    p.grad = torch.zeros_like(p)
            buckets = make_buckets([p.grad for p, needed in zip(params, used) if needed], GRADIENT_BUCKET_BYTES)
            self._ensure_bucket_buffers(buckets)
        except BaseException as exc:
            if not is_oom_error(exc):
                raise
            failed = True
        if self.any(failed):  # agree before the all-reduces, so no rank is left in one alone
            raise torch.OutOfMemoryError("out of memory materializing gradients") if failed else PeerOutOfMemory()
        world = dist.get_world_size()
        pending: list[tuple[Any, torch.Tensor, list[torch.Tensor]]] = []
        slots: dict[tuple[torch.dtype, torch.device], int] = {}
        for bucket in buckets:
            if len(bucket) == 1:
                flat = bucket[0]  # one large tensor: reduced in place
            else:
                key = (bucket[0].dtype, bucket[0].device)
                slot = slots[key] = (slots.get(key, -1) + 1) % len(self._buffers[key])
                for work in [w for w in pending if w[1].data_ptr() == self._buffers[key][slot].data_ptr()]:
                    _finish(*work)  # the buffer's previous bucket is back
                    pending.remove(work)
                flat = self._buffers[key][slot][: sum(g.numel() for g in bucket)]
                torch.cat([g.reshape(-1) for g in bucket], out=flat)
            flat.div_(world)
            pending.append((dist.all_reduce(flat, async_op=True), flat, bucket))
        for work in pending:
            _finish(*work)

    def _ensure_bucket_buffers(self, buckets: list[list[torch.Tensor]]) -> None:
        """Two buffers per dtype and device (one when a single bucket has it), each as large as its largest bucket."""
        needed: dict[tuple[torch.dtype, torch.device], tuple[int, int]] = {}  # key -> (largest numel, buckets)
        for bucket in buckets:
            if len(bucket) > 1:
                key = (bucket[0].dtype, bucket[0].device)
                numel, count = needed.get(key, (0, 0))
                needed[key] = (max(numel, sum(g.numel() for g in bucket)), count + 1)
        for key, (numel, count) in needed.items():
            have = self._buffers.get(key)
            if have is None or have[0].numel() < numel or len(have) < min(2, count):
                self._buffers[key] = [torch.empty(numel, dtype=key[0], device=key[1]) for _ in range(min(2, count))]


#: Gradients are averaged over ranks in flat buckets of about this size (DDP's default bucket cap).
GRADIENT_BUCKET_BYTES = 25 * 2**20


def make_buckets(tensors: list[torch.Tensor], cap_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive tensors grouped by dtype and device, each group cut at ``cap_bytes``."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        last = buckets[-1] if buckets else None
        nbytes = t.numel() * t.element_size()
        if last is None or (t.dtype, t.device) != (last[0].dtype, last[0].device) or size + nbytes > cap_bytes:
            buckets.append([t])
            size = nbytes
        else:
            last.append(t)
            size += nbytes
    return buckets


def _finish(work: Any, flat: torch.Tensor, bucket: list[torch.Tensor]) -> None:
    """Wait for a bucket's all-reduce and copy the averaged values back into its gradients."""
    work.wait()
    if len(bucket) > 1:
        offset = 0
        for grad in bucket:
            grad.copy_(flat[offset: offset + grad.numel()].view_as(grad))
            offset += grad.numel()
