"""lightning-autotune: memory-elastic auto-tuning for PyTorch Lightning.

The runtime callbacks live in :mod:`autotune.callbacks`; this package holds the engine behind them and the
memory tools (probe, budget).
"""

from autotune._budget import Budget
from autotune._oom import OutOfMemoryAtMinimumError, is_oom_error
from autotune._plan import PRECISIONS, STRATEGIES, Plan, Provenance
from autotune._probe import MemoryProbe, probe_memory
from autotune._tuned import PlanFileError, load_plan

__version__ = "0.1.0"

__all__ = [
    "PRECISIONS",
    "STRATEGIES",
    "Budget",
    "MemoryProbe",
    "OutOfMemoryAtMinimumError",
    "Plan",
    "PlanFileError",
    "Provenance",
    "__version__",
    "is_oom_error",
    "load_plan",
    "probe_memory",
]
