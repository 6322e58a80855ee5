"""The sections of `dflash-report html`'s page (profiler/report/html.py), each from its part of `hotspots`' dict
(docs/REPORT.md) with the figures formatted as the text report formats them (profiler/report/report_text.py), and
every window and sample count named. Every string is escaped (`esc`) on its way into the page. Standard library only.
"""
from __future__ import annotations

import re

from profiler.report.html_svg import esc
from profiler.report.report_text import _g, _ms, _pct, rank_windows
from profiler.schema.windows import compute_clause

GIB = 1024 ** 3


_NUMBER = re.compile(r"[-+0-9.,%e ]*|-")


def table(head: list, rows: list, caption: str) -> str:
    """An HTML table, every cell escaped; numbers right-aligned, words left."""
    def cells(tag: str, row: list) -> str:
        return "".join(f'<{tag}{"" if _NUMBER.fullmatch(str(c)) else " class=l"}>{esc(c)}</{tag}>' for c in row)
    return (f"<table><caption>{esc(caption)}</caption><tr>{cells('th', head)}</tr>"
            + "".join(f"<tr>{cells('td', r)}</tr>" for r in rows) + "</table>")


def para(text: str, cls: str = "note") -> str:
    return f'<p class="{cls}">{esc(text)}</p>'


def items(lines: list) -> str:
    return "<ul>" + "".join(f"<li>{esc(x)}</li>" for x in lines) + "</ul>" if lines else ""


def steady(rep: dict) -> str:
    """Each role's steady state (steady_tokens_per_s), or a loop of its own's interval rates."""
    rows, loops = [], []
    for role, r in (rep["steady"].get("roles") or {}).items():
        ir = r.get("intervals")
        if ir:
            loops.append(f"{role}: {_g(ir['tokens_per_s'], ',.0f')} tokens/s (sum over {ir['ranks']} rank(s)), "
                         f"{_g(ir['steps_per_s'], '.3g')} steps/s (per rank) over {ir['window']}, "
                         f"{ir['seconds']:.1f} s (interval counters and set_step)")
            continue
        phases = ", ".join(f"{n} {v:.1f} s" for n, v in (r.get("phases_seconds") or {}).items() if v and v > 0.05)
        compute = compute_clause(r.get("steady_model_flops_per_s"), r.get("mfu") or {}, r.get("peaks") or {})
        rows.append([role, _g(r.get("steady_tokens_per_s"), ",.0f"), r.get("ranks_measured"), _g(r.get("steady_steps"), "d"),
                     _g(r.get("steady_seconds"), ".1f"), r.get("segments"), r.get("window"), compute or "-",
                     phases or "none", f"{r.get('warmup_from', 'intervals')} {_g(r.get('warmup_seconds'), '.1f')} s",
                     r.get("reason") or ""])
    head = ["role", "tokens/s", "ranks", "steps", "steady s", "segments", "window", "model FLOP/s, MFU",
            "whole-run phases", "warm-up", "reason"]
    return (para(f"drafters' steady_tokens_per_s: {_g(rep['steady_tokens_per_s'], ',.1f')} (after warm-up; "
                 "compile, evaluation and checkpoint time left out; the throughput meter's window)")
            + (table(head, rows, "per role: steady state (steps = samples)") if rows else "") + items(loops))


def verdict(rep: dict) -> str:
    v = rep["verdict"]
    rows = [[role, r.get("wait_span") or "-", _pct(r.get("wait_share")), _pct(r.get("busy_share")),
             _g(r.get("wall_seconds"), ".1f"), _g(r.get("tokens"), ",.0f"), r.get("window")]
            for role, r in (v.get("roles") or {}).items()]
    gpu = [[role, _g(g.get("util_percent_mean"), ".0f"), _g(g.get("sm_active_percent_mean"), ".0f"),
            _g(g.get("tensor_active_percent_mean"), ".0f"), _g(g.get("dram_active_percent_mean"), ".0f"),
            g.get("samples"), g.get("window"), g.get("bound") or "-"] for role, g in (v.get("gpu") or {}).items()]
    word = (v["verdict"] or "none") if v.get("applies", True) else "does not apply (a loop of its own)"
    return (f'<p><b>verdict: {esc(word)}</b></p>' + items(v.get("evidence") or [])
            + (table(["role", "wait span", "wait", "busy", "wall s", "tokens", "window"], rows,
                     "each role over its ranks' steady windows") if rows else "")
            + (table(["role", "util %", "SM active %", "tensor %", "DRAM %", "samples", "window", "bound"], gpu,
                     "NVML/GPM means over the role's window (samples: interval x GPU entries)") if gpu else ""))


def findings(rep: dict) -> str:
    if not rep["findings"]:
        return para("none")
    out = []
    for f in rep["findings"]:
        flags = " ".join(f"<code>{esc(x)}</code>" for x in f.get("flags") or [])
        out.append(f"<li><b>{esc(f['summary'])}</b> <span class=note>({esc(f['kind'])})</span>"
                   f"<div class=note>evidence: {esc(f['evidence'])}</div><div>next: {esc(f['next'])}</div>"
                   + (f"<div>flags: {flags}</div>" if flags else "") + "</li>")
    return "<ol>" + "".join(out) + "</ol>"


def spans(rep: dict) -> str:
    s = rep["spans"]
    on_gpu = any(r["gpu_window_seconds"] is not None for r in s["rows"])
    head = ["span", "role", "count", "on", "total s", "self s", "share", "cpu s", "GPU window s", "mean ms", "p50 ms",
            "p95 ms", "quantiles from", "wait"] + (["GPU", "busy"] if on_gpu else [])
    rows = [[r["span"], r["role"], r["count"], r["on"], _g(r["total_seconds"], ".3f"), _g(r.get("self_seconds"), ".3f"),
             _pct(r["share"]), _g(r["cpu_seconds"], ".3f"), _g(r["gpu_window_seconds"], ".3f"), _ms(r["mean_seconds"]),
             _ms(r["p50_seconds"]), _ms(r["p95_seconds"]), r["quantiles_from"], "wait" if r["wait"] else ""]
            + (_gpu_cells(r.get("gpu_bound")) if on_gpu else []) for r in s["rows"]]
    notes = [f"{role}: {len(r['ranks'])} rank(s), {r['wall_seconds']:.1f} s of intervals over the whole run"
             for role, r in s["roles"].items()]
    if s["spans_total"] > len(s["rows"]):
        notes.append(f"{s['spans_total'] - len(s['rows'])} more span(s) not shown (--top)")
    return (table(head, rows, "whole run, by total time; share of the role's whole-run time; count = the spans "
                              "(samples) of each row; on: the clock (gpu: its GPU window, cpu: host wall)")
            + items(notes))


def bandwidth(rep: dict) -> str:
    rows = [[b["span"], b["role"], _g(b["bytes"] / 1e9, ".3g"),
             _g(b["bandwidth_bytes_per_s"] and b["bandwidth_bytes_per_s"] / 1e9, ".3g"), b["floor"] or "-",
             _g(b["floor_bytes_per_s"] and b["floor_bytes_per_s"] / 1e9, ".3g"), _pct(b["floor_ratio"]),
             _g(b["seconds_over_floor"], ".3g")] for b in rep["bandwidth"]]
    if not rows:
        return para("no span declares bytes")
    return table(["span", "role", "GB", "GB/s", "floor", "floor GB/s", "ratio", "s over floor"], rows,
                 "whole run, spans that declare bytes, against the floors measured at start")


def _gpu_cells(g: dict | None) -> list:
    """A span row's GPU class and busy estimate, as the text's GPU and busy columns show them."""
    if not g:
        return ["-", "-"]
    return [g["class"], "-" if g["busy_share"] is None else f"{100 * g['busy_share']:.0f}%"]


def memory(rep: dict) -> str:
    m = rep["memory"]
    if not m["measured"]:
        return para(m["reason"])
    gpus = [[g["gpu"], g["name"] or "-", _g(g["total_bytes"] / GIB, ".1f"), g["intervals"],
             _g(g["used_bytes_peak"] / GIB, ".2f"), _g(g["low_point"]["headroom_bytes"] / GIB, ".2f"),
             _pct(g["low_point"]["headroom_ratio"]), _g(g["low_point"]["seconds_since_start"], ".0f"),
             f"rank {g['low_point']['rank']} interval {g['low_point']['interval']} step {g['low_point']['step']}",
             f"{g['low_point']['dominant_span']} ({_pct(g['low_point']['dominant_span_share'])})",
             _g(g["last_headroom_bytes"] / GIB, ".2f"),
             ", ".join(f"{k} {v}" for k, v in (g.get("throttle_intervals") or {}).items()) or "none"]
            for g in m["gpus"]]
    head = ["gpu", "name", "total GiB", "intervals", "peak used GiB", "low headroom GiB", "low %", "low at s",
            "low where", "dominant span then", "last GiB", "throttle (intervals)"]
    return (table(head, gpus, "per GPU over the whole run (NVML; low point = total minus an interval's peak used; "
                              "intervals = samples)") + _allocator(m["allocator"]))


def _allocator(rows: list) -> str:
    out = [[a["rank"], a["role"], a["intervals"], f"{a['alloc_retries_first']} -> {a['alloc_retries_last']}",
            a["ooms_last"], _g(a["reserved_bytes_first"] and a["reserved_bytes_first"] / GIB, ".2f"),
            _g(a["reserved_bytes_last"] and a["reserved_bytes_last"] / GIB, ".2f"),
            _g(a["reserved_bytes_peak"] and a["reserved_bytes_peak"] / GIB, ".2f")] for a in rows]
    trends = [f"rank {a['rank']} {t['series'].replace('_bytes', '')}, {t['window']} (intervals {t['intervals'][0]}-"
              f"{t['intervals'][1]}, {t['samples']} samples): Theil-Sen slope "
              f"{t['slope_bytes_per_s'] * 60 / GIB:+.3g} GiB/min, residual MAD {t['mad_bytes'] / GIB:.3g} GiB: "
              f"{'LEAK' if t['leak'] else 'no leak'} ({t['why']})"
              for a in rows for t in (a.get("trends") or {}).values() if t["samples"]]
    if not out:
        return ""
    return table(["rank", "role", "intervals", "alloc retries", "OOMs", "reserved first GiB", "last GiB", "peak GiB"],
                 out, "CUDA caching allocator per rank, first and last interval of the whole run") + items(trends)


def margin(rep: dict) -> str:
    m = rep["memory_margin"]
    if not rep["pipeline"]:
        return para("dflash-train's batch-size margin: does not apply to a loop of its own")
    if m["max_tokens_per_batch"] is None:
        return para(m["reason"])
    rows = [[g["gpu"], ", ".join(g["roles"]), _g(g["total_bytes"] / GIB, ".1f"), _g(g["fixed_bytes"] / GIB, ".2f"),
             _g(g["per_batch_bytes"] / GIB, ".2f"), _g(g["max_tokens_per_batch"], ",.0f")] for g in m["gpus"]]
    return (para(f"batches of at most {m['max_tokens_per_batch']} tokens keep {_pct(m['headroom_share'])} headroom on "
                 f"every GPU at the whole run's peaks (mean tokens per batch {_g(m['mean_tokens_per_batch'], '.0f')}, "
                 f"--tokens-per-batch {m['tokens_per_batch']}); per-batch bytes assumed {m['growth']}")
            + table(["gpu", "roles", "total GiB", "fixed GiB", "per batch GiB", "max tokens/batch"], rows,
                    "per GPU, whole run"))


def forecast(rep: dict) -> str:
    """The memory forecast (profiler/report/memory_forecast.py): per setting the largest that fits, or why none."""
    fc = rep.get("memory_forecast") or {}
    if fc.get("reason") or not fc.get("settings"):
        return para(fc.get("reason") or "no setting scales the sizes of the steps")
    rows = [[st["flag"], _g(st["current"], ",.0f"),
             (f"{st['largest']:,} (capped by {st['capped_by']['flag']})" if st.get("capped_by") else
              "not limited" if st["scale"] is not None and st["scale"] >= 1024 else _g(st["largest"], ",.0f")),
             st["limited_by"]["gpu"], _g(st["need_bytes_at_current"] / GIB, ".1f"), _g(st["limit_bytes"] / GIB, ".1f"),
             ", ".join(f"rank {t['rank']} step {t['step']}" for t in st["transient"]) or "-"] for st in fc["settings"]]
    steps = sum(r["steps"] for r in fc["ranks"])
    return (para(f"the largest setting that keeps {_pct(fc['headroom_share'])} of every GPU free, from {steps} steps' "
                 f"allocator peaks past warm-up ({len(fc['ranks'])} rank(s))")
            + table(["setting", "now", "largest", "limiting gpu", "need now GiB", "usable GiB", "binding warm-up peak"],
                    rows, "per setting, steps past warm-up"))


def events(rep: dict) -> str:
    ev = rep["events"]
    if not ev["kinds"]:
        return para("none over the whole run")
    rows = []
    for kind in ev["problems"]:
        k = ev["kinds"][kind]
        first = k["examples"][0] if k["examples"] else {}
        rows.append([kind, k["count"], ", ".join(map(str, k["ranks"])),
                     ", ".join(f"{key} {val}" for key, val in first.items()
                               if key != "time_unix" and not isinstance(val, (dict, list)))])
    others = ", ".join(f"{kind} {k['count']}" for kind, k in ev["kinds"].items() if kind not in ev["problems"])
    return ((table(["problem", "count", "ranks", "first"], rows, "events that mean trouble, whole run, most serious "
                                                                 "first") if rows else para("no problems"))
            + (para(f"other events over the whole run: {others}") if others else ""))


def ranks(rep: dict) -> str:
    rt = rep["ranks"]
    rows = [[r["rank"], r["role"], _g(r["tokens_per_s"], ",.0f"), _pct(r["busy_share"]),
             _g(r["capacity_tokens_per_s"], ",.0f"), _g(r["steps"], "d"), r["host"] or "-", r["status"],
             r["bad_lines"], _pct(r.get("profiler_share")), rank_windows(r)] for r in rt["ranks"]]
    s = rt["straggler"]
    line = (f"straggler: rank {s['rank']} ({s['role']}) at {_pct(s['capacity_ratio'])} of its peers' median "
            f"capacity" + (f"; most excess in {s['span']}" if s.get("span") else "") if s else
            f"straggler: none ({rt['reason'] or 'every rank within 20% of its peers'})")
    missing = [f"rank {r['rank']}: no steady tokens/s: {r['steady_reason']}" for r in rt["ranks"]
               if r["tokens_per_s"] is None and rep["pipeline"]]
    return (table(["rank", "role", "tokens/s", "busy", "capacity", "steps", "host", "status", "bad lines",
                   "profiler CPU", "windows"], rows, "per rank, each figure over the window named at the row's end") + items([line, *missing]))


def split(rep: dict) -> str:
    s = rep["split"]
    if s["n_gpus"] < 2 or not rep["pipeline"] or not s["best"]:
        return para(s["reason"] or "no split for this run")
    rows = [[f"{x['target_gpus']}:{x['drafter_gpus']}", _g(x["predicted_tokens_per_s"], ",.0f")] for x in s["splits"]]
    c = s["current"]
    return (para(f"{s['n_gpus']} GPUs ({s.get('n_gpus_from')}): best {s['best']['target_gpus']}:"
                 f"{s['best']['drafter_gpus']} (target:drafter), predicted "
                 f"{_g(s['best']['predicted_tokens_per_s'], ',.0f')} tokens/s"
                 + (f"; this run {c['target_gpus']}:{c['drafter_gpus']} predicted "
                    f"{_g(c['predicted_tokens_per_s'], ',.0f')}, measured {_g(c['measured_tokens_per_s'], ',.0f')} "
                    "tokens/s over the steady state" if c else ""))
            + table(["split", "predicted tokens/s"], rows, "every split (capacity = steady tokens/s over each rank's "
                                                           "busy share, per GPU)"))


def _cmp_rows(rows: list, scale: float, unit: str) -> list:
    def v(x):
        return "-" if x is None else f"{x * scale:.4g}"
    return [[label, v(c["a"]["mean"]), v(c["b"]["mean"]), _pct(c["change_ratio"]), v(c["a"]["spread"]),
             v(c["b"]["spread"]), c["a"]["intervals"], c["b"]["intervals"], unit, c["verdict"]] for label, c in rows]


def compare(t: dict) -> str:
    """The A/B table (profiler.report.compare): spans per call, tokens/s per role, peak GPU memory; regressions."""
    head = ["", "A", "B", "change", "spread A", "spread B", "n A", "n B", "unit", "verdict"]
    windows = [f"{role}: A over {w['a'] or 'no ranks'}; B over {w['b'] or 'no ranks'}"
               for role, w in (t.get("role_windows") or {}).items()] or \
        [f"over A's {t['windows']['a']} and B's {t['windows']['b']}"]
    mw = t.get("memory_windows") if t["memory"] else None
    mem = (table(head, _cmp_rows([(f"gpu {g}", c) for g, c in t["memory"].items()], 1 / GIB, "GiB"),
                 "GPU memory, peak used" + (f"; A over {mw['a']}, B over {mw['b']}" if mw else ""))
           if t["memory"] else para(f"GPU memory: {t['memory_reason']}"))
    return (para(f"A (baseline) {t['a']}; B {t['b']}. A and B: means of one sample per window and rank, n of them; "
                 "spread: the samples' 10th-90th percentile range; a change is called only beyond both runs' spread "
                 "of the mean (spread / sqrt(n))") + items(windows)
            + table(head, _cmp_rows([(f"{r['span']} ({r['role']})", r) for r in t["spans"]], 1e3, "ms/call"),
                    "spans, mean per call")
            + table(head, _cmp_rows(list(t["tokens_per_s"].items()), 1.0, "tokens/s"), "tokens/s per role")
            + mem + f'<p class="{"bad" if t["regressions"] else "note"}">Regressions: '
            + esc(", ".join(t["regressions"]) or "none") + "</p>")


def plots(figs: list) -> str:
    if not figs:
        return para("no interval records to plot")
    return (para("hover a point (or a column of a stacked plot) for its values; the run's time runs left to right")
            + "".join(f'<figure id="{esc(f["id"])}"><figcaption>{esc(f["title"])}</figcaption>{f["svg"]}</figure>'
                      for f in figs))


def links(link: dict) -> str:
    """The merged trace and the Kineto captures, by paths relative to the page."""
    trace = (f'<p>merged trace (Perfetto / chrome://tracing): <a href="{esc(link["trace"])}">{esc(link["trace"])}'
             "</a></p>" if link["trace"] else
             para(f"no merged trace at {link['trace_path']}: `dflash-report trace RUN_DIR` writes it"))
    caps = "".join(f'<li>capture at step {esc(step)}, rank {esc(rank)}: <a href="{esc(href)}">{esc(href)}</a></li>'
                   for step, rank, href in link["captures"])
    return trace + (f"<p>Kineto captures (`dflash-report kernels RUN_DIR --capture N` breaks one down):</p><ul>{caps}"
                    "</ul>" if caps else para("no Kineto captures under RUN_DIR/kineto"))


def body_sections(rep: dict, figs: list, table_ab: dict | None, link: dict) -> list:
    """(id, title, html) of each section, in the page's order (findings near the top: where the eye lands)."""
    out = [("steady", "Steady state", steady(rep)), ("verdict", "Verdict", verdict(rep)),
           ("findings", "Findings and next steps", findings(rep)), ("spans", "Spans", spans(rep)),
           ("plots", "Over time", plots(figs)), ("bandwidth", "Bandwidth", bandwidth(rep)),
           ("memory", "Memory and headroom", memory(rep)), ("margin", "Memory margin", margin(rep)),
           ("forecast", "Memory forecast", forecast(rep)),
           ("events", "Events", events(rep)), ("ranks", "Ranks", ranks(rep)), ("split", "GPU split", split(rep))]
    if table_ab:
        out.append(("compare", "Compare (A/B)", compare(table_ab)))
    return out + [("links", "Trace and captures", links(link))]
