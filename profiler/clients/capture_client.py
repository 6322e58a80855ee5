"""`dflash-profile capture` and `dflash-profile memory`: the client side of the endpoint's `capture` and `memory`
commands. Standard library only.

A capture of a run asks every live rank for its step (`probe`), then arms each at the same absolute step N: the
next multiple of `round_to` at least MIN_AHEAD steps beyond the furthest rank (like dynolog's roundup), or the
`at_step` given. A rank that has moved past N by the time it is asked says so; without `at_step` every rank is
armed again at a later N (a rank's armed request is replaced), with it that line is the answer. Then it waits for
each rank's `capture` event in its run log, which names the file.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from profiler.schema import views
from profiler.capture import MAX_STEPS
from profiler.control import default_discovery_dir, discover, pid_alive, query
from profiler.clients.snapshot import live_ranks

ROUND_TO = 10
MIN_AHEAD = 2
"""Steps between the furthest rank and the capture's first: the ranks move on while they are asked."""
ARM_TRIES = 3
QUERY_TIMEOUT_S = 5.0
MEMORY_TIMEOUT_S = 120.0   # a snapshot of a large allocator with its history takes a while to pickle


class CaptureError(ValueError):
    """Nothing can be asked or armed: one line (the CLI exits 2)."""


def ranks_of(pid: int | None = None, run_dir=None, discovery_dir=None) -> list[dict]:
    """Discovery records of the ranks to ask: one pid, or every live rank of a run directory."""
    directory = default_discovery_dir(discovery_dir)
    if pid is not None:
        if not pid_alive(pid):
            raise CaptureError(f"no such pid {pid}")
        try:
            record = discover(pid, directory)
        except ValueError as exc:
            raise CaptureError(str(exc)) from None
        if record is None:
            raise CaptureError(f"pid {pid} is not a dflash rank of yours: no discovery file {directory}/{pid}.json "
                               "(not a profiled dflash-train rank, another user's, or its endpoint is off)")
        return [record]
    if not Path(run_dir).is_dir():
        raise CaptureError(f"no such run directory: {run_dir}")
    ranks = live_ranks(run_dir, directory)
    if not ranks:
        raise CaptureError(f"no live rank of {run_dir}: the run has ended (or has not started, or runs with its "
                           f"endpoint off): nothing to capture")
    return ranks


def _ask(record: dict, fields: dict, query_fn, timeout_s: float = QUERY_TIMEOUT_S) -> dict:
    reply = query_fn(record["socket_path"], "capture", timeout_s=timeout_s, fields=fields)
    return dict(reply, rank=record.get("rank"), role=record.get("role"), pid=record.get("pid"))


def roundup(step: int, round_to: int = ROUND_TO) -> int:
    """The first multiple of round_to at least MIN_AHEAD steps after `step`."""
    return -(-(step + MIN_AHEAD) // round_to) * round_to


def arm(records: list, steps: int, at_step: int | None = None, round_to: int = ROUND_TO, options=None,
        query_fn=query) -> dict:
    """Arm every rank at one step: {"at_step", "replies"}; CaptureError (one line) when a rank cannot be."""
    if not 1 <= steps <= MAX_STEPS:
        raise CaptureError(f"--steps must be from 1 to {MAX_STEPS}, got {steps}")
    probes = [_ask(r, {"probe": True}, query_fn) for r in records]
    _raise_first(probes)
    n = at_step if at_step is not None else roundup(max(p["step"] for p in probes), round_to)
    for _ in range(ARM_TRIES):
        replies = [_ask(r, {"at_step": n, "steps": steps, **(options or {})}, query_fn) for r in records]
        behind = [r for r in replies if not r.get("ok") and isinstance(r.get("step"), int) and r["step"] >= n]
        if not behind or at_step is not None:
            _raise_first(replies)
            return {"at_step": n, "steps": steps, "replies": replies}
        n = roundup(max(r["step"] for r in behind), round_to)   # a rank moved past n: all again, later
    _raise_first(replies)
    raise CaptureError(f"the ranks kept moving past the step they were asked for ({n}): try --at-step")


def _raise_first(replies: list) -> None:
    bad = next((r for r in replies if not r.get("ok")), None)
    if bad is not None:
        raise CaptureError(f"rank {bad['rank']} ({bad['role']}, pid {bad['pid']}): {bad.get('error')}")


class LogTail:
    """The records appended to a run log after it was opened (whole lines only)."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0
        self.rest = b""

    def new_records(self) -> list:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        self.offset += len(data)
        *lines, self.rest = (self.rest + data).split(b"\n")
        out = []
        for line in lines:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                out.append(rec)
        return out


def wait(records: list, at_step: int, timeout_s: float, tails: dict, clock=time.monotonic, poll_s: float = 0.5) -> list:
    """Each rank's `capture` event for `at_step` (with its "rank", "role"), or {"error"} when the rank ended
    without one or `timeout_s` passed."""
    found: dict = {}
    deadline = clock() + timeout_s
    while True:
        for r in records:
            key = r["rank"]
            if key in found:
                continue
            for rec in map(views.view, tails[key].new_records()):
                if isinstance(rec, views.Capture) and rec.step == at_step:
                    found[key] = dict(rec.raw, pid=r["pid"])
            if key not in found and not pid_alive(r["pid"]):
                found[key] = {"rank": key, "role": r.get("role"), "pid": r["pid"],
                              "error": f"the rank ended before its capture of step {at_step} was written"}
        if len(found) == len(records) or clock() >= deadline:
            break
        time.sleep(poll_s)
    return [found.get(r["rank"]) or {"rank": r["rank"], "role": r.get("role"), "pid": r["pid"],
                                     "error": f"no capture of step {at_step} within {timeout_s:g} s"}
            for r in records]


def tails_of(records: list) -> dict:
    """A LogTail of each rank's run log, opened now (before arming: no event is missed)."""
    return {r["rank"]: LogTail(Path(r["run_dir"]) / "profile" / f"rank{r['rank']}.jsonl") for r in records}


def format_capture(result: dict) -> str:
    """Each rank's answer: its capture event (with its pid), the client's {"rank", "role", "pid", "error"}, or
    (--no-wait) the endpoint's armed reply {"at_step", "file", ...}."""
    lines = [f"capture of steps {result['at_step']}-{result['at_step'] + result['steps'] - 1} "
             f"({result['steps']} step{'s' * (result['steps'] > 1)}) on {len(result['ranks'])} rank(s):"]
    for answer in result["ranks"]:
        ev = views.Capture.of(answer)   # the client's error and the armed reply share the event's rank, role, error
        who = f"  rank {ev.rank} ({ev.role}, pid {answer.get('pid')})"
        if ev.error:
            lines.append(f"{who}: {ev.error}")
        elif "at_step" in answer:   # armed only (--no-wait): the endpoint's reply
            lines.append(f"{who}: armed at step {answer['at_step']}, will write {answer['file']}")
        else:
            first, last = ev.steps
            lines.append(f"{who}: {ev.files[0]}  steps {first}-{last}, {ev.bytes / 1e6:.2f} MB "
                         f"({ev.bytes_per_step / 1e6:.2f} MB a step), {len(ev.captured_spans)} spans")
    return "\n".join(lines)


def memory(records: list, query_fn=query) -> list:
    """Each rank's `memory` reply (with its rank, role, pid)."""
    return [dict(query_fn(r["socket_path"], "memory", timeout_s=MEMORY_TIMEOUT_S), rank=r.get("rank"),
                 role=r.get("role"), pid=r.get("pid")) for r in records]


def format_memory(replies: list) -> str:
    """Each rank's `memory` reply: {"ok": false, "error"}, or the fields of the `memory_snapshot` event it wrote."""
    lines = []
    for r in replies:
        snap = views.MemorySnapshot.of(r)
        who = f"rank {snap.rank} ({snap.role}, pid {r['pid']})"
        lines.append(f"{who}: {r['error']}" if not r.get("ok") else
                     f"{who}: {snap.file}  {snap.allocated_bytes / 2**30:.2f} GiB allocated of "
                     f"{snap.reserved_bytes / 2**30:.2f} GiB reserved in {snap.segments} segments"
                     + ("" if snap.history else " (no allocation history: --memory-history N keeps one)"))
    return "\n".join(lines)
