"""Lightning callbacks of lightning-autotune (installed as ``autotune.callbacks``)."""

from autotune._runtime.events import ElasticEvent
from autotune.callbacks.apply_plan import ApplyPlan
from autotune.callbacks.elastic import ElasticBatchSize
from autotune.callbacks.monitor import MemoryMonitor
from autotune.callbacks._lightning_cli import install as _install_cli_errors

_install_cli_errors((ElasticBatchSize, ApplyPlan, MemoryMonitor))  # one-line errors for their bad values under LightningCLI

__all__ = ["ApplyPlan", "ElasticBatchSize", "ElasticEvent", "MemoryMonitor"]
