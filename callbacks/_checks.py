"""The Trainer settings ``ElasticBatchSize`` refuses at setup, each with a one-line fix: strategies it does not run
with, Lightning's own gradient accumulation, manual optimization."""

from __future__ import annotations

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.fabric.utilities.exceptions import MisconfigurationException


def check_strategy(trainer: Trainer, supported: tuple[type, ...]) -> None:
    strategy = trainer.strategy
    if type(strategy) not in supported:
        names = ", ".join(cls.__name__ for cls in supported)
        raise MisconfigurationException(
            f"ElasticBatchSize does not support {type(strategy).__name__}: it runs with {names} exactly (one device; "
            "strategy='ddp', 'ddp_spawn', 'ddp_fork'; FSDP2 through ModelParallelStrategy with data parallelism only). "
            "Lightning's FSDPStrategy (FSDP1), DeepSpeed and XLA strategies are not supported; remove the callback or "
            "use one of these."
        )
    if isinstance(strategy, ModelParallelStrategy):
        tensor_parallel = strategy.device_mesh["tensor_parallel"].size()
        if tensor_parallel != 1:
            raise MisconfigurationException(
                f"ElasticBatchSize supports ModelParallelStrategy with data parallelism only (FSDP2), but "
                f"tensor_parallel_size is {tensor_parallel}. Use ModelParallelStrategy(data_parallel_size=N, "
                "tensor_parallel_size=1), or remove the callback."
            )


def check_trainer(trainer: Trainer, pl_module: LightningModule) -> None:
    if trainer.accumulate_grad_batches != 1:
        raise MisconfigurationException(
            f"ElasticBatchSize does the gradient accumulation itself, but the Trainer has "
            f"accumulate_grad_batches={trainer.accumulate_grad_batches}. Set Trainer(accumulate_grad_batches=1) and "
            f"let the dataloader yield the effective batch (e.g. batch_size=16 x {trainer.accumulate_grad_batches} "
            f"= {16 * trainer.accumulate_grad_batches})."
        )
    for callback in trainer.callbacks:
        if isinstance(callback, GradientAccumulationScheduler) and set(callback.scheduling.values()) != {1}:
            raise MisconfigurationException(
                f"ElasticBatchSize does the gradient accumulation itself, but a GradientAccumulationScheduler sets "
                f"accumulate_grad_batches to {callback.scheduling} by epoch. Remove it and let the dataloader yield "
                "the effective batch (a batch size that changes by epoch: a batch sampler or a DataModule that "
                "reloads its dataloaders, reload_dataloaders_every_n_epochs=1)."
            )
    if not pl_module.automatic_optimization:
        raise MisconfigurationException(
            "ElasticBatchSize needs automatic optimization, but the LightningModule sets "
            "`automatic_optimization = False`. Remove the callback, or switch to automatic optimization."
        )
