"""`dflash-profile snapshot`: a live process's own state (control endpoint) merged with its py-spy stacks.

Standard library only. For one pid: the endpoint's `state` and `py-spy dump --json`, joined per thread on the
OS thread id (without an endpoint: stacks, with a note); for a run directory: every live rank at once, and
who waits on whom. A span is stuck when open longer than max(STUCK_FACTOR x recent p95, STUCK_FLOOR_S), its
recent p95 the larger of CPU and GPU in the latest closed interval in which it finished (the live last
interval, else the run log); without one it is not judged and `stuck_basis` says why.
"""
from __future__ import annotations

import functools
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from profiler.schema import views
from profiler.control import default_discovery_dir, discover, discover_all, pid_alive, query
from profiler.schema.records import read_records
from profiler.stacks import NO_SUCH_PID, PySpy, StackError, read_threads
from profiler.threadcpu import is_profiler_thread

STUCK_FACTOR = 10.0
STUCK_FLOOR_S = 5.0
STUCK_RULE = f"open longer than max({STUCK_FACTOR:g} x recent p95, {STUCK_FLOOR_S:g} s)"
NO_LIVE_RANK = "no_live_rank"


class SnapshotError(StackError):
    """A snapshot that cannot be taken at all (one-line message; the CLI exits 2)."""


# ---- one process -----------------------------------------------------------------------------
def check_pid(pid: int) -> None:
    if not isinstance(pid, int) or pid <= 0:
        raise SnapshotError(NO_SUCH_PID, f"no such pid {pid!r} (a pid is a positive integer)")
    if not pid_alive(pid):   # another user's process counts: py-spy says whether we may trace it
        raise SnapshotError(NO_SUCH_PID, f"no such pid {pid}")


def live_state(pid: int, discovery_dir=None):
    """(discovery record or None, state or None, note or None) of a process."""
    directory = default_discovery_dir(discovery_dir)
    try:
        record = discover(pid, directory)
    except ValueError as exc:
        return None, None, f"no control endpoint ({exc}); stacks only"
    if record is None:
        return None, None, (f"no control endpoint: pid {pid} has no discovery file in {directory} (not a "
                            "profiled dflash process, or its endpoint is off); stacks only")
    reply = query(record["socket_path"], "state")
    if not reply.get("ok"):
        return record, None, f"control endpoint did not answer ({reply.get('error')}); stacks only"
    return record, reply["state"], None


def interval_p95_seconds(interval, name: str) -> float | None:
    """The larger of a span's CPU and GPU p95 in one interval record (a dict or views.Interval; None when it did
    not finish)."""
    entry = views.interval(interval).spans.get(name)
    if entry is None:
        return None
    values = [p for p in (entry.cpu.p95_seconds, entry.gpu.p95_seconds if entry.gpu else None) if p is not None]
    return max(values) if values else None


def recent_p95(last_interval: dict | None, log_path: Path | None):
    """name -> (recent p95 or None, why not): the live last interval first, then the run log."""
    @functools.cache
    def logged() -> list:
        """The run log's intervals, newest first, read once when first needed."""
        try:
            return [r for r in map(views.view, read_records(log_path)[0]) if isinstance(r, views.Interval)][::-1]
        except (OSError, TypeError):
            return []

    def lookup(name: str):
        if last_interval is None:
            return None, "no interval closed yet: no recent p95 to judge against"
        p95_s = interval_p95_seconds(last_interval, name)
        if p95_s is None:
            p95_s = next((p for p in (interval_p95_seconds(i, name) for i in logged()) if p is not None), None)
        if p95_s is None:
            return None, f"{name} has not finished in any closed interval: no recent p95 to judge against"
        return p95_s, None
    return lookup


def judge_span(name: str, open_s: float, p95_lookup) -> dict:
    p95_s, why_not = p95_lookup(name)
    limit_s = max(STUCK_FACTOR * p95_s, STUCK_FLOOR_S) if p95_s is not None else None
    view = {"name": name, "open_seconds": open_s, "p95_seconds": p95_s, "limit_seconds": limit_s,
            "stuck": limit_s is not None and open_s > limit_s}
    return view if why_not is None else dict(view, stuck_basis=why_not)


def thread_view(name: str, native_id, role, spans_entry, stack: dict | None, p95_lookup) -> dict:
    """One thread: its open spans (`spans_entry`, an `open_spans` entry or None) judged, beside its py-spy stack."""
    spans = [judge_span(s.name, s.open_seconds, p95_lookup) for s in views.OpenSpans.of(spans_entry).spans]
    stuck = next((s for s in reversed(spans) if s["stuck"]), None)  # the innermost stuck span
    frames = stack["frames"] if stack else []
    view = {"name": name, "native_id": native_id, "role": role, "profiler": is_profiler_thread(name),
            "active": stack["active"] if stack else None, "owns_gil": stack["owns_gil"] if stack else None,
            "open_spans": spans, "stuck": stuck is not None, "stuck_span": stuck["name"] if stuck else None,
            "stuck_frame": frames[0] if stuck and frames else None, "frames": frames}
    if stack is None:
        view["note"] = "not in the py-spy dump (the thread ended between the two views?)"
    return view


def merge_threads(stacks: list, active_spans: list, role, p95_lookup) -> list:
    """py-spy threads joined with the profiler's open spans on the OS thread id; stuck threads
    first, then threads with open spans, then the rest, the profiler's own threads last (py-spy's order within each
    group)."""
    by_id = {entry.native_id: entry for entry in map(views.OpenSpans.of, active_spans)}
    threads = [thread_view(t["name"], t["native_id"], role, by_id.pop(t["native_id"], None), t, p95_lookup)
               for t in stacks]
    threads += [thread_view(e.thread, e.native_id, role, e, None, p95_lookup) for e in by_id.values()]
    return sorted(threads, key=lambda v: (not v["stuck"], not v["open_spans"], v["profiler"]))


def summarize_interval(record, top_spans: int = 6) -> dict | None:
    """The last closed interval (a record, or None) in a snapshot: its spans by share and its counters' rates."""
    if not record:
        return None
    rec = views.interval(record)
    ranked = sorted(rec.spans.items(), key=lambda kv: -(kv[1].share or 0.0))
    return {"index": rec.index, "step": rec.step, "duration_seconds": rec.duration_seconds, "final": rec.final,
            "spans": [{"name": name, "count": e.count, "share": e.share,
                       "p95_seconds": interval_p95_seconds(rec, name)} for name, e in ranked[:top_spans]],
            "per_second": {k: c.per_second for k, c in rec.counters.items()}}


def memory_now(state: dict) -> dict:
    """NVML now (the sampler's latest) and the allocator now, as the profiler's state carries them."""
    nvml = dict(state.get("memory") or {})
    allocator = nvml.pop("allocator", None)
    return {"nvml": nvml or None, "allocator": allocator}


def snapshot_process(pid: int, native: bool = False, runner=None, discovery_dir=None) -> dict:
    """One process: its live state merged with its stacks. Raises StackError (one line) when the
    pid does not exist or its stacks cannot be taken."""
    check_pid(pid)
    record, state, note = live_state(pid, discovery_dir)
    runner = runner or PySpy()
    start_s = time.perf_counter()
    stacks = read_threads(runner(pid, native=native))
    pyspy_s = time.perf_counter() - start_s
    state, record = state or {}, record or {}
    rank, role = state.get("rank", record.get("rank")), state.get("role", record.get("role"))
    run_dir = state.get("run_dir") or record.get("run_dir")
    last = state.get("last_interval")
    log = Path(run_dir) / "profile" / f"rank{rank}.jsonl" if run_dir is not None and rank is not None else None
    p95 = recent_p95(last, log)
    threads = merge_threads(stacks, state.get("active_spans") or [], role, p95)
    basis = None if last or not state else "no interval closed yet: stuck detection needs a recent p95"
    return {"pid": pid, "time_unix": time.time(), "rank": rank, "role": role, "step": state.get("step"),
            "run_dir": run_dir, "endpoint": record.get("socket_path") if state else None, "note": note,
            "native": native, "pyspy_seconds": pyspy_s, "stuck_rule": STUCK_RULE, "stuck_basis": basis,
            "stuck": any(t["stuck"] for t in threads), "intervals_closed": state.get("intervals_closed"),
            "last_interval": summarize_interval(last), "memory": memory_now(state) if state else None,
            "threads": threads}


# ---- a whole run -----------------------------------------------------------------------------
def live_ranks(run_dir, discovery_dir=None) -> list[dict]:
    """Discovery records of the run's live processes, in rank order."""
    wanted = str(Path(run_dir).resolve())
    found = [r for r in discover_all(discovery_dir) if r.get("run_dir") == wanted and pid_alive(r["pid"])]
    return sorted(found, key=lambda r: (r.get("rank", -1), r["pid"]))


def _snapshot_or_error(record: dict, **kwargs) -> dict:
    try:
        return snapshot_process(record["pid"], **kwargs)
    except StackError as exc:
        return {"pid": record["pid"], "rank": record.get("rank"), "role": record.get("role"),
                "error": str(exc), "error_kind": exc.kind, "threads": []}


def snapshot_run(run_dir, waits_for_role: dict | None = None, native: bool = False, runner=None,
                 discovery_dir=None) -> dict:
    """Every live rank of a run at once (one thread each, so the views are simultaneous). `waits_for_role`
    ({span name: role}, the caller's span contract) names the spans in which a rank waits on ranks of another
    role: who waits on whom. SnapshotError (no_live_rank) when the run has no live rank."""
    ranks = live_ranks(run_dir, discovery_dir)
    if not ranks:
        raise SnapshotError(NO_LIVE_RANK, f"no live rank of {run_dir}: no discovery file in "
                                          f"{default_discovery_dir(discovery_dir)} names it (the run ended, has "
                                          "not started, or runs with its endpoint off)")
    kwargs = dict(native=native, runner=runner, discovery_dir=discovery_dir)
    with ThreadPoolExecutor(max_workers=len(ranks)) as pool:
        snaps = list(pool.map(lambda r: _snapshot_or_error(r, **kwargs), ranks))
    return {"run_dir": str(Path(run_dir).resolve()), "time_unix": time.time(), "ranks": snaps,
            "waits": explain_waits(snaps, waits_for_role or {})}


def explain_waits(snaps: list, waits_for_role: dict) -> list[dict]:
    """Each thread stuck in a waiting span (a key of `waits_for_role`), with the ranks of the role it waits
    on that are stuck in a span of their own (the likely cause)."""
    culprits = [(s, t) for s in snaps for t in s["threads"] if t["stuck"] and t["stuck_span"] not in waits_for_role]
    waits = []
    for snap in snaps:
        for t in snap["threads"]:
            if not t["stuck"] or t["stuck_span"] not in waits_for_role:
                continue
            want = waits_for_role[t["stuck_span"]]
            span = next(s for s in t["open_spans"] if s["name"] == t["stuck_span"])
            waits.append({"rank": snap["rank"], "role": snap["role"], "thread": t["name"], "span": span["name"],
                          "open_seconds": span["open_seconds"], "waits_for_role": want,
                          "stuck_ranks": [{"rank": s["rank"], "thread": c["name"], "span": c["stuck_span"],
                                           "frame": c["stuck_frame"]} for s, c in culprits if s["role"] == want]})
    return waits


# ---- keeping a snapshot ----------------------------------------------------------------------
def record_fields(snap: dict, file_path: str | None) -> dict:
    keys = ("name", "native_id", "open_spans", "stuck", "stuck_span", "stuck_frame", "frames")
    return {"pid": snap["pid"], "step": snap["step"], "native": snap["native"], "file": file_path,
            "stuck": snap["stuck"], "stuck_rule": snap["stuck_rule"], "note": snap["note"],
            "threads": [{k: t[k] for k in keys} for t in snap["threads"]]}


def _write_json(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)  # readers never see a half-written snapshot


def keep_snapshot(snap: dict) -> dict:
    """Write the snapshot under RUN_DIR/snapshots/ and have the process record it in its run log;
    returns (and sets as snap["kept"]) {"file", "recorded", "reason"}. Never raises: a run
    directory we cannot write to still gets the run-log record, and the reason says why no file."""
    if not snap.get("run_dir") or "error" in snap:
        why = snap.get("error") or "no run directory (no endpoint)"
        snap["kept"] = {"file": None, "recorded": False, "reason": why}
        return snap["kept"]
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(snap["time_unix"])) + f"{snap['time_unix'] % 1:.3f}"[1:]
    path = Path(snap["run_dir"]) / "snapshots" / f"{stamp}Z-rank{snap['rank']}-pid{snap['pid']}.json"
    reasons = []
    try:
        _write_json(path, snap)
    except OSError as exc:
        reasons.append(f"no file: {exc.strerror or exc}: {exc.filename or path}")
        path = None
    reply = {"ok": False, "error": "no control endpoint answered"}
    if snap.get("endpoint"):
        reply = query(snap["endpoint"], "record", fields=record_fields(snap, str(path) if path else None))
    if not reply.get("ok"):
        reasons.append(reply.get("error"))
    snap["kept"] = {"file": str(path) if path else None, "recorded": bool(reply.get("ok")),
                    "reason": "; ".join(reasons) or None}
    return snap["kept"]

# ---- human output ----------------------------------------------------------------------------
FRAMES_SHOWN = 5


def _gib(n) -> str:
    return "?" if n is None else f"{n / 2**30:.2f} GiB"


def _memory_line(memory: dict) -> str:
    nvml, allocator, parts = memory.get("nvml") or {}, memory.get("allocator"), []
    if nvml.get("available") is False:
        parts.append(f"NVML: {nvml.get('reason')}")
    for g in nvml.get("gpus") or []:
        parts.append(f"gpu{g['index']}: {g.get('reason')}" if "used_bytes" not in g else
                     f"gpu{g['index']} {_gib(g['used_bytes'])} used of {_gib(g['total_bytes'])} "
                     f"({_gib(g.get('headroom_bytes'))} headroom)")
    if isinstance(allocator, dict):
        parts.append(f"allocator: {allocator.get('reason')}" if allocator.get("available") is False else
                     f"allocator {_gib(allocator.get('allocated_bytes'))} allocated, "
                     f"{_gib(allocator.get('reserved_bytes'))} reserved")
    return "memory: " + ("; ".join(parts) or "not reported")


def rate_text(per_s: float) -> str:
    """A rate with at least three significant digits: 0.4 steps/s reads "0.4", 1739.2 tokens/s "1,739"."""
    return f"{per_s:,.0f}" if abs(per_s) >= 100 else f"{per_s:.3g}"


def _interval_line(last: dict) -> str:
    spans = ", ".join(f"{s['name']} {100 * (s['share'] or 0):.0f}%" +
                      (f" (p95 {s['p95_seconds']:.3f} s)" if s["p95_seconds"] is not None else "")
                      for s in last["spans"]) or "no span finished"
    rates = ", ".join(f"{k} {rate_text(v)}/s" for k, v in last["per_second"].items() if v is not None)
    return (f"last interval #{last['index']} ({last['duration_seconds']:.1f} s, to step {last['step']}): "
            f"{spans}" + (f"; {rates}" if rates else ""))


def _thread_lines(t: dict) -> list[str]:
    state = "running" if t["active"] else "waiting" if t["active"] is False else "not in the dump"
    head = f"  {t['name']} (native id {t['native_id']}, {state})"
    if t["stuck"]:
        span = next(s for s in t["open_spans"] if s["name"] == t["stuck_span"])
        head += (f"  STUCK in {span['name']}: open {span['open_seconds']:.1f} s > {span['limit_seconds']:.1f} s "
                 f"(recent p95 {span['p95_seconds']:.3f} s) at {t['stuck_frame']}")
    lines = [head]
    if t["open_spans"]:
        nested = " > ".join(f"{s['name']} {s['open_seconds']:.2f} s" for s in t["open_spans"])
        lines.append(f"      open spans: {nested}")
    lines += [f"      {'at' if i == 0 else '  '} {f}" for i, f in enumerate(t["frames"][:FRAMES_SHOWN])]
    if len(t["frames"]) > FRAMES_SHOWN:
        more = len(t["frames"]) - FRAMES_SHOWN
        lines.append(f"         ... {more} outer frame{'s' * (more > 1)} (--json for all)")
    return lines


def _apart(t: dict) -> bool:
    """A profiler thread with nothing of the training's to show (no open span, not stuck): one word, not a stack."""
    return bool(t.get("profiler")) and not t["open_spans"] and not t["stuck"]


def format_process(snap: dict) -> str:
    """A human-readable snapshot of one process."""
    if "error" in snap:
        return f"pid {snap['pid']}  rank {snap['rank']}  role {snap['role']}: {snap['error']}"
    who = f"pid {snap['pid']}" + (f"  rank {snap['rank']}  role {snap['role']}  step {snap['step']}"
                                  if snap["endpoint"] else "")
    lines = [who + (f"  (endpoint {snap['endpoint']})" if snap["endpoint"] else "")]
    lines += [f"note: {snap['note']}"] if snap["note"] else []
    if snap["endpoint"]:
        lines.append(_interval_line(snap["last_interval"]) if snap["last_interval"] else
                     f"last interval: none closed yet ({snap['stuck_basis']})")
        lines.append(_memory_line(snap["memory"]))
        lines.append(f"stuck rule: a span {STUCK_RULE}")
    own = [t for t in snap["threads"] if _apart(t)]
    lines.append(f"py-spy dump{' --native' if snap['native'] else ''}: {1000 * snap['pyspy_seconds']:.0f} ms, "
                 f"{len(snap['threads'])} threads (innermost frame first)")
    for t in snap["threads"]:
        lines += [] if _apart(t) else _thread_lines(t)
    if own:
        lines.append(f"  the profiler's own {len(own)} thread{'s' * (len(own) > 1)}, apart (--json for their stacks): "
                     + ", ".join(f"{t['name']} ({'running' if t['active'] else 'waiting'})" for t in own))
    kept = snap.get("kept")
    if kept and snap["endpoint"]:
        lines.append(f"kept: {kept['file'] or 'no file'}; " + ("recorded in the run log" if kept["recorded"] else
                                                              "not recorded in the run log")
                     + (f" ({kept['reason']})" if kept["reason"] else ""))
    return "\n".join(lines)


def _rank_state(snap: dict, waiting: set) -> str:
    if "error" in snap:
        return f"error: {snap['error']}"
    stuck = [t for t in snap["threads"] if t["stuck"]]
    if stuck:
        t = stuck[0]
        span = next(s for s in t["open_spans"] if s["name"] == t["stuck_span"])
        verb = "waits (stuck) in" if (snap["rank"], t["name"]) in waiting else "STUCK in"
        return f"{verb} {span['name']} {span['open_seconds']:.1f} s on {t['name']} at {t['stuck_frame']}"
    busy = [(t["name"], t["open_spans"][-1]) for t in snap["threads"] if t["open_spans"]]
    return "; ".join(f"{name}: {s['name']} {s['open_seconds']:.2f} s" for name, s in busy) or "no open span"


def format_run(run: dict) -> str:
    """Every rank side by side (one line each), who waits on whom, then each rank in full."""
    lines = [f"run {run['run_dir']}: {len(run['ranks'])} live ranks", "  rank  role      pid      step  state"]
    waiting = {(w["rank"], w["thread"]) for w in run["waits"]}
    for s in run["ranks"]:
        lines.append(f"  {s['rank']!s:<5} {s['role']!s:<9} {s['pid']:<8} {s.get('step')!s:<5} "
                     f"{_rank_state(s, waiting)}")
    for w in run["waits"]:
        cause = "; ".join(f"rank {c['rank']} is stuck in {c['span']} at {c['frame']}" for c in w["stuck_ranks"])
        cause = cause or f"no {w['waits_for_role']} rank is stuck in a span of its own"
        lines.append(f"rank {w['rank']} ({w['role']}) waits in {w['span']} for {w['open_seconds']:.1f} s on the "
                     f"{w['waits_for_role']} ranks: {cause}")
    for s in run["ranks"]:
        lines += ["", format_process(s)]
    return "\n".join(lines)
