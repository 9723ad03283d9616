"""A small GPT-style decoder language model as a LightningModule (the example's model)."""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from typing_extensions import override


class Block(nn.Module):
    """One pre-LayerNorm transformer block: causal self-attention, then an MLP, each with a residual connection.

    Args:
        n_embd: width of the residual stream.
        n_head: attention heads; must divide ``n_embd``.
        dropout: dropout on attention weights and on both residual branches.
    """

    def __init__(self, *, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.dropout = dropout
        self.ln_1 = nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)  # attention output projection (scaled init in GPT)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd),
            nn.GELU(),
            nn.Linear(4 * n_embd, n_embd),  # MLP output projection (scaled init in GPT)
            nn.Dropout(dropout),
        )
        self.resid_dropout = nn.Dropout(dropout)

    def attention(self, x: Tensor) -> Tensor:
        """Causal multi-head self-attention over ``x`` of shape (B, T, C)."""
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(b, t, c)))

    @override
    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(LightningModule):
    """A GPT-style decoder: token + position embeddings, ``n_layer`` pre-LN blocks, final LayerNorm, LM head.

    Batches are ``(input_ids, targets)`` long tensors of shape (B, T) with ``T <= block_size``; the loss is the mean
    next-token cross-entropy. The optimizer is AdamW (no weight decay on biases, LayerNorms and embeddings) with a
    per-step schedule: linear warmup over ``warmup_steps``, then cosine decay to 10% of ``lr`` at the last step.

    Args:
        vocab_size: number of token ids.
        block_size: longest sequence (context length); also ``tokens_per_sample``.
        n_layer: transformer blocks.
        n_head: attention heads; must divide ``n_embd``.
        n_embd: embedding width.
        dropout: dropout probability in [0, 1).
        tie_weights: share the token embedding matrix with the LM head.
        lr: peak learning rate.
        weight_decay: AdamW weight decay on matrices.
        warmup_steps: optimizer steps of linear warmup.

    Raises:
        ValueError: for a bad argument, naming it and what is accepted.

    Example:
        >>> model = GPT(n_layer=2, n_embd=64, block_size=32)
        >>> model(torch.zeros(2, 32, dtype=torch.long)).shape
        torch.Size([2, 32, 256])
    """

    #: Final learning rate as a share of ``lr`` at the end of the cosine decay.
    MIN_LR_RATIO = 0.1

    def __init__(
        self,
        *,
        vocab_size: int = 256,
        block_size: int = 64,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        tie_weights: bool = True,
        lr: float = 3e-4,
        weight_decay: float = 0.1,
        warmup_steps: int = 10,
    ) -> None:
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("block_size", block_size), ("n_layer", n_layer),
                            ("n_head", n_head), ("n_embd", n_embd)):
            _check_int(name, value, minimum=1)
        _check_int("warmup_steps", warmup_steps, minimum=0)
        if n_embd % n_head:
            raise ValueError(f"`n_embd` must be a multiple of `n_head` ({n_head}); got {n_embd}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"`dropout` must be in [0, 1); got {dropout!r}")
        if not lr > 0:
            raise ValueError(f"`lr` must be > 0; got {lr!r}")
        if not weight_decay >= 0:
            raise ValueError(f"`weight_decay` must be >= 0; got {weight_decay!r}")
        self.save_hyperparameters()
        self.block_size = block_size
        self.tokens_per_sample = block_size  # tokens one sample contributes to a step (for tokens/s)

        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd=n_embd, n_head=n_head, dropout=dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.apply(_init_weights)
        for block in self.blocks:  # GPT-2: residual projections scaled by depth
            for proj in (block.proj, block.mlp[2]):
                nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))
        if tie_weights:
            self.head.weight = self.tok_emb.weight

    @override
    def forward(self, input_ids: Tensor) -> Tensor:
        """Logits of shape (B, T, vocab_size) for ``input_ids`` of shape (B, T)."""
        t = input_ids.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence length {t} is longer than `block_size` ({self.block_size})")
        pos = torch.arange(t, device=input_ids.device)
        x = self.drop(self.tok_emb(input_ids) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        """Mean next-token cross-entropy of a ``(input_ids, targets)`` batch."""
        input_ids, targets = batch
        logits = self(input_ids)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss, prog_bar=True, batch_size=batch[0].shape[0])
        return loss

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self.loss(batch)
        self.log("val_loss", loss, prog_bar=True, batch_size=batch[0].shape[0])
        return loss

    @override
    def configure_optimizers(self) -> Any:
        decay, no_decay = [], []
        for name, param in self.named_parameters():  # a tied head appears once, as tok_emb.weight
            if not param.requires_grad:
                continue
            is_matrix = param.ndim >= 2 and not name.startswith(("tok_emb", "pos_emb"))
            (decay if is_matrix else no_decay).append(param)
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


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def _check_int(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"`{name}` must be an int >= {minimum}; got {value!r}")
