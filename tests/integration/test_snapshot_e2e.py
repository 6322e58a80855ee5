"""`dflash-profile snapshot` against real processes with the real py-spy: a dflash-train run whose target
hangs in target.fwd (DFLASH_FAULT=hang@...), a plain Python process, a missing pid, a non-Python one."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from profiler.schema.records import read_records
from profiler.clients.snapshot import live_ranks, snapshot_run

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
# tests/integration/test_pipeline.py's SMALL run, without evaluation: ~20 s on 2 cores to the hang.
SMALL = ["--builtin-conversations", "48", "--eval-prompts", "0", "--tokens-per-batch", "1024",
         "--max-length", "128", "--profile-interval", "1", "--device", "cpu"]
HANG = "hang@target.fwd:step=4"


def profile(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash.profile_cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def _wait_until_stuck(run: Path, train: subprocess.Popen, deadline_s: float = 240) -> dict:
    """Poll the run (library call, real py-spy) until the target rank's main thread is stuck."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        assert train.poll() is None, f"dflash-train exited early ({train.returncode}); see {run.parent}/train.log"
        if len(live_ranks(run)) == 2:
            snap = snapshot_run(run)
            ranks = {s["role"]: s for s in snap["ranks"]}
            if ranks.get("target", {}).get("stuck") and ranks.get("drafter", {}).get("stuck"):
                return {role: s["pid"] for role, s in ranks.items()}
        time.sleep(1.0)
    raise AssertionError(f"the run never got stuck in {deadline_s} s")


@pytest.fixture(scope="module")
def hung_run(tmp_path_factory, prebuilt, live_run):
    """One real two-rank run whose target hangs in target.fwd at step 4 (the drafter then waits in
    drafter.recv); yields (run_dir, {role: pid}) once both are past the stuck limit."""
    run = prebuilt(tmp_path_factory.mktemp("snapshot") / "run")
    with live_run(run, ["--max-steps", "1000", *SMALL], {"DFLASH_FAULT": HANG}) as train:
        yield run, _wait_until_stuck(run, train)


def test_snapshot_of_a_running_train_rank_shows_threads_roles_and_the_stuck_span(hung_run, tmp_path):
    run, pids = hung_run
    r = profile("snapshot", "--pid", str(pids["target"]), "--out", str(tmp_path / "snap.json"))
    assert r.returncode == 0, r.stderr
    text = r.stdout
    assert f"pid {pids['target']}  rank 1  role target" in text
    for thread in ("target.main", "target.sender"):
        assert f"  {thread} (native id " in text
    own = next(line for line in text.splitlines() if line.startswith("  the profiler's own "))   # apart, one line
    assert "profiler.control (" in own and "profiler.collector (" in own and "profiler.control (native" not in text
    assert "open spans: target.fwd" in text and "STUCK in target.fwd: open " in text
    assert "at FaultPlan.on_enter (profiler/faults.py:" in text  # the frame it is stuck in
    snap = json.loads((tmp_path / "snap.json").read_text())
    main = next(t for t in snap["threads"] if t["name"] == "target.main")
    assert main["native_id"] == pids["target"] and main["role"] == "target" and main["stuck"] is True
    fwd = main["open_spans"][-1]
    assert fwd["name"] == "target.fwd" and fwd["open_seconds"] > fwd["limit_seconds"] >= 5.0
    assert 0 < fwd["p95_seconds"] < 1.0 and main["stuck_frame"].startswith("FaultPlan.on_enter")
    sender = next(t for t in snap["threads"] if t["name"] == "target.sender")
    assert sender["stuck"] is False and sender["frames"]
    kept = Path(snap["kept"]["file"])
    assert kept.parent == run.resolve() / "snapshots" and json.loads(kept.read_text())["pid"] == pids["target"]


def test_the_snapshot_is_recorded_in_the_ranks_run_log(hung_run):
    run, pids = hung_run
    r = profile("snapshot", "--pid", str(pids["drafter"]), "--json")
    assert r.returncode == 0, r.stderr
    kept = json.loads(r.stdout)["kept"]
    assert kept["recorded"] is True, kept
    recs = [x for x in read_records(run / "profile" / "rank0.jsonl")[0] if x["type"] == "snapshot"]
    assert recs and recs[-1]["file"] == kept["file"] and recs[-1]["role"] == "drafter"
    main = next(t for t in recs[-1]["threads"] if t["name"] == "drafter.main")
    assert main["stuck"] is True and main["open_spans"][-1]["name"] == "drafter.recv" and main["frames"]


def test_run_dir_snapshot_puts_ranks_side_by_side_and_names_the_stuck_one(hung_run):
    run, pids = hung_run
    r = profile("snapshot", "--run-dir", str(run))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == f"run {run.resolve()}: 2 live ranks"
    assert lines[2].startswith(f"  0     drafter   {pids['drafter']:<8}")
    assert "waits (stuck) in drafter.recv" in lines[2]
    assert lines[3].startswith(f"  1     target    {pids['target']:<8}") and "STUCK in target.fwd" in lines[3]
    assert lines[4].startswith("rank 0 (drafter) waits in drafter.recv for ")
    assert "on the target ranks: rank 1 is stuck in target.fwd at FaultPlan.on_enter (profiler/faults.py:" in lines[4]
    r = profile("snapshot", "--run-dir", str(run), "--json")
    both = json.loads(r.stdout)
    assert [s["rank"] for s in both["ranks"]] == [0, 1] and all(s["kept"]["file"] for s in both["ranks"])
    assert both["waits"][0]["stuck_ranks"][0]["rank"] == 1


@pytest.mark.parametrize("command, code, lines", [("snapshot", 0, 3), ("memory", 2, 2)])   # memory: the rank, the forecast
@pytest.mark.parametrize("reader", ["head -3", "true"])
def test_dflash_profile_piped_into_head_ends_quietly(hung_run, command, code, lines, reader):
    """`dflash-profile snapshot ... | head -3` (issue 37) ends with its own exit status (memory: 2, a CPU rank has no
    allocator to save: a reader gone early does not turn it into 0) and no BrokenPipeError traceback. The text may fit the pipe's buffer before head leaves, so
    `| true`, gone long before the live rank answers, makes the closed pipe certain."""
    run, pids = hung_run
    r = subprocess.run(f"{sys.executable} -m dflash.profile_cli {command} --pid {pids['target']} | {reader}; "
                       "exit ${PIPESTATUS[0]}", shell=True, executable="/bin/bash", cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == code and "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, r.stderr
    assert len(r.stdout.splitlines()) == (lines if reader.startswith("head") else 0), r.stdout


def test_plain_python_process_gets_its_stacks_and_a_note(tmp_path):
    code = ("import threading, time\ndef parked():\n    time.sleep(60)\n"
            "threading.Thread(target=parked, name='parker').start()\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        time.sleep(0.5)
        r = profile("snapshot", "--pid", str(proc.pid))
    finally:
        proc.kill()
        proc.wait()
    assert r.returncode == 0, r.stderr
    assert f"note: no control endpoint: pid {proc.pid} has no discovery file" in r.stdout and "stacks only" in r.stdout
    assert "  parker (native id " in r.stdout and "at parked (<string>:3)" in r.stdout
    assert "  MainThread (native id " in r.stdout


def test_missing_pid_and_non_python_process_are_one_line_errors(tmp_path):
    gone = subprocess.Popen(["sleep", "60"])
    try:
        r = profile("snapshot", "--pid", str(gone.pid))
        assert (r.returncode, r.stdout) == (2, "")
        assert r.stderr == (f"dflash-profile: error: pid {gone.pid} is not a Python process "
                            "(py-spy found no interpreter in it)\n")
    finally:
        gone.kill()
        gone.wait()
    r = profile("snapshot", "--pid", str(gone.pid))
    assert (r.returncode, r.stderr) == (2, f"dflash-profile: error: no such pid {gone.pid}\n")
    r = profile("snapshot", "--run-dir", str(tmp_path))
    assert r.returncode == 2 and r.stderr.startswith(f"dflash-profile: error: no live rank of {tmp_path}")
    assert r.stderr.count("\n") == 1


# ---- issue 34 row 6: names from another process never drive the terminal ---------------------
NASTY = "\x1b]0;owned\x07\x1b[2J\x1b]52;c;cGF5bG9hZA==\x07\r\x9b1K"   # title, clear, clipboard, CR, C1 CSI
PARKED = "import time\n\ndef parked():\n    while True:\n        time.sleep(1)\n"
# A process whose thread names and module file name hold NASTY; with an endpoint argument it also serves a
# real control endpoint (profiler.control) for a run directory, whose state names spans and roles with it.
PROGRAM = """import importlib.util, sys, threading
NASTY = {nasty!r}
spec = importlib.util.spec_from_file_location("evil", {module!r})
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
worker = threading.Thread(target=mod.parked, name="worker" + NASTY, daemon=True)
worker.start()
threading.current_thread().name = "main" + NASTY
if len(sys.argv) > 1:
    from profiler.control import ControlServer
    interval = {{"index": 0, "step": 3, "duration_seconds": 1.0, "counters": {{}},
                "spans": {{"drafter.recv" + NASTY: {{"count": 2, "share": 0.5, "cpu": {{"p95_seconds": 0.01}}}}}}}}
    state = {{"rank": 0, "role": "drafter" + NASTY, "step": 3, "run_dir": sys.argv[1], "intervals_closed": 1,
             "last_interval": interval, "memory": {{"available": False, "reason": "no GPU" + NASTY}},
             "active_spans": [{{"thread": "worker" + NASTY, "native_id": worker.native_id,
                               "spans": [{{"name": "drafter.recv" + NASTY, "open_seconds": 99.0}}]}}]}}
    server = ControlServer(sys.argv[1], 0, "drafter" + NASTY, lambda: state)
    server.start()
    assert server.error is None, server.error
print("ready", flush=True)
sys.stdin.read()
if len(sys.argv) > 1:
    server.close()
"""


def raw_controls(data: bytes) -> list[str]:
    """The control characters (C0 but newline and tab, DEL, C1) in UTF-8 output."""
    return [c for c in data.decode() if (ord(c) < 0x20 and c not in "\n\t") or 0x7F <= ord(c) < 0xA0]


@pytest.fixture
def other_user():
    """(name, uid, gid) of a system user made for this test and removed after it."""
    import pwd
    import shutil
    import uuid

    if os.geteuid() != 0:
        pytest.skip("needs root: the test makes a second local user and snapshots that user's process")
    useradd, userdel = shutil.which("useradd"), shutil.which("userdel")
    if useradd is None or userdel is None:
        pytest.skip("useradd/userdel missing: cannot make the second local user this test needs")
    name = f"dfl-snap-{uuid.uuid4().hex[:8]}"
    subprocess.run([useradd, "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True,
                   capture_output=True)
    try:
        entry = pwd.getpwnam(name)
        yield name, entry.pw_uid, entry.pw_gid
    finally:
        subprocess.run([userdel, name], capture_output=True)


@contextlib.contextmanager
def parked_process(argv: list, **popen):
    """A process of PROGRAM, once it said it is ready; ended by closing its stdin (then killed)."""
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, **popen)
    try:
        assert proc.stdout.readline() == b"ready\n", f"the parked process did not start (exit {proc.poll()})"
        yield proc
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def _interpreter_for(uid: int, gid: int) -> str:
    """A Python the other user may run (this venv's may sit under a directory only we can enter)."""
    for candidate in (sys.executable, sys._base_executable, "/usr/bin/python3"):
        try:
            ok = subprocess.run([candidate, "-c", "pass"], user=uid, group=gid, extra_groups=[], capture_output=True,
                                cwd="/")
        except OSError:   # not theirs to run
            continue
        if ok.returncode == 0:
            return candidate
    pytest.skip("no Python interpreter the second user may run")


def _snapshot_bytes(*args: str) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "dflash.profile_cli", "snapshot", *args], cwd=REPO,
                       capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    assert raw_controls(r.stdout) == [] and raw_controls(r.stderr) == [], args
    return r


def test_a_snapshot_of_another_users_process_prints_no_raw_escape(other_user, tmp_path):
    """Issue 34 row 6, the snapshot half: thread names and a module file name holding terminal escapes (window
    title, clear screen, OSC 52 clipboard write, CR, C1 CSI), in another user's process (--pid, py-spy as root)
    and in a profiled process of ours whose endpoint's state holds them too (--run-dir: discovery files are per
    user, so --run-dir only ever finds this user's ranks). No raw control character reaches stdout or stderr,
    in text or --json, and the names still arrive whole (escaped), not dropped."""
    import shutil
    import tempfile

    from profiler.control import clean_stale_discovery, default_discovery_dir

    _, uid, gid = other_user
    shared = Path(tempfile.mkdtemp(prefix="dflash-snap-"))   # not under pytest's 0700 base: the user reads it
    try:
        shared.chmod(0o755)
        module = shared / f"evil{NASTY}.py"
        module.write_text(PARKED)
        main = shared / "main.py"
        main.write_text(PROGRAM.format(nasty=NASTY, module=str(module)))
        for f in (module, main):
            f.chmod(0o644)
        with parked_process([_interpreter_for(uid, gid), str(main)], user=uid, group=gid, extra_groups=[],
                            cwd="/") as theirs:
            text = _snapshot_bytes("--pid", str(theirs.pid)).stdout.decode()
            as_json = json.loads(_snapshot_bytes("--pid", str(theirs.pid), "--json").stdout)
        esc = NASTY.encode("unicode_escape").decode().replace("\\r", "\\x0d")   # how printable() shows it
        assert f"  worker{esc} (native id " in text and f"  main{esc} (native id " in text, text
        assert f"at parked (evil{esc}.py:5)" in text, text
        worker = next(t for t in as_json["threads"] if t["name"] == "worker" + NASTY)
        assert worker["frames"][0] == f"parked (evil{NASTY}.py:5)"

        run = tmp_path / f"run{NASTY}"
        run.mkdir()
        with parked_process([sys.executable, str(main), str(run)], cwd=REPO,
                            env=dict(os.environ, PYTHONPATH=str(REPO))) as ours:
            text = _snapshot_bytes("--run-dir", str(run)).stdout.decode()
            as_json = json.loads(_snapshot_bytes("--run-dir", str(run), "--json").stdout)
        assert f"run {str(run.resolve()).replace(NASTY, esc)}: 1 live ranks" in text, text
        assert f"role drafter{esc}" in text and f"open spans: drafter.recv{esc} " in text, text
        [snap] = as_json["ranks"]
        assert snap["pid"] == ours.pid and snap["role"] == "drafter" + NASTY
        worker = next(t for t in snap["threads"] if t["name"] == "worker" + NASTY)
        assert worker["open_spans"][0]["name"] == "drafter.recv" + NASTY
    finally:
        shutil.rmtree(shared, ignore_errors=True)
        clean_stale_discovery(default_discovery_dir())
