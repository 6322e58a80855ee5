"""Static inline SVG charts for `dflash-report html` (profiler/report/html.py): lines and stacked step areas over
time, each value a hover tooltip (an SVG <title>), no script. Every string drawn is escaped here (a run log can hold
hostile text). Standard library only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from html import escape

WIDTH, HEIGHT = 980, 230
LEFT, RIGHT, TOP, BOTTOM = 72, 210, 12, 36   # margins: the legend sits in the right one
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94")
TOOLTIP_LAYERS = 12   # layers named in a stacked column's tooltip (largest first); the rest summed


def esc(value) -> str:
    """Text or attribute value, escaped (quotes too)."""
    return escape(str(value), quote=True)


def fmt(value) -> str:
    """A number as the charts print it ("-" for none)."""
    if value is None:
        return "-"
    return f"{value:,.0f}" if abs(value) >= 1e4 else f"{value:.4g}"


@dataclass
class Line:
    """One series: its label and (seconds since the run started, value or None) points in time order."""
    label: str
    seconds: list
    values: list
    dashed: bool = False


@dataclass
class Frame:
    """A chart's axes: x in seconds shown in `unit` (`per` seconds each), y from y_lo to y_hi."""
    x_hi_s: float
    y_lo: float
    y_hi: float
    per: float
    unit: str
    y_label: str
    hlines: list = field(default_factory=list)   # (label, y): dashed reference lines

    def x(self, seconds: float) -> float:
        return LEFT + (WIDTH - LEFT - RIGHT) * seconds / (self.x_hi_s or 1.0)

    def y(self, value: float) -> float:
        span = (self.y_hi - self.y_lo) or 1.0
        return TOP + (HEIGHT - TOP - BOTTOM) * (1.0 - (value - self.y_lo) / span)


def time_unit(last_s: float) -> tuple[str, float]:
    """(unit name, seconds per unit) that keeps a run's length readable."""
    return ("s", 1.0) if last_s < 600 else ("min", 60.0) if last_s < 5 * 3600 else ("h", 3600.0)


def nice_step(span: float, ticks: int = 4) -> float:
    """A 1-2-5 step that cuts `span` into about `ticks` parts."""
    raw = span / ticks if span > 0 else 1.0
    base = 10 ** math.floor(math.log10(raw))
    return next(m * base for m in (1, 2, 5, 10) if m * base >= raw)


def frame_for(values: list, x_hi_s: float, y_label: str, from_zero: bool = True, hlines=()) -> Frame:
    """The frame that holds `values` (numbers or None) and the reference lines, on 1-2-5 ticks."""
    seen = [v for v in values if v is not None] + [y for _, y in hlines]
    lo, hi = (min(seen, default=0.0), max(seen, default=1.0))
    lo = min(lo, 0.0) if from_zero else lo
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    step = nice_step(hi - lo)
    unit, per = time_unit(x_hi_s)
    return Frame(x_hi_s or 1.0, math.floor(lo / step) * step, math.ceil(hi / step) * step, per, unit, y_label,
                 list(hlines))


def _axes(f: Frame) -> list:
    """The plot area, y ticks with grid lines, x ticks, the axis labels."""
    out = [f'<rect x="{LEFT}" y="{TOP}" width="{WIDTH - LEFT - RIGHT}" height="{HEIGHT - TOP - BOTTOM}" '
           'class="area"/>']
    step = nice_step(f.y_hi - f.y_lo)
    for k in range(int(round((f.y_hi - f.y_lo) / step)) + 1):
        v = f.y_lo + k * step
        y = f.y(v)
        out.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>'
                   f'<text x="{LEFT - 4}" y="{y + 3:.1f}" class="tick" text-anchor="end">{esc(fmt(v))}</text>')
    x_step = nice_step(f.x_hi_s / f.per, 6)
    for k in range(int(f.x_hi_s / f.per / x_step) + 1):
        x = f.x(k * x_step * f.per)
        out.append(f'<text x="{x:.1f}" y="{HEIGHT - BOTTOM + 14}" class="tick" text-anchor="middle">'
                   f'{esc(fmt(k * x_step))}</text>')
    out.append(f'<text x="{(LEFT + WIDTH - RIGHT) / 2}" y="{HEIGHT - 4}" class="axis" text-anchor="middle">'
               f'{esc(f.unit)} since the run started</text>'
               f'<text x="12" y="{(TOP + HEIGHT - BOTTOM) / 2}" class="axis" text-anchor="middle" '
               f'transform="rotate(-90 12 {(TOP + HEIGHT - BOTTOM) / 2})">{esc(f.y_label)}</text>')
    for label, v in f.hlines:
        out.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{f.y(v):.1f}" y2="{f.y(v):.1f}" class="ref">'
                   f'<title>{esc(label)}: {esc(fmt(v))}</title></line>')
    return out


def _legend(labels: list) -> list:
    out = []
    for i, label in enumerate(labels[:18]):
        y = TOP + 10 + 12 * i
        out.append(f'<rect x="{WIDTH - RIGHT + 10}" y="{y - 8}" width="9" height="9" '
                   f'fill="{PALETTE[i % len(PALETTE)]}"/><text x="{WIDTH - RIGHT + 23}" y="{y}" class="legend">'
                   f'{esc(label[:34])}</text>')
    if len(labels) > 18:
        out.append(f'<text x="{WIDTH - RIGHT + 10}" y="{TOP + 10 + 12 * 18}" class="legend">'
                   f'... {len(labels) - 18} more</text>')
    return out


def _svg(title: str, parts: list) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" '
            f'height="{HEIGHT}" role="img"><title>{esc(title)}</title>' + "".join(parts) + "</svg>")


def line_chart(title: str, lines: list, f: Frame) -> str:
    """Each line a polyline (broken where a value is missing) with a dot per point whose tooltip says its time and
    value."""
    parts = _axes(f)
    for i, line in enumerate(lines):
        color = PALETTE[i % len(PALETTE)]
        runs, run = [], []
        for t, v in zip(line.seconds, line.values):
            if v is None:
                runs, run = runs + [run] if run else runs, []
                continue
            run.append((t, v))
        runs += [run] if run else []
        dash = ' stroke-dasharray="4 3"' if line.dashed else ""
        for r in runs:
            pts = " ".join(f"{f.x(t):.1f},{f.y(v):.1f}" for t, v in r)
            parts.append(f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="1.3"{dash}/>')
        parts += [f'<circle cx="{f.x(t):.1f}" cy="{f.y(v):.1f}" r="2" fill="{color}"><title>{esc(line.label)} at '
                  f'{esc(fmt(t / f.per))} {esc(f.unit)}: {esc(fmt(v))}</title></circle>' for r in runs for t, v in r]
    return _svg(title, parts + _legend([line.label for line in lines]))


def stacked_chart(title: str, edges_s: list, layers: list, f: Frame) -> str:
    """Layers ((label, [value per column]), bottom first) stacked as steps over columns [edges_s[k], edges_s[k+1]];
    each column's tooltip names its time and its layers' values, largest first."""
    parts, below = _axes(f), [0.0] * (len(edges_s) - 1)
    for i, (_, values) in enumerate(layers):
        top = [b + (v or 0.0) for b, v in zip(below, values)]
        fwd = "".join(f"L{f.x(edges_s[k]):.1f},{f.y(top[k]):.1f}L{f.x(edges_s[k + 1]):.1f},{f.y(top[k]):.1f}"
                      for k in range(len(top)))
        back = "".join(f"L{f.x(edges_s[k + 1]):.1f},{f.y(below[k]):.1f}L{f.x(edges_s[k]):.1f},{f.y(below[k]):.1f}"
                       for k in reversed(range(len(top))))
        parts.append(f'<path d="M{fwd[1:]}{back}Z" fill="{PALETTE[i % len(PALETTE)]}" stroke="none"/>')
        below = top
    for k in range(len(edges_s) - 1):
        named = sorted(((label, values[k] or 0.0) for label, values in layers), key=lambda lv: -lv[1])
        rest = sum(v for _, v in named[TOOLTIP_LAYERS:])
        lines = [f"{esc(label)}: {esc(fmt(v))}" for label, v in named[:TOOLTIP_LAYERS]] + \
            ([f"{len(named) - TOOLTIP_LAYERS} more: {esc(fmt(rest))}"] if rest else [])
        x0, x1 = f.x(edges_s[k]), f.x(edges_s[k + 1])
        parts.append(f'<rect x="{x0:.1f}" y="{TOP}" width="{max(x1 - x0, 0.5):.1f}" height="{HEIGHT - TOP - BOTTOM}" '
                     f'class="hover"><title>{esc(fmt(edges_s[k] / f.per))}-{esc(fmt(edges_s[k + 1] / f.per))} '
                     f'{esc(f.unit)}, total {esc(fmt(below[k]))} {esc(f.y_label)}&#10;' + "&#10;".join(lines)
                     + "</title></rect>")
    return _svg(title, parts + _legend([label for label, _ in layers]))
