"""``ElasticBatchSize``: fit the effective batch the dataloader yields into the memory there is."""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from autotune._compat.lightning import (
    AFTER_CLOSURE, BATCH_TRANSFER_HANDLER, batch_transfer_handler, clip_gradients, logs_written_this_step,
)
from autotune._compat.torch import is_batch_norm
from autotune._device.budget import Budget, ResolvedBudget, format_bytes, resolve_budget
from autotune._runtime.checkpoint import gathered, own
from autotune._runtime.events import ElasticEvent
from autotune._runtime.microbatch import ElasticEngine
from autotune._runtime.policy import Memory, MicroBatchPolicy
from autotune._device.probe import probe_memory
from autotune.callbacks._checks import check_ddp_model, check_positive_int, check_strategy, check_trainer

log = logging.getLogger("autotune")

_EVAL_STEPS = {"validation_step": "validate", "test_step": "test", "predict_step": "predict"}


class ElasticBatchSize(Callback):
    """Split each optimizer step into micro-batches that fit the memory budget, and recover from OOM exactly.

    The dataloader yields the effective batch (the math); run with ``Trainer(accumulate_grad_batches=1)``. Each
    step is cut into micro-batches whose gradients are accumulated before one optimizer update. An out-of-memory
    error in forward, backward or the update replays the same samples at half the micro-batch: no sample is lost
    or seen twice, and the weights are those of Lightning's own accumulation at that micro-batch. After
    ``grow_after`` clean steps with room to spare, the micro-batch is doubled again (never above the batch); if
    that fails, it goes back and waits twice as long before the next try.

    Batches whose memory follows their shape (dynamic padding, mixed resolutions) are split by shape: once a batch's
    sample size (its elements per sample, e.g. the padded length) differs from the first batch's, each step runs at
    the largest micro-batch that a memory model of the step, learned online from the micro-batches that ran, the
    out-of-memory errors and the measured peaks, predicts to fit *this* batch; short batches are not held to the long
    ones' micro-batch. See docs/elastic.md ("Batches of varying shape").

    Args:
        budget: memory this process may use: bytes like ``"20GiB"`` or ``4294967296``, a fraction of the device's total
            like ``0.8``, ``"auto"`` (free memory minus a margin), a budget already resolved to bytes for this device
            (:func:`autotune._device.budget.resolve_budget`: a search's trial gets the bytes the search judges it
            against, not a second reading), or None to react to OOM only (on CUDA the device's
            memory, or the cap of ``set_per_process_memory_fraction`` where one is set before fit, is then the limit
            that growing and the shape model work to). On CUDA the budget is a
            hard cap on the caching allocator (``torch.cuda.set_per_process_memory_fraction``), so a large GPU behaves
            like a smaller one. On CPU it is soft: the step's peak resident set net of file-backed pages (``VmHWM -
            RssFile``) is checked after the step and an overshoot halves the micro-batch of the next step.
        micro_batch_size: the micro-batch to start with; None starts with the whole batch.
        min_micro_batch_size: an OOM at this size ends ``fit`` with
            :class:`~autotune.OutOfMemoryAtMinimumError`.
        grow: whether to try larger micro-batches again after clean steps.
        grow_after: clean steps before the first try to grow (doubled after each failed try).
        sample_size: a function of the (host) batch returning its size per sample (a positive number, e.g. the padded
            sequence length) for batches whose structure does not show it; by default the elements per sample of the
            batch's tensors whose first dimension is the batch size.
        micro_batch_sample_size: the elements per sample (as ``sample_size`` counts them) at which ``micro_batch_size``
            is known to fit, e.g. the longest batch a search measured (a tuned plan writes it where lengths vary): the
            split starts from it, so shorter batches take larger micro-batches from the first step (at most twice the
            load known to fit) and longer ones smaller. Needs ``micro_batch_size``.
        protect_update: make an OOM inside ``optimizer.step`` replayable. Updates that create optimizer state (the
            first one, parameters added or unfrozen later: the ones that allocate the most) are preceded by a host
            copy of the parameters and state they change, freed once the update succeeds; steady-state updates copy
            nothing, only note the tensors' version counters, so an OOM that strikes before the update changed
            anything replays too, and one after it ends ``fit`` with a clear error. With False, no update is copied.

    Raises:
        ValueError: for a bad argument, naming it and what is accepted.

    Example:
        >>> from lightning.pytorch import Trainer
        >>> from autotune.callbacks import ElasticBatchSize
        >>> trainer = Trainer(callbacks=[ElasticBatchSize(budget="20GiB")], accumulate_grad_batches=1)  # doctest: +SKIP
    """

    #: The strategy types supported, exactly: a subclass (DeepSpeed's and XLA's derive from DDP's) is refused.
    SUPPORTED_STRATEGIES = (SingleDeviceStrategy, DDPStrategy, ModelParallelStrategy)

    def __init__(
        self,
        *,
        budget: str | int | float | ResolvedBudget | None = None,
        micro_batch_size: int | None = None,
        min_micro_batch_size: int = 1,
        grow: bool = True,
        grow_after: int = 50,
        protect_update: bool = True,
        sample_size: Callable[[Any], float] | None = None,
        micro_batch_sample_size: float | None = None,
    ) -> None:
        check_positive_int("micro_batch_size", micro_batch_size, allow_none=True)
        if micro_batch_sample_size is not None and (
                isinstance(micro_batch_sample_size, bool) or not isinstance(micro_batch_sample_size, (int, float))
                or not 0 < micro_batch_sample_size < math.inf or micro_batch_size is None):
            raise ValueError("`micro_batch_sample_size` must be a positive number (the elements per sample at which "
                             f"`micro_batch_size` fits) with `micro_batch_size` set, or None; got "
                             f"{micro_batch_sample_size!r}")
        if sample_size is not None and not callable(sample_size):
            raise ValueError(f"`sample_size` must be a function of the batch returning its size per sample, or None; "
                             f"got {sample_size!r}")
        for name, flag in (("grow", grow), ("protect_update", protect_update)):
            if flag not in (True, False):
                raise ValueError(f"`{name}` must be True or False; got {flag!r}")
        check_positive_int("min_micro_batch_size", min_micro_batch_size, allow_none=False)
        check_positive_int("grow_after", grow_after, allow_none=False)
        if micro_batch_size is not None and micro_batch_size < min_micro_batch_size:
            raise ValueError(
                f"`micro_batch_size` ({micro_batch_size}) must be >= `min_micro_batch_size` ({min_micro_batch_size})"
            )
        # a budget resolved already (a trial's) is kept as bytes; any other is resolved at ``setup``, on its device
        self._resolved = budget if isinstance(budget, ResolvedBudget) else None
        self.budget = None if budget is None else Budget.parse(
            budget if self._resolved is None else self._resolved.budget or self._resolved.budget_bytes)
        self._start_micro_batch_size = micro_batch_size
        self.min_micro_batch_size = min_micro_batch_size
        self.grow = bool(grow)
        self.grow_after = grow_after
        self.protect_update = bool(protect_update)
        self.sample_size = sample_size
        self.micro_batch_sample_size = None if micro_batch_sample_size is None else float(micro_batch_sample_size)
        self._state_key: tuple[tuple[Any, ...], str] | None = None
        self.engine: ElasticEngine | None = None
        self._pending_state: dict[str, Any] | None = None
        self._restore: list[tuple[Any, str, bool, Any]] = []
        self._fraction_set_on: torch.device | None = None
        self._fraction_before = 1.0
        self._rank_and_world = (0, 1)

    # ------------------------------------------------------------------------------------------ public state
    @property
    def micro_batch_size(self) -> int | None:
        """The training micro-batch in use now (None before the first batch when starting from the whole batch)."""
        return self.engine.micro_batch_size if self.engine is not None else self._start_micro_batch_size

    @property
    def events(self) -> list[ElasticEvent]:
        """Every shrink, grow and failed grow so far, oldest first."""
        return list(self.engine.events) if self.engine is not None else []

    @property
    def update_snapshot_bytes(self) -> int:
        """Host bytes copied to protect the last optimizer update (0 in steady state; see ``protect_update``)."""
        return self.engine.update.snapshot_bytes if self.engine is not None else 0

    @property
    def budget_bytes(self) -> int | None:
        """The budget resolved against the device at ``setup`` (None without a budget)."""
        return self.engine.policy.memory.budget_bytes if self.engine is not None else None

    # ----------------------------------------------------------------------------------------------- set up
    @property
    def state_key(self) -> str:
        """Its settings: two instances (a user's config and a tuned file stacked after it, of which the later one
        runs) are told apart in checkpoints; two with the same settings are one too many (Lightning refuses them)."""
        settings = (None if self.budget is None else str(self.budget), self._start_micro_batch_size,
                    self.min_micro_batch_size, self.grow, self.grow_after, self.protect_update)
        if self._state_key is None or self._state_key[0] != settings:  # Lightning asks for it at every hook call
            self._state_key = (settings, self._generate_state_key(
                budget=settings[0], micro_batch_size=settings[1], min_micro_batch_size=settings[2], grow=settings[3],
                grow_after=settings[4], protect_update=settings[5]))
        return self._state_key[1]

    def describe(self) -> str:
        """Its settings in words, e.g. ``budget 2GiB, micro-batch 16, no growing``.

        Example:
            >>> ElasticBatchSize(micro_batch_size=8, grow_after=10).describe()
            'no budget, micro-batch 8, growing after 10 clean steps'
        """
        parts = [f"budget {self.budget}" if self.budget is not None else "no budget",
                 f"micro-batch {self._start_micro_batch_size}" if self._start_micro_batch_size else "the whole batch",
                 f"growing after {self.grow_after} clean steps" if self.grow else "no growing"]
        if self.min_micro_batch_size != 1:
            parts.append(f"at least {self.min_micro_batch_size}")
        if not self.protect_update:
            parts.append("updates unprotected")
        return ", ".join(parts)

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        mine = [c for c in trainer.callbacks if isinstance(c, ElasticBatchSize)]
        if mine and mine[-1] is not self:  # a later one (a tuned file's, stacked after the user's config) takes over
            rank_zero_info(f"ElasticBatchSize: the later one in the callbacks ({mine[-1].describe()}) runs in place "
                           f"of this one ({self.describe()}).")
            return
        check_strategy(trainer, self.SUPPORTED_STRATEGIES)
        if stage == "fit":
            check_trainer(trainer, pl_module)
        if any(is_batch_norm(m) for m in pl_module.modules()):
            rank_zero_warn(
                "ElasticBatchSize: the model has BatchNorm layers; splitting a batch changes their batch statistics "
                "(as any gradient accumulation does). Prefer LayerNorm/GroupNorm, or keep micro_batch_size = batch."
            )
        device = trainer.strategy.root_device
        budget_bytes, limit = self._resolve_budget(device)
        hard = device.type == "cuda"
        policy = MicroBatchPolicy(
            micro_batch_size=self._start_micro_batch_size,
            min_micro_batch_size=self.min_micro_batch_size,
            grow=self.grow,
            grow_after=self.grow_after,
            memory=Memory(budget_bytes=budget_bytes, limit_bytes=limit, hard=hard,
                          budget_text=None if self.budget is None else str(self.budget)),
            sample_size=self.sample_size,
            micro_batch_sample_size=self.micro_batch_sample_size,
            rank=trainer.global_rank if trainer.world_size > 1 else None,
        )
        self.engine = ElasticEngine(
            policy=policy,
            protect_update=self.protect_update,
            device=device,
            world_size=trainer.world_size,
            log_fn=pl_module.log,
            sharded=isinstance(trainer.strategy, ModelParallelStrategy),
            collectives=any(isinstance(m, torch.nn.SyncBatchNorm) for m in pl_module.modules()),
        )
        self.engine.logs.owner = pl_module
        self._rank_and_world = (trainer.global_rank, trainer.world_size)
        if self._pending_state is not None:
            self.engine.load_state_dict(own(self._pending_state, rank=trainer.global_rank, world=trainer.world_size))
            self._pending_state = None
        self._install(trainer, pl_module)

    def _resolve_budget(self, device: torch.device) -> tuple[int | None, int | None]:
        if self.budget is None:
            probe = probe_memory(device)
            if device.type != "cuda":
                return None, probe.free_bytes
            # A cap set before fit (``set_per_process_memory_fraction``: by the user, a launcher, a shared node's
            # policy) is where this process's allocator runs out: the limit the growth and the shape model work to.
            try:
                fraction = torch.cuda.get_per_process_memory_fraction(device)
            except RuntimeError:  # an allocator plugged in (RMM and the like) keeps no fraction
                fraction = 1.0
            if not 0.0 < fraction < 1.0:  # no cap (some plugged-in allocators answer 0)
                return None, probe.total_bytes
            return None, min(probe.total_bytes, int(fraction * torch.cuda.mem_get_info(device)[1]))
        budget_bytes = resolve_budget(self._resolved or self.budget, device).budget_bytes
        if device.type == "cuda":
            allocator_total = torch.cuda.mem_get_info(device)[1]  # what the fraction multiplies (NVML's may differ)
            fraction = min(1.0, budget_bytes / allocator_total)
            self._fraction_before = torch.cuda.get_per_process_memory_fraction(device)
            torch.cuda.set_per_process_memory_fraction(fraction, device)
            self._fraction_set_on = device
            log.info("autotune: CUDA allocator capped at %s (%.3f of %s)", format_bytes(budget_bytes), fraction,
                     format_bytes(allocator_total))
        return budget_bytes, budget_bytes

    def _patch(self, obj: Any, name: str, new: Any) -> None:
        had = name in obj.__dict__
        self._restore.append((obj, name, had, obj.__dict__.get(name)))
        setattr(obj, name, new)

    def _install(self, trainer: Trainer, pl_module: LightningModule) -> None:
        engine = self.engine
        assert engine is not None  # set just before; not user input
        original_step = pl_module.optimizer_step
        original_training_step = pl_module.training_step
        original_transfer = batch_transfer_handler(pl_module)

        def in_training() -> bool:
            return trainer.state.stage == RunningStage.TRAINING

        @functools.wraps(original_transfer)
        def transfer(batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
            if in_training():
                return batch  # stays on the host; each micro-batch is moved on its own in training_step
            return original_transfer(batch, device, dataloader_idx)

        @functools.wraps(original_training_step)
        def training_step(batch: Any, *args: Any, **kwargs: Any) -> Any:
            part, _ = engine.micro_part(batch)
            part = original_transfer(part, trainer.strategy.root_device, 0)
            return engine.scale_output(original_training_step(part, *args, **kwargs))

        @functools.wraps(original_step)
        def optimizer_step(epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> Any:
            parallel_model = trainer.strategy.model if trainer.world_size > 1 else None
            return engine.run_training_step(
                step=lambda closure: original_step(epoch, batch_idx, optimizer, closure),
                closure=optimizer_closure,
                optimizer=getattr(optimizer, "optimizer", optimizer),
                module=pl_module,
                parallel_model=parallel_model,
                scaler=getattr(trainer.precision_plugin, "scaler", None),
                global_step=trainer.global_step,
            )

        plugin = trainer.precision_plugin
        original_after = getattr(plugin, AFTER_CLOSURE, None)
        if original_after is not None:
            @functools.wraps(original_after)
            def after_closure(model: Any, optimizer: Any) -> None:
                # on_before_optimizer_step once per step: not again on a replay after an OOM in the update (its
                # hooks ran on the failed attempt); the replay's own gradients are clipped all the same.
                if engine.hooks_due():
                    original_after(model, optimizer)
                else:
                    clip_gradients(plugin, model, optimizer)

            self._patch(plugin, AFTER_CLOSURE, after_closure)
        self._patch(pl_module, "log", engine.logs)
        self._patch(pl_module, BATCH_TRANSFER_HANDLER, transfer)
        self._patch(pl_module, "training_step", training_step)
        self._patch(pl_module, "optimizer_step", optimizer_step)
        for name, stage in _EVAL_STEPS.items():
            original = getattr(pl_module, name, None)
            if original is not None:
                self._patch(pl_module, name, _eval_wrapper(engine, stage, original, pl_module))

    def _uninstall(self) -> None:
        if self.engine is not None:
            self.engine.close()
        for obj, name, had, value in reversed(self._restore):
            if had:
                obj.__dict__[name] = value
            else:
                obj.__dict__.pop(name, None)
        self._restore = []
        if self._fraction_set_on is not None:
            torch.cuda.set_per_process_memory_fraction(self._fraction_before, self._fraction_set_on)
            self._fraction_set_on = None

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.engine is not None:  # DDP wrapped the module; a hook registered on it in on_fit_start is there
            check_ddp_model(trainer.strategy.model)

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._eval_starts(trainer.num_sanity_val_batches if trainer.sanity_checking else trainer.num_val_batches)

    @override
    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._eval_starts(trainer.num_test_batches)

    @override
    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._eval_starts(trainer.num_predict_batches)

    def _eval_starts(self, batches: list[int | float]) -> None:
        if self.engine is not None:  # under DDP: whether the loop's steps vote (its ranks run as many steps)
            self.engine.eval_loop_starts([float(b) for b in batches])

    # -------------------------------------------------------------------------------------------- per batch
    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.engine is not None:
            self.engine.start_batch(batch, logged=logs_written_this_step(trainer))

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        engine = self.engine
        if engine is None or engine.micro_batch_size is None or not logs_written_this_step(trainer):
            return  # log on the steps the Trainer writes (log_every_n_steps): each self.log call costs ~1 ms
        metrics = {
            "autotune/micro_batch_size": float(min(engine.micro_batch_size, engine.batch_size or 1)),
            "autotune/num_micro_batches": float(len(engine.sizes)),
            "autotune/oom_events": float(engine.oom_events),
            "autotune/over_budget_events": float(engine.over_budget_events),
            "autotune/peak_memory_gib": engine.last_peak_bytes / 2**30,
        }
        shapes = engine.shapes
        if shapes.varies:  # split by shape: the sample size, tokens per micro-batch and the peak the model predicted
            metrics["autotune/sample_size"] = shapes.size
            micro = min(engine.micro_batch_size, engine.batch_size or 1)
            metrics["autotune/tokens_per_micro_batch"] = shapes.size * micro
            if shapes.predicted_peak_bytes:
                metrics["autotune/predicted_peak_gib"] = shapes.predicted_peak_bytes / 2**30
        for name, value in metrics.items():
            engine.logs.log_fn(name, value, on_step=True, on_epoch=False, batch_size=1)

    # ------------------------------------------------------------------------------------------- tear down
    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._uninstall()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._uninstall()

    @override
    def state_dict(self) -> dict[str, Any]:
        """Every rank's own state (its micro-batch, shape model, events), so that each resumes with its own."""
        if self.engine is None:
            return dict(self._pending_state or {})
        return gathered(self.engine.state_dict(), several=self.engine.agree.enabled)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.engine is not None:
            self.engine.load_state_dict(own(state_dict, rank=self._rank_and_world[0], world=self._rank_and_world[1]))
        else:
            self._pending_state = dict(state_dict)


def _eval_wrapper(engine: ElasticEngine, stage: str, original: Any, module: LightningModule) -> Any:
    @functools.wraps(original)
    def step(batch: Any, *args: Any, **kwargs: Any) -> Any:
        return engine.run_eval_step(stage, original, batch, args, kwargs, module)

    return step

