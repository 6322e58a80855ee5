"""profiler.schema.views: a typed view of every record kind as docs/RUNLOG.md shows it, the one check (`problem`/`parse`)
that makes a record with a missing or wrong-typed field one bad line with its reason, and views over every record
of a real run reading every field."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from profiler.schema import views, windows
from profiler.schema.records import read_records, rank_logs

REPO = Path(__file__).resolve().parents[2]

BUCKETS = [0, 1, 2, 0, 0]
CPU = {"total_seconds": 1.25, "self_seconds": 1.0, "mean_seconds": 0.5, "p50_seconds": 0.5, "p95_seconds": 0.7,
       "p99_seconds": 0.7, "max_seconds": 0.7, "buckets": BUCKETS}
GPU = {"total_seconds": 0.9, "self_seconds": 0.8, "mean_seconds": 0.45, "p50_seconds": 0.45, "p95_seconds": 0.5,
       "p99_seconds": 0.5, "max_seconds": 0.5, "buckets": [0, 2, 0, 0, 0]}
GPU_LAG = {"n": 2, "unplaced": 0, "launch_bound": 1, "gpu_bound": 1, "start_lag_p50_s": 1e-5, "end_lag_p50_s": 0.01,
           "window_seconds": 0.9, "tail_seconds": 0.02, "tolerance_s": 6e-5}
ENTRY = {"count": 2, "threads": ["drafter.main"], "cpu": CPU, "gpu": GPU, "gpu_count": 2, "open_cpu_seconds": 0.25,
         "share": 0.45, "bytes": 4096, "bandwidth_bytes_per_s": 8192.0, "floor": "device_copy",
         "floor_bytes_per_s": 1e9, "floor_ratio": 8.192e-6, "gpu_unresolved": 0, "gpu_lag": GPU_LAG}
OPEN_SPANS = [{"thread": "drafter.main", "native_id": 41, "spans": [
    {"name": "drafter.fwd_bwd", "depth": 0, "open_seconds": 3.5}]}]
GPU_MEMORY = {"index": 0, "name": "H100", "uuid": "GPU-1", "total_bytes": 80e9, "used_bytes_last": 30e9,
              "used_bytes_peak": 40e9, "headroom_bytes": 40e9, "util_percent_mean": 97.0, "power_watts_mean": 500.0,
              "temperature_c_max": 70, "sm_clock_hz_last": 1.98e9, "throttle_reasons": ["sw_power_cap"],
              "sm_active_percent_mean": 80.0, "sm_occupancy_percent_mean": 40.0, "tensor_active_percent_mean": 30.0,
              "dram_active_percent_mean": None, "samples": 12, "reasons": {"dram_active_percent_mean": "no GPM"}}
ALLOCATOR = {"available": True, "allocated_bytes": 10e9, "reserved_bytes": 12e9, "peak_allocated_bytes": 11e9,
             "peak_reserved_bytes": 13e9, "num_alloc_retries": 0, "num_ooms": 0, "inactive_split_bytes": 1e6}
HEADER = {"time_unix": 1_800_000_000.5, "rank": 0, "role": "drafter"}
FORENSICS = {"threads": [{"thread": "drafter.main", "native_id": 41, "daemon": False,
                          "stack": ["a.py:1 in f: x()"]}],
             "open_spans": OPEN_SPANS, "forensics_file": "R/forensics/rank0-hang-1.txt",
             "extra": {"transfer_ring": [{"time_unix": 1.0, "kind": "received", "thread": "drafter.receiver",
                                          "src": 1, "batch": 7, "ready": "done", "queued": 1}]}}

RECORDS = {
    "run_start": {"type": "run_start", **HEADER, "schema": 1, "run_id": "r-1", "clock": {
        "perf_counter_ns": 5, "unix_ns": 1_800_000_000_000_000_000}, "t_s": 10.0,
        "histogram_buckets_seconds": [0.001, 0.01, 0.1, 1.0], "detail_steps": 3, "detail_follows": True,
        "world_size": 2, "pid": 7, "hostname": "h", "python_version": "3.11", "torch_version": "2.13",
        "device": "cuda:0", "device_name": "H100", "version": "0.1.0",
        "floors": {"device_copy": 1e12, "pinned_d2h": 2e10, "pinned_h2d": 2e10, "host_copy": 1e10},
        "interval_s": 60.0, "warmup_steps": 2, "phase_spans": ["drafter.compile", "ckpt.save"],
        "config": {"tokens_per_batch": 2048}},
    "interval": {"type": "interval", **HEADER, "index": 3, "step": 40, "warmup": True,
                 "step_rate": {"steps": 10, "per_second": 0.5}, "start_s": 10.0, "end_s": 30.0,
                 "duration_seconds": 20.0, "spans": {"drafter.fwd_bwd": ENTRY},
                 "counters": {"tokens": {"total": 2048, "per_second": 102.4, "run_total": 8192}},
                 "gauges": {"queue_depth": {"last": 1, "mean": 0.5, "max": 2}},
                 "metrics": {"loss": {"last": None, "mean": 2.5, "reasons": {"last": "non-finite: nan"}}},
                 "memory": {"available": True, "gpus": [GPU_MEMORY], "allocator": ALLOCATOR, "sampler_errors": 0},
                 "threads": [{"name": "drafter.main", "native_id": 41}],
                 "threads_cpu_seconds": {"drafter.main": 19.0, "profiler.collector": 0.1}, "profiler_share": 0.005,
                 "exporters": {"prometheus": {"exported": 10, "dropped": 0, "failed": 0}}, "open_spans": OPEN_SPANS,
                 "stack_samples": {"samples": 5, "failed": 0, "threads": [
                     {"name": "drafter.main", "native_id": 41, "idle_samples": 1,
                      "top_frames": [{"frame": "f (a.py:1)", "count": 4}]}]}},
    "tick": {"type": "tick", **HEADER, "index": 2, "t_s": 15.0, "step": 30, "warmup": True, "final": True,
             "counters": {"tokens": 6144}, "spans": {"drafter.fwd_bwd": {
                 "count": 6, "cpu_seconds": 3.0, "self_seconds": 2.5, "gpu_seconds": 2.0, "gpu_self_seconds": 1.9,
                 "gpu_count": 6}}, "metrics": {"loss": {"sum": 15.0, "count": 6, "nonfinite": 1}}},
    "spans": {"type": "spans", **HEADER, "index": 3, "steps": [31, 33], "dropped": 0, "spans": [
        {"id": 1, "parent": None, "name": "transfer.send", "thread": "target.sender", "tid": 9, "depth": 0,
         "start_unix_ns": 10, "end_unix_ns": 20, "cpu_seconds": 1e-8, "gpu_seconds": None, "gpu_start_unix_ns": 12,
         "bytes": 4096, "attrs": {"flow": "1:7", "detail": True}}]},
    "snapshot": {"type": "snapshot", **HEADER, "pid": 7, "step": 40, "native": False, "file": "R/snapshots/s.json",
                 "stuck": True, "stuck_rule": "open longer than max(10 x recent p95, 5 s)", "note": None,
                 "threads": [{"name": "drafter.main", "native_id": 41, "stuck": True,
                              "stuck_span": "drafter.fwd_bwd", "stuck_frame": "f (a.py:1)",
                              "frames": ["f (a.py:1)", "g (a.py:2)"],
                              "open_spans": [{"name": "drafter.fwd_bwd", "open_seconds": 80.0, "p95_seconds": 0.7,
                                              "limit_seconds": 7.0, "stuck": True}]}]},
    "run_end": {"type": "run_end", **HEADER, "step": 40, "status": "DiskFullStop", "duration_seconds": 100.0,
                "intervals": 5, "run_log": {"error": "No space left on device", "dropped_records": 3},
                "spans": {"drafter.fwd_bwd": {k: v for k, v in ENTRY.items() if k != "open_cpu_seconds"}},
                "counters": {"tokens": {"total": 8192, "per_second": 81.92}},
                "exporters": {"console": {"exported": 5, "dropped": 0, "failed": 0}}},
}
EVENTS = {
    "throughput": {"window": "steady state", "steady_tokens_per_s": 100.0, "steady_steps_per_s": 0.05,
                   "steady_tokens": 6000, "steady_steps": 3, "steady_seconds": 60.0, "window_seconds": 65.0,
                   "phases_seconds": {"ckpt.save": 5.0, "drafter.compile": 0.0}, "warmup_steps": 2, "first_step": 0,
                   "last_step": 5},
    "capture": {"steps": [10, 11], "steps_recorded": 2, "steps_asked": 2, "source": "control",
                "options": {"memory": False, "shapes": False, "stacks": False}, "files": ["R/kineto/a.json.gz"],
                "bytes": 2_000_000, "bytes_per_step": 1_000_000.0, "activities": ["cpu", "cuda"],
                "begin_seconds": 0.1, "stop_seconds": 0.3, "ended": "stopped at step 12", "spans_unfinished": 0,
                "captured_spans": [{"name": "drafter.fwd_bwd", "thread": "drafter.main", "tid": 41, "depth": 0,
                                    "step": 10, "start_unix_ns": 1, "end_unix_ns": 2, "cpu_seconds": 0.5,
                                    "gpu_seconds": 0.4, "bytes": None}]},
    "startup": {"origin": "launch", "origin_unix_ns": 5, "total_seconds": 9.0,
                "phases_seconds": {"spawn": 1.0, "imports": 8.0}, "bytecode": "beside sources",
                "intra_op_threads": 4, "omp_wait_policy": None},
    "nonfinite": {"span": "drafter.recv", "tensor": "payload.transfer", "tensors": ["payload.transfer"], "count": 1,
                  "policy": "stop", "action": "skipped_step", "src": 1, "batch": 7},
    "checkpoint": {"path": "R/checkpoints/step_0000040", "seconds": 1.5},
    "eval": {"prompts": 2, "measured_tau": 3.1, "simulated_tau": 3.0, "simulated_tau_independent": 2.9,
             "lossless": True, "mismatches": 0, "generated_tokens": 24},
    "stop": {"reason": "SIGTERM", "dropped_batches": 1},
    "bad_records": {"path": "data.jsonl", "count": 2, "examples": ["line 3: no messages"]},
    "memory_snapshot": {"file": "R/forensics/m.pickle", "bytes": 100, "history": True, "reserved_bytes": 12e9,
                        "allocated_bytes": 10e9, "segments": 4, "open_spans": OPEN_SPANS},
    "hang": {**FORENSICS, "stalled_seconds": 301.0, "timeout_seconds": 300.0},
    "thread_crash": {**FORENSICS, "thread": "target.sender", "error": "RuntimeError: x", "traceback": "Trace...",
                     "last_finished_span": {"name": "transfer.send", "ended_seconds_ago": 0.2}},
    "oom": {**FORENSICS, "thread": "drafter.main", "error": "OutOfMemoryError: x", "traceback": "Trace...",
            "last_finished_span": None, "allocator": ALLOCATOR, "headroom_history": [], "memory_history_file": None,
            "span": "drafter.fwd_bwd", "kernel": None},
    "signal": {**FORENSICS, "signal": "SIGTERM", "forced": True, "reason": "blocked in a collective"},
    "peer_lost": {**FORENSICS, "reason": "Connection closed by peer"},
}
for _kind, _fields in EVENTS.items():
    RECORDS[f"event {_kind}"] = {"type": "event", **HEADER, "kind": _kind, "step": 40, **_fields}

KIND_CLASSES = {"run_start": views.RunStart, "interval": views.Interval, "tick": views.Tick,
                "spans": views.DetailWindow, "snapshot": views.Snapshot, "run_end": views.RunEnd,
                "event throughput": views.Throughput, "event capture": views.Capture, "event startup": views.Startup,
                "event nonfinite": views.Nonfinite, "event checkpoint": views.Checkpoint, "event eval": views.Eval,
                "event stop": views.Stop, "event bad_records": views.BadRecords,
                "event memory_snapshot": views.MemorySnapshot, "event hang": views.Hang,
                "event thread_crash": views.ThreadCrash, "event oom": views.Oom, "event signal": views.Signal,
                "event peer_lost": views.PeerLost}

_TYPES = {"num": (int, float, type(None)), "int": (int, type(None)), "str": (str, type(None)), "flag": (bool,),
          "list": (list, type(None)), "map": (dict,)}


def read_all(v, path: str = "") -> list:
    """Read every field of view `v` and of every view nested in it; the keys it holds that no field reads."""
    fields = type(v).fields()
    unknown = [f"{path}.{k}" for k in v.raw if k not in fields]
    for key, f in fields.items():
        got = getattr(v, key)
        where = f"{path}.{key}"
        if f.kind in _TYPES:
            assert isinstance(got, _TYPES[f.kind]), (where, got)
            assert f.kind == "flag" or not isinstance(got, bool), (where, got)
        elif f.kind in ("part", "optional") and got is not None:
            unknown += read_all(got, where)
        elif f.kind == "views":
            unknown += [u for i, item in enumerate(got) for u in read_all(item, f"{where}[{i}]")]
        elif f.kind == "entries":
            unknown += [u for name, item in got.items() for u in read_all(item, f"{where}[{name!r}]")]
    return unknown


def _view_classes():
    out, todo = set(), [views.View]
    while todo:
        cls = todo.pop()
        out.add(cls)
        todo += cls.__subclasses__()
    return out


# ---- every kind as docs/RUNLOG.md shows it ---------------------------------------------------------------------

def test_every_field_of_every_view_is_named_as_the_log_names_it_and_says_what_it_is():
    for cls in _view_classes():
        for name, f in vars(cls).items():
            if isinstance(f, views.Field):
                assert name == f.key, (cls, name)
                assert f.__doc__ and f.__doc__ != views.Field.__doc__, (cls, name)


@pytest.mark.parametrize("name", sorted(RECORDS))
def test_every_kind_parses_to_its_view_and_every_documented_field_is_read(name):
    rec = RECORDS[name]
    v = views.parse(rec)
    assert type(v) is KIND_CLASSES[name]
    assert read_all(v) == []        # every field the record holds, nested pieces' too, has a property
    assert v.raw is rec and v.time_unix == HEADER["time_unix"] and v.rank == 0 and v.role == "drafter"
    assert views.view(v) is v and type(v).of(v) is v and views.view(rec) == v


def test_an_interval_reads_its_fields_typed_and_its_quantities_as_profiler_windows_does():
    rec = RECORDS["interval"]
    iv = views.interval(rec)
    assert (iv.index, iv.step, iv.warmup, iv.final, iv.duration_seconds) == (3, 40, True, False, 20.0)
    assert iv.step_rate.per_second == 0.5 and iv.profiler_share == 0.005 and iv.source is None
    e = iv.spans["drafter.fwd_bwd"]
    assert list(iv.spans) == ["drafter.fwd_bwd"] and "drafter.fwd_bwd" in iv.spans and len(iv.spans) == 1
    assert e.count == 2 and e.cpu.buckets == BUCKETS and e.gpu.p95_seconds == 0.5 and e.gpu_lag.launch_bound == 1
    stats, on = e.basis()
    assert on == "gpu" and stats.total_seconds == 0.9 and e.floor == "device_copy"
    entry = rec["spans"]["drafter.fwd_bwd"]
    assert e.basis_seconds == windows.basis_seconds(entry) and e.whole_seconds == windows.whole_seconds(entry)
    assert e.self_seconds("cpu") == 1.0 and e.clock_seconds("gpu") == windows.clock_seconds(entry, "gpu")
    assert e.gpu_bound() == windows.gpu_bound([entry]) and e.gpu_scale == 1.0
    assert iv.counters["tokens"].run_total == 8192 and iv.gauges["queue_depth"].max == 2
    assert iv.metrics["loss"].last is None and iv.metrics["loss"].reasons == {"last": "non-finite: nan"}
    assert iv.counters.get("samples") is None and iv.counters.entry("samples").total is None
    (gpu,) = iv.measured_gpus
    assert gpu.headroom_bytes == 40e9 and gpu.throttle_reasons == ["sw_power_cap"] and gpu.dram_active_percent_mean \
        is None and gpu.reasons == {"dram_active_percent_mean": "no GPM"}
    assert iv.memory.allocator.available and iv.memory.allocator.peak_reserved_bytes == 13e9
    assert iv.open_at_end == {"drafter.fwd_bwd": [("drafter.main", 3.5)]}
    assert iv.open_spans[0].spans[0].open_seconds == 3.5 and iv.threads[0].native_id == 41
    assert iv.stack_samples.threads[0].top_frames[0].count == 4 and iv.exporters["prometheus"].exported == 10
    assert not iv.is_steady(()) and iv.phase_share(["drafter.fwd_bwd"]) == windows.phase_share(rec, ["drafter.fwd_bwd"])


def test_each_event_kind_reads_its_own_fields():
    ev = {k: views.parse(RECORDS[f"event {k}"]) for k in EVENTS}
    assert ev["throughput"].steady_tokens_per_s == 100.0 and ev["throughput"].phases_seconds["ckpt.save"] == 5.0
    assert ev["capture"].captured_spans[0].gpu_seconds == 0.4 and ev["capture"].files == ["R/kineto/a.json.gz"]
    assert ev["capture"].error is None and ev["capture"].steps == [10, 11]
    assert ev["startup"].phases_seconds == {"spawn": 1.0, "imports": 8.0} and ev["startup"].omp_wait_policy is None
    assert ev["nonfinite"].src == 1 and ev["nonfinite"].tensors == ["payload.transfer"]
    assert ev["hang"].stalled_seconds == 301.0 and ev["hang"].threads[0].stack == ["a.py:1 in f: x()"]
    (entry,) = ev["hang"].transfer_ring
    assert (entry.kind, entry.src, entry.batch, entry.dst) == ("received", 1, 7, None)
    assert ev["thread_crash"].last_finished_span.ended_seconds_ago == 0.2
    assert ev["oom"].last_finished_span is None and ev["oom"].allocator.num_ooms == 0 and ev["oom"].kernel is None
    assert ev["signal"].forced and ev["peer_lost"].reason == "Connection closed by peer"
    assert ev["memory_snapshot"].open_spans[0].thread == "drafter.main" and ev["memory_snapshot"].history
    assert ev["checkpoint"].seconds == 1.5 and ev["eval"].lossless and ev["stop"].dropped_batches == 1
    assert views.parse(RECORDS["event stop"]).body() == {"kind": "stop", "step": 40, "reason": "SIGTERM",
                                                         "dropped_batches": 1}


def test_the_other_kinds_read_their_fields():
    start, tick, spans, snap, end = (views.parse(RECORDS[k]) for k in ("run_start", "tick", "spans", "snapshot",
                                                                       "run_end"))
    assert start.clock.perf_counter_ns == 5 and start.floors["host_copy"] == 1e10 and start.marks_warmup
    assert start.phase_spans == ["drafter.compile", "ckpt.save"] and start.config == {"tokens_per_batch": 2048}
    assert tick.counters == {"tokens": 6144} and tick.spans["drafter.fwd_bwd"].gpu_self_seconds == 1.9
    assert tick.metrics["loss"].nonfinite == 1 and tick.final
    (raw,) = spans.spans
    assert raw.parent is None and raw.attrs == {"flow": "1:7", "detail": True} and spans.steps == [31, 33]
    assert snap.threads[0].open_spans[0].limit_seconds == 7.0 and snap.threads[0].frames[0] == "f (a.py:1)"
    assert end.run_log.dropped_records == 3 and end.spans["drafter.fwd_bwd"].open_cpu_seconds is None
    assert views.run_end({"type": "run_end"}).run_log is None


def test_a_kind_or_field_this_reader_does_not_know_is_read_and_left_alone():
    rec = {"type": "interval", **HEADER, "index": 0, "duration_seconds": 1.0, "new_field": {"x": 1}}
    assert views.parse(rec).duration_seconds == 1.0
    assert read_all(views.parse(rec)) == [".new_field"]
    other = views.parse({"type": "gauge_dump", **HEADER, "x": 1})
    assert type(other) is views.Record and other.rank == 0
    assert type(views.parse({"type": "event", **HEADER, "kind": "eval_started"})) is views.Event
    assert type(views.view({"type": ["interval"]})) is views.Record      # an unhashable type is still no crash


def test_a_field_of_another_type_reads_as_absent_and_a_view_wraps_a_dict_a_view_or_nothing():
    iv = views.interval({"step": True, "index": "3", "warmup": 1, "spans": [], "memory": "full",
                         "threads": "main", "open_spans": [3]})
    assert (iv.step, iv.index, iv.warmup, len(iv.spans), iv.threads) == (None, None, False, 0, [])
    assert iv.memory.available is False and iv.memory.gpus == [] and iv.open_spans[0].thread is None
    assert views.Interval.of(None).duration_seconds is None and views.Interval.of(None).raw == {}
    ev = views.event({"kind": "capture"})
    assert views.Throughput.of(ev).steady_seconds is None and views.Capture.of(ev) is ev
    assert type(views.event(views.Event({"kind": "capture"}))) is views.Capture   # a plain Event finds its kind


# ---- the check: one reason per bad record -----------------------------------------------------------------------

def _with(name: str, **changes) -> dict:
    rec = json.loads(json.dumps(RECORDS[name]))
    for key, value in changes.items():
        if value is ...:
            rec.pop(key)
        else:
            rec[key] = value
    return rec


def _entry(**changes) -> dict:
    return {"drafter.fwd_bwd": dict(ENTRY, **changes)}


BAD = [
    # the shapes every record but spans and tick has (as report.runs.shape_problem had them)
    (_with("interval", step="40"), "step is str"),
    (_with("interval", index=True), "index is bool"),
    (_with("run_end", duration_seconds="100"), "duration_seconds is str"),
    (_with("interval", spans=[]), "spans is list"),
    (_with("run_end", counters=None), "counters is NoneType"),
    (_with("interval", gauges=[]), "gauges is list"),
    (_with("interval", metrics=1), "metrics is int"),
    (_with("event throughput", kind=3), "kind is int"),
    (_with("interval", spans={"x": []}), "span 'x' is not an entry with an integer count"),
    (_with("run_end", spans=_entry(count=2.0)), "span 'drafter.fwd_bwd' is not an entry with an integer count"),
    (_with("interval", spans=_entry(cpu=dict(CPU, total_seconds="1"))),
     "span 'drafter.fwd_bwd': its cpu block holds a non-number"),
    (_with("interval", spans=_entry(gpu=[0.5])), "span 'drafter.fwd_bwd': its gpu block holds a non-number"),
    (_with("interval", counters={"tokens": {"total": "2048"}}), "counter 'tokens' has no numeric total"),
    (_with("snapshot", step=1.5), "step is float"),
    # a detail window and a tick
    (_with("spans", spans={}), "spans is not a list"),
    (_with("tick", index=None), "tick: index is NoneType"),
    (_with("tick", t_s="15"), "tick: t_s is str"),
    (_with("tick", spans={"x": {"count": "1"}}), "tick: span 'x' holds a non-number"),
    (_with("tick", counters={"tokens": None}), "tick: a counter is not a number"),
    (_with("tick", metrics=[]), "tick: metrics is list"),
    (_with("tick", metrics={"loss": {"sum": None}}), "tick: metric 'loss' holds a non-number"),
    # required where a reader would crash or mislead: an interval a plot cannot place or a rate cannot divide by
    (_with("interval", time_unix=...), "interval: time_unix is missing"),
    (_with("interval", time_unix="now"), "interval: time_unix is str"),
    (_with("interval", duration_seconds=...), "interval: duration_seconds is missing"),
    (_with("tick", time_unix=...), "tick: time_unix is missing"),
    # a throughput event every surface sums and divides
    (_with("event throughput", steady_tokens_per_s="100"), "throughput: steady_tokens_per_s is str"),
    (_with("event throughput", steady_steps=[3]), "throughput: steady_steps is list"),
    (_with("event throughput", steady_seconds=...), "throughput: steady_tokens_per_s without steady_seconds"),
    (_with("event throughput", phases_seconds={"ckpt.save": "5"}), "throughput: phases_seconds is not {phase: "
                                                                     "seconds}"),
    # a run_start whose phase names or histogram bounds cannot be read as such
    (_with("run_start", phase_spans="ckpt.save"), "run_start: phase_spans is not a list of span names"),
    (_with("run_start", histogram_buckets_seconds=[0.1, "1"]),
     "run_start: histogram_buckets_seconds is not a list of numbers"),
]


@pytest.mark.parametrize("rec, why", BAD, ids=[why for _, why in BAD])
def test_a_missing_or_wrong_typed_field_is_one_bad_record_with_its_reason(rec, why):
    assert views.problem(rec) == why
    with pytest.raises(views.BadRecord, match=f"^{re.escape(why)}$"):
        views.parse(rec)


def test_what_the_rules_leave_alone_parses():
    ok = [_with("interval", step=None), _with("event throughput", steady_tokens_per_s=None, steady_seconds=None),
          _with("event throughput", phases_seconds=...), _with("run_start", phase_spans=...),
          _with("interval", spans=_entry(gpu=None)), {"type": "event", "kind": "stop"}, {"type": "run_end"},
          {"type": "spans"}, _with("interval", spans=_entry(count=True))]   # bools count as ints, as they did
    assert [views.problem(r) for r in ok] == [None] * len(ok)
    with pytest.raises(views.BadRecord, match="^not a JSON object$"):
        views.parse([1])


# ---- a real run --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def real_run(tmp_path_factory, prebuilt) -> Path:
    run_dir = prebuilt(tmp_path_factory.mktemp("views") / "run")
    proc = subprocess.run([sys.executable, "-m", "dflash.cli", "--run-dir", str(run_dir), "--builtin-conversations",
                           "48", "--max-steps", "12", "--profile-interval", "1", "--eval-prompts", "0",
                           "--device", "cpu"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


@pytest.mark.slow
def test_a_view_over_every_record_of_a_real_run_reads_every_field(real_run):
    kinds, unknown = set(), []
    for rank, path in rank_logs(real_run).items():
        recs, bad = read_records(path)
        assert bad == 0
        for rec in recs:
            v = views.parse(rec)
            kinds.add(type(v).__name__)
            unknown += [f"rank {rank} {rec['type']}{u}" for u in read_all(v)]
        ticks = [rec for rec in recs if rec["type"] == "tick"]
        for w in windows.tick_windows(ticks):   # a tick window reads as an interval
            unknown += read_all(views.interval(w), f"rank {rank} tick window")
    assert kinds >= {"RunStart", "Interval", "Tick", "DetailWindow", "Throughput", "Startup", "RunEnd"}
    assert unknown == []
