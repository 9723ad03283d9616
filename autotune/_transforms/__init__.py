"""The model transforms that apply a plan (ApplyPlan) and that the estimator traces: activation checkpointing,
activation offload and compile per block, optimizer offload, low-bit optimizer state and FSDP2 sharding. Imports
only ``autotune._compat``; the replay engine in ``autotune._runtime`` does not use it."""
