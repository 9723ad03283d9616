"""The replay engine behind the callbacks: micro-batching and rank agreement, batch structure, the log buffer and
replay state. Imports only ``autotune._compat`` and ``autotune._device``; the transforms that apply a plan live in
``autotune._transforms``."""
