"""The launcher/rank hand-off, shared by dflash.launch and the ranks so neither imports the other: the
config through a gate (ENV_GATE_FD) once the preflight passed, and the rendezvous store, whose socket
rank 0 inherits bound on loopback (TCPStore's own server binds every interface).
"""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import sys
import threading
import time
from datetime import timedelta

from dflash.config import ConfigError

ENV_STORE_FD = "DFLASH_STORE_FD"
"""The listening socket the launcher bound for rank 0's store: its file descriptor in rank 0."""
ENV_GATE_FD = "DFLASH_GATE_FD"
"""The read end of a rank's gate: the run's config arrives there once the preflight passed."""
RUN_UMASK = 0o077
"""Files a run writes are readable by this user only (README, "Security: what a run exposes")."""
# A rank that has waited this long at the rendezvous (or half the timeout) says what it waits for.
_ANNOUNCE_AFTER_S = 15.0


class RendezvousError(RuntimeError):
    """The ranks did not all join in time: one line saying where, and how many came."""


@contextlib.contextmanager
def long_lived():
    """For allocations that live as long as the process (the heavy imports): the cyclic collector is off
    inside, and what is alive at the end is frozen (gc.freeze), so no later pass walks those objects."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was:
            gc.enable()


def write_gate(fd: int, data: bytes) -> None:
    """Launcher side: the config into one rank's gate, then close it (a rank gone is the supervisor's)."""
    try:
        with os.fdopen(fd, "wb") as gate:
            gate.write(data)
    except BrokenPipeError:   # the file is closed all the same
        pass


def read_gate(environ=os.environ) -> bytes:
    """Rank side: the config the launcher wrote into this rank's gate (b"" if the preflight failed).
    ConfigError when this process has no gate (a rank started by hand)."""
    fd = environ.get(ENV_GATE_FD, "")
    try:
        with os.fdopen(int(fd), "rb") as gate:
            return gate.read()
    except (ValueError, OSError) as e:
        raise ConfigError(f"a rank process reads its config from the launcher's gate ({ENV_GATE_FD}={fd!r}: "
                          f"{getattr(e, 'strerror', None) or 'not set'}); run dflash-train, or torchrun -m dflash.cli"
                          ) from None


def rendezvous_store(rank: int, world: int, timeout_s: float):
    """The store a rank passes to init_process_group once all `world` ranks joined (None under
    torchrun: its agent's store); RendezvousError after `timeout_s`."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None
    addr, port = _master_address()
    where = f"{addr}:{port}"
    waits_for = (f"all {world} ranks (WORLD_SIZE) to join at {where}" if rank == 0
                 else f"rank 0's rendezvous store at {where} (MASTER_ADDR:MASTER_PORT)")
    announce = threading.Timer(min(_ANNOUNCE_AFTER_S, timeout_s / 2), lambda: print(
        f"dflash-train: rank {rank}: waiting up to {timeout_s:g} s for {waits_for}", file=sys.stderr, flush=True))
    announce.daemon = True
    announce.start()
    try:
        store = (_serve_store(addr, port, world, timeout_s) if rank == 0
                 else _join_store(addr, port, world, timeout_s))
    finally:
        announce.cancel()
    # Process-group set-up may wait on a slow rank's model load: torch's default timeout from here.
    store.set_timeout(timedelta(minutes=30))
    return store


def _master_address() -> tuple[str, int]:
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    if not addr or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"MASTER_ADDR={addr!r} MASTER_PORT={port!r}: ranks started by hand (RANK and "
                          "WORLD_SIZE set) need rank 0's address and a TCP port")
    return addr, int(port)


def _serve_store(addr: str, port: int, world: int, timeout_s: float):
    """Rank 0: the store's server on the launcher's loopback socket, else on MASTER_ADDR alone."""
    import torch.distributed

    fd = os.environ.get(ENV_STORE_FD)
    try:
        listener = socket.socket(fileno=int(fd)) if fd else socket.create_server((addr, port), backlog=128)
    except OSError as e:
        raise ConfigError(f"MASTER_ADDR:MASTER_PORT {addr}:{port}: cannot listen there ({e.strerror})") from None
    try:
        return torch.distributed.TCPStore(addr, port, world, True, timeout=timedelta(seconds=timeout_s),
                                          wait_for_workers=True, master_listen_fd=listener.detach())
    except torch.distributed.DistError as e:  # "... 1/2 clients joined."
        raise RendezvousError(f"rendezvous at {addr}:{port}: {str(e).splitlines()[0]} "
                              f"(WORLD_SIZE={world}, --rendezvous-timeout-s {timeout_s:g})") from None


def _join_store(addr: str, port: int, world: int, timeout_s: float):
    """Other ranks: wait (quietly, in Python) until rank 0 listens, then join its store."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((addr, port), timeout=1.0).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise RendezvousError(f"rendezvous at {addr}:{port}: nothing listened there within "
                                      f"{timeout_s:g} s (--rendezvous-timeout-s)") from None
            time.sleep(0.5)
    left_s = max(1.0, deadline - time.monotonic())
    import torch.distributed

    try:
        return torch.distributed.TCPStore(addr, port, world, False, timeout=timedelta(seconds=left_s))
    except torch.distributed.DistError as e:
        raise RendezvousError(f"rendezvous at {addr}:{port}: {str(e).splitlines()[0]}") from None
