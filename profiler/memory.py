"""GPU memory telemetry: an NVML sampler thread and the caching allocator's per-interval stats.

The sampler reads NVML at a fixed rate (default 2 Hz) so peaks between interval closes (a Triton autotune) are
seen, and keeps the last intervals' headroom low points for OOM forensics; it never asks NVML for the process
list (slow, privileged on some hosts). On GPUs with NVML's GPM metrics (Hopper and later) the same thread also
reads SM, tensor-pipe and DRAM activity, each a mean over the period between two GPM samples. A failing NVML
call is counted and logged once; a field that could not be measured is None, with a reason.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import statistics
import threading
import time

import torch

logger = logging.getLogger("profiler")

HEADROOM_HISTORY_LEN = 32   # closed-interval headroom low points kept for OOM forensics
# nvmlClocksEventReason* bits (formerly ClocksThrottleReason*), named as the dashboard shows them.
THROTTLE_REASONS = {0x1: "gpu_idle", 0x2: "applications_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
                    0x10: "sync_boost", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake",
                    0x100: "display_clocks"}
# sample field -> (NVML query, its constant argument as (pynvml name, value if a fake lacks it), reading -> value)
_READS = {
    "used_bytes": ("nvmlDeviceGetMemoryInfo", None, lambda m: int(m.used)),
    "util_percent": ("nvmlDeviceGetUtilizationRates", None, lambda u: float(u.gpu)),
    "power_watts": ("nvmlDeviceGetPowerUsage", None, lambda mw: mw / 1000.0),
    "temperature_c": ("nvmlDeviceGetTemperature", ("NVML_TEMPERATURE_GPU", 0), float),
    "sm_clock_hz": ("nvmlDeviceGetClockInfo", ("NVML_CLOCK_SM", 1), lambda mhz: float(mhz) * 1e6),
    "throttle_reasons": ("nvmlDeviceGetCurrentClocksEventReasons", None,
                         lambda mask: [name for bit, name in THROTTLE_REASONS.items() if int(mask) & bit]),
}
# interval field -> (sample field, how the interval's measured values aggregate)
_AGGREGATES = {"used_bytes_last": ("used_bytes", lambda v: v[-1]), "used_bytes_peak": ("used_bytes", max),
               "util_percent_mean": ("util_percent", statistics.fmean),
               "power_watts_mean": ("power_watts", statistics.fmean),
               "temperature_c_max": ("temperature_c", max), "sm_clock_hz_last": ("sm_clock_hz", lambda v: v[-1]),
               "throttle_reasons": ("throttle_reasons", lambda v: v[-1]),
               **{f"{field}_mean": (field, statistics.fmean) for field in ("sm_active_percent", "sm_occupancy_percent",
                                                                          "tensor_active_percent", "dram_active_percent")}}
# GPM sample field -> pynvml metric id name: SM activity (share of SMs busy), occupancy (warps resident over the
# maximum), any tensor pipe active, DRAM bandwidth used over its peak; each 0-100 over the period between samples.
GPM_METRICS = {"sm_active_percent": "NVML_GPM_METRIC_SM_UTIL", "sm_occupancy_percent": "NVML_GPM_METRIC_SM_OCCUPANCY",
               "tensor_active_percent": "NVML_GPM_METRIC_ANY_TENSOR_UTIL",
               "dram_active_percent": "NVML_GPM_METRIC_DRAM_BW_UTIL"}


class GpmReader:
    """NVML GPM metrics of one GPU: each `read()` takes a GPM sample and returns the metrics over the period since
    the previous one (None on the first read). Two sample buffers are allocated once and reused in turn; `close()`
    frees them. Unsupported (pre-Hopper, a pynvml without GPM, a virtualised GPU) or failing: `reason` says why and
    every read is None, so the fields are null with that reason, never 0."""

    def __init__(self, nvml, handle):
        self._nvml, self._handle = nvml, handle
        self._lock = threading.Lock()   # the sampler thread and an interval close may both sample
        self._samples: list = []
        self._have_previous = False
        self.reason: str | None = None
        self.metric_errors: dict[str, str] = {}   # field -> why NVML gave no value for it (last time)
        try:
            if not getattr(nvml, "nvmlGpmQueryDeviceSupport", None):
                raise RuntimeError("this pynvml has no GPM functions (nvidia-ml-py >= 12.535 has them)")
            if not nvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice:
                raise RuntimeError("GPM is not supported on this GPU (nvmlGpmQueryDeviceSupport; Hopper and later)")
            self._ids = {field: getattr(nvml, name) for field, name in GPM_METRICS.items()}
            for _ in range(2):
                self._samples.append(nvml.nvmlGpmSampleAlloc())   # one by one: close() frees what was made
        except Exception as exc:   # noqa: BLE001 - GPM is optional: its fields say why they are null
            self.reason = f"GPM unavailable: {type(exc).__name__}: {exc}"
            self.close()

    def read(self) -> dict | None:
        """{field: percent or None} over the period since the last read; None before there is a previous sample.
        Raises when NVML fails (the sampler counts it; the next read starts a new period)."""
        with self._lock:
            if self.reason is not None:
                return None
            previous, current = self._samples
            try:
                self._nvml.nvmlGpmSampleGet(self._handle, current)
            except Exception:
                self._have_previous = False
                raise
            self._samples.reverse()   # this sample is the next read's previous; the old buffer is reused
            if not self._have_previous:
                self._have_previous = True
                return None
            return self._metrics(previous, current)

    def _metrics(self, first, second) -> dict:
        nvml = self._nvml
        request = nvml.c_nvmlGpmMetricsGet_t()
        request.version, request.numMetrics = nvml.NVML_GPM_METRICS_GET_VERSION, len(self._ids)
        request.sample1, request.sample2 = first, second
        for i, metric_id in enumerate(self._ids.values()):
            request.metrics[i].metricId = metric_id
        nvml.nvmlGpmMetricsGet(request)
        out = {}
        for i, field in enumerate(self._ids):
            metric = request.metrics[i]
            value = float(metric.value) if metric.nvmlReturn == 0 else None
            if value is None or not math.isfinite(value):   # seen on an H100: DRAM_BW_UTIL NaN in some periods
                self.metric_errors[field] = (f"nvmlGpmMetricsGet: {GPM_METRICS[field]} returned " +
                                             (f"NVML error {metric.nvmlReturn}" if value is None else f"{value}"))
                value = None
            out[field] = value
        return out

    def close(self) -> None:
        with self._lock:
            samples, self._samples = self._samples, []
            if self.reason is None:
                self.reason = "GPM reader closed"
        for sample in samples:
            try:
                self._nvml.nvmlGpmSampleFree(sample)
            except Exception:   # noqa: BLE001 - freeing at shutdown: nothing left to do about it
                pass


class NvmlMemorySampler:
    """A daemon thread reading every `_READS` field (and, where supported, the GPM metrics) of each GPU given
    (NVML index, or UUID string) every period_s; the current interval's samples are aggregated at its close. The caller (make_memory_sampler) has
    called nvmlInit; the sampler never shuts NVML down (reference counted, released at exit)."""

    def __init__(self, gpu_indices: list, nvml=None, period_s: float = 0.5, clock=time.monotonic):
        if not gpu_indices:
            raise ValueError("NvmlMemorySampler: gpu_indices is empty (give at least one GPU)")
        if not period_s > 0:
            raise ValueError(f"NvmlMemorySampler: period_s must be > 0, got {period_s!r}")
        if nvml is None:
            import pynvml as nvml  # noqa: PLC0415 - optional dependency, only needed on GPU hosts
        self._period_s, self._clock = float(period_s), clock
        # field -> (query name, function, extra arguments, conversion); older pynvml names the reasons
        # query ...ClocksThrottleReasons.
        self._reads = {field: (query, getattr(nvml, query, None) or getattr(nvml, query.replace("Event", "Throttle")),
                               (getattr(nvml, *const),) if const else (), convert)
                       for field, (query, const, convert) in _READS.items()}
        self._lock = threading.Lock()
        self._errors = 0
        self._error_reasons: dict[str, str] = {}  # query name -> last error text
        self._gpus = [self._describe(nvml, index) for index in gpu_indices]
        self._samples: list[list] = [[] for _ in self._gpus]   # the current interval's samples, per GPU
        self._latest: list[dict | None] = [None for _ in self._gpus]
        self._headroom_history: collections.deque = collections.deque(maxlen=HEADROOM_HISTORY_LEN)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _describe(self, nvml, index) -> dict:
        """One GPU's fixed facts: its handle, name, memory size, UUID (DCGM's `GPU-...` form; None with the
        error in `uuid_reason` when NVML cannot say) and its GPM reader."""
        handle = (nvml.nvmlDeviceGetHandleByUUID(index) if isinstance(index, str)
                  else nvml.nvmlDeviceGetHandleByIndex(int(index)))
        name = nvml.nvmlDeviceGetName(handle)   # bytes from old pynvml versions
        gpu = {"index": index, "handle": handle, "name": name.decode(errors="replace") if isinstance(name, bytes) else name,
               "total_bytes": int(nvml.nvmlDeviceGetMemoryInfo(handle).total), "uuid": None, "uuid_reason": None}
        try:
            uuid = nvml.nvmlDeviceGetUUID(handle)
            gpu["uuid"] = uuid.decode(errors="replace") if isinstance(uuid, bytes) else str(uuid)
        except Exception as exc:   # noqa: BLE001 - the UUID only labels series; its absence is said
            gpu["uuid_reason"] = f"nvmlDeviceGetUUID failed: {type(exc).__name__}: {exc}"
        gpu["gpm"] = GpmReader(nvml, handle)
        return gpu

    # ---- thread -------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="profiler.nvml", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and free the GPM samples (the thread no longer reads them once it has ended)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._period_s + 2.0)
            if self._thread.is_alive():
                return   # stuck in an NVML call: leave its GPM buffers alone
            self._thread = None
        for gpu in self._gpus:
            gpu["gpm"].close()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample_safely()
            self._stop.wait(self._period_s)

    # ---- sampling -----------------------------------------------------------------------------
    def _record_error(self, query: str, exc: BaseException) -> None:
        text = f"{type(exc).__name__}: {exc}"
        with self._lock:
            self._errors += 1
            first = query not in self._error_reasons
            self._error_reasons[query] = text
        if first:
            logger.warning("NVML %s failed (counted in sampler_errors, logged once): %s", query, text)

    def _read(self, handle, query: str, fn, args: tuple, convert):
        try:
            return convert(fn(handle, *args))
        except Exception as exc:  # noqa: BLE001 - one failing query must not lose the others
            self._record_error(query, exc)
            return None

    def _read_gpm(self, gpu: dict) -> dict:
        """The GPM fields of one sample: the period since the previous sample, or all None."""
        try:
            values = gpu["gpm"].read()
        except Exception as exc:  # noqa: BLE001 - GPM failing must not lose the other fields
            self._record_error("nvmlGpmSampleGet", exc)
            values = None
        return {field: (values or {}).get(field) for field in GPM_METRICS}

    def sample_once(self) -> None:
        """Read every GPU once and add the sample to the current interval (the thread's body)."""
        now = self._clock()
        for i, gpu in enumerate(self._gpus):
            sample = {"time_s": now, **{field: self._read(gpu["handle"], *read) for field, read in self._reads.items()},
                      **self._read_gpm(gpu)}
            with self._lock:
                self._samples[i].append(sample)
                self._latest[i] = sample

    def _sample_safely(self) -> None:
        try:
            self.sample_once()
        except Exception as exc:  # noqa: BLE001 - telemetry never kills training
            self._record_error("sample", exc)

    # ---- reading ------------------------------------------------------------------------------
    def _reason(self, gpu: dict, key: str, samples: list) -> str:
        """Why sample field `key` has no value in `samples`."""
        if not samples:
            return "no NVML sample in this interval"
        if key not in GPM_METRICS:
            return self._error_reasons.get(self._reads[key][0], "not measured")
        gpm = gpu["gpm"]
        return gpm.reason or gpm.metric_errors.get(key) or self._error_reasons.get(
            "nvmlGpmSampleGet", "GPM needs two samples a period apart: none completed in this interval")

    def _gpu_entry(self, gpu: dict, samples: list) -> dict:
        """One GPU's interval aggregates; a field that was never measured is None, with its reason."""
        entry = {"index": gpu["index"], "name": gpu["name"], "uuid": gpu["uuid"], "total_bytes": gpu["total_bytes"]}
        reasons = {"uuid": gpu["uuid_reason"]} if gpu["uuid"] is None else {}
        for field, (key, aggregate) in _AGGREGATES.items():
            values = [s[key] for s in samples if s[key] is not None]
            entry[field] = aggregate(values) if values else None
            if not values:
                reasons[field] = self._reason(gpu, key, samples)
        peak = entry["used_bytes_peak"]
        entry["headroom_bytes"] = gpu["total_bytes"] - peak if peak is not None else None
        if peak is None:
            reasons["headroom_bytes"] = reasons["used_bytes_peak"]
        entry["samples"] = len(samples)
        if reasons:
            entry["reasons"] = reasons
        return entry

    def interval_summary(self, reset: bool = True) -> dict:
        """Aggregates since the last reset; an interval with no sample yet takes one now."""
        with self._lock:
            need_sample = not all(self._samples)
        if need_sample:
            self._sample_safely()
        now = self._clock()
        with self._lock:
            gpus = [self._gpu_entry(gpu, samples) for gpu, samples in zip(self._gpus, self._samples)]
            if reset:
                self._headroom_history.append(
                    {"time_s": now, "gpus": [{"index": g["index"], "headroom_bytes_min": g["headroom_bytes"]}
                                             for g in gpus]})
                self._samples = [[] for _ in self._gpus]
            errors = self._errors
        return {"available": True, "gpus": gpus, "sampler_errors": errors}

    def latest(self) -> dict:
        """The last sample per GPU (for the control endpoint), with its age in seconds."""
        now = self._clock()
        gpus = []
        with self._lock:
            for gpu, sample in zip(self._gpus, self._latest):
                entry = {"index": gpu["index"], "name": gpu["name"], "uuid": gpu["uuid"], "total_bytes": gpu["total_bytes"]}
                if sample is None:
                    entry["reason"] = "no NVML sample yet"
                else:
                    used = sample["used_bytes"]
                    entry.update({k: sample[k] for k in ("used_bytes", "util_percent", "power_watts", "temperature_c")},
                                 headroom_bytes=gpu["total_bytes"] - used if used is not None else None,
                                 age_seconds=now - sample["time_s"])
                gpus.append(entry)
            errors = self._errors
        return {"available": True, "gpus": gpus, "sampler_errors": errors}

    def headroom_history(self) -> list[dict]:
        """Headroom low points of the last closed intervals, oldest first (for OOM forensics)."""
        with self._lock:
            return [dict(h, gpus=[dict(g) for g in h["gpus"]]) for h in self._headroom_history]


class UnavailableMemorySampler:
    """Stands in for the NVML sampler where NVML cannot be used; reports why, never numbers."""

    def __init__(self, reason: str):
        self.reason = reason

    def start(self) -> None:
        pass

    stop = start

    def interval_summary(self, reset: bool = True) -> dict:
        return {"available": False, "reason": self.reason}

    latest = interval_summary

    def headroom_history(self) -> list[dict]:
        return []


def nvml_device_for(torch_index: int, env=os.environ) -> int | str:
    """The NVML index (int) or UUID (str) of torch's CUDA device `torch_index`, honouring
    CUDA_VISIBLE_DEVICES (NVML ignores it and always sees every GPU of the host)."""
    visible = env.get("CUDA_VISIBLE_DEVICES") or ""
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if not visible.strip():
        return torch_index
    if torch_index >= len(entries):
        raise ValueError(f"CUDA device {torch_index} is not among CUDA_VISIBLE_DEVICES={visible!r} "
                         f"({len(entries)} visible)")
    entry = entries[torch_index]
    try:
        return int(entry)
    except ValueError:
        return entry  # a GPU-... or MIG-... UUID


def make_memory_sampler(device, nvml=None, period_s: float = 0.5, env=os.environ):
    """An NVML sampler for a CUDA device, or an UnavailableMemorySampler saying why not."""
    if device is None or torch.device(device).type != "cuda":
        return UnavailableMemorySampler("no CUDA device")
    device, failed = torch.device(device), "NVML unavailable"
    try:
        if nvml is None:
            import pynvml as nvml  # noqa: PLC0415
        nvml.nvmlInit()
        failed = "NVML device lookup failed"
        torch_index = device.index if device.index is not None else torch.cuda.current_device()
        return NvmlMemorySampler([nvml_device_for(torch_index, env)], nvml=nvml, period_s=period_s)
    except Exception as exc:  # noqa: BLE001 - telemetry never kills training
        reason = f"{failed}: {type(exc).__name__}: {exc}"
        logger.warning("memory sampler: %s", reason)
        return UnavailableMemorySampler(reason)


_logged_allocator_error = False
_ALLOCATOR_STATS = {"allocated_bytes": "allocated_bytes.all.current",
                    "reserved_bytes": "reserved_bytes.all.current", "peak_allocated_bytes": "allocated_bytes.all.peak",
                    "peak_reserved_bytes": "reserved_bytes.all.peak", "num_alloc_retries": "num_alloc_retries",
                    "num_ooms": "num_ooms", "inactive_split_bytes": "inactive_split_bytes.all.current"}
"""The `allocator` block's fields and the torch.cuda.memory_stats keys they read."""


def allocator_summary(device, reset_peak: bool = True) -> dict:
    """The caching allocator's stats from ONE torch.cuda.memory_stats call (~150 us: once per interval, never
    per span); resets the peaks when reset_peak."""
    global _logged_allocator_error
    try:
        if device is None or torch.device(device).type != "cuda":
            return {"available": False, "reason": "allocator stats need a CUDA device"}
        device = torch.device(device)
        stats = torch.cuda.memory_stats(device)
        if not stats:  # memory_stats returns {} before CUDA is initialised in this process
            return {"available": False, "reason": "CUDA is not initialised in this process yet"}
        summary = {"available": True, **{field: stats.get(key) for field, key in _ALLOCATOR_STATS.items()}}
        backend = torch.cuda.get_allocator_backend()
        if backend != "native":
            # Under cudaMallocAsync these stats are not tracked and read as 0: report them unmeasured.
            untracked = ("num_alloc_retries", "inactive_split_bytes")
            summary.update(dict.fromkeys(untracked), reasons=dict.fromkeys(untracked,
                                                                           f"not tracked by the {backend} allocator"))
        if reset_peak:
            torch.cuda.reset_peak_memory_stats(device)
        return summary
    except Exception as exc:  # noqa: BLE001 - telemetry never kills training
        reason = f"{type(exc).__name__}: {exc}"
        if not _logged_allocator_error:
            _logged_allocator_error = True
            logger.warning("allocator_summary failed (logged once): %s", reason)
        return {"available": False, "reason": reason}


def memory_state(sampler, device, interval: bool, step_peaks=None) -> dict:
    """The `memory` block: the sampler's interval aggregates and the allocator's stats, peaks reset (`interval`),
    else its latest sample and the stats as they stand (a snapshot). A failing part says why instead. With
    `step_peaks` (profiler/memory_steps.py StepPeaks, which resets the peaks at every step boundary) an interval's
    allocator peaks are the maxima of its steps and of the step still running, and its `steps` part the step rows."""
    try:
        memory = dict(sampler.interval_summary(reset=True) if interval else sampler.latest())
    except Exception as exc:   # noqa: BLE001
        memory = {"available": False, "reason": f"memory sampler failed: {type(exc).__name__}: {exc}"}
    taken = step_peaks.take() if interval and step_peaks is not None else None
    memory["allocator"] = allocator = allocator_summary(device, reset_peak=interval and taken is None)   # never raises
    if taken is not None:
        memory["steps"], (steps_allocated, steps_reserved) = taken
        if allocator.get("available"):
            allocator["peak_allocated_bytes"] = max(allocator["peak_allocated_bytes"] or 0, steps_allocated)
            allocator["peak_reserved_bytes"] = max(allocator["peak_reserved_bytes"] or 0, steps_reserved)
    return memory
