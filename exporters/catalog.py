"""Every metric family the live sinks publish (Prometheus, OpenTelemetry and the dashboard read this catalog),
named by Prometheus conventions: prefix `dflash_`, base unit in the name, `_total` counters, `_info` infos; and
the tables that say which run-log field feeds which family (exporters/fold.py walks them). A metric read from an
interval's own field, a GPU's or the allocator's is one family here and one row in its table.
"""
from __future__ import annotations

from dataclasses import dataclass

PREFIX = "dflash"
COMMON_LABELS = ("rank", "role", "host")
# Training scalars (profiler.metric names) -> (family key, extra labels).
_TRAIN_METRICS = {"loss": "train_loss", "tau": "train_tau", "tau_prefix": "train_tau_prefix",
                  "lr": "train_learning_rate", "grad_norm": "train_grad_norm"}
# Event kinds that always exist as series (at 0), so dashboards and alerts see them before they happen.
EVENT_KINDS = ("nonfinite", "oom", "thread_crash", "signal", "bad_records", "hang", "numerics_drift")


def metric_name(base: str, unit: str | None = None, kind: str = "gauge") -> str:
    """`dflash_<base>[_<unit>][_total|_info]`; dots become underscores. The only place names are made."""
    name = f"{PREFIX}_{base.replace('.', '_')}"
    if unit and not name.endswith("_" + unit):
        name += "_" + unit
    return name + {"counter": "_total", "info": "_info"}.get(kind, "")


@dataclass(frozen=True)
class Otel:
    """How OpenTelemetry names a family, by its semantic conventions: dotted, no unit in the name, a UCUM unit."""
    name: str
    unit: str
    instrument: str = ""
    """counter | updown | gauge | histogram; empty: the family's own kind (a Prometheus counter is a counter)."""
    attributes: tuple = ()
    """Fixed (key, value) attributes the conventions ask for (hw.type, hw.gpu.task)."""
    labels: tuple = ()
    """The attribute key of each of the family's labels, in order ("" leaves it out: a GPU's UUID is the sample's
    hw.id); empty: the labels' own names."""


@dataclass(frozen=True)
class Family:
    key: str
    name: str
    kind: str          # gauge | counter | histogram | info
    help: str
    labels: tuple = ()  # besides COMMON_LABELS
    otel: Otel | None = None   # None: not exported to OpenTelemetry (the process series prometheus_client reads)


# A GPU's series carry its NVML index and its UUID (`GPU-...`, DCGM exporter's label), so they join with DCGM's.
GPU_LABELS = ("gpu", "UUID")
_HW_GPU = (("hw.type", "gpu"),)


def _hw(name: str, unit: str, instrument: str = "", attributes: tuple = _HW_GPU, extra: tuple = ()) -> Otel:
    """A GPU family's OTel spec: its `gpu` index kept, its UUID carried as the sample's hw.id instead."""
    return Otel(name, unit, instrument, attributes, ("gpu", "", *extra))


def _f(key, base, unit, kind, help_, *labels, otel: Otel | None = None) -> Family:
    return Family(key, metric_name(base, unit, kind), kind, help_, tuple(labels), otel)


FAMILIES = {f.key: f for f in (
    _f("span_seconds", "span", "seconds", "histogram",
       "Whole durations of the spans that ended (window: one interval, accumulated over the run), CPU wall time "
       "or GPU window (CUDA events, idle gaps included): buckets, count and sum hold whole spans (the sum: their "
       "mean times their count; the time inside a window is dflash_span_time_seconds_total).", "span", "clock",
       otel=Otel("dflash.span.duration", "s", "histogram")),
    _f("span_time", "span_time", "seconds", "counter",
       "Seconds spent in the span (whole run, from every tick: spans still open count their elapsed part; CPU wall "
       "time, or the GPU window of resolved CUDA pairs on clock=\"gpu\"); each sample stamped with its tick's "
       "time, so rate() over any window is the time per second the run log gives for it.", "span", "clock",
       otel=Otel("dflash.span.time", "s")),
    _f("span_self_time", "span_self_time", "seconds", "counter",
       "The span's self (exclusive) seconds, its children's left out (whole run, from every tick; stamped).",
       "span", "clock", otel=Otel("dflash.span.self_time", "s")),
    _f("span_count", "spans", None, "counter",
       "Spans completed (whole run, from every tick; on clock=\"gpu\" those with a resolved CUDA pair; stamped).",
       "span", "clock", otel=Otel("dflash.span.count", "{span}")),
    _f("span_p95", "span_p95", "seconds", "gauge",
       "Exact 95th percentile of the span's whole durations in the last interval in which the rank ended any "
       "(window: that interval, the sample stamped with its end; kept 300 s); the run log's and the report's "
       "figure, not a bucket estimate.",
       "span", "clock", otel=Otel("dflash.span.duration.p95", "s")),
    _f("span_share", "span_share", "ratio", "gauge",
       "Share of the last interval spent in the span (window: one interval; its GPU window when CUDA-timed, "
       "else CPU wall time).", "span", otel=Otel("dflash.span.share", "1")),
    _f("span_bytes", "span_bytes", None, "counter", "Bytes moved by spans that declare bytes.", "span",
       otel=Otel("dflash.span.io", "By")),
    _f("span_bandwidth", "span_bandwidth", "bytes_per_second", "gauge",
       "Achieved bandwidth of the span in the last interval.", "span", otel=Otel("dflash.span.bandwidth", "By/s")),
    _f("span_floor", "span_floor", "bytes_per_second", "gauge",
       "Bandwidth floor measured at start for the span's kind of copy.", "span", "floor",
       otel=Otel("dflash.span.bandwidth.floor", "By/s")),
    _f("span_floor_ratio", "span_floor", "ratio", "gauge",
       "Achieved bandwidth over its floor in the last interval.", "span",
       otel=Otel("dflash.span.bandwidth.utilization", "1")),
    _f("wait_share", "wait", "ratio", "gauge",
       "Share of the last interval a role spent waiting on the other side.", "span", otel=Otel("dflash.wait.share", "1")),
    _f("tokens", "tokens", None, "counter",
       "Tokens processed by this rank (whole run, from every tick, stamped with the tick's time: rate() gives any "
       "window).", otel=Otel("dflash.tokens", "{token}")),
    _f("samples", "samples", None, "counter",
       "Sequences processed by this rank (whole run, from every tick, stamped).",
       otel=Otel("dflash.samples", "{sequence}")),
    _f("steps", "steps", None, "counter",
       "Drafter optimiser steps taken by this rank (whole run, from every tick, stamped).",
       otel=Otel("dflash.steps", "{step}")),
    _f("tokens_rate", "tokens", "per_second", "gauge", "Tokens per second over the last interval.",
       otel=Otel("dflash.tokens.rate", "{token}/s")),
    _f("samples_rate", "samples", "per_second", "gauge", "Sequences per second over the last interval.",
       otel=Otel("dflash.samples.rate", "{sequence}/s")),
    _f("steps_rate", "steps", "per_second", "gauge", "Drafter optimiser steps per second over the last interval.",
       otel=Otel("dflash.steps.rate", "{step}/s")),
    _f("model_flops", "model_flops", None, "counter",
       "Model FLOPs of this rank's steps (dflash/flops.py: matmuls at 2 a multiply-add, 3x forward for trained "
       "weights, masked-in attention pairs, no padding; whole run, from every tick, stamped: rate() gives model "
       "FLOP/s over any window).", otel=Otel("dflash.model_flops", "{flop}")),
    _f("model_flops_rate", "model_flops", "per_second", "gauge", "Model FLOP/s over the last interval.",
       otel=Otel("dflash.model_flops.rate", "{flop}/s")),
    _f("peak_flops", "peak_flops", "per_second", "gauge",
       "The device's compute peak MFU reads against: peak=\"datasheet\" (dense bf16 of the GPU's datasheet) or "
       "peak=\"measured\" (a bf16 matmul timed at the rank's start; float32 on a CPU).", "peak",
       otel=Otel("dflash.peak_flops", "{flop}/s")),
    _f("mfu", "mfu", "ratio", "gauge",
       "Model FLOPs utilisation over the last interval: its model FLOP/s over the peak (peak=\"datasheet\" or "
       "\"measured\", dflash_peak_flops_per_second).", "peak", otel=Otel("dflash.mfu", "1")),
    _f("step", "step", None, "gauge", "The rank's current training step.", otel=Otel("dflash.step", "{step}")),
    _f("queue_depth", "queue_depth", None, "gauge",
       "Received batches waiting for the drafter (last, mean and max of the interval).", "stat",
       otel=Otel("dflash.queue.depth", "{batch}")),
    _f("gpu_memory_used", "gpu_memory_used", "bytes", "gauge", "GPU memory used (NVML), last sample.", *GPU_LABELS,
       otel=_hw("hw.gpu.memory.usage", "By", "updown")),
    _f("gpu_memory_peak", "gpu_memory_peak_used", "bytes", "gauge",
       "Peak GPU memory used in the last interval (NVML samples).", *GPU_LABELS,
       otel=_hw("dflash.gpu.memory.usage.peak", "By")),
    _f("gpu_memory_total", "gpu_memory_total", "bytes", "gauge", "GPU memory size (NVML).", *GPU_LABELS,
       otel=_hw("hw.gpu.memory.limit", "By", "updown")),
    _f("gpu_headroom", "gpu_memory_headroom", "bytes", "gauge", "GPU memory free now (total minus used).",
       *GPU_LABELS, otel=_hw("dflash.gpu.memory.headroom", "By")),
    _f("gpu_headroom_min", "gpu_memory_headroom_min", "bytes", "gauge",
       "Lowest GPU memory headroom in the last interval (total minus its peak used).", *GPU_LABELS,
       otel=_hw("dflash.gpu.memory.headroom.low", "By")),
    _f("gpu_headroom_ratio", "gpu_memory_headroom_min", "ratio", "gauge",
       "Lowest headroom in the last interval as a share of the GPU's memory.", *GPU_LABELS,
       otel=_hw("dflash.gpu.memory.headroom.low_fraction", "1")),
    _f("alloc_allocated", "allocator_allocated", "bytes", "gauge", "Caching allocator: allocated now.", *GPU_LABELS,
       otel=_hw("dflash.allocator.allocated", "By")),
    _f("alloc_reserved", "allocator_reserved", "bytes", "gauge", "Caching allocator: reserved now.", *GPU_LABELS,
       otel=_hw("dflash.allocator.reserved", "By")),
    _f("alloc_peak_allocated", "allocator_peak_allocated", "bytes", "gauge",
       "Caching allocator: peak allocated in the last interval.", *GPU_LABELS,
       otel=_hw("dflash.allocator.allocated.peak", "By")),
    _f("alloc_peak_reserved", "allocator_peak_reserved", "bytes", "gauge",
       "Caching allocator: peak reserved in the last interval.", *GPU_LABELS,
       otel=_hw("dflash.allocator.reserved.peak", "By")),
    _f("alloc_retries", "allocator_alloc_retries", None, "counter",
       "cudaMalloc retries after freeing cached blocks (a sign of fragmentation).", *GPU_LABELS,
       otel=_hw("dflash.allocator.retries", "{retry}")),
    _f("alloc_ooms", "allocator_ooms", None, "counter", "Out-of-memory errors raised by the allocator.", *GPU_LABELS,
       otel=_hw("dflash.allocator.ooms", "{error}")),
    _f("gpu_utilization", "gpu_utilization", "ratio", "gauge", "GPU busy share (NVML), interval mean.", *GPU_LABELS,
       otel=_hw("hw.gpu.utilization", "1", attributes=_HW_GPU + (("hw.gpu.task", "general"),))),
    _f("gpu_power", "gpu_power", "watts", "gauge", "GPU power draw (NVML), interval mean.", *GPU_LABELS,
       otel=_hw("hw.power", "W")),
    _f("gpu_temperature", "gpu_temperature", "celsius", "gauge", "GPU temperature (NVML), interval max.", *GPU_LABELS,
       otel=_hw("hw.temperature", "Cel")),
    _f("gpu_sm_clock", "gpu_sm_clock", "hertz", "gauge", "SM clock (NVML), last sample.", *GPU_LABELS,
       otel=_hw("dflash.gpu.clock.sm", "Hz")),
    _f("gpu_throttle", "gpu_throttle_reason_active", None, "gauge",
       "1 while NVML reports the clock-event (throttle) reason active.", *GPU_LABELS, "reason",
       otel=_hw("dflash.gpu.throttle.active", "1", extra=("reason",))),
    _f("gpu_sm_active", "gpu_sm_active", "ratio", "gauge",
       "Share of the GPU's SMs busy (NVML GPM SM_UTIL, like DCGM's SM_ACTIVE), interval mean; Hopper and later.",
       *GPU_LABELS, otel=_hw("dflash.gpu.sm.activity", "1")),
    _f("gpu_sm_occupancy", "gpu_sm_occupancy", "ratio", "gauge",
       "Resident warps over the SMs' maximum (NVML GPM SM_OCCUPANCY), interval mean; Hopper and later.",
       *GPU_LABELS, otel=_hw("dflash.gpu.sm.occupancy", "1")),
    _f("gpu_tensor_active", "gpu_tensor_active", "ratio", "gauge",
       "Share of time any tensor pipe was active (NVML GPM ANY_TENSOR_UTIL, like DCGM's PIPE_TENSOR_ACTIVE), "
       "interval mean; Hopper and later.", *GPU_LABELS, otel=_hw("dflash.gpu.tensor.activity", "1")),
    _f("gpu_dram_active", "gpu_dram_active", "ratio", "gauge",
       "DRAM bandwidth used over its peak (NVML GPM DRAM_BW_UTIL, like DCGM's DRAM_ACTIVE), interval mean; "
       "Hopper and later.", *GPU_LABELS, otel=_hw("dflash.gpu.dram.activity", "1")),
    _f("train_loss", "train_loss", None, "gauge", "Drafter loss, interval mean.", otel=Otel("dflash.train.loss", "1")),
    _f("train_tau", "train_tau", None, "gauge",
       "Simulated acceptance length (tokens per verify step), interval mean.", otel=Otel("dflash.train.tau", "{token}")),
    _f("train_tau_prefix", "train_tau_prefix", None, "gauge",
       "Teacher-forced accepted prefix length (tokens per verify step), interval mean.",
       otel=Otel("dflash.train.tau_prefix", "{token}")),
    _f("train_accuracy", "train_accuracy", "ratio", "gauge",
       "Drafter top-1 accuracy at block position k, interval mean.", "position", otel=Otel("dflash.train.accuracy", "1")),
    _f("train_learning_rate", "train_learning_rate", None, "gauge", "Learning rate, last of the interval.",
       otel=Otel("dflash.train.learning_rate", "1")),
    _f("train_grad_norm", "train_grad_norm", None, "gauge", "Gradient norm before clipping, interval mean.",
       otel=Otel("dflash.train.grad_norm", "1")),
    _f("numerics_absmax", "numerics_absmax", None, "gauge",
       "Largest finite |x| of the stage's tensor over its sampled steps in the last interval (profiler/numerics.py; "
       "span: where it was produced, tensor: which).", "span", "tensor", otel=Otel("dflash.numerics.absmax", "1")),
    _f("numerics_rms", "numerics_rms", None, "gauge",
       "Root mean square of the stage's tensor at the interval's last sampled step.", "span", "tensor",
       otel=Otel("dflash.numerics.rms", "1")),
    _f("numerics_growth", "numerics_absmax_growth", "per_step", "gauge",
       "Growth factor per step of the stage's absmax over the last interval's sampled steps (least squares in "
       "log2; 1: flat, 2: doubling every step).", "span", "tensor", otel=Otel("dflash.numerics.absmax.growth", "1")),
    _f("numerics_headroom", "numerics_headroom", "binades", "gauge",
       "Doublings left between the stage's largest |x| of the last interval and its dtype's largest finite value.",
       "span", "tensor", otel=Otel("dflash.numerics.headroom", "{binade}")),
    _f("numerics_out_of_range", "numerics_out_of_range", "ratio", "gauge",
       "Largest share, over the last interval's sampled steps, of the stage's values within 2^8 of the dtype's "
       "largest value (bound=\"overflow\") or nonzero below its smallest normal one (bound=\"underflow\").",
       "span", "tensor", "bound", otel=Otel("dflash.numerics.out_of_range", "1")),
    _f("memory_forecast_largest", "memory_forecast_largest", None, "gauge",
       "The largest value of the setting (setting: its flag, --tokens-per-batch, --max-length or --num-anchors; in "
       "its own unit) that keeps 5% of every GPU free, at most the value of a setting that caps it (--max-length: "
       "--tokens-per-batch), by the run's last memory_forecast event (rank 0 of a CUDA run, "
       "dflash/memory_watch.py); absent where the run's value is not a number.", "setting",
       otel=Otel("dflash.memory.forecast.largest", "1")),
    _f("memory_forecast_scale", "memory_forecast_scale", "ratio", "gauge",
       "The setting's largest value that keeps 5% of every GPU free over the run's current value, by the last "
       "memory_forecast event (1024: not limited by memory; below 1: the current value does not fit).", "setting",
       otel=Otel("dflash.memory.forecast.scale", "1")),
    _f("memory_forecast_need", "memory_forecast_need", "bytes", "gauge",
       "What the ranks on the GPU that limits the setting need at its current value, by the last memory_forecast "
       "event (limiting_gpu: that GPU as host:index, not an NVML index).", "setting", "limiting_gpu",
       otel=Otel("dflash.memory.forecast.need", "By")),
    _f("memory_forecast_limit", "memory_forecast_limit", "bytes", "gauge",
       "What the GPU that limits the setting has for its ranks, 5% of it kept free and the memory outside their "
       "allocators left out, by the last memory_forecast event (limiting_gpu: host:index).", "setting",
       "limiting_gpu",
       otel=Otel("dflash.memory.forecast.limit", "By")),
    _f("events", "events", None, "counter", "Run-log events by kind (non-finite, oom, crash, signal, ...).",
       "kind", otel=Otel("dflash.events", "{event}")),
    _f("heartbeat", "heartbeat_timestamp", "seconds", "gauge", "Unix time of the rank's last record.",
       otel=Otel("dflash.heartbeat.time", "s")),
    _f("run_end", "run_end_timestamp", "seconds", "gauge",
       "Unix time the rank wrote its run_end record, labelled with its status (ok, hang, oom: ..., killed: "
       "SIGTERM, ...); absent while the rank runs.", "status", otel=Otel("dflash.run_end.time", "s")),
    _f("intervals", "profile_intervals", None, "counter", "Profile intervals closed.",
       otel=Otel("dflash.profile.intervals", "{interval}")),
    _f("profiled_seconds", "profiled", "seconds", "counter",
       "Wall seconds the rank has profiled, up to its last tick (whole run; stamped with the tick's time): what "
       "any share over a window divides by (sum the numerators and these over ranks for a role's share).",
       otel=Otel("dflash.profile.time", "s")),
    _f("profiler_cpu", "profiler_cpu", "ratio", "gauge",
       "CPU time of the profiler's and its exporters' threads over the last interval's wall time.",
       otel=Otel("dflash.profiler.cpu.utilization", "1")),
    _f("profiler_cpu_seconds", "profiler_cpu", "seconds", "counter",
       "CPU seconds of the profiler's and its exporters' threads (whole run); over dflash_profiled_seconds_total "
       "it is the profiling share of any window.", otel=Otel("dflash.profiler.cpu.time", "s")),
    _f("thread_cpu", "thread_cpu", "seconds", "counter",
       "CPU seconds of each Python thread of the rank (threads of one name summed; whole run).", "thread",
       otel=Otel("dflash.thread.cpu.time", "s")),
    _f("process_threads", "process_threads", None, "gauge",
       "OS threads of the rank's process (Python's and native ones: torch, gloo, NCCL), read at scrape time."),
    _f("exporter_dropped", "exporter_dropped_records", None, "counter",
       "Records an exporter dropped (queue full or export failed).", "exporter",
       otel=Otel("dflash.exporter.dropped", "{record}")),
    _f("build_info", "build", None, "info", "Versions and device of the run (value 1).",
       "version", "schema", "torch_version", "python_version", "device_name", otel=Otel("dflash.build.info", "1")),
)}
# Process series every rank's endpoint serves through prometheus_client's ProcessCollector (with the common labels
# added): not folded from records, named by prometheus_client, listed so the dashboard and its checks know them.
PROCESS_FAMILIES = {f.key: f for f in (
    Family("process_cpu", "process_cpu_seconds_total", "counter", "User and system CPU seconds of the rank's process."),
    Family("process_resident_memory", "process_resident_memory_bytes", "gauge", "Resident memory of the rank's process."),
    Family("process_open_fds", "process_open_fds", "gauge", "Open file descriptors of the rank's process."),
)}


def _otel_name(name: str) -> str:
    """A loop's own counter or gauge under OTel's instrument-name rules: `dflash.<name>`, other characters `_`."""
    return "dflash." + "".join(c if c.isascii() and (c.isalnum() or c in "._-/") else "_" for c in name)


def counter_family(name: str) -> Family:
    """A profiler counter's family: the catalog's (tokens, samples, steps), or one made for a loop's own."""
    if name in FAMILIES and FAMILIES[name].kind == "counter":
        return FAMILIES[name]
    return Family(name, metric_name(name, kind="counter"), "counter", f"profiler counter {name}",
                  otel=Otel(_otel_name(name), "1"))


def gauge_family(name: str) -> Family:
    """A profiler gauge's family, labelled by `stat` (last, mean, max of the interval): the catalog's
    (queue_depth), or one made for a loop's own."""
    if name in FAMILIES:
        return FAMILIES[name]
    return Family(name, metric_name(name), "gauge", f"profiler gauge {name}", ("stat",), Otel(_otel_name(name), "1"))


def train_metric_family(name: str) -> tuple[Family, dict] | None:
    """The family and extra labels for a profiler.metric name, or None when it has none."""
    if name in _TRAIN_METRICS:
        return FAMILIES[_TRAIN_METRICS[name]], {}
    if name.startswith("acc_") and name[4:].isdigit():
        return FAMILIES["train_accuracy"], {"position": name[4:]}
    return None


def train_metric_value(name: str, stats):
    """The value a training scalar's gauge shows (`stats`: an interval's views.MetricStats): the learning rate's
    last of the interval, else the mean."""
    return stats.last if name == "lr" else stats.mean


# (family key, field of an interval's numerics.stages[] entry) for the per-stage gauges read as they are.
NUMERICS_FIELDS = (("numerics_absmax", "absmax_max"), ("numerics_rms", "rms_last"),
                   ("numerics_growth", "growth_per_step"), ("numerics_headroom", "headroom_binades"))
# (bound label, field of a numerics.stages[] entry) of dflash_numerics_out_of_range_ratio.
NUMERICS_BOUNDS = (("overflow", "near_overflow_fraction_max"), ("underflow", "underflow_fraction_max"))
# (family key, field of a memory_forecast event's settings[] entry, a views.ForecastSetting): its gauges, each
# labelled by the entry's flag (`setting`) and, where the family has a `gpu` label, its limiting GPU.
MEMORY_FORECAST_FIELDS = (("memory_forecast_largest", "largest"), ("memory_forecast_scale", "scale"),
                          ("memory_forecast_need", "need_bytes_at_current"), ("memory_forecast_limit", "limit_bytes"))
# (family key, field of an interval record) for the rank's gauges read as they are.
INTERVAL_GAUGES = (("step", "step"), ("profiler_cpu", "profiler_share"))
# (family key, field of an interval's memory.gpus[] entry) for the per-GPU gauges read as they are.
GPU_FIELDS = (("gpu_memory_used", "used_bytes_last"), ("gpu_memory_peak", "used_bytes_peak"),
              ("gpu_memory_total", "total_bytes"), ("gpu_headroom_min", "headroom_bytes"),
              ("gpu_power", "power_watts_mean"), ("gpu_temperature", "temperature_c_max"),
              ("gpu_sm_clock", "sm_clock_hz_last"))
# (family key, percent field of memory.gpus[]) for the ratios read from NVML percentages (GPM: Hopper and later).
GPU_PERCENT_FIELDS = (("gpu_utilization", "util_percent_mean"), ("gpu_sm_active", "sm_active_percent_mean"),
                      ("gpu_sm_occupancy", "sm_occupancy_percent_mean"),
                      ("gpu_tensor_active", "tensor_active_percent_mean"),
                      ("gpu_dram_active", "dram_active_percent_mean"))
# (family key, field of memory.allocator): gauges, then the allocator's running counts.
ALLOCATOR_GAUGES = (("alloc_allocated", "allocated_bytes"), ("alloc_reserved", "reserved_bytes"),
                    ("alloc_peak_allocated", "peak_allocated_bytes"), ("alloc_peak_reserved", "peak_reserved_bytes"))
ALLOCATOR_COUNTERS = (("alloc_retries", "num_alloc_retries"), ("alloc_ooms", "num_ooms"))
# NVML clock-event (throttle) reasons, as profiler/memory.py names them: each a series (0 or 1) of every GPU that
# reports its reasons, so a dashboard sees the ones never active.
THROTTLE_REASONS = ("gpu_idle", "applications_clocks", "sw_power_cap", "hw_slowdown", "sync_boost", "sw_thermal",
                    "hw_thermal", "hw_power_brake", "display_clocks")


def gpu_gauges(gpu) -> dict:
    """{family key: value} of one memory.gpus[] entry (a views.GpuMemory), with the headroom now, the low point's
    share of the GPU and NVML's percentages as ratios; values the entry lacks (null, with a reason) are left out."""
    out = {key: getattr(gpu, field) for key, field in GPU_FIELDS}
    total, used, low = gpu.total_bytes, gpu.used_bytes_last, gpu.headroom_bytes
    if total and used is not None:
        out["gpu_headroom"] = total - used
    if total and low is not None:
        out["gpu_headroom_ratio"] = low / total
    for key, field in GPU_PERCENT_FIELDS:
        if (percent := getattr(gpu, field)) is not None:
            out[key] = percent / 100.0
    return {k: v for k, v in out.items() if v is not None}


def gpu_labels(gpu) -> tuple:
    """GPU_LABELS' values for one memory.gpus[] entry (a views.GpuMemory): its NVML index and UUID ("" when NVML
    gave none)."""
    return str(gpu.index), str(gpu.uuid or "")


def gpu_about(gpu) -> tuple:
    """What OTel's conventions say of one memory.gpus[] entry (a views.GpuMemory) besides its labels: hw.id (its
    UUID, else its index) and hw.name."""
    return (("hw.id", gpu.uuid or f"gpu-index-{gpu.index}"), ("hw.name", gpu.name or "unknown"))
