"""The few collectives that keep ranks in step under DDP: votes, and gradients averaged in flat buckets."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from autotune._device.oom import is_oom_error


class PeerOutOfMemory(RuntimeError):
    """Raised on ranks that did not run out of memory themselves when another rank did; ``fatal`` when that rank was
    at its minimum micro-batch (it ends the run, and so do its peers, rather than wait for it in the next step)."""

    def __init__(self, *, fatal: bool = False) -> None:
        at = " at its minimum micro-batch" if fatal else ""
        super().__init__(f"another rank ran out of memory in this step{at}")
        self.fatal = fatal


class Agreement:
    """The collectives that keep ranks in step; everything is local when there is one process.

    A step that no rank fails costs one small collective, :meth:`vote`, besides the gradients' own all-reduces:
    micro-batches run under ``no_sync`` (no collective in them), so a rank that runs out of memory in one stops
    there and brings its failure to the vote, which every rank reaches before any gradient collective.
    """

    def __init__(self, device: torch.device, world_size: int) -> None:
        self.enabled = world_size > 1 and dist.is_available() and dist.is_initialized()
        self.device = device
        self.votes = 0  # collectives made to agree (not the gradients' all-reduces), for benchmarks and tests
        self._buffers: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        self._expected: list[bool] | None = None  # which parameters the last step reduced
        self._prepared: list[bool] | None = None  # what this step's vote prepared for

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
        self.votes += 1
        return t.tolist()

    def vote(self, params: list[torch.nn.Parameter], *, failed: int, batch_size: int,
             shaped: bool, peak: int = 0) -> tuple[int, bool, list[bool], bool, int]:
        """The step's one agreement, before any gradient collective: the worst ``failed`` of the ranks (0: none ran out
        of memory, 1: one did, 2: one did at its minimum micro-batch),
        whether every rank had a batch of ``batch_size`` samples, which parameters got a gradient on some rank, and
        whether any rank is ``shaped`` (its batches' sample sizes vary: it splits by its own shape), and the largest
        ``peak`` (the last step's, which a soft budget checks one step late rather than in a collective of its own).

        Gradients of parameters that were reduced last step but have none here are made zeros before the vote, and
        the bucket buffers sized, so the usual step allocates nothing after it; an OOM doing so is this rank's
        failure, voted like any other.
        """
        local = [p.grad is not None for p in params]
        made: list[torch.nn.Parameter] = []
        self._prepared = None
        if not failed:
            try:
                self._prepared = self._expected or local
                made = self._prepare(params, self._prepared)
            except BaseException as exc:
                if not is_oom_error(exc):
                    raise
                failed = max(failed, 1)
        values = [float(failed), float(batch_size), float(-batch_size), float(shaped), float(peak),
                  *(1.0 if used else 0.0 for used in local)]
        reduced = self.max(*values)
        any_failed, most, least, any_shaped = int(reduced[0]), int(reduced[1]), int(-reduced[2]), reduced[3] > 0
        worst_peak = int(reduced[4])
        used = [u > 0 for u in reduced[5:]]
        index = {id(p): i for i, p in enumerate(params)} if made else {}
        for p in made:
            if not used[index[id(p)]]:
                p.grad = None  # a zero made for a parameter no rank used this step: leave it out, as DDP does
        return any_failed, most == least, used, any_shaped, worst_peak

    def _prepare(self, params: list[torch.nn.Parameter], used: list[bool]) -> list[torch.nn.Parameter]:
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

    def average_gradients(self, params: list[torch.nn.Parameter], used: list[bool]) -> None:
        """Average the ``used`` parameters' gradients over ranks as DDP does (divide by world size, then sum).

        Like DDP, gradients travel in flat buckets of about ``GRADIENT_BUCKET_BYTES``, two in flight, through buffers
        kept from step to step. When the set of parameters used changed since the last step, what it needs is
        allocated now and the ranks agree on it once more before the all-reduces (no rank is left in one alone).
        """
        if not self.enabled:
            return
        if used != self._prepared:
            failed = False
            try:
                self._prepare(params, used)
            except BaseException as exc:
                if not is_oom_error(exc):
                    raise
                failed = True
            if self.any(failed):
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
