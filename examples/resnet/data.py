"""Deterministic synthetic images as a LightningDataModule (the example's data)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningDataModule
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override


class SyntheticImages(LightningDataModule):
    """Images of ``num_classes`` smooth class patterns, randomly shifted and buried in noise: learnable by a CNN.

    Each class has a seeded prototype: a random ``channels x 4 x 4`` grid upsampled (bilinear) to ``image_size``,
    so it is made of blobs a few convolutions can see. A sample is its class's prototype rolled by up to
    ``max_shift`` pixels in each direction (so the net must learn the pattern, not a pixel), plus Gaussian noise of
    standard deviation ``noise``. Everything (prototypes, labels, shifts, noise, the shuffling order) comes from
    ``torch.Generator``s seeded with ``seed``, so two modules with the same arguments yield the same batches.

    Each batch is ``(images, labels)``: a float tensor of shape (batch_size, channels, image_size, image_size) and a
    long tensor of shape (batch_size,) with values in ``[0, num_classes)``.

    Args:
        num_classes: classes (one prototype each).
        channels: image channels.
        image_size: height and width in pixels (at least 4).
        batch_size: the EFFECTIVE batch of one optimizer step. With ``ElasticBatchSize`` the dataloader yields the
            whole effective batch and the callback cuts it into micro-batches that fit in memory; keep
            ``Trainer(accumulate_grad_batches=1)``.
        num_samples: training samples (whole batches only: the last partial batch is dropped).
        val_samples: validation samples.
        num_workers: dataloader worker processes.
        pin_memory: pin host memory of batches (speeds up copies to a GPU).
        seed: seed of the prototypes, the samples and the shuffling order.
        noise: standard deviation of the pixel noise (the prototypes have one of about 0.75).
        max_shift: largest shift of a sample's pattern, in pixels, in each direction.

    Raises:
        ValueError: for a bad argument, naming it and what is accepted.

    Example:
        >>> dm = SyntheticImages(batch_size=4, image_size=8, num_samples=16, val_samples=4)
        >>> dm.setup("fit")
        >>> [t.shape for t in next(iter(dm.train_dataloader()))]
        [torch.Size([4, 3, 8, 8]), torch.Size([4])]
    """

    def __init__(
        self,
        *,
        num_classes: int = 10,
        channels: int = 3,
        image_size: int = 32,
        batch_size: int = 64,
        num_samples: int = 2048,
        val_samples: int = 256,
        num_workers: int = 0,
        pin_memory: bool = False,
        seed: int = 0,
        noise: float = 1.0,
        max_shift: int = 4,
    ) -> None:
        super().__init__()
        for name, value, minimum in (("num_classes", num_classes, 2), ("channels", channels, 1),
                                     ("image_size", image_size, 4), ("batch_size", batch_size, 1),
                                     ("val_samples", val_samples, 1), ("num_workers", num_workers, 0),
                                     ("seed", seed, 0), ("max_shift", max_shift, 0)):
            _check_int(name, value, minimum=minimum)
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < batch_size:
            raise ValueError(f"`num_samples` must be an int >= `batch_size` ({batch_size}); got {num_samples!r}")
        if isinstance(noise, bool) or not isinstance(noise, (int, float)) or not noise >= 0:
            raise ValueError(f"`noise` must be a number >= 0; got {noise!r}")
        self.save_hyperparameters()
        self.num_classes = num_classes
        self.channels = channels
        self.image_size = image_size
        self.batch_size = batch_size
        self.num_samples = num_samples
        self.val_samples = val_samples
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.seed = seed
        self.noise = float(noise)
        self.max_shift = max_shift
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None

    def prototypes(self) -> Tensor:
        """The class patterns: a float tensor of shape (num_classes, channels, image_size, image_size)."""
        gen = torch.Generator().manual_seed(self.seed)
        coarse = torch.randn(self.num_classes, self.channels, 4, 4, generator=gen)
        return F.interpolate(coarse, size=(self.image_size, self.image_size), mode="bilinear", align_corners=False)

    def images(self) -> tuple[Tensor, Tensor]:
        """All ``num_samples + val_samples`` images and their labels, training ones first."""
        protos = self.prototypes()
        gen = torch.Generator().manual_seed(self.seed + 1)  # the samples' own stream, apart from the prototypes'
        n = self.num_samples + self.val_samples
        labels = torch.randint(self.num_classes, (n,), generator=gen)
        shifts = torch.randint(-self.max_shift, self.max_shift + 1, (n, 2), generator=gen)
        images = torch.empty(n, self.channels, self.image_size, self.image_size)
        for i, (label, (dy, dx)) in enumerate(zip(labels.tolist(), shifts.tolist())):
            images[i] = torch.roll(protos[label], shifts=(dy, dx), dims=(1, 2))
        images += self.noise * torch.randn(images.shape, generator=gen)
        return images, labels

    @override
    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        images, labels = self.images()
        k = self.num_samples
        self.train_set = TensorDataset(images[:k], labels[:k])
        self.val_set = TensorDataset(images[k:], labels[k:])

    @override
    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    @override
    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    def _loader(self, dataset: TensorDataset | None, *, shuffle: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError("SyntheticImages: call `setup()` before asking for a dataloader")
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
