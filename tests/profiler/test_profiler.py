"""The Profiler end to end on CPU: run log contents, lifecycle (incl. a raising with-block),
single active profiler, the interval, events, faults, control endpoint, console text."""
import io
import json
import os
import threading
import time

import pytest

from exporters.console import ConsoleExporter
import torch

import profiler
from exporters.console import format_hotspots, format_interval
from profiler.control import query
from profiler.config import ProfilerConfig, check_interval_s
from profiler.faults import FaultPlan, InjectedFault, parse_faults
from tests.profiler.build import make_profiler


def make_prof(tmp_path, **kw):
    kw.setdefault("interval_s", 3600.0)
    kw.setdefault("control", False)
    kw.setdefault("measure_floors", False)
    return make_profiler(tmp_path, **kw)


def test_run_log_records(tmp_path):
    with make_prof(tmp_path, rank=1, world_size=2, role="drafter", run_config={"lr": 1e-3}):
        with profiler.span("drafter.fwd_bwd"):
            pass
        profiler.count("tokens", 10)
        profiler.set_step(4)
        profiler.event("checkpoint", path="/x")
    recs, bad = profiler.read_records(tmp_path / "profile" / "rank1.jsonl")
    assert bad == 0
    assert [r["type"] for r in recs] == ["run_start", "event", "interval", "tick", "run_end"]
    for r in recs:
        assert r["rank"] == 1 and r["role"] == "drafter" and isinstance(r["time_unix"], float)
    start, ev, interval, _tick, end = recs
    assert start["config"] == {"lr": 1e-3} and start["pid"] == os.getpid() and start["interval_s"] == 3600.0
    for k in ("hostname", "python_version", "torch_version", "device_name", "floors", "world_size"):
        assert k in start
    assert ev["kind"] == "checkpoint" and ev["step"] == 4 and ev["path"] == "/x"
    assert interval["final"] is True and interval["spans"]["drafter.fwd_bwd"]["count"] == 1
    assert end["status"] == "ok" and end["step"] == 4 and end["duration_seconds"] > 0
    assert end["spans"]["drafter.fwd_bwd"]["count"] == 1
    assert set(end["spans"]["drafter.fwd_bwd"]["cpu"]) == {
        "total_seconds", "self_seconds", "mean_seconds", "p50_seconds", "p95_seconds", "p99_seconds", "max_seconds"}
    assert end["counters"]["tokens"]["total"] == 10
    assert profiler.active() is None


def test_raising_block_still_writes_run_end_and_stops_threads(tmp_path):
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(ZeroDivisionError):
        with make_prof(tmp_path, interval_s=0.05, poll_s=0.01):
            with profiler.span("x.work"):
                time.sleep(0.12)                      # a couple of automatic intervals
                raise ZeroDivisionError("division by zero")
    assert profiler.active() is None
    recs, _ = profiler.read_records(tmp_path / "profile" / "rank0.jsonl")
    assert recs[-1]["type"] == "run_end" and recs[-1]["status"] == "ZeroDivisionError"
    assert recs[-1]["spans"]["x.work"]["count"] == 1
    assert sum(r["type"] == "interval" for r in recs) >= 2
    time.sleep(0.05)
    assert "profiler.collector" not in {t.name for t in threading.enumerate()} - before


def test_only_one_active_profiler(tmp_path):
    with make_prof(tmp_path / "a"):
        with pytest.raises(RuntimeError, match="already active"):
            with make_prof(tmp_path / "b"):
                pass
        assert profiler.active() is not None
    assert profiler.active() is None
    with make_prof(tmp_path / "c"):                   # usable again afterwards
        assert profiler.active() is not None


def test_interval_is_taken_as_given_and_bad_values_refused(monkeypatch):
    monkeypatch.setenv("DFLASH_PROFILE_INTERVAL", "5")   # the profiler reads no environment
    assert check_interval_s(2) == 2.0
    for bad in (0, -1.0, True, "5", None):
        with pytest.raises(ValueError, match="interval_s must be a positive"):
            check_interval_s(bad)


@pytest.mark.parametrize("field, bad", [("detail_steps", -1), ("memory_history", 1.5), ("poll_s", -0.1),
                                        ("hang_timeout_s", "soon"), ("interval_s", 0)])
def test_a_bad_setting_is_refused_naming_its_field(field, bad):
    with pytest.raises(ValueError, match=field):
        ProfilerConfig(**{field: bad})


def test_the_runs_own_config_goes_in_run_config_not_config(tmp_path):
    with pytest.raises(TypeError, match="run_config"):
        profiler.Profiler(tmp_path, config={"lr": 1e-3})


def test_faults_fire_in_spans_and_keep_the_stack_right(tmp_path):
    plan = FaultPlan(parse_faults("crash@target.fwd:step=2;nan@drafter.fwd_bwd;slow=0.03@target.fetch"), rank=0)
    with make_prof(tmp_path, fault_plan=plan) as prof:
        with profiler.span("target.fwd"):             # step 0: no crash
            pass
        profiler.set_step(2)
        with pytest.raises(InjectedFault):
            with profiler.span("target.fwd"):
                pass
        assert prof.state()["active_spans"] == []
        with profiler.span("target.fetch"):
            pass
        t = torch.ones(3)
        assert torch.isnan(profiler.corrupt("drafter.fwd_bwd", t)).all()
        assert profiler.corrupt("target.fwd", t) is t
        rec = prof.close_interval()
    assert rec["spans"]["target.fwd"]["count"] == 1          # the crashed enter is not a span
    assert rec["spans"]["target.fetch"]["cpu"]["max_seconds"] >= 0.03   # slow counts inside the span


def test_control_endpoint_serves_state(tmp_path):
    with make_prof(tmp_path, control=True, role="target") as prof:
        profiler.set_step(11)
        prof.close_interval()
        reply = query(prof.control.socket_path)
    assert reply["ok"] is True
    st = reply["state"]
    assert st["pid"] == os.getpid() and st["step"] == 11 and st["role"] == "target"
    assert st["last_interval"]["type"] == "interval" and st["memory"]["available"] is False
    assert not os.path.exists(prof.control.socket_path)


def test_console_prints_intervals(tmp_path):
    out = io.StringIO()
    with make_prof(tmp_path, exporters=[ConsoleExporter(out)], floors={"host_copy": 1e10}):
        for _ in range(3):
            with profiler.span("target.fwd"):
                time.sleep(0.002)
        with profiler.span("d2h_copy", bytes=10 << 20):
            time.sleep(0.001)
        profiler.count("tokens", 500)
    text = out.getvalue()
    assert "target.fwd" in text and "d2h_copy" in text and "GB/s" in text and "of host_copy" in text
    assert "tokens:" in text and "memory: n/a (no CUDA device)" in text
    assert text.index("target.fwd") < text.index("d2h_copy")   # sorted by share


def _span(total, count, p95, gpu=None):
    stats = {"total_seconds": total, "mean_seconds": total / count, "p50_seconds": p95, "p95_seconds": p95,
             "p99_seconds": p95, "max_seconds": p95}
    return {"count": count, "threads": ["t"], "cpu": stats, "gpu": gpu, "share": None}


def test_format_interval_memory_and_bandwidth():
    rec = {"rank": 0, "role": "target", "index": 2, "step": 9, "duration_seconds": 60.0,
           "spans": {"a.x": {**_span(6.0, 10, 0.7), "share": 0.1},
                     "d2h_copy": {**_span(30.0, 10, 3.1), "share": 0.5, "bytes": 10 ** 10,
                                  "bandwidth_bytes_per_s": 20e9, "floor": "pinned_d2h",
                                  "floor_bytes_per_s": 25e9, "floor_ratio": 0.8}},
           "counters": {"tokens": {"total": 600, "per_second": 10.0, "run_total": 1200}},
           "gauges": {}, "metrics": {"loss": {"last": 2.5, "mean": 2.6}},
           "memory": {"available": True, "gpus": [{"index": 0, "name": "H200", "total_bytes": 140 * 2 ** 30,
                                                   "used_bytes_peak": 100 * 2 ** 30,
                                                   "headroom_bytes": 40 * 2 ** 30}]}}
    text = format_interval(rec)
    lines = text.splitlines()
    assert lines[2].split()[0] == "d2h_copy" and "50.0%" in lines[2] and "20.00 GB/s (80% of pinned_d2h)" in lines[2]
    assert "3000.00" in lines[2]                       # mean ms of 30 s / 10
    assert "tokens: 10.0/s" in text and "headroom 40.00 GiB of 140.0 GiB" in text and "loss 2.5" in text


def test_format_hotspots_over_ranks():
    ends = [{"type": "run_end", "rank": 0, "role": "target", "duration_seconds": 100.0,
             "spans": {"target.fwd": _span(50.0, 100, 0.6)},
             "counters": {"tokens": {"total": 1000, "per_second": 10.0}}},
            {"type": "run_end", "rank": 1, "role": "target", "duration_seconds": 100.0,
             "spans": {"target.fwd": _span(30.0, 100, 0.9)},
             "counters": {"tokens": {"total": 1000, "per_second": 10.0}}},
            {"type": "run_end", "rank": 2, "role": "drafter", "duration_seconds": 100.0,
             "spans": {"drafter.fwd_bwd": _span(90.0, 100, 1.0, gpu=None)}, "counters": {}}]
    steady = [{"type": "event", "kind": "throughput", "rank": 2, "role": "drafter", "steady_tokens_per_s": 1234.5,
               "steady_steps": 90, "warmup_steps": 5, "steady_seconds": 80.0,
               "phases_seconds": {"ckpt.save": 2.0, "drafter.compile": 0.0}}]
    text = format_hotspots(ends, steady)
    lines = text.splitlines()
    assert lines[0] == "whole run:"
    assert lines[2].split()[:2] == ["drafter.fwd_bwd", "drafter"] and "90.0%" in lines[2]
    tf = lines[3].split()
    assert tf[:3] == ["target.fwd", "target", "80.000"] and tf[3] == "40.0%"   # 80 s of 200 s
    assert tf[4] == "400.00" and tf[5] == "900.00"     # mean 80/200 spans; worst rank's p95
    assert "target (2 ranks, 200.0 s, whole run): tokens 20.0/s" in text
    assert ("drafter steady state: 1,234 tokens/s (steady_tokens_per_s; 90 steps after 5 warm-up, over 80.0 s; "
            "phases left out: ckpt.save 2.0 s)") in text
    json.dumps(ends)


def test_failing_memory_sampler_does_not_lose_the_interval(tmp_path):
    class Broken:
        def start(self):
            pass

        def stop(self):
            pass

        def interval_summary(self, reset=True):
            raise RuntimeError("NVML went away")

        def latest(self):
            raise RuntimeError("NVML went away")

    with make_prof(tmp_path, memory_sampler=Broken()) as prof:
        with profiler.span("x.step"):
            pass
        rec = prof.close_interval()
        st = prof.state()
    assert rec["spans"]["x.step"]["count"] == 1
    assert rec["memory"]["available"] is False and "NVML went away" in rec["memory"]["reason"]
    assert st["memory"]["available"] is False
