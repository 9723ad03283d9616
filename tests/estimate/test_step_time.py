"""The step-time model: what it counts of a traced step (FLOPs, bytes, host-link copies, by phase), the rooflines it
sums against a device's speeds, what-if rankings whose order is certain, the devices table, and this machine's device
measured once and cached."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from collections.abc import Callable
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

from autotune import Plan, predict_speed
from autotune._estimate import local_speed
from autotune._estimate.devices import KNOWN_DEVICES, DeviceSpeed, device_type, peak_flops_for
from autotune._estimate.fake_step import step_tracker
from autotune._estimate.speed import SpeedModel
from autotune._estimate.trace import Traces
from autotune._estimate.step_time import BOUNDS, step_parts
from autotune._estimate.work import OpWork, StepWork, WorkCounter

BATCH, WIDTH, OUT = 16, 64, 8


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


class Stack(L.LightningModule):
    """Two repeated bias-free linear blocks and a head, SGD: FLOPs known by hand."""

    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(2))
        self.head = nn.Linear(width, OUT, bias=False)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        for block in self.blocks:
            x = block(x)
        return nn.functional.mse_loss(self.head(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _batch(size: int = BATCH, width: int = WIDTH) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(size, width), torch.randn(size, OUT)


def test_the_flops_of_a_known_step_are_counted_exactly_by_phase() -> None:
    b, w, o = BATCH, WIDTH, OUT
    work = Traces(model=Stack(), batch=_batch(), plan=Plan(), device="cpu", optimizer=None).work(BATCH)
    assert work.flops("forward") == 2 * (2 * b * w * w) + 2 * b * w * o
    # head: input and weight gradients; the second block: both; the first: its weight's only (x needs none)
    assert work.flops("backward") == 2 * (2 * b * w * o) + 3 * (2 * b * w * w)
    assert work.flops("recompute") == 0
    checkpointed = Traces(model=Stack(), batch=_batch(), plan=Plan(activation_checkpointing=1.0), device="cpu",
                          optimizer=None).work(BATCH)
    assert checkpointed.flops("recompute") == 2 * (2 * b * w * w)  # both blocks' forward once more
    assert checkpointed.model_flops_per_sample() == work.model_flops_per_sample() == work.flops(
        "forward", "backward") / b
    assert work.parameter_bytes == work.gradient_bytes == 4 * (2 * w * w + w * o) and work.units == 3


def test_bytes_are_each_tensor_read_or_written_once_and_copies_off_the_device_cross_the_host_link() -> None:
    counter = WorkCounter("cpu")
    a, row, c = torch.randn(4, 8), torch.randn(8), torch.randn(8, 16)
    with step_tracker(counter=counter):
        torch.add(a, row)  # 32 + 8 + 32 values
        torch.add(a, row.expand(4, 8))  # a broadcast input's real elements only
        a.view(32)  # a view: the host's cost, no bytes
        torch.mm(a, c)
        a.to("meta")  # off the device (a what-if trace's host)
    add, expand, broadcast, view, mm, copy = counter.ops
    assert (add.bytes, add.flops, add.host_link) == (4 * 72, 0, False)
    assert broadcast.bytes == 4 * 72 and (view.bytes, view.flops) == (expand.bytes, expand.flops) == (0, 0)
    assert (mm.flops, mm.bytes, mm.dtype) == (2 * 4 * 8 * 16, 4 * (32 + 128 + 64), "fp32")
    assert copy.host_link and copy.bytes == 4 * 32
    q = torch.randn(2, 4, 8, 16)  # batch 2, 4 heads: attention's fixed cost is per head
    counter.ops.clear()
    with step_tracker(counter=counter):
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
    [attention] = [op for op in counter.ops if op.flops]
    assert attention.attention and attention.heads == 8 and attention.flops == 2 * (2 * 2 * 4 * 8 * 8 * 16)


def _speed(**changes: Any) -> DeviceSpeed:
    return dataclasses.replace(KNOWN_DEVICES["h100-sxm"], **changes)


WIDE = 8192  # matrix products of 8192 x 8192 x 8192: an H100's compute, not its launches, sets the step


@pytest.fixture(scope="module")
def wide() -> Callable[..., float]:
    """Seconds per step of a plan of the wide stack on a device (what-if CUDA; traced once per shape, weights on the
    meta device and an uninitialized batch: nothing is computed)."""
    with torch.device("meta"):
        model = Stack(width=WIDE)
    batch = (torch.empty(WIDE, WIDE), torch.empty(WIDE, OUT))
    traces: dict[str, Traces] = {}

    def seconds(plan: Plan, speed: DeviceSpeed, *, world: int = 1) -> float:
        shape = plan.replace(micro_batch_size=None)
        if shape.key() not in traces:
            traces[shape.key()] = Traces(model=model, batch=batch, plan=shape, device="cuda", optimizer=None)
        work = traces[shape.key()].work(WIDE)
        return SpeedModel(speed, batch_size=WIDE).predict(work, plan, world_size=world).seconds_per_step

    return seconds


def test_what_if_rankings_whose_order_is_certain(wide: Callable[..., float]) -> None:
    h100 = _speed()
    # offloading activations costs more over a slower host link
    slow_link = _speed(name="slow", host_link_bandwidth=h100.host_link_bandwidth / 8)
    penalty = {s.name: wide(Plan(activation_offload=True), s) - wide(Plan(), s) for s in (h100, slow_link)}
    assert 0 < penalty[h100.name] < penalty["slow"]
    # bf16 gains where its peak is higher than fp32's, and not where it is the same
    flat = _speed(name="flat", flops={**h100.flops, "bf16": h100.flops["fp32"], "tf32": h100.flops["fp32"]})
    gain = {s.name: wide(Plan(precision="bf16-mixed"), s) / wide(Plan(), s) for s in (h100, flat)}
    assert gain[h100.name] < 0.5 < 0.9 < gain["flat"]
    # recomputation costs time; more micro-batches cost launches (and smaller products)
    assert wide(Plan(), h100) < wide(Plan(activation_checkpointing=0.5), h100) < wide(
        Plan(activation_checkpointing=1.0), h100)
    assert wide(Plan(micro_batch_size=WIDE), h100) < wide(Plan(micro_batch_size=64), h100)
    # DDP's all-reduce over a slow interconnect
    ddp = Plan(strategy="ddp")
    assert wide(ddp, _speed(interconnect_bandwidth=1e9), world=8) > 2 * wide(ddp, h100, world=8)


def test_what_if_predictions_name_their_bound(wide: Callable[..., float]) -> None:
    tiny = predict_speed(model=Stack(), batch=_batch(), plan=Plan(precision="bf16-mixed"), device_type="h100")
    assert tiny.bound == "launch" and tiny.world_size == 1 and tiny.samples_per_second > 0
    with torch.device("meta"):
        model = Stack(width=WIDE)
    big = predict_speed(model=model, batch=(torch.empty(WIDE, WIDE), torch.empty(WIDE, OUT)),
                        plan=Plan(precision="bf16-mixed"), device_type="h100")
    assert big.bound == "compute" and 0.3 < big.mfu < 0.7  # a datasheet's peak at 70%, less the memory-bound ops


def test_a_cpus_pointwise_math_its_caches_and_fresh_pages() -> None:
    cpu = DeviceSpeed(name="cpu", kind="cpu", flops={"fp32": 1e11}, memory_bandwidth=1e10, host_link_bandwidth=1e10,
                      interconnect_bandwidth=1e9, launch_seconds=0.0, measured=True,
                      pointwise_seconds={"tanh|fp32": 2e-9, "add|fp32": 1e-10}, bandwidth_by_size=((2**23, 4e10),),
                      fresh_page_bandwidth=2e9)
    mega = 2**20

    def seconds(op: OpWork) -> dict[str, float]:
        work = StepWork(ops=(op,), micro_batch_size=1)
        parts = step_parts(work, Plan(micro_batch_size=1), device=cpu, batch_size=1,
                           efficiency=dict.fromkeys(BOUNDS, 1.0))
        return {b: v for b, v in parts.seconds.items() if v}

    # a tanh over a million values in the caches: its math (2 ns a value), not its 8 MiB at 40 GB/s
    assert seconds(OpWork("forward", 0.0, 8 * mega, "fp32", elements=mega, kernel="tanh")) == {"compute": 2e-9 * mega}
    # an add whose 12 MiB leave the caches: the memory's bandwidth, not its arithmetic
    assert seconds(OpWork("forward", 0.0, 12 * mega, "fp32", elements=mega)) == {"memory": 12 * mega / 1e10}
    # 64 MiB made anew each time: its pages faulted in
    big = seconds(OpWork("forward", 0.0, 128 * mega, "fp32", elements=16 * mega, written=64 * mega))
    assert big == {"memory": pytest.approx(128 * mega / 1e10 + 64 * mega / 2e9)}


def test_the_devices_table_by_name_and_a_bad_name_in_one_line() -> None:
    assert device_type("H100") is KNOWN_DEVICES["h100-sxm"] and device_type("a100") is KNOWN_DEVICES["a100-80gb"]
    assert peak_flops_for("NVIDIA H200", (9, 0), 132, "32-true") == KNOWN_DEVICES["h200"].flops["tf32"]
    with pytest.raises(ValueError, match=r"^--device-type 'h900' is not a known device; known: h100-sxm, .*l4.*$"):
        device_type("h900")


def test_this_machines_device_is_measured_once_and_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(local_speed, "_MATMUL_SIZES", {"cpu": (16, 64)})  # the real kernels, small
    monkeypatch.setattr(local_speed, "_COPY_BYTES", {"cpu": 2**20})
    monkeypatch.setattr(local_speed, "_CACHED_COPIES", {"cpu": (2**16,)})
    monkeypatch.setattr(local_speed, "_POINTWISE_VALUES", 2**12)
    monkeypatch.setattr(local_speed, "_attention", lambda device, dtype, sync: {"forward": (1e9, 0.0),
                                                                                  "backward": (1e9, 0.0)})
    monkeypatch.setattr(local_speed, "_fresh_page_bandwidth", lambda sync: 1e9)  # 64 MiB written 16 times
    speed = local_speed.local_device_speed(torch.device("cpu"))
    assert speed.measured and speed.kind == "cpu" and not speed.asynchronous
    assert min(speed.flops["fp32"], speed.memory_bandwidth, speed.launch_seconds) > 0
    assert speed.pointwise_seconds["tanh|bf16"] > 0 and speed.pointwise_seconds["add|fp32"] > 0
    [key] = json.loads((tmp_path / "device-speed.json").read_text())
    assert key.startswith("cpu|") and f"torch {torch.__version__}" in key and "threads" in key

    def measure(device: torch.device) -> DeviceSpeed:
        raise AssertionError("measured again")

    monkeypatch.setattr(local_speed, "measure_device", measure)
    assert local_speed.local_device_speed(torch.device("cpu")) == speed  # from the file
    with pytest.raises(AssertionError, match="measured again"):
        local_speed.local_device_speed(torch.device("cpu"), refresh=True)
