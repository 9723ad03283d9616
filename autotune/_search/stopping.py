"""When a search stops: enough measured trials, or trials that keep failing; and Ctrl-C's quiet exit."""

from __future__ import annotations

import logging
from typing import Any

from autotune._search.auto import point_key

__all__ = ["MaxMeasured", "OPTUNA_OPTIMIZE", "StopOnFailures", "drop_interrupts", "finished"]

log = logging.getLogger("autotune")

OPTUNA_OPTIMIZE = "optuna.study._optimize"  # the logger of Optuna's "Trial N failed" warnings


def drop_interrupts(record: logging.LogRecord) -> bool:
    """Keep Optuna's warnings but those for a trial that Ctrl-C interrupted (its error, and the "failed with value
    None" line that follows every failure)."""
    message = record.getMessage()
    return "KeyboardInterrupt" not in message and not message.endswith("failed with value None.")


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
    """Stop a search whose trials keep failing (a broken target): after 5 failures in a row, or ``trials`` in all."""

    def __init__(self, trials: int) -> None:
        self.limit, self.in_a_row, self.total = trials, 0, 0

    def __call__(self, study: Any, trial: Any) -> None:
        from optuna.trial import TrialState

        failed = trial.state == TrialState.FAIL
        self.in_a_row = self.in_a_row + 1 if failed else 0
        self.total += int(failed)
        if self.in_a_row >= 5 or self.total >= self.limit:
            log.warning("autotune: stopping the search: %d trials failed (last: %s)", self.total,
                        trial.user_attrs.get("reason", "see autotune report"))
            study.stop()
