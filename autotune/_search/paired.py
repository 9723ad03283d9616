"""Compare two plans by paired runs: A B, then B A, and so on, back to back, judged by each round's ratio.

Two throughputs measured minutes apart on a shared host compare the host's moments as much as the plans (one plan
read 573, 121 and 31 samples/s within an hour as other work came and went). A round runs both plans one after the
other, so both meet nearly the same neighbours, and the order alternates from round to round, so a load that rises
or falls through a round favours neither. Each round gives one ratio, the challenger's samples/s over the
incumbent's; the comparison is the geometric mean of the rounds' ratios with its 95% interval (Student's t on their
logarithms, :func:`autotune._search.stats.ratio_interval`).

Rounds go on from :data:`MIN_ROUNDS` until the interval is clear of 1 (one plan is faster), or within
:data:`PAIR_WITHIN` of its ratio (the two are as fast as that can tell), or :data:`MAX_ROUNDS` were run: a search on a
busy host ends in bounded time, with an honest, wide interval. Each run records the load it ran beside
(:mod:`autotune._device.load`); a round whose two runs met unlike loads (a neighbour came or went between them) is
run again, up to :data:`RERUN_ROUNDS` times in a comparison. Every run is kept as one more measurement of its plan
(``choose.add_remeasured``), and the comparison as a study attribute (:data:`PAIRED`), which a rerun of the search,
or another worker choosing at the same time, reuses instead of comparing the same two plans again.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autotune._device.load import busy, load_differs
from autotune._search.stats import ratio_interval

__all__ = ["MAX_ROUNDS", "MIN_ROUNDS", "PAIRED", "PAIR_WITHIN", "RERUN_ROUNDS", "Ratio", "compare", "compare_plans",
           "paired_rounds", "stored_ratio"]

#: Rounds a comparison takes at least (one round's ratio has no interval).
MIN_ROUNDS = 2
#: Rounds a comparison takes at most.
MAX_ROUNDS = 4
#: A comparison ends once its interval is within this share of its ratio, either side.
PAIR_WITHIN = 0.03
#: Rounds run again at most in a comparison, for runs that met unlike loads.
RERUN_ROUNDS = 2
#: Each comparison is a study user attribute ``paired:<incumbent>:<challenger>:<when>-<id>`` (trial numbers).
PAIRED = "paired"


@dataclass(frozen=True)
class Ratio:
    """A paired comparison: the challenger's samples/s over the incumbent's, round by round.

    ``ratio`` is the geometric mean of ``rounds`` with its 95% interval ``[low, high]``; ``busy_rounds`` how many
    rounds ran beside a busy host, ``rerun_rounds`` how many were run again for unlike loads; ``stopped`` why the
    comparison ended before a verdict ("" when it did not), naming the plan whose run failed or did not fit.

    Example:
        >>> r = Ratio(incumbent=0, challenger=3, ratio=0.9, low=0.86, high=0.94, rounds=(0.89, 0.91))
        >>> r.describe(), r.faster(), r.slower()
        ('0.90x [0.86, 0.94] over 2 rounds', False, True)
    """

    incumbent: int
    challenger: int
    ratio: float
    low: float
    high: float
    rounds: tuple[float, ...]
    busy_rounds: int = 0
    rerun_rounds: int = 0
    stopped: str = ""

    def faster(self) -> bool:
        """Whether the challenger is faster beyond the comparison's noise."""
        return self.low > 1.0

    def slower(self) -> bool:
        """Whether the challenger is slower beyond the comparison's noise."""
        return self.high < 1.0

    def scaled(self, factor: float) -> Ratio:
        """The comparison with its ratio and interval times ``factor`` (what the budget's edge takes off a plan)."""
        from dataclasses import replace

        return replace(self, ratio=self.ratio * factor, low=self.low * factor, high=self.high * factor)

    def as_attrs(self) -> dict[str, Any]:
        return {"incumbent": self.incumbent, "challenger": self.challenger, "ratio": self.ratio,
                "interval": [self.low, self.high if math.isfinite(self.high) else None], "rounds": list(self.rounds),
                "busy_rounds": self.busy_rounds, "rerun_rounds": self.rerun_rounds, "stopped": self.stopped}

    @classmethod
    def from_attrs(cls, attrs: dict[str, Any]) -> Ratio:
        low, high = attrs["interval"]
        return cls(incumbent=int(attrs["incumbent"]), challenger=int(attrs["challenger"]), ratio=float(attrs["ratio"]),
                   low=float(low), high=math.inf if high is None else float(high),
                   rounds=tuple(float(r) for r in attrs["rounds"]), busy_rounds=int(attrs.get("busy_rounds", 0)),
                   rerun_rounds=int(attrs.get("rerun_rounds", 0)), stopped=str(attrs.get("stopped", "")))

    def inverse(self) -> Ratio:
        """The same comparison seen from the other side (incumbent and challenger swapped)."""
        return Ratio(incumbent=self.challenger, challenger=self.incumbent, ratio=1 / self.ratio,
                     low=1 / self.high if self.high > 0 else 0.0, high=1 / self.low if self.low > 0 else math.inf,
                     rounds=tuple(1 / r for r in self.rounds), busy_rounds=self.busy_rounds,
                     rerun_rounds=self.rerun_rounds, stopped=self.stopped)

    def describe(self) -> str:
        """``"0.90x [0.86, 0.94] over 3 rounds (1 beside a busy host)"``."""
        high = f"{self.high:.2f}" if math.isfinite(self.high) else "inf"
        rounds = len(self.rounds)
        text = f"{self.ratio:.2f}x [{self.low:.2f}, {high}] over {rounds} round{'s' if rounds != 1 else ''}"
        if self.busy_rounds:
            text += f" ({self.busy_rounds} beside a busy host)"
        return text


def stored_ratio(study: Any, incumbent: int, challenger: int) -> Ratio | None:
    """The comparison of the two trials' plans the study holds (made either way round), from the incumbent's side;
    the latest where there are several."""
    found = None
    for key in sorted(k for k in study.user_attrs if k.startswith(PAIRED + ":")):
        _, a, b, _ = key.split(":", 3)
        if {int(a), int(b)} == {incumbent, challenger}:
            ratio = Ratio.from_attrs(study.user_attrs[key])
            found = ratio if ratio.incumbent == incumbent else ratio.inverse()
    return found


def compare(study: Any, incumbent: Any, challenger: Any, remeasure: Callable[[Any], dict[str, Any]], *,
            fits: Callable[[dict[str, Any]], bool], keep: Callable[[Any, int, dict[str, Any]], None]) -> Ratio:
    """Compare the plans of trials ``incumbent`` and ``challenger`` in paired rounds (see the module's notes), or
    return the comparison the study holds already. ``remeasure(trial)`` runs a trial's plan once more and returns
    its run (status, samples/s, peak, load); ``fits(run)`` says whether a run stayed within the budget; ``keep(study,
    trial number, run)`` stores a run as one more measurement of its plan. A run that fails or does not fit ends the
    comparison (``Ratio.stopped`` names it); its run is kept, so the plan's figure says so too. Before each round
    the study is read again: a comparison of the same two plans another worker stored meanwhile ends this one."""
    known = stored_ratio(study, incumbent.number, challenger.number)
    if known is not None:
        return known

    def run(trial: Any) -> dict[str, Any]:
        result = remeasure(trial)
        keep(study, trial.number, result)
        return result

    found = paired_rounds(lambda: run(incumbent), lambda: run(challenger), fits=fits,
                          stop=lambda: stored_ratio(study, incumbent.number, challenger.number))
    if isinstance(found, Ratio) and found.incumbent == -1:  # this worker's own comparison
        from dataclasses import replace

        found = replace(found, incumbent=incumbent.number, challenger=challenger.number)
        study.set_user_attr(f"{PAIRED}:{incumbent.number}:{challenger.number}:{time.time_ns():020d}-"
                            f"{uuid.uuid4().hex[:8]}", found.as_attrs())
    return found


def paired_rounds(run_a: Callable[[], dict[str, Any]], run_b: Callable[[], dict[str, Any]], *,
                  fits: Callable[[dict[str, Any]], bool] = lambda run: True,
                  stop: Callable[[], Ratio | None] = lambda: None) -> Ratio:
    """Rounds of ``run_a()`` and ``run_b()`` back to back in alternating order (A B, B A, ...) until the ratio of B's
    samples/s over A's is known (see the module's notes); each run returns its record (status, samples/s, load).
    ``stop()``, asked before each round, may return a comparison made elsewhere that ends this one. The result's
    ``incumbent`` and ``challenger`` are -1 and -2 (no trials): the caller names them."""
    ratios: list[float] = []
    busy_rounds = rerun = 0
    stopped = ""
    while len(ratios) < MAX_ROUNDS:
        known = stop()
        if known is not None:  # made by another worker choosing at the same time: this one's runs are kept
            return known
        order = ((0, run_a), (1, run_b)) if (len(ratios) + rerun) % 2 == 0 else ((1, run_b), (0, run_a))
        runs: dict[int, dict[str, Any]] = {}
        for side, run in order:
            record = run()
            runs[side] = record
            if record.get("status") != "ok" or not record.get("samples_per_second") or not fits(record):
                role = "incumbent" if side == 0 else "challenger"
                why = "did not fit the budget" if record.get("status") == "ok" else f"ended {record.get('status')}"
                stopped = f"the {role}'s run {why}"
                break
        if stopped:
            break
        first, second = runs[0], runs[1]
        if load_differs(first.get("load"), second.get("load")) and rerun < RERUN_ROUNDS:
            rerun += 1  # a neighbour came or went between the two runs: this round compares the host, not the plans
            continue
        busy_rounds += busy(first.get("load")) or busy(second.get("load"))
        ratios.append(second["samples_per_second"] / first["samples_per_second"])
        if len(ratios) >= MIN_ROUNDS:
            _, low, high = ratio_interval(ratios)
            if low > 1 or high < 1 or high / low <= (1 + PAIR_WITHIN) ** 2:
                break
    ratio, low, high = ratio_interval(ratios) if ratios else (1.0, 0.0, math.inf)
    return Ratio(incumbent=-1, challenger=-2, ratio=ratio, low=low, high=high, rounds=tuple(ratios),
                 busy_rounds=busy_rounds, rerun_rounds=rerun, stopped=stopped)


def compare_plans(*, target: str, a: Any, b: Any, budget: str | int | float | None = None, config: str | None = None,
                  device: str | None = None, devices: int = 1, steps: int = 10, warmup: int = 2,
                  timeout: float = 600.0) -> tuple[Ratio, list[Any], list[Any]]:
    """Measure plans ``a`` and ``b`` of ``target`` in paired rounds, as a search compares its leader with a rival:
    each run a fresh process (:func:`autotune.measure_plan`, at most ``steps`` timed steps), A B, then B A, and so
    on, until the ratio of B's samples/s over A's is clear of 1, within 3%, or 4 rounds ran (a round whose runs met
    unlike loads run again, up to twice). Returns the comparison and each plan's runs.

    Example:
        >>> from autotune import Plan, compare_plans
        >>> ratio, runs_a, runs_b = compare_plans(target="examples/gpt/train.py:make",  # doctest: +SKIP
        ...                                       a=Plan(micro_batch_size=32),
        ...                                       b=Plan(micro_batch_size=32, activation_checkpointing=1.0))
        >>> ratio.describe()  # doctest: +SKIP
        '0.78x [0.74, 0.82] over 2 rounds'
    """
    from autotune._search.trial import measure_plan

    runs: dict[str, list[Any]] = {"a": [], "b": []}

    def run(side: str, plan: Any) -> Callable[[], dict[str, Any]]:
        def once() -> dict[str, Any]:
            result = measure_plan(target=target, plan=plan, budget=budget, config=config, device=device,
                                  devices=devices, steps=steps, warmup=warmup, timeout=timeout)
            runs[side].append(result)
            return result.as_attrs()

        return once

    return paired_rounds(run("a", a), run("b", b)), runs["a"], runs["b"]
