"""Perfetto / Chrome trace-event JSON of the detail windows' spans, for exporters.trace (live, per rank) and
report.trace (all ranks, from the logs). Stdlib only.

One process per rank (pid = rank + 1: pid 0 is Perfetto's idle process), one track per OS thread plus a "(GPU)"
track (tid + GPU_TID_OFFSET), tids unique across the file. Slices are "X" events in integer Unix microseconds,
both ends floored so nested spans stay nested; slices that would overlap without nesting get "[overlap N]" lanes.
Flow arrows join each flow-start span tagged `flow` (from its start) to the flow-end span with the same string (to
its end, when the batch arrived: arrows point forward in time), the span names given by the run's span table
(`FlowSpans`; dflash-train: `transfer.send` to `drafter.recv`); a one-rank file draws its halves under the ids the
pairs get, so files put together join.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import threading
import zlib
from pathlib import Path
from typing import NamedTuple

MAX_EVENTS = 500_000              # slices kept per trace file; the oldest spans records go first
GPU_TID_OFFSET = 1 << 30          # GPU track of thread T: T + offset (Linux thread ids stay below 2**22)
OVERLAP_TID_BASE = 1 << 29        # extra lanes, and a thread whose id a track already took
GPU_START_UNKNOWN = "unknown; aligned to CPU start"


class FlowSpans(NamedTuple):
    """The spans a trace joins with flow arrows (a run's span table: profiler/schema/span_kinds.py): each span of `start`
    tagged `flow` to the span of `end` with the same tag."""
    start: frozenset = frozenset()
    end: frozenset = frozenset()

    @classmethod
    def of(cls, flows: dict) -> "FlowSpans":
        """From {span: "start" or "end"} (profiler.schema.span_kinds.SpanKinds.flows())."""
        return cls(frozenset(n for n, end in flows.items() if end == "start"),
                   frozenset(n for n, end in flows.items() if end == "end"))

    @property
    def cat(self) -> str:
        """The arrows' category: their start span's (its name up to the first dot), the same in every rank's file."""
        return min(self.start).split(".")[0] if self.start else "flow"

# ---------------------------------------------------------------- one span -> slices

def num(x):
    """x if it is a finite number (not a bool), else None."""
    ok = isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
    return x if ok else None


def json_safe(v):
    """Non-finite floats -> None, recursively (trace files must stay valid JSON)."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {str(k): json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_safe(x) for x in v]
    return v


def trace_pid(rank: int) -> int:
    """The trace's pid for a rank (not 0: Perfetto's idle process)."""
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
    cpu, gpu, nbytes = (num(entry.get(k)) for k in ("cpu_seconds", "gpu_seconds", "bytes"))
    args = {"id": json_safe(entry.get("id")), "parent": json_safe(entry.get("parent")),
            "depth": num(entry.get("depth")),
            "cpu_seconds": cpu, "gpu_seconds": gpu, "bytes": nbytes}
    seconds, on = (gpu, "gpu") if gpu else (cpu, "cpu")
    if nbytes and seconds and seconds > 0:
        args["achieved_gb_per_s"] = round(nbytes / seconds / 1e9, 3)
        args["achieved_on"] = on
    if steps:
        args["steps"] = steps
    if entry.get("attrs"):
        args["attrs"] = json_safe(entry["attrs"])
    return {k: v for k, v in args.items() if v is not None}


def span_slices(entry: dict, steps=None) -> list | None:
    """One `spans` entry -> [("cpu", X event), ("gpu", X event)?] without pid/tid; None without start/end.
    `steps`: the record's step window, JSON-safe."""
    start, end = num(entry.get("start_unix_ns")), num(entry.get("end_unix_ns"))
    if start is None or end is None:
        return None
    start, end = int(start), int(end)
    name = str(entry.get("name") or "span")
    cat = name.split(".")[0]
    ts = start // 1000
    out = [("cpu", {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": max(0, end // 1000 - ts),
                    "args": _span_args(entry, steps)})]
    gpu = num(entry.get("gpu_seconds"))
    if gpu is not None and gpu >= 0:
        args = {k: v for k, v in (("id", json_safe(entry.get("id"))), ("depth", num(entry.get("depth"))),
                                  ("gpu_seconds", gpu)) if v is not None}
        g0 = num(entry.get("gpu_start_unix_ns"))
        if g0 is None:
            g0, args["gpu_start"] = start, GPU_START_UNKNOWN
        g0 = int(g0)
        gts = g0 // 1000
        out.append(("gpu", {"ph": "X", "name": name, "cat": cat + ",gpu", "ts": gts,
                            "dur": max(0, (g0 + round(gpu * 1e9)) // 1000 - gts), "args": args}))
    return out


def slice_cost(entry) -> int:
    """Slices a span entry becomes (the unit of the event bound)."""
    return 1 + (isinstance(entry, dict) and num(entry.get("gpu_seconds")) is not None)


def newest_within(records: list, max_events: int) -> tuple[list, int, int]:
    """The newest spans records whose slices fit in max_events -> (kept, records evicted, spans evicted); a
    record larger than the bound keeps its latest spans (a trimmed copy)."""
    kept, used = [], 0
    for i in range(len(records) - 1, -1, -1):
        spans = records[i].get("spans") or []
        cost = sum(slice_cost(s) for s in spans)
        if used + cost <= max_events:
            kept.append(records[i])
            used += cost
            continue
        evicted = sum(len(r.get("spans") or []) for r in records[:i])
        if kept:
            return kept[::-1], i + 1, evicted + len(spans)
        n = len(spans)
        while n and used + slice_cost(spans[n - 1]) <= max_events:
            n -= 1
            used += slice_cost(spans[n])
        return [{**records[i], "spans": spans[n:]}], i, evicted + n
    return kept[::-1], 0, 0


# ---------------------------------------------------------------- slices -> trace events

def prepare(rank: int, record: dict, flow_spans: FlowSpans) -> dict:
    """One spans record -> its slices keyed by track, its flow halves (of `flow_spans`) and counts; built once per
    record (the live exporter keeps them between rewrites)."""
    items, flows, spans, bad = [], [], 0, 0
    steps, pid = json_safe(record.get("steps")), trace_pid(rank)
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
        is_start = cpu["name"] in flow_spans.start
        if isinstance(attrs, dict) and attrs.get("flow") is not None and (is_start or cpu["name"] in flow_spans.end):
            flows.append((str(attrs["flow"]), is_start, cpu))
    return {"items": items, "flows": flows, "spans": spans, "bad_spans": bad, "flow_cat": flow_spans.cat}


def build_trace(procs: list, prepared: list, halves: bool = False) -> tuple[list, dict]:
    """procs ([{"rank", "role", "host"}]) and prepare() of their spans records -> (traceEvents, counts): the
    metadata, then each track's slices and flow points in ts order. `halves`: draw unpaired flow halves too."""
    tracks, flows, counts = {}, [], {"spans": 0, "bad_spans": 0}
    for prep in prepared:
        for key, ev in prep["items"]:
            tracks.setdefault(key, []).append(ev)
        flows += prep["flows"]
        counts["spans"] += prep["spans"]
        counts["bad_spans"] += prep["bad_spans"]
    meta, slices = _layout(tracks)
    cat = next((prep["flow_cat"] for prep in prepared), FlowSpans().cat)
    flow_events, counts["flows_matched"], counts["flows_unmatched"] = _flow_events(flows, cat, halves)
    counts["flow_sends"] = sum(1 for _, is_start, _ in flows if is_start)
    counts["flow_receives"] = len(flows) - counts["flow_sends"]
    timed = slices + flow_events
    timed.sort(key=lambda e: (e["pid"], e["tid"], e["ts"], e["ph"] != "X", -e.get("dur", 0),
                              e.get("args", {}).get("depth") or 0))
    counts["events"] = len(timed)
    return _process_metadata(procs) + meta + timed, counts


def _slice_order(ev: dict) -> tuple:
    return ev["ts"], -ev["dur"], ev["args"].get("depth") or 0


def _lanes(slices: list) -> list:
    """One track's slices in lanes where any two are disjoint or nested (a thread's CPU spans: one lane; GPU
    slices placed at their CPU start may not nest)."""
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


def flows_matched(flows: list) -> int:
    """How many of prepare()'s flow halves pair up, as _flow_events pairs them (the i-th send of a flow string with
    its i-th receive): build_trace's `flows_matched`, without laying out the trace."""
    halves: dict = {}
    for flow, is_start, _ in flows:
        halves.setdefault(flow, [0, 0])[0 if is_start else 1] += 1
    return sum(min(sends, receives) for sends, receives in halves.values())


def _flow_events(flows: list, cat: str, halves: bool = False) -> tuple[list, int, int]:
    """Flow pairs ("s", "f") of category `cat` from each flow start to its end -> (events, matched, unmatched): the
    i-th send of a flow string pairs with its i-th receive in time order (a resumed run may reuse a batch id); an
    unpaired half is counted, and drawn only with `halves` (its partner in another rank's file has its id)."""
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
        for i in range(max(len(starts), len(ends)) if halves else n):
            fid = flow_id(flow if i == 0 else f"{flow}#{i}")
            if i < len(starts):
                out.append(_flow_point("s", starts[i], fid, flow, cat))
            if i < len(ends):
                out.append(_flow_point("f", ends[i], fid, flow, cat))
    return out, matched, unmatched


def _flow_point(ph: str, sl: dict, fid: int, flow: str, cat: str) -> dict:
    """A flow event inside slice `sl`, which Perfetto binds it to (the innermost slice open on the track at its
    time): a send's at the send's start; a receive's at the receive's last microsecond, when the batch is in
    hand. A receive may begin long before the batch was sent (a drafter waiting for its first batch), so its
    start would draw the arrow backwards in time; its end never precedes the send."""
    ts = sl["ts"] if ph == "s" else sl["ts"] + max(0, sl["dur"] - 1)
    ev = {"ph": ph, "name": "batch", "cat": cat, "id": fid, "pid": sl["pid"], "tid": sl["tid"],
          "ts": ts, "args": {"flow": flow}}
    if ph == "f":
        ev["bp"] = "e"
    return ev


def backward_flows(events: list) -> list:
    """The flows of a trace that point backwards in time, as (flow, send ts, receive ts) in microseconds: a
    receive point ("f") earlier than its send point ("s") of the same id."""
    sends = {e["id"]: e["ts"] for e in events if e.get("ph") == "s"}
    return [(e["args"]["flow"], sends[e["id"]], e["ts"]) for e in events
            if e.get("ph") == "f" and e["id"] in sends and e["ts"] < sends[e["id"]]]


def _process_metadata(procs: list) -> list:
    """process_name ("rank R (role) host") and process_sort_index per rank (no tid: 0 is special to Perfetto)."""
    out = []
    for p in procs:
        label = f"rank {p['rank']} ({p.get('role') or 'unknown role'})" + (f" {p['host']}" if p.get("host") else "")
        pid = trace_pid(p["rank"])
        out.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": label}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": p["rank"]}})
    return out


def proc_info(rank: int, run_start: dict) -> dict:
    """What a trace shows about a rank, from its run_start (or any record header)."""
    return {"rank": rank, "role": run_start.get("role"), "host": run_start.get("hostname"),
            "pid": run_start.get("pid"), "run_id": run_start.get("run_id"), "clock": run_start.get("clock")}


def write_trace(path, events: list, metadata: dict) -> None:
    """Write the trace atomically (a temporary file beside `path`, then os.replace), one event per line so a
    large file streams out without one huge string."""
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
