"""NVML sampler aggregates (through a fake NVML), error tolerance, and the unavailable paths."""

import logging
import time
from types import SimpleNamespace

import pytest
import torch

from profiler.memory import (
    NvmlMemorySampler,
    UnavailableMemorySampler,
    allocator_summary,
    make_memory_sampler,
    nvml_device_for,
)

GIB = 2**30


class FakeNvml:
    """The pynvml functions the sampler uses, driven by scripted per-sample values."""

    NVML_TEMPERATURE_GPU = 0

    def __init__(self, used, util, power_mw, temp, total=141 * GIB, raising=()):
        self.used, self.util, self.power_mw, self.temp = list(used), list(util), list(power_mw), list(temp)
        self.total = total
        self.raising = set(raising)  # names of functions that raise
        self.reads = 0  # memory-info reads after the constructor's
        self.calls = []
        self.inited = 0

    def _check(self, name):
        self.calls.append(name)
        if name in self.raising:
            raise RuntimeError(f"fake {name} failure")

    def nvmlInit(self):
        self.inited += 1

    def nvmlDeviceGetHandleByIndex(self, index):
        self._check("nvmlDeviceGetHandleByIndex")
        return ("handle", index)

    def nvmlDeviceGetHandleByUUID(self, uuid):
        self._check("nvmlDeviceGetHandleByUUID")
        return ("uuid", uuid)

    def nvmlDeviceGetName(self, handle):
        return b"NVIDIA H200"  # bytes, as old pynvml versions return

    def nvmlDeviceGetUUID(self, handle):
        self._check("nvmlDeviceGetUUID")
        return b"GPU-8c4d2a5e-1b6f-4f2e-9a1d-3e5b7c9d0f12"  # bytes, as old pynvml versions return

    def nvmlDeviceGetMemoryInfo(self, handle):
        self._check("nvmlDeviceGetMemoryInfo")
        used = self.used[min(self.reads, len(self.used) - 1)] if self.used else 0
        return SimpleNamespace(total=self.total, used=used, free=self.total - used)

    def nvmlDeviceGetUtilizationRates(self, handle):
        self._check("nvmlDeviceGetUtilizationRates")
        return SimpleNamespace(gpu=self.util[min(self.reads, len(self.util) - 1)], memory=0)

    def nvmlDeviceGetPowerUsage(self, handle):
        self._check("nvmlDeviceGetPowerUsage")
        return self.power_mw[min(self.reads, len(self.power_mw) - 1)]

    def nvmlDeviceGetTemperature(self, handle, sensor):
        self._check("nvmlDeviceGetTemperature")
        value = self.temp[min(self.reads, len(self.temp) - 1)]
        self.reads += 1  # last query of a sample: advance the script
        return value

    def nvmlDeviceGetClockInfo(self, handle, clock):
        self._check("nvmlDeviceGetClockInfo")
        return 1980  # MHz

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        self._check("nvmlDeviceGetCurrentClocksEventReasons")
        return 0x4 | 0x20  # sw_power_cap, sw_thermal


def five_sample_fake(**kw):
    return FakeNvml(
        used=[10 * GIB, 40 * GIB, 25 * GIB, 60 * GIB, 30 * GIB],
        util=[10, 20, 30, 40, 50],
        power_mw=[100_000, 200_000, 300_000, 400_000, 500_000],
        temp=[40, 45, 70, 50, 55],
        **kw,
    )


def test_aggregates_over_five_samples_and_reset():
    nvml = five_sample_fake()
    sampler = NvmlMemorySampler([0], nvml=nvml, clock=lambda: 100.0)
    for _ in range(5):
        sampler.sample_once()
    summary = sampler.interval_summary(reset=True)
    assert summary["available"] is True and summary["sampler_errors"] == 0
    (gpu,) = summary["gpus"]
    assert gpu["index"] == 0 and gpu["name"] == "NVIDIA H200"
    assert gpu["uuid"] == "GPU-8c4d2a5e-1b6f-4f2e-9a1d-3e5b7c9d0f12"
    assert gpu["total_bytes"] == 141 * GIB
    assert gpu["samples"] == 5
    assert gpu["used_bytes_peak"] == 60 * GIB
    assert gpu["used_bytes_last"] == 30 * GIB
    assert gpu["headroom_bytes"] == 141 * GIB - 60 * GIB
    assert gpu["util_percent_mean"] == pytest.approx(30.0)
    assert gpu["power_watts_mean"] == pytest.approx(300.0)
    assert gpu["temperature_c_max"] == 70
    assert gpu["sm_clock_hz_last"] == 1980e6 and gpu["throttle_reasons"] == ["sw_power_cap", "sw_thermal"]
    # This fake has no GPM functions: those fields are null with the reason, and nothing else is
    gpm = {"sm_active_percent_mean", "sm_occupancy_percent_mean", "tensor_active_percent_mean",
           "dram_active_percent_mean"}
    assert set(gpu["reasons"]) == gpm and all(gpu[f] is None for f in gpm)
    assert all("no GPM functions" in gpu["reasons"][f] for f in gpm)
    # The closed interval's low point is in the forensics history.
    assert sampler.headroom_history() == [
        {"time_s": 100.0, "gpus": [{"index": 0, "headroom_bytes_min": 81 * GIB}]}
    ]
    # Reset: the next interval starts fresh (its one sample is the script's last value).
    sampler.sample_once()
    (gpu2,) = sampler.interval_summary(reset=False)["gpus"]
    assert gpu2["samples"] == 1 and gpu2["used_bytes_peak"] == 30 * GIB
    assert gpu2["temperature_c_max"] == 55
    # reset=False kept it: a second read still shows the same interval.
    assert sampler.interval_summary(reset=True)["gpus"][0]["samples"] == 1
    assert len(sampler.headroom_history()) == 2


def test_empty_interval_takes_a_measured_sample():
    nvml = five_sample_fake()
    sampler = NvmlMemorySampler([0], nvml=nvml)
    (gpu,) = sampler.interval_summary()["gpus"]
    assert gpu["samples"] == 1 and gpu["used_bytes_peak"] == 10 * GIB


def test_latest_reports_last_sample_with_age():
    now = [5.0]
    sampler = NvmlMemorySampler([3], nvml=five_sample_fake(), clock=lambda: now[0])
    assert sampler.latest()["gpus"][0]["reason"] == "no NVML sample yet"
    sampler.sample_once()
    sampler.sample_once()
    now[0] = 7.5
    gpu = sampler.latest()["gpus"][0]
    assert gpu["index"] == 3 and gpu["used_bytes"] == 40 * GIB
    assert gpu["headroom_bytes"] == 101 * GIB and gpu["power_watts"] == 200.0
    assert gpu["age_seconds"] == pytest.approx(2.5)


def test_raising_query_is_counted_logged_once_and_thread_survives(caplog):
    nvml = five_sample_fake(raising={"nvmlDeviceGetPowerUsage"})
    sampler = NvmlMemorySampler([0], nvml=nvml, period_s=0.01)
    with caplog.at_level(logging.WARNING, logger="profiler"):
        sampler.start()
        try:
            deadline = time.monotonic() + 3.0
            while nvml.calls.count("nvmlDeviceGetPowerUsage") < 4 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert sampler.alive
        finally:
            sampler.stop()
    assert not sampler.alive
    summary = sampler.interval_summary()
    gpu = summary["gpus"][0]
    assert summary["sampler_errors"] >= 4
    # Power was never measured: null with the reason, never 0; the other fields are still measured.
    assert gpu["power_watts_mean"] is None
    assert "fake nvmlDeviceGetPowerUsage failure" in gpu["reasons"]["power_watts_mean"]
    assert gpu["used_bytes_peak"] is not None and gpu["util_percent_mean"] is not None
    power_logs = [r for r in caplog.records if "nvmlDeviceGetPowerUsage" in r.getMessage()]
    assert len(power_logs) == 1


def test_uuid_entries_use_handle_by_uuid():
    nvml = five_sample_fake()
    sampler = NvmlMemorySampler(["GPU-1234"], nvml=nvml)
    assert "nvmlDeviceGetHandleByUUID" in nvml.calls
    assert sampler.interval_summary()["gpus"][0]["index"] == "GPU-1234"


def test_nvml_device_for_honours_cuda_visible_devices():
    assert nvml_device_for(1, env={}) == 1
    assert nvml_device_for(1, env={"CUDA_VISIBLE_DEVICES": "4,6"}) == 6
    assert nvml_device_for(0, env={"CUDA_VISIBLE_DEVICES": "GPU-ab-cd, 3"}) == "GPU-ab-cd"
    with pytest.raises(ValueError, match=r"CUDA device 2 is not among CUDA_VISIBLE_DEVICES='4,6'"):
        nvml_device_for(2, env={"CUDA_VISIBLE_DEVICES": "4,6"})


def test_make_memory_sampler_maps_visible_index_and_reports_init_failure():
    nvml = five_sample_fake()
    sampler = make_memory_sampler(torch.device("cuda", 1), nvml=nvml, env={"CUDA_VISIBLE_DEVICES": "2,5"})
    assert isinstance(sampler, NvmlMemorySampler) and nvml.inited == 1
    assert sampler.interval_summary()["gpus"][0]["index"] == 5

    class BrokenNvml(FakeNvml):
        def nvmlInit(self):
            raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    broken = make_memory_sampler(torch.device("cuda", 0), nvml=BrokenNvml([], [], [], []))
    assert isinstance(broken, UnavailableMemorySampler)
    assert "libnvidia-ml.so.1" in broken.interval_summary()["reason"]


def test_unavailable_sampler_has_reason_and_no_numbers():
    sampler = make_memory_sampler(torch.device("cpu"))
    assert isinstance(sampler, UnavailableMemorySampler)
    sampler.start()
    sampler.stop()
    for report in (sampler.interval_summary(), sampler.latest()):
        assert report == {"available": False, "reason": "no CUDA device"}
    assert make_memory_sampler(None).interval_summary()["available"] is False


def test_allocator_summary_on_cpu_is_unavailable():
    assert allocator_summary(torch.device("cpu")) == {
        "available": False, "reason": "allocator stats need a CUDA device"}


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.cuda
@cuda
def test_allocator_summary_on_cuda():
    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.empty(64 * 2**20, dtype=torch.uint8, device=device)
    summary = allocator_summary(device, reset_peak=True)
    assert summary["available"] is True
    for key in ("allocated_bytes", "reserved_bytes", "peak_allocated_bytes", "peak_reserved_bytes",
                "num_alloc_retries", "num_ooms", "inactive_split_bytes"):
        assert key in summary
    assert summary["allocated_bytes"] >= x.numel()
    y = torch.empty(128 * 2**20, dtype=torch.uint8, device=device)
    del y  # a transient peak between two interval closes
    with_peak = allocator_summary(device, reset_peak=True)
    assert with_peak["peak_allocated_bytes"] >= with_peak["allocated_bytes"] + 128 * 2**20
    # The peak was reset at the last call: the next interval's peak no longer includes y.
    assert allocator_summary(device)["peak_allocated_bytes"] < with_peak["peak_allocated_bytes"]
    del x


@pytest.mark.cuda
@cuda
def test_nvml_sampler_on_real_gpu():
    sampler = make_memory_sampler(torch.device("cuda", torch.cuda.current_device()), period_s=0.05)
    assert isinstance(sampler, NvmlMemorySampler), sampler.interval_summary()
    sampler.start()
    time.sleep(0.3)
    sampler.stop()
    gpu = sampler.interval_summary()["gpus"][0]
    assert gpu["total_bytes"] > 0 and gpu["samples"] >= 2
    assert 0 < gpu["used_bytes_peak"] <= gpu["total_bytes"]
