"""Perfetto / Chrome trace: per-thread span timelines of the detail windows (docs/RUNLOG.md, `spans`).

Trace-event JSON (Chrome's JSON Object Format), viewable in ui.perfetto.dev and chrome://tracing:

  process  pid = rank + 1 (Perfetto treats pid 0 as the kernel's idle process, so rank 0 cannot be
           pid 0), named "rank R (role) host", ordered by rank
  thread   tid = the span's OS thread id (`tid`), named after the thread; a span's GPU time goes on a
           second track of that thread, tid + GPU_TID_OFFSET, named "<thread> (GPU)". Tids are unique
           across the file (ranks on different hosts may share an OS thread id: the later one gets a
           synthetic tid and "(tid N)" in its name)
  slice    "X" per span, ts/dur in integer Unix microseconds (so every rank shares one timebase; both
           ends are floored, so spans nested on a thread stay nested); args: id, parent, depth, steps,
           cpu_seconds, gpu_seconds, bytes, achieved GB/s, attrs. A GPU slice starts at the span's
           `gpu_start_unix_ns` when the record has one, else at its CPU start, and says so in its args
  flow     "s" at the start of a `transfer.send` tagged `flow`, "f" (bp "e") at the start of the
           `drafter.recv` with the same flow string, each listed right after its slice: Perfetto binds a
           v1 flow event to the slice most recently begun on its track; id = a stable 48-bit hash of
           the string, name "batch", cat "transfer"

A track whose slices would overlap without nesting (GPU slices placed at their CPU start can) gets
extra lanes ("<track> [overlap N]"), so every track holds properly nested "X" events.

Two producers: `TraceExporter` (the live per-rank file RUN_DIR/trace/rank{R}.json, rewritten at each
`spans` record) and `merge_traces` (one file for every rank, rebuilt from the run logs, so it works
after a crash too): `python -m exporters.trace merge RUN_DIR [-o FILE]`. Standard library only.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import math
import os
import sys
import threading
import time
import zlib
from pathlib import Path

from profiler.records import RUN_END, RUN_START, SPANS, check_schema, of_type, read_run_dir

logger = logging.getLogger("exporters")

MAX_EVENTS = 500_000              # slices kept per trace file; the oldest spans records go first
GPU_TID_OFFSET = 1 << 30          # GPU track of thread T: T + offset (Linux thread ids stay below 2**22)
OVERLAP_TID_BASE = 1 << 29        # extra lanes, and a thread whose id a track already took
FLOW_START, FLOW_END, FLOW_CAT = "transfer.send", "drafter.recv", "transfer"
GPU_START_UNKNOWN = "unknown; aligned to CPU start"
PROG = "python -m exporters.trace"


class TraceInputError(ValueError):
    """A run directory a trace cannot be built from (missing, foreign, empty, newer schema)."""


# ---------------------------------------------------------------- one span -> slices

def _num(x):
    """x if it is a finite number (not a bool), else None."""
    ok = isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
    return x if ok else None


def _json_safe(v):
    """Non-finite floats -> None, recursively (trace files must stay valid JSON)."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {str(k): _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    return v


def trace_pid(rank: int) -> int:
    """The trace's pid for a rank (Perfetto gives pid 0 the kernel idle process's special handling)."""
    return int(rank) + 1


def flow_id(flow: str) -> int:
    """A stable integer id for a flow string (48 bits: exact in JSON readers that use doubles)."""
    return int.from_bytes(hashlib.blake2b(flow.encode(), digest_size=6).digest(), "big")


def _thread_key(entry: dict) -> tuple[int, str]:
    """(tid, name) of a span's thread; a stable stand-in id when the record has no usable `tid`."""
    name = str(entry.get("thread") or "thread")
    tid = entry.get("tid")
    if not isinstance(tid, int) or isinstance(tid, bool) or not 0 <= tid < OVERLAP_TID_BASE:
        tid = zlib.crc32(name.encode()) % (1 << 22)
    return tid, name


def _span_args(entry: dict, steps) -> dict:
    """The CPU slice's args: identity, times, bytes and achieved bandwidth, the step window, tags."""
    cpu, gpu, nbytes = (_num(entry.get(k)) for k in ("cpu_seconds", "gpu_seconds", "bytes"))
    args = {"id": _json_safe(entry.get("id")), "parent": _json_safe(entry.get("parent")),
            "depth": _num(entry.get("depth")),
            "cpu_seconds": cpu, "gpu_seconds": gpu, "bytes": nbytes}
    seconds, on = (gpu, "gpu") if gpu else (cpu, "cpu")
    if nbytes and seconds and seconds > 0:
        args["achieved_gb_per_s"] = round(nbytes / seconds / 1e9, 3)
        args["achieved_on"] = on
    if steps:
        args["steps"] = steps
    if entry.get("attrs"):
        args["attrs"] = _json_safe(entry["attrs"])
    return {k: v for k, v in args.items() if v is not None}


def span_slices(entry: dict, steps=None) -> list | None:
    """One `spans` entry -> [("cpu", X event), ("gpu", X event)?] without pid/tid; None when the entry
    has no start/end time. `steps` is the record's step window, already JSON-safe."""
    start, end = _num(entry.get("start_unix_ns")), _num(entry.get("end_unix_ns"))
    if start is None or end is None:
        return None
    start, end = int(start), int(end)
    name = str(entry.get("name") or "span")
    cat = name.split(".")[0]
    ts = start // 1000
    out = [("cpu", {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": max(0, end // 1000 - ts),
                    "args": _span_args(entry, steps)})]
    gpu = _num(entry.get("gpu_seconds"))
    if gpu is not None and gpu >= 0:
        args = {k: v for k, v in (("id", _json_safe(entry.get("id"))), ("depth", _num(entry.get("depth"))),
                                  ("gpu_seconds", gpu)) if v is not None}
        g0 = _num(entry.get("gpu_start_unix_ns"))
        if g0 is None:
            g0, args["gpu_start"] = start, GPU_START_UNKNOWN
        g0 = int(g0)
        gts = g0 // 1000
        out.append(("gpu", {"ph": "X", "name": name, "cat": cat + ",gpu", "ts": gts,
                            "dur": max(0, (g0 + round(gpu * 1e9)) // 1000 - gts), "args": args}))
    return out


def _cost(entry) -> int:
    """Slices a span entry becomes (the unit of the event bound)."""
    return 1 + (isinstance(entry, dict) and _num(entry.get("gpu_seconds")) is not None)


def newest_within(records: list, max_events: int) -> tuple[list, int, int]:
    """Keep the newest spans records whose slices fit in max_events -> (kept, records evicted, spans
    evicted). A record larger than the whole bound keeps its latest spans (a trimmed copy)."""
    kept, used = [], 0
    for i in range(len(records) - 1, -1, -1):
        spans = records[i].get("spans") or []
        cost = sum(_cost(s) for s in spans)
        if used + cost <= max_events:
            kept.append(records[i])
            used += cost
            continue
        evicted = sum(len(r.get("spans") or []) for r in records[:i])
        if kept:
            return kept[::-1], i + 1, evicted + len(spans)
        n = len(spans)
        while n and used + _cost(spans[n - 1]) <= max_events:
            n -= 1
            used += _cost(spans[n])
        return [{**records[i], "spans": spans[n:]}], i, evicted + n
    return kept[::-1], 0, 0


# ---------------------------------------------------------------- slices -> trace events

def prepare(rank: int, record: dict) -> dict:
    """One spans record -> its slices keyed by track, its flow halves and its counts. Built once per
    record: the live exporter keeps them between rewrites (build_trace only sets their tids)."""
    items, flows, spans, bad = [], [], 0, 0
    steps, pid = _json_safe(record.get("steps")), trace_pid(rank)
    for entry in record.get("spans") or ():
        slices = span_slices(entry, steps) if isinstance(entry, dict) else None
        if slices is None:
            bad += 1
            continue
        spans += 1
        tid, thread = _thread_key(entry)
        for kind, ev in slices:
            ev["pid"] = pid
            items.append(((rank, tid, thread, kind), ev))
        attrs, cpu = entry.get("attrs"), slices[0][1]
        if isinstance(attrs, dict) and attrs.get("flow") is not None and cpu["name"] in (FLOW_START, FLOW_END):
            flows.append((str(attrs["flow"]), cpu["name"] == FLOW_START, cpu))
    return {"items": items, "flows": flows, "spans": spans, "bad_spans": bad}


def build_trace(procs: list, prepared: list) -> tuple[list, dict]:
    """procs: [{"rank", "role", "host"}] (one process each); prepared: prepare() of their spans records
    -> (traceEvents, counts). Events: process and thread metadata, then each track's slices and flow
    points in ts order."""
    tracks, flows, counts = {}, [], {"spans": 0, "bad_spans": 0}
    for prep in prepared:
        for key, ev in prep["items"]:
            tracks.setdefault(key, []).append(ev)
        flows += prep["flows"]
        counts["spans"] += prep["spans"]
        counts["bad_spans"] += prep["bad_spans"]
    meta, slices = _layout(tracks)
    flow_events, counts["flows_matched"], counts["flows_unmatched"] = _flow_events(flows)
    timed = slices + flow_events
    timed.sort(key=lambda e: (e["pid"], e["tid"], e["ts"], e["ph"] != "X", -e.get("dur", 0),
                              e.get("args", {}).get("depth") or 0))
    counts["events"] = len(timed)
    return _process_metadata(procs) + meta + timed, counts


def _slice_order(ev: dict) -> tuple:
    return ev["ts"], -ev["dur"], ev["args"].get("depth") or 0


def _lanes(slices: list) -> list:
    """Split one track's slices into lanes in which any two slices are disjoint or nested. CPU spans of
    a thread always nest (one lane); GPU slices placed at their CPU start may not."""
    slices.sort(key=_slice_order)
    lanes, stacks = [], []           # per lane: its slices, and the end times of its open slices
    for ev in slices:
        end = ev["ts"] + ev["dur"]
        for lane, stack in zip(lanes, stacks):
            while stack and stack[-1] <= ev["ts"]:
                stack.pop()
            if not stack or end <= stack[-1]:
                lane.append(ev)
                stack.append(end)
                break
        else:
            lanes.append([ev])
            stacks.append([end])
    return lanes


def _layout(tracks: dict) -> tuple[list, list]:
    """Give every lane of every track a tid -> (thread metadata events, slices with pid/tid)."""
    first = {}
    for (rank, tid, thread, _), evs in tracks.items():
        t0 = min(e["ts"] for e in evs)
        first[(rank, tid, thread)] = min(t0, first.get((rank, tid, thread), t0))
    order = sorted(tracks, key=lambda k: (k[0], first[k[:3]], k[1], k[2], k[3]))
    taken, sort_index, meta, slices = set(), {}, [], []     # tids are unique across processes
    for key in order:
        rank, tid, thread, kind = key
        pid = trace_pid(rank)
        for i, lane in enumerate(_lanes(tracks[key])):
            preferred = (tid if kind == "cpu" else tid + GPU_TID_OFFSET) if i == 0 else None
            lane_tid = _claim(taken, preferred)
            label = (thread + (f" (tid {tid})" if i == 0 and lane_tid != preferred else "")
                     + (" (GPU)" if kind == "gpu" else "") + (f" [overlap {i}]" if i else ""))
            sort_index[pid] = sort_index.get(pid, -1) + 1
            meta.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": lane_tid, "args": {"name": label}})
            meta.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": lane_tid,
                         "args": {"sort_index": sort_index[pid]}})
            for ev in lane:
                ev["tid"] = lane_tid
            slices.extend(lane)
    return meta, slices


def _claim(taken: set, preferred) -> int:
    """The preferred tid if no track has it yet, else the next free synthetic one."""
    tid = preferred
    if tid is None or tid in taken:
        tid = OVERLAP_TID_BASE
        while tid in taken:
            tid += 1
    taken.add(tid)
    return tid


def _flow_events(flows: list) -> tuple[list, int, int]:
    """Flow event pairs ("s", "f") from each transfer.send to its drafter.recv -> (events, matched,
    unmatched).
    The i-th send of a flow string pairs with its i-th receive in time order (a resumed run may reuse
    a batch id); a half with no partner (the other rank's log is absent) is counted, not drawn."""
    by_flow = {}
    for flow, is_start, ev in flows:
        by_flow.setdefault(flow, ([], []))[0 if is_start else 1].append(ev)
    out, matched, unmatched = [], 0, 0
    for flow, (starts, ends) in by_flow.items():
        starts.sort(key=_slice_order)
        ends.sort(key=_slice_order)
        n = min(len(starts), len(ends))
        unmatched += len(starts) + len(ends) - 2 * n
        matched += n
        for i in range(n):
            fid = flow_id(flow if i == 0 else f"{flow}#{i}")
            out.append(_flow_point("s", starts[i], fid, flow))
            out.append(_flow_point("f", ends[i], fid, flow))
    return out, matched, unmatched


def _flow_point(ph: str, sl: dict, fid: int, flow: str) -> dict:
    """A flow event at the start of slice `sl`. Perfetto binds it to the slice begun last on the track
    (finished children stay on its stack until the next slice begins), so a point later inside `sl`
    could bind to a child; at the start it follows `sl` itself in ts order (X events sort first)."""
    ev = {"ph": ph, "name": "batch", "cat": FLOW_CAT, "id": fid, "pid": sl["pid"], "tid": sl["tid"],
          "ts": sl["ts"], "args": {"flow": flow}}
    if ph == "f":
        ev["bp"] = "e"
    return ev


def _process_metadata(procs: list) -> list:
    """process_name ("rank R (role) host") and process_sort_index per rank. No tid: tid 0 is special
    to Perfetto too."""
    out = []
    for p in procs:
        label = f"rank {p['rank']} ({p.get('role') or 'unknown role'})" + (f" {p['host']}" if p.get("host") else "")
        pid = trace_pid(p["rank"])
        out.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": label}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": p["rank"]}})
    return out


def _proc_info(rank: int, run_start: dict) -> dict:
    """What a trace shows about a rank, from its run_start (or any record header)."""
    return {"rank": rank, "role": run_start.get("role"), "host": run_start.get("hostname"),
            "pid": run_start.get("pid"), "run_id": run_start.get("run_id"), "clock": run_start.get("clock")}


def write_trace(path, events: list, metadata: dict) -> None:
    """Write the trace atomically: a temporary file beside `path`, then os.replace (a reader never
    sees half a file). One event per line, so a large file streams out without one huge string."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    encode = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write('{"traceEvents":[\n')
            for i, ev in enumerate(events):
                f.write((",\n" if i else "") + encode(ev))
            f.write('\n],"displayTimeUnit":"ms","metadata":' + json.dumps(metadata, allow_nan=False) + "}\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# ---------------------------------------------------------------- the live per-rank exporter

class TraceExporter:
    """RUN_DIR/trace/rank{R}.json, rewritten atomically at each `spans` record and at close.

    Keeps the newest `max_events` slices (whole spans records, oldest evicted first). Each record's
    slices are built once; a rewrite lays out, sorts and serialises them all (6-10 us a slice on the
    2-core VM: 205 ms for the 19,200 slices of 800 records, 13 hours of a run at 60 s intervals), so a
    rewrite waits until the time since the last one ended is 1/WRITE_DUTY times that one's cost: the
    trace never takes over WRITE_DUTY of a core, on the exporter thread and under the GIL the training
    thread wants. A record that comes sooner is kept and goes into the next rewrite (or the final one
    at close); the file lags the run by at most 1/WRITE_DUTY times a rewrite.
    stats(): `exported` = spans records that reached a written file; `dropped` = spans records
    evicted by the bound, plus those never written when the final write failed; `failed` = a write
    failed (logged once; the next one tries again). Flow arrows need both ranks: see merge_traces.
    """

    name = "trace"
    WRITE_DUTY = 0.005

    def __init__(self, run_dir, rank: int, max_events: int = MAX_EVENTS, clock=time.monotonic):
        self.rank, self.max_events, self._clock = int(rank), int(max_events), clock
        self.path = Path(run_dir) / "trace" / f"rank{self.rank}.json"
        self._proc = _proc_info(self.rank, {})
        self._chunks: list = []                      # (spans record, prepare() of it), oldest first
        self._seq = self._written_seq = 0            # spans records received / covered by the last write
        self._exported = self._dropped = self._evicted_spans = self._profiler_dropped = 0
        self._status = None
        self._last_write = (0.0, -math.inf)          # (seconds it took, when it ended)
        self._failed = self._logged = False
        self._lock = threading.Lock()

    def export(self, record: dict) -> None:
        rtype = record.get("type")
        with self._lock:
            if rtype == RUN_START:
                self._proc = _proc_info(self.rank, record)
            elif rtype == RUN_END:
                self._status = record.get("status")
            elif rtype == SPANS:
                self._keep(record)
                took, ended = self._last_write
                if self._clock() - ended >= took / self.WRITE_DUTY:
                    self._write()

    def _keep(self, record: dict) -> None:
        """Add a spans record, evicting the oldest ones over the bound (a trimmed record is re-prepared)."""
        self._seq += 1
        self._profiler_dropped += int(_num(record.get("dropped")) or 0)
        chunks = self._chunks + [(record, None)]
        kept, n_records, n_spans = newest_within([r for r, _ in chunks], self.max_events)
        self._chunks = [(r, prep if r is orig and prep is not None else prepare(self.rank, r))
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
        events, counts = build_trace([self._proc], [prep for _, prep in self._chunks])
        meta = {"source": "TraceExporter (live, this rank only)", "timebase": "Unix microseconds",
                **{k: v for k, v in self._proc.items() if k != "rank"}, "rank": self.rank,
                "status": self._status, **counts, "evicted_spans": self._evicted_spans,
                "profiler_dropped_spans": self._profiler_dropped,
                "flows": f"arrows need both ranks: {PROG} merge RUN_DIR"}
        try:
            write_trace(self.path, events, _json_safe(meta))
        except OSError as exc:
            self._failed = True
            if not self._logged:
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


# ---------------------------------------------------------------- merged trace from the run logs

def _read_logs(run_dir: Path) -> dict:
    """{rank: (records, n_bad)}, or TraceInputError naming what is wrong with run_dir."""
    if not run_dir.is_dir():
        raise TraceInputError(f"{run_dir}: no such directory")
    try:
        logs = read_run_dir(run_dir)
    except OSError as exc:
        raise TraceInputError(f"{run_dir}: cannot read its run logs: {exc}") from None
    if not logs:
        raise TraceInputError(f"{run_dir}: not a run directory (no profile/rank*.jsonl)")
    if not any(records for records, _ in logs.values()):
        raise TraceInputError(f"{run_dir}: its run logs hold no records")
    return logs


def _rank_proc(rank: int, records: list, budget: int) -> tuple[dict, int, int]:
    """A rank's process description with its newest spans records -> (proc, evicted, profiler drops)."""
    starts = of_type(records, RUN_START)
    for rs in starts:
        try:
            check_schema(rs, f"rank {rank} log")
        except ValueError as exc:
            raise TraceInputError(str(exc)) from None
    proc = _proc_info(rank, starts[-1] if starts else next((r for r in records if r.get("role")), {}))
    spans = of_type(records, SPANS)
    proc["records"], _, evicted = newest_within(spans, budget)
    proc["segments"] = len(starts)
    return proc, evicted, sum(int(_num(r.get("dropped")) or 0) for r in spans)


def merge_traces(run_dir, out_path=None, max_events: int = MAX_EVENTS) -> dict:
    """One trace for every rank of a run, built from RUN_DIR/profile/rank*.jsonl (so it also works after
    a crash, when per-rank trace files may be stale) and written to out_path (default
    RUN_DIR/trace/merged.json). Returns a summary; TraceInputError for a directory with no run logs."""
    run_dir = Path(run_dir)
    logs = _read_logs(run_dir)
    budget = max(1, max_events // len(logs))      # newest windows of every rank, which line up in time
    procs, ranks, evicted, prof_dropped = [], {}, 0, 0
    for rank, (records, bad) in logs.items():
        proc, ev, dropped = _rank_proc(rank, records, budget)
        procs.append(proc)
        evicted, prof_dropped = evicted + ev, prof_dropped + dropped
        ranks[str(rank)] = {**{k: v for k, v in proc.items() if k not in ("rank", "records")}, "bad_lines": bad}
    events, counts = build_trace(procs, [prepare(p["rank"], r) for p in procs for r in p["records"]])
    out = Path(out_path) if out_path is not None else run_dir / "trace" / "merged.json"
    summary = {"out": str(out), "ranks": list(logs), **counts, "evicted_spans": evicted,
               "profiler_dropped_spans": prof_dropped,
               "bad_lines": sum(bad for _, bad in logs.values())}
    meta = {"source": "run logs", "run_dir": str(run_dir), "timebase": "Unix microseconds",
            **{k: v for k, v in summary.items() if k not in ("out", "ranks")}, "ranks": ranks}
    write_trace(out, events, _json_safe(meta))
    return summary


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):             # one line, no usage dump; main() turns it into exit 2
        raise _UsageError(message)


def main(argv=None, prog: str = None) -> int:
    """`merge RUN_DIR [-o FILE]`: 0 written, 1 cannot write, 2 bad usage or no run logs (one line).
    `prog` names the command in messages (dflash-report passes its own)."""
    prog = prog or PROG
    parser = _Parser(prog=prog, description="Perfetto/Chrome traces of a dflash run's detail windows.")
    sub = parser.add_subparsers(dest="command", required=True)
    merge = sub.add_parser("merge", help="one trace for every rank, from the run logs")
    merge.add_argument("run_dir", help="the run directory (holds profile/rank*.jsonl)")
    merge.add_argument("-o", "--output", help="output file (default RUN_DIR/trace/merged.json)")
    try:
        args = parser.parse_args(argv)
        s = merge_traces(args.run_dir, args.output)
    except SystemExit as exc:              # --help
        return exc.code if isinstance(exc.code, int) else 0
    except (_UsageError, TraceInputError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"{prog}: error: cannot write the trace: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {s['out']}: {len(s['ranks'])} ranks, {s['spans']} spans, {s['events']} events, "
          f"flows {s['flows_matched']} matched / {s['flows_unmatched']} unmatched"
          + (f", {s['bad_lines']} unreadable run-log lines skipped" if s["bad_lines"] else ""))
    if not s["spans"]:
        print(f"{prog}: note: no spans records (a detail window is written at each interval's close)",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
