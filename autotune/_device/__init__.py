"""Device memory facts: what a device has (probe), what a run may use (budget), what a step used (meter), and the
one out-of-memory predicate. The lowest stage: it imports nothing else from autotune."""
