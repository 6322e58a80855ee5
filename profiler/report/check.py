"""`dflash-report check RUN_DIR`: the invariants of DESIGN.md "Windows, phases and invariants", evaluated on
any run directory. Each broken one is a `Violation` naming its file, rank, interval and span; what a log
cannot hold (logs written before self time, warm-up marks or phase lists) is skipped with a note.

shares     a share is at most 100% of its threads' time; per thread, self time fits in the interval
order      p50 <= p95 <= p99 <= max and mean <= max; counts non-negative
agree      one quantity, one value: throughput file = its event = the report's JSON and text; run_end = its
           intervals summed; a one-rank role's percentiles = its run_end's (the console's end-of-run table)
once       a span's time over the run fits in its threads' wall time; self <= total
phases     warm-up intervals marked, phase spans (the run_start span_table's) listed in phase_spans, a throughput event
           once warm-up is past
windows    a figure named steady is read over steady windows (tick windows where the run wrote ticks, else
           intervals; neither warm-up nor final, at most a tenth in phases: profiler.schema.windows.is_steady), and the
           text names each window, followed by its own length; with none steady, its label says so, and never
           beside a steady state with ticks; no window label beside another window's figure (each rank row's
           tokens/s, busy share and capacity named by the window each was read over)
compare    both sides of a compare (the run against itself; check_compare for two) read each role over the same
           kind of window, each label's count is its tokens/s row's n, no span both runs have is "only in" one,
           the Regressions line lists every regression of the table
flows      the merged trace's flows point forward in time, and it matches at least FLOW_MATCH_MIN of its sends
gpu        every GPU-timed span of an interval is placed on the host timeline or counted unplaced (gpu_lag), and
           an entry whose spans were all launch-bound has a GPU window within its CPU time / (1 - HOST_PACED_SHARE)
           plus the tolerance per span: the window of a launch-bound span is host time

Standard library only (the report's loader, profiler.schema.windows and the trace builder), like the report.
"""
from __future__ import annotations

import json
import marshal
import math
import multiprocessing
import tempfile
from dataclasses import asdict, dataclass, field, fields
from itertools import chain
from pathlib import Path

from profiler.schema import views
from profiler.schema.trace_events import MAX_EVENTS, backward_flows
from profiler.gpu_lag import HOST_PACED_SHARE
from profiler.schema.span_kinds import PHASE, of_run_start
from profiler.schema.windows import clock_fields, clock_seconds, counter_per_second, counter_total, duration_seconds, \
    entry_counts, entry_fields, is_steady, most_threads, past_warm_up, span_clock, span_entries, span_names, \
    steady_throughput, summed_clock_seconds, summed_counts, threads_of, wall_seconds, window_index, window_warmup
from profiler.report import format_compare, format_hotspots, hotspots_of
from profiler.report.background import Background, _start_method, cores
from profiler.report.compare import compare as compare_runs
from profiler.report.runs import _INTERVAL_LINE, RankLog, Run, _per_rank, _rank_log, _rank_logs, empty_logs_line, \
    load_run, paused_gc, rank_paths, rank_phase_spans, read_ranks
from profiler.report.trace import flow_trace

SHARE_SLACK = 1e-6       # shares and self-time sums: rounding of nanoseconds to seconds
RATE_TOLERANCE = 0.01    # the same steady rate on two surfaces (DESIGN.md: within 1%)
TOTAL_REL, TOTAL_ABS_SECONDS = 0.01, 1e-3   # run_end CPU totals against their intervals summed
FLOW_MATCH_MIN = 0.95
STAT_KEYS = ("p50_seconds", "p95_seconds", "p99_seconds", "max_seconds")


@dataclass(frozen=True)
class Violation:
    """One broken invariant: which (`invariant`, one of the module doc's names), where, and what."""
    invariant: str
    where: str
    message: str

    def __str__(self) -> str:
        return f"{self.invariant}: {self.where}: {self.message}"


@dataclass
class CheckResult:
    """Everything `check` found: the violations, the notes on what it skipped, and how much it checked."""
    run_dir: str
    violations: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    checked: int = 0          # invariant instances evaluated
    ranks: int = 0
    intervals: int = 0
    _noted: set = field(default_factory=set, repr=False, compare=False)

    def expect(self, ok: bool, invariant: str, where: str, message) -> bool:
        """Count one evaluated invariant; record a Violation (message: a str or a callable making one) if
        it does not hold."""
        self.checked += 1
        if not ok:
            self.violations.append(Violation(invariant, where, message() if callable(message) else message))
        return ok

    def fail(self, invariant: str, where: str, message: str) -> None:
        """Record a Violation of an invariant evaluated (and counted in `checked`) by the caller."""
        self.violations.append(Violation(invariant, where, message))

    def absorb(self, part: CheckResult) -> None:
        """Take in what another CheckResult found, as if its invariants had been evaluated here at this point."""
        self.violations += part.violations
        for line in part.notes:
            self.note(line)
        self.checked += part.checked

    def note(self, line: str) -> None:
        if line in self._noted:   # said already (the same line comes once per interval)
            return
        self._noted.add(line)
        if line not in self.notes:
            self.notes.append(line)

    def to_json(self) -> dict:
        return {"run_dir": self.run_dir, "ok": not self.violations, "invariants": self.checked,
                "ranks": self.ranks, "intervals": self.intervals,
                "violations": [asdict(v) for v in self.violations], "notes": list(self.notes)}

    def summary(self) -> str:
        return f"check: {self.checked} invariants over {self.ranks} ranks, {self.intervals} intervals: all hold"


def _le(a, b, slack: float = 0.0) -> bool:
    """a <= b (+ slack, + a relative 1e-9 for floating sums); True when either is unknown."""
    return a is None or b is None or a <= b + slack + 1e-9 * abs(b)


def _fmt(x) -> str:
    return "null" if x is None else f"{x:.6g}"


def check(run_dir) -> CheckResult:
    """Every invariant over RUN_DIR; ReportError when it cannot be read (as every dflash-report command). With
    two cores, one process reads the run rank by rank for what each rank's log alone holds (its intervals,
    segments and totals) and the flows, while the other reads it whole for the report's invariants
    (_checked_on_two_cores)."""
    with paused_gc():
        return _check(run_dir)   # the run is freed before the collector is back on: it never walks it


def _check(run_dir) -> CheckResult:
    logs, empty = rank_paths(run_dir)
    if cores() >= 2:
        shape, common, (parts, flows) = _checked_on_two_cores(run_dir, logs, empty)
    else:
        run = load_run(run_dir, with_spans=True, read_older=False)   # the flows read only the windows a trace draws
        shape, common = _shape(run), _run_checks(run)
        parts, flows = {rank: _rank_checks(log) for rank, log in run.ranks.items()}, _flow_checks(run)
    ranks, intervals, empty_logs = shape
    pre, throughput, tail = common
    res = CheckResult(run_dir=str(run_dir), ranks=len(ranks), intervals=intervals)
    if empty_logs:
        res.note(empty_logs_line(empty_logs))
    res.absorb(pre)
    for rank in ranks:
        res.absorb(parts[rank])
        res.absorb(throughput[rank])
    res.absorb(tail)
    res.absorb(flows)
    return res


def _shape(run: Run) -> tuple[list, int, int]:
    """(its ranks in order, its intervals, its empty logs): what `check` says of a run beside what it found."""
    return list(run.ranks), sum(len(log.intervals) for log in run.ranks.values()), run.empty_logs


SHIP_SHARE = 0.55
"""The most of the logs' bytes the process checking each rank alone reads for the other too (_shipped), which reads
the rest meanwhile and unmarshals these (a third of the cost of parsing them). On the 2-core VM (933 MB, 8 equal logs)
4 are shipped: the last arrives as the other has read its own 4 and unmarshalled 3."""


def _checked_on_two_cores(run_dir, logs: dict, empty: int) -> tuple[tuple, tuple, tuple]:
    """(_shape, _run_checks, _alone_checks) of the run on two processes: one checks each rank alone and the flows
    (_alone_checks), reading the _shipped ranks first and handing them over (a file each, marshalled, named through
    a pipe); the other reads the rest meanwhile and checks the report (_report_checks). The intervals are parsed
    once for the report. Where the child is a fork (it sees this process's state) it checks the report, and the run
    it holds goes with it at its exit, not freed object by object; else this process checks the report."""
    shipped = _shipped(logs)
    names, send = multiprocessing.Pipe(duplex=False)
    with names, tempfile.TemporaryDirectory(prefix="dflash-check-") as tmp:
        alone_args, report_args = (logs, shipped, send, tmp), (run_dir, logs, empty, shipped, names, send)
        if _start_method() == "fork":
            with Background(_report_checks, *report_args, []) as report:
                try:
                    alone = _alone_checks(*alone_args)
                except Exception:
                    report.result()   # the report's error first, as where this process checks the report
                    raise
                return (*report.result(), alone)
        with Background(_alone_checks, *alone_args) as child:
            shape, common = _report_checks(*report_args, [])   # the run freed here, while the child ends its share
            return shape, common, child.result()


def _shipped(logs: dict) -> tuple:
    """The ranks _alone_checks reads for _report_checks too, in rank order: the larger logs first, up to SHIP_SHARE
    of the bytes (none where a log is gone: the reading then says so, as load_run would)."""
    try:
        sizes = {rank: p.stat().st_size for rank, p in logs.items()}
    except OSError:
        return ()
    chosen, used, bound = set(), 0, SHIP_SHARE * sum(sizes.values())
    for rank in sorted(logs, key=sizes.__getitem__, reverse=True):
        if used + sizes[rank] <= bound:
            chosen.add(rank)
            used += sizes[rank]
    return tuple(rank for rank in logs if rank in chosen)


def _report_checks(run_dir, logs: dict, empty: int, shipped: tuple, names, send, held: list) -> tuple[tuple, tuple]:
    """(_shape, _run_checks) of the run, read as load_run reads it, the `shipped` ranks from the other process. The
    run stays in `held`: in a child (its arguments, kept to its end) its pages go at its exit all at once, where
    freeing a run object by object takes a second."""
    send.close()   # this process's copy: the other's closing its own then ends the names
    run = _load_shipped(run_dir, logs, empty, shipped, names)
    held.append(run)
    return _shape(run), _run_checks(run)


def _load_shipped(run_dir, logs: dict, empty: int, shipped: tuple, names) -> Run:
    """load_run(run_dir, second_core=False), its `shipped` ranks as the other process names their files (each read
    here where that one stopped before it). Where a log cannot be read (or none holds a record), load_run reads the
    run again, to raise what it raises."""
    try:
        ranks = _rank_logs({rank: p for rank, p in logs.items() if rank not in shipped}, None, (), True)
        named: dict = {}
        for rank in shipped:
            while rank not in named and (sent := _next_name(names)) is not None:
                named[sent[0]] = sent[1]
            ranks[rank] = _unshipped(named.pop(rank, None)) or _rank_log(rank, logs[rank], None, (), True)
    except (OSError, ValueError):
        return load_run(run_dir, second_core=False)
    if not any(log.run_starts or log.intervals for log in ranks.values()):
        return load_run(run_dir, second_core=False)
    return Run(run_dir=str(Path(run_dir)), ranks={rank: ranks[rank] for rank in logs}, empty_logs=empty)


def _next_name(names) -> tuple | None:
    """(rank, its file) as the other process named it, or None once it names no more."""
    try:
        return names.recv()
    except EOFError:
        return None


_FIELDS = tuple(f.name for f in fields(RankLog))


def _unshipped(path) -> RankLog | None:
    """The RankLog in a file _ship wrote; None without one (gone: taken by a process that died since)."""
    try:
        blob = Path(path).read_bytes() if path else None
    except FileNotFoundError:
        blob = None
    if blob is None:
        return None
    Path(path).unlink()
    return RankLog(*marshal.loads(blob))


def _ship(logs: dict, shipped: tuple, send, tmp: str) -> dict:
    """{rank: RankLog} of the `shipped` ranks, read as load_run reads them, each marshalled to a file of `tmp` and
    named through `send` as soon as read (names are small: the pipe never makes this process wait). Stops at a log
    it cannot read or write: the other process reads that one itself (to raise what load_run raises) and the rest."""
    read = {}
    with send:
        for rank in shipped:
            path = Path(tmp) / f"rank{rank}.marshal"
            try:
                read[rank] = _rank_log(rank, logs[rank], None, (), True)
                path.write_bytes(marshal.dumps(tuple(getattr(read[rank], name) for name in _FIELDS)))
            except (OSError, ValueError):
                read.pop(rank, None)
                break
            send.send((rank, str(path)))
    return read


def _alone_checks(logs: dict, shipped: tuple, send, tmp: str) -> tuple[dict, CheckResult]:
    """({rank: _rank_checks}, _flow_checks) read rank by rank: one rank's records held at a time, then only its
    detail windows, events and segment records; but the `shipped` ranks are read first, for the other process too
    (_ship; not where `send` is closed: a Background child's work done here), and held until checked, first."""
    read = {} if send.closed else _ship(logs, shipped, send, tmp)
    per_rank = _per_rank(MAX_EVENTS, logs)
    rest = {rank: p for rank, p in logs.items() if rank not in read}
    # read_ranks gives each rank of `rest` the detail-window budget it has among all the logs
    ranks = chain(((rank, _with_detail_windows(read.pop(rank), logs, per_rank)) for rank in list(read)),
                  read_ranks(rest, with_spans=True, max_events=per_rank * len(rest), read_older=False))
    kept, parts = {}, {}
    for rank, log in ranks:
        parts[rank] = _rank_checks(log)
        log.intervals, log.ticks = [], []
        kept[rank] = log
    return parts, _flow_checks(Run(run_dir="", ranks={rank: kept[rank] for rank in logs}))


def _with_detail_windows(log: RankLog, logs: dict, per_rank: int) -> RankLog:
    """A shipped rank's log (read without detail windows) as read_ranks(with_spans=True, read_older=False) reads it:
    its newest detail windows read apart, interval lines left unparsed. That is the same log where no detail window
    sits on a line of another shape: none in the log read without them (which holds no other) and none misfiled (the
    newest read back keep their None counts); else the log is read again whole."""
    rank = log.rank
    try:
        windows = _rank_log(rank, logs[rank], per_rank, (_INTERVAL_LINE,), False)
    except (OSError, ValueError):
        windows = None
    if windows is None or log.spans or windows.spans_evicted is not None:
        return next(read_ranks({rank: logs[rank]}, with_spans=True, max_events=per_rank, read_older=False))[1]
    log.spans, log.spans_evicted, log.spans_profiler_dropped = windows.spans, None, None
    return log


def _rank_checks(log) -> CheckResult:
    """The invariants one rank's log holds alone: per interval, per segment, and its spans' time over the run (the
    entries of each span gathered per segment on the pass over the intervals)."""
    res, where = CheckResult(run_dir=""), _log_name(log)
    segments = _segments(log)
    named = [{} for _ in segments]
    for (_start, intervals, _end), by_name in zip(segments, named):
        for rec in intervals:
            _check_interval(res, where, rec, by_name)
    for seg, ((start, intervals, end), by_name) in enumerate(zip(segments, named)):
        _check_segment(res, f"{where} segment {seg}", start, intervals, end, by_name)
    _check_once(res, where, log, named)
    return res


def _flow_checks(run: Run) -> CheckResult:
    res = CheckResult(run_dir="")
    _check_flows(res, run)
    return res


def _run_checks(run: Run) -> tuple[CheckResult, dict, CheckResult]:
    """The invariants of the run's report and across its ranks: (the throughput files read, {rank: its throughput
    checks}, the report's rows, rates, windows and compare), each apart, to be put in `check`'s order."""
    pre, throughput, tail = CheckResult(run_dir=""), {}, CheckResult(run_dir="")
    report = hotspots_of(run)
    files = {rank: _read_throughput(pre, run, log) for rank, log in run.ranks.items()}
    rates = {rank: _rank_rate(log, files[rank]) for rank, log in run.ranks.items()}
    for log in run.ranks.values():
        throughput[log.rank] = CheckResult(run_dir="")
        _check_throughput(throughput[log.rank], log, files[log.rank], rates[log.rank], report)
    _check_report_rows(tail, run, report)
    _check_role_rates(tail, run, rates, report)
    _check_windows(tail, run, report, rates, format_hotspots(report).splitlines())
    _check_compare(tail, run, run)
    return pre, throughput, tail


def check_run(run_dir) -> list:
    """The violations of RUN_DIR's invariants (empty: all hold); see `check` for the notes and counts."""
    return check(run_dir).violations


def _log_name(log) -> str:
    return f"profile/rank{log.rank}.jsonl ({log.role})"


# ---- per interval: shares, order statistics, self <= total ---------------------------------------

def _check_interval(res: CheckResult, where: str, rec: dict, by_name: dict) -> None:
    """The shares, order and self-time invariants of one interval (the loop the check spends most in: each
    invariant counted and tested inline, where it is named only when one breaks); each span entry is added to its
    span's in `by_name`. Fields are read by profiler.schema.windows' accessors at dict speed, the interval's index through
    its view where a broken invariant names it."""
    duration = duration_seconds(rec)
    per_thread: dict = {}
    unowned, counted = False, 0
    for name, e in span_entries(rec).items():
        entries = by_name.get(name)
        if entries is None:
            by_name[name] = [e]
        else:
            entries.append(e)
        count, timed, unresolved, threads, share, cpu, gpu, lag = entry_fields(e)
        cpu = clock_fields(cpu) if cpu else None
        checked = _entry_checked(count, timed, unresolved, cpu, clock_fields(gpu) if gpu else None)
        faults = _NO_FAULTS
        if checked is None:   # something may be broken: the full pass names it
            checked, faults = _entry_faults(e)
        counted += checked + 1
        threads = threads or ()
        most = len(threads) or 1
        if not (share is None or share <= most + SHARE_SLACK + 1e-9 * abs(most)):   # _le, inline
            res.fail("shares", f"{where} interval {views.interval(rec).index} span {name}",
                     f"share {_fmt(share)} over {most} thread(s)")
        for invariant, clock, message in faults:
            res.fail(invariant, f"{where} interval {views.interval(rec).index} span {name}{clock}", message)
        if lag:
            _check_gpu_lag(res, f"{where} interval {views.interval(rec).index} span {name}", e)
        own = cpu[6] if cpu else None   # the CPU block's self_seconds (clock_fields)
        if own is None:
            unowned = True
        elif len(threads) == 1:
            per_thread[threads[0]] = per_thread.get(threads[0], 0.0) + own
    res.checked += counted
    if unowned:
        res.note(f"{where}: intervals without cpu.self_seconds (written before self time): "
                 "per-thread self-time sums not checked")
    for thread, own in per_thread.items():
        res.checked += 1   # res.expect inline: the interval named only where it breaks
        if not _le(own, duration, SHARE_SLACK):
            res.fail("shares", f"{where} interval {views.interval(rec).index} thread {thread}",
                     f"self CPU time of its spans {_fmt(own)} s > the interval's {_fmt(duration)} s")


def _check_gpu_lag(res: CheckResult, here: str, e: dict) -> None:
    """The `gpu` invariants of one interval span entry with a `gpu_lag` (module doc)."""
    entry = views.SpanEntry.of(e)
    lag = entry.gpu_lag
    if lag is None:
        return
    placed, unplaced, timed = lag.n, lag.unplaced, entry.gpu_count or 0
    res.expect(placed + unplaced == timed, "gpu", here,
               lambda: f"gpu_lag placed {placed} + unplaced {unplaced} spans != gpu_count {timed}")
    host_mean_s = entry.cpu.mean_seconds
    if not (placed and lag.launch_bound == placed == timed == entry.count) or host_mean_s is None:
        return
    host_s = host_mean_s * placed
    bound_s = host_s / (1 - HOST_PACED_SHARE) + placed * (lag.tolerance_s or 0.0)
    gpu_s = entry.gpu.total_seconds if entry.gpu else None
    res.expect(_le(gpu_s, bound_s, 1e-6), "gpu", here,
               lambda: f"launch-bound, yet its GPU window {_fmt(gpu_s)} s exceeds its CPU time "
                       f"{_fmt(host_s)} s / {1 - HOST_PACED_SHARE:g} + the tolerance")


COUNT_KEYS = ("count", "gpu_count", "gpu_unresolved")   # entry_fields' first three, named in messages
_NO_FAULTS = ()


def _check_entry_stats(res: CheckResult, here: str, e: dict) -> None:
    """Order statistics, non-negative counts and self <= total of one span entry (interval or run_end)."""
    checked, faults = _entry_faults(e)
    res.checked += checked
    for invariant, clock, message in faults:
        res.fail(invariant, here + clock, message)


def _entry_checked(count, timed, unresolved, cpu: tuple | None, gpu: tuple | None) -> int | None:
    """_entry_faults(e)'s count where every invariant of the entry holds with no tolerance needed (and each block has
    all four order statistics and its mean); None where one may break, for _entry_faults to name it. Strictly in
    order implies in order within _le's slack, so the count is the same. Given the entry's count, gpu_count and
    gpu_unresolved and its cpu and gpu blocks' clock_fields (None where it has no such block), as _check_interval
    read them."""
    checked = 0
    for n in (count, timed, unresolved):
        if n is not None:
            if not n >= 0:
                return None
            checked += 1
    for stats in (cpu, gpu):
        if stats is None:
            continue
        p50, p95, p99, top, mean, total, own, buckets = stats
        try:
            if not (p50 <= p95 <= p99 <= top and mean <= top):
                return None
        except TypeError:   # a statistic missing or null
            return None
        checked += 4
        if buckets is not None:
            if type(buckets) is not list:
                return None
            try:
                bytes(buckets)   # in C: every count an integer 0..255, so none negative and their sum no NaN
            except (TypeError, ValueError):
                if buckets and not (min(buckets) >= 0 and (summed := sum(buckets)) == summed):
                    return None
            checked += 1
        if own is not None:
            if not (own >= 0 and (total is None or own <= total)):
                return None
            checked += 1
    return checked


def _entry_faults(e: dict) -> tuple[int, list | tuple]:
    """(invariants evaluated, [(invariant, " cpu", " gpu" or "": where in the entry, message)] of those broken) of
    _check_entry_stats: counts non-negative; per clock p50 <= p95 <= p99 <= max and mean <= max (_check_order),
    no negative bucket, 0 <= self <= total. Tested inline: it runs for every entry of every interval."""
    checked, faults = 0, _NO_FAULTS
    *counts, _threads, _share, cpu, gpu, _lag = entry_fields(e)
    for key, n in zip(COUNT_KEYS, counts):
        if n is not None:
            checked += 1
            if not n >= 0:
                faults = [*faults, ("order", "", f"{key} {n} < 0")]
    for block, at in ((cpu, " cpu"), (gpu, " gpu")):
        if not block:
            continue
        *ordered, mean, total, own, buckets = clock_fields(block)
        chain = [(k, v) for k, v in zip(STAT_KEYS, ordered) if v is not None]
        checked += max(1, len(chain))   # each neighbouring pair, and mean <= max
        for (ka, a), (kb, b) in zip(chain, chain[1:]):
            if not a <= b + 1e-9 * abs(b):   # _le(a, b) of two numbers, inline
                faults = [*faults, ("order", at, f"{ka} {_fmt(a)} > {kb} {_fmt(b)}")]
        top = ordered[-1]
        if not _le(mean, top):
            faults = [*faults, ("order", at, f"mean_seconds {_fmt(mean)} > max_seconds {_fmt(top)}")]
        if buckets is not None:
            checked += 1
            if buckets and not (min(buckets) >= 0 and (summed := sum(buckets)) == summed):   # NaN sums to NaN
                faults = [*faults, ("order", at, "a negative bucket count")]
        if own is not None:
            checked += 1
            if not (own >= 0 and _le(own, total, 1e-9)):
                faults = [*faults, ("once", at, f"self {_fmt(own)} s not within 0..total {_fmt(total)} s")]
    return checked, faults


def _check_order(res: CheckResult, here: str, stats: dict) -> None:
    """p50 <= p95 <= p99 <= max and mean <= max, over the keys a hotspots row has (the report's own output)."""
    chain = [(k, stats[k]) for k in STAT_KEYS if stats.get(k) is not None]
    for (ka, a), (kb, b) in zip(chain, chain[1:]):
        res.expect(_le(a, b), "order", here, lambda: f"{ka} {_fmt(a)} > {kb} {_fmt(b)}")
    mean, top = stats.get("mean_seconds"), stats.get("max_seconds")
    res.expect(_le(mean, top), "order", here, lambda: f"mean_seconds {_fmt(mean)} > max_seconds {_fmt(top)}")


# ---- per segment: run_end against its intervals; warm-up marked; phases listed ----------------------

def _segments(log) -> list:
    """[(run_start or None, intervals, run_end or None)] in file order: a segment's intervals count from
    index 0; its run_end is the first written at or after its last interval and before the next segment."""
    groups: list = []
    for rec in log.intervals:
        if window_index(rec) == 0 or not groups:
            groups.append([])
        groups[-1].append(rec)
    out = []
    for k, intervals in enumerate(groups):
        lo = views.interval(intervals[-1]).time_unix or 0.0
        hi = views.interval(groups[k + 1][0]).time_unix if k + 1 < len(groups) else None
        end = next((e for e in log.run_ends if (at := views.run_end(e).time_unix or 0.0) >= lo
                    and (hi is None or at < hi)), None)
        start = log.run_starts[k] if k < len(log.run_starts) else None
        out.append((start, intervals, end))
    return out


def _check_segment(res: CheckResult, where: str, start, intervals: list, end, by_name: dict) -> None:
    """A segment's phases tagged, and its run_end against its intervals (`by_name`: their entries of each span)."""
    if start is not None:
        _check_phases_tagged(res, where, start, intervals, by_name)
    if end is None:
        res.note(f"{where}: no run_end (the rank stopped without one): its totals not checked")
        return
    ended = views.run_end(end)
    if ended.run_log is not None:   # the disk filled: the run_end covers records the log could not take
        res.note(f"{where}: the run log lost {ended.run_log.dropped_records} record(s) to "
                 f"{ended.run_log.error}: its run_end's totals not checked against its intervals")
        return
    res.expect(ended.intervals in (None, len(intervals)), "agree", f"{where} run_end",
               lambda: f"says {ended.intervals} intervals, the log holds {len(intervals)}")
    for name, e in span_entries(end).items():   # entries as written: a count not written is None here, not 0
        here = f"{where} run_end span {name}"
        _check_entry_stats(res, here, e)
        entries = by_name.get(name, [])
        count = summed_counts(entries)
        said = entry_counts(e)[0]
        res.expect(said == count, "agree", here, lambda: f"count {said} != its intervals' {count}")
        total = clock_seconds(e, "cpu")
        summed = summed_clock_seconds(entries, "cpu")
        res.expect(abs(total - summed) <= TOTAL_REL * abs(summed) + TOTAL_ABS_SECONDS, "agree", here,
                   lambda: f"cpu.total_seconds {_fmt(total)} != its intervals' {_fmt(summed)}")
    for name, c in ended.counters.items():
        summed = counter_total(intervals, name)
        total = c.total or 0
        res.expect(abs(total - summed) <= 1e-9 * max(abs(total), 1.0), "agree", f"{where} run_end counter {name}",
                   lambda: f"total {_fmt(total)} != its intervals' {_fmt(summed)}")


def _check_phases_tagged(res: CheckResult, where: str, start: dict, intervals: list, by_name: dict) -> None:
    """A segment with warm-up steps marks its first interval warm-up; every phase span that shows is listed."""
    begun = views.run_start(start)
    if not begun.marks_warmup:
        res.note(f"{where}: run_start without warmup_steps (written before warm-up marks): not checked")
    elif (begun.warmup_steps or 0) > 0 and intervals:
        first = intervals[0]
        res.expect(window_warmup(first), "phases", f"{where} interval {window_index(first)}",
                   lambda: f"not marked warmup, though run_start gives warmup_steps {begun.warmup_steps}")
    if not begun.lists_phases:
        res.note(f"{where}: run_start without phase_spans (written before phases were listed): not checked")
        return
    listed = set(begun.phase_spans)
    phases = of_run_start(start).names(PHASE)   # the run's phase spans: each that shows must be listed
    seen = {n for n in by_name if n in phases}
    for name in sorted(seen - listed):
        res.expect(False, "phases", f"{where} span {name}", "a phase span not listed in run_start phase_spans")
    res.checked += len(seen & listed)


# ---- per rank: nothing counted twice; the throughput file, its event and the report -----------------

def _check_once(res: CheckResult, where: str, log, named: list) -> None:
    """Per span name, its time over the rank's intervals on its one clock fits in the rank's wall time times
    the threads that ran it (a span counted as open CPU time and again as GPU time would not); `named`: each
    segment's entries of each span."""
    wall = wall_seconds(log.intervals)
    by_name: dict = named[0] if len(named) == 1 else {}
    for segment in named if len(named) > 1 else ():
        for name, entries in segment.items():
            by_name.setdefault(name, []).extend(entries)
    for name, entries in by_name.items():
        on = span_clock(entries)
        total = summed_clock_seconds(entries, on)
        threads = max(1, len(threads_of(entries)))
        res.expect(_le(total, wall * threads, SHARE_SLACK * max(1, len(entries))), "once", f"{where} span {name}",
                   lambda: f"{_fmt(total)} s on the {on} clock over the run > {threads} thread(s) x its "
                           f"wall {_fmt(wall)} s")


def _read_throughput(res: CheckResult, run: Run, log) -> dict | None:
    """RUN_DIR/throughput/rank{R}.json, or None when absent; an unreadable one is a violation."""
    path = Path(run.run_dir) / "throughput" / f"rank{log.rank}.json"
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        res.expect(False, "agree", f"throughput/rank{log.rank}.json", f"unreadable: {e}")
        return None


def _throughput_events(log) -> list:
    """The rank's `throughput` events, as written (profiler.schema.windows.steady_throughput reads them)."""
    return [e for e in log.events if isinstance(views.event(e), views.Throughput)]


def _marks_phases(log) -> bool:
    """Whether the rank's log was written with warm-up marks, phase lists and throughput events (6042c1f)."""
    return any(s.marks_warmup for s in map(views.run_start, log.run_starts))


def _rank_rate(log, file: dict | None) -> float | None:
    """The rank's steady_tokens_per_s as its throughput file says (a resumed rank: its events, all segments)."""
    events = _throughput_events(log)
    if len(events) > 1:
        return steady_throughput(events)["steady_tokens_per_s"]
    if file:   # the throughput file (a JSON file of its own, not a run-log record)
        return file.get("steady_tokens_per_s")
    return views.event(events[-1]).steady_tokens_per_s if events else None


def _check_throughput(res: CheckResult, log, got: dict | None, want: float | None, report: dict) -> None:
    """The file says what the rank's last throughput event says (exactly), the report's rank row what its
    events say (within RATE_TOLERANCE), and a drafter past warm-up wrote one."""
    name = f"throughput/rank{log.rank}.json"
    events = _throughput_events(log)
    if not _marks_phases(log) and not events:
        res.note(f"{_log_name(log)}: written before throughput events: {name} not checked against it")
        return
    if got is not None or events:
        res.expect(got is not None and bool(events), "agree", name, lambda: "the throughput file is missing"
                   if got is None else f"no throughput event in {_log_name(log)}")
    if got is not None and events:
        last = views.event(events[-1]).steady_tokens_per_s
        res.expect(got.get("steady_tokens_per_s") == last, "agree", name,
                   lambda: f"steady_tokens_per_s {_fmt(got.get('steady_tokens_per_s'))} != its last throughput "
                           f"event's {_fmt(last)} ({_log_name(log)})")
    if len(events) > 1:
        res.note(f"{name}: holds the last of {len(events)} segments; the report's rate (all segments) is "
                 "checked against the run log's throughput events")
    row = next((r for r in report["ranks"]["ranks"] if r["rank"] == log.rank), None)
    if row is not None:
        res.expect(_close(row.get("steady_tokens_per_s"), want), "agree", f"hotspots ranks rank {log.rank}",
                   lambda: f"steady_tokens_per_s {_fmt(row.get('steady_tokens_per_s'))} != {name}'s {_fmt(want)}")
    if log.role == "drafter":
        _check_past_warmup(res, log, events)


def _close(a, b, rel: float = RATE_TOLERANCE) -> bool:
    if a is None or b is None:
        return a is b
    return abs(a - b) <= rel * max(abs(a), abs(b))


def _check_past_warmup(res: CheckResult, log, events: list) -> None:
    """Each segment that ended `ok` more than warmup_steps past where it began has a throughput event
    (ThroughputMeter.finish). A segment's steps start where the previous segment's last step left off."""
    begin_step, after_unix = 0, None
    for k, (start, _intervals, end) in enumerate(_segments(log)):
        if end is None or start is None:
            begin_step, after_unix = None, None
            continue
        done = views.run_end(end)
        warm, step = views.run_start(start).warmup_steps, done.step or 0
        if warm is not None and begin_step is not None and done.status == "ok" and step > begin_step + warm:
            ended = done.time_unix or 0.0
            mine = [e for e in map(views.event, events) if (after_unix is None or (e.time_unix or 0.0) > after_unix)
                    and (e.time_unix or 0.0) <= ended]
            res.expect(bool(mine), "phases", f"{_log_name(log)} segment {k}",
                       lambda: f"ran to step {step}, past {warm} warm-up steps from step {begin_step}, "
                               "and wrote no throughput event")
        begin_step, after_unix = step + 1, done.time_unix


# ---- the report: its rows and its per-role steady rates ---------------------------------------------

def _check_report_rows(res: CheckResult, run: Run, report: dict) -> None:
    """Each hotspots row: share at most its threads' (share x role wall <= threads x wall), order
    statistics in order, self <= total, a one-rank role's percentiles its run_end's."""
    threads = _most_threads(run)
    roles = run.by_role()
    for row in report["spans"]["rows"]:
        here = f"hotspots row {row['role']} {row['span']}"
        n = threads.get((row["role"], row["span"]), 1)
        res.expect(_le(row.get("share"), n, SHARE_SLACK), "shares", here,
                   lambda: f"share {_fmt(row.get('share'))} over {n} thread(s)")
        _check_order(res, here, row)
        res.expect(row.get("count", 0) >= 0, "order", here, lambda: f"count {row.get('count')} < 0")
        res.expect(_le(row.get("self_seconds"), row.get("total_seconds"), 1e-9), "once", here,
                   lambda: f"self {_fmt(row.get('self_seconds'))} s > total {_fmt(row.get('total_seconds'))} s")
        _check_row_against_run_end(res, here, row, roles.get(row["role"], []))
    for role, shares in ((report.get("verdict") or {}).get("roles") or {}).items():
        wait = shares.get("wait_share")   # a role's waits are its ranks' main-thread waits: at most its wall
        res.expect(_le(wait, 1.0, SHARE_SLACK), "shares", f"hotspots verdict {role}",
                   lambda: f"waits {_fmt(wait)} of its wall on {shares.get('wait_span')}")


def _most_threads(run: Run) -> dict:
    """{(role, span): the most threads one of its interval entries names}, where that is more than one."""
    most: dict = {}
    for log in run.ranks.values():
        for name, n in most_threads(log.intervals).items():
            if n > 1 and n > most.get((log.role, name), 1):
                most[log.role, name] = n
    return most


def _check_row_against_run_end(res: CheckResult, here: str, row: dict, logs: list) -> None:
    """A role of one rank's one segment: the row's p50, p95 and max are its run_end's (on the row's clock), as
    the console's end-of-run table prints them."""
    if len(logs) != 1 or len(logs[0].run_ends) != 1 or len(logs[0].run_starts) != 1:
        return
    end = views.run_end(logs[0].run_ends[0])
    if end.run_log is not None:   # its log lost records to a full disk: the run_end covers more
        return
    entry = end.spans.entry(row["span"])
    stats = views.ClockStats.of(entry.gpu if row["on"] == "gpu" else entry.cpu if row["on"] == "cpu" else None)
    for key in ("p50_seconds", "p95_seconds", "max_seconds"):   # ClockStats fields, named as the log names them
        said = getattr(stats, key)
        if said is not None:
            res.expect(math.isclose(row[key] or 0.0, said, rel_tol=1e-9, abs_tol=1e-12), "agree", here,
                       lambda: f"{key} {_fmt(row[key])} != its run_end's {_fmt(said)}")


def _check_role_rates(res: CheckResult, run: Run, rates: dict, report: dict) -> None:
    """The report's steady rate per role is its ranks' throughput files summed (a resumed rank: its events,
    all segments), the headline `steady_tokens_per_s` and the split's measured rate the drafters'."""
    roles = report["steady"]["roles"]
    for role, logs in run.by_role().items():
        if not any(_marks_phases(log) or _throughput_events(log) for log in logs):
            continue   # written before throughput events: noted per rank
        mine = (roles.get(role) or {}).get("steady_tokens_per_s")
        got = [rates[log.rank] for log in logs if rates[log.rank] is not None]
        want = sum(got) if got else None
        res.expect(_close(mine, want), "agree", f"hotspots steady {role}",
                   lambda: f"steady_tokens_per_s {_fmt(mine)} != its ranks' throughput files summed {_fmt(want)}")
    drafter = (roles.get("drafter") or {}).get("steady_tokens_per_s")
    res.expect(report.get("steady_tokens_per_s") == drafter, "agree", "hotspots steady_tokens_per_s",
               lambda: f"{_fmt(report.get('steady_tokens_per_s'))} != the drafters' {_fmt(drafter)}")
    current = report["split"].get("current")
    if current:
        res.expect(_close(current["measured_tokens_per_s"], drafter), "agree", "hotspots split current",
                   lambda: f"measured_tokens_per_s {_fmt(current['measured_tokens_per_s'])} != the drafters' "
                           f"steady_tokens_per_s {_fmt(drafter)}")


# ---- windows: what a figure is read over, and what the text calls it ---------------------------------

def _check_windows(res: CheckResult, run: Run, report: dict, rates: dict, text: list) -> None:
    """Each rank's row and each role's verdict name the window their figures were read over: its steady
    intervals (profiler.schema.windows.is_steady over the marks and phase spans, not the report's code), or, with
    none, a label saying none is steady; the text's verdict line and rank rows show those labels, and each row's
    tokens/s is the rank's throughput file's."""
    rows = {r["rank"]: r for r in report["ranks"]["ranks"]}
    verdict = next((line for line in text if line.startswith("Verdict (")), "")
    table = _rank_lines(text)
    steady: dict = {}
    for log in run.ranks.values():
        if not _marks_phases(log):
            res.note(f"{_log_name(log)}: run_start without warmup_steps (written before warm-up marks): "
                     "its windows not checked")
            continue
        windows, phases = _windows_of(log), rank_phase_spans(log)
        steady[log.rank] = [r for r in windows if is_steady(r, phases)]
        row, where = rows[log.rank], f"hotspots ranks rank {log.rank}"
        _expect_window(res, where, row["window"], len(steady[log.rank]), bool(_fine_ticks(log)),
                       bool(past_warm_up(windows)))
        read = wall_seconds(steady[log.rank] or past_warm_up(windows) or windows)
        res.expect(abs(row["window_seconds"] - read) <= 1e-6, "windows", where,
                   lambda: f"window_seconds {_fmt(row['window_seconds'])} != its intervals' {_fmt(read)}")
        line = table.get(log.rank, "")
        res.expect(row["window"] in line, "windows", f"hotspots text ranks rank {log.rank}",
                   lambda: f"the row does not name its window {row['window']!r}: {line!r}")
        _check_rank_line(res, log, row, line, rates[log.rank], steady[log.rank])
    if not report["verdict"].get("applies", True):   # a loop of its own: no verdict line to name windows
        return
    for role, logs in run.by_role().items():
        if all(log.rank in steady for log in logs):
            label = report["verdict"]["roles"][role]["window"]
            ks = [len(steady[log.rank]) for log in logs]
            phased = not any(ks) and all(past_warm_up(_windows_of(log)) for log in logs)
            _expect_window(res, f"hotspots verdict {role}", label, sum(ks) if all(ks) else 0,
                           all(_fine_ticks(log) for log in logs), phased)
            res.expect(f"{role}: {label}" in verdict, "windows", f"hotspots text verdict {role}",
                       lambda: f"the verdict line does not name {role}'s window {label!r}: {verdict!r}")
            wall = wall_seconds([r for log in logs for r in (steady[log.rank] or past_warm_up(_windows_of(log))
                                                             or _windows_of(log))])
            _expect_beside(res, f"hotspots text verdict {role}", verdict, f"{role}: {label}", wall)
            _expect_steady_beside_steady(res, role, logs, label, report)


def _expect_beside(res: CheckResult, where: str, text: str, label: str, seconds: float) -> None:
    """A window's label in `text` is followed by its own length ("LABEL, 70 s"), not another window's figure."""
    at = text.find(label)
    said = text[at + len(label):].split(";")[0].split(")")[0] if at >= 0 else ""
    res.expect(said.strip(", ") == f"{seconds:.0f} s", "windows", where,
               lambda: f"{label!r} is followed by {said!r}, but its windows last {seconds:.0f} s")


def _expect_steady_beside_steady(res: CheckResult, role: str, logs: list, label: str, report: dict) -> None:
    """Where the role wrote ticks and its steady state has a rate, its verdict's window is a steady one: "steady"
    never sits beside "none steady"."""
    rate = (((report.get("steady") or {}).get("roles") or {}).get(role) or {}).get("steady_tokens_per_s")
    if rate is None or not all(_fine_ticks(log) for log in logs):
        return
    res.expect("none steady" not in label, "windows", f"hotspots verdict {role}",
               lambda: f"the steady state reads {rate:,.0f} tokens/s, but the verdict's window is {label!r}")


def _windows_of(log) -> list:
    """What a rank's figures are read over: its tick windows (profiler.schema.windows.tick_windows) where it wrote ticks
    finer than its intervals, else its intervals."""
    return _fine_ticks(log) or log.intervals


def _fine_ticks(log) -> list:
    """The rank's tick windows where finer than its intervals (RankLog.tick_windows, read once), else none."""
    return log.tick_windows


def _expect_window(res: CheckResult, where: str, label: str, steady: int, ticks: bool = False,
                   phased: bool = False) -> None:
    """`label` names `steady` steady intervals (or tick windows: `ticks`); with none, the windows past warm-up
    where there are some (`phased`: each over a tenth in phases), else says none is steady."""
    past = "past-warm-up tick windows (" if ticks else "past-warm-up intervals ("
    want = (f"steady windows ({steady} x" if ticks else f"steady intervals ({steady})") if steady else \
        past if phased else "a label saying none is steady"
    ok = (label.startswith(want) if ticks else label == want) if steady else label.startswith(past) if phased else \
        "none steady" in label and not label.startswith("steady")
    res.expect(ok, "windows", where, lambda: f"window {label!r}, but its figures were read over {want}")


def _rank_lines(text: list) -> dict:
    """{rank: its row} of the text's Ranks table."""
    start = next((i for i, line in enumerate(text) if line.startswith("Ranks (")), len(text))
    out = {}
    for line in text[start + 2:]:
        fields = line.split()
        if not fields or not fields[0].isdigit():
            break
        out[int(fields[0])] = line
    return out


def _check_rank_line(res: CheckResult, log, row: dict, line: str, meter_rate, steady: list) -> None:
    """No window label beside another window's figure, in a rank's row: its tokens/s is the meter's steady rate
    named "steady state" with the meter's seconds, or, for a loop of its own without a meter, the tokens/s of the
    row's window (its steady windows; where none is, those past warm-up, else all of them, the row's label saying
    which: the steady line's rate, runs.steady_window) named by their label and wall; busy and capacity are named by that label and
    wall, and the capacity is the steady windows' tokens/s over the work share (none without a steady one)."""
    where = f"hotspots text ranks rank {log.rank}"
    read = steady or past_warm_up(_windows_of(log)) or _windows_of(log)
    wall = wall_seconds(read)
    window_rate = counter_total(read, "tokens") / wall if wall > 0 else None
    meter = steady_throughput(log.events)
    if meter_rate is not None and meter is not None:
        want, label, source = meter_rate, f"tokens/s over steady state, {meter['steady_seconds']:.1f} s", \
            "its throughput file's steady_tokens_per_s"
    elif log.role not in ("target", "drafter") and window_rate:
        want, label, source = window_rate, f"tokens/s over {row['window']}, {wall:.1f} s", \
            "its window's tokens/s"
    else:
        want, label, source = None, "tokens/s over -", "no rate"
    _expect_text_rate(res, log.rank, line, want, source)
    res.expect(label in line, "windows", where, lambda: f"its tokens/s is over {label[len('tokens/s over '):]!r}, "
                                                         f"the row names another window: {line!r}")
    busy = f"busy, capacity over {row['window']}, {wall:.1f} s"
    res.expect(busy in line, "windows", where, lambda: f"the row does not name its busy/capacity window "
                                                        f"{busy!r}: {line!r}")
    cap, work = row.get("capacity_tokens_per_s"), row.get("work_share")
    if cap is not None:
        res.expect(steady and work and window_rate and _close(cap, window_rate / work), "windows",
                   f"hotspots ranks rank {log.rank}", lambda: f"capacity {_fmt(cap)} is not its steady intervals' "
                   f"tokens/s {_fmt(window_rate)} over their work share {_fmt(work)}")


def _expect_text_rate(res: CheckResult, rank: int, line: str, want: float | None,
                      source: str = "its throughput file's steady_tokens_per_s") -> None:
    """The tokens/s cell of a rank's row (its third field, printed to the token) is `want`, or "-" without one."""
    cell = (line.split() + ["", "", ""])[2].replace(",", "")
    try:
        got = None if cell == "-" else float(cell)
    except ValueError:
        got = cell
    ok = got is None if want is None else isinstance(got, float) and abs(got - want) <= 0.5 + RATE_TOLERANCE * want
    res.expect(ok, "agree", f"hotspots text ranks rank {rank}",
               lambda: f"tokens/s {cell!r} != {source} {_fmt(want)}")


# ---- compare: both runs over the same kind of window, counts and the summary agreeing ------------------

def check_compare(run_dir_a, run_dir_b) -> CheckResult:
    """The compare invariants of `dflash-report compare A B` (`check RUN_DIR --compare BASELINE`)."""
    with paused_gc():
        return _checked_pair(run_dir_a, run_dir_b)   # the runs are freed before the collector is back on


def _checked_pair(run_dir_a, run_dir_b) -> CheckResult:
    run_a, run_b = load_run(run_dir_a), load_run(run_dir_b)
    res = CheckResult(run_dir=f"{run_dir_a} vs {run_dir_b}", ranks=len(run_a.ranks) + len(run_b.ranks),
                      intervals=sum(len(log.intervals) for r in (run_a, run_b) for log in r.ranks.values()))
    _check_compare(res, run_a, run_b)
    return res


def _check_compare(res: CheckResult, run_a: Run, run_b: Run) -> None:
    """Per role, both runs are read over the same kind of window (tick windows where every rank of both wrote
    ticks, else intervals; steady ones where both have some, else all), each label names its window count, the
    tokens/s row has one sample per window; a span both runs have is never "only in" one; the Regressions line
    lists every row called a regression."""
    table = compare_runs(run_a, run_b)
    text = format_compare(table)
    sides = {"a": run_a.by_role(), "b": run_b.by_role()}
    for role in sorted(set(sides["a"]) & set(sides["b"])):
        logs = sides["a"][role] + sides["b"][role]
        if not all(_marks_phases(log) for log in logs):
            res.note(f"compare {role}: a log without warm-up marks: its windows not checked")
            continue
        ticks = all(_fine_ticks(log) for log in logs)
        kept = {side: [_steady_of(_windows_alike_of(log, ticks), rank_phase_spans(log)) for log in sides[side][role]]
                for side in sides}
        steady = all(all(ws) for ws in kept.values())
        for side in sides:
            windows = [w for k, log in enumerate(sides[side][role])
                       for w in (kept[side][k] if steady else _windows_alike_of(log, ticks))]
            label = table["role_windows"][role][side]
            want = (f"steady windows ({len(windows)} x" if ticks else f"steady intervals ({len(windows)})") if steady \
                else f"all {len(windows)} " if len(windows) > 1 else "the only "
            res.expect(label.startswith(want), "compare", f"compare {role} {side.upper()}",
                       lambda: f"read over {label!r}, but both runs' windows alike are {want}...")
            rate = table["tokens_per_s"].get(role)
            timed = sum(1 for w in windows if counter_per_second(w, "tokens") is not None)
            res.expect(rate is None or rate[side]["intervals"] == timed, "compare", f"compare {role} {side.upper()}",
                       lambda: f"tokens/s n = {rate[side]['intervals']}, but {timed} of its windows have a rate")
        res.expect(f"{role}: A over {table['role_windows'][role]['a']}; B over {table['role_windows'][role]['b']}"
                   in text, "compare", f"compare text {role}", "the text does not name both runs' windows")
    _check_compare_rows(res, run_a, run_b, table, text)


def _check_compare_rows(res: CheckResult, run_a: Run, run_b: Run, table: dict, text: str) -> None:
    have = [_span_names(run_a)]
    have.append(have[0] if run_b is run_a else _span_names(run_b))
    for row in table["spans"]:
        key = (row["role"], row["span"])
        res.expect(not (row["verdict"].startswith("only in") and key in have[0] and key in have[1]), "compare",
                   f"compare {row['role']}/{row['span']}", lambda: f"{row['verdict']!r}, but both runs have it")
    called = ([f"{r['role']}/{r['span']}" for r in table["spans"] if r["verdict"] == "regression"]
              + [f"tokens/s ({k})" for k, c in table["tokens_per_s"].items() if c["verdict"] == "regression"]
              + [f"peak used (gpu {k})" for k, c in table["memory"].items() if c["verdict"] == "regression"])
    line = next((x for x in text.splitlines() if x.startswith("Regressions: ")), "")
    res.expect(line == "Regressions: " + (", ".join(called) or "none"), "compare", "compare text Regressions",
               lambda: f"{line!r}, but the table calls {called or 'none'} regressions")


def _span_names(run: Run) -> set:
    """{(role, span)} of every span entry of the run's intervals."""
    names: dict = {}
    for log in run.ranks.values():
        mine = names.setdefault(log.role, set())
        mine.update(span_names(log.intervals))
    return {(role, name) for role, mine in names.items() for name in mine}


def _steady_of(windows: list, phases: tuple) -> list:
    return [w for w in windows if is_steady(w, phases)]


def _windows_alike_of(log, ticks: bool) -> list:
    return _fine_ticks(log) if ticks else log.intervals


# ---- flows in the merged trace ---------------------------------------------------------------------

def _check_flows(res: CheckResult, run: Run) -> None:
    """In the merged trace (report.trace's flow points, built in memory), every flow points forward in time (its
    receive point at or after its send point), and at least FLOW_MATCH_MIN of the sends have their receive, when
    the run has a target and a drafter that sent and no rank stopped early."""
    if not {"target", "drafter"} <= set(run.by_role()):
        res.note("flows: no transfers to match (they go from a target to a drafter rank, and the run lacks one): "
                 "not checked")
        return
    events, counts = flow_trace(run)
    backward = backward_flows(events)
    res.expect(not backward, "flows", "merged trace", lambda: (
        f"{len(backward)} flow(s) point backwards in time, e.g. batch {backward[0][0]}: received at "
        f"{(backward[0][2] - backward[0][1]) / 1e6:+.3f} s from its send"))
    stopped = [log.rank for log in run.ranks.values()
               if any(views.event(e).kind in ("stop", "signal") for e in log.events)
               or any(views.run_end(end).status not in (None, "ok") for end in log.run_ends)
               or len(log.run_ends) < len(log.run_starts)]
    if stopped:   # a stop drops the batches in flight: their sends have no receive, by design
        res.note(f"flows: rank(s) {', '.join(map(str, stopped))} stopped early (a signal, a stop or a failure): "
                 "the batches in flight at the stop are never received; matching not checked")
        return
    matched, sends = counts["flows_matched"], counts["flow_sends"]
    if not sends:
        res.note("flows: no transfer.send with a flow in any detail window: not checked")
        return
    res.expect(matched >= FLOW_MATCH_MIN * sends, "flows", "merged trace",
               lambda: f"{matched} of {sends} sends have their receive ({matched / sends:.0%}; "
                       f"at least {FLOW_MATCH_MIN:.0%} must)")
