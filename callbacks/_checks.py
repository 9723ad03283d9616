"""The Trainer settings ``ElasticBatchSize`` refuses at setup, each with a one-line fix: strategies it does not run
with (DDP's static graph and communication hooks among them), Lightning's own gradient accumulation, manual
optimization."""

from __future__ import annotations

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from lightning.fabric.utilities.exceptions import MisconfigurationException

from autotune._compat.lightning import ddp_module_settings, ddp_strategy_settings

_STATIC_GRAPH = (
    "ElasticBatchSize does not support DDP's static_graph=True: it runs every micro-batch under no_sync and averages "
    "the gradients itself after the ranks' vote, which a static graph's reducer does not allow. Use "
    "DDPStrategy(static_graph=False) (the default), or remove the callback."
)
_COMM_HOOK = (
    "ElasticBatchSize does not support the DDP communication hook {name}: it averages the gradients itself after the "
    "ranks' vote, so the hook would never run. Remove ddp_comm_hook from DDPStrategy (and any register_comm_hook "
    "call), or remove the callback to train with the hook."
)


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
    if isinstance(strategy, DDPStrategy):
        static, hook = ddp_strategy_settings(strategy)
        if static:
            raise MisconfigurationException(_STATIC_GRAPH)
        if hook is not None:
            raise MisconfigurationException(_COMM_HOOK.format(name=hook))
    if isinstance(strategy, ModelParallelStrategy):
        tensor_parallel = strategy.device_mesh["tensor_parallel"].size()
        if tensor_parallel != 1:
            raise MisconfigurationException(
                f"ElasticBatchSize supports ModelParallelStrategy with data parallelism only (FSDP2), but "
                f"tensor_parallel_size is {tensor_parallel}. Use ModelParallelStrategy(data_parallel_size=N, "
                "tensor_parallel_size=1), or remove the callback."
            )


def check_ddp_model(model: object) -> None:
    """At the training's start, once DDP wrapped the module: a static graph or a communication hook set on the module
    itself (``model._set_static_graph()``, ``model.register_comm_hook(...)``) is refused as at setup."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return
    static, hook = ddp_module_settings(model)
    if static:
        raise MisconfigurationException(_STATIC_GRAPH)
    if hook is not None:
        raise MisconfigurationException(_COMM_HOOK.format(name=hook))


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


def check_positive_int(name: str, value: object, *, allow_none: bool) -> None:
    """Refuse an argument that is not a positive int (or None, where ``allow_none``), naming it."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        accepted = "a positive int or None" if allow_none else "a positive int"
        raise ValueError(f"`{name}` must be {accepted}; got {value!r}")
