"""Each step's allocator peak beside its sizes (profiler/memory_steps.py, issue #50): the step that ended gets the
peaks read at the next boundary, rows are bounded per interval with the highest peaks kept, bad sizes are refused
at the call, and on a GPU a real run's intervals carry the rows (the peak of a step that allocated more is its)."""
from __future__ import annotations

import pytest
import torch

import profiler
from profiler.memory import memory_state
from profiler.memory_steps import ROWS_PER_INTERVAL, StepPeaks, thin
from tests.profiler.build import make_profiler


def fake(values):
    it = iter(values)
    return lambda index: next(it)


def test_the_step_that_ended_gets_the_peaks_read_at_the_next_boundary():
    sp = StepPeaks(0, fake([(1, 2, 0), (150, 300, 40), (120, 310, 41), (500, 600, 42)]))
    sp.on_step(0)                       # the first boundary: no step ended (model build goes to the maxima only)
    sp.sizes({"tokens": 10})
    sp.on_step(1)
    sp.sizes({"tokens": 20})
    sp.on_step(2)
    sp.on_step(3)                       # step 2 named no sizes: kept with {}
    part, peaks = sp.take()
    assert [(r["step"], r["peak_allocated_bytes"], r["allocated_bytes"], r["sizes"]) for r in part["rows"]] == [
        (0, 150, 40, {"tokens": 10}), (1, 120, 41, {"tokens": 20}), (2, 500, 42, {})]
    assert part["steps"] == 3 and peaks == (500, 600)
    assert sp.take() == ({"rows": [], "steps": 0}, (0, 0))   # both start again


@pytest.mark.parametrize("sizes", [{"t": -1}, {"t": True}, {"t": "4"}, {f"s{i}": 1 for i in range(9)}])
def test_bad_sizes_are_refused_at_the_call(sizes):
    with pytest.raises(ValueError, match="memory_sizes"):
        StepPeaks(0, fake([])).sizes(sizes)


def test_an_interval_keeps_at_most_its_rows_with_the_highest_peaks():
    rows = [{"step": i, "peak_allocated_bytes": (i * 37) % 101} for i in range(500)]
    kept = thin(rows, ROWS_PER_INTERVAL)
    assert len(kept) == ROWS_PER_INTERVAL and [r["step"] for r in kept] == sorted(r["step"] for r in kept)
    top = sorted((r["peak_allocated_bytes"] for r in rows), reverse=True)[:ROWS_PER_INTERVAL // 4]
    assert sorted((r["peak_allocated_bytes"] for r in kept), reverse=True)[:len(top)] == top
    assert kept[0]["step"] == 0 and kept[-1]["step"] == 499   # the spread reaches both ends


class _Sampler:
    def interval_summary(self, reset=True):
        return {"available": False, "reason": "no NVML here"}


def test_memory_state_hands_the_steps_over_with_the_interval():
    sp = StepPeaks(0, fake([(1, 1, 0), (7, 9, 3), (5, 9, 3)]))
    sp.on_step(0)
    sp.sizes({"tokens": 3})
    sp.on_step(1)
    mem = memory_state(_Sampler(), None, interval=True, step_peaks=sp)
    assert mem["steps"]["rows"][0]["sizes"] == {"tokens": 3} and mem["steps"]["steps"] == 1
    assert "steps" not in memory_state(_Sampler(), None, interval=False, step_peaks=sp)   # a snapshot takes none


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_intervals_carry_each_steps_peak_and_sizes(tmp_path):
    dev = torch.device("cuda", torch.cuda.current_device())
    with make_profiler(tmp_path, control=False, measure_floors=False, background=False, interval_s=3600.0,
                       device=dev, floors={}) as prof:
        for step in range(4):
            profiler.set_step(step)
            x = torch.empty((step + 1) * 2 ** 26, dtype=torch.uint8, device=dev)   # (step + 1) x 64 MiB
            profiler.memory_sizes(mib=(step + 1) * 64)
            del x
        profiler.set_step(4)
        prof.collector.close()
    recs = [r for r in profiler.read_records(tmp_path / "profile" / "rank0.jsonl")[0] if r["type"] == "interval"]
    rows = [r for rec in recs for r in rec["memory"]["steps"]["rows"]]
    assert [r["sizes"]["mib"] for r in rows] == [64, 128, 192, 256]
    for r in rows:
        assert r["peak_allocated_bytes"] - r["allocated_bytes"] >= r["sizes"]["mib"] * 2 ** 20
    assert recs[0]["memory"]["allocator"]["peak_allocated_bytes"] >= 256 * 2 ** 20
