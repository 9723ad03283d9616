"""Learn online which micro-batch fits a batch, from a memory model of the training step in the batch's shape.

With dynamic padding (or mixed image resolutions) what a micro-batch costs follows the batch's *shape*, not its
sample count. The model describes a sample by its **size** ``s``: the elements one sample has in the batch's tensors
(the non-batch dimensions: sequence length, channels x height x width, summed over the batch's tensors), or what the
user's ``sample_size`` function returns for it. A micro-batch of ``m`` samples of size ``s`` costs ``m * g(s)`` over
the memory the step holds anyway (weights, gradients, optimizer state). The per-sample cost ``g`` is an affine term
in the tokens plus a term in the length squared (attention scores materialised, masks of [L, L]):

    g(s) = w0 + w1 * x + w2 * x**2,    x = s / s_ref   (s_ref: the first size seen).

The weights are not fitted by regression. The model keeps every ``w`` of a grid on the simplex (``w0 + w1 + w2 = 1``)
that agrees with what the run has seen. With each ``w`` it keeps the interval the capacity ``C`` (in units of ``g``)
can still be in:

- A micro-batch that ran (``m`` samples of size ``s``) says ``C >= m * g(s)`` (the *fits* frontier).
- An out-of-memory error (or a step over a soft budget) says ``C < m * g(s)`` (the *fails* frontier).
- Peaks may be measured where a byte limit is known. On CUDA that is the allocator's peak after a reset, with no
  synchronisation, read before the update, whose temporaries do not grow with the batch. On CPU with a budget it is
  the budget's own meter. Then the bytes a unit of load took cap ``C`` at the limit's headroom. A micro-batch under
  that cap (and under ``growth`` times what ran) is taken to fit.
- Bytes may be measured at two sample sizes or more. Then a ``w`` whose bytes per unit of load vary over them much
  more than the best ``w``'s is ruled out (``_PLAUSIBLE_SPREAD``): bytes that grew with the tokens contradict a cost
  in the length squared.

A ``w`` whose interval is empty is ruled out. Until both sides are seen the model is conservative. For any ``w``
still possible, ``C`` is never taken above ``growth`` times the largest load seen to work (the factor the doubling
of fixed-shape runs uses). So no micro-batch is tried that some possible cost puts further than that from what ran.

For a batch the model picks the fewest micro-batches whose largest one fits with probability ``confidence``. The
probability is over the ``w`` left and their intervals (log-uniform in ``C``). A micro-batch only matters through the
count it gives, so a larger one is tried only when it saves a micro-batch. After an out-of-memory error the replay
takes what every ``w`` says fits (``confidence`` 1).

Evidence is kept on two Pareto frontiers (at most one point per micro-batch size each), newest first. A new point that
contradicts an older one on the other frontier removes it: a success at a load an older failure ruled out, or a failure
where a micro-batch ran before. A fit removed that way is remembered as *lost*: memory pressure (another process,
fragmentation) may have caused the failure. A **probe** runs when the runtime allows one (after ``grow_after`` clean
steps). It tries the fewest micro-batches that no evidence rules out: a lost fit, or a split whose chance of fitting is
below ``confidence`` but above zero. So a batch just under the boundary is not held split for the rest of the run, and
either outcome moves a frontier. A failure at a load never seen to work rules that load out, and it is not probed.

Limits: the model knows shape, not content (two batches of one shape cost the same). The batch's sample size is its
padded size. A per-sample cost that falls with the size, or grows faster than its square, is outside the family. It
is met by out-of-memory replays, each of which moves the frontier.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autotune._runtime.batch import sample_size_of

#: The per-sample cost's weights (w0, w1, w2): the simplex in steps of 1/6 (28 candidates).
_GRID_STEPS = 6
_CANDIDATES = tuple(
    (a / _GRID_STEPS, b / _GRID_STEPS, (_GRID_STEPS - a - b) / _GRID_STEPS)
    for a in range(_GRID_STEPS + 1)
    for b in range(_GRID_STEPS + 1 - a)
)
#: Frontier points kept on each side (the oldest go first).
_MAX_POINTS = 64
#: Where bytes were measured at several sample sizes: how much more than the best ``w``'s a ``w``'s bytes per unit of
#: load may vary over them and still be possible (the grid is coarse, and a step holds parts that do not grow with it).
_PLAUSIBLE_SPREAD = 1.25


@dataclass
class _Point:
    s: float
    m: int
    t: int  # when it was seen (a counter), to forget the oldest first
    act_bytes: int = 0  # measured bytes over the step's static part (fits only; 0: not measured)
    loads: tuple[float, ...] = ()  # m * g(s) for every candidate w (filled when first needed)


@dataclass(frozen=True)
class ShapeChoice:
    """What the model chose for one batch: ``micro`` samples per micro-batch (the largest of the split)."""

    micro: int


class ShapeModel:
    """The memory model of one fit (one per rank); see the module's docstring.

    Example:
        >>> model = ShapeModel()
        >>> model.fitted(32, 16.0)       # 32 samples of 16 tokens ran
        >>> model.failed(16, 128.0)      # 16 samples of 128 tokens ran out of memory
        >>> model.fitted(8, 128.0)
        >>> model.choose(32, 16.0).micro, model.choose(32, 128.0, confidence=1.0).micro
        (32, 8)
        >>> model.choose(32, 128.0).micro  # 3 micro-batches of at most 11: more likely to fit than not
        11
    """

    def __init__(self, *, growth: float = 2.0, confidence: float = 0.5) -> None:
        self.growth = growth
        self.confidence = confidence
        self.s_ref: float | None = None
        self.fits: list[_Point] = []
        self.fails: list[_Point] = []
        self.lost: list[_Point] = []  # fits a newer failure contradicted (pressure?): what a probe tries again
        self.limit_bytes: int | None = None  # headroom x limit: the bytes a step may peak at (None: not known)
        self.static_bytes = 0
        self._clock = 0
        self._bounds: list[tuple[int, float, float, float]] | None = None
        self._cache: dict[tuple[int, float, bool, float], ShapeChoice] = {}  # (n, s, probe, confidence)

    # ---------------------------------------------------------------------------------------------- evidence
    def fitted(self, m: int, s: float, act_bytes: int = 0) -> None:
        """``m`` samples of size ``s`` ran; ``act_bytes``: the step's measured peak over its static part (0: none)."""
        if self.s_ref is None:
            self.s_ref = s
        self._clock += 1
        for p in self.fits:
            if p.s >= s and p.m >= m:  # nothing new (a point at least as large ran)
                if p.s == s and p.m == m and act_bytes > p.act_bytes:
                    grew = act_bytes > p.act_bytes * 1.0625
                    p.act_bytes = act_bytes
                    if grew and self.limit_bytes is not None:
                        self._changed()  # the byte cap moves (not for every page of noise)
                return
        self.fits = [p for p in self.fits if not (p.s <= s and p.m <= m)]
        self.fits.append(_Point(s, m, self._clock, act_bytes))
        self.lost = [p for p in self.lost if not (p.s <= s and p.m <= m)]
        stale = [p for p in self.fails if p.s <= s and p.m <= m]  # a failure this success contradicts: forgotten
        if stale:
            self.fails = [p for p in self.fails if p not in stale]
        del self.fits[:-_MAX_POINTS]
        self._changed()

    def failed(self, m: int, s: float) -> None:
        """``m`` samples of size ``s`` ran out of memory (or over a soft budget)."""
        if self.s_ref is None:
            self.s_ref = s
        self._clock += 1
        if any(p.s <= s and p.m <= m for p in self.fails):
            return
        self.fails = [p for p in self.fails if not (p.s >= s and p.m >= m)]
        self.fails.append(_Point(s, m, self._clock))
        contradicted = [p for p in self.fits if p.s >= s and p.m >= m]  # by the newer failure: pressure?
        if contradicted:
            self.fits = [p for p in self.fits if p not in contradicted]
            self.lost = (self.lost + contradicted)[-_MAX_POINTS:]
        del self.fails[:-_MAX_POINTS]
        self._changed()

    def set_memory(self, *, limit_bytes: int | None, static_bytes: int) -> None:
        """The bytes a step may peak at (the limit times the headroom; None: unknown) and what the step holds anyway."""
        if limit_bytes != self.limit_bytes or abs(static_bytes - self.static_bytes) > 2**20:
            self.limit_bytes, self.static_bytes = limit_bytes, static_bytes
            self._changed()

    @property
    def known(self) -> bool:
        """Whether any micro-batch has run or failed yet."""
        return bool(self.fits or self.fails)

    def _changed(self) -> None:
        self._bounds = None
        self._cache.clear()

    # ---------------------------------------------------------------------------------------------- the model
    def _g_all(self, s: float) -> tuple[float, ...]:
        """``g(s)`` for every candidate ``w``."""
        x = s / (self.s_ref or s or 1.0)
        return tuple(w0 + w1 * x + w2 * x * x for w0, w1, w2 in _CANDIDATES)

    def _loads(self, p: _Point) -> tuple[float, ...]:
        if not p.loads:
            p.loads = tuple(p.m * g for g in self._g_all(p.s))
        return p.loads

    def _compute_bounds(self) -> list[tuple[int, float, float, float]]:
        """For each ``w`` still possible: (its index, lowest C, highest C, byte cap on C). Where bytes were measured
        at two sample sizes or more, a ``w`` is possible only if its bytes per unit of load vary over them at most
        ``_PLAUSIBLE_SPREAD`` times as much as the best ``w``'s (a cost in the length squared cannot explain
        bytes that grew with the tokens)."""
        while True:
            count = len(_CANDIDATES)
            los = [max(c) for c in zip(*(self._loads(p) for p in self.fits))] if self.fits else [0.0] * count
            his = [min(c) for c in zip(*(self._loads(p) for p in self.fails))] if self.fails else [math.inf] * count
            measured = [p for p in self.fits if p.act_bytes] if self.limit_bytes is not None else []
            room = max(0, (self.limit_bytes or 0) - self.static_bytes)
            bounds, spreads = [], []
            for i in range(count):
                lo, hi = los[i], his[i]
                if lo >= hi:
                    continue
                ratios = [p.act_bytes / self._loads(p)[i] for p in measured]
                per_unit = max(ratios, default=0.0)
                bounds.append((i, lo, hi, room / per_unit if per_unit > 0 else math.inf))
                spreads.append(per_unit / min(ratios) if ratios else 1.0)
            if len({p.s for p in measured}) >= 2 and bounds:
                best = min(spreads)
                bounds = [b for b, spread in zip(bounds, spreads) if spread <= best * _PLAUSIBLE_SPREAD]
            if bounds or not (self.fits and self.fails):
                return bounds
            # Nothing agrees with all of it (noise, pressure that came and went): forget the oldest point.
            oldest = min(self.fits + self.fails, key=lambda p: p.t)
            if oldest in self.fits:
                self.fits.remove(oldest)
            else:
                self.fails.remove(oldest)

    def _fit_probability(self, m: int, s: float, gs: tuple[float, ...], *, probe: bool) -> float:
        if any(p.s >= s and p.m >= m for p in self.fits):
            return 1.0  # a micro-batch at least as large, of samples at least as large, ran
        if probe and any(p.s >= s and p.m >= m for p in self.lost):
            return 1.0  # it ran before a failure that may have been passing pressure: try it again
        if any(p.s <= s and p.m <= m for p in self.fails):
            return 0.0
        if self._bounds is None:
            self._bounds = self._compute_bounds()
        if not self._bounds:
            return 0.0
        total = 0.0
        for i, lo, hi, cap in self._bounds:
            load = m * gs[i]
            if lo <= 0:  # only failures seen: what half the smallest failure's load fits, nothing above
                total += 1.0 if load <= min(hi / 2, cap) else 0.0
                continue
            if load > self.growth * lo:
                return 0.0  # beyond what ran, by more than the growth factor, for some cost still possible
            top = min(hi, self.growth * lo, cap)
            if cap < math.inf:  # measured bytes under a known limit: they decide, not an interval of ignorance
                total += 1.0 if load <= top and load < hi else 0.0
            elif load <= lo:
                total += 1.0
            elif load < top:
                total += math.log(top / load) / math.log(top / lo)
        return total / len(self._bounds)

    def choose(self, n: int, s: float, *, confidence: float | None = None, probe: bool = False) -> ShapeChoice:
        """The largest micro-batch for ``n`` samples of size ``s``: the fewest micro-batches whose largest fits with
        probability ``confidence`` (the model's own by default; 1.0 after an OOM). ``probe``: the fewest that the
        evidence does not rule out (any chance above zero, or what ran before a later failure contradicted it)."""
        q = self.confidence if confidence is None else confidence
        key = (n, s, probe, q)
        found = self._cache.get(key)
        if found is not None:
            return found
        gs = self._g_all(s)
        lo_k, hi_k = 1, n  # the fewest micro-batches that fit lies in [lo_k, hi_k]; n (micro-batches of 1) is the floor
        while lo_k < hi_k:
            k = (lo_k + hi_k) // 2
            chance = self._fit_probability(-(-n // k), s, gs, probe=probe)
            allowed = chance >= q or (probe and chance > 0)  # a probe: whatever the evidence does not rule out
            if allowed:
                hi_k = k
            else:
                lo_k = k + 1
        choice = ShapeChoice(-(-n // lo_k))
        if len(self._cache) > 4096:
            self._cache.clear()
        self._cache[key] = choice
        return choice

    def predicted_peak(self, m: int, s: float) -> int:
        """The step's peak for ``m`` samples of size ``s`` predicted from the measured fits (0 without one): with the
        ``w`` still possible whose bytes per unit of load vary least over them, at the largest bytes per unit seen."""
        measured = [p for p in self.fits if p.act_bytes]
        if not measured:
            return 0
        if self._bounds is None:
            self._bounds = self._compute_bounds()
        best, spread = 0, math.inf
        for i, *_ in self._bounds or [(1, 0, 0, 0)]:
            ratios = [p.act_bytes / self._loads(p)[i] for p in measured]
            r = max(ratios) / max(min(ratios), 1e-12)
            if r < spread:
                best, spread = i, r
        per_unit = max(p.act_bytes / self._loads(p)[best] for p in measured)
        return int(self.static_bytes + per_unit * m * self._g_all(s)[best])

    # ------------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {
            "s_ref": self.s_ref,
            "fits": [(p.s, p.m, p.t, p.act_bytes) for p in self.fits],
            "fails": [(p.s, p.m, p.t) for p in self.fails],
            "lost": [(p.s, p.m, p.t, p.act_bytes) for p in self.lost],
            "clock": self._clock,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.s_ref = state.get("s_ref")
        self.fits = [_Point(*p) for p in state.get("fits", [])]
        self.fails = [_Point(*p) for p in state.get("fails", [])]
        self.lost = [_Point(*p) for p in state.get("lost", [])]
        self._clock = state.get("clock", 0)
        self._changed()


class ShapeSplit:
    """The policy's use of the model: the sample size of each batch, whether sizes vary, the micro-batch chosen.

    While every batch has the sample size of the first (a fixed-shape run) the policy keeps its halving and doubling
    and the model only takes note; once a size differs on this rank (``varies``), each step's split comes from the
    model. Each rank decides on its own batches.
    """

    def __init__(self, *, sample_size: Callable[[Any], float] | None, min_micro_batch_size: int) -> None:
        self.model = ShapeModel()
        self.sample_size_fn = sample_size
        self.min_micro_batch_size = min_micro_batch_size
        self.first: float | None = None
        self.varies = False
        self.size = 1.0  # this batch's sample size
        self.micro_chosen = 0

    def seed(self, micro: int, size: float) -> None:
        """``micro`` samples of ``size`` are known to fit (a tuned plan's micro-batch, measured on its longest
        batch): the model starts from it, and a first batch of another size is split by shape from the start."""
        self.model.fitted(micro, size)
        self.first = size

    def start(self, batch: Any, n: int) -> None:
        """A batch of ``n`` samples begins: its sample size."""
        if self.sample_size_fn is not None:
            size = self.sample_size_fn(batch)
            if isinstance(size, bool) or not isinstance(size, (int, float)) or not 0 < size < math.inf:
                raise ValueError(f"ElasticBatchSize's `sample_size` function must return a positive finite number for "
                                 f"each batch; got {size!r}")
            self.size = float(size)
        else:
            self.size = sample_size_of(batch, n)
        if self.first is None:
            self.first = self.size
        elif self.size != self.first:
            self.varies = True

    def micro(self, n: int, *, confidence: float | None = None, probe: bool = False) -> int:
        """The micro-batch for this batch (the model's choice, never below the minimum)."""
        choice = self.model.choose(n, self.size, confidence=confidence, probe=probe)
        self.micro_chosen = max(min(self.min_micro_batch_size, n), choice.micro)
        return self.micro_chosen

    @property
    def predicted_peak_bytes(self) -> int:
        """The peak the model predicts for the micro-batch chosen last (0 before any was measured)."""
        return self.model.predicted_peak(self.micro_chosen, self.size) if self.micro_chosen else 0

