"""The module-level instrumentation API: spans, counters, gauges, metrics, steps, events and forensics hooks.

`span()` reads one module global, `_spans`: the active recorder's thread-local view (its `d` is the calling
thread's name -> span cache), or a view of the shared no-op dict with no profiler. A hit is one attribute read
and one subscript; a miss validates the name (ValueError, profiler or not) and fills the cache.
"""
from __future__ import annotations

from types import SimpleNamespace

from profiler.spans import NoopSpan, bind_lookup, check_bytes, check_name

_noop_spans: dict = {}
_noop_view = SimpleNamespace(d=_noop_spans)   # with no profiler: the `d` of the recorder's thread-local view
_spans = _noop_view            # swapped by activate()/deactivate()
_active = None                 # the active Profiler
_recorder = None               # its SpanRecorder
_checked_names: set = set()    # counter/gauge/metric names already validated
_PLAIN = (float, int)          # gauge/metric values that need no check (bool and numpy types are checked)


def span(name, bytes=None):
    """Context manager and decorator timing a named stage (`with profiler.span("target.fwd"):`); `bytes=` gives
    a transfer's size, for its bandwidth. No-op with no active profiler."""
    if bytes is None:
        try:
            return _spans.d[name]
        except (AttributeError, KeyError, TypeError):   # a new name, this thread's first span, or no str at all
            pass
    return _make_span(name, bytes)


bind_lookup(span)   # a decorated function's span is looked up through span() at each call


def _make_span(name, nbytes):
    rec = _recorder
    if rec is not None:
        return rec.make_span(name, nbytes)
    check_bytes(name, nbytes)
    s = NoopSpan(check_name(name), nbytes)
    if nbytes is None:
        _noop_spans[name] = s
    return s


def active():
    """The active Profiler, or None."""
    return _active


def _check(name, what):
    if name not in _checked_names:
        check_name(name, what)
        _checked_names.add(name)


def count(name: str, n=1) -> None:
    """Add n (>= 0) to a monotonically increasing counter (e.g. "tokens")."""
    _check(name, "counter")
    rec = _recorder
    if rec is not None:
        if n < 0:
            raise ValueError(f"counter {name!r}: increment must be >= 0, got {n!r}")
        rec.count(name, n)


def gauge(name: str, value) -> None:
    """Set a gauge (e.g. "queue_depth"); intervals report last/mean/max."""
    _check(name, "gauge")
    rec = _recorder
    if rec is not None:
        if type(value) not in _PLAIN:   # a float or an int needs no check
            _check_scalar(name, "gauge", value)
        rec.gauge(name, value)


def metric(name: str, value) -> None:
    """Record a training scalar; a 0-dim tensor is kept as is and read on the collector thread at the next tick or
    interval close."""
    _check(name, "metric")
    rec = _recorder
    if rec is not None:
        if type(value) not in _PLAIN:   # a float or an int needs no check
            _check_scalar(name, "metric", value)
        rec.metric(name, value)


def _check_scalar(name, what, value) -> None:
    """ValueError now unless the interval close can make `value` one float (a one-element tensor, or anything
    float() takes): a bad value would fail the close and lose the interval. Reads numel() only, no device."""
    try:
        n = value.numel()   # a tensor: read at close, in one batch
    except (AttributeError, TypeError):
        n = None
    if n is not None:
        if n != 1:
            raise ValueError(f"{what} {name!r}: a number or a one-element tensor, got {n} elements")
        return
    try:
        float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} {name!r}: a number or a one-element tensor, got {value!r:.60}") from None


def tag(**attrs) -> None:
    """Attributes for the calling thread's innermost open span (`tag(flow="1:7")`), into its `spans` entry;
    `detail=True`/`False` decides whether the detail window keeps it, whatever step it begins in."""
    rec = _recorder
    if rec is not None:
        rec.tag(attrs)


def set_step(step: int) -> None:
    """Set the current training step (used in records, faults and forensics)."""
    p = _active
    if p is not None:
        p.set_step(step)


def in_detail() -> bool:
    """Whether the current step is in the detail window (profiler/detail.py): a producer marks the batches it
    makes in it, so their consumer keeps them too."""
    p = _active
    return p is not None and p.in_detail()


def keep_step() -> None:
    """Keep the current step in the detail window: a detail_follows consumer, for a batch its producer marked."""
    p = _active
    if p is not None:
        p.keep_step()


def event(kind: str, **fields) -> None:
    """Write an {"type": "event", "kind": kind, ...} record now (flushed)."""
    p = _active
    if p is not None:
        p.event(kind, **fields)


def corrupt(span_name: str, tensor, step=None, kinds=("nan", "drift")):
    """Fault-injection hook for `nan@SPAN` and `drift@SPAN`: the tensor, possibly NaN-multiplied or scaled;
    `step` (default: the current one) is matched against the fault's `:step=N`; `kinds`: the fault kinds this hook
    fires (a span with two hooks, one for each)."""
    p = _active
    if p is None:
        return tensor
    return p.corrupt(span_name, tensor, step, kinds)


def check_finite(span_name: str, tensors: dict, step=None, **fields) -> None:
    """Flag NaN/Inf in `tensors` ({name: tensor}) on the device, read back without a sync; the first found is
    a `nonfinite` event."""
    p = _active
    if p is not None:
        p.check_finite(span_name, tensors, step, **fields)


def check_flags(span_name: str, names: list, flags, step=None, **fields) -> None:
    """Like check_finite, for bool flags already computed on the device (true = bad), one per name."""
    p = _active
    if p is not None:
        p.nonfinite.check_flags(span_name, p.step if step is None else step, names, flags, **fields)


def check_numerics(span_name: str, tensors: dict, step=None, **fields) -> None:
    """Statistics of `tensors` ({name: tensor}, at most 8) on the device, read back without a sync, at the steps
    ProfilerConfig.numerics_every samples; the numerics detector warns (a `numerics_drift` event) when one drifts
    toward overflow (profiler/numerics.py). `jump=True`: a ratio whose order-of-magnitude jump warns too."""
    p = _active
    if p is not None:
        p.check_numerics(span_name, tensors, step, **fields)


def memory_sizes(**sizes) -> None:
    """The sizes this step's memory depends on (named non-negative numbers: `memory_sizes(tokens=4096)`), kept with
    the step's allocator peak on a CUDA device (profiler/memory_steps.py): the history the report's memory forecast
    is fitted to. ProfilerConfig.memory_sizes says which setting scales each. No-op with no active profiler."""
    p = _active
    if p is not None:
        p.memory_sizes(sizes)


def numerics_due(step=None) -> bool:
    """Whether `check_numerics()` samples this step (default: the current one): a caller that must prepare a tensor for
    it (a copy of the weights for the update ratio) does so only then. False with no active profiler."""
    p = _active
    return p is not None and p.numerics_due(step)


def numerics_drift():
    """The first `numerics_drift` warning read back so far (the collector thread fills it), or None."""
    p = _active
    return None if p is None else p.numerics.first


def nonfinite_found():
    """The first non-finite finding read back so far (the collector thread fills it), or None."""
    p = _active
    return None if p is None else p.nonfinite.first


def disk_full():
    """The OSError (ENOSPC or EDQUOT, filename the run log) with which the active profiler's run log found the
    disk full, or None: from then on the log keeps only its run_end, so the caller should stop (dflash: one line,
    exit 1)."""
    p = _active
    return None if p is None else p.disk_full


def note_disk_full(exc: OSError) -> None:
    """Another writer of the run (a file beside the log) found the disk full: the run log stops taking records
    but its frame, as if it had found it, and disk_full() names `exc.filename`."""
    p = _active
    if p is not None:
        p.runlog.note_full(exc)


def settle_nonfinite(timeout_s: float = 5.0):
    """Poll (up to timeout_s) until every check so far is read back; the first finding or None. A deliberate
    wait: only where a sync is fine (a save)."""
    p = _active
    return None if p is None else p.nonfinite.settle(timeout_s)


def register_forensics(name: str, fn) -> None:
    """Register fn() -> JSON-able state that the active profiler's forensics dumps include as `name`."""
    p = _active
    if p is not None:
        p.dumper.register(name, fn)


def forensics() -> dict:
    """Every registered forensics source's state now ({} with no active profiler)."""
    p = _active
    return {} if p is None else p.dumper.sources()


def activate(profiler, recorder) -> None:
    """Make `profiler` the process's active profiler; RuntimeError if one already is."""
    global _active, _recorder, _spans
    if _active is not None:
        raise RuntimeError(f"a profiler is already active in this process (rank {_active.rank}, "
                           f"run dir {_active.run_dir}); close it before starting another")
    _active, _recorder, _spans = profiler, recorder, recorder.local


def deactivate(profiler) -> None:
    """Clear the active profiler (only if it is `profiler`)."""
    global _active, _recorder, _spans
    if _active is profiler:
        _spans, _recorder, _active = _noop_view, None, None
