"""A benchmark target built from a transformers config (no download): a small Llama (rotary embeddings, grouped-query
attention, SwiGLU) trained with AdamW on random tokens, as users wrap a transformers model in a LightningModule.

``benchmarks/_hf_llama.py:make`` as a search target: 2 layers of width 128, 64 tokens per sample, batches of 32.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset


class Llama(L.LightningModule):
    def __init__(self, *, width: int = 128, layers: int = 2, vocab: int = 512, lr: float = 1e-3) -> None:
        super().__init__()
        import transformers

        torch.manual_seed(0)
        self.lr = lr
        self.model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=width, intermediate_size=width * 11 // 4, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class _Tokens(Dataset):
    def __init__(self, samples: int, length: int, vocab: int) -> None:
        self.ids = torch.randint(vocab, (samples, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, Any]:
        ids = self.ids[index]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


class Tokens(L.LightningDataModule):
    def __init__(self, *, batch_size: int = 32, length: int = 64, vocab: int = 512, samples: int = 4096) -> None:
        super().__init__()
        self.batch_size, self.length, self.vocab, self.samples = batch_size, length, vocab, samples
        self.num_workers = 0

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_Tokens(self.samples, self.length, self.vocab), batch_size=self.batch_size, shuffle=True,
                          num_workers=self.num_workers)


def make() -> tuple[Llama, Tokens]:
    return Llama(), Tokens()
