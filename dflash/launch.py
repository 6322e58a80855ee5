"""Launch one worker process per rank on this host (what torchrun would do, minus the elasticity),
forward SIGINT/SIGTERM to them, and stop everyone as soon as one rank fails."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from dflash.config import ConfigError, TrainConfig
from dflash.worker import resolve_topology

# After a rank fails, how long the others get to exit on SIGTERM before SIGKILL.
_GRACE_SECONDS = 10.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plan_world(cfg: TrainConfig) -> int:
    """How many ranks this host runs: CPU one of each role unless told; GPUs one per device."""
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if cfg.target_gpus is not None and cfg.drafter_gpus is not None:
        world = cfg.target_gpus + cfg.drafter_gpus
    elif use_cuda:
        world = max(2, torch.cuda.device_count())
    else:
        world = (cfg.target_gpus or 1) + (cfg.drafter_gpus or 1)
    resolve_topology(cfg, world, torch.cuda.device_count() if use_cuda else 0)  # validates the split
    return world


def launch(cfg: TrainConfig) -> int:
    if cfg.resume and cfg.run_dir is None:
        raise ConfigError("--resume: needs --run-dir naming the run to continue")
    if cfg.resume and not (Path(cfg.run_dir) / "checkpoints" / "latest").is_file():
        raise ConfigError(f"--resume: no checkpoint in {Path(cfg.run_dir) / 'checkpoints'}")
    world = plan_world(cfg)
    if cfg.run_dir is None:
        cfg.run_dir = time.strftime("runs/%Y%m%d-%H%M%S")
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(world),
               LOCAL_WORLD_SIZE=str(world), DFLASH_CONFIG_JSON=json.dumps(cfg.to_dict()),
               PYTHONUNBUFFERED="1")
    procs = [subprocess.Popen([sys.executable, "-m", "dflash.worker"],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)))
             for r in range(world)]
    forwarded: list[int] = []

    def forward(signum, frame):
        forwarded.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _supervise(procs)
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _supervise(procs: list[subprocess.Popen]) -> int:
    """Wait for all ranks; the first non-zero exit stops the rest and decides the exit code."""
    while True:
        codes = [p.poll() for p in procs]
        failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            rank, code = failed[0]
            _stop_all(procs)
            print(f"dflash-train: rank {rank} exited with code {code}; stopped the other ranks",
                  file=sys.stderr)
            return 2 if code == 2 else 1
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.2)


def _stop_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + _GRACE_SECONDS
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
