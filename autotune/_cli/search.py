"""``autotune search`` and ``autotune report``: parser builders and actions (printing lives here, not in the library)."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from typing import Any

from autotune._device.budget import format_bytes

_EXIT_OK = 0
_EXIT_NO_PLAN = 1


def build_search(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", help="path/to/file.py:factory, package.module:factory, or a LightningCLI config")
    parser.add_argument("--budget", required=True, help="memory budget: 20GiB, 512MiB, bytes, 0.8 (of total), auto")
    parser.add_argument("--config", default=None, help="a LightningCLI config with the rest of a factory target")
    parser.add_argument("--space", default=None, help="default, cpu, multi_gpu, or a .yaml path (default: by device)")
    parser.add_argument("--trials", type=int, default=30, help="finished trials the study should have (default 30)")
    parser.add_argument("--timeout", type=float, default=None, help="stop starting trials after SECONDS")
    parser.add_argument("--storage", default=None, help="sqlite:///PATH (default sqlite:///autotune.db), "
                        "journal:PATH, or postgresql://USER:PASSWORD@HOST/DB")
    parser.add_argument("--study", default=None,
                        help="study name (default: derived from target, budget, space and device)")
    parser.add_argument("--out", default="tuned.yaml", help="where to write the best plan (default tuned.yaml)")
    parser.add_argument("--seed", type=int, default=None, help="sampler seed")
    parser.add_argument("--steps", type=int, default=20, help="timed optimizer steps per trial at most (default 20)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed optimizer steps per trial at least; more while step time settles (default 2)")
    parser.add_argument("--interval", type=_share, default=0.03,
                        help="a trial stops timing once its 95%% interval is within +- this share (default 0.03)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:N or N (default: cuda when there is one)")
    parser.add_argument("--devices", type=int, default=1, help="devices (ranks) per trial, for multi-device spaces: DDP, FSDP2 (default 1)")
    parser.add_argument("--no-progress", action="store_true", help="no live progress display")


def run_search(args: argparse.Namespace) -> int:
    from autotune._device.budget import Budget

    budget = Budget.parse(args.budget)  # a bad budget fails before torch, Lightning and Optuna are imported
    from autotune._search.search import NoFeasiblePlanError, search

    progress = None if args.no_progress else _Progress(args.trials)
    command = "autotune search " + " ".join(shlex.quote(a) for a in sys.argv[2:]) if sys.argv[1:2] == ["search"] \
        else f"autotune search {args.target} --budget {args.budget}"
    try:
        result = search(
            target=args.target, budget=budget, config=args.config, space=args.space, trials=args.trials,
            timeout=args.timeout, storage=args.storage, study=args.study, out=args.out, seed=args.seed,
            steps=args.steps, warmup=args.warmup, interval=args.interval, device=args.device,
            devices=args.devices, callbacks=[progress] if progress else [], command=command,
        )
        if progress and result.figure:
            progress.chosen(result.figure)
    except NoFeasiblePlanError as err:
        print(f"autotune: {err}", file=sys.stderr)
        return _EXIT_NO_PLAN
    finally:
        if progress:
            progress.close()
    plan, prov = result.plan, result.plan.provenance
    for note in result.notes:
        print(f"note: {note}")
    peak = format_bytes(prov.peak_bytes) if prov.peak_bytes else "?"
    print(f"best plan (trial {result.trial_number} of study '{result.study.study_name}'): {plan.describe()}")
    figure = result.figure
    chose = f"{figure.describe()}, 95% interval [{figure.low:.1f}, {figure.high:.1f}]" if figure else \
        f"{prov.samples_per_second:.1f}/s"
    print(f"  {chose}, peak {peak} of budget {prov.budget}")
    from autotune._search.report import chosen_lines, micro_batch_lines

    choice = result.study.user_attrs.get("chosen") or {}
    for line in chosen_lines(choice) + micro_batch_lines(result.study, choice):
        print(line)
    print(f"wrote {args.out}: python train.py fit --config your_config.yaml --config {args.out}")
    return _EXIT_OK


def _share(text: str) -> float:
    """An argparse type: a number strictly between 0 and 1."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be a number between 0 and 1 (0.03: +-3%); got {text!r}")
    return value


class _Progress:
    """A rich progress display as an Optuna callback: trial n of N, last plan, best so far, feasible count, ETA."""

    def __init__(self, total: int, console: Any = None) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
        from rich.table import Column

        # the counter, bar and time keep their width; the description takes the rest, cut with an ellipsis
        fixed = {"no_wrap": True, "overflow": "crop"}
        self.progress = Progress(
            TextColumn("trial", table_column=Column(**fixed, min_width=5)),
            MofNCompleteColumn(table_column=Column(**fixed, min_width=2 * len(str(total)) + 1)),
            BarColumn(bar_width=10), TimeRemainingColumn(),
            TextColumn("{task.description}", table_column=Column(no_wrap=True, overflow="ellipsis", ratio=1)),
            console=console or Console(stderr=True), transient=False, expand=True)
        self.task = self.progress.add_task("starting", total=total)
        self.total = total
        self.started = False  # shown from the first finished trial on, so that input errors print alone

    def __call__(self, study: Any, trial: Any) -> None:
        from optuna.trial import TrialState

        if not self.started:
            self.progress.start()
            self.started = True
        from autotune._search.choose import figures

        finished = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
        ranked = figures(study, study.user_attrs.get("budget_bytes", 0))  # what the search itself ranks by
        best_text = f"best {ranked[0].samples_per_second:.1f}/s ({ranked[0].plan})" if ranked else \
            "no feasible plan yet"
        last = f"{trial.user_attrs.get('plan', '?')}: {trial.user_attrs.get('status', trial.state.name.lower())}"
        self.progress.update(self.task, completed=min(len(finished), self.total),
                             description=f"{len(ranked)} fit | {best_text} | last {last}")

    def chosen(self, figure: Any) -> None:
        """The last line: the plan the search chose, after its re-measurements."""
        self.progress.update(self.task, description=f"chosen {figure.samples_per_second:.1f}/s ({figure.plan})")

    def close(self) -> None:
        if self.started:
            self.progress.stop()


def build_report(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--storage", default=None, help="the search's storage URL (default sqlite:///autotune.db)")
    parser.add_argument("--study", default=None, help="study name (default: the only study in the storage)")
    parser.add_argument("--out", default=None, help="folder for PNG plots (default: print the table only)")


def run_report(args: argparse.Namespace) -> int:
    import importlib.util

    if args.out and importlib.util.find_spec("matplotlib") is None:  # before anything is printed
        raise ValueError("the report's plots (--out) need matplotlib: pip install 'lightning-autotune[report]'")
    if args.out and os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ValueError(f"--out '{args.out}' is a file; the report writes its plots into a folder")
    from autotune._plan.space import quiet_list_choices
    from autotune._search.report import load_study, trial_table, write_plots

    with quiet_list_choices():  # a study whose choices are lists of block class names
        study = load_study(storage=args.storage, study=args.study)
        print(trial_table(study))
        if args.out:
            for path in write_plots(study, args.out):
                print(f"wrote {path}")
    return _EXIT_OK
