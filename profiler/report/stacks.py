"""`dflash-report stacks`: the run's stack samples as flame graphs of host time. Standard library only (no torch).

Input: the whole stacks each interval's `stack_samples` holds (profiler/stacks.py `StackSampler`, recorded with
`dflash-train --stack-samples-per-interval K`: per thread its most common stacks, root first, and an `other_samples`
count for the rest) and, with `snapshots`, the `snapshot` records' full per-thread stacks (one sample per thread per
snapshot, in profiles of their own, never mixed into the sampled counts).

Output: speedscope's file format (https://www.speedscope.app/file-format-schema.json; the jlfwong/speedscope
repository's src/lib/file-format-spec.ts): one "sampled" profile per rank, role and thread, named
"rank0 drafter / MainThread (N samples, whole run)", weights in samples (unit "none"), the hottest training thread
shown first; or folded stacks ("frame;frame;frame count" per line, what flamegraph.pl and inferno read), each
stack under two root frames, "rank0 drafter" and the thread's name, so one flame graph holds every rank.

Synthetic frames: IDLE is the leaf of a sample where py-spy saw the thread waiting (left out with `running_only`:
CPU time, not wall time), OTHER stands for the stacks an interval did not keep, NO_FRAMES for a sample without a
Python frame. A thread's weights add up to its samples in the logs (less its idle ones with `running_only`).

The profiler's own threads (profiler.threadcpu.is_profiler_thread: `profiler.*`, the metrics endpoint, the OTel
exporter) are left out unless `profiler_threads`, and then drawn as profiles of their own marked PROFILER_MARK.
"""
from __future__ import annotations

import json
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from profiler.schema import views
from profiler.report.runs import ReportError, Run, load_run
from profiler.threadcpu import is_profiler_thread

SCHEMA_URL = "https://www.speedscope.app/file-format-schema.json"
IDLE = "(idle)"
OTHER = "(other stacks)"
NO_FRAMES = "(no Python frames)"
MISSING = "(frame missing from the log)"
PROFILER_MARK = " [profiler]"
WINDOW = "whole run"
_LABEL = re.compile(r"^(?P<name>.*) \((?P<file>[^()]*):(?P<line>\d+|\?)\)$")


@dataclass
class ThreadStacks:
    """One profile: a thread of a rank (or its snapshots), its stacks root first with their sample counts."""
    rank: int
    role: str
    thread: str
    snapshots: bool = False
    counts: Counter = field(default_factory=Counter)   # (frame label, ...) -> samples
    samples: int = 0    # the log's samples of the thread (snapshots: how many held it)
    idle: int = 0       # of them, where it waited

    @property
    def profiler(self) -> bool:
        return is_profiler_thread(self.thread)

    @property
    def weight(self) -> int:
        return sum(self.counts.values())

    def root(self) -> str:
        return f"rank{self.rank} {self.role}" + (" (snapshots)" if self.snapshots else "")

    def name(self) -> str:
        mark = PROFILER_MARK if self.profiler else ""
        what = (f"{self.weight} snapshots" if self.snapshots else
                f"{self.weight} samples" if self.weight == self.samples else
                f"{self.weight} running of {self.samples} samples")
        return f"rank{self.rank} {self.role} / {self.thread}{mark} ({what}, {WINDOW})"


@dataclass
class Stacks:
    """What a run's logs hold for flame graphs."""
    run_dir: str
    threads: list            # [ThreadStacks], rank order, the training's threads hottest first
    intervals: int = 0       # intervals with whole-stack samples
    dumps: int = 0           # their py-spy dumps
    failed: int = 0          # dumps that failed
    profiler_left_out: int = 0   # profiler threads not drawn (profiler_threads=False)
    snapshots: int = 0       # snapshot records drawn

    def summary_line(self) -> str:
        ranks = len({t.rank for t in self.threads})
        sampled = sum(t.weight for t in self.threads if not t.snapshots)
        parts = [f"{len(self.threads)} profiles of {ranks} ranks: {sampled} thread samples from {self.dumps} "
                 f"dumps over {self.intervals} intervals ({WINDOW})"]
        if self.snapshots:
            parts.append(f"{self.snapshots} snapshots")
        if self.failed:
            parts.append(f"{self.failed} failed dumps")
        if self.profiler_left_out:
            parts.append(f"{self.profiler_left_out} profiler threads left out (--profiler-threads)")
        return "; ".join(parts)


def _labels(table: list, indexes: list) -> tuple:
    """A recorded stack's frame indexes as labels; an index outside the interval's table reads as MISSING."""
    return tuple(table[i] if type(i) is int and 0 <= i < len(table) and type(table[i]) is str else MISSING
                 for i in indexes) or (NO_FRAMES,)


def _add_thread(acc: ThreadStacks, table: list, t: views.SampledThread, running_only: bool) -> None:
    """One interval's entry of a thread: each kept stack's running samples, its idle ones under IDLE, and the
    samples of the stacks not kept under OTHER."""
    pieces = [(_labels(table, s.frames), s.count, s.idle_samples) for s in t.stacks]
    pieces.append(((OTHER,), t.other_samples, t.other_idle_samples))
    for stack, count, idle in pieces:
        idle = max(0, min(idle, count))   # a damaged entry never adds samples the thread did not have
        if count - idle > 0:
            acc.counts[stack] += count - idle
        if idle > 0 and not running_only:
            acc.counts[stack + (IDLE,)] += idle
    acc.samples += t.samples if t.samples is not None else sum(n for _, n, _ in pieces)
    acc.idle += t.idle_samples or 0


def _sampled(run: Run, roles: set, running_only: bool, out: dict) -> tuple[int, int, int, int]:
    """Every interval's whole stacks into `out` {(rank, thread): ThreadStacks}; (intervals with whole stacks,
    their dumps, failed dumps, intervals whose stack_samples predate whole stacks)."""
    intervals = dumps = failed = older = 0
    for log in run.ranks.values():
        if log.role not in roles:
            continue
        for rec in map(views.interval, log.intervals):
            ss = rec.stack_samples
            if ss.samples is None:
                continue
            if not ss.whole_stacks:   # written before whole stacks were recorded: hot frames only
                older += 1
                continue
            intervals, dumps, failed = intervals + 1, dumps + ss.samples, failed + (ss.failed or 0)
            for t in ss.threads:
                key = (log.rank, t.name or f"thread {t.native_id}", False)
                acc = out.setdefault(key, ThreadStacks(log.rank, log.role, key[1]))
                _add_thread(acc, ss.frames, t, running_only)
    return intervals, dumps, failed, older


def _snapshots(run: Run, roles: set, out: dict) -> int:
    """Every snapshot record's threads into `out`, one sample each, stacks root first; how many records."""
    n = 0
    for log in run.ranks.values():
        if log.role not in roles:
            continue
        for snap in map(views.snapshot, log.snapshots):
            n += 1
            for t in snap.threads:
                key = (log.rank, t.name or f"thread {t.native_id}", True)
                acc = out.setdefault(key, ThreadStacks(log.rank, log.role, key[1], snapshots=True))
                frames = [f if type(f) is str else MISSING for f in t.frames]
                acc.counts[tuple(reversed(frames)) or (NO_FRAMES,)] += 1
                acc.samples += 1
    return n


def _roles(run: Run, role: str | None) -> set:
    roles = {log.role for log in run.ranks.values()}
    if role is not None and role not in roles:
        raise ReportError(f"{run.run_dir}: no rank has role {role!r} (its roles: {', '.join(sorted(map(str, roles)))})")
    return {role} if role is not None else roles


def _no_samples(run: Run, older: int, snapshots: bool) -> ReportError:
    how = ("run dflash-train with --stack-samples-per-interval K" if run.pipeline else
           "give the Profiler deps=ProfilerDeps(stack_sampler=profiler.stacks.make_stack_sampler(os.getpid(), K, "
           "interval_s)), as dflash-train's --stack-samples-per-interval K does")
    why = (f"its {older} intervals' stack_samples predate whole stacks" if older else "no stack samples")
    n_snaps = sum(len(log.snapshots) for log in run.ranks.values())
    snaps = f"; --snapshots draws its {n_snaps} dflash-profile snapshot records" if n_snaps and not snapshots else ""
    return ReportError(f"{run.run_dir}: {why} in the run logs, nothing to draw: {how}{snaps}")


def collect(run: Run, role: str | None = None, profiler_threads: bool = False, running_only: bool = False,
            snapshots: bool = False) -> Stacks:
    """The run's stacks per rank and thread (module doc); ReportError for an unknown role or nothing to draw."""
    roles = _roles(run, role)
    out: dict = {}
    intervals, dumps, failed, older = _sampled(run, roles, running_only, out)
    n_snaps = _snapshots(run, roles, out) if snapshots else 0
    drawn = [t for t in out.values() if t.weight > 0]
    kept = [t for t in drawn if profiler_threads or not t.profiler]
    if not drawn:
        raise _no_samples(run, older, snapshots)
    if not kept:
        raise ReportError(f"{run.run_dir}: only the profiler's own threads have stack samples; --profiler-threads "
                          "draws them")
    kept.sort(key=lambda t: (t.rank, t.snapshots, t.profiler, -(t.samples - t.idle), t.thread))
    return Stacks(run.run_dir, kept, intervals, dumps, failed, len(drawn) - len(kept), n_snaps)


def frame_object(label: str) -> dict:
    """A frame label ("func (file.py:123)", profiler.stacks.frame_label) as speedscope's Frame."""
    m = _LABEL.match(label)
    if m is None:
        return {"name": label}
    frame = {"name": m["name"], "file": m["file"]}
    if m["line"] != "?":
        frame["line"] = int(m["line"])
    return frame


def _exporter() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return f"dflash-report@{version('dflash-observability')}"
    except PackageNotFoundError:
        return "dflash-report"


def speedscope(stacks: Stacks) -> dict:
    """The speedscope file: shared frames, one sampled profile per thread (its stacks, most samples first)."""
    index: dict = {}
    profiles = []
    for t in stacks.threads:
        rows = sorted(t.counts.items(), key=lambda kv: (-kv[1], kv[0]))
        profiles.append({"type": "sampled", "name": t.name(), "unit": "none", "startValue": 0, "endValue": t.weight,
                         "samples": [[index.setdefault(f, len(index)) for f in stack] for stack, _ in rows],
                         "weights": [n for _, n in rows]})
    hottest = max(range(len(stacks.threads)), default=0, key=lambda i: (
        not stacks.threads[i].snapshots and not stacks.threads[i].profiler,
        stacks.threads[i].samples - stacks.threads[i].idle, -i))
    return {"$schema": SCHEMA_URL, "shared": {"frames": [frame_object(f) for f in index]}, "profiles": profiles,
            "name": f"{Path(stacks.run_dir).name}: stack samples ({WINDOW})", "activeProfileIndex": hottest,
            "exporter": _exporter()}


def _folded_frame(label: str) -> str:
    """A frame as folded stacks can hold it: no `;` (the separator) and no line break."""
    return label.replace(";", ",").replace("\n", " ").replace("\r", " ")


def folded(stacks: Stacks) -> str:
    """Folded stacks: "rank0 drafter;THREAD;frame;...;leaf COUNT" per line, sorted; profiler threads' second
    frame marked PROFILER_MARK, snapshots' first frame "(snapshots)"."""
    lines = []
    for t in stacks.threads:
        head = [t.root(), t.thread + (PROFILER_MARK if t.profiler else "")]
        lines += [";".join(map(_folded_frame, head + list(stack))) + f" {n}" for stack, n in t.counts.items()]
    return "".join(line + "\n" for line in sorted(lines))


def render(run_dir, folded_text: bool = False, role: str | None = None, profiler_threads: bool = False,
           running_only: bool = False, snapshots: bool = False) -> tuple[str, Stacks]:
    """(the file's text, what it holds): speedscope JSON, or folded stacks with `folded_text`."""
    stacks = collect(load_run(run_dir), role, profiler_threads, running_only, snapshots)
    text = folded(stacks) if folded_text else json.dumps(speedscope(stacks), separators=(",", ":")) + "\n"
    return text, stacks


def default_path(run_dir, folded_text: bool) -> Path:
    return Path(run_dir) / "stacks" / ("stacks.folded" if folded_text else "stacks.speedscope.json")


def write(text: str, path) -> Path:
    """`text` written to `path` whole (a temporary file beside it, renamed), its folder made; OSError otherwise."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
