"""The collector's libcuda path (profiler/cuda_timing.py DriverTiming) against a scripted driver: one
call per pair, "not ready" is None (never a wait), a thread without a current context
gets the device's primary one once, any other driver error is raised. Real events: tests/profiler/test_cuda.py."""
import pytest

from profiler.cuda_timing import EventPool, DriverTiming, TorchTiming, resolve


class Event:
    def __init__(self, handle):
        self.cuda_event = handle


class ScriptedLib:
    """libcuda as DriverTiming calls it: return codes scripted per handle, every call logged."""

    def __init__(self, elapsed_rc=None, no_context_once=False):
        self.elapsed_rc = elapsed_rc or {}
        self.no_context = no_context_once
        self.calls = []

    def cuEventElapsedTime_v2(self, ms_ref, start, end):
        self.calls.append(("elapsed", start, end))
        rc = 201 if self.no_context else self.elapsed_rc.get((start, end), 0)
        if rc == 0:
            ms_ref._obj.value = (end - start) / 4
        return rc

    def cuDeviceGet(self, dev_ref, ordinal):
        self.calls.append(("device", ordinal.value))
        dev_ref._obj.value = 10 + ordinal.value
        return 0

    def cuDevicePrimaryCtxRetain(self, ctx_ref, dev):
        self.calls.append(("retain", dev.value))
        ctx_ref._obj.value = 4096
        return 0

    def cuCtxSetCurrent(self, ctx):
        self.calls.append(("set_current", ctx.value))
        self.no_context = False
        return 0


def test_one_driver_call_per_pair_and_not_ready_is_none():
    lib = ScriptedLib(elapsed_rc={(8, 30): 600, (8, 20): 600})
    timing = DriverTiming(lib, device_index=0)
    assert timing.elapsed_ms(Event(2), Event(10)) == 2.0
    assert timing.elapsed_ms(Event(8), Event(30)) is None            # either event not done: None, no wait
    assert timing.elapsed_ms(Event(8), Event(20)) is None
    assert lib.calls == [("elapsed", 2, 10), ("elapsed", 8, 30), ("elapsed", 8, 20)]


def test_a_thread_without_a_context_gets_the_primary_one_once():
    lib = ScriptedLib(no_context_once=True)
    timing = DriverTiming(lib, device_index=3)
    assert timing.elapsed_ms(Event(0), Event(8)) == 2.0
    assert lib.calls == [("elapsed", 0, 8), ("device", 3), ("retain", 13), ("set_current", 4096), ("elapsed", 0, 8)]
    lib.no_context, lib.calls = True, []
    assert timing.elapsed_ms(Event(0), Event(8)) == 2.0               # another thread: retained context reused
    assert lib.calls == [("elapsed", 0, 8), ("set_current", 4096), ("elapsed", 0, 8)]


def test_other_driver_errors_are_raised_not_taken_for_not_ready():
    timing = DriverTiming(ScriptedLib(elapsed_rc={(1, 7): 400}), device_index=0)
    with pytest.raises(RuntimeError, match="CUDA driver error 400"):
        timing.elapsed_ms(Event(1), Event(7))
    stuck = DriverTiming(ScriptedLib(no_context_once=True), device_index=0)
    stuck._make_context_current = lambda: None                         # the context never becomes current
    with pytest.raises(RuntimeError, match="CUDA driver error 201"):
        stuck.elapsed_ms(Event(1), Event(7))


def test_resolve_keeps_order_and_releases_only_resolved_pairs():
    lib = ScriptedLib(elapsed_rc={(12, 16): 600})
    pool = EventPool(event_factory=lambda: Event(0), prealloc=0, timing=DriverTiming(lib, 0))
    a, b, c, d = Event(0), Event(8), Event(12), Event(16)
    rec = lambda s, e: [None] * 8 + [s, e]   # noqa: E731 - the record's start and end slots
    pending = [("t", rec(a, b)), ("t", rec(c, d)), ("u", rec(b, c))]
    done, still = resolve(pending, pool)
    assert [(n, sec) for n, _, sec in done] == [("t", 0.002), ("u", 0.001)]
    assert still == [pending[1]] and sorted(e.cuda_event for e in pool.free_list) == [0, 8, 8, 12]


def test_test_events_and_hosts_without_libcuda_use_torchs_calls():
    assert EventPool(event_factory=lambda: Event(0), prealloc=0).elapsed_ms == TorchTiming.elapsed_ms


def test_a_replays_reference_changes_apply_retains_first_in_one_call():
    pool = EventPool(event_factory=lambda: Event(0), prealloc=0)
    a, b, c = Event(1), Event(2), Event(3)
    pool.adjust([a, a, b], [a, b, c])       # a: 1 + 2 - 1 = 2 holders; b: 1 + 1 - 1; c: 1 - 1, free
    assert pool.free_list == [c]
    pool.release(a, b)
    assert pool.free_list == [c, b]         # a still has one holder
    pool.release(a)
    assert pool.free_list == [c, b, a]
