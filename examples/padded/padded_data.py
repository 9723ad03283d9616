"""Variable-length token sequences, padded per batch to the batch's longest (dynamic padding): the example's data."""

from __future__ import annotations

import math
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

#: The label of padded positions (the loss ignores it, as transformers' collators do).
IGNORE_INDEX = -100


def long_tailed_lengths(count: int, *, short: int, longest: int, generator: torch.Generator) -> list[int]:
    """``count`` batch lengths: most near ``short``, a few up to ``longest`` (a Pareto tail, clipped).

    Example:
        >>> lengths = long_tailed_lengths(1000, short=16, longest=128, generator=torch.Generator().manual_seed(0))
        >>> min(lengths) >= 8, max(lengths) <= 128, sorted(lengths)[500] < 32
        (True, True, True)
    """
    u = torch.rand(count, generator=generator, dtype=torch.float64)
    return [max(short // 2, min(longest, int(short / (1.0 - float(x)) ** 0.55))) for x in u]


class VariableLengthTokens(Dataset):
    """Samples of a noisy Markov chain over ``vocab_size`` tokens, of varying length.

    Samples come in groups of ``group`` (one batch per rank and step): within a group every length lies between half
    the group's length and that length, the group lengths following :func:`long_tailed_lengths`, as a sampler that
    groups samples by length (transformers' ``group_by_length``) delivers them. Read in order (no shuffling), each
    batch of ``group`` samples has its own padded length.
    """

    def __init__(self, *, num_samples: int, group: int, vocab_size: int, short: int, longest: int, seed: int,
                 noise: float = 0.1) -> None:
        g = torch.Generator().manual_seed(seed)
        next_of = torch.randperm(vocab_size, generator=g)
        groups = long_tailed_lengths(math.ceil(num_samples / group), short=short, longest=longest, generator=g)
        tops = torch.tensor([groups[i // group] for i in range(num_samples)])
        lengths = torch.maximum(tops // 2, torch.full_like(tops, 2)) + (
            torch.rand(num_samples, generator=g) * (tops - torch.maximum(tops // 2, torch.full_like(tops, 2)) + 1)
        ).long()
        chain = torch.empty(num_samples, longest, dtype=torch.long)
        chain[:, 0] = torch.randint(vocab_size, (num_samples,), generator=g)
        for t in range(1, longest):  # every sample's chain at once
            follow = torch.rand(num_samples, generator=g) > noise
            chain[:, t] = torch.where(follow, next_of[chain[:, t - 1]],
                                      torch.randint(vocab_size, (num_samples,), generator=g))
        self.samples: list[Tensor] = [chain[i, : int(n)].clone() for i, n in enumerate(lengths)]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> Tensor:
        return self.samples[i]


def pad_collate(samples: list[Tensor]) -> dict[str, Tensor]:
    """Pad a list of token sequences to the longest one: ``input_ids`` (pad 0), ``attention_mask`` (1 on real
    tokens) and ``labels`` (the next token, ``IGNORE_INDEX`` where there is none), each of shape (batch, longest - 1).

    Example:
        >>> batch = pad_collate([torch.tensor([1, 2, 3]), torch.tensor([4, 5])])
        >>> batch["input_ids"].tolist(), batch["labels"].tolist(), batch["attention_mask"].tolist()
        ([[1, 2], [4, 0]], [[2, 3], [5, -100]], [[1, 1], [1, 0]])
    """
    width = max(len(s) for s in samples) - 1
    input_ids = torch.zeros(len(samples), width, dtype=torch.long)
    labels = torch.full((len(samples), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros(len(samples), width, dtype=torch.long)
    for i, s in enumerate(samples):
        n = len(s) - 1
        input_ids[i, :n] = s[:-1]
        labels[i, :n] = s[1:]
        mask[i, :n] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


class PaddedTokens(LightningDataModule):
    """Variable-length sequences, batched in order and padded per batch (see :class:`VariableLengthTokens`).

    Args:
        vocab_size: number of token ids.
        batch_size: the EFFECTIVE batch of one optimizer step (per rank); ``ElasticBatchSize`` splits it.
        short: the typical batch's longest sample, in tokens.
        longest: the longest sample of the longest batches (``longest / short``: how far the tail goes).
        num_samples: training samples.
        seed: seed of the lengths and the tokens.

    Example:
        >>> dm = PaddedTokens(batch_size=4, num_samples=8, short=8, longest=32)
        >>> dm.setup("fit")
        >>> batch = next(iter(dm.train_dataloader()))
        >>> sorted(batch), batch["input_ids"].shape[0]
        (['attention_mask', 'input_ids', 'labels'], 4)
    """

    def __init__(self, *, vocab_size: int = 256, batch_size: int = 32, short: int = 16, longest: int = 128,
                 num_samples: int = 2048, seed: int = 0) -> None:
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("batch_size", batch_size), ("short", short),
                            ("longest", longest), ("num_samples", num_samples)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive int; got {value!r}")
        if not 2 <= short <= longest:
            raise ValueError(f"`short` must be at least 2 and at most `longest` ({longest}); got {short!r}")
        self.vocab_size, self.batch_size, self.short, self.longest = vocab_size, batch_size, short, longest
        self.num_samples, self.seed = num_samples, seed
        self.train: VariableLengthTokens | None = None

    @override
    def setup(self, stage: str) -> None:
        if self.train is None:
            world = self.trainer.world_size if self.trainer is not None else 1
            self.train = VariableLengthTokens(num_samples=self.num_samples, group=self.batch_size * world,
                                              vocab_size=self.vocab_size, short=self.short, longest=self.longest,
                                              seed=self.seed)

    @override
    def train_dataloader(self) -> DataLoader[Any]:
        if self.train is None:
            raise RuntimeError("PaddedTokens.train_dataloader() needs setup('fit') first (Lightning calls it)")
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=False, collate_fn=pad_collate,
                          drop_last=True)
