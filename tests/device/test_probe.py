import dataclasses
import logging
import os
import sys
import types
from pathlib import Path

import psutil
import pytest
import torch

from autotune._device.probe import MemoryProbe, probe_memory, resolve_device

MIB = 2**20
GIB = 2**30
UUIDS = ["6f1c2a3b-0000-1111-2222-333344445555", "9e8d7c6b-aaaa-bbbb-cccc-ddddeeeeffff"]
FIELDS = [
    "device",
    "name",
    "total_bytes",
    "free_bytes",
    "process_reserved_bytes",
    "process_allocated_bytes",
    "other_processes_bytes",
]
BAD_SPEC = r"device must be 'cpu', 'cuda', 'cuda:N' or a CUDA index N; got "


# ------------------------------------------------------------------------------------------------------------- CPU


def test_cpu_probe_is_consistent():
    probe = probe_memory("cpu")
    assert probe.device == "cpu"
    assert isinstance(probe.name, str) and probe.name
    assert probe.total_bytes == psutil.virtual_memory().total > 0
    assert 0 < probe.free_bytes <= probe.total_bytes
    assert probe.process_reserved_bytes == probe.process_allocated_bytes > 0
    assert probe.process_reserved_bytes < probe.total_bytes
    assert probe.other_processes_bytes == max(0, probe.total_bytes - probe.free_bytes - probe.process_reserved_bytes)


def test_cpu_probe_counts_this_process_rss():
    before = probe_memory(device="cpu").process_reserved_bytes
    block = torch.ones(256 * MIB // 4, dtype=torch.float32)  # 256 MiB, every page touched
    after = probe_memory(device="cpu").process_reserved_bytes
    assert after - before >= 200 * MIB
    del block


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs a resettable peak RSS (Linux)")
def test_cpu_meter_counts_allocations_and_not_mapped_files(tmp_path: Path) -> None:
    """The CPU budget's measure: 64 MiB of a mapped file raise the resident set, not the meter; 64 MiB of fresh
    anonymous pages (what a new tensor's memory is) do. Mapped here, not allocated by torch: the C allocator may serve
    a tensor from pages an earlier test of this process left resident, which no meter sees rise."""
    import mmap

    from autotune._device.meter import MemoryMeter, current_host_bytes, peak_host_bytes, peak_rss_bytes

    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(64 * MIB))  # in the page cache now, not yet mapped by this process
    meter = MemoryMeter(torch.device("cpu"))
    static = meter.start()
    rss0 = peak_rss_bytes()
    assert abs(static - current_host_bytes()) < 4 * MIB
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        total = sum(mapped[i] for i in range(0, 64 * MIB, 4096))  # touch every page: resident, file-backed
        assert peak_rss_bytes() - rss0 > 60 * MIB
        assert meter.peak() - static < 8 * MIB, total
    meter.start()
    static = current_host_bytes()
    with mmap.mmap(-1, 64 * MIB) as block:  # anonymous pages, every one written
        for i in range(0, 64 * MIB, 4096):
            block[i] = 1
        assert meter.peak() - static > 60 * MIB
        assert meter.peak() <= peak_rss_bytes() and abs(peak_host_bytes() - meter.peak()) < MIB


def test_the_cuda_meter_reads_the_figures_torch_s_own_helpers_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """The meter reads the allocator's nested statistics (no flattening and sorting of ~130 figures, twice a step):
    with torch's statistics call played, each figure is the one torch's own helper returns."""
    import torch.cuda.memory as cuda_memory

    from autotune._device.meter import MemoryMeter, cuda_stat

    stats: dict = {name: {pool: {"current": 1 + i, "peak": 100 + i, "allocated": 7, "freed": 3} for pool in
                          ("all", "small_pool", "large_pool")}
                   for i, name in enumerate(("allocated_bytes", "reserved_bytes", "active_bytes", "segment"))}
    stats["num_alloc_retries"] = 2
    monkeypatch.setattr(torch._C, "_cuda_memoryStats", lambda device: stats, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_resetPeakMemoryStats", lambda device: None, raising=False)
    monkeypatch.setattr(cuda_memory, "is_initialized", lambda: True)
    monkeypatch.setattr(cuda_memory, "_get_device_index", lambda device, optional=False: 0)
    expected = (torch.cuda.memory_allocated(0), torch.cuda.max_memory_reserved(0), torch.cuda.max_memory_allocated(0))

    def flattened(device: object = None) -> dict:
        raise AssertionError("the meter flattened the statistics (torch.cuda.memory_stats)")

    monkeypatch.setattr(cuda_memory, "memory_stats", flattened)
    meter = MemoryMeter(torch.device("cuda", 0))
    assert (meter.start(), meter.peak(), meter.peak_allocated()) == expected == (1, 101, 100)
    assert cuda_stat(0, "segment", "current") == 4 and cuda_stat(0, "no_such_figure", "peak") == 0


def test_cpu_name_is_the_model_from_cpuinfo():
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    if not names:
        pytest.skip("no 'model name' in /proc/cpuinfo on this machine")
    assert probe_memory("cpu").name == names[0]


def test_as_dict_has_every_field_with_bytes_as_ints():
    probe = probe_memory("cpu")
    data = probe.as_dict()
    assert list(data) == FIELDS == [f.name for f in dataclasses.fields(MemoryProbe)]
    assert all(type(data[key]) is int for key in FIELDS if key.endswith("_bytes"))
    assert data["device"] == "cpu"


# ---------------------------------------------------------------------------------------------- device validation


@pytest.mark.parametrize("device", ["cpu", "cpu:0", torch.device("cpu")])
def test_cpu_specs_resolve_to_cpu(device):
    assert resolve_device(device) == torch.device("cpu")


@pytest.mark.parametrize(
    ("device", "shown"),
    [
        ("gpu", "'gpu'"),
        ("cuda:x", "'cuda:x'"),
        ("CUDA", "'CUDA'"),
        ("", "''"),
        (True, "True"),
        (-1, "-1"),
        (1.5, "1.5"),
    ],
)
def test_unknown_device_specs_are_rejected(device, shown):
    with pytest.raises(ValueError, match=rf"^{BAD_SPEC}{shown}$"):
        probe_memory(device)


@pytest.mark.parametrize("device", ["mps", "meta"])
def test_other_device_types_are_not_supported(device):
    with pytest.raises(ValueError, match=rf"^device '{device}' is not supported: use 'cpu', 'cuda', 'cuda:N'"):
        resolve_device(device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_without_cuda_says_so():
    message = r"^device 'cuda' does not exist: CUDA is not available on this machine; use 'cpu'$"
    with pytest.raises(ValueError, match=message):
        probe_memory("cuda")


@pytest.mark.parametrize(("device", "shown"), [("cuda:0", "'cuda:0'"), (0, "0"), ("0", "'0'"),
                                             (torch.device("cuda", 1), "'cuda:1'")])
def test_any_cuda_device_without_cuda_is_rejected(monkeypatch, device, shown):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=rf"^device {shown} does not exist: CUDA is not available on this machine"):
        resolve_device(device)


def test_default_device_without_cuda_is_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device() == torch.device("cpu")
    assert probe_memory().device == "cpu"


# --------------------------------------------------------------------------------- CUDA with torch and NVML faked


class FakeNVMLError(Exception):
    pass


class FakeNVMLNotFound(FakeNVMLError):
    pass


@pytest.fixture
def fake_cuda(monkeypatch):
    """Two visible CUDA devices, cuda:1 current, 1 GiB reserved and 768 MiB allocated by torch on each."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda index: GIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda index: 768 * MIB)
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda index: types.SimpleNamespace(uuid=UUIDS[index], name=f"Torch GPU {index}"),
    )
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (30 * GIB, 79 * GIB))


def install_fake_pynvml(monkeypatch, *, known_uuids, processes, init_error=None):
    """A pynvml that knows ``known_uuids``: 80 GiB total, 50 GiB free, 30 GiB used; records its calls."""
    module = types.ModuleType("pynvml")
    module.calls = []
    module.NVMLError = FakeNVMLError
    module.NVMLError_NotFound = FakeNVMLNotFound

    def nvml_init():
        module.calls.append("init")
        if init_error is not None:
            raise init_error

    def get_handle(uuid):
        module.calls.append(f"handle {uuid}")
        if uuid not in known_uuids:
            raise FakeNVMLNotFound("Not Found")
        return uuid

    module.nvmlInit = nvml_init
    module.nvmlShutdown = lambda: module.calls.append("shutdown")
    module.nvmlDeviceGetHandleByUUID = get_handle
    module.nvmlDeviceGetName = lambda handle: b"NVIDIA H100 80GB HBM3"  # old pynvml returns bytes
    module.nvmlDeviceGetMemoryInfo = lambda handle: types.SimpleNamespace(total=80 * GIB, free=50 * GIB, used=30 * GIB)
    module.nvmlDeviceGetComputeRunningProcesses = lambda handle: [types.SimpleNamespace(**p) for p in processes]
    monkeypatch.setitem(sys.modules, "pynvml", module)
    return module


def test_cuda_probe_reads_nvml_for_the_device_with_torch_uuid(fake_cuda, monkeypatch, caplog):
    processes = [{"pid": os.getpid(), "usedGpuMemory": 2 * GIB}, {"pid": 1, "usedGpuMemory": 28 * GIB}]
    nvml = install_fake_pynvml(monkeypatch, known_uuids={f"GPU-{UUIDS[0]}"}, processes=processes)
    with caplog.at_level(logging.WARNING, logger="autotune._device.probe"):
        probe = probe_memory("cuda:0")
    assert probe == MemoryProbe(
        device="cuda:0",
        name="NVIDIA H100 80GB HBM3",
        total_bytes=80 * GIB,
        free_bytes=50 * GIB,
        process_reserved_bytes=GIB,
        process_allocated_bytes=768 * MIB,
        other_processes_bytes=28 * GIB,  # used minus this pid's NVML entry, which includes its CUDA context
    )
    assert nvml.calls == ["init", f"handle GPU-{UUIDS[0]}", "shutdown"]
    assert caplog.records == []


def test_cuda_probe_defaults_to_the_current_device(fake_cuda, monkeypatch):
    install_fake_pynvml(monkeypatch, known_uuids={f"GPU-{uuid}" for uuid in UUIDS}, processes=[])
    assert probe_memory().device == "cuda:1"
    assert probe_memory("cuda").device == "cuda:1"
    assert probe_memory(0).device == "cuda:0"


def test_cuda_probe_uses_torch_reserve_when_this_pid_is_not_listed(fake_cuda, monkeypatch):
    install_fake_pynvml(monkeypatch, known_uuids={f"GPU-{UUIDS[1]}"}, processes=[{"pid": 1, "usedGpuMemory": None}])
    probe = probe_memory(1)
    assert probe.device == "cuda:1"
    assert probe.other_processes_bytes == 30 * GIB - GIB


def test_cuda_probe_finds_a_mig_slice(fake_cuda, monkeypatch):
    nvml = install_fake_pynvml(monkeypatch, known_uuids={f"MIG-{UUIDS[0]}"}, processes=[])
    assert probe_memory("cuda:0").total_bytes == 80 * GIB
    assert nvml.calls == ["init", f"handle GPU-{UUIDS[0]}", f"handle MIG-{UUIDS[0]}", "shutdown"]


def test_other_processes_never_go_negative(fake_cuda, monkeypatch):
    processes = [{"pid": os.getpid(), "usedGpuMemory": 40 * GIB}]
    install_fake_pynvml(monkeypatch, known_uuids={f"GPU-{UUIDS[0]}"}, processes=processes)
    assert probe_memory("cuda:0").other_processes_bytes == 0


def test_cuda_probe_falls_back_to_torch_when_nvml_fails(fake_cuda, monkeypatch, caplog):
    error = FakeNVMLError("Driver Not Loaded")
    nvml = install_fake_pynvml(monkeypatch, known_uuids=set(), processes=[], init_error=error)
    with caplog.at_level(logging.WARNING, logger="autotune._device.probe"):
        probe = probe_memory("cuda:1")
    assert probe == MemoryProbe(
        device="cuda:1",
        name="Torch GPU 1",
        total_bytes=79 * GIB,
        free_bytes=30 * GIB,
        process_reserved_bytes=GIB,
        process_allocated_bytes=768 * MIB,
        other_processes_bytes=79 * GIB - 30 * GIB - GIB,
    )
    assert nvml.calls == ["init"]
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "NVML could not be used for cuda:1 (nvmlInit failed: Driver Not Loaded)" in caplog.text
    assert "torch.cuda.mem_get_info" in caplog.text


def test_cuda_probe_falls_back_when_nvml_does_not_know_the_device(fake_cuda, monkeypatch, caplog):
    nvml = install_fake_pynvml(monkeypatch, known_uuids=set(), processes=[])
    with caplog.at_level(logging.WARNING, logger="autotune._device.probe"):
        probe = probe_memory("cuda:0")
    assert probe.total_bytes == 79 * GIB
    assert nvml.calls[-1] == "shutdown"
    assert f"NVML query for GPU {UUIDS[0]} failed: Not Found" in caplog.text


def test_cuda_probe_falls_back_without_pynvml(fake_cuda, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    with caplog.at_level(logging.WARNING, logger="autotune._device.probe"):
        probe = probe_memory("cuda:0")
    assert probe.free_bytes == 30 * GIB
    assert "pynvml is not installed" in caplog.text


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("cuda:3", r"^device 'cuda:3' does not exist: 2 CUDA device\(s\) visible \(cuda:0, cuda:1\)$"),
        (2, r"^device 2 does not exist: 2 CUDA device\(s\) visible \(cuda:0, cuda:1\)$"),
    ],
)
def test_cuda_index_out_of_range_lists_visible_devices(fake_cuda, device, message):
    with pytest.raises(ValueError, match=message):
        probe_memory(device)


def test_one_visible_device_is_listed(fake_cuda, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    message = r"^device 'cuda:3' does not exist: 1 CUDA device\(s\) visible \(cuda:0\)$"
    with pytest.raises(ValueError, match=message):
        resolve_device("cuda:3")


# --------------------------------------------------------------------------------------------------- real CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_real_cuda_probe():
    probe = probe_memory("cuda:0")
    free, total = torch.cuda.mem_get_info(0)
    assert probe.device == "cuda:0"
    assert probe.name
    # NVML's total includes memory the driver keeps back, so it can exceed cudaMemGetInfo's by a little.
    assert abs(probe.total_bytes - total) <= 0.05 * total
    assert 0 < probe.free_bytes <= probe.total_bytes
    assert probe.other_processes_bytes >= 0
    block = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda:0")
    after = probe_memory("cuda:0")
    assert after.process_allocated_bytes - probe.process_allocated_bytes >= 256 * MIB
    assert after.process_reserved_bytes >= after.process_allocated_bytes
    del block
