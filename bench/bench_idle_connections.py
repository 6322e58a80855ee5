"""Training while another process holds idle connections to the metrics ports (issue 34 row 9): the drafter's
steady tokens/s of a run whose two ranks' ports hold `--connections` idle TCP connections the whole time (each
one the server closes is opened again), against the same run without them, in ABBA pairs (bench/overhead_ab.py's
pairing and summary), with the most threads its training processes had at any time.

    python3 bench/bench_idle_connections.py [--pairs 3] [--connections 1000] [-- DFLASH-TRAIN ARGS...]
"""
from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

import common
from overhead_ab import DEFAULT_TRAIN, drafter_tokens_per_s, run_pair, summary_line

ROUND_S = 5.0


def free_base_port() -> int:
    """A port P with P and P + 1 free on 127.0.0.1 (one per local rank)."""
    for _ in range(100):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            base = a.getsockname()[1]
            with socket.socket() as b:
                if b.connect_ex(("127.0.0.1", base + 1)) != 0:
                    return base
    raise RuntimeError("no two adjacent free ports")


def hold_idle(ports: list[int], count: int, stop: threading.Event) -> None:
    """Keep `count` connections open across `ports`, sending nothing; every ROUND_S reopen those the server
    closed (it serves 16 at once and drops one idle for 5 s)."""
    conns: list = [None] * count
    while not stop.is_set():
        for i, c in enumerate(conns):
            if c is not None:
                try:
                    if c.recv(1, socket.MSG_DONTWAIT) == b"":
                        c.close()
                        conns[i] = None
                except BlockingIOError:
                    continue
                except OSError:
                    c.close()
                    conns[i] = None
            if conns[i] is None:
                with_port = ports[i % len(ports)]
                try:
                    conns[i] = socket.create_connection(("127.0.0.1", with_port), timeout=0.2)
                except OSError:
                    pass   # the rank has not bound its port yet, or refused: tried again next round
        stop.wait(ROUND_S)
    for c in conns:
        if c is not None:
            c.close()


def run_with(connections: int):
    """A overhead_ab `run` callable: arm args starting with `idle` train under `connections` idle ones."""
    def run(args: list[str], run_dir: Path) -> float:
        idle = args[:1] == ["idle"]
        port = free_base_port()
        stop, most = threading.Event(), [0]
        proc = common.train(run_dir, ["--metrics-port", port, *args[1:]], wait=False,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        holder = threading.Thread(target=hold_idle, args=([port, port + 1], connections, stop), daemon=True)
        if idle:
            holder.start()
        while proc.poll() is None:
            try:
                most[0] = max(most[0], max((c.num_threads() for c in psutil.Process(proc.pid).children()),
                                           default=0))
            except psutil.Error:
                pass
            time.sleep(0.5)
        stop.set()
        print(f"    most threads in a rank: {most[0]}", flush=True)
        if proc.returncode != 0:
            raise RuntimeError(f"dflash-train exited {proc.returncode} in {run_dir}")
        return drafter_tokens_per_s(run_dir)
    return run


def main() -> int:
    cut = sys.argv.index("--") if "--" in sys.argv else len(sys.argv)
    ap = common.parser(__doc__)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--connections", type=int, default=1000)
    a = ap.parse_args(sys.argv[1:cut])
    train = sys.argv[cut + 1:] or list(DEFAULT_TRAIN)
    work = Path(tempfile.mkdtemp(prefix="idle-conn-"))
    arms = [("idle", ["idle", *train]), ("none", ["none", *train])]
    ratios = [run_pair(f"pair{i}", arms, i % 2 == 1, work, run_with(a.connections), False)
              for i in range(a.pairs)]
    print(f"dflash-train {' '.join(train)}; {a.connections} idle connections")
    print(summary_line(f"with/without {a.connections} idle connections (drafter steady tokens/s)", ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
