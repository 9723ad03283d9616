"""Private Lightning API that autotune uses, each access with what breaks if it changes: the batch transfer, the
logger connector, ``self.log``'s hook name, the automatic-optimization closure, the trainer reference, the optimizer
configuration and the precision plugins."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


#: The ``LightningModule`` method that moves a batch to the device (``_apply_batch_transfer_handler``: runs the
#: ``transfer_batch_to_device`` and ``on_after_batch_transfer`` hooks). ``ElasticBatchSize`` replaces it for the
#: run, so the batch stays on the host and each micro-batch is moved alone. If it were renamed, the patch would
#: change nothing and whole batches would be moved to the device (more memory, same results). Patching the public
#: hooks is not done: they are the user's to override.
BATCH_TRANSFER_HANDLER = "_apply_batch_transfer_handler"


def batch_transfer_handler(module: Any) -> Callable[..., Any]:
    """The module's current batch transfer method (see :data:`BATCH_TRANSFER_HANDLER`); ``AttributeError`` at
    ``ElasticBatchSize`` setup if it is gone."""
    handler: Callable[..., Any] = getattr(module, BATCH_TRANSFER_HANDLER)
    return handler


def logs_written_this_step(trainer: Any) -> bool:
    """Whether the loggers write on this training step (``trainer._logger_connector.should_update_logs``, the gate
    of Lightning's own ``DeviceStatsMonitor`` and ``LearningRateMonitor``: every ``log_every_n_steps`` batches that
    stepped, and when ``should_stop``). If it went away, ``ElasticBatchSize`` and ``MemoryMonitor`` would fail on
    each batch end; recomputing it is not done, as that needs the fit loop's private step counter too."""
    return bool(trainer._logger_connector.should_update_logs)


def current_hook_name(module: Any) -> str | None:
    """The name of the hook the module is running, which ``self.log`` files values under
    (``LightningModule._current_fx_name``; None outside a hook or for other objects). If it went away, buffered
    micro-batch logs would not be told apart by hook."""
    return getattr(module, "_current_fx_name", None)


def set_current_hook_name(module: Any, name: str | None) -> None:
    """Set the hook name ``self.log`` files values under (``LightningModule._current_fx_name``), so logs buffered
    during micro-batches are committed from the hook that made them. If Lightning read another attribute, committed
    values would land under the wrong hook (or raise "You are trying to `self.log()`" outside one)."""
    module._current_fx_name = name


def set_closure_loss(closure: Any, total: Any, *, extra: Any = None) -> None:
    """Make Lightning's automatic-optimization closure report the whole batch's loss to the loop.

    ``total`` is the sum of the weighted micro-batch losses; ``extra`` holds the other keys ``training_step`` returned,
    put together from the micro-batches (None: keep the last call's). ``Closure._result`` (a ``ClosureResult``) is
    replaced by a new ``lightning.pytorch.loops.optimization.automatic.ClosureResult``. Nothing is done where the
    closure has no result or ``total`` is None. If either changed, the progress bar and ``training_step`` outputs would
    show one micro-batch's loss, or fail."""
    from lightning.pytorch.loops.optimization.automatic import ClosureResult

    result = getattr(closure, "_result", None)
    if result is None or total is None or not hasattr(result, "closure_loss"):
        return
    closure._result = ClosureResult(closure_loss=total.detach(), extra=result.extra if extra is None else extra)


def closure_extra(closure: Any) -> Any:
    """What the closure's last call returned besides the loss (``Closure._result.extra``: the other keys of the dict
    ``training_step`` returned), or None. If it went away, ``on_train_batch_end`` would get the last micro-batch's
    outputs only."""
    result = getattr(closure, "_result", None)
    return getattr(result, "extra", None)


def wrap_zero_grad(closure: Any, wrap: Callable[[Callable[[], None]], Callable[[], None]]) -> None:
    """Replace the zero-grad function of Lightning's automatic-optimization closure (``Closure._zero_grad_fn``, run
    after ``training_step`` on each call: the ``on_before_zero_grad`` hooks, then ``optimizer_zero_grad``) by
    ``wrap(original)``; nothing where it has none (Lightning's accumulation skips it). If the attribute went away,
    this raises rather than let gradients be zeroed between micro-batches."""
    if not hasattr(closure, "_zero_grad_fn"):
        raise RuntimeError("ElasticBatchSize: this Lightning's optimizer closure has no `_zero_grad_fn`; this version "
                           "of lightning-autotune supports Lightning 2.6")
    if closure._zero_grad_fn is not None:
        closure._zero_grad_fn = wrap(closure._zero_grad_fn)


def set_trainer_reference(model: Any, trainer: Any) -> None:
    """Attach ``trainer`` (or None) to a ``LightningModule`` without touching its children
    (``LightningModule._trainer``). Public ``model.trainer = ...`` is not used: it also sets the trainer of nested
    LightningModules. If it went away, estimating a model whose ``configure_optimizers`` reads ``self.trainer`` would
    fail."""
    model._trainer = trainer


def trainer_reference(model: Any) -> Any:
    """The trainer attached to ``model``, or None (``LightningModule._trainer``; public ``model.trainer`` raises when
    none is attached). If it went away, the estimator would deep-copy an attached Trainer with the model."""
    return getattr(model, "_trainer", None)


def optimizers_from_config(config: Any) -> list[Any]:
    """The optimizers in whatever ``configure_optimizers`` returned (``lightning.pytorch.core.optimizer.
    _configure_optimizers``, which accepts every form Lightning does). If it went away, the estimator could not read
    a model's optimizers without a Trainer."""
    from lightning.pytorch.core.optimizer import _configure_optimizers

    return list(_configure_optimizers(config)[0])


def precision_input_dtype(precision: Any) -> Any:
    """The dtype a Lightning precision plugin converts the model to (``Precision._desired_input_dtype`` of
    ``HalfPrecision``; None for others). If it went away, ``bf16-true``/``16-true`` estimates would count fp32
    parameters."""
    return getattr(precision, "_desired_input_dtype", None)


def set_module_device_dtype(module: Any, device: Any, dtype: Any) -> None:
    """Make ``module.device``/``module.dtype`` of a Lightning module answer ``device`` and ``dtype`` (``_device`` and
    ``_dtype`` of ``lightning.fabric.utilities.device_dtype_mixin._DeviceDtypeModuleMixin``, which ``Module.to``
    sets there); other modules are left alone. If they changed, a fake model's ``self.device`` would still name the
    host, and steps that make tensors on ``self.device`` would be traced on the wrong device."""
    from lightning.fabric.utilities.device_dtype_mixin import _DeviceDtypeModuleMixin

    if isinstance(module, _DeviceDtypeModuleMixin):
        module._device = device
        module._dtype = dtype or module._dtype


def quiet_third_party_notices() -> None:
    """Drop two messages every Lightning run prints that are neither Lightning's account of the run nor anything a user
    of autotune can act on (idempotent; called when ``autotune.callbacks`` is imported):

    - Lightning 2.6's advertisement for its cloud logger (``"💡 Tip: For seamless cloud logging ... litlogger"``), logged
      at every Trainer's creation, even with ``logger=False``: a filter on its logger drops records starting so.
    - torch 2.13's ``FutureWarning`` that ``isinstance(treespec, LeafSpec)`` is deprecated, raised at every fit from
      Lightning's own ``utilities/_pytree.py`` (its ``CombinedLoader``), not from the user's code or ours: ignored for
      that module only. If either changes its wording, the message shows again, nothing else changes.
    """
    import logging
    import warnings

    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _TipFilter) for f in logger.filters):
        logger.addFilter(_TipFilter())
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning,
                            module=r"lightning\.pytorch\.utilities\._pytree")


class _TipFilter:
    """Drops Lightning's promotional tips (``"💡 Tip: ..."``); keeps every other record."""

    def filter(self, record: Any) -> bool:
        return not str(record.msg).startswith("💡 Tip:")


def subcommand_parsers(parser: Any) -> dict[str, Any]:
    """The subcommands' parsers of a jsonargparse parser (LightningCLI's ``fit``, ``validate``, ...), by name:
    ``parser._subcommands_action._name_parser_map``, jsonargparse's (4.x) private record of them. If it went away,
    a config's misspelt top-level key would be named against the root parser's keys only."""
    return dict(getattr(getattr(parser, "_subcommands_action", None), "_name_parser_map", None) or {})


def ddp_strategy_settings(strategy: Any) -> tuple[bool, str | None]:
    """Whether a ``DDPStrategy`` asks for a static graph, and the name of the communication hook it registers (None:
    none): ``strategy._ddp_kwargs`` and ``strategy._ddp_comm_hook``, Lightning's private record of its arguments. If
    they went away, the DDP module itself is still checked at the fit's start (:func:`ddp_module_settings`)."""
    kwargs = getattr(strategy, "_ddp_kwargs", None) or {}
    hook = getattr(strategy, "_ddp_comm_hook", None)
    return bool(kwargs.get("static_graph", False)), None if hook is None else _hook_name(hook)


def ddp_module_settings(model: Any) -> tuple[bool, str | None]:
    """Whether a ``DistributedDataParallel`` module runs a static graph, and the name of a communication hook
    registered on it (None: none): ``model.static_graph``, ``model._comm_hooks`` (Python hooks) and the DDP logger's
    ``comm_hook`` (built-in C++ hooks too). If these went away, a hook registered on the module itself would go
    unseen (one given to ``DDPStrategy`` is still refused at setup)."""
    hooks = getattr(model, "_comm_hooks", None) or []
    name = _hook_name(hooks[0][0]) if hooks else None
    if name is None:
        try:
            name = model._get_ddp_logging_data().get("comm_hook") or None
        except (AttributeError, RuntimeError):
            name = None
    return bool(getattr(model, "static_graph", False)), name


def _hook_name(hook: Any) -> str:
    return str(getattr(hook, "__qualname__", None) or getattr(hook, "__name__", None) or hook)


#: The precision plugin's method that runs after each closure evaluation inside ``optimizer.step``: the
#: ``on_before_optimizer_step`` hooks (callbacks', the module's), then gradient clipping (``_clip_gradients``, which
#: calls ``configure_gradient_clipping``). ``ElasticBatchSize`` replaces it on the plugin for the fit so a step replayed
#: after an OOM in its update runs the hooks once. If it were renamed, the patch would change nothing and the hooks
#: would run again on such a replay (as before).
AFTER_CLOSURE = "_after_closure"


def clip_gradients(plugin: Any, model: Any, optimizer: Any) -> None:
    """The plugin's gradient clipping with the trainer's settings (``plugin._clip_gradients``), without the hooks."""
    trainer = model.trainer
    plugin._clip_gradients(model, optimizer, trainer.gradient_clip_val,
                           gradient_clip_algorithm=trainer.gradient_clip_algorithm)
