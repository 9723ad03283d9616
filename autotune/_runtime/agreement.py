"""The collectives that keep ranks in step: the step's vote, the guard before a collective inside a micro-batch, and
small agreements (a count, a flag).

Every attempt at a step ends, on every rank, in one **vote**: an all-reduce (maximum) of one vector whatever happened
on the rank: its micro-batches ran, it ran out of memory in one of them or before them, or another rank's failure
stopped it. A collective the model makes inside a micro-batch (SyncBatchNorm, a metric synced on step, expert or
tensor-parallel layers) is preceded by a **guard**: the same all-reduce, of the same vector, marked "still inside its
micro-batches". A rank that failed is in its vote while its peers stand at a guard: the two meet in one all-reduce,
the peers learn of the failure before they enter a collective the failed rank will never join, stop, and vote in
turn. A vote is repeated until no rank is still inside its micro-batches, so every rank leaves with the same result.
Without such collectives a step that no rank fails costs this one vote.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

#: Where a rank at its minimum failed, as the vote carries it.
_WHERE = ("", "closure", "update")
#: The vote's slots (the header); DDP appends one per parameter: whether it got a gradient on some rank. ``_PART``
#: and ``_NEG_PART``: at a guard, the size of the micro-batch running (the largest and, negated, the smallest).
(_FAILED, _FLOOR_RANK, _FLOOR_MICRO, _FLOOR_WHERE, _FLOOR_PEAK, _INSIDE, _DONE, _LEFT, _COLLECTIVES, _BATCH, _NEG,
 _PART, _NEG_PART) = range(13)
HEADER = 13


class PeerOutOfMemory(RuntimeError):
    """Raised on a rank that did not run out of memory itself when another rank did (or, ``left``, when another rank
    left its micro-batches while this one had a collective to make: their splits differed)."""

    def __init__(self, *, left: bool = False) -> None:
        super().__init__("another rank left its micro-batches before this rank's collective" if left
                         else "another rank ran out of memory in this step")
        self.left = left


class Failure(NamedTuple):
    """This rank's part of a vote: whether it ran out of memory, and at its minimum micro-batch (``micro``, ``where``,
    ``peak`` then say how)."""

    failed: bool = False
    at_floor: bool = False
    micro: int = 0
    where: str = ""
    peak: int = 0


class Verdict(NamedTuple):
    """What every rank learns from a vote."""

    failed: bool  # some rank ran out of memory: every rank replays
    floor_rank: int | None  # the rank that failed at its minimum micro-batch (the run ends on every rank), or None
    floor_micro: int
    floor_where: str
    floor_peak: int
    left: bool  # a rank had a collective to make after another left its micro-batches (their splits differed)
    collectives: bool  # some rank made collectives of its own inside its micro-batches
    same_batch: bool  # every rank had a batch of the same size
    used: list[bool]  # which parameters got a gradient on some rank (DDP)

    @property
    def replay(self) -> bool:
        return self.failed or self.left


class StepFailed(RuntimeError):
    """An attempt at the step failed on some rank (the ``verdict`` every rank reached); ``own``: on this one."""

    def __init__(self, verdict: Verdict, *, own: bool, where: str, cause: BaseException | None = None) -> None:
        super().__init__("a rank ran out of memory in this step")
        self.verdict, self.own, self.where = verdict, own, where
        self.cause = cause  # this rank's own error, its traceback dropped (it held the failed attempt's activations)


class Agreement:
    """The collectives that keep ranks in step; everything is local when there is one process."""

    def __init__(self, device: torch.device, world_size: int) -> None:
        self.enabled = world_size > 1 and dist.is_available() and dist.is_initialized()
        self.device = device
        self.rank = dist.get_rank() if self.enabled else 0
        self.votes = 0  # collectives made to agree (not the gradients' all-reduces), for benchmarks and tests
        self.width = HEADER  # the vote's length this step (a guard sends as many values)
        self.guards = 0  # guards passed in this attempt

    def max(self, *values: float) -> list[float]:
        """The element-wise maximum of ``values`` over ranks."""
        if not self.enabled:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64 if self.device.type != "mps" else torch.float32)
        t = t.to(self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        self.votes += 1
        return t.tolist()

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on any rank."""
        return self.max(1.0 if flag else 0.0)[0] > 0 if self.enabled else flag

    def start_attempt(self, width: int) -> None:
        """An attempt begins: its vote (and every guard in it) carries ``width`` values."""
        self.width = width
        self.guards = 0

    def guard(self, size: int = 0) -> None:
        """Before a collective inside a micro-batch of ``size`` samples (0: not known): one all-reduce of the vote's
        shape, marked inside. Raises :class:`PeerOutOfMemory` when another rank failed or left its micro-batches (it
        will not join the collective), or stands at its guard in a micro-batch of another size (``left``: their splits
        differ, and a collective whose size follows the micro-batch would not agree)."""
        if not self.enabled:
            return
        values = [0.0] * self.width
        values[_INSIDE] = values[_COLLECTIVES] = 1.0
        values[_NEG] = -float("inf")
        values[_PART], values[_NEG_PART] = (float(size), -float(size)) if size else (0.0, -float("inf"))
        reduced = self.max(*values)
        self.guards += 1
        if reduced[_FAILED] > 0:
            raise PeerOutOfMemory()
        if reduced[_DONE] > 0 or (reduced[_NEG_PART] > -float("inf") and reduced[_PART] != -reduced[_NEG_PART]):
            raise PeerOutOfMemory(left=True)

    def vote(self, failure: Failure, *, left: bool = False, batch_size: int = 0,
             used: list[bool] | None = None) -> Verdict:
        """The attempt's vote: this rank's ``failure`` (or ``left``: another rank's failure or departure stopped it),
        its batch size and (DDP) which parameters got a gradient; repeated until no rank is inside its micro-batches
        (a peer standing at a guard meets it there, and votes in turn)."""
        used = used or []
        values = [0.0] * max(self.width, HEADER + len(used))
        values[_FAILED] = float(failure.failed)
        if failure.at_floor:
            values[_FLOOR_RANK] = float(self.rank + 1)
            values[_FLOOR_MICRO] = float(failure.micro)
            values[_FLOOR_WHERE] = float(_WHERE.index(failure.where) if failure.where in _WHERE else 0)
            values[_FLOOR_PEAK] = float(failure.peak)
        values[_DONE] = 1.0
        values[_LEFT] = float(left)
        values[_COLLECTIVES] = float(self.guards > 0)
        values[_BATCH], values[_NEG] = float(batch_size), -float(batch_size)
        values[_NEG_PART] = -float("inf")  # a guard that meets this vote compares its size with its peers' guards only
        values[HEADER:HEADER + len(used)] = [1.0 if u else 0.0 for u in used]
        while True:
            reduced = self.max(*values)
            if not self.enabled or reduced[_INSIDE] == 0:
                break
        floor = int(reduced[_FLOOR_RANK])
        return Verdict(
            failed=reduced[_FAILED] > 0, floor_rank=floor - 1 if floor else None,
            floor_micro=int(reduced[_FLOOR_MICRO]), floor_where=_WHERE[int(reduced[_FLOOR_WHERE])],
            floor_peak=int(reduced[_FLOOR_PEAK]), left=reduced[_LEFT] > 0, collectives=reduced[_COLLECTIVES] > 0,
            same_batch=int(reduced[_BATCH]) == int(-reduced[_NEG]),
            used=[u > 0 for u in reduced[HEADER:HEADER + len(used)]])

    def after_update(self, failure: Failure) -> Verdict:
        """After a protected update (one every rank protects alike): did any rank's update run out of memory, and at
        its minimum? Every rank then rolls its update back and replays."""
        values = [float(failure.failed), float(self.rank + 1) if failure.at_floor else 0.0, float(failure.micro),
                  float(_WHERE.index("update")), float(failure.peak)]
        reduced = self.max(*values) if self.enabled else values
        floor = int(reduced[1])
        return Verdict(failed=reduced[0] > 0, floor_rank=floor - 1 if floor else None, floor_micro=int(reduced[2]),
                       floor_where="update", floor_peak=int(reduced[4]), left=False, collectives=False,
                       same_batch=True, used=[])
