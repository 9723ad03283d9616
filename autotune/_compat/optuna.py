"""Private Optuna API that autotune uses, each access with what breaks if it changes: a study's storage, a trial's
storage id and enqueued parameters, a journal file's path, failing a queued trial."""

from __future__ import annotations

from typing import Any


def study_storage(study: Any) -> Any:
    """The storage a ``Study`` reads and writes (``Study._storage``; Optuna has no public accessor). If it went away,
    dead-worker recovery on journal storage would fail."""
    return study._storage


def trial_id(trial: Any) -> int:
    """The storage's id of a ``FrozenTrial`` (``FrozenTrial._trial_id``, what storage methods take; ``number`` is
    per study). Public ``study.tell(number, state=FAIL)`` is not used: it would also run the sampler's
    ``after_trial`` for a trial this worker did not run. If it went away, dead-worker recovery would fail."""
    return int(trial._trial_id)


def enqueued_params(trial: Any) -> dict[str, Any]:
    """The parameters a waiting trial was enqueued with (its ``system_attrs["fixed_params"]``, where
    ``Study.enqueue_trial`` keeps them; a waiting trial's ``params`` are empty until it runs). If Optuna kept them
    elsewhere, a search would no longer see which queued plans its step-time model has ruled out, and would not stop
    early while any is queued."""
    return dict(trial.system_attrs.get("fixed_params") or {})


def journal_file_path(storage: Any) -> str | None:
    """The file of a ``JournalStorage`` on a ``JournalFileBackend`` (``JournalStorage._backend._file_path``), or
    None. If either changed, workers seeding one study through a journal file would not take the shared lock, and
    could enqueue the same seed trials twice."""
    return getattr(getattr(storage, "_backend", None), "_file_path", None)


def fail_waiting(study: Any, trial: Any, attrs: dict[str, Any]) -> None:
    """Fail a waiting (queued, never run) trial with ``attrs`` as its user attributes: Optuna has no public call to
    take a trial off the queue, so this goes to the study's storage (``Study._storage``,
    ``FrozenTrial._trial_id``). If either changed, a search whose model was contradicted could not drop the trials
    it had queued by the model's first order."""
    from optuna.trial import TrialState

    storage, number = study_storage(study), trial_id(trial)
    for key, value in attrs.items():
        storage.set_trial_user_attr(number, key, value)
    storage.set_trial_state_values(number, state=TrialState.FAIL)
