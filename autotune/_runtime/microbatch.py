"""The engine behind :class:`autotune.callbacks.ElasticBatchSize`: split, replay, agree, grow.

One optimizer step of Lightning runs ``optimizer.step(closure)``. The engine hands the optimizer a closure that
calls Lightning's own closure once per micro-batch (``training_step`` is wrapped to cut micro-batch ``i`` out of
the batch and weight its loss), so forward, backward and the update of every micro-batch surface in one place.
An out-of-memory error there is caught, gradients are dropped, the parameters and optimizer state are put back
when the update itself failed, the random state is restored, and the same batch is replayed at a smaller
micro-batch. Lightning sees one successful ``optimizer_step`` per batch: its step counters, LR schedulers and
gradient clipping are untouched.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_only

from autotune._runtime.batch import batch_size_of, combine_outputs, scale_step_output, slice_batch, split_sizes
from autotune._device.budget import format_bytes
from autotune._runtime.logbuffer import LogBuffer
from autotune._device.meter import MemoryMeter
from autotune._runtime.state import MetricStates, RNGState, UpdateSnapshot, release_memory
from autotune._device.oom import OutOfMemoryAtMinimumError, is_oom_error

log = logging.getLogger("autotune")

#: Grow only when the step's peak, scaled to the larger micro-batch, stays under this share of the limit.
GROW_HEADROOM = 0.9


@rank_zero_only
def _info(msg: str) -> None:
    log.info(msg)


_UNPROTECTED = ("Out of memory inside the optimizer update with protect_update=False: the update may be "
                "half-applied and cannot be replayed. Use ElasticBatchSize(protect_update=True).")


class _PeerOutOfMemory(RuntimeError):
    """Raised on ranks that did not run out of memory themselves when another rank did."""

    def __init__(self) -> None:
        super().__init__("another rank ran out of memory in this step")


@dataclass(frozen=True)
class ElasticEvent:
    """One decision of :class:`~autotune.callbacks.ElasticBatchSize` (its ``events`` list, oldest first).

    ``kind`` is "oom" (an out-of-memory error; the step was replayed at ``micro_batch_size``), "grow" (the
    micro-batch doubled after clean steps), "grow_failed" (the larger micro-batch ran out of memory and went back),
    "over_budget" (a step's peak passed the soft CPU budget; the next step runs smaller) or "eval_oom" (an
    evaluation step was split). ``step`` is the global step, ``batch_size`` the effective batch, ``previous`` and
    ``micro_batch_size`` the micro-batch before and after, ``where`` the phase that failed ("closure": forward or
    backward, "update": the optimizer step; for "eval_oom" the stage), ``peak_bytes`` the step's peak when known.

    Example:
        >>> ElasticEvent(kind="oom", step=3, batch_size=64, previous=32, micro_batch_size=16).micro_batch_size
        16"""

    kind: str
    step: int
    batch_size: int
    previous: int
    micro_batch_size: int
    where: str = ""
    peak_bytes: int = 0


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
            buckets = _buckets([p.grad for p, needed in zip(params, used) if needed], GRADIENT_BUCKET_BYTES)
            self._ensure_bucket_buffers(buckets)
        except BaseException as exc:
            if not is_oom_error(exc):
                raise
            failed = True
        if self.any(failed):  # agree before the all-reduces, so no rank is left in one alone
            raise torch.OutOfMemoryError("out of memory materializing gradients") if failed else _PeerOutOfMemory()
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


def _buckets(tensors: list[torch.Tensor], cap_bytes: int) -> list[list[torch.Tensor]]:
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


class ElasticEngine:
    """Micro-batch size policy and the step runners; one per fit, owned by the callback."""

    def __init__(
        self,
        *,
        micro_batch_size: int | None,
        min_micro_batch_size: int,
        grow: bool,
        grow_after: int,
        protect_update: bool,
        budget_bytes: int | None,
        budget_text: str | None,
        hard_budget: bool,
        limit_bytes: int | None,
        device: torch.device,
        world_size: int,
        log_fn: Callable[..., Any],
    ) -> None:
        self.micro_batch_size = micro_batch_size
        self.min_micro_batch_size = min_micro_batch_size
        self.grow = grow
        self.grow_wait = grow_after
        self.protect_update = protect_update
        self.budget_bytes = budget_bytes
        self.budget_text = budget_text
        self.hard_budget = hard_budget
        self.limit_bytes = limit_bytes
        self.device = device
        self.agree = Agreement(device, world_size)
        self.logs = LogBuffer(log_fn)
        self.meter = MemoryMeter(device)
        self.snapshot = UpdateSnapshot()
        # Policy state (saved in checkpoints).
        self.clean_steps = 0
        self.oom_events = 0
        self.growing_from: int | None = None
        self.events: list[ElasticEvent] = []
        self.eval_micro_batch_size: dict[str, int] = {}
        # Per-step state.
        self.batch_size: int | None = None
        self.sizes: list[int] = []
        self.index = 0
        self.phase = "closure"
        self.last_peak_bytes = 0
        self._warned_floor = False
        self._metrics: list[torch.nn.Module] | None = None

    # ----------------------------------------------------------------------------------------------- training
    def start_batch(self, batch: Any) -> None:
        """Called with the host batch before the step: fixes the step's batch size ``N``."""
        self.batch_size = batch_size_of(batch)
        self.sizes = [self.batch_size] if self.batch_size else []
        self.index = 0

    def micro_part(self, batch: Any) -> tuple[Any, bool]:
        """The current micro-batch of ``batch`` and whether the batch is being split at all."""
        n = self.batch_size
        if not n or len(self.sizes) <= 1:
            return batch, False
        start = sum(self.sizes[: self.index])
        return slice_batch(batch, start, start + self.sizes[self.index], n), True

    def scale_output(self, output: Any) -> Any:
        return scale_step_output(output, sizes=self.sizes, index=self.index) if len(self.sizes) > 1 else output

    def run_training_step(
        self,
        *,
        step: Callable[[Callable[[], Any]], Any],
        closure: Callable[[], Any],
        optimizer: torch.optim.Optimizer,
        module: torch.nn.Module,
        ddp_model: Any,
        scaler: Any,
        global_step: int,
    ) -> Any:
        """Run one optimizer step (``step(closure)``) over micro-batches, replaying it after an OOM."""
        n = self.batch_size
        if self.agree.enabled:
            self._check_same_split(n)
        if not n:  # nothing to split (no tensor in the batch): behave as if the callback were absent
            return step(closure)
        if self.micro_batch_size is None:
            self.micro_batch_size = n
        rng = RNGState()
        metrics = self._metric_states(module)
        if self.protect_update:
            self.snapshot.capture(optimizer)
        static = self.meter.start()
        replayed = False
        while True:
            micro = min(self.micro_batch_size, n)
            self.sizes = split_sizes(n, micro)
            if replayed and self.agree.enabled:
                self._check_same_split(n)
            self.phase = "closure"
            self.logs.start()
            failed_in = ""
            cause: BaseException | None = None
            try:
                result = step(self._multi_closure(closure, module, ddp_model))
            except BaseException as exc:
                self.logs.discard()
                if not (is_oom_error(exc) or isinstance(exc, _PeerOutOfMemory)):
                    raise
                failed_in = self.phase
                if failed_in == "update" and self.agree.enabled:
                    self.agree.any(True)
                next_micro = self._shrink(micro)
                if next_micro is None:
                    raise self._floor_error(n, micro, failed_in, peer=isinstance(exc, _PeerOutOfMemory)) from exc
                if failed_in == "update" and not self.protect_update:
                    raise OutOfMemoryAtMinimumError(_UNPROTECTED) from exc
                cause = exc
            else:
                if self.agree.enabled and self.agree.any(False):
                    failed_in = "update"  # a peer failed in its update: undo ours too
                    next_micro = self._shrink(micro)
                    if next_micro is None:
                        raise self._floor_error(n, micro, failed_in, peer=True)
                    if not self.protect_update:
                        raise OutOfMemoryAtMinimumError(_UNPROTECTED + " (another rank ran out of memory in it)")
            if not failed_in:
                break
            # Recover outside the except block: its traceback holds the frames of the failed attempt.
            del cause
            optimizer.zero_grad(set_to_none=True)
            release_memory(module.parameters(), self.device, static_bytes=static)
            if failed_in == "update":
                self.snapshot.restore()
            if scaler is not None:
                scaler._per_optimizer_states.clear()  # forget unscale_/inf checks of the failed attempt
            rng.restore()
            metrics.restore()
            self._record("grow_failed" if self.growing_from is not None else "oom", global_step, micro, next_micro,
                         failed_in)
            self.growing_from = None
            self.micro_batch_size = next_micro
            replayed = True
            static = self.meter.start()
        self.logs.flush()
        self._after_success(n, micro, static, global_step, clean=not replayed)
        return result

    def _metric_states(self, module: torch.nn.Module) -> MetricStates:
        """The model's torchmetrics states now (the metrics are looked up once per fit)."""
        if self._metrics is None:
            self._metrics = MetricStates.find(module)
        return MetricStates(self._metrics)

    def _check_same_split(self, n: int | None) -> None:
        """Under DDP every rank must run as many micro-batches (each is followed by a vote): check it, together."""
        count = len(split_sizes(n, min(self.micro_batch_size or n, n))) if n else 0
        most, least = self.agree.max(float(count), float(-count))
        if most != -least:
            raise RuntimeError(
                f"ElasticBatchSize: the ranks got batches of different sizes ({int(-least)} to {int(most)} "
                "micro-batches this step); every rank must see the same batch size (Lightning's DistributedSampler "
                "pads the ranks to equal shares; keep use_distributed_sampler=True or pad a custom sampler)."
            )

    def _multi_closure(self, closure: Callable[[], Any], module: torch.nn.Module, ddp_model: Any) -> Callable[[], Any]:
        def run_micro_batches() -> Any:
            total = None
            for i in range(len(self.sizes)):
                self.index = i
                self.logs.n = self.sizes[i]
                sync_off = ddp_model.no_sync() if self.agree.enabled and ddp_model is not None else contextlib.nullcontext()
                try:
                    with sync_off:
                        loss = closure()
                except BaseException as exc:
                    if self.agree.enabled and is_oom_error(exc):
                        self.agree.any(True)  # tell the peers before leaving
                    raise
                if self.agree.enabled and self.agree.any(False):
                    raise _PeerOutOfMemory()
                if loss is not None:
                    total = loss if total is None else total + loss
            self.agree.average_gradients([p for p in module.parameters() if p.requires_grad])
            if self.protect_update:
                self.snapshot.wait()
            self.phase = "update"
            _set_closure_loss(closure, total)
            return total

        return run_micro_batches

    def _shrink(self, micro: int) -> int | None:
        """The micro-batch to replay with after an OOM at ``micro``; None when nothing smaller is allowed."""
        if self.growing_from is not None and self.growing_from < micro:
            return self.growing_from
        self.growing_from = None  # the grow did not apply to this (short) batch: an ordinary OOM
        if micro <= self.min_micro_batch_size:
            return None
        return max(self.min_micro_batch_size, micro // 2)

    def _after_success(self, n: int, micro: int, static: int, global_step: int, *, clean: bool) -> None:
        peak = self.meter.peak()
        if self.growing_from is not None:
            self._record("grow", global_step, self.growing_from, micro, peak=peak)
            self.growing_from = None
        self.clean_steps += int(clean)  # a replayed step is not a clean one
        soft = self.budget_bytes is not None and not self.hard_budget
        grow_due = self.grow and micro < n and self.clean_steps >= self.grow_wait
        if soft or grow_due:  # decisions every rank must take alike: decide on the worst rank's figures
            peak_f, static_f = self.agree.max(float(peak), float(static))
            peak, static = int(peak_f), int(static_f)
        self.last_peak_bytes = peak
        if soft and self.budget_bytes is not None and peak > self.budget_bytes:
            if micro > self.min_micro_batch_size:
                smaller = max(self.min_micro_batch_size, micro // 2)
                self._record("over_budget", global_step, micro, smaller, peak=peak)
                self.micro_batch_size = smaller
                self.clean_steps = 0
            elif not self._warned_floor:
                self._warned_floor = True
                log.warning(
                    "Step peak %s is over the budget %s at the minimum micro-batch %d; the CPU budget is soft, "
                    "training goes on.", format_bytes(peak), self.budget_text, micro,
                )
            return
        if not grow_due:
            return
        self.clean_steps = 0
        target = min(n, micro * 2)
        projected = static + (peak - static) * target / micro
        if self.limit_bytes is None or projected <= GROW_HEADROOM * self.limit_bytes:
            _info(f"autotune: growing the micro-batch {micro} -> {target} (projected peak {format_bytes(int(projected))})")
            self.growing_from = micro
            self.micro_batch_size = target
        else:
            log.debug("autotune: not growing %d -> %d: projected peak %s", micro, target, format_bytes(int(projected)))

    def _record(self, kind: str, step: int, previous: int, new: int, where: str = "", peak: int | None = None) -> None:
        if kind in ("oom", "grow_failed", "eval_oom"):
            self.oom_events += 1
            self.clean_steps = 0
        if kind == "grow_failed":
            self.grow_wait *= 2
        peak = self.meter.peak() if peak is None else peak
        event = ElasticEvent(kind, step, self.batch_size or 0, previous, new, where, peak)
        self.events.append(event)
        del self.events[:-1000]  # keep the checkpoint small on very long runs
        _info(f"autotune: {kind} at step {step} ({where or 'step'}): micro-batch {previous} -> {new}")

    def _floor_error(self, n: int, micro: int, where: str, *, peer: bool) -> OutOfMemoryAtMinimumError:
        budget = self.budget_text or "none (no cap)"
        who = "another rank" if peer else "this rank"
        return OutOfMemoryAtMinimumError(
            f"Out of memory at the minimum micro-batch ({who}, in the {where or 'step'}): batch size {n}, "
            f"micro-batch {micro} (min_micro_batch_size={self.min_micro_batch_size}), budget {budget}, "
            f"peak {format_bytes(self.meter.peak())}. Reduce memory per sample (precision, activation "
            "checkpointing), lower min_micro_batch_size, or raise the budget."
        )

    # --------------------------------------------------------------------------------------------- evaluation
    def run_eval_step(self, stage: str, step: Callable[..., Any], batch: Any, args: tuple, kwargs: dict,
                      module: torch.nn.Module) -> Any:
        """Run an evaluation step, splitting its batch after an OOM; the training micro-batch is not touched."""
        n = batch_size_of(batch)
        rng = RNGState()
        metrics = self._metric_states(module)
        while True:
            micro = min(self.eval_micro_batch_size.get(stage, n or 1), n or 1)
            sizes = split_sizes(n, micro) if n else [1]
            self.logs.start()
            try:
                outputs, start = [], 0
                for size in sizes:
                    part = batch if len(sizes) == 1 else slice_batch(batch, start, start + size, n)
                    self.logs.n = size
                    outputs.append(step(part, *args, **kwargs))
                    start += size
            except BaseException as exc:
                self.logs.discard()
                if not is_oom_error(exc):
                    raise
                if not n or micro <= 1:
                    raise OutOfMemoryAtMinimumError(
                        f"Out of memory in {stage} at the smallest evaluation split: batch size {n}, micro-batch "
                        f"{micro}, budget {self.budget_text or 'none (no cap)'}, peak "
                        f"{format_bytes(self.meter.peak())}."
                    ) from exc
                smaller = micro // 2
            else:
                self.logs.flush()
                return combine_outputs(outputs, sizes)
            outputs = []
            release_memory((), self.device)
            rng.restore()
            metrics.restore()
            self.eval_micro_batch_size[stage] = smaller
            self._record("eval_oom", -1, micro, smaller, where=stage)

    # ------------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {
            "micro_batch_size": self.micro_batch_size,
            "clean_steps": self.clean_steps,
            "grow_wait": self.grow_wait,
            "oom_events": self.oom_events,
            "events": [asdict(e) for e in self.events],
            "eval_micro_batch_size": dict(self.eval_micro_batch_size),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.micro_batch_size = state.get("micro_batch_size", self.micro_batch_size)
        self.clean_steps = state.get("clean_steps", 0)
        self.grow_wait = state.get("grow_wait", self.grow_wait)
        self.oom_events = state.get("oom_events", 0)
        self.events = [ElasticEvent(**e) for e in state.get("events", [])]
        self.eval_micro_batch_size = dict(state.get("eval_micro_batch_size", {}))


def _set_closure_loss(closure: Any, total: Any) -> None:
    """Make Lightning's closure report the whole batch's loss (the sum of the weighted micro-batch losses)."""
    result = getattr(closure, "_result", None)
    if result is None or total is None or not hasattr(result, "closure_loss"):
        return
    from lightning.pytorch.loops.optimization.automatic import ClosureResult

    closure._result = ClosureResult(closure_loss=total.detach(), extra=result.extra)
