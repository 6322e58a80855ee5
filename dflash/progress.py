"""Rank 0's progress line, fed without host-device syncs."""

from __future__ import annotations

import collections
import sys
import time

import torch


class LazyCopy:
    """A small tensor whose values reach the host without a sync: `start()` queues a non-blocking copy into
    pinned memory behind an event, `values()` is None until it has landed. The tensor must not be changed in
    place afterwards (Progress makes a new one each step)."""

    def __init__(self, t: torch.Tensor):
        self._t = t.detach()
        self._host: torch.Tensor | None = None
        self._ready = None

    def start(self) -> None:
        """Queue the copy once (pinned: a non-blocking copy into pageable memory would block the host)."""
        if self._host is not None:
            return
        t, self._t = self._t, None
        if t.is_cuda:
            self._host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self._host.copy_(t, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = t

    def values(self) -> list[float] | None:
        self.start()
        if self._ready is not None and not self._ready.query():
            return None
        return [float(v) for v in self._host.reshape(-1).tolist()]


RECENT_S = 30.0
"""The progress line's rate window: tokens/s and steps/s (the ETA's) over the last this many seconds, labelled."""
EMA_SPAN_STEPS = 20
"""The progress line's loss and tau are exponential moving averages over every step, with span this many steps
(weight 2 / (span + 1) on the newest, as pandas' `ewm(span=...)`), kept on the device and labelled with it."""


class Progress:
    """One line, rewritten in place on a terminal; on a pipe or file, a line every `every_s` seconds: the step,
    the loss and tau as EMAs (span EMA_SPAN_STEPS), the learning rate (the scheduler's after the last step, what
    the next one uses, as the interval's `lr` metric holds), tokens/s over the last RECENT_S seconds and the ETA
    at that window's step rate, and the time since the first step began."""

    def __init__(self, total_steps: int, stream=None, every_s: float = 10.0, clock=time.monotonic,
                 refresh_s: float = 0.5, start_step: int = 0, ema_span: int = EMA_SPAN_STEPS):
        self.total, self.stream, self.every_s, self.clock = total_steps, stream or sys.stdout, every_s, clock
        self.refresh_s, self.ema_span = refresh_s, ema_span
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = self._last_print = clock()
        self._ema: torch.Tensor | None = None      # [loss, tau], on the training device
        self._shown: list[float] | None = None     # the EMAs as last copied to the host
        self._lr: float | None = None
        self._in_flight: LazyCopy | None = None
        self._started_at = None
        self._printed_step = -1
        self._recent: collections.deque = collections.deque([(self.t0, start_step, 0)])   # (time, step, tokens)

    def observe(self, loss: torch.Tensor, tau: torch.Tensor, lr: float | None = None) -> None:
        """Called every step: the step's loss and tau folded into their EMAs on the device (a non-finite value is
        left out, so one NaN step does not blank the line for good); at most one copy of the EMAs in flight,
        started at most every `refresh_s`."""
        self._lr = lr
        pair = torch.stack([loss.detach().float().reshape(()), tau.detach().float().reshape(())])
        if self._ema is None:
            self._ema = pair
        else:
            ema = torch.where(torch.isfinite(self._ema), torch.lerp(self._ema, pair, 2.0 / (self.ema_span + 1)), pair)
            self._ema = torch.where(torch.isfinite(pair), ema, self._ema)
        self._take_landed()
        now = self.clock()
        if self._in_flight is None and (self._started_at is None or now - self._started_at >= self.refresh_s):
            self._started_at = now
            self._in_flight = LazyCopy(self._ema)
            self._in_flight.start()
            self._take_landed()

    def _take_landed(self) -> None:
        if self._in_flight is not None:
            values = self._in_flight.values()
            if values is not None:
                self._shown, self._in_flight = values, None

    def _recent_rates(self, now: float, step: int, tokens_total: int) -> tuple[float, float, float]:
        """(tokens/s, steps/s, window seconds) over the last RECENT_S seconds (or since the start, when shorter; or
        between the last two updates, when those are further apart)."""
        self._recent.append((now, step, tokens_total))
        while len(self._recent) > 2 and now - self._recent[0][0] > RECENT_S:
            self._recent.popleft()
        t_a, step_a, tokens_a = self._recent[0]
        span_s = max(now - t_a, 1e-9)
        return (tokens_total - tokens_a) / span_s, (step - step_a) / span_s, span_s

    def update(self, step: int, tokens_total: int, force: bool = False) -> None:
        now = self.clock()
        if step == self._printed_step:
            return
        tokens_per_s, steps_per_s, window_s = self._recent_rates(now, step, tokens_total)
        if not force and not self.tty and now - self._last_print < self.every_s and step < self.total:
            return
        self._last_print, self._printed_step = now, step
        self._take_landed()
        line = self.format_line(step, now - self.t0, tokens_per_s, steps_per_s, window_s)
        if self.tty:
            self.stream.write("\r" + line + ("\n" if step >= self.total or force else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def format_line(self, step: int, elapsed_s: float, tokens_per_s: float, steps_per_s: float,
                    window_s: float) -> str:
        frac = min(1.0, step / max(1, self.total))
        bar = "#" * int(20 * frac) + "-" * (20 - int(20 * frac))
        loss, tau = (" - ", " - ") if self._shown is None else (f"{self._shown[0]:.3f}", f"{self._shown[1]:.2f}")
        lr = "-" if self._lr is None else f"{self._lr:.2e}"
        left = self.total - step
        eta = "done" if left <= 0 else f"ETA {short_duration(left / steps_per_s)}" if steps_per_s > 0 else "ETA -"
        return (f"[{bar}] step {step}/{self.total} | loss {loss} tau {tau} (EMA, span {self.ema_span} steps) | "
                f"lr {lr} | {tokens_per_s:,.0f} tok/s (last {window_s:.0f} s) | {short_duration(elapsed_s)}, {eta}")


def short_duration(seconds: float) -> str:
    """`42s`, `3m05s`, `2h07m`."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"


class NullProgress:
    def observe(self, loss, tau, lr=None) -> None:
        pass

    def update(self, step: int, tokens_total: int, force: bool = False) -> None:
        pass
