"""Estimates at scale: models built on the meta device (no weights), per rank, with the classic arithmetic beside them.

1. For GPT-shaped models of 125M to 70B parameters built under ``torch.device("meta")``, the wall time and this
   process's peak resident set of one estimate per plan (goal for 7B: under 60 s and 2 GiB).
2. For a 10B-parameter model, each plan's model state in bytes per parameter as the estimator finds it (parameters,
   gradients and optimizer state of one rank, gathered units excluded) next to the closed form: fp32 AdamW 4 + 4 + 8;
   bf16-mixed the same fp32 master state (its autocast weight copies are activations, 2 bytes per parameter during
   the forward); bf16-true 2 + 2 + 4; 8-bit AdamW state 4 + 4 + 2 x (1 + 4/256) (codes and one fp32 scale per 256
   values; each tensor's 1 KiB code map is left out); ZeRO-3 (``strategy="fsdp"``) over N ranks 16 / N.
3. The capacity answer for 7B (1.3B with ``--quick``): the smallest number of 80 GiB CUDA devices, estimated what-if
   on this machine, and the plan.

    python benchmarks/estimator_scale.py            # 125M..70B; about 3 minutes on a 2-core CPU
    python benchmarks/estimator_scale.py --quick    # 125M and 1.3B only
"""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path
from typing import Any

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:  # _common.py, also when this file is loaded by path
    sys.path.insert(0, _HERE)

from _common import (  # noqa: E402
    add_json,
    in_fresh_process,
    machine,
    machine_line,
    make_parser,
    markdown_table,
    quiet,
    use_paths,
    write_json,
)

#: (layers, width, heads) of GPT-shaped models (vocabulary 32000, no weight tying), by their nominal size.
SHAPES = {"125M": (12, 768, 12), "1.3B": (24, 2048, 16), "7B": (32, 4096, 32), "10B": (40, 4608, 36),
          "70B": (80, 8192, 64)}
CONTEXT = 64  # tokens per sample in the traced batch (one sample): the model state is what scales here
GOAL_7B_SECONDS, GOAL_7B_RSS = 60.0, 2 * 2**30


def build(shape: tuple[int, int, int]) -> Any:
    use_paths(gpt=True)
    import torch
    from model import GPT

    layers, width, heads = shape
    with torch.device("meta"):
        return GPT(vocab_size=32000, block_size=CONTEXT, n_layer=layers, n_head=heads, n_embd=width,
                   tie_weights=False)


def plans() -> list[tuple[str, Any, int]]:
    from autotune import Plan

    return [("fp32, AdamW", Plan(), 1), ("bf16-mixed", Plan(precision="bf16-mixed"), 1),
            ("bf16-true", Plan(precision="bf16-true"), 1),
            ("8-bit AdamW state (torchao)", Plan(optimizer_state="8bit"), 1),
            ("ZeRO-3 over 8 (fsdp, bf16-mixed)", Plan(strategy="fsdp", precision="bf16-mixed"), 8),
            ("ZeRO-3 over 64 (fsdp, bf16-mixed)", Plan(strategy="fsdp", precision="bf16-mixed"), 64)]


#: The closed form of each plan's model state, bytes per parameter (the 0-dim Adam step tensors are left out).
CLOSED = {"fp32, AdamW": 16.0, "bf16-mixed": 16.0, "bf16-true": 8.0,
          "8-bit AdamW state (torchao)": 4 + 4 + 2 * (1 + 4 / 256), "ZeRO-3 over 8 (fsdp, bf16-mixed)": 2.0,
          "ZeRO-3 over 64 (fsdp, bf16-mixed)": 0.25}


def measure(name: str) -> dict[str, Any]:
    """In a fresh process: build ``name`` on meta, estimate every plan; wall time, peak RSS, bytes per parameter."""
    quiet()
    import torch

    from autotune import estimate

    started = time.perf_counter()
    model = build(SHAPES[name])
    params = sum(p.numel() for p in model.parameters())
    tensors = sum(1 for _ in model.parameters())
    batch = (torch.zeros(1, CONTEXT, dtype=torch.long), torch.zeros(1, CONTEXT, dtype=torch.long))
    rows = []
    for label, plan, world in plans():
        t = time.perf_counter()
        e = estimate(model=model, batch=batch, plan=plan, device="cpu", world_size=world)
        state = e.parameters_bytes + e.gradients_bytes + e.optimizer_state_bytes - e.gathered_bytes
        steps = 4 * tensors  # AdamW's 0-dim step per parameter tensor, whole on every rank
        rows.append({"plan": label, "seconds": time.perf_counter() - t, "peak_bytes": e.predicted_peak_bytes,
                     "state_per_param": (state - steps) / params, "closed_per_param": CLOSED[label],
                     "gathered_bytes": e.gathered_bytes, "activations_bytes": e.activations_bytes})
    return {"model": name, "params": params, "seconds": time.perf_counter() - started,
            "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "rows": rows}


def capacity_of(name: str, device_memory: int = 80 * 2**30, max_world_size: int = 64) -> dict[str, Any]:
    """In a fresh process: the smallest number of what-if CUDA devices of ``device_memory`` for ``name`` (built on
    meta, 4 samples per rank), as ``autotune estimate --device cuda --device-memory 80GiB --max-world-size 64``."""
    quiet()
    import torch

    from autotune import estimate_capacity

    started = time.perf_counter()
    model = build(SHAPES[name])
    batch = (torch.zeros(4, CONTEXT, dtype=torch.long), torch.zeros(4, CONTEXT, dtype=torch.long))
    rows = estimate_capacity(model=model, batch=batch, device="cuda", device_memory_bytes=device_memory,
                             max_world_size=max_world_size)
    return {"model": name, "seconds": time.perf_counter() - started,
            "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "rows": [{"world_size": r.world_size, "fits": r.fits, "plan": r.estimate.plan.describe(),
                      "peak_bytes": r.estimate.predicted_peak_bytes} for r in rows]}


def main() -> None:
    parser = make_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="125M and 1.3B only")
    add_json(parser)
    args = parser.parse_args()
    quiet()
    m = machine("cpu")
    print(machine_line(m))
    names = ["125M", "1.3B"] if args.quick else list(SHAPES)
    results = [in_fresh_process(measure, name) for name in names]
    print(f"\nOne estimate per plan ({len(plans())} plans), model built on meta, one fresh process per model\n")
    print(markdown_table(["model", "parameters", "wall (all plans)", "per estimate", "peak RSS"],
                         [[r["model"], f"{r['params'] / 1e9:.2f} B", f"{r['seconds']:.1f} s",
                           f"{max(x['seconds'] for x in r['rows']):.1f} s max",
                           f"{r['max_rss_bytes'] / 2**30:.2f} GiB"] for r in results], right=(1, 2, 3, 4)))
    seven = next((r for r in results if r["model"] == "7B"), None)
    if seven:
        ok = seven["seconds"] <= GOAL_7B_SECONDS and seven["max_rss_bytes"] <= GOAL_7B_RSS
        print(f"\n7B: {seven['seconds']:.1f} s, {seven['max_rss_bytes'] / 2**30:.2f} GiB peak RSS "
              f"(goal < {GOAL_7B_SECONDS:.0f} s, < 2 GiB): {'met' if ok else 'NOT met'}")
    ten = next((r for r in results if r["model"] == "10B"), results[-1])
    print(f"\nModel state per parameter, {ten['model']} ({ten['params'] / 1e9:.2f} B parameters), one rank: the estimator "
          "against the closed form\n")
    print(markdown_table(["plan", "estimator", "closed form", "one rank's peak (micro-batch 1)"],
                         [[x["plan"], f"{x['state_per_param']:.3f} B", f"{x['closed_per_param']:.3f} B",
                           f"{x['peak_bytes'] / 2**30:.1f} GiB"] for x in ten["rows"]], right=(1, 2, 3)))
    cap = in_fresh_process(capacity_of, "1.3B" if args.quick else "7B")
    print(f"\nCapacity, {cap['model']} on what-if 80 GiB CUDA devices (4 samples of {CONTEXT} tokens per rank): "
          f"{cap['seconds']:.1f} s, {cap['max_rss_bytes'] / 2**30:.2f} GiB peak RSS\n")
    print(markdown_table(["devices", "fits", "plan (closest where none fits)", "peak per rank"],
                         [[str(r["world_size"]), "yes" if r["fits"] else "no", r["plan"],
                           f"{r['peak_bytes'] / 2**30:.2f} GiB"] for r in cap["rows"]], right=(0, 3)))
    write_json(args.json, {"machine": m, "results": results, "capacity": cap})


if __name__ == "__main__":
    main()
