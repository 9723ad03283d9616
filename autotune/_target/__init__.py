"""Targets: the user's model and data, resolved from a TARGET string (factory or LightningCLI config)."""
