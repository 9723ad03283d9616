"""The memory budget a run may use: bytes, a fraction of the device's total memory, or ``'auto'``; and its one
resolution into bytes for a device (:func:`resolve_budget`), which the search, the estimate and the callback share."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from decimal import Decimal
from typing import TYPE_CHECKING, ClassVar, Literal, Union

if TYPE_CHECKING:
    import torch

__all__ = ["CUDA_CONTEXT_BYTES", "Budget", "BudgetKind", "BudgetSpec", "ResolvedBudget", "format_bytes",
           "resolve_budget"]

BudgetKind = Literal["bytes", "fraction", "auto"]
BudgetSpec = Union[str, int, float, "Budget"]

#: Device memory a CUDA process holds outside the caching allocator: the context, with CUDA 12's lazy module
#: loading, for torch's kernels and cuBLAS/cuDNN handles. It varies with the driver, the GPU and the libraries
#: loaded (300-600 MiB is usual on A100/H100); ``probe_memory`` shows a process's real figure on a GPU. A device
#: whose memory is given (not read) has this much less free for a budget.
CUDA_CONTEXT_BYTES = 512 * 2**20

_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")

# A number (digits with an optional decimal part, or a leading-dot decimal), spaces (not tabs), an optional unit.
_SPEC_PATTERN = re.compile(r"(?P<number>\d+(?:\.\d*)?|\.\d+) *(?P<unit>[a-z]+)?", re.IGNORECASE | re.ASCII)



def check_bytes(name: str, value: object) -> None:
    """Refuse ``value`` unless it is a positive int (a count of bytes), naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int of bytes; got {value!r}")

def format_bytes(n: int) -> str:
    """Format a byte count with binary units and two decimals, for tables and messages.

    Args:
        n: A number of bytes; negative values (differences) keep their sign.

    Returns:
        ``"512 B"`` below one KiB, else the value with two decimals in the largest binary unit in which it
        reads at least 1.00, like ``"1.50 GiB"``.

    Example:
        >>> format_bytes(3 * 2**29)
        '1.50 GiB'
        >>> format_bytes(512)
        '512 B'
    """
    sign = "-" if n < 0 else ""
    size = abs(int(n))
    if size < 1024:
        return f"{sign}{size} B"
    exponent = 1
    # Step up while the rounded value would read 1024.00 or more, so 2**30 - 1 shows as "1.00 GiB".
    while exponent < len(_BINARY_UNITS) - 1 and round(size / 1024**exponent, 2) >= 1024:
        exponent += 1
    return f"{sign}{size / 1024**exponent:.2f} {_BINARY_UNITS[exponent]}"


@dataclass(frozen=True, kw_only=True)
class Budget:
    """How much device memory a run may use, as parsed from a user's spec.

    Build one with :meth:`Budget.parse`; it returns the same value for equal specs in any spelling
    (``"20 gib"`` and ``"20GiB"``). Turn it into bytes for one device with :meth:`resolve`.

    Attributes:
        kind: ``"bytes"``, ``"fraction"`` (of the device's total memory) or ``"auto"`` (free memory minus a margin).
        value: The byte count (``int``) for ``"bytes"``, the fraction (``float``) for ``"fraction"``, ``None``
            for ``"auto"``.
        text: The spec in canonical spelling (``"20GiB"``, ``"0.8"``, ``"auto"``); ``Budget.parse(text)`` gives this
            budget back, so it is what messages and tuned YAML files show.

    Example:
        >>> budget = Budget.parse("1.5GiB")
        >>> budget.kind, budget.value, str(budget)
        ('bytes', 1610612736, '1.5GiB')
        >>> Budget.parse(0.5).resolve(total_bytes=8 * 2**30, free_bytes=2**30)
        4294967296
    """

    kind: BudgetKind
    value: int | float | None
    text: str = field(compare=False)

    #: Bytes per unit; unit names are matched case-insensitively.
    UNITS: ClassVar[dict[str, int]] = {
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
        "KiB": 2**10,
        "MiB": 2**20,
        "GiB": 2**30,
        "TiB": 2**40,
    }
    KINDS: ClassVar[tuple[str, ...]] = ("bytes", "fraction", "auto")
    #: ``'auto'`` keeps back ``max(AUTO_MARGIN_MIN_BYTES, AUTO_MARGIN_FRACTION * total)`` of the free memory, for
    #: the allocator's fragmentation, CUDA/cuDNN workspaces and other processes that grow while the run goes on.
    AUTO_MARGIN_MIN_BYTES: ClassVar[int] = 512 * 2**20
    AUTO_MARGIN_FRACTION: ClassVar[float] = 0.05
    ACCEPTED: ClassVar[str] = (
        "bytes like '20GiB', '512MiB' or 4294967296, a fraction of total memory in (0, 1] like 0.8, or 'auto'"
    )

    def __post_init__(self) -> None:
        valid = (
            (self.kind == "bytes" and _is_int(self.value) and self.value > 0)
            or (self.kind == "fraction" and isinstance(self.value, float) and 0.0 < self.value <= 1.0)
            or (self.kind == "auto" and self.value is None)
        )
        if not valid:
            raise ValueError(
                f"Budget(kind={self.kind!r}, value={self.value!r}) is not valid: kind must be one of "
                f"{', '.join(repr(k) for k in self.KINDS)} with a positive int of bytes, a float in (0, 1] or None; "
                "build budgets with Budget.parse('20GiB')"
            )

    @classmethod
    def parse(cls, value: BudgetSpec) -> Budget:
        """Parse a budget spec.

        Strings are matched ignoring case and surrounding whitespace; a space between number and unit is allowed.

        Args:
            value: A positive ``int`` of bytes; a string of bytes with a unit (``"20GiB"``, ``"20GB"``,
                ``"1.5 GiB"``, ``"4096B"``; units B, KB, MB, GB, TB and KiB, MiB, GiB, TiB) or a plain digit string
                (``"4096"``, bytes); a fraction of total memory in (0, 1] as a ``float`` or a decimal string
                (``0.8``, ``"0.8"``); ``"auto"``; or a :class:`Budget`, returned as it is. Fractional byte counts
                (``"1.1MiB"``) are rounded down to whole bytes.

        Returns:
            The parsed budget.

        Raises:
            ValueError: If ``value`` is none of these, including zero, negative sizes, NaN, fractions above 1
                (``1.5``, ``"1.5"``), unknown units (``"20XB"``), ``bool`` and ``None``.

        Example:
            >>> Budget.parse("20GiB").value
            21474836480
            >>> Budget.parse("0.8").kind
            'fraction'
        """
        if isinstance(value, Budget):
            return value
        if _is_int(value):
            if value > 0:
                return cls(kind="bytes", value=int(value), text=str(int(value)))
        elif isinstance(value, float):
            if 0.0 < value <= 1.0:  # False for NaN
                return cls(kind="fraction", value=value, text=_fraction_text(value))
        elif isinstance(value, str):
            parsed = cls._parse_text(value.strip())
            if parsed is not None:
                return parsed
        raise ValueError(f"budget must be {cls.ACCEPTED}; got {value!r}")

    @classmethod
    def _parse_text(cls, text: str) -> Budget | None:
        if text.lower() == "auto":
            return cls(kind="auto", value=None, text="auto")
        match = _SPEC_PATTERN.fullmatch(text)
        if match is None:
            return None
        number, unit = match.group("number"), match.group("unit")
        if unit is None:
            if "." not in number:  # a plain digit string is bytes
                count = int(number)
                return cls(kind="bytes", value=count, text=str(count)) if count > 0 else None
            fraction = float(number)
            if not 0.0 < fraction <= 1.0:
                return None
            return cls(kind="fraction", value=fraction, text=_fraction_text(fraction))
        canonical_unit = next((name for name in cls.UNITS if name.lower() == unit.lower()), None)
        if canonical_unit is None:
            return None
        count = int(Decimal(number) * cls.UNITS[canonical_unit])  # exact, then rounded down to whole bytes
        if count <= 0:
            return None
        return cls(kind="bytes", value=count, text=f"{_number_text(number)}{canonical_unit}")

    @classmethod
    def margin_bytes(cls, *, total_bytes: int) -> int:
        """The free memory that ``'auto'`` keeps back on a device with ``total_bytes`` of memory.

        Args:
            total_bytes: The device's total memory.

        Returns:
            ``max(AUTO_MARGIN_MIN_BYTES, AUTO_MARGIN_FRACTION * total_bytes)``: 512 MiB or 5% of total.

        Example:
            >>> Budget.margin_bytes(total_bytes=80 * 2**30) == 4 * 2**30
            True
        """
        return max(cls.AUTO_MARGIN_MIN_BYTES, int(cls.AUTO_MARGIN_FRACTION * total_bytes))

    def resolve(self, *, total_bytes: int, free_bytes: int) -> int:
        """The budget in bytes on a device with the given memory.

        Args:
            total_bytes: The device's total memory (must be positive).
            free_bytes: The device's free memory now (used by ``'auto'`` only).

        Returns:
            Bytes: the value itself for a byte budget, ``int(fraction * total_bytes)`` for a fraction, and
            ``free_bytes - margin_bytes(total_bytes=total_bytes)`` for ``'auto'``.

        Raises:
            ValueError: If ``total_bytes`` is not positive, ``free_bytes`` is negative, or ``'auto'`` leaves no
                memory because free memory is at or below the margin.

        Example:
            >>> Budget.parse("auto").resolve(total_bytes=8 * 2**30, free_bytes=6 * 2**30) == 6 * 2**30 - 2**29
            True
        """
        if not _is_int(total_bytes) or total_bytes <= 0:
            raise ValueError(f"total_bytes must be a positive int of bytes; got {total_bytes!r}")
        if not _is_int(free_bytes) or free_bytes < 0:
            raise ValueError(f"free_bytes must be a non-negative int of bytes; got {free_bytes!r}")
        if self.kind == "bytes":
            return int(self.value)  # type: ignore[arg-type]
        if self.kind == "fraction":
            return int(self.value * total_bytes)  # type: ignore[operator]
        margin = self.margin_bytes(total_bytes=total_bytes)
        budget = free_bytes - margin
        if budget <= 0:
            raise ValueError(
                f"budget 'auto' leaves no memory: free memory is {format_bytes(free_bytes)} ({free_bytes} bytes), "
                f"at or below the safety margin of {format_bytes(margin)}; free some memory or pass an explicit "
                "budget like '20GiB' or 0.8"
            )
        return budget

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True, kw_only=True)
class ResolvedBudget:
    """A budget in bytes for one device, resolved once by :func:`resolve_budget`, with the spec it came from.

    It is what crosses layers and processes: a search's trials cap their memory at ``budget_bytes``, the bytes the
    search judges them against, and show ``text`` in messages and tuned files.

    Attributes:
        budget: The budget as given; None for "the device's usable memory" (a what-if estimate without ``--budget``).
        budget_bytes: The budget in bytes.
        total_bytes: The device memory it was resolved against; None where that is not known (bytes for a what-if
            device whose memory was not given).
        device_name: The device's name where it was read (the GPU or CPU model); None where it was not.

    Example:
        >>> resolved = resolve_budget("1GiB", "cpu")
        >>> resolved.budget_bytes, resolved.text
        (1073741824, '1GiB')
    """

    budget: Budget | None
    budget_bytes: int
    total_bytes: int | None = None
    device_name: str | None = None

    @property
    def text(self) -> str | None:
        """The budget's canonical spelling (``"auto"``, ``"0.8"``, ``"20GiB"``), None without one."""
        return None if self.budget is None else self.budget.text

    def __str__(self) -> str:
        return self.text if self.text is not None else format_bytes(self.budget_bytes)


def resolve_budget(budget: BudgetSpec | ResolvedBudget | None, device: torch.device | str, *, what_if: bool = False,
                   device_memory: int | None = None) -> ResolvedBudget:
    """Turn a budget into bytes for ``device``: the one place a budget's text becomes bytes.

    Shares of memory (``0.8``, ``"auto"``) are resolved against ``device_memory`` where it is given (a CUDA device
    then has :data:`CUDA_CONTEXT_BYTES` less free), else against a reading of the device (:func:`probe_memory`); a
    what-if device (not on this machine) has no reading. A budget above the device's memory is refused.

    Args:
        budget: A spec :meth:`Budget.parse` takes, a :class:`Budget`, a :class:`ResolvedBudget` (returned as it is:
            resolved once, never again) or None: all of ``device_memory`` less the CUDA context.
        device: The device the budget is for (``torch.device`` or its text).
        what_if: Whether ``device`` is not on this machine (nothing to read).
        device_memory: The device's memory in bytes, in place of a reading.

    Returns:
        The budget in bytes with the spec it came from.

    Raises:
        ValueError: for a bad spec; a budget over the device's memory; a share of a what-if device's memory without
            ``device_memory``; no budget without ``device_memory`` (or with no more than the CUDA context).

    Example:
        >>> resolve_budget(0.5, "cuda", what_if=True, device_memory=8 * 2**30).budget_bytes == 4 * 2**30
        True
    """
    if isinstance(budget, ResolvedBudget):
        return budget
    import torch

    device = torch.device(device)
    parsed = None if budget is None else Budget.parse(budget)
    context = CUDA_CONTEXT_BYTES if device.type == "cuda" else 0
    name = None
    if device_memory is not None:
        total, free = device_memory, max(device_memory - context, 0)
    elif what_if:
        total = free = None
    else:
        from autotune._device.probe import probe_memory

        probe = probe_memory(device)
        total, free, name = probe.total_bytes, probe.free_bytes, probe.name
    if parsed is None:
        if device_memory is None or device_memory <= context:
            raise ValueError(f"the device's memory must exceed the CUDA context ({context} bytes); got "
                             f"{device_memory!r}")
        return ResolvedBudget(budget=None, budget_bytes=device_memory - context, total_bytes=total)
    if total is None or free is None:
        if parsed.kind != "bytes":
            raise ValueError(f"budget {parsed.text!r} is a share of the device's memory, and {device} is not on this "
                             "machine: give the budget in bytes (80GiB) or the device's memory (--device-memory)")
        return ResolvedBudget(budget=parsed, budget_bytes=int(parsed.value))  # type: ignore[arg-type]
    budget_bytes = parsed.resolve(total_bytes=total, free_bytes=free)
    if budget_bytes > total:
        raise ValueError(_over_device(parsed, budget_bytes, device=device, total_bytes=total))
    return ResolvedBudget(budget=parsed, budget_bytes=budget_bytes, total_bytes=total, device_name=name)


def _over_device(budget: Budget, budget_bytes: int, *, device: object, total_bytes: int) -> str:
    """The one sentence refusing a budget above the device's memory, whoever resolves it."""
    return (f"budget {budget.text} ({format_bytes(budget_bytes)}) is more than {device}'s memory "
            f"({format_bytes(total_bytes)}); give at most that, a share (0.8) or auto")


def _is_int(value: object) -> bool:
    """Whether ``value`` is an ``int`` and not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def _fraction_text(fraction: float) -> str:
    """A fraction's canonical text, always with a decimal point so it never reads back as bytes: 1.0 -> ``"1.0"``."""
    text = _number_text(fraction)
    return text if "." in text else f"{text}.0"


def _number_text(number: str | float) -> str:
    """A decimal without exponent or padding: ``"1.50"`` -> ``"1.5"``, ``".5"`` -> ``"0.5"``, 1e-05 -> ``"0.00001"``."""
    text = repr(number) if isinstance(number, float) else number
    return format(Decimal(text).normalize(), "f")
