"""lightning-autotune: memory-elastic auto-tuning for PyTorch Lightning.

The runtime callbacks live in :mod:`autotune.callbacks`; this package holds the engine behind them and the
memory tools (probe, budget).
"""

from autotune._budget import Budget
from autotune._oom import OutOfMemoryAtMinimumError, is_oom_error
from autotune._probe import MemoryProbe, probe_memory

__version__ = "0.1.0"

__all__ = [
    "Budget",
    "MemoryProbe",
    "OutOfMemoryAtMinimumError",
    "__version__",
    "is_oom_error",
    "probe_memory",
]
