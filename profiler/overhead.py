"""`dflash-profile overhead`: what profiling costs a live run, measured inside it.

Whole-run on/off pairs spread too much on a shared host to resolve 1% (bench/RESULTS.md), so this
alternates profiled ("on") and paused ("off": the training threads run --no-profile's code,
profiler/pause.py) phases inside one run, on every live rank at once, in ABBA order (on/off, off/on,
...) so a drift hits both arms alike. A phase: switch every rank, wait `settle_s` for the pipeline's
queues to reach the new state, read rank 0's step and the time it was set (the endpoint's
`progress`), wait `measure_s`, read again. The phase's rate is rank 0's steps over the time between
those two step starts: the run's own clock, so neither the socket's latency nor this process's
sleeps enter it. The statistics are bench/ab_profile.py's (profiler/abstats.py): per pair the ratio
on/off, the geometric mean difference with a 95% paired t interval, "resolves 1%" and "within 1%".

`part` (profiler/pause.py) pauses one part of the profiler only in the off phases: `inline` (the training
threads' spans, counters and checks) or `background` (collector, interval clock, samplers), so the
difference is what that part costs; `all` (the default) is --no-profile's path. `none` pauses nothing: both
arms profile, so the difference is the measurement's own bias (an A/A run), expected zero within its interval.

What differs from --no-profile in an off phase of `all`: the profiler's idle threads exist (its collector
wakes 4 times a second to watch the pause's lease), each step sets the step (a method call), and the
memory the profiler holds stays held. Pauses are leases the client renews: if this process dies, the
run profiles again within `lease_s`. Every exit path resumes every rank.

Standard library only (the CLI starts without torch).
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from profiler.abstats import arm_stats, paired_stats, verdicts
from profiler.control import default_discovery_dir, discover, query
from profiler.pause import max_lease_s
from profiler.snapshot import NO_LIVE_RANK, SnapshotError, check_pid, require_live_ranks
from profiler.taskcpu import NullTaskCpu

NULL_PROBE = NullTaskCpu()

MIN_STEPS_PER_PHASE = 3
# The fields of a `profile_overhead` event (brief()); the endpoint keeps these and no others.
SUMMARY_FIELDS = ("part", "pairs", "measure_s", "settle_s", "metric", "on_mean", "off_mean", "mean_diff_pct",
                  "ci_low_pct", "ci_high_pct", "half_width_pct", "resolves", "within", "threshold_pct", "stopped")
LEASE_MARGIN_S = 10.0
PAUSED_LABELS = {"all": "paused (--no-profile's path)", "inline": "inline paused (background on)",
                 "background": "background paused (inline on)", "gpu": "GPU timing paused (CPU spans)",
                 "none": "paused nothing (A/A)"}


class OverheadError(RuntimeError):
    """The measurement cannot start or go on (one line; the CLI exits 2 before any phase, 1 after)."""

    def __init__(self, message: str, started: bool = False):
        super().__init__(message)
        self.started = started


@dataclass
class Phase:
    arm: str
    """"on" (profiled) or "off" (paused)."""
    steps: int
    """Rank 0's steps begun between the phase's two readings."""
    seconds: float
    """Time between the first and the last of those step starts (the run's clock)."""
    steps_per_s: float
    """steps / seconds."""


class RunEndpoints:
    """The control endpoints of one run's live ranks; rank 0's `progress` is the meter."""

    def __init__(self, records: list[dict], owner: str, lease_s: float, query_fn=query, timeout_s: float = 5.0,
                 part: str = "all"):
        self.records, self.owner, self.lease_s, self.part = records, owner, lease_s, part
        self._query, self.timeout_s = query_fn, timeout_s
        self.meter = next((r for r in records if r.get("rank") == 0), None)

    def _ask(self, record: dict, cmd: str, **args) -> dict:
        reply = self._query(record["socket_path"], cmd, timeout_s=self.timeout_s, **args)
        if not reply.get("ok"):
            raise OverheadError(f"rank {record.get('rank')} (pid {record['pid']}): {cmd}: {reply.get('error')}")
        return reply

    def check(self) -> None:
        """Every rank answers `progress` and nobody else has paused it (before any phase)."""
        if self.meter is None:
            ranks = sorted(r.get("rank") for r in self.records)
            raise OverheadError(f"rank 0 (the drafter whose steps are the meter) is not among the live ranks {ranks}")
        for record in self.records:
            reply = self._ask(record, "progress")
            if reply.get("paused_by") not in (None, self.owner):
                raise OverheadError(f"rank {record.get('rank')} is paused by {reply['paused_by']}")

    def switch(self, arm: str) -> None:
        for record in self.records:
            if arm == "off":
                self._ask(record, "pause", owner=self.owner, lease_s=self.lease_s, part=self.part)
            else:
                self._ask(record, "resume", owner=self.owner)

    def resume_all(self) -> list[str]:
        """Resume every rank that answers; the ones that did not, as text (never raises)."""
        failed = []
        for record in self.records:
            reply = self._query(record["socket_path"], "resume", timeout_s=self.timeout_s, owner=self.owner)
            if not reply.get("ok"):
                failed.append(f"rank {record.get('rank')}: {reply.get('error')}")
        return failed

    def note(self, summary: dict) -> str | None:
        """Record the summary as a `profile_overhead` event in rank 0's run log; None, or why not."""
        reply = self._query(self.meter["socket_path"], "overhead_result", timeout_s=self.timeout_s, result=summary)
        return None if reply.get("ok") else str(reply.get("error"))

    def thread_names(self) -> dict:
        """{(rank, native thread id): Python thread name} of every rank that answers `threads` (else none)."""
        names = {}
        for record in self.records:
            reply = self._query(record["socket_path"], "threads", timeout_s=self.timeout_s)
            threads = reply.get("threads") if reply.get("ok") else None
            for name, tid in threads or ():
                names[(record.get("rank"), tid)] = name
        return names

    def progress(self) -> tuple[int, float | None]:
        reply = self._ask(self.meter, "progress")
        return reply["step"], reply.get("step_time_unix")


def lease_for(part: str, settle_s: float, measure_s: float) -> float:
    """The lease each pause takes: two phases and a margin (a renewal comes every other phase at most);
    OverheadError when that passes what a pause of `part` may hold."""
    lease_s = 2 * (settle_s + measure_s) + LEASE_MARGIN_S
    cap = max_lease_s(part)
    if lease_s > cap:
        raise OverheadError(f"--phase-s {measure_s:g} and --settle-s {settle_s:g} need a pause of {lease_s:g} s, "
                            f"more than a pause of part {part!r} may last ({cap:g} s: 2 x (phase + settle) + "
                            f"{LEASE_MARGIN_S:g} must be at most that)")
    return lease_s


def check_budget(max_s: float | None, settle_s: float, measure_s: float) -> None:
    """OverheadError when a time budget cannot hold the two pairs a result needs (4 phases and their settles)."""
    need_s = 4 * (settle_s + measure_s)
    if max_s is not None and max_s < need_s:
        raise OverheadError(f"--max-s {max_s:g} is shorter than the two pairs a result needs "
                            f"(4 x (phase + settle) = {need_s:g} s)")


def find_run(pid: int | None, run_dir, discovery_dir=None) -> tuple[str, list[dict]]:
    """(run dir, its live ranks' discovery records) from a pid of any rank, or from the run dir."""
    directory = discovery_dir if discovery_dir is not None else default_discovery_dir()
    if pid is not None:
        check_pid(pid)
        try:
            record = discover(pid, directory)
        except ValueError as exc:
            raise SnapshotError(NO_LIVE_RANK, str(exc)) from None
        if record is None:
            raise SnapshotError(NO_LIVE_RANK, f"pid {pid} has no control endpoint (no discovery file in {directory}: "
                                              "not a profiled dflash-train rank, or run with --no-profile)")
        run_dir = record["run_dir"]
    return str(Path(run_dir).resolve()), require_live_ranks(run_dir, directory)


def measure_phase(endpoints: RunEndpoints, arm: str, settle_s: float, measure_s: float, sleep=time.sleep,
                  probe=NULL_PROBE) -> Phase:
    """One phase (module doc); OverheadError when rank 0 began too few steps in it to time. `probe` reads the
    ranks' threads' CPU right after each progress reading (profiler/taskcpu.py)."""
    endpoints.switch(arm)
    sleep(settle_s)
    step_a, t_a = endpoints.progress()
    cpu_a = probe.read()
    sleep(measure_s)
    step_b, t_b = endpoints.progress()
    cpu_b = probe.read()
    steps = step_b - step_a
    if steps < MIN_STEPS_PER_PHASE or t_a is None or t_b is None or t_b <= t_a:
        raise OverheadError(f"an {arm} phase of {measure_s:g} s saw {steps} steps of rank 0 (fewer than "
                            f"{MIN_STEPS_PER_PHASE}): the run is stalled, ending, or its steps are too long "
                            "for this --phase-s", started=True)
    probe.add(arm, cpu_a, cpu_b, steps)
    return Phase(arm, steps, t_b - t_a, steps / (t_b - t_a))


def measure(endpoints: RunEndpoints, pairs: int, settle_s: float, measure_s: float, sleep=time.sleep,
            clock=time.time, on_phase=None, probe=NULL_PROBE, max_s: float | None = None,
            stop_requested=lambda: None) -> dict:
    """Alternate `pairs` on/off pairs (ABBA) and summarise; every rank is resumed on the way out. A run
    that ends or stalls after two whole pairs gives the pairs it completed (`stopped` says why). So does
    `max_s` (no pair is begun that would end past it: a time budget) and `stop_requested()` (returns why
    to stop, e.g. a signal, or None; read before each phase). With a `probe` (TaskCpu), `threads_cpu` says
    per thread what a step cost in each arm."""
    endpoints.check()
    phases: list[Phase] = []
    stopped, t0 = None, clock()
    try:
        for i in range(pairs):
            stopped = _budget_spent(i, clock() - t0, max_s)
            for arm in (("on", "off") if i % 2 == 0 else ("off", "on")):
                stopped = stopped or stop_requested()
                if stopped:
                    break
                phases.append(measure_phase(endpoints, arm, settle_s, measure_s, sleep, probe))
                if on_phase is not None:
                    on_phase(len(phases) - 1, phases[-1])
            if stopped:
                break
    except OverheadError as exc:
        stopped = str(exc)
    finally:
        failed = endpoints.resume_all()
    if stopped and len(phases) < 4:   # fewer than two whole pairs: no result
        raise OverheadError(stopped, started=bool(phases))
    phases = phases[:len(phases) // 2 * 2]   # whole pairs only
    result = summarise(phases, stopped, failed, {"part": endpoints.part, "pairs_asked": pairs, "settle_s": settle_s,
                                                 "measure_s": measure_s, "seconds": clock() - t0})
    if probe is not NULL_PROBE:
        result["threads_cpu"] = probe.summary(_names_or_none(endpoints))
    why = endpoints.note(brief(result))
    result["recorded"] = why is None
    if why is not None:
        result["not_recorded_because"] = why
    return result


def _budget_spent(pairs_done: int, elapsed_s: float, max_s: float | None) -> str | None:
    """Why pair `pairs_done + 1` is not begun under the time budget `max_s`, or None (no budget, it fits at
    the mean pace of the pairs done, or fewer than two are done: a result needs two, whatever the budget)."""
    if max_s is None or pairs_done < 2 or elapsed_s + elapsed_s / pairs_done <= max_s:
        return None
    return f"time budget of {max_s:g} s reached after {pairs_done} pairs"


def _names_or_none(endpoints) -> dict:
    """The Python names of the ranks' threads, or {} when a rank cannot say (the kernel's names serve)."""
    try:
        return endpoints.thread_names()
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def brief(result: dict) -> dict:
    """The scalar summary that goes into the run log (a `profile_overhead` event: docs/RUNLOG.md)."""
    p, v = result["paired"], result["verdicts"]
    return {"part": result["part"], "pairs": result["pairs"], "measure_s": result["measure_s"],
            "settle_s": result["settle_s"],
            "metric": result["metric"], "on_mean": result["on"]["mean"], "off_mean": result["off"]["mean"],
            "mean_diff_pct": p["mean_diff_pct"], "ci_low_pct": p["ci_low_pct"], "ci_high_pct": p["ci_high_pct"],
            "half_width_pct": p["half_width_pct"], "resolves": v["resolves"], "within": v["within"],
            "threshold_pct": v["threshold_pct"], "stopped": result["stopped"]}


def summarise(phases: list[Phase], stopped, resume_failed: list, settings: dict) -> dict:
    """The JSON result: settings, phases, each arm's rates, the paired statistics and the verdicts."""
    on = [p.steps_per_s for p in phases if p.arm == "on"]
    off = [p.steps_per_s for p in phases if p.arm == "off"]
    paired = paired_stats(on, off)
    return {**settings, "pairs": len(on), "stopped": stopped, "resume_failed": resume_failed,
            "metric": "rank 0 steps/s", "phases": [asdict(p) for p in phases],
            "on": arm_stats(on), "off": arm_stats(off), "paired": paired, "verdicts": verdicts(paired),
            "steps_per_phase": statistics.fmean(p.steps for p in phases) if phases else None}


def owner_name() -> str:
    return f"dflash-profile overhead (pid {os.getpid()})"


def format_result(result: dict) -> str:
    """The human table: each arm, the paired difference and the verdicts."""
    lines = [f"dflash-profile overhead: {result.get('run_dir', '?')} ({result.get('ranks', '?')} ranks): "
             f"{result['pairs']} on/off pairs of {result['measure_s']:g} s phases ({result['settle_s']:g} s settle "
             f"each), {result['seconds']:.0f} s, {result['steps_per_phase']:.0f} steps per phase; metric: "
             f"{result['metric']}" + (f"; off phases pause the {result['part']} part only"
                                 if result.get("part", "all") != "all" else "")]
    paused = PAUSED_LABELS[result.get("part", "all")]
    for arm, label in (("on", "profiled"), ("off", paused)):
        s = result[arm]
        cv = f"{100 * s['cv']:.1f}%" if s["cv"] is not None else "-"
        lines.append(f"  {arm:<3} {label:<30} mean {s['mean']:.2f}  median {s['median']:.2f}  CV {cv}")
    p, v = result["paired"], result["verdicts"]
    ci = (f" (95% CI {p['ci_low_pct']:+.2f} .. {p['ci_high_pct']:+.2f}%, half-width {p['half_width_pct']:.2f}%)"
          if p["ci_low_pct"] is not None else "")
    lines.append(f"  on vs off: {p['mean_diff_pct']:+.2f}%{ci}")
    lines.append(f"  resolves {v['threshold_pct']:g}%: {'yes' if v['resolves'] else 'no'}; "
                 f"on within {v['threshold_pct']:g}% of off: {v['within']}")
    if result["stopped"]:
        lines.append(f"  stopped early: {result['stopped']}")
    if not result.get("recorded", True):
        lines.append(f"  not recorded in rank 0's run log: {result.get('not_recorded_because')}")
    for failure in result["resume_failed"]:
        lines.append(f"  NOT RESUMED (its lease ends it): {failure}")
    return "\n".join(lines + _thread_lines(result.get("threads_cpu")))


def _thread_lines(threads_cpu: dict | None, top: int = 12) -> list:
    """The per-thread table: CPU per rank-0 step and busy share in each arm, the `top` largest differences."""
    rows = ((threads_cpu or {}).get("threads") or [])[:top]
    if not rows:
        return []
    lines = ["  CPU per rank-0 step (us; /proc schedstat) and busy share (CPU / wall), largest on-off difference "
             "first;", "  a thread busy as often in both arms did the same work slower, not more of it:",
             f"    {'rank':>4} {'thread':<28} {'on':>9} {'off':>9} {'on-off':>9} {'wait on':>9} {'wait off':>9} "
             f"{'busy on':>8} {'busy off':>8}"]
    for r in rows:
        lines.append(f"    {str(r['rank']):>4} {str(r['name'])[:28]:<28} {r['on_cpu_us']:>9.1f} {r['off_cpu_us']:>9.1f} "
                     f"{r['diff_cpu_us']:>+9.1f} {r['on_wait_us']:>9.1f} {r['off_wait_us']:>9.1f} "
                     f"{_pct(r.get('on_busy_pct')):>8} {_pct(r.get('off_busy_pct')):>8}")
    return lines


def _pct(value) -> str:
    """A busy share for the table: '69.8%', or '-' where none was measured."""
    return f"{value:.1f}%" if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"
