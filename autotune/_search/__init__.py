"""The search: the Optuna objective, isolated trials, study storage and the report."""
