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

import logging
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from autotune._compat import closure_extra, forget_scaler_steps, set_closure_loss, wrap_zero_grad
from autotune._runtime.agreement import Agreement, PeerOutOfMemory
from autotune._runtime.drain import CollectiveDrain
from autotune._runtime.evaluation import EvalSteps
from autotune._runtime.batch import (
    batch_size_of, combine_outputs, passed_whole, scale_step_output, slice_batch, split_even, split_sizes,
)
from autotune._device.budget import format_bytes
from autotune._runtime.logbuffer import LogBuffer
from autotune._runtime.events import _DIFFERENT_SPLITS, _NOT_SPLIT, _PASSED_WHOLE, _WARN_ONCE, ElasticEvent
from autotune._runtime.shapes import ShapeSplit
from autotune._runtime.sync import no_sync
from autotune._device.meter import MemoryMeter, release_host_memory
from autotune._runtime.state import MetricStates, RNGState, release_memory
from autotune._runtime.update import UpdateGuard
from autotune._device.oom import OutOfMemoryAtMinimumError, is_oom_error

log = logging.getLogger("autotune")

#: Grow only when the step's peak (CUDA: its tensors') scaled to the larger micro-batch stays under this share of the
#: limit; the shape model's byte cap too. The rest is the allocator's fragmentation (an OOM there is replayed).
GROW_HEADROOM = 0.9


@rank_zero_only
def _info(msg: str) -> None:
    log.info(msg)


class ElasticEngine(EvalSteps):
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
        sharded: bool = False,
        sample_size: Callable[[Any], float] | None = None,
        micro_batch_sample_size: float | None = None,
    ) -> None:
        self.micro_batch_size = micro_batch_size
        self.min_micro_batch_size = min_micro_batch_size
        self.grow = grow
        self.grow_wait = grow_after
        self.budget_bytes = budget_bytes
        self.budget_text = budget_text
        self.hard_budget = hard_budget
        self.limit_bytes = limit_bytes
        self.device = device
        self.agree = Agreement(device, world_size)
        self.logs = LogBuffer(log_fn)
        self.meter = MemoryMeter(device)
        self.sharded = sharded  # FSDP2: the module's own reduce-scatter; an OOM is drained, voted and replayed
        self.drain = CollectiveDrain() if sharded else None
        self.shapes = ShapeSplit(sample_size=sample_size, min_micro_batch_size=min_micro_batch_size,
                                 ranks_vote=self.agree.enabled)
        if micro_batch_sample_size is not None and micro_batch_size is not None:
            self.shapes.seed(micro_batch_size, micro_batch_sample_size)
        self.update = UpdateGuard(protect=protect_update)
        self._zeroed: set[int] = set()  # the closure evaluations of this step whose zero-grad function ran
        self._used: list[bool] = []  # which parameters' gradients this step reduces (DDP)
        # Policy state (saved in checkpoints).
        self.clean_steps = 0
        self.oom_events = 0
        self.over_budget_events = 0
        self._warned: set[str] = set()  # event kinds already warned about (once per kind and fit)
        self.growing_from: int | None = None
        self.events: list[ElasticEvent] = []
        self.eval_micro_batch_size: dict[str, int] = {}
        # Per-step state.
        self.batch_size: int | None = None
        self.sizes: list[int] = []
        self.index = 0
        self.phase = "closure"
        self.last_peak_bytes = 0
        #: Under several ranks with a soft budget: (micro-batch, sample size, step, this rank's peak) of the last step,
        #: whose worst-rank peak the next step's one agreement brings (no second collective per step).
        self._unsettled: tuple[int, float, int, int] | None = None
        self._measure = True  # whether this step reads the peak (see start_batch)
        self._closure_load: int | None = None  # the tensors' peak before the update, where a byte limit is known
        self._warned_floor = False
        self._metrics: tuple[list[torch.nn.Module], Any] | None = None

    # ----------------------------------------------------------------------------------------------- training
    def start_batch(self, batch: Any, *, logged: bool = True) -> None:
        """Called with the host batch before the step: fixes the step's batch size ``N``. ``logged``: whether this
        step's peak is logged (without a budget on the host the peak is read only where it is used: 0.2 ms a step)."""
        self._measure = logged or self.budget_bytes is not None or self.meter.is_cuda or (
            self.grow and self.clean_steps + 1 >= self.grow_wait and not self.shapes.varies)
        self.batch_size = batch_size_of(batch)
        self.sizes = [self.batch_size] if self.batch_size else []
        self.index = 0
        if self.batch_size:
            self.shapes.start(batch, self.batch_size)
            if "whole" not in self._warned:  # the first batch's tensors that are not cut (sequence-first ones?)
                self._warned.add("whole")
                whole = passed_whole(batch, self.batch_size)
                if whole:
                    rank_zero_warn(_PASSED_WHOLE.format(n=self.batch_size, shapes=", ".join(map(str, whole))))

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
        parallel_model: Any,
        scaler: Any,
        global_step: int,
    ) -> Any:
        """Run one optimizer step (``step(closure)``) over micro-batches, replaying it after an OOM.
        ``parallel_model`` is DDP's wrapper (or the FSDP2-sharded module) when there are several ranks, else None."""
        n = self.batch_size
        if not n:  # nothing to split (no tensor nor list in the batch): behave as if the callback were absent
            if "unsplit" not in self._warned:
                self._warned.add("unsplit")
                rank_zero_warn(_NOT_SPLIT)
            return step(closure)
        if self.drain is not None:
            self.drain.install(module)
        if self.micro_batch_size is None:
            self.micro_batch_size = n
        rng = RNGState()
        metrics = self._metric_states(module)
        static = self.meter.start() if self._measure else 0
        replayed = False
        self._zeroed = set()
        wrap_zero_grad(closure, lambda original: self._zero_grad_once(original, optimizer))
        while True:
            self.sizes = self._split(n, replayed)
            micro = self.sizes[0]
            self.phase = "closure"
            self.update.start_attempt()
            self._closure_load = None
            self.logs.start()
            failed_in = ""
            try:
                result = step(self._multi_closure(closure, module, parallel_model, optimizer))
            except BaseException as exc:
                self.logs.discard()
                if not (is_oom_error(exc) or isinstance(exc, PeerOutOfMemory)):
                    raise
                if self.drain is not None and self.drain.unsupported and self.agree.enabled:
                    raise OutOfMemoryAtMinimumError(self.drain.unsupported_error()) from exc
                failed_in = self.phase
                if failed_in == "update":
                    self.update.check_replayable(optimizer, cause=exc, agree=self.agree)
                next_micro = self._shrink(micro, n, peer=isinstance(exc, PeerOutOfMemory))
                if next_micro is None or getattr(exc, "fatal", False):
                    raise self._floor_error(n, micro, failed_in, peer=isinstance(exc, PeerOutOfMemory)) from exc
            else:
                if self.agree.enabled and self.update.protected and self.agree.any(False):
                    failed_in = "update"  # a peer failed in its protected update: undo ours too
                    next_micro = self._shrink(micro, n, peer=True)
                    if next_micro is None:
                        raise self._floor_error(n, micro, failed_in, peer=True)
            if not failed_in:
                break
            # Recover outside the except block: its traceback holds the frames of the failed attempt.
            if self.drain is not None:
                self.drain.reset(optimizer)  # FSDP2's iteration state and unsharded gradients, on every rank
            optimizer.zero_grad(set_to_none=True)
            release_memory(module.parameters(), self.device, static_bytes=static)
            if failed_in == "update" and self.update.protected:
                self.update.snapshot.restore()
            if scaler is not None:
                forget_scaler_steps(scaler)  # forget unscale_/inf checks of the failed attempt
            rng.restore()
            metrics.restore()
            self._record("grow_failed" if self.growing_from is not None else "oom", global_step, micro, next_micro,
                         failed_in)
            self.growing_from = None
            self.micro_batch_size = next_micro
            replayed = True
            static = self.meter.start() if self._measure else 0
        self.logs.flush(parts=len(self.sizes))
        self.update.succeeded(optimizer)
        self._after_success(n, micro, static, global_step, clean=not replayed)
        return result

    def _split(self, n: int, replayed: bool) -> list[int]:
        """This attempt's micro-batch sizes: from the shape model once this rank's sample sizes vary (a larger one
        tried when growing is due), else the running micro-batch; under FSDP2 the count every rank runs."""
        if self.shapes.varies:
            if not replayed:
                self.micro_batch_size = self.shapes.micro(n)
                if self.grow and self.clean_steps >= self.grow_wait:
                    larger = self.shapes.micro(n, probe=True)  # what ran before a failure that may have passed
                    if larger > self.micro_batch_size:
                        self.growing_from, self.micro_batch_size = self.micro_batch_size, larger
                        self.clean_steps = 0
        sizes = split_sizes(n, min(self.micro_batch_size or n, n))
        if self.drain is not None and self.agree.enabled:
            unsettled, self._unsettled = self._unsettled, None
            count, shaped, worst_peak = self.drain.start_attempt(self.agree, len(sizes), self.shapes.varies,
                                                                 peak=unsettled[3] if unsettled else 0)
            self.shapes.agreed = self.shapes.agreed or shaped
            if unsettled is not None:
                self._settle(unsettled, worst_peak)  # from the next step on: this attempt's count is agreed
            if count != len(sizes):
                if count > n:
                    raise RuntimeError(_DIFFERENT_SPLITS)  # each FSDP2 forward gathers parameters: ranks run alike
                sizes = split_even(n, count)
        return sizes

    def _zero_grad_once(self, original: Callable[[], None], optimizer: torch.optim.Optimizer) -> Callable[[], None]:
        """Lightning's zero-grad function (``on_before_zero_grad`` hooks, then ``optimizer_zero_grad``) as its own
        accumulation runs it: on the first micro-batch of each closure evaluation (gradients add up over the
        others), once per evaluation of a step: a replay only drops the gradients (an EMA in the hook moves once)."""
        def zero_grad() -> None:
            if self.index != 0:
                return
            evaluation = self.update.evaluations
            if evaluation in self._zeroed:
                optimizer.zero_grad(set_to_none=True)
                return
            original()
            self._zeroed.add(evaluation)

        return zero_grad

    def _metric_states(self, module: torch.nn.Module) -> MetricStates:
        """The model's torchmetrics states and norm layers' running statistics now (looked up once per fit)."""
        if self._metrics is None:
            self._metrics = MetricStates.find(module)
        return MetricStates(self._metrics)

    def _multi_closure(self, closure: Callable[[], Any], module: torch.nn.Module, parallel_model: Any,
                       optimizer: torch.optim.Optimizer) -> Callable[[], Any]:
        drain = self.drain if self.agree.enabled and self.sharded else None

        def run_micro_batches() -> Any:
            total = None
            failure: BaseException | None = None
            extras: list[Any] = []
            self.update.evaluation_starts()
            for i in range(len(self.sizes)):
                self.index = i
                self.logs.n = self.sizes[i]
                # DDP: no reduction in any micro-batch (averaged after the vote). FSDP2 (no no_sync): every backward
                # reduce-scatters as in Lightning's accumulation, so gradients stay sharded (not 28 GB/rank for 7B).
                if drain is not None:
                    drain.begin(i)
                try:
                    with no_sync(parallel_model if self.agree.enabled else None):
                        loss = closure()
                except BaseException as exc:
                    if not (self.agree.enabled and is_oom_error(exc) and not (drain and drain.unsupported)):
                        raise
                    # DDP: no collective in the micro-batches, bring the failure to the step's vote. FSDP2: drain
                    # first, without the traceback (its frames hold the failed attempt's activations).
                    failure = exc if drain is None else exc.with_traceback(None)
                    if drain is not None:
                        drain.failed(i)
                    break
                if drain is not None:
                    drain.end()
                if loss is not None:
                    total = loss if total is None else total + loss
                    extras.append((closure_extra(closure), self.sizes[i]))
            level = 0 if failure is None else 1 + self._at_floor(self.sizes[0])
            if drain is not None:
                worst = drain.vote(self.agree, level, optimizer, self.device)
                if worst:
                    raise failure if failure is not None else PeerOutOfMemory(fatal=worst > 1)
            if self.agree.enabled and not self.sharded:
                params = list(module.parameters())
                self._vote(params, failure, level)
                self.agree.average_gradients(params, self._used)
            if self._measure and self._byte_limit() is not None:
                # What grows with the micro-batch peaks before the update (whose temporaries do not grow with it:
                # a parameter-sized set for a foreach AdamW). No reset: a per-step reading of the peak stays the step's.
                self._closure_load = self.meter.peaks()[1]
            self.update.prepare(optimizer, ranks=self.agree.enabled)
            self.phase, self.logs.n = "update", None  # the update's hooks log for the whole step, not a part
            if len(extras) > 1 and all(extra for extra, _ in extras):  # outputs besides the loss: the whole batch's
                set_closure_loss(closure, total, extra=combine_outputs([e for e, _ in extras], [k for _, k in extras]))
            else:
                set_closure_loss(closure, total)
            return total

        return run_micro_batches

    def _vote(self, params: list[torch.nn.Parameter], failure: BaseException | None, level: int) -> None:
        """The step's one collective: did any rank run out of memory, have all the same batch size, which gradients to
        reduce, does any split by shape."""
        unsettled, self._unsettled = self._unsettled, None
        failed, same_split, self._used, shaped, worst_peak = self.agree.vote(
            params, failed=level, batch_size=sum(self.sizes), shaped=self.shapes.varies,
            peak=unsettled[3] if unsettled else 0)
        self.shapes.agreed = self.shapes.agreed or shaped
        if unsettled is not None and not failed:
            self._settle(unsettled, worst_peak)
        if failed:
            if failure is not None:
                raise failure
            raise PeerOutOfMemory(fatal=failed > 1)
        if not same_split:
            raise RuntimeError(_DIFFERENT_SPLITS)

    def _at_floor(self, micro: int) -> bool:
        """Whether an OOM at ``micro`` leaves nothing smaller to replay with (see :meth:`_shrink`)."""
        return micro <= self.min_micro_batch_size and not (self.growing_from is not None and self.growing_from < micro)

    def _shrink(self, micro: int, n: int, *, peer: bool = False) -> int | None:
        """The micro-batch to replay with after an OOM at ``micro`` (this rank's, or a ``peer``'s); None when nothing
        smaller is allowed. With varying sample sizes: what the shape model, told of the failure, says fits for sure
        (a peer's failure leaves this rank's split as it was)."""
        if not peer:
            self.shapes.model.failed(micro, self.shapes.size)
        if self.growing_from is not None and self.growing_from < micro:
            return self.growing_from
        self.growing_from = None  # the grow did not apply to this (short) batch: an ordinary OOM
        if self.shapes.varies and peer:
            return micro
        if self._at_floor(micro):
            return None
        smaller = self.shapes.micro(n, confidence=1.0) if self.shapes.varies else micro // 2
        return max(self.min_micro_batch_size, min(micro - 1, smaller))

    def _after_success(self, n: int, micro: int, static: int, global_step: int, *, clean: bool) -> None:
        peak, load = self.meter.peaks() if self._measure else (0, 0)  # the budget's measure, the tensors' (CUDA)
        if self.growing_from is not None:
            self._record("grow", global_step, self.growing_from, micro, peak=peak)
            self.growing_from = None
        self.clean_steps += int(clean)  # a replayed step is not a clean one
        soft = self.budget_bytes is not None and not self.hard_budget
        shapes = self.shapes
        # What grows with the micro-batch: the tensors' peak before the update where it was read, else the step's.
        grows = load if self._closure_load is None else self._closure_load
        if self._measure:
            limit = self._byte_limit()
            shapes.model.set_memory(limit_bytes=None if limit is None else int(GROW_HEADROOM * limit),
                                    static_bytes=static)
        shapes.model.fitted(micro, shapes.size, max(0, grows - static) if self._measure else 0)
        grow_due = self.grow and micro < n and self.clean_steps >= self.grow_wait and not shapes.varies
        # Several ranks, a soft budget, the same shapes everywhere: the worst rank's peak comes with the next step's
        # agreement and is checked then (one step later); a step that may grow agrees at once (growth needs it now).
        deferred = soft and not grow_due and self.agree.enabled and not shapes.agreed
        if (soft or grow_due) and not shapes.agreed and not deferred:  # decisions every rank takes alike: the worst
            peak, load, static, grows = (int(x) for x in self.agree.max(peak, load, static, grows))  # worst rank's
        if self._measure:
            self.last_peak_bytes = peak
        if deferred:
            self._unsettled = (micro, shapes.size, global_step, peak)
            return
        if soft and self._over_budget(micro, shapes.size, peak, global_step, n):
            return
        if not grow_due:
            return
        self.clean_steps = 0
        target = min(n, micro * 2)
        projected = max(static + (grows - static) * target / micro, load if load > grows else 0)
        if self.limit_bytes is None or projected <= GROW_HEADROOM * self.limit_bytes:
            _info(f"autotune: growing the micro-batch {micro} -> {target} "
                  f"(projected peak {format_bytes(int(projected))})")
            self.growing_from = micro
            self.micro_batch_size = target
        else:
            log.debug("autotune: not growing %d -> %d: projected peak %s", micro, target, format_bytes(int(projected)))

    def _byte_limit(self) -> int | None:
        """The bytes a step may not pass where one is known (CUDA's; on a host, a budget's)."""
        return self.limit_bytes if self.hard_budget or self.budget_bytes is not None else None

    def _over_budget(self, micro: int, size: float, peak: int, global_step: int, n: int) -> bool:
        """A soft budget's check of a step's peak (the worst rank's under several ranks): over it, the micro-batch
        shrinks for the next step (or, at the minimum, a warning once). Whether it was over."""
        if self.budget_bytes is None or peak <= self.budget_bytes:
            return False
        shapes = self.shapes
        shapes.model.failed(micro, size)
        if shapes.varies and micro > self.min_micro_batch_size:  # per rank: the next step's split is its own
            self._record("over_budget", global_step, micro, shapes.micro(n), peak=peak)
            self.clean_steps = 0
            release_host_memory()  # the next step is measured at its own need, not the heap this one left
        elif micro > self.min_micro_batch_size:
            smaller = max(self.min_micro_batch_size, micro // 2)
            self._record("over_budget", global_step, micro, smaller, peak=peak)
            self.micro_batch_size = smaller
            self.clean_steps = 0
            release_host_memory()
        elif not self._warned_floor:
            self._warned_floor = True
            log.warning(
                "Step peak %s is over the budget %s at the minimum micro-batch %d; the CPU budget is soft, "
                "training goes on.", format_bytes(peak), self.budget_text, micro,
            )
        return True

    def _settle(self, unsettled: tuple[int, float, int, int], worst_peak: int) -> None:
        """Check the last step's peak, now agreed (the worst rank's), against the soft budget; unless the micro-batch
        changed since (a replay shrank it): that peak says nothing of the new one."""
        micro, size, global_step, _ = unsettled
        if micro == self.micro_batch_size:  # (deferred only where shapes do not vary: ``n`` is not read)
            self._over_budget(micro, size, worst_peak, global_step, micro)

    def _record(self, kind: str, step: int, previous: int, new: int, where: str = "", peak: int | None = None,
                batch_size: int | None = None) -> None:
        if kind in ("oom", "grow_failed", "eval_oom"):
            self.oom_events += 1
            self.clean_steps = 0
        if kind == "over_budget":
            self.over_budget_events += 1
        if kind == "grow_failed":
            self.grow_wait *= 2
        peak = self.meter.peak() if peak is None else peak
        event = ElasticEvent(kind, step, (self.batch_size if batch_size is None else batch_size) or 0, previous, new,
                             where, peak)
        self.events.append(event)
        del self.events[:-1000]  # keep the checkpoint small on very long runs
        _info(f"autotune: {kind} at step {step} ({where or 'step'}): micro-batch {previous} -> {new}")
        warning = _WARN_ONCE.get(kind)
        if warning is not None and kind not in self._warned:
            self._warned.add(kind)
            rank_zero_warn(warning.format(step=step, where=where or "step", previous=previous, new=new,
                                          peak=format_bytes(peak), budget=self.budget_text))

    def _floor_error(self, n: int, micro: int, where: str, *, peer: bool) -> OutOfMemoryAtMinimumError:
        budget = self.budget_text or "none (no cap)"
        who = "another rank" if peer else "this rank"
        return OutOfMemoryAtMinimumError(
            f"Out of memory at the minimum micro-batch ({who}, in the {where or 'step'}): batch size {n}, "
            f"micro-batch {micro} (min_micro_batch_size={self.min_micro_batch_size}), budget {budget}, "
            f"peak {format_bytes(self.meter.peak())}. Reduce memory per sample (precision, activation "
            "checkpointing), lower min_micro_batch_size, or raise the budget."
        )

    # ------------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {
            "micro_batch_size": self.micro_batch_size,
            "clean_steps": self.clean_steps,
            "grow_wait": self.grow_wait,
            "oom_events": self.oom_events,
            "over_budget_events": self.over_budget_events,
            "events": [asdict(e) for e in self.events],
            "eval_micro_batch_size": dict(self.eval_micro_batch_size),
            "shape_model": self.shapes.model.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.micro_batch_size = state.get("micro_batch_size", self.micro_batch_size)
        self.clean_steps = state.get("clean_steps", 0)
        self.grow_wait = state.get("grow_wait", self.grow_wait)
        self.oom_events = state.get("oom_events", 0)
        self.over_budget_events = state.get("over_budget_events", 0)
        self.events = [ElasticEvent(**e) for e in state.get("events", [])]
        self.eval_micro_batch_size = dict(state.get("eval_micro_batch_size", {}))
        self.shapes.model.load_state_dict(state.get("shape_model", {}))

