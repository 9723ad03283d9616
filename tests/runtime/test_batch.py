"""How a micro-batch is cut from a batch: which lists are one item per sample and which are structure."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from autotune._runtime.batch import batch_size_of, sample_size_of, slice_batch


def test_per_sample_lists_of_any_kind_are_cut() -> None:
    batch = {
        "images": torch.zeros(4, 3),
        "boxes": [torch.zeros(k, 4) for k in (1, 4, 2, 3)],  # one tensor per image; one happens to have 4 rows
        "targets": [{"labels": torch.tensor([i])} for i in range(4)],
        "ids": list(np.arange(4)),  # NumPy ids, as ``df.index.values`` gives
        "sizes": [(i, i + 1) for i in range(4)],
        "names": ["a", None, "c", "d"],
    }
    part = slice_batch(batch, 1, 3, 4)
    assert [len(b) for b in part["boxes"]] == [4, 2]  # the box tensor with 4 rows is a sample, not cut itself
    assert [t["labels"].item() for t in part["targets"]] == [1, 2]
    assert [int(i) for i in part["ids"]] == [1, 2]
    assert part["sizes"] == [(1, 2), (2, 3)] and part["names"] == [None, "c"]


def test_lists_that_are_structure_are_mapped_not_cut() -> None:
    ids, positions = torch.arange(6).view(2, 3), torch.arange(3).view(1, 3)
    part = slice_batch((ids, positions), 1, 2, 2)  # two items, batch of two: a pair, not two samples
    assert part[0].tolist() == [[3, 4, 5]] and part[1] is positions
    x, y = torch.arange(2), torch.arange(2) * 10
    assert [t.tolist() for t in slice_batch([x, y], 0, 1, 2)] == [[0], [0]]
    mixed = [torch.zeros(3, 2), torch.zeros(5), "cfg"]  # different kinds: structure
    assert [getattr(v, "shape", v) for v in slice_batch(mixed, 0, 1, 3)] == [(1, 2), (5,), "cfg"]
    part = slice_batch({"labels": torch.zeros(2), "inputs": (torch.zeros(2, 5), None)}, 0, 1, 2)["inputs"]
    assert part[0].shape == (1, 5) and part[1] is None  # None aside, one N-row tensor: structure
    sub = slice_batch({"y": torch.zeros(2), "text": [torch.zeros(2, 5), torch.ones(2, 5)]}, 1, 2, 2)["text"]
    assert [t.shape for t in sub] == [(1, 5), (1, 5)]  # N-row tensors of one shape: a sub-batch


def test_images_whose_channels_equal_the_batch_size_are_still_samples() -> None:
    images = [torch.zeros(3, h, h) for h in (4, 5, 6)]
    part = slice_batch({"label": torch.zeros(3), "images": images}, 1, 3, 3)["images"]
    assert [tuple(t.shape) for t in part] == [(3, 5, 5), (3, 6, 6)]


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: torch.Tensor
    weight: torch.Tensor = dataclasses.field(init=False)


def test_dataclass_fields_set_after_construction_are_cut() -> None:
    batch = Frozen(torch.arange(4))
    object.__setattr__(batch, "weight", torch.arange(4) * 2.0)
    part = slice_batch(batch, 2, 4, 4)
    assert part.x.tolist() == [2, 3] and part.weight.tolist() == [4.0, 6.0]
    assert batch.x.tolist() == [0, 1, 2, 3]  # the batch itself is left as it was
    assert batch_size_of(Frozen(torch.zeros(3))) == 3  # ``weight`` not set yet: skipped, not an AttributeError


@dataclasses.dataclass
class Counted:
    x: torch.Tensor
    size: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.size = len(self.x)


def test_a_dataclass_micro_batch_runs_its_post_init() -> None:
    assert slice_batch(Counted(torch.zeros(4)), 0, 3, 4).size == 3


def test_sample_size_counts_per_sample_lists_of_images() -> None:
    images = [torch.zeros(3, 8, 8), torch.zeros(3, 4, 4), torch.zeros(3, 2, 2), torch.zeros(3, 2, 2)]
    assert sample_size_of({"label": torch.zeros(4), "images": images}, 4) == 1 + 3 * (64 + 16 + 4 + 4) / 4
    assert sample_size_of({"label": torch.zeros(4), "images": images[:1] * 4}, 4) == 1 + 3 * 64  # follows the size
