"""The run log: RUN_DIR/profile/rank{R}.jsonl, one JSON object per line, written whole, with room kept
past its end for its `run_end` when the disk fills."""
from __future__ import annotations

import ctypes
import errno
import functools
import json
import math
import os
import platform
import socket
import sys
import threading
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from profiler.schema.records import RUN_END, RUN_START, read_records  # noqa: F401 - the reader lives beside the writer

RESERVE_BYTES = 128 * 1024
"""Space the log keeps allocated past its end (topped up once half of it is used): when a top-up finds the disk
full, the log takes only its frame (`run_start`, `run_end`) from then on, into the half still reserved."""
FALLOC_FL_KEEP_SIZE = 1   # linux/falloc.h: allocate past the end, the file's size unchanged
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def is_disk_full(exc: BaseException) -> bool:
    """Whether `exc` is a write that found no space (a full disk or an exhausted quota)."""
    return isinstance(exc, OSError) and exc.errno in _DISK_FULL


@functools.cache
def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    return libc


def keep_size_reserve(fd: int, offset: int, length: int) -> None:
    """Allocate [offset, offset + length) of `fd` without changing its size (Linux fallocate KEEP_SIZE); an
    OSError where it cannot (ENOSPC: the disk is full; EOPNOTSUPP: the file system keeps no reserve)."""
    if not sys.platform.startswith("linux"):
        raise OSError(errno.EOPNOTSUPP, "no fallocate on this platform")
    if _libc().fallocate(fd, FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


class RunLog:
    """Appends records as whole lines from any thread, under a lock. A write the disk cannot take is cut back
    to the last whole line, never left half written; the first such failure (or a reserve top-up that finds the
    disk full) is kept as `full`, and from then on only `run_start` and `run_end` are written, into the space
    reserved past the end; the rest are counted in `dropped`. Any other OSError is raised, the line cut back."""

    def __init__(self, path, reserve_bytes: int = RESERVE_BYTES, reserve=keep_size_reserve):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._f = open(self.path, "ab", buffering=0)
        self._size = os.fstat(self._f.fileno()).st_size
        self._reserve, self._reserve_bytes, self._reserved_to = reserve, reserve_bytes, self._size
        self.full: OSError | None = None
        """The write or reserve top-up that found the disk full (errno ENOSPC or EDQUOT, filename the log)."""
        self.dropped = 0
        """Records not written since `full`."""
        self._top_up()

    def write(self, record: dict) -> dict:
        """Append one record; returns it as written (non-finite floats null), so every consumer sees the log's."""
        try:
            text = json.dumps(record, default=_json_default, allow_nan=False)
        except ValueError:   # a NaN/Inf somewhere: never write bare NaN (not JSON)
            record = finite_only(record)
            text = json.dumps(record, default=_json_default, allow_nan=False)
        line = (text + "\n").encode()
        with self._lock:
            if self._f is None:
                raise ValueError(f"run log {self.path} is closed")
            if self.full is not None and record.get("type") not in (RUN_START, RUN_END):
                self.dropped += 1
            else:
                self._append(line)
        return record

    def _append(self, line: bytes) -> None:
        fd, done = self._f.fileno(), 0
        try:
            while done < len(line):   # a short write is retried: the next one says why it fell short
                done += os.write(fd, line[done:])
        except OSError as exc:
            os.ftruncate(fd, self._size)   # the part that got in goes: never half a line
            if not is_disk_full(exc):
                raise
            self._mark_full(exc)
            self.dropped += 1
            return
        self._size += done
        if self.full is None and self._size + self._reserve_bytes // 2 > self._reserved_to:
            self._top_up()

    def _top_up(self) -> None:
        if self._reserve is None:
            return
        try:
            self._reserve(self._f.fileno(), self._size, self._reserve_bytes)
        except OSError as exc:
            if is_disk_full(exc):
                self._mark_full(exc)
            else:   # this file system keeps no reserve: run_end then needs whatever space is left
                self._reserve = None
            return
        self._reserved_to = self._size + self._reserve_bytes

    def _mark_full(self, exc: OSError) -> None:
        self.note_full(OSError(exc.errno, os.strerror(exc.errno), str(self.path)))

    def note_full(self, exc: OSError) -> None:
        """Take `exc` (a write of this run that found the disk full, `filename` the file) as the log's own full
        disk, unless it found one first: from now on only the frame is written, into the reserve."""
        if self.full is None:
            self.full = exc

    def close(self) -> None:
        """Close; the reserve past the end is given back (the file keeps its size)."""
        with self._lock:
            if self._f is not None:
                if self._reserved_to > self._size:
                    try:
                        os.ftruncate(self._f.fileno(), self._size)
                    except OSError:
                        pass
                self._f.close()
                self._f = None


def finite_only(obj):
    """A copy of `obj` with every NaN/Inf float None; each dict that held one gains `"reasons": {key:
    "non-finite: nan"}` (a list element is named `key[i]`)."""
    if isinstance(obj, dict):
        out, reasons = {}, {}
        for k, v in obj.items():
            if isinstance(v, float) and not math.isfinite(v):
                out[k], reasons[k] = None, f"non-finite: {v}"
            elif isinstance(v, list):
                out[k] = [None if isinstance(x, float) and not math.isfinite(x) else finite_only(x) for x in v]
                reasons.update({f"{k}[{i}]": f"non-finite: {x}" for i, x in enumerate(v)
                                if isinstance(x, float) and not math.isfinite(x)})
            else:
                out[k] = finite_only(v)
        if reasons:
            out["reasons"] = {**(out.get("reasons") or {}), **reasons}
        return out
    if isinstance(obj, (list, tuple)):
        return [finite_only(x) for x in obj]
    if hasattr(obj, "item") and getattr(obj, "ndim", 1) == 0 and type(obj).__module__.startswith("numpy"):
        v = obj.item()
        return None if isinstance(v, float) and not math.isfinite(v) else v
    return obj


def _json_default(obj):
    """Paths, devices, dataclass-like configs and numpy scalars -> JSON; anything else as str."""
    if hasattr(obj, "item") and callable(obj.item) and getattr(obj, "ndim", 1) == 0 \
            and type(obj).__module__.startswith("numpy"):
        return obj.item()
    if isinstance(obj, (set, frozenset)):
        return list(obj)
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    return str(obj)


def host_fields(device, is_cuda: bool) -> dict:
    """What run_start says about the process and its machine: versions, pid, host, device."""
    try:
        import torch
        torch_version = torch.__version__
        device_name = (torch.cuda.get_device_name(device) if is_cuda
                       else platform.processor() or platform.machine() or "cpu")
    except Exception as exc:   # noqa: BLE001
        torch_version, device_name = None, f"unknown ({type(exc).__name__})"
    try:
        package_version = version("dflash-observability")
    except PackageNotFoundError:   # running from a source tree without installing
        package_version = None
    return {"version": package_version, "pid": os.getpid(), "hostname": socket.gethostname(),
            "python_version": platform.python_version(), "torch_version": torch_version,
            "device": str(device) if device is not None else "cpu", "device_name": device_name}
