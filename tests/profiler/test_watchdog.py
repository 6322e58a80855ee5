"""Forensics units on CPU: the hang watchdog (fake clock, then a real Profiler), the signal watch
(fake deliveries, then a real signal through the wakeup fd), thread crashes and OOMs through
threading.excepthook, the triton autotune wrapper (a fake Autotuner: no triton on the CPU), and
the CUDA allocator history snapshot (skips without a GPU)."""
import os
import signal
import threading
import time

import pytest

from exporters.console import ConsoleExporter
import torch

import profiler
from profiler.forensics import CudaMemoryHistory, format_open_spans, install_autotune_spans, is_oom
from profiler.runlog import read_records
from profiler.watchdog import SignalWatch, Watchdog
from tests.profiler.build import make_profiler


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class Exits:
    """Stands in for os._exit: records the code; the aborting thread then simply returns."""

    def __init__(self):
        self.codes: list = []
        self.done = threading.Event()

    def __call__(self, code):
        self.codes.append(code)
        self.done.set()


def make_prof(tmp_path, **kw):
    kw.setdefault("interval_s", 3600.0)
    kw.setdefault("control", False)
    kw.setdefault("measure_floors", False)
    kw.setdefault("poll_s", 0.05)
    return make_profiler(tmp_path, **kw)


def log(tmp_path) -> list:
    recs, truncated = read_records(tmp_path / "profile" / "rank0.jsonl")
    assert truncated == 0
    return recs


# ---------------------------------------------------------------------------------- watchdog
def test_watchdog_fires_once_after_the_timeout_without_progress_and_only_once_armed():
    clock, fired = FakeClock(), []
    state = {"armed": False, "token": 0}
    dog = Watchdog(10.0, lambda: (state["armed"], state["token"]), fired.append, clock=clock)
    clock.now += 1000   # start-up and the first step's build: not armed, never a hang
    assert not dog.check()
    state["armed"] = True
    assert not dog.check()          # arming starts the clock
    clock.now += 9.9
    assert not dog.check()
    state["token"] = 1              # progress: the clock starts over
    assert not dog.check()
    clock.now += 9.9
    assert not dog.check() and fired == []
    clock.now += 0.2
    assert dog.check() and fired == [pytest.approx(10.1)]
    clock.now += 100
    assert not dog.check() and len(fired) == 1


def test_watchdog_refuses_a_non_positive_timeout():
    with pytest.raises(ValueError, match="timeout_s"):
        Watchdog(0, lambda: (True, 0), print)


def test_a_hung_rank_dumps_its_open_spans_and_stacks_writes_run_end_and_exits_1(tmp_path):
    exits = Exits()
    with make_prof(tmp_path, hang_timeout_s=0.4, exit_fn=exits) as prof:
        prof.set_step(0)
        with profiler.span("train.build"):
            time.sleep(0.8)         # the first step: longer than the timeout, not a hang
        assert exits.codes == []
        prof.set_step(1)            # armed from here
        with profiler.span("train.wait"):
            assert exits.done.wait(5.0)
    assert exits.codes == [1]
    recs = log(tmp_path)
    hang = [r for r in recs if r.get("kind") == "hang"]
    assert len(hang) == 1 and hang[0]["step"] == 1 and hang[0]["stalled_seconds"] >= 0.4
    (main,) = [e for e in hang[0]["open_spans"] if e["thread"] == threading.current_thread().name]
    assert [s["name"] for s in main["spans"]] == ["train.wait"] and main["spans"][0]["open_seconds"] >= 0.3
    stack = [t for t in hang[0]["threads"] if t["thread"] == threading.current_thread().name][0]["stack"]
    assert any("test_a_hung_rank_dumps" in frame for frame in stack)
    ends = [r for r in recs if r["type"] == "run_end"]
    assert [e["status"] for e in ends] == ["hang"]    # the with-block's exit wrote nothing more
    last = [r for r in recs if r["type"] != "tick"]   # the final close writes a tick beside its interval
    assert last[-2]["type"] == "interval" and last[-2]["final"] and recs[-2]["type"] == "tick" and recs[-2]["final"]
    text = open(hang[0]["forensics_file"]).read()
    assert "train.wait (" in text and "test_a_hung_rank_dumps" in text


def test_intervals_and_the_console_show_spans_still_open(tmp_path):
    import io
    out = io.StringIO()
    with make_prof(tmp_path, exporters=[ConsoleExporter(out)], background=False) as prof:
        with profiler.span("target.fwd"):
            prof.close_interval()
            time.sleep(0.05)
            rec = prof.close_interval()   # the span outlasted this whole interval: it is named
    (entry,) = rec["open_spans"]
    assert entry["spans"][0]["name"] == "target.fwd" and entry["spans"][0]["open_seconds"] >= 0.05
    assert out.getvalue().count("still open: MainThread: target.fwd 0 s") == 1
    assert format_open_spans(rec["open_spans"], min_seconds=60.0) == ""


# ------------------------------------------------------------------------------ signal watch
def make_watch(clock, observed=lambda: False, grace_s=2.0, progress=lambda: 0):
    calls = {"noted": [], "blocked": []}
    watch = SignalWatch(calls["noted"].append, observed, lambda *a: calls["blocked"].append(a),
                        grace_s=grace_s, repeat_after_s=1.0, clock=clock, poll_s=0.01, progress=progress)
    return watch, calls


def wait_for(cond, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


def test_a_signal_not_seen_at_a_step_boundary_within_the_grace_stops_the_rank():
    clock = FakeClock()
    watch, calls = make_watch(clock)
    watch.deliver(signal.SIGTERM)
    assert calls["noted"] == [signal.SIGTERM]
    time.sleep(0.05)
    assert calls["blocked"] == []
    clock.now += 2.0
    assert wait_for(lambda: calls["blocked"])
    assert calls["blocked"] == [("SIGTERM", "blocked: no step boundary nor progress within 2 s")]


def test_a_rank_still_making_progress_after_a_signal_is_left_to_finish():
    clock, token = FakeClock(), [0]
    watch, calls = make_watch(clock, progress=lambda: token[0])
    watch.deliver(signal.SIGTERM)
    for _ in range(5):              # 5 grace periods, a span finishing in each
        clock.now += 1.5
        token[0] += 1
        time.sleep(0.05)
    assert calls["blocked"] == []
    clock.now += 2.0                # then nothing more: blocked
    assert wait_for(lambda: calls["blocked"])


def test_a_signal_seen_at_a_step_boundary_lets_the_rank_stop_by_itself():
    clock, seen = FakeClock(), []
    watch, calls = make_watch(clock, observed=lambda: bool(seen))
    watch.deliver(signal.SIGINT)
    seen.append(True)
    clock.now += 5.0
    time.sleep(0.1)
    assert calls["blocked"] == []


def test_a_second_signal_escalates_at_once_but_ctrl_c_twice_in_a_moment_does_not():
    clock = FakeClock()
    watch, calls = make_watch(clock, observed=lambda: True)
    watch.deliver(signal.SIGINT)
    clock.now += 0.2
    watch.deliver(signal.SIGINT)    # the terminal's and the launcher's copy of one Ctrl-C
    assert calls["blocked"] == []
    clock.now += 1.0
    watch.deliver(signal.SIGTERM)
    assert calls["blocked"] == [("SIGTERM", "a second signal")]


def test_a_closed_watch_never_acts():
    clock = FakeClock()
    watch, calls = make_watch(clock)
    watch.deliver(signal.SIGTERM)
    watch.close()
    clock.now += 10
    time.sleep(0.1)
    watch.deliver(signal.SIGTERM)
    assert calls["blocked"] == [] and len(calls["noted"]) == 2


def test_a_real_signal_reaches_the_watch_through_the_wakeup_fd():
    clock = FakeClock()
    watch, calls = make_watch(clock)
    old = signal.signal(signal.SIGTERM, lambda s, f: None)
    try:
        watch.install()
        os.kill(os.getpid(), signal.SIGTERM)
        assert wait_for(lambda: calls["noted"] == [signal.SIGTERM])
    finally:
        watch.close()
        signal.signal(signal.SIGTERM, old)


# ------------------------------------------------------------------------- thread crashes, OOM
def crash_in_thread(exc: BaseException, name: str) -> None:
    def body():
        with profiler.span("worker.step"):
            raise exc
    t = threading.Thread(target=body, name=name)
    t.start()
    t.join()


def test_a_crashed_thread_leaves_its_traceback_and_all_stacks_then_stops_the_rank(tmp_path, capsys):
    exits = Exits()
    with make_prof(tmp_path, exit_fn=exits) as prof:
        prof.set_step(7)
        with profiler.span("train.main"):
            crash_in_thread(ValueError("bad shape"), "loader")
    assert exits.codes == [1]
    recs = log(tmp_path)
    (crash,) = [r for r in recs if r.get("kind") == "thread_crash"]
    assert crash["thread"] == "loader" and crash["step"] == 7 and crash["error"] == "ValueError: bad shape"
    assert "in body" in crash["traceback"] and "raise exc" in crash["traceback"]
    main = [e for e in crash["open_spans"] if e["thread"] == "MainThread"][0]
    assert main["spans"][0]["name"] == "train.main"
    assert any(t["thread"] == "MainThread" for t in crash["threads"])
    assert [r["status"] for r in recs if r["type"] == "run_end"] == ["thread_crash: ValueError"]
    assert os.path.isfile(crash["forensics_file"])
    assert "thread loader crashed" in capsys.readouterr().err
    assert threading.excepthook is not prof.dumper.excepthook   # restored at the end


def test_an_oom_in_a_thread_is_an_oom_record_with_memory_state(tmp_path):
    exits = Exits()
    with make_prof(tmp_path, exit_fn=exits):
        crash_in_thread(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), "autotune")
    (oom,) = [r for r in log(tmp_path) if r.get("kind") == "oom"]
    assert oom["thread"] == "autotune" and "Tried to allocate" in oom["error"]
    assert oom["allocator"]["available"] is False          # CPU: said, not invented
    assert oom["headroom_history"] == [] and oom["memory_history_file"] is None
    assert [r["status"] for r in log(tmp_path) if r["type"] == "run_end"] == ["oom: OutOfMemoryError"]


def test_the_guard_records_an_oom_leaving_the_main_loop_and_lets_it_propagate(tmp_path):
    with pytest.raises(torch.OutOfMemoryError):
        with make_prof(tmp_path) as prof, prof.dumper.guard(ignore=lambda e: "peer" in str(e)):
            with profiler.span("drafter.recv"):
                pass
            with profiler.span("drafter.fwd_bwd"):
                raise torch.OutOfMemoryError("CUDA out of memory")
    with pytest.raises(RuntimeError):
        with make_prof(tmp_path / "b") as prof, prof.dumper.guard(ignore=lambda e: "peer" in str(e)):
            raise RuntimeError("Connection closed by peer")
    (oom,) = [r for r in log(tmp_path) if r["type"] == "event"]
    assert oom["kind"] == "oom" and oom["last_finished_span"]["name"] == "drafter.fwd_bwd"   # the span it unwound
    assert 0 <= oom["last_finished_span"]["ended_seconds_ago"] < 5
    assert [r for r in log(tmp_path / "b") if r["type"] == "event"] == []
    assert is_oom(RuntimeError("wrapped")) is False


# ------------------------------------------------------------------------------ triton autotune
class FakeJit:
    def __init__(self, name):
        self.fn = type("K", (), {"__name__": name})()   # a JITFunction wraps the Python function


class FakeAutotuner:
    """The part of triton.runtime.autotuner.Autotuner that the wrapper touches."""

    def __init__(self, kernel, alloc=0, fail=None):
        self.fn, self.alloc, self.fail = FakeJit(kernel), alloc, fail

    def _bench(self, *args, config=None, **meta):
        PEAK[0] += self.alloc
        if self.fail is not None:
            raise self.fail
        return [1.0]


PEAK = [1000]


def test_autotune_windows_are_spans_naming_the_kernel_and_an_oom_names_itself(tmp_path):
    assert install_autotune_spans(FakeAutotuner, peak_bytes_fn=lambda: PEAK[0])
    assert install_autotune_spans(FakeAutotuner, peak_bytes_fn=lambda: PEAK[0])   # idempotent
    with make_prof(tmp_path, background=False, detail_steps=5) as prof:
        prof.set_step(0)
        FakeAutotuner("chunk_fwd_kernel", alloc=512)._bench(config="BLOCK=64")
        FakeAutotuner("chunk_bwd_kernel")._bench(config="BLOCK=32")
        with pytest.raises(torch.OutOfMemoryError) as info:
            FakeAutotuner("fused_recurrent", fail=torch.OutOfMemoryError("CUDA out of memory"))._bench(config="X")
        prof.set_step(1)
        prof.close_interval()
    assert info.value.dflash_span == "triton.autotune" and info.value.dflash_kernel == "fused_recurrent"
    assert "during triton.autotune of kernel fused_recurrent" in "".join(info.value.__notes__)
    spans = [s for r in log(tmp_path) if r["type"] == "spans" for s in r["spans"]]
    attrs = [s.get("attrs") for s in spans if s["name"] == "triton.autotune"]
    assert {"kernel": "chunk_fwd_kernel", "config": "BLOCK=64", "memory_peak_bytes": 1512} in attrs
    assert {"kernel": "chunk_bwd_kernel", "config": "BLOCK=32", "memory_peak_bytes": None} in attrs


def test_without_triton_nothing_is_wrapped():
    try:
        import triton  # noqa: F401
        pytest.skip("triton is importable here")
    except ImportError:
        assert install_autotune_spans() is False


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_memory_history_snapshot_is_written_at_an_oom(tmp_path):
    history = CudaMemoryHistory(1000)
    history.start()
    try:
        x = torch.empty(1 << 20, device="cuda")
        del x
        path = history.dump(tmp_path / "forensics" / "snap.pickle")
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    assert os.path.getsize(path) > 0


def test_dump_final_is_the_one_dump_and_a_later_abort_still_ends_the_rank(tmp_path):
    exits = []
    with make_prof(tmp_path) as prof:
        prof.dumper.exit_fn = exits.append
        assert prof.dumper.dump_final("peer_lost", reason="Connection closed by peer") is True
        prof.dumper.abort("hang", "hang", stalled_seconds=9.0)   # the way out got stuck: ends, no second dump
        prof.dumper.abort("signal", "killed: SIGTERM")           # the first abort won
    events = [r for r in log(tmp_path) if r["type"] == "event"]
    assert [(e["kind"], e["reason"]) for e in events] == [("peer_lost", "Connection closed by peer")]
    assert "transfer_ring" not in events[0]["extra"] and events[0]["threads"]
    assert exits == [1]
    assert [r["status"] for r in log(tmp_path) if r["type"] == "run_end"] == ["hang"]


def test_dump_final_after_an_abort_began_dumps_nothing(tmp_path):
    with make_prof(tmp_path) as prof:
        prof.dumper.exit_fn = lambda code: None
        prof.dumper.abort("hang", "hang", stalled_seconds=9.0)
        assert prof.dumper.dump_final("peer_lost", reason="x") is False
    assert [r["kind"] for r in log(tmp_path) if r["type"] == "event"] == ["hang"]


def test_stacks_are_read_with_the_cyclic_gc_off_and_its_state_restored():
    """sys._current_frames can deadlock CPython 3.11 when a collection starts inside it (gh-106883): the read
    runs with the GC off, and leaves it as it found it, on an error too."""
    import gc

    from profiler.forensics import current_frames
    seen = []

    def frames():
        seen.append(gc.isenabled())
        return {}
    assert gc.isenabled()
    assert current_frames(frames) == {} and seen == [False] and gc.isenabled()
    gc.disable()
    try:
        current_frames(frames)
        assert seen == [False, False] and not gc.isenabled()   # off before: stays off
    finally:
        gc.enable()

    def broken():
        raise RuntimeError("no frames")
    with pytest.raises(RuntimeError):
        current_frames(broken)
    assert gc.isenabled()
