"""What the step-time model knows of a device (:class:`DeviceSpeed`): peak dense FLOP/s per dtype, memory, host-link
and interconnect bandwidth, and the host's cost per operator; the table of common GPUs (:data:`KNOWN_DEVICES`, each
figure with its source), the one table both the step-time model and a trial's MFU read. This machine's own device is
measured instead (:mod:`autotune._estimate.local_speed`).

Datasheet figures are peaks: FLOP/s are dense (NVIDIA's datasheets print the 2:4 sparse figure and mark it with an
asterisk: the dense one is half), bandwidths the interface's (NVLink and PCIe as a total over both directions: a
copy one way gets half). What a step reaches of them is the model's efficiency per bound
(:data:`DATASHEET_EFFICIENCY` until trials measure it, :mod:`autotune._estimate.calibration`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

__all__ = ["DATASHEET_EFFICIENCY", "FRESH_PAGES_FROM", "DeviceSpeed", "KNOWN_DEVICES", "device_type", "matching_device",
           "mfu_dtype", "peak_flops_for"]

GB, TB = 1e9, 1e12


@dataclass(frozen=True, kw_only=True)
class DeviceSpeed:
    """The speeds a step's time is predicted from, for one device.

    Attributes:
        name: What it is called (``"NVIDIA H100 SXM5 80GB"``, a CPU's model name).
        kind: ``"cuda"`` or ``"cpu"``.
        flops: Peak dense FLOP/s of matrix products by dtype: ``"fp32"``, ``"tf32"``, ``"bf16"``, ``"fp16"``,
            ``"fp8"`` (a dtype missing runs at ``"fp32"``'s).
        memory_bandwidth: Bytes/s between the device's memory and its cores.
        pointwise_seconds: Where measured, seconds per value written by pointwise operators, keyed
            ``"kernel|dtype"``: each of ``POINTWISE_MATH`` (``"tanh|fp32"``), and ``"add|dtype"`` for all other
            arithmetic (a CPU's bf16 add, converting, is slower than its fp32 one); none on the table's GPUs, whose
            pointwise operators are bound by their bytes.
        fresh_page_bandwidth: A CPU's bytes/s of writing memory the OS has just mapped (its page faults): what
            each tensor of ``FRESH_PAGES_FROM`` bytes or more costs there (None: not measured).
        bandwidth_by_size: Where measured, faster bytes/s of operators that move less (their data stays in the
            caches): ``(bytes moved, bytes/s)`` pairs, smallest first (:meth:`bandwidth`).
        host_link_bandwidth: Bytes/s one way between host and device (PCIe); a CPU's is its memory's.
        interconnect_bandwidth: Bytes/s one way from one device to its peers (NVLink, else PCIe).
        launch_seconds: The host's cost of one operator (Python, dispatcher, autograd, kernel launch).
        matmul_seconds: The device's fixed cost of a matrix product by dtype, beyond its FLOPs (measured devices:
            small products reach less of the peak; none for the table's GPUs).
        attention_flops: FLOP/s of attention kernels where measured, by dtype for the forward (``"bf16"``) and the
            backward (``"bf16 backward"``); else the matrix products' rate.
        attention_seconds: The fixed cost of an attention kernel per head (batch x heads), keyed alike.
        host_memory_bandwidth: Bytes/s of the host's memory, for updates run on the host (optimizer offload).
        memory_bytes: The device's memory (None: not known).
        capability, sm_count, nvml_name: How a GPU present on this machine is matched to this entry (exactly: a near
            match, an H100 PCIe for an SXM, would be wrong).
        measured: Whether the figures were measured on this machine (else a datasheet's).
        source: Where the figures come from.
    """

    name: str
    kind: str
    flops: dict[str, float]
    memory_bandwidth: float
    host_link_bandwidth: float
    interconnect_bandwidth: float
    launch_seconds: float
    matmul_seconds: dict[str, float] = field(default_factory=dict)
    attention_flops: dict[str, float] = field(default_factory=dict)
    attention_seconds: dict[str, float] = field(default_factory=dict)
    bandwidth_by_size: tuple[tuple[float, float], ...] = ()
    pointwise_seconds: dict[str, float] = field(default_factory=dict)
    fresh_page_bandwidth: float | None = None
    host_memory_bandwidth: float = 50 * GB
    memory_bytes: int | None = None
    capability: tuple[int, int] | None = None
    sm_count: int | None = None
    nvml_name: str | None = None
    measured: bool = False
    source: str = field(default="", compare=False)

    @property
    def asynchronous(self) -> bool:
        """Whether the host queues work ahead of the device (CUDA): a step takes the longer of the host's launches and
        the device's work, not their sum."""
        return self.kind == "cuda"

    def bandwidth(self, moved: float) -> float:
        """Bytes/s of an operator moving ``moved`` bytes: the cached figure of the smallest measured size at least as
        large, on a line in log-size towards the next (the memory's beyond the largest).

        Example:
            >>> speed = dataclasses.replace(KNOWN_DEVICES["l4"], bandwidth_by_size=((2**20, 4e11), (2**24, 2e11)))
            >>> speed.bandwidth(2**20), speed.bandwidth(2**22), speed.bandwidth(2**30) == speed.memory_bandwidth
            (400000000000.0, 300000000000.0, True)
        """
        points = [*self.bandwidth_by_size, (math.inf, self.memory_bandwidth)]
        if moved <= points[0][0]:
            return points[0][1]
        for (small, fast), (large, slow) in zip(points, points[1:]):
            if moved <= large:
                if math.isinf(large):
                    return slow
                share = math.log(moved / small) / math.log(large / small)
                return fast + (slow - fast) * share
        return self.memory_bandwidth

    def matmul_flops(self, dtype: str, *, attention: str | None = None) -> float:
        """Peak FLOP/s of a matrix product in ``dtype`` (one of :attr:`flops`' keys; fp32's where missing), or of an
        attention kernel's ``"forward"`` or ``"backward"`` where measured."""
        key = dtype if attention == "forward" else f"{dtype} backward"
        if attention and self.attention_flops.get(key):
            return self.attention_flops[key]
        return self.flops.get(dtype) or self.flops["fp32"]


#: On a CPU, tensors of this many bytes or more come from fresh pages each time they are made: glibc's malloc serves
#: them with mmap and gives them back on free (its dynamic threshold grows no further than 32 MiB), so their first
#: write costs page faults (a VM's took 10x a write to reused memory at 32 MiB and above, 1.1-1.6x at 16-24 MiB).
FRESH_PAGES_FROM = 32 * 2**20
#: What a step reaches of a datasheet's peaks before any trial measured it, by bound: large matrix products about 70%
#: of the dense peak (torch's own runtime estimator assumes 75%), streaming kernels about 80% of the memory bandwidth,
#: a pinned PCIe copy about 80% of the link, NCCL about 75% of NVLink's per-direction figure. Measured devices start
#: at 1.0 (their figures are what a benchmark reached).
DATASHEET_EFFICIENCY = {"compute": 0.7, "memory": 0.8, "host link": 0.8, "interconnect": 0.75, "launch": 1.0}

#: The host's cost of one eager operator on a GPU server (Python, dispatcher, launch): not a datasheet figure, the
#: order of magnitude torch's eager mode shows (a measured local GPU replaces it).
_GPU_LAUNCH_SECONDS = 6e-6
_PCIE5, _PCIE4 = 128 * GB / 2, 64 * GB / 2  # x16, both directions together on the datasheets: one way is half
_NVLINK4, _NVLINK3 = 900 * GB / 2, 600 * GB / 2


def _gpu(name: str, *, fp32: float, tf32: float, bf16: float, fp8: float | None, memory_gb: float, bandwidth: float,
         host_link: float, interconnect: float, capability: tuple[int, int], sm_count: int, nvml_name: str,
         source: str) -> DeviceSpeed:
    flops = {"fp32": fp32, "tf32": tf32, "bf16": bf16, "fp16": bf16}
    if fp8 is not None:
        flops["fp8"] = fp8
    return DeviceSpeed(name=name, kind="cuda", flops=flops, memory_bandwidth=bandwidth, host_link_bandwidth=host_link,
                       interconnect_bandwidth=interconnect, launch_seconds=_GPU_LAUNCH_SECONDS,
                       memory_bytes=int(memory_gb * 2**30), capability=capability, sm_count=sm_count,
                       nvml_name=nvml_name, source=source)


_H100 = "NVIDIA H100 Tensor Core GPU datasheet (2023): sparse figures halved"
_H200 = "NVIDIA H200 Tensor Core GPU datasheet (2024): sparse figures halved"
_A100 = "NVIDIA A100 Tensor Core GPU datasheet (2021): dense figures"
_L4 = "NVIDIA L4 Tensor Core GPU datasheet (2023): sparse figures halved"
_L40S = "NVIDIA L40S datasheet (2023): dense figures"
_ADA = "NVIDIA Ada GPU architecture whitepaper v2.1, appendix A (GeForce RTX 4090): dense, FP32 accumulate"
_A10 = "NVIDIA A10 Tensor Core GPU datasheet (2021): dense figures"

#: Common GPUs by the name ``--device-type`` takes. Memory in GiB as sold (80 GB is 80 GiB of HBM); an NVLink bridge
#: (A100 and H100 PCIe) joins two cards only, so their interconnect is PCIe's.
KNOWN_DEVICES: dict[str, DeviceSpeed] = {
    "h100-sxm": _gpu("NVIDIA H100 SXM5 80GB", fp32=67 * TB, tf32=494.5 * TB, bf16=989.5 * TB, fp8=1979 * TB,
                     memory_gb=80, bandwidth=3.35 * TB, host_link=_PCIE5, interconnect=_NVLINK4, capability=(9, 0),
                     sm_count=132, nvml_name="NVIDIA H100 80GB HBM3", source=_H100),
    "h100-pcie": _gpu("NVIDIA H100 PCIe 80GB", fp32=51 * TB, tf32=378 * TB, bf16=756.5 * TB, fp8=1513 * TB,
                      memory_gb=80, bandwidth=2.0 * TB, host_link=_PCIE5, interconnect=_PCIE5, capability=(9, 0),
                      sm_count=114, nvml_name="NVIDIA H100 PCIe", source=_H100),
    "h200": _gpu("NVIDIA H200 SXM 141GB", fp32=67 * TB, tf32=494.5 * TB, bf16=989.5 * TB, fp8=1979 * TB,
                 memory_gb=141, bandwidth=4.8 * TB, host_link=_PCIE5, interconnect=_NVLINK4, capability=(9, 0),
                 sm_count=132, nvml_name="NVIDIA H200", source=_H200),
    "a100-80gb": _gpu("NVIDIA A100 SXM4 80GB", fp32=19.5 * TB, tf32=156 * TB, bf16=312 * TB, fp8=None,
                      memory_gb=80, bandwidth=2039 * GB, host_link=_PCIE4, interconnect=_NVLINK3, capability=(8, 0),
                      sm_count=108, nvml_name="NVIDIA A100-SXM4-80GB", source=_A100),
    "a100-40gb": _gpu("NVIDIA A100 SXM4 40GB", fp32=19.5 * TB, tf32=156 * TB, bf16=312 * TB, fp8=None,
                      memory_gb=40, bandwidth=1555 * GB, host_link=_PCIE4, interconnect=_NVLINK3, capability=(8, 0),
                      sm_count=108, nvml_name="NVIDIA A100-SXM4-40GB", source=_A100),
    "a100-pcie-80gb": _gpu("NVIDIA A100 PCIe 80GB", fp32=19.5 * TB, tf32=156 * TB, bf16=312 * TB, fp8=None,
                           memory_gb=80, bandwidth=1935 * GB, host_link=_PCIE4, interconnect=_PCIE4,
                           capability=(8, 0), sm_count=108, nvml_name="NVIDIA A100 80GB PCIe", source=_A100),
    "a100-pcie-40gb": _gpu("NVIDIA A100 PCIe 40GB", fp32=19.5 * TB, tf32=156 * TB, bf16=312 * TB, fp8=None,
                           memory_gb=40, bandwidth=1555 * GB, host_link=_PCIE4, interconnect=_PCIE4,
                           capability=(8, 0), sm_count=108, nvml_name="NVIDIA A100-PCIE-40GB", source=_A100),
    "l40s": _gpu("NVIDIA L40S", fp32=91.6 * TB, tf32=183 * TB, bf16=362.05 * TB, fp8=733 * TB, memory_gb=48,
                 bandwidth=864 * GB, host_link=_PCIE4, interconnect=_PCIE4, capability=(8, 9), sm_count=142,
                 nvml_name="NVIDIA L40S", source=_L40S),
    "l4": _gpu("NVIDIA L4", fp32=30.3 * TB, tf32=60 * TB, bf16=121 * TB, fp8=242.5 * TB, memory_gb=24,
               bandwidth=300 * GB, host_link=_PCIE4, interconnect=_PCIE4, capability=(8, 9), sm_count=58,
               nvml_name="NVIDIA L4", source=_L4),
    "rtx4090": _gpu("NVIDIA GeForce RTX 4090", fp32=82.6 * TB, tf32=82.6 * TB, bf16=165.2 * TB, fp8=330.3 * TB,
                    memory_gb=24, bandwidth=1008 * GB, host_link=_PCIE4, interconnect=_PCIE4, capability=(8, 9),
                    sm_count=128, nvml_name="NVIDIA GeForce RTX 4090", source=_ADA),
    "a10": _gpu("NVIDIA A10", fp32=31.2 * TB, tf32=62.5 * TB, bf16=125 * TB, fp8=None, memory_gb=24,
                bandwidth=600 * GB, host_link=_PCIE4, interconnect=_PCIE4, capability=(8, 6), sm_count=72,
                nvml_name="NVIDIA A10", source=_A10),
}
#: Short names for the common choice of each family.
ALIASES = {"h100": "h100-sxm", "a100": "a100-80gb", "4090": "rtx4090"}


def device_type(name: str) -> DeviceSpeed:
    """The table's entry for ``name`` (``h100``, ``a100-40gb``, any case); ValueError in one line listing the known.

    Example:
        >>> device_type("H100").name
        'NVIDIA H100 SXM5 80GB'
    """
    key = str(name).strip().lower()
    key = ALIASES.get(key, key)
    if key not in KNOWN_DEVICES:
        known = ", ".join([*KNOWN_DEVICES, *ALIASES])
        raise ValueError(f"--device-type {name!r} is not a known device; known: {known}")
    return KNOWN_DEVICES[key]


def matching_device(name: str, capability: tuple[int, int], sm_count: int) -> DeviceSpeed | None:
    """The table's entry for a GPU as torch reports it (name, compute capability, SM count), matched exactly; None
    for a GPU not in the table."""
    for entry in KNOWN_DEVICES.values():
        if (entry.nvml_name, entry.capability, entry.sm_count) == (name, tuple(capability), int(sm_count)):
            return entry
    return None


def mfu_dtype(precision: str) -> str:
    """The dtype whose peak an MFU of ``precision`` is measured against: 16-bit for the 16-bit precisions and
    Transformer Engine, TF32 for 32-true (what a GPU's fp32 matrix products reach with TF32 allowed).

    Example:
        >>> mfu_dtype("bf16-mixed"), mfu_dtype("32-true")
        ('bf16', 'tf32')
    """
    if precision.startswith("bf16") or precision == "transformer-engine":
        return "bf16"
    return "fp16" if precision.startswith("16") else "tf32"


def peak_flops_for(name: str, capability: tuple[int, int], sm_count: int, precision: str) -> float | None:
    """The dense peak FLOP/s of the GPU (name, compute capability, SM count) for ``precision`` (:func:`mfu_dtype`);
    None when the device is not known exactly.

    Example:
        >>> peak_flops_for("NVIDIA H100 80GB HBM3", (9, 0), 132, "bf16-mixed")
        989500000000000.0
        >>> peak_flops_for("NVIDIA H100 PCIe", (9, 0), 132, "bf16-mixed") is None  # not an H100 PCIe's SM count
        True
    """
    known = matching_device(name, capability, sm_count)
    return None if known is None else known.matmul_flops(mfu_dtype(precision))
