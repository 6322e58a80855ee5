"""Captures on a GPU (skipped without one): a live host-transfer run captured on schedule and on demand, its kernels
attributed to target.pack_hidden, drafter.fwd_bwd and d2h_copy, its allocator snapshots taken live and read
offline; and, in this process, our span GPU windows against Kineto's for spans of 1 ms or more, a launch-bound
span named as such and a pinned copy's bandwidth against the pinned floor."""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import profiler  # noqa: E402
from dflash import report_cli  # noqa: E402
from profiler.config import ProfilerConfig  # noqa: E402
from profiler.schema.records import read_records  # noqa: E402
from profiler.clients.snapshot import live_ranks  # noqa: E402
from profiler.report.kernels import kernels  # noqa: E402
from tests.hta_reader import provider, trace_analysis  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

REPO = Path(__file__).resolve().parents[2]
RUN_ARGS = ["--device", "cuda", "--transfer", "host", "--max-steps", "10000", "--builtin-conversations", "48",
            "--eval-prompts", "0", "--tokens-per-batch", "1024", "--max-length", "128", "--profile-interval", "1",
            "--metrics-port", "0", "--memory-history", "20000", "--capture-at-step", "12", "--capture-steps", "3"]


def _captured(run: Path, rank: int, step=None) -> list:
    path = run / "profile" / f"rank{rank}.jsonl"
    if not path.exists():
        return []
    return [r for r in read_records(path)[0] if r.get("kind") == "capture" and step in (None, r.get("step"))]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash.profile_cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory, prebuilt, live_run):
    """A live GPU run (host-staged transfer): a scheduled 3-step capture at step 12, `dflash-profile memory` and
    a 2-step `dflash-profile capture` asked of it live, then a SIGTERM."""
    run = prebuilt(tmp_path_factory.mktemp("gpu-capture") / "run")
    with live_run(run, RUN_ARGS, {}) as train:
        deadline = time.monotonic() + 400
        while not (_captured(run, 0) and _captured(run, 1) and len(live_ranks(run)) == 2):
            assert train.poll() is None and time.monotonic() < deadline, "no scheduled capture on both ranks"
            time.sleep(0.5)
        memory = _cli("memory", "--run-dir", str(run))
        asked = _cli("capture", "--run-dir", str(run), "--steps", "2", "--json")
        train.send_signal(signal.SIGTERM)
        train.wait(timeout=120)
    return run, memory, asked


def test_kernels_are_attributed_to_pack_hidden_fwd_bwd_and_d2h_copy(gpu_run, capsys):
    run, _, asked = gpu_run
    assert asked.returncode == 0, asked.stdout + asked.stderr
    for step in (12, json.loads(asked.stdout)["at_step"]):
        assert report_cli.main(["kernels", str(run), "--capture", str(step), "--json"]) == 0
        rep = json.loads(capsys.readouterr().out)
        assert rep["aligned"] and {r["device"] for r in rep["ranks"]} == {"cuda"}
        spans = {(r["role"], s["name"]): s for r in rep["ranks"] for s in r["spans"]}
        for key in (("target", "target.pack_hidden"), ("drafter", "drafter.fwd_bwd")):
            s = spans[key]
            assert s["kernels_total"]["count"] > 0 and s["kernels"], key
            assert s["our_gpu_count"] == s["count"] > 0 and 0 < s["busy_share"] <= 1.05, s
        copy = [c for c in spans[("target", "d2h_copy")]["copies"] if "DtoH" in c["name"]]
        assert copy and copy[0]["bytes"] > 0 and copy[0]["floor"] == "pinned_d2h" and copy[0]["floor_share"] > 0


def test_kinetos_own_lines_stay_out_of_the_runs_output_on_a_gpu(gpu_run):
    """Issue 51: each capture printed Kineto's "USDT: ... profiler_start" lines (with CUPTI, STAGE lines too)."""
    run = gpu_run[0]
    text = (run.parent / "train.log").read_text(errors="replace")
    assert not re.findall(r"^[A-Z]+:\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ \w+\.cpp:\d+\]", text, re.M), text[-3000:]


def test_memory_snapshots_of_the_live_run_are_summarised_offline(gpu_run, capsys):
    run, memory, _ = gpu_run
    assert memory.returncode == 0, memory.stdout + memory.stderr
    lines = memory.stdout.splitlines()
    assert sum("GiB allocated of" in line for line in lines) == 2
    assert lines[2:] and all(line.startswith("memory forecast: ") for line in lines[2:]), lines   # a basis or why not
    assert report_cli.main(["memory", str(run), "--json"]) == 0
    snaps = [s for s in json.loads(capsys.readouterr().out)["snapshots"] if s["taken"] == "on demand"]
    assert sorted(s["rank"] for s in snaps) == [0, 1]
    for s in snaps:
        assert s["reserved_bytes"] >= s["allocated_bytes"] > 0 and s["history_entries"] > 0
        assert s["largest_live_blocks"][0]["frames"] and s["open_spans"] is not None


def test_hta_breaks_a_gpu_capture_of_both_ranks_down(gpu_run, tmp_path):
    hta = trace_analysis()   # traceinsight or the older HolisticTraceAnalysis (tests/hta_reader.py); skips without
    run = gpu_run[0]
    for rank in (0, 1):
        (tmp_path / f"rank{rank}.json.gz").write_bytes((run / "kineto" / f"rank{rank}-step12.json.gz").read_bytes())
    analysis = hta.TraceAnalysis(trace_dir=str(tmp_path))
    temporal = analysis.get_temporal_breakdown(visualize=False)
    assert sorted(temporal["rank"]) == [0, 1] and (temporal["compute_time(us)"] > 0).all(), provider()
    kinds, per_kernel = analysis.get_gpu_kernel_breakdown(visualize=False)
    assert len(kinds) and len(per_kernel), provider()


def _workloads(device):
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    src = torch.empty(1 << 30, device=device, dtype=torch.float16)   # 2 GiB
    dst = torch.empty_like(src)
    dev = torch.ones(64 << 20, device=device, dtype=torch.uint8)
    pinned = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
    tiny = torch.zeros(16, device=device)
    return {"bench.matmul": lambda: [torch.mm(a, a) for _ in range(6)], "bench.copy": lambda: dst.copy_(src),
            "bench.d2h": lambda: pinned.copy_(dev, non_blocking=True),
            "bench.launch": lambda: [tiny.add_(1.0) for _ in range(2000)], "busy": lambda: torch.mm(a, a),
            "bench.sleep": lambda: torch.cuda._sleep(20_000_000)}   # one kernel, ~10 ms: the two clocks alone


def test_span_windows_agree_with_kineto_and_a_launch_bound_span_is_named(tmp_path):
    device = torch.device("cuda")
    work = _workloads(device)
    cfg = ProfilerConfig(interval_s=3600.0, detail_steps=0, control=False, capture_at_step=3, capture_steps=4)
    with profiler.Profiler(tmp_path, device=device, config=cfg):
        for step in range(9):
            profiler.set_step(step)
            for name in ("bench.sleep", "bench.matmul", "bench.copy", "bench.d2h", "bench.launch"):
                with profiler.span("bench.busy"):   # the stream is busy when each measured span begins
                    work["busy"]()
                with profiler.span(name):
                    work[name]()
    spans = {s["name"]: s for s in kernels(tmp_path)["ranks"][0]["spans"]}
    ratio = {n: s["our_gpu_window_seconds"] / s["kineto_gpu_window_seconds"] for n, s in spans.items()
             if s["our_gpu_window_seconds"] and s["kineto_gpu_window_seconds"]}
    # one kernel per span: its window on either side is the kernel, so the ratio is the clocks' (CUDA events
    # against Kineto's CUPTI timestamps), the peer the other spans' windows are held to
    assert abs(ratio["bench.sleep"] - 1) < 0.03, ratio
    for name in ("bench.matmul", "bench.copy", "bench.d2h"):
        s = spans[name]
        assert s["our_gpu_count"] == s["kineto_gpu_count"] == s["count"] == 4, s
        assert s["kineto_gpu_window_seconds"] / 4 >= 1e-3, s
        assert abs(ratio[name] / ratio["bench.sleep"] - 1) < 0.01, ratio
        assert s["busy_share"] > 0.9 and s["bound"] == "GPU-busy", s
    launch = spans["bench.launch"]
    assert launch["busy_share"] < 0.5 and launch["bound"] == "launch- or sync-bound", launch
    assert launch["kernels_total"]["count"] == 4 * 2000 and launch["launches"] >= 4 * 2000
    d2h = spans["bench.d2h"]["copies"][0]
    assert d2h["floor"] == "pinned_d2h" and 0.5 < d2h["floor_share"] < 1.3, d2h
