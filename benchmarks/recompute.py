"""Checkpointing chosen by the estimator (``activation_checkpointing: auto``) against fixed shares and no checkpointing.

For each model, with its batch ``B`` and budgets between the predicted peak of checkpointing every block and that of
none (so no checkpointing does not fit at ``B``), in the estimator's measure (the step's tensor bytes):

- **auto**: ``autotune.choose_recompute`` at micro-batch ``B`` (its recompute priced on this machine's measured
  speeds): which blocks recompute, and in which the pointwise operators only;
- **0.5** and **1.0**: the first half of the blocks, every block, at ``B``; a share whose predicted peak is over the
  budget is marked as not fitting and not timed;
- **without auto**: the best plan a search without ``auto`` could pick by the estimate: the fastest of the fixed shares
  that fit at ``B`` and no checkpointing at the largest micro-batch that fits (``ElasticBatchSize`` accumulating
  the rest), by the step-time model.

"peak" is each plan's step peak measured on the host (tensor bytes alive, from the profiler's allocator events:
``estimator_accuracy.measure_peak``, its own selective checkpointing policy), against the budget. Speed: paired
rounds of fresh processes (``autotune.compare_plans``: A B, B A, ... until the ratio's 95% interval is clear of 1 or
within 3%, at most 4 rounds), ``auto``'s samples/s over the rival's; > 1: auto is faster.

Models: the GPT example's model at 4 layers (``GPT``, width 128, 64 tokens), transformers' GPT-2 and Llama (4 layers,
width 128, 64 tokens), each trained on random tokens with AdamW. ``--quick``: one budget per model (halfway), fewer
timed steps.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    add_json,
    first_batch,
    machine,
    machine_line,
    make_parser,
    markdown_table,
    quiet,
    use_paths,
    write_json,
)

use_paths(gpt=True)

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from autotune import Plan, choose_recompute, compare_plans, estimate, load_target, predict_speed  # noqa: E402

HERE = Path(__file__).resolve()
BATCH, TOKENS, VOCAB = 16, 64, 256


class Tokens(L.LightningDataModule):
    """Random tokens: ``BATCH`` samples of ``TOKENS`` per batch."""

    def train_dataloader(self) -> DataLoader:
        ids = torch.randint(VOCAB, (BATCH * 64, TOKENS + 1), generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(ids), batch_size=BATCH)


class HF(L.LightningModule):
    """A transformers causal LM on token batches."""

    def __init__(self, name: str) -> None:
        super().__init__()
        import transformers

        if name == "gpt2":
            self.model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
                n_layer=4, n_head=4, n_embd=128, vocab_size=VOCAB, n_positions=TOKENS, use_cache=False))
        else:
            self.model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
                vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=TOKENS, use_cache=False))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        return self.model(input_ids=ids[:, :-1], labels=ids[:, :-1]).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class GPTOnTokens(L.LightningModule):
    """The GPT example's model at 4 layers, on the same tokens."""

    def __init__(self) -> None:
        super().__init__()
        from model import GPT

        self.gpt = GPT(vocab_size=VOCAB, block_size=TOKENS, n_layer=4, n_head=4, n_embd=128, dropout=0.1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.gpt(ids)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        return self.gpt.loss((ids[:, :-1], ids[:, 1:]))

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def make_gpt() -> tuple[L.LightningModule, L.LightningDataModule]:
    torch.manual_seed(0)
    return GPTOnTokens(), Tokens()


def make_gpt2() -> tuple[L.LightningModule, L.LightningDataModule]:
    torch.manual_seed(0)
    return HF("gpt2"), Tokens()


def make_llama() -> tuple[L.LightningModule, L.LightningDataModule]:
    torch.manual_seed(0)
    return HF("llama"), Tokens()


MODELS = {"gpt": "make_gpt", "gpt2": "make_gpt2", "llama": "make_llama"}


def _measure_peak(model: Any, batch: Any, plan: Plan) -> int:
    import estimator_accuracy

    return estimator_accuracy.measure_peak(model=model, batch=batch, plan=plan, device="cpu")


def run_model(name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    spec = f"{HERE}:{MODELS[name]}"
    target = load_target(spec)
    model, batch = target.model, first_batch(target)

    def peak(plan: Plan) -> int:
        return estimate(model=model, batch=batch, plan=plan, device="cpu").predicted_peak_bytes

    plain, full = peak(Plan(micro_batch_size=BATCH)), peak(Plan(micro_batch_size=BATCH, activation_checkpointing=1.0))
    rows = []
    for share in args.budgets:
        budget = int(full + share * (plain - full))
        started = time.perf_counter()
        choice = choose_recompute(model=model, batch=batch, plan=Plan(micro_batch_size=BATCH), budget_bytes=budget,
                                  device="cpu")
        choose_seconds = time.perf_counter() - started
        fixed = {c: Plan(micro_batch_size=BATCH, activation_checkpointing=c) for c in (0.5, 1.0)}
        fits = {c: peak(p) <= budget for c, p in fixed.items()}
        largest = max((m for m in range(1, BATCH + 1) if BATCH % m == 0 and peak(Plan(micro_batch_size=m)) <= budget),
                      default=None)
        rivals = {f"ckpt {c}": p for c, p in fixed.items() if fits[c]}
        if largest is not None:
            rivals[f"no ckpt, micro {largest}"] = Plan(micro_batch_size=largest)
        speed = {label: predict_speed(model=model, batch=batch, plan=p, device="cpu").seconds_per_step
                 for label, p in rivals.items()}
        best = min(speed, key=speed.get) if speed else None
        row: dict[str, Any] = {
            "model": name, "budget_share": share, "budget_bytes": budget, "plain_bytes": plain, "full_bytes": full,
            "recompute": list(choice.plan.recompute or ()), "fits": choice.fits, "choose_seconds": choose_seconds,
            "predicted_bytes": choice.predicted_peak_bytes, "measured_bytes": _measure_peak(model, batch, choice.plan),
            "fixed_fits": {str(c): f for c, f in fits.items()}, "without_auto": best, "ratios": {}}
        for label, plan in rivals.items():
            if label.startswith("ckpt") or label == best:
                ratio, _, _ = compare_plans(target=spec, a=plan, b=choice.plan, device="cpu", steps=args.steps,
                                            warmup=2)
                row["ratios"][label] = {"ratio": ratio.ratio, "low": ratio.low, "high": ratio.high,
                                        "rounds": len(ratio.rounds), "stopped": ratio.stopped}
        rows.append(row)
        print(report_rows([row]), flush=True)
    return rows


def report_rows(rows: list[dict[str, Any]]) -> str:
    header = ("model", "budget", "auto chose", "auto peak / budget", "est. error", "0.5 fits", "vs 1.0", "vs 0.5",
              "vs without auto")
    table = []
    for r in rows:
        def ratio(label: str | None) -> str:
            got = r["ratios"].get(label) if label else None
            return "-" if got is None else f"{got['ratio']:.2f}x [{got['low']:.2f}, {got['high']:.2f}]"

        table.append((r["model"], f"{r['budget_bytes'] / 2**20:.1f} MiB", "/".join(r["recompute"]),
                      f"{r['measured_bytes'] / r['budget_bytes']:.3f}",
                      f"{(r['predicted_bytes'] - r['measured_bytes']) / r['measured_bytes']:+.1%}",
                      "yes" if r["fixed_fits"]["0.5"] else "no", ratio("ckpt 1.0"), ratio("ckpt 0.5"),
                      f"{ratio(r['without_auto'])} ({r['without_auto']})"))
    return markdown_table(header, table, pad=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = make_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="one budget per model, 10 timed steps a run")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    add_json(parser)
    args = parser.parse_args(argv)
    args.budgets = (0.5,) if args.quick else (0.25, 0.5, 0.75)
    args.steps = 10 if args.quick else 20
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    quiet()
    start = time.perf_counter()
    results: dict[str, Any] = {"machine": machine("cpu"), "quick": args.quick, "rows": []}
    for name in args.models:
        results["rows"] += run_model(name, args)
        write_json(args.json, results)
    results["wall_seconds"] = time.perf_counter() - start
    print("\n" + machine_line(results["machine"]) + "\n\n" + report_rows(results["rows"])
          + f"\n\ntotal wall time {results['wall_seconds']:.0f} s")
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
