"""Captures at step boundaries (profiler/capture.py): spans are ranges only while one runs, a request is armed,
begun a step early, recorded and stopped on the training thread, its event written once its spans resolved;
the schedule; refusals; NVTX for the run; and one real torch.profiler capture on the CPU."""
from __future__ import annotations

import gzip
import json
import threading

import pytest

import profiler
from profiler.capture import MAX_STEPS, CaptureSchedule
from profiler.config import ProfilerConfig
from profiler.control import query
from profiler.schema.records import read_records
from profiler.spans import CpuSpan
from tests.profiler.build import make_profiler


class FakeSession:
    """A capture session that logs what the captures asked of it, and pushes/pops named ranges."""

    def __init__(self, log: list, request, fail_start: bool = False):
        self.log, self.request, self.fail_start = log, request, fail_start
        self.ranges = (self._push, self._pop)
        self.open: list = []

    def _push(self, name):
        self.open.append(name)
        self.log.append(("push", name))
        return len(self.open)

    def _pop(self, depth):
        assert depth == len(self.open), "ranges closed out of order"
        self.log.append(("pop", self.open.pop()))

    def begin(self, step):
        if self.fail_start:
            raise RuntimeError("CUPTI is busy")
        self.log.append(("begin", step))

    def step(self, step):
        self.log.append(("step", step))

    def stop(self, path):
        self.log.append(("stop", None if path is None else path.name))
        if path is None:
            return {}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * 1000)
        return {"bytes": 1000, "activities": ["cpu"]}


def make_prof(tmp_path, log, fail_start=False, **kw):
    return make_profiler(tmp_path, interval_s=3600.0, measure_floors=False, control=False, background=False,
                         capture_session=lambda req: FakeSession(log, req, fail_start), **kw)


def events(tmp_path, kind="capture", rank=0):
    return [r for r in read_records(tmp_path / "profile" / f"rank{rank}.jsonl")[0] if r.get("kind") == kind]


def steps(prof, first, last, armed=None):
    for step in range(first, last):
        profiler.set_step(step)
        if step == first and armed:
            assert prof.captures.request(armed)["ok"]
        with profiler.span("t.outer"):
            with profiler.span("t.inner"):
                pass
        prof.tick()


def test_spans_are_ranges_only_while_a_capture_records(tmp_path):
    log: list = []
    with make_prof(tmp_path, log) as prof:
        steps(prof, 0, 2, armed={"at_step": 3, "steps": 2})
        before = type(profiler.span("t.outer"))
        steps(prof, 2, 7)
        after = type(profiler.span("t.outer"))
    assert issubclass(before, CpuSpan) and before.__name__ == "CpuSpan" and after.__name__ == "CpuSpan"
    begun = log.index(("begin", 2))   # Kineto's warm-up, a step ahead
    assert log[begun + 1:begun + 2] == [("step", 3)] and ("stop", "rank0-step3.json.gz") in log
    ranges = [e for e in log if e[0] in ("push", "pop")]
    assert ranges == [("push", "t.outer"), ("push", "t.inner"), ("pop", "t.inner"), ("pop", "t.outer")] * 2
    assert log.index(("step", 3)) < log.index(("push", "t.outer")) and log[-1] == ("stop", "rank0-step3.json.gz")
    (ev,) = events(tmp_path)
    assert ev["step"] == 3 and ev["steps"] == [3, 4] and ev["steps_recorded"] == 2 and ev["bytes"] == 1000
    assert ev["files"] == [str(tmp_path / "kineto" / "rank0-step3.json.gz")] and ev["spans_unfinished"] == 0
    assert [(s["name"], s["step"], s["depth"]) for s in ev["captured_spans"]] == [
        ("t.outer", 3, 0), ("t.inner", 3, 1), ("t.outer", 4, 0), ("t.inner", 4, 1)]
    assert ev["bytes_per_step"] == 500 and ev["source"] == "control" and "stopped at step 5" in ev["ended"]


def test_a_span_open_across_the_stop_is_waited_for(tmp_path):
    log: list = []
    with make_prof(tmp_path, log) as prof:
        steps(prof, 0, 1, armed={"at_step": 2, "steps": 1})
        profiler.set_step(1)
        profiler.set_step(2)
        held = profiler.span("t.long")
        held.__enter__()
        profiler.set_step(3)   # the capture stops while t.long is open
        prof.tick()
        assert events(tmp_path) == []
        held.__exit__(None, None, None)
        prof.tick()
        (ev,) = events(tmp_path)
    assert [s["name"] for s in ev["captured_spans"]] == ["t.long"] and ev["spans_unfinished"] == 0


def test_requests_are_checked_and_answered_in_one_line(tmp_path):
    log: list = []
    with make_prof(tmp_path, log) as prof:
        profiler.set_step(10)
        ask = prof.captures.request
        assert ask({"probe": True}) == {"ok": True, "step": 10, "busy": False, "armed": None}
        for fields, why in (({"at_step": 10, "steps": 2}, "already at step 10, past step 10"),
                            ({"at_step": 20, "steps": 0}, f"steps must be an integer between 1 and {MAX_STEPS}"),
                            ({"at_step": 20, "steps": MAX_STEPS + 1}, "steps must be an integer"),
                            ({"at_step": "20", "steps": 2}, "at_step must be an integer"),
                            ({"at_step": 20, "steps": 2, "memory": "yes"}, "memory must be true or false")):
            reply = ask(fields)
            assert not reply["ok"] and why in reply["error"] and "\n" not in reply["error"], (fields, reply)
        assert ask({"at_step": 12, "steps": 2})["ok"] and ask({"probe": True})["armed"] == 12
        assert ask({"at_step": 14, "steps": 2})["file"].endswith("rank0-step14.json.gz")   # replaces it
        for step in range(11, 16):
            profiler.set_step(step)
            if step == 14:
                busy = ask({"at_step": 30, "steps": 1})
        prof.tick()
    assert not busy["ok"] and busy["error"] == "busy: capturing steps 14-15 (now at step 14)"
    assert [e["step"] for e in events(tmp_path)] == [14]


def test_the_schedule_captures_every_m_steps(tmp_path):
    log: list = []
    with make_prof(tmp_path, log, capture_at_step=2, capture_steps=2, capture_every=5):
        for step in range(0, 14):
            profiler.set_step(step)
            with profiler.span("t.step"):
                pass
    got = [(e["step"], e["steps"], e["source"]) for e in events(tmp_path)]
    assert got == [(2, [2, 3], "schedule"), (7, [7, 8], "schedule"), (12, [12, 13], "schedule")]
    assert "the run ended at step 13" in events(tmp_path)[-1]["ended"]   # stopped with the steps it ran
    assert CaptureSchedule(0, 1).due(0) and not CaptureSchedule(0, 1).due(5)


def test_a_failed_start_and_a_run_ending_first_are_events_not_errors(tmp_path):
    log: list = []
    with make_prof(tmp_path, log, fail_start=True) as prof:
        steps(prof, 0, 4, armed={"at_step": 2, "steps": 1})
        assert type(profiler.span("t.outer")).__name__ == "CpuSpan"
        assert prof.captures.request({"at_step": 9, "steps": 1})["ok"]
    first, second = events(tmp_path)
    assert first["error"] == "torch.profiler did not start: RuntimeError: CUPTI is busy" and first["files"] == []
    assert second["error"] == "the run ended at step 3, before step 9"


@pytest.mark.parametrize("bad, why", [({"capture_steps": 0}, "capture_steps"),
                                      ({"capture_every": 3}, "capture_every needs capture_at_step"),
                                      ({"capture_at_step": 1, "capture_every": 2, "capture_steps": 2}, "overlap"),
                                      ({"capture_at_step": -1}, "capture_at_step")])
def test_bad_capture_settings_are_refused(bad, why):
    with pytest.raises(ValueError, match=why):
        ProfilerConfig(**bad)


def test_a_refused_capture_setting_names_its_field_and_the_fields_it_needs_for_a_caller_to_reword():
    from profiler.config import ConfigFieldError

    with pytest.raises(ConfigFieldError) as e:
        ProfilerConfig(capture_every=3)
    assert (str(e.value), e.value.field) == ("capture_every needs capture_at_step (the first capture)", "capture_every")
    assert e.value.why_in(lambda name: f"<{name}>") == "needs <capture_at_step> (the first capture)"
    with pytest.raises(ConfigFieldError) as e:
        ProfilerConfig(capture_at_step=1, capture_every=2, capture_steps=2)
    assert str(e.value) == "capture_every (2) must be more than capture_steps (2): captures do not overlap"
    assert e.value.why_in(str) == "must be more than capture_steps (2): captures do not overlap"


def test_nvtx_ranges_hold_every_span_for_the_run_and_a_capture_nests_inside(tmp_path):
    log: list = []

    class Nvtx:
        def range_push(self, name):
            log.append(("nvtx+", name))

        def range_pop(self):
            log.append(("nvtx-",))

    with make_prof(tmp_path, log, nvtx=True, nvtx_module=Nvtx()) as prof:
        steps(prof, 0, 4, armed={"at_step": 2, "steps": 1})
    ranges = [e for e in log if e[0] in ("nvtx+", "nvtx-", "push", "pop")]
    plain = [("nvtx+", "t.outer"), ("nvtx+", "t.inner"), ("nvtx-",), ("nvtx-",)]
    captured = [("nvtx+", "t.outer"), ("push", "t.outer"), ("nvtx+", "t.inner"), ("push", "t.inner"),
                ("pop", "t.inner"), ("nvtx-",), ("pop", "t.outer"), ("nvtx-",)]
    assert ranges == plain * 2 + captured + plain
    with make_prof(tmp_path / "cpu", log, nvtx=True) as prof:   # no CUDA and no stand-in: no NVTX
        assert type(profiler.span("t.outer")).__name__ == "CpuSpan"


def test_the_capture_and_memory_commands_answer_on_the_endpoint(tmp_path):
    log: list = []
    with make_profiler(tmp_path, interval_s=3600.0, measure_floors=False, background=False,
                       capture_session=lambda req: FakeSession(log, req)) as prof:
        profiler.set_step(4)
        sock = prof.control.socket_path
        assert query(sock, "capture", fields={"probe": True}) == {"ok": True, "step": 4, "busy": False,
                                                                   "armed": None}
        armed = query(sock, "capture", fields={"at_step": 6, "steps": 1})
        assert armed["ok"] and armed["at_step"] == 6
        assert query(sock, "memory", fields={}) == {
            "ok": False, "error": "rank 0 (main) runs on the CPU: it has no CUDA allocator to snapshot"}
        assert "unknown cmd 'nope'" in query(sock, "nope")["error"]


def test_a_real_cpu_capture_holds_profiler_steps_our_spans_and_the_rank(tmp_path):
    torch = pytest.importorskip("torch")
    with make_profiler(tmp_path, interval_s=3600.0, measure_floors=False, control=False, background=False,
                       rank=1, world_size=2, role="target") as prof:
        worker_done = threading.Event()

        def other_thread():   # a span on another thread is in the trace too (every thread is recorded)
            worker_done.wait()
            with profiler.span("transfer.send"):
                torch.ones(8).sum()

        t = threading.Thread(target=other_thread, name="target.sender")
        t.start()
        for step in range(5):
            profiler.set_step(step)
            if step == 0:
                prof.captures.request({"at_step": 2, "steps": 2})
            if step == 2:
                worker_done.set()
                t.join()
            with profiler.span("target.fwd"):
                torch.ones(64, 64) @ torch.ones(64, 64)
            prof.tick()
    (ev,) = events(tmp_path, rank=1)
    trace = json.loads(gzip.open(ev["files"][0]).read())
    assert trace["distributedInfo"] == {"backend": "none", "rank": 1, "world_size": 2}
    assert trace["dflash"]["role"] == "target" and trace["dflash"]["step"] == 2
    names = {(e["name"], e["tid"]) for e in trace["traceEvents"] if e.get("cat") == "user_annotation"}
    assert {n for n, _ in names} == {"ProfilerStep#2", "ProfilerStep#3", "target.fwd", "transfer.send"}
    assert {tid for n, tid in names if n == "transfer.send"} == {t.native_id}
    assert any(e.get("cat") == "cpu_op" and e["name"] == "aten::mm" for e in trace["traceEvents"])
    assert sorted(s["name"] for s in ev["captured_spans"]) == ["target.fwd", "target.fwd", "transfer.send"]

