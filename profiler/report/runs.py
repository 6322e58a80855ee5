"""A run directory's logs loaded once for the report (every rank's records by kind), and the helpers every
analysis shares. Standard library only: `dflash-report` reads run logs without importing torch.
"""
from __future__ import annotations

import bisect
import gc
import os
import statistics
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

from profiler.schema.trace_events import MAX_EVENTS, slice_cost
from profiler.schema import records as rl
from profiler.schema import views
from profiler.schema.span_kinds import SpanKinds, of_run_starts
from profiler.report.background import Background, cores
from profiler.schema.windows import detail_spans, duration_seconds, gpu_index, is_steady, past_warm_up, tick_windows, \
    window_final, window_index
# the report's modules take these accessors from here: an interval's NVML GPUs, windows' wall seconds, a counter's total
from profiler.schema.windows import counter_total, measured_gpus as gpus, wall_seconds  # noqa: F401


class ReportError(ValueError):
    """A run directory the report cannot read: missing, empty, foreign or too new. One line."""


@dataclass
class RankLog:
    """One rank's records by kind, in file order (a resumed run holds several segments)."""
    rank: int
    role: str
    hostname: str | None
    run_starts: list = field(default_factory=list)
    intervals: list = field(default_factory=list)
    events: list = field(default_factory=list)
    snapshots: list = field(default_factory=list)
    run_ends: list = field(default_factory=list)
    ticks: list = field(default_factory=list)     # cumulative `tick` records: profiler.schema.windows.tick_windows
    spans: list = field(default_factory=list)     # detail windows: read for traces only (load_run's with_spans)
    spans_evicted: int | None = 0            # spans of older detail windows let go while loading (DetailWindows);
    spans_profiler_dropped: int | None = 0   # the profiler's `dropped` count over every detail window of the log;
    #                                          both None where the older windows were left unread (load_run's read_older)
    bad_lines: int = 0
    bad_examples: list = field(default_factory=list)   # "file:line: why" of the first bad lines

    @property
    def config(self) -> dict:
        return views.run_start(self.run_starts[-1]).config if self.run_starts else {}

    @cached_property
    def steady_intervals(self) -> Window:
        """steady_window(self, ticks=False), worked out once: every analysis and check reads it, some per role."""
        return _steady_intervals(self)

    @cached_property
    def steady_ticks(self) -> Window:
        """steady_window(self) where the rank has tick windows, worked out once."""
        return _steady_ticks(self)

    @cached_property
    def tick_windows(self) -> list:
        """The windows between the rank's consecutive ticks (profiler.schema.windows.tick_windows), read once, where
        they are finer than its intervals (more of them); none where ticks came only at the closes (tick_s at or
        above interval_s): the intervals, with their whole spans, say the same then."""
        windows = tick_windows(self.ticks)
        return windows if len(windows) > len(self.intervals) else []


PIPELINE_ROLES = ("target", "drafter")
"""dflash-train's roles. A run with neither is a loop of its own (the README's `trainer`, a Hugging Face Trainer):
the report leaves out what only the pipeline has (the verdict, the GPU split, the batch-size margin, dflash-train
flags in advice)."""


@dataclass
class Run:
    run_dir: str
    ranks: dict  # {rank: RankLog}
    empty_logs: int = 0   # rank logs holding not a byte: counted (empty_logs_line), never read as ranks

    @property
    def pipeline(self) -> bool:
        """Whether the run has a target or a drafter rank (PIPELINE_ROLES): dflash-train's, not a loop of its own."""
        return any(log.role in PIPELINE_ROLES for log in self.ranks.values())

    def by_role(self) -> dict:
        """{role: [RankLog, ...]} in rank order."""
        out: dict = {}
        for log in self.ranks.values():
            out.setdefault(log.role, []).append(log)
        return out

    @property
    def config(self) -> dict:
        return next((log.config for log in self.ranks.values() if log.config), {})

    def histogram_bounds_seconds(self) -> list | None:
        return next((bounds for log in self.ranks.values() for s in map(views.run_start, log.run_starts)
                     if (bounds := s.histogram_buckets_seconds)), None)


_KIND_LISTS = {rl.RUN_START: "run_starts", rl.INTERVAL: "intervals", rl.EVENT: "events",
               rl.SNAPSHOT: "snapshots", rl.RUN_END: "run_ends", rl.SPANS: "spans", rl.TICK: "ticks"}


# Detail-window `spans` records are for traces (report.trace), not for this report: a whole such line is
# left unparsed (they are most of a long log's bytes). A cut one is still parsed (and counted as bad).
_SPANS_LINE = b'{"type": "' + rl.SPANS.encode() + b'"'


class DetailWindows:
    """A rank's newest detail-window `spans` records whose slices fit in `max_events` (all a trace draws of it:
    profiler.schema.trace_events.newest_within), kept while the log streams by; older ones are only counted, so a
    week's detail windows cost the report its trace's size, not the log's."""

    def __init__(self, max_events: int):
        self.max_events = max_events
        self.records: deque = deque()
        self._costs: deque = deque()
        self._used = 0
        self.evicted_spans = 0      # spans of the records let go here (never drawn)
        self.profiler_dropped = 0   # the profiler's own `dropped` count, over every record read

    def add(self, rec: dict) -> None:
        spans = detail_spans(rec)
        self.profiler_dropped += views.detail_window(rec).dropped
        self.records.append(rec)
        self._costs.append(sum(slice_cost(s) for s in spans))
        self._used += self._costs[-1]
        # the oldest goes once the newer ones fill the bound without it (newest_within would never reach it)
        while len(self.records) > 1 and self._used - self._costs[0] >= self.max_events:
            self._used -= self._costs.popleft()
            self.evicted_spans += len(detail_spans(self.records.popleft()))


def _why_bad(raw: bytes) -> tuple[dict | None, str | None]:
    """(record, None) or (None, why the line cannot be read as docs/RUNLOG.md says)."""
    if rl.too_deep(raw):
        return None, f"nested deeper than {rl.MAX_NESTING} brackets"
    try:
        rec = rl.loads(raw)
    except (ValueError, RecursionError):
        rec = None
    why = "not a JSON object" if not isinstance(rec, dict) else views.problem(rec)
    return (rec, None) if why is None else (None, why)


BATCH_LINES = 256
"""Lines parsed by one loads: its key memo then holds each field name once for all of them (a quarter less
memory than a call per line, and faster)."""
_INTERVAL_LINE = b'{"type": "' + rl.INTERVAL.encode() + b'"'
EXAMPLES = 3   # bad lines a rank log names ("file:line: why"), its first ones


def _whole(raw: bytes) -> bool:
    """Whether the line ends its record (a cut one does not)."""
    return raw.endswith(b"}\n") or raw.rstrip().endswith(b"}")


def _lines(f, skip: tuple, aside: bytes = b"", noted: list | None = None):
    """(line number, bytes) of the log's lines to parse, read one at a time: blank lines and whole lines that start
    with a `skip` prefix (a record kind left unparsed) are left out; whole lines that start with `aside` go to
    `noted` instead, as (line number, byte offset, length), to be read later if at all."""
    offset = 0
    for n, raw in enumerate(f, 1):
        at, offset = offset, offset + len(raw)
        if raw.isspace() or (raw.startswith(skip) and _whole(raw)):
            continue
        if aside and raw.startswith(aside) and _whole(raw):
            noted.append((n, at, len(raw)))
            continue
        yield n, raw


def _batches(lines, size: int):
    batch: list = []
    for item in lines:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _parsed(batch: list) -> list:
    """[(line number, record or None, why not)] of a batch of lines: one loads (records.loads) over them all when together they
    nest within MAX_NESTING and give one object per line; else line by line, each bad one with its reason. (Only a
    crafted pair of cut lines could close each other into one record, and a third split in two to keep the count:
    a log's writer writes whole lines, and a cut last line leaves the batch unparsable.)"""
    joined = b"[" + b",".join(raw for _, raw in batch) + b"]"
    if not rl.too_deep(joined, rl.MAX_NESTING + 1):
        try:
            recs = rl.loads(joined)
        except (ValueError, RecursionError):
            recs = None
        if recs is not None and len(recs) == len(batch) and all(isinstance(r, dict) for r in recs):
            return [(n, rec, views.problem(rec)) for (n, _), rec in zip(batch, recs)]
    return [(n, *_why_bad(raw)) for n, raw in batch]


class BadLines:
    """A rank log's unreadable lines: how many, and the first EXAMPLES of them by line number."""

    def __init__(self, path: Path):
        self.path, self.count, self._first = path, 0, []

    def add(self, n: int, why: str) -> None:
        self.count += 1
        if len(self._first) < EXAMPLES or n < self._first[-1][0]:
            bisect.insort(self._first, (n, why))
            del self._first[EXAMPLES:]

    @property
    def examples(self) -> list:
        """"file:line: why" of the first ones."""
        return [f"{self.path}:{n}: {why}" for n, why in self._first]


def _read_for_report(path: Path, spans: DetailWindows | None, skip: tuple = ()) -> tuple[list, BadLines]:
    """(records, bad lines), streamed in batches of BATCH_LINES. Lines of the `skip` prefixes are left unparsed,
    detail-window `spans` lines too unless `spans` keeps them (they go there, not into records); a record of the
    wrong shape counts as a bad line, with where and why."""
    records, bad = [], BadLines(path)
    skip = skip if spans is not None else (*skip, _SPANS_LINE)
    with open(path, "rb") as f:
        for batch in _batches(_lines(f, skip), BATCH_LINES):
            for n, rec, why in _parsed(batch):
                if why is not None:
                    bad.add(n, why)
                elif spans is not None and rec.get("type") == rl.SPANS:
                    spans.add(rec)
                else:
                    records.append(rec)
    return records, bad


class _Misfiled(Exception):
    """A detail-window line holds another kind of record (a hand-made log): read the log in file order instead."""


def _read_newest(path: Path, max_events: int, skip: tuple = ()) -> tuple[list, BadLines, list]:
    """(records, bad lines, detail windows): what _read_for_report gives with a DetailWindows(max_events), but the
    whole detail-window lines are only noted on the way through and read back from the end, so those older than
    what the window keeps are never parsed (nor counted when bad, nor their spans as evicted)."""
    records, bad, noted, found = [], BadLines(path), [], []
    with open(path, "rb") as f:
        for batch in _batches(_lines(f, skip, _SPANS_LINE, noted), BATCH_LINES):
            for n, rec, why in _parsed(batch):
                if why is not None:
                    bad.add(n, why)
                elif rec.get("type") == rl.SPANS:   # a detail window on a line of another shape
                    found.append((n, rec))
                else:
                    records.append(rec)
        candidates = sorted(noted + found, key=lambda c: c[0]) if found else noted
        return records, bad, _newest_back(f.fileno(), candidates, max_events, bad)


def _newest_back(fd: int, candidates: list, max_events: int, bad: BadLines) -> list:
    """The detail windows DetailWindows(max_events) keeps of `candidates` (in file order: noted lines (n, offset,
    length) or parsed (n, record)): each one whose newer ones' slices stay under max_events, and the newest, read
    back from the end a batch at a time until one falls outside."""
    kept, used, end = [], 0, len(candidates)
    while end > 0:
        chunk = candidates[max(0, end - BATCH_LINES):end]
        lines = [(c[0], os.pread(fd, c[2], c[1])) for c in chunk if len(c) == 3]
        read = {n: (rec, why) for n, rec, why in _parsed(lines)} if lines else {}
        for c in reversed(chunk):
            rec, why = read[c[0]] if len(c) == 3 else (c[1], None)
            if why is not None:
                bad.add(c[0], why)
                continue
            if rec.get("type") != rl.SPANS:
                raise _Misfiled
            if kept and used >= max_events:
                return kept[::-1]
            kept.append(rec)
            used += sum(map(slice_cost, detail_spans(rec)))
        end -= len(chunk)
    return kept[::-1]


def _rank_log(rank: int, path: Path, spans_events: int | None, skip: tuple = (), older: bool = True) -> RankLog:
    """One rank's log (load_run's arguments: `older` is its read_older)."""
    recs = None
    if spans_events is not None and not older:
        try:
            recs, bad, kept = _read_newest(path, spans_events, skip)
            spans = (kept, None, None)
        except _Misfiled:
            recs = None
    if recs is None:
        windows = DetailWindows(spans_events) if spans_events is not None else None
        recs, bad = _read_for_report(path, windows, skip)
        spans = (list(windows.records), windows.evicted_spans, windows.profiler_dropped) if windows else ([], 0, 0)
    role = next((role for role in (views.Record.of(r).role for r in recs) if role), None) or "unknown"
    log = RankLog(rank=rank, role=role, hostname=None, bad_lines=bad.count, bad_examples=bad.examples)
    for rec in recs:
        name = _KIND_LISTS.get(rec.get("type"))
        if name is not None:
            getattr(log, name).append(rec)
    if spans_events is not None:
        log.spans, log.spans_evicted, log.spans_profiler_dropped = spans
    for start in log.run_starts:
        rl.check_schema(start, where=str(path))
        log.hostname = log.hostname or views.run_start(start).hostname
    return log


def empty_logs_line(count: int) -> str:
    """The one line every surface says the left-out empty rank logs with (they are counted, never listed)."""
    return (f"{count} empty run log{'s' if count != 1 else ''} (profile/rank*.jsonl of 0 bytes) left out, "
            "not counted as ranks")


def _split_empty(logs: dict) -> tuple[dict, int]:
    """(the rank logs holding any byte, how many hold none): an empty rankN.jsonl (a rank that died before its
    first record, or files left beside the run) is counted once, not reported as a rank of unknown role."""
    kept = {rank: p for rank, p in logs.items() if p.stat().st_size > 0}
    return kept, len(logs) - len(kept)


@contextmanager
def paused_gc():
    """The cyclic collector off for the block: a run log is millions of small objects, all kept."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def load_run(run_dir, with_spans: bool = False, max_events: int = MAX_EVENTS, with_intervals: bool = True,
             read_older: bool = True, second_core: bool = True) -> Run:
    """Every rank's log of RUN_DIR (with_spans: with its newest `spans` records, the ones a trace of at most
    max_events slices draws; without its interval records unless with_intervals); ReportError if it cannot be
    read. Without read_older the older detail windows' lines are left unparsed, as without with_spans: their
    spans and bad lines go uncounted (spans_evicted and spans_profiler_dropped are None). With second_core (unless
    the caller's own child has it) a large run is read on two cores (SECOND_CORE_MIN_BYTES)."""
    logs, empty = rank_paths(run_dir)
    with paused_gc():
        try:
            per_rank = _per_rank(max_events, logs) if with_spans else None
            skip = () if with_intervals else (_INTERVAL_LINE,)
            ranks = (_rank_logs_on_two_cores if second_core else _rank_logs)(logs, per_rank, skip, read_older)
        except ValueError as e:   # a schema newer than this reader
            raise ReportError(str(e)) from None
        except OSError as e:
            raise ReportError(f"{run_dir}: cannot read its run logs: {e}") from None
    if not any(log.run_starts or log.intervals for log in ranks.values()):
        raise ReportError(f"{run_dir}: the run logs hold no run_start or interval record; "
                          "empty, or not written by dflash-train")
    return Run(run_dir=str(Path(run_dir)), ranks=ranks, empty_logs=empty)


SECOND_CORE_MIN_BYTES = 16 * 2**20
"""Logs of at least this many bytes in all are read on two cores where there are two: a child process reads up to
CHILD_SHARE of them (by bytes) and sends their RankLogs back pickled, which costs this process about a fifth of parsing
them (a 12 MB rank log: 0.24 s to parse, 0.05 s to unpickle). Smaller runs are read here (a child costs tens of ms)."""


CHILD_SHARE = 0.44
"""The most of the logs' bytes the child reads: it parses and pickles them while this process parses the rest, and
this process unpickles them after, so the halves end together below half (933 MB of 8 equal logs, read on the
2-core VM: 4 to the child 9.2-9.4 s, 3 to it 7.8 s)."""


def _rank_logs(logs: dict, per_rank, skip: tuple, read_older: bool) -> dict:
    return {rank: _rank_log(rank, p, per_rank, skip, read_older) for rank, p in logs.items()}


def _rank_logs_on_two_cores(logs: dict, per_rank, skip: tuple, read_older: bool) -> dict:
    """{rank: RankLog} of `logs`, in their order: load_run's reading, split by bytes between this process and a
    child where SECOND_CORE_MIN_BYTES and two cores allow (a child's error is raised here, as if read here)."""
    sizes = {rank: p.stat().st_size for rank, p in logs.items()}
    if len(logs) < 2 or sum(sizes.values()) < SECOND_CORE_MIN_BYTES or cores() < 2:
        return _rank_logs(logs, per_rank, skip, read_older)
    mine, theirs, their_bytes, bound = {}, {}, 0, CHILD_SHARE * sum(sizes.values())
    for rank in sorted(logs, key=sizes.__getitem__, reverse=True):   # the larger logs first
        if their_bytes + sizes[rank] <= bound:
            theirs[rank], their_bytes = logs[rank], their_bytes + sizes[rank]
        else:
            mine[rank] = logs[rank]
    with Background(_rank_logs, theirs, per_rank, skip, read_older) as child:
        read = _rank_logs(mine, per_rank, skip, read_older)
        read.update(child.result())
    return {rank: read[rank] for rank in logs}


def read_ranks(logs: dict, with_spans: bool = False, max_events: int = MAX_EVENTS, read_older: bool = True):
    """(rank, RankLog) of each rank log of `logs` ({rank: path}, as rank_paths gives them), read one at a time as
    load_run reads them (its arguments), for a pass over a run that holds one rank's records at a time;
    ReportError as load_run."""
    per_rank = _per_rank(max_events, logs) if with_spans else None
    for rank, p in logs.items():
        try:
            with paused_gc():
                log = _rank_log(rank, p, per_rank, (), read_older)
        except ValueError as e:   # a schema newer than this reader
            raise ReportError(str(e)) from None
        except OSError as e:
            raise ReportError(f"{p}: cannot read: {e}") from None
        yield rank, log


def rank_paths(run_dir) -> tuple[dict, int]:
    """({rank: path} of RUN_DIR's rank logs holding any byte, how many hold none); ReportError where it has none."""
    path = Path(run_dir)
    if not path.exists():
        raise ReportError(f"{run_dir}: no such directory")
    if not path.is_dir():
        raise ReportError(f"{run_dir}: not a directory")
    logs = rl.rank_logs(path)
    if not logs:
        raise ReportError(f"{run_dir}: no run logs (profile/rank*.jsonl); not a dflash-train run directory")
    try:
        return _split_empty(logs)
    except OSError as e:
        raise ReportError(f"{run_dir}: cannot read its run logs: {e}") from None


def log_stamp(run_dir) -> tuple:
    """(name, size, modification time, inode) of each rank log of RUN_DIR, in name order (none where it has no
    logs): what changes when a log is written, appended to or replaced."""
    profile = Path(run_dir) / "profile"
    try:
        entries = sorted(os.scandir(profile), key=lambda d: d.name) if profile.is_dir() else []
        return tuple((d.name, st.st_size, st.st_mtime_ns, st.st_ino) for d in entries
                     if rl.RANK_FILE.match(d.name) and (st := d.stat()))
    except OSError:
        return ()


def _per_rank(max_events: int, logs: dict) -> int:
    """A rank's share of a trace's max_events slices."""
    return max(1, max_events // max(1, len(logs)))


def line_counts(logs: dict, max_events: int = MAX_EVENTS, with_intervals: bool = True) -> dict:
    """{rank: (bad lines, their examples, spans_evicted, spans_profiler_dropped)} as load_run(with_spans=True) counts
    them over the rank logs `logs` ({rank: path}), older detail windows included, keeping no record: a few numbers
    a child process hands back while this one loads with read_older off (report.trace)."""
    per_rank, skip, out = _per_rank(max_events, logs), () if with_intervals else (_INTERVAL_LINE,), {}
    with paused_gc():
        for rank, p in logs.items():
            windows = DetailWindows(per_rank)
            bad = _read_for_report(p, windows, skip)[1]
            out[rank] = (bad.count, bad.examples, windows.evicted_spans, windows.profiler_dropped)
    return out


def _did_work(rec: dict) -> bool:
    window = views.interval(rec)
    tokens = window.counters.entry("tokens").total
    return bool(tokens) if tokens is not None else bool(window.spans)


PHASED_WORDS = "each over a tenth in phases: compile, evaluation or checkpoints"
"""How a Window.phased label says why none of its windows counts as steady. It is not "none steady": the steady
state's own window (dflash/throughput.py) is these steps with the phases' time left out."""


@dataclass(frozen=True)
class Window:
    """The windows a figure is read over (interval records, or the tick windows of profiler.schema.windows.tick_windows
    where the run wrote ticks: `source`), and the words every surface names it with. A rank with no steady window
    (a short run: all warm-up, phases or final) is read over all of its windows, and its label says so."""
    intervals: list
    steady: int                 # how many of `intervals` are steady
    fallback: tuple = ()        # the ranks read over all their windows: none of theirs is steady
    source: str = "intervals"   # "intervals", "ticks", or "mixed" (ranks of both kinds)
    named: str = ""             # a label of its own (interval_window's whole run)
    phased: bool = False        # none steady, but read over the windows past warm-up (not the last): each is over
    #                             a tenth in phases (a drafter that recompiles all along), as the steady state's
    #                             own window (dflash/throughput.py) holds them with the phases' time left out

    @property
    def label(self) -> str:
        n = len(self.intervals)
        if self.named:
            return self.named
        if self.source != "intervals":
            return self._tick_label(n)
        if not self.fallback:
            return f"steady intervals ({n})"
        if self.phased:
            return f"past-warm-up intervals ({n}; {PHASED_WORDS})"
        if not self.steady:
            return ("the only interval" if n == 1 else f"all {n} intervals") + " (none steady: warm-up, phases or final)"
        return (f"steady intervals ({self.steady}) and {n - self.steady} of rank "
                f"{', '.join(map(str, self.fallback))} (none steady there)")

    def _tick_label(self, n: int) -> str:
        """"steady windows (14 x 5 s)": how many windows, and their typical (median) length."""
        durations = [duration_seconds(r) for r in self.intervals]
        each = f" x {statistics.median(durations):.2g} s" if durations and self.source == "ticks" else \
            ": tick windows and intervals"
        if not self.fallback:
            return f"steady windows ({n}{each})"
        if self.phased:
            return f"past-warm-up tick windows ({n}{each}; {PHASED_WORDS})"
        if not self.steady:
            return ("the only tick window" if n == 1 else f"all {n} tick windows") + \
                " (none steady: warm-up, phases or final)"
        return (f"steady windows ({self.steady} of {n}{each}, the rest of rank "
                f"{', '.join(map(str, self.fallback))}: none steady there)")


def rank_phase_spans(log: RankLog) -> tuple:
    """The span names the rank's profiler called phases (its run_start `phase_spans`)."""
    return tuple(next((names for s in map(views.run_start, log.run_starts) if (names := s.phase_spans)), ()))


def steady_window(log: RankLog, ticks: bool = True) -> Window:
    """The rank's steady windows: where it wrote ticks (and `ticks`), its steady tick windows; else its steady
    intervals. Steady is profiler.schema.windows.is_steady (past warm-up, not the last, under a tenth in compile,
    evaluation or checkpoint phases); in logs written before warm-up marks (no run_start `warmup_steps`), each
    segment's start up to the first interval that did work is left out. All of them, labelled so, when that
    leaves none. Figures that need an interval's own fields (memory, gauges) pass ticks=False."""
    return log.steady_ticks if ticks and log.tick_windows else log.steady_intervals


def _steady_ticks(log: RankLog) -> Window:
    """steady_window(log) of a rank with tick windows (RankLog.steady_ticks, worked out once)."""
    windows, phases = log.tick_windows, rank_phase_spans(log)
    steady = [w for w in windows if is_steady(w, phases)]
    if steady:
        return Window(steady, len(steady), (), "ticks")
    past = past_warm_up(windows)
    return Window(past or list(windows), 0, (log.rank,), "ticks", phased=bool(past))


def _steady_intervals(log: RankLog) -> Window:
    """steady_window(log, ticks=False) (RankLog.steady_intervals, worked out once)."""
    marked = any(s.marks_warmup for s in map(views.run_start, log.run_starts))
    phases = rank_phase_spans(log)
    steady, starting = [], True
    for rec in log.intervals:
        if marked:
            if is_steady(rec, phases):
                steady.append(rec)
            continue
        if window_index(rec) == 0:
            starting = True
        if starting:
            starting = not _did_work(rec)
        elif not window_final(rec):
            steady.append(rec)
    if steady or not log.intervals:
        return Window(steady, len(steady))
    past = past_warm_up(log.intervals) if marked else []
    return Window(past or list(log.intervals), 0, (log.rank,), phased=bool(past))


def merged_window(logs, ticks: bool = True) -> Window:
    """One window over several ranks (a role, a run): their windows, in rank order (steady_window's `ticks`)."""
    parts = [steady_window(log, ticks) for log in logs]
    sources = {w.source for w in parts}
    return Window([r for w in parts for r in w.intervals], sum(w.steady for w in parts),
                  tuple(rank for w in parts for rank in w.fallback),
                  sources.pop() if len(sources) == 1 else "mixed",
                  phased=bool(parts) and all(w.phased for w in parts))


def interval_window(logs) -> Window:
    """The ranks' steady intervals, for what only interval records hold (gauges, NVML and GPM, the profiler's
    share). Where none is steady but every rank's tick windows are (a run of one or two intervals: the README's
    default), all its intervals, named as the whole run: "none steady" never sits beside steady tick windows."""
    w = merged_window(logs, ticks=False)
    if not w.fallback or not all(log.tick_windows and not steady_window(log).fallback for log in logs):
        return w
    n = len(w.intervals)
    return replace(w, named=f"the whole run ({n} interval{'s' if n != 1 else ''}, warm-up included: this figure is "
                            "per interval only)")


def phase_spans(run) -> tuple:
    """The span names the run's profiler called phases (run_start `phase_spans`)."""
    return next((names for log in run.ranks.values() if (names := rank_phase_spans(log))), ())


def span_kinds(run) -> SpanKinds:
    """What each span of the run is: its waits, collectives, phases and flows (run_start `span_table`, read by
    profiler/schema/span_kinds.py)."""
    return of_run_starts(s for log in run.ranks.values() for s in log.run_starts)


def gpu_key(log: RankLog, gpu: dict) -> str:
    """"host:index": a GPU named across ranks (ranks on one host may share it)."""
    return f"{log.hostname or '?'}:{gpu_index(gpu)}"

