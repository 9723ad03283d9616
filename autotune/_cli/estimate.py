"""``autotune estimate``: the predicted peak of each plan against a budget, ranked by predicted speed, or the fewest
devices a model needs (``--max-world-size``)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from autotune._cli import speed as _cli_speed
from autotune._cli.options import int_option as _int_option
from autotune._cli.options import size_option as _size_option
from autotune._device.budget import format_bytes

_EXIT_OK = 0


def build_estimate(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", nargs="?", default=None, metavar="TARGET",
                        help="path/to/file.py:factory, package.module:factory, or a LightningCLI config")
    parser.add_argument("--budget", default=None,
                        help="memory budget per rank: 20GiB, 512MiB, bytes, 0.8 (of total), auto (default with "
                        "--device-memory: the device's memory less the CUDA context)")
    parser.add_argument("--config", default=None, help="a LightningCLI config with the rest of a factory target")
    parser.add_argument("--plan", nargs="+", action="extend", default=[], metavar="TUNED",
                        help="tuned .yaml files whose plans to estimate")
    parser.add_argument("--precision", nargs="+", action="extend", default=[], metavar="P",
                        help="precisions to estimate, each with and without checkpointing, and with --world-size N > 1 "
                        "each replicated (ddp) and sharded (fsdp) (default without --plan: 32-true and bf16-mixed)")
    parser.add_argument("--auto-checkpointing", action="store_true",
                        help="also a row per precision with activation_checkpointing: auto (what each block recomputes "
                        "chosen for the row's micro-batch and the budget; each block's memory saved and time paid "
                        "are printed)")
    parser.add_argument("--optimizer-state", nargs="+", action="extend", default=[], metavar="S",
                        help="optimizer states of the default rows: full, 8bit, 4bit (default: full)")
    parser.add_argument("--micro-batch-size", default=None, metavar="N",
                        help="micro-batch of every row (default: the plan's, else the whole batch)")
    parser.add_argument("--seq-len", default=None, metavar="L",
                        help="estimate the target's batch padded or cut to this sequence length (its token ids, masks "
                        "and labels; default: the batch's own): for batches whose length varies")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:N or N (default: cuda when there is one); "
                        "cuda without CUDA on this machine estimates what-if, with CUDA's rules")
    _cli_speed.add_device_type(parser)
    parser.add_argument("--device-memory", default=None, metavar="SIZE",
                        help="the memory of each device (80GiB; default with --device-type: the table's): for a "
                        "device this machine does not have, and for --max-world-size")
    parser.add_argument("--max-world-size", default=None, metavar="N",
                        help="capacity mode: the smallest number of devices (1, 2, 4, ... up to N) and the plan that "
                        "fits the model, with its largest micro-batch")
    parser.add_argument("--world-size", default=None, metavar="N",
                        help="ranks the plans run on: each row is one rank's peak (replicated under ddp, sharded "
                        "under fsdp; default: a plan's devices, else 1)")
    parser.add_argument("--trace", default="auto", choices=_TRACE_CHOICES,
                        help="how each step is traced: auto (without data, and with real tensors on the host where "
                        "that fails: a step that reads tensor values, an op without a fake rule), fake (without data "
                        "only: a failure is an error), real (real tensors on the host at each row's micro-batch, "
                        "however long it takes; default: auto)")
    parser.add_argument("--json", action="store_true", help="print the rows as a JSON list, with bytes as integers")


#: ``--trace``'s choices (``estimate(trace=...)`` also takes "line", a check of the real path's extrapolation).
_TRACE_CHOICES = ("auto", "fake", "real")


def run_estimate(args: argparse.Namespace) -> int:
    from autotune._device.budget import Budget

    # bad input fails before the target is built, and before torch is imported
    device, device_speed, memory = _cli_speed.device_options(
        args.device, args.device_type, _size_option("--device-memory", args.device_memory))
    if args.budget is None and memory is None:
        raise ValueError("give --budget (20GiB, 0.8, auto) or --device-memory (80GiB)")
    budget = Budget.parse(args.budget) if args.budget is not None else None
    micro = _int_option("--micro-batch-size", args.micro_batch_size, "a positive int")
    seq_len = _int_option("--seq-len", args.seq_len, "a positive int")
    world = _int_option("--world-size", args.world_size, "an int >= 1")
    most = _int_option("--max-world-size", args.max_world_size, "an int >= 1")
    if most is not None and memory is None:
        raise ValueError("--max-world-size needs --device-memory, the memory of each device (80GiB)")
    if most is not None and (world is not None or micro is not None or args.plan):
        raise ValueError("--max-world-size chooses the world size, the plan and the micro-batch: drop --world-size, "
                         "--micro-batch-size and --plan")
    if args.target is None and args.config is None:
        raise ValueError("give a TARGET (path/to/file.py:factory, package.module:factory, or a LightningCLI config) "
                         "or --config")
    from autotune._device.budget import resolve_budget
    from autotune._estimate.estimate import default_plans, estimate_device, estimate_target
    from autotune._plan.plan import load_plan
    from autotune._target.failure import target_code
    from autotune._target.target import load_target

    plans = [load_plan(path) for path in args.plan]
    if args.precision or args.optimizer_state or not plans:
        plans += default_plans(precisions=args.precision or None, world_size=world or 1,
                               optimizer_states=args.optimizer_state or ("full",))
    if args.auto_checkpointing:
        plans += [p.replace(activation_checkpointing="auto") for p in plans if p.activation_checkpointing == 1.0]
    resolved, what_if = estimate_device(device)
    resolved_budget = resolve_budget(budget, resolved, what_if=what_if, device_memory=memory)  # text -> bytes, once
    if resolved.type == "cpu" and most is None:  # the baseline's short run: its server imports while the target loads
        from autotune._search.trial import start_trial_server

        start_trial_server()
    target = load_target(args.target, config=args.config)
    if most is not None:
        with target_code(target.spec, traced=True):
            return _run_capacity(args, target=target, device=resolved, what_if=what_if, memory=memory,
                                 usable=resolved_budget.budget_bytes, most=most, seq_len=seq_len)
    baseline, measured = 0, False
    if resolved.type == "cpu":  # the budget is the process's memory: add what a training process holds
        from autotune._search.memory import SearchEstimator

        estimator = SearchEstimator(target=target, device=resolved, trace=args.trace,
                                    unestimated="the process baseline is not measured (this process's memory stands "
                                    "in for it)")
        estimator.measure_baseline(target=args.target or args.config, config=args.config if args.target else None,
                                   budget_bytes=resolved_budget.budget_bytes)
        measured = estimator.calibrated
        # the process grows with the micro-batch: each row's at its own (the two short runs draw the line)
        baseline = estimator.baseline_for if measured else estimator.baseline
    if device_speed is None and not what_if:  # this machine's device, measured once
        from autotune._estimate.local_speed import local_device_speed

        device_speed = local_device_speed(resolved)
    with target_code(target.spec, traced=True):  # its own code failing: where, in a few lines
        rows = estimate_target(target=target, plans=plans, budget=resolved_budget, device=device,
                               micro_batch_size=micro, world_size=world, baseline_bytes=baseline, seq_len=seq_len,
                               trace=args.trace, device_speed=device_speed)
    if measured:  # on CPU, a row within the estimate's error of the budget is settled by a short run of it
        spec = {"target": args.target or args.config, "config": args.config if args.target else None}
        rows = [_settled(row, **spec) if abs(row.peak_bytes - row.budget_bytes) <= SETTLE_BAND * row.budget_bytes
                else row for row in rows]
    rows = _cli_speed.ranked(rows)
    print(json.dumps([row.as_dict() for row in rows], indent=2) if args.json
          else format_estimate_table(rows, baseline_measured=measured,
                                     speed_notes=_cli_speed.speed_notes(rows, device_speed, what_if=what_if)))
    return _EXIT_OK


def _run_capacity(args: argparse.Namespace, *, target: Any, device: Any, what_if: bool, memory: int,
                  usable: int, most: int, seq_len: int | None) -> int:
    from autotune._estimate.capacity import estimate_capacity
    from autotune._estimate.estimate import first_batch
    from autotune._runtime.batch import batch_size_of

    batch = first_batch(target, seq_len=seq_len)
    rows = estimate_capacity(model=target.model, batch=batch, device=device, device_memory_bytes=memory,
                             budget_bytes=usable, max_world_size=most, precisions=args.precision or None,
                             trace=args.trace)
    last = rows[-1]
    if args.json:
        print(json.dumps({"device": str(device), "what_if": what_if, "device_memory_bytes": memory,
                          "usable_bytes": usable, "rows": [row.as_dict() for row in rows],
                          "smallest": last.as_dict() if last.fits else None}, indent=2))
        return _EXIT_OK
    kind = f"{device}, what-if" if what_if else str(device)
    lines = [f"devices of {format_bytes(memory)} ({kind}), {format_bytes(usable)} usable per rank"]
    table = [("devices", "plan", "max micro", "peak per rank")]
    for row in rows:
        plan = ", ".join(p for p in row.estimate.plan.describe().split(", ") if not p.startswith("micro "))
        table.append((str(row.world_size), plan if row.fits else f"none fits (closest: {plan}, micro 1)",
                      str(row.max_micro_batch_size or "-"), format_bytes(row.estimate.predicted_peak_bytes)))
    widths = [max(len(line[i]) for line in table) for i in range(4)]
    lines += [f"{a:>{widths[0]}}  {b:<{widths[1]}}  {c:>{widths[2]}}  {d:>{widths[3]}}" for a, b, c, d in table]
    if last.fits:
        lines.append(f"smallest: {last.world_size} device(s) of {format_bytes(memory)}: {last.estimate.plan.describe()}"
                     f" (of a batch of {batch_size_of(batch)} per rank)")
    else:
        lines.append(f"no plan fits {most} device(s) of {format_bytes(memory)}: try more devices, or a plan the "
                     "default rows do not cover (offload, a smaller batch)")
    notes = dict.fromkeys(note for row in rows for note in row.estimate.notes)
    print("\n".join([*lines, *(f"note: {note}" for note in notes)]))
    return _EXIT_OK


#: A CPU row whose predicted peak is within this share of the budget is measured by a short run (``autotune
#: estimate``): the process's resident set beside the tensors scatters by a few percent between micro-batches (the
#: example GPT's `32-true, ckpt 1.0` at 274 MiB: 273.46 MiB predicted, 284.77 MiB measured).
SETTLE_BAND = 0.05


def _settled(row: Any, *, target: str, config: str | None) -> Any:
    """``row`` with the peak of a short run of its plan (one warm-up step, one measured step), which decides its fit;
    the row as it was where the run fails."""
    import dataclasses

    from autotune._search.trial import TrialSpec, run_trial

    result = run_trial(TrialSpec(target=target, config=config, plan=row.estimate.plan.to_dict(), budget=None,
                                 device="cpu", steps=1, warmup=1), timeout=600.0)
    if result.status != "ok" or not result.peak_bytes:
        return row
    return dataclasses.replace(row, measured_peak_bytes=result.peak_bytes)


#: How each row was traced (``Estimate.method``), in the table: no data, or real tensors on the host (notes say more).
_TRACED = {"fake": "no data", "real": "real", "extrapolated": "real, extrapolated"}


def format_estimate_table(rows: Sequence[Any], *, baseline_measured: bool = True,
                          speed_notes: Sequence[str] = ()) -> str:
    """The rows of :func:`autotune._estimate.estimate_target` as a table: plan, micro-batch, peak, fit, max micro,
    and where rows have a predicted speed, samples/s, MFU and bound; ``baseline_measured``: whether the rows' process
    baseline (CPU) was measured, or is this process's memory; ``speed_notes``: what the speed columns are.

    Example:
        >>> print(format_estimate_table(rows))  # doctest: +SKIP
        device cpu, batch 32, budget 4.00 GiB
        plan     micro  predicted peak  fits  max micro  state/param  traced   samples/s  MFU  bound
        32-true     32       12.02 MiB  yes          32     16.00 B  no data    1,012.3   7%  compute
    """
    if not rows:
        return "no plans to estimate"
    first = rows[0]
    ranks = f", per rank of {first.estimate.world_size}" if first.estimate.world_size > 1 else ""
    header = (f"device {first.estimate.device}, batch {first.batch_size}, budget {format_bytes(first.budget_bytes)}"
              f"{ranks}")
    speed = any(row.speed is not None for row in rows)
    table = [("plan", "micro", "predicted peak", "fits", "max micro", "state/param", "traced")
             + (("samples/s", "MFU", "bound") if speed else ())]
    for row in rows:
        label = ", ".join(p for p in row.estimate.plan.describe().split(", ") if not p.startswith("micro "))
        best = row.max_micro_batch_size
        verdict = ("yes" if row.fits else "no") + ("*" if row.measured_peak_bytes is not None else "")
        table.append((label, str(row.estimate.micro_batch_size), format_bytes(row.peak_bytes),
                      verdict, "none fits" if best is None else str(best),
                      f"{row.state_bytes_per_parameter:.2f} B", _TRACED[row.estimate.method])
                     + (_cli_speed.speed_cells(row) if speed else ()))
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    left = {0, 3, 6, 9}  # plan, fits, traced, bound
    lines = ["  ".join(f"{cell:<{w}}" if i in left else f"{cell:>{w}}" for i, (cell, w) in enumerate(zip(line, widths)))
             .rstrip() for line in table]
    notes = dict.fromkeys(note for row in rows for note in row.estimate.notes)  # each once, in order
    for row in rows:
        if row.measured_peak_bytes is not None:
            label = row.estimate.plan.describe()
            notes[f"*: {label} is predicted within {SETTLE_BAND:.0%} of the budget, so a short run settled it: "
                  f"measured peak {format_bytes(row.measured_peak_bytes)}"] = None
    if first.baseline_bytes and baseline_measured:
        low, high = (f(row.baseline_bytes for row in rows) for f in (min, max))
        span = format_bytes(low) if low == high else f"{format_bytes(low)} to {format_bytes(high)} by micro-batch"
        notes[f"the peaks include the process baseline measured here, {span} (short training runs' peaks less their "
              "tensors, at micro-batch 1 and at a larger one: the process grows with the micro-batch): on CPU the "
              "budget is the process's resident set net of file pages, as for a search's trials"] = None
    elif first.baseline_bytes:
        notes[f"the peaks include this process's memory now, {format_bytes(first.baseline_bytes)}, in place of the "
              "process baseline, which could not be measured (the short training run or its estimate failed): on CPU "
              "the budget is the process's resident set net of file pages"] = None
    notes.update(dict.fromkeys(speed_notes))
    for row in rows:
        if row.recompute is not None:
            lines.append(f"{row.estimate.plan.describe()}: recompute chosen per block")
            lines += [f"  {line}" for line in row.recompute.describe()]
    return "\n".join([header, *lines, *(f"note: {note}" for note in notes)])
