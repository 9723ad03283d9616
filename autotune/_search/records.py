"""What crosses a trial's process boundary: the spec the search hands the trial, and the result the trial writes.

Both are plain picklable records with no Lightning in them, so the search imports them without importing the
trial's callback (:mod:`autotune._search.meter`, which only the trial process needs).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from autotune._device.budget import ResolvedBudget

__all__ = ["TRIAL_PID", "TrialResult", "TrialSpec"]

#: The environment variable holding the trial process's pid (set by the trial, inherited by its ranks and workers).
TRIAL_PID = "AUTOTUNE_TRIAL_PID"


@dataclass(frozen=True)
class TrialSpec:
    """What a trial process needs (picklable): where the model comes from, the plan, and how long to measure."""

    target: str
    config: str | None
    plan: dict[str, Any]  # the plan's dict form (Plan.to_dict)
    # resolved once, by the search (or ``measure_plan``): the trial caps its memory at these bytes, the ones it is
    # judged against, and shows the text; None: no cap
    budget: ResolvedBudget | None
    device: str  # "cpu" or "cuda"
    devices: int = 1
    steps: int = 20  # timed steps at most
    warmup: int = 2  # warm-up steps at least (more while the step time is not stable)
    interval: float = 0.03  # stop timing once the 95% interval is within +- this share of the throughput
    stop_below: float | None = None  # samples/s: stop early when the interval's top is below this
    # A file holding the batch of the largest samples the search read (``torch.save``), where batches vary in shape:
    # the trial runs it in place of a warm-up step's batch, so its peak covers the longest batch while its timed
    # steps keep the data as it comes (mostly short batches). None: the data as it comes.
    long_batch: str | None = None

    def __post_init__(self) -> None:
        if self.budget is not None and not isinstance(self.budget, ResolvedBudget):  # a trial never resolves it again
            raise TypeError(f"TrialSpec.budget must be a ResolvedBudget (resolve_budget) or None; got {self.budget!r}")

    def memory_plan(self) -> Any:
        """The :class:`~autotune.Plan` of this trial, read back from its dict form."""
        from autotune._plan.plan import Plan

        return Plan.from_dict(self.plan)


@dataclass(frozen=True)
class TrialResult:
    """What a trial measured (:func:`autotune.measure_plan`, each trial of :func:`autotune.search`).

    ``status`` is "ok", "oom" (infeasible), "pruned" (stopped early: its interval clearly below the best plans so
    far) or "error"
    (``reason`` says why). Peaks are the largest step's peak memory in the budget's measure, as ``ElasticBatchSize``
    measures a step (CUDA: allocator reserved bytes, plus the CUDA context; CPU: the process's peak resident set net of
    file-backed pages), the worst rank's under DDP. On CUDA ``allocated_peak_bytes`` is the largest step's peak of
    bytes allocated to tensors (what the estimator's tensors predict) and ``context_bytes`` the context counted in
    the peak (None where NVML does not list the process), that rank's under DDP: the rest of the peak is the
    allocator's reserve beyond its tensors; ``allocated_step_peaks`` each step's, in order (rank 0's), which says
    whether a peak comes from one step (the first's, say) or grows from step to step. ``interval`` is the 95%
    interval of ``samples_per_second`` over this run's timed steps (None when it is unbounded); ``peak_noise_bytes``
    how much the timed steps' peaks varied (a search ranks a plan whose peak is within it of the budget by the
    samples/s a run of it can be expected to give); ``warmup_steps`` how many steps ran before timing started (more
    than asked while the step time was settling). ``step_peaks`` are every step's peaks in order (rank 0's) and
    ``run_peak_bytes`` the peak a training run is projected to reach as its steps' peaks creep (the trend of the
    timed steps' peaks carried to a run's length: :mod:`autotune._search.growth`), with ``run_noise_bytes`` the
    scatter about that trend; ``load`` what the timed steps ran beside (:class:`autotune._device.load.LoadRecord`:
    this run's CPU per wall second, the cores its host's other processes kept busy, steal).

    Example:
        >>> TrialResult("oom", reason="CUDA out of memory").status
        'oom'
    """

    status: str
    samples_per_second: float | None = None
    interval: tuple[float, float] | None = None  # the 95% interval of samples_per_second over this run's steps
    tokens_per_second: float | None = None
    peak_bytes: int | None = None
    peak_noise_bytes: int | None = None  # how much its timed steps' peaks varied (largest - smallest)
    allocated_peak_bytes: int | None = None  # CUDA: the largest step's peak of tensor bytes
    context_bytes: int | None = None  # CUDA: the context in peak_bytes
    allocated_step_peaks: list[int] | None = None  # CUDA: each step's peak of tensor bytes, in order (rank 0's)
    step_peaks: list[int] | None = None  # each step's peak in the budget's measure, in order (rank 0's)
    timed_from: int | None = None  # the index in step_peaks of the first timed step
    run_peak_bytes: int | None = None  # the peak a run of run_steps steps is projected to reach (growth.py)
    run_noise_bytes: int | None = None  # how much a step's peak scatters about that projection's trend
    load: dict[str, Any] | None = None  # what the timed steps ran beside (autotune._device.load.LoadRecord)
    steps_timed: int = 0
    warmup_steps: int = 0
    flops_per_sample: float | None = None
    mfu: float | None = None
    startup_seconds: float | None = None
    wall_seconds: float | None = None
    reason: str = ""
    trainer_settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    # "error" where the target's own code failed (:mod:`autotune._target.failure`): what failed, while doing what, and
    # the user's frames, a line each; None for any other error
    target_error: list[str] | None = None

    def as_attrs(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
