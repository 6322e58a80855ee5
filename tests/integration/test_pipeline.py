"""dflash-train end to end on CPU: real processes over gloo (the launcher's and torchrun's), the run
log's spans on both ranks, resume equivalence, SIGTERM, bad input."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from profiler import report
import torch
from safetensors.torch import load_file

from profiler.runlog import read_records

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
# Small enough for ~20 s a run on 2 cores; still the real default code path.
SMALL = ["--builtin-conversations", "48", "--eval-prompts", "2", "--eval-new-tokens", "12",
         "--tokens-per-batch", "1024", "--max-length", "128", "--profile-interval", "2", "--device", "cpu"]
TARGET_SPANS = {"target.fetch", "target.fwd", "target.pack_hidden", "transfer.wait_slot", "transfer.send"}
DRAFTER_SPANS = {"drafter.recv", "drafter.unpack", "drafter.fwd_bwd", "drafter.optim", "ckpt.save", "eval.decode"}


def train(args: list[str], env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, **(env or {})))


def records(run_dir: Path, rank: int) -> list[dict]:
    recs, truncated = read_records(run_dir / "profile" / f"rank{rank}.jsonl")
    assert truncated == 0
    return recs


def spans_seen(recs: list[dict]) -> set[str]:
    return {name for r in recs if r["type"] == "interval" for name in r["spans"]}


# The 8-step run with a step-4 checkpoint that test_resume_matches_an_uninterrupted_run compares against.
EIGHT_STEPS = ["--max-steps", "8", "--checkpoint-every", "4"]


@pytest.fixture(scope="module")
def eight_step_run(tmp_path_factory, prebuilt) -> tuple[Path, subprocess.CompletedProcess]:
    """One real 8-step run, read by two tests: every span of the CPU path, and the uninterrupted run
    that a resumed one must match (evaluation runs after the last checkpoint and on the held-out corpus,
    so it changes neither the data order nor the weights). Its built-ins are prebuilt: a run building
    its own is the shared healthy run (the README default run)."""
    run = prebuilt(tmp_path_factory.mktemp("pipeline") / "run")
    with socket.socket() as s:   # an OTLP collector that is not there: training must not notice
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    r = train(["--run-dir", str(run), *EIGHT_STEPS, *SMALL],
              env={"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{dead}"})
    return run, r


def test_two_process_run_records_every_span_of_the_cpu_path(eight_step_run):
    run, r = eight_step_run
    assert r.returncode == 0, r.stderr[-3000:]
    # ...and says so once per rank, not once per batch of spans.
    assert r.stderr.count("otel: export of traces") == 2, r.stderr[-3000:]   # one line per rank
    assert "Traceback" not in r.stderr
    assert f"run directory: {run}" in r.stdout
    assert "eval: acceptance length" in r.stdout and "lossless" in r.stdout
    drafter, target = records(run, 0), records(run, 1)
    assert {x["role"] for x in drafter} == {"drafter"} and {x["role"] for x in target} == {"target"}
    assert [x["type"] for x in drafter][0] == "run_start" and drafter[-1]["type"] == "run_end"
    assert TARGET_SPANS <= spans_seen(target)
    assert DRAFTER_SPANS <= spans_seen(drafter)
    assert target[-1]["spans"]["target.fwd"]["count"] == 8
    assert drafter[-1]["spans"]["drafter.fwd_bwd"]["count"] == 8
    assert drafter[-1]["counters"]["tokens"]["total"] == target[-1]["counters"]["tokens"]["total"]
    # the host path's copies do not exist on CPU: no d2h/h2d spans pretending to measure something
    assert not ({"d2h_copy", "h2d_copy"} & (spans_seen(target) | spans_seen(drafter)))
    ckpt = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 16
    assert json.loads((run / "config.json").read_text())["resolved"]["transfer"] == "host"
    assert (run / "builtin" / "tiny-target" / "config.json").is_file()  # the target travels with the run
    meter = json.loads((run / "throughput" / "rank0.json").read_text())
    # 8 steps, 2 warm-up: the steady state is steps 3..8, one definition on every surface
    assert meter["window"] == "steady state" and meter["role"] == "drafter"
    assert meter["steady_steps"] == 6 and meter["first_step"] == 3 and meter["last_step"] == 8
    assert 0 < meter["steady_seconds"] <= meter["window_seconds"] and 0 < meter["steady_tokens_per_s"]
    (event,) = [x for x in drafter if x["type"] == "event" and x["kind"] == "throughput"]
    assert event["steady_tokens_per_s"] == meter["steady_tokens_per_s"]
    rep = report.hotspots(run)
    assert rep["steady_tokens_per_s"] == meter["steady_tokens_per_s"]
    # where each rank's start-up went, from the command's start, in order and adding up
    for recs in (drafter, target):
        (up,) = [x for x in recs if x["type"] == "event" and x["kind"] == "startup"]
        assert up["origin"] == "launch"
        assert list(up["phases_seconds"]) == ["spawn", "imports", "preflight", "device", "rendezvous", "groups",
                                              "built-ins", "data", "profiler", "model", "loop setup"]
        assert sum(up["phases_seconds"].values()) == pytest.approx(up["total_seconds"], abs=1e-3)
        assert 0.5 < up["phases_seconds"]["imports"] and up["total_seconds"] < 120
        assert up["bytecode"] in ("beside sources", "not written") or up["bytecode"].endswith("/pycache")
        # a CPU run's ranks wait asleep, so the drafter (the bound stage) takes all the cores
        assert up["omp_wait_policy"] == "PASSIVE"
    cores = len(os.sched_getaffinity(0))
    assert [x["intra_op_threads"] for recs in (drafter, target) for x in recs if x.get("kind") == "startup"] == [
        cores, max(1, cores // 2)]
    assert "dflash-train: start-up " in r.stdout and " s from launch to the first step: spawn " in r.stdout


def test_torchrun_launch_runs_the_same_worker(tmp_path, prebuilt):
    run = prebuilt(tmp_path / "run")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", "dflash.cli", "--run-dir", str(run), "--max-steps", "3",
                        *SMALL, "--eval-prompts", "0"], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert spans_seen(records(run, 0)) >= {"drafter.fwd_bwd"}
    assert spans_seen(records(run, 1)) >= {"target.fwd"}
    (up,) = [x for x in records(run, 0) if x["type"] == "event" and x["kind"] == "startup"]
    assert up["origin"] == "process" and list(up["phases_seconds"])[0] == "imports"   # no launcher here
    # no launcher to set OMP_WAIT_POLICY: threads that spin while they wait, so each rank keeps its share
    assert up["omp_wait_policy"] is None and up["intra_op_threads"] == max(1, len(os.sched_getaffinity(0)) // 2)


def test_resume_matches_an_uninterrupted_run(tmp_path, eight_step_run, train_main):
    common = [*EIGHT_STEPS, *SMALL, "--eval-prompts", "0"]
    full, r = eight_step_run
    assert r.returncode == 0, r.stderr[-3000:]
    # A new run (no --resume) into a directory holding one is refused before touching it.
    before = (full / "profile" / "rank0.jsonl").read_bytes()
    r = train_main(["--run-dir", full, *common])
    assert r.returncode == 2 and "pass --resume" in r.stderr and "Traceback" not in r.stderr
    assert (full / "profile" / "rank0.jsonl").read_bytes() == before
    cut = tmp_path / "cut"
    shutil.copytree(full / "builtin", cut / "builtin")   # the same built-ins, not built a second time
    # Die mid-run after the step-4 checkpoint, through the real fault-injection path.
    r = train(["--run-dir", str(cut), *common], env={"DFLASH_FAULT": "crash@drafter.fwd_bwd:step=5"})
    assert r.returncode == 1 and "injected crash" in r.stderr
    assert (cut / "checkpoints" / "latest").read_text().strip() == "step_0000004"
    r = train(["--run-dir", str(cut), "--resume", *common])
    assert r.returncode == 0, r.stderr[-3000:]
    a = load_file(str(full / "checkpoints" / "step_0000008" / "model.safetensors"))
    b = load_file(str(cut / "checkpoints" / "step_0000008" / "model.safetensors"))
    assert a.keys() == b.keys()
    # Same data order, anchors and noise after resume: on CPU the weights agree to float rounding.
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst <= 1e-5, worst
    last = lambda run: [x for x in records(run, 0) if x["type"] == "run_end"][-1]["spans"]  # noqa: E731
    assert last(cut)["drafter.fwd_bwd"]["count"] == 4  # the resumed process did only the remaining steps


def test_sigterm_stops_at_a_step_boundary_with_a_checkpoint(tmp_path, prebuilt):
    run = prebuilt(tmp_path / "run")
    p = subprocess.Popen([sys.executable, "-m", "dflash.cli", "--run-dir", str(run), "--max-steps", "10000",
                          *SMALL, "--eval-prompts", "0"], cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    log = run / "profile" / "rank0.jsonl"
    while time.monotonic() < deadline:  # wait until training is under way (an interval was written)
        if log.is_file() and any(x["type"] == "interval" for x in read_records(log)[0]):
            break
        time.sleep(0.5)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-3000:]
    step = int((run / "checkpoints" / "latest").read_text().strip().split("_")[1])
    assert 0 < step < 10000
    kinds = [x.get("kind") for x in records(run, 0) if x["type"] == "event"]
    assert "signal" in kinds and "checkpoint" in kinds
    assert "run directory:" in out


def test_bad_data_exits_2_naming_file_and_line(tmp_path, train_main):
    data = tmp_path / "d.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
                    "{oops\n")
    r = train_main(["--run-dir", tmp_path / "run", "--data", data, "--on-bad-record", "fail", *SMALL])
    assert r.returncode == 2
    assert f"{data}:2:" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_default_run_learns_and_real_acceptance_matches_simulated(healthy_run):
    """The README's main job, with only a run directory and a shorter interval (the shared healthy run,
    which also serves metrics and exports OTLP): loss halves within the first minute, and real
    draft-and-verify acceptance on held-out prompts is within 15% of the teacher-forced simulation on
    the same conversations."""
    run = healthy_run.run
    assert healthy_run.returncode == 0, healthy_run.stderr[-3000:]
    # 198 s on the idle 2-core VM (2026-12-04, README); the bound holds on a busy machine too, where the
    # suite must pass (a CPU-heavy process beside it roughly doubles the run)
    assert healthy_run.wall_seconds < 600
    recs = records(run, 0)
    start = recs[0]["time_unix"]
    losses = [(x["time_unix"] - start, x["metrics"]["loss"]["mean"]) for x in recs
              if x["type"] == "interval" and "loss" in x.get("metrics", {})]
    first = losses[0][1]
    assert any(t <= 60 and loss <= first / 2 for t, loss in losses[1:]), losses
    ev = next(x for x in recs if x["type"] == "event" and x["kind"] == "eval")
    assert ev["lossless"] and ev["prompts"] == 8
    assert abs(ev["measured_tau"] - ev["simulated_tau"]) <= 0.15 * ev["simulated_tau"], ev
    assert ev["measured_tau"] > 2.0  # it learned something worth drafting with


def test_split_fc_layers_trains_exactly_like_target_side_concat(tmp_path, prebuilt):
    """DFLASH_SPLIT_FC_LAYERS ships the K layers separately; the drafter concatenates and adds the same
    seeded noise, so the whole run is the same computation: identical weights at the end. The two runs
    go side by side: each rank computes on its own fixed threads, so neither changes the other's numbers."""
    common = ["--max-steps", "3", "--hidden-noise", "0.05", *SMALL, "--eval-prompts", "0"]
    procs = {}
    for split in ("0", "1"):
        run = prebuilt(tmp_path / f"split{split}")
        procs[split] = run, subprocess.Popen(
            [sys.executable, "-m", "dflash.cli", "--run-dir", str(run), *common], cwd=REPO, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True, env=dict(os.environ, DFLASH_SPLIT_FC_LAYERS=split))
    runs = {}
    for split, (run, p) in procs.items():
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
        assert json.loads((run / "config.json").read_text())["parallel"]["split_fc_layers"] is (split == "1")
        runs[split] = load_file(str(run / "checkpoints" / "step_0000003" / "model.safetensors"))
    assert all(torch.equal(runs["0"][k], runs["1"][k]) for k in runs["0"])


def test_background_thread_crash_surfaces_with_its_traceback_and_stops_the_run(tmp_path, prebuilt):
    """The seeds' hidden failure: an exception in a background thread. Injected in the sender thread
    (transfer.send runs there), it must reach the main thread, fail the run with exit 1, keep the
    thread's own traceback, and be recorded as the target's run_end status."""
    run = prebuilt(tmp_path / "run")
    r = train(["--run-dir", str(run), "--max-steps", "8", *SMALL, "--eval-prompts", "0"],
              env={"DFLASH_FAULT": "crash@transfer.send:step=2"})
    assert r.returncode == 1
    assert "target.sender thread failed" in r.stderr
    # step 2, or the sender thread's first send after it (it may run while the target is past step 2)
    assert re.search(r"injected crash at transfer.send step [2-9] rank 1", r.stderr), r.stderr[-3000:]
    assert 'transfer.py", line' in r.stderr and "in _run" in r.stderr  # the sender thread's own frames
    end = [x for x in records(run, 1) if x["type"] == "run_end"][-1]
    assert end["status"] == "RuntimeError"


def test_a_wrong_world_guess_is_corrected_before_the_ranks_get_their_config(tmp_path, monkeypatch, prebuilt):
    """The launcher starts the ranks before it imports torch, from the CUDA driver's device count; a
    driver that shows GPUs this torch cannot use (a CPU-only wheel) gives a wrong world, which the
    preflight's torch count replaces: the gated ranks are killed and the right number started."""
    from dflash import cli, launch

    monkeypatch.setattr(launch, "cuda_driver_device_count", lambda: 3)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    worlds = []
    real = launch.GatedRanks
    monkeypatch.setattr(launch, "GatedRanks", lambda world, ns, env=None: worlds.append(
        (world, env.get("OMP_WAIT_POLICY"))) or real(world, ns, env))
    run = prebuilt(tmp_path / "run")
    args = [a if a != "cpu" else "auto" for a in SMALL]
    assert cli.main(["--run-dir", str(run), "--max-steps", "2", *args, "--eval-prompts", "0"]) == 0
    assert worlds == [(3, None), (2, "PASSIVE")]   # started again as the CPU run it is, threads asleep
    assert [r["world_size"] for r in (records(run, 0)[0], records(run, 1)[0])] == [2, 2]
    assert not (run / "profile" / "rank2.jsonl").exists()
