"""A small residual MLP classifier as a LightningModule (the example's model)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from typing_extensions import override


class ResidualBlock(nn.Module):
    """A pre-LayerNorm MLP block with a residual connection: ``x + W2 gelu(W1 norm(x))``.

    Args:
        width: width of the residual stream.
        expansion: hidden width as a multiple of ``width``.
    """

    def __init__(self, *, width: int, expansion: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, expansion * width)
        self.down = nn.Linear(expansion * width, width)

    @override
    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class MLPClassifier(LightningModule):
    """An MLP classifier: input projection, ``depth`` residual blocks, final LayerNorm, linear head.

    The blocks are same-class submodules, so ``ApplyPlan(activation_checkpointing=...)`` (or a searched plan) finds
    them. Batches are ``(features, labels)``; the loss is the mean cross-entropy and the optimizer AdamW at a
    constant ``lr``. Validation metrics are averaged over the ranks under DDP (``sync_dist=True``).

    Args:
        in_features: dimensions of a sample.
        num_classes: classes of the head.
        width: width of the residual stream.
        depth: residual blocks.
        expansion: hidden width of a block as a multiple of ``width``.
        lr: learning rate.
        weight_decay: AdamW weight decay.

    Raises:
        ValueError: for a bad argument, naming it and what is accepted.

    Example:
        >>> model = MLPClassifier(in_features=8, num_classes=3, width=16, depth=2)
        >>> model(torch.zeros(5, 8)).shape
        torch.Size([5, 3])
    """

    def __init__(
        self,
        *,
        in_features: int = 32,
        num_classes: int = 8,
        width: int = 128,
        depth: int = 4,
        expansion: int = 4,
        lr: float = 1e-3,
        weight_decay: float = 0.01,
    ) -> None:
        super().__init__()
        for name, value, minimum in (("in_features", in_features, 1), ("num_classes", num_classes, 2),
                                     ("width", width, 1), ("depth", depth, 1), ("expansion", expansion, 1)):
            _check_int(name, value, minimum=minimum)
        if not lr > 0:
            raise ValueError(f"`lr` must be > 0; got {lr!r}")
        if not weight_decay >= 0:
            raise ValueError(f"`weight_decay` must be >= 0; got {weight_decay!r}")
        self.save_hyperparameters()
        self.embed = nn.Linear(in_features, width)
        self.blocks = nn.ModuleList(ResidualBlock(width=width, expansion=expansion) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, num_classes)

    @override
    def forward(self, features: Tensor) -> Tensor:
        """Logits of shape (B, num_classes) for ``features`` of shape (B, in_features)."""
        x = self.embed(features)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def loss_and_accuracy(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """Mean cross-entropy and accuracy of a ``(features, labels)`` batch."""
        features, labels = batch
        logits = self(features)
        return F.cross_entropy(logits, labels), (logits.argmax(dim=1) == labels).float().mean()

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss, _ = self.loss_and_accuracy(batch)
        self.log("train_loss", loss, prog_bar=True, batch_size=batch[0].shape[0])  # this rank's loss
        return loss

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss, accuracy = self.loss_and_accuracy(batch)
        size = batch[0].shape[0]
        self.log("val_loss", loss, prog_bar=True, batch_size=size, sync_dist=True)
        self.log("val_acc", accuracy, prog_bar=True, batch_size=size, sync_dist=True)
        return loss

    @override
    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)


def _check_int(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"`{name}` must be an int >= {minimum}; got {value!r}")
