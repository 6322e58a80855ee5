"""Numerics early warning: statistics per stage, read back from the device without a host sync, and a detector
that warns before the first non-finite value. Standard library only (the device side is profiler/nonfinite.py's
`tensor_stats` and `NonfiniteMonitor.check_stats`).

A stage is a span and a tensor it produced (`target.pack_hidden` `layer3`, `drafter.fwd_bwd` `loss`). Each sampled
step gives one row per tensor, reduced on the device (STATS): the largest |x|, the 2-norm, how many |x| are within
NEAR_MAX_BINADES of the dtype's largest value, how many nonzero |x| are below its smallest normal value, and how
many values are NaN or Inf. The rows come back with the non-finite flags (one batch per collector poll, a step or
two late), so the detector looks at every sampled step, not only at interval close: a drift that overflows within
one 60 s interval is still seen over many samples.

The detector (`NumericsDetector`) keeps, per stage and statistic (log2 of absmax and of RMS), a robust baseline:
the median and MAD of the samples after the quiet steps (the trainer's warm-up and learning-rate warm-up, counted
from the segment's first sample, so a resume starts a new baseline), later samples joining it only while inside
its band. It warns once per stage when a statistic leaves the band in a way that precedes overflow:

- growth: GROWTH_SAMPLES samples in a row each above the one before, at least MIN_SLOPE_BINADES per step over
  them, the last ABOVE_SAMPLES above the band; the projected steps to overflow are the binades left to the dtype's largest value
  over that slope;
- near_range: the absmax within NEAR_MAX_BINADES of the dtype's largest value, or any value that close;
- square_range: for float32 and bf16, the absmax within NEAR_MAX_BINADES of the square root of float32's largest
  value, where a norm, a variance or an RMSNorm computing its square overflows (the two range rules need no
  baseline, and hold through the quiet steps: no healthy stage comes near);
- jump (stages checked with `jump=True`: the update-to-weight ratio): JUMP_SAMPLES samples in a row more than
  JUMP_FACTOR times the baseline median.

A loss falling fast, a learning-rate warm-up and a warm-up's noise neither grow for samples in a row nor sit above
a band built after them. The interval section (`section()`) sums each stage's samples of the interval.
"""
from __future__ import annotations

import collections
import math
import statistics
import threading

STATS = ("absmax", "norm", "near_overflow", "underflow", "nonfinite")
"""A tensor's row as the device reduces it (profiler/nonfinite.py tensor_stats), in order."""
NEAR_MAX_BINADES = 8
"""|x| within this many binades (powers of two) of the dtype's largest finite value counts as near overflow."""
SQUARE_LOG2_MAX = 128
"""log2 of float32's range, which norms, variances and RMSNorm square into (bf16 and float32 tensors alike): an
absmax within NEAR_MAX_BINADES of its square root (2^56, 7.2e16) is a square near overflow (`square_range`)."""
GROWTH_SAMPLES = 4          # samples in a row, each above the one before, for a growth warning
ABOVE_SAMPLES = 2           # ... the last of them this many above the band
MIN_SLOPE_BINADES = 0.25    # ... growing at least this many binades per step over them (x1.19 a step)
BASELINE_MIN = 5            # samples after the quiet steps before the band exists (no warning before)
BASELINE_MAX = 64           # in-band samples the baseline keeps (the newest)
BAND_MADS = 6.0             # the band: this many MADs (scaled to a normal's sigma) around the median ...
BAND_MIN_BINADES = 2.0      # ... but never narrower than this many binades (x4) either side
JUMP_FACTOR = 10.0          # a jump stage's sample this many times its baseline median ...
JUMP_SAMPLES = 2            # ... this many samples in a row
TREND_POINTS = 8            # (step, absmax) points an interval keeps per stage (thinned evenly)
HISTORY = 16                # samples a warning carries as its trend
PASSED = ("policy",)        # check fields a warning carries into its event
MAX_STAGES = 64             # stages the detector follows (more are counted in `ignored_stages`)


def log2(value) -> float | None:
    """log2 of a positive finite number, else None."""
    return math.log2(value) if isinstance(value, (int, float)) and 0 < value < math.inf else None


def dtype_limits(finfo_max: float, finfo_tiny: float) -> tuple[float, float]:
    """(near-overflow bound, underflow bound) of a dtype from its largest finite and smallest normal values."""
    return finfo_max * 2.0 ** -NEAR_MAX_BINADES, finfo_tiny


class Sample(collections.namedtuple("Sample", "step absmax rms near_fraction underflow_fraction nonfinite")):
    """One stage's statistics at one step (None: not a finite number)."""
    __slots__ = ()

    @classmethod
    def of(cls, step: int, row: list, count: int) -> "Sample":
        """From a device row (STATS order) of a tensor of `count` elements."""
        absmax, norm, near, under, bad = (float(v) for v in row)
        rms = norm / math.sqrt(count) if count and math.isfinite(norm) else None
        finite = absmax if math.isfinite(absmax) else None
        return cls(step, finite, rms, near / count if count else 0.0, under / count if count else 0.0, int(bad))


class Level:
    """One statistic of a stage in log2: its baseline (median and MAD of in-band samples after the quiet steps)
    and its last samples."""

    def __init__(self):
        self.base: collections.deque = collections.deque(maxlen=BASELINE_MAX)
        self.recent: collections.deque = collections.deque(maxlen=max(GROWTH_SAMPLES, JUMP_SAMPLES))
        self._band: tuple | None = None

    def band(self) -> tuple | None:
        """(median, half-width) in binades, once BASELINE_MIN samples are in; None before."""
        if self._band is None and len(self.base) >= BASELINE_MIN:
            med = statistics.median(self.base)
            mad = statistics.median(abs(b - med) for b in self.base)
            self._band = med, max(BAND_MADS * 1.4826 * mad, BAND_MIN_BINADES)
        return self._band

    def add(self, step: int, level: float, quiet: bool) -> None:
        """A sample; it joins the baseline after the quiet steps while the band is not made yet or holds it."""
        self.recent.append((step, level))
        if quiet:
            return
        band = self.band()
        if band is None or abs(level - band[0]) <= band[1]:
            self.base.append(level)
            self._band = None   # recomputed when read

    def growth(self) -> float | None:
        """Binades per step over the last GROWTH_SAMPLES samples when each is above the one before, the last
        ABOVE_SAMPLES above the band (one spike is not a trend), at MIN_SLOPE_BINADES or more; else None."""
        band, pts = self.band(), list(self.recent)[-GROWTH_SAMPLES:]
        if band is None or len(pts) < GROWTH_SAMPLES or any(
                level <= band[0] + band[1] for _, level in pts[-ABOVE_SAMPLES:]):
            return None
        if any(b[1] <= a[1] or b[0] <= a[0] for a, b in zip(pts, pts[1:])):
            return None
        slope = (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])
        return slope if slope >= MIN_SLOPE_BINADES else None

    def jumped(self) -> bool:
        """The last JUMP_SAMPLES samples are all more than JUMP_FACTOR times the baseline median."""
        band, pts = self.band(), list(self.recent)[-JUMP_SAMPLES:]
        return (band is not None and len(pts) == JUMP_SAMPLES
                and all(level > band[0] + math.log2(JUMP_FACTOR) for _, level in pts))


class Stage:
    """One span's tensor: its statistics' levels, its recent samples, and the interval's sums."""

    def __init__(self, span: str, tensor: str, dtype: str, log2_max: float, jump: bool):
        self.span, self.tensor, self.dtype, self.log2_max, self.jump = span, tensor, dtype, log2_max, jump
        self.levels = {"absmax": Level(), "rms": Level()}
        self.history: collections.deque = collections.deque(maxlen=HISTORY)
        self.warned = False
        self.first_nonfinite_step: int | None = None
        self._reset_interval()

    def _reset_interval(self) -> None:
        self.n, self.absmax_max, self.near_max, self.under_max, self.nonfinite = 0, None, 0.0, 0.0, 0
        self.last: Sample | None = None
        self.trend: list = []
        self._fit = [0, 0.0, 0.0, 0.0, 0.0]   # n, sum x, sum y, sum xy, sum xx of (step, log2 absmax)

    def observe(self, s: Sample, quiet: bool) -> dict | None:
        """Take a sample; the warning it raises (a dict of the event's fields), if any."""
        self._interval_add(s)
        self.history.append((s.step, s.absmax))
        if s.nonfinite:
            if self.first_nonfinite_step is None:
                self.first_nonfinite_step = s.step
            return None
        for name, value in (("absmax", s.absmax), ("rms", s.rms)):
            level = log2(value)
            if level is not None:
                self.levels[name].add(s.step, level, quiet)
        if self.warned or self.first_nonfinite_step is not None:
            return None
        found = self._range_rule(s) or (None if quiet else self._trend_rule(s))
        if found is not None:
            self.warned = True
        return found

    def _range_rule(self, s: Sample) -> dict | None:
        """near_range or square_range: a value no healthy stage has, so it needs no baseline and holds through the
        quiet steps too (a learning rate that blows the first update up does so inside its warm-up)."""
        level = log2(s.absmax)
        absmax = self.levels["absmax"]
        if level is not None and (level >= self.log2_max - NEAR_MAX_BINADES or s.near_fraction > 0):
            return self._warning(s, "absmax", "near_range", absmax, absmax.growth())
        if level is not None and self.log2_max >= SQUARE_LOG2_MAX - 1 and \
                level >= SQUARE_LOG2_MAX / 2 - NEAR_MAX_BINADES:
            return self._warning(s, "absmax", "square_range", absmax, absmax.growth())
        return None

    def _trend_rule(self, s: Sample) -> dict | None:
        """The first trend the stage's latest sample breaks against its baseline: jump, growth (absmax, then
        RMS)."""
        absmax = self.levels["absmax"]
        if self.jump and absmax.jumped():
            return self._warning(s, "absmax", "jump", absmax, None)
        for name in ("absmax", "rms"):
            slope = self.levels[name].growth()
            if slope is not None:
                return self._warning(s, name, "growth", self.levels[name], slope)
        return None

    def _warning(self, s: Sample, statistic: str, rule: str, level: Level, slope: float | None) -> dict:
        band = level.band()
        left = self.log2_max - (log2(s.absmax) or self.log2_max)
        return {"span": self.span, "tensor": self.tensor, "statistic": statistic, "rule": rule,
                "value": s.absmax if statistic == "absmax" else s.rms,
                "baseline": 2.0 ** band[0] if band else None,
                "growth_per_step": 2.0 ** slope if slope is not None else None,
                "steps_to_overflow": math.ceil(left / slope) if slope else None,
                "window": [level.recent[0][0], s.step], "dtype": self.dtype,
                "trend": [[step, v] for step, v in self.history]}

    def _interval_add(self, s: Sample) -> None:
        self.n += 1
        self.last = s
        self.nonfinite += s.nonfinite
        self.near_max = max(self.near_max, s.near_fraction)
        self.under_max = max(self.under_max, s.underflow_fraction)
        if s.absmax is not None:
            self.absmax_max = s.absmax if self.absmax_max is None else max(self.absmax_max, s.absmax)
        level = log2(s.absmax)
        if level is not None:
            f = self._fit
            f[0], f[1], f[2], f[3], f[4] = f[0] + 1, f[1] + s.step, f[2] + level, f[3] + s.step * level, f[4] + s.step ** 2
        self.trend.append([s.step, s.absmax if s.nonfinite == 0 else None])
        if len(self.trend) > 2 * TREND_POINTS:   # thinned evenly, the newest kept
            self.trend = self.trend[::-2][::-1]

    def interval_entry(self) -> dict:
        """The interval's figures of this stage (docs/RUNLOG.md `numerics`), then a fresh interval."""
        n, sx, sy, sxy, sxx = self._fit
        den = n * sxx - sx * sx
        slope = (n * sxy - sx * sy) / den if n >= 2 and den > 0 else None
        band = self.levels["absmax"].band()
        last = self.last
        trend = self.trend if len(self.trend) <= TREND_POINTS else self.trend[-TREND_POINTS:]
        out = {"span": self.span, "tensor": self.tensor, "dtype": self.dtype, "samples": self.n,
               "absmax_max": self.absmax_max, "absmax_last": last.absmax if last else None,
               "rms_last": last.rms if last else None, "near_overflow_fraction_max": self.near_max,
               "underflow_fraction_max": self.under_max, "nonfinite": self.nonfinite,
               "growth_per_step": 2.0 ** slope if slope is not None else None,
               "baseline_absmax": 2.0 ** band[0] if band else None,
               "headroom_binades": (self.log2_max - log2(self.absmax_max)) if log2(self.absmax_max) is not None
               else None, "first_nonfinite_step": self.first_nonfinite_step, "trend": trend}
        self._reset_interval()
        return out


class NumericsDetector:
    """The stages of one rank: `observe()` each read-back row (any thread), `on_warning(fields)` for a warning (the
    caller writes the `numerics_drift` event), `section()` the interval's `numerics` part. `quiet_steps`: steps from
    the first sample's on which nothing warns and the baselines are not built; `every`: the sampling cadence the
    section says."""

    def __init__(self, on_warning, quiet_steps: int = 0, every: int = 1):
        self._on_warning = on_warning
        self.quiet_steps, self.every = int(quiet_steps), int(every)
        self._stages: dict = {}
        self._lock = threading.Lock()
        self.first_step: int | None = None
        self.warnings = self._interval_warnings = 0
        self.ignored_stages = 0
        self.first: dict | None = None

    def observe(self, span: str, step: int, names: list, rows: list, meta: dict) -> None:
        """One check's rows (STATS order, one per name). `meta`: counts (elements per tensor), dtype, log2_max,
        jump."""
        warnings = []
        with self._lock:
            if self.first_step is None:
                self.first_step = step
            quiet = step < self.first_step + self.quiet_steps
            for name, row, count in zip(names, rows, meta["counts"]):
                stage = self._stage(span, name, meta)
                if stage is not None:
                    found = stage.observe(Sample.of(step, row, count), quiet)
                    if found is not None:
                        warnings.append({**found, "step": step, **{k: v for k, v in meta.items() if k in PASSED}})
            self.warnings += len(warnings)
            self._interval_warnings += len(warnings)
            if warnings and self.first is None:
                self.first = warnings[0]
        for w in warnings:
            self._on_warning(w)

    def _stage(self, span: str, name: str, meta: dict) -> Stage | None:
        key = (span, name)
        stage = self._stages.get(key)
        if stage is None:
            if len(self._stages) >= MAX_STAGES:
                self.ignored_stages += 1
                return None
            stage = self._stages[key] = Stage(span, name, meta["dtype"], meta["log2_max"], meta.get("jump", False))
        return stage

    def section(self, duration_s: float = 0.0) -> dict:
        """The interval record's `numerics` part: the cadence, the interval's warnings and one entry per stage
        sampled in it (docs/RUNLOG.md); {} when nothing was ever sampled."""
        with self._lock:
            if not self._stages:
                return {}
            stages = {f"{s.span}/{s.tensor}": s.interval_entry() for s in self._stages.values() if s.n}
            out = {"every": self.every, "warnings": self._interval_warnings, "warnings_total": self.warnings,
                   "stages": stages}
            if self.ignored_stages:
                out["ignored_stages"] = self.ignored_stages
            self._interval_warnings = 0
        return {"numerics": out}


def _g(v) -> str:
    return "-" if v is None else f"{v:.4g}"


def drift_line(w: dict, rank: int, role: str) -> str:
    """A warning (the `numerics_drift` event's fields) as one console line: the stage, the statistic against its
    baseline, the growth over the steps read, the projected steps to overflow and the policy."""
    first, last = (w.get("window") or [w["step"], w["step"]])[:2]
    trend = {"growth": f"grows x{_g(w.get('growth_per_step'))} a step over steps {first}-{last}",
             "near_range": f"within 2^{NEAR_MAX_BINADES} of the {w.get('dtype')} range",
             "square_range": f"within 2^{NEAR_MAX_BINADES} of sqrt(float32 max): its square overflows",
             "jump": f"over {JUMP_FACTOR:g}x its baseline at steps {first}-{last}"}[w["rule"]]
    left = (f"; overflow ({w.get('dtype')}) in ~{w['steps_to_overflow']} steps"
            if w.get("steps_to_overflow") is not None else "")
    return (f"numerics drift: rank {rank} ({role}) step {w['step']}: {w['span']} {w['tensor']} {w['statistic']} "
            f"{_g(w.get('value'))} (baseline {_g(w.get('baseline'))}) {trend}{left}; no non-finite value yet "
            f"(--on-numerics-drift {w.get('policy') or 'warn'})")
