"""Forensics: what a failing rank leaves behind, in its run log and in RUN_DIR/forensics/.

A dump (every Python thread's stack, the open spans with their ages, the sources registered with
profiler.register_forensics) is one `event` record of its kind (`hang`, `oom`, `thread_crash`, `signal`) and
a text file `RUN_DIR/forensics/rank{R}-{kind}-{unix_ms}.txt`. `Forensics.abort` is the way out of a rank
that cannot stop by itself: dump, final interval and `run_end`, then `exit_fn` (os._exit: a stuck thread
cannot be interrupted, and a normal exit would wait for it).
"""
from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

from profiler.memory import allocator_summary
from profiler.spans import check_name

logger = logging.getLogger("profiler")

# What a thread's stack keeps in the run log: its innermost frames (the file keeps them all).
_MAX_FRAMES_IN_LOG = 40


def current_frames(frames_fn=sys._current_frames) -> dict:
    """sys._current_frames() with the cyclic GC off meanwhile: on CPython 3.11 a collection started inside it
    can deadlock on the thread-list lock it holds (CPython gh-106883, fixed in 3.12)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return frames_fn()
    finally:
        if enabled:
            gc.enable()


def thread_stacks() -> list[dict]:
    """Every Python thread's stack, outermost frame first: [{"thread", "native_id", "daemon",
    "stack": ["file:line in function: source", ...]}]. Threads without a Python frame are skipped."""
    frames = current_frames()
    return [{"thread": t.name, "native_id": t.native_id, "daemon": t.daemon,
             "stack": [f"{fs.filename}:{fs.lineno} in {fs.name}: {(fs.line or '').strip()}"
                       for fs in traceback.extract_stack(frames[t.ident])]}
            for t in threading.enumerate() if t.ident in frames]


def is_oom(exc: BaseException) -> bool:
    """torch's OutOfMemoryError (CUDA or the injected fault), however deep in the cause chain."""
    while exc is not None:
        if isinstance(exc, torch.OutOfMemoryError):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


class NullMemoryHistory:
    """--memory-history 0, or no CUDA: nothing recorded, nothing dumped."""

    def start(self) -> None:
        pass

    def dump(self, path: Path) -> str | None:
        return None


class CudaMemoryHistory:
    """The CUDA allocator's history of the last `max_entries` events (bounded by torch), dumped as a
    pickle snapshot at a failure (open it in https://pytorch.org/memory_viz)."""

    def __init__(self, max_entries: int):
        self.max_entries = max_entries

    def start(self) -> None:
        torch.cuda.memory._record_memory_history(max_entries=self.max_entries)

    def dump(self, path: Path) -> str | None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(path))
        return str(path)


def make_memory_history(max_entries: int, is_cuda: bool):
    return CudaMemoryHistory(max_entries) if max_entries > 0 and is_cuda else NullMemoryHistory()


class Forensics:
    """Dumps for one rank. `prof` gives event(), open spans, the memory sampler, extra collectors
    and finish_now(); `exit_fn` and `wall_clock` are injected so tests can swap them."""

    def __init__(self, prof, memory_history=None, exit_fn=os._exit, wall_clock=time.time):
        self.prof = prof
        self.memory_history = memory_history or NullMemoryHistory()
        self.exit_fn, self.wall_clock = exit_fn, wall_clock
        self.dir = Path(prof.run_dir) / "forensics"
        self._abort_lock = threading.Lock()
        self._final_dumped = False   # dump_final wrote this rank's state (abort then skips its dump)
        self._sources: dict = {}     # name -> fn() giving state that dumps include (register)

    def register(self, name: str, fn) -> None:
        """fn() -> JSON-able state that dumps include under `name` (profiler.register_forensics)."""
        self._sources[check_name(name, "forensics")] = fn

    def sources(self) -> dict:
        """Every registered source's state now; a failing source gives its error instead."""
        out = {}
        for name, fn in list(self._sources.items()):
            try:
                out[name] = fn()
            except Exception as exc:   # noqa: BLE001 - a dump must still come out
                out[name] = {"error": f"{type(exc).__name__}: {exc}"}
        return out

    def dump(self, kind: str, **fields) -> dict:
        """One `event` record of `kind` with threads' stacks, open spans and extras, plus its file."""
        threads = thread_stacks()
        stamp = f"rank{self.prof.rank}-{kind}-{int(self.wall_clock() * 1000)}"
        path = self.dir / f"{stamp}.txt"
        body = {**fields, "open_spans": self._open_spans(), "extra": self.sources(),
                "forensics_file": str(path)}
        rec = self.prof.event(kind, **body, threads=[dict(t, stack=t["stack"][-_MAX_FRAMES_IN_LOG:])
                                                     for t in threads])
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            path.write_text(format_dump(dict(rec, threads=threads)))
        except OSError as exc:   # the record above is what counts; a full disk must not hide it
            logger.error("forensics: %s not written: %s", path, exc)
        return rec

    def _open_spans(self) -> list:
        with contextlib.suppress(Exception):
            self.prof.collector.poll()   # replay the threads' logs so the open stacks are current
        return self.prof.recorder.open_spans()

    def exception(self, exc: BaseException, thread_name: str) -> dict:
        """An `oom` record (with the memory state) for an out-of-memory error, else `thread_crash`."""
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        fields = {"thread": thread_name, "error": f"{type(exc).__name__}: {exc}", "traceback": tb}
        with contextlib.suppress(Exception):
            fields["last_finished_span"] = self.prof.collector.last_finished_span(thread_name)
        if not is_oom(exc):
            return self.dump("thread_crash", **fields)
        return self.dump("oom", **fields, span=getattr(exc, "dflash_span", None),
                         kernel=getattr(exc, "dflash_kernel", None), **self._memory_state())

    def _memory_state(self) -> dict:
        state = {"allocator": allocator_summary(self.prof.device, reset_peak=False)}   # says why, never raises
        try:
            state["headroom_history"] = self.prof.sampler.headroom_history()
        except Exception as exc:   # noqa: BLE001
            state["headroom_history"] = {"available": False, "reason": f"{type(exc).__name__}: {exc}"}
        path = self.dir / f"rank{self.prof.rank}-oom-{int(self.wall_clock() * 1000)}-memory.pickle"
        try:
            state["memory_history_file"] = self.memory_history.dump(path)
        except Exception as exc:   # noqa: BLE001
            state["memory_history_file"] = None
            state["memory_history_error"] = f"{type(exc).__name__}: {exc}"
        return state

    @contextlib.contextmanager
    def guard(self, ignore=lambda exc: False):
        """Around a rank's main loop: an exception leaving it is recorded (oom or thread_crash),
        then propagates; `ignore(exc)` true (a peer that went away) records nothing."""
        try:
            yield
        except Exception as exc:
            if not ignore(exc):
                self._safely(lambda exc=exc: self.exception(exc, threading.current_thread().name))
            raise

    def install(self):
        """Start the allocator history and take threading.excepthook over; returns the undo."""
        self.memory_history.start()
        previous, threading.excepthook = threading.excepthook, self.excepthook
        return lambda: setattr(threading, "excepthook", previous)

    def on_hang(self, stalled_s: float, timeout_s: float) -> None:
        """The hang watchdog fired (on its thread): say it, dump, write run_end and leave."""
        print(f"profiler: rank {self.prof.rank}: no progress for {stalled_s:.1f} s (hang timeout {timeout_s:g} s); "
              f"stopping with a dump in {self.dir}", file=sys.stderr, flush=True)
        self.abort("hang", "hang", stalled_seconds=stalled_s, timeout_seconds=timeout_s)

    def excepthook(self, args) -> None:
        """threading.excepthook: an exception that ended a thread stops the rank (exit 1) after a dump."""
        if issubclass(args.exc_type, SystemExit):
            return
        name = args.thread.name if args.thread is not None else "unknown"
        print(f"profiler: rank {self.prof.rank}: thread {name} crashed:\n"
              + "".join(traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback)),
              file=sys.stderr, flush=True)
        exc = args.exc_value if args.exc_value is not None else args.exc_type()
        kind = "oom" if is_oom(exc) else "thread_crash"
        self.abort(kind, f"{kind}: {type(exc).__name__}", record=lambda: self.exception(exc, name))

    def abort(self, kind: str, status: str, record=None, **fields) -> None:
        """Dump (or run `record`), write the final interval and run_end with `status`, exit 1. The first
        caller wins; a second (another thread failing meanwhile) returns at once."""
        if not self._abort_lock.acquire(blocking=False):
            return
        if not self._final_dumped:   # a dump_final already holds this rank's state: no second one
            self._safely(record or (lambda: self.dump(kind, **fields)))
        self._safely(lambda: self.prof.finish_now(status))
        # the exporters get the dump and run_end before the exit: the alerts on a hang or a crash read them there
        self._safely(lambda: self.prof.hub.close(self.prof.cfg.export_timeout_s))
        self._safely(self.prof.control.close)   # its socket and discovery file: nothing left behind
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        self.exit_fn(1)

    def dump_final(self, kind: str, **fields) -> bool:
        """A dump on the way out of a rank that ends by itself, unless an abort began (True when it dumped). A
        later abort (the way out got stuck) still ends the rank, without a second dump."""
        if not self._abort_lock.acquire(blocking=False):
            return False
        try:
            self._safely(lambda: self.dump(kind, **fields))
            self._final_dumped = True
        finally:
            self._abort_lock.release()
        return True

    @staticmethod
    def _safely(fn) -> None:
        try:
            fn()
        except Exception:   # noqa: BLE001 - forensics must never hide the failure it describes
            logger.exception("forensics: recording failed")


def kernel_name(tuner) -> str:
    """The name of the kernel a triton Autotuner tunes (its JIT function's, however wrapped)."""
    fn = getattr(tuner, "base_fn", None) or getattr(tuner, "fn", None)
    while fn is not None and not hasattr(fn, "__name__") and hasattr(fn, "fn"):
        fn = fn.fn
    return getattr(fn, "__name__", None) or type(tuner).__name__


def install_autotune_spans(autotuner_cls=None, peak_bytes_fn=None) -> bool:
    """Time each triton autotune benchmark as a `triton.autotune` span tagged with kernel, config and memory
    peak, so an OOM during autotune names itself (`dflash_span`/`dflash_kernel` and a note on the exception).
    False when triton is not importable. Idempotent."""
    if autotuner_cls is None:
        try:
            from triton.runtime.autotuner import Autotuner as autotuner_cls
        except Exception:   # noqa: BLE001 - no triton (CPU-only torch): nothing to wrap
            return False
    original = autotuner_cls._bench
    if getattr(original, "_dflash_autotune_span", False):
        return True
    peak_fn = peak_bytes_fn or torch.cuda.max_memory_allocated   # host-side allocator stats: no sync
    from profiler import api

    @functools.wraps(original)
    def _bench(self, *args, **kwargs):
        name = kernel_name(self)
        try:
            with api.span("triton.autotune"):
                peak_before = peak_fn()
                result = original(self, *args, **kwargs)
                peak_after = peak_fn()
                # A new peak inside the window is the window's; otherwise it stayed below the old one.
                api.tag(kernel=name, config=str(kwargs.get("config")),
                        memory_peak_bytes=peak_after if peak_after > peak_before else None)
                return result
        except BaseException as exc:
            if is_oom(exc):
                exc.dflash_span, exc.dflash_kernel = "triton.autotune", name
                exc.add_note(f"during triton.autotune of kernel {name} (config {kwargs.get('config')})")
            raise

    _bench._dflash_autotune_span = True
    autotuner_cls._bench = _bench
    return True


def format_dump(rec: dict) -> str:
    """The text file of a dump: header, open spans with their ages, traceback, every thread's stack."""
    lines = [f"{rec.get('kind')} on rank {rec.get('rank')} ({rec.get('role')}) at step {rec.get('step')}, "
             f"time_unix {rec.get('time_unix')}"]
    for key in ("reason", "error", "signal", "stalled_seconds", "memory_history_file"):
        if rec.get(key) is not None:
            lines.append(f"{key}: {rec[key]}")
    lines.append("\nopen spans:")
    for entry in rec.get("open_spans") or []:
        spans = " > ".join(f"{s['name']} ({s['open_seconds']:.1f} s)" for s in entry["spans"])
        lines.append(f"  {entry['thread']}: {spans}")
    if rec.get("traceback"):
        lines += ["\ntraceback:", rec["traceback"].rstrip()]
    for t in rec.get("threads") or []:
        lines.append(f"\nthread {t['thread']} (native id {t['native_id']}, daemon={t['daemon']}):")
        lines += [f"  {frame}" for frame in t["stack"]]
    if rec.get("extra"):
        lines += ["\nextra:", repr(rec["extra"])]
    return "\n".join(lines) + "\n"


def format_open_spans(open_spans: list, min_seconds: float = 0.0) -> str:
    """One console line naming the spans open for at least `min_seconds` ("" when none): what an
    interval in which nothing finished is waiting on."""
    parts = [f"{entry['thread']}: {s['name']} {s['open_seconds']:.0f} s"
             for entry in open_spans for s in entry["spans"] if s["open_seconds"] >= min_seconds]
    return ("  still open: " + "; ".join(parts)) if parts else ""
