"""Launch one worker process per rank on this host (torchrun minus the elasticity), forward SIGINT and
SIGTERM to them, and stop everyone as soon as one rank fails. Loopback only: the store's socket is
bound to 127.0.0.1 here, and GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME default to `lo`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

from dflash import startup
from dflash.cli_output import ENV_INVOKED_AS
from dflash.compile_cache import bytecode_env
from dflash.config import TrainConfig
from dflash.run_lock import hold_run_dir
from dflash.handoff import ENV_GATE_FD, ENV_STORE_FD, RUN_UMASK, long_lived, write_gate

# After a rank fails (or a second signal), how long the others get to exit before SIGKILL.
_GRACE_SECONDS = 3.0
_REPEAT_SECONDS = 1.2
"""After a rank fails, the others get a second SIGTERM this long after the first: a rank stops at once, with its
dump and run_end, on a second signal a second or more after its first (dflash.worker._forensics), where the
first alone gives it --stop-timeout-s to finish its step."""


_SECOND_SIGNAL_SECONDS = 1.0
"""A second SIGINT/SIGTERM to the launcher escalates (SIGKILL `_GRACE_SECONDS` later) only this long or more after
the first, as a rank's own second signal does (profiler.watchdog.SignalWatch's repeat_after_s)."""


def world_for(cfg: TrainConfig, gpus: int) -> int:
    """How many ranks this host runs: CPU one of each role unless told; GPUs one per device."""
    if cfg.parallel.target_gpus is not None and cfg.parallel.drafter_gpus is not None:
        return cfg.parallel.target_gpus + cfg.parallel.drafter_gpus
    if gpus > 0:
        return max(2, gpus)
    return (cfg.parallel.target_gpus or 1) + (cfg.parallel.drafter_gpus or 1)


def threads_env(gpus: int, environ=os.environ) -> dict:
    """A CPU run's ranks share the host's cores: OpenMP's threads wait asleep (OMP_WAIT_POLICY=PASSIVE)
    rather than spin on the others' cores. Read once when torch loads; a value the user set is kept."""
    return {"OMP_WAIT_POLICY": "PASSIVE"} if gpus == 0 and "OMP_WAIT_POLICY" not in environ else {}


def cuda_driver_device_count() -> int:
    """cuInit + cuDeviceGetCount from libcuda.so.1; 0 without a driver or a device."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


def launch(cfg: TrainConfig, started_ns: int | None = None) -> int:
    """One worker process per rank, each behind a gate: the ranks import while this process runs the
    preflight, and get the config once it passed; on bad input they are killed and the ConfigError goes up."""
    started_ns = started_ns or time.time_ns()
    from dflash import preflight   # no torch: its path and directory checks answer before a rank starts

    preflight.check_early(cfg)
    # torch_gpus without importing torch (the CUDA driver's count): a guess checked below.
    gpus = 0 if cfg.parallel.device == "cpu" else cuda_driver_device_count()
    bytecode = use_bytecode_cache(bytecode_env(cfg.model.bytecode_cache, cfg.model.compile_cache_dir))
    ranks = GatedRanks(world_for(cfg, gpus), started_ns, {**bytecode, **threads_env(gpus)})
    try:
        with long_lived():   # the launcher's heavy imports (torch), side by side with the ranks'
            planned = preflight.torch_gpus(cfg)
            world = world_for(cfg, planned)
            preflight.check(cfg, world, world, gpus=planned)
        if (world, planned > 0) != (world_for(cfg, gpus), gpus > 0):
            ranks.abort()              # the driver and torch disagree (a CPU-only torch): start again
            ranks = GatedRanks(world, started_ns, {**bytecode, **threads_env(planned)})
        if cfg.run_dir is None:
            cfg.run_dir = time.strftime("runs/%Y%m%d-%H%M%S")
        lock_fd = hold_run_dir(cfg.run_dir)   # one run per directory, until the ranks are done
        try:
            procs = ranks.open(cfg)
        except BaseException:
            os.close(lock_fd)
            raise
    except BaseException:
        ranks.abort()
        raise
    supervisor = Supervisor(procs)
    old = {s: signal.signal(s, supervisor.forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return supervisor.run()
    finally:
        os.close(lock_fd)
        for s, h in old.items():
            signal.signal(s, h)


def use_bytecode_cache(changes: dict) -> dict:
    """Apply `bytecode_env`'s changes to this process too, so the preflight's imports share the cache."""
    if changes:
        sys.pycache_prefix = changes["PYTHONPYCACHEPREFIX"]
        sys.dont_write_bytecode = False
    return changes


class GatedRanks:
    """`world` worker processes, each blocked at its gate (a pipe) after its imports until open() writes
    the config there or abort() kills them; rank 0 gets the store's socket, bound here on loopback."""

    def __init__(self, world: int, started_ns: int, env_changes: dict | None = None):
        store_socket = socket.create_server(("127.0.0.1", 0), backlog=max(128, world))
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store_socket.getsockname()[1]),
                   WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), PYTHONUNBUFFERED="1",
                   **{startup.ENV_LAUNCH_NS: str(started_ns),
                      ENV_INVOKED_AS: os.environ.get(ENV_INVOKED_AS) or sys.argv[0]})   # its printed commands
        # A change to None removes the variable.
        env = {var: value for var, value in {**env, **(env_changes or {})}.items() if value is not None}
        for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            env.setdefault(var, "lo")  # unless the user named an interface
        self.procs: list[subprocess.Popen] = []
        self.gates: list[int] = []
        try:
            for rank in range(world):
                read_fd, write_fd = os.pipe()
                self.gates.append(write_fd)
                try:
                    self.procs.append(_spawn(env, rank, store_socket if rank == 0 else None, read_fd))
                finally:
                    os.close(read_fd)
        except BaseException:
            self.abort()
            raise
        finally:
            store_socket.close()  # rank 0 holds its own copy

    def open(self, cfg: TrainConfig) -> list[subprocess.Popen]:
        """Send every rank the config (a rank already gone, e.g. a failed import, is the supervisor's)."""
        data = json.dumps(cfg.to_dict()).encode()
        for fd in self.gates:
            write_gate(fd, data)
        self.gates = []
        return self.procs

    def abort(self) -> None:
        _kill_live(self.procs)
        for fd in self.gates:
            os.close(fd)
        self.gates = []


def _spawn(env: dict, rank: int, store_socket: socket.socket | None, gate_fd: int) -> subprocess.Popen:
    env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), **{ENV_GATE_FD: str(gate_fd)})
    fds: tuple = (gate_fd,)
    if store_socket is not None:
        fds += (store_socket.fileno(),)
        env[ENV_STORE_FD] = str(store_socket.fileno())
    return subprocess.Popen([sys.executable, "-m", "dflash.rank"], env=env, pass_fds=fds, umask=RUN_UMASK)


class Supervisor:
    """Waits for all ranks; the first non-zero exit stops the rest (SIGTERM, SIGKILL after `grace_s`)
    and decides the exit code. Signals are forwarded; a second one `repeat_after_s` or more after the first also
    SIGKILLs `grace_s` later (sooner, it is the same Ctrl-C or a double press: the clean stop goes on)."""

    def __init__(self, procs: list[subprocess.Popen], grace_s: float = _GRACE_SECONDS, clock=time.monotonic,
                 poll_s: float = 0.1, stderr=None, repeat_after_s: float = _SECOND_SIGNAL_SECONDS):
        self.procs, self.grace_s, self.clock, self.poll_s = procs, grace_s, clock, poll_s
        self.stderr, self.repeat_after_s = stderr, repeat_after_s
        self.first_signal_s: float | None = None
        self.kill_at_s: float | None = None

    def forward(self, signum, frame=None) -> None:
        now = self.clock()
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signum)  # the signal received, so the run records which one it was
        if self.first_signal_s is None:
            self.first_signal_s = now
        elif now - self.first_signal_s >= self.repeat_after_s and self.kill_at_s is None:
            self.kill_at_s = now + self.grace_s

    def run(self) -> int:
        while True:
            codes = [p.poll() for p in self.procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                self.stop_all()
                if code not in (1, 2):  # 1 and 2: the rank has said why itself
                    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
                    print(f"dflash-train: rank {rank} {how}; stopped the other ranks", file=self.stderr or sys.stderr)
                # Bad input found by any rank decides, even when a rank that lost it as a peer exited first.
                return 2 if 2 in [p.returncode for p in self.procs] else 1
            if all(c == 0 for c in codes):
                return 0
            if self.kill_at_s is not None and self.clock() >= self.kill_at_s:
                _kill_live(self.procs)
            time.sleep(self.poll_s)

    def stop_all(self) -> None:
        """After a failure: SIGTERM, a second one `_REPEAT_SECONDS` later (within the grace), then SIGKILL."""
        start = self.clock()
        repeat_at = start + _REPEAT_SECONDS if _REPEAT_SECONDS < self.grace_s else None
        self._signal_live(signal.SIGTERM)
        while any(p.poll() is None for p in self.procs) and self.clock() < start + self.grace_s:
            if repeat_at is not None and self.clock() >= repeat_at:
                repeat_at = None
                self._signal_live(signal.SIGTERM)
            time.sleep(self.poll_s / 2)
        for rank, p in enumerate(self.procs):
            if p.poll() is None:   # it could not stop itself: say why its log ends without a run_end
                why = ("was stopped (SIGSTOP, or a debugger: process state T) and made no progress"
                       if _proc_state(p.pid) in ("T", "t") else f"did not end within {self.grace_s:.0f} s of SIGTERM")
                print(f"dflash-train: rank {rank} (pid {p.pid}) {why}: killed, so its log ends without a run_end",
                      file=self.stderr or sys.stderr)
        _kill_live(self.procs)

    def _signal_live(self, signum: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signum)


def _proc_state(pid: int) -> str | None:
    """The process's state letter from /proc (R, S, D, T stopped, t traced, Z), None where unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _kill_live(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
