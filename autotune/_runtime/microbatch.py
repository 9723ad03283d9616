"""The engine behind :class:`autotune.callbacks.ElasticBatchSize`: run a step's micro-batches, replay it after an OOM.

One optimizer step of Lightning runs ``optimizer.step(closure)``. The engine hands the optimizer a closure that calls
Lightning's own closure once per micro-batch (``training_step`` is wrapped to cut micro-batch ``i`` out of the batch
and weight its loss), so forward, backward and the update of every micro-batch surface in one place. An out-of-memory
error there is caught, gradients are dropped, the parameters and optimizer state are put back when the update itself
failed, the random state and the module's buffers are restored, and the same batch is replayed at the micro-batch the
policy (:mod:`autotune._runtime.policy`) gives. Lightning sees one successful ``optimizer_step`` per batch: its step
counters, LR schedulers and gradient clipping are untouched. Under several ranks each attempt ends in one vote on every
rank (:mod:`autotune._runtime.agreement`), whatever happened on it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from autotune._compat.lightning import closure_extra, set_closure_loss, wrap_zero_grad
from autotune._compat.torch import forget_scaler_steps
from autotune._device.meter import MemoryMeter, release_host_memory
from autotune._device.oom import OutOfMemoryAtMinimumError, is_oom_error
from autotune._runtime.agreement import HEADER, Agreement, Failure, PeerOutOfMemory, StepFailed, Verdict
from autotune._runtime.batch import (
    batch_size_of, combine_outputs, passed_whole, scale_step_output, slice_batch, split_even, split_sizes,
)
from autotune._runtime.drain import CollectiveDrain
from autotune._runtime.evaluation import loop_votes, run_eval_step
from autotune._runtime.events import _COUNTS_DIFFER, _DIFFERENT_SPLITS, _NOT_SPLIT, _PASSED_WHOLE, floor_message
from autotune._runtime.gradients import GradientAverager
from autotune._runtime.guard import CollectiveGuard
from autotune._runtime.logbuffer import LogBuffer
from autotune._runtime.policy import MicroBatchPolicy, StepPeaks
from autotune._runtime.state import MetricStates, RNGState, release_memory
from autotune._runtime.sync import DDPBuffers, no_sync
from autotune._runtime.update import UpdateGuard


class ElasticEngine:
    """Runs each training step's attempts for one fit and tells the policy what happened; owned by the callback."""

    def __init__(self, *, policy: MicroBatchPolicy, protect_update: bool, device: torch.device, world_size: int,
                 log_fn: Callable[..., Any], sharded: bool = False, collectives: bool = False) -> None:
        self.policy = policy
        self.device = device
        self.agree = Agreement(device, world_size)
        self.logs = LogBuffer(log_fn)
        self.meter = MemoryMeter(device)
        self.sharded = sharded  # FSDP2: the module's own reduce-scatter; an OOM is drained, voted and replayed
        self.guard = CollectiveGuard()
        self.drain = CollectiveDrain(self.guard.passing) if sharded else None
        self.gradients = GradientAverager()
        self.update = UpdateGuard(protect=protect_update)
        #: Whether the ranks run equal counts of micro-batches: FSDP2 (its forwards gather parameters) and a model
        #: that makes collectives of its own in its micro-batches (known at setup, or learned from a vote).
        self.counts_agree = sharded or collectives
        self.eval_votes = False  # the evaluation loop running votes its steps (see autotune._runtime.evaluation)
        self.eval_counts_agree = False  # ... and its ranks run equal counts of parts (its steps make collectives)
        if self.agree.enabled:
            self.guard.install()
        self._zeroed: set[int] = set()  # the closure evaluations of this step whose zero-grad function ran
        self._hooked: set[int] = set()  # ... whose on_before_optimizer_step hooks ran
        self._metrics: tuple[list[torch.nn.Module], Any] | None = None
        self._warned: set[str] = set()
        # Per step.
        self.batch_size: int | None = None
        self.sizes: list[int] = []
        self.index = 0
        self.phase = "closure"
        self.last_peak_bytes = 0
        self._measure = True  # whether this step reads the peak (see start_batch)
        self._closure_load: int | None = None  # the tensors' peak before the update, where a byte limit is known
        self._voted = False  # this attempt's vote was taken
        self._params: list[torch.nn.Parameter] = []  # the module's parameters this step (the DDP vote's order)

    # ---------------------------------------------------------------------------------------- the policy's view
    @property
    def micro_batch_size(self) -> int | None:
        return self.policy.micro_batch_size

    @property
    def shapes(self) -> Any:
        return self.policy.shapes

    @property
    def events(self) -> list[Any]:
        return self.policy.events

    @property
    def oom_events(self) -> int:
        return self.policy.oom_events

    @property
    def over_budget_events(self) -> int:
        return self.policy.over_budget_events

    def eval_loop_starts(self, batches: list[float]) -> None:
        """An evaluation loop of ``batches`` steps per dataloader starts (on every rank alike)."""
        self.eval_votes = loop_votes(self, batches)

    def run_eval_step(self, stage: str, step: Callable[..., Any], batch: Any, args: tuple, kwargs: dict,
                      module: torch.nn.Module) -> Any:
        """An evaluation step, split after an OOM (see :func:`autotune._runtime.evaluation.run_eval_step`)."""
        return run_eval_step(self, stage, step, batch, args, kwargs, module)

    def close(self) -> None:
        """Undo what the engine installed for the fit (the collectives' wrappers)."""
        self.guard.remove()

    # ----------------------------------------------------------------------------------------------- training
    def start_batch(self, batch: Any, *, logged: bool = True) -> None:
        """Called with the host batch before the step: fixes the step's batch size ``N``. ``logged``: whether this
        step's peak is logged (without a budget on the host the peak is read only where it is used: 0.2 ms a step)."""
        policy = self.policy
        memory = policy.memory
        self._measure = logged or memory.budget_bytes is not None or self.meter.is_cuda or (
            policy.grow and policy.clean_steps + 1 >= policy.grow_wait and not policy.shapes.varies)
        self.batch_size = batch_size_of(batch)
        self.sizes = [self.batch_size] if self.batch_size else []
        self.index = 0
        if self.batch_size:
            policy.start_batch(batch, self.batch_size)
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
        self._params = list(module.parameters())
        buffers = DDPBuffers(parallel_model)  # broadcast at the step's start, as Lightning's accumulation does
        rng = RNGState()
        states = self._metric_states(module)
        static = self.meter.start() if self._measure else 0
        replayed, left_before = False, False
        self._zeroed = set()
        self._hooked = set()
        wrap_zero_grad(closure, lambda original: self._zero_grad_once(original, optimizer))
        micro = self.policy.micro_for(n)
        while True:
            self.sizes = self._agreed_split(n, micro)
            buffers.before_attempt()
            self.phase = "closure"
            self.update.start_attempt()
            self._closure_load = None
            self._voted = False
            self.logs.start()
            try:
                result = step(self._multi_closure(closure, module, parallel_model, optimizer))
                failed = self._after_update(optimizer) if self.agree.enabled and self.update.protected else None
            except BaseException as exc:
                self.logs.discard()
                failed = self._failure_of(exc, optimizer, module)
            if failed is None:
                break
            verdict = failed.verdict
            if verdict.floor_rank is not None:
                raise OutOfMemoryAtMinimumError(floor_message(verdict, n, policy=self.policy, ranks=self.agree.enabled)) from failed.cause
            if verdict.left and left_before:
                raise RuntimeError(_COUNTS_DIFFER)  # equal counts and still apart: collectives that follow the data
            left_before = left_before or verdict.left
            # Recover outside the except block: its traceback holds the frames of the failed attempt.
            if self.drain is not None:
                self.drain.reset(optimizer)  # FSDP2's iteration state and unsharded gradients, on every rank
            optimizer.zero_grad(set_to_none=True)
            release_memory(module.parameters(), self.device, static_bytes=static)
            if failed.where == "update" and self.update.protected:
                self.update.snapshot.restore()
            if scaler is not None:
                forget_scaler_steps(scaler)  # forget unscale_/inf checks of the failed attempt
            rng.restore()
            states.restore()
            next_micro = self.policy.after_oom(ran=self.sizes[0], n=n, own=failed.own, step=global_step,
                                               where=failed.where, peak=self.meter.peak())
            if next_micro is None:  # cannot happen: the vote's floor rank is this one then
                raise OutOfMemoryAtMinimumError(floor_message(verdict, n, policy=self.policy, ranks=self.agree.enabled))
            micro = next_micro
            replayed = True
            static = self.meter.start() if self._measure else 0
        self.logs.flush(parts=len(self.sizes))
        buffers.after_step()
        self.update.succeeded(optimizer)
        peaks = self._peaks(static) if self._measure else None
        self.last_peak_bytes = peaks.peak if peaks is not None else self.last_peak_bytes
        over = self.policy.over_budget_events
        self.policy.after_success(n=n, ran=self.sizes[0], clean=not replayed, step=global_step, peaks=peaks,
                                  count=len(self.sizes))
        if self.policy.over_budget_events > over:
            release_host_memory()  # the smaller next step is measured at its own need, not the heap this one left
        return result

    def _agreed_split(self, n: int, micro: int) -> list[int]:
        """This attempt's micro-batch sizes: ``micro`` at a time, or, where the ranks run equal counts, the largest
        count any rank wants, this rank's batch split evenly into it."""
        sizes = split_sizes(n, min(micro, n))
        count = len(sizes)
        if self.agree.enabled and self.drain is not None:
            count = self.drain.start_attempt(self.agree, count)
        elif self.agree.enabled and self.counts_agree:
            count = int(self.agree.max(float(count))[0])
        even = self.agree.enabled and self.counts_agree
        if count != len(sizes) or even:
            if count > n:
                raise RuntimeError(_DIFFERENT_SPLITS)  # ranks run alike: a rank with fewer samples cannot
            # Equal counts, equal sizes: every rank (of equal batches) splits evenly, also the one whose own count is
            # the largest, so a collective whose size follows the micro-batch (an all-gather of its rows) agrees.
            sizes = split_even(n, count)
        self.agree.start_attempt(HEADER if self.sharded else HEADER + len(self._params))
        return sizes

    def _after_update(self, optimizer: torch.optim.Optimizer) -> StepFailed | None:
        """After this rank's protected update succeeded: the peers' say on theirs (every rank protects alike)."""
        verdict = self.agree.after_update(Failure())
        return StepFailed(verdict, own=False, where="update") if verdict.failed else None

    def _failure_of(self, exc: BaseException, optimizer: torch.optim.Optimizer,
                    module: torch.nn.Module) -> StepFailed:
        """What an exception out of the step means for every rank (re-raised when it is not a memory failure)."""
        if isinstance(exc, StepFailed):
            return exc
        if not is_oom_error(exc):
            raise exc
        if self.drain is not None and self.drain.unsupported and self.agree.enabled:
            raise OutOfMemoryAtMinimumError(self.drain.unsupported_error()) from exc
        failure = Failure(True, self.policy.at_floor(self.sizes[0]), self.sizes[0], self.phase, self.meter.peak())
        if self._voted:  # after the vote: inside the update (or preparing it), which every rank reached
            failure = failure._replace(where="update")
            self.update.check_replayable(optimizer, cause=exc, ranks=self.agree.enabled)
            verdict = self.agree.after_update(failure) if self.agree.enabled else self._local(failure)
            return StepFailed(verdict, own=True, where="update", cause=exc.with_traceback(None))
        # Out of the step before its vote (inside ``optimizer.step``, before it called the closure): the peers are in
        # their micro-batches or their vote; this rank's vote must meet them there.
        cause = exc.with_traceback(None)
        verdict = self._vote(failure, left=False, module=module, optimizer=optimizer)
        return StepFailed(verdict, own=True, where="closure", cause=cause)

    def _local(self, failure: Failure) -> Verdict:
        return Verdict(failed=failure.failed, floor_rank=0 if failure.at_floor else None, floor_micro=failure.micro,
                       floor_where=failure.where, floor_peak=failure.peak, left=False, collectives=False,
                       same_batch=True, used=[])

    def _multi_closure(self, closure: Callable[[], Any], module: torch.nn.Module, parallel_model: Any,
                       optimizer: torch.optim.Optimizer) -> Callable[[], Any]:
        def run_micro_batches() -> Any:
            total = None
            failure, left, cause = Failure(), False, None
            extras: list[Any] = []
            drain = self.drain if self.agree.enabled else None
            self.update.evaluation_starts()
            with self.guard.window(self._guard_point):
                for i in range(len(self.sizes)):
                    self.index = i
                    self.logs.n = self.sizes[i]
                    if drain is not None:
                        drain.begin(i)
                    try:
                        # DDP: no reduction in any micro-batch (averaged after the vote). FSDP2 (no no_sync): every
                        # backward reduce-scatters as in Lightning's accumulation, so gradients stay sharded.
                        with no_sync(parallel_model if self.agree.enabled else None):
                            loss = closure()
                    except BaseException as exc:
                        if isinstance(exc, PeerOutOfMemory):  # raised at a guard: a peer failed or left
                            left = exc.left
                            if drain is not None:
                                drain.stop()
                            break
                        if not is_oom_error(exc) or (drain is not None and drain.unsupported):
                            raise
                        failure = Failure(True, self.policy.at_floor(self.sizes[0]), self.sizes[0], "closure",
                                          self.meter.peak())
                        cause = exc.with_traceback(None)
                        if drain is not None:
                            drain.failed(i)
                        break
                    if drain is not None:
                        drain.end()
                    if loss is not None:
                        total = loss if total is None else total + loss
                        extras.append((closure_extra(closure), self.sizes[i]))
            # Out of the loop (and its except block, whose traceback holds the failed attempt's activations). Every
            # evaluation of the closure votes (L-BFGS evaluates it several times, inside its update).
            verdict = self._vote(failure, left=left, module=module, optimizer=optimizer)
            if verdict.replay or verdict.floor_rank is not None:
                raise StepFailed(verdict, own=failure.failed, where=self.phase, cause=cause)
            if not verdict.same_batch:
                raise RuntimeError(_DIFFERENT_SPLITS)
            if self.agree.enabled and not self.sharded:
                self._average(verdict.used)
            if self._measure and self.policy.memory.limit_bytes is not None:
                # What grows with the micro-batch peaks before the update (whose temporaries do not grow with it).
                self._closure_load = self.meter.peaks()[1]
            self.update.prepare(optimizer, ranks=self.agree.enabled)
            self.phase, self.logs.n = "update", None  # the update's hooks log for the whole step, not a part
            if len(extras) > 1 and all(extra for extra, _ in extras):  # outputs besides the loss: the whole batch's
                set_closure_loss(closure, total, extra=combine_outputs([e for e, _ in extras], [k for _, k in extras]))
            else:
                set_closure_loss(closure, total)
            return total

        return run_micro_batches

    def _guard_point(self) -> None:
        """Before a collective of the model's own inside a micro-batch: noted for the drain, then the guard."""
        if self.drain is not None:
            self.drain.guard_point()
        self.agree.guard(self.sizes[self.index] if self.sizes else 0)

    def _vote(self, failure: Failure, *, left: bool, module: torch.nn.Module,
              optimizer: torch.optim.Optimizer) -> Verdict:
        """The attempt's vote, after what a failed rank owes its peers (FSDP2: the collectives they still expect)."""
        self._voted = True
        if self.drain is not None and self.agree.enabled:
            self.drain.before_vote(failure.failed, optimizer, self.device)
        used: list[bool] = []
        if self.agree.enabled and not self.sharded:
            params = self._params
            used = [p.grad is not None for p in params]
            if not (failure.failed or left):
                try:
                    used = self.gradients.prepare(params)
                except BaseException as exc:
                    if not is_oom_error(exc):
                        raise
                    failure = Failure(True, self.policy.at_floor(self.sizes[0]), self.sizes[0], "closure",
                                      self.meter.peak())
        verdict = self.agree.vote(failure, left=left, batch_size=sum(self.sizes), used=used)
        if self.drain is not None and self.agree.enabled:
            self.drain.end_attempt()
        if verdict.collectives:
            self.counts_agree = True  # the model makes collectives in its micro-batches: ranks run equal counts
        return verdict if self.agree.enabled else self._local(failure)

    def _average(self, used: list[bool]) -> None:
        """DDP: average the gradients some rank got; an OOM making a missing one is every rank's replay."""
        params = self._params
        self.gradients.forget_unused(params, used)
        try:
            self.gradients.average(params, used, self.agree.any)
        except (torch.OutOfMemoryError, PeerOutOfMemory) as exc:
            own = isinstance(exc, torch.OutOfMemoryError)
            verdict = Verdict(failed=True, floor_rank=None, floor_micro=0, floor_where="", floor_peak=0, left=False,
                              collectives=False, same_batch=True, used=used)
            raise StepFailed(verdict, own=own, where=self.phase) from None

    def _peaks(self, static: int) -> StepPeaks:
        peak, load = self.meter.peaks()  # the budget's measure, the tensors' (CUDA)
        grows = load if self._closure_load is None else self._closure_load
        return StepPeaks(peak=peak, static=static, grows=grows, load=load)

    def hooks_due(self) -> bool:
        """Whether the ``on_before_optimizer_step`` hooks are to run after this closure evaluation: once per
        evaluation of a step, not again when the step is replayed after an OOM in its update (they ran then)."""
        evaluation = self.update.evaluations
        if evaluation in self._hooked:
            return False
        self._hooked.add(evaluation)
        return True

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

    def _metric_states(self, module: torch.nn.Module, *, training: bool = True) -> MetricStates:
        """The model's torchmetrics states and buffers now (looked up once per fit)."""
        if self._metrics is None:
            self._metrics = MetricStates.find(module)
        return MetricStates(self._metrics, training=training)

    # ------------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return self.policy.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.policy.load_state_dict(state)
