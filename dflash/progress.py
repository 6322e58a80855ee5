"""Rank 0's progress line, fed without host-device syncs."""

from __future__ import annotations

import collections
import sys
import time

import torch


class LazyScalar:
    """A 0-dim tensor whose value reaches the host without a sync: `start()` queues a non-blocking copy
    into pinned memory behind an event, `value()` is None until it has landed. Making one costs nothing,
    so only the scalars the progress line shows are ever copied."""

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

    def value(self) -> float | None:
        self.start()
        if self._ready is not None and not self._ready.query():
            return None
        return float(self._host)


RECENT_S = 30.0
"""The progress line's rate window: tokens/s over the last this many seconds, labelled as such."""


class Progress:
    """One line, rewritten in place on a terminal; on a pipe or file, a line every `every_s` seconds."""

    def __init__(self, total_steps: int, stream=None, every_s: float = 10.0, clock=time.monotonic,
                 refresh_s: float = 0.5):
        self.total, self.stream, self.every_s, self.clock = total_steps, stream or sys.stdout, every_s, clock
        self.refresh_s = refresh_s
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = self._last_print = clock()
        self._loss = self._tau = None
        self._in_flight: tuple | None = None   # (loss, tau) being copied to the host
        self._started_at = None
        self._printed_step = -1
        self._recent: collections.deque = collections.deque()                # (time, tokens so far) within the last RECENT_S

    def observe(self, loss: LazyScalar, tau: LazyScalar) -> None:
        """Called every step: at most one (loss, tau) copy in flight, started at most every `refresh_s`."""
        self._take_landed()
        now = self.clock()
        if self._in_flight is None and (self._started_at is None or now - self._started_at >= self.refresh_s):
            self._started_at = now
            loss.start()
            tau.start()
            self._in_flight = (loss, tau)
            self._take_landed()

    def _take_landed(self) -> None:
        if self._in_flight is not None:
            loss_value, tau_value = self._in_flight[0].value(), self._in_flight[1].value()
            if loss_value is not None and tau_value is not None:
                self._loss, self._tau, self._in_flight = loss_value, tau_value, None

    def _recent_rate(self, now: float, tokens_total: int) -> str:
        """Tokens/s over the last RECENT_S seconds (or since the start, when shorter), with its window."""
        self._recent.append((now, tokens_total))
        while len(self._recent) > 2 and now - self._recent[1][0] >= RECENT_S:
            self._recent.popleft()
        t_a, n_a = self._recent[0] if len(self._recent) > 1 else (self.t0, 0)
        span_s = max(now - t_a, 1e-9)
        return f"{(tokens_total - n_a) / span_s:,.0f} tok/s (last {span_s:.0f} s)"

    def update(self, step: int, tokens_total: int, force: bool = False) -> None:
        now = self.clock()
        if step == self._printed_step:
            return
        rate = self._recent_rate(now, tokens_total)
        if not force and not self.tty and now - self._last_print < self.every_s and step < self.total:
            return
        self._last_print, self._printed_step = now, step
        elapsed = max(now - self.t0, 1e-9)
        frac = step / max(1, self.total)
        bar = "#" * int(20 * frac) + "-" * (20 - int(20 * frac))
        loss = "  -  " if self._loss is None else f"{self._loss:.3f}"
        tau = "  -  " if self._tau is None else f"{self._tau:.2f}"
        line = (f"[{bar}] step {step}/{self.total} | loss {loss} | tau {tau} | "
                f"{rate} | {elapsed:.0f}s")
        if self.tty:
            self.stream.write("\r" + line + ("\n" if step >= self.total or force else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


class NullProgress:
    def observe(self, loss, tau) -> None:
        pass

    def update(self, step: int, tokens_total: int, force: bool = False) -> None:
        pass
