"""`dflash-report kernels` on a Kineto trace laid out as torch.profiler writes a CUDA capture (categories, args,
correlation and External ids as a torch 2.11 capture on an H100 holds them): kernels attributed to the span that
launched them (the backward's, launched from autograd's thread, to the training thread's span; a runtime call
with a stale thread id through its op's External id), copies against the floors, a launch-bound span named so."""
from __future__ import annotations

import gzip
import json

import pytest

from dflash import report_cli
from profiler.report.kernels import kernels
from profiler.report.kineto_trace import innermost, union_us

MAIN, AUTOGRAD, SENDER, STREAM = 100, 200, 300, 7
FLOORS = {"pinned_d2h": 5e10, "pinned_h2d": 5e10, "device_copy": 3e12}


class Trace:
    """Builds traceEvents: our spans, ops, runtime calls and the GPU work they launch."""

    def __init__(self):
        self.events, self.corr = [], 1000

    def x(self, cat, name, tid, ts, dur, **args):
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur,
                            "args": args})

    def launch(self, tid, t, gpu_ts, gpu_dur, cat="kernel", name="void k_add<float>", call="cudaLaunchKernel",
               call_tid=None, ext=None, **args):
        self.corr += 1
        ids = {"External id": ext} if ext is not None else {}
        self.x("cuda_runtime", call, call_tid or tid, t, 2.0, correlation=self.corr, **ids)
        self.x(cat, name, STREAM, gpu_ts, gpu_dur, correlation=self.corr, stream=STREAM, **ids, **args)


def build(tmp_path, step=10) -> tuple:
    t = Trace()
    t.x("user_annotation", f"ProfilerStep#{step}", MAIN, 0, 1000)
    t.x("user_annotation", "target.pack_hidden", MAIN, 10, 100)
    for i in range(10):   # ten 1 us kernels, 9 us apart: the stream idles between them
        t.launch(MAIN, 12 + 9 * i, 20 + 9 * i, 1.0, name="void index_kernel")
    t.x("gpu_user_annotation", "target.pack_hidden", STREAM, 20, 82)
    t.x("user_annotation", "d2h_copy", MAIN, 200, 50)
    t.launch(MAIN, 205, 210, 20.0, cat="gpu_memcpy", name="Memcpy DtoH (Device -> Pinned)",
             call="cudaMemcpyAsync", bytes=1_000_000)
    t.x("user_annotation", "drafter.fwd_bwd", MAIN, 300, 500)
    for i in range(4):   # forward on the training thread, backward from autograd's
        t.launch(MAIN, 305 + i, 310 + 50 * i, 50.0, name="sm90_gemm")
        t.launch(AUTOGRAD, 520 + i, 520 + 40 * i, 40.0, name="void backward_kernel")
    t.x("cpu_op", "aten::mm", MAIN, 304, 10, **{"External id": 1})
    t.x("cuda_runtime", "cudaStreamSynchronize", MAIN, 700, 50.0, correlation=1)
    t.x("user_annotation", "transfer.send", SENDER, 400, 30)
    t.x("cpu_op", "aten::copy_", SENDER, 402, 20, **{"External id": 77})
    t.launch(SENDER, 405, 406, 10.0, cat="gpu_memcpy", name="Memcpy DtoD (Device -> Device)", call="cudaMemcpyAsync",
             call_tid=999, ext=77, bytes=300_000)   # the runtime call's tid is stale; its op's is right
    t.x("user_annotation", "transfer.wait_slot", MAIN, 850, 40)
    t.launch(MAIN, 900, 905, 5.0, name="void stray_kernel")   # outside every span
    run = tmp_path / "run"
    (run / "kineto").mkdir(parents=True)
    (run / "profile").mkdir()
    with gzip.open(run / "kineto" / f"rank1-step{step}.json.gz", "wt") as f:
        json.dump({"distributedInfo": {"rank": 1, "world_size": 2}, "traceEvents": t.events}, f)
    spans = [{"name": "target.pack_hidden", "gpu_seconds": 90e-6, "cpu_seconds": 100e-6},
             {"name": "d2h_copy", "gpu_seconds": 20.5e-6, "cpu_seconds": 50e-6},
             {"name": "drafter.fwd_bwd", "gpu_seconds": 400e-6, "cpu_seconds": 500e-6},
             {"name": "transfer.send", "gpu_seconds": None, "cpu_seconds": 30e-6},
             {"name": "transfer.wait_slot", "gpu_seconds": 50e-6, "cpu_seconds": 40e-6}]
    lines = [{"type": "run_start", "schema": 1, "rank": 1, "role": "target", "floors": FLOORS, "time_unix": 1.0},
             {"type": "event", "kind": "capture", "rank": 1, "role": "target", "step": step, "steps": [step, step],
              "bytes": 1, "captured_spans": spans, "time_unix": 2.0}]
    (run / "profile" / "rank1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return run


def test_each_span_gets_the_gpu_work_it_launched(tmp_path):
    rep = kernels(build(tmp_path))
    (rank,) = rep["ranks"]
    assert rep["capture"] == 10 and rep["aligned"] and rank["device"] == "cuda" and rank["steps"] == [10, 10]
    spans = {s["name"]: s for s in rank["spans"]}
    pack = spans["target.pack_hidden"]
    assert pack["kernels"] == [{"name": "void index_kernel", "count": 10, "seconds": pytest.approx(10e-6)}]
    assert pack["our_gpu_window_seconds"] == 90e-6 and pack["kineto_gpu_window_seconds"] == pytest.approx(82e-6)
    assert pack["busy_share"] == pytest.approx(10 / 90) and pack["bound"] == "launch- or sync-bound"
    assert pack["idle_seconds"] == pytest.approx(80e-6) and pack["launches"] == 10
    assert pack["host_launch_seconds"] == pytest.approx(20e-6)
    fwd = spans["drafter.fwd_bwd"]
    assert {k["name"]: k["count"] for k in fwd["kernels"]} == {"sm90_gemm": 4, "void backward_kernel": 4}
    assert fwd["kernel_busy_seconds"] == pytest.approx(360e-6)   # 310-510 and 520-680
    assert fwd["host_sync_seconds"] == pytest.approx(50e-6) and fwd["bound"] == "GPU-busy"
    copy = spans["d2h_copy"]["copies"][0]
    assert copy["floor"] == "pinned_d2h" and copy["bytes_per_s"] == pytest.approx(5e10)
    assert copy["floor_share"] == pytest.approx(1.0)
    dtod = spans["transfer.send"]["copies"][0]
    assert dtod["floor"] == "device_copy" and dtod["bytes_per_s"] == pytest.approx(2 * 300_000 / 10e-6)
    assert spans["(outside our spans)"]["kernels_total"]["count"] == 1
    wait = spans["transfer.wait_slot"]   # a wait with a GPU window but no GPU work of its own: no verdict
    assert wait["our_gpu_window_seconds"] == 50e-6 and wait["busy_share"] == 0 and wait["bound"] is None


def test_the_text_names_the_window_and_the_verdicts(tmp_path, capsys):
    run = build(tmp_path)
    assert report_cli.main(["kernels", str(run)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("capture at step 10 (the captured steps 10-10 only")
    assert "target.pack_hidden" in text and "launch- or sync-bound" in text and "of the pinned_d2h floor" in text


@pytest.mark.parametrize("args, why", [(["--capture", "99"], "no capture begins at step 99; captures begin at 10"),
                                       ([], None)])
def test_missing_captures_are_one_line_exit_2(tmp_path, capsys, args, why):
    run = build(tmp_path)
    if why is None:   # no kineto directory at all
        for p in (run / "kineto").iterdir():
            p.unlink()
        why = "no captures in"
    assert report_cli.main(["kernels", str(run), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and why in err


def test_a_file_that_is_not_a_trace_is_one_line_exit_2(tmp_path, capsys):
    run = build(tmp_path)
    (run / "kineto" / "rank1-step10.json.gz").write_bytes(b"not gzip")
    assert report_cli.main(["kernels", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a readable Kineto trace" in err


def test_innermost_and_union():
    assert innermost([(0, 10, "a"), (2, 5, "b"), (6, 8, "c")], [(1, 1), (3, 2), (7, 3), (9, 4), (11, 5)]) == {
        1: "a", 2: "b", 3: "c", 4: "a", 5: None}
    assert union_us([(0, 10), (5, 12), (20, 21)]) == 13


def test_the_report_reads_captures_without_torch(tmp_path):
    import subprocess
    import sys
    run = build(tmp_path)
    code = ("import sys; from dflash import report_cli; rc = report_cli.main(['kernels', sys.argv[1], '--json']); "
            "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', rc, file=sys.stderr)")
    r = subprocess.run([sys.executable, "-c", code, str(run)], capture_output=True, text=True, timeout=60)
    assert r.stderr.strip().splitlines()[-1] == "NO-TORCH 0", r.stderr


def test_a_gzip_bomb_is_refused_at_the_limit_unread(tmp_path, capsys, monkeypatch):
    import importlib
    import tracemalloc

    kernels_mod = importlib.import_module("profiler.report.kernels")   # the package's `kernels` is the function
    run = build(tmp_path)
    path = run / "kineto" / "rank1-step10.json.gz"
    with gzip.open(path, "wb") as f:   # 16 MB of whitespace: a few kB on disk
        for _ in range(16):
            f.write(b" " * (1 << 20))
    monkeypatch.setattr(kernels_mod, "MAX_TRACE_BYTES", 1 << 20)
    tracemalloc.start()
    try:
        assert report_cli.main(["kernels", str(run)]) == 2
        peak_bytes = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err and f"past {1 << 20} bytes" in err
    assert peak_bytes < 4 << 20   # the limit's bytes, not the file's 16 MB


def test_a_deeply_nested_trace_is_one_line_exit_2(tmp_path, capsys):
    run = build(tmp_path)
    with gzip.open(run / "kineto" / "rank1-step10.json.gz", "wt") as f:
        f.write('{"traceEvents": [' + "[" * 100_000 + "]" * 100_000 + "]}")
    assert report_cli.main(["kernels", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nested deeper than" in err
