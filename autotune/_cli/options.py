"""Command-line values parsed where they enter: positive ints and sizes, each refused in one line naming the option."""

from __future__ import annotations

__all__ = ["int_option", "size_option"]


def int_option(name: str, value: str | None, accepted: str) -> int | None:
    """``value`` (the text given to option ``name``) as a positive int, None when not given; ValueError saying
    ``accepted`` otherwise."""
    if value is None:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{name} must be {accepted}; got {value!r}")
    return int(value)


def size_option(name: str, value: str | None) -> int | None:
    """``value`` (the text given to option ``name``) as bytes (``80GiB``, ``24GB``, a number), None when not given;
    ValueError otherwise."""
    from autotune._device.budget import Budget

    if value is None:
        return None
    try:
        parsed = Budget.parse(value)
    except ValueError:
        parsed = None
    if parsed is None or parsed.kind != "bytes":
        raise ValueError(f"{name} must be a size like 80GiB, 24GB or a number of bytes; got {value!r}")
    return int(parsed.value)  # type: ignore[arg-type]
