"""`dflash-profile top`: a live terminal view of a run's ranks, refreshed from their control endpoints. Standard
library only (curses for the live view).

Each refresh asks every rank for its `state` at once (one thread each, each request with its own timeout, so a rank
that does not answer never holds the view). Per rank: its step; tokens/s and steps/s and its busiest span over the
rank's own tick window (the ticks its endpoint served, kept by top until they span `window_s`: the WIN column
says how long the window is); its open spans with their ages, judged by `dflash-profile snapshot`'s stuck rule;
its GPU's busy percent and memory from NVML's latest sample (CPU ranks: "-"). The bound stage is the role whose
ranks wait least over their windows (the wait spans come from the caller's span table). A rank whose process ended
shows as ended, with its run_end status where its log has one; one that stops answering shows the age of its last
answer. `build_frame` is a pure function of what was polled (RankView): the live view and `--once` print it.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from profiler.schema import views, windows
from profiler.clients.capture_client import CaptureError, ranks_of
from profiler.control import default_discovery_dir, pid_alive, query
from profiler.schema.records import parse_line, printable
from profiler.clients.snapshot import interval_p95_seconds, judge_span, live_ranks, rate_text

DEFAULT_INTERVAL_S = 2.0
INTERVAL_RANGE_S = (0.2, 3600.0)
WINDOW_S = 10.0
"""How far back the rates and busy shares reach: the newest tick and the latest one at least this much older."""
WINDOW_RANGE_S = (1.0, 86400.0)
QUERY_TIMEOUT_S = 1.0
"""Each request's limit (or the refresh interval where shorter): a rank that does not answer costs no more."""
LOG_TAIL_BYTES = 1 << 20
"""How much of an ended rank's run log is read for its run_end (its last record)."""
MAX_POLL_THREADS = 32
BOUND_MARGIN = 0.05
"""The least-waiting role bounds the pipeline only when it waits this much less (a share of WIN) than the next:
two roles stalled outside their wait spans both read 0%."""
SORTS = ("rank", "step", "tok/s", "state")
"""The sort columns `s` cycles through: rank (low first), step (laggards first), tok/s (high first), state
(stuck and silent ranks first, ended last)."""


class TopError(ValueError):
    """Nothing to show (bad --interval, no such pid, no live rank): one line, the CLI exits 2."""


def check_seconds(flag: str, value, bounds: tuple) -> float:
    """`value` as seconds within `bounds`, else TopError naming the flag."""
    low, high = bounds
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise TopError(f"{flag} must be a number of seconds from {low:g} to {high:g}, got {value!r}")
    return float(value)


def find_ranks(pid: int | None = None, run_dir=None, discovery_dir=None) -> list[dict]:
    """Discovery records of the ranks to show: one pid's, or every live rank of a run directory."""
    if pid is not None:
        try:
            return ranks_of(pid=pid, discovery_dir=discovery_dir)
        except CaptureError as exc:
            raise TopError(str(exc)) from None
    if not Path(run_dir).is_dir():
        raise TopError(f"no such run directory: {run_dir}")
    ranks = live_ranks(run_dir, discovery_dir)
    if not ranks:
        raise TopError(f"no live rank of {run_dir}: no discovery file in {default_discovery_dir(discovery_dir)} names "
                       "it (the run ended, has not started, or runs with its endpoint off)")
    return ranks


# ---- what top knows of a rank --------------------------------------------------------------------------------

@dataclass
class RankView:
    """One rank as top knows it at a refresh: the frame builder's input."""
    rank: int | None
    role: str | None
    pid: int
    state: dict | None = None
    """Its last `state` reply (None: it never answered)."""
    answer_age_s: float | None = None
    """Seconds from that reply to this refresh (None: it never answered)."""
    error: str | None = None
    """Why the latest request got no answer (None: it answered)."""
    ended: str | None = None
    """Once its process ended: its run_end status, or why there is none."""
    end_step: int | None = None
    ticks: list = field(default_factory=list)
    """The tick records seen, oldest first: the newest and those back to the window's start."""
    p95_s: dict = field(default_factory=dict)
    """{span: its latest recent p95 seen in a closed interval} (the stuck rule's basis)."""
    socket_path: str | None = None
    log_path: Path | None = None
    since_unix: float | None = None
    """When its endpoint started (its run_end is the first one written after)."""
    answered_at_s: float | None = None


def view_of(record: dict) -> RankView:
    run_dir, rank = record.get("run_dir"), record.get("rank")
    log = Path(run_dir) / "profile" / f"rank{rank}.jsonl" if run_dir and rank is not None else None
    return RankView(rank=rank, role=record.get("role"), pid=record["pid"], socket_path=record.get("socket_path"),
                    log_path=log, since_unix=record.get("start_time_unix"))


def keep_ticks(view: RankView, ticks, window_s: float) -> None:
    """Add a reply's ticks to the rank's (each once), and drop those before the window's start: the latest tick
    at least window_s older than the newest."""
    seen = {_tick_key(t) for t in view.ticks}
    for tick in ticks if isinstance(ticks, list) else ():
        if isinstance(tick, dict) and (key := _tick_key(tick))[1] is not None and key not in seen:
            view.ticks.append(tick)
            seen.add(key)
    if not view.ticks:
        return
    view.ticks.sort(key=_tick_t_s)
    newest_s = _tick_t_s(view.ticks[-1])
    start = max((i for i, t in enumerate(view.ticks) if newest_s - _tick_t_s(t) >= window_s), default=0)
    del view.ticks[:start]


def _tick_key(tick: dict) -> tuple:
    """A tick record's (`index`, `t_s`): which tick of its segment it is, and its instant on the interval clock
    (seconds); what tells a tick served twice."""
    t = views.tick(tick)
    return t.index, t.t_s


def _tick_t_s(tick: dict) -> float:
    """A kept tick record's `t_s` (keep_ticks keeps only ticks that have one), seconds."""
    return views.tick(tick).t_s


def note_p95(view: RankView, last_interval) -> None:
    """Remember each span's recent p95 from the rank's last closed interval (a span open through a whole interval
    keeps the p95 of the one before)."""
    if isinstance(last_interval, dict):
        for name in views.interval(last_interval).spans.keys():
            p95_s = interval_p95_seconds(last_interval, name)
            if p95_s is not None:
                view.p95_s[name] = p95_s


def last_run_end(log_path: Path | None, since_unix: float | None):
    """The rank's run_end (views.RunEnd) among the last LOG_TAIL_BYTES of its log, written after `since_unix`;
    None when there is none (killed, or still running)."""
    if log_path is None:
        return None
    try:
        with open(log_path, "rb") as f:
            start = max(0, f.seek(0, os.SEEK_END) - LOG_TAIL_BYTES)
            f.seek(start)
            lines = f.read(LOG_TAIL_BYTES).split(b"\n")
    except OSError:
        return None
    for raw in reversed(lines[1:] if start else lines):   # a tail's first line is cut
        rec = parse_line(raw) if raw.strip() else None
        end = views.view(rec) if rec is not None else None
        if isinstance(end, views.RunEnd):
            return end if since_unix is None or (end.time_unix or 0.0) >= since_unix else None
    return None


def ended_reason(view: RankView) -> tuple | None:
    """(status, step) once the rank's process is gone, or its endpoint is gone after its run_end; None while
    it may still answer."""
    alive = pid_alive(view.pid)
    if alive and view.socket_path and os.path.exists(view.socket_path):
        return None
    end = last_run_end(view.log_path, view.since_unix)
    if end is not None:
        return end.status or "no status", end.step
    return None if alive else ("no run_end in its log (killed?)", None)


class Poller:
    """Asks each rank for its state, all at once, and keeps a RankView of each; with `run_dir`, ranks that start
    later are added (a rank that comes back, a resume, replaces its ended row)."""

    def __init__(self, records: list, run_dir=None, window_s: float = WINDOW_S, timeout_s: float = QUERY_TIMEOUT_S,
                 discovery_dir=None, query_fn=query, clock=time.monotonic):
        self.run_dir, self.window_s, self.timeout_s = run_dir, window_s, timeout_s
        self.discovery_dir, self._query, self._clock = discovery_dir, query_fn, clock
        self.views: dict = {}
        for record in records:
            self._add(record)
        self._pool = ThreadPoolExecutor(max_workers=MAX_POLL_THREADS, thread_name_prefix="top.poll")

    def _add(self, record: dict) -> None:
        for pid, old in list(self.views.items()):
            if old.rank == record.get("rank") and old.ended is not None:
                del self.views[pid]
        self.views[record["pid"]] = view_of(record)

    def refresh(self) -> list:
        """Ask every rank not ended; returns the views, rank order."""
        if self.run_dir is not None:
            for record in live_ranks(self.run_dir, self.discovery_dir):
                if record["pid"] not in self.views:
                    self._add(record)
        asked = [v for v in self.views.values() if v.ended is None]
        replies = list(self._pool.map(lambda v: self._ask(v), asked))
        now_s = self._clock()
        for view, reply in zip(asked, replies):
            self._update(view, reply, now_s)
        for view in self.views.values():
            view.answer_age_s = None if view.answered_at_s is None else now_s - view.answered_at_s
        return sorted(self.views.values(), key=lambda v: (v.rank if v.rank is not None else -1, v.pid))

    def _ask(self, view: RankView) -> dict:
        if not view.socket_path:
            return {"ok": False, "error": "its discovery file names no socket"}
        return self._query(view.socket_path, "state", timeout_s=self.timeout_s)

    def _update(self, view: RankView, reply: dict, now_s: float) -> None:
        state = reply.get("state")
        if reply.get("ok") and isinstance(state, dict):
            view.state, view.error, view.answered_at_s = state, None, now_s
            keep_ticks(view, state.get("ticks"), self.window_s)
            note_p95(view, state.get("last_interval"))
            return
        view.error = str(reply.get("error") or "no reply").removeprefix(f"control endpoint {view.socket_path}: ")
        ended = ended_reason(view)
        if ended is not None:
            view.ended, view.end_step = ended

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


# ---- the frame: a pure function of the views -------------------------------------------------------------------

def clean(text) -> str:
    """Text from a rank or its log on one line: control characters escaped (profiler.schema.records.printable), newlines
    and tabs too."""
    return printable(str(text)).replace("\n", "\\n").replace("\t", " ")


def fit(line: str, width: int) -> str:
    """`line` cut to `width` characters, the cut marked with "..."."""
    return line if len(line) <= width else (line[:width - 3] + "...") if width > 3 else line[:max(0, width)]


def _cut_left(text: str, width: int) -> str:
    """`text` cut from the left to `width` characters ("..." marks the cut): a path's last parts are kept."""
    return text if len(text) <= width else "..." + text[len(text) - max(0, width - 3):]


def _s(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 100 else f"{seconds:,.0f} s"


def rank_window(view: RankView) -> dict | None:
    """The interval-shaped window (profiler.schema.windows.tick_windows) from the first tick kept to the newest; None before
    two ticks of one segment."""
    if len(view.ticks) < 2:
        return None
    found = windows.tick_windows([view.ticks[0], view.ticks[-1]])
    return found[0] if found else None


def _stuck_rule(p95_s: dict):
    """snapshot.judge_span's lookup over the p95s top saw."""
    def lookup(name: str):
        p95 = p95_s.get(name)
        return (p95, None) if p95 is not None else (None, f"{name} finished in no interval top saw")
    return lookup


def open_spans(view: RankView) -> list:
    """[(thread, judged span)] of the innermost open span of each thread, its age grown by the answer's age."""
    extra_s, lookup, out = view.answer_age_s or 0.0, _stuck_rule(view.p95_s), []
    for entry in map(views.OpenSpans.of, (view.state or {}).get("active_spans") or ()):
        spans = entry.spans
        if spans:
            out.append((entry.thread, judge_span(spans[-1].name, (spans[-1].open_seconds or 0.0) + extra_s, lookup)))
    return out


def _open_text(spans: list) -> str:
    return "open: " + (", ".join(f"{clean(s['name'])} {_s(s['open_seconds'])}" for _, s in spans) or "none")


def busiest(window: dict | None, top: int = 2) -> str:
    """The rank's spans that took most of its window (self time, on the GPU clock where timed), as shares."""
    if window is None:
        return "busy: - (no tick window yet)"
    w = views.interval(window)
    wall_s = w.duration_seconds or 0.0
    took = sorted(((e.self_seconds(e.basis()[1]), name) for name, e in w.spans.items()), reverse=True)
    shown = [f"{clean(name)} {seconds / wall_s:.0%}" for seconds, name in took[:top] if seconds > 0 and wall_s > 0]
    return "busy: " + (", ".join(shown) or "no span")


@dataclass(frozen=True)
class Row:
    """One rank's figures as the table shows them."""
    view: RankView
    state: str
    detail: str
    severity: int
    """0: stuck or not answering, 1: running, 2: ended (the state sort)."""
    window: dict | None
    tokens_per_s: float | None
    steps_per_s: float | None


def _status(view: RankView, spans: list) -> tuple:
    """(state column, second line, severity)."""
    if view.ended is not None:
        at = f" at step {view.end_step}" if view.end_step is not None else ""
        return "ended", f"ended: {clean(view.ended)}{at}" + (" (its run_end)" if "run_end" not in view.ended else ""), 2
    if view.error is not None:
        age = _s(view.answer_age_s) if view.answer_age_s is not None else None
        if age is None:
            return "NO ANSWER", f"no answer ({clean(view.error)}); it never answered", 0
        return (f"NO ANSWER {view.answer_age_s:.0f}s", f"no answer for {age} ({clean(view.error)}); "
                f"{_open_text(spans)}", 0)
    stuck = next((s for _, s in spans if s["stuck"]), None)
    if stuck is not None:
        thread = next(t for t, s in spans if s is stuck)
        return (f"STUCK {stuck['open_seconds']:.0f}s", f"STUCK in {clean(stuck['name'])} {_s(stuck['open_seconds'])} > "
                f"{_s(stuck['limit_seconds'])} (p95 {stuck['p95_seconds']:.3g} s) on {clean(thread)}", 0)
    return "running", None, 1


def make_row(view: RankView) -> Row:
    window = rank_window(view) if view.ended is None and view.error is None else None
    spans = open_spans(view)
    state, detail, severity = _status(view, spans)
    tokens = steps = None
    if window is not None:
        w = views.interval(window)
        tokens = w.counters["tokens"].per_second if "tokens" in w.counters else None
        first, last = views.tick(view.ticks[0]).step, views.tick(view.ticks[-1]).step
        if first is not None and last is not None and w.duration_seconds:
            steps = (last - first) / w.duration_seconds
    if detail is None:
        detail = f"{busiest(window)}; {_open_text(spans)}"
    return Row(view, state, detail, severity, window, tokens, steps)


def gpu_now(view: RankView) -> tuple:
    """(busy %, "used/total GiB") of the rank's GPU from NVML's latest sample; "-" without one (a CPU rank)."""
    memory = (view.state or {}).get("memory") if view.error is None and view.ended is None else None
    if not isinstance(memory, dict) or memory.get("available") is not True:
        return "-", "-"
    gpus = [g for g in memory.get("gpus") or () if isinstance(g, dict)]
    if not gpus:
        return "-", "-"
    util, used, total = (gpus[0].get(k) for k in ("util_percent", "used_bytes", "total_bytes"))
    busy = f"{util:.0f}" if isinstance(util, (int, float)) else "?"
    mem = f"{used / 2**30:.1f}/{total / 2**30:.0f}" if all(isinstance(x, (int, float)) for x in (used, total)) else "?"
    return busy, mem


HEADER = f"{'RANK':>4} {'ROLE':<9} {'STEP':>7} {'STATE':<13} {'TOK/S':>9} {'STEP/S':>7} {'WIN':>5} {'GPU%':>5} " \
         f"{'MEM GiB':>11}"


def row_lines(row: Row) -> list:
    """The rank's two lines: its figures under HEADER, then what it does (or why it shows none)."""
    v, w = row.view, row.window
    step = v.end_step if v.ended is not None and v.end_step is not None else (v.state or {}).get("step")
    busy, mem = gpu_now(v)
    tokens = rate_text(row.tokens_per_s) if row.tokens_per_s is not None else "-"
    steps = f"{row.steps_per_s:.2f}" if row.steps_per_s is not None else "-"
    win = f"{views.interval(w).duration_seconds:.0f}s" if w is not None else "-"
    first = (f"{v.rank if v.rank is not None else '?':>4} {clean(v.role or '?'):<9.9} "
             f"{step if isinstance(step, int) else '-':>7} {row.state:<13.13} {tokens:>9} {steps:>7} {win:>5} "
             f"{busy:>5} {mem:>11}")
    return [first, "     " + row.detail]


def bound_line(rows: list, waits: dict | None) -> str:
    """The role whose ranks wait least over their windows: their wait spans' (`waits`: {span: role}) CPU seconds
    over the windows' summed length."""
    wait_roles, acc = set((waits or {}).values()), {}
    for row in rows:
        if row.window is None or row.view.role not in wait_roles:
            continue
        w = views.interval(row.window)
        waited_s = sum(e.clock_seconds("cpu") for name, e in w.spans.items() if waits.get(name) == row.view.role)
        seen = acc.setdefault(row.view.role, [0.0, 0.0, 0])
        seen[0], seen[1], seen[2] = seen[0] + waited_s, seen[1] + (w.duration_seconds or 0.0), seen[2] + 1
    shares = {role: (waited_s / wall_s, n) for role, (waited_s, wall_s, n) in acc.items() if wall_s > 0}
    if len(shares) < 2:
        return "bound stage: - (needs a tick window from ranks of two roles that wait on each other)"
    ranked = sorted(shares.items(), key=lambda kv: kv[1][0])
    said = ", ".join(f"{clean(role)} {share:.0%}" for role, (share, _) in ranked)
    n = sum(n for _, n in shares.values())
    if ranked[1][1][0] - ranked[0][1][0] < BOUND_MARGIN:
        return f"bound stage: - (roles wait alike over WIN: {said}; {n} ranks)"
    return f"bound stage: {clean(ranked[0][0])} (least waiting over WIN: {said}; {n} ranks)"


def sort_rows(rows: list, sort: str, reverse: bool = False) -> list:
    """Rows by a SORTS column (its natural order; `reverse` flips it), rank breaking ties."""
    def rank(r):
        return r.view.rank if r.view.rank is not None else -1

    def step(r):
        value = (r.view.state or {}).get("step")
        return (False, value) if isinstance(value, int) else (True, 0)   # unknown steps last
    keys = {"rank": lambda r: (rank(r),), "step": lambda r: (*step(r), rank(r)),
            "tok/s": lambda r: (r.tokens_per_s is None, -(r.tokens_per_s or 0.0), rank(r)),
            "state": lambda r: (r.severity, rank(r))}
    return sorted(rows, key=keys[sort], reverse=reverse)


@dataclass(frozen=True)
class FrameSettings:
    """What a frame shows besides the ranks."""
    where: str
    """What is shown (the run directory, or a pid of one): cut from the left where the width is short."""
    window_s: float = WINDOW_S
    waits: dict | None = None
    keys: bool = False
    """Show the keys line (the live view)."""


def build_frame(rank_views: list, settings: FrameSettings, width: int, height: int | None = None,
                sort: str = "rank", reverse: bool = False, clock_text: str = "") -> list:
    """The lines of one frame, none longer than `width`; with `height`, at most that many (the ranks that do not fit
    are counted on the last line)."""
    rows = sort_rows([make_row(v) for v in rank_views], sort, reverse)
    ended = sum(r.view.ended is not None for r in rows)
    counts = (f": {len(rows)} rank{'s' * (len(rows) != 1)}, {len(rows) - ended} live" + (f", {ended} ended" if ended
              else "") + (f"  {clock_text}" if clock_text else ""))
    head = [f"dflash-profile top {_cut_left(settings.where, width - len('dflash-profile top ') - len(counts))}{counts}",
            f"TOK/S, STEP/S, busy: each rank's ticks over its last WIN (up to {settings.window_s:g} s)",
            "GPU%, MEM: NVML's latest sample; stuck: open > max(10 x recent p95, 5 s)",
            bound_line(rows, settings.waits), HEADER]
    foot = [f"sort: {sort}{' reversed' if reverse else ''}   s: next sort   r: reverse   q: quit"] if settings.keys else []
    body = [line for row in rows for line in row_lines(row)]
    if height is not None and len(head) + len(body) + len(foot) > height:
        room = max(0, (height - len(head) - len(foot) - 1) // 2)
        hidden = len(rows) - room
        body = body[:2 * room] + [f"... {hidden} more rank{'s' * (hidden > 1)} (a taller terminal shows them)"]
    lines = head + body + foot
    return [fit(line, width) for line in (lines if height is None else lines[:height])]


# ---- running it --------------------------------------------------------------------------------------------------

def _where(records: list, pid: int | None, run_dir) -> str:
    return clean(run_dir if pid is None else f"pid {pid} of {records[0].get('run_dir')}")


def run(pid: int | None = None, run_dir=None, interval_s=DEFAULT_INTERVAL_S, window_s=WINDOW_S, once: bool = False,
        waits: dict | None = None, out=None, discovery_dir=None) -> int:
    """`dflash-profile top`: TopError (one line) before any work for a bad --interval or --window, a pid that is no
    rank of ours, a run directory without a live rank, or (without --once) a stdout that is not a terminal."""
    interval_s = check_seconds("--interval", interval_s, INTERVAL_RANGE_S)
    window_s = check_seconds("--window", window_s, WINDOW_RANGE_S)
    out = out or sys.stdout
    if not once and not out.isatty():
        raise TopError("stdout is not a terminal: the live view needs one (--once prints one plain frame)")
    records = find_ranks(pid, run_dir, discovery_dir)
    poller = Poller(records, run_dir=run_dir if pid is None else None, window_s=window_s,
                    timeout_s=min(QUERY_TIMEOUT_S, interval_s), discovery_dir=discovery_dir)
    settings = FrameSettings(_where(records, pid, run_dir), window_s, waits, keys=not once)
    try:
        if once:
            width = shutil.get_terminal_size((80, 24)).columns
            print("\n".join(build_frame(poller.refresh(), settings, width, clock_text=time.strftime("%H:%M:%S"))),
                  file=out)
            return 0
        return live(poller, settings, interval_s)
    finally:
        poller.close()


def live(poller: Poller, settings: FrameSettings, interval_s: float) -> int:
    """The curses view until `q` (or Ctrl-C): a refresh every interval_s, sleeping in getch between them."""
    import curses

    try:
        curses.wrapper(_screen, poller, settings, interval_s)
    except KeyboardInterrupt:
        pass
    except curses.error as exc:   # no terminal description (TERM), before anything is drawn
        raise TopError(f"cannot drive this terminal (TERM={os.environ.get('TERM')!r}): {exc}") from None
    return 0


def _screen(scr, poller: Poller, settings: FrameSettings, interval_s: float) -> None:
    import curses

    with contextlib.suppress(curses.error):
        curses.curs_set(0)
    sort, reverse = 0, False
    rank_views, clock_text = poller.refresh(), time.strftime("%H:%M:%S")
    due_s = time.monotonic() + interval_s
    while True:
        height, width = scr.getmaxyx()
        scr.erase()
        lines = build_frame(rank_views, settings, width, height, SORTS[sort], reverse, clock_text)
        for y, line in enumerate(lines):
            with contextlib.suppress(curses.error):   # the bottom-right cell cannot be written: that is all
                scr.addstr(y, 0, line, curses.A_BOLD if y == 0 else curses.A_NORMAL)
        scr.refresh()
        scr.timeout(max(0, int(1000 * (due_s - time.monotonic()))))
        key = scr.getch()
        if key in (ord("q"), ord("Q")):
            return
        if key == ord("s"):
            sort = (sort + 1) % len(SORTS)
        elif key == ord("r"):
            reverse = not reverse
        if time.monotonic() >= due_s:
            rank_views, clock_text = poller.refresh(), time.strftime("%H:%M:%S")
            due_s = time.monotonic() + interval_s
