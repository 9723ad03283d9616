"""A search trial's measured peak against the estimator's, split into its parts, one plan feature at a time: where
the estimate and a trial part ways (on the H200, 5.25 GiB predicted against 11.86 GiB measured for the realistic
search's best plan) and which feature does it.

Each plan runs as a search trial does (``autotune.measure_plan``: a fresh process, the plan applied by its callbacks,
compile, float8 and optimizer offload included) and is estimated by ``autotune.estimate`` on the target's first
batch (what the search's estimate of a target whose batches keep their shape starts from, before it adds the CUDA
context and what earlier trials of the plan's shape measured beyond their tensors). Columns:

- **est. tensors**: the estimate's peak, the bytes allocated to tensors in one step;
- **tensors** (CUDA): the trial's largest step's peak of bytes allocated (``max_memory_allocated``), the figure
  the estimate predicts; **error** is the estimate against it;
- **peak**: the trial's peak in the search's measure (CUDA: the allocator's peak reserve plus the CUDA context; CPU:
  the process's resident set net of file pages, of which the tensors are only a part);
- **reserve beyond tensors** and **context** (CUDA): the peak's other parts.

The plans (CUDA, on ``benchmarks/gpu_targets.py:gpt_350m``, 310M parameters, context 1024): bf16-mixed at
micro-batch 16 with full checkpointing (eager), then with optimizer offload, then also compiled with
``compile_memory_budget`` 0 (the realistic search's best plan), then eager with float8 (``--quick``: the first
three). On CUDA the first plan is then fitted again as its trial ran (a fresh process, the trial's callbacks, its
number of steps, and the FLOPs of step 0's first micro-batch counted under ``FlopCounterMode`` as the trial's meter
counts them) under the allocator's memory history: what is alive at its peak is listed by the Python line that
allocated it and by size, and the peak placed in its phase of a step (``where`` in the JSON; without stacks where
recording them fails), and once more without the FLOP count, untraced: each step's peak of both fits, beside each
step's of the trial itself, says whether the trial's own measuring adds to its peak (on the H200 a fit in the
benchmark's process peaked at the estimate, 7.57 GiB, and the trial at 11.20). On CPU, on the example GPT, 32-true at
micro-batch 8 with full checkpointing and the same compiled (``--quick``: the first only, a check of the plumbing).

Usage::

    python benchmarks/trial_vs_estimate.py --device cuda --quick --json trial_vs_estimate.json
    python benchmarks/trial_vs_estimate.py --device cpu --quick
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent) not in sys.path:  # _common.py, also when this file is loaded by path
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    GPT_TARGET,
    HERE,
    add_device,
    add_json,
    first_batch,
    in_fresh_process,
    machine,
    machine_line,
    make_parser,
    quiet,
    write_json,
)

#: The realistic search's target (``gpu_check.py``) and a smaller one for the CPU.
CUDA_TARGET = f"{HERE / 'gpu_targets.py'}:gpt_350m"


def plans(device: str, quick: bool) -> list[tuple[str, dict[str, Any]]]:
    """The plans measured, each a label and its fields: one feature added at a time."""
    if device != "cuda":
        base = {"micro_batch_size": 8, "activation_checkpointing": 1.0}
        rows = [("32-true, micro 8, ckpt 1.0", base),
                ("+ compile budget 0", {**base, "compile": True, "compile_memory_budget": 0.0})]
        return rows[:1] if quick else rows
    base = {"precision": "bf16-mixed", "micro_batch_size": 16, "activation_checkpointing": 1.0}
    offload = {**base, "optimizer_offload": True}
    rows = [("bf16-mixed, micro 16, ckpt 1.0 (eager)", base),
            ("+ optimizer offload", offload),
            ("+ compile budget 0 (the search's best)", {**offload, "compile": True, "compile_memory_budget": 0.0}),
            ("eager + float8", {**base, "float8": True})]
    return rows[:3] if quick else rows


#: Seconds one trial may take (a compile included) before it is stopped and its row says so.
TRIAL_TIMEOUT = 280


def measure(target: str, label: str, fields: dict[str, Any], device: str, steps: int) -> dict[str, Any]:
    """One plan: the trial's figures and the estimate's peak (None where the estimator cannot trace it)."""
    import autotune

    plan = autotune.Plan(**fields)
    result = autotune.measure_plan(target=target, plan=plan, device=device, steps=steps, warmup=1,
                                   timeout=TRIAL_TIMEOUT)
    loaded = autotune.load_target(target)
    batch = first_batch(loaded)
    try:
        found = autotune.estimate(model=loaded.model, batch=batch, plan=plan, device=device)
        predicted: int | None = found.predicted_peak_bytes
    except ValueError as err:  # a plan the estimator refuses: the row says so
        predicted, note = None, str(err)
    else:
        note = "; ".join(n for n in found.notes if "not traced" in n)
    return {"plan": label, "fields": fields, "status": result.status, "reason": result.reason,
            "steps": result.warmup_steps + result.steps_timed, "predicted_bytes": predicted,
            "peak_bytes": result.peak_bytes,
            "allocated_peak_bytes": result.allocated_peak_bytes, "context_bytes": result.context_bytes,
            "peak_noise_bytes": result.peak_noise_bytes, "allocated_step_peaks": result.allocated_step_peaks,
            "samples_per_second": result.samples_per_second, "note": note}


#: Markers the "where" fit allocates and frees at each phase of a step (``Phases``), in 512-byte blocks so that the
#: allocator's rounding keeps them apart: the trace then says in which phase its peak lies.
MARKER_BLOCKS = {"step": 1009, "forward": 1013, "backward": 1019, "update": 1021}
MARKER_SIZES = {512 * blocks: phase for phase, blocks in MARKER_BLOCKS.items()}


def peak_index(events: list[dict[str, Any]]) -> tuple[int, int]:
    """The peak of bytes requested in a CUDA allocator trace and the index of the event that reached it."""
    alive = peak = at = 0
    for i, event in enumerate(events):
        if event["action"] == "alloc":
            alive += event["size"]
            if alive > peak:
                peak, at = alive, i
        elif event["action"] == "free_requested":
            alive -= event["size"]
    return peak, at


def peak_sites(events: list[dict[str, Any]], *, top: int = 12) -> tuple[int, list[tuple[str, int]], int]:
    """The peak of bytes requested in a CUDA allocator trace (``torch.cuda.memory._snapshot()["device_traces"][i]``,
    recorded from before the first allocation) and the tensors alive at it, grouped by the innermost Python frame
    outside torch that allocated them, the ``top`` largest groups first; and how many frees the trace has no
    allocation for (allocated before it, or a ring buffer that wrapped: then the figures are partial).

    A tensor counts from ``alloc`` to ``free_requested``, when the allocator's ``allocated_bytes`` drops too (its
    block may be reused only later, after the streams that used it); the sizes are those requested, which the
    allocator rounds to its blocks (512 B, and up to 1 MiB that a large block keeps unsplit), so the peak is a little
    under ``max_memory_allocated``. A checkpointed block's recompute shows its model's lines; what autograd allocates
    on its CUDA worker thread (gradients) has no Python frame."""
    peak, at_peak, unmatched = _alive_at_peak(events)
    by_site: dict[str, int] = {}
    for event in at_peak:
        site = _site(event.get("frames") or [])
        by_site[site] = by_site.get(site, 0) + event["size"]
    return peak, sorted(by_site.items(), key=lambda item: -item[1])[:top], unmatched


def _alive_at_peak(events: list[dict[str, Any]]) -> tuple[int, list[dict[str, Any]], int]:
    peak, at = peak_index(events)
    live: dict[int, dict[str, Any]] = {}
    at_peak: list[dict[str, Any]] = []
    unmatched = 0
    for i, event in enumerate(events):
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_requested":
            unmatched += live.pop(event["addr"], None) is None
        if i == at:
            at_peak = list(live.values())
    return peak, at_peak, unmatched


def peak_phase(events: list[dict[str, Any]]) -> str:
    """Where in the fit the trace's peak lies, from the markers ``Phases`` allocated: "step 3, backward of
    micro-batch 2" ("before the first marker" where none precedes it)."""
    _, at = peak_index(events)
    step = micro = 0
    phase = ""
    for event in events[:at + 1]:
        name = MARKER_SIZES.get(event["size"]) if event["action"] == "alloc" else None
        if name == "step":
            step, micro, phase = step + 1, 0, "start"
        elif name == "forward":
            micro, phase = micro + 1, "forward"
        elif name is not None:
            phase = name
    if not phase:
        return "before the first marker"
    return f"step {step}, {phase}" + (f" of micro-batch {micro}" if phase in ("forward", "backward") else "")


def sizes_at_peak(events: list[dict[str, Any]], *, top: int = 8) -> list[tuple[int, int]]:
    """The tensors alive at the trace's peak grouped by size (``(size, count)``), the largest total first: a trace
    without stacks still says what is alive (parameter-sized copies, one block's activations)."""
    counts: dict[int, int] = {}
    for event in _alive_at_peak(events)[1]:
        counts[event["size"]] = counts.get(event["size"], 0) + 1
    return sorted(counts.items(), key=lambda item: -item[0] * item[1])[:top]


def _site(frames: list[dict[str, Any]]) -> str:
    for frame in frames:  # innermost first
        path = Path(frame.get("filename", ""))
        if "torch" not in path.parts:
            return f"{'/'.join(path.parts[-2:])}:{frame.get('line', '?')} {frame.get('name', '?')}"
    return "(torch only)" if frames else "(no Python frame)"


def where_the_peak_goes(target: str, fields: dict[str, Any], *, steps: int = 3, count_flops: bool = False,
                        top: int = 12) -> dict[str, Any]:
    """CUDA: the plan fitted for ``steps`` steps as a trial runs it (ElasticBatchSize at the plan's micro-batch,
    ApplyPlan; with ``count_flops`` the FLOPs of step 0's first micro-batch counted as the trial's meter counts them)
    under the allocator's memory history: the peak of bytes requested, the phase it lies in (:func:`peak_phase`), what
    is alive at it by the line that allocated it (:func:`peak_sites`) and by size (:func:`sizes_at_peak`), beside each
    step's ``max_memory_allocated`` (ElasticBatchSize resets it each step).

    With Python stacks first; where that recording fails (on an H200 with torch 2.11 it made the backward of a
    checkpointed step fail: ``SystemError: run_backward returned NULL``), fitted again without stacks: the phase and the
    sizes are still there."""
    failures: list[str] = []
    for stacks in (True, False):
        try:
            events, peaks, floor = _fit(target, fields, record=stacks, steps=steps, count_flops=count_flops)
        except Exception as err:  # noqa: BLE001 - the next way of recording, or the reason in the report
            failures.append(f"{'with' if stacks else 'without'} stacks: {type(err).__name__}: {err}")
            continue
        peak, sites, unmatched = peak_sites(events, top=top)
        return {"fields": fields, "steps": steps, "count_flops": count_flops, "stacks": stacks, "failures": failures,
                "peak_requested_bytes": peak, "max_memory_allocated": max(peaks, default=0), "step_peaks": peaks,
                "floor_bytes": floor,
                "phase": peak_phase(events), "sites": sites if stacks else [], "sizes": sizes_at_peak(events),
                "frees_without_alloc": unmatched, "trace_full": len(events) >= TRACE_ENTRIES}
    raise RuntimeError("; ".join(failures))


def where_worker(target: str, fields: dict[str, Any], steps: int) -> dict[str, Any]:
    """In a fresh process (``_common.in_fresh_process``, as a trial starts): :func:`where_the_peak_goes` with the
    trial's FLOP count, then each step's peak of the same fit without it, untraced (``untraced_step_peaks``). A
    failure comes back as ``{"error": reason}`` (or ``untraced_failure``), not as a process without a result."""
    def reason(err: Exception) -> str:
        return f"{type(err).__name__}: {' '.join(str(err).split())}"[:2000]

    try:
        found = where_the_peak_goes(target, fields, steps=steps, count_flops=True)
    except Exception as err:  # noqa: BLE001 - the reason, for the report
        return {"error": reason(err)}
    try:
        _, found["untraced_step_peaks"], found["untraced_floor_bytes"] = _fit(target, fields, record=None,
                                                                              steps=steps, count_flops=False)
    except Exception as err:  # noqa: BLE001
        found["untraced_failure"] = reason(err)
    return found


#: Allocator events the "where" fit keeps (a ring buffer: more and the oldest are lost).
TRACE_ENTRIES = 4_000_000


def _fit(target: str, fields: dict[str, Any], *, record: bool | None, steps: int,
         count_flops: bool) -> tuple[list[dict[str, Any]], list[int], int]:
    """The plan fitted for ``steps`` steps, under the allocator's memory history (``record``: with Python stacks or
    without; None: not recorded): its events, each step's peak allocated, and what was allocated before it started
    (an earlier fit's leftovers, after collecting them)."""
    import gc

    import lightning as L
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    import autotune
    from autotune.callbacks import ApplyPlan, ElasticBatchSize

    device = torch.device("cuda", torch.cuda.current_device())

    def mark(phase: str) -> None:
        torch.empty(512 * MARKER_BLOCKS[phase], dtype=torch.uint8, device=device)  # allocated, freed at once

    class Phases(L.Callback):
        """Each step's peak allocated, and a marker at each phase of a step (see ``MARKER_BLOCKS``)."""

        def __init__(self) -> None:
            self.peaks: list[int] = []

        def on_train_start(self, trainer: Any, module: Any) -> None:
            module.register_forward_pre_hook(lambda *args: mark("forward"))

        def on_train_batch_start(self, *args: Any) -> None:
            mark("step")

        def on_before_backward(self, *args: Any) -> None:
            mark("backward")

        def on_before_optimizer_step(self, *args: Any) -> None:
            mark("update")

        def on_train_batch_end(self, *args: Any) -> None:
            self.peaks.append(torch.cuda.max_memory_allocated())

    class CountFlops(L.Callback):
        """As a trial's meter: ``FlopCounterMode`` from step 0's start to its first micro-batch's backward."""

        def __init__(self) -> None:
            self.counter: Any = None

        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == 0 and self.counter is None:
                self.counter = FlopCounterMode(display=False)
                self.counter.__enter__()

        def stop(self, *args: Any) -> None:
            if self.counter is not None and self.counter.mode is not None:
                self.counter.__exit__(None, None, None)

        on_after_backward = on_before_optimizer_step = on_train_batch_end = stop

    plan = autotune.Plan(**fields)
    loaded = autotune.load_target(target)
    micro = plan.micro_batch_size or loaded.batch_size()
    kwargs = plan.trainer_kwargs()
    kwargs.pop("devices", None)
    phases, counting = Phases(), CountFlops()
    trainer = L.Trainer(accelerator="cuda", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, callbacks=[
                            ElasticBatchSize(micro_batch_size=micro, min_micro_batch_size=micro, grow=False),
                            ApplyPlan(**plan.apply_kwargs()), phases, *([counting] if count_flops else [])],
                        **kwargs)
    gc.collect()  # an earlier fit's trainer, model and optimizer sit in reference cycles
    torch.cuda.empty_cache()
    floor = torch.cuda.memory_allocated(device)
    if record is not None:
        torch.cuda.memory._record_memory_history(max_entries=TRACE_ENTRIES,
                                                 **({"stacks": "python"} if record else {"context": None}))
    try:
        trainer.fit(loaded.model, datamodule=loaded.datamodule)
        snapshot = torch.cuda.memory._snapshot() if record is not None else None
    finally:
        counting.stop()  # a fit that failed in step 0's backward leaves no counter behind for the next fit
        if record is not None:
            torch.cuda.memory._record_memory_history(enabled=None)
    return (snapshot["device_traces"][device.index] if snapshot else []), phases.peaks, floor


def where_lines(label: str, where: dict[str, Any]) -> str:
    """The report's lines for :func:`where_worker`'s result."""
    gib = 2**30
    partial = (" (partial: the trace has frees without their allocation)"
               if where["frees_without_alloc"] or where["trace_full"] else "")
    lines = [f"\nwhere the peak goes ({label}, fitted as its trial: a fresh process, {where['steps']} steps, step 0's "
             f"FLOPs counted{'' if where['stacks'] else ', recorded without stacks'}): the peak of bytes requested, "
             f"{where['peak_requested_bytes'] / gib:.2f} GiB (the largest step's max_memory_allocated "
             f"{where['max_memory_allocated'] / gib:.2f} GiB){partial}, lies in {where['phase']}",
             "  each step's max_memory_allocated (GiB): " + " ".join(f"{p / gib:.2f}" for p in where["step_peaks"])
             + f" (allocated before the fit: {where['floor_bytes'] / gib:.2f})",
             "  the same fit without the FLOP count, untraced (GiB): "
             + (f"failed: {where['untraced_failure']}" if "untraced_failure" in where else
                " ".join(f"{p / gib:.2f}" for p in where["untraced_step_peaks"])
                + f" (allocated before the fit: {where['untraced_floor_bytes'] / gib:.2f})")]
    lines += [f"  (recording {failure})" for failure in where["failures"]]
    if where["sites"]:
        lines.append("  alive at it by the innermost Python frame outside torch:")
    lines += [f"  {size / gib:7.3f} GiB  {site}" for site, size in where["sites"]]
    lines.append("  alive at it by size: " + ", ".join(f"{count} x {size / 2**20:.1f} MiB"
                                                   for size, count in where["sizes"]))
    return "\n".join(lines)


def error(row: dict[str, Any]) -> str:
    """The estimated tensors against the trial's tensors' peak (CUDA), or "-"."""
    allocated, predicted = row["allocated_peak_bytes"], row["predicted_bytes"]
    return f"{(predicted - allocated) / allocated:+.1%}" if allocated and predicted is not None else "-"


def table(rows: list[dict[str, Any]]) -> str:
    from _common import markdown_table

    largest = max((r["peak_bytes"] or 0 for r in rows), default=0)
    unit, scale = ("GiB", 2**30) if largest >= 2**30 else ("MiB", 2**20)

    def _in_unit(n: int | None) -> str:
        return "-" if n is None else f"{n / scale:.2f}"

    lines = []
    for r in rows:
        allocated, predicted = r["allocated_peak_bytes"], r["predicted_bytes"]
        beyond = (r["peak_bytes"] - allocated - (r["context_bytes"] or 0)
                  if allocated is not None and r["peak_bytes"] is not None else None)
        lines.append([r["plan"], r["status"] + (f" ({r['reason'][:60]})" if r["reason"] else ""), _in_unit(predicted),
                      _in_unit(allocated), error(r), _in_unit(r["peak_bytes"]), _in_unit(beyond),
                      _in_unit(r["context_bytes"])])
    return markdown_table(["plan", "trial", f"est. tensors ({unit})", f"tensors ({unit})", "error", f"peak ({unit})",
                           f"reserve beyond tensors ({unit})", f"context ({unit})"], lines, right=(2, 3, 4, 5, 6, 7))


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__doc__)
    add_device(parser)
    parser.add_argument("--quick", action="store_true",
                        help="fewer plans and steps (CUDA: 3 plans, CPU: 1; 3 timed steps)")
    parser.add_argument("--target", default=None,
                        help=f"the target (default: {CUDA_TARGET} on CUDA, {GPT_TARGET} on CPU)")
    add_json(parser)
    args = parser.parse_args(argv)
    quiet()
    target = args.target or (CUDA_TARGET if args.device == "cuda" else GPT_TARGET)
    m = machine(args.device)
    print(machine_line(m))
    print(f"\ntarget {target}: each plan one search trial (fresh process) and the search's estimate\n")
    rows: list[dict[str, Any]] = []
    for label, fields in plans(args.device, args.quick):
        rows.append(measure(target, label, fields, args.device, 3 if args.quick else 6))
        write_json(args.json, {"machine": m, "target": target, "rows": rows})  # kept if a later plan hangs
    print(table(rows))
    for r in rows:  # CUDA: whether a trial's peak is one step's (the first's, say) or grows from step to step
        if r["allocated_step_peaks"]:
            print(f"{r['plan']}: each step's tensors' peak (GiB) "
                  + " ".join(f"{p / 2**30:.2f}" for p in r["allocated_step_peaks"]))
    where = None
    if args.device == "cuda" and rows:  # the first plan's peak, taken apart (a trial keeps no allocator trace)
        label, fields = plans(args.device, args.quick)[0]
        steps = rows[0]["steps"] or 3
        try:
            where = in_fresh_process(where_worker, target, fields, steps)
        except Exception as err:  # noqa: BLE001 - a diagnostic: the table above stands without it
            where = {"error": f"{type(err).__name__}: {err}"}
        print(f"\nwhere the peak goes ({label}): failed: {where['error']}" if "error" in where
              else where_lines(label, where))
        write_json(args.json, {"machine": m, "target": target, "rows": rows, "where": where})
    for r in rows:
        if r["note"]:
            print(f"- {r['plan']}: {r['note']}")
    for r in rows:  # one line each that gpu_check's report keeps (it keeps the lines that name an error)
        peak = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**30:.2f} GiB"
        print(f"{r['plan']}: {r['status']}, peak {peak}, error of the estimated tensors {error(r)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
