"""Two watchers that get a stuck rank out: the hang watchdog and the signal watch.

SignalWatch: SIGTERM/SIGINT reach the C-level handler even while the main thread is blocked in a collective,
where a Python handler would never run: signal.set_wakeup_fd hands each signal to this watch's thread, which
runs `on_signal(signum)` and waits for a step boundary (`observed()`); a rank without progress for `grace_s`
meanwhile is blocked: `on_blocked(signame, why)`. A second signal at least `repeat_after_s` after the first
(Ctrl-C reaches the group and the launcher forwards another) calls it at once.
"""
from __future__ import annotations

import signal
import socket
import threading
import time


class NullWatchdog:
    """hang_timeout_s = 0: no thread, no checks."""

    def start(self) -> None:
        pass

    stop = start


class Watchdog:
    """Calls on_hang(stalled_s) once after `timeout_s` seconds without progress. progress_fn() -> (armed,
    token): the collector arms it at the first step change (start-up and the first compile never trip it),
    and the token changes whenever a span finished or the step changed."""

    def __init__(self, timeout_s: float, progress_fn, on_hang, clock=time.monotonic):
        if not timeout_s > 0:
            raise ValueError(f"Watchdog: timeout_s must be > 0, got {timeout_s!r}")
        # A twentieth of the timeout (at most 5 s): a hang is declared within 5% of it, waking rarely.
        self.timeout_s = float(timeout_s)
        self.poll_s = min(5.0, max(0.05, self.timeout_s / 20))
        self._progress_fn, self._on_hang, self._clock = progress_fn, on_hang, clock
        self._token = object()
        self._since_s = clock()
        self.fired = False
        self._stop = threading.Event()
        self._thread = None

    def check(self) -> bool:
        """One look: True when this call declared a hang (and ran on_hang)."""
        armed, token = self._progress_fn()
        now = self._clock()
        if not armed or token != self._token:
            self._token, self._since_s = token, now
            return False
        stalled_s = now - self._since_s
        if self.fired or stalled_s < self.timeout_s:
            return False
        self.fired = True
        self._on_hang(stalled_s)
        return True

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="profiler.watchdog", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self.check():
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None


class SignalWatch:
    """See the module doc."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, on_signal, observed, on_blocked, grace_s: float = 2.0, repeat_after_s: float = 1.0,
                 clock=time.monotonic, poll_s: float = 0.05, progress=lambda: None):
        self._on_signal, self._observed, self._on_blocked = on_signal, observed, on_blocked
        self._progress = progress
        self.grace_s, self.repeat_after_s, self.poll_s, self._clock = grace_s, repeat_after_s, poll_s, clock
        self._first_s: float | None = None
        self._first_name = ""
        self._lock = threading.Lock()
        self._rsock = self._wsock = None
        self._old_fd = None
        self._closed = False

    def install(self) -> None:
        """From the main thread, after the Python handlers are installed (the wakeup fd needs them)."""
        self._rsock, self._wsock = socket.socketpair()
        self._wsock.setblocking(False)
        self._old_fd = signal.set_wakeup_fd(self._wsock.fileno(), warn_on_full_buffer=False)
        threading.Thread(target=self._read, name="profiler.signal_watch", daemon=True).start()

    def close(self) -> None:
        """From the main thread: restore the previous wakeup fd and end the reader; a grace period
        still running ends without acting (the rank is past the code that could block)."""
        self._closed = True
        if self._wsock is not None:
            signal.set_wakeup_fd(self._old_fd if self._old_fd is not None else -1)
            self._wsock.close()
            self._rsock.close()
            self._wsock = None

    def _read(self) -> None:
        while True:
            try:
                data = self._rsock.recv(64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum in self.SIGNALS:
                    self.deliver(signum)

    def deliver(self, signum: int) -> None:
        """One signal: note it; the first starts the grace clock, a later distinct one escalates."""
        self._on_signal(signum)
        if self._closed:
            return
        now = self._clock()
        with self._lock:
            first = self._first_s is None
            if first:
                self._first_s, self._first_name = now, signal.Signals(signum).name
            repeat = not first and now - self._first_s >= self.repeat_after_s
        if first:
            threading.Thread(target=self._grace, name="profiler.signal_grace", daemon=True).start()
        elif repeat:
            self._on_blocked(signal.Signals(signum).name, "a second signal")

    def _grace(self) -> None:
        deadline, token = self._first_s + self.grace_s, self._progress()
        while self._clock() < deadline:
            if self._observed() or self._closed:
                return
            if self._progress() != token:   # still working: the grace starts over
                deadline, token = self._clock() + self.grace_s, self._progress()
            time.sleep(self.poll_s)
        if not self._observed() and not self._closed:
            self._on_blocked(self._first_name, f"blocked: no step boundary nor progress within {self.grace_s:g} s")
