"""When a search stops: enough measured trials, trials that keep failing, or the target's own code failing; and
Optuna's failure reports replaced by one line each (Ctrl-C's by none)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from autotune._search.auto import point_key
from autotune._target.failure import TargetCodeError

__all__ = ["MaxMeasured", "OPTUNA_OPTIMIZE", "STOPPED_BY_TARGET", "StopOnFailures", "finished", "quiet_failures",
           "recording_target_failure"]

log = logging.getLogger("autotune")

OPTUNA_OPTIMIZE = "optuna.study._optimize"  # the logger of Optuna's "Trial N failed" warnings
#: The study attribute that says why a search stopped when the target's own code failed: the error's lines (None once
#: a later run of the search got past that point).
STOPPED_BY_TARGET = "stopped_by_target"


def quiet_failures(record: logging.LogRecord) -> bool:
    """Keep Optuna's warnings but its report of a trial that failed the way the search expects (a trial that crashed,
    which :class:`StopOnFailures` says in one line; one that Ctrl-C interrupted): its error with our objective's
    traceback, and the "failed with value None" line that follows every failure."""
    message = record.getMessage()
    return not ("KeyboardInterrupt" in message or "error: TrialCrashed(" in message
                or message.endswith("failed with value None."))


@contextlib.contextmanager
def recording_target_failure(study: Any) -> Iterator[None]:
    """Record on ``study`` (``STOPPED_BY_TARGET``) why the search stops when the target's own code fails
    (:class:`~autotune._target.failure.TargetCodeError`), and clear an earlier run's record: this run starts again
    from where that one stopped."""
    if study.user_attrs.get(STOPPED_BY_TARGET):
        study.set_user_attr(STOPPED_BY_TARGET, None)
    try:
        yield
    except TargetCodeError as err:
        study.set_user_attr(STOPPED_BY_TARGET, list(err.lines))
        ran = sum(1 for t in study.get_trials(deepcopy=False) if t.user_attrs.get("source") == "measured")
        err.add(f"the search stopped {f'after {ran} trial(s)' if ran else 'before its first trial'}; its study "
                f"'{study.study_name}' is kept: fix the code and run the same command again to resume it")
        raise


def _finished_states() -> tuple[Any, ...]:
    from optuna.trial import TrialState

    return (TrialState.COMPLETE, TrialState.PRUNED)


def finished(study: Any) -> int:
    """Finished trials that measured or estimated a plan (a re-proposed plan served from the cache does not count)."""
    return len([t for t in study.get_trials(deepcopy=False, states=_finished_states())
                if t.user_attrs.get("source") != "cache"])


class MaxMeasured:
    """Stop once the study has ``trials`` finished trials that were not cache hits, or has nothing left to try.

    Nothing is left when every point of the space has an answer (measured, or from the cache) and no point is queued
    again (an ``auto`` point tried again at another micro-batch). As a guard for a small space the sampler keeps
    re-proposing, it also stops at three times ``trials`` in all."""

    def __init__(self, trials: int, space_size: int) -> None:
        self.trials, self.space_size = trials, space_size

    def __call__(self, study: Any, trial: Any) -> None:
        from optuna.trial import TrialState

        # Points, not plans: an 'auto' point tried again at another micro-batch is one point of several plans, and a
        # point whose plan another point measured ('auto' resolving to 16, then 16) is answered by the cache.
        points = {point_key(t.params) for t in study.get_trials(deepcopy=False, states=_finished_states())}
        everything = len(study.get_trials(deepcopy=False, states=(*_finished_states(), TrialState.FAIL)))
        queued = bool(study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))
        covered = len(points) >= self.space_size and not queued
        if finished(study) >= self.trials or covered or everything >= 3 * self.trials:
            study.stop()


class StopOnFailures:
    """Say each failed trial in one line, and stop a search whose trials keep failing: after 5 failures in a row, or
    ``trials`` in all; and at once where two trials in a row of different plans fail in the target's own code at the
    same place (the failure does not depend on the plan: :class:`~autotune._target.failure.TargetCodeError`)."""

    def __init__(self, trials: int) -> None:
        self.limit, self.in_a_row, self.total = trials, 0, 0
        self.last_target_error: tuple[str, tuple[str, ...]] | None = None  # the plan and lines of the last failure

    def __call__(self, study: Any, trial: Any) -> None:
        from optuna.trial import TrialState

        failed = trial.state == TrialState.FAIL
        self.in_a_row = self.in_a_row + 1 if failed else 0
        self.total += int(failed)
        lines = tuple(trial.user_attrs.get("target_error") or ()) if failed else ()
        if failed and trial.user_attrs.get("status") != "interrupted":
            where = f" ({lines[1].strip()})" if len(lines) > 1 else ""
            log.warning("autotune: trial %d (%s) failed: %s%s", trial.number, trial.user_attrs.get("plan", "?"),
                        trial.user_attrs.get("reason", "no reason recorded"), where)
        last, plan, place = self.last_target_error, str(trial.user_attrs.get("plan_key")), lines[1:] or lines
        if lines and last is not None and last[1] == place and last[0] != plan:
            raise TargetCodeError([*lines, f"(the same in trials of two plans: {trial.user_attrs.get('plan', '?')} "
                                           f"and the one before it)"])
        if not failed or lines:
            self.last_target_error = (plan, place) if lines else None
        if self.in_a_row >= 5 or self.total >= self.limit:
            log.warning("autotune: stopping the search: %d trials failed (last: %s)", self.total,
                        trial.user_attrs.get("reason", "see autotune report"))
            study.stop()
