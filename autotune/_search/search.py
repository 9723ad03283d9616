"""``autotune.search``: Optuna finds the fastest plan that fits the budget, measured in isolated trials."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune._device.budget import Budget, format_bytes
from autotune._plan.plan import Plan
from autotune._plan.provenance import Provenance
from autotune._plan.space import (
    AUTO, SearchSpace, default_space_name, load_space, plan_from_params, quiet_list_choices,
)
from autotune._search.auto import AutoMicro
from autotune._search.choose import Figure, choose, figures, no_fit_message, over_budget_by, run_of
from autotune._search.confirm import (
    chosen_prediction, learn_speed, observe_trial, predicted_best_first, stop_when_confirmed,
)
from autotune._search.halving import PINNED, walk_ladder
from autotune._search.inert import without_inert
from autotune._search.memory import SearchEstimator, sharded_devices
from autotune._search.speed import SearchSpeed, guided_trials, ranked_candidates, with_variations
from autotune._search.stopping import OPTUNA_OPTIMIZE, MaxMeasured, StopOnFailures, drop_interrupts, finished
from autotune._search.storage import (
    digest, exclusive, open_storage, recover_dead_workers, requeue_interrupted, stamp_study, storage_file, study_name,
    worker_id,
)
from autotune._search.trial import (
    TrialResult,
    TrialSpec,
    check_interval,
    check_positive_int,
    run_trial,
    start_trial_server,
)
from autotune._search.twin import measure_twin

if TYPE_CHECKING:
    from autotune._estimate.estimate import BatchSizes

log = logging.getLogger("autotune")

#: A plan the estimator predicts above this multiple of the budget is recorded infeasible without running.
ESTIMATE_REJECT_FACTOR = 1.5
#: Stop a trial early when the top of its interval is below this share of the bottom of the second best plan's.
EARLY_STOP_SHARE = 0.9


class NoFeasiblePlanError(RuntimeError):
    """No trial fitted in the budget; the message names the smallest peak seen and its plan."""


class _TrialCrashed(RuntimeError):
    """A trial failed for a reason unrelated to memory (recorded as FAIL; the search goes on)."""


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
    budget: str | int | float,
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
        budget: memory the run may use: ``"4GiB"``, bytes, a fraction of the device like ``0.8``, or ``"auto"``.
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

    Example:
        >>> result = search(target="examples/gpt/train.py:make", budget="2GiB", trials=10)  # doctest: +SKIP
        >>> result.plan.describe()  # doctest: +SKIP
    """
    import optuna
    import torch

    from autotune._device.probe import probe_memory, resolve_device
    from autotune._target.target import load_target

    parsed_budget = Budget.parse(budget)
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
    start_trial_server()  # its imports run while this process loads the target and the study
    dev = resolve_device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    tgt = load_target(target, config=config)
    batch_size = tgt.batch_size()
    probe = probe_memory(dev)
    budget_bytes = parsed_budget.resolve(total_bytes=probe.total_bytes, free_bytes=probe.free_bytes)
    if budget_bytes > probe.total_bytes:
        raise ValueError(f"budget {parsed_budget} ({format_bytes(budget_bytes)}) is more than {dev}'s memory "
                         f"({format_bytes(probe.total_bytes)}); give at most that, a share (0.8) or auto")
    weights = sum(p.numel() * p.element_size() for p in tgt.model.parameters())
    if weights >= budget_bytes:
        raise ValueError(f"budget {parsed_budget} ({format_bytes(budget_bytes)}) is below the model's weights alone "
                         f"({format_bytes(weights)}); raise the budget")
    loaded_space = load_space(space or default_space_name(dev))
    space_obj = loaded_space.for_device(dev, batch_size=batch_size)
    tgt.check_runnable(next((d.choices for d in space_obj.dimensions if d.name == "strategy"), ("auto",)))
    stor = open_storage(storage)
    name = study or study_name(target, parsed_budget, space_obj, dev)
    verbosity = optuna.logging.get_verbosity()
    runner: _Objective | None = None
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # no INFO line per trial; the caller's level comes back
    quiet = quiet_list_choices()  # block class names as choices: Optuna stores them by index, as it says it will not
    quiet.__enter__()
    try:
        guided = guided_trials(trials, len(space_obj.seeds))
        # The sampler models the measurements from the first unguided trial on (Optuna's default waits for 10).
        sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=guided)
        the_study = optuna.create_study(study_name=name, storage=stor, direction="maximize", sampler=sampler,
                                        load_if_exists=True)
        stamp_study(the_study, {
            "target": target, "budget": str(parsed_budget), "space": space_obj.name, "device": dev.type,
            "batch_size": batch_size, "devices": devices,
            "space_content": digest(loaded_space.dimensions, loaded_space.seeds),  # as written, before the device's cut
            "config_content": digest(Path(config).read_bytes()) if config else None})
        the_study.set_user_attr("budget_bytes", budget_bytes)  # "auto" and fractions resolve anew on each run
        runner = _Objective(target=target, config=config, target_obj=tgt, space=space_obj, budget=parsed_budget,
                            budget_bytes=budget_bytes, device=dev, devices=devices, steps=steps, warmup=warmup,
                            interval=interval, trial_timeout=trial_timeout)
        space_obj = runner.space = without_inert(space_obj, runner.estimator.inert)  # settings doing nothing here
        recover_dead_workers(the_study)
        requeue_interrupted(the_study)
        runner.learn_context(the_study)  # a resumed search: the context its trials measured
        learn_speed(the_study, runner.speed, devices)  # and the speeds, which calibrate the step-time model
        if finished(the_study) < trials:
            if not the_study.trials:  # a new study: its first trials are the seeds, then the estimator's ranking
                runner.measure_baseline()
                with exclusive(stor):
                    for params in runner.first_trials(guided):
                        the_study.enqueue_trial(params, skip_if_exists=True)
            logging.getLogger(OPTUNA_OPTIMIZE).addFilter(drop_interrupts)  # Ctrl-C: the CLI's one line only
            the_study.optimize(
                runner,
                n_trials=None,
                timeout=timeout,
                callbacks=[MaxMeasured(trials, space_obj.size()), StopOnFailures(trials),
                           stop_when_confirmed(runner, space=space_obj, budget_bytes=budget_bytes), *callbacks],
                catch=(_TrialCrashed,),
            )

        def run_one() -> None:  # one more trial: halving's rung, the leader's plain twin (or a trial queued before)
            the_study.optimize(runner, n_trials=1, catch=(_TrialCrashed,), callbacks=callbacks)

        walk_ladder(the_study, space_obj, batch_size=batch_size, budget_bytes=budget_bytes, devices=devices,
                    wait_seconds=trial_timeout, run_one=run_one)
        measure_twin(the_study, space_obj, budget_bytes=budget_bytes, devices=devices, run_one=run_one,
                     wait_seconds=trial_timeout)
        figure = choose(the_study, budget_bytes, runner.remeasure)
        if figure is None:
            raise NoFeasiblePlanError(no_fit_message(the_study, str(parsed_budget), budget_bytes))
        best = the_study.trials[figure.trial]
        tokens = best.user_attrs.get("tokens_per_second")
        measured = plan_from_params(best.params, micro_batch_size=best.user_attrs.get("micro_batch_size"),
                                    **sharded_devices(best.params, devices))
        if devices > 1:  # its figures were measured on that many ranks, whatever the strategy
            measured = measured.replace(devices=devices)
        predicted = best.user_attrs.get("predicted_peak_bytes")  # None: it ran untraced
        plan = measured.replace(
            budget=str(parsed_budget),
            provenance=Provenance.here(
                budget=str(parsed_budget), device_name=probe.name, device_total_bytes=probe.total_bytes,
                samples_per_second=figure.samples_per_second, samples_per_second_interval=[figure.low, figure.high],
                measurements=len(figure.runs),
                tokens_per_second=tokens * figure.samples_per_second / best.user_attrs["samples_per_second"]
                if tokens else None,
                peak_bytes=figure.peak_bytes,
                predicted_peak_bytes=predicted if predicted is not None else runner.predict(measured),
                command=command, produced_by=f"search (study '{name}', trial {best.number})",
                trainer_settings=best.user_attrs.get("trainer_settings") or {},
                prediction=chosen_prediction(best, runner.speed, measured),
            ),
        )
        plan = _at_largest_samples(plan, runner.estimator.batch_sizes, runner.predict(plan), budget_bytes)
        if out_path is not None:
            plan.save(out_path, command=command)
        return SearchResult(plan=plan, study=the_study, trial_number=best.number,
                            notes=space_obj.notes + _shape_notes(the_study, runner.estimator.batch_sizes, plan),
                            figure=figure)
    finally:
        if runner is not None:
            runner.close()
        logging.getLogger(OPTUNA_OPTIMIZE).removeFilter(drop_interrupts)
        optuna.logging.set_verbosity(verbosity)
        quiet.__exit__(None, None, None)


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


class _Objective:
    """One Optuna trial: suggest a plan, reuse a measurement of the same plan or run it, record the constraint."""

    def __init__(self, *, target: str, config: str | None, target_obj: Any, space: SearchSpace, budget: Budget,
                 budget_bytes: int, device: Any, devices: int, steps: int, warmup: int, interval: float,
                 trial_timeout: float) -> None:
        self.target, self.config, self.target_obj, self.space = target, config, target_obj, space
        self.budget, self.budget_bytes, self.device, self.devices = budget, budget_bytes, device, devices
        self.steps, self.warmup, self.interval, self.trial_timeout = steps, warmup, interval, trial_timeout
        self.estimator = SearchEstimator(target_obj, device)
        self.speed = SearchSpeed(self.estimator, batch_size=target_obj.batch_size(), devices=devices)
        self.auto = AutoMicro(self.estimator, budget_bytes=budget_bytes, batch_size=target_obj.batch_size(),
                              devices=devices)
        self._long_dir: Any = None  # a TemporaryDirectory holding the long batch, once written

    def measure_baseline(self) -> None:
        """On CPU, where a trial's peak is its process's memory (resident set net of file pages), measure what a trial
        holds besides the tensors the estimator counts (see :meth:`SearchEstimator.measure_baseline`)."""
        seeds = [plan_from_params(p, micro_batch_size=None if p.get("micro_batch_size") == AUTO else
                                  p.get("micro_batch_size"), **sharded_devices(p, self.devices))
                 for p in self.space.seeds]
        # the seeds are the first trials: their traces (an ``auto`` one's starts at the whole batch) are made while
        # the short run measures memory
        self.estimator.measure_baseline(target=self.target, config=self.config, timeout=self.trial_timeout,
                                        meanwhile=seeds)

    def learn_context(self, study: Any) -> None:
        """CUDA: the context a resumed study's measured trials saw, for the shapes not measured yet."""
        for t in study.get_trials(deepcopy=False):
            if t.user_attrs.get("source") == "measured" and t.user_attrs.get("context_bytes"):
                self.estimator.measured_context(t.user_attrs["context_bytes"])

    def first_trials(self, count: int) -> list[dict[str, Any]]:
        """The predicted best point (the estimator's first ranked candidate), the space's seeds, then the other
        ranked candidates not among them, ``count`` in all."""
        seeds = [dict(p) for p in self.space.seeds]
        batch_size = self.target_obj.batch_size()
        ranked = ranked_candidates(
            self.space, limit=count, batch_size=batch_size, devices=self.devices, cost=self.speed.seconds_per_sample,
            resolve_micro=self.auto, peak=self.estimator.peak, budget_bytes=self.budget_bytes,
            tensor_room=self.budget_bytes - self.estimator.baseline)
        return predicted_best_first(seeds, with_variations(self.space, ranked))[:max(count, len(seeds) + 1)]

    def __call__(self, trial: Any) -> float:
        import optuna

        try:
            return self._run(trial)
        except KeyboardInterrupt:  # Ctrl-C: Optuna fails the trial; the next run of the search queues it again
            trial.set_user_attr("status", "interrupted")
            raise
        except (optuna.TrialPruned, _TrialCrashed):
            raise
        except Exception as err:  # anything else is this trial's failure, recorded with a constraint and a reason
            reason = f"{type(err).__name__}: {' '.join(str(err).split())}"[:500]
            trial.set_constraint("memory", 1.0)
            trial.set_user_attr("status", "error")
            trial.set_user_attr("reason", reason)
            raise _TrialCrashed(reason) from err

    def _run(self, trial: Any) -> float:
        import optuna

        started = time.perf_counter()
        trial.set_user_attr("worker", worker_id())
        params = self.space.suggest(trial)
        micro, pinned = params.get("micro_batch_size"), trial.user_attrs.get(PINNED)  # a rung's, a plain twin's
        if micro == AUTO and pinned:
            micro = pinned
        elif micro == AUTO:
            if trial.user_attrs.get("auto_ceiling"):  # a retry's, set by whichever worker saw the OOM
                self.auto.hold(params, trial.user_attrs["auto_ceiling"])
            micro = self.auto(params)
            trial.set_user_attr("auto_micro_batch_size", micro)
        plan = plan_from_params(params, micro_batch_size=micro, **sharded_devices(params, self.devices))
        trial.set_user_attr("micro_batch_size", plan.micro_batch_size)
        trial.set_user_attr("plan", plan.describe())
        trial.set_user_attr("plan_key", plan.key())
        cached = self._cached(trial, plan)
        if cached is not None:
            result, measured = cached
            value = self._record(trial, result, source="cache")
            if result.status == "oom" and measured:  # a resumed search meets its earlier 'auto' that ran out
                self._auto_ran_out(trial, params, plan.micro_batch_size)
            return value
        # A plan whose least peak is known to be under the rejection bar (a larger micro-batch of its shape is) runs
        # untraced, unless its trace is at hand; its measurement calibrates its shape when that is next asked for.
        limit = ESTIMATE_REJECT_FACTOR * self.budget_bytes
        bounded = not self.estimator.traced(plan) and self.estimator.known_under(plan, int(limit))
        predicted = None if bounded else self.predict(plan)
        if predicted is not None:
            trial.set_user_attr("predicted_peak_bytes", predicted)
            trial.set_user_attr("predicted_tensor_bytes", self.estimator.tensors(plan))  # without the baseline
            trial.set_user_attr("estimate_method", self.estimator.method(plan))
            least = self.estimator.least_peak(plan)
            if least is not None and least > limit:
                result = TrialResult("oom", peak_bytes=least,
                                     reason=f"estimated peak {format_bytes(least)} is far over the budget")
                return self._record(trial, result, source="estimate")
        spec = self._spec(plan, stop_below=self._stop_below(trial.study))
        launched = time.perf_counter()
        result = run_trial(spec, timeout=self.trial_timeout)
        ran = time.perf_counter() - launched
        value = self._record(trial, result, source="measured")
        observe_trial(trial, plan, self.speed, result.samples_per_second if result.status == "ok" else None)
        if result.context_bytes:  # CUDA: the process's context, measured, for the shapes not measured yet
            self.estimator.measured_context(result.context_bytes)
        if result.status == "oom" and not pinned:
            self._auto_ran_out(trial, params, plan.micro_batch_size)
        if result.status == "ok" and result.peak_bytes and self.estimator.calibrate(plan, result.peak_bytes,
                                                                                     lazily=True):
            if params.get("micro_batch_size") == AUTO and not pinned:
                # 'auto' is the largest micro-batch that fits: measured, the shape has more room than predicted, or
                # less (over the budget), so its choice moves: try it again, next
                fits = over_budget_by(result.peak_bytes, result.peak_noise_bytes, self.budget_bytes) <= 0
                again = self.auto(params)
                if (fits and again > micro) or (not fits and again < micro):
                    trial.study.enqueue_trial(params, user_attrs={"auto_again_of": trial.number})
        # this process's own time for the trial (sampler, estimator, storage), apart from the trial's process
        trial.set_user_attr("parent_seconds", time.perf_counter() - started - ran)
        if result.status == "pruned":
            raise optuna.TrialPruned(result.reason)
        if result.status == "error":
            raise _TrialCrashed(result.reason)
        return value

    def _spec(self, plan: Plan, *, stop_below: float | None = None) -> TrialSpec:
        return TrialSpec(target=self.target, config=self.config, plan=plan.to_dict(), budget=str(self.budget),
                         device=self.device.type, devices=self.devices, steps=self.steps, warmup=self.warmup,
                         interval=self.interval, stop_below=stop_below, long_batch=self._long_batch())

    def _long_batch(self) -> str | None:
        """Where batches vary in shape: a file holding the batch of the largest samples the estimator read, for each
        trial to run once (its peak then covers it); written once per search, removed by :meth:`close`."""
        sizes, batch = self.estimator.batch_sizes, self.estimator.batch
        if sizes is None or not sizes.varies or batch is None:
            return None
        if self._long_dir is None:
            import tempfile

            import torch

            self._long_dir = tempfile.TemporaryDirectory(prefix="autotune-long-batch-")
            torch.save(batch, Path(self._long_dir.name) / "batch.pt")
        return str(Path(self._long_dir.name) / "batch.pt")

    def close(self) -> None:
        if self._long_dir is not None:
            self._long_dir.cleanup()
            self._long_dir = None

    def _record(self, trial: Any, result: TrialResult, *, source: str) -> float:
        peak = result.peak_bytes
        if result.status == "oom":
            over = (peak - self.budget_bytes) / self.budget_bytes if peak and peak > self.budget_bytes else 1.0
        elif peak is not None:  # within its steps' noise of the budget: fits, at a cost the choice counts (edge.py)
            over = over_budget_by(peak, result.peak_noise_bytes, self.budget_bytes) / self.budget_bytes
        else:
            over = 1.0  # nothing measured: not known to fit
        trial.set_constraint("memory", over)  # every path: feasible when <= 0
        trial.set_user_attr("status", result.status)
        trial.set_user_attr("source", source)
        for key, value in result.as_attrs().items():
            if key != "status":
                trial.set_user_attr(key, value)
        return float(result.samples_per_second or 0.0) if result.status in ("ok", "pruned") else 0.0

    def _cached(self, trial: Any, plan: Plan) -> tuple[TrialResult, bool] | None:
        """The result of an earlier trial of ``plan`` (measured, or estimated far over the budget) and whether it
        was measured; None when there is none."""
        from optuna.trial import TrialState

        key = plan.key()
        for other in trial.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            if other.user_attrs.get("plan_key") == key and other.user_attrs.get("source") != "cache":
                attrs = other.user_attrs
                trial.set_user_attr("cached_from", other.number)
                figures = ("samples_per_second", "tokens_per_second", "peak_bytes", "peak_noise_bytes",
                           "allocated_peak_bytes", "context_bytes")
                result = TrialResult(attrs.get("status", "ok"), reason=attrs.get("reason", ""),
                                     **{name: attrs.get(name) for name in figures})
                return result, attrs.get("source") == "measured"
        return None

    def _stop_below(self, study: Any) -> float | None:
        # The second best plan's, not the best's: one lucky measurement must not stop every trial after it. A trial
        # stops only when the top of its own interval is below this.
        ranked = figures(study, self.budget_bytes)
        return EARLY_STOP_SHARE * ranked[1].low if len(ranked) >= 2 else None

    def predict(self, plan: Plan) -> int | None:
        """The estimator's peak of ``plan`` in the search's measure (per rank: a sharded plan's devices are its world
        size); None when it cannot tell."""
        return self.estimator.peak(plan)

    def _auto_ran_out(self, trial: Any, params: dict[str, Any], micro: int | None) -> None:
        """An ``auto`` plan ran out of memory: its point is tried again at once, at half (:meth:`AutoMicro.ran_out`)."""
        ceiling = self.auto.ran_out(params, micro)
        if ceiling is not None:
            trial.study.enqueue_trial(params, user_attrs={"auto_again_of": trial.number, "auto_ceiling": ceiling})

    def remeasure(self, trial: Any) -> dict[str, Any]:
        """Measure ``trial``'s plan once more (a contender for best); the run's record."""
        plan = plan_from_params(trial.params, micro_batch_size=trial.user_attrs.get("micro_batch_size"),
                                **sharded_devices(trial.params, self.devices))
        return run_of(run_trial(self._spec(plan), timeout=self.trial_timeout).as_attrs())


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
