"""Low-bit and compiler plans against their baselines, side by side in one run (the example GPT, CPU or CUDA).

For each plan, a fresh process trains the example GPT (``--layers`` blocks of ``--width``) for ``--steps`` optimizer
steps with ``ApplyPlan`` and reports:

- the optimizer state as stored (torchao's low-bit tensors count their codes, scales and code maps), and the
  estimator's figure for it;
- the bytes autograd saves for backward in one training step (distinct storages packed by
  ``saved_tensors_hooks``: what ``compile_memory_budget`` trades), on the device;
- the median step time of the last half of the steps (the first ones compile torchao's update and the blocks);
- the final training loss (the same batches for every plan).

Plans: fp32 AdamW (baseline), 8-bit and 4-bit state; bf16-mixed (baseline for) bf16-true with stochastic rounding;
compile (baseline for) compile with a memory budget of 0.5 and 0.0. Ratios are against each group's baseline.

    python benchmarks/lowbit.py            # about 4 minutes on a 2-core CPU
    python benchmarks/lowbit.py --quick    # a smaller model, fewer steps
    python benchmarks/lowbit.py --search 10   # also: does the search's winner change with the new dimensions?
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from _common import (  # noqa: E402
    add_device,
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

#: (label, plan fields, precision, baseline label)
PLANS = [
    ("fp32 AdamW", {}, "32-true", None),
    ("8-bit state", {"optimizer_state": "8bit"}, "32-true", "fp32 AdamW"),
    ("4-bit state", {"optimizer_state": "4bit"}, "32-true", "fp32 AdamW"),
    ("bf16-mixed", {}, "bf16-mixed", None),
    ("bf16-true (stochastic rounding)", {}, "bf16-true", "bf16-mixed"),
    ("compile", {"compile": True}, "32-true", None),
    ("compile, budget 0.5", {"compile": True, "compile_memory_budget": 0.5}, "32-true", "compile"),
    ("compile, budget 0.0", {"compile": True, "compile_memory_budget": 0.0}, "32-true", "compile"),
]


def stored_bytes(t: Any) -> int:
    """Bytes a tensor stores: a tensor subclass (torchao's low-bit state, DTensor) counts its inner tensors."""
    import torch

    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is not None and type(t) is not torch.Tensor:
        return sum(stored_bytes(getattr(t, name)) for name in flatten()[0])
    return t.numel() * t.element_size()


def measure(label: str, fields: dict[str, Any], precision: str, cfg: dict[str, Any]) -> dict[str, Any]:
    quiet()
    use_paths(gpt=True)
    import lightning as L
    import torch
    from data import SyntheticTokens
    from model import GPT

    from autotune import Plan, estimate
    from autotune.callbacks import ApplyPlan

    class Probe(L.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.saved = 0
            self.loss = float("nan")
            self._hooks: Any = None

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step == cfg["steps"] - 1:  # one step's saved tensors, after compilation
                seen: dict[int, int] = {}

                def pack(t: torch.Tensor) -> torch.Tensor:
                    if t.device.type == cfg["device"]:
                        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                    return t

                self._seen = seen
                self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
                self._hooks.__enter__()
            if cfg["device"] == "cuda":
                torch.cuda.synchronize()
            self._start = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if cfg["device"] == "cuda":
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self._start)
            self.loss = float(outputs["loss"])
            if self._hooks is not None:
                self._hooks.__exit__(None, None, None)
                self._hooks = None
                self.saved = sum(self._seen.values())

    torch.manual_seed(0)
    data = SyntheticTokens(vocab_size=256, block_size=cfg["block"], batch_size=cfg["batch"],
                           num_samples=cfg["batch"] * cfg["steps"], val_samples=cfg["batch"])
    model = GPT(vocab_size=256, block_size=cfg["block"], n_layer=cfg["layers"], n_head=4, n_embd=cfg["width"])
    plan = Plan(precision=precision, **fields)
    predicted = estimate(model=model, batch=next(iter(_loader(data))), plan=plan.replace(compile=False,
                         compile_memory_budget=None), device=cfg["device"]).optimizer_state_bytes
    probe = Probe()
    trainer = L.Trainer(max_steps=cfg["steps"], accelerator=cfg["device"], devices=1, precision=precision,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=[*plan.callbacks(), probe])
    trainer.fit(model, data)
    opt = trainer.strategy.optimizers[0]
    state = sum(stored_bytes(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    late = probe.times[len(probe.times) // 2:]
    return {"plan": label, "state_bytes": state, "predicted_state_bytes": predicted, "saved_bytes": probe.saved,
            "step_seconds": statistics.median(late), "loss": probe.loss,
            "params": sum(p.numel() for p in model.parameters())}


def _loader(data: Any) -> Any:
    data.setup("fit")
    return data.train_dataloader()


#: The CPU space plus this issue's dimensions: what the search may pick on this machine.
LOWBIT_SPACE = """description: cpu space plus low-bit optimizer state, bf16-true and compile's memory budget
dimensions:
  precision:
    choices: [32-true, bf16-mixed, bf16-true]
  micro_batch_size:
    choices: [auto, 4, 8, 16, 32]
  activation_checkpointing:
    choices: [0.0, 1.0]
  optimizer_state:
    choices: [full, 8bit, 4bit]
  compile:
    choices: [false, true]
  compile_memory_budget:
    choices: [null, 0.5]
    when: {compile: [true]}
seeds:
  - {precision: 32-true, micro_batch_size: auto, activation_checkpointing: 0.0, optimizer_state: full}
"""


def search_both(budget: str, trials: int) -> list[dict[str, Any]]:
    """The search on the example GPT with the CPU space and with the low-bit one: the winners side by side."""
    import tempfile

    from autotune import search

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        space_file = Path(tmp) / "lowbit.yaml"
        space_file.write_text(LOWBIT_SPACE)
        for name, space in (("cpu", "cpu"), ("cpu + low-bit dimensions", str(space_file))):
            started = time.perf_counter()
            result = search(target=str(Path(_HERE).parent / "examples" / "gpt" / "train.py") + ":make", budget=budget,
                            space=space, trials=trials, seed=0, steps=4, warmup=2, out=None,
                            storage=f"sqlite:///{tmp}/{len(rows)}.db")
            prov = result.plan.provenance
            rows.append({"space": name, "plan": result.plan.describe(), "samples_per_second": prov.samples_per_second,
                         "peak_bytes": prov.peak_bytes, "seconds": time.perf_counter() - started})
    return rows


def main() -> None:
    parser = make_parser(__doc__)
    add_device(parser)
    parser.add_argument("--quick", action="store_true", help="2 blocks of width 128, 12 steps")
    parser.add_argument("--search", type=int, default=0, metavar="TRIALS",
                        help="also search the example GPT with the CPU space and with the low-bit dimensions added "
                        "(TRIALS trials each, budget 2GiB) and print both winners")
    add_json(parser)
    args = parser.parse_args()
    quiet()
    cfg = {"device": args.device, "layers": 2 if args.quick else 4, "width": 128 if args.quick else 256,
           "block": 64, "batch": 16, "steps": 12 if args.quick else 24}
    m = machine(args.device)
    print(machine_line(m))
    print(f"\nExample GPT, {cfg['layers']} blocks of width {cfg['width']}, batch {cfg['batch']} x {cfg['block']} tokens, "
          f"{cfg['steps']} steps, one fresh process per plan\n")
    rows = [in_fresh_process(measure, label, fields, precision, cfg) for label, fields, precision, _ in PLANS]
    by = {r["plan"]: r for r in rows}
    table = []
    for (label, _, _, base), r in zip(PLANS, rows):
        ref = by[base] if base else r
        table.append([label, f"{r['state_bytes'] / 2**20:.2f} MiB",
                      f"{r['predicted_state_bytes'] / max(r['state_bytes'], 1):.3f}",
                      f"{r['state_bytes'] / max(ref['state_bytes'], 1):.2f}x",
                      f"{r['saved_bytes'] / 2**20:.2f} MiB", f"{r['saved_bytes'] / max(ref['saved_bytes'], 1):.2f}x",
                      f"{r['step_seconds'] * 1e3:.1f} ms", f"{r['step_seconds'] / ref['step_seconds']:.2f}x",
                      f"{r['loss']:.4f}"])
    print(markdown_table(["plan", "optimizer state", "estimate / stored", "vs baseline", "saved for backward",
                          "vs baseline", "step (median)", "vs baseline", "final loss"], table,
                         right=(1, 2, 3, 4, 5, 6, 7, 8)))
    print(f"\n{rows[0]['params'] / 1e6:.2f} M parameters; baselines: fp32 AdamW, bf16-mixed, compile")
    found = in_fresh_process(search_both, "2GiB", args.search) if args.search else []
    if found:
        print(f"\nThe search on the example GPT (examples/gpt/train.py:make, budget 2GiB, {args.search} trials, seed 0)\n")
        print(markdown_table(["space", "winner", "samples/s", "peak", "wall"],
                             [[r["space"], r["plan"], f"{r['samples_per_second']:.1f}",
                               f"{(r['peak_bytes'] or 0) / 2**20:.0f} MiB", f"{r['seconds']:.0f} s"] for r in found],
                             right=(2, 3, 4)))
    write_json(args.json, {"machine": m, "config": cfg, "rows": rows, "search": found})


if __name__ == "__main__":
    main()
