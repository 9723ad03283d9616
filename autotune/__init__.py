"""lightning-autotune: memory-elastic auto-tuning for PyTorch Lightning.

The runtime callbacks live in :mod:`autotune.callbacks`; this package holds the plan, the estimator, the search
and the memory tools (probe, budget). Each public name is imported on first use (torch and Lightning by most,
Optuna by the search, matplotlib by the report), so `import autotune` and the CLI's `--help`, `--version` and
argument errors are immediate.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from autotune._version import __version__

if TYPE_CHECKING:
    from autotune._device.budget import Budget
    from autotune._device.oom import OutOfMemoryAtMinimumError, is_oom_error
    from autotune._device.probe import MemoryProbe, probe_memory
    from autotune._estimate.capacity import CapacityRow, estimate_capacity
    from autotune._estimate.estimate import Estimate, estimate
    from autotune._estimate.recompute import BlockRecompute, RecomputeChoice, choose_recompute
    from autotune._estimate.speed import predict_speed
    from autotune._estimate.step_time import SpeedPrediction
    from autotune._plan.plan import PRECISIONS, STRATEGIES, Plan, load_plan
    from autotune._plan.provenance import Provenance
    from autotune._plan.space import SearchSpace, SpaceError, available_spaces, load_space
    from autotune._plan.tuned import PlanFileError
    from autotune._search.auto import AutoMicro
    from autotune._search.memory import SearchEstimator
    from autotune._search.paired import Ratio, compare_plans
    from autotune._search.search import NoFeasiblePlanError, SearchResult, search
    from autotune._search.trial import TrialResult, measure_plan
    from autotune._target.target import Target, TargetError, load_target

#: Where each public name lives: imported on first use, so `autotune --version`, `--help` and argument errors
#: do not pay for torch, Lightning and Optuna.
_EXPORTS = {
    "Budget": "autotune._device.budget",
    "OutOfMemoryAtMinimumError": "autotune._device.oom",
    "is_oom_error": "autotune._device.oom",
    "MemoryProbe": "autotune._device.probe",
    "probe_memory": "autotune._device.probe",
    "CapacityRow": "autotune._estimate.capacity",
    "estimate_capacity": "autotune._estimate.capacity",
    "Estimate": "autotune._estimate.estimate",
    "estimate": "autotune._estimate.estimate",
    "BlockRecompute": "autotune._estimate.recompute",
    "RecomputeChoice": "autotune._estimate.recompute",
    "choose_recompute": "autotune._estimate.recompute",
    "predict_speed": "autotune._estimate.speed",
    "SpeedPrediction": "autotune._estimate.step_time",
    "PRECISIONS": "autotune._plan.plan",
    "STRATEGIES": "autotune._plan.plan",
    "Plan": "autotune._plan.plan",
    "Provenance": "autotune._plan.provenance",
    "load_plan": "autotune._plan.plan",
    "SearchSpace": "autotune._plan.space",
    "SpaceError": "autotune._plan.space",
    "available_spaces": "autotune._plan.space",
    "load_space": "autotune._plan.space",
    "PlanFileError": "autotune._plan.tuned",
    "AutoMicro": "autotune._search.auto",
    "SearchEstimator": "autotune._search.memory",
    "Ratio": "autotune._search.paired",
    "compare_plans": "autotune._search.paired",
    "NoFeasiblePlanError": "autotune._search.search",
    "SearchResult": "autotune._search.search",
    "search": "autotune._search.search",
    "TrialResult": "autotune._search.trial",
    "measure_plan": "autotune._search.trial",
    "Target": "autotune._target.target",
    "TargetError": "autotune._target.target",
    "load_target": "autotune._target.target",
}

__all__ = [
    "PRECISIONS",
    "STRATEGIES",
    "AutoMicro",
    "BlockRecompute",
    "Budget",
    "CapacityRow",
    "Estimate",
    "MemoryProbe",
    "NoFeasiblePlanError",
    "OutOfMemoryAtMinimumError",
    "Plan",
    "PlanFileError",
    "Provenance",
    "Ratio",
    "RecomputeChoice",
    "SearchEstimator",
    "SearchResult",
    "SearchSpace",
    "SpeedPrediction",
    "TrialResult",
    "SpaceError",
    "Target",
    "TargetError",
    "__version__",
    "available_spaces",
    "choose_recompute",
    "compare_plans",
    "estimate",
    "estimate_capacity",
    "is_oom_error",
    "load_plan",
    "load_space",
    "load_target",
    "measure_plan",
    "predict_speed",
    "probe_memory",
    "search",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'autotune' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
