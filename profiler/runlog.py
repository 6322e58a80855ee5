"""The run log: RUN_DIR/profile/rank{R}.jsonl, one JSON object per line, written whole."""
from __future__ import annotations

import json
import math
import os
import platform
import socket
import threading
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from profiler.records import read_records  # noqa: F401 - the reader lives beside the writer


class RunLog:
    """Appends records as whole lines from any thread: one write call per line, O_APPEND, under a lock."""

    def __init__(self, path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        # Unbuffered binary: the single write() below is a single os.write of the whole line.
        self._f = open(self.path, "ab", buffering=0)

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
            self._f.write(line)
            self._f.flush()
        return record

    def close(self) -> None:
        with self._lock:
            if self._f is not None:
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
