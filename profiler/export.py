"""The exporter contract: records reach exporters on ONE exporter thread through a bounded queue.

Never on a training thread, never under a profiler lock: `submit(record)` is one `put_nowait` (a full queue
drops the record for every exporter, counted). An exporter that raises is logged once, marked failed, counts
the record dropped and keeps receiving records. `close(timeout_s)` drains the queue and closes each exporter
within one deadline; one still busy then is abandoned (the thread is a daemon). An exporter's optional
`stats()` ({"exported", "dropped", "failed"}) is merged into the hub's.
"""
from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Protocol, runtime_checkable
from collections.abc import Iterable

logger = logging.getLogger("profiler")

DEFAULT_QUEUE_RECORDS = 1024
_STOP = object()


@runtime_checkable
class Exporter(Protocol):
    """What the profiler feeds, after the OpenTelemetry SDK's `SpanExporter`: one object per sink, fed every run
    log record (docs/RUNLOG.md) one at a time; `close(timeout_s)` is shutdown and flush in one."""

    name: str
    """The exporter's key in the `exporters` stats of interval and run_end records."""

    def export(self, record: dict) -> None:
        """Take one record; raise on failure. Never called concurrently, never on a training thread."""

    def close(self, timeout_s: float) -> None:
        """Flush and release within timeout_s; no export() follows."""


@dataclass
class _Slot:
    """Book-keeping for one exporter."""
    exporter: Exporter
    exported: int = 0
    dropped: int = 0
    failed: bool = False
    logged: bool = False


class ExportHub:
    """Fans records out to exporters from one daemon thread `profiler.exporter`."""

    def __init__(self, exporters: Iterable[Exporter] = (), maxsize: int = DEFAULT_QUEUE_RECORDS):
        self._slots = [_Slot(e) for e in exporters]
        self._queue: queue.Queue = queue.Queue(maxsize=maxsize)
        self.queue_dropped = 0
        self._thread = None

    def start(self) -> None:
        if self._slots and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="profiler.exporter", daemon=True)
            self._thread.start()

    def submit(self, record: dict) -> None:
        """Queue a record for every exporter; never blocks (a full queue drops it, counted)."""
        if self._thread is None:
            return
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self.queue_dropped += 1

    def _run(self) -> None:
        while True:
            record = self._queue.get()
            if record is _STOP:
                return
            for slot in self._slots:
                self._export_one(slot, record)

    def _export_one(self, slot: _Slot, record: dict) -> None:
        try:
            slot.exporter.export(record)
            slot.exported += 1
        except Exception as exc:   # noqa: BLE001 - an exporter failing must not stop the others
            slot.dropped += 1
            slot.failed = True
            if not slot.logged:
                slot.logged = True
                logger.warning("exporter %s failed (logged once; its records are dropped and counted): %s: %s",
                               _name(slot.exporter), type(exc).__name__, exc)

    def close(self, timeout_s: float = 5.0) -> dict:
        """Drain the queue and close every exporter within `timeout_s` overall; returns stats()."""
        deadline = time.monotonic() + timeout_s
        if self._thread is not None:
            with contextlib.suppress(queue.Full):
                self._queue.put(_STOP, timeout=max(0.0, deadline - time.monotonic()))
            self._thread.join(max(0.0, deadline - time.monotonic()))
            if self._thread.is_alive():
                logger.warning("exporters did not drain within %.1f s; %d records left behind",
                               timeout_s, self._queue.qsize())
        for slot in self._slots:
            try:
                slot.exporter.close(max(0.1, deadline - time.monotonic()))
            except Exception as exc:   # noqa: BLE001
                slot.failed = True
                logger.warning("exporter %s failed to close: %s: %s", _name(slot.exporter), type(exc).__name__, exc)
        self._thread = None
        return self.stats()

    def stats(self) -> dict:
        """{exporter name: {"exported", "dropped", "failed"}}; queue drops count against every one."""
        out = {}
        for slot in self._slots:
            try:
                own = dict(getattr(slot.exporter, "stats", dict)())
            except Exception:   # noqa: BLE001 - stats are telemetry too
                own = {}
            out[_name(slot.exporter)] = {
                "exported": slot.exported,
                "dropped": slot.dropped + self.queue_dropped + int(own.get("dropped", 0) or 0),
                "failed": slot.failed or bool(own.get("failed", False))}
        return out


def _name(exporter) -> str:
    return getattr(exporter, "name", None) or type(exporter).__name__
