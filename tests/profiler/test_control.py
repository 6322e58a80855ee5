"""Control endpoint over a real Unix socket: query, modes, discovery, errors, cleanup, fallback."""

import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from profiler.control import ControlServer, NullControlServer, clean_stale_discovery, discover, query


@pytest.fixture
def disc_dir(tmp_path):
    return tmp_path / "disc"


def test_state_query_modes_and_discovery(tmp_path, disc_dir):
    calls = []

    def state_fn():
        calls.append(1)
        return {"step": 7, "open_spans": [{"name": "target.fwd", "open_seconds": 1.5}]}

    server = ControlServer(tmp_path / "run", rank=1, role="drafter", state_fn=state_fn, discovery_dir=disc_dir)
    server.start()
    try:
        assert server.socket_path == str((tmp_path / "run" / "control" / "rank1.sock").resolve())
        assert stat.S_ISSOCK(os.stat(server.socket_path).st_mode)
        assert stat.S_IMODE(os.stat(server.socket_path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(disc_dir).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(server.discovery_path).st_mode) == 0o600

        reply = query(server.socket_path)
        assert reply == {"ok": True, "state": state_fn()}
        assert query(server.socket_path, "ping") == {"ok": True, "pid": os.getpid(), "rank": 1, "role": "drafter"}
        bad = query(server.socket_path, "launch_missiles")
        assert bad["ok"] is False and "unknown cmd 'launch_missiles'" in bad["error"]

        record = discover(os.getpid(), discovery_dir=disc_dir)
        assert record["socket_path"] == server.socket_path
        assert record["run_dir"] == str((tmp_path / "run").resolve())
        assert (record["rank"], record["role"], record["pid"]) == (1, "drafter", os.getpid())
        assert record["socket_fallback"] is False and record["start_time_unix"] > 0
    finally:
        server.close()
    assert not os.path.exists(server.socket_path)
    assert not os.path.exists(server.discovery_path)
    assert discover(os.getpid(), discovery_dir=disc_dir) is None
    assert query(server.socket_path)["ok"] is False  # gone: an error reply, not an exception


def test_raising_state_fn_gives_error_and_server_survives(tmp_path, disc_dir):
    fail = [True]

    def state_fn():
        if fail[0]:
            raise KeyError("no interval yet")
        return {"fine": True}

    server = ControlServer(tmp_path, rank=0, role="target", state_fn=state_fn, discovery_dir=disc_dir)
    server.start()
    try:
        reply = query(server.socket_path)
        assert reply["ok"] is False and reply["error"] == "state failed: KeyError: 'no interval yet'"
        fail[0] = False
        assert query(server.socket_path) == {"ok": True, "state": {"fine": True}}
    finally:
        server.close()


def test_non_json_state_and_garbage_request(tmp_path, disc_dir):
    server = ControlServer(tmp_path, rank=0, role="target", state_fn=lambda: {"x": object()}, discovery_dir=disc_dir)
    server.start()
    try:
        reply = query(server.socket_path)
        assert reply["ok"] is False and "not JSON serializable" in reply["error"]
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(2)
            s.connect(server.socket_path)
            s.sendall(b"not json\n")
            answer = json.loads(s.makefile().readline())
        assert answer["ok"] is False and "not a JSON line" in answer["error"]
    finally:
        server.close()


def test_long_run_dir_falls_back_to_discovery_dir(tmp_path, disc_dir):
    long_run_dir = tmp_path / ("r" * 120)
    server = ControlServer(long_run_dir, rank=2, role="target", state_fn=lambda: {"ok": 1}, discovery_dir=disc_dir)
    server.start()
    try:
        assert server.socket_path == str(disc_dir / f"rank2-{os.getpid()}.sock")
        assert len(os.fsencode(server.socket_path)) <= 107
        assert query(server.socket_path)["state"] == {"ok": 1}
        record = discover(os.getpid(), discovery_dir=disc_dir)
        assert record["socket_fallback"] is True and record["socket_path"] == server.socket_path
    finally:
        server.close()
    assert not os.path.exists(server.socket_path)


def test_stale_socket_is_replaced(tmp_path, disc_dir):
    (tmp_path / "control").mkdir()
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(tmp_path / "control" / "rank0.sock"))
    stale.close()  # a dead process's socket file: nobody listens
    server = ControlServer(tmp_path, rank=0, role="target", state_fn=lambda: {}, discovery_dir=disc_dir)
    server.start()
    try:
        assert server.socket_fallback is False
        assert query(server.socket_path) == {"ok": True, "state": {}}
    finally:
        server.close()


def test_start_failure_disables_endpoint_without_raising(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    server = ControlServer(blocker, rank=0, role="target", state_fn=dict, discovery_dir=tmp_path / "d")
    server.start()  # run_dir is a file: cannot create control/ under it
    assert server.error is not None and "file" in server.error
    assert discover(os.getpid(), discovery_dir=tmp_path / "d") is None
    server.close()


def test_discover_rejects_corrupt_file(tmp_path):
    (tmp_path / "123.json").write_text("{half")
    with pytest.raises(ValueError, match=r"123\.json is not valid JSON"):
        discover(123, discovery_dir=tmp_path)


def test_null_control_server():
    server = NullControlServer()
    server.start()
    server.close()
    assert server.socket_path is None and server.discovery_path is None


def test_record_command_calls_record_fn_and_reports_failures(tmp_path, disc_dir):
    written = []
    server = ControlServer(tmp_path, rank=0, role="target", state_fn=dict, record_fn=written.append,
                           discovery_dir=disc_dir)
    server.start()
    try:
        fields = {"threads": [{"name": "MainThread", "frames": ["f (a.py:1)"] * 2000}]}  # > the old 64 KiB
        assert query(server.socket_path, "record", fields=fields) == {"ok": True}
        assert written == [fields]
        bad = query(server.socket_path, "record")
        assert bad["ok"] is False and "needs a 'fields' object" in bad["error"]
        assert len(written) == 1
    finally:
        server.close()
    boom = ControlServer(tmp_path, rank=0, role="target", state_fn=dict,
                         record_fn=lambda f: (_ for _ in ()).throw(OSError("disk full")), discovery_dir=disc_dir)
    boom.start()
    try:
        reply = query(boom.socket_path, "record", fields={"x": 1})
        assert reply == {"ok": False, "error": "record failed: OSError: disk full"}
        assert query(boom.socket_path, "ping")["ok"] is True  # the server survived
    finally:
        boom.close()


def test_record_without_record_fn_says_so(tmp_path, disc_dir):
    server = ControlServer(tmp_path, rank=0, role="target", state_fn=dict, discovery_dir=disc_dir)
    server.start()
    try:
        reply = query(server.socket_path, "record", fields={"x": 1})
        assert reply["ok"] is False and "no record_fn" in reply["error"]
    finally:
        server.close()


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid  # reaped: no such process now (pid reuse within the test is vanishingly unlikely)


def _discovery_file(directory, pid, socket_path):
    directory.mkdir(mode=0o700, exist_ok=True)
    path = directory / f"{pid}.json"
    path.write_text(json.dumps({"pid": pid, "socket_path": str(socket_path)}))
    return path


def test_start_removes_discovery_files_of_dead_endpoints_only(tmp_path, disc_dir):
    dead = _dead_pid()
    dead_file = _discovery_file(disc_dir, dead, disc_dir / f"rank0-{dead}.sock")
    dead_sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead_sock.bind(str(disc_dir / f"rank0-{dead}.sock"))
    dead_sock.close()  # the dead process's fallback socket file is left behind
    half_written = disc_dir / f"{dead}.json.tmp"
    half_written.write_text("{")
    # A live endpoint (served from this process) announced under another live pid: kept.
    live = ControlServer(tmp_path / "live", rank=1, role="drafter", state_fn=dict, discovery_dir=disc_dir)
    live.start()
    sleepers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    try:
        kept = _discovery_file(disc_dir, sleepers[0].pid, live.socket_path)
        # A live pid whose socket nobody listens on (pid reused, or the endpoint is gone): removed.
        unanswered = _discovery_file(disc_dir, sleepers[1].pid, tmp_path / "gone.sock")
        server = ControlServer(tmp_path / "new", rank=0, role="target", state_fn=dict, discovery_dir=disc_dir)
        server.start()
        try:
            assert not dead_file.exists() and not half_written.exists()
            assert not (disc_dir / f"rank0-{dead}.sock").exists()
            assert not unanswered.exists()
            assert kept.exists() and Path(server.discovery_path).exists()
            assert Path(live.discovery_path).exists()  # this process's own file is never touched
            assert query(live.socket_path, "ping")["ok"] is True
        finally:
            server.close()
    finally:
        for sleeper in sleepers:
            sleeper.kill()
            sleeper.wait()
        live.close()


@pytest.mark.skipif(os.getuid() != 0, reason="chown to another uid needs root")
def test_clean_stale_discovery_keeps_other_uids_files(tmp_path):
    directory = tmp_path / "d"
    theirs = _discovery_file(directory, _dead_pid(), tmp_path / "x.sock")
    os.chown(theirs, 12345, 12345)  # as root: a file of another uid, dead pid
    assert clean_stale_discovery(directory) == []
    assert theirs.exists()


@pytest.mark.parametrize("planted", ["symlink", "other_user"])
def test_a_planted_discovery_dir_is_refused_and_the_endpoint_serves_without_it(tmp_path, caplog, planted):
    """Issue 34 row 3: a link (or another user's directory) planted at the discovery path is never
    chmodded or cleaned; the endpoint says so in one line and still answers on its run-dir socket."""
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o755)
    os.chmod(victim, 0o755)
    (victim / "123.json").write_text("{}")        # a dead pid's name: clean_stale_discovery would take it
    disc = tmp_path / "disc"
    if planted == "symlink":
        disc.symlink_to(victim)
    else:
        if os.getuid() != 0:
            pytest.skip("chown to another uid needs root")
        disc.mkdir(mode=0o755)
        (disc / "123.json").write_text("{}")
        os.chown(disc, 65534, 65534)
        victim = disc
    server = ControlServer(tmp_path / "run", rank=0, role="main", state_fn=lambda: {"step": 1}, discovery_dir=disc)
    with caplog.at_level("WARNING", logger="profiler"):
        server.start()
    try:
        assert query(server.socket_path) == {"ok": True, "state": {"step": 1}}
        assert server.discovery_path is None
        warned = [r.getMessage() for r in caplog.records if "discovery" in r.getMessage()]
        assert len(warned) == 1 and str(disc) in warned[0]
    finally:
        server.close()
    assert stat.S_IMODE(os.stat(victim).st_mode) == 0o755
    assert (victim / "123.json").exists()
    assert clean_stale_discovery(disc) == [] and (victim / "123.json").exists()


def test_a_discovery_file_the_disk_cannot_take_is_one_warning_and_the_endpoint_serves_on(tmp_path, caplog,
                                                                                          monkeypatch):
    """Issue 34 row 7: a full /tmp while the discovery file is written: one warning line, no traceback, no
    temporary file left, and the endpoint still answers on its run-dir socket."""
    import errno
    import io

    class Full(io.StringIO):
        def write(self, text):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def full_fdopen(fd, mode="r"):
        os.close(fd)
        return Full()
    monkeypatch.setattr("profiler.control.os.fdopen", full_fdopen)
    disc = tmp_path / "disc"
    server = ControlServer(tmp_path / "run", rank=0, role="main", state_fn=lambda: {"step": 1}, discovery_dir=disc)
    with caplog.at_level("WARNING", logger="profiler"):
        server.start()
    try:
        assert server.error is None and query(server.socket_path) == {"ok": True, "state": {"step": 1}}
        warned = [r.getMessage() for r in caplog.records]
        assert server.discovery_path is None and len(warned) == 1 and "No space left on device" in warned[0]
        assert list(disc.iterdir()) == []
    finally:
        server.close()


def test_idle_clients_do_not_stop_it_serving_and_each_gets_its_deadline(tmp_path, disc_dir):
    """Issue 46: 10 same-uid connections that send nothing (or a byte now and then) held the one server thread
    (and filled the backlog of 8): the snapshot degraded to stacks only for 20 s. Now every request is answered as
    soon as its line is in, and an idle connection is closed CLIENT_TIMEOUT_S after it connected."""
    import time

    from profiler import control
    server = ControlServer(tmp_path / "run", rank=0, role="drafter", state_fn=lambda: {"step": 3},
                           discovery_dir=disc_dir)
    server.start()
    idle = []
    try:
        for i in range(10):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(server.socket_path)
            if i % 2:
                s.sendall(b'{"cmd": ')   # half a request, the rest never sent
            idle.append(s)
        for _ in range(3):
            t = time.monotonic()
            assert query(server.socket_path, "state", timeout_s=1.0) == {"ok": True, "state": {"step": 3}}
            assert time.monotonic() - t < 0.5
        for s in idle:   # each one closed at its deadline: the server's end of stream
            s.settimeout(control.CLIENT_TIMEOUT_S + 2.0)
            assert s.recv(1) == b""
    finally:
        for s in idle:
            s.close()
        server.close()


def test_a_request_split_across_sends_is_answered(tmp_path, disc_dir):
    server = ControlServer(tmp_path / "run", rank=0, role="drafter", state_fn=lambda: {"step": 3},
                           discovery_dir=disc_dir)
    server.start()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(2.0)
            s.connect(server.socket_path)
            for part in (b'{"cmd"', b': "ping"', b"}\n"):
                s.sendall(part)
            assert json.loads(s.makefile("rb").readline())["rank"] == 0
    finally:
        server.close()
