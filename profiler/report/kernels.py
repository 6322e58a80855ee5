"""`dflash-report kernels RUN_DIR [--capture N] [--json]`: one capture (RUN_DIR/kineto/rank{R}-step{N}.json.gz,
every rank's of the same steps) broken down per rank and span: the top kernels by device time, the copies with
their bandwidth against the floors the rank measured at start, memsets, the host's launch, sync and allocator
time, and our span's GPU window (its CUDA events, from the `capture` event) beside the union of the GPU work it
launched: their ratio is the span's busy share, and a span far below 100% is launch- or sync-bound. On a CPU
capture, the CPU ops each span ran. Every figure covers the captured steps only. Standard library only.
"""
from __future__ import annotations

import gzip
import json
import re
import zlib
from pathlib import Path

from profiler.schema import views
from profiler.schema.records import MAX_NESTING, too_deep
from profiler.report.kineto_trace import OUTSIDE, Capture, copy_rows, gpu_breakdown, host_breakdown, kineto_windows
from profiler.report.runs import ReportError, load_run

BOUND_SHARE = 0.5
"""A span whose GPU work fills less than this share of its GPU window is launch- or sync-bound."""
TOP = 8
_FILE = re.compile(r"^rank(\d+)-step(\d+)\.json\.gz$")
_SPAN_NAME = re.compile(r"^[a-z0-9_]+(\.[a-z0-9_]+)*$")


def captures_in(run_dir) -> dict:
    """{first step: {rank: path}} of the traces under RUN_DIR/kineto."""
    out: dict = {}
    for path in sorted((Path(run_dir) / "kineto").glob("rank*-step*.json.gz")):
        m = _FILE.match(path.name)
        if m:
            out.setdefault(int(m.group(2)), {})[int(m.group(1))] = path
    return out


MAX_TRACE_BYTES = 512 << 20
"""Decompressed bytes a Kineto trace may hold: a capture of a few steps is tens of MB, and parsed it costs several
times its size; a file that inflates past this (a gzip bomb: 13 MB of whitespace became 3 GB) is refused unread."""


def _decompressed(path: Path, max_bytes: int) -> bytes:
    """The file's bytes, gunzipped into at most max_bytes (+1 to see it go past); ReportError beyond."""
    with gzip.open(path, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ReportError(f"{path}: decompresses past {max_bytes} bytes (MAX_TRACE_BYTES, this reader's limit); "
                          "not read")
    return data


def _unreadable(path: Path, why: str) -> ReportError:
    return ReportError(f"{path}: not a readable Kineto trace ({why})")


def load_trace(path: Path, max_bytes: int | None = None) -> dict:
    """The capture's trace, read within max_bytes (MAX_TRACE_BYTES) decompressed and MAX_NESTING brackets deep;
    ReportError (one line naming the file) for one that is not a readable trace within those."""
    try:
        data = _decompressed(path, MAX_TRACE_BYTES if max_bytes is None else max_bytes)
    except (OSError, EOFError, zlib.error) as exc:
        raise _unreadable(path, f"{type(exc).__name__}: {exc}") from None
    if too_deep(data):
        raise _unreadable(path, f"nested deeper than {MAX_NESTING} brackets")
    try:
        trace = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise _unreadable(path, f"{type(exc).__name__}: {exc}") from None
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise ReportError(f"{path}: not a Kineto trace (no traceEvents list)")
    return trace


def kernels(run_dir, capture: int | None = None, top: int = TOP) -> dict:
    """The breakdown of one capture (the latest when `capture` is None); ReportError when there is none."""
    run = load_run(run_dir)
    found = captures_in(run_dir)
    if not found:
        raise ReportError(f"{run_dir}: no captures in {Path(run_dir) / 'kineto'} (take one with `dflash-profile "
                          "capture --run-dir` on a live run, or `dflash-train --capture-at-step N`)")
    step = max(found) if capture is None else capture
    if step not in found:
        raise ReportError(f"{run_dir}: no capture begins at step {step}; captures begin at "
                          f"{', '.join(map(str, sorted(found)))}")
    ranks = [rank_report(run.ranks.get(rank), rank, path, step, top) for rank, path in sorted(found[step].items())]
    last = max((r["steps"][1] for r in ranks if r["steps"]), default=step)
    return {"run_dir": str(run_dir), "capture": step, "captures": sorted(found),
            "window": f"the captured steps {step}-{last} only", "ranks": ranks,
            "aligned": all(r["steps"] and r["steps"][0] == step for r in ranks)}


def capture_busy(run) -> dict:
    """{(role, span): busy share} over every capture of the run (its kernels' busy time over our GPU windows of the
    captured spans, summed over captures and ranks); traces that cannot be read are left out. The window: the
    captured steps only."""
    sums: dict = {}
    for step, paths in captures_in(run.run_dir).items():
        for rank, path in paths.items():
            log = run.ranks.get(rank)
            try:
                rows = rank_report(log, rank, path, step, TOP)["spans"]
            except (ReportError, OSError):
                continue
            for r in rows:
                if r["our_gpu_window_seconds"] and not r["outside_spans"]:
                    acc = sums.setdefault((log.role if log else None, r["name"]), [0.0, 0.0])
                    acc[0] += r["kernel_busy_seconds"]
                    acc[1] += r["our_gpu_window_seconds"]
    return {key: busy / window for key, (busy, window) in sums.items() if window > 0}


def _capture_event(log, step: int):
    """The rank's last `capture` event (views.Capture) of the capture that begins at `step`, or None."""
    events = [e for e in map(views.event, log.events if log else []) if isinstance(e, views.Capture)
              and e.step == step]
    return events[-1] if events else None


def _ours(event) -> dict:
    """Our spans in the capture, from its event: {name: count, CPU seconds, GPU window seconds and count}."""
    out: dict = {}
    for s in event.captured_spans if event else ():
        o = out.setdefault(s.name, {"count": 0, "cpu_seconds": 0.0, "gpu_seconds": 0.0, "gpu_count": 0})
        o["count"] += 1
        o["cpu_seconds"] += s.cpu_seconds or 0.0
        if s.gpu_seconds is not None:
            o["gpu_seconds"] += s.gpu_seconds
            o["gpu_count"] += 1
    return out


def rank_report(log, rank: int, path: Path, step: int, top: int) -> dict:
    event, trace = _capture_event(log, step), load_trace(path)
    ours = _ours(event)
    names = set(ours) or {e.get("name") for e in trace["traceEvents"] if e.get("cat") == "user_annotation"
                          and _SPAN_NAME.match(str(e.get("name")))}
    cap = Capture(trace, names)
    gpu, host, kin = gpu_breakdown(cap), host_breakdown(cap), kineto_windows(cap)
    floors = views.run_start(log.run_starts[-1]).floors if log and log.run_starts else {}
    rows = [span_row(n, ours.get(n), gpu.get(n), host.get(n), kin.get(n), floors, top)
            for n in sorted(set(host) | set(gpu) | set(ours))]
    rows = [r for r in rows if not r["outside_spans"] or r["kernels_total"]["count"] or r["copies"] or r["cpu_ops"]
            or r["host_launch_seconds"]]
    rows.sort(key=lambda r: -(r["our_gpu_window_seconds"] or r["kernel_busy_seconds"] or r["cpu_seconds"] or 0))
    return {"rank": rank, "role": log.role if log else None, "file": str(path), "bytes": path.stat().st_size,
            "steps": [cap.steps[0], cap.steps[-1]] if cap.steps else None, "profiler_steps": len(cap.steps),
            "device": "cuda" if any(r["kernels_total"]["count"] for r in rows) else "cpu",
            "distributed_rank": (trace.get("distributedInfo") or {}).get("rank"),
            "event": None if event is None else _event_summary(event),
            "spans": rows}


def _event_summary(event) -> dict:
    """What the capture cost (its `capture` event, views.Capture): its file's size, how it was asked, its time on
    the training thread, and why it failed."""
    return {"bytes": event.bytes, "bytes_per_step": event.bytes_per_step, "source": event.source,
            "begin_seconds": event.begin_seconds, "stop_seconds": event.stop_seconds, "error": event.error}


def _verdict(share, window_s, gpu_events: int) -> str | None:
    """None for a span that put no work on the GPU (a wait, a host-side stage): its window is not its own."""
    if share is None or not window_s or not gpu_events:
        return None
    return "launch- or sync-bound" if share < BOUND_SHARE else "GPU-busy"


def span_row(name: str, ours, gpu, host, kin, floors: dict, top: int) -> dict:
    """One span of one rank over the capture (see the module doc)."""
    ours, host = ours or {}, host or {"count": 0, "cpu_us": 0.0, "launch_us": 0.0, "launches": 0, "sync_us": 0.0,
                                      "alloc_us": 0.0, "ops": {}, "allocs": [0, 0]}
    gpu = gpu or {"kernels": {}, "copies": {}, "memsets": [0, 0.0, 0], "busy_us": 0.0}
    our_gpu = ours.get("gpu_seconds") if ours.get("gpu_count") else None
    kin_s = kin[1] / 1e6 if kin else None
    busy_s = gpu.get("busy_us", 0.0) / 1e6
    window_s = our_gpu if our_gpu is not None else kin_s
    share = busy_s / window_s if window_s else None
    kernels = sorted(gpu["kernels"].items(), key=lambda kv: -kv[1][1])
    ops = sorted(host["ops"].items(), key=lambda kv: -kv[1][1])
    return {"name": name, "count": host["count"] or ours.get("count", 0), "cpu_seconds": host["cpu_us"] / 1e6,
            "our_gpu_window_seconds": our_gpu, "our_gpu_count": ours.get("gpu_count", 0),
            "kineto_gpu_window_seconds": kin_s, "kineto_gpu_count": kin[0] if kin else 0,
            "kernel_busy_seconds": busy_s, "busy_share": share,
            "bound": _verdict(share, window_s, gpu.get("gpu_events", 0)),
            "idle_seconds": max(0.0, window_s - busy_s) if window_s else None,
            "host_launch_seconds": host["launch_us"] / 1e6, "launches": host["launches"],
            "host_sync_seconds": host["sync_us"] / 1e6, "host_alloc_seconds": host["alloc_us"] / 1e6,
            "allocations": {"count": host["allocs"][0], "bytes": host["allocs"][1]},
            "kernels": [{"name": k, "count": n, "seconds": us / 1e6} for k, (n, us) in kernels[:top]],
            "kernels_total": {"kinds": len(kernels), "count": sum(n for n, _ in gpu["kernels"].values()),
                              "seconds": sum(us for _, us in gpu["kernels"].values()) / 1e6},
            "copies": copy_rows(gpu["copies"], floors),
            "memsets": {"count": gpu["memsets"][0], "seconds": gpu["memsets"][1] / 1e6, "bytes": gpu["memsets"][2]},
            "cpu_ops": [{"name": k, "count": n, "seconds": us / 1e6} for k, (n, us) in ops[:top]],
            "outside_spans": name == OUTSIDE}


# ---- text ------------------------------------------------------------------------------------------
def _ms(seconds) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.2f}"


def _pct(share) -> str:
    return "-" if share is None else f"{100 * share:.0f}%"


def format_kernels(rep: dict) -> str:
    lines = [f"capture at step {rep['capture']} ({rep['window']}; captures in this run begin at "
             f"{', '.join(map(str, rep['captures']))})" + ("" if rep["aligned"] else
                                                            "; WARNING: the ranks' traces begin at different steps")]
    for r in rep["ranks"]:
        lines += [""] + _rank_lines(r)
    return "\n".join(lines)


def _rank_lines(r: dict) -> list:
    steps = f"steps {r['steps'][0]}-{r['steps'][1]}" if r["steps"] else "no ProfilerStep ranges"
    lines = [f"rank {r['rank']} ({r['role']}, {r['device']}): {r['file']}, {r['bytes'] / 1e6:.2f} MB, {steps}"]
    if r["device"] == "cuda":
        lines.append(f"  {'span':<22}{'n':>4}{'GPU window ms':>14}{'busy ms':>10}{'busy':>6}{'idle ms':>10}"
                     f"{'launch ms':>11}{'sync ms':>9}  verdict")
        for s in r["spans"]:
            lines.append(f"  {s['name']:<22}{s['count']:>4}{_ms(s['our_gpu_window_seconds']):>14}"
                         f"{_ms(s['kernel_busy_seconds']):>10}{_pct(s['busy_share']):>6}{_ms(s['idle_seconds']):>10}"
                         f"{_ms(s['host_launch_seconds']):>11}{_ms(s['host_sync_seconds']):>9}  {s['bound'] or ''}")
            lines += _detail_lines(s)
    else:
        lines.append(f"  {'span':<22}{'n':>4}{'CPU ms':>10}  top CPU ops (top-level, count x, ms)")
        for s in r["spans"]:
            ops = ", ".join(f"{o['name']} {o['count']}x {_ms(o['seconds'])}" for o in s["cpu_ops"][:4])
            lines.append(f"  {s['name']:<22}{s['count']:>4}{_ms(s['cpu_seconds']):>10}  {ops}")
    return lines


def _detail_lines(s: dict) -> list:
    out = [f"      kernel {k['name'][:70]}: {k['count']}x, {_ms(k['seconds'])} ms" for k in s["kernels"][:4]]
    for c in s["copies"]:
        bw = "-" if c["bytes_per_s"] is None else f"{c['bytes_per_s'] / 1e9:.1f} GB/s"
        floor = (f" ({_pct(c['floor_share'])} of the {c['floor']} floor)" if c["floor_share"] is not None else
                 f" (no {c['floor']} floor measured)")
        out.append(f"      copy {c['name']}: {c['count']}x, {c['bytes'] / 1e6:.1f} MB, {_ms(c['seconds'])} ms, "
                   f"{bw}{floor}")
    if s["memsets"]["count"]:
        out.append(f"      memset: {s['memsets']['count']}x, {_ms(s['memsets']['seconds'])} ms")
    if s["allocations"]["count"] or s["host_alloc_seconds"]:
        out.append(f"      allocator: {s['allocations']['count']} allocations, "
                   f"{s['allocations']['bytes'] / 1e6:.1f} MB; {_ms(s['host_alloc_seconds'])} ms in cudaMalloc/Free")
    return out
