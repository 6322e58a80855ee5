"""Diagnostic only (bench/gpu/env.sh puts this directory first on PYTHONPATH when DFLASH_COSTAT_DIR is set):
where the profiler's own threads spend their CPU in a live run. Every Python process that can import the
profiler wraps a list of its functions (TARGETS: the collector's poll and close and their parts, each
exporter) with a thread-CPU timer and a wall clock, and tallies {thread: {function: [calls, thread cpu seconds,
wall seconds]}} (wall above CPU: the thread was off a CPU inside the call, waiting for a lock, the driver, the GIL
it dropped, or a vCPU the hypervisor took; whatever of it passed with the GIL held, the training thread waited); the
collector's iterations are split into `tick:poll` and `tick:close`, the exporter's calls by exporter.
Times are inclusive (a caller's include its callees'). Every 5 s, and at exit, it rewrites
$DFLASH_COSTAT_DIR/costat-<pid>.json. cProfile cannot do this on Python 3.12: its hook is one
sys.monitoring tool for every thread, so a collector-only profile would see the training thread too.
A wrapper costs four clock reads (~1 us), so only functions called a few hundred times a second are here.
DFLASH_COSTAT_BURN_US=N also makes every collector poll (Profiler._poll: never while profiling is paused)
spin N us of pure Python after its work, holding the GIL as the collector's own Python does: a known
amount of collector time, to measure what one microsecond of it costs the training thread (an in-run
A/B with and without it).
DFLASH_COSTAT_NO_CUDA=1 (on its own, or with DFLASH_COSTAT_DIR) makes the collector's reading-back free of CUDA
calls, the training threads' side unchanged: every CUDA pair resolves at once as 0 s of GPU time without asking
the driver (EventPool.elapsed_ms), and every batch of non-finite checks is sent and has landed without a CUDA call
(CudaReadback.issue and .done; its flags read as clean: checks are meaningless in such a run). An in-run A/B
with it against one without says what the collector's CUDA calls cost the training thread beyond their own time
(they slow the launches they meet: bench/RESULTS.md, eleventh #14 session). Run on an H200 in the twelfth
session: it did not (the launch workload read -2.16% +- 0.93 with it).
DFLASH_COSTAT_CPU_SPANS=1 makes every span CPU-only (no CUDA events: the spans' `gpu` figures stay empty), the
non-finite checks unchanged: an in-run A/B with it says what the spans' CUDA events cost a run (the twelfth #14
session's question, after DFLASH_COSTAT_NO_CUDA cleared the collector's CUDA calls)."""
import os


def _install_no_cuda() -> None:
    """The DFLASH_COSTAT_NO_CUDA patches (module doc): after each EventPool's own set-up, and on CudaReadback."""
    from profiler import cuda_timing, nonfinite

    pool_init = cuda_timing.EventPool.__init__

    def pool_no_driver(self, *args, **kwargs):
        pool_init(self, *args, **kwargs)
        self.elapsed_ms = lambda start, end: 0.0

    def issue_no_cuda(self, flags, streams):   # a batch "sent" without a CUDA call: its flags read clean
        slot = self._free.popleft()
        return slot, self._host[slot][:sum(f.numel() for f in flags)], None, flags

    cuda_timing.EventPool.__init__ = pool_no_driver
    nonfinite.CudaReadback.issue = issue_no_cuda
    nonfinite.CudaReadback.done = lambda self, handle: True


def _install_cpu_spans() -> None:
    """The DFLASH_COSTAT_CPU_SPANS patch (module doc): each SpanRecorder makes CPU spans, its event pool kept."""
    from profiler import spans

    recorder_init = spans.SpanRecorder.__init__
    cpu_class = {spans.CudaSpan: spans.CpuSpan, spans.FaultCudaSpan: spans.FaultCpuSpan}

    def cpu_spans(self, *args, **kwargs):
        recorder_init(self, *args, **kwargs)
        self._span_cls = cpu_class.get(self._span_cls, self._span_cls)

    spans.SpanRecorder.__init__ = cpu_spans


if os.environ.get("DFLASH_COSTAT_CPU_SPANS") == "1":
    try:
        _install_cpu_spans()
    except ImportError:   # not this repository's interpreter
        pass

if os.environ.get("DFLASH_COSTAT_NO_CUDA") == "1":
    try:
        _install_no_cuda()
    except ImportError:   # not this repository's interpreter
        pass

if os.environ.get("DFLASH_COSTAT_DIR"):
    import atexit
    import importlib
    import json
    import threading
    import time

    TARGETS = [
        ("profiler.core", "Profiler._poll"), ("profiler.core", "Profiler.close_interval"),
        ("profiler.core", "Profiler._add_drained"), ("profiler.core", "Profiler._memory_summary"),
        ("profiler.core", "Profiler._write"), ("profiler.core", "allocator_summary"),
        ("profiler.intervals", "IntervalAggregator.add_drained"),
        ("profiler.intervals", "IntervalAggregator._add_finished"),
        ("profiler.intervals", "IntervalAggregator.resolve_pending"),
        ("profiler.intervals", "IntervalAggregator._add_resolved"),
        ("profiler.intervals", "IntervalAggregator.close_parts"),
        ("profiler.intervals", "IntervalAggregator._close_spans"),
        ("profiler.intervals", "to_floats"), ("profiler.intervals", "resolve"),
        ("profiler.spans", "SpanRecorder.drain"), ("profiler.spans", "SpanRecorder.open_spans"),
        ("profiler.nonfinite", "NonfiniteMonitor.poll"), ("profiler.nonfinite", "CudaReadback.issue"),
        ("profiler.nonfinite", "CudaReadback.done"), ("profiler.detail", "DetailWindow.offer_cpu"),
        ("profiler.threadcpu", "ThreadCpu.take"),
        ("profiler.detail", "DetailWindow.take"), ("exporters.console", "format_interval"),
    ]
    _DIR = os.environ["DFLASH_COSTAT_DIR"]
    _totals: dict = {}      # thread name -> {function -> [calls, thread cpu ns, wall ns]}
    _lock = threading.Lock()
    _clock, _wall = time.thread_time_ns, time.perf_counter_ns

    def _tally(key: str, spent: int, wall: int) -> None:
        name = threading.current_thread().name
        with _lock:
            row = _totals.setdefault(name, {}).setdefault(key, [0, 0, 0])
            row[0] += 1
            row[1] += spent
            row[2] += wall

    def _timed(key, fn, kind_of=None):
        def wrapper(*args, **kwargs):
            w0, t0 = _wall(), _clock()
            result = fn(*args, **kwargs)
            t1, w1 = _clock(), _wall()
            _tally(key if kind_of is None else kind_of(args, result), t1 - t0, w1 - w0)
            return result
        return wrapper

    def _patch(module_name: str, qualname: str, kind_of=None) -> None:
        owner = importlib.import_module(module_name)
        *path, attr = qualname.split(".")
        for part in path:
            owner = getattr(owner, part)
        setattr(owner, attr, _timed(qualname, getattr(owner, attr), kind_of))

    def _dump():
        with _lock:
            text = json.dumps({"time": time.time(), "pid": os.getpid(), "argv": __import__("sys").argv[:3],
                               "threads": {t: {k: [n, ns / 1e9, wall / 1e9] for k, (n, ns, wall) in rows.items()}
                                           for t, rows in _totals.items()}})
        tmp = os.path.join(_DIR, f"costat-{os.getpid()}.json.tmp")
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, os.path.join(_DIR, f"costat-{os.getpid()}.json"))

    def _writer():
        while True:
            time.sleep(5.0)
            if _totals:
                _dump()

    def _burning(fn, burn_s: float):
        def wrapper(*args, **kwargs):
            result = fn(*args, **kwargs)
            end = time.perf_counter() + burn_s
            while time.perf_counter() < end:   # pure Python: the GIL stays held but for forced switches
                pass
            return result
        return wrapper

    def _install():
        burn_us = float(os.environ.get("DFLASH_COSTAT_BURN_US") or 0)
        if burn_us > 0:
            from profiler import core
            core.Profiler._poll = _burning(core.Profiler._poll, burn_us / 1e6)
        for module_name, qualname in TARGETS:
            _patch(module_name, qualname)
        _patch("profiler.intervals", "IntervalTimer.tick", lambda a, closed: "tick:close" if closed else "tick:poll")
        _patch("profiler.export", "ExportHub._export_one",
               lambda a, _: "export:" + (getattr(a[1].exporter, "name", None) or type(a[1].exporter).__name__))

    try:
        _install()
    except ImportError:   # not this repository's interpreter
        pass
    else:
        threading.Thread(target=_writer, name="costat", daemon=True).start()
        atexit.register(lambda: _totals and _dump())
