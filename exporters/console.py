"""Console text from run-log records (live and after the fact): the per-interval summary and the end-of-run
hotspot table. Times are GPU times where measured, else CPU (the `on` column).
"""
from __future__ import annotations

import shlex
import sys
from collections import Counter, defaultdict

from profiler.schema import views
from profiler.schema.records import printable
from profiler.schema.windows import STEADY_PHASE_SHARE_MAX, compute_clause, mfu, summed_mfu

GIB = 1024 ** 3


def _ms(seconds) -> str:
    if seconds is None:
        return "-"
    ms = seconds * 1e3
    return f"{ms:.2f}" if ms >= 0.1 else f"{ms:.4f}"   # sub-0.1 ms spans keep 4 decimals


def _pct(ratio) -> str:
    return "-" if ratio is None else f"{ratio * 100:.1f}%"


def _num(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and v != v:
        return "nan"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _gib(n, digits: int = 2) -> str:
    return "?" if n is None else f"{n / GIB:.{digits}f}"


def format_memory(memory) -> list[str]:
    """One line per GPU with headroom, or "memory: n/a (reason)"; never a made-up number (an unread figure is
    "?"). `memory`: an interval's memory block (a dict or views.Memory), or None."""
    mem = views.Memory.of(memory)
    if not mem.available:
        return [f"  memory: n/a ({mem.reason or 'no memory data'})"]
    lines = []
    for g in mem.gpus:
        if g.headroom_bytes is None or g.total_bytes is None:
            lines.append(f"  memory gpu{g.index}: n/a (no samples this interval)")
            continue
        lines.append(f"  memory gpu{g.index} {g.name or ''}: headroom {_gib(g.headroom_bytes)} GiB "
                     f"of {_gib(g.total_bytes, 1)} GiB (peak used {_gib(g.used_bytes_peak)} GiB)")
    alloc = mem.allocator
    if alloc.available:
        lines.append(f"  allocator: allocated {_gib(alloc.allocated_bytes)} GiB, reserved "
                     f"{_gib(alloc.reserved_bytes)} GiB, peak allocated {_gib(alloc.peak_allocated_bytes)} GiB")
    return lines or ["  memory: n/a (no GPUs listed)"]


def format_interval(record, phase_spans=(), peaks: dict | None = None) -> str:
    """A short block for one interval record (a dict or views.Interval): spans by share (each column what its
    header says), then the spans open at the interval's end and for how long, counters' rates, gauges, metrics,
    memory, thread CPU. The head says when the interval is not steady work: warm-up, or mostly in `phase_spans`
    (run_start's); `peaks` (run_start's compute_peaks): what its model FLOP/s is read against (MFU)."""
    rec = views.interval(record)
    rate = rec.step_rate.per_second
    head = (f"[profile] rank {rec.rank} {rec.role}  interval {rec.index}  "
            f"step {rec.step}{'' if rate is None else f' ({rate:.3g} steps/s)'}  "
            f"{rec.duration_seconds or 0.0:.1f} s{_not_steady_tag(rec, phase_spans)}  "
            f"[every figure: this interval]")
    lines = [head]
    spans = rec.spans
    if spans:
        lines.extend(_span_table(spans, rec.memory, rec.open_at_end))
    else:
        lines.append("  (no spans finished in this interval)")
    for name, c in rec.counters.items():
        rate = c.per_second
        lines.append(f"  {name}: {'-' if rate is None else f'{rate:.1f}'}/s (interval {_num(c.total)}, "
                     f"run {_num(c.run_total)})")
    flops = rec.counters.get("model_flops")
    if flops is not None and flops.per_second is not None:
        lines.append("  " + compute_clause(flops.per_second, mfu(flops.per_second, peaks or {}), _whats(peaks)))
    for name, g in rec.gauges.items():
        lines.append(f"  {name}: last {_num(g.last)} mean {_num(g.mean)} max {_num(g.max)}")
    metrics = rec.metrics
    if metrics:
        lines.append("  last: " + "  ".join(f"{n} {_num(m.last)}" for n, m in metrics.items()))
    lines.extend(format_memory(rec.memory))
    lines.extend(format_thread_cpu(rec))
    return "\n".join(lines)


def _span_table(spans, memory, opened: dict) -> list:
    """The interval's spans by share, the line of spans open at its end, and the notes on GPU times."""
    sm = _sm_active_percent(memory)
    on_gpu = any(e.gpu for e in spans.values())   # the GPU and busy columns: CUDA runs only
    lines = [f"  {'span':<24} {'count':>7} {'on':>3} {'mean ms':>9} {'p95 ms':>9} {'share':>7}"
             + (f"  {'GPU':<13} {'busy':>5}" if on_gpu else "") + "  bandwidth"]
    for name, e in sorted(spans.items(), key=lambda kv: -(kv[1].share or 0.0)):
        stats, on = e.basis()
        line = (f"  {name:<24} {e.count:>7} {on:>3} {_ms(stats.mean_seconds):>9} "
                f"{_ms(stats.p95_seconds):>9} {_pct(e.share):>7}"
                + (f"  {_gpu_cells(e, sm)}" if on_gpu else ""))
        bw = e.bandwidth_bytes_per_s
        if bw is not None:
            line += f"  {bw / 1e9:.2f} GB/s"
            if e.floor_ratio is not None:
                line += f" ({e.floor_ratio * 100:.0f}% of {e.floor})"
        lines.append(line)
    lines.extend(_open_line(opened))
    lines.extend(_gpu_sample_note(spans))
    if on_gpu:
        lines.append("  on gpu: mean/p95/share of the GPU window (CUDA events: stream reached start to end, "
                     "idle gaps included); GPU: launch-bound (the GPU kept pace with the host's launches: the "
                     "window is host time), GPU-bound (it ran behind the host) or mixed; busy: GPM SM active")
    return lines


def _sm_active_percent(memory) -> float | None:
    """The interval's GPM SM active percent (the mean over its GPUs), None where GPM did not measure it."""
    values = [g.sm_active_percent_mean for g in memory.gpus if g.sm_active_percent_mean is not None]
    return sum(values) / len(values) if values else None


def _gpu_cells(entry, sm_active_percent) -> str:
    """A span row's GPU class and busy estimate in this interval (profiler.schema.windows.gpu_bound), "-" where unknown."""
    g = entry.gpu_bound(sm_active_percent=sm_active_percent)
    if g is None:
        return f"{'-':<13} {'-':>5}"
    busy = "-" if g["busy_share"] is None else f"{100 * g['busy_share']:.0f}%"
    return f"{g['class']:<13} {busy:>5}"


def _not_steady_tag(rec, phase_spans) -> str:
    """"  (warm-up)", "  (phases 8.2 s: drafter.eval 8.2 s; not steady)" when the phases took more than
    STEADY_PHASE_SHARE_MAX of the interval (profiler.schema.windows.is_steady's test), else ""."""
    if rec.warmup:
        return "  (warm-up)"
    if rec.phase_share(phase_spans) <= STEADY_PHASE_SHARE_MAX:
        return ""
    phases = {n: s for n, s in rec.phase_seconds(phase_spans).items() if s > 0}
    named = ", ".join(f"{n} {s:.1f} s" for n, s in sorted(phases.items(), key=lambda kv: -kv[1]))
    return f"  (phases {sum(phases.values()):.1f} s: {named}; not steady)"


def _open_line(opened: dict) -> list:
    """One line for the spans open at the interval's end (their rows hold only the part of their time that fell
    in this interval), with how long each had been open and on which thread: `drafter.fwd_bwd 75.2 s (main)`."""
    if not opened:
        return []
    return ["  open at the interval's end: " + ", ".join(
        f"{name} {age_s:.3g} s ({thread})" for name, ages in opened.items() for thread, age_s in ages)]


def _gpu_sample_note(spans) -> list:
    """One line when some spans carry no GPU time (their event pairs resolve in a later interval), else none."""
    timed = [(e.gpu_count, e.count) for e in spans.values() if e.gpu_count is not None]
    n, total = sum(t for t, _ in timed), sum(c for _, c in timed)
    if n >= total:
        return []
    return [f"  gpu times for {n} of {total} spans, the others not yet resolved (shares scale them by count / timed)"]


def format_thread_cpu(record, top: int = 4) -> list:
    """One line: the interval's busiest threads by CPU time, and the profiler threads' share of wall time."""
    rec = views.interval(record)
    cpu = rec.threads_cpu_seconds
    if not cpu:
        return []
    busiest = ", ".join(f"{n} {v:.2f} s" for n, v in list(cpu.items())[:top])
    share = rec.profiler_share
    own = "" if share is None else f"; profiler threads {share * 100:.2f}% of the interval"
    return [f"  thread cpu: {busiest}{own}"]


def hotspot_rows(run_end_records: list) -> tuple[list, dict]:
    """run_end records summed over ranks and segments: rows (role, span, total_s, share, mean_s, p95_s,
    count) by total time, and per role {"wall_seconds", "ranks", "segments", "rates"}. A rank's rate is its
    counter's total over its wall time, a role's the sum of its ranks'; p95 is exact for a role of one rank's one
    segment, else the worst of theirs (dflash-report hotspots merges their histograms)."""
    walls, totals, agg, segments = Counter(), defaultdict(Counter), {}, Counter()
    for rec in map(views.run_end, run_end_records):
        role, key = rec.role, (rec.role, rec.rank)
        walls[key] += rec.duration_seconds or 0.0
        segments[role] += 1
        totals[key].update({n: c.total for n, c in rec.counters.items() if c.total is not None})
        for sname, e in rec.spans.items():
            a = agg.setdefault((role, sname), {"total": 0.0, "whole": 0.0, "count": 0, "p95s": []})
            a["total"] += e.basis_seconds
            a["whole"] += e.whole_seconds
            a["count"] += e.count
            a["p95s"].append(e.basis()[0].p95_seconds)
    roles: dict = {}
    for (role, rank_id), wall in walls.items():
        r = roles.setdefault(role, {"wall_seconds": 0.0, "ranks": [], "segments": segments[role], "rates": {}})
        r["wall_seconds"] += wall
        r["ranks"].append(rank_id)
        for cname, total in totals[(role, rank_id)].items():
            if wall > 0:
                r["rates"][cname] = r["rates"].get(cname, 0.0) + total / wall
    rows = [(role, sname, a["total"], a["total"] / wall if (wall := roles[role]["wall_seconds"]) > 0 else None,
             a["whole"] / a["count"] if a["count"] else None,
             max((p for p in a["p95s"] if p is not None), default=None), a["count"])
            for (role, sname), a in agg.items()]
    return sorted(rows, key=lambda r: -r[2]), roles


def format_hotspots(run_end_records: list, throughput_events: list = (), run_starts: list = ()) -> str:
    """The end-of-run table over the whole run: spans by total time with their share of the role's wall time,
    every counter's rate per role, then each role's steady state from its ranks' last `throughput` events (with
    the MFU against the compute peaks of the ranks' `run_starts`)."""
    rows, roles = hotspot_rows(run_end_records)
    lines = ["whole run:", f"{'span':<24} {'role':<10} {'total s':>9} {'share':>7} {'mean ms':>9} {'p95 ms':>9}"]
    for role, sname, total, share, mean, p95, _ in rows:
        lines.append(f"{sname:<24} {str(role):<10} {total:>9.3f} {_pct(share):>7} {_ms(mean):>9} {_ms(p95):>9}")
    if not rows:
        lines.append("(no spans recorded)")
    several = sorted(str(role) for role, r in roles.items() if r["segments"] > 1)
    if several:
        lines.append(f"(p95 of {', '.join(several)}: the worst of its ranks' and segments')")
    if any(e.gpu for rec in map(views.run_end, run_end_records) for e in rec.spans.values()):
        lines.append("(a CUDA span's times are its GPU window: the stream reached its start event .. its end event, "
                     "idle gaps included; `dflash-report hotspots` says which spans are launch-bound)")
    for role, r in roles.items():
        rates = ", ".join(f"{n} {v:.1f}/s" for n, v in sorted(r["rates"].items())) or "no counters"
        lines.append(f"{role} ({len(r['ranks'])} rank{'s' if len(r['ranks']) != 1 else ''}, "
                     f"{r['wall_seconds']:.1f} s, whole run): {rates}")
    resumed = {role for role, r in roles.items() if r["segments"] > len(r["ranks"])}
    peaks = {start.rank: start.compute_peaks for start in map(views.run_start, run_starts)}
    lines.extend(format_steady(throughput_events, resumed, peaks))
    return "\n".join(lines)


def format_steady(throughput_events: list, resumed=(), peaks: dict | None = None) -> list:
    """One line per role: its ranks' steady tokens/s summed, with the window, steps and phases left out (of the
    last segment for a role in `resumed`: a rank's last event is its last segment's), and where the loop counted
    model FLOPs their rate over the same window and the role's MFU against `peaks` ({rank: run_start
    compute_peaks})."""
    by_role: dict = {}
    for e in map(views.Throughput.of, throughput_events):
        if e.steady_tokens_per_s is not None:
            by_role.setdefault(e.role, []).append(e)
    lines = []
    for role, evs in by_role.items():
        phases = Counter()
        for e in evs:
            phases.update({n: v or 0.0 for n, v in e.phases_seconds.items()})
        left = ", ".join(f"{n} {v:.1f} s" for n, v in phases.items() if v > 0.05) or "none"
        lines.append(f"{role} steady state{' of the last segment' if role in resumed else ''}: "
                     f"{sum(e.steady_tokens_per_s for e in evs):,.0f} tokens/s "
                     f"(steady_tokens_per_s; {sum(e.steady_steps or 0 for e in evs)} steps after "
                     f"{evs[0].warmup_steps} warm-up, over {max(e.steady_seconds or 0.0 for e in evs):.1f} s; "
                     f"phases left out: {left}){_steady_compute(evs, peaks or {})}")
    return lines


def _steady_compute(events: list, peaks: dict) -> str:
    """`; model ... TFLOP/s, MFU ...` of a role's throughput events (views.Throughput) over their steady window:
    their model FLOP/s summed, over the summed peaks of their ranks ({rank: compute_peaks})."""
    ranks = [(e.steady_model_flops_per_s, peaks.get(e.rank) or {}) for e in events
             if e.steady_model_flops_per_s is not None]
    if not ranks:
        return ""
    whats = {n: what for _, rank_peaks in ranks for n, what in _whats(rank_peaks).items()}
    return "; " + compute_clause(sum(r for r, _ in ranks), summed_mfu(ranks), whats)


def _whats(peaks: dict | None) -> dict:
    """{peak: its `what`} of a run_start's compute_peaks (each a views.ComputePeak): the MFU's labels."""
    return {n: views.ComputePeak.of(p).what for n, p in (peaks or {}).items() if isinstance(p, dict)}


class ConsoleExporter:
    """The console summary as an exporter: on the exporter thread, each `interval` record is printed
    with `format_interval`, followed by the spans open the whole interval (what a stalled interval
    waits on). Whoever builds a rank's exporters registers it (dflash/telemetry.py: rank 0 only).
    With `run_dir` (a loop's own profiler: exporters.build), the run_end record is printed too: this rank's
    whole-run table and the `dflash-report hotspots RUN_DIR` command; dflash-train prints its own over every rank."""

    name = "console"

    def __init__(self, stream=None, run_dir=None):
        self.stream = stream   # None: sys.stdout at print time (pytest's capture swaps it)
        self.run_dir = run_dir
        self.phase_spans = ()   # from the run_start record: which spans are phases, to tag their intervals
        self.peaks: dict = {}   # and the compute peaks its model FLOP/s is read against

    def export(self, record: dict) -> None:
        out = self.stream or sys.stdout
        rec = views.view(record)
        if isinstance(rec, views.RunStart):
            self.phase_spans, self.peaks = tuple(rec.phase_spans), rec.compute_peaks
        if isinstance(rec, views.RunEnd) and self.run_dir is not None:
            print(printable(f"{format_hotspots([rec])}\nrun directory: {self.run_dir}  (report: dflash-report "
                            f"hotspots {shlex.quote(str(self.run_dir))})"), file=out, flush=True)
        if not isinstance(rec, views.Interval):
            return
        from profiler.forensics import format_open_spans   # imports torch: not for format_* readers

        # thread names are anyone's: printable
        print(printable(format_interval(rec, self.phase_spans, self.peaks)), file=out, flush=True)
        stuck = format_open_spans([t.raw for t in rec.open_spans], min_seconds=rec.duration_seconds or 0.0)
        if stuck:
            print(printable(stuck), file=out, flush=True)

    def close(self, timeout_s: float = 0.0) -> None:
        pass
