"""``Provenance``: where a plan came from and what was measured with it, and the checks of its mapping and of a tuned
file's format version."""

from __future__ import annotations

import dataclasses
import datetime
import platform
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from autotune._plan.tuned import FORMAT_VERSION


@dataclass(frozen=True, kw_only=True)
class Provenance:
    """Where a plan came from and what was measured with it (all optional; kept through the tuned file).

    Example:
        >>> Provenance(budget="4GiB", device_name="NVIDIA H100", samples_per_second=812.5).budget
        '4GiB'
    """

    budget: str | None = None
    device_name: str | None = None
    device_total_bytes: int | None = None
    samples_per_second: float | None = None  # a search's: the mean of the chosen plan's runs
    samples_per_second_interval: list[float] | None = None  # its 95%-style interval (see docs/search.md)
    measurements: int | None = None  # how many runs the figure is the mean of
    tokens_per_second: float | None = None
    peak_bytes: int | None = None
    predicted_peak_bytes: int | None = None
    versions: dict[str, str] = field(default_factory=dict)
    created: str | None = None
    command: str | None = None
    produced_by: str | None = None  # "search", "estimate", "hand"
    trainer_settings: dict[str, Any] = field(default_factory=dict)  # the user's Trainer settings the trials ran with
    # the step-time model's prediction for the plan (samples_per_second, mfu, bound, device, error, ...): all a
    # suggested plan has (``autotune suggest``: nothing measured), beside the measured figures of a searched one
    prediction: dict[str, Any] = field(default_factory=dict)
    # a search's decisive paired comparisons (docs/search.md, "How a verdict is protected"): each rival, its ratio to
    # the plan it met with the interval, the rounds, and the verdict
    paired: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def here(cls, **fields: Any) -> Provenance:
        """A provenance stamped with the library versions and today's date, plus ``fields``."""
        import lightning
        import torch

        from autotune._version import __version__

        versions = {"autotune": __version__, "torch": str(torch.__version__), "lightning": str(lightning.__version__),
                    "python": platform.python_version()}
        created = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        return cls(versions=versions, created=created, **fields)

    def as_dict(self) -> dict[str, Any]:
        """Only the fields that are set, for the tuned file."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v not in (None, {}, [])}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "provenance") -> Provenance:
        """The provenance of a tuned file or an ``ApplyPlan`` argument (``format_version`` checked and dropped).

        Raises:
            ValueError: naming ``where`` and every problem (a newer format, unknown keys).
        """
        problems = provenance_problems(data, where=where)
        if problems:
            raise ValueError("; ".join(problems))
        return cls(**{k: v for k, v in data.items() if k != "format_version"})


def provenance_problems(data: Any, *, where: str = "provenance") -> list[str]:
    """Every problem with a provenance mapping, each starting with ``where``."""
    if not isinstance(data, Mapping):
        return [f"{where}: must be a mapping; got {type(data).__name__}"]
    problems = version_problems(data, where=f"{where}.format_version")
    unknown = sorted(set(data) - {f.name for f in dataclasses.fields(Provenance)} - {"format_version"})
    if unknown:
        problems.append(f"{where}: unknown keys {', '.join(map(str, unknown))}")
    return problems


def version_problems(data: Mapping[str, Any], *, where: str = "format_version") -> list[str]:
    """A problem when ``data['format_version']`` is not a version this lightning-autotune reads (missing: current)."""
    version = data.get("format_version", FORMAT_VERSION)
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        return [f"{where}: must be a positive int; got {version!r}"]
    if version > FORMAT_VERSION:
        return [f"{where}: {version!r} is newer than this lightning-autotune reads ({FORMAT_VERSION}); upgrade "
                "lightning-autotune"]
    return []
