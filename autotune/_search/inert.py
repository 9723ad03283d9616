"""The search's space for its target: without the choices that apply to nothing for that model (checkpointing that
finds no blocks or whose blocks never run, compile whose modules never run, offload with nothing to move; see
:mod:`autotune._estimate.inert`), which would only spend trials measuring the same step again."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

from autotune._plan.plan import Plan
from autotune._plan.space import Dimension, SearchSpace

__all__ = ["INERT_CHECKED", "without_inert"]

#: The dimensions whose choices may apply to nothing for a model (activation offload does so on the CPU only, where
#: the space has dropped it already: :meth:`autotune._plan.space.SearchSpace.for_device`).
INERT_CHECKED = ("activation_checkpointing", "optimizer_offload", "compile")


def without_inert(space: SearchSpace, inert: Callable[[Plan], dict[str, str]]) -> SearchSpace:
    """``space`` without the choices that ``inert`` (the estimator's, for the target: the plan's settings that apply
    to nothing, by field name, with why) names, one note per dimension that loses some, and without the seeds that
    use them (the note gives the reason of the last choice dropped). A dimension keeps its choices where all would go,
    and its off choice (0, False) is never asked about.

    Example:
        >>> without_inert(space, estimator.inert).notes[-1]  # doctest: +SKIP
        'activation_checkpointing=0.5, 1.0 dropped for this target: it applies to nothing (...)'
    """
    notes, dims = list(space.notes), []
    gone: dict[str, list[int]] = {}  # by dimension: the indices of its dropped choices
    for dim in space.dimensions:
        why: dict[int, str] = {}  # by choice index
        if dim.name in INERT_CHECKED:
            for index, choice in enumerate(dim.choices):
                reason = inert(Plan(**{dim.name: choice})).get(dim.name) if choice else None
                if reason:
                    why[index] = reason
        if not why or len(why) == len(dim.choices):
            dims.append(dim)
            continue
        gone[dim.name] = list(why)
        dims.append(dataclasses.replace(dim, choices=tuple(c for i, c in enumerate(dim.choices) if i not in why)))
        seeds = sum(1 for seed in space.seeds if _uses(seed, dim, why))
        notes.append(f"{dim.name}={', '.join(repr(dim.choices[i]) for i in why)} dropped for this target: it applies "
                     f"to nothing ({why[max(why)]})" + (f"; {seeds} seed(s) with it left out" if seeds else ""))
    seeds = tuple(seed for seed in space.seeds
                  if not any(_uses(seed, dim, gone.get(dim.name, [])) for dim in space.dimensions))
    return dataclasses.replace(space, dimensions=tuple(dims), seeds=seeds, notes=tuple(notes))


def _uses(seed: dict[str, object], dim: Dimension, indices: Iterable[int]) -> bool:
    """Whether ``seed`` takes one of ``dim``'s choices at ``indices``."""
    return dim.name in seed and any(seed[dim.name] == dim.choices[i] for i in indices)
