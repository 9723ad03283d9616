"""``autotune report``: a table of a study's trials and PNG plots made offline (matplotlib, Agg backend).

optuna-dashboard reads the same storage (``optuna-dashboard sqlite:///autotune.db``); note that it shows the
memory constraint as a plain attribute and may rank infeasible trials as best.
"""

from __future__ import annotations

import statistics

from pathlib import Path
from typing import Any

from autotune._device.budget import format_bytes
from autotune._device.load import busy
from autotune._search.figures import chosen, over_budget_by, remeasured_runs, run_peak
from autotune._search.edge import overflow_chance
from autotune._search.stopping import STOPPED_BY_TARGET
from autotune._search.storage import open_storage


def load_study(*, storage: str | None, study: str | None) -> Any:
    """Open a study of a search; with one study in the storage its name may be left out.

    Raises:
        ValueError: when the study does not exist, naming the studies that do.
    """
    import optuna

    stor = open_storage(storage, read_only=True)
    names = [s.study_name for s in optuna.get_all_study_summaries(stor, include_best_trial=False)]
    if study is None:
        if len(names) != 1:
            raise ValueError(f"give --study: the storage holds {len(names)} studies ({', '.join(names) or 'none'})")
        study = names[0]
    if study not in names:
        raise ValueError(f"no study '{study}' in the storage; studies there: {', '.join(names) or 'none'}")
    return optuna.load_study(study_name=study, storage=stor)


def _rows(study: Any) -> list[dict[str, Any]]:
    budget = study.user_attrs.get("budget_bytes")
    choice = chosen(study) or {}
    again = remeasured_runs(study)
    rows = []
    for t in study.get_trials(deepcopy=False):
        attrs = t.user_attrs
        peak = attrs.get("peak_bytes")
        projected, noise = run_peak(attrs)
        fits = None if peak is None or budget is None else (
            over_budget_by(projected, noise, budget) <= 0 and attrs.get("status") in ("ok", "pruned"))
        rows.append({
            "trial": t.number, "state": t.state.name.lower(), "status": attrs.get("status", ""),
            "plan": attrs.get("plan", str(t.params)), "samples_per_second": attrs.get("samples_per_second"),
            "interval": attrs.get("interval"), "peak_bytes": peak, "fits": fits, "source": attrs.get("source", ""),
            "edge": bool(fits) and overflow_chance(projected, noise, budget) > 0,
            "run_peak_bytes": projected if peak is not None else None, "busy": busy(attrs.get("load")),
            "reason": attrs.get("reason") or ("interrupted (Ctrl-C or a lost worker); a resumed search runs it again"
                                              if attrs.get("status") == "interrupted" else ""),
            "chosen": choice.get("trial") == t.number,
            "predicted_peak_bytes": attrs.get("predicted_peak_bytes"), "estimate_method": attrs.get("estimate_method"),
            "allocated_peak_bytes": attrs.get("allocated_peak_bytes"), "context_bytes": attrs.get("context_bytes"),
            "predicted_tensor_bytes": attrs.get("predicted_tensor_bytes"),
            "remeasured": [r.get("samples_per_second") or 0.0 for r in again.get(str(t.number), [])],
        })
    return rows


def _half(interval: Any, rate: float | None) -> str:
    return f"+-{(interval[1] - interval[0]) / 2 / rate:.1%}" if interval and rate else "-"


#: How a trial's predicted peak was traced, where not without data (``Estimate.method``): a mark in the table.
_METHOD_MARK = {"real": " r", "extrapolated": " x"}
_METHOD_LEGEND = {"real": "traced with real tensors on the host (the step reads tensor values)",
                  "extrapolated": "on the line through two such traces at smaller micro-batches"}


def trial_table(study: Any) -> str:
    """A plain-text table of every trial: plan, throughput with its interval, peak, whether it fits, and why not;
    the chosen plan marked ``*`` with the figures that chose it (the mean of all its runs)."""
    budget = study.user_attrs.get("budget", "?")
    lines = [f"study '{study.study_name}': target {study.user_attrs.get('target', '?')}, budget {budget}, "
             f"space {study.user_attrs.get('space', '?')}"]
    rows = _rows(study)
    cuda = any(r["allocated_peak_bytes"] is not None for r in rows)  # the peak's parts, where a trial measured them
    header = (f"{'#':>5}  {'state':<8} {'samples/s':>10} {'95% int.':>9} {'peak':>11} {'predicted':>13} "
              + (f"{'tensors':>11} {'est. tensors':>12} " if cuda else "") + f"{'fits':<4}  plan / reason")
    lines += [header, "-" * len(header)]
    for r in rows:
        sps = f"{r['samples_per_second']:.1f}" if r["samples_per_second"] else "-"
        peak = format_bytes(r["peak_bytes"]) if r["peak_bytes"] else "-"
        predicted = "-" if r["predicted_peak_bytes"] is None else (
            format_bytes(r["predicted_peak_bytes"]) + _METHOD_MARK.get(r["estimate_method"], ""))
        fits = "edge" if r["edge"] else {True: "yes", False: "no", None: "-"}[r["fits"]]
        why = f"  [{r['source']}: {r['reason']}]" if r["reason"] else (f"  [{r['source']}]" if r["source"] else "")
        again = f"  (measured again: {', '.join(f'{x:.1f}' for x in r['remeasured'])})" if r["remeasured"] else ""
        mark = "*" if r["chosen"] else " "
        half = _half(r["interval"], r["samples_per_second"]) + ("!" if r["busy"] else " ")
        tensors = "" if not cuda else " ".join(
            f"{'-' if r[k] is None else format_bytes(r[k]):>{w}}"
            for k, w in (("allocated_peak_bytes", 11), ("predicted_tensor_bytes", 12))) + " "
        lines.append(f"{mark}{r['trial']:>4}  {r['state']:<8} {sps:>10} {half:>8} {peak:>11} {predicted:>13} "
                     f"{tensors}{fits:<4}  {r['plan']}{why}{again}")
    if cuda:
        contexts = [r["context_bytes"] for r in rows if r["context_bytes"] is not None]
        context = "not measured: NVML does not list the process"
        if contexts:
            low, high = format_bytes(min(contexts)), format_bytes(max(contexts))
            context = low if low == high else f"{low}-{high}"
        lines.append(f"peak: the allocator's peak reserve plus the CUDA context ({context}); predicted: the "
                     "estimator's tensors plus the context estimate and its plan shape's gap measured by earlier "
                     "trials; tensors: the trial's peak of bytes allocated, est. tensors: the estimator's")
    if any(r["busy"] for r in rows):
        lines.append("'!' after the interval: timed beside a busy host (other processes kept a quarter of its cores or "
                     "more busy); the choice compares plans in paired runs, not by these figures alone")
    if any(r["edge"] for r in rows):
        lines.append("fits 'edge': its peak's noise reaches the budget; ranked by the samples/s a run can be expected "
                     "to give, counting the runtime's fallback to half the micro-batch when it overflows")
    marks = sorted({r["estimate_method"] for r in rows} & _METHOD_MARK.keys())
    if marks:
        lines.append("predicted: " + "; ".join(f"'{_METHOD_MARK[m].strip()}' {_METHOD_LEGEND[m]}" for m in marks))
    lines += _model_lines(study)
    stopped = study.user_attrs.get(STOPPED_BY_TARGET)
    if stopped:
        lines += ["the search stopped: the target's own code failed:", *(f"  {line.strip()}" for line in stopped)]
    choice = chosen(study)
    if choice:
        low, high = choice["interval"]
        runs = len(choice["runs"])
        lines.append(f"* chosen: trial {choice['trial']}, {choice['plan']}: "
                     f"{choice['samples_per_second']:.1f} samples/s "
                     f"(mean of {runs} run{'s' if runs > 1 else ''}, interval [{low:.1f}, {high:.1f}]), peak "
                     f"{format_bytes(choice['peak_bytes'])}")
        lines += chosen_lines(choice) + micro_batch_lines(study, choice)
    return "\n".join(lines)


def micro_batch_lines(study: Any, choice: dict[str, Any]) -> list[str]:
    """Why the chosen plan's micro-batch is the one its tuned file runs at (its ``ElasticBatchSize`` does not grow past
    it): how the larger micro-batches of the same plan fared, where any was tried."""
    from optuna.trial import TrialState

    if not choice:
        return []
    best = study.trials[choice["trial"]]
    micro, batch = best.user_attrs.get("micro_batch_size"), study.user_attrs.get("batch_size")
    if not micro or not batch or micro >= batch:
        return []  # the whole batch: nothing larger to grow to
    rest = {k: v for k, v in best.params.items() if k != "micro_batch_size"}
    fared = {}
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
        larger, attrs = t.user_attrs.get("micro_batch_size"), t.user_attrs
        if not larger or larger <= micro or larger in fared or attrs.get("source") == "cache" \
                or {k: v for k, v in t.params.items() if k != "micro_batch_size"} != rest:
            continue
        if attrs.get("status") == "oom" or (attrs.get("peak_bytes") or 0) > study.user_attrs.get("budget_bytes", 1e30):
            fared[larger] = f"micro {larger} did not fit (trial {t.number})"
        elif attrs.get("samples_per_second"):
            ratio = attrs["samples_per_second"] / choice["samples_per_second"] - 1
            fared[larger] = f"micro {larger} measured {abs(ratio):.0%} {'slower' if ratio < 0 else 'faster'} " \
                            f"(trial {t.number})"
    why = "; ".join(fared[m] for m in sorted(fared)) or "no larger micro-batch of this plan was measured"
    return [f"  runs at micro {micro} (its tuned file's ElasticBatchSize: grow false): {why}; grow: true lets it try "
            "larger ones when memory allows"]


def chosen_lines(choice: dict[str, Any]) -> list[str]:
    """What the search and the report say of a choice besides its figures: a faster-measured plan it was chosen over
    for doing less work, the expected samples/s of a plan on the budget's edge, the plans within noise of it."""
    lines = []
    over = choice.get("simpler_than")
    if over:
        low, high = over["interval"]
        why = ("as fast within measurement noise" if not choice.get("paired")
               else "by the paired comparisons below")
        lines.append(f"  chosen over {over['plan']} ({over['expected_samples_per_second']:.1f}/s expected, interval "
                     f"[{low:.1f}, {high:.1f}]): {why}, and that plan adds work ({', '.join(over['adds']) or 'more'})")
    if choice.get("overflow_chance") and choice.get("fallback_samples_per_second") is not None:
        lines.append(f"  on the budget's edge: a run overflows with chance {choice['overflow_chance']:.2f}; expected "
                     f"{choice['expected_samples_per_second']:.1f}/s with the fallback to half the micro-batch "
                     f"({choice['fallback_samples_per_second']:.1f}/s) after it")
    for v in choice.get("paired") or []:
        lines.append(f"  paired: {v['against']} ({v['why']}) ran at {_ratio_text(v, v.get('incumbent_plan', '?'))}; "
                     f"{v['verdict']}" + (f" ({v['stopped']})" if v.get("stopped") else ""))
    if choice.get("within_noise_of"):
        lines.append(f"  within measurement noise of: {'; '.join(choice['within_noise_of'])}")
    return lines


def _ratio_text(v: dict[str, Any], incumbent: str) -> str:
    """A paired comparison's record as ``"1.30x [1.26, 1.34] the samples/s of PLAN over 2 paired rounds"``."""
    from autotune._search.paired import Ratio

    ratio = Ratio.from_attrs(v)
    extra = []
    if ratio.busy_rounds:
        extra.append(f"{ratio.busy_rounds} beside a busy host")
    if ratio.rerun_rounds:
        extra.append(f"{ratio.rerun_rounds} run again: a neighbour came or went between its runs")
    high = f"{ratio.high:.2f}" if ratio.high != float("inf") else "inf"
    rounds = len(ratio.rounds)
    return (f"{ratio.ratio:.2f}x [{ratio.low:.2f}, {high}] the samples/s of {incumbent} over {rounds} paired round"
            f"{'s' if rounds != 1 else ''}" + (f" ({'; '.join(extra)})" if extra else ""))


def _model_lines(study: Any) -> list[str]:
    """How far the step-time model's predictions (each made before its trial ran, with the trials before it) were
    from the measured trials, and whether it stopped the search."""
    misses = [abs(t.user_attrs["predicted_samples_per_second"] - t.user_attrs["samples_per_second"])
              / t.user_attrs["samples_per_second"] for t in study.get_trials(deepcopy=False)
              if t.user_attrs.get("source") == "measured" and t.user_attrs.get("status") == "ok"
              and t.user_attrs.get("samples_per_second") and t.user_attrs.get("predicted_samples_per_second")]
    lines = []
    if misses:
        lines.append(f"step-time model: each measured trial predicted before it ran, off by {min(misses):.0%} to "
                     f"{max(misses):.0%} (median {statistics.median(misses):.0%}) over {len(misses)} trials")
    stopped = study.user_attrs.get("stopped_by_model")
    if stopped:
        lines.append(f"the search stopped early: no plan left unmeasured was predicted to beat "
                     f"{stopped['best_samples_per_second']:.1f} samples/s by the model's error")
    return lines


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both axes (higher throughput, lower peak), by peak.

    Example:
        >>> pareto_front([(10.0, 5.0), (8.0, 6.0), (12.0, 7.0)])
        [0, 2]
    """
    front = [i for i, (s, m) in enumerate(points)
             if not any((s2 >= s and m2 <= m) and (s2, m2) != (s, m) for s2, m2 in points)]
    return sorted(front, key=lambda i: points[i][1])


def write_plots(study: Any, out: str | Path) -> list[Path]:
    """Write ``tradeoff.png`` (throughput vs peak, budget line, Pareto front), ``history.png`` and, with enough
    completed trials, ``importance.png`` into ``out``.

    Raises:
        ValueError: when ``out`` cannot be created, or matplotlib is missing
            (``pip install lightning-autotune[report]``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("the report's plots need matplotlib: pip install 'lightning-autotune[report]'") from None
    folder = Path(out)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"cannot create the report folder '{folder}': {err.strerror or err}") from None
    written = []
    rows = [r for r in _rows(study) if r["samples_per_second"] and r["peak_bytes"]]
    budget = study.user_attrs.get("budget_bytes")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    gib = 2**30
    for fits, colour, label in ((True, "tab:green", "fits"), (False, "tab:red", "over budget")):
        pts = [r for r in rows if bool(r["fits"]) is fits]
        ax.scatter([r["peak_bytes"] / gib for r in pts], [r["samples_per_second"] for r in pts], c=colour,
                   label=label, alpha=0.7)
    points = [(r["samples_per_second"], r["peak_bytes"]) for r in rows]
    front = [rows[i] for i in pareto_front(points)]
    if front:
        ax.plot([r["peak_bytes"] / gib for r in front], [r["samples_per_second"] for r in front], "k--",
                label="Pareto front")
    if budget:
        ax.axvline(budget / gib, color="tab:orange", label=f"budget {study.user_attrs.get('budget', '')}")
    choice = chosen(study)
    if choice:
        low, high = choice["interval"]
        rate = choice["samples_per_second"]
        ax.errorbar([choice["peak_bytes"] / gib], [rate], yerr=[[rate - low], [high - rate]], fmt="*", ms=14,
                    color="tab:blue", label=f"chosen (trial {choice['trial']}, {len(choice['runs'])} runs)")
    ax.set_xlabel("peak memory (GiB)")
    ax.set_ylabel("throughput (samples/s)")
    ax.set_title(f"{study.study_name}: throughput vs memory")
    ax.legend()
    fig.tight_layout()
    written.append(_save(fig, folder / "tradeoff.png", plt))

    from optuna.trial import TrialState
    from optuna.visualization import matplotlib as ovm

    completed = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if rows:
        written.append(_save(_history(study, rows, plt), folder / "history.png", plt))
    varied = {k for t in completed for k in t.params if len({str(o.params.get(k)) for o in completed}) > 1}
    if len(completed) >= 4 and varied:
        import warnings

        from optuna.exceptions import ExperimentalWarning

        with warnings.catch_warnings():  # Optuna marks its matplotlib plots experimental: not the user's concern
            warnings.simplefilter("ignore", ExperimentalWarning)
            ax = ovm.plot_param_importances(study)
        written.append(_save(ax.figure, folder / "importance.png", plt))
    return written


def _history(study: Any, rows: list[dict[str, Any]], plt: Any) -> Any:
    """Each trial's samples/s with its interval, in trial order, fitting or not; the chosen plan's figure (the mean
    of its runs) as a star. Optuna's own history plot would call the trial with the largest single value best."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for fits, colour, label in ((True, "tab:green", "fits"), (False, "tab:red", "over budget or stopped early")):
        pts = [r for r in rows if (bool(r["fits"]) and r["status"] == "ok") is fits]
        ax.errorbar([r["trial"] for r in pts], [r["samples_per_second"] for r in pts],
                    yerr=[[r["samples_per_second"] - r["interval"][0] if r["interval"] else 0 for r in pts],
                          [r["interval"][1] - r["samples_per_second"] if r["interval"] else 0 for r in pts]],
                    fmt="o", color=colour, alpha=0.7, label=label)
    choice = chosen(study)
    if choice:
        low, high = choice["interval"]
        rate = choice["samples_per_second"]
        ax.errorbar([choice["trial"]], [rate], yerr=[[rate - low], [high - rate]], fmt="*", ms=14, color="tab:blue",
                    label=f"chosen: {choice['plan']} ({len(choice['runs'])} runs)")
    ax.set_xlabel("trial")
    ax.set_ylabel("throughput (samples/s)")
    ax.set_title(f"{study.study_name}: trials")
    ax.legend()
    fig.tight_layout()
    return fig


def _save(fig: Any, path: Path, plt: Any) -> Path:
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
