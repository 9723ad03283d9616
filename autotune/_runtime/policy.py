"""The micro-batch policy of :class:`autotune.callbacks.ElasticBatchSize`: which micro-batch a step runs, and what
changes after an out-of-memory error, a clean step or a step over a soft budget.

The policy is this rank's alone and pure: it makes no collective, reads no device and runs no step. The engine
(:mod:`autotune._runtime.microbatch`) runs the attempts and tells the policy what happened. A fixed-shape run halves
after its own OOM and doubles after ``grow_after`` clean steps when the projected peak leaves room; once a rank's
batches vary in shape, each step's split comes from the shape model (:mod:`autotune._runtime.shapes`). Another
rank's OOM makes this rank replay the step at its own micro-batch: it changes nothing here.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import asdict
from typing import Any, NamedTuple

from autotune._device.budget import format_bytes
from autotune._runtime.batch import split_sizes
from autotune._runtime.events import _WARN_ONCE, ElasticEvent
from autotune._runtime.shapes import ShapeSplit

log = logging.getLogger("autotune")

#: Grow only when the step's peak (CUDA: its tensors') scaled to the larger micro-batch stays under this share of the
#: limit; the shape model's byte cap too. The rest is the allocator's fragmentation (an OOM there is replayed).
GROW_HEADROOM = 0.9


class Memory(NamedTuple):
    """What the policy knows of this process's memory.

    ``budget_bytes`` is the budget resolved (None: no budget). ``limit_bytes`` is what a step may not pass, where one is
    known (CUDA's cap or device, a host budget). ``hard`` says whether the budget is hard (CUDA: the allocator raises at
    it) or soft (a host budget, checked after each step). ``budget_text`` is the budget as the user wrote it."""

    budget_bytes: int | None = None
    limit_bytes: int | None = None
    hard: bool = False
    budget_text: str | None = None


class StepPeaks(NamedTuple):
    """A step's measured memory: ``peak`` in the budget's measure (CUDA's reserve; the host's resident set),
    ``static`` what it held before its first micro-batch, ``grows`` what grows with the micro-batch (the tensors' peak
    before the update, or the step's), ``load`` the tensors' peak of the whole step (the update's temporaries too)."""

    peak: int = 0
    static: int = 0
    grows: int = 0
    load: int = 0


class MicroBatchPolicy:
    """This rank's micro-batch size and its growth state; one per fit (saved in checkpoints).

    Example:
        >>> policy = MicroBatchPolicy(micro_batch_size=32, min_micro_batch_size=1, grow=False, grow_after=50)
        >>> policy.start_batch({"x": __import__("torch").zeros(64, 8)}, 64)
        >>> policy.micro_for(64), policy.after_oom(ran=32, n=64, own=True, step=0, where="closure")
        (32, 16)
        >>> policy.after_oom(ran=16, n=64, own=False, step=0, where="closure")  # another rank's: nothing changes
        16
    """

    def __init__(self, *, micro_batch_size: int | None, min_micro_batch_size: int, grow: bool, grow_after: int,
                 memory: Memory = Memory(), sample_size: Callable[[Any], float] | None = None,
                 micro_batch_sample_size: float | None = None, rank: int | None = None) -> None:
        self._micro = micro_batch_size
        self.min_micro_batch_size = min_micro_batch_size
        self.grow = grow
        self.grow_wait = grow_after
        self.memory = memory
        self.clean_steps = 0
        self.growing_from: int | None = None
        self.oom_events = 0
        self.over_budget_events = 0
        self.events: list[ElasticEvent] = []
        self.eval_micro_batch_size: dict[str, int] = {}
        self.shapes = ShapeSplit(sample_size=sample_size, min_micro_batch_size=min_micro_batch_size)
        if micro_batch_sample_size is not None and micro_batch_size is not None:
            self.shapes.seed(micro_batch_size, micro_batch_sample_size)
        self._rank = rank  # named in messages under several ranks
        self._warned: set[str] = set()
        self._warned_floor = False
        self._batch_size = 0

    @property
    def micro_batch_size(self) -> int | None:
        """The micro-batch this rank runs next (None before the first batch when starting from the whole batch)."""
        return self._micro

    # --------------------------------------------------------------------------------------------- per step
    def start_batch(self, batch: Any, n: int) -> None:
        """A batch of ``n`` samples begins: its sample size (the shape model's input)."""
        self._batch_size = n
        self.shapes.start(batch, n)

    def micro_for(self, n: int) -> int:
        """The micro-batch of the step's first attempt: the shape model's choice once this rank's sample sizes vary
        (a larger one probed when growing is due), else the running one (the whole batch at first)."""
        if self._micro is None:
            self._micro = n
        if self.shapes.varies:
            self._micro = self.shapes.micro(n)
            if self.grow and self.clean_steps >= self.grow_wait:
                larger = self.shapes.micro(n, probe=True)  # a split the evidence allows that was not taken
                if larger > self._micro:
                    self.growing_from, self._micro = self._micro, larger
                    self.clean_steps = 0
        return min(self._micro, n)

    def at_floor(self, micro: int) -> bool:
        """Whether an OOM at ``micro`` leaves nothing smaller to replay with (a failed grow goes back instead)."""
        return micro <= self.min_micro_batch_size and not (self.growing_from is not None and self.growing_from < micro)

    def after_oom(self, *, ran: int, n: int, own: bool, step: int, where: str, peak: int = 0) -> int | None:
        """The micro-batch to replay the step with after an OOM at ``ran`` samples: this rank's (``own``) or another
        rank's. Another rank's changes nothing here: the replay runs this rank's own micro-batch. None: this rank
        failed at its minimum."""
        if not own:
            self._record("peer_oom", step, ran, min(self._micro or n, n), where, peak)
            return min(self._micro or n, n)
        self.shapes.model.failed(ran, self.shapes.size)
        if self.growing_from is not None and self.growing_from < ran:
            back, self.growing_from = self.growing_from, None
            self.grow_wait *= 2
            self._record("grow_failed", step, ran, back, where, peak)
            self._micro = back
            return back
        self.growing_from = None  # a grow that did not apply to this (short) batch: an ordinary OOM
        if self.at_floor(ran):
            return None
        smaller = self.shapes.micro(n, confidence=1.0) if self.shapes.varies else ran // 2
        self._micro = max(self.min_micro_batch_size, min(ran - 1, smaller))
        self._record("oom", step, ran, self._micro, where, peak)
        return self._micro

    def after_success(self, *, n: int, ran: int, clean: bool, step: int, peaks: StepPeaks | None,
                      count: int | None = None) -> None:
        """The step ran at ``ran`` samples per micro-batch (``clean``: at its first attempt) in ``count`` micro-batches
        (None: as many as ``ran`` at a time makes); ``peaks``: what it measured (None: not measured). Learns from it,
        checks a soft budget, and grows when growing is due."""
        grew = False
        if self.growing_from is not None:
            if ran > self.growing_from:  # (not when other ranks' count held this one to what it ran before)
                self._record("grow", step, self.growing_from, ran, peak=peaks.peak if peaks else 0)
                grew = True
            self.growing_from = None
        self.clean_steps += int(clean)
        shapes, memory = self.shapes, self.memory
        limit = memory.limit_bytes if memory.hard or memory.budget_bytes is not None else None
        if peaks is not None and limit is not None:
            shapes.model.set_memory(limit_bytes=int(GROW_HEADROOM * limit), static_bytes=peaks.static)
        shapes.model.fitted(ran, shapes.size, max(0, peaks.grows - peaks.static) if peaks is not None else 0)
        if peaks is not None and self._over_budget(ran, n, step, peaks.peak, grew=grew):
            return
        # The ranks' count ran more micro-batches than this rank's own split would (an even split of the same count
        # as this rank's own, whose largest part is below the micro-batch, is not held).
        own = len(split_sizes(n, min(self._micro, n))) if self._micro is not None else 1
        held = self._micro is not None and (count if count is not None else len(split_sizes(n, ran))) > own
        if held or not (self.grow and ran < n and self.clean_steps >= self.grow_wait and not shapes.varies):
            return
        self.clean_steps = 0
        target = min(n, ran * 2)
        if peaks is None:
            projected = 0.0
        else:
            grows = peaks.grows - peaks.static
            projected = max(peaks.static + grows * target / ran, peaks.load if peaks.load > peaks.grows else 0)
        if memory.limit_bytes is None or projected <= GROW_HEADROOM * memory.limit_bytes:
            log.info("autotune: growing the micro-batch %d -> %d%s (projected peak %s)", ran, target, self._where(),
                     format_bytes(int(projected)))
            self.growing_from, self._micro = ran, target
        else:
            log.debug("autotune: not growing %d -> %d: projected peak %s", ran, target, format_bytes(int(projected)))

    def _over_budget(self, ran: int, n: int, step: int, peak: int, *, grew: bool = False) -> bool:
        """A soft budget's check of this rank's step peak: over it, the micro-batch shrinks for the next step (at the
        minimum, a warning once). Whether it was over.

        A step that ``grew`` and went over is a failed grow, as an OOM would be: the wait before the next one doubles
        (else a run would grow back into the same overflow every ``grow_after`` steps)."""
        budget = self.memory.budget_bytes
        if budget is None or self.memory.hard or peak <= budget:
            return False
        shapes = self.shapes
        shapes.model.failed(ran, shapes.size)
        if ran > self.min_micro_batch_size:
            smaller = shapes.micro(n) if shapes.varies else max(self.min_micro_batch_size, ran // 2)
            self._record("over_budget", step, ran, smaller, peak=peak)
            if not shapes.varies:
                self._micro = smaller
            self.clean_steps = 0
            if grew:
                self.grow_wait *= 2
        elif not self._warned_floor:
            self._warned_floor = True
            log.warning("Step peak %s is over the budget %s at the minimum micro-batch %d%s; the CPU budget is soft, "
                        "training goes on.", format_bytes(peak), self.memory.budget_text, ran, self._where())
        return True

    # ------------------------------------------------------------------------------------------- evaluation
    def eval_micro(self, stage: str, n: int) -> int:
        """The split of a ``stage`` evaluation batch of ``n`` samples (whole until one ran out of memory)."""
        return min(self.eval_micro_batch_size.get(stage, n), n)

    def after_eval_oom(self, stage: str, micro: int, *, step: int, n: int) -> int | None:
        """Half the evaluation split after an OOM at ``micro`` (None at one sample)."""
        if micro <= 1:
            return None
        self.eval_micro_batch_size[stage] = micro // 2
        self._record("eval_oom", step, micro, micro // 2, stage, batch_size=n)
        return micro // 2

    # ---------------------------------------------------------------------------------------------- events
    def _where(self) -> str:
        return "" if self._rank is None else f" on rank {self._rank}"

    def _record(self, kind: str, step: int, previous: int, new: int, where: str = "", peak: int = 0,
                batch_size: int | None = None) -> None:
        if kind in ("oom", "grow_failed", "eval_oom"):
            self.oom_events += 1
            self.clean_steps = 0
        if kind == "over_budget":
            self.over_budget_events += 1
        event = ElasticEvent(kind, step, batch_size if batch_size is not None else self._batch_size, previous, new,
                             where, peak)
        self.events.append(event)
        del self.events[:-1000]  # keep the checkpoint small on very long runs
        log.info("autotune: %s at step %d (%s)%s: micro-batch %d -> %d", kind, step, where or "step", self._where(),
                 previous, new)
        warning = _WARN_ONCE.get(kind)
        if warning is not None and kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(warning.format(step=step, where=where or "step", previous=previous, new=new,
                                         peak=format_bytes(peak), budget=self.memory.budget_text, rank=self._where()),
                          stacklevel=2)

    # ------------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            "micro_batch_size": self._micro,
            "clean_steps": self.clean_steps,
            "grow_wait": self.grow_wait,
            "oom_events": self.oom_events,
            "over_budget_events": self.over_budget_events,
            "events": [asdict(e) for e in self.events],
            "eval_micro_batch_size": dict(self.eval_micro_batch_size),
            "shape_model": self.shapes.model.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._micro = state.get("micro_batch_size", self._micro)
        self.clean_steps = state.get("clean_steps", 0)
        self.grow_wait = state.get("grow_wait", self.grow_wait)
        self.oom_events = state.get("oom_events", 0)
        self.over_budget_events = state.get("over_budget_events", 0)
        self.events = [ElasticEvent(**e) for e in state.get("events", [])]
        self.eval_micro_batch_size = dict(state.get("eval_micro_batch_size", {}))
        self.shapes.model.load_state_dict(state.get("shape_model", {}))
