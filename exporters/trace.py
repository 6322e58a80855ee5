"""The live per-rank Perfetto/Chrome trace: RUN_DIR/trace/rank{R}.json (trace layout: profiler.schema.trace_events)."""
from __future__ import annotations

import logging
import math
import threading
import time
from pathlib import Path

from profiler.schema import views
from profiler.runlog import is_disk_full
from profiler.schema.span_kinds import of_run_start
from profiler.schema.trace_events import (MAX_EVENTS, FlowSpans, build_trace, json_safe, newest_within, prepare, proc_info,
                                   write_trace)

logger = logging.getLogger("exporters")


class TraceExporter:
    """RUN_DIR/trace/rank{R}.json, rewritten atomically at `spans` records (at most WRITE_DUTY of a core: the
    exporter thread shares the GIL with training) and at close: the newest `max_events` slices and this rank's
    flow halves. stats(): spans records written (`exported`), evicted or never written (`dropped`), `failed`."""

    name = "trace"
    WRITE_DUTY = 0.005

    def __init__(self, run_dir, rank: int, max_events: int = MAX_EVENTS, clock=time.monotonic):
        self.rank, self.max_events, self._clock = int(rank), int(max_events), clock
        self.path = Path(run_dir) / "trace" / f"rank{self.rank}.json"
        self._proc = proc_info(self.rank, {})
        self._flows = FlowSpans.of(of_run_start(None).flows())   # the fallback's, until run_start gives the table
        self._chunks: list = []                      # (spans record, prepare() of it), oldest first
        self._seq = self._written_seq = 0            # spans records received / covered by the last write
        self._exported = self._dropped = self._evicted_spans = self._profiler_dropped = 0
        self._status = None
        self._last_write = (0.0, -math.inf)          # (seconds it took, when it ended)
        self._failed = self._logged = False
        self._lock = threading.Lock()

    def export(self, record: dict) -> None:
        rec = views.view(record)
        with self._lock:
            if isinstance(rec, views.RunStart):
                self._proc = proc_info(self.rank, record)
                self._flows = FlowSpans.of(of_run_start(record).flows())
            elif isinstance(rec, views.RunEnd):
                self._status = rec.status
            elif isinstance(rec, views.DetailWindow):
                self._keep(record, rec.dropped)
                took, ended = self._last_write
                if self._clock() - ended >= took / self.WRITE_DUTY:
                    self._write()

    def _keep(self, record: dict, dropped: int) -> None:
        """Add a spans record (`dropped`: the profiler's count of its spans not kept), evicting the oldest ones over
        the bound (a trimmed record is re-prepared)."""
        self._seq += 1
        self._profiler_dropped += dropped or 0
        chunks = self._chunks + [(record, None)]
        kept, n_records, n_spans = newest_within([r for r, _ in chunks], self.max_events)
        self._chunks = [(r, prep if r is orig and prep is not None else prepare(self.rank, r, self._flows))
                        for r, (orig, prep) in zip(kept, chunks[len(chunks) - len(kept):])]
        self._dropped += n_records
        self._evicted_spans += n_spans

    def _unwritten(self) -> int:
        return min(len(self._chunks), self._seq - self._written_seq)

    def _write(self) -> bool:
        t0 = self._clock()
        try:
            return self._write_now()
        finally:
            self._last_write = (self._clock() - t0, self._clock())

    def _write_now(self) -> bool:
        events, counts = build_trace([self._proc], [prep for _, prep in self._chunks], halves=True)
        meta = {"source": "TraceExporter (live, this rank only)", "timebase": "Unix microseconds",
                **{k: v for k, v in self._proc.items() if k != "rank"}, "rank": self.rank,
                "status": self._status, **counts, "evicted_spans": self._evicted_spans,
                "profiler_dropped_spans": self._profiler_dropped,
                "flows": "this rank's flow halves, each under the id its pair has: the arrows need both ranks "
                         "(dflash-report trace RUN_DIR joins them)"}
        try:
            write_trace(self.path, events, json_safe(meta))
        except OSError as exc:
            self._failed = True
            if not self._logged and not is_disk_full(exc):   # a full disk: the rank stops and says it
                self._logged = True
                logger.warning("trace exporter: cannot write %s (logged once; it retries at the next spans "
                               "record, and counts what never gets written as dropped): %s", self.path, exc)
            return False
        self._exported += self._unwritten()
        self._written_seq = self._seq
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Write the final file (once; a write in progress cannot be cut short, so timeout_s is advisory)."""
        with self._lock:
            if self._seq or self._proc.get("role") is not None:
                if not self._write():
                    self._dropped += self._unwritten()
                    self._written_seq = self._seq

    def stats(self) -> dict:
        return {"exported": self._exported, "dropped": self._dropped, "failed": self._failed}
