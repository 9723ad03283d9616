"""Dynamic padding: ElasticBatchSize on batches whose memory follows their shape, against the fewest micro-batches.

Trains the padded-LM example (``examples/padded``: every batch padded to its own longest sample, most about 16 tokens,
a few up to 8x longer, 32 samples per step) with ``ElasticBatchSize()`` (its defaults) while a memory rule raises
``torch.OutOfMemoryError`` at the real places: the *tokens* rule in forward when a micro-batch holds more than
``capacity`` tokens (samples x padded length), the *length-squared* rule in backward (a hook on the logits) when
samples x length^2 passes its capacity, as materialised attention scores would. For each rule it reports the OOMs, the
micro-batches run against the fewest that fit each batch (``ceil(32 / largest fitting micro-batch)``, summed), whether
every sample was seen once per step, ``global_step`` against the number of batches, and the largest weight difference
to the same steps computed on whole batches by plain Lightning (dropout 0; in float64 on the CPU, where fp32's
summation order would otherwise show). The ``fixed`` rows run the same callback
told that every batch has one size (``sample_size=lambda batch: 1.0``): the micro-batch policy before shapes counted.
The *memory* rule (CUDA only) raises nothing: a larger model of the same kind (``MEMORY_MODEL``, float64) trains
under an allocator cap (``torch.cuda.set_per_process_memory_fraction``, set before ``fit``, which the default
callback takes as its limit) of ``MEMORY_ROOM`` x the peak of a steady whole-batch step at twice the typical length,
so the longest batches run out of real memory; its "fewest" comes from probing, under the same cap, the largest
micro-batch whose forward and backward run at each padded length (a binary search per length).
"shape model us/step" is the host time of the model's per-step work (the batch's sample size, the split's choice,
taking note of the step), timed by wrapping those calls.

    python benchmarks/dynamic_padding.py            # 240 steps per run, seeds 0-2
    python benchmarks/dynamic_padding.py --quick    # 60 steps, seed 0 (what the test suite runs)
    python benchmarks/dynamic_padding.py --device cuda   # the simulated rules and the real-memory rule on a GPU
    python benchmarks/dynamic_padding.py --device cuda --quick --rule memory   # real memory only, 60 steps
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from _common import ROOT, add_json, machine, machine_line, make_parser, markdown_table, quiet, write_json  # noqa: E402

PADDED_DIR = ROOT / "examples" / "padded"
#: The effective batch, the typical and longest padded lengths, and the model.
BATCH, SHORT, LONGEST = 32, 16, 128
MODEL = {"vocab_size": 64, "width": 32, "heads": 2, "layers": 1, "dropout": 0.0, "lr": 3e-3}
#: Capacities: the tokens rule lets the typical batch run whole (32 x 16 tokens x 1.3) and the longest in 7
#: micro-batches; the length-squared rule lets batches up to 32 tokens run whole and the longest in 16.
CAPACITY = {"tokens": int(BATCH * SHORT * 1.3), "length2": 2 * LONGEST**2}
#: Goals of the issue: at most this many OOMs and this ratio to the fewest micro-batches over 240 steps.
GOAL_OOMS, GOAL_RATIO = 6, 1.15
#: The real-memory rule (CUDA): a model (21M parameters, float64) whose cap is over a GiB, so that the allocator's
#: 20 MiB segments are a small step of it, and whose longest batch needs a few GiB; capped at ``MEMORY_ROOM`` x the peak
#: of a steady whole-batch step at ``MEMORY_FIT_LENGTH`` tokens (most batches run whole, the longest need several).
MEMORY_MODEL = {"vocab_size": 8192, "width": 512, "heads": 8, "layers": 4, "dropout": 0.0, "lr": 3e-3}
MEMORY_ROOM, MEMORY_FIT_LENGTH = 1.1, 2 * SHORT


def _cost(rule: str, samples: int, length: int) -> int:
    return samples * length if rule == "tokens" else samples * length * length


def fewest(rule: str, length: int, memory: RealMemory | None = None) -> int:
    """The fewest micro-batches that fit a batch of ``BATCH`` samples padded to ``length`` under ``rule`` (``memory``:
    the real-memory rule's probed sizes)."""
    if rule == "memory":
        if memory is None:
            raise ValueError("the memory rule's fewest micro-batches need its probe (RealMemory)")
        return math.ceil(BATCH / memory.largest[length])
    largest = max(m for m in range(1, BATCH + 1) if m == 1 or _cost(rule, m, length) <= CAPACITY[rule])
    return math.ceil(BATCH / largest)


class RealMemory:
    """The memory rule's cap on a CUDA device and, under it, the largest micro-batch whose forward and backward run at
    each padded length (probed once on a copy of the model with its gradients and AdamW state allocated, as in a step
    after the first; the probe's model is freed before training)."""

    def __init__(self, device: str) -> None:
        import gc

        import torch

        self.device = torch.device(device)
        # The fraction calls take an index (``cuda`` alone is refused); the others accept either.
        self.index = self.device.index if self.device.index is not None else (
            torch.cuda.current_device() if self.device.type == "cuda" else 0)
        _, PaddedLM, _ = _imports()
        torch.manual_seed(0)
        model = PaddedLM(**MEMORY_MODEL, max_length=LONGEST).to(device=self.device, dtype=torch.float64)
        optimizer = model.configure_optimizers()
        for _ in range(2):  # the second step is a steady one: AdamW's state is there through forward and backward
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self._fits(model, BATCH, MEMORY_FIT_LENGTH)  # uncapped: a steady step's peak at this length sets the cap
            optimizer.step()
        self.steady_peak = torch.cuda.max_memory_reserved(self.device)
        self.cap = int(MEMORY_ROOM * self.steady_peak)
        self.fraction = self.cap / torch.cuda.mem_get_info(self.device)[1]
        self.largest: dict[int, int] = {}
        with self.capped():
            for length in range(1, LONGEST + 1):  # a binary search per length: one odd failure stays local
                low, high = 1, BATCH  # the answer lies in [low, high]; 1 is the floor whatever happens
                while low < high:
                    middle = (low + high + 1) // 2
                    low, high = (middle, high) if self._fits(model, middle, length) else (low, middle - 1)
                self.largest[length] = low
        del model, optimizer
        gc.collect()
        torch.cuda.empty_cache()

    def _fits(self, model: Any, samples: int, length: int) -> bool:
        import torch

        try:
            ids = torch.randint(1, MEMORY_MODEL["vocab_size"], (samples, length), device=self.device)
            model.loss({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}).backward()
            return True
        except torch.OutOfMemoryError:
            return False
        finally:
            ids = None  # the batch and any activations an OOM left referenced go before the next probe
            torch.cuda.empty_cache()

    @contextlib.contextmanager
    def capped(self) -> Iterator[None]:
        """The allocator capped at ``cap`` while the block runs (the previous fraction back after it)."""
        import torch

        before = torch.cuda.get_per_process_memory_fraction(self.index)
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(self.fraction, self.index)
        try:
            yield
        finally:
            torch.cuda.set_per_process_memory_fraction(before, self.index)
            torch.cuda.empty_cache()

    def describe(self) -> str:
        mib = 2**20
        return (f"memory rule: allocator cap {self.cap / mib:.0f} MiB ({MEMORY_ROOM} x a steady whole-batch step's peak "
                f"at length {MEMORY_FIT_LENGTH}, {self.steady_peak / mib:.0f} MiB); largest micro-batch that fits: "
                + ", ".join(f"length {n}: {self.largest[n]}" for n in (SHORT, 2 * SHORT, LONGEST // 2, LONGEST - 1)))


def _imports() -> tuple[Any, Any, Any]:
    if str(PADDED_DIR) not in sys.path:
        sys.path.insert(0, str(PADDED_DIR))
    from padded_data import PaddedTokens, pad_collate  # type: ignore[import-not-found]
    from padded_model import PaddedLM  # type: ignore[import-not-found]

    return PaddedTokens, PaddedLM, pad_collate


def run(*, rule: str, policy: str, steps: int, seed: int, device: str = "cpu",
        memory: RealMemory | None = None) -> dict[str, Any]:
    """One training run of ``steps`` steps under ``rule`` ("tokens", "length2", "memory": ``memory``'s cap, or any
    other name: no rule), ``policy`` "shape" (the callback's defaults) or "fixed" (every batch told it has one size);
    with "reference" no callback and no rule: whole batches, plain Lightning (``memory`` given: its model)."""
    import lightning as L
    import torch

    from autotune.callbacks import ElasticBatchSize

    PaddedTokens, PaddedLM, _ = _imports()

    class Faulty(PaddedLM):  # type: ignore[misc, valid-type]
        """The memory rule, raised where a real OOM surfaces; records the ids every micro-batch ran."""

        def training_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
            samples, length = batch["input_ids"].shape
            self.attempts.append(batch["ids"].tolist())
            if rule == "tokens" and _cost(rule, samples, length) > CAPACITY[rule]:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated: tokens rule, in forward)")
            loss = self.loss(batch)
            if rule == "length2" and _cost(rule, samples, length) > CAPACITY[rule]:
                def fail(grad: Any) -> Any:
                    raise torch.OutOfMemoryError("CUDA out of memory (simulated: length-squared rule, in backward)")
                loss.register_hook(fail)
            return loss

    class Record(L.Callback):
        def __init__(self) -> None:
            self.lengths: list[int] = []
            self.micro_batches = 0
            self.exact = True
            self.host_s = 0.0  # time in the shape model's per-step work (sample size, choice, taking note)
            self.trace: list[dict[str, Any]] = []  # the memory rule's steps: length, split, the allocator's peaks

        def on_train_start(self, trainer: Any, module: Any) -> None:
            if elastic is None:
                return
            shapes = elastic.engine.shapes
            for owner, name in ((shapes, "start"), (shapes, "micro"), (shapes.model, "fitted"),
                                (shapes.model, "failed"), (shapes.model, "set_memory")):
                setattr(owner, name, self._timed(getattr(owner, name)))

        def _timed(self, fn: Any) -> Any:
            def timed(*args: Any, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.host_s += time.perf_counter() - start
            return timed

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.lengths.append(int(batch["input_ids"].shape[1]))
            engine = elastic.engine if elastic is not None else None
            count = len(engine.sizes) if engine is not None else 1
            self.micro_batches += count
            ran = [i for ids in module.attempts[-count:] for i in ids]  # the attempt that succeeded
            self.exact = self.exact and ran == batch["ids"].tolist()
            module.attempts.clear()
            if memory is not None and rule == "memory" and engine is not None:  # what bound each step's split
                model = engine.shapes.model
                self.trace.append({"length": self.lengths[-1], "micro": engine.sizes[0], "count": count,
                                   "allocated": torch.cuda.max_memory_allocated(), "static": model.static_bytes,
                                   "reserved": torch.cuda.max_memory_reserved(), "limit": model.limit_bytes})

    L.seed_everything(seed, verbose=False)
    data = PaddedTokens(vocab_size=MODEL["vocab_size"], batch_size=BATCH, short=SHORT, longest=LONGEST,
                        num_samples=steps * BATCH, seed=seed)
    model = Faulty(**(MEMORY_MODEL if memory is not None else MODEL), max_length=LONGEST)
    model.attempts = []
    data.train_dataloader = _with_ids(data)  # type: ignore[method-assign]
    elastic = None
    if policy == "shape":
        elastic = ElasticBatchSize()
    elif policy == "fixed":
        elastic = ElasticBatchSize(sample_size=lambda batch: 1.0)
    record = Record()
    # 64-bit on the CPU and for real memory: a split sums a batch's gradient in another order than a whole batch, and
    # AdamW turns fp32's rounding of that into differences of 1e-4 over a few hundred steps; in float64 only the
    # method's error is left.
    precision = "64-true" if device == "cpu" or memory is not None else "32-true"
    trainer = L.Trainer(accelerator=device, devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                        precision=precision,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[c for c in (elastic, record) if c is not None])
    start = time.perf_counter()
    with memory.capped() if memory is not None and rule == "memory" else contextlib.nullcontext():
        trainer.fit(model, datamodule=data)
    wall = time.perf_counter() - start
    rule_for_count = rule if rule in CAPACITY or rule == "memory" else None
    return {
        "rule": rule, "policy": policy, "seed": seed, "steps": steps, "wall_s": wall,
        "global_step": trainer.global_step, "batches": len(record.lengths),
        "ooms": elastic.engine.oom_events if elastic is not None and elastic.engine is not None else 0,
        "micro_batches": record.micro_batches,
        "fewest": sum(fewest(rule_for_count, n, memory) for n in record.lengths) if rule_for_count else None,
        "every_sample_once": record.exact,
        "weights": [p.detach().cpu().clone() for p in model.parameters()],
        "longest_batch": max(record.lengths), "shortest_batch": min(record.lengths),
        "host_us_per_step": 1e6 * record.host_s / max(1, len(record.lengths)),
        **({"trace": record.trace} if record.trace else {}),
    }


def split_beyond(row: dict[str, Any], memory: RealMemory) -> list[str]:
    """Lines on the memory rule's steps split into more micro-batches than the probe's fewest: how many, and by
    padded length the tensors' peak over the step's static part per sample-token, against the model's byte cap (a
    cost per token that falls with the length is a part of the step that does not grow with the batch)."""
    mib, trace = 2**20, row["trace"]
    over = [t for t in trace if t["count"] > fewest("memory", t["length"], memory)]
    limits = {t["limit"] for t in trace if t["limit"]}
    lines = [f"split beyond the fewest: {len(over)} of {len(trace)} steps ({row['policy']}); the model's cap on a "
             f"step's tensors {', '.join(f'{x / mib:.0f}' for x in sorted(limits)) or '-'} MiB, static "
             f"{max(t['static'] for t in trace) / mib:.0f} MiB"]
    for low, high in ((1, 16), (17, 32), (33, 64), (65, LONGEST)):
        steps = [t for t in trace if low <= t["length"] <= high]
        if not steps:
            continue
        per_token = [(t["allocated"] - t["static"]) / (t["micro"] * t["length"]) / 1024 for t in steps]
        run = [t["micro"] for t in steps]
        probed = [memory.largest[t["length"]] for t in steps]
        lines.append(f"  lengths {low}-{high}: {len(steps)} steps, {sum(t in over for t in steps)} split beyond; "
                     f"micro-batch run {min(run)}-{max(run)}, the probe's {min(probed)}-{max(probed)}; tensors over "
                     f"static {min(per_token):.0f}-{max(per_token):.0f} KiB per sample-token, peak "
                     f"{max(t['allocated'] for t in steps) / mib:.0f} MiB, reserve "
                     f"{max(t['reserved'] for t in steps) / mib:.0f} MiB")
    return lines


def _with_ids(data: Any) -> Any:
    """The datamodule's loader, each batch carrying its samples' ids (to check every sample runs once per step)."""
    import torch
    from torch.utils.data import DataLoader

    _, _, pad_collate = _imports()

    def collate(items: list[tuple[int, Any]]) -> dict[str, Any]:
        batch = pad_collate([sample for _, sample in items])
        batch["ids"] = torch.tensor([i for i, _ in items])
        return batch

    def loader() -> DataLoader:
        dataset = [(i, s) for i, s in enumerate(data.train.samples)]
        return DataLoader(dataset, batch_size=data.batch_size, shuffle=False, collate_fn=collate, drop_last=True)

    return loader


def measure(*, rules: list[str], steps: int, seeds: list[int], device: str,
            memory: RealMemory | None = None) -> list[dict[str, Any]]:
    """Every rule x policy x seed, each beside the same seed's whole-batch reference (of its own model)."""
    rows = []
    for seed in seeds:
        references: dict[bool, dict[str, Any]] = {}
        for rule in rules:
            real = memory if rule == "memory" else None
            if (real is not None) not in references:
                references[real is not None] = run(rule="none", policy="reference", steps=steps, seed=seed,
                                                   device=device, memory=real)
            reference = references[real is not None]
            for policy in ("shape", "fixed"):
                result = run(rule=rule, policy=policy, steps=steps, seed=seed, device=device, memory=real)
                result["max_weight_diff"] = max(float((a - b).abs().max())
                                                for a, b in zip(result.pop("weights"), reference["weights"]))
                result["ratio"] = (result["micro_batches"] / result["fewest"]) if result["fewest"] else None
                rows.append(result)
    return rows


def report(rows: list[dict[str, Any]], info: dict[str, Any], memory: RealMemory | None = None) -> str:
    header = ["rule", "policy", "seed", "steps", "OOMs", "micro-batches", "fewest", "ratio", "global_step = batches",
              "every sample once", "max weight diff", "padded lengths", "shape model us/step", "wall s"]
    body = []
    for r in rows:
        body.append([r["rule"], r["policy"], str(r["seed"]), str(r["steps"]), str(r["ooms"]), str(r["micro_batches"]),
                     str(r["fewest"]), f"{r['ratio']:.3f}" if r["ratio"] else "-",
                     "yes" if r["global_step"] == r["batches"] == r["steps"] else "NO",
                     "yes" if r["every_sample_once"] else "NO", f"{r['max_weight_diff']:.1e}",
                     f"{r['shortest_batch']}-{r['longest_batch']}", f"{r['host_us_per_step']:.0f}",
                     f"{r['wall_s']:.1f}"])
    shape = [r for r in rows if r["policy"] == "shape" and r["ratio"]]
    lines = [machine_line(info), *([info["memory_rule"]] if info.get("memory_rule") else []), "",
             markdown_table(header, body), ""]
    if shape:
        worst_ooms = max(r["ooms"] for r in shape)
        worst_ratio = max(r["ratio"] for r in shape)
        lines.append(f"shape-aware (defaults): OOMs at most {worst_ooms} (goal <= {GOAL_OOMS} over 240 steps), ratio "
                     f"to the fewest micro-batches at most {worst_ratio:.3f} (goal <= {GOAL_RATIO}); the shape "
                     "model's host "
                     f"time at most {max(r['host_us_per_step'] for r in shape):.0f} us per step (goal <= 100; timed "
                     "with wrappers, which add about 1 us a call)")
    for r in rows:
        if memory is not None and r.get("trace"):
            lines += split_beyond(r, memory)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="60 steps, seed 0")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--rule", action="append", choices=["tokens", "length2", "memory"],
                        help="the memory rule(s) to run (default: tokens and length2, and memory on CUDA)")
    add_json(parser)
    args = parser.parse_args(argv)
    rules = args.rule or ["tokens", "length2", *(["memory"] if args.device == "cuda" else [])]
    if "memory" in rules and args.device != "cuda":
        parser.error("--rule memory needs --device cuda (a real allocator cap); on a CPU use tokens or length2")
    quiet()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no CUDA device")
    torch.set_num_threads(1)
    steps, seeds = (60, [0]) if args.quick else (240, [0, 1, 2])
    info = machine(args.device)
    memory = RealMemory(args.device) if "memory" in rules else None
    if memory is not None:
        info["memory_rule"] = memory.describe()
    rows = measure(rules=rules, steps=steps, seeds=seeds, device=args.device, memory=memory)
    print(report(rows, info, memory))
    write_json(args.json, {"machine": info, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
