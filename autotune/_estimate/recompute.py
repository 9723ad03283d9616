"""``activation_checkpointing="auto"``: the least recomputation whose predicted peak fits the budget, chosen block by
block and, inside a block, op by op (its matrix products and attention saved, the rest recomputed) by the estimator
and the step-time model.

Each block has three levels (:data:`~autotune._transforms.recompute.RECOMPUTE_LEVELS`): ``none``, ``ops`` (torch's
selective checkpointing: the outputs of matrix products, convolutions and fused attention saved, the pointwise
operators, norms and dropout recomputed) and ``block`` (all of it recomputed). Every level of every block is traced
alone, once: the memory it saves (the step's predicted peak without checkpointing less the peak with that block at
that level) and the time it adds (the step-time model's seconds, which price each operator the recompute runs).
Then, while the whole choice's traced peak is over the budget, one block goes up a level: where one step up closes
the gap by those figures, the cheapest in seconds that does, else the one that saves most bytes per second added
(ties to the first block). Last, each block that can go down a level with the traced peak still in the budget does,
dearest first, until none can: the choice is minimal by the estimate (lowering any block breaks the budget), and
deterministic (traces and rules, no clock).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autotune._device.budget import check_bytes
from autotune._estimate.fake_step import OptimizerFactory
from autotune._estimate.speed import SpeedModel, speed_device
from autotune._estimate.trace import Traces
from autotune._runtime.batch import batch_size_of
from autotune._plan.plan import Plan
from autotune._transforms.blocks import find_blocks
from autotune._transforms.recompute import RECOMPUTE_LEVELS

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule

    from autotune._device.probe import DeviceSpec
    from autotune._estimate.devices import DeviceSpeed

__all__ = ["SELECTIVE_LAUNCHES", "BlockRecompute", "RecomputeChoice", "choose", "choose_recompute"]

log = logging.getLogger(__name__)

#: The host's cost of selective checkpointing per operator of an ``ops`` block, in operator launches: its Python
#: dispatch mode sees each operator in the forward and again in the recompute (a saved one returns its cached output).
#: The traced step does not hold it (the trace runs no such mode). A guess, not fitted: on a 2-core CPU the example
#: GPT's choice with two ``ops`` blocks measured no faster than checkpointing half its blocks whole, where the
#: recompute's operators alone predicted it faster (docs/benchmarks.md).
SELECTIVE_LAUNCHES = 2.0


@dataclass(frozen=True, kw_only=True)
class BlockRecompute:
    """One repeated block's level in a choice: ``name`` (its module path), ``level``, the predicted peak bytes it saves
    at that level traced alone (``saved_bytes``) and the predicted seconds per step its recompute adds."""

    index: int
    name: str
    level: str
    saved_bytes: int
    recompute_seconds: float


@dataclass(frozen=True, kw_only=True)
class RecomputeChoice:
    """What :func:`choose_recompute` chose: the plan with its ``recompute`` levels, each block's figures, the traced
    peak of the whole choice against the budget, and the peak and step seconds without checkpointing.

    ``fits`` is False where even every block recomputed whole does not fit (``plan`` then recomputes every block).
    ``traced``: the distinct choices the estimator traced to decide."""

    plan: Plan
    blocks: tuple[BlockRecompute, ...]
    budget_bytes: int
    predicted_peak_bytes: int
    plain_peak_bytes: int
    plain_seconds: float
    seconds: float
    fits: bool
    traced: int

    @property
    def recompute_seconds(self) -> float:
        """The predicted seconds per step the choice adds to the step without checkpointing."""
        return self.seconds - self.plain_seconds

    def describe(self) -> list[str]:
        """One line per block that recomputes, and a total (what ``autotune estimate`` prints).

        Example:
            >>> choice.describe()[0]  # doctest: +SKIP
            'blocks.0  ops    saves 12.0 MiB for +1.2 ms per step'
        """
        lines = [f"{b.name}  {b.level:<5}  saves {_mib(b.saved_bytes)} for +{b.recompute_seconds * 1e3:.2f} ms per "
                 "step" for b in self.blocks if b.level != "none"]
        verdict = "fits" if self.fits else "does not fit"
        lines.append(f"{sum(b.level != 'none' for b in self.blocks)} of {len(self.blocks)} blocks recompute: peak "
                     f"{_mib(self.predicted_peak_bytes)} ({verdict} {_mib(self.budget_bytes)}; "
                     f"{_mib(self.plain_peak_bytes)} without), +{self.recompute_seconds * 1e3:.2f} ms per step")
        return lines


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def choose_recompute(
    *, model: LightningModule, batch: Any, plan: Plan, budget_bytes: int, device: DeviceSpec = None,
    device_type: str | None = None, optimizer: OptimizerFactory | None = None, world_size: int | None = None,
) -> RecomputeChoice:
    """Choose what each repeated block of ``model`` recomputes so that ``plan``'s predicted step peak fits
    ``budget_bytes`` with the least predicted recompute time (``activation_checkpointing="auto"``).

    Args:
        model: The LightningModule (automatic optimization).
        batch: A training batch; ``plan.micro_batch_size`` of it is traced (None: all).
        plan: The plan to choose for (its checkpointing setting is replaced by ``"auto"`` with the chosen levels).
        budget_bytes: The bytes the step's predicted peak must fit (what :class:`~autotune.Estimate` predicts).
        device: As :func:`autotune.estimate`.
        device_type: A GPU of the step-time model's table to price the recompute on (``"h100"``); None: this
            machine's ``device``, measured once (cached).
        optimizer: As :func:`autotune.estimate`.
        world_size: As :func:`autotune.estimate`.

    Returns:
        The choice; its ``plan`` has ``activation_checkpointing="auto"`` and ``recompute`` set.

    Raises:
        ValueError: as :func:`autotune.estimate`; for ``budget_bytes`` not a positive int, or a model without
            repeated blocks.

    Example:
        >>> choice = choose_recompute(model=model, batch=batch, plan=Plan(micro_batch_size=8),
        ...                           budget_bytes=2**30)  # doctest: +SKIP
        >>> choice.plan.recompute  # doctest: +SKIP
        ('ops', 'none', 'none', 'none')
    """
    resolved, speed = speed_device(device, device_type=device_type)
    return choose(model=model, batch=batch, plan=plan, budget_bytes=budget_bytes, device=resolved, speed=speed,
                  optimizer=optimizer, world_size=world_size)


def choose(*, model: LightningModule, batch: Any, plan: Plan, budget_bytes: int, device: DeviceSpec,
           speed: DeviceSpeed, optimizer: OptimizerFactory | None = None, world_size: int | None = None,
           traced_before: dict[tuple[str, int | None], tuple[int, float, float]] | None = None) -> RecomputeChoice:
    """:func:`choose_recompute` with the device's speeds given. ``traced_before``: the traces' figures of earlier
    choices for the same model and batch (a search chooses again for each calibration: only the greedy runs again)."""
    check_bytes("budget_bytes", budget_bytes)
    blocks = find_blocks(model)
    if not blocks:
        raise ValueError(f"activation_checkpointing='auto' chooses among repeated blocks, and "
                         f"{type(model).__name__} has none found; name the classes to checkpoint instead")
    names = {id(m): name for name, m in model.named_modules()}
    size = batch_size_of(batch)
    micro = min(plan.micro_batch_size or size, size)
    model_speed = SpeedModel(speed, batch_size=size)
    top = len(RECOMPUTE_LEVELS) - 1
    cache: dict[tuple[int, ...], tuple[int, float]] = {}
    shared = traced_before if traced_before is not None else {}
    n = len(blocks)
    block_ops = [0.0] * n  # each block's operators per micro-batch (its recompute whole, traced alone)
    passes = -(-size // micro)

    def traced(levels: tuple[int, ...]) -> tuple[int, float]:
        """The predicted peak and step seconds of ``levels`` (indices into RECOMPUTE_LEVELS), with selective
        checkpointing's host cost for the ``ops`` blocks (:data:`SELECTIVE_LAUNCHES`)."""
        if levels not in cache:
            at = _plan_at(plan, levels, micro)
            key = (at.key(), world_size)
            if key not in shared:
                traces = Traces(model=model, batch=batch, plan=at, device=device, optimizer=optimizer,
                                world_size=world_size)
                work = traces.work(micro)
                shared[key] = (traces.at(micro).predicted_peak_bytes,
                               model_speed.predict(work, at, world_size=traces.world_size).seconds_per_step,
                               sum(op.calls for op in work.phase("recompute")))
            peak, seconds, recomputed = shared[key]
            if sum(levels) == top and levels.count(top) == 1:  # one block recomputed whole: its operators
                block_ops[levels.index(top)] = recomputed
            cache[levels] = (peak, seconds)
        peak, seconds = cache[levels]
        selective = sum(block_ops[i] for i, v in enumerate(levels) if v == 1)
        return peak, seconds + SELECTIVE_LAUNCHES * selective * passes * speed.launch_seconds

    none = (0,) * n
    plain_peak, plain_seconds = traced(none)
    # each level of each block alone: bytes saved, seconds added (level 0: nothing)
    saved = [[0] * len(RECOMPUTE_LEVELS) for _ in range(n)]
    added = [[0.0] * len(RECOMPUTE_LEVELS) for _ in range(n)]
    if plain_peak > budget_bytes:
        for i in range(n):
            for level in reversed(range(1, len(RECOMPUTE_LEVELS))):  # whole first: it counts the block's operators
                peak, seconds = traced(tuple(level if j == i else 0 for j in range(n)))
                saved[i][level], added[i][level] = plain_peak - peak, max(seconds - plain_seconds, 0.0)
    levels = list(none)
    while traced(tuple(levels))[0] > budget_bytes:
        gap = traced(tuple(levels))[0] - budget_bytes
        steps = [(i, up, saved[i][up] - saved[i][levels[i]], added[i][up] - added[i][levels[i]])
                 for i in range(n) for up in range(levels[i] + 1, top + 1)]
        steps = [s for s in steps if s[2] > 0]
        if not steps:  # no step up saves anything more by the single traces: the rest of the way, whole blocks
            steps = [(i, top, 1, 0.0) for i in range(n) if levels[i] < top]
            if not steps:
                break
        closing = [s for s in steps if s[2] >= gap]
        i, up, _, _ = (min(closing, key=lambda s: (s[3], s[0], s[1])) if closing else
                       max(steps, key=lambda s: (s[2] / max(s[3], 1e-12), -s[0], -s[1])))
        levels[i] = up
    fits = traced(tuple(levels))[0] <= budget_bytes
    if fits:
        levels = _pruned(levels, traced, added, budget_bytes)
    peak, seconds = traced(tuple(levels))
    chosen = _plan_at(plan, tuple(levels), plan.micro_batch_size)
    rows = tuple(BlockRecompute(index=i, name=names.get(id(b), type(b).__name__), level=RECOMPUTE_LEVELS[levels[i]],
                                saved_bytes=saved[i][levels[i]], recompute_seconds=added[i][levels[i]])
                 for i, b in enumerate(blocks))
    log.info("autotune: recompute %s at micro-batch %d: peak %d of %d bytes (%d traces)", chosen.recompute, micro,
             peak, budget_bytes, len(cache))
    return RecomputeChoice(plan=chosen, blocks=rows, budget_bytes=budget_bytes, predicted_peak_bytes=peak,
                           plain_peak_bytes=plain_peak, plain_seconds=plain_seconds, seconds=seconds, fits=fits,
                           traced=len(cache))


def _pruned(levels: list[int], traced: Any, added: list[list[float]], budget_bytes: int) -> list[int]:
    """``levels`` with blocks taken down a level (dearest recompute first) while the traced peak fits, until no
    block can go down: the greedy's early steps may be needless once later ones were taken."""
    levels = list(levels)
    changed = True
    while changed:
        changed = False
        order = sorted((i for i in range(len(levels)) if levels[i]), key=lambda i: (-added[i][levels[i]], i))
        for i in order:
            for down in range(levels[i]):  # the lowest level that still fits
                trial = levels[:i] + [down] + levels[i + 1:]
                if traced(tuple(trial))[0] <= budget_bytes:
                    levels, changed = trial, True
                    break
            if changed:
                break
    return levels


def _plan_at(plan: Plan, levels: tuple[int, ...], micro: int | None) -> Plan:
    return plan.replace(activation_checkpointing="auto", recompute=tuple(RECOMPUTE_LEVELS[v] for v in levels),
                        micro_batch_size=micro)
