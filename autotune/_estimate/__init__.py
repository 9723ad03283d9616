"""The estimator: one training step traced on fake tensors with a plan applied (no memory, no compute)."""
