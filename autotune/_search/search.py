"""``autotune.search``: Optuna finds the fastest plan that fits the budget, measured in isolated trials.

:func:`search` runs five steps: check the inputs (the budget resolved to bytes, once), open the study (load the
target, create or resume the study, the objective of :mod:`autotune._search.objective`), run the trials, choose the
best plan, write it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune._device.budget import Budget, ResolvedBudget, format_bytes, resolve_budget
from autotune._plan.plan import Plan
from autotune._plan.provenance import Provenance
from autotune._plan.space import SearchSpace, default_space_name, load_space, plan_for, quiet_list_choices
from autotune._search.choose import Figure, choose, no_fit_message
from autotune._search.confirm import (
    GUIDED, FollowWhatIsMeasured, chosen_prediction, learn_speed, stop_when_confirmed,
)
from autotune._search.halving import halving_key, walk_ladder
from autotune._search.inert import without_inert
from autotune._search.objective import Objective, TrialCrashed
from autotune._search.speed import guided_trials
from autotune._search.stopping import (
    OPTUNA_OPTIMIZE, MaxMeasured, StopOnFailures, finished, quiet_failures, recording_target_failure,
)
from autotune._search.storage import (
    digest, exclusive, open_storage, recover_dead_workers, requeue_interrupted, stamp_study, storage_file, study_name,
)
from autotune._search.trial import check_interval, check_positive_int, start_trial_server
from autotune._search.twin import measure_twin, twin_key

if TYPE_CHECKING:
    import torch

    from autotune._estimate.estimate import BatchSizes

log = logging.getLogger("autotune")


class NoFeasiblePlanError(RuntimeError):
    """No trial fitted in the budget; the message names the smallest peak seen and its plan."""


@dataclass(frozen=True)
class SearchResult:
    """What :func:`search` found: the best plan (with provenance), the Optuna study, and notes on the space."""

    plan: Plan
    study: Any
    trial_number: int
    notes: tuple[str, ...] = ()
    figure: Figure | None = None  # the chosen plan's throughput over all its runs, with its interval


def search(
    *,
    target: str,
    budget: str | int | float | Budget,
    config: str | None = None,
    space: str | None = None,
    trials: int = 30,
    timeout: float | None = None,
    storage: str | None = None,
    study: str | None = None,
    out: str | Path | None = "tuned.yaml",
    seed: int | None = None,
    steps: int = 20,
    warmup: int = 2,
    interval: float = 0.03,
    device: str | None = None,
    devices: int = 1,
    trial_timeout: float = 600.0,
    callbacks: Sequence[Callable[[Any, Any], None]] = (),
    command: str | None = None,
) -> SearchResult:
    """Search the plan space for the fastest plan whose measured peak memory fits ``budget``.

    Every trial trains the target in a fresh process and measures end-to-end samples/s (data loading included) with
    its 95% interval, and peak memory: warm-up until the step time is stable, then timed steps until the interval is
    within ``interval`` or ``steps`` steps. The budget is an Optuna constraint; an OOM is a completed, infeasible
    trial. The estimator orders the first trials (plans predicted to fit, fastest predicted first) and rejects plans
    predicted far over the budget without running them. Before choosing, the plans whose intervals overlap the
    leader's are measured again. Rerunning the same call resumes the study (``trials`` is the total for the study).

    Args:
        target: ``path/to/file.py:factory``, ``package.module:factory`` or a LightningCLI config file.
        budget: memory the run may use: ``"4GiB"``, bytes, a fraction of the device like ``0.8``, or ``"auto"``;
            resolved to bytes once, against ``device``, and every trial is capped at and judged against those bytes.
        config: a LightningCLI config giving the rest of a factory target (trainer settings).
        space: a shipped space (``default``, ``cpu``, ``multi_gpu``) or a YAML path; None picks one for the device.
        trials: finished trials the study should have (a resumed study counts the ones it has).
        timeout: stop starting trials after this many seconds.
        storage: ``sqlite:///PATH`` (default ``sqlite:///autotune.db``), ``journal:PATH`` or ``postgresql://...``.
        study: the study name; None derives it from target, budget, space and device, so a rerun resumes.
        out: where the best plan is written (atomically); None writes nothing.
        seed: the sampler's seed.
        steps: timed optimizer steps per trial at most.
        warmup: untimed optimizer steps per trial at least (more while the step time settles).
        interval: a trial stops timing once its 95% interval is within +- this share of its throughput.
        device: ``"cpu"`` or ``"cuda"`` (default: CUDA when there is one).
        devices: devices (ranks) per trial, for the multi-device spaces (DDP, FSDP2); a sharded plan records it.
        trial_timeout: seconds before a trial is stopped and recorded as failed.
        callbacks: Optuna callbacks ``f(study, trial)`` (the CLI's progress display is one).
        command: the command line, for the tuned file's provenance.

    Returns:
        The best plan, the study and the trial it came from.

    Raises:
        ValueError: for bad input (budget, target, space, storage, ``out``), before anything is written.
        NoFeasiblePlanError: when no plan fits, naming the smallest peak seen.
        TargetCodeError: (a ``ValueError``) when the target's own code fails, whatever the plan: before the first
            trial where the estimator or the short first run meets it (``lines``: the exception and the user's frames);
            the study records it (``stopped_by_target``) and the same call resumes once it is fixed.

    Example:
        >>> result = search(target="examples/gpt/train.py:make", budget="2GiB", trials=10)  # doctest: +SKIP
        >>> result.plan.describe()  # doctest: +SKIP
    """
    checked = _check_inputs(target=target, budget=budget, config=config, space=space, storage=storage, out=out,
                            trials=trials, steps=steps, warmup=warmup, devices=devices, interval=interval,
                            timeout=timeout, seed=seed, device=device)
    start_trial_server()  # its imports run while this process loads the target and the study
    with contextlib.ExitStack() as cleanup:
        opened = _open_study(cleanup, checked, target=target, config=config, space=space, storage=storage,
                             study=study, seed=seed, trials=trials, devices=devices, steps=steps, warmup=warmup,
                             interval=interval, trial_timeout=trial_timeout)
        _run_trials(cleanup, opened, trials=trials, timeout=timeout, callbacks=callbacks)
        best, figure = _choose_best(opened)
        return _write_plan(opened, best, figure, out=checked.out, command=command)


@dataclass(frozen=True)
class _Checked:
    """What the input checks give the steps after them: where to write, the device, the budget in bytes."""

    out: Path | None
    device: torch.device
    budget: ResolvedBudget


@dataclass(frozen=True)
class _Opened:
    """An open study and what runs it: the objective, the space (inert settings dropped), the budget."""

    study: Any
    storage: Any
    name: str
    space: SearchSpace
    runner: Objective
    budget: ResolvedBudget
    batch_size: int
    devices: int
    guided: int  # the first trials, queued in order (the seeds, then the estimator's ranking)
    trial_timeout: float


def _check_inputs(*, target: str, budget: str | int | float | Budget, config: str | None, space: str | None,
                  storage: str | None, out: str | Path | None, trials: int, steps: int, warmup: int, devices: int,
                  interval: float, timeout: float | None, seed: int | None, device: str | None) -> _Checked:
    """Refuse bad input before anything is loaded or written; resolve the device and the budget (text to bytes, the
    one conversion: trials get these bytes)."""
    import torch

    from autotune._device.probe import resolve_device

    parsed = Budget.parse(budget)  # a bad budget is named first
    check_positive_int("trials", trials)
    check_positive_int("steps", steps)
    check_positive_int("warmup", warmup, minimum=1)  # timing starts at the end of the last warm-up step
    check_positive_int("devices", devices)
    check_interval(interval)
    if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
        raise ValueError(f"timeout {timeout} is not a positive number of seconds")
    if seed is not None and not (isinstance(seed, int) and 0 <= seed < 2**32):
        raise ValueError(f"seed {seed} is not an integer from 0 to 2**32 - 1")
    out_path = _check_out(out, inputs={"storage": storage_file(storage), "space": space, "config": config,
                                       "target": target.rpartition(":")[0] if ":" in target else target})
    dev = resolve_device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    return _Checked(out=out_path, device=dev, budget=resolve_budget(parsed, dev))


def _open_study(cleanup: contextlib.ExitStack, checked: _Checked, *, target: str, config: str | None,
                space: str | None, storage: str | None, study: str | None, seed: int | None, trials: int,
                devices: int, steps: int, warmup: int, interval: float, trial_timeout: float) -> _Opened:
    """Load the target and the space, create the study or resume it (what its trials measured reaches the models),
    and build the objective; ``cleanup`` takes back Optuna's log level and the objective's files at the end."""
    import optuna

    from autotune._target.target import load_target

    budget, dev = checked.budget, checked.device
    tgt = load_target(target, config=config)
    batch_size = tgt.batch_size()
    weights = sum(p.numel() * p.element_size() for p in tgt.model.parameters())
    if weights >= budget.budget_bytes:
        raise ValueError(f"budget {budget} ({format_bytes(budget.budget_bytes)}) is below the model's weights alone "
                         f"({format_bytes(weights)}); raise the budget")
    loaded_space = load_space(space or default_space_name(dev))
    space_obj = loaded_space.for_device(dev, batch_size=batch_size)
    tgt.check_runnable(next((d.choices for d in space_obj.dimensions if d.name == "strategy"), ("auto",)))
    stor = open_storage(storage)
    name = study or study_name(target, budget.budget, space_obj, dev)
    cleanup.callback(optuna.logging.set_verbosity, optuna.logging.get_verbosity())  # the caller's level comes back
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # no INFO line per trial
    cleanup.enter_context(quiet_list_choices())  # block class names as choices: Optuna stores them by index
    guided = guided_trials(trials, len(space_obj.seeds))
    # The sampler models the measurements from the first unguided trial on (Optuna's default waits for 10).
    sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=guided)
    the_study = optuna.create_study(study_name=name, storage=stor, direction="maximize", sampler=sampler,
                                    load_if_exists=True)
    cleanup.enter_context(recording_target_failure(the_study))  # the target's own code failing stops it: say so
    stamp_study(the_study, {
        "target": target, "budget": budget.text, "space": space_obj.name, "device": dev.type,
        "batch_size": batch_size, "devices": devices,
        "space_content": digest(loaded_space.dimensions, loaded_space.seeds),  # as written, before the device's cut
        "config_content": digest(Path(config).read_bytes()) if config else None})
    the_study.set_user_attr("budget_bytes", budget.budget_bytes)  # "auto" and fractions resolve anew on each run
    runner = Objective(target=target, config=config, target_obj=tgt, space=space_obj, budget=budget, device=dev,
                       devices=devices, steps=steps, warmup=warmup, interval=interval, trial_timeout=trial_timeout)
    cleanup.callback(runner.close)
    space_obj = runner.space = without_inert(space_obj, runner.estimator.inert)  # settings doing nothing here
    recover_dead_workers(the_study)
    requeue_interrupted(the_study)
    runner.learn_context(the_study)  # a resumed search: the context its trials measured
    learn_speed(the_study, runner.speed, devices)  # and the speeds, which calibrate the step-time model
    return _Opened(study=the_study, storage=stor, name=name, space=space_obj, runner=runner, budget=budget,
                   batch_size=batch_size, devices=devices, guided=guided, trial_timeout=trial_timeout)


def _run_trials(cleanup: contextlib.ExitStack, opened: _Opened, *, trials: int, timeout: float | None,
                callbacks: Sequence[Callable[[Any, Any], None]]) -> None:
    """Run the study's trials up to ``trials`` (a new study's first ones queued: the seeds, then the estimator's
    ranking), then halving's ladder and the leader's plain twin, where they are due."""
    the_study, runner, space, budget_bytes = opened.study, opened.runner, opened.space, opened.budget.budget_bytes
    failures = StopOnFailures(trials)
    if finished(the_study) < trials:
        # a new study (or one whose trials all failed, queued again: the target's code failed, fixed since), its
        # first trials the seeds, then the estimator's ranking
        if all(t.state.name == "FAIL" or (t.state.name == "WAITING" and "retry_of" in t.user_attrs)
               for t in the_study.get_trials(deepcopy=False)):
            runner.measure_baseline()
            with exclusive(opened.storage):
                for index, params in enumerate(runner.first_trials(opened.guided)):
                    the_study.enqueue_trial(params, skip_if_exists=True, user_attrs={GUIDED: index})
        optimize_log = logging.getLogger(OPTUNA_OPTIMIZE)
        optimize_log.addFilter(quiet_failures)  # a failed trial: one line of ours; Ctrl-C: the CLI's one line only
        cleanup.callback(optimize_log.removeFilter, quiet_failures)
        the_study.optimize(
            runner,
            n_trials=None,
            timeout=timeout,
            callbacks=[MaxMeasured(trials, space.size()), failures,
                       FollowWhatIsMeasured(lambda count: _unmeasured(the_study, runner, space, count),
                                            room=lambda study: trials - finished(study)),
                       stop_when_confirmed(runner, space=space, budget_bytes=budget_bytes), *callbacks],
            catch=(TrialCrashed,),
        )

    def run_one() -> None:  # one more trial: halving's rung, the leader's plain twin (or a trial queued before)
        the_study.optimize(runner, n_trials=1, catch=(TrialCrashed,), callbacks=[failures, *callbacks])

    walk_ladder(the_study, space, batch_size=opened.batch_size, budget_bytes=budget_bytes, devices=opened.devices,
                wait_seconds=opened.trial_timeout, run_one=run_one)
    measure_twin(the_study, space, budget_bytes=budget_bytes, devices=opened.devices, run_one=run_one,
                 wait_seconds=opened.trial_timeout)


def _unmeasured(study: Any, runner: Objective, space: SearchSpace, count: int) -> list[dict[str, Any]]:
    """Points of ``space`` neither measured nor queued, as the model ranks them once the study's trials have corrected
    it: the fastest predicted of each precision first (a contradiction says the model compares precisions wrongly,
    not plans of one precision), then the fastest predicted of all; ``count`` of them, or one per precision if more."""
    from optuna.trial import TrialState

    from autotune._compat.optuna import enqueued_params
    from autotune._search.auto import point_key
    from autotune._search.speed import by_precision, modelled_dimensions

    names = set(modelled_dimensions(space))  # the ranked points' dimensions
    taken = {point_key({k: v for k, v in (t.params or enqueued_params(t)).items() if k in names})
             for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED,
                                                               TrialState.WAITING, TrialState.RUNNING))}
    def untaken(sub: SearchSpace, limit: int) -> list[dict[str, Any]]:
        found = runner.ranked(sub, limit + len(taken))
        return [p for p in found if point_key({k: v for k, v in p.items() if k in names}) not in taken][:limit]

    covering = [found[0] for found in (untaken(sub, 1) for sub in by_precision(space)) if found]
    ranked = [p for p in untaken(space, count) if p not in covering]
    return (covering + ranked)[:max(count, len(covering))]


def _choose_best(opened: _Opened) -> tuple[Any, Figure]:
    """The best trial and its figure over all its runs, after its paired comparisons with its rivals (its plain twin,
    halving's plan, the plans within reach: ``choose.py``); NoFeasiblePlanError if none fits."""
    budget_bytes = opened.budget.budget_bytes
    figure = choose(opened.study, budget_bytes, opened.runner.remeasure,
                    twin=twin_key(opened.study, opened.space, budget_bytes=budget_bytes, devices=opened.devices),
                    halving=halving_key(opened.study, opened.space, batch_size=opened.batch_size,
                                        budget_bytes=budget_bytes, devices=opened.devices))
    if figure is None:
        raise NoFeasiblePlanError(no_fit_message(opened.study, str(opened.budget), opened.budget.budget_bytes))
    return opened.study.trials[figure.trial], figure


def _write_plan(opened: _Opened, best: Any, figure: Figure, *, out: Path | None, command: str | None) -> SearchResult:
    """The chosen plan with its provenance (what was measured and predicted), written to ``out`` where given."""
    runner, budget = opened.runner, opened.budget
    tokens = best.user_attrs.get("tokens_per_second")
    measured = plan_for(best.params, best.user_attrs.get("micro_batch_size"), opened.devices,
                        best.user_attrs.get("recompute"))
    if opened.devices > 1:  # its figures were measured on that many ranks, whatever the strategy
        measured = measured.replace(devices=opened.devices)
    predicted = best.user_attrs.get("predicted_peak_bytes")  # None: it ran untraced
    plan = measured.replace(
        budget=budget.text,
        provenance=Provenance.here(
            budget=budget.text, device_name=budget.device_name, device_total_bytes=budget.total_bytes,
            samples_per_second=figure.samples_per_second, samples_per_second_interval=[figure.low, figure.high],
            measurements=len(figure.runs),
            tokens_per_second=tokens * figure.samples_per_second / best.user_attrs["samples_per_second"]
            if tokens else None,
            peak_bytes=figure.peak_bytes,
            predicted_peak_bytes=predicted if predicted is not None else runner.predict(measured),
            command=command, produced_by=f"search (study '{opened.name}', trial {best.number})",
            trainer_settings=best.user_attrs.get("trainer_settings") or {},
            prediction=chosen_prediction(best, runner.speed, measured),
            paired=[{k: v[k] for k in ("against", "why", "incumbent_plan", "ratio", "interval", "rounds",
                                       "busy_rounds", "rerun_rounds", "verdict")}
                    for v in (opened.study.user_attrs.get("chosen") or {}).get("paired", [])],
        ),
    )
    plan = _at_largest_samples(plan, runner.estimator.batch_sizes, runner.predict(plan), budget.budget_bytes)
    if out is not None:
        plan.save(out, command=command)
    return SearchResult(plan=plan, study=opened.study, trial_number=best.number,
                        notes=opened.space.notes + _shape_notes(opened.study, runner.estimator.batch_sizes, plan),
                        figure=figure)


def _check_out(out: str | Path | None, *, inputs: dict[str, str | None]) -> Path | None:
    """``out`` as a path a search may write: a file in a writable folder, none of the search's own ``inputs``."""
    if out is None:
        return None
    path = Path(out)
    for what, given in inputs.items():
        if given and Path(given).resolve() == path.resolve():  # the storage's file may not exist yet
            raise ValueError(f"--out '{path}' is the search's {what} file; give another path for the tuned plan")
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise ValueError(f"--out '{path}' is a folder; give a file path like tuned.yaml")
    if not folder.is_dir():
        raise ValueError(f"--out '{path}': folder '{folder}' does not exist")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ValueError(f"--out '{path}' is not writable")
    return path


def _at_largest_samples(plan: Plan, sizes: BatchSizes | None, predicted: int | None, budget_bytes: int) -> Plan:
    """Where batches vary in shape and ``plan``'s micro-batch is predicted to fit the batch of the largest samples
    (the estimator's batch), the plan says so (``micro_batch_sample_size``): its run then starts shorter batches at
    larger micro-batches."""
    if sizes is None or not sizes.varies or plan.micro_batch_size is None or predicted is None \
            or predicted > budget_bytes:
        return plan
    return plan.replace(micro_batch_sample_size=sizes.largest)


def _shape_notes(study: Any, sizes: BatchSizes | None, plan: Plan) -> tuple[str, ...]:
    """Where the target's batches vary in shape (dynamic padding, mixed resolutions): a note, and the sizes kept in
    the study (``batch_sizes``)."""
    if sizes is None or not sizes.varies:
        return ()
    study.set_user_attr("batch_sizes", dataclasses.asdict(sizes))
    return (f"batches vary in shape ({sizes.describe()}): each plan was estimated on the batch of the largest samples, "
            f"so micro-batch {plan.micro_batch_size} is predicted to fit it; trials measured the batches the loader "
            "gave them, and at run time ElasticBatchSize splits each batch by its own shape",)
