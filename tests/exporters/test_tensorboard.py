"""The TensorBoard sink (exporters/tensorboard.py), read back with TensorBoard's own reader (EventAccumulator):
its scalars are the fold's samples, tagged by window; on the session's healthy run (tests/conftest.py,
`--sinks tensorboard`) each rank's tokens/s, loss and token total equal its run log's; a sink whose library is
missing, or one --sinks does not know, is one line and exit 2 before any rank."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from exporters.fold import Buckets, Fold  # noqa: E402
from exporters.tensorboard import NOT_SCALARS, TensorBoardExporter, tag  # noqa: E402

T0 = 1_800_000_000.0


def _records() -> list:
    start = {"type": "run_start", "time_unix": T0, "rank": 0, "role": "drafter", "schema": 1, "run_id": "r1",
             "hostname": "h", "device": "cpu", "t_s": 0.0, "histogram_buckets_seconds": [0.1, 1.0]}
    out = [start]
    for k in range(3):
        out.append({"type": "tick", "time_unix": T0 + 5 * k + 4, "rank": 0, "role": "drafter", "index": k,
                    "t_s": 5.0 * k + 4, "step": 10 * k + 8, "counters": {"tokens": 4096 * (k + 1)},
                    "spans": {"drafter.fwd_bwd": {"count": 8 * (k + 1), "cpu_seconds": 3.0 * (k + 1),
                                                  "self_seconds": 3.0 * (k + 1)}}})
        out.append({"type": "interval", "time_unix": T0 + 5 * k + 5, "rank": 0, "role": "drafter", "index": k,
                    "step": 10 * (k + 1), "duration_seconds": 5.0, "start_s": 5.0 * k, "end_s": 5.0 * (k + 1),
                    "spans": {"drafter.fwd_bwd": {"count": 10, "share": 0.6 + 0.1 * k,
                                                  "cpu": {"total_seconds": 3.0, "mean_seconds": 0.3,
                                                          "p95_seconds": 0.4 + k / 10, "max_seconds": 0.5,
                                                          "buckets": [2, 8, 0]}}},
                    "counters": {"tokens": {"total": 5000, "per_second": 1000.0 + k, "run_total": 5000 * (k + 1)}},
                    "metrics": {"loss": {"last": 2.0 - k / 10, "mean": 2.5 - k / 10}},
                    "memory": {"available": False, "reason": "no CUDA device"}})
    out.append({"type": "run_end", "time_unix": T0 + 20, "rank": 0, "role": "drafter", "status": "ok", "step": 30})
    return out


def _scalars(logdir: Path) -> dict:
    """{tag: [(step, value), ...]} of every scalar TensorBoard reads from the directory's event files."""
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def test_every_scalar_sample_of_the_fold_is_read_back_under_its_windows_tag(tmp_path):
    records = _records()
    sink = TensorBoardExporter(tmp_path, 0, "drafter", "r1")
    for rec in records:
        sink.export(rec)
    sink.close(5.0)
    got = _scalars(tmp_path / "tensorboard" / "rank0")
    fold, want, step = Fold(), {}, 0
    for rec in records:
        step = rec.get("step", step) if rec["type"] in ("tick", "interval") else step
        for s in fold(rec):
            if s.family.key not in NOT_SCALARS and s.value is not None and not isinstance(s.value, Buckets):
                want.setdefault(tag(s), []).append((step, s.value))
    assert set(got) == set(want)
    for t, points in want.items():
        assert [p[0] for p in got[t]] == [p[0] for p in points], t
        assert [p[1] for p in got[t]] == pytest.approx([p[1] for p in points], rel=1e-6), t   # float32 in the file
    # the windows as the tags name them: an interval's gauges, the run's totals
    assert got["interval/tokens_rate"] == [(10, 1000.0), (20, 1001.0), (30, 1002.0)]
    assert [p[0] for p in got["interval/span_share/drafter.fwd_bwd"]] == [10, 20, 30]
    assert [p[1] for p in got["interval/span_share/drafter.fwd_bwd"]] == pytest.approx([0.6, 0.7, 0.8])
    assert got["run/tokens"] == [(8, 4096.0), (18, 8192.0), (28, 12288.0)]
    assert [v for _, v in got["interval/train_loss"]] == pytest.approx([2.5, 2.4, 2.3])


def _intervals_and_ticks(run: Path, rank: int) -> tuple[list, list]:
    recs = [json.loads(line) for line in (run / "profile" / f"rank{rank}.jsonl").read_text().splitlines()]
    return [r for r in recs if r["type"] == "interval"], [r for r in recs if r["type"] == "tick"]


def test_the_healthy_runs_scalars_are_its_run_logs(healthy_run):
    """Each rank's tokens/s per interval (at the interval's step), its token total at its last tick, and the
    drafter's loss per interval, as TensorBoard reads them, are the run log's."""
    assert healthy_run.returncode == 0, healthy_run.stderr[-2000:]
    for rank in (0, 1):
        got = _scalars(healthy_run.run / "tensorboard" / f"rank{rank}")
        intervals, ticks = _intervals_and_ticks(healthy_run.run, rank)
        rates = [r["counters"]["tokens"]["per_second"] for r in intervals
                 if (r.get("counters") or {}).get("tokens", {}).get("per_second") is not None]
        assert [v for _, v in got["interval/tokens_rate"]] == pytest.approx(rates, rel=1e-6)
        assert got["run/tokens"][-1][1] == pytest.approx(ticks[-1]["counters"]["tokens"], rel=1e-6)
        assert got["run/tokens"][-1][0] == ticks[-1]["step"]
        if intervals[0]["role"] == "drafter":
            losses = [r["metrics"]["loss"]["mean"] for r in intervals if "loss" in (r.get("metrics") or {})]
            assert [v for _, v in got["interval/train_loss"]] == pytest.approx(losses, rel=1e-6)


@pytest.mark.parametrize("sinks, said", [("bogus", "'bogus' is not one of: tensorboard"),
                                         ("tensorboard", "pip install tensorboard")])
def test_a_sink_it_cannot_make_is_one_line_and_exit_2_before_any_rank(tmp_path, train_main, monkeypatch, sinks,
                                                                       said):
    monkeypatch.setitem(sys.modules, "tensorboard", None)   # as where it is not installed: find_spec says None
    r = train_main(["--run-dir", tmp_path / "run", "--sinks", sinks, "--device", "cpu"])
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "telemetry.sinks" in lines[0] and said in lines[0], r.stderr
    assert not (tmp_path / "run").exists()
