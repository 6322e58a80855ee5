"""Profiling on vs `--no-profile`: a paired A/B of whole `dflash-train` runs that can resolve 1%.

    python3 bench/ab_profile.py [--workload launch|gpu|both] [--pairs 8] [--steps N] [--budget-s S]
                                [--device auto|cuda|cpu] [--small] [--workdir DIR] [--json FILE]

Each run is `python -m dflash.cli` (the interpreter running this script, with this checkout first on
PYTHONPATH; no console script needed) in a fresh run directory, with the same arguments in both arms
except `--no-profile`. Each rank's meter writes RUN_DIR/throughput/rank{R}.json with or without the
profiler; the metric is `tail_tokens_per_s` of rank 0 (the drafter) unless --metric/--rank say otherwise.

Workloads:
- `launch`: the built-in tiny target (hidden 128, many small kernels): bound by the host's kernel
  launches and Python, so per-step CPU work of the profiler shows fully.
- `gpu`: a random Qwen3-shaped target made here (hidden 2048, 12 layers, bf16 on CUDA) on long synthetic
  conversations, 2 x 2048 tokens per batch and 512 anchors per sequence, 2 drafter layers: tens of ms of
  GPU work per step, so host-side costs hide behind the device and only device-side ones remain.
  The target and corpus are made once under the workdir and reused by every run.
`--small` shrinks both to CPU sizes (a smoke test: it says nothing about 1%).

What the harness controls, because run-to-run spread (+-10% seen on the H200) swamps a 1% effect:
- Pairs in alternating order (on/off for even pairs, off/on for odd: ABBA...), so a drift over the
  session (clocks, temperature, page cache, other tenants) hits both arms alike, and the statistic
  is the per-pair ratio, not a difference of two arm means.
- Warm-up run(s) first, discarded: they build the built-in target and corpus and fill the compile
  caches. Every run shares one compile cache (--compile-cache, default WORKDIR/compile-cache): passed
  as the trainer's `--compile-cache-dir` when this checkout has that flag, else as
  TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR (unless the caller set them).
- The built-in target and corpus of the warm-up run are copied into every later run directory, so
  no run regenerates them (the trainer reuses a matching build) and the page cache holds them.
- Identical environment for both arms (PYTHONHASHSEED=0, the caches above), fixed `--seed`, the same
  argument list; the order of the pair is the only other difference.
- The same CPU set for every run (`taskset -c`, default: the CPUs `nvidia-smi topo` lists for GPU 0,
  else all CPUs this process may use), so the scheduler's placement domain does not change by arm.
  With --pin-ranks each rank gets its own whole physical cores of that set, set on every thread as
  the rank starts (the trainer has no affinity option): two ranks' main threads then never share a
  core or its hyperthread sibling, one way a run can land in a slow mode. --one-cpu-per-core keeps one
  hyperthread per core, --no-aslr starts every run under `setarch -R`; on the H200 VM neither removed the
  launch workload's modes, which likely follow the vCPUs' own speed (bench/gpu/vcpu_pairs.py, bench/RESULTS.md).
- A cool-down sleep between runs (--cooldown-s), and the GPU's temperature, SM clock and power (and
  the host's load average) recorded before each run, so a drift is visible in the JSON.
- `--profile-interval 5` by default in both arms (ignored with --no-profile): the on arm closes
  intervals (allocator stats, metric read-back, trace, exporters, console) inside the measured tail.
  The users' default (60 s) costs less per second; 5 s is the stricter test.
- The end-of-run evaluation is off (`--eval-prompts 0`): it comes after the meter and only costs time.

Statistics (stdlib only, profiler/abstats.py, shared with `dflash-profile overhead`): per arm n, mean,
median, coefficient of variation; per pair the ratio on/off; the mean paired difference as the geometric
mean ratio minus 1, with a 95% paired t interval from the per-pair log ratios. "resolves 1%" is yes when
the interval's half-width is at most 1%. "on within 1% of off" is one-sided, since the question is the
profiler's cost: yes when the interval's lower end is at or above -1%, no when its upper end is below
-1%, otherwise (or with fewer than 2 pairs) undetermined.

How many pairs: the interval's half-width is t(n-1) * sd / sqrt(n), sd being the spread of the per-pair
log ratios (`sd_log_ratio` in the JSON). Resolving 1% takes 4 pairs at sd 0.5%, 7 at 1%, 12 at 1.5%,
18 at 2% and 38 at 3%. `--budget-s` (per workload) stops starting pairs when the next would end past
it; the first pair always runs. A run costs its start-up (imports, process groups, loading, compile
from the cache) on top of its steps, and the tail (the meter's last half) is what is compared. The
tail must still span several profile intervals, or whether an interval's close falls inside it decides
the on arm's value: after the warm-up, --tail-seconds (15) raises the steps to match the warm-up's
rate (a 150-step launch run on the H200 had a 1.8 s tail, and pairs spread +-11%).
The on runs' `profiler_share` (the interval records' CPU of the profiler's threads over wall time) is
read back and summarised: the background cost, measured directly rather than by the difference.

Output: a table per workload and the machine (GPU, torch, date) on stdout, a progress line per run,
and a JSON rewritten after every run ($OUT/ab_profile.json when $OUT is set, else under the workdir),
so a timeout still leaves every finished run. Needs no GPU: `--device cpu --small` runs anywhere.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))   # the checkout's profiler package, run from anywhere
from profiler.abstats import (DEFAULT_LEVEL, THRESHOLD_PCT, arm_stats, incomplete_beta,  # noqa: E402,F401
                              paired_stats, t_cdf, t_quantile, verdicts)


# ------------------------------------------------------------------------------------------- machine
def _command_output(argv: list[str], timeout_s: float = 20.0, env: dict | None = None) -> str | None:
    """A command's stdout, or None when it is missing or fails."""
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def machine_info(env: dict) -> dict:
    """Date, host, CPUs and NUMA nodes, GPU (nvidia-smi), torch and the checkout's commit, for the report's
    header."""
    from ab_probe import numa_nodes

    probe = ("import json, torch; c = torch.cuda.is_available(); print(json.dumps({'torch': torch.__version__, "
             "'cuda': torch.version.cuda, 'gpu_count': torch.cuda.device_count() if c else 0, "
             "'device_name': torch.cuda.get_device_name(0) if c else None}))")
    torch_info = _command_output([sys.executable, "-c", probe], timeout_s=120, env=env)
    smi = _command_output(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
                           "--format=csv,noheader"])
    commit = _command_output(["git", "-C", str(REPO), "rev-parse", "HEAD"])
    dirty = _command_output(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"])
    return {"date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host": os.uname().nodename,
            "cpu_count": os.cpu_count(), "cpus_allowed": len(os.sched_getaffinity(0)),
            "python": sys.version.split()[0], "torch": json.loads(torch_info) if torch_info else None,
            "gpus": smi.splitlines() if smi else [], "commit": commit, "numa_nodes": numa_nodes(),
            "cores": len(core_groups(sorted(os.sched_getaffinity(0)))),
            "tree_modified": bool(dirty) if dirty is not None else None}


def gpu_state() -> dict:
    """GPU temperature, SM clock and power now, and the host's load average: recorded per run."""
    state: dict = {"loadavg_1m": os.getloadavg()[0]}
    smi = _command_output(["nvidia-smi", "--query-gpu=temperature.gpu,clocks.sm,power.draw,utilization.gpu",
                           "--format=csv,noheader,nounits"], timeout_s=10)
    if smi:
        fields = [f.strip() for f in smi.splitlines()[0].split(",")]
        state.update(zip(("temperature_c", "sm_clock_mhz", "power_w", "util_percent"), fields))
    return state


def pick_cpus(spec: str) -> list[int] | None:
    """The CPU set every run is pinned to: `none`, a taskset-style list ("0-7,12"), or `auto` (GPU 0's
    CPU affinity from `nvidia-smi topo -m`, else every CPU this process may use)."""
    if spec == "none":
        return None
    allowed = sorted(os.sched_getaffinity(0))
    if spec != "auto":
        return _parse_cpu_list(spec)
    topo = re.sub(r"\x1b\[[0-9;]*m", "", _command_output(["nvidia-smi", "topo", "-m"], timeout_s=10) or "")
    header = next((line.split("\t") for line in topo.splitlines() if "CPU Affinity" in line), None)
    row = next((line.split("\t") for line in topo.splitlines() if line.startswith("GPU0")), None)
    if header and row and len(row) > header.index("CPU Affinity"):
        try:
            cpus = [c for c in _parse_cpu_list(row[header.index("CPU Affinity")].strip()) if c in allowed]
        except ValueError:   # "N/A"
            cpus = []
        if cpus:
            return cpus
    return allowed


def _parse_cpu_list(text: str) -> list[int]:
    """"0-3,8" -> [0, 1, 2, 3, 8]; ValueError on anything else."""
    from ab_probe import parse_cpu_list
    return parse_cpu_list(text)


# ----------------------------------------------------------------------------------------- workloads
@dataclass
class Workload:
    """One workload: its dflash-train arguments (besides run dir, steps and --no-profile) and what the
    workdir must hold first."""
    name: str
    steps: int
    flags: list
    target_shape: dict | None = None
    """Qwen3Config fields of a random target to make (None: the built-in tiny target)."""
    corpus: dict = field(default_factory=dict)
    """make_long_corpus arguments for the random target's data."""


GPU_SHAPE = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=12, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=32768, max_position_embeddings=4096,
                 rope_theta=1_000_000.0)
SMALL_SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, vocab_size=256, max_position_embeddings=1024,
                   rope_theta=1_000_000.0)


def make_workload(name: str, small: bool, steps: int | None, conversations: int | None = None) -> Workload:
    """The `launch` or `gpu` workload, full size or `small` (CPU smoke test); `conversations`: the
    built-in corpus's size (default: the trainer's, 64 when small)."""
    if name == "launch":
        conversations = conversations or (64 if small else None)
        flags = ["--builtin-conversations", str(conversations)] if conversations else []
        return Workload("launch", steps or (16 if small else 300), flags)
    length, batch, anchors = (128, 512, 16) if small else (2048, 4096, 512)
    flags = ["--max-length", str(length), "--tokens-per-batch", str(batch), "--num-anchors", str(anchors),
             "--num-draft-layers", "1" if small else "2", "--warmup-steps", "2"]
    return Workload("gpu", steps or (12 if small else 150), flags, SMALL_SHAPE if small else GPU_SHAPE,
                    {"n": 64 if small else 200, "words_per_turn": length})


MAKE_TARGET = """
import json, os, shutil, sys, torch
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.utils import logging
from dflash.tiny import build_tiny_tokenizer
out, shape = sys.argv[1], json.loads(sys.argv[2])
logging.disable_progress_bar()
tok = build_tiny_tokenizer()
cfg = Qwen3Config(**shape, tie_word_embeddings=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
torch.manual_seed(0)
with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
    model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
tmp = out + ".tmp"
shutil.rmtree(tmp, ignore_errors=True)
model.save_pretrained(tmp, safe_serialization=True)
tok.save_pretrained(tmp)
os.replace(tmp, out)
print(f"made {out}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f} M parameters")
"""


def prepare_workload(wl: Workload, workdir: Path, env: dict) -> list[str]:
    """Make the random target and corpus once (kept under the workdir, reused by later calls) and
    return the arguments that point the trainer at them; nothing for the built-in target."""
    if wl.target_shape is None:
        return []
    key = "-".join(f"{v}" for v in wl.target_shape.values())
    target = workdir / f"target-{key}"
    if not (target / "config.json").is_file():
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", MAKE_TARGET, str(target), json.dumps(wl.target_shape)],
                       check=True, env=env, cwd=REPO)
        print(f"[{wl.name}] target made in {time.perf_counter() - t0:.0f} s", flush=True)
    data = workdir / f"corpus-{wl.corpus['n']}x{wl.corpus['words_per_turn']}.jsonl"
    if not data.is_file():
        sys.path.insert(0, str(REPO / "bench"))
        from bench_pipeline import make_long_corpus   # one word = one token of the tiny tokenizer
        make_long_corpus(data, wl.corpus["n"], words_per_turn=wl.corpus["words_per_turn"])
    return ["--target-model", str(target), "--data", str(data)]


# ---------------------------------------------------------------------------------------------- runs
@dataclass
class Setup:
    """What every run of a session shares: interpreter environment, CPU set, trainer flags."""
    env: dict
    cpus: list | None
    common: list
    """Arguments both arms get (device, seed, interval, cache flag, --extra)."""
    metric: str
    rank: int
    cooldown_s: float
    run_timeout_s: float
    keep_runs: bool
    workdir: Path
    pin_ranks: bool = False
    """Give each rank its own share of `cpus` (whole physical cores), set as the ranks start."""
    tail_seconds: float = 0.0
    """Size the measured runs' steps from the warm-up so the meter's tail lasts this long (0: keep)."""
    probe: str = ""
    """Shell command run against rank `rank` of every measured run (bench/ab_probe.py); "" = none."""
    probe_after_s: float = 25.0
    """Seconds from a run's launch to its probe."""
    no_aslr: bool = False
    """Start every run under `setarch -R`: the same address-space layout in every run and arm."""


def base_env(cache_dir: Path | None) -> dict:
    """The environment of every run: this checkout first on PYTHONPATH, a fixed hash seed, and, when
    `cache_dir` is given (a trainer without --compile-cache-dir), the compile caches under it unless
    the caller set them."""
    env = dict(os.environ, PYTHONHASHSEED="0", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    if cache_dir is not None:
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir / "inductor"))
        env.setdefault("TRITON_CACHE_DIR", str(cache_dir / "triton"))
    return env


def trainer_has_flag(flag: str, env: dict) -> bool:
    """Whether this checkout's dflash-train knows `flag` (its --help lists every config field)."""
    text = _command_output([sys.executable, "-m", "dflash.cli", "--help"], timeout_s=120, env=env) or ""
    return flag in text.split()


def train_argv(setup: Setup, run_dir: Path, args: list[str], arm: str) -> list[str]:
    """The command line of one run: the same in both arms but for --no-profile."""
    argv = [sys.executable, "-m", "dflash.cli", "--run-dir", str(run_dir), *setup.common, *args]
    if arm == "off":
        argv.append("--no-profile")
    if setup.no_aslr:
        argv = ["setarch", platform.machine(), "-R", *argv]
    if setup.cpus and shutil.which("taskset"):   # without taskset, only --pin-ranks narrows the ranks
        argv = ["taskset", "-c", ",".join(map(str, setup.cpus)), *argv]
    return argv


def read_metric(run_dir: Path, rank: int, metric: str) -> tuple[float | None, dict]:
    """The metric from RUN_DIR/throughput/rank{R}.json, and the whole file (empty when absent)."""
    path = run_dir / "throughput" / f"rank{rank}.json"
    try:
        meter = json.loads(path.read_text())
    except (OSError, ValueError):
        return None, {}
    value = meter.get(metric)
    return (float(value) if isinstance(value, (int, float)) else None), meter


METER_WARM_STEPS = 5   # dflash.roles: the meter starts after min(5, max_steps // 4) steps


def read_profiler_share(run_dir: Path, rank: int) -> float | None:
    """The profiler's and its exporters' threads' CPU over wall time in the run's intervals (the
    interval records' `profiler_share`, weighted by duration), or None (an off run, an older trainer)."""
    busy = wall = 0.0
    try:
        lines = (run_dir / "profile" / f"rank{rank}.jsonl").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("type") == "interval" and rec.get("profiler_share") is not None:
            busy += rec["profiler_share"] * rec["duration_seconds"]
            wall += rec["duration_seconds"]
    return busy / wall if wall > 0 else None


def tail_steps_per_s(meter: dict) -> float | None:
    """The steps per second of the meter's tail (its tokens/s over the run's tokens per step), or None."""
    try:
        return meter["tail_tokens_per_s"] / (meter["tokens"] / meter["steps"]) if meter["tail_steps"] else None
    except (KeyError, TypeError, ZeroDivisionError):
        return None


def steps_for_tail(meter: dict, tail_seconds: float, minimum: int) -> int | None:
    """--max-steps whose tail (the meter's second half, after its warm steps) lasts about `tail_seconds`
    at the rate of the run the meter measured; None when it measured no tail."""
    steps_per_s = tail_steps_per_s(meter)
    if not steps_per_s:
        return None
    return max(minimum, int(2 * tail_seconds * steps_per_s) + METER_WARM_STEPS)


def seed_builtin(run_dir: Path, builtin: Path | None) -> None:
    """A fresh run directory, holding a copy of the built-in target and corpus when one exists (a few
    MB; copies, not links, since the trainer rewrites its marker files in place when they differ)."""
    run_dir.mkdir(parents=True)
    if builtin is not None and builtin.is_dir():
        shutil.copytree(builtin, run_dir / "builtin")


def core_groups(cpus: list[int]) -> list[list[int]]:
    """`cpus` grouped by physical core (hyperthread siblings together, from sysfs), in order."""
    from ab_probe import siblings

    groups, seen = [], set()
    for cpu in cpus:
        if cpu in seen:
            continue
        core = siblings(cpu)
        group = [c for c in cpus if c in core or c == cpu]
        seen.update(group)
        groups.append(group)
    return groups


def rank_cpu_sets(cpus: list[int], world: int) -> list[list[int]]:
    """Disjoint CPU sets, one per rank, of whole physical cores; [] when there are too few cores."""
    groups = core_groups(cpus)
    per = len(groups) // world if world > 0 else 0
    return [sum(groups[r * per:(r + 1) * per], []) for r in range(world)] if per else []


class RankPinner:
    """A thread that finds the launcher's rank processes (by RANK and WORLD_SIZE in their
    environment) as they start and sets every thread of rank r to its own CPU set. The ranks' threads
    made later inherit it; each rank is set again a second later for a thread made in between."""

    def __init__(self, launcher_pid: int, cpus: list[int], poll_s: float = 0.01, timeout_s: float = 120.0):
        self.launcher_pid, self.cpus, self.poll_s, self.timeout_s = launcher_pid, cpus, poll_s, timeout_s
        self.pinned: dict = {}     # rank -> CPUs
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ab.pinner", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)

    def _run(self) -> None:
        deadline, first_set, set_again, sets = time.monotonic() + self.timeout_s, {}, set(), None
        while not self._stop.wait(self.poll_s) and time.monotonic() < deadline:
            ranks = _rank_children(self.launcher_pid)
            for pid, rank, world in ranks:
                sets = rank_cpu_sets(self.cpus, world) if sets is None else sets
                if rank >= len(sets):   # too few cores for a set per rank: leave them all on `cpus`
                    continue
                if pid not in first_set:
                    _set_affinity(pid, sets[rank])
                    first_set[pid], self.pinned[rank] = time.monotonic(), sets[rank]
                elif pid not in set_again and time.monotonic() - first_set[pid] > 1.0:
                    _set_affinity(pid, sets[rank])
                    set_again.add(pid)
            if ranks and len(set_again) == ranks[0][2]:
                return


def _rank_children(pid: int) -> list[tuple[int, int, int]]:
    """(pid, rank, world size) of each child of `pid` that is a dflash rank."""
    try:
        children = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []
    out = []
    for child in children:
        try:
            env = dict(kv.split("=", 1) for kv in Path(f"/proc/{child}/environ").read_bytes().decode(
                errors="replace").split("\0") if "=" in kv)
            out.append((child, int(env["RANK"]), int(env["WORLD_SIZE"])))
        except (OSError, KeyError, ValueError):
            continue
    return out


def _set_affinity(pid: int, cpus: list[int]) -> None:
    """Every current thread of `pid` to `cpus` (a thread that just ended is skipped)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:
            pass


def run_once(setup: Setup, run_dir: Path, args: list[str], arm: str, probe: bool = False) -> dict:
    """One dflash-train run to completion (or --run-timeout-s): exit code, wall time, the metric, the
    machine state before it and, with `probe`, the probe's outcome. The run is its own process group,
    stopped with it on any exit."""
    state = gpu_state()
    log = run_dir.with_suffix(".log")
    t0 = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(train_argv(setup, run_dir, args, arm), stdout=out, stderr=subprocess.STDOUT,
                                env=setup.env, cwd=REPO, start_new_session=True)
        pinner = RankPinner(proc.pid, setup.cpus) if setup.pin_ranks and setup.cpus else None
        prober = _start_probe(setup, proc.pid, run_dir) if probe and setup.probe else None
        try:
            code = proc.wait(timeout=setup.run_timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            _stop_group(proc)
            if pinner is not None:
                pinner.stop()
            probed = prober.stop() if prober is not None else None
    value, meter = read_metric(run_dir, setup.rank, setup.metric)
    rec = {"arm": arm, "run_dir": str(run_dir), "exit": code, "wall_s": time.perf_counter() - t0,
           "value": value, "throughput": meter, "before": state,
           "profiler_share": read_profiler_share(run_dir, setup.rank)}
    if pinner is not None:
        rec["rank_cpus"] = pinner.pinned
    if probed is not None:
        rec["probe"] = probed
    if code != 0 or value is None:
        rec["log_tail"] = log.read_text(errors="replace")[-3000:]
    return rec


def _start_probe(setup: Setup, launcher_pid: int, run_dir: Path):
    """The probe of one run (bench/ab_probe.py), against rank `setup.rank` of the launcher's children."""
    from ab_probe import Probe

    def find_pid():
        return next((pid for pid, rank, _ in _rank_children(launcher_pid) if rank == setup.rank), None)
    return Probe(setup.probe, run_dir.with_suffix(".probe"), find_pid, setup.probe_after_s)


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to a run's process group (the trainer stops at a step boundary), SIGKILL 10 s later."""
    if proc.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait_s)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def tidy_run(run_dir: Path, keep: bool) -> None:
    """Drop a finished run's checkpoints and built-ins (gigabytes for the gpu workload); the
    throughput file, run log and config stay."""
    if not keep:
        for name in ("checkpoints", "builtin"):
            shutil.rmtree(run_dir / name, ignore_errors=True)


# -------------------------------------------------------------------------------------------- report
class Report:
    """Everything measured so far, rewritten (atomically) as JSON after every run."""

    def __init__(self, path: Path, header: dict):
        self.path, self.data = path, dict(header, workloads={})

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(self.data, indent=1) + "\n")
        tmp.replace(self.path)


def summarize(runs: list[dict]) -> dict:
    """Complete pairs only (both arms measured): per-arm stats, the paired comparison, the verdicts."""
    by_pair: dict = {}
    for r in runs:
        if "pair" in r and r["value"] is not None:
            by_pair.setdefault(r["pair"], {})[r["arm"]] = r["value"]
    pairs = sorted(p for p, arms in by_pair.items() if len(arms) == 2)
    on, off = [by_pair[p]["on"] for p in pairs], [by_pair[p]["off"] for p in pairs]
    paired = paired_stats(on, off)
    return {"pairs": pairs, "on": arm_stats(on), "off": arm_stats(off), "paired": paired,
            "verdict": verdicts(paired)}


def _pct(x: float | None, signed: bool = True) -> str:
    return "n/a" if x is None else (f"{x:+.2f}%" if signed else f"{x:.2f}%")


def format_summary(name: str, section: dict) -> str:
    """The workload's table: pairs, arms, the paired difference with its interval, the verdicts."""
    s, runs = section["summary"], section["runs"]
    lines = [f"== {name}: {section['metric']} of rank {section['rank']}, {section['steps']} steps, "
             f"{len(s['pairs'])} complete pairs (alternating order)", "| pair | order | on | off | on/off |",
             "|---|---|---|---|---|"]
    for p, ratio in zip(s["pairs"], s["paired"]["ratios"]):
        arms = [r for r in runs if r.get("pair") == p]
        value = {r["arm"]: r["value"] for r in arms}
        lines.append(f"| {p + 1} | {','.join(r['arm'] for r in arms)} | {value['on']:,.0f} | {value['off']:,.0f} "
                     f"| {ratio:.4f} |")
    lines += ["| arm | n | mean | median | CV |", "|---|---|---|---|---|"]
    for arm in ("on", "off"):
        a = s[arm]
        if a["n"]:
            cv = _pct(100 * a["cv"] if a["cv"] is not None else None, False)
            lines.append(f"| {arm} | {a['n']} | {a['mean']:,.0f} | {a['median']:,.0f} | {cv} |")
    p, v = s["paired"], s["verdict"]
    t = f", t={p['t_quantile']:.3f}" if p["t_quantile"] else ""
    lines.append(f"mean paired difference, on vs off: {_pct(p['mean_diff_pct'])} "
                 f"({100 * p['level']:.0f}% CI {_pct(p['ci_low_pct'])} .. {_pct(p['ci_high_pct'])}{t}, n={p['n']})")
    lines.append(f"resolves {v['threshold_pct']:g}%: {'yes' if v['resolves'] else 'no'} "
                 f"(CI half-width {_pct(p['half_width_pct'], False)})")
    lines.append(f"on within {v['threshold_pct']:g}% of off: {v['within']}")
    lines += _run_notes([r for r in runs if "pair" in r and r["value"] is not None])
    if v["on_faster_beyond_threshold"]:
        lines.append("note: on is faster than off beyond the threshold: the arms differ in something besides "
                     "the profiler")
    return "\n".join(lines)


def tail_seconds(meter: dict) -> float | None:
    """How long the meter's tail lasted (its steps at its rate), or None."""
    steps_per_s = tail_steps_per_s(meter)
    return meter["tail_steps"] / steps_per_s if steps_per_s else None


def _run_notes(runs: list) -> list:
    """The measured runs' mean tail length, and the on runs' profiler share (its threads' CPU)."""
    tails = [t for t in (tail_seconds(r.get("throughput") or {}) for r in runs) if t is not None]
    shares = [r["profiler_share"] for r in runs if r["arm"] == "on" and r.get("profiler_share") is not None]
    lines = [f"tail: {statistics.fmean(tails):.1f} s per run (mean of {len(tails)})"] if tails else []
    if shares:
        lines.append(f"on runs: the profiler's threads used {100 * statistics.fmean(shares):.2f}% of the wall time "
                     f"in CPU (max {100 * max(shares):.2f}%, {len(shares)} runs; interval records' profiler_share)")
    return lines + _sample_notes(runs) + _numa_notes(runs) + _host_notes(runs)


def _host_notes(runs: list) -> list:
    """One line per probed run that measured them: its tokens/s beside the share of its CPUs' time the
    hypervisor took (steal) and how often its two busiest threads sat on one physical core."""
    lines = []
    for r in runs:
        probe = r.get("probe") or {}
        if probe.get("steal_share") is None and not probe.get("busiest_threads"):
            continue
        line = f"host: pair {r['pair'] + 1} {r['arm']} {r['value']:,.0f}:"
        if probe.get("steal_share") is not None:
            line += f" steal {100 * probe['steal_share']:.1f}% of its CPUs' time;"
        pair = probe.get("busiest_threads")
        if pair and pair["samples"]:
            line += (f" {' + '.join(pair['threads'])} ({' + '.join(f'{c:.1f}' for c in pair['cpu_s'])} s CPU) "
                     f"on one core in {100 * pair['same_core'] / pair['samples']:.0f}% of {pair['samples']} samples")
        lines.append(line.rstrip(";"))
    return lines


def _numa_notes(runs: list) -> list:
    """Where each probed run's memory sat, when it spread over (or sat on) more than one NUMA node
    across the runs: one line per run, its tokens/s beside the share of its pages per node."""
    placed = [(r, (r.get("probe") or {}).get("numa_pages") or {}) for r in runs]
    if len({node for _, pages in placed for node in pages}) < 2:
        return []
    lines = []
    for r, pages in placed:
        total = sum(pages.values())
        if total:
            share = ", ".join(f"{node} {100 * n / total:.0f}%" for node, n in sorted(pages.items()))
            lines.append(f"numa: pair {r['pair'] + 1} {r['arm']} {r['value']:,.0f}: pages {share}")
    return lines


def _sample_notes(runs: list) -> list:
    """Per arm and kind of probe file (`idle`: every sample, the wall time; `gil`: the GIL holder's), the
    share of the training thread's py-spy samples inside the profiler, pooled over the runs
    (bench/ab_probe.py), with its binomial standard error."""
    pooled: dict = {}
    for r in runs:
        for name, s in ((r.get("probe") or {}).get("main_thread_samples") or {}).items():
            row = pooled.setdefault((r["arm"], name.split(".")[-2]), [0, 0, 0])
            row[0], row[1], row[2] = row[0] + s["samples"], row[1] + s["profiler"], row[2] + 1
    failed = [r["probe"] for r in runs if r.get("probe") and (r["probe"].get("ran") is False or r["probe"].get("exit"))]
    lines = [f"probe failed in {len(failed)} runs, first: {failed[0].get('why') or 'exit %s' % failed[0].get('exit')} "
             f"{(failed[0].get('stderr_tail') or '').strip()[-200:]}"] if failed else []
    for (arm, kind), (n, k, files) in sorted(pooled.items()):
        p = k / n
        lines.append(f"{arm} runs ({kind} samples): the training thread was in profiler code in {100 * p:.2f}% "
                     f"of {n} (+-{100 * math.sqrt(p * (1 - p) / n):.2f}%, {files} runs; py-spy probe)")
    return lines


def format_machine(m: dict) -> str:
    """One line of where and when: GPU(s), torch, CPUs, date, commit."""
    torch_info = m.get("torch") or {}
    gpu = "; ".join(m["gpus"]) or torch_info.get("device_name") or "no GPU"
    commit = (m.get("commit") or "unknown")[:12] + (" (modified)" if m.get("tree_modified") else "")
    return (f"machine: {gpu} | torch {torch_info.get('torch')} (CUDA {torch_info.get('cuda')}) | python "
            f"{m['python']} | {m['cpus_allowed']}/{m['cpu_count']} CPUs{_cores(m)} | {m['host']} | {m['date_utc']} "
            f"| commit {commit}" + _numa_topology(m.get("numa_nodes") or {}))


def _cores(m: dict) -> str:
    """` (8 cores)` when the allowed CPUs are hyperthreads of fewer physical cores (as sysfs says)."""
    cores = m.get("cores")
    return f" ({cores} cores)" if cores and cores < m["cpus_allowed"] else ""


def _numa_topology(nodes: dict) -> str:
    """` | NUMA node0 0-7, node1 8-15` when the machine has more than one node (one node: nothing)."""
    return " | NUMA " + ", ".join(f"{k} {v}" for k, v in nodes.items()) if len(nodes) > 1 else ""


# ------------------------------------------------------------------------------------------- driving
def _progress(name: str, rec: dict, label: str, section: dict) -> None:
    """One line per run, and the running paired result once a pair is complete."""
    value = "FAILED (exit {})".format(rec["exit"]) if rec["value"] is None else f"{rec['value']:,.0f}"
    line = f"[{name}] {label} {rec['arm']}: {value} in {rec['wall_s']:.0f} s"
    p = section["summary"]["paired"]
    if p["n"]:
        line += (f" | on/off {_pct(p['mean_diff_pct'])} CI {_pct(p['ci_low_pct'])} .. "
                 f"{_pct(p['ci_high_pct'])} (n={p['n']})")
    print(line, flush=True)
    if rec["value"] is None:
        print(rec.get("log_tail", ""), flush=True)


def _measure(setup: Setup, section: dict, report: Report, run_dir: Path, args: list, arm: str, extra: dict) -> dict:
    """Run, record, save the JSON, print the progress line, cool down (the caller tidies the run)."""
    rec = dict(run_once(setup, run_dir, args, arm, probe=not extra.get("warmup")), **extra)
    section["runs"].append(rec)
    section["summary"] = summarize(section["runs"])
    report.save()
    label = "warm-up" if rec.get("warmup") else f"pair {rec['pair'] + 1}/{section['pairs_planned']}"
    _progress(section["name"], rec, label, section)
    time.sleep(setup.cooldown_s)
    return rec


def _warm_up(setup: Setup, wl: Workload, section: dict, report: Report, runs: Path, args: list,
             count: int) -> Path | None:
    """The discarded runs; keeps the first good run's built-in target and corpus for the rest (and for
    later calls with this workdir: the key holds every flag that shapes them)."""
    builtin = setup.workdir / ("builtin-" + "-".join(wl.flags or ["default"]).replace("--", ""))
    for i in range(count):
        run_dir = runs / f"warmup{i + 1}-{('on', 'off')[i % 2]}"
        seed_builtin(run_dir, builtin if wl.target_shape is None else None)
        rec = _measure(setup, section, report, run_dir, args, ("on", "off")[i % 2], {"warmup": True})
        if wl.target_shape is None and rec["exit"] == 0 and not builtin.is_dir() and (run_dir / "builtin").is_dir():
            shutil.copytree(run_dir / "builtin", builtin)
        tidy_run(run_dir, setup.keep_runs)
    return builtin if wl.target_shape is None and builtin.is_dir() else None


def _size_steps(setup: Setup, name: str, section: dict, args: list) -> list:
    """More steps (--max-steps is the last argument) when the last warm-up's tail rate says the tail
    would last less than --tail-seconds: a tail must span several profile intervals."""
    good = [r for r in section["runs"] if r.get("warmup") and r["value"] is not None]
    if not setup.tail_seconds or not good:
        return args
    sized = steps_for_tail(good[-1]["throughput"], setup.tail_seconds, section["steps"])
    if sized is None or sized == section["steps"]:
        return args
    section["steps"] = sized
    print(f"[{name}] {sized} steps per run: a tail of about {setup.tail_seconds:g} s at the warm-up's rate",
          flush=True)
    return [*args[:-1], str(sized)]


def run_workload(setup: Setup, wl: Workload, report: Report, pairs: int, warmups: int, budget_s: float) -> dict:
    """Warm-up, then up to `pairs` alternating pairs (on/off, off/on, ...) while the budget lasts."""
    t0 = time.monotonic()
    args = [*prepare_workload(wl, setup.workdir, setup.env), *wl.flags, "--max-steps", str(wl.steps)]
    runs = setup.workdir / "runs" / f"{wl.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    section = report.data["workloads"][wl.name] = {
        "name": wl.name, "metric": setup.metric, "rank": setup.rank, "steps": wl.steps, "pairs_planned": pairs,
        "args": [*setup.common, *args], "cpus": setup.cpus, "runs": [], "summary": summarize([])}
    builtin = _warm_up(setup, wl, section, report, runs, args, warmups)
    args = _size_steps(setup, wl.name, section, args)
    failures = 0
    for i in range(pairs):
        measured = [r["wall_s"] + setup.cooldown_s for r in section["runs"] if not r.get("warmup")] or \
                   [r["wall_s"] + setup.cooldown_s for r in section["runs"]] or [0.0]
        if budget_s and i > 0 and time.monotonic() - t0 + 2 * statistics.fmean(measured) > budget_s:
            section["stopped"] = f"budget: {budget_s:.0f} s would be exceeded by pair {i + 1}"
            print(f"[{wl.name}] {section['stopped']}", flush=True)
            break
        for arm in (("on", "off") if i % 2 == 0 else ("off", "on")):
            run_dir = runs / f"p{i + 1:02d}-{arm}"
            seed_builtin(run_dir, builtin)
            rec = _measure(setup, section, report, run_dir, args, arm, {"pair": i})
            tidy_run(run_dir, setup.keep_runs)
            failures = failures + 1 if rec["value"] is None else 0
        if failures >= 2:
            section["stopped"] = "two runs in a row failed"
            break
    section["wall_s"] = time.monotonic() - t0
    report.save()
    return section


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=("launch", "gpu", "both"), default="both")
    ap.add_argument("--pairs", type=int, default=8, help="at most this many on/off pairs per workload")
    ap.add_argument("--warmup-runs", type=int, default=1, help="discarded runs first (builds, compile caches)")
    ap.add_argument("--steps", type=int, default=None, help="--max-steps of every run (default per workload)")
    ap.add_argument("--tail-seconds", type=float, default=15.0,
                    help="after the warm-up, more steps if needed so each run's measured tail lasts this long, "
                         "several profile intervals (0: never change --steps)")
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="per workload: start no pair that would end after this many seconds (0 = no limit)")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--small", action="store_true", help="CPU-sized workloads (a smoke test)")
    ap.add_argument("--builtin-conversations", type=int, default=None,
                    help="the launch workload's built-in corpus size (default: the trainer's)")
    ap.add_argument("--metric", default="tail_tokens_per_s", help="field of RUN_DIR/throughput/rank{R}.json")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--profile-interval", default="5", help="--profile-interval of both arms")
    ap.add_argument("--seed", default="0")
    ap.add_argument("--cooldown-s", type=float, default=3.0, help="sleep between runs")
    ap.add_argument("--cpus", default="auto", help="taskset CPU list for every run, 'auto' or 'none'")
    ap.add_argument("--pin-ranks", action="store_true",
                    help="also split those CPUs into one set of whole physical cores per rank")
    ap.add_argument("--no-aslr", action="store_true",
                    help="start every run under `setarch -R` (no address-space randomisation): a suspect for "
                         "whole-run speed modes is where the heap and libraries land")
    ap.add_argument("--one-cpu-per-core", action="store_true",
                    help="keep one hyperthread of each physical core of those CPUs: no two threads of a run share a "
                         "core (a run whose busy threads land on sibling hyperthreads runs slower for its life)")
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "dflash-ab",
                    help="run directories, the random target, corpus and built-ins (kept between calls)")
    ap.add_argument("--compile-cache", type=Path, default=None, help="default: WORKDIR/compile-cache")
    ap.add_argument("--json", type=Path, default=None,
                    help="default: $OUT/ab_profile.json, else WORKDIR/ab_profile.json")
    ap.add_argument("--run-timeout-s", type=float, default=600.0)
    ap.add_argument("--keep-runs", action="store_true", help="keep checkpoints and built-ins of every run")
    ap.add_argument("--extra", default="", help="more dflash-train arguments for both arms, one string (not "
                    "--builtin-conversations: use the option above, which keys the built-in cache)")
    ap.add_argument("--probe", default="", help="shell command run against rank --rank of every measured run, "
                    "{pid} and {out} filled in (bench/ab_probe.py); its per-thread CPU goes in the JSON")
    ap.add_argument("--probe-after-s", type=float, default=25.0, help="seconds from a run's launch to its probe")
    ap.add_argument("--merge", type=Path, nargs="+", default=None, metavar="JSON",
                    help="run nothing: pool the pairs of these reports per workload and print the tables")
    a = ap.parse_args(argv)
    if a.pairs < 1 or a.warmup_runs < 0:
        ap.error("--pairs must be >= 1 and --warmup-runs >= 0")
    if a.probe_after_s < 0:
        ap.error("--probe-after-s must be >= 0")
    try:
        a.probe.format(pid=0, out="x")
    except (KeyError, IndexError, ValueError) as e:
        ap.error(f"--probe: {type(e).__name__} {e}: only {{pid}} and {{out}} are filled in (write other braces twice)")
    if a.no_aslr and not shutil.which("setarch"):
        ap.error("--no-aslr needs setarch (util-linux), not found on PATH")
    if a.one_cpu_per_core and a.cpus == "none":
        ap.error("--one-cpu-per-core needs a CPU set: drop --cpus none")
    return a


def build_setup(a: argparse.Namespace) -> tuple[Setup, str]:
    """The shared environment, CPU set and trainer arguments of every run, and how the compile cache
    is shared: the trainer's --compile-cache-dir when it has one (each rank then sets both cache
    variables itself), else TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR in the environment."""
    a.workdir.mkdir(parents=True, exist_ok=True)
    cache = (a.compile_cache or a.workdir / "compile-cache").absolute()
    common = ["--device", a.device, "--seed", a.seed, "--profile-interval", a.profile_interval, "--eval-prompts", "0"]
    if trainer_has_flag("--compile-cache-dir", base_env(None)):
        env, how = base_env(None), f"--compile-cache-dir {cache}"
        common += ["--compile-cache-dir", str(cache)]
    else:
        env = base_env(cache)
        how = (f"TORCHINDUCTOR_CACHE_DIR={env['TORCHINDUCTOR_CACHE_DIR']} TRITON_CACHE_DIR={env['TRITON_CACHE_DIR']} "
               "(this trainer has no --compile-cache-dir)")
    common += a.extra.split()
    cpus = pick_cpus(a.cpus)
    if cpus and a.one_cpu_per_core:
        cpus = [group[0] for group in core_groups(cpus)]
    setup = Setup(env=env, cpus=cpus, common=common, metric=a.metric, rank=a.rank,
                  cooldown_s=a.cooldown_s, run_timeout_s=a.run_timeout_s, keep_runs=a.keep_runs,
                  workdir=a.workdir.resolve(), pin_ranks=a.pin_ranks, tail_seconds=a.tail_seconds,
                  probe=a.probe, probe_after_s=a.probe_after_s, no_aslr=a.no_aslr)
    return setup, how


def merge_reports(paths: list[Path]) -> dict:
    """The measured pairs of several JSON reports (device calls of one machine kind), pooled per
    workload: pair numbers offset so they stay distinct, warm-ups dropped. {workload: section}."""
    merged: dict = {}
    for path in paths:
        for name, sec in json.loads(Path(path).read_text()).get("workloads", {}).items():
            into = merged.setdefault(name, {**sec, "runs": [], "steps": set(), "sources": []})
            offset = 1 + max((r["pair"] for r in into["runs"]), default=-1)
            into["runs"] += [dict(r, pair=r["pair"] + offset) for r in sec["runs"] if "pair" in r]
            into["steps"].add(sec["steps"])
            into["sources"].append(str(path))
    for sec in merged.values():
        sec["steps"] = "/".join(str(n) for n in sorted(sec["steps"]))
        sec["summary"] = summarize(sec["runs"])
    return merged


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.merge:
        try:
            merged = merge_reports(a.merge)
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"ab_profile: --merge: not a report of this script ({type(e).__name__}: {e})", file=sys.stderr)
            return 2
        for name, sec in merged.items():
            print(format_summary(name, sec) + f"\npooled from: {', '.join(sec['sources'])}", flush=True)
        return 0
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))   # runs stop with us
    setup, cache_note = build_setup(a)
    json_path = a.json or (Path(os.environ["OUT"]) / "ab_profile.json" if os.environ.get("OUT")
                           else setup.workdir / "ab_profile.json")
    machine = machine_info(setup.env)
    print(format_machine(machine), flush=True)
    per_rank = " (a share per rank)" if setup.pin_ranks else ""
    print(f"cpus: {setup.cpus or 'not pinned'}{per_rank} | compile cache: {cache_note} | json: {json_path}", flush=True)
    report = Report(json_path, {"machine": machine, "command": sys.argv, "compile_cache": cache_note,
                                "cpus": setup.cpus})
    names = ("launch", "gpu") if a.workload == "both" else (a.workload,)
    sections = []
    for name in names:
        wl = make_workload(name, a.small, a.steps, a.builtin_conversations)
        sections.append(run_workload(setup, wl, report, a.pairs, a.warmup_runs, a.budget_s))
        print(format_summary(name, sections[-1]), flush=True)
    print(format_machine(machine))
    return 0 if all(s["summary"]["pairs"] for s in sections) else 1


if __name__ == "__main__":
    sys.exit(main())
