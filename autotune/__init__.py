"""lightning-autotune: memory-elastic auto-tuning for PyTorch Lightning.

The runtime callbacks live in :mod:`autotune.callbacks`; this package holds the plan, the estimator, the search
and the memory tools (probe, budget). Optuna and matplotlib are imported only by the search and report paths.
"""

from autotune._device.budget import Budget
from autotune._device.oom import OutOfMemoryAtMinimumError, is_oom_error
from autotune._device.probe import MemoryProbe, probe_memory
from autotune._estimate.capacity import CapacityRow, estimate_capacity
from autotune._estimate.estimate import Estimate, estimate
from autotune._plan.plan import PRECISIONS, STRATEGIES, Plan, Provenance, load_plan
from autotune._plan.space import SearchSpace, SpaceError, available_spaces, load_space
from autotune._plan.tuned import PlanFileError
from autotune._search.search import NoFeasiblePlanError, SearchResult, search
from autotune._search.trial import TrialResult, measure_plan
from autotune._target.target import Target, TargetError, load_target
from autotune._version import __version__

__all__ = [
    "PRECISIONS",
    "STRATEGIES",
    "Budget",
    "CapacityRow",
    "Estimate",
    "MemoryProbe",
    "NoFeasiblePlanError",
    "OutOfMemoryAtMinimumError",
    "Plan",
    "PlanFileError",
    "Provenance",
    "SearchResult",
    "SearchSpace",
    "TrialResult",
    "SpaceError",
    "Target",
    "TargetError",
    "__version__",
    "available_spaces",
    "estimate",
    "estimate_capacity",
    "is_oom_error",
    "load_plan",
    "load_space",
    "load_target",
    "measure_plan",
    "probe_memory",
    "search",
]
