"""What makes an out-of-memory error inside ``optimizer.step`` replayable: a host copy before the updates that need
one, a fingerprint of the others (a part of :class:`autotune._runtime.microbatch.ElasticEngine`)."""

from __future__ import annotations

from typing import Any

import torch

from autotune._device.oom import OutOfMemoryAtMinimumError
from autotune._runtime.events import _HALF_APPLIED, _STEADY_OF_A_RANK, _UNSEEN, _WHY_OFF, _WHY_STEADY
from autotune._runtime.state import UpdateSnapshot, creates_state, update_fingerprint, update_parameters


class UpdateGuard:
    """Decides, once per attempt of a step, how its update is protected, and undoes or refuses a failed one.

    A host copy (:class:`UpdateSnapshot`) is taken before an update that creates optimizer state: those allocate the
    most and are the ones that run out of memory. It is also taken before every update of an optimizer that evaluates
    the closure more than once in a step (L-BFGS moves the parameters between evaluations, each a whole forward and
    backward).
    Any other update keeps only a fingerprint, so an OOM before it changed anything replays without a copy.
    Parameters that a completed update left without state (SGD without momentum, all but the first of L-BFGS) are
    stateless: they do not make later updates look like ones that create state.
    """

    def __init__(self, *, protect: bool) -> None:
        self.protect = protect
        self.snapshot = UpdateSnapshot()
        self.protected = False
        self.snapshot_bytes = 0  # host bytes copied to protect the last update (0 in steady state)
        self._fingerprint: list[Any] | None = None
        self._prepared = False
        self.evaluations = 0  # closure evaluations in this attempt
        self._reevaluates = False  # the optimizer has called the closure more than once in a step
        self._stateless: set[int] = set()  # ids of parameters a completed update left without state

    def start_attempt(self) -> None:
        self._prepared = False
        self.protected = False
        self.evaluations = 0

    def evaluation_starts(self) -> None:
        """The optimizer calls the closure (once per step, or more: L-BFGS)."""
        self.evaluations += 1
        self._reevaluates = self._reevaluates or self.evaluations > 1

    def prepare(self, optimizer: torch.optim.Optimizer, *, ranks: bool) -> None:
        """Right before the attempt's update (the end of its first closure evaluation; later evaluations run inside
        the update): a host copy of what it changes, or a fingerprint. The same decision on every rank (same
        parameters, same state). ``ranks``: several ranks, where a process may not repeat an update alone."""
        if self._prepared:
            return
        self._prepared = True
        self.protected = self.protect and (self._reevaluates or creates_state(optimizer, stateless=self._stateless))
        if self.protected:
            self.snapshot.capture(optimizer)  # an OOM here leaves nothing to restore: the update has not run
            self.snapshot.wait()
            self.snapshot_bytes = self.snapshot.held_bytes
            self._fingerprint = None
        else:
            self.snapshot_bytes = 0
            # One process may repeat an update that changed nothing; under DDP the peers have moved on.
            self._fingerprint = None if ranks else update_fingerprint(optimizer)

    def succeeded(self, optimizer: torch.optim.Optimizer) -> None:
        """The step's update went through: the parameters it left without state are stateless, the copy is freed."""
        if self.protected:
            state = optimizer.state
            self._stateless.update(id(p) for p in update_parameters(optimizer) if not state.get(p))
            self.snapshot.release()  # steady-state steps hold no host copy

    def check_replayable(self, optimizer: torch.optim.Optimizer, *, cause: BaseException, ranks: bool) -> None:
        """After an OOM in this rank's update: go on when it can be undone (a snapshot) or repeated (it changed
        nothing, one process), else end the run with one clear error.

        Under several ranks a protected update is followed by a vote (the engine's), so the peers roll theirs back
        too. A steady-state update is not (one collective per step): its OOM ends the run on this rank, and the
        launcher ends the others (Lightning's launchers and torchrun stop every rank when one fails); a vote here
        could meet whatever collective a peer makes next and mismatch it."""
        if self.protected:
            return
        why = _WHY_STEADY if self.protect else _WHY_OFF
        if ranks:
            raise OutOfMemoryAtMinimumError(_STEADY_OF_A_RANK.format(why=why)) from cause
        if self._fingerprint is None:  # an update whose changes version counters may not see
            raise OutOfMemoryAtMinimumError(_UNSEEN.format(name=type(optimizer).__name__, why=why)) from cause
        if update_fingerprint(optimizer) != self._fingerprint:
            raise OutOfMemoryAtMinimumError(_HALF_APPLIED.format(why=why)) from cause
