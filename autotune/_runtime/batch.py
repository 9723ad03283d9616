"""Batch structure helpers: find the batch size, cut a micro-batch, put outputs back together.

A batch is any nesting of mappings, sequences, namedtuples and dataclasses around tensors (or NumPy arrays). The
batch size ``N`` is the length of the first dimension of the first tensor found depth-first. A micro-batch keeps
the structure and cuts every tensor whose first dimension is ``N``; other tensors (a scalar, a shared mask) are
passed unchanged.

A list or tuple of ``N`` items that does not hold the tensor ``N`` was read from is a per-sample list, cut too, when
its items are numbers or strings (ids, captions). It is per-sample too when its items are all of one kind (``None``
aside) and are tensors other than ``N``-row tensors of one shape (images of mixed resolutions, one box tensor per
image). Containers that do not all hold a tensor of ``N`` samples count alike (one target dict per image, ``(h, w)``
sizes). Any other list or tuple is structure (``[x, y]``, ``(input_ids, position_ids)``, sub-batches) and each
item is mapped. Mappings, namedtuples and dataclasses are always structure. So put a tuple of ``N`` items that is not
per-sample (a ``(mean, std)`` pair when ``N`` is 2) in one of those.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

try:  # NumPy is optional for torch; batches may still carry arrays when it is there.
    import numpy as np

    _ARRAY_TYPES: tuple[type, ...] = (Tensor, np.ndarray)
except ImportError:  # pragma: no cover - numpy ships with every torch wheel we support
    _ARRAY_TYPES = (Tensor,)

_LEAF_TYPES = (str, bytes, int, float, bool, type(None))


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def _is_dataclass_instance(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def _children(batch: Any) -> Any:
    """What a batch's container holds (mapping values, dataclass fields, sequence items); () for anything else."""
    if isinstance(batch, Mapping):
        return batch.values()
    if _is_dataclass_instance(batch):
        return (getattr(batch, f.name) for f in dataclasses.fields(batch) if hasattr(batch, f.name))
    if isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)):
        return batch
    return ()


def batch_size_of(batch: Any) -> int | None:
    """The first dimension of the first tensor in ``batch`` (depth-first); in a batch without tensors (texts and ids,
    tokenized in ``training_step``), the length of its first list of numbers or strings; None when it has neither.

    Example:
        >>> batch_size_of({"text": ["a b", "c", "d e f"], "id": [4, 5, 6]})
        3
    """
    first = _first_array(batch)
    if first is not None:
        return int(first.shape[0])
    items = _first_leaf_list(batch)
    return None if items is None else len(items)


def _first_leaf_list(batch: Any) -> Any:
    """The first non-empty list or tuple of numbers and strings in ``batch``, depth-first (not all None), or None."""
    if isinstance(batch, (list, tuple)) and batch and not _is_namedtuple(batch) and all(
            isinstance(v, _LEAF_TYPES) or _is_number(v) for v in batch) and any(v is not None for v in batch):
        return batch
    for child in _children(batch):
        found = _first_leaf_list(child)
        if found is not None:
            return found
    return None


def sample_size_of(batch: Any, size: int) -> float:
    """Count the elements per sample in a batch of ``size`` samples.

    Every tensor whose first dimension is ``size`` adds the product of its other dimensions (sequence length,
    channels x height x width). Each per-sample list adds its tensors' elements over ``size`` (a list of images of
    different sizes). The count is 1.0 when there is none.

    With dynamic padding it follows the batch's padded length; with mixed resolutions, its image size.

    Example:
        >>> sample_size_of({"input_ids": torch.zeros(4, 9), "mask": torch.zeros(4, 9), "label": torch.zeros(4)}, 4)
        19.0
        >>> sample_size_of({"label": torch.zeros(2), "images": [torch.zeros(3, 4, 4), torch.zeros(3, 2, 2)]}, 2)
        31.0
    """
    return _elements_per_sample(batch, size, _first_array(batch)) or 1.0


def _elements_per_sample(batch: Any, size: int, first: Any) -> float:
    if isinstance(batch, _ARRAY_TYPES):
        return _elements(batch) / size if batch.ndim > 0 and batch.shape[0] == size else 0.0
    if isinstance(batch, (list, tuple)) and _is_per_sample(batch, size, first):
        return sum(_elements(a) for a in _arrays(batch)) / size
    return sum(_elements_per_sample(child, size, first) for child in _children(batch))


def _elements(array: Any) -> float:
    n = 1
    for d in array.shape:
        n *= int(d)
    return float(n)


def _arrays(batch: Any) -> Any:
    if isinstance(batch, _ARRAY_TYPES):
        yield batch
    for child in _children(batch):
        yield from _arrays(child)


def slice_batch(batch: Any, start: int, stop: int, size: int) -> Any:
    """Samples ``start:stop`` of a batch of ``size`` samples, keeping its structure.

    Example:
        >>> b = {"x": torch.arange(6).view(3, 2), "ids": ["a", "b", "c"], "scale": torch.tensor(2.0)}
        >>> part = slice_batch(b, 1, 3, 3)
        >>> part["x"].tolist(), part["ids"], part["scale"].item()
        ([[2, 3], [4, 5]], ['b', 'c'], 2.0)
    """
    def cut(array: Any) -> Any:
        return array[start:stop] if array.ndim > 0 and array.shape[0] == size else array

    first = _first_array(batch)

    def per_sample(items: list[Any] | tuple[Any, ...]) -> Any:  # ids, captions, a target per image
        return items[start:stop] if _is_per_sample(items, size, first) else None

    return _map_arrays(batch, cut, per_sample)


def passed_whole(batch: Any, size: int) -> list[tuple[int, ...]]:
    """The shapes of the tensors that every micro-batch of ``batch`` (of ``size`` samples) gets whole: those of one
    or more dimensions whose first is not ``size``, per-sample lists aside.

    Example:
        >>> passed_whole({"x": torch.zeros(7, 4, 3), "y": torch.zeros(4), "w": torch.zeros(3)}, 7)
        [(4,), (3,)]
    """
    first = _first_array(batch)
    shapes: list[tuple[int, ...]] = []

    def note(array: Any) -> Any:
        if array.ndim > 0 and array.shape[0] != size:
            shapes.append(tuple(array.shape))
        return array

    _map_arrays(batch, note, lambda items: items if _is_per_sample(items, size, first) else None)
    return shapes


def _first_array(batch: Any) -> Any:
    """The first tensor or array in ``batch`` depth-first, 0-d ones aside (``N`` is its first dimension), or None."""
    if isinstance(batch, _ARRAY_TYPES):
        return batch if batch.ndim > 0 else None
    for child in _children(batch):
        found = _first_array(child)
        if found is not None:
            return found
    return None


def _holds(value: Any, test: Any) -> bool:
    """Whether ``value`` is, or holds at any depth, a tensor or array for which ``test`` is true."""
    if isinstance(value, _ARRAY_TYPES):
        return bool(test(value))
    return any(_holds(child, test) for child in _children(value))


def _kind(value: Any) -> Any:
    """What items of one per-sample list share: their type, and for arrays their number of dimensions and dtype,
    for mappings their keys."""
    if isinstance(value, _ARRAY_TYPES):
        return type(value), value.ndim, value.dtype
    if isinstance(value, Mapping):
        return type(value), tuple(value)
    return type(value)


def _is_per_sample(items: list[Any] | tuple[Any, ...], size: int, first: Any) -> bool:
    """Whether a list or tuple is one item per sample of a batch of ``size`` (see the module's docstring)."""
    if len(items) != size or not items:
        return False
    if all(isinstance(v, _LEAF_TYPES) or _is_number(v) for v in items):
        return True
    present = [v for v in items if v is not None]
    if len({_kind(v) for v in present}) != 1 or _holds(items, lambda a: a is first):
        return False
    if isinstance(present[0], _ARRAY_TYPES):  # tensors: structure only as N-row tensors of one shape (sub-batches)
        return len({tuple(v.shape) for v in present}) > 1 or present[0].shape[0] != size
    return not all(_holds(v, lambda a: a.ndim > 0 and a.shape[0] == size) for v in present)


def _is_number(value: Any) -> bool:
    return _ARRAY_TYPES[-1] is not Tensor and isinstance(value, np.generic)  # NumPy ids (``df.index.values``)


def split_sizes(batch_size: int, micro_batch_size: int) -> list[int]:
    """Sizes of the micro-batches that cover ``batch_size`` samples: full ones, then the remainder.

    Example:
        >>> split_sizes(10, 4)
        [4, 4, 2]
    """
    micro = max(1, min(micro_batch_size, batch_size))
    full, rest = divmod(batch_size, micro)
    return [micro] * full + ([rest] if rest else [])


def sequence_length(batch: Any, size: int) -> int | None:
    """The batch's sequence length: the second dimension of its first tensor of two or more dimensions whose first
    is ``size`` (None when it has none).

    Example:
        >>> sequence_length({"label": torch.zeros(4), "input_ids": torch.zeros(4, 9)}, 4)
        9
    """
    if isinstance(batch, Tensor):
        return int(batch.shape[1]) if batch.ndim >= 2 and batch.shape[0] == size else None
    for child in _children(batch):
        found = sequence_length(child, size)
        if found is not None:
            return found
    return None


def with_sequence_length(batch: Any, size: int, length: int) -> Any:
    """The batch with its sequence length (see :func:`sequence_length`) made ``length``: every dimension after the
    first that has the old length, in every tensor whose first dimension is ``size`` (token ids, masks, labels,
    [L, L] masks), is cut or filled by repeating its values; the structure and everything else are kept.

    Raises:
        ValueError: when the batch has no sequence dimension.

    Example:
        >>> b = with_sequence_length({"ids": torch.tensor([[1, 2, 3]]), "mask": torch.ones(1, 3, 3)}, 1, 5)
        >>> b["ids"].tolist(), tuple(b["mask"].shape)
        ([[1, 2, 3, 1, 2]], (1, 5, 5))
    """
    old = sequence_length(batch, size)
    if old is None:
        raise ValueError(f"the batch has no sequence dimension (no tensor of shape [{size}, length, ...]) to set to "
                         f"length {length}")

    def resize(t: Any) -> Any:
        if not isinstance(t, Tensor) or t.ndim < 2 or t.shape[0] != size:
            return t
        index = torch.arange(length, device=t.device) % old
        for dim in range(1, t.ndim):
            if t.shape[dim] == old:
                t = t.index_select(dim, index)
        return t

    return _map_arrays(batch, resize)


def _map_arrays(batch: Any, fn: Any, lists: Any = None) -> Any:
    """``batch`` with ``fn`` applied to every tensor and array in it, its structure kept (mappings, namedtuples,
    dataclasses, lists, tuples); ``lists`` may replace a list or tuple whole (its result; None: map inside it)."""
    if isinstance(batch, _ARRAY_TYPES):
        return fn(batch)
    if isinstance(batch, Mapping):
        items = {k: _map_arrays(v, fn, lists) for k, v in batch.items()}
        try:
            return type(batch)(items)
        except TypeError:  # mappings without a dict constructor (e.g. defaultdict needs a factory)
            return items
    if _is_namedtuple(batch):
        return type(batch)(*(_map_arrays(v, fn, lists) for v in batch))
    if _is_dataclass_instance(batch):  # ``replace`` (``__post_init__`` runs again), then fields set after it
        fields = [f for f in dataclasses.fields(batch) if hasattr(batch, f.name)]
        try:
            mapped = dataclasses.replace(batch, **{f.name: _map_arrays(getattr(batch, f.name), fn, lists)
                                                   for f in fields if f.init})
        except (TypeError, ValueError):  # an InitVar, or a __post_init__ that needs more: a copy of the object
            mapped = copy.copy(batch)
        for f in fields:  # ``init=False`` fields the batch's maker set (per-sample weights), frozen or not
            old = getattr(batch, f.name)
            new = _map_arrays(old, fn, lists)
            if new is not old or not hasattr(mapped, f.name):  # not one ``__post_init__`` derives (a count)
                object.__setattr__(mapped, f.name, new)
        return mapped
    if isinstance(batch, (list, tuple)):
        whole = lists(batch) if lists is not None else None
        return whole if whole is not None else type(batch)(_map_arrays(v, fn, lists) for v in batch)
    return batch


def split_even(batch_size: int, count: int) -> list[int]:
    """``batch_size`` samples in exactly ``count`` micro-batches as even as can be, larger ones first (FSDP2: the
    ranks run the same number of micro-batches, whatever each one's own split would be).

    Example:
        >>> split_even(32, 3)
        [11, 11, 10]
    """
    base, extra = divmod(batch_size, count)
    return [base + 1] * extra + [base] * (count - extra)


def scale_loss(loss: Tensor, *, sizes: list[int], index: int) -> Tensor:
    """Weight micro-batch ``index``'s mean loss so the micro-batches add up to the whole batch's mean.

    An even split divides by the number of micro-batches, as Lightning's own accumulation does, so the result is
    bit-identical to it; an uneven split weights by ``n_i / N``.
    """
    if len(sizes) == 1:
        return loss
    if all(n == sizes[0] for n in sizes):
        return loss / len(sizes)
    return loss * (sizes[index] / sum(sizes))


def scale_step_output(output: Any, *, sizes: list[int], index: int) -> Any:
    """Apply :func:`scale_loss` to what ``training_step`` returned (a loss tensor, a dict with "loss", or None)."""
    if isinstance(output, Tensor):
        return scale_loss(output, sizes=sizes, index=index)
    if isinstance(output, Mapping) and isinstance(output.get("loss"), Tensor):
        scaled = dict(output)
        scaled["loss"] = scale_loss(output["loss"], sizes=sizes, index=index)
        return scaled
    return output


def combine_outputs(outputs: list[Any], sizes: list[int]) -> Any:
    """Put the outputs of the micro-batches of one evaluation batch back together.

    Tensors whose first dimension is the micro-batch size are concatenated. Other tensors and numbers are averaged,
    weighted by micro-batch size. Per-sample lists are concatenated (by the rule that cuts a batch's lists, the largest
    part deciding: one prediction dict or tensor per sample). Other containers are combined element-wise. Anything
    else is taken from the last part.

    Example:
        >>> combine_outputs([torch.ones(2, 3), torch.zeros(1, 3)], [2, 1]).shape
        torch.Size([3, 3])
    """
    if len(outputs) == 1:
        return outputs[0]
    first = outputs[0]
    if first is None:
        return None
    if isinstance(first, Tensor):
        if first.ndim > 0 and all(o.ndim > 0 and o.shape[0] == n for o, n in zip(outputs, sizes)):
            return torch.cat(outputs)
        total = sum(sizes)
        return sum(o * (n / total) for o, n in zip(outputs, sizes))
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return sum(o * n for o, n in zip(outputs, sizes)) / sum(sizes)
    if isinstance(first, Mapping):
        return type(first)({k: combine_outputs([o[k] for o in outputs], sizes) for k in first})
    if _is_namedtuple(first):
        return type(first)(*(combine_outputs(list(parts), sizes) for parts in zip(*outputs)))
    if isinstance(first, (list, tuple)):
        if _is_per_sample(first, sizes[0], None) and all(len(o) == n for o, n in zip(outputs, sizes)):
            return type(first)(item for o in outputs for item in o)  # per-sample lists concatenate
        return type(first)(combine_outputs(list(parts), sizes) for parts in zip(*outputs))
    return outputs[-1]
