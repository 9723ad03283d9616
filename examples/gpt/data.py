"""A deterministic synthetic token corpus as a LightningDataModule (the example's data)."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override


class SyntheticTokens(LightningDataModule):
    """Sequences from a noisy Markov chain over ``vocab_size`` tokens: learnable, so the loss goes down.

    A seeded permutation ``next_of`` of the vocabulary drives the chain: each token is followed by ``next_of[token]``
    with probability ``1 - noise`` and by a uniformly random token otherwise. The best achievable loss is therefore
    well below the ``log(vocab_size)`` of an untrained model. Everything (the chain, the samples, the shuffling
    order) comes from ``torch.Generator``s seeded with ``seed``, so two modules with the same arguments yield the
    same batches.

    Each batch is ``(input_ids, targets)``: two long tensors of shape (batch_size, block_size), ``targets`` being
    ``input_ids`` shifted left by one token.

    Args:
        vocab_size: number of token ids.
        block_size: tokens per sample.
        batch_size: the EFFECTIVE batch of one optimizer step. With ``ElasticBatchSize`` the dataloader yields the
            whole effective batch and the callback cuts it into micro-batches that fit in memory; keep
            ``Trainer(accumulate_grad_batches=1)``.
        num_samples: training samples (whole batches only: the last partial batch is dropped).
        val_samples: validation samples.
        num_workers: dataloader worker processes.
        pin_memory: pin host memory of batches (speeds up copies to a GPU).
        seed: seed of the corpus and of the shuffling order.
        noise: probability that a token is followed by a random token instead of its successor.

    Raises:
        ValueError: for a bad argument, naming it and what is accepted.

    Example:
        >>> dm = SyntheticTokens(batch_size=4, block_size=8, num_samples=16, val_samples=4)
        >>> dm.setup("fit")
        >>> [t.shape for t in next(iter(dm.train_dataloader()))]
        [torch.Size([4, 8]), torch.Size([4, 8])]
    """

    def __init__(
        self,
        *,
        vocab_size: int = 256,
        block_size: int = 64,
        batch_size: int = 32,
        num_samples: int = 2048,
        val_samples: int = 256,
        num_workers: int = 0,
        pin_memory: bool = False,
        seed: int = 0,
        noise: float = 0.1,
    ) -> None:
        super().__init__()
        for name, value, minimum in (("vocab_size", vocab_size, 2), ("block_size", block_size, 1),
                                     ("batch_size", batch_size, 1), ("val_samples", val_samples, 1),
                                     ("num_workers", num_workers, 0)):
            _check_int(name, value, minimum=minimum)
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < batch_size:
            raise ValueError(f"`num_samples` must be an int >= `batch_size` ({batch_size}); got {num_samples!r}")
        _check_int("seed", seed, minimum=0)
        if not 0.0 <= noise <= 1.0:
            raise ValueError(f"`noise` must be in [0, 1]; got {noise!r}")
        self.save_hyperparameters()
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.batch_size = batch_size
        self.num_samples = num_samples
        self.val_samples = val_samples
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.seed = seed
        self.noise = noise
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None

    def corpus(self) -> Tensor:
        """All ``num_samples + val_samples`` sequences of ``block_size + 1`` tokens, training ones first."""
        gen = torch.Generator().manual_seed(self.seed)
        next_of = torch.randperm(self.vocab_size, generator=gen)
        n, length = self.num_samples + self.val_samples, self.block_size + 1
        tokens = torch.empty(n, length, dtype=torch.long)
        tokens[:, 0] = torch.randint(self.vocab_size, (n,), generator=gen)
        for t in range(1, length):
            random = torch.randint(self.vocab_size, (n,), generator=gen)
            keep = torch.rand(n, generator=gen) >= self.noise
            tokens[:, t] = torch.where(keep, next_of[tokens[:, t - 1]], random)
        return tokens

    @override
    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        tokens = self.corpus()
        train, val = tokens[: self.num_samples], tokens[self.num_samples :]
        self.train_set = TensorDataset(train[:, :-1], train[:, 1:])
        self.val_set = TensorDataset(val[:, :-1], val[:, 1:])

    @override
    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    @override
    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    def _loader(self, dataset: TensorDataset | None, *, shuffle: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError("SyntheticTokens: call `setup()` before asking for a dataloader")
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            drop_last=shuffle,  # training steps always see the full effective batch
            generator=torch.Generator().manual_seed(self.seed) if shuffle else None,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.num_workers > 0,
        )


def _check_int(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"`{name}` must be an int >= {minimum}; got {value!r}")
