"""Span recording: per-thread event logs, lock-free on the worker side, replayed by the collector.

Hot path (`with span(name):`): a threading.local read and a dict lookup (api.span), then the tag and `t0_ns`
appended on enter and `t1_ns` on exit: C calls only, no lock, no new container. The collector replays each
thread's log against its open-span stack for nesting and finished records, off the hot path.

Event-log items (appended by the owning thread only): begin `tag` then `t0_ns`, or CUDA `(tag, t0_ns,
start_event)`, tag = name or (name, bytes); end `t1_ns`, or CUDA `(t1_ns, end_event)`; `None` cancels a begin
whose enter raised (fault injection); a `SpanAttrs` dict tags the innermost open span (`profiler.tag`).
The replay keeps each thread's open spans as `SpanRecord`s on a stack and completes them into finished ones
(drain()); readers take their fields by name.

Hand-over without a lock: the collector takes `n = len(log)`, copies `log[:n]` and deletes `log[:n]`, each an
atomic list operation, so every item is taken exactly once however the owner's appends interleave.
"""
from __future__ import annotations

import functools
import itertools
import re
import threading
import time
from typing import Any

_NAME_RE = re.compile(r"^[a-z0-9_]+(\.[a-z0-9_]+)*$")
_now_ns = time.perf_counter_ns


def check_name(name, what: str = "span") -> str:
    """Return `name` if it is a valid span/counter name, else raise ValueError naming it."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"bad {what} name {name!r}: must match {_NAME_RE.pattern} "
                         f"(lowercase words joined by dots, e.g. 'target.fwd')")
    return name


def check_bytes(name: str, nbytes) -> None:
    """ValueError unless a span's bytes= is None or a non-negative int."""
    if nbytes is not None and (isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0):
        raise ValueError(f"span {name!r}: bytes must be a non-negative int, got {nbytes!r}")


class SpanRecord:
    """One span on the collector side: open on its thread's stack while the replay has its begin and not its end,
    finished once the end is replayed (SpanRecorder.drain() returns finished ones, read-only from then on). A
    `__slots__` class, so the replay makes one object per span and every reader's field access is a slot read."""
    __slots__ = ("name", "t0_ns", "t1_ns", "depth", "bytes", "id", "parent", "attrs", "start_event", "end_event")

    name: str
    t0_ns: int
    """perf_counter_ns at the enter (a CUDA span: after its start event was recorded)."""
    t1_ns: int | None
    """perf_counter_ns at the exit (a CUDA span: before its end event was recorded); None while open."""
    depth: int
    """Spans open around it on its thread (0: outermost)."""
    bytes: int | None
    """What the span declared it moved (`bytes=`), else None."""
    id: int
    """The recorder's number for it, in begin order."""
    parent: int | None
    """The enclosing span's id, or None."""
    attrs: dict | None
    """What `profiler.tag()` gave it (merged), or None."""
    start_event: Any
    """A CUDA span's start event (profiler/cuda_timing.py), recorded on the current stream; None: CPU only."""
    end_event: Any
    """A CUDA span's end event; None: CPU only, or still open."""

    @classmethod
    def of(cls, name: str, t0_ns: int, t1_ns: int | None, depth: int = 0, nbytes: int | None = None,
           span_id: int = 0, parent: int | None = None, attrs: dict | None = None, start_event=None,
           end_event=None) -> "SpanRecord":
        """A record from its fields. The replay fills a bare `SpanRecord()` itself, slot by slot (every slot: see
        SpanRecorder._replay), so no Python `__init__` frame is a cost per span."""
        s = cls()
        s.name, s.t0_ns, s.t1_ns, s.depth, s.bytes = name, t0_ns, t1_ns, depth, nbytes
        s.id, s.parent, s.attrs, s.start_event, s.end_event = span_id, parent, attrs, start_event, end_event
        return s

    def __repr__(self) -> str:
        return "SpanRecord(" + ", ".join(f"{k}={getattr(self, k)!r}" for k in self.__slots__) + ")"


class SpanAttrs(dict):
    """Attributes logged by `profiler.tag()` for the thread's innermost open span."""
    __slots__ = ()


class ThreadState:
    """One thread's event log, counter buffer, span objects and (collector side) open-span stack."""
    __slots__ = ("thread", "buf", "misc", "spans", "open", "begun")

    def __init__(self, thread: threading.Thread):
        self.thread = thread
        self.buf: list = []     # span event log, appended by the owning thread only
        self.misc: list = []    # (kind, name, value): 0 counter, 1 gauge, 2 metric; owner appends
        self.spans: dict = {}   # name -> this thread's span object (bytes=None)
        self.open: list = []    # collector side: the open SpanRecords, outermost first
        self.begun = None       # collector side, CPU: a replayed tag whose t0 is still to come


_lookup = None   # span(name, bytes) -> the span to enter now: api.span, bound by bind_lookup (no import cycle)


def bind_lookup(fn) -> None:
    """Where decorated functions look their span up at call time (profiler.api binds its `span`)."""
    global _lookup
    _lookup = fn


class _Named:
    """A span's name and bytes, and its use as a decorator: each call runs inside `span(name, bytes)` looked
    up at CALL time, so a function decorated at import (no profiler yet) is timed once one is active."""
    __slots__ = ("name", "bytes")
    _what = "span"

    def __init__(self, name: str, nbytes=None):
        self.name = name
        self.bytes = nbytes

    def __call__(self, fn):
        name, nbytes = self.name, self.bytes

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with _lookup(name, nbytes):
                return fn(*args, **kwargs)
        return wrapper

    def __repr__(self):
        return f"<{self._what} {self.name}>"


class NoopSpan(_Named):
    """What span() returns with no active profiler: one shared object per name. Enter and exit are the C-level
    `"".format` (no Python frame), returning "" (falsy: exceptions propagate; the `as` target is "")."""
    __slots__ = ()
    _what = "noop span"
    __enter__ = "".format
    __exit__ = "".format


class CpuSpan(_Named):
    """Active span with CPU timing only. One object per (thread, name), holding its thread's event log, so
    enter/exit touch no thread-local and no lock: do not share one between threads."""
    __slots__ = ("_tag", "_buf", "_recorder")

    def __init__(self, recorder: "SpanRecorder", st: ThreadState, name: str, nbytes=None):
        super().__init__(name, nbytes)
        self._tag = name if nbytes is None else (name, nbytes)
        self._buf = st.buf
        self._recorder = recorder

    def __enter__(self):
        buf = self._buf
        buf.append(self._tag)
        buf.append(_now_ns())
        return self

    def __exit__(self, et, ev, tb):
        self._buf.append(_now_ns())


def fast_enter_class(buf: list, tag) -> type:
    """A CpuSpan subclass for one (thread, name) whose __enter__ is C calls only with CpuSpan.__enter__'s effect:
    `next()` on `map(buf.extend, zip(repeat(tag), iter(clock, None)))` logs the tag and a fresh clock reading
    (staticmethod keeps the partial unbound; the `as` target is None)."""
    enter = functools.partial(next, map(buf.extend, zip(itertools.repeat(tag), iter(_now_ns, None))))
    return type("CpuSpan", (CpuSpan,), {"__slots__": (), "__enter__": staticmethod(enter), "__module__": __name__})


class CudaSpan(CpuSpan):
    """Active span that also times the GPU with a start and end CUDA event on the current stream; CPU times
    leave the records' own cost out (t0 after the start record, t1 before the end one)."""
    __slots__ = ("_pool", "_free", "_getraw", "_dev", "_record", "_streams")

    def __init__(self, recorder: "SpanRecorder", st: ThreadState, name: str, nbytes=None):
        super().__init__(recorder, st, name, nbytes)
        pool = self._pool = recorder.event_pool
        self._free, self._streams = pool.free_list, pool.streams
        self._getraw, self._dev, self._record = pool.getraw, pool.device_index, pool.record

    def _recorded(self):
        """An event from the pool, recorded on the current stream: an asynchronous enqueue, no sync."""
        raw = self._getraw(self._dev)
        try:
            ev = self._free.pop()
        except IndexError:          # pool empty: grow (the collector returns events once resolved)
            ev = self._pool.take()
        self._record(ev, self._streams.get(raw) or self._pool.stream_for(raw))
        return ev

    def __enter__(self):
        ev = self._recorded()
        self._buf.append((self._tag, _now_ns(), ev))
        return self

    def __exit__(self, et, ev, tb):
        t1 = _now_ns()
        self._buf.append((t1, self._recorded()))


def _fault_enter(span, base_enter):
    """Enter the span, then give the fault plan its chance (slow/hang count inside the span); a raising fault
    skips __exit__, so a cancel is logged for the collector to drop the begin (a CUDA one's event goes back)."""
    base_enter(span)
    rec = span._recorder
    try:
        rec.fault_plan.on_enter(span.name, rec.step_fn())
    except BaseException:
        span._buf.append(None)   # cancel the begin just logged
        raise
    return span


class FaultCpuSpan(CpuSpan):
    """A CpuSpan that consults the fault plan on enter (only when the plan is not empty)."""
    __slots__ = ()

    def __enter__(self):
        return _fault_enter(self, CpuSpan.__enter__)


class FaultCudaSpan(CudaSpan):
    """A CudaSpan that consults the fault plan on enter (only when the plan is not empty)."""
    __slots__ = ()

    def __enter__(self):
        return _fault_enter(self, CudaSpan.__enter__)


def ranged_class(base: type, push, pop) -> type:
    """A subclass of span class `base` that also opens a range around each span: `push(name) -> handle` before
    base's enter, `pop(handle)` after base's exit (a `record_function`, an NVTX range), so the range holds the
    span and the span's own times leave the range's cost out. Handles stack on the object (one object per
    thread and name, entered LIFO on its thread)."""
    base_init, base_enter, base_exit = base.__init__, base.__enter__, base.__exit__

    def __init__(self, *args):
        base_init(self, *args)
        self._ranges = []

    def __enter__(self):
        handle = push(self.name)
        try:
            base_enter(self)
        except BaseException:   # a fault that raised in enter: no exit follows, so close the range here
            pop(handle)
            raise
        self._ranges.append(handle)
        return self

    def __exit__(self, et, ev, tb):
        base_exit(self, et, ev, tb)
        pop(self._ranges.pop())

    return type(f"Ranged{base.__name__}", (base,), {"__slots__": ("_ranges",), "__init__": __init__,
                                                    "__enter__": __enter__, "__exit__": __exit__,
                                                    "__module__": __name__})


def joined_ranges(outer, inner):
    """One (push, pop) opening `outer`'s range around `inner`'s (either may be None)."""
    if outer is None or inner is None:
        return outer or inner
    (push_o, pop_o), (push_i, pop_i) = outer, inner

    def push(name):
        handle = push_o(name)
        try:
            return handle, push_i(name)
        except BaseException:
            pop_o(handle)
            raise

    def pop(handles):
        pop_i(handles[1])
        pop_o(handles[0])
    return push, pop


class SpanRecorder:
    """Per-profiler recording state: thread states (registered on a thread's first use), span objects,
    counter/gauge/metric buffers, and the drain. `ranges` ((push, pop): profiler/capture.py's NVTX ranges) makes
    every span also a range for the whole run; `set_ranges()` adds or drops ranges while a capture runs."""

    def __init__(self, event_pool=None, fault_plan=None, step_fn=lambda: 0, ranges=None):
        self.event_pool = event_pool
        self.fault_plan = fault_plan
        self.step_fn = step_fn
        faulty = fault_plan is not None and not fault_plan.empty
        if event_pool is not None:
            base = FaultCudaSpan if faulty else CudaSpan
        else:
            base = FaultCpuSpan if faulty else CpuSpan
        self._plain_cls, self._run_ranges = base, ranges
        self._span_cls = base if ranges is None else ranged_class(base, *ranges)
        self._states: list = []
        self.unmatched = 0                 # ends with no open begin (a span object used across threads)
        self.native_ids: dict = {}         # thread name -> OS thread id (py-spy's native id)
        self._next_id = 0                  # collector side: ids in begin order
        self._names: set = set()           # span names validated so far (make_span)
        self._generation = 0               # bumped by set_ranges: a span made across it is not cached
        self._reg_lock = threading.Lock()
        self.drain_lock = threading.Lock()
        # Per-thread `st` (the ThreadState) and `d` (its name -> span cache), which api.span() reads.
        self.local = threading.local()

    def thread_state(self) -> ThreadState:
        """The calling thread's state, registering it on the thread's first use."""
        try:
            return self.local.st
        except AttributeError:
            st = ThreadState(threading.current_thread())
            with self._reg_lock:
                self._states.append(st)
            self.local.st = st
            self.local.d = st.spans
            return st

    def make_span(self, name: str, nbytes=None):
        """Slow path of span() (every call with bytes=): validate, a name once; cache the object without bytes."""
        check_bytes(name, nbytes)
        if type(name) is not str or name not in self._names:   # the regex: once per name, not per bytes= call
            self._names.add(check_name(name))
        st, cls, generation = self.thread_state(), self._span_cls, self._generation
        if cls is CpuSpan and nbytes is None:   # cached, so its class is made once (not per bytes= call)
            cls = fast_enter_class(st.buf, name)
        s = cls(self, st, name, nbytes)
        if nbytes is None and generation == self._generation:   # not cached across a set_ranges()
            st.spans[name] = s
        return s

    def set_ranges(self, ranges) -> None:
        """From now on every span is also a range ((push, pop), see ranged_class), or no longer (None). Each
        thread's cached span objects are dropped, so its next span() makes one of the new class: outside a
        capture the spans are of the classes they were before it, and cost what they did."""
        ranges = joined_ranges(self._run_ranges, ranges)
        self._span_cls = self._plain_cls if ranges is None else ranged_class(self._plain_cls, *ranges)
        self._generation += 1
        with self._reg_lock:
            states = list(self._states)
        for st in states:
            st.spans.clear()   # one C call; the owner's next lookup misses and makes a new object

    def count(self, name: str, n) -> None:
        self.thread_state().misc.append((0, name, n))

    def gauge(self, name: str, value) -> None:
        self.thread_state().misc.append((1, name, value))

    def metric(self, name: str, value) -> None:
        self.thread_state().misc.append((2, name, value))

    def tag(self, attrs: dict) -> None:
        self.thread_state().buf.append(SpanAttrs(attrs))

    def drain(self):
        """Take and replay every logged item: [(thread_name, [finished SpanRecord], misc)]; ended threads with
        nothing left are dropped."""
        out = []
        with self.drain_lock:
            with self._reg_lock:
                states = list(self._states)
            dead = []
            for st in states:
                events = _take(st.buf)
                misc = _take(st.misc)
                spans = self._replay(st, events) if events else []
                self.native_ids[st.thread.name] = st.thread.native_id
                if spans or misc:
                    out.append((st.thread.name, spans, misc))
                if not st.thread.is_alive() and not st.buf and not st.misc and not st.open:
                    dead.append(st)
            if dead:
                with self._reg_lock:
                    self._states = [s for s in self._states if s not in dead]
        return out

    def _replay(self, st: ThreadState, events) -> list:
        """Match begins and ends (LIFO per thread) into finished SpanRecords; `st.open` carries open spans over.
        A begin's record gets every slot here (no Python __init__: the collector pays this loop per span), its
        depth and parent from the stack it opens on, which is the stack it ends on."""
        open_, out = st.open, []
        begun, next_id = st.begun, self._next_id   # locals in the loop; written back below
        pop, push, emit, Record = open_.pop, open_.append, out.append, SpanRecord
        unused = []   # events of cancelled or unmatched CUDA spans, back to the pool after the loop
        for e in events:
            te = type(e)
            if te is int:
                if begun is None:                       # CPU end
                    if open_:
                        s = pop()
                        s.t1_ns = e
                        emit(s)
                    else:
                        self.unmatched += 1
                    continue
                tag = begun                             # CPU begin: the t0 after its tag
                t0_ns = e
                start = begun = None
            elif te is str or (te is tuple and len(e) == 2 and type(e[1]) is int and type(e[0]) is str):
                begun = e                               # CPU tag: name, or (name, bytes)
                continue
            elif e is None or te is SpanAttrs:          # a cancelled begin, or profiler.tag()
                _amend(open_, e, unused)
                continue
            elif type(e[0]) is int:                     # CUDA end: (t1, end_event)
                if open_:
                    s = pop()
                    s.t1_ns, s.end_event = e
                    emit(s)
                else:
                    unused.append(e[1])
                    self.unmatched += 1
                continue
            else:                                       # begin: (tag, t0[, start_event])
                tag, t0_ns, start = e[0], e[1], e[2] if len(e) > 2 else None
            s = Record()
            if type(tag) is str:
                s.name = tag
                s.bytes = None
            else:
                s.name, s.bytes = tag
            s.t0_ns = t0_ns
            s.id = next_id
            s.depth = len(open_)
            s.parent = open_[-1].id if open_ else None
            s.start_event = start
            s.t1_ns = s.attrs = s.end_event = None
            push(s)
            next_id += 1
        st.begun, self._next_id = begun, next_id
        if unused:
            self.event_pool.put(*unused)
        return out

    def open_spans(self, now_ns=None, ids: bool = False):
        """Open spans per thread as of the last drain: [{"thread", "native_id", "spans": [{"name", "depth",
        "open_seconds"}]}], outermost first; `ids` adds "id" and "t0_ns" (the aggregator splits time with them)."""
        now_ns = _now_ns() if now_ns is None else now_ns
        out = []
        with self.drain_lock:   # the open stacks belong to the collector side
            with self._reg_lock:
                states = list(self._states)
            for st in states:
                if st.open:
                    spans = [{"name": s.name, "depth": s.depth, "open_seconds": (now_ns - s.t0_ns) / 1e9}
                             for s in st.open]
                    if ids:
                        for entry, s in zip(spans, st.open):
                            entry["id"], entry["t0_ns"] = s.id, s.t0_ns
                    out.append({"thread": st.thread.name, "native_id": st.thread.native_id, "spans": spans})
        return out


def _amend(open_: list, e, unused: list) -> None:
    """A replayed None (the innermost open span's enter raised: it is dropped, a CUDA one's start event goes to
    `unused`) or SpanAttrs (merged into the innermost open span's attrs)."""
    if not open_:
        return
    if e is None:
        s = open_.pop()
        if s.start_event is not None:
            unused.append(s.start_event)
    else:
        s = open_[-1]
        s.attrs = {**(s.attrs or {}), **e}


def _take(buf: list) -> list:
    """Remove and return the first len(buf) items; concurrent appends land after them (see module doc)."""
    n = len(buf)
    if not n:
        return []
    chunk = buf[:n]
    del buf[:n]
    return chunk
