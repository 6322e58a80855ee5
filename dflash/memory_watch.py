"""The memory forecast while the run trains (issue #50): on rank 0 of a CUDA run, a thread reads the run's logs so
far through the report's own forecast (profiler/report/memory_forecast.py: the figure `dflash-report hotspots`
gives for the same logs), says it on the console once it first has a basis (every rank past its warm-up with
enough steps: the end of warm-up, in the trainer's terms), and writes it as a `memory_forecast` event each time it
is worked out, which every sink folds (Prometheus `dflash_memory_forecast_*`, the `DFlashMemoryHeadroomLow`
alert). The logs grow as the run goes on, so it is worked out at intervals that double once it has a basis (the
reads add up to a few times the log, not its square).
"""
from __future__ import annotations

import sys
import threading

import profiler

FIRST_TRIES = 8
"""Tries one interval apart before the forecast has a basis; then the waits double (as they do after it has one)."""


def event_fields(fc: dict) -> dict:
    """The `memory_forecast` event's fields (docs/RUNLOG.md) from the report's forecast."""
    return {"headroom_share": fc["headroom_share"], "reason": fc["reason"],
            "steps": sum(r["steps"] for r in fc["ranks"]),
            "settings": [{"flag": s["flag"], "current": s["current"], "largest": s["largest"], "scale": s["scale"],
                          "capped_by": s.get("capped_by"),
                          "need_bytes_at_current": s["need_bytes_at_current"], "limit_bytes": s["limit_bytes"],
                          "gpu": s["limited_by"]["gpu"], "ranks": s["limited_by"]["ranks"],
                          "transient_steps": [t["step"] for t in s["transient"]]} for s in fc["settings"]]}


def console_lines(fields: dict) -> list:
    """What rank 0 says when the forecast first has a basis: one line per setting."""
    lines = []
    for s in fields["settings"]:
        fits = fits_text(s)
        binding = f"; a warm-up transient binds (step {s['transient_steps'][0]})" if s["transient_steps"] else ""
        lines.append(f"dflash-train: memory forecast: {s['flag']} {fits} (now {s['current']}; "
                     f"{s['need_bytes_at_current'] / 2 ** 30:.1f} of {s['limit_bytes'] / 2 ** 30:.1f} GiB usable on "
                     f"gpu {s['gpu']}, {fields['steps']} steps past warm-up{binding}; dflash-report hotspots shows the "
                     f"basis)")
    return lines


def fits_text(s: dict) -> str:
    """What fits of one setting, in words: capped by another setting, not limited, or up to a value."""
    cap = s.get("capped_by")
    if cap:
        alone = (f"memory alone allows {cap['memory_largest']:,}" if cap["memory_largest"] is not None
                 else "memory does not limit it")
        return f"up to {s['largest']:,} fit (capped by {cap['flag']} {cap['value']:,}; {alone})"
    if s["largest"] is None or s["scale"] >= 1024:
        return "not limited by memory"
    return f"up to {s['largest']:,} fit"


class MemoryForecastWatch:
    """The thread (`profiler.memory_forecast`: the profiler's own for CPU accounting); `close()` ends it."""

    def __init__(self, run_dir, interval_s: float, forecast=None, err=None):
        self._run_dir, self._interval_s = run_dir, interval_s
        self._forecast = forecast or _forecast
        self._err = err or sys.stderr
        self._stop = threading.Event()
        self._said = False
        self._thread = threading.Thread(target=self._run, name="profiler.memory_forecast", daemon=True)

    def start(self) -> MemoryForecastWatch:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def _run(self) -> None:
        wait_s, tries = self._interval_s, 0
        while not self._stop.wait(wait_s):
            tries += 1
            try:
                fields = event_fields(self._forecast(self._run_dir))
            except Exception as e:   # noqa: BLE001 - the forecast never fails the run: one line, then it stops
                print(f"dflash-train: memory forecast: not available ({type(e).__name__}: {e})", file=self._err,
                      flush=True)
                return
            based = fields["reason"] is None and bool(fields["settings"])
            if based:
                profiler.event("memory_forecast", **fields)
                if not self._said:
                    self._said = True
                    print("\n".join(console_lines(fields)), file=self._err, flush=True)
            if based or tries >= FIRST_TRIES:
                wait_s *= 2


def _forecast(run_dir, second_core: bool = False) -> dict:
    """The report's forecast over the run's logs so far; a training rank reads them in its own process
    (second_core=False: never a child process from a rank with CUDA and threads)."""
    from profiler.report import load_run
    from profiler.report.memory_forecast import memory_forecast
    return memory_forecast(load_run(run_dir, second_core=second_core))


def live_fields(run_dir, forecast=None) -> dict:
    """`dflash-profile memory`'s forecast from another process: the `memory_forecast` event's fields over the
    run's logs so far (the figure hotspots gives for them), its `reason` saying why where there is no basis."""
    try:
        return {**event_fields((forecast or _forecast)(run_dir, second_core=True)), "error": None}
    except Exception as e:   # noqa: BLE001 - the snapshots are saved by now: a failing forecast is one line
        return {"headroom_share": None, "reason": None, "steps": 0, "settings": [],
                "error": f"{type(e).__name__}: {e}"}


def live_lines(fields: dict) -> list:
    """The forecast as `dflash-profile memory` prints it under the ranks' snapshots."""
    if fields.get("error"):
        return [f"memory forecast: not available ({fields['error']})"]
    if fields["reason"] is not None or not fields["settings"]:
        return [f"memory forecast: none yet: {fields['reason'] or 'no setting scales the sizes of the steps'}"]
    return [line.replace("dflash-train: ", "") for line in console_lines(fields)]


ROUND_TO = {"--tokens-per-batch": 256, "--max-length": 64, "--num-anchors": 8}
"""A recommended setting is the forecast's largest rounded down to a multiple of this."""


def plan_lines(run_dir, forecast=None) -> tuple[list, int]:
    """--plan-memory's answer from the plan run's logs: (lines, exit code): the forecast per setting and the flags
    it recommends, 0; or the one line saying why there is no forecast, 1."""
    fc = (forecast or _forecast)(run_dir)
    if fc["reason"] is not None or not fc["settings"]:
        return [f"memory plan: no forecast: {fc['reason'] or 'no setting scales the sizes of the steps'}"], 1
    fields = event_fields(fc)
    flags = []
    for s in fields["settings"]:
        if s["largest"] is not None and (s["scale"] < 1024 or s.get("capped_by")):
            step = ROUND_TO.get(s["flag"], 1)
            flags.append(f"{s['flag']} {max(step, s['largest'] // step * step)}")
    head = f"memory plan ({fields['steps']} steps past warm-up; {fc['headroom_share']:.0%} of every GPU kept free):"
    body = [line.replace("dflash-train: memory forecast: ", "  ") for line in console_lines(fields)]
    advice = (f"recommended, each alone (the others at their planned values): {'; '.join(flags)}" if flags
              else "recommended: no change (no setting is limited by memory)")
    return [head, *body, advice], 0


class NullWatch:
    """No forecast while training (not rank 0, a CPU run, --no-profile)."""

    def close(self) -> None:
        pass
