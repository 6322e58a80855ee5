"""Snapshot client and stack sampler: the merge per native thread id, the stuck rule, keeping a
snapshot, a run side by side, py-spy's failures classified (real py-spy), and the in-run sampler."""

import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from profiler.control import ControlServer
from profiler.schema.records import read_records
from profiler.runlog import RunLog
from profiler.clients.snapshot import (NO_LIVE_RANK, SnapshotError, format_process, format_run, keep_snapshot,
                               snapshot_process, snapshot_run)
from profiler.stacks import (NO_SUCH_PID, NOT_PERMITTED, NOT_PYTHON, PYSPY_MISSING, NullStackSampler, PySpy,
                             StackError, StackSampler, make_stack_sampler)

REPO = Path(__file__).resolve().parents[2]


def pyspy_thread(name, native_id, frames, active=False):
    """One thread as `py-spy dump --json` prints it (frames innermost first)."""
    return {"pid": 1, "thread_id": native_id * 7, "thread_name": name, "os_thread_id": native_id, "active": active,
            "owns_gil": False, "frames": [{"name": f, "filename": f"/src/{file}", "short_filename": file, "line": line,
                                           "module": None, "locals": None} for f, file, line in frames]}


CPU_ALLOCATOR = {"available": False, "reason": "allocator stats need a CUDA device"}


def interval(spans_p95: dict, index=3) -> dict:
    return {"type": "interval", "index": index, "step": 40, "duration_seconds": 2.0,
            "spans": {name: {"count": 9, "share": 0.25, "cpu": {"p95_seconds": p95}, "gpu": None}
                      for name, p95 in spans_p95.items()},
            "counters": {"tokens": {"per_second": 1500.0}},
            "memory": {"allocator": CPU_ALLOCATOR}}


def open_spans(native_id, thread, *spans):
    return {"thread": thread, "native_id": native_id,
            "spans": [{"name": n, "depth": i, "open_seconds": s} for i, (n, s) in enumerate(spans)]}


def state_with(run_dir, active, last, rank=1, role="target"):
    return {"pid": os.getpid(), "rank": rank, "role": role, "step": 41, "time_unix": time.time(),
            "run_dir": str(run_dir), "active_spans": active, "last_interval": last, "intervals_closed": 4,
            "memory": {"available": False, "reason": "no CUDA device", "allocator": CPU_ALLOCATOR}}


@pytest.fixture
def served(tmp_path):
    """A real endpoint in this process serving a settable state; yields (holder, discovery dir, records)."""
    holder, written = {}, []
    run_dir = tmp_path / "run"
    log = RunLog(run_dir / "profile" / "rank1.jsonl")
    record_fn = lambda fields: (written.append(fields), log.write({"type": "snapshot", **fields}))  # noqa: E731
    server = ControlServer(run_dir, rank=1, role="target", state_fn=lambda: holder["state"], record_fn=record_fn,
                           discovery_dir=tmp_path / "disc")
    server.start()
    holder["run_dir"] = server.run_dir
    yield holder, tmp_path / "disc", written
    server.close()
    log.close()


MAIN_FRAMES = [("FaultPlan.on_enter", "profiler/faults.py", 146), ("target_step", "dflash/roles.py", 111)]


def test_merge_by_native_id_and_the_stuck_rule(served):
    holder, disc, _ = served
    holder["state"] = state_with(holder["run_dir"], [
        open_spans(101, "target.main", ("target.step", 6.5), ("target.fwd", 6.0)),  # fwd: 6 s > max(10 x 0.1, 5)
        open_spans(102, "target.sender", ("transfer.send", 12.0)),                  # 12 s < 10 x 2.0
    ], interval({"target.step": 1.0, "target.fwd": 0.1, "transfer.send": 2.0}))
    stacks = [pyspy_thread("target.sender", 102, [("Sender._run", "dflash/transfer.py", 276)]),
              pyspy_thread("profiler.control", 103, [("socket.accept", "socket.py", 294)]),
              pyspy_thread("target.main", 101, MAIN_FRAMES, active=True)]
    calls = []
    snap = snapshot_process(os.getpid(), runner=lambda pid, native=False, nonblocking=False:
                            calls.append((pid, native, nonblocking)) or stacks, discovery_dir=disc)
    assert calls == [(os.getpid(), False, False)]
    assert [t["name"] for t in snap["threads"]] == ["target.main", "target.sender", "profiler.control"]
    main, sender, control = snap["threads"]
    assert (main["native_id"], main["role"], main["active"]) == (101, "target", True)
    assert main["frames"] == ["FaultPlan.on_enter (profiler/faults.py:146)", "target_step (dflash/roles.py:111)"]
    fwd = main["open_spans"][1]
    assert fwd == {"name": "target.fwd", "open_seconds": 6.0, "p95_seconds": 0.1, "limit_seconds": 5.0, "stuck": True}
    assert main["open_spans"][0]["stuck"] is False  # target.step: 6.5 s < 10 x 1.0
    assert (main["stuck"], main["stuck_span"], main["stuck_frame"]) == (True, "target.fwd", main["frames"][0])
    assert sender["open_spans"][0]["limit_seconds"] == 20.0 and sender["stuck"] is False
    assert control["open_spans"] == [] and control["stuck"] is False
    assert snap["stuck"] is True and (snap["rank"], snap["role"], snap["step"]) == (1, "target", 41)
    assert snap["last_interval"]["per_second"] == {"tokens": 1500.0}
    assert snap["memory"] == {"nvml": {"available": False, "reason": "no CUDA device"}, "allocator": CPU_ALLOCATOR}
    text = format_process(snap)
    assert "STUCK in target.fwd: open 6.0 s > 5.0 s (recent p95 0.100 s) at FaultPlan.on_enter" in text
    assert "open spans: target.step 6.50 s > target.fwd 6.00 s" in text
    assert "rank 1  role target  step 41" in text and "note:" not in text
    # the profiler's own thread, last and apart: one word, not its stack (issue 37)
    assert control["profiler"] is True and main["profiler"] is False
    assert "the profiler's own 1 thread, apart (--json for their stacks): profiler.control (waiting)" in text
    assert "socket.accept" not in text


def test_no_interval_yet_is_said_not_guessed_and_the_floor_holds(served):
    holder, disc, _ = served
    runner = lambda pid, native=False, nonblocking=False: [pyspy_thread("target.main", 101, MAIN_FRAMES)]  # noqa: E731
    holder["state"] = state_with(holder["run_dir"], [open_spans(101, "target.main", ("target.fwd", 600.0))], None)
    snap = snapshot_process(os.getpid(), runner=runner, discovery_dir=disc)
    span = snap["threads"][0]["open_spans"][0]
    assert span["stuck"] is False and span["stuck_basis"].startswith("no interval closed yet")
    assert snap["stuck_basis"] == "no interval closed yet: stuck detection needs a recent p95"
    assert "last interval: none closed yet" in format_process(snap)
    holder["state"] = state_with(holder["run_dir"], [open_spans(101, "target.main", ("target.fwd", 4.9))],
                                 interval({"target.fwd": 0.01}))
    span = snapshot_process(os.getpid(), runner=runner, discovery_dir=disc)["threads"][0]["open_spans"][0]
    assert (span["limit_seconds"], span["stuck"]) == (5.0, False)  # 4.9 s: under the 5 s floor


def test_recent_p95_comes_from_the_run_log_when_the_span_stopped_finishing(served):
    holder, disc, _ = served
    log = Path(holder["run_dir"]) / "profile" / "rank1.jsonl"
    with open(log, "a") as f:
        for rec in (interval({"target.fwd": 0.2}, index=0), interval({"target.fwd": 0.7}, index=1),
                    interval({}, index=2)):
            f.write(json.dumps(rec) + "\n")
    holder["state"] = state_with(holder["run_dir"], [open_spans(101, "target.main", ("target.fwd", 6.9),
                                                                ("never.done", 99.0))], interval({}, index=2))
    runner = lambda pid, native=False, nonblocking=False: [pyspy_thread("target.main", 101, MAIN_FRAMES)]  # noqa: E731
    fwd, never = snapshot_process(os.getpid(), runner=runner, discovery_dir=disc)["threads"][0]["open_spans"]
    assert (fwd["p95_seconds"], fwd["limit_seconds"], fwd["stuck"]) == (0.7, 7.0, False)  # the latest: #1
    assert never["stuck"] is False and "never.done has not finished in any closed interval" in never["stuck_basis"]


def test_keep_writes_the_file_and_the_process_records_it(served):
    holder, disc, written = served
    holder["state"] = state_with(holder["run_dir"], [open_spans(101, "target.main", ("target.fwd", 9.0))],
                                 interval({"target.fwd": 0.1}))
    runner = lambda pid, native=False, nonblocking=False: [pyspy_thread("target.main", 101, MAIN_FRAMES)]  # noqa: E731
    snap = snapshot_process(os.getpid(), native=True, runner=runner, discovery_dir=disc)
    kept = keep_snapshot(snap)
    assert kept["recorded"] is True and kept["reason"] is None
    path = Path(kept["file"])
    assert path.parent == Path(holder["run_dir"]) / "snapshots" and path.name.endswith(f"-rank1-pid{os.getpid()}.json")
    assert json.loads(path.read_text())["threads"][0]["stuck_span"] == "target.fwd"
    recs = [r for r in read_records(Path(holder["run_dir"]) / "profile" / "rank1.jsonl")[0] if r["type"] == "snapshot"]
    assert len(recs) == 1 and written[0]["file"] == str(path) and written[0]["native"] is True
    thread = recs[0]["threads"][0]
    assert {"name", "native_id", "open_spans", "stuck", "frames"} <= thread.keys()
    assert thread["frames"][0] == "FaultPlan.on_enter (profiler/faults.py:146)" and thread["stuck"] is True
    assert thread["open_spans"][0]["name"] == "target.fwd" and thread["open_spans"][0]["open_seconds"] == 9.0
    assert "recorded in the run log" in format_process(snap)


def test_an_unwritable_run_dir_still_gets_the_run_log_record(served):
    holder, disc, written = served
    holder["state"] = state_with(holder["run_dir"], [], interval({}))
    (Path(holder["run_dir"]) / "snapshots").write_text("a file where the directory should be")
    runner = lambda pid, native=False, nonblocking=False: [pyspy_thread("target.main", 101, MAIN_FRAMES)]  # noqa: E731
    snap = snapshot_process(os.getpid(), runner=runner, discovery_dir=disc)
    kept = keep_snapshot(snap)
    assert kept["file"] is None and kept["recorded"] is True and kept["reason"].startswith("no file: ")
    assert written[0]["file"] is None and written[0]["threads"][0]["name"] == "target.main"
    assert "kept: no file; recorded in the run log (no file: " in format_process(snap)


def test_a_process_without_an_endpoint_gets_stacks_and_a_note(tmp_path):
    runner = lambda pid, native=False, nonblocking=False: [pyspy_thread("MainThread", pid, MAIN_FRAMES)]  # noqa: E731
    snap = snapshot_process(os.getpid(), runner=runner, discovery_dir=tmp_path)
    assert snap["endpoint"] is None and "no control endpoint" in snap["note"] and snap["memory"] is None
    assert snap["threads"][0]["frames"][0].startswith("FaultPlan.on_enter") and snap["stuck"] is False
    assert keep_snapshot(snap) == {"file": None, "recorded": False, "reason": "no run directory (no endpoint)"}
    assert "note: no control endpoint" in format_process(snap)


def _sleepers(n):
    return [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(n)]


def test_run_dir_snapshots_every_live_rank_and_says_who_waits_for_whom(tmp_path):
    run_dir, disc = (tmp_path / "run").resolve(), tmp_path / "disc"
    disc.mkdir(mode=0o700)
    procs = _sleepers(2)  # live pids to stand for the two ranks; their endpoints are served from here
    states = {procs[0].pid: state_with(run_dir, [open_spans(11, "drafter.main", ("drafter.recv", 30.0))],
                                       interval({"drafter.recv": 0.2}), rank=0, role="drafter"),
              procs[1].pid: state_with(run_dir, [open_spans(21, "target.main", ("target.fwd", 31.0))],
                                       interval({"target.fwd": 0.1}), rank=1, role="target")}
    servers = []
    try:
        for pid, state in states.items():
            server = ControlServer(run_dir, state["rank"], state["role"], state_fn=lambda s=state: s,
                                   discovery_dir=tmp_path / f"own{pid}")
            server.start()
            servers.append(server)
            (disc / f"{pid}.json").write_text(json.dumps({"pid": pid, "rank": state["rank"], "role": state["role"],
                                                          "run_dir": str(run_dir), "socket_path": server.socket_path}))
        stacks = {procs[0].pid: [pyspy_thread("drafter.main", 11, [("Condition.wait", "threading.py", 331)])],
                  procs[1].pid: [pyspy_thread("target.main", 21, MAIN_FRAMES)]}
        run = snapshot_run(run_dir, {"drafter.recv": "target"},
                           runner=lambda pid, native=False, nonblocking=False: stacks[pid], discovery_dir=disc)
    finally:
        for p in procs:
            p.kill()
            p.wait()
        for server in servers:
            server.close()
    assert [(s["rank"], s["role"]) for s in run["ranks"]] == [(0, "drafter"), (1, "target")]
    assert all(s["stuck"] for s in run["ranks"])
    assert run["waits"] == [{"rank": 0, "role": "drafter", "thread": "drafter.main", "span": "drafter.recv",
                             "open_seconds": 30.0, "waits_for_role": "target",
                             "stuck_ranks": [{"rank": 1, "thread": "target.main", "span": "target.fwd",
                                              "frame": "FaultPlan.on_enter (profiler/faults.py:146)"}]}]
    text = format_run(run)
    assert ("rank 0 (drafter) waits in drafter.recv for 30.0 s on the target ranks: "
            "rank 1 is stuck in target.fwd") in text
    assert "waits (stuck) in drafter.recv 30.0 s" in text and "STUCK in target.fwd 31.0 s on target.main" in text
    with pytest.raises(SnapshotError, match="no live rank of") as err:
        snapshot_run(run_dir, discovery_dir=disc)  # both pids are dead now
    assert err.value.kind == NO_LIVE_RANK


def test_missing_pid_is_refused_before_py_spy_runs():
    dead = _sleepers(1)[0]
    dead.kill()
    dead.wait()
    with pytest.raises(SnapshotError, match=f"^no such pid {dead.pid}$") as err:
        snapshot_process(dead.pid, runner=lambda *a, **k: pytest.fail("py-spy must not run"))
    assert err.value.kind == NO_SUCH_PID


# ---- py-spy failures, classified from the real py-spy's own messages -------------------------------
def test_pyspy_failures_are_one_line_and_classified():
    with pytest.raises(StackError) as err:
        PySpy(executable="/nonexistent/py-spy")(os.getpid())
    assert err.value.kind == PYSPY_MISSING and "pip install py-spy" in str(err.value)
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        with pytest.raises(StackError) as err:
            PySpy()(sleeper.pid)
        assert err.value.kind == NOT_PYTHON and str(err.value) == f"pid {sleeper.pid} is not a Python process " \
                                                                  "(py-spy found no interpreter in it)"
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run py-spy as another user")
def test_tracing_not_permitted_says_how_to_allow_it():
    as_nobody = lambda argv, **kw: subprocess.run(  # noqa: E731 - the real py-spy, run as uid 65534
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *argv], **kw)
    sleeper = _sleepers(1)[0]
    try:
        with pytest.raises(StackError) as err:
            PySpy(run=as_nobody)(sleeper.pid)
    finally:
        sleeper.kill()
        sleeper.wait()
    message = str(err.value)
    assert err.value.kind == NOT_PERMITTED and "\n" not in message
    assert "same user" in message and "SYS_PTRACE" in message and "kernel.yama.ptrace_scope" in message


# ---- the in-run stack sampler -----------------------------------------------------------------------
def test_sampler_counts_hot_frames_of_running_threads_only(caplog):
    torn = StackError("failed", "py-spy dump of pid 1 failed: boom")
    dumps = iter([
        [pyspy_thread("w", 5, [("spin", "a.py", 1), ("run", "a.py", 9)], active=True),
         pyspy_thread("q", 6, [("Queue.get", "queue.py", 171)])],
        torn, torn,                                   # failed, and failed again when retried
        torn, [pyspy_thread("w", 5, [("spin", "a.py", 1)], active=True),   # the retry is a sample
               pyspy_thread("q", 6, [("Queue.get", "queue.py", 171)])],
        [pyspy_thread("w", 5, [("other", "a.py", 4)], active=True)],
        RuntimeError("not even JSON"),                # not a StackError: not retried
        StackError("not_permitted", "ptrace refused"),  # would fail again: not retried
    ])
    calls = []

    def runner(pid, native=False, nonblocking=False):
        assert (pid, native, nonblocking) == (4242, False, True)  # never stops the threads
        calls.append(pid)
        item = next(dumps)
        if isinstance(item, Exception):
            raise item
        return item

    sampler = StackSampler(4242, samples_per_interval=5, interval_s=10.0, runner=runner)
    with caplog.at_level(logging.WARNING, logger="profiler"):
        results = [sampler.sample_once() for _ in range(6)]
    assert results == [True, False, True, True, False, False] and len(calls) == 8
    assert [r.getMessage() for r in caplog.records] == [
        "stack sampling: py-spy dump of pid 1 failed: boom (logged once; later failures are only counted)"]
    summary = sampler.interval_summary()
    assert (summary["samples"], summary["failed"], summary["error"]) == (3, 3, "ptrace refused")
    w, q = summary["threads"]
    spin, run, other, get = (summary["frames"].index(f) for f in (
        "spin (a.py:1)", "run (a.py:9)", "other (a.py:4)", "Queue.get (queue.py:171)"))
    assert w == {"name": "w", "native_id": 5, "samples": 3, "idle_samples": 0,
                 "top_frames": [{"frame": "spin (a.py:1)", "count": 2}, {"frame": "other (a.py:4)", "count": 1}],
                 "stacks": [{"frames": [run, spin], "count": 1, "idle_samples": 0},   # whole stacks, root first
                            {"frames": [spin], "count": 1, "idle_samples": 0},
                            {"frames": [other], "count": 1, "idle_samples": 0}],
                 "other_samples": 0, "other_idle_samples": 0}
    assert q == {"name": "q", "native_id": 6, "samples": 2, "idle_samples": 2, "top_frames": [],
                 "stacks": [{"frames": [get], "count": 2, "idle_samples": 2}], "other_samples": 0,
                 "other_idle_samples": 0}
    assert sampler.interval_summary() == {"samples": 0, "failed": 0, "frames": [], "threads": []}  # reset


def test_sampler_spreads_samples_over_the_interval():
    start = time.monotonic()
    times = []
    sampler = StackSampler(1, samples_per_interval=4, interval_s=0.4,
                           runner=lambda pid, native=False, nonblocking=False: times.append(time.monotonic()) or [])
    sampler.start()
    deadline = start + 10.0                 # slots every 0.1 s; a busy host may run them late, never early
    while len(times) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    sampler.stop()
    assert len(times) >= 3
    for i, t in enumerate(times):  # slot i is never early: start + (i + 1/2) x period
        assert t - start >= (i + 0.5) * 0.1 - 0.005
    assert make_stack_sampler(1, 0, 1.0).interval_summary() is None
    assert isinstance(make_stack_sampler(1, 0, 1.0), NullStackSampler)
    with pytest.raises(ValueError, match="samples_per_interval"):
        StackSampler(1, 0, 1.0)


def _spin_for_the_sampler(stop):
    while not stop.is_set():
        sum(i * i for i in range(2000))


def test_sampler_with_real_py_spy_finds_a_busy_thread_of_its_own_process():
    stop = threading.Event()
    worker = threading.Thread(target=_spin_for_the_sampler, args=(stop,), name="spinner")
    worker.start()
    try:
        sampler = StackSampler(os.getpid(), samples_per_interval=8, interval_s=10.0)
        for _ in range(8):
            sampler.sample_once()
        summary = sampler.interval_summary()
    finally:
        stop.set()
        worker.join()
    assert summary["samples"] == 8 and summary["failed"] == 0
    spinner = next(t for t in summary["threads"] if t["native_id"] == worker.native_id)
    assert spinner["name"] == "spinner"
    hot = [f["frame"] for f in spinner["top_frames"]]
    assert any("_spin_for_the_sampler" in f or "<genexpr>" in f for f in hot), spinner


def test_the_cli_client_never_imports_torch():
    sleeper = _sleepers(1)[0]
    code = ("import sys; from dflash import profile_cli; "
            f"rc = profile_cli.main(['snapshot', '--pid', '{sleeper.pid}', '--json']); "
            "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', rc)")
    try:
        r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "NO-TORCH 0"
    assert json.loads(r.stdout[:r.stdout.rindex("NO-TORCH")])["pid"] == sleeper.pid


def test_slow_rates_keep_their_significant_digits(served):
    """0.4 steps/s used to print as "steps 0/s" (issue 45); large rates keep their thousands, no fake decimals."""
    holder, disc, _ = served
    last = interval({"target.fwd": 0.1})
    last["counters"] = {"steps": {"per_second": 0.4}, "tokens": {"per_second": 1739.2}, "seqs": {"per_second": 12.345}}
    holder["state"] = state_with(holder["run_dir"], [], last)
    snap = snapshot_process(os.getpid(), runner=lambda pid, native=False, nonblocking=False: [], discovery_dir=disc)
    text = format_process(snap)
    assert "steps 0.4/s, tokens 1,739/s, seqs 12.3/s" in text
