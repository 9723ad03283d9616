"""DDP settings the elastic runtime cannot honour are refused in one line naming what to change (one CPU rank, gloo):
a static graph (it died at step 0 with PyTorch's ``expect_autograd_hooks_`` assert) and a communication hook (the
callback's own averaging skipped it, silently), given to ``DDPStrategy`` or registered on the DDP module."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

from autotune.callbacks import ElasticBatchSize
from tests.support.toy import ToyModel, loader


def fit(strategy: DDPStrategy, module: L.LightningModule | None = None) -> None:
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[ElasticBatchSize(micro_batch_size=4)])
    trainer.fit(module or ToyModel(), loader(16, 8))


class HookedOnTheModule(ToyModel):
    def on_fit_start(self) -> None:  # the user's own registration, on the DDP module
        self.trainer.strategy.model.register_comm_hook(None, fp16_compress_hook)


@pytest.mark.parametrize(("strategy", "module", "says"), [
    (lambda: DDPStrategy(static_graph=True), None, r"static_graph=True.*DDPStrategy\(static_graph=False\)"),
    (lambda: DDPStrategy(ddp_comm_hook=fp16_compress_hook), None, r"hook fp16_compress_hook.*Remove ddp_comm_hook"),
    (lambda: DDPStrategy(), HookedOnTheModule, r"hook fp16_compress_hook.*register_comm_hook"),
])
def test_a_ddp_setting_the_runtime_cannot_honour_is_refused_naming_the_fix(strategy: Any, module: Any,
                                                                          says: str) -> None:
    with pytest.raises(MisconfigurationException, match=says):
        fit(strategy(), module() if module else None)
