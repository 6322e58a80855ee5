"""GPU memory telemetry: an NVML sampler thread and the caching allocator's per-interval stats.

The sampler reads NVML at a fixed rate (default 2 Hz) so peaks between interval closes (a Triton
autotune, a burst of activations) are seen, and keeps a short history of per-interval headroom low
points for OOM forensics. It never uses NVML's process-list query (slow, and needs privileges on
some hosts). Telemetry never kills training: a failing NVML call is counted and logged once.
Reported numbers are only measured ones: a field that could not be measured is None, with a reason.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time

import torch

logger = logging.getLogger("profiler")

# How many closed-interval headroom low points the sampler remembers (for OOM forensics).
HEADROOM_HISTORY_LEN = 32

# NVML_TEMPERATURE_GPU and NVML_CLOCK_SM in pynvml; used when a fake NVML module does not define them.
_NVML_TEMPERATURE_GPU = 0
_NVML_CLOCK_SM = 1
# nvmlClocksEventReason* bits (formerly ClocksThrottleReason*), named as the dashboard shows them.
THROTTLE_REASONS = {0x1: "gpu_idle", 0x2: "applications_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
                    0x10: "sync_boost", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake",
                    0x100: "display_clocks"}


def throttle_names(mask: int) -> list[str]:
    """Names of the clock-event (throttle) reasons set in an NVML bitmask."""
    return [name for bit, name in THROTTLE_REASONS.items() if mask & bit]


_MEMORY, _UTIL, _POWER, _TEMP, _CLOCK, _REASONS = (
    "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetPowerUsage", "nvmlDeviceGetTemperature",
    "nvmlDeviceGetClockInfo", "nvmlDeviceGetCurrentClocksEventReasons")
_FIELD_QUERY = {"used_bytes_last": _MEMORY, "used_bytes_peak": _MEMORY, "headroom_bytes": _MEMORY,
                "util_percent_mean": _UTIL, "power_watts_mean": _POWER, "temperature_c_max": _TEMP,
                "sm_clock_hz_last": _CLOCK, "throttle_reasons": _REASONS}
"""The NVML query each interval field comes from (what its reason names when it is None)."""


class NvmlMemorySampler:
    """A daemon thread reading NVML every period_s for each GPU given (NVML index, or UUID string).

    Reads memory used/total, utilisation, power (mW -> W), temperature, SM clock and throttle reasons; keeps
    the current interval's samples (aggregated at its close) and the last HEADROOM_HISTORY_LEN interval
    headroom low points. The caller (make_memory_sampler) has already
    called nvmlInit; the sampler does not shut NVML down (nvmlInit is reference counted and the
    process exit releases it).
    """

    def __init__(self, gpu_indices: list, nvml=None, period_s: float = 0.5, clock=time.monotonic):
        if not gpu_indices:
            raise ValueError("NvmlMemorySampler: gpu_indices is empty (give at least one GPU)")
        if not period_s > 0:
            raise ValueError(f"NvmlMemorySampler: period_s must be > 0, got {period_s!r}")
        if nvml is None:
            import pynvml as nvml  # noqa: PLC0415 - optional dependency, only needed on GPU hosts
        self._nvml = nvml
        self._period_s = float(period_s)
        self._clock = clock
        self._temperature_sensor = getattr(nvml, "NVML_TEMPERATURE_GPU", _NVML_TEMPERATURE_GPU)
        self._gpus = []  # dicts: index, handle, name, total_bytes
        for index in gpu_indices:
            if isinstance(index, str):
                handle = nvml.nvmlDeviceGetHandleByUUID(index)
            else:
                handle = nvml.nvmlDeviceGetHandleByIndex(int(index))
            name = nvml.nvmlDeviceGetName(handle)
            if isinstance(name, bytes):  # old pynvml versions return bytes
                name = name.decode(errors="replace")
            total_bytes = int(nvml.nvmlDeviceGetMemoryInfo(handle).total)
            self._gpus.append({"index": index, "handle": handle, "name": name, "total_bytes": total_bytes})
        self._lock = threading.Lock()
        self._samples: list[list] = [[] for _ in self._gpus]   # the current interval's samples, per GPU
        self._latest: list[dict | None] = [None for _ in self._gpus]
        self._headroom_history: collections.deque = collections.deque(maxlen=HEADROOM_HISTORY_LEN)
        self._errors = 0
        self._error_reasons: dict[str, str] = {}  # query name -> last error text
        self._logged_queries: set[str] = set()
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
            try:
                self.sample_once()
            except Exception as exc:  # noqa: BLE001 - telemetry never kills training
                self._record_error("sample", exc)
            self._stop.wait(self._period_s)

    # ---- sampling -----------------------------------------------------------------------------
    def _record_error(self, query: str, exc: BaseException) -> None:
        text = f"{type(exc).__name__}: {exc}"
        with self._lock:
            self._errors += 1
            self._error_reasons[query] = text
            first = query not in self._logged_queries
            self._logged_queries.add(query)
        if first:
            logger.warning("NVML %s failed (counted in sampler_errors, logged once): %s", query, text)

    def _query(self, query: str, fn, *args):
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - one failing query must not lose the others
            self._record_error(query, exc)
            return None

    def sample_once(self) -> None:
        """Read every GPU once and add the sample to the current interval (the thread's body)."""
        nvml, now, q = self._nvml, self._clock(), self._query
        for i, gpu in enumerate(self._gpus):
            handle = gpu["handle"]
            mem = q(_MEMORY, nvml.nvmlDeviceGetMemoryInfo, handle)
            util = q(_UTIL, nvml.nvmlDeviceGetUtilizationRates, handle)
            power_mw = q(_POWER, nvml.nvmlDeviceGetPowerUsage, handle)
            temp_c = q(_TEMP, nvml.nvmlDeviceGetTemperature, handle, self._temperature_sensor)
            clock_mhz = q(_CLOCK, nvml.nvmlDeviceGetClockInfo, handle, getattr(nvml, "NVML_CLOCK_SM", _NVML_CLOCK_SM))
            reasons = q(_REASONS, _clock_event_reasons(nvml), handle)
            sample = {"time_s": now, "used_bytes": int(mem.used) if mem is not None else None,
                      "util_percent": float(util.gpu) if util is not None else None,
                      "power_watts": power_mw / 1000.0 if power_mw is not None else None,
                      "temperature_c": float(temp_c) if temp_c is not None else None,
                      "sm_clock_hz": float(clock_mhz) * 1e6 if clock_mhz is not None else None,
                      "throttle_reasons": throttle_names(int(reasons)) if reasons is not None else None}
            with self._lock:
                self._samples[i].append(sample)
                self._latest[i] = sample

    # ---- reading ------------------------------------------------------------------------------
    def _gpu_entry(self, gpu: dict, samples: list) -> dict:
        """One GPU's interval aggregates; a field that was never measured is None, with its reason."""
        def values(key):
            return [s[key] for s in samples if s[key] is not None]
        used, util, power, temp = values("used_bytes"), values("util_percent"), values("power_watts"), \
            values("temperature_c")
        peak = max(used) if used else None
        entry = {"index": gpu["index"], "name": gpu["name"], "total_bytes": gpu["total_bytes"],
                 "used_bytes_last": used[-1] if used else None, "used_bytes_peak": peak,
                 "headroom_bytes": gpu["total_bytes"] - peak if peak is not None else None,
                 "util_percent_mean": sum(util) / len(util) if util else None,
                 "power_watts_mean": sum(power) / len(power) if power else None,
                 "temperature_c_max": max(temp) if temp else None,
                 "sm_clock_hz_last": (values("sm_clock_hz") or [None])[-1],
                 "throttle_reasons": (values("throttle_reasons") or [None])[-1], "samples": len(samples)}
        reasons = {field: "no NVML sample in this interval" if not samples else
                   self._error_reasons.get(query, "not measured")
                   for field, query in _FIELD_QUERY.items() if entry[field] is None}
        if reasons:
            entry["reasons"] = reasons
        return entry

    def interval_summary(self, reset: bool = True) -> dict:
        """Aggregates since the last reset. An interval with no sample yet takes one now, so every
        reported number is a measured one."""
        with self._lock:
            need_sample = not all(self._samples)
        if need_sample:
            try:
                self.sample_once()
            except Exception as exc:  # noqa: BLE001
                self._record_error("sample", exc)
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


def _clock_event_reasons(nvml):
    """nvmlDeviceGetCurrentClocksEventReasons, or its older name (ClocksThrottleReasons)."""
    fn = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
    return fn or getattr(nvml, "nvmlDeviceGetCurrentClocksThrottleReasons")


class UnavailableMemorySampler:
    """Stands in for the NVML sampler where NVML cannot be used; reports why, never numbers."""

    def __init__(self, reason: str):
        self.reason = reason

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def interval_summary(self, reset: bool = True) -> dict:
        return {"available": False, "reason": self.reason}

    def latest(self) -> dict:
        return {"available": False, "reason": self.reason}

    def headroom_history(self) -> list[dict]:
        return []


def nvml_device_for(torch_index: int, env=os.environ) -> int | str:
    """The NVML index (int) or UUID (str) of torch's CUDA device `torch_index`, honouring
    CUDA_VISIBLE_DEVICES (NVML ignores it and always sees every GPU of the host)."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None or visible.strip() == "":
        return torch_index
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if torch_index >= len(entries):
        raise ValueError(
            f"CUDA device {torch_index} is not among CUDA_VISIBLE_DEVICES={visible!r} ({len(entries)} visible)"
        )
    entry = entries[torch_index]
    try:
        return int(entry)
    except ValueError:
        return entry  # a GPU-... or MIG-... UUID


def make_memory_sampler(device, nvml=None, period_s: float = 0.5, env=os.environ):
    """An NVML sampler for a CUDA device, or an UnavailableMemorySampler saying why not."""
    if device is None or torch.device(device).type != "cuda":
        return UnavailableMemorySampler("no CUDA device")
    device = torch.device(device)
    try:
        if nvml is None:
            import pynvml as nvml  # noqa: PLC0415
        nvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - telemetry never kills training
        reason = f"NVML unavailable: {type(exc).__name__}: {exc}"
        logger.warning("memory sampler: %s", reason)
        return UnavailableMemorySampler(reason)
    try:
        torch_index = device.index if device.index is not None else torch.cuda.current_device()
        return NvmlMemorySampler([nvml_device_for(torch_index, env)], nvml=nvml, period_s=period_s)
    except Exception as exc:  # noqa: BLE001
        reason = f"NVML device lookup failed: {type(exc).__name__}: {exc}"
        logger.warning("memory sampler: %s", reason)
        return UnavailableMemorySampler(reason)


_logged_allocator_error = False
_ALLOCATOR_STATS = {"allocated_bytes": "allocated_bytes.all.current",
                    "reserved_bytes": "reserved_bytes.all.current", "peak_allocated_bytes": "allocated_bytes.all.peak",
                    "peak_reserved_bytes": "reserved_bytes.all.peak", "num_alloc_retries": "num_alloc_retries",
                    "num_ooms": "num_ooms", "inactive_split_bytes": "inactive_split_bytes.all.current"}
"""The `allocator` block's fields and the torch.cuda.memory_stats keys they read."""


def allocator_summary(device, reset_peak: bool = True) -> dict:
    """The caching allocator's stats for the interval, from ONE torch.cuda.memory_stats call
    (~150 us: call it once per interval, never per span); resets the peaks when reset_peak."""
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
    """The `memory` block: the NVML sampler's interval aggregates and allocator stats with the peaks reset
    (`interval`), else its latest sample and the stats as they stand (a snapshot; about 150 us). A failing part
    says why instead: telemetry never kills training."""
    try:
        memory = dict(sampler.interval_summary(reset=True) if interval else sampler.latest())
    except Exception as exc:   # noqa: BLE001
        memory = {"available": False, "reason": f"memory sampler failed: {type(exc).__name__}: {exc}"}
    memory["allocator"] = allocator_summary(device, reset_peak=interval)   # says why, never raises
    return memory
