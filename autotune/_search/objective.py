"""One trial of the search, as Optuna asks for it: suggest a plan, reuse a measurement of the same plan, reject it on
the estimate, or run it in a fresh process; record the memory constraint against the budget the search resolved."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from autotune._device.budget import ResolvedBudget, format_bytes
from autotune._plan.plan import Plan
from autotune._plan.space import AUTO, SearchSpace, plan_for
from autotune._search.auto import AutoMicro
from autotune._search.figures import figures, over_budget_by, run_of, run_peak
from autotune._search.confirm import observe_trial, predicted_best_first
from autotune._search.halving import PINNED
from autotune._search.memory import SearchEstimator
from autotune._search.speed import SearchSpeed, by_precision, ranked_candidates, with_variations
from autotune._search.storage import worker_id
from autotune._search.trial import TrialResult, TrialSpec, run_trial

__all__ = ["EARLY_STOP_SHARE", "ESTIMATE_REJECT_FACTOR", "PAIRED_STEPS", "Objective", "TrialCrashed"]

#: A plan the estimator predicts above this multiple of the budget is recorded infeasible without running.
ESTIMATE_REJECT_FACTOR = 1.5
#: Stop a trial early when the top of its interval is below this share of the bottom of the second best plan's.
EARLY_STOP_SHARE = 0.9
#: Timed steps at most of a run in a paired comparison (``paired.py``): short runs keep a round's pair close in time.
PAIRED_STEPS = 10


class TrialCrashed(RuntimeError):
    """A trial failed for a reason unrelated to memory (recorded as FAIL; the search goes on)."""


class Objective:
    """One Optuna trial: suggest a plan, reuse a measurement of the same plan or run it, record the constraint."""

    def __init__(self, *, target: str, config: str | None, target_obj: Any, space: SearchSpace,
                 budget: ResolvedBudget, device: Any, devices: int, steps: int, warmup: int, interval: float,
                 trial_timeout: float) -> None:
        self.target, self.config, self.target_obj, self.space = target, config, target_obj, space
        self.budget, self.device, self.devices = budget, device, devices
        self.steps, self.warmup, self.interval, self.trial_timeout = steps, warmup, interval, trial_timeout
        self.estimator = SearchEstimator(target=target_obj, device=device)
        self.speed = SearchSpeed(self.estimator, batch_size=target_obj.batch_size(), devices=devices)
        self.auto = AutoMicro(estimator=self.estimator, budget_bytes=budget.budget_bytes,
                              batch_size=target_obj.batch_size(), devices=devices)
        self._long_dir: Any = None  # a TemporaryDirectory holding the long batch, once written
        self.estimator.recompute_budget = budget.budget_bytes  # activation_checkpointing="auto" chooses for it
        self.estimator.recompute_speed = lambda: self.speed.model.speed

    @property
    def budget_bytes(self) -> int:
        """The budget in bytes, resolved once by the search: what every trial is judged against and capped at."""
        return self.budget.budget_bytes

    def measure_baseline(self) -> None:
        """On CPU, where a trial's peak is its process's memory (resident set net of file pages), measure what a trial
        holds besides the tensors the estimator counts (see :meth:`SearchEstimator.measure_baseline`)."""
        seeds = [plan_for(p, None, self.devices) for p in self.space.seeds]
        # the seeds are the first trials: their traces (an ``auto`` one's starts at the whole batch) are made while
        # the short run measures memory
        run = self.estimator.measure_baseline(target=self.target, config=self.config, timeout=self.trial_timeout,
                                              meanwhile=seeds, budget_bytes=self.budget_bytes)
        if run is not None and run.result.samples_per_second:  # its second run timed a plan: a first calibration
            self.speed.observe(run.plan, run.result.samples_per_second)

    def learn_context(self, study: Any) -> None:
        """CUDA: the context a resumed study's measured trials saw, for the shapes not measured yet."""
        for t in study.get_trials(deepcopy=False):
            if t.user_attrs.get("source") == "measured" and t.user_attrs.get("context_bytes"):
                self.estimator.measured_context(t.user_attrs["context_bytes"])

    def first_trials(self, count: int) -> list[dict[str, Any]]:
        """The predicted best point (the estimator's first ranked candidate), the space's seeds, the predicted best of
        each other precision, then the other ranked candidates not among them, ``count`` in all."""
        seeds = [dict(p) for p in self.space.seeds]
        ranked = self.ranked(self.space, count)
        covering = [found[0] for found in (self.ranked(sub, 1) for sub in by_precision(self.space)) if found]
        first = predicted_best_first(seeds, with_variations(self.space, ranked), covering)
        return first[:max(count, len(predicted_best_first(seeds, ranked[:1], covering)))]

    def ranked(self, space: SearchSpace, limit: int) -> list[dict[str, Any]]:
        """Up to ``limit`` points of ``space`` predicted to fit, the fastest predicted first (the model as its trials
        have corrected it so far)."""
        return ranked_candidates(
            space, limit=limit, batch_size=self.target_obj.batch_size(), devices=self.devices,
            cost=self.speed.seconds_per_sample, resolve_micro=self.auto, peak=self.estimator.peak,
            budget_bytes=self.budget_bytes, tensor_room=self.budget_bytes - self.estimator.baseline)

    def __call__(self, trial: Any) -> float:
        import optuna

        try:
            return self._run(trial)
        except KeyboardInterrupt:  # Ctrl-C: Optuna fails the trial; the next run of the search queues it again
            trial.set_user_attr("status", "interrupted")
            raise
        except (optuna.TrialPruned, TrialCrashed):
            raise
        except Exception as err:  # anything else is this trial's failure, recorded with a constraint and a reason
            reason = f"{type(err).__name__}: {' '.join(str(err).split())}"[:500]
            trial.set_constraint("memory", 1.0)
            trial.set_user_attr("status", "error")
            trial.set_user_attr("reason", reason)
            raise TrialCrashed(reason) from err

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
        plan = self.estimator.resolved(plan_for(params, micro, self.devices))
        if params.get("activation_checkpointing") == AUTO:  # what it chose: the trial's plan, and the tuned file's
            chosen = list(plan.recompute) if plan.recompute is not None else plan.activation_checkpointing
            trial.set_user_attr("recompute", chosen)
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
        # the peak a run of the plan reaches (its trial's, with the creep its steps show) calibrates its shape
        projected, noise = run_peak(result.as_attrs())
        if result.status == "ok" and result.peak_bytes and self.estimator.calibrate(plan, projected, lazily=True):
            if params.get("micro_batch_size") == AUTO and not pinned:
                # 'auto' is the largest micro-batch that fits: measured, the shape has more room than predicted, or
                # less (over the budget), so its choice moves: try it again, next
                fits = over_budget_by(projected, noise, self.budget_bytes) <= 0
                again = self.auto(params)
                if (fits and again > micro) or (not fits and again < micro):
                    trial.study.enqueue_trial(params, user_attrs={"auto_again_of": trial.number})
        # this process's own time for the trial (sampler, estimator, storage), apart from the trial's process
        trial.set_user_attr("parent_seconds", time.perf_counter() - started - ran)
        if result.status == "pruned":
            raise optuna.TrialPruned(result.reason)
        if result.status == "error":
            raise TrialCrashed(result.reason)
        return value

    def _spec(self, plan: Plan, *, stop_below: float | None = None) -> TrialSpec:
        # the budget as the search resolved it: the trial caps its memory at the bytes it is judged against
        return TrialSpec(target=self.target, config=self.config, plan=plan.to_dict(), budget=self.budget,
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
        elif peak is not None:  # a run's projected peak within its noise of the budget: fits, at a cost (edge.py)
            over = over_budget_by(*run_peak(result.as_attrs()), self.budget_bytes) / self.budget_bytes
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
                           "run_peak_bytes", "run_noise_bytes", "allocated_peak_bytes", "context_bytes")
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
        """Measure ``trial``'s plan once more (one side of a paired round: at most ``PAIRED_STEPS`` timed steps, so
        that a round's two runs are close in time); the run's record."""
        plan = plan_for(trial.params, trial.user_attrs.get("micro_batch_size"), self.devices,
                        trial.user_attrs.get("recompute"))
        spec = dataclasses.replace(self._spec(plan), steps=min(self.steps, PAIRED_STEPS))
        return run_of(run_trial(spec, timeout=self.trial_timeout).as_attrs())
