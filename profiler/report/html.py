"""`dflash-report html RUN_DIR [-o FILE]`: one self-contained HTML page of what `hotspots` says (docs/REPORT.md):
the steady state, the verdict, the findings with their next steps, the span table, bandwidth, memory and headroom,
the ranks, the split, the A/B table with `--compare`, plots over time (profiler/report/html_series.py, drawn as
inline SVG), and relative links to the run's merged trace and Kineto captures. Every figure comes from
`hotspots_of`'s dict (the one `hotspots --json` prints), `compare`'s table or `plot.timeline`, never recomputed;
every string from the logs is escaped. No script, no network: styles inline, plots static SVG with tooltips.
Standard library only.
"""
from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import quote

from profiler.report.compare import compare as compare_runs
from profiler.report import hotspots_of
from profiler.report.findings import GENERIC, Advice
from profiler.report.html_series import figures
from profiler.report.html_sections import body_sections
from profiler.report.html_svg import esc
from profiler.report.kernels import captures_in
from profiler.report.plot import timeline
from profiler.report.report_text import format_compare, format_hotspots
from profiler.report.runs import ReportError, empty_logs_line, load_run, paused_gc, rank_paths

DEFAULT_NAME = "report.html"
STYLE = """
body{font:13px/1.4 system-ui,sans-serif;margin:16px 24px;color:#111;max-width:1400px}
h1{font-size:20px;margin:0 0 4px} h2{font-size:16px;margin:22px 0 6px;border-bottom:1px solid #ccc}
table{border-collapse:collapse;margin:4px 0 8px;font-size:12px} caption{text-align:left;color:#444;padding:2px 0}
th,td{border:1px solid #ddd;padding:2px 6px;text-align:right;vertical-align:top} th{background:#f3f3f3}
td.l,th.l{text-align:left} .note{color:#444;margin:2px 0} .bad{color:#b00;font-weight:600}
nav a{margin-right:10px} code{background:#f4f4f4;padding:0 3px} pre{font-size:11px;overflow-x:auto}
svg{display:block;margin:2px 0 14px} svg .area{fill:#fcfcfc;stroke:#999} svg .grid{stroke:#e6e6e6}
svg .ref{stroke:#c00;stroke-dasharray:5 4} svg .tick,svg .legend{font-size:10px} svg .axis{font-size:11px}
svg .hover{fill:transparent} svg .hover:hover{fill:rgba(0,0,0,.07)} figure{margin:0} figcaption{color:#333}
"""


def output_path(run_dir, out=None) -> Path:
    """Where the page goes (RUN_DIR/report.html by default), checked before any work: ReportError in one line when it
    cannot be written there."""
    path = Path(out) if out is not None else Path(run_dir) / DEFAULT_NAME
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise ReportError(f"cannot write {path}: it is a directory")
    if not parent.is_dir():
        raise ReportError(f"cannot write {path}: no directory {parent}")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ReportError(f"cannot write {path}: permission denied")
    return path


def links(run_dir, out: Path) -> dict:
    """{"trace": href or None, "trace_path", "captures": [(step, rank, href)]}: relative to the page's folder."""
    def href(p: Path) -> str:
        return quote(os.path.relpath(Path(p).resolve(), out.resolve().parent))
    trace = Path(run_dir) / "trace" / "merged.json"
    caps = [(step, rank, href(p)) for step, ranks in sorted(captures_in(run_dir).items())
            for rank, p in sorted(ranks.items())]
    return {"trace": href(trace) if trace.is_file() else None, "trace_path": str(trace), "captures": caps}


def render(rep: dict, figs: list, table: dict | None, link: dict) -> str:
    """The page from the report dict, its figures, the A/B table (or None) and the links."""
    text = format_hotspots(rep) + ("\n\n" + format_compare(table) if table else "")
    sections = body_sections(rep, figs, table, link) + [
        ("text", "The text report", f"<details><summary>dflash-report hotspots, as printed</summary><pre>"
                                    f"{esc(text)}</pre></details>")]
    nav = " ".join(f'<a href="#{sid}">{esc(title)}</a>' for sid, title, _ in sections)
    head = (f"<h1>dflash-report: {esc(rep['run_dir'])}</h1><p class=\"note\">run {esc(rep['run_id'] or '-')}, "
            f"log schema {esc(rep['log_schema'])}, report schema {esc(rep['report_schema'])}, segments "
            f"{esc(rep['segments'])}; ranks: " + esc(", ".join(f"{len(r['ranks'])} {role}" for role, r in
                                                              rep["spans"]["roles"].items())) + "</p>"
            + (f'<p class="note">{esc(empty_logs_line(rep["empty_logs"]))}</p>' if rep.get("empty_logs") else ""))
    body = "".join(f'<section id="{sid}"><h2>{esc(title)}</h2>{html}</section>' for sid, title, html in sections)
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'; "
            "img-src data:\">"
            f"<title>dflash-report {esc(rep['run_dir'])}</title><style>{STYLE}</style></head><body>{head}"
            f"<nav>{nav}</nav>{body}</body></html>\n")


def write_html(run_dir, out=None, top: int | None = None, n_gpus: int | None = None, advice: Advice = GENERIC,
               baseline_dir=None) -> dict:
    """Write the page of RUN_DIR (with the A/B table of baseline_dir against it); returns {out, bytes, figures}.
    ReportError for an unreadable run or an output that cannot be written (checked first)."""
    for d in (run_dir, baseline_dir):   # a missing or foreign run directory is named first
        if d is not None:
            rank_paths(d)
    path = output_path(run_dir, out)
    with paused_gc():
        run = load_run(run_dir)
        rep = hotspots_of(run, top, n_gpus, advice)
        figs = figures(run, timeline(run))
        table = None
        if baseline_dir is not None:
            same = Path(baseline_dir).resolve() == Path(run_dir).resolve()
            table = compare_runs(run if same else load_run(baseline_dir), run)
        del run
        page = render(rep, figs, table, links(run_dir, path))
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(page, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise ReportError(f"cannot write {path}: {e.strerror or e}") from None
    return {"out": str(path), "bytes": len(page.encode()), "figures": len(figs)}
