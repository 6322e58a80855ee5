"""Non-finite checks without a host sync, and the packed-batch fingerprint.

A span hands tensors to `NonfiniteMonitor.check(span, step, {name: tensor})`. On the device, each
tensor is reduced to one flag (`not isfinite(t).all()`), the flags are stacked into a small buffer and
copied non-blocking into a row of pinned host memory allocated once at start (SLOTS rows; when all are
in flight the check is counted in `dropped`, never waited for), and an event is recorded after the
copy. Nothing waits:
the collector thread calls `poll()`, which asks each pending check's event `query()` in order and
reads the host flags only once the event says the copy has landed. The first non-finite flag found
becomes `first` (span, step, rank, tensor) and is handed to `on_found`, which writes the `nonfinite`
event; later ones are counted and handed on too.

How far behind: a check's flags are on the host once the device has run the work queued before it
(on a GPU the training thread runs ahead by the queued kernels, a step or two at most), and the
collector polls every `poll_s` (0.25 s by default). A training loop that acts on `first` at its step
boundaries therefore acts one to two steps after the bad one (plus a poll period); exact guards (the
checkpoint's) must check for themselves; `settle()` is the deliberate wait for such rare points.

On the CPU there is no device: the flags are computed where they are, and `poll()` reads them.
`fingerprint()` is the cheap summary of a packed batch the target sends with it: (finite count, sum)
in float64, computed on the batch's device, compared after receipt (`fingerprint_flags()`).
`step_unless()` skips an optimizer step on a device flag, without reading it where the optimizer allows.
"""
from __future__ import annotations

import collections
import logging
import threading
import time

import torch

logger = logging.getLogger("profiler")

SLOTS = 64        # pinned flag rows in flight at once (checks not read back yet)
MAX_FLAGS = 8     # tensors one check may name


class Finding(dict):
    """One non-finite check that fired: span, step, rank, tensor (the first flagged), tensors (all)."""


class NonfiniteMonitor:
    """Device-side checks read back asynchronously. `on_found(finding)` is called on the polling
    thread for every check that flagged something; `first` keeps the first one."""

    def __init__(self, rank: int, on_found, is_cuda: bool, record=None):
        self.rank = rank
        self._on_found = on_found
        self._is_cuda = is_cuda
        # record(event) on the current stream: the event pool's C-call record (1.8 us on an H200 host
        # against 6.6 us for the public Event.record()), else the public one.
        self._record = record or (lambda ev: ev.record())
        self._pending: collections.deque = collections.deque()
        # Pinned rows allocated once, here: allocating pinned memory (cudaHostAlloc) can wait for the
        # device, so the hot path only takes a free row and the poll gives it back after reading it.
        self._host = torch.zeros(SLOTS, MAX_FLAGS, dtype=torch.bool, pin_memory=True) if is_cuda else None
        # Every row's views for 1..MAX_FLAGS flags, made once: indexing in the hot path was most of the
        # profiler's own GIL time on a launch-bound H200 drafter (bench/RESULTS.md, seventh session).
        self._row_views = ([[self._host[row, :n] for n in range(MAX_FLAGS + 1)] for row in range(SLOTS)]
                           if is_cuda else None)
        self._free_rows = collections.deque(range(SLOTS)) if is_cuda else None
        # One "copy landed" event per row, reused: a row is taken again only after poll() saw it done.
        self._ready = [torch.cuda.Event() for _ in range(SLOTS)] if is_cuda else None
        self.dropped = 0
        self._poll_lock = threading.Lock()
        self.first: Finding | None = None
        self.found = 0
        self.checks = 0

    def check(self, span: str, step: int, tensors: dict, **fields) -> None:
        """Flag each tensor that holds a NaN or Inf; never waits for the device."""
        flags = torch.stack([~torch.isfinite(t).all() for t in tensors.values()])
        self.check_flags(span, step, list(tensors), flags, **fields)

    def check_flags(self, span: str, step: int, names: list, flags: torch.Tensor, **fields) -> None:
        """Queue already computed bool flags (one per name, true = bad) for reading back."""
        if len(names) > MAX_FLAGS:
            raise ValueError(f"check {span!r}: at most {MAX_FLAGS} tensors, got {len(names)}")
        self.checks += 1
        row = ready = None
        if self._is_cuda and flags.is_cuda:
            if not self._free_rows:   # the collector is SLOTS checks behind: count it, never wait
                self.dropped += 1
                if self.dropped == 1:
                    logger.warning("profiler: non-finite checks dropped: %d flag rows still in flight", SLOTS)
                return
            row = self._free_rows.popleft()
            host = self._row_views[row][len(names)]
            host.copy_(flags, non_blocking=True)
            ready = self._ready[row]
            self._record(ready)   # after the copy on the current stream; queried later, never waited on
        else:
            host = flags
        self._pending.append((span, step, names, host, ready, row, fields))

    def pending(self) -> int:
        """Checks not read back yet."""
        return len(self._pending)

    def poll(self) -> int:
        """Read back every check whose copy has landed (in order; stops at the first still pending).
        Returns how many were read. Called off the training thread (the profiler's collector)."""
        read = 0
        with self._poll_lock:
            while self._pending:
                span, step, names, host, ready, row, fields = self._pending[0]
                if ready is not None and not ready.query():
                    break
                self._pending.popleft()
                read += 1
                bad = [n for n, flag in zip(names, host.tolist()) if flag]
                if row is not None:
                    self._free_rows.append(row)
                if bad:
                    self._found(Finding(span=span, step=step, rank=self.rank, tensor=bad[0], tensors=bad,
                                        **fields))
        return read

    def settle(self, timeout_s: float, sleep=time.sleep) -> Finding | None:
        """Read back every check issued so far, polling Event.query() for up to timeout_s; returns
        `first`. A deliberate wait for the device: for rare points only (a checkpoint, run end)."""
        deadline = time.monotonic() + timeout_s
        self.poll()
        while self._pending and time.monotonic() < deadline:
            sleep(0.002)
            self.poll()
        return self.first

    def _found(self, finding: Finding) -> None:
        self.found += 1
        if self.first is None:
            self.first = finding
        try:
            self._on_found(finding)
        except Exception:   # noqa: BLE001 - telemetry never kills training; `first` still holds it
            logger.exception("profiler: reporting a non-finite value failed")


# A float64 sum casts its input first (a temporary of 8 bytes per element: 4x a bf16 payload, 1.3 GB
# for the 8B bench's 336 MB batch, every batch). Chunks bound the temporaries to 128 MiB (+16 MiB).
FINGERPRINT_CHUNK_ELEMENTS = 1 << 24


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """[finite count, sum], float64, on t's device; no host read. Summed chunk by chunk (the same
    order on both sides, so equal bytes give equal sums); the sum is NaN when t holds one: the count
    tells."""
    parts = [torch.stack([torch.count_nonzero(torch.isfinite(c)).to(torch.float64), c.sum(dtype=torch.float64)])
             for c in t.reshape(-1).split(FINGERPRINT_CHUNK_ELEMENTS)]
    return torch.stack(parts).sum(0) if parts else torch.zeros(2, dtype=torch.float64, device=t.device)


def fingerprint_flags(sent: torch.Tensor, received: torch.Tensor, numel: int) -> torch.Tensor:
    """Bool flags [pack, transfer] on the device: the sender's fingerprint counts non-finite values
    (the pack made them), or the receiver's differs from the sender's (the copy or the wire changed
    the payload). Sums agree to float64 rounding for the same bytes: 1e-9 relative."""
    sent = sent.to(received.device, non_blocking=True)
    pack_bad = sent[0] != numel
    moved = (received[0] != sent[0]) | ~torch.isclose(received[1], sent[1], rtol=1e-9, atol=1e-6, equal_nan=True)
    return torch.stack([pack_bad, moved & ~pack_bad])


def step_unless(optimizer: torch.optim.Optimizer, bad: torch.Tensor) -> None:
    """optimizer.step(), skipped where the 0-dim flag `bad` is true. A fused optimizer (AdamW/Adam
    fused=True, the trainer's on GPUs) skips on the device through its `found_inf` input, as under
    GradScaler: no host read. Otherwise the host reads the flag: on the CPU that is a memory read;
    a non-fused optimizer on a GPU pays one deliberate sync per step here."""
    if optimizer.defaults.get("fused"):
        optimizer.found_inf = bad.to(torch.float32).reshape(())
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
    elif not bool(bad):   # CPU: no device to wait for; GPU + non-fused: the deliberate sync above
        optimizer.step()
