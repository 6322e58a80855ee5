"""Every metric family the live sinks publish (Prometheus, OpenTelemetry and the dashboard read this catalog),
named by Prometheus conventions: prefix `dflash_`, base unit in the name, `_total` counters, `_info` infos.
"""
from __future__ import annotations

from dataclasses import dataclass

PREFIX = "dflash"
COMMON_LABELS = ("rank", "role", "host")
# Spans during which a role waits for the other side: their share of an interval is a wait share.
WAIT_SPANS = {"transfer.wait_slot": "target", "drafter.recv": "drafter"}
# Training scalars (profiler.metric names) -> (family key, extra labels).
_TRAIN_METRICS = {"loss": "train_loss", "tau": "train_tau", "tau_prefix": "train_tau_prefix",
                  "lr": "train_learning_rate", "grad_norm": "train_grad_norm"}
# Event kinds that always exist as series (at 0), so dashboards and alerts see them before they happen.
EVENT_KINDS = ("nonfinite", "oom", "thread_crash", "signal", "bad_records", "hang")


def metric_name(base: str, unit: str | None = None, kind: str = "gauge") -> str:
    """`dflash_<base>[_<unit>][_total|_info]`; dots become underscores. The only place names are made."""
    name = f"{PREFIX}_{base.replace('.', '_')}"
    if unit and not name.endswith("_" + unit):
        name += "_" + unit
    return name + {"counter": "_total", "info": "_info"}.get(kind, "")


@dataclass(frozen=True)
class Family:
    key: str
    name: str
    kind: str          # gauge | counter | histogram | info
    help: str
    labels: tuple = ()  # besides COMMON_LABELS


def _f(key, base, unit, kind, help_, *labels) -> Family:
    return Family(key, metric_name(base, unit, kind), kind, help_, tuple(labels))


FAMILIES = {f.key: f for f in (
    _f("span_seconds", "span", "seconds", "histogram",
       "Span time per profile interval (window: one interval, accumulated over the run), CPU wall time "
       "or GPU window (CUDA events, idle gaps included): buckets and count hold whole spans; the CPU sum "
       "is time in the interval (a long span split across intervals).", "span", "clock"),
    _f("span_share", "span_share", "ratio", "gauge",
       "Share of the last interval spent in the span (window: one interval; its GPU window when CUDA-timed, "
       "else CPU wall time).", "span"),
    _f("span_bytes", "span_bytes", None, "counter", "Bytes moved by spans that declare bytes.", "span"),
    _f("span_bandwidth", "span_bandwidth", "bytes_per_second", "gauge",
       "Achieved bandwidth of the span in the last interval.", "span"),
    _f("span_floor", "span_floor", "bytes_per_second", "gauge",
       "Bandwidth floor measured at start for the span's kind of copy.", "span", "floor"),
    _f("span_floor_ratio", "span_floor", "ratio", "gauge",
       "Achieved bandwidth over its floor in the last interval.", "span"),
    _f("wait_share", "wait", "ratio", "gauge",
       "Share of the last interval a role spent waiting on the other side.", "span"),
    _f("tokens", "tokens", None, "counter", "Tokens processed by this rank (whole run; rate() gives any window)."),
    _f("samples", "samples", None, "counter", "Sequences processed by this rank (whole run)."),
    _f("steps", "steps", None, "counter", "Drafter optimiser steps taken by this rank (whole run)."),
    _f("tokens_rate", "tokens", "per_second", "gauge", "Tokens per second over the last interval."),
    _f("step", "step", None, "gauge", "The rank's current training step."),
    _f("queue_depth", "queue_depth", None, "gauge",
       "Received batches waiting for the drafter (last, mean and max of the interval).", "stat"),
    _f("gpu_memory_used", "gpu_memory_used", "bytes", "gauge", "GPU memory used (NVML), last sample.", "gpu"),
    _f("gpu_memory_peak", "gpu_memory_peak_used", "bytes", "gauge",
       "Peak GPU memory used in the last interval (NVML samples).", "gpu"),
    _f("gpu_memory_total", "gpu_memory_total", "bytes", "gauge", "GPU memory size (NVML).", "gpu"),
    _f("gpu_headroom", "gpu_memory_headroom", "bytes", "gauge", "GPU memory free now (total minus used).", "gpu"),
    _f("gpu_headroom_min", "gpu_memory_headroom_min", "bytes", "gauge",
       "Lowest GPU memory headroom in the last interval (total minus its peak used).", "gpu"),
    _f("gpu_headroom_ratio", "gpu_memory_headroom_min", "ratio", "gauge",
       "Lowest headroom in the last interval as a share of the GPU's memory.", "gpu"),
    _f("alloc_allocated", "allocator_allocated", "bytes", "gauge", "Caching allocator: allocated now.", "gpu"),
    _f("alloc_reserved", "allocator_reserved", "bytes", "gauge", "Caching allocator: reserved now.", "gpu"),
    _f("alloc_peak_allocated", "allocator_peak_allocated", "bytes", "gauge",
       "Caching allocator: peak allocated in the last interval.", "gpu"),
    _f("alloc_peak_reserved", "allocator_peak_reserved", "bytes", "gauge",
       "Caching allocator: peak reserved in the last interval.", "gpu"),
    _f("alloc_retries", "allocator_alloc_retries", None, "counter",
       "cudaMalloc retries after freeing cached blocks (a sign of fragmentation).", "gpu"),
    _f("alloc_ooms", "allocator_ooms", None, "counter", "Out-of-memory errors raised by the allocator.", "gpu"),
    _f("gpu_utilization", "gpu_utilization", "ratio", "gauge", "GPU busy share (NVML), interval mean.", "gpu"),
    _f("gpu_power", "gpu_power", "watts", "gauge", "GPU power draw (NVML), interval mean.", "gpu"),
    _f("gpu_temperature", "gpu_temperature", "celsius", "gauge", "GPU temperature (NVML), interval max.", "gpu"),
    _f("gpu_sm_clock", "gpu_sm_clock", "hertz", "gauge", "SM clock (NVML), last sample.", "gpu"),
    _f("gpu_throttle", "gpu_throttle_reason_active", None, "gauge",
       "1 while NVML reports the clock-event (throttle) reason active.", "gpu", "reason"),
    _f("train_loss", "train_loss", None, "gauge", "Drafter loss, interval mean."),
    _f("train_tau", "train_tau", None, "gauge",
       "Simulated acceptance length (tokens per verify step), interval mean."),
    _f("train_tau_prefix", "train_tau_prefix", None, "gauge",
       "Teacher-forced accepted prefix length (tokens per verify step), interval mean."),
    _f("train_accuracy", "train_accuracy", "ratio", "gauge",
       "Drafter top-1 accuracy at block position k, interval mean.", "position"),
    _f("train_learning_rate", "train_learning_rate", None, "gauge", "Learning rate, last of the interval."),
    _f("train_grad_norm", "train_grad_norm", None, "gauge", "Gradient norm before clipping, interval mean."),
    _f("events", "events", None, "counter", "Run-log events by kind (non-finite, oom, crash, signal, ...).",
       "kind"),
    _f("heartbeat", "heartbeat_timestamp", "seconds", "gauge", "Unix time of the rank's last record."),
    _f("intervals", "profile_intervals", None, "counter", "Profile intervals closed."),
    _f("profiler_cpu", "profiler_cpu", "ratio", "gauge",
       "CPU time of the profiler's and its exporters' threads over the last interval's wall time."),
    _f("exporter_dropped", "exporter_dropped_records", None, "counter",
       "Records an exporter dropped (queue full or export failed).", "exporter"),
    _f("build_info", "build", None, "info", "Versions and device of the run (value 1).",
       "version", "schema", "torch_version", "python_version", "device_name"),
)}


def train_metric_family(name: str) -> tuple[Family, dict] | None:
    """The family and extra labels for a profiler.metric name, or None when it has none."""
    if name in _TRAIN_METRICS:
        return FAMILIES[_TRAIN_METRICS[name]], {}
    if name.startswith("acc_") and name[4:].isdigit():
        return FAMILIES["train_accuracy"], {"position": name[4:]}
    return None


def train_metric_value(name: str, stats: dict):
    """The value a training scalar's gauge shows: the learning rate's last of the interval, else the mean."""
    return stats.get("last" if name == "lr" else "mean")


# (family key, field of an interval's memory.gpus[] entry) for the per-GPU gauges read as they are.
GPU_FIELDS = (("gpu_memory_used", "used_bytes_last"), ("gpu_memory_peak", "used_bytes_peak"),
              ("gpu_memory_total", "total_bytes"), ("gpu_headroom_min", "headroom_bytes"),
              ("gpu_power", "power_watts_mean"), ("gpu_temperature", "temperature_c_max"),
              ("gpu_sm_clock", "sm_clock_hz_last"))
# (family key, field of memory.allocator): gauges, then the allocator's running counts.
ALLOCATOR_GAUGES = (("alloc_allocated", "allocated_bytes"), ("alloc_reserved", "reserved_bytes"),
                    ("alloc_peak_allocated", "peak_allocated_bytes"), ("alloc_peak_reserved", "peak_reserved_bytes"))
ALLOCATOR_COUNTERS = (("alloc_retries", "num_alloc_retries"), ("alloc_ooms", "num_ooms"))


def gpu_gauges(gpu: dict) -> dict:
    """{family key: value} of one memory.gpus[] entry, with the headroom now, the low point's share of the
    GPU and the utilisation as a ratio derived from it; values the entry lacks are left out."""
    out = {key: gpu.get(field) for key, field in GPU_FIELDS}
    total, used, low, util = (gpu.get(k) for k in ("total_bytes", "used_bytes_last", "headroom_bytes",
                                                   "util_percent_mean"))
    if total and used is not None:
        out["gpu_headroom"] = total - used
    if total and low is not None:
        out["gpu_headroom_ratio"] = low / total
    if util is not None:
        out["gpu_utilization"] = util / 100.0
    return {k: v for k, v in out.items() if v is not None}
