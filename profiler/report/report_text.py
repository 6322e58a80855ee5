"""The human text of `dflash-report`: one formatter per section of a report dict; a missing number is "-".
Every figure says its window in words (whole run, steady state, an interval, the last N intervals) and a
statistic its sample count (docs/REPORT.md, "What is measured over what")."""
from __future__ import annotations

from profiler.report.numerics import format_numerics
from profiler.report.memory_forecast import MAX_SCALE
from profiler.report.runs import empty_logs_line
from profiler.schema.windows import compute_clause

GIB = 1024 ** 3


def _ms(seconds) -> str:
    if seconds is None:
        return "-"
    ms = seconds * 1e3
    return f"{ms:.2f}" if ms >= 0.1 else f"{ms:.4f}"


def _pct(ratio) -> str:
    if ratio is None:
        return "-"
    return f"{ratio * 100:.2g}%" if 0 < abs(ratio) < 0.001 else f"{ratio * 100:.1f}%"


def _g(v, fmt: str = ".4g") -> str:
    return "-" if v is None else format(v, fmt)


def _spans(rep: dict) -> list:
    s = rep["spans"]
    on_gpu = any(r["gpu_window_seconds"] is not None for r in s["rows"])   # the GPU and busy columns: CUDA runs
    lines = ["Spans over the whole run by total time (share of the role's whole-run time; each span on one clock, "
             "'on': gpu = its GPU window (CUDA events: the stream reached its start .. its end, idle gaps included), "
             "cpu = host wall time; self s leaves its children out; mean, p50 and p95 over the whole spans on that "
             "clock; GPU: what the GPU did in the window, busy: the capture's kernels over the window, else GPM SM "
             "active, see below)",
             f"  {'span':<22} {'role':<8} {'count':>7} {'on':>3} {'total s':>9} {'self s':>9} {'share':>6} {'cpu s':>9} "
             f"{'GPU window s':>12} {'mean ms':>9} {'p50 ms':>9} {'p95 ms':>9}"
             + (f"  {'GPU':<13} {'busy':>5}" if on_gpu else "")]
    for r in s["rows"]:
        lines.append(f"  {r['span']:<22} {r['role']:<8} {r['count']:>7} {r['on']:>3} {r['total_seconds']:>9.3f} "
                     f"{r['self_seconds']:>9.3f} {_pct(r['share']):>6} {r['cpu_seconds']:>9.3f} {_g(r['gpu_window_seconds'], '.3f'):>12} "
                     f"{_ms(r['mean_seconds']):>9} {_ms(r['p50_seconds']):>9} {_ms(r['p95_seconds']):>9}"
                     + (f"  {gpu_class_cells(r.get('gpu_bound'))}" if on_gpu else "") + ("  (wait)" if r["wait"] else ""))
    if not s["rows"]:
        lines.append("  (no spans recorded)")
    if s["spans_total"] > len(s["rows"]):
        lines.append(f"  ... {s['spans_total'] - len(s['rows'])} more (--top)")
    for role, r in s["roles"].items():
        lines.append(f"  {role}: {len(r['ranks'])} rank(s), {r['wall_seconds']:.1f} s of intervals over the whole run")
    estimated = [r["span"] for r in s["rows"] if r["quantiles_from"] != "exact"]
    if estimated:
        lines.append(f"  p50 and p95 of {len(estimated)} span(s) are estimates over several ranks, segments or "
                     "intervals (quantiles_from: summed histogram buckets, or older logs' percentiles); the others exact")
    return (lines + _gpu_sampled(s["rows"]) + _gpu_classes(s["rows"]) + _open_spans(s["rows"])
            + _means_with_phases(s["rows"]))


def _means_with_phases(rows: list) -> list:
    """A line naming the rows whose whole-run mean lies above their p95: the mean holds the phase steps (a first
    call's compile, a checkpoint, evaluation) that the percentiles leave in the tail, and the steady state out."""
    above = [r for r in rows if r["mean_seconds"] is not None and r["p95_seconds"] is not None
             and r["mean_seconds"] > r["p95_seconds"]]
    if not above:
        return []
    named = ", ".join(f"{r['span']} ({r['role']}: mean {_ms(r['mean_seconds'])} ms, p95 {_ms(r['p95_seconds'])} ms, "
                      f"max {_ms(r['max_seconds'])} ms)" for r in above)
    return [f"  mean above p95, whole run with its phases in (the first step's waits and compile, checkpoints, evaluation: the "
            f"longest spans, which the mean averages in and p95 leaves in the tail; the Steady state section leaves "
            f"them out): {named}"]


def gpu_class_cells(g: dict | None) -> str:
    """The GPU and busy cells of a span row: its class and busy estimate ("-" where unknown)."""
    if not g:
        return f"{'-':<13} {'-':>5}"
    busy = "-" if g["busy_share"] is None else f"{100 * g['busy_share']:.0f}%"
    return f"{g['class']:<13} {busy:>5}"


def _gpu_classes(rows: list) -> list:
    """How the GPU column was read, with its samples and the busy estimate's sources."""
    classed = [r for r in rows if r.get("gpu_bound")]
    if not classed:
        return []
    sources = sorted({r["gpu_bound"]["busy_source"] for r in classed if r["gpu_bound"]["busy_source"]})
    launch = [r["span"] for r in classed if r["gpu_bound"]["class"] == "launch-bound"]
    return [f"  GPU: each CUDA span placed on the host timeline ({sum(r['gpu_bound']['samples'] for r in classed)} "
            "spans over the whole run): launch-bound = the GPU kept pace with the host's launches (its window is host "
            "time, idle between kernels), GPU-bound = the GPU ran behind the host, mixed = neither for 2/3 of its "
            f"spans; busy from {', '.join(sources) or 'nothing measured'} (the capture: its steps only)"
            + (f"; launch-bound: {', '.join(launch)}" if launch else "")]


def _gpu_sampled(rows: list) -> list:
    """A line when some spans carry no GPU time (an older run's sampled steps, unresolved pairs): estimates."""
    timed = [(r["gpu_timed"], r["count"]) for r in rows if r.get("gpu_timed") is not None]
    n, total = sum(t for t, _ in timed), sum(c for _, c in timed)
    if n >= total:
        return []
    return [f"  GPU times for {n} of {total} spans (sampled steps in an older run, or pairs left unresolved); GPU "
            "window s, total s and share on the GPU scale them by count / timed"]


def _open_spans(rows: list) -> list:
    """Spans still open at an interval's end: how often, for how long at most, where; open at the log's end."""
    opened = sorted((r for r in rows if r.get("open_intervals")), key=lambda r: -(r["open_max_seconds"] or 0.0))
    if not opened:
        return []
    lines = ["  Open at an interval's end, over the whole run (their time is split across intervals; count and "
             "percentiles wait for the end):"]
    for r in opened:
        where = r.get("open_where") or {}
        lines.append(f"    {r['span']} ({r['role']}): at {r['open_intervals']} interval end(s), longest "
                     f"{_g(r['open_max_seconds'], '.3g')} s (rank {where.get('rank', '-')} interval "
                     f"{where.get('interval', '-')}, {where.get('thread', '-')})"
                     + ("; still open when the log ends" if r.get("open_at_end") else ""))
    return lines


def _verdict(rep: dict) -> list:
    v = rep["verdict"]
    if not v.get("applies", True):   # a loop of its own: no target and drafter to weigh; its GPUs' activity
        return ["GPU activity (NVML and GPM)", *(f"  {e}" for e in v["evidence"])] if v["evidence"] else []
    over = "; ".join(f"{role}: {r['window']}, {r['wall_seconds']:.0f} s" for role, r in v["roles"].items())
    return [f"Verdict ({over or 'no intervals'}): {v['verdict'] or 'none'}", *(f"  {e}" for e in v["evidence"])]


def _bandwidth(rep: dict) -> list:
    rows = rep["bandwidth"]
    if not rows:
        return ["Bandwidth: no span declares bytes"]
    lines = ["Bandwidth over the whole run of spans that declare bytes (against the floors measured at start)",
             f"  {'span':<22} {'role':<8} {'GB':>9} {'GB/s':>9} {'floor':<12} {'floor GB/s':>10} {'ratio':>7} "
             f"{'s over floor':>12}"]
    for b in rows:
        fl = b["floor_bytes_per_s"]
        lines.append(f"  {b['span']:<22} {b['role']:<8} {b['bytes'] / 1e9:>9.3g} "
                     f"{_g(b['bandwidth_bytes_per_s'] and b['bandwidth_bytes_per_s'] / 1e9, '.3g'):>9} "
                     f"{str(b['floor'] or '-'):<12} {_g(fl and fl / 1e9, '.3g'):>10} {_pct(b['floor_ratio']):>7} "
                     f"{_g(b['seconds_over_floor'], '.3g'):>12}")
    return lines


def _memory(rep: dict) -> list:
    m = rep["memory"]
    if not m["measured"]:
        return [f"Memory headroom: {m['reason']}"]
    lines = ["Memory headroom per GPU over the whole run (low point = total minus an interval's peak used)"]
    for g in m["gpus"]:
        low = g["low_point"]
        when = f" at +{low['seconds_since_start']:.0f} s" if low["seconds_since_start"] is not None else ""
        lines.append(f"  gpu {g['gpu']} {g['name'] or ''}: low of {g['intervals']} interval records "
                     f"{low['headroom_bytes'] / GIB:.2f} GiB "
                     f"({_pct(low['headroom_ratio'])} of {g['total_bytes'] / GIB:.1f} GiB){when}, rank {low['rank']} "
                     f"interval {low['interval']} step {low['step']}, during {low['dominant_span']} (the interval's "
                     f"dominant span, {_pct(low['dominant_span_share'])}); "
                     f"last interval {g['last_headroom_bytes'] / GIB:.2f} GiB")
    for a in m["allocator"]:
        first, last = a["reserved_bytes_first"], a["reserved_bytes_last"]
        lines.append(f"  allocator rank {a['rank']} ({a['role']}), first -> last of {a['intervals']} intervals: "
                     f"retries {a['alloc_retries_first']} -> {a['alloc_retries_last']}, reserved "
                     f"{_g(first and first / GIB, '.2f')} -> {_g(last and last / GIB, '.2f')} GiB")
        lines += [_trend(t) for t in (a.get("trends") or {}).values() if t["samples"]]
    return lines


def _trend(t: dict) -> str:
    """One allocator series' trend after warm-up: slope, spread, samples, and the leak verdict with its why."""
    return (f"    {t['series'].replace('_bytes', '')}, {t['window']} (intervals {t['intervals'][0]}-{t['intervals'][1]},"
            f" {t['samples']} samples): Theil-Sen slope {t['slope_bytes_per_s'] * 60 / GIB:+.3g} GiB/min, residual "
            f"MAD {t['mad_bytes'] / GIB:.3g} GiB: {'leak' if t['leak'] else 'no leak'} ({t['why']})")


def _events(rep: dict) -> list:
    ev = rep["events"]
    if not ev["kinds"]:
        return ["Events: none"]
    lines = ["Events over the whole run"]
    for kind in ev["problems"]:
        k = ev["kinds"][kind]
        first = k["examples"][0] if k["examples"] else {}
        detail = ", ".join(f"{key} {val}" for key, val in first.items()
                           if key != "time_unix" and not isinstance(val, (dict, list)))
        lines.append(f"  {kind}: {k['count']} on rank(s) {', '.join(map(str, k['ranks']))}; first: {detail}")
    others = [f"{kind} {k['count']}" for kind, k in ev["kinds"].items() if kind not in ev["problems"]]
    if others:
        lines.append("  other: " + ", ".join(others))
    return lines


def _rings(rep: dict) -> list:
    """The transfer flight recorders' section (empty when no ring was dumped)."""
    rings = rep.get("transfer_rings") or {}
    if not rings.get("dumps"):
        return []
    lines = ["Transfer flight recorders (last protocol steps dumped at the failure)"]
    for d in rings["dumps"]:
        last = d["last"] or {}
        lines.append(f"  rank {d['rank']} ({d['role']}), {d['kind']} dump: {d['entries']} entries, last "
                     f"{last.get('kind', '-')} batch {last.get('batch', '-')} on {last.get('thread', '-')}")
    for link in rings["links"]:
        lines.append(f"  rank {link['target']} -> rank {link['drafter']}: submitted {link['submitted']}, completed "
                     f"{link['completed']}, received {link['received']}: {link['verdict']}")
    return lines


def _frames(rep: dict) -> list:
    hf = rep["hot_frames"]
    if hf["reason"]:
        return [f"Hot frames: {hf['reason']}"]
    lines = ["Hot frames per thread over the whole run (the training's threads; the profiler's own below)"]
    idle = [t for t in hf["threads"] if not t["top_frames"] and not t["snapshot_frames"] and not t["open_spans"]]
    for t in (t for t in hf["threads"] if t not in idle):
        seen = ([f"{t['stack_samples']} samples"] if t["stack_samples"] else []) + (
            [f"{t['snapshots']} snapshot(s), {t['stuck_snapshots']} stuck"] if t["snapshots"] else [])
        lines.append(f"  rank {t['rank']} {t['thread']} (tid {t['native_id']}): {', '.join(seen)}")
        lines.extend(f"    {_pct(f['share'])} {f['frame']}" for f in t["top_frames"])
        lines.extend(f"    snapshot x{f['count']}: {f['frame']}" for f in t["snapshot_frames"] if not t["top_frames"])
        if t["open_spans"]:
            lines.append("    open spans: " + ", ".join(f"{s.get('name')} {_g(s.get('open_seconds'), '.1f')} s"
                                                      for s in t["open_spans"]))
    if idle:
        lines.append("  no hot frame: " + ", ".join(f"rank {t['rank']} {t['thread']}" for t in idle))
    return lines + _profiler_frames(hf.get("profiler_threads") or [])


def _profiler_frames(threads: list) -> list:
    """The profiler's and its exporters' threads in one line each, apart: their hottest frame, if they ran."""
    if not threads:
        return []
    lines = ["  the profiler's own threads (profiler.*, exporters), apart from the training's:"]
    for t in threads:
        top = t["top_frames"][0] if t["top_frames"] else None
        lines.append(f"    rank {t['rank']} {t['thread']}: " + (f"{_pct(top['share'])} {top['frame']}" if top else
                                                                 "no hot frame (waiting)"))
    return lines


def _ranks(rep: dict) -> list:
    rt = rep["ranks"]
    lines = ["Ranks (each figure with the window it is over, named at the row's end: tokens/s the steady state's "
             "steady_tokens_per_s, or a loop of its own's interval rate; busy share and capacity (that window's "
             "tokens/s over the work share) over the rank's interval window; steps: the last interval's)",
             f"  {'rank':>4} {'role':<8} {'tokens/s':>9} {'busy':>6} {'capacity':>9} {'steps':>6} {'host':<12} "
             "status; windows"]
    for r in rt["ranks"]:
        lines.append(f"  {r['rank']:>4} {r['role']:<8} {_g(r['tokens_per_s'], ',.0f'):>9} "
                     f"{_pct(r['busy_share']):>6} {_g(r['capacity_tokens_per_s'], ',.0f'):>9} {_g(r['steps'], 'd'):>6} "
                     f"{str(r['host'] or '-'):<12} {r['status']}"
                     + (f", {r['bad_lines']} bad lines" if r["bad_lines"] else "") + "; " + rank_windows(r))
    lines += [f"  rank {r['rank']}: no steady tokens/s: {r['steady_reason']}"
              for r in rt["ranks"] if r["tokens_per_s"] is None and rep["pipeline"]]
    s = rt["straggler"]
    if s:
        lines.append(f"  straggler: rank {s['rank']} ({s['role']}) at {_pct(s['capacity_ratio'])} of its peers' "
                     f"median capacity" + (f"; most excess in {s['span']}" if s.get("span") else ""))
    else:
        lines.append(f"  straggler: none ({rt['reason'] or 'every rank within 20% of its peers'})")
    return lines


def _split(rep: dict) -> list:
    """Absent below two GPUs (a CPU run, ranks sharing one GPU, without --gpus N): the JSON says why."""
    s = rep["split"]
    if s["n_gpus"] < 2 or not rep["pipeline"]:
        return []
    if not s["best"]:
        return [f"Split: {s['reason']}"]
    t, d = s["roles"]["target"], s["roles"]["drafter"]
    lines = [f"Split of {s['n_gpus']} GPUs{' (--gpus)' if s.get('n_gpus_from') == '--gpus' else ''} "
             "(capacity = steady_tokens_per_s over the busy share of each rank's window, per GPU)",
             f"  capacity per GPU: target {t['capacity_tokens_per_s_per_gpu']:.4g}, drafter "
             f"{d['capacity_tokens_per_s_per_gpu']:.4g} tokens/s: {s['targets_per_drafter_to_balance']:.2f} targets "
             f"per drafter balance them",
             f"  best: {s['best']['target_gpus']}:{s['best']['drafter_gpus']} (target:drafter), predicted "
             f"{s['best']['predicted_tokens_per_s']:.4g} tokens/s"]
    if s["current"]:
        c = s["current"]
        lines.append(f"  this run: {c['target_gpus']}:{c['drafter_gpus']}, predicted "
                     f"{c['predicted_tokens_per_s']:.4g}, measured {_g(c['measured_tokens_per_s'])} tokens/s over the "
                     "steady state")
    lines.append("  every split: " + ", ".join(
        f"{x['target_gpus']}:{x['drafter_gpus']} {x['predicted_tokens_per_s']:.4g}" for x in s["splits"]))
    return lines


def _margin(rep: dict) -> list:
    m = rep["memory_margin"]
    if not rep["pipeline"]:   # batch-size advice in dflash-train's terms
        return []
    if m["max_tokens_per_batch"] is None:
        return [f"Memory margin: {m['reason']}"]
    lim = m["limited_by"]
    g = next(x for x in m["gpus"] if x["gpu"] == lim["gpu"])
    held = (f"batches held {m['mean_tokens_per_batch']:.0f} tokens on average over the whole run at --tokens-per-batch "
            f"{m['tokens_per_batch']}" if m["mean_tokens_per_batch"] else f"--tokens-per-batch {m['tokens_per_batch']}")
    return [f"Memory margin: batches of at most {m['max_tokens_per_batch']} tokens keep {_pct(m['headroom_share'])} "
            f"headroom on every GPU at the whole run's peaks ({held})",
            f"  limited by gpu {lim['gpu']} ({', '.join(lim['roles'])}, rank {', '.join(map(str, lim['ranks']))}): "
            f"{g['fixed_bytes'] / GIB:.2f} GiB fixed + {g['per_batch_bytes'] / GIB:.2f} GiB per batch (whole run), of "
            f"{g['total_bytes'] / GIB:.1f} GiB; per-batch bytes assumed {m['growth']}"]


def _forecast(rep: dict) -> list:
    """The memory forecast (profiler/report/memory_forecast.py): per setting the largest that fits, or why none."""
    fc = rep.get("memory_forecast") or {}
    if fc.get("reason") or not fc.get("settings"):
        return [f"Memory forecast: {fc.get('reason') or 'no setting scales the sizes of the steps'}"] if fc else []
    steps = sum(r["steps"] for r in fc["ranks"])
    lines = [f"Memory forecast ({_pct(fc['headroom_share'])} of every GPU kept free; from {steps} steps' allocator "
             f"peaks past warm-up, {len(fc['ranks'])} rank(s))"]
    for st in fc["settings"]:
        lim = st["limited_by"]
        where = (f"the steps need {st['need_bytes_at_current'] / GIB:.1f} of {st['limit_bytes'] / GIB:.1f} GiB usable "
                 f"on gpu {lim['gpu']}, rank {', '.join(map(str, lim['ranks']))}")
        cap = st.get("capped_by")
        if st["largest"] is None:
            head = f"x{st['scale']:.3g} the run's sizes"
        elif cap:
            alone = (f"memory alone allows {cap['memory_largest']:,}" if cap["memory_largest"] is not None
                     else f"not limited by memory within {MAX_SCALE:.0f}x {st['current']}")
            head = f"up to {st['largest']:,}, capped by {cap['flag']} {cap['value']:,} ({alone})"
        elif st["scale"] >= MAX_SCALE:
            head = f"not limited by memory within {MAX_SCALE:.0f}x {st['current']}"
        else:
            head = f"up to {st['largest']:,}"
        lines.append(f"  {st['flag']} {head} (now {st['current']}; {where})")
        for t in st["transient"]:
            lines.append(f"    binding: rank {t['rank']}'s warm-up step {t['step']} peaked {t['peak_bytes'] / GIB:.1f} "
                         f"GiB (compilation, autotune), above its steady steps: the forecast scales it")
    return lines


def _findings(rep: dict) -> list:
    if not rep["findings"]:
        return ["Findings: none"]
    lines = ["Findings"]
    for i, f in enumerate(rep["findings"], 1):
        lines += [f"  {i}. {f['summary']}", f"     evidence: {f['evidence']}", f"     next: {f['next']}"]
    return lines


def rank_windows(r: dict) -> str:
    """The end of a rank's row: the window of its tokens/s, then that of its busy share and capacity."""
    tokens = ("tokens/s over -" if r["tokens_per_s"] is None else
              f"tokens/s over {r['tokens_window']}, {r['tokens_window_seconds']:.1f} s")
    return f"{tokens}; busy, capacity over {r['window']}, {r['window_seconds']:.1f} s"


def _steady(rep: dict) -> list:
    """Each role's steady state (steady_tokens_per_s, dflash/throughput.py), with the phases left out."""
    st = rep.get("steady") or {}
    lines = ["Steady state (after warm-up; compile, evaluation and checkpoint time left out)"]
    for role, r in (st.get("roles") or {}).items():
        if r.get("intervals"):
            lines.append(_interval_rates(role, r["intervals"]))
            continue
        if r.get("steady_tokens_per_s") is None:
            lines.append(f"  {role}: - ({r.get('reason')})")
            continue
        phases = ", ".join(f"{n} {v:.1f} s" for n, v in (r.get("phases_seconds") or {}).items() if v > 0.05)
        segs = f", {r['segments']} segments" if r["segments"] > 1 else ""
        compute = compute_clause(r.get("steady_model_flops_per_s"), r.get("mfu") or {}, r.get("peaks") or {})
        lines.append(f"  {role}: {r['steady_tokens_per_s']:,.0f} tokens/s (steady_tokens_per_s, {r['ranks_measured']} "
                     f"rank(s){segs}, {r['steady_steps']} steps over {r['steady_seconds']:.1f} s)"
                     f"{'; ' + compute if compute else ''}; whole-run phases: "
                     f"{phases or 'none'}; warm-up {r.get('warmup_from', 'intervals')} {r['warmup_seconds']:.1f} s")
    return lines


def _interval_rates(role: str, ir: dict) -> str:
    """A loop without a throughput meter: its rates read from the interval records over its steady window."""
    return (f"  {role}: {_g(ir['tokens_per_s'], ',.0f')} tokens/s (sum over {ir['ranks']} rank(s)), "
            f"{_g(ir['steps_per_s'], '.3g')} steps/s (per rank) over {ir['window']}, {ir['seconds']:.1f} s "
            "(interval counters and set_step: a loop of its own has no throughput meter)")


def format_hotspots(rep: dict) -> str:
    """The whole report as text, findings last (where the eye lands)."""
    roles = ", ".join(f"{len(r['ranks'])} {role}" for role, r in rep["spans"]["roles"].items())
    head = [f"dflash-report hotspots {rep['run_dir']}" + (f"  (run {rep['run_id']})" if rep["run_id"] else ""),
            f"  ranks: {roles}; segments: {rep['segments']}"]
    if rep.get("empty_logs"):
        head.append(f"  {empty_logs_line(rep['empty_logs'])}")
    sections = [head, _steady(rep), _verdict(rep), _spans(rep), _bandwidth(rep), _memory(rep), _events(rep),
                format_numerics(rep),
                _rings(rep), _frames(rep), _ranks(rep), _split(rep), _margin(rep), _forecast(rep), _findings(rep)]
    return "\n\n".join("\n".join(s) for s in sections if s)


def _cmp_row(label: str, c: dict, scale: float, unit: str) -> str:
    a, b = c["a"], c["b"]

    def v(x):
        return "-" if x is None else f"{x * scale:.4g}"
    return (f"  {label:<32} {v(a['mean']):>10} {v(b['mean']):>10} {_pct(c['change_ratio']):>8} "
            f"{v(a['spread']):>9} {v(b['spread']):>9} {a['intervals']:>4} {b['intervals']:>4} {unit:<9} {c['verdict']}")


def _compare_windows(table: dict) -> list:
    """One line per role: the windows each run was sampled over (their count is the tokens/s row's n)."""
    per_role = table.get("role_windows") or {}
    if not per_role:
        return [f"  over A's {table['windows']['a']} and B's {table['windows']['b']}"]
    return [f"  {role}: A over {w['a'] or 'no ranks'}; B over {w['b'] or 'no ranks'}" for role, w in per_role.items()]


def format_compare(table: dict) -> str:
    """The A/B table: spans (mean per call), tokens/s per role, peak GPU memory; then the regressions."""
    head = (f"  {'':<32} {'A':>10} {'B':>10} {'change':>8} {'spread A':>9} {'spread B':>9} {'n A':>4} {'n B':>4} "
            f"{'unit':<9} verdict")
    lines = [f"dflash-report compare  A {table['a']}  B {table['b']}",
             "(A and B: means of one sample per window and rank, n of them (a span's: the windows it ran in, "
             "weighted by its calls), both runs over the same kind of window; spread: the samples' 10th-90th "
             "percentile range; a change is called only when it exceeds both runs' spread of the mean, spread / "
             "sqrt(n))",
             *_compare_windows(table), "", "Spans (mean per call)", head]
    lines += [_cmp_row(f"{r['span']} ({r['role']})", r, 1e3, "ms/call") for r in table["spans"]]
    lines += ["", "Tokens/s", head]
    lines += [_cmp_row(role, c, 1.0, "tokens/s") for role, c in table["tokens_per_s"].items()]
    mw = table.get("memory_windows") if table["memory"] else None
    lines += ["", "GPU memory (peak used" + (f"; A over {mw['a']}, B over {mw['b']}" if mw else "") + ")"]
    if table["memory"]:
        lines += [head] + [_cmp_row(f"gpu {gpu}", c, 1 / GIB, "GiB") for gpu, c in table["memory"].items()]
    else:
        lines.append(f"  {table['memory_reason']}")
    lines += ["", "Regressions: " + (", ".join(table["regressions"]) or "none")]
    return "\n".join(lines)
