"""What a trial takes of the user's Trainer config: its plain settings and its callbacks, less what a trial sets or
turns off itself (a trial measures the run you train, not a different one)."""

from __future__ import annotations

from typing import Any

__all__ = ["user_callbacks", "user_trainer_settings"]

#: Trainer settings a trial sets itself (the measurement, the plan, the devices): the user's are not taken.
_TRIAL_OWNS = frozenset(
    "accelerator devices num_nodes strategy precision accumulate_grad_batches max_steps max_epochs min_steps "
    "min_epochs max_time logger callbacks enable_checkpointing enable_progress_bar enable_model_summary num_sanity_val_steps "
    "limit_train_batches limit_val_batches limit_test_batches limit_predict_batches val_check_interval "
    "check_val_every_n_epoch default_root_dir fast_dev_run profiler overfit_batches log_every_n_steps plugins".split())


def user_trainer_settings(trainer_config: dict[str, Any]) -> dict[str, Any]:
    """The settings of the user's ``trainer:`` config that a trial's Trainer takes as they are: every plain value
    (gradient clipping, ``deterministic``, ``detect_anomaly``, ``benchmark``, ...) but those a trial sets itself
    (``_TRIAL_OWNS``); loggers and plugins are left out, callbacks are :func:`user_callbacks`. A trial measures the
    run you train."""
    return {k: v for k, v in trainer_config.items()
            if k not in _TRIAL_OWNS and v is not None and isinstance(v, (bool, int, float, str))}


#: Callbacks a trial leaves out: what it turns off (checkpoints, validation, progress bars, summaries, loggers), what
#: changes the run's batch (the tuners), and the plan's own callbacks (the trial adds them with the plan's settings).
_TRIAL_DROPS = ("ModelCheckpoint", "EarlyStopping", "ProgressBar", "ModelSummary", "LearningRateMonitor",
                "DeviceStatsMonitor", "BatchSizeFinder", "LearningRateFinder", "ElasticBatchSize", "ApplyPlan")


def user_callbacks(trainer_config: dict[str, Any], *, folders: tuple[str, ...] = ()) -> tuple[list[Any], list[str]]:
    """The callbacks of the user's ``trainer.callbacks`` (LightningCLI's ``class_path``/``init_args`` form, a list
    or one) that a trial runs with, built anew with ``folders`` on ``sys.path`` (the config's and the current one,
    as LightningCLI has them), and the class names of the kept ones (for the provenance); those of
    ``_TRIAL_DROPS`` and their subclasses are left out."""
    entries = trainer_config.get("callbacks") or []
    entries = entries if isinstance(entries, list) else [entries]
    if not entries:
        return [], []
    from lightning.pytorch.cli import instantiate_class

    from autotune._target.config import on_sys_path

    kept = []
    with on_sys_path(folders):
        for entry in entries:
            callback = instantiate_class((), {"class_path": entry} if isinstance(entry, str) else entry)
            if not any(cls.__name__ in _TRIAL_DROPS for cls in type(callback).__mro__):
                kept.append(callback)
    return kept, [type(c).__name__ for c in kept]
