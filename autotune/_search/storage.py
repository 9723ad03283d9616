"""Optuna storage from a URL: SQLite (default, one process), journal file (many workers on one machine),
PostgreSQL (many machines); heartbeat where the storage has one, and dead-worker recovery where it has not; and a
study's identity: its default name and the stamp a resumed study must match."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from autotune._compat.optuna import journal_file_path, study_storage, trial_id

DEFAULT_STORAGE = "sqlite:///autotune.db"
HEARTBEAT_SECONDS = 2
GRACE_SECONDS = 8
_ACCEPTED = "sqlite:///PATH, postgresql://USER:PASSWORD@HOST:PORT/DB, or journal:PATH"


def open_storage(url: str | None, *, read_only: bool = False) -> Any:
    """An Optuna storage for ``url`` (None: ``sqlite:///autotune.db`` in the current folder).

    With ``read_only`` (``autotune report``) nothing is created or written: a SQLite or journal file must exist, a
    SQLite file is opened read-only, and no database table is created.

    Raises:
        ValueError: for a malformed URL, a storage that cannot be reached, or (``read_only``) one that does not exist,
            in one line.
    """
    import optuna

    url = shown = url or DEFAULT_STORAGE
    path = storage_file(url)
    if url.startswith("journal:"):
        if not path:
            raise ValueError(f"storage '{url}' has no file path; expected {_ACCEPTED}")
        _check_place(url, path, must_exist=read_only)
        _check_content(url, path, journal=True, read_only=read_only)
        from optuna.storages.journal import JournalFileBackend

        try:
            return optuna.storages.JournalStorage(JournalFileBackend(path))
        except Exception as err:  # a file that is no journal: binary, YAML, a half-written line
            raise ValueError(f"storage '{url}': '{path}' is not an Optuna journal file ({type(err).__name__}: "
                             f"{' '.join(str(err).split())[:200]}); give a new path or one a search wrote") from None
    if url.startswith("sqlite:///") and path:
        if path.startswith(":memory:") or "mode=memory" in url:
            raise ValueError(f"storage '{url}' keeps nothing once the search ends, so it cannot be resumed or "
                             f"reported; expected {_ACCEPTED}")
        _check_place(url, path, must_exist=read_only)
        _check_content(url, path, journal=False, read_only=read_only)
        if read_only:  # SQLite's read-only mode: even a file that is no Optuna study is left as it is
            url = f"sqlite:///file:{os.path.abspath(path)}?mode=ro&uri=true"
    elif not url.startswith(("postgresql://", "postgresql+psycopg2://", "postgresql+psycopg://")) or "/" not in url[
        len("postgresql://") :
    ]:
        raise ValueError(f"storage '{url}' is not a storage URL; expected {_ACCEPTED}")
    try:
        with warnings.catch_warnings():  # heartbeat and retry are marked experimental; we rely on them knowingly
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return _rdb(url, read_only=read_only)
    except ImportError as err:
        raise ValueError(f"storage '{_redact(shown)}' needs a database driver: {err} "
                         "(pip install 'lightning-autotune[postgres]')") from None
    except Exception as err:  # SQLAlchemy raises many types for a server it cannot reach
        while err.__cause__ is not None or err.__context__ is not None:  # Optuna's wrapper hides the reason
            err = err.__cause__ or err.__context__  # type: ignore[assignment]
        message = " ".join(str(err).split("(Background on this error")[0].split())[:300]
        raise ValueError(f"cannot open storage '{_redact(shown)}': {type(err).__name__}: {message}") from None


def _check_content(url: str, path: str, *, journal: bool, read_only: bool) -> None:
    """Refuse a file that is there and not empty but is no Optuna journal (its first line a journal entry) or no
    SQLite database (its header), before Optuna opens it: a journal is appended to before it is read; and, to read,
    an empty one."""
    if not os.path.isfile(path):
        return
    if not os.path.getsize(path):
        if read_only:
            raise ValueError(f"storage '{url}': '{path}' is empty (no search has used it)")
        return
    with open(path, "rb") as f:
        head = f.readline(1 << 20) if journal else f.read(16)
    if journal:
        try:
            entry = json.loads(head)
        except ValueError:
            entry = None
        if isinstance(entry, dict) and "op_code" in entry:
            return
    elif head == b"SQLite format 3\x00":
        return
    kind = "an Optuna journal file" if journal else "a SQLite database"
    raise ValueError(f"storage '{url}': '{path}' is not {kind}; give a new path or one a search wrote")


def _check_place(url: str, path: str, *, must_exist: bool) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"storage '{url}': folder '{folder}' does not exist")
    if os.path.isdir(path):
        raise ValueError(f"storage '{url}': '{path}' is a folder; give a file path")
    if must_exist and not os.path.isfile(path):
        raise ValueError(f"storage '{url}': file '{path}' does not exist (no search has used it)")
    # A search writes the file, and SQLite and the journal's lock write beside it.
    if not must_exist and not (os.access(folder, os.W_OK) and (not os.path.exists(path) or os.access(path, os.W_OK))):
        raise ValueError(f"storage '{url}': '{path}' or its folder is not writable")


def storage_file(url: str | None) -> str | None:
    """The file a SQLite or journal storage URL names (None for a server)."""
    url = url or DEFAULT_STORAGE
    if url.startswith("journal:"):
        return url[len("journal:") :].removeprefix("//") or None
    if url.startswith("sqlite:///"):
        return url[len("sqlite:///") :].split("?")[0] or None
    return None


def _rdb(url: str, *, read_only: bool = False) -> Any:
    import optuna
    from optuna.storages import RetryHeartbeatStaleTrialCallback

    engine_kwargs = {"pool_pre_ping": True} if url.startswith("postgresql") else None
    if read_only:
        return optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs, skip_table_creation=True)
    return optuna.storages.RDBStorage(
        url,
        heartbeat_interval=HEARTBEAT_SECONDS,
        grace_period=GRACE_SECONDS,
        heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=1),
        engine_kwargs=engine_kwargs,
    )


def _redact(url: str) -> str:
    if "@" in url and ":" in url.split("@", 1)[0].split("//", 1)[-1]:
        scheme, rest = url.split("//", 1)
        user = rest.split(":", 1)[0]
        return f"{scheme}//{user}:***@{rest.split('@', 1)[1]}"
    return url


@contextlib.contextmanager
def exclusive(storage: Any) -> Iterator[None]:
    """Hold a lock shared by the workers of a journal file (one machine) while seeding a study; RDB storages
    make the duplicate check themselves."""
    import optuna

    path = journal_file_path(storage) if isinstance(storage, optuna.storages.JournalStorage) else None
    if path is None:
        yield
        return
    import fcntl

    with open(f"{path}.seed-lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def worker_id() -> str:
    """This worker, as recorded on the trials it runs: ``host:pid``."""
    return f"{socket.gethostname()}:{os.getpid()}"


def recover_dead_workers(study: Any) -> list[int]:
    """Journal storage has no heartbeat: fail RUNNING trials whose worker (on this host) is dead, and queue their
    parameters once more. Returns the numbers of the trials failed."""
    import optuna
    from optuna.trial import TrialState

    if not isinstance(study_storage(study), optuna.storages.JournalStorage):
        return []
    failed = []
    host = socket.gethostname()
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        worker = trial.user_attrs.get("worker", "")
        worker_host, _, pid = worker.rpartition(":")
        if worker_host != host or not pid.isdigit() or _alive(int(pid)):
            continue
        study_storage(study).set_trial_state_values(trial_id(trial), TrialState.FAIL)
        failed.append(trial.number)
        if "retry_of" not in trial.user_attrs:  # retried once, as heartbeat storages do
            study.enqueue_trial(trial.params, user_attrs={"retry_of": trial.number})
    return failed


def requeue_interrupted(study: Any) -> list[int]:
    """Queue once more the parameters of each trial a Ctrl-C interrupted (failed with status ``interrupted``), or that
    failed in the target's own code (``target_error``: fixed since, or it fails again at once), that no trial retries
    yet. Returns their numbers."""
    from optuna.trial import TrialState

    retried = {t.user_attrs.get("retry_of") for t in study.get_trials(deepcopy=False)}
    again = [t for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,))
             if (t.user_attrs.get("status") == "interrupted" or t.user_attrs.get("target_error"))
             and t.number not in retried]
    for trial in again:
        study.enqueue_trial(trial.params, user_attrs={"retry_of": trial.number})
    return [t.number for t in again]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ------------------------------------------------------------------------------------------ study identity
def study_name(target: str, budget: Any, space: Any, device: Any) -> str:
    """``autotune-<target>-<budget>-<space>-<device>``: the same command resumes the same study.

    A file target is named with its folder (``gpt-train.py:make``): two projects' ``train.py`` searched from one folder
    (one ``autotune.db``) get two studies, not one refused for its other target."""
    file = target.partition(":")[0]
    stem = Path(target).name
    if file.endswith((".py", ".yaml", ".yml")):
        stem = f"{Path(file).resolve().parent.name}-{stem}"
    return "autotune-" + re.sub(r"[^A-Za-z0-9_.:-]+", "-", stem) + f"-{budget}-{space.name}-{device.type}"


def digest(*what: Any) -> str:
    """A short digest of what a study's measurements depend on (a space's dimensions, a config file's bytes)."""
    import hashlib

    return hashlib.sha256(repr(what).encode()).hexdigest()[:12]


def stamp_study(study: Any, attrs: dict[str, Any]) -> None:
    """Record what the study is about; a resumed study must be about the same thing."""
    existing = study.user_attrs
    clashes = [f"{k} {existing[k]!r} (now {v!r})" for k, v in attrs.items() if k in existing and existing[k] != v]
    if clashes:
        raise ValueError(f"study '{study.study_name}' was created for another search: {', '.join(clashes)}; "
                         "use another --study name")
    for key, value in attrs.items():
        if key not in existing:
            study.set_user_attr(key, value)
