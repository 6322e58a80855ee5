"""Per-rank control endpoint: a Unix socket a live process answers queries on, found through the discovery
file /tmp/dflash-$UID/PID.json (`dflash-profile snapshot --pid PID`).

Protocol: one JSON line in, one out ({"ok": true, ...} or {"ok": false, "error": "..."}), then the server
closes the connection. `ControlServer.commands` maps each command to its handler: "ping" -> pid, rank, role;
"state" -> {"state": state_fn()}; "record" with "fields" -> record_fn(fields) writes a record into the rank's own
run log (the process stays its log's single writer); the profiler adds "capture" and "memory" (profiler/capture.py,
profiler/allocator_snapshot.py). Only the owning user (or root) can connect: socket 0600, discovery dir 0700, the
peer's uid checked. A starting server removes this uid's discovery files of dead endpoints.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import selectors
import socket
import stat
import struct
import threading
import time
from pathlib import Path

logger = logging.getLogger("profiler")

# sockaddr_un.sun_path is 108 bytes on Linux, including the terminating NUL.
MAX_SOCKET_PATH_BYTES = 107
MAX_REQUEST_BYTES = 4 * 1024 * 1024   # a `record` request carries a snapshot (every thread's stack)
MAX_REPLY_BYTES = 64 * 1024 * 1024    # a `state` reply carries the last interval record
CLIENT_TIMEOUT_S = 2.0   # a client's whole request, from connecting, and the send of its reply
MAX_CLIENTS = 64         # connections held at once: one more drops the oldest
ACCEPT_RETRY_S = 0.2  # pause after a failed accept() (close() wakes a blocked one with shutdown())


def default_discovery_dir(directory=None) -> Path:
    """`directory` when given, else /tmp/dflash-$UID."""
    return Path(directory) if directory is not None else Path("/tmp") / f"dflash-{os.getuid()}"


def _private_dir(path: Path) -> Path:
    """Create `path` (0700), or take an existing one only when it is a real directory owned by this user,
    then make it 0700. Checked and chmodded through a descriptor opened without following links, so a link
    or another user's directory at the name is refused (PermissionError) and nothing it points to touched."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        raise PermissionError(f"{path} is not a real directory (a symlink or a file): refused") from exc
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid():
            raise PermissionError(f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})")
        if st.st_mode & 0o777 != 0o700:
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)
    return path


def _nobody_listens(path: str) -> bool:
    """True only when connecting is refused or the socket file is gone: nobody will ever answer.
    A timeout (a listener too busy to accept, e.g. a hung process) is not proof of death."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(0.5)
    try:
        probe.connect(path)
        return False
    except (ConnectionRefusedError, FileNotFoundError, NotADirectoryError):
        return True
    except OSError as exc:
        return exc.errno == errno.ENOTSOCK
    finally:
        probe.close()


def pid_alive(pid: int) -> bool:
    """The process exists (another user's included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale_discovery(directory, own_pid: int | None = None) -> list[str]:
    """Remove this uid's discovery files (and their fallback sockets) whose process is dead or whose socket
    nobody listens on; returns the removed paths. A file that does not parse goes only when the pid in its
    name is dead; other uids' files and `own_pid`'s stay."""
    directory, removed = Path(directory), []
    try:
        st = os.lstat(directory)
    except OSError:
        return removed
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        return removed   # a link or another user's directory: nothing in it is ours to remove
    for path in sorted(directory.glob("*.json*")):
        pid_text = path.name.split(".", 1)[0]
        if not pid_text.isdigit() or int(pid_text) == own_pid:
            continue
        try:
            if path.lstat().st_uid != os.getuid():
                continue
            record = json.loads(path.read_text()) if path.name.endswith(".json") else None
        except (OSError, ValueError):
            record = None
        socket_path = record.get("socket_path") if isinstance(record, dict) else None
        dead = not pid_alive(int(pid_text)) or (isinstance(socket_path, str) and _nobody_listens(socket_path))
        if not dead:
            continue
        stale = [path]
        if isinstance(socket_path, str) and Path(socket_path).parent == directory:
            stale.append(Path(socket_path))  # a fallback socket: it lives in the discovery dir
        for item in stale:
            with contextlib.suppress(OSError):
                item.unlink()
                removed.append(str(item))
    return removed


def _read_line(conn: socket.socket, max_bytes: int = MAX_REQUEST_BYTES) -> bytes:
    """One message: the bytes up to its newline (or the end of the stream)."""
    with conn.makefile("rb") as stream:
        line = stream.readline(max_bytes + 1)
    if len(line) > max_bytes and not line.endswith(b"\n"):
        raise ValueError(f"message longer than {max_bytes} bytes without a newline")
    return line.rstrip(b"\n")


class ControlServer:
    """Unix-socket endpoint of one rank, served by a daemon thread, plus its discovery file."""

    def __init__(self, run_dir, rank: int, role: str, state_fn, record_fn=None, discovery_dir=None, commands=None):
        self.run_dir = Path(run_dir).resolve()
        self.rank = int(rank)
        self.role = str(role)
        self._state_fn = state_fn
        self._record_fn = record_fn  # fields -> writes a record (the profiler: write_record("snapshot", ...))
        # Command name -> handler(request) -> the reply's fields; a raising handler replies {"ok": false, "error"}.
        self.commands = {"ping": lambda request: {"pid": self.pid, "rank": self.rank, "role": self.role},
                         "state": lambda request: {"state": self._state_fn()},
                         "record": self._record, **(commands or {})}
        self.discovery_dir = default_discovery_dir(discovery_dir)
        self.pid = os.getpid()
        self.discovery_path = str(self.discovery_dir / f"{self.pid}.json")
        preferred = str(self.run_dir / "control" / f"rank{self.rank}.sock")
        self.socket_fallback = len(os.fsencode(preferred)) > MAX_SOCKET_PATH_BYTES
        self.socket_path = self._fallback_path() if self.socket_fallback else preferred
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.error: str | None = None  # why start() failed, if it did

    def _fallback_path(self) -> str:
        return str(self.discovery_dir / f"rank{self.rank}-{self.pid}.sock")

    def start(self) -> None:
        """Bind, write the discovery file and serve. A failure logs once and leaves the endpoint off, with
        the reason in self.error: telemetry never kills training."""
        try:
            self._start()
        except Exception as exc:  # noqa: BLE001
            self.error = f"{type(exc).__name__}: {exc}"
            logger.warning("control endpoint disabled: %s", self.error)
            self.close()

    def _start(self) -> None:
        if self.socket_fallback:
            _private_dir(self.discovery_dir)
        else:
            (self.run_dir / "control").mkdir(parents=True, exist_ok=True)
            if os.path.exists(self.socket_path) and not _nobody_listens(self.socket_path):
                # Another live process (same run dir and rank) owns it: do not steal it.
                logger.warning("control socket %s is in use by another process; using a /tmp path", self.socket_path)
                _private_dir(self.discovery_dir)
                self.socket_fallback = True
                self.socket_path = self._fallback_path()
        if os.path.lexists(self.socket_path):
            os.unlink(self.socket_path)  # stale socket of a dead process (e.g. a resumed run)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(self.socket_path)
            os.chmod(self.socket_path, 0o600)  # before listen(): nobody can connect before this
            sock.listen(MAX_CLIENTS)   # served by a blocking select(): no wakeups while idle
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._write_discovery()
        self._thread = threading.Thread(target=self._serve, name="profiler.control", daemon=True)
        self._thread.start()

    def _write_discovery(self) -> None:
        """The discovery file; without a discovery directory of our own the endpoint serves on without one."""
        try:
            _private_dir(self.discovery_dir)
        except OSError as exc:
            logger.warning("control endpoint: no discovery file: %s", exc)
            self.discovery_path = None
            return
        try:
            clean_stale_discovery(self.discovery_dir, own_pid=self.pid)
        except OSError as exc:
            logger.debug("control endpoint: cleaning stale discovery files failed: %s", exc)
        record = {"pid": self.pid, "rank": self.rank, "role": self.role, "run_dir": str(self.run_dir),
                  "socket_path": self.socket_path, "socket_fallback": self.socket_fallback,
                  "start_time_unix": time.time()}
        tmp = f"{self.discovery_path}.tmp"
        try:
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
                f.write(json.dumps(record) + "\n")
            os.replace(tmp, self.discovery_path)  # readers never see a half-written file
        except OSError as exc:   # a full /tmp: one line, and the endpoint serves on without the file
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            logger.warning("control endpoint: no discovery file: %s", exc)
            self.discovery_path = None

    def close(self) -> None:
        self._stop.set()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)   # wakes the server thread's blocked accept()
        if self._thread is not None:
            self._thread.join(timeout=ACCEPT_RETRY_S + CLIENT_TIMEOUT_S + 1.0)
            self._thread = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            # Only files this server created: the socket it bound and its own discovery file.
            for path in filter(None, (self.socket_path, self.discovery_path)):
                with contextlib.suppress(OSError):
                    os.unlink(path)

    # ---- server thread ------------------------------------------------------------------------
    def _serve(self) -> None:
        """One thread over every connection at once (a selector): a request is answered once its whole line is in,
        so clients that connect and send nothing, or trickle, never stop it serving the others; each has
        CLIENT_TIMEOUT_S from connecting for its whole request, and past MAX_CLIENTS the oldest is dropped."""
        sel = selectors.DefaultSelector()
        sel.register(self._sock, selectors.EVENT_READ)
        pending: dict = {}   # connection -> [bytes so far, deadline (monotonic s)], oldest first
        try:
            while not self._stop.is_set():
                wait_s = min((d for _, d in pending.values()), default=None)
                for key, _ in sel.select(None if wait_s is None else max(0.0, wait_s - time.monotonic())):
                    if key.fileobj is self._sock:
                        if not self._accept(sel, pending):
                            return
                    else:
                        self._receive(sel, pending, key.fileobj)
                now = time.monotonic()
                for conn in [c for c, (_, deadline) in pending.items() if deadline <= now]:
                    self._drop(sel, pending, conn)
        finally:
            for conn in list(pending):
                self._drop(sel, pending, conn)
            sel.close()

    def _accept(self, sel, pending: dict) -> bool:
        """Take one connection (False once the server is stopping); a foreign uid is answered at once."""
        try:
            conn, _ = self._sock.accept()
        except OSError as exc:
            if self._stop.is_set():
                return False
            logger.warning("control endpoint accept failed: %s", exc)
            time.sleep(ACCEPT_RETRY_S)
            return True
        uid = self._peer_uid(conn)
        if uid is not None and uid not in (os.getuid(), 0):
            self._answer(conn, {"ok": False, "error": f"uid {uid} may not query this process"})
            return True
        conn.setblocking(False)
        sel.register(conn, selectors.EVENT_READ)
        pending[conn] = [b"", time.monotonic() + CLIENT_TIMEOUT_S]
        if len(pending) > MAX_CLIENTS:
            self._drop(sel, pending, next(iter(pending)))
        return True

    def _receive(self, sel, pending: dict, conn: socket.socket) -> None:
        """Read what the connection has; answer it once its line (or its end of stream) is in."""
        try:
            data = conn.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = None
        if data is None or (not data and not pending[conn][0]):
            self._drop(sel, pending, conn)
            return
        got = pending[conn][0] + data
        pending[conn][0] = got
        if data and b"\n" not in data and len(got) <= MAX_REQUEST_BYTES:
            return
        self._drop(sel, pending, conn, close=False)
        if b"\n" not in got and len(got) > MAX_REQUEST_BYTES:
            reply = {"ok": False, "error": f"request is not a JSON line: message longer than {MAX_REQUEST_BYTES} "
                                           "bytes without a newline"}
        else:
            reply = self._reply(got.split(b"\n", 1)[0])
        self._answer(conn, reply)

    def _drop(self, sel, pending: dict, conn: socket.socket, close: bool = True) -> None:
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(conn)
        pending.pop(conn, None)
        if close:
            conn.close()

    def _answer(self, conn: socket.socket, reply: dict) -> None:
        """Send the reply within CLIENT_TIMEOUT_S (sendall's timeout bounds the whole send) and close."""
        try:
            conn.settimeout(CLIENT_TIMEOUT_S)
            conn.sendall(json.dumps(reply).encode() + b"\n")
        except OSError as exc:   # a client that hung up or does not read: nothing to report
            logger.debug("control endpoint client error: %s", exc)
        finally:
            conn.close()

    def _peer_uid(self, conn: socket.socket) -> int | None:
        try:
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        except (AttributeError, OSError):
            return None  # no SO_PEERCRED on this platform: the 0600 mode is the guard
        return struct.unpack("3i", creds)[1]

    def _reply(self, line: bytes) -> dict:
        try:
            request = json.loads(line)
        except ValueError as exc:
            return {"ok": False, "error": f"request is not a JSON line: {exc}"}
        cmd = request.get("cmd") if isinstance(request, dict) else None
        handler = self.commands.get(cmd)
        if handler is None:
            expected = ", ".join(map(repr, self.commands))
            return {"ok": False, "error": f"unknown cmd {cmd!r} (expected one of {expected})"}
        try:
            reply = handler(request)
            json.dumps(reply)  # fail here, with the reason, rather than half-way through sending
        except Exception as exc:  # noqa: BLE001 - a failing command never kills the server
            return {"ok": False, "error": f"{cmd} failed: {type(exc).__name__}: {exc}"}
        return {"ok": True, **reply}

    def _record(self, request: dict) -> dict:
        if self._record_fn is None:
            raise LookupError("this process does not record through its endpoint (no record_fn)")
        fields = request.get("fields")
        if not isinstance(fields, dict):
            raise TypeError(f"record needs a 'fields' object, got {type(fields).__name__}")
        self._record_fn(fields)
        return {}


class NullControlServer:
    """Stands in for ControlServer when the endpoint is off."""

    socket_path = None
    discovery_path = None

    def start(self) -> None:
        pass

    close = start


def query(socket_path: str, cmd: str = "state", timeout_s: float = 2.0, fields: dict | None = None) -> dict:
    """Ask a live endpoint (`fields` go with cmd="record"); a dead or missing one gives ok=false with why."""
    request = {"cmd": cmd} if fields is None else {"cmd": cmd, "fields": fields}
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(socket_path)
        sock.sendall(json.dumps(request).encode() + b"\n")
        line = _read_line(sock, MAX_REPLY_BYTES)
    except (OSError, ValueError) as exc:
        return {"ok": False, "error": f"control endpoint {socket_path}: {type(exc).__name__}: {exc}"}
    finally:
        sock.close()
    try:
        return json.loads(line)
    except ValueError as exc:
        return {"ok": False, "error": f"control endpoint {socket_path} sent a bad reply: {exc}"}


def discover(pid: int, discovery_dir=None) -> dict | None:
    """The discovery record of process `pid`, or None when it has none (no endpoint, or not ours)."""
    path = default_discovery_dir(discovery_dir) / f"{int(pid)}.json"
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        record = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"discovery file {path} is not valid JSON: {exc}") from None
    if not isinstance(record, dict) or record.get("pid") != int(pid):
        raise ValueError(f"discovery file {path} does not describe pid {pid}")
    return record


def discover_all(discovery_dir=None) -> list[dict]:
    """Every readable discovery record in the directory (any state: callers check liveness)."""
    directory = default_discovery_dir(discovery_dir)
    records = []
    for path in sorted(directory.glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # removed or rewritten under us, or not ours to read
        if isinstance(record, dict) and isinstance(record.get("pid"), int):
            records.append(record)
    return records
