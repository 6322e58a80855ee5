"""NVML GPM (Hopper's SM, tensor-pipe and DRAM activity) on the sampler thread: through a fake pynvml that
keeps the real call protocol (support query, two sample buffers, metrics over a pair of samples, free), and
on a real Hopper GPU (CUDA test)."""

import logging
import time
from types import SimpleNamespace

import pytest
import torch

from profiler.memory import GPM_METRICS, GpmReader, NvmlMemorySampler, make_memory_sampler
from tests.profiler.test_memory import five_sample_fake

GPM_FIELDS = tuple(f"{field}_mean" for field in GPM_METRICS)


class FakeGpmNvml:
    """five_sample_fake's NVML plus GPM: each period between two samples has scripted percentages
    (`periods[k]` for the period ending at the k+1-th sample), read back only from two distinct buffers
    taken in that order; allocations and frees are counted."""

    NVML_GPM_METRICS_GET_VERSION = 1
    NVML_GPM_METRIC_SM_UTIL, NVML_GPM_METRIC_SM_OCCUPANCY = 2, 3
    NVML_GPM_METRIC_ANY_TENSOR_UTIL, NVML_GPM_METRIC_DRAM_BW_UTIL = 5, 10

    def __init__(self, periods, supported=True, failing_gets=(), failing_metric=None):
        self.base = five_sample_fake()
        self.periods, self.supported = list(periods), supported
        self.failing_gets, self.failing_metric = set(failing_gets), failing_metric
        self.allocated, self.freed, self.gets = [], [], 0

    def __getattr__(self, name):   # every non-GPM query is five_sample_fake's
        return getattr(self.base, name)

    class c_nvmlGpmMetricsGet_t:   # noqa: N801 - pynvml's name
        def __init__(self):
            self.version = self.numMetrics = 0
            self.sample1 = self.sample2 = None
            self.metrics = [SimpleNamespace(metricId=0, nvmlReturn=0, value=0.0) for _ in range(8)]

    def nvmlGpmQueryDeviceSupport(self, handle):
        return SimpleNamespace(version=1, isSupportedDevice=int(self.supported))

    def nvmlGpmSampleAlloc(self):
        sample = SimpleNamespace(taken=None)
        self.allocated.append(sample)
        return sample

    def nvmlGpmSampleFree(self, sample):
        self.freed.append(sample)

    def nvmlGpmSampleGet(self, handle, sample):
        self.gets += 1
        if self.gets in self.failing_gets:
            raise RuntimeError("fake nvmlGpmSampleGet failure")
        sample.taken = self.gets

    def nvmlGpmMetricsGet(self, request):
        first, second = request.sample1, request.sample2
        assert request.version == 1 and first is not second and first.taken < second.taken
        values = self.periods[min(second.taken - 2, len(self.periods) - 1)]
        ids = {self.NVML_GPM_METRIC_SM_UTIL: 0, self.NVML_GPM_METRIC_SM_OCCUPANCY: 1,
               self.NVML_GPM_METRIC_ANY_TENSOR_UTIL: 2, self.NVML_GPM_METRIC_DRAM_BW_UTIL: 3}
        for metric in request.metrics[:request.numMetrics]:
            metric.value = values[ids[metric.metricId]]
            metric.nvmlReturn = 999 if metric.metricId == self.failing_metric else 0
        return request


def test_interval_means_over_the_periods_between_samples_and_both_buffers_freed():
    nvml = FakeGpmNvml(periods=[(90, 40, 10, 30), (100, 50, 30, 50)])
    sampler = NvmlMemorySampler([0], nvml=nvml)
    for _ in range(3):   # three samples: two periods, the first sample only opens one
        sampler.sample_once()
    gpu = sampler.interval_summary(reset=True)["gpus"][0]
    assert gpu["sm_active_percent_mean"] == pytest.approx(95.0)
    assert gpu["sm_occupancy_percent_mean"] == pytest.approx(45.0)
    assert gpu["tensor_active_percent_mean"] == pytest.approx(20.0)
    assert gpu["dram_active_percent_mean"] == pytest.approx(40.0)
    assert "reasons" not in gpu and gpu["uuid"].startswith("GPU-")
    sampler.sample_once()   # the next interval's first sample closes a period begun in the last one
    assert sampler.interval_summary()["gpus"][0]["tensor_active_percent_mean"] == pytest.approx(30.0)
    assert len(nvml.allocated) == 2 and nvml.freed == []   # two buffers, reused in turn
    sampler.stop()
    assert sorted(map(id, nvml.freed)) == sorted(map(id, nvml.allocated))


def test_unsupported_gpu_gives_nulls_with_the_reason_and_allocates_nothing():
    nvml = FakeGpmNvml(periods=[(1, 2, 3, 4)], supported=False)
    sampler = NvmlMemorySampler([0], nvml=nvml)
    for _ in range(3):
        sampler.sample_once()
    gpu = sampler.interval_summary()["gpus"][0]
    for field in GPM_FIELDS:
        assert gpu[field] is None and "not supported on this GPU" in gpu["reasons"][field]
    assert gpu["used_bytes_peak"] is not None and nvml.allocated == [] and nvml.gets == 0


def test_a_failing_gpm_sample_is_counted_and_the_next_period_starts_afresh(caplog):
    nvml = FakeGpmNvml(periods=[(10, 10, 10, 10), (20, 20, 20, 20), (30, 30, 30, 30), (40, 40, 40, 40)],
                       failing_gets={2})
    sampler = NvmlMemorySampler([0], nvml=nvml, period_s=0.01)
    with caplog.at_level(logging.WARNING, logger="profiler"):
        sampler.sample_once()                 # opens a period
        sampler.sample_once()                 # fails: counted, logged, no value
        gpu = sampler.interval_summary(reset=True)["gpus"][0]
        assert gpu["sm_active_percent_mean"] is None
        assert "fake nvmlGpmSampleGet failure" in gpu["reasons"]["sm_active_percent_mean"]
        assert sampler.interval_summary()["sampler_errors"] == 1
        sampler.start()                       # the thread goes on after it
        deadline = time.monotonic() + 3.0
        while nvml.gets < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        sampler.stop()
    gpu = sampler.interval_summary()["gpus"][0]
    # samples 3 and 4 make the first period after the failure (the one ending at sample 4: 30 %)
    assert gpu["sm_active_percent_mean"] is not None and gpu["sm_active_percent_mean"] >= 30.0
    assert len([r for r in caplog.records if "nvmlGpmSampleGet" in r.getMessage()]) == 1


def test_a_non_finite_gpm_value_is_left_out_of_the_mean_with_its_reason():
    nvml = FakeGpmNvml(periods=[(50, 20, 10, float("nan")), (70, 20, 30, 40.0)])
    sampler = NvmlMemorySampler([0], nvml=nvml)
    for _ in range(3):
        sampler.sample_once()
    gpu = sampler.interval_summary()["gpus"][0]
    assert gpu["dram_active_percent_mean"] == 40.0 and gpu["tensor_active_percent_mean"] == 20.0
    nvml = FakeGpmNvml(periods=[(50, 20, 10, float("nan"))])
    sampler = NvmlMemorySampler([0], nvml=nvml)
    sampler.sample_once()
    sampler.sample_once()
    gpu = sampler.interval_summary()["gpus"][0]
    assert gpu["dram_active_percent_mean"] is None and "returned nan" in gpu["reasons"]["dram_active_percent_mean"]


def test_a_metric_nvml_cannot_give_is_null_with_its_error_and_the_others_stay():
    nvml = FakeGpmNvml(periods=[(70, 35, 5, 60)], failing_metric=FakeGpmNvml.NVML_GPM_METRIC_DRAM_BW_UTIL)
    sampler = NvmlMemorySampler([0], nvml=nvml)
    sampler.sample_once()
    sampler.sample_once()
    gpu = sampler.interval_summary()["gpus"][0]
    assert gpu["dram_active_percent_mean"] is None
    assert "NVML_GPM_METRIC_DRAM_BW_UTIL returned NVML error 999" in gpu["reasons"]["dram_active_percent_mean"]
    assert (gpu["sm_active_percent_mean"], gpu["tensor_active_percent_mean"]) == (70.0, 5.0)


def test_a_pynvml_without_gpm_says_so():
    reader = GpmReader(five_sample_fake(), ("handle", 0))
    assert reader.read() is None and "no GPM functions" in reader.reason


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpm_on_a_real_hopper_gpu_sees_tensor_work():
    """On a GPU of compute capability 9 or later, GPM must be supported and a bf16 matmul loop must show SM
    and tensor-pipe activity; older GPUs must say why the fields are null."""
    device = torch.device("cuda", torch.cuda.current_device())
    sampler = make_memory_sampler(device, period_s=0.1)
    assert isinstance(sampler, NvmlMemorySampler), sampler.interval_summary()
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    sampler.start()
    try:
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            for _ in range(20):
                a = (a @ a).clamp_(-1, 1)
            torch.cuda.synchronize()   # deliberate: keep the loop's work inside the sampled window
    finally:
        sampler.stop()
    gpu = sampler.interval_summary()["gpus"][0]
    assert gpu["uuid"].startswith("GPU-")
    if torch.cuda.get_device_capability(device)[0] < 9:
        assert gpu["tensor_active_percent_mean"] is None and "GPM" in gpu["reasons"]["tensor_active_percent_mean"]
        return
    assert gpu["sm_active_percent_mean"] > 50, gpu
    assert gpu["tensor_active_percent_mean"] > 10, gpu
    assert 0 < gpu["dram_active_percent_mean"] <= 100, gpu
