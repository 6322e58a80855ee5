"""Findings that fit the run: on run logs written as docs/RUNLOG.md says (one GPU shared by both ranks, two
GPUs, the CPU, --gpus N), every flag a finding suggests is run through the trainer's own config and preflight
checks for that run's devices; the split section only with two GPUs or more; a memory leak only on a
sustained climb after warm-up that is large against the GPU and beyond the interval-to-interval noise."""
from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from profiler import report
from dflash.advice import ADVICE
from profiler.report.advice import run_topology
from profiler.report.runs import load_run

GIB = 1024 ** 3
T0 = 1_700_000_000.0
H200_BYTES = 141 * GIB
INTERVAL_S = 60.0


def _config(**over) -> dict:
    from dflash.config import TrainConfig
    return {**TrainConfig().flat_dict(), **over}


def _stats(seconds: float, count: int) -> dict:
    return {"total_seconds": seconds * count, "mean_seconds": seconds, "p50_seconds": seconds,
            "p95_seconds": seconds, "p99_seconds": seconds, "max_seconds": seconds}


def _entry(seconds: float, count: int, **extra) -> dict:
    return {"count": count, "cpu": _stats(seconds, count), "gpu": _stats(seconds, count),
            "share": seconds * count / INTERVAL_S, **extra}


def _nvml(index: int, used_peak_bytes: float) -> dict:
    return {"index": index, "name": "NVIDIA H200", "total_bytes": H200_BYTES, "used_bytes_last": used_peak_bytes,
            "used_bytes_peak": used_peak_bytes, "headroom_bytes": H200_BYTES - used_peak_bytes}


def _memory(index: int, used_peak_gib: float, allocated_bytes: float, reserved_bytes: float,
            peak_reserved_gib: float, retries: int = 0) -> dict:
    return {"available": True, "gpus": [_nvml(index, used_peak_gib * GIB)],
            "allocator": {"available": True, "allocated_bytes": allocated_bytes, "reserved_bytes": reserved_bytes,
                          "peak_allocated_bytes": peak_reserved_gib * GIB, "peak_reserved_bytes": peak_reserved_gib * GIB,
                          "num_alloc_retries": retries, "num_ooms": 0}}


def _interval(rank: int, role: str, index: int, spans: dict, memory: dict | None, last: bool, **extra) -> dict:
    return {"type": "interval", "time_unix": T0 + INTERVAL_S * (index + 1), "rank": rank, "role": role,
            "index": index, "step": 10 * (index + 1), "duration_seconds": INTERVAL_S,
            "start_s": INTERVAL_S * index, "end_s": INTERVAL_S * (index + 1), "spans": spans,
            "counters": {"tokens": {"total": 20_000, "per_second": 20_000 / INTERVAL_S}},
            "memory": memory or {"available": False, "reason": "no CUDA device"}, **({"final": True} if last else {}),
            **extra}


def _write(run_dir: Path, starts: dict, logs: dict, events: tuple = ()) -> Path:
    (run_dir / "profile").mkdir(parents=True)
    for rank, recs in logs.items():
        lines = [starts[rank], *recs, *(e for e in events if e["rank"] == rank)]
        (run_dir / "profile" / f"rank{rank}.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    return run_dir


def _start(rank: int, role: str, device: str, config: dict) -> dict:
    return {"type": "run_start", "time_unix": T0, "rank": rank, "role": role, "schema": 1, "run_id": "r",
            "hostname": "h200", "world_size": 2, "device": device, "interval_s": INTERVAL_S, "config": config}


INTERVALS = 12


def _pipeline(run_dir: Path, devices: tuple, transfer: str = "auto", events: tuple = ()) -> Path:
    """A drafter-bound 1:1 run on `devices` (drafter's, target's): the target waits 2/3 of its time on
    transfer slots, its transfer.send moves at 4% of its floor, a GPU run's shared low point is under 5%
    headroom, the drafter's allocator retried and its allocated memory climbs 1 GiB an interval."""
    cuda = devices[0].startswith("cuda")
    cfg = _config(device="cuda" if cuda else "cpu", transfer=transfer, profile_interval=INTERVAL_S)
    index = {d: i for i, d in enumerate(dict.fromkeys(devices))}
    drafter, target = [], []
    for k in range(INTERVALS):
        last = k == INTERVALS - 1
        mem_d = _memory(index[devices[0]], 136 if k == 5 else 100, (30 + k) * GIB, 60 * GIB, 60, retries=2) \
            if cuda else None
        mem_t = _memory(index[devices[1]], 100, 10 * GIB, 20 * GIB, 20) if cuda else None
        drafter.append(_interval(0, "drafter", k, {"drafter.fwd_bwd": _entry(0.5, 100),
                                                   "drafter.recv": _entry(0.05, 100)}, mem_d, last,
                                 profiler_share=0.05))
        send = _entry(0.05, 100, bytes=10_000_000_000, floor="pinned_d2h", floor_bytes_per_s=50e9)
        target.append(_interval(1, "target", k, {"target.fwd": _entry(0.1, 100), "transfer.send": send,
                                                 "transfer.wait_slot": _entry(0.4, 100)}, mem_t, last))
    starts = {0: _start(0, "drafter", devices[0], cfg), 1: _start(1, "target", devices[1], cfg)}
    meters = tuple(_throughput(rank, role, 20_000 / INTERVAL_S) for rank, role in ((0, "drafter"), (1, "target")))
    return _write(run_dir, starts, {0: drafter, 1: target}, (*events, *meters))


def _throughput(rank: int, role: str, tokens_per_s: float) -> dict:
    """The rank's steady state as dflash/throughput.py writes it at the end of its loop."""
    seconds = INTERVAL_S * (INTERVALS - 2)
    return {"type": "event", "kind": "throughput", "rank": rank, "role": role, "time_unix": T0 + INTERVAL_S * INTERVALS,
            "window": "steady state", "steady_tokens_per_s": tokens_per_s, "steady_tokens": tokens_per_s * seconds,
            "steady_seconds": seconds, "steady_steps": 10 * (INTERVALS - 2), "phases_seconds": {}}


def _trainer_accepts(run_config: dict, flags: list, gpus: int, tmp: Path) -> None:
    """The flags on top of the run's own config pass the trainer's config validation and its launch
    preflight for `gpus` GPUs, as dflash.launch runs it (world from dflash.launch.world_for)."""
    from dflash import launch, preflight
    from dflash.cli import build_parser
    from dflash.config import resolve_config

    given = {k: v for k, v in vars(build_parser().parse_args(flags)).items() if v is not None and k != "config"}
    base = {k: v for k, v in run_config.items() if v is not None and v != ""}
    base.update(run_dir=str(tmp / "next-run"), metrics_port=0, compile_cache_dir=str(tmp / "cache"))
    cfg = resolve_config(flag_values={**base, **given}, env={})
    world = launch.world_for(cfg, gpus)
    preflight.check(cfg, world, world, gpus=gpus)


_OTHER_TOOLS = re.compile(r"dflash-(?:profile|report) [a-z]+(?: --[a-z-]+(?: [^\s,;)]+)?)*")


def _named_trainer_flags(text: str) -> set:
    """The dflash-train flags a finding's text names (other tools' command lines left out)."""
    from dflash.cli import build_parser
    known = set(build_parser()._option_string_actions)
    return {f for f in re.findall(r"--[a-z][a-z0-9-]*", _OTHER_TOOLS.sub("", text)) if f in known}


def _check_every_suggestion(rep: dict, gpus: int, tmp: Path) -> list:
    """Each finding's flags are the trainer flags its text names, and the trainer accepts them on this run."""
    for i, f in enumerate(rep["findings"]):
        assert _named_trainer_flags(f["next"]) <= set(f["flags"]), f
        _trainer_accepts(rep["config"], f["flags"], gpus, tmp / f"f{i}")
    return [x for f in rep["findings"] for x in f["flags"]]


def _checkpoint(run_dir: Path) -> None:
    """What a run stopped by a signal leaves: a latest checkpoint --resume can load."""
    import torch
    ckpt = run_dir / "checkpoints" / "step_00000120"
    ckpt.mkdir(parents=True)
    from safetensors.torch import save_file
    torch.save({"step": 120}, ckpt / "training_state.pt")
    save_file({"fc.weight": torch.zeros(2, 2)}, str(ckpt / "model.safetensors"))   # a header preflight can read
    (run_dir / "checkpoints" / "latest").write_text(ckpt.name)


EVENTS = ({"type": "event", "kind": "nonfinite", "rank": 0, "role": "drafter", "time_unix": T0 + 300,
           "span": "drafter.fwd_bwd", "step": 40},
          {"type": "event", "kind": "oom", "rank": 0, "role": "drafter", "time_unix": T0 + 400, "step": 50},
          {"type": "event", "kind": "signal", "rank": 1, "role": "target", "time_unix": T0 + 700, "signal": "SIGTERM"})


def test_one_shared_gpu_gets_no_nccl_no_split_and_only_flags_it_accepts(tmp_path):
    run = _pipeline(tmp_path / "one", ("cuda:0", "cuda:0"), events=EVENTS)
    _checkpoint(run)
    topo = run_topology(load_run(run))
    assert (topo["device"], topo["gpus"], topo["ranks"], topo["ranks_share_gpus"]) == ("cuda", 1, 2, True)
    assert (topo["transfer"], topo["nccl_allowed"]) == ("host", False)
    rep = report.hotspots(run, advice=ADVICE)
    kinds = {f["kind"] for f in rep["findings"]}
    assert {"below_floor", "target_waits_on_slots", "low_headroom", "alloc_retries", "memory_leak",
            "profiler_cost", "nonfinite", "oom", "signal"} <= kinds, kinds
    send = next(f for f in rep["findings"] if f["kind"] == "below_floor")
    assert "--transfer" not in send["next"] and send["flags"] == [] and "2 ranks on 1 GPU" in send["next"]
    wait = next(f for f in rep["findings"] if f["kind"] == "target_waits_on_slots")
    assert "share a GPU" in wait["next"] and wait["flags"] == []
    assert wait["evidence"].startswith("drafter: steady intervals (10), 600 s; target: steady intervals (10), 600 s: "
                                       "target waits 67% on transfer.wait_slot"), wait["evidence"]
    flags = _check_every_suggestion(rep, gpus=1, tmp=tmp_path)
    assert {"--tokens-per-batch", "--resume", "--max-in-flight", "--memory-history"} <= set(flags)
    assert rep["split"]["best"] is None and "share 1 GPU" in rep["split"]["reason"]
    text = report.format_hotspots(rep)
    assert "Split" not in text


def test_the_trainer_refuses_what_the_one_gpu_run_used_to_be_told(tmp_path):
    """The check itself can fail: --transfer nccl on one GPU shared by two ranks is exit 2."""
    from dflash.config import ConfigError
    run = _pipeline(tmp_path / "one", ("cuda:0", "cuda:0"))
    with pytest.raises(ConfigError, match="NCCL needs one GPU per rank"):
        _trainer_accepts(report.hotspots(run, advice=ADVICE)["config"], ["--transfer", "nccl"], 1, tmp_path)


@pytest.mark.parametrize("transfer, other", [("auto", "host"), ("host", "nccl")])
def test_two_gpus_get_the_other_transfer_path_and_the_split(tmp_path, transfer, other):
    run = _pipeline(tmp_path / transfer, ("cuda:0", "cuda:1"), transfer=transfer)
    topo = run_topology(load_run(run))
    assert (topo["gpus"], topo["ranks_share_gpus"], topo["nccl_allowed"]) == (2, False, True)
    assert topo["transfer"] == ("nccl" if transfer == "auto" else "host")
    rep = report.hotspots(run, advice=ADVICE)
    send = next(f for f in rep["findings"] if f["kind"] == "below_floor")
    assert send["flags"] == ["--transfer", other]
    _check_every_suggestion(rep, gpus=2, tmp=tmp_path)
    text = report.format_hotspots(rep)
    assert "Split of 2 GPUs" in text and rep["split"]["best"] == {"target_gpus": 1, "drafter_gpus": 1,
                                                                  "predicted_tokens_per_s": pytest.approx(
                                                                      rep["split"]["best"]["predicted_tokens_per_s"])}


def test_a_cpu_run_has_no_split_unless_asked_and_no_nccl(tmp_path):
    run = _pipeline(tmp_path / "cpu", ("cpu", "cpu"))
    rep = report.hotspots(run, advice=ADVICE)
    assert rep["split"]["topology"]["device"] == "cpu" and rep["split"]["best"] is None
    assert rep["split"]["reason"].startswith("a CPU run has no GPUs to split")
    assert "Split" not in report.format_hotspots(rep)
    send = next(f for f in rep["findings"] if f["kind"] == "below_floor")
    assert send["flags"] == [] and "this run is on the CPU" in send["next"]
    _check_every_suggestion(rep, gpus=0, tmp=tmp_path)


def test_gpus_n_gives_the_split_and_a_command_for_n_gpus(tmp_path):
    run = _pipeline(tmp_path / "one", ("cuda:0", "cuda:0"))
    rep = report.hotspots(run, n_gpus=4, advice=ADVICE)
    assert rep["split"]["n_gpus"] == 4 and rep["split"]["best"]["drafter_gpus"] >= 2   # the drafter is slow
    wait = next(f for f in rep["findings"] if f["kind"] == "target_waits_on_slots")
    assert wait["flags"][:1] == ["--target-gpus"]
    assert "Split of 4 GPUs (--gpus)" in report.format_hotspots(rep)
    _check_every_suggestion(rep, gpus=4, tmp=tmp_path)


# ---- memory: a leak only on a real trend ------------------------------------------------------------

def _memory_run(run_dir: Path, allocated: list, reserved: list, used_peak_gib: float = 60.0,
                warmup: bool = False) -> Path:
    """A one-rank drafter run on one H200 with the given allocator series (bytes, one per interval); with
    `warmup`, one stopped during its warm-up (every interval marked warm-up)."""
    cfg = _config(device="cuda")
    recs = [_interval(0, "drafter", k, {"drafter.fwd_bwd": _entry(0.5, 100)},
                      _memory(0, used_peak_gib, a, r, max(reserved) / GIB), k == len(allocated) - 1,
                      **({"warmup": True} if warmup else {}))
            for k, (a, r) in enumerate(zip(allocated, reserved))]
    start = {**_start(0, "drafter", "cuda:0", cfg), **({"warmup_steps": 10_000} if warmup else {})}
    return _write(run_dir, {0: start}, {0: recs})


def _trends(run_dir: Path) -> tuple[dict, list]:
    rep = report.hotspots(run_dir, advice=ADVICE)
    (alloc,) = rep["memory"]["allocator"]
    return alloc["trends"], [f for f in rep["findings"] if f["kind"] == "memory_leak"]


def test_reserved_memory_creeping_from_0_14_to_0_23_gib_on_an_h200_is_no_leak(tmp_path):
    rng = random.Random(0)
    n = 30
    reserved = [(0.14 + 0.09 * k / (n - 1)) * GIB + rng.uniform(-0.005, 0.005) * GIB for k in range(n)]
    allocated = [0.10 * GIB + rng.uniform(-0.01, 0.01) * GIB for _ in range(n)]
    trends, leaks = _trends(_memory_run(tmp_path / "creep", allocated, reserved))
    assert leaks == []
    assert trends["reserved_bytes"]["slope_bytes_per_s"] > 0 and not trends["reserved_bytes"]["leak"]
    assert trends["reserved_bytes"]["why"].startswith("small")


def test_a_noisy_flat_series_is_no_leak(tmp_path):
    rng = random.Random(1)
    allocated = [40 * GIB + rng.uniform(-3, 3) * GIB for _ in range(30)]
    trends, leaks = _trends(_memory_run(tmp_path / "noisy", allocated, [60 * GIB] * 30))
    assert leaks == [] and not trends["allocated_bytes"]["leak"]
    assert trends["allocated_bytes"]["samples"] == 30 - 2 - 2   # start-up, final, and the first tenth's warm-up
    assert "noise" in trends["allocated_bytes"]["why"] or "sustained" in trends["allocated_bytes"]["why"]


def test_a_steady_climb_that_would_fill_the_gpu_within_the_run_is_a_leak(tmp_path):
    rng = random.Random(2)
    n = 20
    allocated = [20 * GIB + 2 * GIB * k + rng.uniform(-0.2, 0.2) * GIB for k in range(n)]
    trends, leaks = _trends(_memory_run(tmp_path / "climb", allocated, [100 * GIB] * n, used_peak_gib=110.0))
    t = trends["allocated_bytes"]
    assert t["leak"] and t["slope_bytes_per_s"] * INTERVAL_S == pytest.approx(2 * GIB, rel=0.05)
    assert t["seconds_to_exhaust"] < t["run_seconds"]
    (leak,) = leaks
    assert re.fullmatch(r"allocated memory on rank 0 \(drafter\) climbs (1\.9\d|2|2\.0\d) GiB/min after warm-up",
                        leak["summary"]), leak
    assert ("the last segment's steady intervals less their first tenth, intervals 2-18 (17 samples, 16.0 min)"
            in leak["evidence"]), leak
    assert "the 31.0 GiB headroom of the last interval is gone in 15 min (the run so far: 20 min)" in leak["evidence"]
    assert re.search(r"Theil-Sen slope (1\.9\d|2|2\.0\d) GiB/min", leak["evidence"]) and "residual MAD" in leak["evidence"]
    # one interval's outlier does not make or break it
    allocated[10] += 30 * GIB
    assert _trends(_memory_run(tmp_path / "outlier", allocated, [100 * GIB] * n, used_peak_gib=110.0))[1]


def test_a_small_climb_into_little_headroom_is_a_leak(tmp_path):
    """0.05 GiB an interval is under 3% of the GPU over the run, but 1 GiB of headroom is gone in 20 min."""
    n = 24
    allocated = [50 * GIB + 0.05 * GIB * k for k in range(n)]
    trends, leaks = _trends(_memory_run(tmp_path / "tight", allocated, [100 * GIB] * n, used_peak_gib=140.0))
    t = trends["allocated_bytes"]
    assert t["rise_bytes"] < 0.03 * H200_BYTES and t["seconds_to_exhaust"] < t["run_seconds"] and t["leak"]
    assert "headroom of the last interval is gone in 20 min" in leaks[0]["evidence"]


def test_a_climb_during_warm_up_is_no_leak_and_names_its_window(tmp_path):
    """A run stopped during warm-up: its trend is read over every interval of the segment, named so, and never
    a leak (the caching allocator fills during warm-up)."""
    n = 20
    allocated = [20 * GIB + 2 * GIB * k for k in range(n)]
    trends, leaks = _trends(_memory_run(tmp_path / "warm", allocated, [100 * GIB] * n, used_peak_gib=110.0,
                                        warmup=True))
    t = trends["allocated_bytes"]
    assert leaks == [] and not t["leak"] and t["why"].startswith("no interval past warm-up")
    assert t["window"] == "the last segment's intervals (none steady: warm-up, phases or final) less their first tenth"
    assert t["samples"] == n - 2
