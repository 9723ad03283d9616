"""A small causal language model for padded batches: attention scores materialised ([B, H, L, L]), so a step's memory
grows with the tokens and with the length squared, as many models' do without a fused attention kernel."""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from typing_extensions import override

#: The label of padded positions (the loss ignores them; padded_data.py's collate writes it, as transformers'
#: collators do).
IGNORE_INDEX = -100


class Block(nn.Module):
    """Pre-LayerNorm attention (explicit softmax over a causal, padding-masked [L, L] score matrix) and MLP."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        b, length, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, length, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(width // self.heads)
        scores = scores.masked_fill(~mask, float("-inf"))
        attn = self.drop(torch.softmax(scores, dim=-1))
        y = (attn @ v).transpose(1, 2).reshape(b, length, width)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.mlp(self.ln2(x)))


class PaddedLM(L.LightningModule):
    """A decoder trained on ``{"input_ids", "attention_mask", "labels"}`` batches padded to their longest sample.

    The loss is the mean over samples of each sample's mean token loss, so a batch split by samples (gradient
    accumulation, ``ElasticBatchSize``) computes exactly the whole batch's gradient. A loss averaged over the batch's
    tokens would not be: each micro-batch would weigh its tokens by its own token count (see docs/elastic.md).

    Example:
        >>> model = PaddedLM(vocab_size=16, width=8, heads=2, layers=1)
        >>> batch = {"input_ids": torch.zeros(2, 5, dtype=torch.long), "attention_mask": torch.ones(2, 5),
        ...          "labels": torch.zeros(2, 5, dtype=torch.long)}
        >>> model.training_step(batch, 0).shape
        torch.Size([])
    """

    def __init__(self, *, vocab_size: int = 256, width: int = 64, heads: int = 4, layers: int = 2,
                 dropout: float = 0.0, lr: float = 3e-3, max_length: int = 512) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab_size, width)
        self.pos = nn.Embedding(max_length, width)
        self.blocks = nn.ModuleList(Block(width, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        length = input_ids.shape[1]
        x = self.embed(input_ids) + self.pos(torch.arange(length, device=input_ids.device))
        causal = torch.ones(length, length, dtype=torch.bool, device=input_ids.device).tril()
        mask = causal & attention_mask.bool()[:, None, None, :]  # [B, 1, L, L]: no attention to padding
        mask = mask | torch.eye(length, dtype=torch.bool, device=input_ids.device)  # padded rows see themselves
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln(x))

    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        logits = self(batch["input_ids"], batch["attention_mask"])  # through __call__: FSDP2 hooks run
        labels = batch["labels"]
        per_token = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=IGNORE_INDEX, reduction="none")
        real = (labels != IGNORE_INDEX).sum(dim=1).clamp(min=1)
        return (per_token.sum(dim=1) / real).mean()  # mean over samples of each sample's mean token loss

    @override
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        return loss

    @override
    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
