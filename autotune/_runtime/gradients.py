"""Gradients averaged over DDP ranks after the step's micro-batches, as DDP does, in flat buckets."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from autotune._device.oom import is_oom_error
from autotune._runtime.agreement import PeerOutOfMemory

#: Gradients are averaged over ranks in flat buckets of about this size (DDP's default bucket cap).
GRADIENT_BUCKET_BYTES = 25 * 2**20


class GradientAverager:
    """Averages the gradients of the parameters some rank used (divide by world size, then sum: DDP's arithmetic).

    Like DDP, gradients travel in flat buckets of about ``GRADIENT_BUCKET_BYTES``, two in flight, through buffers kept
    from step to step. :meth:`prepare` runs before the step's vote and allocates the zeros for the gradients this rank
    lacks and the bucket buffers. So an OOM doing so is voted like any other, and the usual step allocates nothing
    after the vote.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        self._expected: list[bool] | None = None  # which parameters the last step reduced
        self._prepared: list[bool] | None = None  # what this step's vote prepared for
        self._made: list[torch.nn.Parameter] = []

    def prepare(self, params: list[torch.nn.Parameter]) -> list[bool]:
        """Before the vote: zeros for the gradients the last step reduced that this rank lacks, bucket buffers sized
        (raises this rank's OOM doing so). Returns which parameters got a gradient on this rank (before the zeros)."""
        local = [p.grad is not None for p in params]
        self._prepared = None
        self._made = []
        used = self._expected or local
        self._made = self._materialize(params, used)
        self._prepared = used
        return local

    def forget_unused(self, params: list[torch.nn.Parameter], used: list[bool]) -> None:
        """After the vote: a zero made for a parameter no rank used this step is left out, as DDP does."""
        if not self._made:
            return
        index = {id(p): i for i, p in enumerate(params)}
        for p in self._made:
            if not used[index[id(p)]]:
                p.grad = None
        self._made = []

    def average(self, params: list[torch.nn.Parameter], used: list[bool], any_failed: Any) -> None:
        """Average the ``used`` parameters' gradients over ranks. When the set used changed since the vote prepared,
        what it needs is allocated now and the ranks agree once more (``any_failed(flag)``, a collective) before the
        all-reduces, so no rank is left in one alone. Whether to is decided alike on every rank: the set used differs
        from the last step's (always at the first step)."""
        if used != self._expected:
            failed = False
            try:
                self._materialize(params, used)
            except BaseException as exc:
                if not is_oom_error(exc):
                    raise
                failed = True
            if any_failed(failed):
                raise torch.OutOfMemoryError("out of memory materializing gradients") if failed else PeerOutOfMemory()
        self._expected = used
        buckets = make_buckets([p.grad for p, needed in zip(params, used) if needed], GRADIENT_BUCKET_BYTES)
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

    def _materialize(self, params: list[torch.nn.Parameter], used: list[bool]) -> list[torch.nn.Parameter]:
        """Zeros for the gradients of ``used`` parameters that have none, and bucket buffers for the ``used``
        gradients; returns the parameters given a zero gradient."""
        made = []
        for p, needed in zip(params, used):
            if needed and p.grad is None:
                p.grad = torch.zeros_like(p)
                made.append(p)
        self._ensure_bucket_buffers(make_buckets([p.grad for p, needed in zip(params, used) if needed],
                                                 GRADIENT_BUCKET_BYTES))
        return made

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
