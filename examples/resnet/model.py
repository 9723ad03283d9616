"""A small ResNet-style image classifier as a LightningModule (the example's model)."""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from typing_extensions import override


def group_norm(channels: int, groups: int) -> nn.GroupNorm:
    """GroupNorm with ``groups`` groups (fewer when ``channels`` is not a multiple), affine.

    GroupNorm, not BatchNorm: it normalizes every sample on its own, so a batch cut into micro-batches by
    ``ElasticBatchSize`` gives exactly the gradients of the whole batch. BatchNorm would normalize each micro-batch
    with that micro-batch's statistics (a different model for every micro-batch size), which is why the elastic
    runtime warns when a model has BatchNorm layers.
    """
    return nn.GroupNorm(math.gcd(groups, channels), channels)


class BasicBlock(nn.Module):
    """The ResNet basic block: two 3x3 convolutions with GroupNorm, plus a shortcut, then ReLU.

    The shortcut is the identity, or a 1x1 convolution with GroupNorm when the block changes the width or the
    resolution (``stride`` 2). The last GroupNorm of the residual branch starts at zero scale, so the branch adds
    nothing at first and the signal flows through the shortcuts (a deeper net trains from the first step).

    Args:
        in_channels: channels in.
        out_channels: channels out.
        stride: 1, or 2 to halve the resolution.
        groups: GroupNorm groups.
    """

    def __init__(self, *, in_channels: int, out_channels: int, stride: int, groups: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.norm1 = group_norm(out_channels, groups)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.norm2 = group_norm(out_channels, groups)
        nn.init.zeros_(self.norm2.weight)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False), group_norm(out_channels, groups)
            )

    @override
    def forward(self, x: Tensor) -> Tensor:
        y = F.relu(self.norm1(self.conv1(x)))
        return F.relu(self.norm2(self.conv2(y)) + self.shortcut(x))


class ResNet(LightningModule):
    """A ResNet for small images: a 3x3 stem, stages of ``BasicBlock``s, global average pooling, a linear head.

    Stage ``i`` has ``blocks_per_stage`` blocks of width ``widths[i]``; every stage after the first starts with a
    block of stride 2. The blocks are same-class submodules, so ``ApplyPlan(activation_checkpointing=0.5)`` (or a
    searched plan) finds them and recomputes the first half in backward. Batches are ``(images, labels)``; the loss
    is the mean cross-entropy. The optimizer is AdamW (no weight decay on norms and biases) with a per-step
    schedule: linear warmup over ``warmup_steps``, then cosine decay to 10% of ``lr`` at the last step.

    Args:
        num_classes: classes of the head.
        in_channels: image channels.
        widths: the width of each stage (one stage per entry).
        blocks_per_stage: ``BasicBlock``s per stage.
        groups: GroupNorm groups (reduced to a divisor of the width where needed).
        lr: peak learning rate.
        weight_decay: AdamW weight decay of the convolution and head weights.
        warmup_steps: optimizer steps of linear warmup.

    Raises:
        ValueError: for a bad argument, naming it and what is accepted.

    Example:
        >>> model = ResNet(num_classes=10, widths=(8, 16), blocks_per_stage=1)
        >>> model(torch.zeros(2, 3, 16, 16)).shape
        torch.Size([2, 10])
    """

    #: The schedule ends at this fraction of the peak learning rate.
    MIN_LR_RATIO = 0.1

    def __init__(
        self,
        *,
        num_classes: int = 10,
        in_channels: int = 3,
        widths: tuple[int, ...] = (16, 32, 64),
        blocks_per_stage: int = 2,
        groups: int = 8,
        lr: float = 3e-3,
        weight_decay: float = 0.05,
        warmup_steps: int = 5,
    ) -> None:
        super().__init__()
        widths = tuple(widths)
        if not widths:
            raise ValueError("`widths` must be a non-empty list of ints >= 1; got []")
        for i, width in enumerate(widths):
            _check_int(f"widths[{i}]", width, minimum=1)
        for name, value, minimum in (("num_classes", num_classes, 2), ("in_channels", in_channels, 1),
                                     ("blocks_per_stage", blocks_per_stage, 1), ("groups", groups, 1),
                                     ("warmup_steps", warmup_steps, 0)):
            _check_int(name, value, minimum=minimum)
        if not lr > 0:
            raise ValueError(f"`lr` must be > 0; got {lr!r}")
        if not weight_decay >= 0:
            raise ValueError(f"`weight_decay` must be >= 0; got {weight_decay!r}")
        self.save_hyperparameters()

        self.stem = nn.Sequential(nn.Conv2d(in_channels, widths[0], 3, padding=1, bias=False),
                                  group_norm(widths[0], groups), nn.ReLU())
        blocks = []
        channels = widths[0]
        for stage, width in enumerate(widths):
            for i in range(blocks_per_stage):
                stride = 2 if stage > 0 and i == 0 else 1
                blocks.append(BasicBlock(in_channels=channels, out_channels=width, stride=stride, groups=groups))
                channels = width
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(channels, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    @override
    def forward(self, images: Tensor) -> Tensor:
        """Logits of shape (B, num_classes) for ``images`` of shape (B, in_channels, H, W)."""
        x = self.blocks(self.stem(images))
        return self.head(x.mean(dim=(2, 3)))

    def loss_and_accuracy(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """Mean cross-entropy and accuracy of an ``(images, labels)`` batch."""
        images, labels = batch
        logits = self(images)
        return F.cross_entropy(logits, labels), (logits.argmax(dim=1) == labels).float().mean()

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss, accuracy = self.loss_and_accuracy(batch)
        size = batch[0].shape[0]
        self.log("train_loss", loss, prog_bar=True, batch_size=size)
        self.log("train_acc", accuracy, batch_size=size)
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
        decay = [p for p in self.parameters() if p.requires_grad and p.ndim >= 2]  # conv and head weights
        no_decay = [p for p in self.parameters() if p.requires_grad and p.ndim < 2]  # norms and biases
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": self.hparams.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=self.hparams.lr,
        )
        total = self.trainer.estimated_stepping_batches
        schedule = functools.partial(
            warmup_cosine,
            warmup_steps=self.hparams.warmup_steps,
            total_steps=int(total) if math.isfinite(total) else None,
            min_ratio=self.MIN_LR_RATIO,
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}


def warmup_cosine(step: int, *, warmup_steps: int, total_steps: int | None, min_ratio: float) -> float:
    """LR multiplier at optimizer step ``step``: linear warmup, then cosine decay to ``min_ratio`` at ``total_steps``.

    With ``total_steps`` None (an unbounded run) the multiplier stays at 1 after the warmup.

    Example:
        >>> [round(warmup_cosine(s, warmup_steps=2, total_steps=6, min_ratio=0.1), 3) for s in range(7)]
        [0.5, 1.0, 1.0, 0.868, 0.55, 0.232, 0.1]
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if total_steps is None or total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _check_int(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"`{name}` must be an int >= {minimum}; got {value!r}")
