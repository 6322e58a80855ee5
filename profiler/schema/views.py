"""Typed read views of the run log's records (docs/RUNLOG.md), and `parse`, the one check that a record can be read
as documented. Standard library only; imports only profiler.schema.records and profiler.schema.windows.

A view wraps the parsed dict (`__slots__`, nothing copied) and reads each field through a property named as the
log names it (units in the name where the log's key has one). A field whose value is not of its documented type
reads as absent: None for a number, a string or a part that may be missing, False for a flag, [] for a list, an
empty map for a map, an empty view for a part that is always written (an interval's `memory`, a span entry's
`cpu`). Nested views are made when read. Unknown extra fields are allowed and ignored.

Make a view with the kind's `of` (`Interval.of(rec)`; the module functions `interval(rec)`, `run_end(rec)`, ...
are the same), which hands a view back unchanged, so code that wraps at its entry works whether it is given dicts
or views; `view(rec)` picks the class by the record's `type` (and an event's by its `kind`). `parse(rec)` makes the
view after `problem(rec)`, raising BadRecord with the reason for a record that cannot be read as documented: a
reader counts that record as one bad line. The schema version is `profiler.schema.records.check_schema`'s.
"""
from __future__ import annotations

from types import MappingProxyType

from profiler.schema import windows
from profiler.schema.records import EVENT, INTERVAL, RUN_END, RUN_START, SNAPSHOT, SPANS, TICK

_NUM = (int, float)
_EMPTY = MappingProxyType({})


# ---- fields -------------------------------------------------------------------------------------------------

class Field(property):
    """A property that reads one key of the record: `key` (the log's name), `kind` (what it reads as: "num",
    "int", "str", "flag", "list", "views", "map", "entries", "part", "optional", "any") and `of` (the view class
    of a nested piece, else None)."""

    def __init__(self, fget, key: str, kind: str, doc: str, of=None):
        super().__init__(fget)
        self.__doc__, self.key, self.kind, self.of = doc, key, kind, of


def _num(key: str, doc: str) -> Field:
    """A number (int or float, never a bool), else None."""
    def get(self):
        v = self._d.get(key)
        return v if type(v) is float or type(v) is int else None
    return Field(get, key, "num", doc)


def _int(key: str, doc: str, default: int | None = None) -> Field:
    """An integer (never a bool), else `default`."""
    def get(self):
        v = self._d.get(key)
        return v if type(v) is int else default
    return Field(get, key, "int", doc)


def _str(key: str, doc: str) -> Field:
    """A string, else None."""
    def get(self):
        v = self._d.get(key)
        return v if type(v) is str else None
    return Field(get, key, "str", doc)


def _flag(key: str, doc: str) -> Field:
    """True only where the log says `true`."""
    def get(self):
        return self._d.get(key) is True
    return Field(get, key, "flag", doc)


def _list(key: str, doc: str, optional: bool = False) -> Field:
    """A list of plain values (names, numbers), as written; [] (None when `optional`) where there is none."""
    def get(self):
        v = self._d.get(key)
        return v if type(v) is list else None if optional else []
    return Field(get, key, "list", doc)


def _views(key: str, of, doc: str) -> Field:
    """A list of nested pieces, each read through view class `of` (an item that is not an object reads as empty)."""
    def get(self):
        v = self._d.get(key)
        return [of(x if type(x) is dict else _EMPTY) for x in v] if type(v) is list else []
    return Field(get, key, "views", doc, of)


def _map(key: str, doc: str) -> Field:
    """A map whose keys are not fields (free-form names: config, floors, phases, attrs), as written; {} where there
    is none."""
    def get(self):
        v = self._d.get(key)
        return v if type(v) is dict else {}
    return Field(get, key, "map", doc)


def _entries(key: str, of, doc: str) -> Field:
    """A map of names to nested pieces (spans, counters, gauges, metrics), each read through `of` when read."""
    def get(self):
        v = self._d.get(key)
        return ViewMap(v if type(v) is dict else _EMPTY, of)
    return Field(get, key, "entries", doc, of)


def _part(key: str, of, doc: str) -> Field:
    """A nested piece that is always written, read through `of`; an empty view (every field absent) where none is."""
    def get(self):
        v = self._d.get(key)
        return of(v if type(v) is dict else _EMPTY)
    return Field(get, key, "part", doc, of)


def _maybe(key: str, of, doc: str) -> Field:
    """A nested piece that may be missing, read through `of`; None where it is absent, null or empty."""
    def get(self):
        v = self._d.get(key)
        return of(v) if type(v) is dict and v else None
    return Field(get, key, "optional", doc, of)


def _any(key: str, doc: str) -> Field:
    """A value of more than one documented shape, as written (the docstring says which)."""
    def get(self):
        return self._d.get(key)
    return Field(get, key, "any", doc)


# ---- the base view and maps -----------------------------------------------------------------------------------

class View:
    """A read-only view over one parsed JSON object of the run log."""
    __slots__ = ("_d",)

    def __init__(self, d):
        self._d = d

    @classmethod
    def of(cls, d):
        """`d` read through this class: a view of this class as it is, another view's object, a dict, or None (an
        empty view)."""
        if type(d) is dict:
            return cls(d)
        if isinstance(d, cls):
            return d
        if isinstance(d, View):
            d = d._d
        return cls(d if isinstance(d, dict) else _EMPTY)

    @classmethod
    def fields(cls) -> dict:
        """{log key: Field} of every field this view reads (its class's and its bases')."""
        out = {}
        for klass in reversed(cls.__mro__):
            out.update({f.key: f for f in vars(klass).values() if isinstance(f, Field)})
        return out

    @property
    def raw(self):
        """The object this view reads, whole: for handing it on (to a JSON dump, a writer, a profiler.schema.windows
        accessor), never for reading a field."""
        return {} if self._d is _EMPTY else self._d

    reasons = _map("reasons", "{field: why it is null} (a non-finite number, an unmeasured NVML field)")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._d!r})"

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and other._d == self._d

    __hash__ = None


class ViewMap:
    """{name: view} over one of a record's maps (spans, counters, gauges, metrics), each entry's view made when it
    is read; an entry that is not an object reads as empty."""
    __slots__ = ("_d", "_of")

    def __init__(self, d, of):
        self._d, self._of = d, of

    def __len__(self) -> int:
        return len(self._d)

    def __iter__(self):
        return iter(self._d)

    def __contains__(self, name) -> bool:
        return name in self._d

    def __getitem__(self, name):
        v = self._d[name]
        return self._of(v if type(v) is dict else _EMPTY)

    def get(self, name, default=None):
        v = self._d.get(name)
        return default if v is None else self._of(v if type(v) is dict else _EMPTY)

    def entry(self, name):
        """The entry called `name`, or an empty one (every field absent) when there is none."""
        v = self._d.get(name)
        return self._of(v if type(v) is dict else _EMPTY)

    def keys(self):
        return self._d.keys()

    def items(self) -> list:
        of = self._of
        return [(k, of(v if type(v) is dict else _EMPTY)) for k, v in self._d.items()]

    def values(self) -> list:
        of = self._of
        return [of(v if type(v) is dict else _EMPTY) for v in self._d.values()]

    @property
    def raw(self):
        """The map this view reads, whole (see View.raw)."""
        return {} if self._d is _EMPTY else self._d

    def __repr__(self) -> str:
        return f"ViewMap({self._of.__name__}, {self._d!r})"


# ---- the pieces of an interval (and of run_end) -------------------------------------------------------------

class ClockStats(View):
    """A span entry's `cpu` or `gpu` block: its times on one clock in the window."""
    __slots__ = ()
    total_seconds = _num("total_seconds", "Seconds in the window: on the CPU split at its edges (open spans' pieces "
                                         "included), on the GPU the resolved pairs' whole GPU windows.")
    self_seconds = _num("self_seconds", "total_seconds less the children's time (spans opened inside it on its "
                                       "thread), seconds.")
    mean_seconds = _num("mean_seconds", "Mean whole duration of the spans that ended in the window, seconds; None "
                                       "when none ended.")
    p50_seconds = _num("p50_seconds", "Median whole duration of the spans that ended, seconds.")
    p95_seconds = _num("p95_seconds", "95th percentile whole duration of the spans that ended, seconds.")
    p99_seconds = _num("p99_seconds", "99th percentile whole duration of the spans that ended, seconds.")
    max_seconds = _num("max_seconds", "Longest whole duration of the spans that ended, seconds.")
    buckets = _list("buckets", "Per-window counts of the ended spans per bound of run_start's "
                               "histogram_buckets_seconds, plus one for +Inf (not cumulative); [] in run_end.")


class GpuLag(View):
    """Where a span entry's resolved CUDA spans lay on the host timeline (profiler/gpu_lag.py)."""
    __slots__ = ()
    n = _int("n", "Spans placed (n + unplaced = gpu_count).", 0)
    unplaced = _int("unplaced", "Spans that began before the first anchor.", 0)
    launch_bound = _int("launch_bound", "Placed spans the host paced (idle stream at their begin, GPU work "
                                           "ended within tolerance of the host's end).", 0)
    gpu_bound = _int("gpu_bound", "Placed spans whose GPU work ran on after the host's end for half their "
                                     "window or more.", 0)
    start_lag_p50_s = _num("start_lag_p50_s", "Median of GPU-reached-start minus the host's begin, seconds.")
    end_lag_p50_s = _num("end_lag_p50_s", "Median of GPU-reached-end minus the host's end, seconds.")
    window_seconds = _num("window_seconds", "The placed spans' GPU windows summed, seconds.")
    tail_seconds = _num("tail_seconds", "The parts of those windows after the host's end (queued work), seconds.")
    tolerance_s = _num("tolerance_s", "The placement tolerance: 50 us plus the p90 of the anchors' error, seconds.")


class SpanEntry(View):
    """One span name's entry in an interval's (or run_end's, or a tick window's) `spans`."""
    __slots__ = ()
    count = _int("count", "Spans of this name collected complete in the window (0 while one is still open).", 0)
    threads = _list("threads", "Names of the threads that ran the span in the window.")
    cpu = _part("cpu", ClockStats, "The CPU (wall) clock's times.")
    gpu = _maybe("gpu", ClockStats, "The GPU (CUDA event) times of the pairs that resolved; None without CUDA "
                                      "timing or when none resolved.")
    gpu_count = _int("gpu_count", "How many of count carry GPU times (present with gpu).")
    gpu_unresolved = _int("gpu_unresolved", "GPU-timed spans whose events had not completed (counted CPU-only).")
    open_cpu_seconds = _num("open_cpu_seconds", "The part of cpu.total_seconds from spans still open at the window's "
                                               "end, seconds.")
    share = _num("share", "GPU time when timed, else CPU total, over the window's duration (a fraction).")
    bytes = _num("bytes", "Bytes the ended spans declared (spans with bytes= only).")
    bandwidth_bytes_per_s = _num("bandwidth_bytes_per_s", "bytes over the ended spans' whole durations, bytes/s.")
    floor = _str("floor", "The floor of the copy's path (host_staged, pinned_d2h, pinned_h2d, device_copy, "
                          "host_copy).")
    floor_bytes_per_s = _num("floor_bytes_per_s", "That floor, bytes/s.")
    floor_ratio = _num("floor_ratio", "bandwidth_bytes_per_s over floor_bytes_per_s.")
    gpu_lag = _maybe("gpu_lag", GpuLag, "CUDA only: where the resolved spans lay on the host timeline.")

    def basis(self) -> tuple:
        """(ClockStats, "gpu" | "cpu"): the block the span's times are read from (profiler.schema.windows.basis)."""
        stats, on = windows.basis(self._d)
        return ClockStats(stats if isinstance(stats, dict) else _EMPTY), on

    def clock(self, on: str) -> ClockStats:
        """The `gpu` block when `on` is "gpu", else the `cpu` block: the entry's times on that clock; an empty
        ClockStats (every field absent) where the entry has none."""
        v = self._d.get("gpu" if on == "gpu" else "cpu")
        return ClockStats(v if type(v) is dict else _EMPTY)

    @property
    def gpu_scale(self) -> float:
        """count / gpu_count: what scales the GPU total to all the entry's spans (profiler.schema.windows.gpu_scale)."""
        return windows.gpu_scale(self._d)

    @property
    def basis_seconds(self) -> float:
        """The entry's time in its window, seconds: the scaled GPU total, else the CPU total."""
        return windows.basis_seconds(self._d)

    @property
    def whole_seconds(self) -> float:
        """The summed whole durations of the entry's spans, seconds (profiler.schema.windows.whole_seconds)."""
        return windows.whole_seconds(self._d)

    def clock_seconds(self, on: str) -> float:
        """The entry's time on clock `on` ("cpu": split total; "gpu": scaled GPU total, 0 where none resolved)."""
        return windows.clock_seconds(self._d, on)

    def self_seconds(self, on: str) -> float:
        """The entry's self (exclusive) time on clock `on`, seconds (profiler.schema.windows.self_seconds)."""
        return windows.self_seconds(self._d, on)

    def gpu_bound(self, capture_busy_share: float | None = None, sm_active_percent: float | None = None):
        """This entry's launch-/GPU-bound class and busy estimate (profiler.schema.windows.gpu_bound), None unplaced."""
        return windows.gpu_bound([self._d], capture_busy_share, sm_active_percent)


class CounterStats(View):
    """One counter of an interval (or run_end): `tokens`, `samples`, `steps`, ..."""
    __slots__ = ()
    total = _num("total", "Counted in the window (run_end: in the segment).")
    per_second = _num("per_second", "total over the window's duration, per second.")
    run_total = _num("run_total", "Counted since the run began.")


class GaugeStats(View):
    """One gauge of an interval (`queue_depth`)."""
    __slots__ = ()
    last = _num("last", "The last value set in the interval.")
    mean = _num("mean", "The mean of the values set in the interval.")
    max = _num("max", "The largest value set in the interval.")


class MetricStats(View):
    """One training scalar of an interval (`loss`, `tau`, `lr`, ...); a NaN/Inf reads None with its reason."""
    __slots__ = ()
    last = _num("last", "The last value recorded in the window.")
    mean = _num("mean", "The mean of the values recorded in the window.")


class StepRate(View):
    """How far `set_step` advanced the step in an interval."""
    __slots__ = ()
    steps = _int("steps", "The step at the interval's close minus the step at its start (None: it went back).")
    per_second = _num("per_second", "steps over duration_seconds, steps/s.")


class GpuMemory(View):
    """One GPU's NVML figures over an interval (`memory.gpus[]`)."""
    __slots__ = ()
    index = _int("index", "NVML's index of the GPU.")
    name = _str("name", "The GPU's name.")
    uuid = _str("uuid", "NVML's GPU-... UUID (DCGM's label); None with a reason when NVML gives none.")
    total_bytes = _num("total_bytes", "The GPU's memory, bytes.")
    used_bytes_last = _num("used_bytes_last", "Memory used at the last sample, bytes.")
    used_bytes_peak = _num("used_bytes_peak", "Most memory used in the interval, bytes.")
    headroom_bytes = _num("headroom_bytes", "total_bytes minus used_bytes_peak: the interval's low point, bytes.")
    util_percent_mean = _num("util_percent_mean", "NVML's GPU busy (a kernel ran in the sample period), percent.")
    power_watts_mean = _num("power_watts_mean", "Mean power draw, watts.")
    temperature_c_max = _num("temperature_c_max", "Highest temperature, degrees Celsius.")
    sm_clock_hz_last = _num("sm_clock_hz_last", "The SM clock at the last sample, Hz.")
    throttle_reasons = _list("throttle_reasons", "Names of the active NVML clock-event reasons; None unmeasured.",
                             optional=True)
    sm_active_percent_mean = _num("sm_active_percent_mean", "GPM: the share of SMs busy, percent.")
    sm_occupancy_percent_mean = _num("sm_occupancy_percent_mean", "GPM: resident warps over the maximum, percent.")
    tensor_active_percent_mean = _num("tensor_active_percent_mean", "GPM: time any tensor pipe was active, percent.")
    dram_active_percent_mean = _num("dram_active_percent_mean", "GPM: DRAM bandwidth over its peak, percent.")
    samples = _int("samples", "NVML samples in the interval.")


class Allocator(View):
    """The caching allocator's stats (an interval's `memory.allocator`, an `oom` event's `allocator`)."""
    __slots__ = ()
    available = _flag("available", "Whether the stats were read (a CUDA device).")
    reason = _str("reason", "Why they were not.")
    allocated_bytes = _num("allocated_bytes", "Allocated now, bytes.")
    reserved_bytes = _num("reserved_bytes", "Reserved now, bytes.")
    peak_allocated_bytes = _num("peak_allocated_bytes", "Most allocated since the last reset, bytes.")
    peak_reserved_bytes = _num("peak_reserved_bytes", "Most reserved since the last reset, bytes.")
    num_alloc_retries = _int("num_alloc_retries", "cudaMalloc retries after freeing cached blocks, so far.")
    num_ooms = _int("num_ooms", "Out-of-memory errors the allocator raised, so far.")
    inactive_split_bytes = _num("inactive_split_bytes", "Inactive split blocks (fragmentation), bytes.")


class StepPeak(View):
    """One step's allocator peak and its sizes (`memory.steps.rows[]`, profiler/memory_steps.py)."""
    __slots__ = ()
    step = _int("step", "The step.")
    peak_allocated_bytes = _num("peak_allocated_bytes", "Most allocated during the step, bytes.")
    peak_reserved_bytes = _num("peak_reserved_bytes", "Most reserved during the step, bytes.")
    allocated_bytes = _num("allocated_bytes", "Allocated once the step ended (what stays between steps), bytes.")
    sizes = _map("sizes", "{size name: value} the loop named for the step (profiler.memory_sizes); {} for none.")


class StepPeaks(View):
    """An interval's `memory.steps`: its steps' allocator peaks (a CUDA device)."""
    __slots__ = ()
    rows = _views("rows", StepPeak, "At most memory_steps.ROWS_PER_INTERVAL steps: the highest peaks and a spread.")
    steps = _int("steps", "Steps that ended in the interval (rows beyond the kept ones are counted here).")


class Memory(View):
    """An interval's `memory`: NVML per GPU and the allocator; `available` False with a reason without a GPU."""
    __slots__ = ()
    available = _flag("available", "Whether NVML measured the GPUs.")
    reason = _str("reason", "Why it did not.")
    gpus = _views("gpus", GpuMemory, "One entry per GPU.")
    allocator = _part("allocator", Allocator, "The caching allocator's stats.")
    sampler_errors = _int("sampler_errors", "Failed NVML queries so far.")
    steps = _maybe("steps", StepPeaks, "Each step's allocator peak and sizes (a CUDA device); None elsewhere.")

    @property
    def measured_gpus(self) -> list:
        """The per-GPU entries when NVML measured them, else []."""
        return self.gpus if self.available else []


class OpenSpan(View):
    """A span still open (`open_spans[].spans[]`), outermost first."""
    __slots__ = ()
    name = _str("name", "The span's name.")
    depth = _int("depth", "Nesting depth on its thread (0: outermost).")
    open_seconds = _num("open_seconds", "How long it had been open, seconds.")


class OpenSpans(View):
    """One thread's open spans (`open_spans[]` of an interval, a forensics dump, a memory snapshot)."""
    __slots__ = ()
    thread = _str("thread", "The thread's name.")
    native_id = _int("native_id", "Its OS thread id.")
    spans = _views("spans", OpenSpan, "Its open spans, outermost first.")


class SpanThread(View):
    """A thread that recorded spans (`threads[]` of an interval)."""
    __slots__ = ()
    name = _str("name", "The thread's name.")
    native_id = _int("native_id", "Its OS thread id (py-spy's thread_id/native_id).")


class ExporterStats(View):
    """What one exporter did with the records so far (`exporters` of an interval or run_end)."""
    __slots__ = ()
    exported = _int("exported", "Records exported.")
    dropped = _int("dropped", "Records dropped (queue full).")
    failed = _int("failed", "Records whose export raised.")


class HotFrame(View):
    """A thread's innermost frame in stack samples where it ran."""
    __slots__ = ()
    frame = _str("frame", "\"func (file.py:123)\".")
    count = _int("count", "Samples with this innermost frame.", 0)


class SampledStack(View):
    """One whole stack of a thread in an interval's stack samples."""
    __slots__ = ()
    frames = _list("frames", "Indexes into the interval's `frames` labels, root (outermost) first.")
    count = _int("count", "Samples of the thread with this stack.", 0)
    idle_samples = _int("idle_samples", "Those of them in which the thread waited.", 0)


class SampledThread(View):
    """One thread of an interval's `stack_samples`."""
    __slots__ = ()
    name = _str("name", "The thread's name.")
    native_id = _int("native_id", "Its OS thread id.")
    samples = _int("samples", "Dumps that saw the thread (None in logs written before it was recorded).")
    idle_samples = _int("idle_samples", "Samples in which it waited.")
    top_frames = _views("top_frames", HotFrame, "Its hottest frames.")
    stacks = _views("stacks", SampledStack, "Its most common whole stacks (profiler.stacks.STACKS_PER_THREAD at "
                                            "most; [] in logs written before whole stacks were recorded).")
    other_samples = _int("other_samples", "Its samples whose stack is not among `stacks`.", 0)
    other_idle_samples = _int("other_idle_samples", "Those of them in which it waited.", 0)


class StackSamples(View):
    """An interval's `stack_samples` (only with --stack-samples-per-interval)."""
    __slots__ = ()
    samples = _int("samples", "Stack dumps taken in the interval.")
    failed = _int("failed", "Dumps that failed even when taken once more.")
    error = _str("error", "The last failure's one-line reason (only when a dump failed).")
    frames = _list("frames", "The frame labels (\"func (file.py:123)\") its threads' `stacks` index.")
    threads = _views("threads", SampledThread, "Per thread: its idle samples, hot frames and whole stacks.")

    @property
    def whole_stacks(self) -> bool:
        """Whether the samples hold whole stacks (a `frames` table; logs written before whole stacks were recorded
        have hot frames only)."""
        return "frames" in self._d


class NumericsStage(View):
    """One stage (a span's tensor) of an interval's `numerics` part: its statistics over the interval's sampled
    steps (profiler/numerics.py)."""
    __slots__ = ()
    span = _str("span", "The span that produced the tensor.")
    tensor = _str("tensor", "The tensor's name (layer3, loss, grad_norm, update_ratio, ...).")
    dtype = _str("dtype", "Its dtype (float32, bfloat16, ...): the range overflow is read against.")
    samples = _int("samples", "Sampled steps in the interval.", 0)
    absmax_max = _num("absmax_max", "The largest finite |x| of the interval's samples (None: none finite).")
    absmax_last = _num("absmax_last", "The last sample's largest |x| (None: not finite).")
    rms_last = _num("rms_last", "The last sample's root mean square (None: not finite).")
    near_overflow_fraction_max = _num("near_overflow_fraction_max", "The largest share of |x| within 2**8 of the "
                                                                    "dtype's largest value.")
    underflow_fraction_max = _num("underflow_fraction_max", "The largest share of nonzero |x| below the dtype's "
                                                            "smallest normal value.")
    nonfinite = _int("nonfinite", "NaN and Inf values summed over the interval's samples.", 0)
    growth_per_step = _num("growth_per_step", "absmax's growth factor per step over the interval's samples (least "
                                              "squares in log2; 1: flat); None under two finite samples.")
    baseline_absmax = _num("baseline_absmax", "The baseline's median absmax (None: no baseline yet).")
    headroom_binades = _num("headroom_binades", "log2(dtype max / absmax_max): doublings left before overflow.")
    first_nonfinite_step = _int("first_nonfinite_step", "The step of the stage's first non-finite sample, if any.")
    trend = _list("trend", "[[step, absmax], ...]: up to 8 of the interval's samples (absmax None: not finite).")


class Numerics(View):
    """An interval's `numerics` part: the numerics statistics' cadence and warnings, and each stage sampled."""
    __slots__ = ()
    every = _int("every", "Statistics taken at every this many steps.")
    warnings = _int("warnings", "numerics_drift warnings raised in the interval.", 0)
    warnings_total = _int("warnings_total", "... and in the segment so far.", 0)
    ignored_stages = _int("ignored_stages", "Stages past the detector's limit, not followed.", 0)
    stages = _entries("stages", NumericsStage, "{\"span/tensor\": its entry}.")


# ---- records -------------------------------------------------------------------------------------------------

class Record(View):
    """Any run-log record: the common header (a record of a kind this reader does not know reads as this)."""
    __slots__ = ()
    type = _str("type", "The record's kind: run_start, interval, tick, spans, event, snapshot, run_end.")
    time_unix = _num("time_unix", "Unix time the record was written (a tick: the instant it describes), seconds.")
    rank = _int("rank", "The writing rank.")
    role = _str("role", "Its role (target, drafter, or a loop's own).")

    _HEADER = frozenset(("type", "time_unix", "rank", "role"))

    def body(self) -> dict:
        """The record's own fields (the common header left out), as written: for showing a record whole."""
        return {k: v for k, v in self._d.items() if k not in self._HEADER}


class Clock(View):
    """run_start's `clock`: perf_counter_ns and unix_ns read back to back."""
    __slots__ = ()
    perf_counter_ns = _int("perf_counter_ns", "time.perf_counter_ns() at the anchor, ns.")
    unix_ns = _int("unix_ns", "time.time_ns() at the anchor, ns.")


class ComputePeak(View):
    """One of run_start's `compute_peaks` (`datasheet` or `measured`, profiler/floors.py): a peak MFU reads against."""
    __slots__ = ()
    flops_per_s = _num("flops_per_s", "The peak, FLOP/s.")
    what = _str("what", "What it is (the datasheet's figure, or the matmul measured), for the MFU's label.")


class MemorySize(View):
    """One of run_start's `memory_sizes`: a size the loop names per step (profiler.memory_sizes) and the settings that
    scale it, what the memory forecast (profiler/report/memory_forecast.py) scales a step's peak by."""
    __slots__ = ()
    role = _str("role", "The role whose steps name it (None: any role's).")
    scales = _map("scales", "{setting (a command-line flag: --tokens-per-batch, --max-length, --num-anchors): how a "
                            "step's memory grows with it, 1 linear, 2 quadratic}.")
    what = _str("what", "What it is, one line.")

    def exponent(self, flag: str) -> float | None:
        """How the size grows with the setting `flag` (None: it does not scale with it)."""
        v = self.scales.get(flag)
        return float(v) if _number(v) else None


class RunStart(Record):
    """`run_start`: once per segment, when the profiler starts."""
    __slots__ = ()
    schema = _int("schema", "Record-format version (profiler.schema.records.check_schema reads it).")
    run_id = _str("run_id", "The run's unique id, stable across resumed segments.")
    clock = _part("clock", Clock, "The anchor that turns span times into wall-clock times.")
    t_s = _num("t_s", "The interval clock when the segment began (its ticks' origin), seconds.")
    histogram_buckets_seconds = _list("histogram_buckets_seconds", "Upper bounds of the span-time histogram "
                                                                   "buckets, seconds (+Inf implicit).")
    detail_steps = _int("detail_steps", "Steps per interval whose raw spans go into a spans record.")
    detail_follows = _flag("detail_follows", "Whether the detail window keeps the steps its caller marks.")
    world_size = _int("world_size", "Ranks in the run.")
    pid = _int("pid", "The process id.")
    hostname = _str("hostname", "The machine's name.")
    python_version = _str("python_version", "Python's version.")
    torch_version = _str("torch_version", "torch's version.")
    device = _str("device", "The rank's device (cpu, cuda:N).")
    device_name = _str("device_name", "The device's name.")
    version = _str("version", "dflash-observability's version.")
    floors = _map("floors", "{device_copy, pinned_d2h, pinned_h2d, host_copy: bytes/s} measured at start.")
    compute_peaks = _map("compute_peaks", "{datasheet|measured: {flops_per_s, what}}: the device's peaks MFU reads "
                                          "against (profiler/floors.py compute_peaks; ComputePeak reads one).")
    interval_s = _num("interval_s", "The profile interval's length, seconds.")
    warmup_steps = _int("warmup_steps", "Steps from the first set_step that are warm-up (0: none).")
    phase_spans = _list("phase_spans", "Span names whose time is a phase (compile, eval, checkpoint), not steady "
                                       "work.")
    span_table = _map("span_table", "{span name: {role, kind, ...}}: what each of the loop's spans is (work, wait, "
                                     "phase, collective, a flow's end); profiler.schema.span_kinds reads it.")
    memory_sizes = _map("memory_sizes", "{size name: {role, scales, what}}: the sizes the loop names per step and "
                                         "the settings that scale each (ProfilerConfig.memory_sizes; MemorySize "
                                         "reads one).")
    memory_caps = _map("memory_caps", "{setting: the setting whose value the forecast's largest of it may not "
                                       "pass} (ProfilerConfig.memory_caps).")
    config = _map("config", "The training config (any JSON).")
    gpu_steps_per_s = _num("gpu_steps_per_s", "Logs before 2026-12-04: GPU-timed steps per second (> 0: sampled).")

    @property
    def marks_warmup(self) -> bool:
        """Whether the segment's intervals carry warm-up marks (logs written before them have no warmup_steps)."""
        return "warmup_steps" in self._d

    @property
    def lists_phases(self) -> bool:
        """Whether the segment lists its phase spans (logs written before phases were listed have no phase_spans)."""
        return "phase_spans" in self._d


class Interval(Record):
    """`interval`: one per interval_s per rank, a last one `final`. Also reads a tick window
    (profiler.schema.windows.tick_windows), whose shape is an interval's."""
    __slots__ = ()
    index = _int("index", "Interval number from 0 in the segment (a tick window: the earlier tick's).")
    step = _int("step", "The step at its close (None before the first set_step).")
    warmup = _flag("warmup", "The interval began before warmup_steps were done.")
    final = _flag("final", "The run's last interval.")
    source = _str("source", "\"ticks\" for a tick window (profiler.schema.windows.tick_windows); absent on intervals.")
    step_rate = _part("step_rate", StepRate, "How far set_step advanced the step.")
    start_s = _num("start_s", "Its start on the interval clock (monotonic), seconds.")
    end_s = _num("end_s", "Its end on the interval clock, seconds.")
    duration_seconds = _num("duration_seconds", "Its length, seconds.")
    spans = _entries("spans", SpanEntry, "{span name: its entry}.")
    counters = _entries("counters", CounterStats, "{counter name: total, per_second, run_total}.")
    gauges = _entries("gauges", GaugeStats, "{gauge name: last, mean, max}.")
    metrics = _entries("metrics", MetricStats, "{metric name: last, mean}.")
    memory = _part("memory", Memory, "NVML and allocator memory.")
    threads = _views("threads", SpanThread, "Every thread that recorded spans.")
    threads_cpu_seconds = _map("threads_cpu_seconds", "{thread name: CPU seconds since the last interval}, most "
                                                         "first.")
    profiler_share = _num("profiler_share", "The profiler's and exporters' threads' CPU over duration_seconds (a "
                                           "fraction); None for an empty interval.")
    exporters = _entries("exporters", ExporterStats, "{exporter name: exported, dropped, failed} so far.")
    open_spans = _views("open_spans", OpenSpans, "Per thread, the spans still open at its end.")
    stack_samples = _part("stack_samples", StackSamples, "py-spy samples of the interval (when asked for).")
    numerics = _part("numerics", Numerics, "The numerics statistics per stage (profiler/numerics.py).")

    @property
    def measured_gpus(self) -> list:
        """The NVML per-GPU entries, or [] where memory was not measured."""
        return self.memory.measured_gpus

    @property
    def open_at_end(self) -> dict:
        """{span name: [(thread, open_seconds), ...]}, longest first (profiler.schema.windows.open_at_end)."""
        return windows.open_at_end(self._d.get("open_spans"))

    def phase_seconds(self, phase_spans) -> dict:
        """{phase span: its self CPU seconds in the interval} (profiler.schema.windows.phase_seconds)."""
        return windows.phase_seconds([self._d], phase_spans)

    def phase_share(self, phase_spans) -> float:
        """The share of the interval's wall its phases took (profiler.schema.windows.phase_share)."""
        return windows.phase_share(self._d, phase_spans)

    def is_steady(self, phase_spans) -> bool:
        """Steady work: past warm-up, not final, at most a tenth in phases (profiler.schema.windows.is_steady)."""
        return windows.is_steady(self._d, phase_spans)


class TickSpan(View):
    """One span's cumulative totals in a `tick`."""
    __slots__ = ()
    count = _int("count", "Spans collected complete so far in the segment.", 0)
    cpu_seconds = _num("cpu_seconds", "CPU wall time credited up to the instant (open spans' elapsed part "
                                     "included), seconds.")
    self_seconds = _num("self_seconds", "cpu_seconds less the children's time, seconds.")
    gpu_seconds = _num("gpu_seconds", "GPU windows of the resolved CUDA pairs, seconds (absent while none).")
    gpu_self_seconds = _num("gpu_self_seconds", "gpu_seconds less the children's time, seconds.")
    gpu_count = _int("gpu_count", "Spans with a resolved CUDA pair.")


class TickMetric(View):
    """One training scalar's cumulative totals in a `tick`."""
    __slots__ = ()
    sum = _num("sum", "Sum of the finite values recorded so far in the segment.")
    count = _int("count", "How many finite values.", 0)
    nonfinite = _int("nonfinite", "NaN/Inf values recorded (present when above 0).", 0)


class Tick(Record):
    """`tick`: cumulative totals between intervals (profiler.schema.windows.tick_windows turns pairs into windows)."""
    __slots__ = ()
    index = _int("index", "0, 1, 2 ... per segment.")
    t_s = _num("t_s", "The interval clock at the instant, seconds.")
    step = _int("step", "The last step given to set_step; None before the first.")
    warmup = _flag("warmup", "The instant is before the steady window began.")
    final = _flag("final", "The tick of the run's final close.")
    counters = _map("counters", "{counter name: run total so far} (numbers).")
    spans = _entries("spans", TickSpan, "{span name: its cumulative totals}.")
    metrics = _entries("metrics", TickMetric, "{metric name: sum, count, nonfinite}.")


class RawSpan(View):
    """One kept span of a detail window (`spans[]` of a `spans` record)."""
    __slots__ = ()
    id = _int("id", "Unique within the rank's segment.")
    parent = _int("parent", "The enclosing span's id on the same thread, or None.")
    name = _str("name", "The span's name.")
    thread = _str("thread", "Its thread's name.")
    tid = _int("tid", "Its OS thread id.")
    depth = _int("depth", "Nesting depth on its thread.")
    start_unix_ns = _int("start_unix_ns", "Its begin, Unix ns.")
    end_unix_ns = _int("end_unix_ns", "Its end, Unix ns.")
    cpu_seconds = _num("cpu_seconds", "Its CPU (wall) duration, seconds.")
    gpu_seconds = _num("gpu_seconds", "Its GPU window, seconds; None without CUDA timing.")
    gpu_start_unix_ns = _int("gpu_start_unix_ns", "Where its GPU window began, Unix ns (where placed).")
    bytes = _num("bytes", "Bytes it declared; None unless declared.")
    attrs = _map("attrs", "Its tags ({\"flow\": \"1:7\", \"detail\": true, ...}); {} untagged.")


class DetailWindow(Record):
    """`spans`: the raw spans of the detail window's steps that ended in one interval."""
    __slots__ = ()
    index = _int("index", "The interval its spans ended in.")
    steps = _list("steps", "[first, last] window steps its spans began in; None when only detail-tagged spans.",
                  optional=True)
    spans = _views("spans", RawSpan, "The kept spans.")
    dropped = _int("dropped", "Spans of the window not kept (over MAX_DETAIL_SPANS).", 0)


class RunLogLoss(View):
    """run_end's `run_log`: what a full disk cost the log."""
    __slots__ = ()
    error = _str("error", "The write's error (\"No space left on device\").")
    dropped_records = _int("dropped_records", "Records the log could not take.")


class RunEnd(Record):
    """`run_end`: the segment's end and its whole-segment aggregates."""
    __slots__ = ()
    step = _int("step", "The step at the end.")
    status = _str("status", "ok, an exception's class name, or hang / thread_crash: C / oom: C / killed: SIG.")
    duration_seconds = _num("duration_seconds", "The segment's length, seconds.")
    intervals = _int("intervals", "Interval records the segment wrote.")
    run_log = _maybe("run_log", RunLogLoss, "Only when the disk filled during the segment.")
    spans = _entries("spans", SpanEntry, "{span name: its whole-segment entry} (no buckets, no open_cpu_seconds).")
    counters = _entries("counters", CounterStats, "{counter name: total, per_second} over the segment.")
    exporters = _entries("exporters", ExporterStats, "{exporter name: exported, dropped, failed}.")


class SnapshotOpenSpan(View):
    """One open span of a snapshot's thread, judged against its recent p95."""
    __slots__ = ()
    name = _str("name", "The span's name.")
    open_seconds = _num("open_seconds", "How long it had been open, seconds.")
    p95_seconds = _num("p95_seconds", "Its recent p95, seconds (None: not judged).")
    limit_seconds = _num("limit_seconds", "max(10 x p95, 5 s): open longer is stuck, seconds.")
    stuck = _flag("stuck", "Whether it was open past its limit.")
    stuck_basis = _str("stuck_basis", "Why it was not judged.")


class SnapshotThread(View):
    """One thread of a `snapshot` record."""
    __slots__ = ()
    name = _str("name", "The thread's name.")
    native_id = _int("native_id", "Its OS thread id.")
    open_spans = _views("open_spans", SnapshotOpenSpan, "Its open spans, judged.")
    stuck = _flag("stuck", "Whether any of them is stuck.")
    stuck_span = _str("stuck_span", "The innermost stuck span.")
    stuck_frame = _str("stuck_frame", "Its innermost frame then.")
    frames = _list("frames", "Its stack, innermost first, as \"func (file.py:123)\".")


class Snapshot(Record):
    """`snapshot`: what `dflash-profile snapshot` saw, written by the rank itself."""
    __slots__ = ()
    pid = _int("pid", "The process id.")
    step = _int("step", "Its step.")
    native = _flag("native", "Whether py-spy read native frames.")
    file = _str("file", "The JSON kept under RUN_DIR/snapshots/.")
    stuck = _flag("stuck", "Whether any span is stuck.")
    stuck_rule = _str("stuck_rule", "The rule a span is stuck by.")
    note = _str("note", "A note (e.g. no endpoint).")
    threads = _views("threads", SnapshotThread, "Every thread, with its open spans and frames.")


# ---- events ----------------------------------------------------------------------------------------------------

class Event(Record):
    """`event`: `kind` plus fields (a kind without a view of its own reads as this; `body()` shows it whole)."""
    __slots__ = ()
    kind = _str("kind", "What happened (checkpoint, eval, stop, throughput, capture, the forensics kinds, ...).")
    step = _int("step", "The step (defaults to the current one).")


class Throughput(Event):
    """`throughput`: a rank's steady state, once per segment (dflash/throughput.py)."""
    __slots__ = ()
    window = _str("window", "\"steady state\".")
    steady_tokens_per_s = _num("steady_tokens_per_s", "Tokens over the steady seconds, tokens/s.")
    steady_steps_per_s = _num("steady_steps_per_s", "Steps over the steady seconds, steps/s.")
    steady_tokens = _num("steady_tokens", "Tokens in the steady window.")
    steady_model_flops = _num("steady_model_flops", "Model FLOPs in the steady window (dflash/flops.py's "
                                                    "convention); absent where the loop counts none.")
    steady_model_flops_per_s = _num("steady_model_flops_per_s", "Model FLOPs over the steady seconds, FLOP/s.")
    steady_steps = _int("steady_steps", "Steps in the steady window.")
    steady_seconds = _num("steady_seconds", "The steady window less its phases, seconds.")
    window_seconds = _num("window_seconds", "From the end of the last warm-up step to the end of the last step, "
                                           "seconds.")
    phases_seconds = _map("phases_seconds", "{phase span: seconds inside the window, left out of "
                                               "steady_seconds}.")
    warmup_steps = _int("warmup_steps", "Warm-up steps.")
    first_step = _int("first_step", "The segment's first step.")
    last_step = _int("last_step", "Its last step.")


class CapturedSpan(View):
    """One of our spans that began in a Kineto capture's steps."""
    __slots__ = ()
    name = _str("name", "The span's name.")
    thread = _str("thread", "Its thread's name.")
    tid = _int("tid", "Its OS thread id.")
    depth = _int("depth", "Nesting depth on its thread.")
    step = _int("step", "The step it began in.")
    start_unix_ns = _int("start_unix_ns", "Its begin, Unix ns.")
    end_unix_ns = _int("end_unix_ns", "Its end, Unix ns.")
    cpu_seconds = _num("cpu_seconds", "Its CPU (wall) duration, seconds.")
    gpu_seconds = _num("gpu_seconds", "Its GPU window (our CUDA events), seconds; None without one.")
    bytes = _num("bytes", "Bytes it declared.")


class Capture(Event):
    """`capture`: one Kineto capture of this rank (profiler/capture.py)."""
    __slots__ = ()
    steps = _list("steps", "[first step, last step recorded].")
    steps_recorded = _int("steps_recorded", "Steps in the trace.")
    steps_asked = _int("steps_asked", "Steps asked for.")
    source = _str("source", "control or schedule.")
    options = _map("options", "{memory, shapes, stacks}: torch.profiler's options.")
    files = _list("files", "[path] of the trace; [] when none was written (error says why).")
    bytes = _num("bytes", "The gzip'd trace's size, bytes.")
    bytes_per_step = _num("bytes_per_step", "bytes over steps_recorded.")
    activities = _list("activities", "[\"cpu\"] or [\"cpu\", \"cuda\"].")
    begin_seconds = _num("begin_seconds", "Preparing torch.profiler on the training thread, seconds.")
    stop_seconds = _num("stop_seconds", "Stopping it and writing the file, seconds.")
    ended = _str("ended", "Why it stopped.")
    captured_spans = _views("captured_spans", CapturedSpan, "Every span that began in the captured steps.")
    spans_unfinished = _int("spans_unfinished", "Spans begun in the capture still open or unresolved.")
    error = _str("error", "Why the capture failed or never began.")


class Startup(Event):
    """`startup`: where the rank's start-up went, from launch to its first step (dflash/startup.py)."""
    __slots__ = ()
    origin = _str("origin", "launch or process.")
    origin_unix_ns = _int("origin_unix_ns", "The origin, Unix ns.")
    total_seconds = _num("total_seconds", "From the origin to the first step, seconds.")
    phases_seconds = _map("phases_seconds", "{phase: seconds}, in order; they sum to total_seconds.")
    bytecode = _str("bytecode", "Where the rank keeps compiled modules.")
    intra_op_threads = _int("intra_op_threads", "torch's intra-op threads.")
    omp_wait_policy = _str("omp_wait_policy", "OMP_WAIT_POLICY as the rank started, or None.")


class Nonfinite(Event):
    """`nonfinite`: a NaN or Inf found (profiler/nonfinite.py)."""
    __slots__ = ()
    span = _str("span", "The span whose tensors were checked.")
    tensor = _str("tensor", "The first flagged tensor.")
    tensors = _list("tensors", "Every flagged tensor.")
    count = _int("count", "Findings on this rank so far, this one included.")
    policy = _str("policy", "--on-nonfinite: stop, skip-step or warn.")
    action = _str("action", "drafter.fwd_bwd only: skipped_step or applied.")
    src = _int("src", "drafter.recv only: the target rank that sent the payload.")
    batch = _int("batch", "drafter.recv only: its batch index.")


class ForecastSetting(View):
    """One setting of a `memory_forecast` event."""
    __slots__ = ()
    flag = _str("flag", "The setting (a command-line flag).")
    current = _num("current", "Its value in the run.")
    largest = _num("largest", "The largest value that keeps headroom_share of every GPU free (None: no value).")
    scale = _num("scale", "largest over current (1024: not limited by memory).")
    need_bytes_at_current = _num("need_bytes_at_current", "What the limiting GPU's ranks need at current, bytes.")
    limit_bytes = _num("limit_bytes", "What that GPU has for them, headroom kept, bytes.")
    gpu = _str("gpu", "The limiting GPU (host:index).")
    ranks = _list("ranks", "The ranks on it.")
    transient_steps = _list("transient_steps", "Warm-up steps whose peak binds the forecast.")
    capped_by = _map("capped_by", "{flag, value, memory_largest} where another setting caps largest (run_start "
                                  "memory_caps); {} where none does.")


class MemoryForecast(Event):
    """`memory_forecast`: the run's memory forecast while it trains (dflash/memory_watch.py)."""
    __slots__ = ()
    settings = _views("settings", ForecastSetting, "One per setting that scales a step's sizes.")
    headroom_share = _num("headroom_share", "The share of each GPU kept free.")
    steps = _int("steps", "Steps past warm-up the forecast is fitted to, over all ranks.")


class NumericsDrift(Event):
    """`numerics_drift`: a statistic of a stage drifts toward overflow, before any non-finite value
    (profiler/numerics.py)."""
    __slots__ = ()
    span = _str("span", "The stage's span.")
    tensor = _str("tensor", "The stage's tensor.")
    statistic = _str("statistic", "absmax or rms.")
    rule = _str("rule", "growth, near_range, square_range or jump.")
    value = _num("value", "The statistic at `step`.")
    baseline = _num("baseline", "The baseline's median of the statistic.")
    growth_per_step = _num("growth_per_step", "Its growth factor per step over the window (None: a jump).")
    steps_to_overflow = _int("steps_to_overflow", "Steps until absmax reaches the dtype's largest value at that "
                                                  "growth (None: no growth to project).")
    window = _list("window", "[first step, last step] of the samples the rule read.")
    dtype = _str("dtype", "The tensor's dtype.")
    trend = _list("trend", "[[step, absmax], ...]: the stage's last samples.")
    policy = _str("policy", "--on-numerics-drift: warn, checkpoint or stop.")


class Checkpoint(Event):
    """`checkpoint`: a checkpoint written."""
    __slots__ = ()
    path = _str("path", "Its directory.")
    seconds = _num("seconds", "Writing it took, seconds.")


class Eval(Event):
    """`eval`: the draft-and-verify evaluation's result (dflash/evaluate.py)."""
    __slots__ = ()
    prompts = _int("prompts", "Held-out prompts decoded.")
    measured_tau = _num("measured_tau", "Acceptance length measured by decoding.")
    simulated_tau = _num("simulated_tau", "Acceptance length simulated teacher-forced.")
    simulated_tau_independent = _num("simulated_tau_independent", "The same by the independent-positions formula.")
    lossless = _flag("lossless", "Whether speculative decoding matched greedy decoding everywhere.")
    mismatches = _int("mismatches", "Prompts where it did not.")
    generated_tokens = _int("generated_tokens", "Tokens generated.")


class Stop(Event):
    """`stop` (and `eval_skipped`): why the loop stopped (or skipped the evaluation)."""
    __slots__ = ()
    reason = _str("reason", "Why.")
    dropped_batches = _int("dropped_batches", "Batches dropped at the stop.")


class BadRecords(Event):
    """`bad_records`: training records skipped."""
    __slots__ = ()
    path = _str("path", "The data file.")
    count = _int("count", "Records skipped.")
    examples = _list("examples", "The first of them, with why.")


class MemorySnapshot(Event):
    """`memory_snapshot`: an allocator snapshot `dflash-profile memory` asked for (profiler/allocator_snapshot.py)."""
    __slots__ = ()
    file = _str("file", "The pickle under RUN_DIR/forensics/.")
    bytes = _num("bytes", "Its size, bytes.")
    history = _flag("history", "Whether the allocator keeps its history.")
    reserved_bytes = _num("reserved_bytes", "Reserved over the snapshot's segments, bytes.")
    allocated_bytes = _num("allocated_bytes", "Allocated over them, bytes.")
    segments = _int("segments", "The snapshot's segments.")
    open_spans = _views("open_spans", OpenSpans, "What each thread was inside when it was taken.")


class RingEntry(View):
    """One transfer-protocol step of a rank's flight recorder (`extra.transfer_ring[]`)."""
    __slots__ = ()
    time_unix = _num("time_unix", "When, Unix seconds.")
    kind = _str("kind", "slot_acquired, submit, header_sent, completed, end_sent, ..., received, stop_sent.")
    thread = _str("thread", "The thread that took the step.")
    dst = _int("dst", "A target's: the drafter rank it sends to.")
    src = _int("src", "A drafter's: the target rank it receives from.")
    batch = _int("batch", "The batch index.")
    in_flight = _int("in_flight", "Transfers in flight then.")
    sent = _int("sent", "Batches sent so far.")
    ready = _str("ready", "The payload's event: done, pending, or None.")
    queued = _int("queued", "Batches queued.")
    shape = _list("shape", "The header's shape.")
    end = _flag("end", "A header that ends the stream.")
    error = _str("error", "Why the sender or receiver failed.")


class ForensicThread(View):
    """One Python thread of a forensics dump (`threads[]`)."""
    __slots__ = ()
    thread = _str("thread", "The thread's name.")
    native_id = _int("native_id", "Its OS thread id.")
    daemon = _flag("daemon", "Whether it is a daemon thread.")
    stack = _list("stack", "Outermost frame first, \"file:line in function: source\" (the innermost 40).")


class Forensics(Event):
    """A forensics dump (`hang`, `oom`, `thread_crash`, `signal`, `peer_lost`; profiler/forensics.py)."""
    __slots__ = ()
    threads = _views("threads", ForensicThread, "Every Python thread's stack.")
    open_spans = _views("open_spans", OpenSpans, "The profiler's open spans per thread.")
    extra = _map("extra", "{source name: state} of the registered forensics sources.")
    forensics_file = _str("forensics_file", "The text file's path.")

    @property
    def transfer_ring(self) -> list | None:
        """The transfer flight recorder in `extra` (oldest first), or None when the dump holds none."""
        ring = self.extra.get("transfer_ring")
        return [RingEntry(e if type(e) is dict else _EMPTY) for e in ring] if type(ring) is list else None


class Hang(Forensics):
    """`hang`: no progress for --hang-timeout-s."""
    __slots__ = ()
    stalled_seconds = _num("stalled_seconds", "How long nothing progressed, seconds.")
    timeout_seconds = _num("timeout_seconds", "The hang timeout, seconds.")


class LastFinishedSpan(View):
    """The span that ended last on a crashed thread."""
    __slots__ = ()
    name = _str("name", "The span's name.")
    ended_seconds_ago = _num("ended_seconds_ago", "How long before the dump it ended, seconds.")


class ThreadCrash(Forensics):
    """`thread_crash`: an exception ended a thread or left the rank's main loop."""
    __slots__ = ()
    thread = _str("thread", "The thread it ended.")
    error = _str("error", "\"Class: message\".")
    traceback = _str("traceback", "Its traceback.")
    last_finished_span = _maybe("last_finished_span", LastFinishedSpan, "The span that ended last on that thread.")


class Oom(ThreadCrash):
    """`oom`: a torch.OutOfMemoryError anywhere in the cause chain."""
    __slots__ = ()
    allocator = _part("allocator", Allocator, "The allocator's stats (peaks not reset).")
    headroom_history = _any("headroom_history", "NVML headroom low points of the last intervals, oldest first "
                                                 "([] without NVML; {available: false, reason} when unreadable).")
    memory_history_file = _str("memory_history_file", "The allocator history pickle (--memory-history N), or None.")
    memory_history_error = _str("memory_history_error", "Why the history could not be dumped.")
    span = _str("span", "The span the OOM came from.")
    kernel = _str("kernel", "The triton kernel whose autotune benchmark raised it.")


class Signal(Forensics):
    """`signal`: a stop by signal; with `forced`, a dump of a rank no loop could stop."""
    __slots__ = ()
    signal = _str("signal", "SIGTERM or SIGINT.")
    forced = _flag("forced", "The rank was blocked (a forced dump).")
    reason = _str("reason", "Why it was forced.")


class PeerLost(Forensics):
    """`peer_lost`: the main loop failed because another rank's process ended."""
    __slots__ = ()
    reason = _str("reason", "The connection error.")


_EVENTS = {"throughput": Throughput, "capture": Capture, "startup": Startup, "nonfinite": Nonfinite,
           "checkpoint": Checkpoint, "eval": Eval, "stop": Stop, "eval_skipped": Stop, "bad_records": BadRecords,
           "memory_snapshot": MemorySnapshot, "hang": Hang, "thread_crash": ThreadCrash, "oom": Oom,
           "signal": Signal, "peer_lost": PeerLost, "numerics_drift": NumericsDrift,
           "memory_forecast": MemoryForecast}
"""The event kinds whose fields differ, and their views."""


# ---- making views ----------------------------------------------------------------------------------------------

def event(rec) -> Event:
    """An event's view, of its kind's class (Event for a kind without one)."""
    if isinstance(rec, Event) and type(rec) is not Event:
        return rec
    d = rec._d if isinstance(rec, View) else rec
    kind = d.get("kind")
    return (_EVENTS.get(kind, Event) if type(kind) is str else Event)(d)


_RECORDS = {RUN_START: RunStart.of, INTERVAL: Interval.of, TICK: Tick.of, SPANS: DetailWindow.of, EVENT: event,
            SNAPSHOT: Snapshot.of, RUN_END: RunEnd.of}


def view(rec) -> Record:
    """A record's view, of its type's class (Record for a type this reader does not know)."""
    if isinstance(rec, Record) and type(rec) is not Record:
        return rec
    d = rec._d if isinstance(rec, View) else rec
    kind = d.get("type")
    return (_RECORDS.get(kind, Record.of) if type(kind) is str else Record.of)(d)


run_start, interval, tick, detail_window, snapshot, run_end = (
    RunStart.of, Interval.of, Tick.of, DetailWindow.of, Snapshot.of, RunEnd.of)


class BadRecord(ValueError):
    """A record that cannot be read as docs/RUNLOG.md says; the message is why, in one line."""


def parse(rec) -> Record:
    """The record's view (`view`), or BadRecord with the reason (`problem`): a reader counts it as one bad line."""
    if not isinstance(rec, dict):
        raise BadRecord("not a JSON object")
    why = problem(rec)
    if why is not None:
        raise BadRecord(why)
    return view(rec)


# ---- the checks ------------------------------------------------------------------------------------------------

_SHAPES = (("step", (int, type(None))), ("index", int), ("duration_seconds", _NUM), ("spans", dict),
           ("counters", dict), ("gauges", dict), ("metrics", dict), ("kind", str))
"""Fields readers compute with, and the types they must have where a record holds them."""


_PLAIN = frozenset((float, int, type(None), list))
"""The types a span's cpu or gpu block holds (a list only as its buckets), checked in one pass."""


def _type_name(rec: dict, key: str) -> str:
    return type(rec[key]).__name__ if key in rec else "missing"


def _shape_problem(rec: dict) -> str | None:
    """The checks every record but `spans` and `tick` gets: the _SHAPES types, then each span entry (an object with
    an integer count, number-or-null times in its cpu and gpu blocks) and counter (an object with a numeric
    total)."""
    for key, want in _SHAPES:
        if key in rec:
            v = rec[key]
            if not isinstance(v, want) or v is True or v is False:
                return f"{key} is {type(v).__name__}"
    spans = rec.get("spans")
    if spans:
        for name, e in spans.items():
            if not isinstance(e, dict) or not isinstance(e.get("count", 0), int):
                return f"span {name!r} is not an entry with an integer count"
            for clock in ("cpu", "gpu"):
                block = e.get(clock)
                if block is None:
                    continue
                if not isinstance(block, dict):
                    return f"span {name!r}: its {clock} block holds a non-number"
                kinds = list(map(type, block.values()))   # in C first: a week's log holds a million blocks
                if _PLAIN.issuperset(kinds) and kinds.count(list) <= (type(block.get("buckets")) is list):
                    continue   # numbers, nulls and at most one list, the buckets
                for k, v in block.items():
                    if k != "buckets" and v is not None and not isinstance(v, _NUM):
                        return f"span {name!r}: its {clock} block holds a non-number"
    counters = rec.get("counters")
    if counters:
        for name, c in counters.items():
            if not isinstance(c, dict) or not isinstance(c.get("total", 0), _NUM):
                return f"counter {name!r} has no numeric total"
    return None


def _number(v) -> bool:
    return isinstance(v, _NUM) and v is not True and v is not False


def _interval_problem(rec: dict) -> str | None:
    """An interval's: the shapes, and a numeric time_unix and duration_seconds (a plot places it by the one, every
    rate and share divides by the other)."""
    why = _shape_problem(rec)
    if why is None:
        for key in ("time_unix", "duration_seconds"):
            if not _number(rec.get(key)):
                return f"interval: {key} is {_type_name(rec, key)}"
    return why


_THROUGHPUT_NUMBERS = ("steady_tokens_per_s", "steady_steps_per_s", "steady_tokens", "steady_steps",
                       "steady_model_flops", "steady_model_flops_per_s",
                       "steady_seconds", "window_seconds")


def _throughput_problem(rec: dict) -> str | None:
    """A throughput event's: its figures numbers or null, steady_seconds a number wherever steady_tokens_per_s is
    (the surfaces sum the one and take the longest of the other), phases_seconds {name: seconds or null}."""
    for key in _THROUGHPUT_NUMBERS:
        v = rec.get(key)
        if v is not None and not _number(v):
            return f"throughput: {key} is {type(v).__name__}"
    if rec.get("steady_tokens_per_s") is not None and rec.get("steady_seconds") is None:
        return "throughput: steady_tokens_per_s without steady_seconds"
    phases = rec.get("phases_seconds", {})
    if not isinstance(phases, dict) or not all(v is None or _number(v) for v in phases.values()):
        return "throughput: phases_seconds is not {phase: seconds}"
    return None


def _event_problem(rec: dict) -> str | None:
    why = _shape_problem(rec)
    if why is None and rec.get("kind") == "throughput":
        return _throughput_problem(rec)
    return why


def _run_start_problem(rec: dict) -> str | None:
    """A run_start's: the shapes, phase_spans a list of names (a string would read as its letters) and
    histogram_buckets_seconds a list of numbers (the exporters and quantiles compute with them)."""
    why = _shape_problem(rec)
    if why is not None:
        return why
    phases = rec.get("phase_spans", [])
    if not isinstance(phases, list) or not all(isinstance(n, str) for n in phases):
        return "run_start: phase_spans is not a list of span names"
    bounds = rec.get("histogram_buckets_seconds", [])
    if not isinstance(bounds, list) or not all(_number(b) for b in bounds):
        return "run_start: histogram_buckets_seconds is not a list of numbers"
    return None


def _tick_problem(rec: dict) -> str | None:
    """A tick's: index, t_s and time_unix numbers, spans and counters maps of numbers, metrics of number maps."""
    for key, want in (("index", int), ("t_s", _NUM), ("spans", dict), ("counters", dict)):
        v = rec.get(key)
        if not isinstance(v, want) or v is True or v is False:
            return f"tick: {key} is {type(v).__name__}"
    for name, e in rec["spans"].items():
        if not isinstance(e, dict) or not all(isinstance(v, _NUM) for v in e.values()):
            return f"tick: span {name!r} holds a non-number"
    if not all(isinstance(v, _NUM) for v in rec["counters"].values()):
        return "tick: a counter is not a number"
    metrics = rec.get("metrics", {})
    if not isinstance(metrics, dict):
        return f"tick: metrics is {type(metrics).__name__}"
    for name, m in metrics.items():
        if not isinstance(m, dict) or not all(isinstance(v, _NUM) for v in m.values()):
            return f"tick: metric {name!r} holds a non-number"
    if not _number(rec.get("time_unix")):   # its window's time: where a plot places it
        return f"tick: time_unix is {_type_name(rec, 'time_unix')}"
    return None


def _detail_problem(rec: dict) -> str | None:
    """A detail window's: its spans a list of raw spans."""
    return None if isinstance(rec.get("spans", []), list) else "spans is not a list"


_CHECKS = {SPANS: _detail_problem, TICK: _tick_problem, INTERVAL: _interval_problem, EVENT: _event_problem,
           RUN_START: _run_start_problem}


def problem(rec: dict) -> str | None:
    """Why the record cannot be read as docs/RUNLOG.md says (a field a reader needs is missing or of the wrong
    type), in one line, or None. Unknown fields and kinds are allowed."""
    kind = rec.get("type")
    check = _CHECKS.get(kind) if type(kind) is str else None
    return (check or _shape_problem)(rec)
