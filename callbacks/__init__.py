"""Lightning callbacks of lightning-autotune (installed as ``autotune.callbacks``)."""

from autotune.callbacks.elastic import ElasticBatchSize

__all__ = ["ElasticBatchSize"]
