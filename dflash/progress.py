"""Rank 0's progress line, fed without host-device syncs."""

from __future__ import annotations

import sys
import time

import torch


class LazyScalar:
    """A 0-dim device tensor copied to the host in the background; `value()` is None until the copy
    has landed, so reading it never blocks on the GPU."""

    def __init__(self, t: torch.Tensor):
        if t.is_cuda:
            # Pinned destination: a non-blocking copy into pageable memory would block the host.
            self._host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self._host.copy_(t.detach(), non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host, self._ready = t.detach(), None

    def value(self) -> float | None:
        if self._ready is not None and not self._ready.query():
            return None
        return float(self._host)


class Progress:
    """One line, rewritten in place on a terminal; on a pipe or file, a line every `every_s` seconds."""

    def __init__(self, total_steps: int, start_step: int = 0, stream=None, every_s: float = 10.0,
                 clock=time.monotonic):
        self.total, self.stream, self.every_s, self.clock = total_steps, stream or sys.stdout, every_s, clock
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = self._last_print = clock()
        self.start_step = start_step
        self._loss = self._tau = None
        self._pending: list = []
        self._printed_step = -1

    def observe(self, loss: LazyScalar, tau: LazyScalar) -> None:
        self._pending.append((loss, tau))
        ready = [p for p in self._pending if p[0].value() is not None]
        if ready:
            self._loss, self._tau = ready[-1][0].value(), ready[-1][1].value()
            self._pending = [p for p in self._pending if p[0].value() is None][-8:]

    def update(self, step: int, tokens_total: int, force: bool = False) -> None:
        now = self.clock()
        if step == self._printed_step:
            return
        if not force and not self.tty and now - self._last_print < self.every_s and step < self.total:
            return
        self._last_print, self._printed_step = now, step
        elapsed = max(now - self.t0, 1e-9)
        frac = step / max(1, self.total)
        bar = "#" * int(20 * frac) + "-" * (20 - int(20 * frac))
        loss = "  -  " if self._loss is None else f"{self._loss:.3f}"
        tau = "  -  " if self._tau is None else f"{self._tau:.2f}"
        line = (f"[{bar}] step {step}/{self.total} | loss {loss} | tau {tau} | "
                f"{tokens_total / elapsed:,.0f} tok/s | {elapsed:.0f}s")
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
