"""Profiling paused on a live run (profiler/pause.py): the training threads take --no-profile's path, the
background holds still (the interval clock stops), the lease ends a forgotten pause, one owner at a time,
and the interval records say how long they were paused. Over the real control socket too."""
import logging
import os
import threading

import pytest
import torch

import profiler
from profiler import api
from profiler.control import query
from profiler.faults import FaultPlan, parse_faults
from profiler.intervals import IntervalTimer
from profiler.pause import MAX_BACKGROUND_LEASE_S, MAX_LEASE_S, PauseControl
from profiler.spans import NoopSpan


def make_prof(tmp_path, **kw):
    kw.setdefault("interval_s", 3600.0)
    kw.setdefault("console", False)
    kw.setdefault("control", False)
    kw.setdefault("measure_floors", False)
    kw.setdefault("background", False)
    return profiler.Profiler(tmp_path, **kw)


def intervals(tmp_path):
    recs, bad = profiler.read_records(tmp_path / "profile" / "rank0.jsonl")
    assert bad == 0
    return [r for r in recs if r["type"] == "interval"], recs


def test_paused_spans_counters_and_faults_take_the_no_profile_path(tmp_path):
    plan = FaultPlan(parse_faults("crash@x.faulty"), rank=0)
    with make_prof(tmp_path, fault_plan=plan) as prof:
        with profiler.span("x.work"):
            pass
        assert prof.pauses.pause("test", 60)["ok"]
        assert isinstance(profiler.span("x.work"), NoopSpan)
        assert profiler.span("x.work") is api._noop_spans["x.work"]   # the object --no-profile gets
        with profiler.span("x.work"), profiler.span("x.faulty"):   # no span recorded, no fault fired
            pass
        profiler.count("tokens", 5)
        profiler.metric("loss", 1.0)
        profiler.set_step(7)
        assert prof.step == 7 and prof.step_ns > 0 and prof.progress()[1][0] == 7   # the watchdog sees steps
        nan = torch.tensor([float("nan")])
        profiler.check_finite("x.work", {"t": nan})
        profiler.check_flags("x.work", ["t"], torch.tensor([True]))
        profiler.event("checkpoint", path="/x")                       # events are still written
        assert profiler.corrupt("x.work", nan) is nan
        assert prof.pauses.resume("test") == {"ok": True, "paused": False}
        assert profiler.settle_nonfinite() is None                    # no check was launched while paused
        with profiler.span("x.work"):
            pass
        profiler.count("tokens", 1)
    (interval,), recs = intervals(tmp_path)
    assert interval["spans"]["x.work"]["count"] == 2 and "x.faulty" not in interval["spans"]
    assert interval["counters"]["tokens"]["total"] == 1
    assert interval["pauses"] == 1 and interval["paused_seconds"] > 0
    assert [r["path"] for r in recs if r.get("kind") == "checkpoint"] == ["/x"]
    assert profiler.active() is None


def test_run_end_while_paused_resumes_and_counts_the_pause(tmp_path):
    with make_prof(tmp_path) as prof:
        prof.close_interval()                       # an interval with no pause has no pause fields
        prof.pauses.pause("test", 60)
        assert profiler.active() is not prof and profiler.active().profiler is prof
    first, final = intervals(tmp_path)[0]
    assert "paused_seconds" not in first and "pauses" not in first
    assert final["final"] and final["pauses"] == 1 and final["paused_seconds"] >= 0
    assert profiler.active() is None and isinstance(profiler.span("x.after"), NoopSpan)


def test_the_interval_clock_stops_while_paused(tmp_path):
    now = [0.0]
    with make_prof(tmp_path, interval_s=10.0, clock=lambda: now[0]) as prof:
        now[0] = 4.0
        prof.pauses.pause("test", 60)                 # 6 s of the interval left
        now[0] = 30.0
        assert prof.tick() is False and prof.intervals_closed == 0   # no boundary passes while paused
        prof.pauses.resume("test")
        now[0] = 35.9
        assert prof.tick() is False
        now[0] = 36.0                                 # 10 s of profiled time: 4 before, 6 after
        assert prof.tick() is True and prof.intervals_closed == 1
        assert prof.last_interval["pauses"] == 1
        now[0] = 46.0
        assert prof.tick() is True and "pauses" not in prof.last_interval
        prof.pauses.pause("test", 60)
        prof.close_interval()                         # a forced close while paused: a whole interval after it
        prof.pauses.resume("test")
        now[0] = 55.9
        assert prof.tick() is False
        now[0] = 56.0
        assert prof.tick() is True and prof.intervals_closed == 4


def test_checks_issued_before_a_pause_are_still_read_back(tmp_path):
    with make_prof(tmp_path) as prof:
        profiler.check_flags("x.work", ["t"], torch.tensor([True]))
        assert prof.pauses.pause("test", 60)["ok"]
        prof.tick()                                   # paused: no drain, but the read-back goes on
        assert profiler.nonfinite_found()["tensor"] == "t" and prof.spans_finished == 0


def test_lease_runs_out_and_owners_do_not_share(tmp_path, caplog):
    now = [100.0]
    samplers = [type("S", (), {"paused": False})(), type("S", (), {"paused": False})()]
    with make_prof(tmp_path) as prof:
        pc = PauseControl(prof, prof.recorder, samplers=samplers, clock=lambda: now[0])
        assert pc.pause("a", 5)["ok"] and all(s.paused for s in samplers)
        taken = pc.pause("b", 5)
        assert taken["ok"] is False and "paused by a for 5.0 s more" in taken["error"]
        assert pc.resume("b") == {"ok": False, "error": "paused by a, not by b"}
        now[0] = 104.0
        assert pc.pause("a", 5)["ok"]                # renews: now ends at 109
        now[0] = 108.0
        pc.expire()
        assert pc.active
        now[0] = 109.0
        with caplog.at_level(logging.WARNING, logger="profiler"):
            pc.expire()
        assert not pc.active and not any(s.paused for s in samplers)
        assert "the pause by a ran out of its lease" in caplog.text
        assert profiler.active() is prof
        assert pc.resume("a") == {"ok": True, "paused": False}   # idempotent


@pytest.mark.parametrize("owner,lease_s,why", [
    ("a", 0, "'lease_s' in (0, 600]"), ("a", -1, "'lease_s'"), ("a", MAX_LEASE_S + 1, "'lease_s'"),
    ("a", True, "'lease_s'"), ("a", "5", "'lease_s'"), ("a", float("nan"), "'lease_s'"),
    ("", 5, "'owner' string"), (None, 5, "'owner' string"), ("x" * 201, 5, "'owner' string")])
def test_bad_pause_requests_are_refused(tmp_path, owner, lease_s, why):
    with make_prof(tmp_path) as prof:
        reply = prof.pauses.pause(owner, lease_s)
        assert reply["ok"] is False and why in reply["error"] and not prof.pauses.active
        assert profiler.active() is prof


def test_an_inline_pause_stops_the_training_threads_records_only(tmp_path):
    now = [0.0]
    with make_prof(tmp_path, interval_s=10.0, clock=lambda: now[0]) as prof:
        prof.sampler = type("S", (), {"paused": False})()
        assert prof.pauses.pause("test", 60, "inline") == {"ok": True, "paused": True, "part": "inline",
                                                            "lease_s": 60.0}
        assert isinstance(profiler.span("x.work"), NoopSpan) and not prof.pauses.background_held
        now[0] = 10.0
        assert prof.tick() is True                      # the interval clock runs on
        assert prof.last_interval["paused_parts"] == ["inline"] and prof.last_interval["pauses"] == 1
        assert prof.pauses.resume("test")["ok"]
        with profiler.span("x.work"):
            pass
        now[0] = 20.0
        assert prof.tick() is True and prof.last_interval["spans"]["x.work"]["count"] == 1
        assert "paused_parts" in prof.last_interval    # paused for the first instant of this interval


def test_a_pause_of_part_none_stops_nothing(tmp_path):
    """The A/A calibration: a `none` pause is counted in the interval, and profiles on as if not paused."""
    now = [0.0]
    samplers = [type("S", (), {"paused": False})()]
    with make_prof(tmp_path, interval_s=10.0, clock=lambda: now[0]) as prof:
        pc = PauseControl(prof, prof.recorder, samplers=samplers, interval_clock=prof.timer)
        prof.pauses = pc
        assert pc.pause("test", 60, "none")["part"] == "none"
        assert pc.active and not pc.background_held and not samplers[0].paused and profiler.active() is prof
        with profiler.span("x.work"):
            pass
        now[0] = 10.0
        assert prof.tick() is True
        interval = prof.last_interval
        assert interval["spans"]["x.work"]["count"] == 1 and interval["paused_parts"] == ["none"]
        assert pc.resume("test")["ok"] and not pc.active


def test_steps_while_paused_count_toward_the_gpu_samplers_step_rate(tmp_path):
    """The sampler's chance comes from the interval's steps over its duration, paused time included, so paused
    steps count too (else a half-paused run would GPU-time twice the steps it should)."""
    with make_prof(tmp_path, gpu_steps_per_s=5.0) as prof:
        assert prof.pauses.pause("test", 60, "all")["ok"]
        for step in range(4):
            profiler.set_step(step)
        assert prof.pauses.resume("test")["ok"]
        profiler.set_step(4)
        assert prof.gpu_sampler.steps == 5


def test_a_gpu_pause_makes_every_span_a_cpu_span_and_nothing_else(tmp_path):
    """Part `gpu`: the spans record no CUDA event (fake events here: tests/profiler/test_cuda_sharing.py) while
    the rest profiles on; the resume times the next step again, and the interval says what was paused."""
    from profiler.cuda_timing import EventPool
    from tests.profiler.test_cuda_sharing import Event, Gpu
    gpu, now = Gpu(), [0.0]
    pool = EventPool(lambda: Event(gpu), prealloc=0)
    with make_prof(tmp_path, interval_s=10.0, clock=lambda: now[0], event_pool=pool, detail_steps=0) as prof:
        assert prof.pauses.pause("test", 60, "gpu")["part"] == "gpu"
        assert profiler.active() is prof and not prof.pauses.background_held
        for step in range(3):
            prof.set_step(step)
            with profiler.span("x.work"):
                gpu.now_ms += 1.0
        assert gpu.records == 0
        assert prof.pauses.resume("test")["ok"]
        prof.set_step(3)
        with profiler.span("x.work"):
            gpu.now_ms += 1.0
        now[0] = 10.0
        assert prof.tick() is True
        e = prof.last_interval["spans"]["x.work"]
        assert gpu.records == 2 and (e["count"], e["gpu_count"]) == (4, 1)
        assert prof.last_interval["paused_parts"] == ["gpu"]


def test_a_background_pause_keeps_the_records_and_drains_them_at_the_resume(tmp_path):
    now = [0.0]
    samplers = [type("S", (), {"paused": False})()]
    pokes = []
    with make_prof(tmp_path, interval_s=10.0, clock=lambda: now[0]) as prof:
        prof.timer.poke = lambda: pokes.append(now[0])
        pc = PauseControl(prof, prof.recorder, samplers=samplers, interval_clock=prof.timer)
        prof.pauses = pc
        assert pc.pause("test", MAX_BACKGROUND_LEASE_S, "background")["ok"]
        assert pc.background_held and samplers[0].paused and pokes == [0.0]   # queued checks go out at once
        with profiler.span("x.work"):                   # the training thread still logs
            pass
        profiler.count("tokens", 3)
        profiler.check_flags("x.work", ["t"], torch.tensor([True]))
        now[0] = 30.0
        assert prof.tick() is False and prof.spans_finished == 0   # the collector holds still, no close...
        assert profiler.nonfinite_found()["tensor"] == "t"         # ...but reads the checks back
        assert pc.resume("test")["ok"] and pokes == [0.0, 30.0] and not samplers[0].paused
        assert prof.tick() is False and prof.spans_finished == 1   # the backlog drains at once
        now[0] = 40.0
        assert prof.tick() is True
        interval = prof.last_interval
        assert interval["spans"]["x.work"]["count"] == 1 and interval["counters"]["tokens"]["total"] == 3
        assert interval["paused_parts"] == ["background"] and interval["duration_seconds"] > 0


def test_a_pause_keeps_its_part_and_background_leases_are_short(tmp_path):
    with make_prof(tmp_path) as prof:
        pc = prof.pauses
        assert pc.pause("a", 5, "inline")["ok"]
        switched = pc.pause("a", 5, "background")
        assert switched["ok"] is False and "paused (inline) by a already" in switched["error"]
        assert pc.pause("a", 5, "inline")["ok"] and pc.part == "inline"   # a renewal of the same part
        assert pc.resume("a")["ok"] and pc.part is None
        for part, lease_s in (("background", MAX_BACKGROUND_LEASE_S + 1), ("nope", 5), (None, 5), (3, 5)):
            reply = pc.pause("a", lease_s, part)
            assert reply["ok"] is False and not pc.active, reply
        assert "part 'background' needs 'lease_s' in (0, 60]" in pc.pause("a", 61, "background")["error"]
        assert "'part' one of all, inline, background, gpu, none, got 'nope'" in pc.pause("a", 5, "nope")["error"]
        assert len(pc.pause("x" * 10**6, 5)["error"]) < 200 and len(pc.pause("a", 5, "y" * 10**6)["error"]) < 200


def test_poke_wakes_the_collector_thread_at_once():
    polls = []
    timer = IntervalTimer(3600.0, lambda: 0.0, lambda: polls.append(1), lambda: None, poll_s=30.0)
    timer.start()
    try:
        timer.poke()
        deadline = 0
        while not polls and deadline < 200:
            threading.Event().wait(0.01)
            deadline += 1
        assert polls, "poke() did not wake the timer thread"
    finally:
        timer.stop()                                    # and stop() wakes it too: no 30 s wait


def test_pause_progress_resume_and_records_over_the_control_socket(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    with make_prof(tmp_path / "run", control=True) as prof:
        sock = prof.control.socket_path
        profiler.set_step(3)
        progress = query(sock, "progress")
        assert progress["ok"] and progress["step"] == 3 and progress["pid"] == os.getpid()
        assert progress["paused_by"] is None and progress["step_time_unix"] == pytest.approx(
            prof.to_unix_ns(prof.step_ns) / 1e9)
        assert query(sock, "pause", owner="client-1", lease_s=30)["ok"]
        assert query(sock, "progress")["paused_by"] == "client-1"
        threads = query(sock, "threads")["threads"]
        assert ["MainThread", threading.main_thread().native_id] in threads
        assert any(name.startswith("profiler") for name, _ in threads)
        assert query(sock, "state")["state"]["paused_by"] == "client-1"
        assert "paused by client-1" in query(sock, "pause", owner="client-2", lease_s=30)["error"]
        assert "'lease_s'" in query(sock, "pause", owner="client-1")["error"]
        assert query(sock, "resume", owner="client-1") == {"ok": True, "paused": False}
        assert query(sock, "pause", owner="client-1", lease_s=30, part="background")["part"] == "background"
        assert profiler.active() is prof and prof.pauses.background_held   # spans on, collector still
        assert "needs 'part' one of" in query(sock, "pause", owner="client-1", lease_s=30, part=[1])["error"]
        assert query(sock, "resume", owner="client-1")["ok"] and not prof.pauses.active
        summary = {"pairs": 3, "mean_diff_pct": -1.5, "within": "no", "phases": [1, 2], "kind": "spoofed",
                   "type": "interval", "rank": 7, "stopped": "x" * 900}
        assert query(sock, "overhead_result", result=summary) == {"ok": True}
        assert "needs a 'result' object" in query(sock, "overhead_result", result="x")["error"]
        assert query(sock, "record", fields={"type": "interval", "rank": 9, "note": "forged?"})["ok"]
    recs = profiler.read_records(tmp_path / "run" / "profile" / "rank0.jsonl")[0]
    (ev,) = [r for r in recs if r["type"] == "event" and r["kind"] == "profile_overhead"]
    assert (ev["pairs"], ev["mean_diff_pct"], ev["within"], ev["step"]) == (3, -1.5, "no", 3) and "phases" not in ev
    assert ev["rank"] == 0 and len(ev["stopped"]) == 500   # header fields are the profiler's; strings are cut
    (snap,) = [r for r in recs if r.get("note") == "forged?"]
    assert (snap["type"], snap["rank"]) == ("snapshot", 0)   # `record` cannot forge a type or rank either
