"""Lightning callbacks of lightning-autotune (installed as ``autotune.callbacks``)."""

from autotune._compat.lightning import quiet_third_party_notices
from autotune._runtime.events import ElasticEvent
from autotune.callbacks.apply_plan import ApplyPlan
from autotune.callbacks.elastic import ElasticBatchSize
from autotune.callbacks.monitor import MemoryMonitor
from autotune.callbacks._lightning_cli import install as _install_cli_errors

_install_cli_errors((ElasticBatchSize, ApplyPlan, MemoryMonitor))  # one-line errors for their bad values under LightningCLI
quiet_third_party_notices()  # no cloud-logger tip, no torch deprecation raised by Lightning's own code

__all__ = ["ApplyPlan", "ElasticBatchSize", "ElasticEvent", "MemoryMonitor"]
