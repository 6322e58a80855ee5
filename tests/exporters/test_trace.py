"""The Perfetto/Chrome trace exporter and merge, on a 2-rank run log written as docs/RUNLOG.md says:
target rank 1 (target.main + a sender thread) feeds drafter rank 0; flows "1:0" and "1:1"."""
from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

from exporters.trace import TraceExporter
from profiler.schema.trace_events import GPU_START_UNKNOWN, backward_flows, trace_pid
from dflash import report_cli
from profiler.report.trace import merge_traces

T0 = 1_700_000_000_000_000_000       # Unix ns of the run's clock anchor
MS = 1_000_000
HOST = "node-a"
ROLES = {0: "drafter", 1: "target"}
REPO = Path(__file__).resolve().parents[2]


def _header(rtype: str, rank: int, t_ms: float = 0) -> dict:
    return {"type": rtype, "time_unix": (T0 + t_ms * MS) / 1e9, "rank": rank, "role": ROLES[rank]}


def run_start(rank: int) -> dict:
    return {**_header("run_start", rank), "schema": 1, "run_id": "run-1",
            "clock": {"perf_counter_ns": 5_000_000, "unix_ns": T0},
            "histogram_buckets_seconds": [0.001, 0.01, 0.1, 1.0], "detail_steps": 1, "world_size": 2,
            "pid": 4000 + rank, "hostname": HOST, "python_version": "3.11.7", "torch_version": "2.4.0",
            "device": "cpu", "device_name": "cpu", "version": "0.1.0",
            "floors": {"host_copy": 5e9}, "interval_s": 60, "config": {"max_steps": 2}}


def span(sid, parent, name, thread, tid, depth, t0_ms, t1_ms, gpu=None, nbytes=None, attrs=None,
         gpu_start_ms=None) -> dict:
    entry = {"id": sid, "parent": parent, "name": name, "thread": thread, "tid": tid, "depth": depth,
             "start_unix_ns": T0 + int(t0_ms * MS), "end_unix_ns": T0 + int(t1_ms * MS),
             "cpu_seconds": (t1_ms - t0_ms) / 1e3, "gpu_seconds": gpu, "bytes": nbytes}
    if attrs:
        entry["attrs"] = attrs
    if gpu_start_ms is not None:
        entry["gpu_start_unix_ns"] = T0 + int(gpu_start_ms * MS)
    return entry


def target_step(k: int) -> list:
    """target.main: fetch, fwd (GPU longer than CPU: its GPU slice overlaps the send's), pack, wait,
    send (tagged with the flow, a d2h_copy inside); the sender thread copies alongside."""
    b, i = k * 100, k * 10
    return sorted([
        span(i + 1, None, "target.fetch", "target.main", 4101, 0, b, b + 5),
        span(i + 2, None, "target.fwd", "target.main", 4101, 0, b + 5, b + 30, gpu=0.040),
        span(i + 3, None, "target.pack_hidden", "target.main", 4101, 0, b + 30, b + 35, gpu=0.004),
        span(i + 4, None, "transfer.wait_slot", "target.main", 4101, 0, b + 35, b + 40),
        span(i + 5, None, "transfer.send", "target.main", 4101, 0, b + 40, b + 50, gpu=0.008,
             nbytes=8 << 20, attrs={"flow": f"1:{k}"}),
        span(i + 6, i + 5, "d2h_copy", "target.main", 4101, 1, b + 41, b + 45, gpu=0.003, nbytes=8 << 20),
        span(i + 7, None, "h2d_copy", "transfer.sender", 4102, 0, b + 42, b + 48, nbytes=4 << 20),
    ], key=lambda s: s["start_unix_ns"])


def drafter_step(k: int) -> list:
    """drafter.main: recv (tagged, an h2d_copy inside with a known GPU start), fwd_bwd, optim."""
    b, i = k * 100 + 40, k * 10
    return [
        span(i + 1, None, "drafter.recv", "drafter.main", 5001, 0, b, b + 15, attrs={"flow": f"1:{k}"}),
        span(i + 2, i + 1, "h2d_copy", "drafter.main", 5001, 1, b + 10, b + 14, gpu=0.002, nbytes=8 << 20,
             gpu_start_ms=b + 11),
        span(i + 3, None, "drafter.fwd_bwd", "drafter.main", 5001, 0, b + 15, b + 40, gpu=0.030),
        span(i + 4, None, "drafter.optim", "drafter.main", 5001, 0, b + 40, b + 45, gpu=0.004),
    ]


def rank_records(rank: int) -> list:
    step = target_step if rank == 1 else drafter_step
    threads = ([{"name": "target.main", "native_id": 4101}, {"name": "transfer.sender", "native_id": 4102}]
               if rank == 1 else [{"name": "drafter.main", "native_id": 5001}])
    out = [run_start(rank)]
    for k in (0, 1):
        out.append({**_header("spans", rank, 100 * k + 95), "index": k, "steps": [k, k], "spans": step(k),
                    "dropped": 0})
        out.append({**_header("interval", rank, 100 * k + 95), "index": k, "step": k + 1,
                    "start_s": 5.0 + k * 0.1, "end_s": 5.1 + k * 0.1, "duration_seconds": 0.1,
                    "spans": {}, "counters": {}, "gauges": {}, "metrics": {},
                    "memory": {"available": False, "reason": "no GPU"}, "threads": threads, "exporters": {},
                    "final": k == 1})
    out.append({**_header("event", rank, 199), "kind": "checkpoint", "step": 2, "path": "ckpt", "seconds": 0.1})
    out.append({**_header("run_end", rank, 200), "step": 2, "status": "ok", "duration_seconds": 0.2,
                "intervals": 2, "spans": {}, "counters": {}})
    return out


def write_run(tmp_path: Path) -> Path:
    """RUN_DIR/profile/rank{0,1}.jsonl; rank 0's log ends in a truncated line, as after a crash."""
    profile = tmp_path / "profile"
    profile.mkdir(parents=True)
    for rank in (0, 1):
        text = "".join(json.dumps(r) + "\n" for r in rank_records(rank))
        if rank == 0:
            text += json.dumps(rank_records(0)[1])[:80]
        (profile / f"rank{rank}.jsonl").write_text(text)
    return tmp_path


def span_names(rank: int) -> set:
    return {s["name"] for r in rank_records(rank) if r["type"] == "spans" for s in r["spans"]}


def load(path: Path) -> dict:
    doc = json.loads(path.read_text())
    assert set(doc) == {"traceEvents", "displayTimeUnit", "metadata"}
    assert doc["displayTimeUnit"] == "ms"
    return doc


def check_tracks(events: list) -> None:
    """Per (pid, tid): timed events in ts order, and X slices disjoint or nested."""
    tracks = {}
    for ev in events:
        if ev["ph"] != "M":
            tracks.setdefault((ev["pid"], ev["tid"]), []).append(ev)
    for key, evs in tracks.items():
        ts = [e["ts"] for e in evs]
        assert ts == sorted(ts), key
        open_ends = []
        for e in (e for e in evs if e["ph"] == "X"):
            assert isinstance(e["ts"], int) and isinstance(e["dur"], int) and e["dur"] >= 0
            while open_ends and open_ends[-1] <= e["ts"]:
                open_ends.pop()
            assert not open_ends or e["ts"] + e["dur"] <= open_ends[-1], (key, e)
            open_ends.append(e["ts"] + e["dur"])


def names_of(events: list, kind: str) -> dict:
    """{(pid, tid): name} of thread_name metadata, or {pid: name} of process_name metadata."""
    return {(e["pid"], e["tid"]) if "tid" in e else e["pid"]: e["args"]["name"]
            for e in events if e["ph"] == "M" and e["name"] == kind}


def slices(events: list, rank: int, name: str, gpu: bool = False) -> list:
    return [e for e in events if e["ph"] == "X" and e["pid"] == trace_pid(rank) and e["name"] == name
            and ("gpu" in e["cat"].split(",")) == gpu]


def test_exporter_writes_each_spans_record_and_every_span(tmp_path):
    exp = TraceExporter(tmp_path, 1)
    out = tmp_path / "trace" / "rank1.json"
    records = rank_records(1)
    for rec in records[:2]:                                # run_start, first spans record
        exp.export(rec)
    assert {e["name"] for e in load(out)["traceEvents"] if e["ph"] == "X"} == {
        s["name"] for s in records[1]["spans"]}
    for rec in records[2:]:
        exp.export(rec)
    exp.close(5.0)
    doc = load(out)
    events = doc["traceEvents"]
    assert {e["name"] for e in events if e["ph"] == "X"} == span_names(1)
    check_tracks(events)
    assert names_of(events, "process_name") == {trace_pid(1): f"rank 1 (target) {HOST}"}
    threads = set(names_of(events, "thread_name").values())
    assert {"target.main", "target.main (GPU)", "transfer.sender"} <= threads
    assert doc["metadata"]["status"] == "ok" and doc["metadata"]["spans"] == 14
    assert exp.stats() == {"exported": 2, "dropped": 0, "failed": False}
    assert [p.name for p in out.parent.iterdir()] == ["rank1.json"]          # no temporary left behind


def test_slices_carry_times_bandwidth_and_gpu_tracks(tmp_path):
    exp = TraceExporter(tmp_path, 1)
    for rec in rank_records(1):
        exp.export(rec)
    exp.close(5.0)
    events = load(tmp_path / "trace" / "rank1.json")["traceEvents"]
    send = slices(events, 1, "transfer.send")[0]
    assert send["ts"] == (T0 + 40 * MS) // 1000 and send["dur"] == 10_000 and send["tid"] == 4101
    a = send["args"]
    assert a["attrs"] == {"flow": "1:0"} and a["steps"] == [0, 0] and a["bytes"] == 8 << 20
    assert a["achieved_on"] == "gpu" and abs(a["achieved_gb_per_s"] - (8 << 20) / 0.008 / 1e9) < 1e-3
    gpu = {e["name"]: e for e in events if e["ph"] == "X" and "gpu" in e["cat"] and e["args"]["id"] < 10}
    assert set(gpu) == {"target.fwd", "target.pack_hidden", "transfer.send", "d2h_copy"}
    fwd = gpu["target.fwd"]
    assert fwd["ts"] == (T0 + 5 * MS) // 1000 and fwd["dur"] == 40_000
    assert fwd["args"]["gpu_start"] == GPU_START_UNKNOWN
    # target.fwd's GPU slice [5, 45) ms overlaps transfer.send's [40, 48) ms: they cannot share a track.
    assert fwd["tid"] != gpu["transfer.send"]["tid"]
    thread_names = names_of(events, "thread_name")
    assert all(thread_names[(trace_pid(1), g["tid"])].startswith("target.main (GPU)") for g in gpu.values())


def test_merge_draws_every_rank_and_matches_flows(tmp_path):
    run = write_run(tmp_path)
    summary = merge_traces(run)
    assert summary["ranks"] == [0, 1] and summary["bad_lines"] == 1
    assert (summary["flows_matched"], summary["flows_unmatched"]) == (2, 0)
    doc = load(run / "trace" / "merged.json")
    events = doc["traceEvents"]
    assert summary["events"] == sum(e["ph"] != "M" for e in events)
    check_tracks(events)
    assert names_of(events, "process_name") == {trace_pid(0): f"rank 0 (drafter) {HOST}",
                                                trace_pid(1): f"rank 1 (target) {HOST}"}
    assert 0 not in {e["pid"] for e in events}                     # pid 0 is Perfetto's idle process
    for rank in (0, 1):
        assert {e["name"] for e in events if e["ph"] == "X" and e["pid"] == trace_pid(rank)} == span_names(rank)
    h2d = slices(events, 0, "h2d_copy", gpu=True)[0]
    assert h2d["ts"] == (T0 + 51 * MS) // 1000 and "gpu_start" not in h2d["args"]
    starts = [e for e in events if e["ph"] == "s"]
    ends = [e for e in events if e["ph"] == "f"]
    assert len(starts) == 2 and sorted(e["id"] for e in starts) == sorted(e["id"] for e in ends)
    for s in starts:
        (f,) = [e for e in ends if e["id"] == s["id"]]
        assert s["cat"] == f["cat"] == "transfer" and f["bp"] == "e" and s["args"] == f["args"]
        assert _bound_to(events, s)["name"] == "transfer.send" and _bound_to(events, f)["name"] == "drafter.recv"
        assert _bound_to(events, s)["args"]["attrs"]["flow"] == s["args"]["flow"]


def test_each_rank_file_carries_its_flow_halves_under_the_ids_of_the_merged_pairs(tmp_path):
    run = write_run(tmp_path)
    summary = merge_traces(run)
    assert (summary["flow_sends"], summary["flow_receives"]) == (2, 2)
    merged = load(run / "trace" / "merged.json")["traceEvents"]
    pairs = {(e["ph"], e["args"]["flow"]): e["id"] for e in merged if e["ph"] in "sf"}
    halves = {}
    for rank, ph, name in ((1, "s", "transfer.send"), (0, "f", "drafter.recv")):
        exp = TraceExporter(tmp_path / f"live{rank}", rank)
        for rec in rank_records(rank):
            exp.export(rec)
        exp.close(5.0)
        doc = load(tmp_path / f"live{rank}" / "trace" / f"rank{rank}.json")
        events = doc["traceEvents"]
        points = [e for e in events if e["ph"] in "sf"]
        assert {e["ph"] for e in points} == {ph} and len(points) == 2
        for p in points:
            assert _bound_to(events, p)["name"] == name and p["args"]["flow"] in ("1:0", "1:1")
            halves[(ph, p["args"]["flow"])] = p["id"]
        meta = doc["metadata"]
        assert (meta["flows_matched"], meta["flows_unmatched"]) == (0, 2)
        assert (meta["flow_sends"], meta["flow_receives"]) == ((2, 0) if rank == 1 else (0, 2))
    assert halves == pairs and len(set(pairs.values())) == 2


def _bound_to(events: list, point: dict) -> dict:
    """The slice a v1 flow event binds to in Perfetto: the innermost slice open on its track at its time (the
    last begun, in ts order, which the file follows, of those that enclose the point)."""
    i = events.index(point)
    open_ = [e for e in events[:i] if e["ph"] == "X" and (e["pid"], e["tid"]) == (point["pid"], point["tid"])
             and e["ts"] <= point["ts"] < e["ts"] + max(1, e["dur"])]
    assert open_, point
    return open_[-1]


def test_a_receive_already_waiting_draws_its_flow_forward_to_when_the_batch_arrived(tmp_path):
    """The drafter waits in drafter.recv from 20 ms, before the target's send at 40 ms: the flow ends where the
    receive ends (the batch in hand), never at the receive's start, before the send (issue 45)."""
    run = write_run(tmp_path)
    path = run / "profile" / "rank0.jsonl"
    recs = [json.loads(line) for line in path.read_text().splitlines()[:-1]]
    recv = recs[1]["spans"][0]
    assert recv["name"] == "drafter.recv"
    recv["start_unix_ns"] = T0 + 20 * MS
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    merge_traces(run)
    events = load(run / "trace" / "merged.json")["traceEvents"]
    (s,) = [e for e in events if e["ph"] == "s" and e["args"]["flow"] == "1:0"]
    (f,) = [e for e in events if e["ph"] == "f" and e["args"]["flow"] == "1:0"]
    assert f["ts"] >= s["ts"]
    assert f["ts"] == (T0 + 55 * MS) // 1000 - 1     # the receive's last microsecond
    assert _bound_to(events, f)["name"] == "drafter.recv"
    assert backward_flows(events) == []


def test_merge_counts_a_flow_whose_other_rank_is_missing(tmp_path):
    run = write_run(tmp_path)
    (run / "profile" / "rank0.jsonl").unlink()
    summary = merge_traces(run, tmp_path / "one.json")
    assert (summary["flows_matched"], summary["flows_unmatched"]) == (0, 2)
    assert not [e for e in load(tmp_path / "one.json")["traceEvents"] if e["ph"] in "sf"]


def test_tids_stay_unique_when_ranks_share_an_os_thread_id(tmp_path):
    """Ranks on two hosts may report the same OS thread id: each track keeps a tid of its own."""
    profile = tmp_path / "profile"
    profile.mkdir()
    for rank in (0, 1):
        recs = [run_start(rank), {**_header("spans", rank), "index": 0, "steps": [0, 0], "dropped": 0,
                                  "spans": [{**s, "tid": 777} for s in drafter_step(0)]}]
        (profile / f"rank{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    merge_traces(tmp_path)
    events = load(tmp_path / "trace" / "merged.json")["traceEvents"]
    check_tracks(events)
    owners = {}
    for e in events:
        if e["ph"] != "M" or "tid" in e:
            owners.setdefault(e["tid"], set()).add(e["pid"])
    assert all(len(pids) == 1 for pids in owners.values()) and len(owners) == 4
    assert "drafter.main (tid 777)" in names_of(events, "thread_name").values()


def test_event_bound_keeps_the_newest_records(tmp_path):
    exp = TraceExporter(tmp_path, 0, max_events=8, clock=lambda: 0.0)   # writes take no time: none waits
    # one drafter step is 4 spans, 7 slices
    exp.export(run_start(0))
    for k in range(3):
        exp.export({**_header("spans", 0), "index": k, "steps": [k, k], "spans": drafter_step(k), "dropped": 0})
    exp.close(5.0)
    events = load(tmp_path / "trace" / "rank0.json")["traceEvents"]
    assert sum(e["ph"] == "X" for e in events) == 7
    assert {e["args"]["steps"][0] for e in events if e["ph"] == "X" and "steps" in e["args"]} == {2}
    assert exp.stats() == {"exported": 3, "dropped": 2, "failed": False}


class SlowClock:
    """A clock that moves 0.6 s per reading: every trace write seems to take 0.6 s."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 0.6
        return self.now


def test_slow_rewrites_are_throttled_and_caught_up(tmp_path):
    clock = SlowClock()
    exp = TraceExporter(tmp_path, 0, clock=clock)
    out = tmp_path / "trace" / "rank0.json"
    exp.export(run_start(0))

    def spans_record(k):
        return {**_header("spans", 0), "index": k, "steps": [k, k], "spans": drafter_step(k), "dropped": 0}

    def steps_in_file():
        return {e["args"]["steps"][0] for e in load(out)["traceEvents"] if e["ph"] == "X" and "steps" in e["args"]}

    exp.export(spans_record(0))
    exp.export(spans_record(1))                       # 0.6 s after a 0.6 s write: waits (0.5% duty: 120 s)
    assert steps_in_file() == {0} and exp.stats()["exported"] == 1
    clock.now += 100.0
    exp.export(spans_record(2))                       # 100.6 s after: still waits
    assert steps_in_file() == {0} and exp.stats()["exported"] == 1
    clock.now += 20.0
    exp.export(spans_record(3))
    assert steps_in_file() == {0, 1, 2, 3} and exp.stats()["exported"] == 4
    exp.export(spans_record(4))
    exp.close(1.0)                                    # close always writes
    assert steps_in_file() == {0, 1, 2, 3, 4} and exp.stats() == {"exported": 5, "dropped": 0, "failed": False}


def test_an_unwritable_trace_dir_logs_once_and_counts_drops(tmp_path, caplog):
    (tmp_path / "trace").write_text("not a directory")
    exp = TraceExporter(tmp_path, 1)
    with caplog.at_level(logging.WARNING, logger="exporters"):
        for rec in rank_records(1):
            exp.export(rec)                                      # never raises
        exp.close(1.0)
    assert len([r for r in caplog.records if r.name == "exporters"]) == 1
    assert exp.stats() == {"exported": 0, "dropped": 2, "failed": True}


def test_cli_merges_and_refuses_what_is_not_a_run(tmp_path, capsys):
    run = write_run(tmp_path / "run")
    assert report_cli.main(["trace", str(run)]) == 0
    assert (run / "trace" / "merged.json").is_file() and "2 matched / 0 unmatched" in capsys.readouterr().out
    assert report_cli.main(["trace", str(run), "-o", str(tmp_path / "x.json")]) == 0
    load(tmp_path / "x.json")
    (tmp_path / "foreign").mkdir()
    (tmp_path / "empty" / "profile").mkdir(parents=True)
    (tmp_path / "empty" / "profile" / "rank0.jsonl").write_text("")
    for bad in ("missing", "foreign", "empty"):
        capsys.readouterr()
        assert report_cli.main(["trace", str(tmp_path / bad)]) == 2, bad
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("dflash-report: error:"), err


def test_cli_needs_no_torch(tmp_path):
    code = ("import sys, dflash.report_cli as c; r = c.main(sys.argv[1:]); assert 'torch' not in sys.modules; "
            "sys.exit(r)")
    proc = subprocess.run([sys.executable, "-c", code, "trace", str(tmp_path / "nope")], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "no such directory" in proc.stderr
