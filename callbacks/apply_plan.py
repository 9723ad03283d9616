"""``ApplyPlan``: apply the model-side settings of a memory plan to a run."""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.strategies import ModelParallelStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from autotune._compat.torch import set_activation_memory_budget, set_cuda_allocator_settings
from autotune._plan.plan import Plan
from autotune._plan.provenance import Provenance
from autotune._runtime.sync import fsdp_modules
from autotune._transforms.blocks import (
    checkpoint_blocks,
    compile_blocks,
    offload_activations,
    ops_only_blocks,
    select_blocks,
)
from autotune._transforms.offload import INSTALL_HINT, OffloadedOptimizer, offload_optimizers
from autotune._transforms.optim_state import INSTALL_HINT as TORCHAO_HINT, LowBitOptimizer, low_bit_optimizers
from autotune._transforms.shard import shard_model

log = logging.getLogger("autotune")

_ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"


class ApplyPlan(Callback):
    """Apply a plan's model-side settings: activation checkpointing, activation and optimizer offload, compile,
    sharding (FSDP2), allocator, data.

    Under ``ModelParallelStrategy`` (a plan's ``strategy: fsdp``) the model is sharded for you when it does not define
    ``configure_model``: each repeated block, then the root (see docs/plan.md), after checkpointing and compile, with
    FSDP2's bf16 mixed-precision policy when the trainer's precision is ``bf16-mixed``. A model that defines
    ``configure_model`` keeps its own wrapping; ``reshard_after_forward=False`` is then applied to its FSDP2 modules.

    The plan's precision goes to ``Trainer(precision=...)`` and its micro-batch and budget to
    :class:`~autotune.callbacks.ElasticBatchSize`; :meth:`autotune.Plan.callbacks` and the tuned file set up both.

    Args:
        activation_checkpointing: fraction in [0, 1] of the model's repeated blocks to recompute in backward (found
            automatically, as FSDP's transformer auto-wrap does), the class names of the modules to recompute, or
            ``"auto"`` with its chosen ``recompute`` levels (see :func:`autotune.choose_recompute`).
        recompute: with ``activation_checkpointing="auto"``, what each repeated block recomputes: ``"none"``,
            ``"ops"`` (its matrix products and attention saved, the rest recomputed) or ``"block"``.
        activation_offload: keep the tensors saved for backward on the host during training steps.
        optimizer_offload: run the optimizers from ``configure_optimizers`` with their state on the host and their
            update on the CPU (torchao's ``CPUOffloadOptimizer``, one CUDA GPU); LR schedulers keep working.
        optimizer_state: ``"full"`` keeps the optimizers; ``"8bit"`` or ``"4bit"`` runs each Adam and AdamW with its
            moments in 8 or 4 bits (torchao), keeping its hyper-parameters, groups and LR schedulers; any other
            optimizer is refused. Under ``precision="bf16-true"`` Adam and AdamW round their bf16 updates
            stochastically (torchao).
        compile: ``torch.compile`` each repeated block in place.
        compile_memory_budget: with ``compile``, the share of activations the compiler keeps for backward (its
            partitioner recomputes the rest); set from ``setup`` to teardown.
        float8: convert the linear layers to torchao's float8 training (CUDA, compute capability 8.9 or newer).
        reshard_after_forward: under FSDP2, free each block's gathered parameters after its forward (ZeRO-3 style);
            False keeps them until its backward (ZeRO-2 style).
        cpu_offload: under FSDP2, keep parameters, gradients and optimizer state on the host (``CPUOffloadPolicy``;
            CUDA only, with the automatic sharding).
        expandable_segments: turn the CUDA allocator's ``expandable_segments`` on at ``setup``, off at teardown.
        num_workers: set the DataModule's ``num_workers`` (None: leave it).
        pin_memory: set the DataModule's ``pin_memory`` (None: leave it).
        provenance: where the plan was measured; a different device at run time gives a warning.

    Raises:
        ValueError: one error listing every invalid setting.

    Example:
        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(callbacks=[ApplyPlan(activation_checkpointing=0.5)])  # doctest: +SKIP
    """

    def __init__(
        self,
        *,
        activation_checkpointing: float | list[str] | str = 0.0,
        recompute: list[str] | None = None,
        activation_offload: bool = False,
        optimizer_offload: bool = False,
        optimizer_state: str = "full",
        compile: bool = False,
        compile_memory_budget: float | None = None,
        float8: bool = False,
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
        expandable_segments: bool = False,
        num_workers: int | None = None,
        pin_memory: bool | None = None,
        provenance: dict[str, Any] | None = None,
    ) -> None:
        settings = {"activation_checkpointing": activation_checkpointing, "recompute": recompute,
                    "activation_offload": activation_offload,
                    "optimizer_offload": optimizer_offload, "optimizer_state": optimizer_state, "compile": compile,
                    "compile_memory_budget": compile_memory_budget, "float8": float8,
                    "reshard_after_forward": reshard_after_forward, "cpu_offload": cpu_offload,
                    "expandable_segments": expandable_segments, "num_workers": num_workers, "pin_memory": pin_memory}
        self.plan = Plan.from_dict(settings, provenance=Provenance.from_dict(provenance or {}))
        self._undo: list[Callable[[], None]] = []
        self._offload: ExitStack | None = None
        self.checkpointed: list[torch.nn.Module] = []
        self.compiled: list[torch.nn.Module] = []
        self.sharded: list[torch.nn.Module] = []
        self.active = True  # False when a later ApplyPlan takes over

    def describe(self) -> str:
        """Its settings in words (the plan's, without the precision and micro-batch, which are not its own).

        Example:
            >>> ApplyPlan(activation_checkpointing=0.5).describe(), ApplyPlan().describe()
            ('ckpt 0.5', 'no settings')
        """
        return ", ".join(self.plan.describe().split(", ")[2:]) or "no settings"

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        mine = [c for c in trainer.callbacks if isinstance(c, ApplyPlan)]
        self.active = not mine or mine[-1] is self
        if not self.active:  # a later one (a tuned file's, stacked after the user's config) takes over
            rank_zero_info(f"ApplyPlan: the later one in the callbacks ({mine[-1].describe()}) runs in place of this "
                           f"one ({self.describe()}).")
            return
        plan = self.plan
        device = trainer.strategy.root_device
        if plan.expandable_segments and device.type == "cuda":
            self._undo.append(_expandable_segments())
        self._warn_if_other_device(device)
        if plan.optimizer_offload and stage == "fit":
            _check_optimizer_offload(trainer)
        if plan.float8:
            _to_float8(pl_module, device)
        if plan.activation_checkpointing:
            self.checkpointed = select_blocks(pl_module, plan.activation_checkpointing, plan.recompute)
            self._undo.append(checkpoint_blocks(
                self.checkpointed, model=pl_module,
                ops_only=ops_only_blocks(pl_module, plan.activation_checkpointing, plan.recompute)))
            own = [b for b in self.checkpointed if getattr(b, "gradient_checkpointing", False) is True]
            if not self.checkpointed and plan.activation_checkpointing != "auto":
                rank_zero_warn(f"ApplyPlan: activation_checkpointing={plan.activation_checkpointing} found no repeated "
                               f"blocks in {type(pl_module).__name__}; nothing is checkpointed (name the classes to "
                               "checkpoint instead: activation_checkpointing: [ClassName, ...])")
            elif own:
                rank_zero_info(f"ApplyPlan: {len(own)} {type(own[0]).__name__} block(s) checkpoint themselves (the "
                               "model's gradient_checkpointing_enable()); they are left to it, not checkpointed twice")
            log.info("autotune: checkpointing %d block(s) of %s", len(self.checkpointed),
                     type(self.checkpointed[0]).__name__ if self.checkpointed else "-")
        if plan.compile:
            self.compiled = compile_blocks(pl_module)
        if plan.compile_memory_budget is not None:  # read when a graph compiles: at the first steps
            previous = set_activation_memory_budget(plan.compile_memory_budget)
            self._undo.append(lambda: set_activation_memory_budget(previous))
        self._setup_sharding(trainer, pl_module)
        datamodule = trainer.datamodule
        for name in ("num_workers", "pin_memory"):
            value = getattr(plan, name)
            if value is None:
                continue
            if datamodule is not None and hasattr(datamodule, name):
                setattr(datamodule, name, value)
                if hasattr(getattr(datamodule, "hparams", None), name):
                    datamodule.hparams[name] = value
            else:
                rank_zero_warn(f"ApplyPlan: the plan sets {name}={value!r}, but the DataModule has no `{name}` "
                               "attribute; the setting is not applied.")

    def _setup_sharding(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Give the model a ``configure_model`` that shards it (after checkpointing and compile, which Lightning
        runs before it), or apply the plan on top of the model's own."""
        plan = self.plan
        strategy = trainer.strategy
        settings = ", ".join(name for name, on in (("cpu_offload=True", plan.cpu_offload),
                                                    ("reshard_after_forward=False", not plan.reshard_after_forward))
                             if on)
        if type(strategy) is not ModelParallelStrategy:
            if settings:
                raise MisconfigurationException(
                    f"ApplyPlan({settings}) configures FSDP2 sharding, but the run uses {type(strategy).__name__}. "
                    "Use ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1) (a plan's strategy "
                    "'fsdp'), or leave these settings at their defaults.")
            return
        if plan.cpu_offload and strategy.root_device.type != "cuda":
            raise MisconfigurationException(
                f"ApplyPlan(cpu_offload=True) keeps a GPU's parameters, gradients and optimizer state on the host, "
                f"but this run is on {strategy.root_device.type}. Run on CUDA, or set cpu_offload=False.")
        if type(pl_module).configure_model is not LightningModule.configure_model:
            if plan.cpu_offload:
                raise MisconfigurationException(
                    f"ApplyPlan(cpu_offload=True) is chosen when a module is sharded, but {type(pl_module).__name__} "
                    "shards itself in configure_model. Pass offload_policy=CPUOffloadPolicy() to its fully_shard "
                    "calls, or remove configure_model and let ApplyPlan shard the model.")
            if not plan.reshard_after_forward:
                self._wrap_configure_model(pl_module)
            return
        tensor_parallel = strategy.device_mesh["tensor_parallel"].size()
        if tensor_parallel != 1:
            raise MisconfigurationException(
                f"ApplyPlan shards the model with FSDP2 over the data-parallel ranks only, but ModelParallelStrategy "
                f"has tensor_parallel_size={tensor_parallel}. Apply tensor parallelism in the model's configure_model, "
                "or use tensor_parallel_size=1.")
        param_dtype = torch.bfloat16 if trainer.precision == "bf16-mixed" else None

        def configure_model() -> None:
            self.sharded = shard_model(pl_module, mesh=pl_module.device_mesh["data_parallel"],
                                       reshard_after_forward=plan.reshard_after_forward, param_dtype=param_dtype,
                                       cpu_offload=plan.cpu_offload)

        self._set_configure_model(pl_module, configure_model)

    def _set_configure_model(self, pl_module: LightningModule, configure_model: Callable[[], None]) -> None:
        """Give this module (not its class) ``configure_model`` until teardown; Lightning calls it after ``setup``."""
        pl_module.configure_model = configure_model  # type: ignore[method-assign]
        self._undo.append(lambda: vars(pl_module).pop("configure_model", None))

    def _wrap_configure_model(self, pl_module: LightningModule) -> None:
        own = pl_module.configure_model

        def configure_model() -> None:
            own()
            self.sharded = fsdp_modules(pl_module)
            for module in self.sharded:
                module.set_reshard_after_forward(False, recurse=False)

        self._set_configure_model(pl_module, configure_model)

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.active:
            return
        bf16_weights = trainer.precision == "bf16-true"
        if self.plan.optimizer_state != "full" or bf16_weights:  # the optimizers exist; checkpoints load later
            try:
                trainer.strategy.optimizers = low_bit_optimizers(
                    trainer.strategy.optimizers, state=self.plan.optimizer_state, bf16_weights=bf16_weights)
            except (ValueError, ImportError) as error:
                raise MisconfigurationException(f"ApplyPlan: {error}") from None
            changed = [opt for opt in trainer.strategy.optimizers if isinstance(opt, LowBitOptimizer)]
            if changed:
                log.info("autotune: optimizer update by torchao: %s", changed)
            kept = [type(opt).__name__ for opt in trainer.strategy.optimizers if not isinstance(opt, LowBitOptimizer)]
            if bf16_weights and kept:
                rank_zero_warn(f"ApplyPlan: precision bf16-true with {', '.join(kept)}: its updates are plain bf16, so "
                               "updates smaller than a weight's bf16 resolution are lost. Only Adam and AdamW (without "
                               "L2 weight decay) get torchao's stochastic rounding; use bf16-mixed to keep fp32 "
                               "weights.")
        if self.plan.optimizer_offload:  # the optimizers exist now, and their checkpointed state is not loaded yet
            trainer.strategy.optimizers = offload_optimizers(
                trainer.strategy.optimizers, refresh_grads=_grads_change_after_backward(trainer, pl_module))
            log.info("autotune: optimizer state offloaded to the host: %s", trainer.strategy.optimizers)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # LightningModule.on_fit_start ran after the host copies were taken
        for opt in _offloaded(trainer) if self.active else []:
            opt.copy_weights_to_host()

    def _warn_if_other_device(self, device: torch.device) -> None:
        measured = self.plan.provenance.device_name
        if not measured:
            return
        from autotune._device.probe import probe_memory

        here = probe_memory(device).name
        if here != measured:
            rank_zero_warn(f"ApplyPlan: this plan was measured on '{measured}' but runs on '{here}'; its memory "
                           "and speed figures may not hold here. Re-run `autotune search` on this device.")

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.active and self.plan.activation_offload and self._offload is None:
            self._offload = ExitStack()
            self._offload.enter_context(offload_activations(pin_memory=trainer.strategy.root_device.type == "cuda"))

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._close_offload()

    def _close_offload(self) -> None:
        if self._offload is not None:
            self._offload.close()
            self._offload = None

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._close_offload()
        for opt in _offloaded(trainer) if self.active else []:
            opt.close()
        for undo in reversed(self._undo):
            undo()
        self._undo = []

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self.teardown(trainer, pl_module, "fit")


def _to_float8(pl_module: LightningModule, device: torch.device) -> None:
    """torchao's float8 training for the linear layers whose dimensions FP8 kernels take (multiples of 16)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        raise MisconfigurationException(
            f"ApplyPlan(float8=True) runs matrix products in FP8, which needs a CUDA GPU of compute capability 8.9 or "
            f"newer (Ada, Hopper); this run is on {device}. Set float8=False.")
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError:
        raise MisconfigurationException(f"ApplyPlan(float8=True) needs torchao: {TORCHAO_HINT}") from None

    def fits(module: torch.nn.Module, name: str) -> bool:
        return isinstance(module, torch.nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0

    convert_to_float8_training(pl_module, module_filter_fn=fits)


def _check_optimizer_offload(trainer: Trainer) -> None:
    device = trainer.strategy.root_device
    if device.type != "cuda":
        raise MisconfigurationException(
            f"ApplyPlan(optimizer_offload=True) moves optimizer state from a CUDA GPU to the host, but this run is on "
            f"{device.type}. Run on one GPU, or set optimizer_offload=False."
        )
    if not isinstance(trainer.strategy, SingleDeviceStrategy) or trainer.world_size > 1:
        raise MisconfigurationException(
            f"ApplyPlan(optimizer_offload=True) runs on one GPU (torchao's CPUOffloadOptimizer), but the run uses "
            f"{type(trainer.strategy).__name__} with {trainer.world_size} process(es). Use devices=1, or set "
            "optimizer_offload=False."
        )
    if importlib.util.find_spec("torchao") is None:
        raise MisconfigurationException(f"ApplyPlan(optimizer_offload=True) needs torchao: {INSTALL_HINT}")


def _offloaded(trainer: Trainer) -> list[OffloadedOptimizer]:
    return [opt for opt in trainer.strategy.optimizers if isinstance(opt, OffloadedOptimizer)]


def _grads_change_after_backward(trainer: Trainer, pl_module: LightningModule) -> bool:
    """Whether something may change gradients between backward and the update (then the offloaded update copies
    them to the host again): clipping, a GradScaler or another precision plugin than Lightning's plain and mixed
    ones, or a hook of the module's class or of a callback that sees them."""
    precision = trainer.precision_plugin
    if trainer.gradient_clip_val or getattr(precision, "scaler", None) is not None:
        return True
    if type(precision) not in (Precision, MixedPrecision, HalfPrecision, DoublePrecision):
        return True
    module_hooks = ("backward", "optimizer_step", "on_after_backward", "on_before_optimizer_step",
                    "configure_gradient_clipping")
    cls = type(pl_module)  # the class: ElasticBatchSize wraps some of these on the instance, and changes nothing
    if any(getattr(cls, hook) is not getattr(LightningModule, hook) for hook in module_hooks):
        return True
    hooks = ("on_after_backward", "on_before_optimizer_step")
    return any(is_overridden(hook, callback, Callback) for callback in trainer.callbacks for hook in hooks)


def _expandable_segments() -> Callable[[], None]:
    """Turn the CUDA caching allocator's expandable segments on (for the segments it makes from now on) and return
    what turns them off again, unless the environment had them on. Process-wide: set in ``setup``, undone at
    ``teardown``; the environment is never changed."""
    if "expandable_segments:True" in os.environ.get(_ALLOC_CONF, ""):
        return lambda: None  # on for the whole process already
    set_cuda_allocator_settings("expandable_segments:True")
    return lambda: set_cuda_allocator_settings("expandable_segments:False")
