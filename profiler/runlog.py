"""The run log: RUN_DIR/profile/rank{R}.jsonl, one JSON object per line, written whole."""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from profiler.records import read_records  # noqa: F401 - the reader lives beside the writer


class RunLog:
    """Appends records as whole lines from any thread: each is json.dumps(record) + "\\n" written
    with ONE write call on a file opened in append mode (O_APPEND), under a lock, then flushed."""

    def __init__(self, path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        # Unbuffered binary: the single write() below is a single os.write of the whole line.
        self._f = open(self.path, "ab", buffering=0)

    def write(self, record: dict) -> None:
        line = (json.dumps(record, default=_json_default) + "\n").encode()
        with self._lock:
            if self._f is None:
                raise ValueError(f"run log {self.path} is closed")
            self._f.write(line)
            self._f.flush()

    def close(self) -> None:
        with self._lock:
            if self._f is not None:
                self._f.close()
                self._f = None


def _json_default(obj):
    """Paths, devices, dataclass-like configs and numpy scalars -> JSON; anything else as str."""
    if hasattr(obj, "item") and callable(obj.item) and getattr(obj, "ndim", 1) == 0 \
            and type(obj).__module__.startswith("numpy"):
        return obj.item()
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    return str(obj)
