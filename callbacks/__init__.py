"""Lightning callbacks of lightning-autotune (installed as ``autotune.callbacks``)."""

from autotune._runtime.events import ElasticEvent
from autotune.callbacks.apply_plan import ApplyPlan
from autotune.callbacks.elastic import ElasticBatchSize
from autotune.callbacks.monitor import MemoryMonitor

__all__ = ["ApplyPlan", "ElasticBatchSize", "ElasticEvent", "MemoryMonitor"]
