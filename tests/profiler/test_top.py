"""`dflash-profile top` without a training run: the frame builder (80 columns, sorting, an ended rank, a stuck
rank, a rank that stopped answering), the poller against real control endpoints (one that never answers
among them), the ticks the endpoint now serves, and the CLI's one-line errors."""
from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash import pipeline, profile_cli
from profiler.clients import top
from profiler.control import ControlServer
from profiler.clients.top import FrameSettings, Poller, RankView, build_frame, keep_ticks, last_run_end

REPO = Path(__file__).resolve().parents[2]
WAITS = pipeline.wait_spans()


def tick(index: int, t_s: float, step: int, tokens: int, spans: dict) -> dict:
    """A tick record: cumulative tokens and, per span, (cpu seconds, self seconds) so far."""
    return {"type": "tick", "index": index, "t_s": t_s, "time_unix": 1e9 + t_s, "step": step,
            "counters": {"tokens": tokens},
            "spans": {n: {"count": step, "cpu_seconds": c, "self_seconds": s} for n, (c, s) in spans.items()}}


def state(step: int, open_spans: dict, memory: dict | None = None, ticks=(), last_interval=None) -> dict:
    """A `state` reply: open_spans {thread: [(span, open seconds), ...] outermost first}."""
    active = [{"thread": thread, "native_id": 100 + i,
               "spans": [{"name": n, "depth": d, "open_seconds": s} for d, (n, s) in enumerate(spans)]}
              for i, (thread, spans) in enumerate(open_spans.items())]
    return {"step": step, "active_spans": active, "ticks": list(ticks), "last_interval": last_interval,
            "memory": memory or {"available": False, "reason": "no CUDA device", "allocator": {}}}


GPU = {"available": True, "gpus": [{"index": 0, "util_percent": 87.0, "used_bytes": 12.3 * 2**30,
                                    "total_bytes": 80 * 2**30}]}


def drafter(rank=0, tokens=(10_000, 22_340), steps=(30, 42)) -> RankView:
    """A drafter on a GPU, 10 s between its ticks: 1,234 tokens/s, 1.2 steps/s, 71% in drafter.fwd_bwd."""
    v = RankView(rank=rank, role="drafter", pid=1000 + rank, answer_age_s=0.1)
    v.state = state(steps[1], {"drafter.main": [("drafter.fwd_bwd", 0.3)]}, GPU)
    keep_ticks(v, [tick(0, 100.0, steps[0], tokens[0], {"drafter.fwd_bwd": (1.0, 1.0), "drafter.recv": (0.5, 0.5)}),
                   tick(1, 110.0, steps[1], tokens[1], {"drafter.fwd_bwd": (8.1, 8.1), "drafter.recv": (0.7, 0.7)})],
               10.0)
    return v


def target(rank=1, wait_s=6.0, open_s=0.2) -> RankView:
    """A CPU target that waited `wait_s` of its 10 s window in transfer.wait_slot, open there for `open_s`."""
    v = RankView(rank=rank, role="target", pid=1000 + rank, answer_age_s=0.1, p95_s={"transfer.wait_slot": 0.2})
    v.state = state(43, {"target.main": [("transfer.wait_slot", open_s)]})
    keep_ticks(v, [tick(0, 100.0, 31, 10_000, {"target.fwd": (1.0, 1.0), "transfer.wait_slot": (0.0, 0.0)}),
                   tick(1, 110.0, 43, 22_000, {"target.fwd": (3.0, 3.0), "transfer.wait_slot": (wait_s, wait_s)})],
               10.0)
    return v


SETTINGS = FrameSettings("/tmp/run", waits=WAITS, keys=True)


def row_of(lines: list, rank: int) -> tuple:
    """(the rank's figures split on spaces, its second line)."""
    i = next(i for i, line in enumerate(lines) if line[:5] == f"{rank:>4} ")
    return lines[i].split(), lines[i + 1]


def test_a_frame_fits_80_columns_and_shows_rates_over_the_stated_window():
    lines = build_frame([drafter(), target()], SETTINGS, 80, clock_text="12:00:00")
    assert all(len(line) <= 80 for line in lines), [line for line in lines if len(line) > 80]
    assert lines[0] == "dflash-profile top /tmp/run: 2 ranks, 2 live  12:00:00"
    assert "each rank's ticks over its last WIN (up to 10 s)" in lines[1]
    assert lines[3] == "bound stage: drafter (least waiting over WIN: drafter 2%, target 60%; 2 ranks)"
    assert lines[4].split() == ["RANK", "ROLE", "STEP", "STATE", "TOK/S", "STEP/S", "WIN", "GPU%", "MEM", "GiB"]
    figures, detail = row_of(lines, 0)
    assert figures == ["0", "drafter", "42", "running", "1,234", "1.20", "10s", "87", "12.3/80"]
    assert detail.strip() == "busy: drafter.fwd_bwd 71%, drafter.recv 2%; open: drafter.fwd_bwd 0.4 s"
    figures, detail = row_of(lines, 1)
    assert figures == ["1", "target", "43", "running", "1,200", "1.20", "10s", "-", "-"]   # a CPU rank: no GPU
    assert detail.strip().startswith("busy: transfer.wait_slot 60%, target.fwd 20%; open: transfer.wait_slot")
    assert lines[-1].startswith("sort: rank ")
    alike = build_frame([drafter(), target(wait_s=0.3)], SETTINGS, 80)[3]   # 3% against 2%: no verdict
    assert alike == "bound stage: - (roles wait alike over WIN: drafter 2%, target 3%; 2 ranks)"


def test_long_names_are_cut_at_the_width_and_escapes_from_a_rank_never_reach_the_terminal():
    v = drafter()
    v.state["active_spans"][0]["spans"][0]["name"] = "x" * 120 + "\x1b[2J"
    v.role = "drafter\x1b]0;owned\x07"
    lines = build_frame([v], FrameSettings("/x" * 60, keys=False), 80)
    assert all(len(line) <= 80 for line in lines) and not any("\x1b" in line or "\x07" in line for line in lines)
    assert row_of(lines, 0)[1].endswith("...")
    assert lines[0] == "dflash-profile top ..." + "/x" * 21 + ": 1 rank, 1 live"   # the path cut from the left
    assert not lines[-1].startswith("sort:")   # --once: no keys line


def test_sorting_by_each_column_and_reversed():
    fast, slow, ended = drafter(0, tokens=(0, 50_000), steps=(30, 40)), drafter(2, tokens=(0, 1_000), steps=(30, 50)), \
        RankView(rank=1, role="target", pid=7, ended="ok", end_step=60)
    stuck = target(3, open_s=30.0)

    def order(sort, reverse=False):
        lines = build_frame([fast, slow, ended, stuck], SETTINGS, 80, sort=sort, reverse=reverse)
        return [int(line[:4]) for line in lines if line[:4].strip().isdigit()]
    assert order("rank") == [0, 1, 2, 3] and order("rank", True) == [3, 2, 1, 0]
    assert order("tok/s") == [0, 3, 2, 1]             # high first, no rate (ended) last
    assert order("step") == [0, 3, 2, 1]              # laggards first: 40, 43, 50, then the ended rank's
    assert order("state") == [3, 0, 2, 1]             # stuck first, ended last
    assert build_frame([fast], SETTINGS, 80, sort="state", reverse=True)[-1].startswith("sort: state reversed ")


def test_an_ended_rank_shows_its_exit_reason_and_no_rates():
    killed = RankView(rank=1, role="target", pid=7, ended="no run_end in its log (killed?)")
    done = RankView(rank=0, role="drafter", pid=8, ended="hang", end_step=4)
    lines = build_frame([done, killed], SETTINGS, 80)
    assert lines[0].endswith("2 ranks, 0 live, 2 ended")
    figures, detail = row_of(lines, 0)
    assert figures == ["0", "drafter", "4", "ended", "-", "-", "-", "-", "-"]
    assert detail.strip() == "ended: hang at step 4 (its run_end)"
    assert row_of(lines, 1)[1].strip() == "ended: no run_end in its log (killed?)"
    assert lines[3].startswith("bound stage: - ")


def test_a_stuck_rank_and_a_rank_that_stopped_answering():
    stuck = target(1, open_s=12.0)
    silent = drafter(0)
    silent.error, silent.answer_age_s = "TimeoutError: timed out", 7.25
    lines = build_frame([silent, stuck], SETTINGS, 80)
    figures, detail = row_of(lines, 1)
    assert figures[3:5] == ["STUCK", "12s"]
    assert detail.strip() == "STUCK in transfer.wait_slot 12.1 s > 5.0 s (p95 0.2 s) on target.main"
    figures, detail = row_of(lines, 0)
    assert figures[3:5] == ["NO", "ANSWER"] and figures[5] == "7s" and figures[6:] == ["-"] * 5
    # its open span's age goes on from its last answer: 0.3 s then, 7.25 s ago
    assert detail.strip() == "no answer for 7.2 s (TimeoutError: timed out); open: drafter.fwd_bwd 7.5 s"
    never = RankView(rank=2, role="target", pid=9, error="ConnectionRefusedError: refused")
    assert "it never answered" in row_of(build_frame([never], SETTINGS, 80), 2)[1]


def test_a_short_terminal_counts_the_ranks_it_cannot_show():
    ranks = [drafter(r) for r in range(8)]
    lines = build_frame(ranks, SETTINGS, 80, height=12)
    assert len(lines) == 11 and lines[-2] == "... 6 more ranks (a taller terminal shows them)"   # 2 of 8 fit
    assert lines[-1].startswith("sort:")


def test_keep_ticks_keeps_one_window_and_each_tick_once():
    v = RankView(rank=0, role="drafter", pid=1)
    for t in range(0, 30, 5):
        keep_ticks(v, [tick(t // 5 - 1, t - 5.0, t, t, {}), tick(t // 5, float(t), t, t, {})], 10.0)
    assert [t["t_s"] for t in v.ticks] == [15.0, 20.0, 25.0]   # the newest and back to 10 s before it
    assert top.rank_window(v)["duration_seconds"] == 10.0


def test_last_run_end_reads_the_tail_and_only_this_segments(tmp_path, monkeypatch):
    log = tmp_path / "rank0.jsonl"
    old_end = {"type": "run_end", "time_unix": 100.0, "step": 5, "status": "ok"}
    lines = [json.dumps({"type": "interval", "pad": "x" * 500}) for _ in range(40)]
    log.write_text("\n".join([json.dumps(old_end), *lines]) + "\n")
    assert last_run_end(log, since_unix=50.0).status == "ok"
    assert last_run_end(log, since_unix=150.0) is None           # a run_end of an earlier segment
    monkeypatch.setattr(top, "LOG_TAIL_BYTES", 1024)
    assert last_run_end(log, since_unix=50.0) is None            # not in the last 1 KiB
    with log.open("a") as f:
        f.write(json.dumps({"type": "run_end", "time_unix": 200.0, "step": 9, "status": "hang"}) + "\n")
    end = last_run_end(log, since_unix=150.0)
    assert (end.status, end.step) == ("hang", 9)
    assert last_run_end(log, since_unix=300.0) is None
    assert last_run_end(tmp_path / "missing.jsonl", None) is None


# ---- against real endpoints ------------------------------------------------------------------------------------

def serve(run_dir: Path, rank: int, role: str, reply: dict, discovery: Path) -> ControlServer:
    server = ControlServer(run_dir, rank, role, lambda: reply, discovery_dir=discovery)
    server.start()
    assert server.error is None, server.error
    return server


def test_the_poller_does_not_wait_on_a_rank_that_never_answers(tmp_path):
    """A socket that accepts and never answers (a stopped process) costs one timeout, not the view."""
    run, discovery = tmp_path / "run", tmp_path / "disc"
    good = serve(run, 0, "drafter", state(5, {}), discovery)
    mute = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    mute.bind(str(tmp_path / "mute.sock"))
    mute.listen(8)
    records = [{"pid": os.getpid(), "rank": 0, "role": "drafter", "socket_path": good.socket_path},
               {"pid": os.getppid(), "rank": 1, "role": "target", "socket_path": str(tmp_path / "mute.sock")}]
    poller = Poller(records, timeout_s=0.3)
    try:
        start = time.monotonic()
        first = poller.refresh()
        assert time.monotonic() - start < 1.5
        assert first[0].state["step"] == 5 and first[0].error is None
        assert first[1].state is None and "timed out" in first[1].error and first[1].ended is None
    finally:
        poller.close()
        good.close()
        mute.close()


def test_a_rank_whose_process_is_gone_is_ended_with_its_run_end(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    run = tmp_path / "run"
    (run / "profile").mkdir(parents=True)
    (run / "profile" / "rank1.jsonl").write_text(json.dumps(
        {"type": "run_end", "time_unix": time.time(), "step": 8, "status": "ok"}) + "\n")
    record = {"pid": gone.pid, "rank": 1, "role": "target", "run_dir": str(run),
              "socket_path": str(tmp_path / "no.sock"), "start_time_unix": time.time() - 60}
    poller = Poller([record], timeout_s=0.3)
    try:
        (view,) = poller.refresh()
    finally:
        poller.close()
    assert (view.ended, view.end_step) == ("ok", 8)


SERVE = """import json, sys, time
from profiler.control import ControlServer
s = ControlServer(sys.argv[1], 1, "target", lambda: json.loads(sys.argv[3]), discovery_dir=sys.argv[2])
s.start()
print("ready", flush=True)
time.sleep(60)
"""


def test_once_prints_one_plain_frame_of_every_live_rank(tmp_path, monkeypatch):
    """Two ranks, one here and one in a process of its own (a discovery file is per process)."""
    run, discovery = tmp_path / "run", tmp_path / "disc"
    here = serve(run, 0, "drafter", state(42, {"drafter.main": [("drafter.fwd_bwd", 0.3)]}, GPU, ticks=drafter().ticks),
                 discovery)
    other = subprocess.Popen([sys.executable, "-c", SERVE, str(run), str(discovery),
                              json.dumps(state(43, {}, ticks=target().ticks))], cwd=REPO, stdout=subprocess.PIPE,
                             text=True)
    monkeypatch.setenv("COLUMNS", "80")
    out = io.StringIO()
    try:
        assert other.stdout.readline() == "ready\n"
        assert top.run(run_dir=run, once=True, waits=WAITS, out=out, discovery_dir=discovery) == 0
    finally:
        here.close()
        other.kill()
        other.wait()
    lines = out.getvalue().splitlines()
    assert all(len(line) <= 80 for line in lines) and "\x1b" not in out.getvalue()
    assert lines[0].startswith("dflash-profile top ") and ": 2 ranks, 2 live  " in lines[0]
    assert row_of(lines, 0)[0][:5] == ["0", "drafter", "42", "running", "1,234"]
    assert row_of(lines, 1)[0][:5] == ["1", "target", "43", "running", "1,200"]


def test_the_endpoint_serves_the_last_two_ticks(tmp_path):
    from tests.profiler.build import make_profiler

    import profiler
    from profiler.control import query

    with make_profiler(tmp_path, interval_s=3600.0, tick_s=3600.0, control=True, measure_floors=False,
                       background=False) as prof:
        assert query(prof.control.socket_path)["state"]["ticks"] == []
        for step in range(3):
            profiler.set_step(step)
            profiler.count("tokens", 100)
            prof.collector.write_tick()
        ticks = query(prof.control.socket_path)["state"]["ticks"]
    assert [(t["type"], t["index"], t["step"], t["counters"]["tokens"]) for t in ticks] == \
        [("tick", 1, 1, 200), ("tick", 2, 2, 300)]


# ---- the command line ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, error", [
    (["--run-dir", "{tmp}", "--interval", "0"], "--interval must be a number of seconds from 0.2 to 3600, got 0.0"),
    (["--run-dir", "{tmp}", "--interval", "nan"], "--interval must be a number of seconds from 0.2 to 3600"),
    (["--run-dir", "{tmp}", "--window", "-1", "--once"], "--window must be a number of seconds from 1 to 86400"),
    (["--run-dir", "{tmp}/nope", "--once"], "no such run directory: {tmp}/nope"),
    (["--run-dir", "{tmp}", "--once"], "no live rank of {tmp}: no discovery file in "),
    (["--pid", "{dead}", "--once"], "no such pid {dead}"),
    (["--pid", "{me}", "--once"], "pid {me} is not a dflash rank of yours: no discovery file "),
    (["--run-dir", "{tmp}"], "stdout is not a terminal: the live view needs one (--once prints one plain frame)"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, error):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    fill = {"tmp": str(tmp_path), "dead": str(gone.pid), "me": str(os.getpid())}
    code = profile_cli.main(["top", *(a.format(**fill) for a in argv)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("dflash-profile: error: " + error.format(**fill)), err


def test_top_imports_no_torch():
    code = "import sys, profiler.clients.top, dflash.profile_cli\nassert 'torch' not in sys.modules\n"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
