"""The CPU cost of each CUDA call a CUDA-timed span makes, so a span's own overhead can be stated
against the calls it cannot avoid. Run on a CUDA host from the repo root:

    PYTHONPATH=. python3 bench/bench_cuda_events.py [--busy]

Each row is one call repeated N times (median of 7 repeats), on an idle GPU, timed with the calling
thread's CPU clock (`time.thread_time_ns`) and with the wall clock. Rows:
- `torch.cuda.current_stream()`, and `torch._C._cuda_getCurrentRawStream(i)` (an int, no object);
- `Event.record()` (the public call: it looks the current stream up in Python each time), and
  `_CudaEventBase.record(ev, stream)` with the stream object cached (the C call alone), on one event
  and round-robin over 2 and 4096 distinct events (a run's spans record distinct pool events until
  the collector returns them);
- `Event.query()` through the Python wrapper and `_CudaEventBase.query` directly, on a completed
  event; `elapsed_time()`; creating an event;
- what the collector pays to resolve one completed pair: torch's calls (`TorchTiming`: query() both,
  elapsed_time()) against libcuda's (`DriverTiming`: one cuEventElapsedTime), GIL held in both;
- a non-finite check's hot path before the batched readback (two flags copied non-blocking into pinned
  memory, an event recorded; two a drafter step), its copy alone, and a one-element kernel launch as the
  peer; the hot path now (the flags queued) and a collector poll sending 34 checks in one batch.
With `--busy`, a second thread launches small kernels throughout (as a launch-bound training thread
does), so the driver calls meet the launches they contend with in a run.
"""
from __future__ import annotations

import itertools
import statistics
import sys
import time

N = 20000
SHORT_N = 400   # calls per repeat for rows that queue GPU work: a sync before each repeat, and 400 copies or
#                 kernels stay under the launch queue's depth, so no call waits for a free slot


def per_call_ns(fn, n=N, repeats=7, before=None):
    """(thread CPU ns, wall ns) per call of fn(), medians over repeats; `before()` runs untimed ahead of
    each repeat."""
    cpu, wall = [], []
    for _ in range(repeats):
        if before is not None:
            before()
        c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
        for _ in range(n):
            fn()
        cpu.append((time.thread_time_ns() - c0) / n)
        wall.append((time.perf_counter_ns() - w0) / n)
    return statistics.median(cpu), statistics.median(wall)


def rows(torch):
    """(label, fn) for each call measured."""
    idx = torch.cuda.current_device()
    stream = torch.cuda.current_stream()
    base = torch._C._CudaEventBase
    ev, ev2 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ev.record()
    ev2.record()
    torch.cuda.synchronize()   # deliberate: set-up, so query()/elapsed_time() see completed events
    getraw = torch._C._cuda_getCurrentRawStream
    two = itertools.cycle([torch.cuda.Event(enable_timing=True) for _ in range(2)])
    many = itertools.cycle([torch.cuda.Event(enable_timing=True) for _ in range(4096)])
    return [
        ("torch.cuda.current_stream()", torch.cuda.current_stream),
        ("_cuda_getCurrentRawStream(i)", lambda: getraw(idx)),
        ("Event.record() (public)", ev.record),
        ("_CudaEventBase.record(ev, s)", lambda: base.record(ev, stream)),
        ("  same, over 2 events", lambda: base.record(next(two), stream)),
        ("  same, over 4096 events", lambda: base.record(next(many), stream)),
        ("Event.query() (public)", ev.query),
        ("_CudaEventBase.query(ev)", lambda: base.query(ev)),
        ("Event.elapsed_time(end)", lambda: ev.elapsed_time(ev2)),
        ("torch.cuda.Event(enable_timing)", lambda: torch.cuda.Event(enable_timing=True)),
        *resolve_rows(torch, ev, ev2),
        *check_rows(torch, lambda e: base.record(e, stream)),
    ]


def check_rows(torch, record):
    """A non-finite check's hot path before the batched readback (its flags copied non-blocking into a pinned
    row, then an event recorded), its copy alone, and a one-element kernel launch as the peer; then the
    check's hot path now (NonfiniteMonitor.check_flags with a CudaReadback: the flags queued with the current
    stream) and a collector poll that sends 34 queued checks as one batch (what a 0.25 s poll meets at 70
    drafter steps a second), its 34 check_flags calls included. Each timed over SHORT_N calls (the poll
    row: SHORT_N / 34 polls) from an empty queue and nothing queued for the monitor."""
    sys.path.insert(0, ".")
    from profiler.cuda_timing import EventPool
    from profiler.nonfinite import CudaReadback, NonfiniteMonitor

    flags = torch.zeros(2, dtype=torch.bool, device="cuda")
    host = torch.zeros(8, dtype=torch.bool, pin_memory=True)[:2]
    ready, x = torch.cuda.Event(), torch.zeros(1, device="cuda")
    readback = CudaReadback(torch.device("cuda"), EventPool(prealloc=0).current)
    mon = NonfiniteMonitor(0, lambda f: None, readback=readback)
    names = ["payload.packed", "payload.transfer"]

    def check():
        host.copy_(flags, non_blocking=True)
        record(ready)

    def poll_34():
        for _ in range(34):
            mon.check_flags("drafter.recv", 0, names, flags)
        mon.poll()

    def empty():
        torch.cuda.synchronize()   # deliberate (bench only): an empty queue, and every batch landed
        mon.settle(10.0)
    return [("check_flags: pinned copy + record", check, SHORT_N),
            ("  its copy_(non_blocking) alone", lambda: host.copy_(flags, non_blocking=True), SHORT_N),
            ("a kernel launch (x.add_(1), 1 elem)", lambda: x.add_(1.0), SHORT_N),
            ("check_flags: queued (now)", lambda: mon.check_flags("drafter.recv", 0, names, flags), SHORT_N, empty),
            ("34 check_flags + a poll sending them", poll_34, SHORT_N // 34, empty)]


def resolve_rows(torch, ev, ev2):
    """The collector's cost per completed pair, by torch's calls and by libcuda's."""
    sys.path.insert(0, ".")
    from profiler.cuda_timing import DriverTiming, TorchTiming

    out = [("resolve a pair: TorchTiming", lambda: TorchTiming.elapsed_ms(ev, ev2))]
    driver = DriverTiming.load(torch.cuda.current_device())
    if driver is not None:
        out.append(("resolve a pair: DriverTiming", lambda: driver.elapsed_ms(ev, ev2)))
    return out


def busy_launcher(torch, stop):
    """A thread launching small kernels until `stop` is set (its own stream, so the events stay done)."""
    import threading

    def run():
        x = torch.zeros(16, device="cuda")
        with torch.cuda.stream(torch.cuda.Stream()):
            while not stop.is_set():
                for _ in range(100):
                    x.add_(1.0)
                torch.cuda.current_stream().synchronize()   # deliberate: bounds the queue (bench only)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("bench_cuda_events: needs a CUDA GPU")
        return 1
    torch.cuda.init()
    busy = "--busy" in sys.argv
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {N} calls x 7 repeats, median"
          + ("; a second thread launching kernels throughout" if busy else ""))
    import threading

    stop = threading.Event()
    launcher = busy_launcher(torch, stop) if busy else None
    print(f"{'call':<34} {'cpu ns':>8} {'wall ns':>8}")
    for label, fn, *n in rows(torch):
        before = n[1] if len(n) > 1 else torch.cuda.synchronize
        for _ in range(1000 if not n else n[0]):
            fn()
        # deliberate syncs (before each repeat of a queueing row): an empty queue for every repeat
        cpu, wall = per_call_ns(fn, n[0], 21, before) if n else per_call_ns(fn)
        before()   # deliberate: between rows, so queued records do not pile up
        print(f"{label:<34} {cpu:>8.0f} {wall:>8.0f}")
    stop.set()
    if launcher is not None:
        launcher.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
