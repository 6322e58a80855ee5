"""One rank's Kineto capture broken down by our spans: what each span launched on the GPU, what its host did.

A trace (the JSON torch.profiler writes) holds our spans as `user_annotation` ranges on the threads that ran them
(a capture makes every span a `record_function`), the CUDA runtime calls each thread made, and the kernels,
copies and memsets those calls put on the GPU (linked by `correlation`). A GPU event belongs to the innermost span
open on the thread that launched it at the launch; a launch from a thread with no span of ours (autograd's
device threads run the backward) belongs to the span open on the training thread (the one with the
`ProfilerStep#N` ranges) at that time. The launching thread is the one of the op (or range) whose `External id`
the runtime call carries: the runtime call's own `tid` can be stale (Kineto keeps the first of several short-lived
threads' ids). Standard library only.
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import defaultdict

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
RUNTIME_CATS = ("cuda_runtime", "cuda_driver")
SYNC_CALLS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize")
"""Runtime calls in which the host waits for the device (a cudaMemcpy that is not ...Async)."""
ALLOC_CALLS = ("cudaMalloc", "cudaFree", "cudaMallocHost", "cudaFreeHost", "cudaHostAlloc", "cuMemAlloc",
               "cuMemFree", "cudaMallocAsync", "cudaFreeAsync")
OUTSIDE = "(outside our spans)"


def _x(events, cat) -> list:
    return [e for e in events if e.get("cat") == cat and e.get("ph") == "X"]


def innermost(intervals: list, points: list) -> dict:
    """{key: index of the innermost interval holding t, or None} for points [(t, key)]; intervals
    [(start, end, index)] nest (one thread's ranges)."""
    intervals = sorted(intervals, key=lambda iv: (iv[0], -iv[1]))
    out, stack, i = {}, [], 0
    for t, key in sorted(points, key=lambda p: p[0]):
        while i < len(intervals) and intervals[i][0] <= t:
            while stack and stack[-1][1] < intervals[i][0]:
                stack.pop()
            stack.append(intervals[i])
            i += 1
        while stack and stack[-1][1] < t:
            stack.pop()
        out[key] = stack[-1][2] if stack else None
    return out


def union_us(ranges: list) -> float:
    """Total length of the union of [start, end) ranges."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(ranges):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


class Capture:
    """One trace's spans (`ann`, our user annotations), their threads, and the attribution of points to them."""

    def __init__(self, trace: dict, names: set):
        events = trace.get("traceEvents") or []
        users = _x(events, "user_annotation")
        self.ann = [e for e in users if e.get("name") in names]
        steps = [e for e in users if str(e.get("name", "")).startswith("ProfilerStep#")]
        self.steps = sorted(int(e["name"].split("#", 1)[1]) for e in steps)
        self.main_tid = steps[0]["tid"] if steps else None
        self.events = events
        self.tids = {e["tid"] for e in self.ann}
        self.by_tid = defaultdict(list)
        for i, e in enumerate(self.ann):
            self.by_tid[e["tid"]].append((e["ts"], e["ts"] + e.get("dur", 0), i))
        self.ext_tid = {e["args"]["External id"]: e["tid"] for e in _x(events, "cpu_op") + users
                        if "External id" in (e.get("args") or {})}

    def thread_of(self, call: dict):
        """The thread a runtime call was made on: its op's, where the trace links one (see the module doc)."""
        return self.ext_tid.get((call.get("args") or {}).get("External id"), call.get("tid"))

    def home(self, tid):
        """The thread whose spans a point on `tid` belongs to."""
        return tid if tid in self.tids or self.main_tid is None else self.main_tid

    def attribute(self, points: list) -> dict:
        """{key: innermost span index or None} for points [(tid, t, key)]."""
        grouped = defaultdict(list)
        for tid, t, key in points:
            grouped[self.home(tid)].append((t, key))
        out = {}
        for tid, pts in grouped.items():
            out.update(innermost(self.by_tid.get(tid, []), pts))
        return out

    def runtime(self) -> dict:
        """correlation id -> the runtime call (cuda_runtime / cuda_driver) that launched it."""
        return {e["args"]["correlation"]: e for cat in RUNTIME_CATS for e in _x(self.events, cat)
                if "correlation" in (e.get("args") or {})}


def _memcpy_floor(name: str) -> tuple:
    """(floor name, bytes factor) a copy's bandwidth is read against (device_copy counts read and written)."""
    if "DtoH" in name:
        return "pinned_d2h", 1
    if "HtoD" in name:
        return "pinned_h2d", 1
    return "device_copy", 2


def gpu_breakdown(cap: Capture) -> dict:
    """Per span name: kernels, copies and memsets launched in it (self), the busy union of every GPU event
    launched inside each instance (children included), and per instance the launch times."""
    runtime = cap.runtime()
    work = [(e, runtime.get((e.get("args") or {}).get("correlation"))) for cat in GPU_CATS for e in _x(cap.events, cat)]
    owner = cap.attribute([(cap.thread_of(rt), rt["ts"], i) for i, (_e, rt) in enumerate(work) if rt is not None])
    per = defaultdict(lambda: {"kernels": defaultdict(lambda: [0, 0.0]), "copies": defaultdict(lambda: [0, 0.0, 0]),
                               "memsets": [0, 0.0, 0], "gpu_events": 0})
    launched = defaultdict(list)   # home tid -> [(launch t, gpu start, gpu end)]
    for i, (e, rt) in enumerate(work):
        idx = owner.get(i)
        entry = per[cap.ann[idx]["name"] if idx is not None else OUTSIDE]
        entry["gpu_events"] += 1
        dur, nbytes = e.get("dur", 0.0), (e.get("args") or {}).get("bytes", 0) or 0
        if e["cat"] == "kernel":
            k = entry["kernels"][e["name"]]
            k[0], k[1] = k[0] + 1, k[1] + dur
        elif e["cat"] == "gpu_memcpy":
            c = entry["copies"][e["name"]]
            c[0], c[1], c[2] = c[0] + 1, c[1] + dur, c[2] + nbytes
        else:
            m = entry["memsets"]
            m[0], m[1], m[2] = m[0] + 1, m[1] + dur, m[2] + nbytes
        if rt is not None:
            launched[cap.home(cap.thread_of(rt))].append((rt["ts"], e["ts"], e["ts"] + dur))
    busy = _busy_per_name(cap, launched)
    for name, us in busy.items():
        per[name]["busy_us"] = us
    return per


def _busy_per_name(cap: Capture, launched: dict) -> dict:
    """Per span name: the union of the GPU events launched while each instance was open (any depth), summed."""
    for items in launched.values():
        items.sort()
    starts = {tid: [t for t, _s, _e in items] for tid, items in launched.items()}
    out = defaultdict(float)
    for e in cap.ann:
        tid = e["tid"]
        lo, hi = bisect_left(starts.get(tid, []), e["ts"]), bisect_right(starts.get(tid, []), e["ts"] + e.get("dur", 0))
        out[e["name"]] += union_us([(s, end) for _t, s, end in launched.get(tid, [])[lo:hi]])
    return out


def host_breakdown(cap: Capture) -> dict:
    """Per span name: its CPU time, the runtime calls made in it (launch, sync, allocator), the top-level CPU
    ops it ran, and the allocations torch.profiler saw (profile_memory)."""
    per = defaultdict(lambda: {"count": 0, "cpu_us": 0.0, "launch_us": 0.0, "launches": 0, "sync_us": 0.0,
                               "alloc_us": 0.0, "ops": defaultdict(lambda: [0, 0.0]), "allocs": [0, 0]})
    for e in cap.ann:
        per[e["name"]]["count"] += 1
        per[e["name"]]["cpu_us"] += e.get("dur", 0.0)
    calls = [e for cat in RUNTIME_CATS for e in _x(cap.events, cat)]
    ops = _top_level(_x(cap.events, "cpu_op"))
    mem = [e for e in cap.events if e.get("name") == "[memory]" and (e.get("args") or {}).get("Bytes", 0) > 0]
    owner = cap.attribute([(cap.thread_of(e), e["ts"], ("c", i)) for i, e in enumerate(calls)]
                          + [(e["tid"], e["ts"], ("o", i)) for i, e in enumerate(ops)]
                          + [(e["tid"], e["ts"], ("m", i)) for i, e in enumerate(mem)])
    for (kind, i), idx in owner.items():
        entry = per[cap.ann[idx]["name"] if idx is not None else OUTSIDE]
        if kind == "c":
            call, dur = calls[i]["name"], calls[i].get("dur", 0.0)
            bucket = ("sync_us" if call.startswith(SYNC_CALLS) and "Async" not in call else
                      "alloc_us" if call.startswith(ALLOC_CALLS) else "launch_us")
            entry[bucket] += dur
            entry["launches"] += bucket == "launch_us"
        elif kind == "o":
            op = entry["ops"][ops[i]["name"]]
            op[0], op[1] = op[0] + 1, op[1] + ops[i].get("dur", 0.0)
        else:
            entry["allocs"][0] += 1
            entry["allocs"][1] += mem[i]["args"]["Bytes"]
    return per


def _top_level(ops: list) -> list:
    """CPU ops not inside another op of their thread (so an op's time is counted once)."""
    out, end = [], {}
    for e in sorted(ops, key=lambda e: (e["tid"], e["ts"], -e.get("dur", 0))):
        if e["ts"] >= end.get(e["tid"], float("-inf")):
            out.append(e)
            end[e["tid"]] = e["ts"] + e.get("dur", 0)
    return out


def kineto_windows(cap: Capture) -> dict:
    """Per span name: Kineto's own GPU range (`gpu_user_annotation`: first kernel start to last kernel end), summed."""
    out = defaultdict(lambda: [0, 0.0])
    names = {e["name"] for e in cap.ann}
    for e in _x(cap.events, "gpu_user_annotation"):
        if e.get("name") in names:
            out[e["name"]][0] += 1
            out[e["name"]][1] += e.get("dur", 0.0)
    return out


def copy_rows(copies: dict, floors: dict) -> list:
    """Each copy kind with its bytes and achieved bandwidth against the floor measured at the run's start."""
    rows = []
    for name, (n, dur_us, nbytes) in sorted(copies.items(), key=lambda kv: -kv[1][1]):
        floor_name, factor = _memcpy_floor(name)
        bw = factor * nbytes / (dur_us / 1e6) if dur_us > 0 else None
        floor = floors.get(floor_name)
        rows.append({"name": name, "count": n, "seconds": dur_us / 1e6, "bytes": nbytes,
                     "bytes_per_s": bw, "floor": floor_name, "floor_bytes_per_s": floor,
                     "floor_share": bw / floor if bw is not None and floor else None,
                     "pageable": "Pageable" in name})
    return rows
