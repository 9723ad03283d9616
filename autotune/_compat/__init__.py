"""Every use of private upstream API, one module per upstream: :mod:`~autotune._compat.torch`,
:mod:`~autotune._compat.fsdp` (FSDP2), :mod:`~autotune._compat.lightning`, :mod:`~autotune._compat.torchmetrics`,
:mod:`~autotune._compat.torchao` and :mod:`~autotune._compat.optuna`.

This is the one place to look when upgrading an upstream package: no other module of autotune reaches into a private
module, class or attribute of theirs (``tests/test_layout.py`` checks it). Each access is one small function (or
constant). Its comment says what it does, what breaks if upstream changes it and, where one exists, the public
alternative and why it is not used. What autotune builds on an access (the estimator's peak tracker, its fake rules)
lives with the code that uses it. Checked against torch 2.13.0, lightning 2.6.6, torchmetrics 1.9.0, optuna 5.0.0
and torchao 0.18.0 (the source of its ``CPUOffloadOptimizer``; the tests run a stand-in with the same attributes).

Bottom layer: imports nothing from autotune, and upstream packages only inside the functions that need them. This
``__init__`` re-exports nothing: import from the upstream's module.
"""
