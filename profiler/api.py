"""The module-level instrumentation API: span, count, gauge, metric, set_step, in_detail, keep_step, event,
corrupt, and the forensics hooks check_finite, check_flags, nonfinite_found, register_forensics, forensics.

`span()` reads one module global, `_spans`: the active recorder's thread-local view (whose `d` is
the calling thread's name -> span-object cache), or a view of the shared no-op dict when no profiler
is active. A hit (the common case) is one attribute read and one subscript (no call); a miss validates
the name and fills the cache. So with no profiler `span("x")` returns the same no-op
object every time, and a bad name raises ValueError whether or not a profiler is active.
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
    """Context manager and decorator timing a named stage: `with profiler.span("target.fwd"):`; `bytes=` gives a
    transfer's size (its bandwidth in the interval record). No-op with no active profiler."""
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
    """Record a training scalar; a 0-dim tensor is kept as is and converted at interval close."""
    _check(name, "metric")
    rec = _recorder
    if rec is not None:
        if type(value) not in _PLAIN:   # a float or an int needs no check
            _check_scalar(name, "metric", value)
        rec.metric(name, value)


def _check_scalar(name, what, value) -> None:
    """ValueError here, at the call, unless the interval close can make `value` one float (a one-element
    tensor, or anything float() takes): one bad value would otherwise fail the whole close and lose the
    interval. Metadata only (numel()), never a device read."""
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
    """Attach attributes to the calling thread's innermost open span (e.g. `tag(flow="1:7")`); they
    reach the span's entry in `spans` records (the trace's flow arrows, OTel span attributes).
    `detail=True`/`False` decides whether the detail window keeps the span, whatever step it begins in."""
    rec = _recorder
    if rec is not None:
        rec.tag(attrs)


def set_step(step: int) -> None:
    """Set the current training step (used in records, faults and forensics)."""
    p = _active
    if p is not None:
        p.set_step(step)


def in_detail() -> bool:
    """Whether the current step is in this rank's detail window (its raw spans go into a `spans` record;
    profiler/detail.py). A producer marks the batches it makes in it, so their consumer can keep them too."""
    p = _active
    return p is not None and p.in_detail()


def keep_step() -> None:
    """Keep the current step in the detail window (from its set_step on): a consumer whose profiler has
    ProfilerConfig.detail_follows calls it for each step that trains on a batch its producer marked."""
    p = _active
    if p is not None:
        p.keep_step()


def event(kind: str, **fields) -> None:
    """Write an {"type": "event", "kind": kind, ...} record now (flushed)."""
    p = _active
    if p is not None:
        p.event(kind, **fields)


def corrupt(span_name: str, tensor, step=None):
    """Fault-injection hook for `nan@SPAN`: returns the tensor (possibly NaN-multiplied). `step`
    (default: the current step) is the step the fault's `:step=N` is matched against."""
    p = _active
    if p is None:
        return tensor
    return p.corrupt(span_name, tensor, step)


def check_finite(span_name: str, tensors: dict, step=None, **fields) -> None:
    """Flag NaN/Inf in `tensors` ({name: tensor}) on the device, read back without a sync; the first
    one found is written as a `nonfinite` event naming span, step, rank and tensor."""
    p = _active
    if p is not None:
        p.check_finite(span_name, tensors, step, **fields)


def check_flags(span_name: str, names: list, flags, step=None, **fields) -> None:
    """Like check_finite, for bool flags already computed on the device (true = bad), one per name."""
    p = _active
    if p is not None:
        p.nonfinite.check_flags(span_name, p.step if step is None else step, names, flags, **fields)


def nonfinite_found():
    """The first non-finite finding read back so far ({"span", "step", "rank", "tensor", ...}), or None.
    A plain attribute read: the collector thread fills it."""
    p = _active
    return None if p is None else p.nonfinite.first


def settle_nonfinite(timeout_s: float = 5.0):
    """Wait (polling Event.query(), up to timeout_s) until every check issued so far is read back, and
    return the first finding or None. A deliberate wait: call it only where a sync is fine (a save)."""
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
