"""Definitions and report rendering of ``benchmarks/elastic_overhead.py``, moved here to keep that script short: the
benchmark's fixed settings (the example GPT's size, the effective batch ``N``, the split ``k`` and the goals), its
sizings and the configurations it measures, and the functions that turn its results into the Markdown report it prints
(the table and the notes under it; the machine description comes from ``_common``). Nothing here trains or times
anything; the script imports this module from its own directory (``benchmarks/``, which it makes sure is on
``sys.path``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from _common import markdown_table

#: The example GPT, sized so that a CPU step at batch ``N`` takes roughly 100 ms on one core of a 2-core VM.
MODEL = {"n_layer": 2, "n_head": 4, "n_embd": 128, "dropout": 0.0, "lr": 3e-4, "warmup_steps": 2}
VOCAB, BLOCK = 256, 64
#: A state-bound GPT: 14 M parameters, whose weights and AdamW state (12 bytes per parameter) pass 100 MB, on small
#: batches, so that its step is dominated by the update: where a cost that grows with the model would show.
STATE_MODEL = {"n_layer": 2, "n_head": 8, "n_embd": 768, "dropout": 0.0, "lr": 3e-4, "warmup_steps": 2}
STATE_BATCH, STATE_BLOCK = 8, 16
#: Goal for the cost of one OOM: at most one extra step.
GOAL_OOM_EXTRA_STEPS = 1.0
#: Effective batch N and the split k of measurements 2 and 4.
BATCH, SPLIT = 32, 4
#: Goals: the callback's time per step over its baseline's.
GOAL_NO_SPLIT, GOAL_SPLIT = 1.01, 1.02


@dataclass(frozen=True)
class Sizing:
    """How long to measure: steps per fit (the first ``warmup`` are not timed) and interleaved repeats."""

    steps: int
    warmup: int
    repeats: int
    ddp_steps: int
    ddp_warmup: int
    ddp_repeats: int

    @property
    def oom_step(self) -> int:
        """The global step (0-based) whose first micro-batch runs out of memory in measurement 3."""
        return self.warmup + 1


QUICK = Sizing(steps=12, warmup=3, repeats=4, ddp_steps=8, ddp_warmup=3, ddp_repeats=2)
FULL = Sizing(steps=30, warmup=5, repeats=7, ddp_steps=25, ddp_warmup=5, ddp_repeats=4)


@dataclass(frozen=True)
class RunConfig:
    """One configuration: the dataloader's batch (per rank), Lightning's accumulation, and the callback's settings."""

    name: str
    label: str
    batch: int
    accumulate: int = 1
    elastic: bool = False
    micro: int | None = None
    protect: bool = True
    oom: bool = False
    state_bound: bool = False  # the state-bound GPT (STATE_MODEL) instead of the example's


PLAIN = RunConfig("plain", f"plain Lightning, batch {BATCH}", BATCH)
NO_SPLIT = [
    PLAIN,
    RunConfig("elastic", f"ElasticBatchSize, batch {BATCH} (micro {BATCH})", BATCH, elastic=True),
    RunConfig("elastic_noprotect", f"ElasticBatchSize, batch {BATCH} (micro {BATCH}), protect_update=False", BATCH,
              elastic=True, protect=False),
]
STATE_PLAIN = RunConfig("state_plain", f"state-bound GPT: plain Lightning, batch {STATE_BATCH}", STATE_BATCH,
                        state_bound=True)
STATE_NO_SPLIT = [
    STATE_PLAIN,
    RunConfig("state_elastic", f"state-bound GPT: ElasticBatchSize defaults, batch {STATE_BATCH}", STATE_BATCH,
              elastic=True, state_bound=True),
]
NATIVE = RunConfig("native_acc", f"Lightning accumulate_grad_batches={SPLIT}, batch {BATCH // SPLIT}",
                   BATCH // SPLIT, accumulate=SPLIT)
SPLIT_K = [
    NATIVE,
    RunConfig("elastic_split", f"ElasticBatchSize micro {BATCH // SPLIT}, batch {BATCH}", BATCH, elastic=True,
              micro=BATCH // SPLIT),
    RunConfig("elastic_split_noprotect", f"ElasticBatchSize micro {BATCH // SPLIT}, batch {BATCH}, "
              "protect_update=False", BATCH, elastic=True, micro=BATCH // SPLIT, protect=False),
]
OOM = RunConfig("elastic_oom", f"ElasticBatchSize, batch {BATCH}, one OOM in forward (micro {BATCH} -> "
                f"{BATCH // 2})", BATCH, elastic=True, oom=True)
#: The DDP configuration whose runs also time the callback's collectives.
ATTRIBUTED_DDP = "ddp_elastic_split"
DDP = {c.name: replace(c, label="DDP x2: " + c.label) for c in (
    RunConfig("ddp_native_acc", NATIVE.label, BATCH // SPLIT, accumulate=SPLIT),
    RunConfig("ddp_elastic_split", SPLIT_K[1].label, BATCH, elastic=True, micro=BATCH // SPLIT),
    RunConfig("ddp_elastic_split_noprotect", SPLIT_K[2].label, BATCH, elastic=True, micro=BATCH // SPLIT,
              protect=False),
)}


# ------------------------------------------------------------------------------------------------- reporting
def _ratio(c: dict[str, float]) -> str:
    return f"{c['ratio']:.3f} ({c['ratio_min']:.3f}-{c['ratio_max']:.3f})"


def _met(c: dict[str, float], goal: float) -> str:
    return "yes" if c["ratio"] <= goal else "no"


def table_rows(results: dict[str, Any]) -> list[list[str]]:
    """Rows of the table; the CPU-time columns only for single-process runs on CPU (GPU work is not CPU time)."""
    rows = []
    cpu_clock = results["device"] == "cpu"

    def add(section: str, configs: list[RunConfig], summary: dict[str, Any], baseline: str, goal: float | None,
            show_cpu: bool) -> None:
        base = summary[baseline]
        for cfg in configs:
            wall, cpu = summary[cfg.name]["wall"], summary[cfg.name]["cpu"]
            row = [section, cfg.label, f"{wall['ms_per_step']:.1f}"]
            if cfg.name == baseline:
                row += ["", "1 (baseline)"] + ([f"{cpu['ms_per_step']:.1f}", "1 (baseline)"] if show_cpu else
                                                ["-", "-"]) + ["", ""]
            else:
                row += [f"{wall['ms_per_step'] - base['wall']['ms_per_step']:+.1f}", _ratio(wall)]
                row += [f"{cpu['ms_per_step']:.1f}", _ratio(cpu)] if show_cpu else ["-", "-"]
                row.append(f"<= {goal:.2f}" if goal else "report")
                row.append((_met(wall, goal) + (f" / {_met(cpu, goal)}" if show_cpu else "")) if goal else "")
            rows.append(row)

    add("1 no split", NO_SPLIT, results["no_split"], PLAIN.name, GOAL_NO_SPLIT, cpu_clock)
    add("1b no split, state-bound", STATE_NO_SPLIT, results["state_no_split"], STATE_PLAIN.name, GOAL_NO_SPLIT,
        cpu_clock)
    add(f"2 split {SPLIT}", SPLIT_K, results["split"], NATIVE.name, GOAL_SPLIT, cpu_clock)
    o = results["oom"]
    w, c = o["wall"], o["cpu"]
    rows.append(["3 one OOM", f"{OOM.label}: normal step after it", f"{w['normal_ms']:.1f}", "", "1 (baseline)"]
                + ([f"{c['normal_ms']:.1f}", "1 (baseline)"] if cpu_clock else ["-", "-"]) + ["", ""])
    rows.append(["3 one OOM", f"{OOM.label}: the OOM step (step {o['oom_step']})", f"{w['oom_step_ms']:.1f}",
                 f"{w['oom_step_ms'] - w['normal_ms']:+.1f}", _oom_ratio(w)]
                + ([f"{c['oom_step_ms']:.1f}", _oom_ratio(c)] if cpu_clock else ["-", "-"])
                + [f"<= {1 + GOAL_OOM_EXTRA_STEPS:.2f}", _oom_met(w) + (f" / {_oom_met(c)}" if cpu_clock else "")])
    if "ddp" in results:  # CPU time leaves out the waits for the other rank: wall time only
        add(f"4 DDP split {SPLIT}", list(DDP.values()), results["ddp"], "ddp_native_acc", None, False)
    return rows


def _oom_met(c: dict[str, float]) -> str:
    return "yes" if c["extra_steps"] <= GOAL_OOM_EXTRA_STEPS else "no"


def _oom_ratio(c: dict[str, float]) -> str:
    return f"{1 + c['extra_steps']:.2f} ({1 + c['extra_steps_min']:.2f}-{1 + c['extra_steps_max']:.2f})"


#: The columns of :func:`table_rows`.
HEADER = ["measurement", "configuration", "ms/step (median)", "delta ms", "ratio (range over repeats)", "CPU ms/step",
          "CPU ratio (range)", "goal", "met? (wall / CPU)"]


def report(results: dict[str, Any]) -> str:
    m, s, o, a = results["machine"], results["sizing"], results["oom"], results["attribution"]
    load = f"load average {_load(m['load_average'])} at start, {_load(results['load_avg_at_end'])} at end"
    clocks = ("wall", "cpu") if results["device"] == "cpu" else ("wall",)
    lines = [
        "## Elastic runtime overhead",
        "",
        f"command: `{results['command']}`",
        f"machine: {m['cpu']}, {m['cores']} cores, torch threads {m['torch_threads']}"
        + (f", GPU {m['gpu']}" if m["gpu"] else "") + f"; python {m['python']}, torch {m['torch']}, "
        f"lightning {m['lightning']}; {m['date']}; {load}",
        f"model: example GPT {_kv(results['model'])}, vocab {VOCAB}, block {BLOCK} ({a['params']:,} parameters); "
        f"N = {BATCH}, k = {SPLIT}; device {results['device']}; {s['steps']} steps per fit ({s['warmup']} warm-up), "
        f"{s['repeats']} interleaved repeats"
        + (f"; DDP: 2 {results['ddp_accelerator']} processes, {s['ddp_steps']} steps ({s['ddp_warmup']} warm-up), "
           f"{s['ddp_repeats']} repeats" if "ddp" in results else ""),
        "ms/step: median over all timed steps of all repeats; ratio: the median over repeats of each repeat's median "
        "over the baseline's in that repeat, with their range; CPU: the process's CPU time per step (on CPU only), "
        "which other processes on the machine barely change.",
        "",
        markdown_table(HEADER, table_rows(results)),
        "",
    ]
    for clock in clocks:
        c = o[clock]
        lines.append(
            f"1 OOM costs {c['extra_steps']:.2f} extra steps by {clock} time (range {c['extra_steps_min']:.2f}-"
            f"{c['extra_steps_max']:.2f}): the OOM step took {c['oom_step_ms']:.1f} ms against {c['normal_ms']:.1f} ms "
            f"for a normal step after it (micro {BATCH // 2}) and {c['before_ms']:.1f} ms before it (micro {BATCH})."
        )
    lines.append(f"gc.collect on the OOM step (the recovery's collection; {a['gc_objects']:,} live objects), in an "
                 f"extra run: {a['gc_calls']} call(s), {a['gc_ms']:.1f} ms wall, {a['gc_cpu_ms']:.1f} ms CPU, "
                 f"{a['gc_collected']} objects collected.")
    for clock in clocks:
        for key, goal, number in (("no_split", GOAL_NO_SPLIT, "1"), ("state_no_split", GOAL_NO_SPLIT, "1b"),
                                  ("split", GOAL_SPLIT, "2")):
            for cfg, summary in results[key].items():
                ratio = summary[clock]["ratio"]
                if cfg not in (PLAIN.name, NATIVE.name, STATE_PLAIN.name) and ratio > goal:
                    lines.append(f"goal missed ({clock} time): measurement {number}, {cfg}: {ratio:.3f} > {goal:.2f}")
    plain_ms = results["no_split"][PLAIN.name][clocks[-1]]["ms_per_step"]
    lines += ["", f"Where the callback's time goes (extra run at micro {BATCH}, defaults; CPU time of the training "
              f"thread, median per step; a plain step is {plain_ms:.1f} ms {clocks[-1]}):", ""]
    for label, v in a["per_step"].items():
        lines.append(f"- {label}: {v['ms_per_step']:.2f} ms ({100 * v['ms_per_step'] / plain_ms:.1f}%), "
                     f"{v['calls_per_step']:g} calls")
    lines.append(f"- for scale, one LightningModule.log call: {a['log_call_ms']:.2f} ms")
    for model, snap in a["snapshot"].items():
        lines.append(f"- update snapshot ({model}, {snap['params']:,} parameters): {snap['first_mib']:.1f} MiB "
                     f"copied to the host before the first update (it creates AdamW's state), "
                     f"{snap['steady_max_bytes']} bytes on every later step")
    if "profile" in a:
        lines += ["", "Profiled (one run each, the whole fit counted per step; the profiler slows both): the names "
                  "whose self CPU time grew most per step with the callback (no split):", ""]
        lines += [f"- {r['name']}: {r['elastic_ms'] - r['plain_ms']:+.3f} ms ({r['plain_calls']:g} -> "
                  f"{r['elastic_calls']:g} calls)" for r in a["profile"]["grew"]]
        for cfg, found in a["profile"]["syncs"].items():
            waits = ", ".join(f"{n} {c:g}" for n, c in sorted(found.items())) or "none"
            lines.append(f"- calls that wait for the device, per step, {cfg}: {waits}")
    if "ddp_attribution" in results:
        d = dict(results["ddp_attribution"])
        step = d.pop("step")["ms_per_step"]
        lines += ["", f"DDP, ElasticBatchSize micro {BATCH // SPLIT}, defaults (rank 0, wall time, median per step "
                  f"over its runs; its step: {step:.1f} ms):", ""]
        lines += [f"- {label}: {v['ms_per_step']:.2f} ms, {v['calls_per_step']:g} calls per step"
                  for label, v in d.items()]
    lines += ["", f"wall time: {results['wall_s']:.0f} s ("
              + ", ".join(f"{k} {v:.0f} s" for k, v in results["phase_s"].items()) + ")"]
    return "\n".join(lines)


def _load(avg: Any) -> str:
    return "/".join(f"{x:.2f}" for x in avg) if avg else "n/a"


def _kv(d: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in d.items())
