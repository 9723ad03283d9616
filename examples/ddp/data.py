"""Deterministic synthetic feature vectors in classes as a LightningDataModule (the example's data)."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override


class SyntheticClasses(LightningDataModule):
    """Feature vectors drawn around ``num_classes`` seeded centers: a classification task an MLP learns in steps.

    Class ``c`` has a center ``separation * z_c`` with ``z_c`` standard normal in ``features`` dimensions; a sample
    of class ``c`` is its center plus standard normal noise, passed through a fixed random rotation and a ``tanh``
    (so a linear model is not quite enough). Everything (centers, samples, labels, the shuffling order) comes from
    ``torch.Generator``s seeded with ``seed``, so two modules with the same arguments yield the same batches.

    Each batch is ``(features, labels)``: a float tensor of shape (batch_size, features) and a long tensor of shape
    (batch_size,) with values in ``[0, num_classes)``.

    Under DDP, Lightning gives every rank its own share of the samples (a ``DistributedSampler``) and each rank's
    dataloader yields ``batch_size`` of them per step: the global batch of one optimizer step is
    ``batch_size * world_size``. ``ElasticBatchSize`` cuts each rank's batch into micro-batches.

    Args:
        features: dimensions of a sample.
        num_classes: classes (one center each).
        batch_size: the EFFECTIVE batch of one optimizer step on one rank; keep
            ``Trainer(accumulate_grad_batches=1)``: ``ElasticBatchSize`` does the accumulation.
        num_samples: training samples (whole batches only: the last partial batch is dropped).
        val_samples: validation samples.
        num_workers: dataloader worker processes (per rank).
        pin_memory: pin host memory of batches (speeds up copies to a GPU).
        seed: seed of the centers, the samples and the shuffling order.
        separation: scale of the class centers against the unit noise: larger is easier.

    Raises:
        ValueError: for a bad argument, naming it and what is accepted.

    Example:
        >>> dm = SyntheticClasses(features=8, batch_size=4, num_samples=16, val_samples=4)
        >>> dm.setup("fit")
        >>> [t.shape for t in next(iter(dm.train_dataloader()))]
        [torch.Size([4, 8]), torch.Size([4])]
    """

    def __init__(
        self,
        *,
        features: int = 32,
        num_classes: int = 8,
        batch_size: int = 64,
        num_samples: int = 4096,
        val_samples: int = 512,
        num_workers: int = 0,
        pin_memory: bool = False,
        seed: int = 0,
        separation: float = 0.5,
    ) -> None:
        super().__init__()
        for name, value, minimum in (("features", features, 1), ("num_classes", num_classes, 2),
                                     ("batch_size", batch_size, 1), ("val_samples", val_samples, 1),
                                     ("num_workers", num_workers, 0), ("seed", seed, 0)):
            _check_int(name, value, minimum=minimum)
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < batch_size:
            raise ValueError(f"`num_samples` must be an int >= `batch_size` ({batch_size}); got {num_samples!r}")
        if isinstance(separation, bool) or not isinstance(separation, (int, float)) or not separation > 0:
            raise ValueError(f"`separation` must be a number > 0; got {separation!r}")
        self.save_hyperparameters()
        self.features = features
        self.num_classes = num_classes
        self.batch_size = batch_size
        self.num_samples = num_samples
        self.val_samples = val_samples
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.seed = seed
        self.separation = float(separation)
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None

    def samples(self) -> tuple[Tensor, Tensor]:
        """All ``num_samples + val_samples`` feature vectors and their labels, training ones first."""
        gen = torch.Generator().manual_seed(self.seed)
        centers = self.separation * torch.randn(self.num_classes, self.features, generator=gen)
        rotation, _ = torch.linalg.qr(torch.randn(self.features, self.features, generator=gen))
        n = self.num_samples + self.val_samples
        labels = torch.randint(self.num_classes, (n,), generator=gen)
        points = centers[labels] + torch.randn(n, self.features, generator=gen)
        return torch.tanh(points @ rotation), labels

    @override
    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        features, labels = self.samples()
        k = self.num_samples
        self.train_set = TensorDataset(features[:k], labels[:k])
        self.val_set = TensorDataset(features[k:], labels[k:])

    @override
    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    @override
    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    def _loader(self, dataset: TensorDataset | None, *, shuffle: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError("SyntheticClasses: call `setup()` before asking for a dataloader")
        return DataLoader(  # under DDP Lightning swaps the sampler for a DistributedSampler with the same shuffle
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
