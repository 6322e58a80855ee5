"""GPU memory telemetry: an NVML sampler thread and the caching allocator's per-interval stats.

The sampler reads NVML at a fixed rate (default 2 Hz) so peaks between interval closes (a Triton autotune) are
seen, and keeps the last intervals' headroom low points for OOM forensics; it never asks NVML for the process
list (slow, privileged on some hosts). A failing NVML call is counted and logged once; a field that could not
be measured is None, with a reason.
"""

from __future__ import annotations

import collections
import logging
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
               "throttle_reasons": ("throttle_reasons", lambda v: v[-1])}


class NvmlMemorySampler:
    """A daemon thread reading every `_READS` field of each GPU given (NVML index, or UUID string) every
    period_s; the current interval's samples are aggregated at its close. The caller (make_memory_sampler) has
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
        self._gpus = []  # dicts: index, handle, name, total_bytes
        for index in gpu_indices:
            handle = (nvml.nvmlDeviceGetHandleByUUID(index) if isinstance(index, str)
                      else nvml.nvmlDeviceGetHandleByIndex(int(index)))
            name = nvml.nvmlDeviceGetName(handle)   # bytes from old pynvml versions
            self._gpus.append({"index": index, "handle": handle,
                               "name": name.decode(errors="replace") if isinstance(name, bytes) else name,
                               "total_bytes": int(nvml.nvmlDeviceGetMemoryInfo(handle).total)})
        self._lock = threading.Lock()
        self._samples: list[list] = [[] for _ in self._gpus]   # the current interval's samples, per GPU
        self._latest: list[dict | None] = [None for _ in self._gpus]
        self._headroom_history: collections.deque = collections.deque(maxlen=HEADROOM_HISTORY_LEN)
        self._errors = 0
        self._error_reasons: dict[str, str] = {}  # query name -> last error text
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- thread -------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="profiler-nvml", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._period_s + 2.0)
            self._thread = None

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

    def sample_once(self) -> None:
        """Read every GPU once and add the sample to the current interval (the thread's body)."""
        now = self._clock()
        for i, gpu in enumerate(self._gpus):
            sample = {"time_s": now, **{field: self._read(gpu["handle"], *read) for field, read in self._reads.items()}}
            with self._lock:
                self._samples[i].append(sample)
                self._latest[i] = sample

    def _sample_safely(self) -> None:
        try:
            self.sample_once()
        except Exception as exc:  # noqa: BLE001 - telemetry never kills training
            self._record_error("sample", exc)

    # ---- reading ------------------------------------------------------------------------------
    def _gpu_entry(self, gpu: dict, samples: list) -> dict:
        """One GPU's interval aggregates; a field that was never measured is None, with its reason."""
        entry = {"index": gpu["index"], "name": gpu["name"], "total_bytes": gpu["total_bytes"]}
        reasons = {}
        for field, (key, aggregate) in _AGGREGATES.items():
            values = [s[key] for s in samples if s[key] is not None]
            entry[field] = aggregate(values) if values else None
            if not values:
                reasons[field] = (self._error_reasons.get(self._reads[key][0], "not measured") if samples
                                  else "no NVML sample in this interval")
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
                entry = {"index": gpu["index"], "name": gpu["name"], "total_bytes": gpu["total_bytes"]}
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


def memory_state(sampler, device, interval: bool) -> dict:
    """The `memory` block: the sampler's interval aggregates and the allocator's stats, peaks reset (`interval`),
    else its latest sample and the stats as they stand (a snapshot). A failing part says why instead."""
    try:
        memory = dict(sampler.interval_summary(reset=True) if interval else sampler.latest())
    except Exception as exc:   # noqa: BLE001
        memory = {"available": False, "reason": f"memory sampler failed: {type(exc).__name__}: {exc}"}
    memory["allocator"] = allocator_summary(device, reset_peak=interval)   # says why, never raises
    return memory
