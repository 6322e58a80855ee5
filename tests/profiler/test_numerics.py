"""Issue #49, the numerics early warning's parts: the device statistics (profiler/nonfinite.py tensor_stats,
check_stats) read back on the non-finite checks' path without a host sync, the detector's rules and its quiet
cases (profiler/numerics.py), the drift fault (profiler/faults.py) and the profiler's event, console line and
interval part. The CUDA test runs under set_sync_debug_mode("error") and skips without a GPU."""
from __future__ import annotations

import json
import logging
import math
import random

import pytest
import torch

import profiler
from profiler import numerics
from profiler.schema import views
from profiler.faults import FaultPlan, check_injection_points, parse_faults
from profiler.nonfinite import NonfiniteMonitor, tensor_stats, update_ratio
from profiler.numerics import NumericsDetector, drift_line
from tests.profiler.build import make_profiler

F32 = {"dtype": "float32", "log2_max": math.log2(torch.finfo(torch.float32).max)}


def feed(det: NumericsDetector, values: dict, span="s.x", tensor="t", jump=False) -> list:
    """Each {step: absmax} as a one-tensor row of 1000 values (RMS a tenth of the absmax)."""
    warned = []
    det._on_warning = warned.append
    for step, v in values.items():
        row = [v, v / 10 * math.sqrt(1000), 0.0, 0.0, 0.0]
        det.observe(span, step, [tensor], [row], {**F32, "counts": [1000], "jump": jump})
    return warned


def noisy(steps, level=4.0, spread=0.15, seed=0) -> dict:
    rng = random.Random(seed)
    return {s: level * (1 + rng.uniform(-spread, spread)) for s in steps}


# ---- the device statistics ---------------------------------------------------------------------------------------
def test_tensor_stats_row_counts_near_overflow_underflow_and_nonfinite():
    big, tiny = torch.finfo(torch.float32).max, torch.finfo(torch.float32).tiny
    t = torch.tensor([3.0, -4.0, big / 2, tiny / 4, 0.0, float("nan"), float("-inf"), 1.0])
    absmax, norm, near, under, bad = tensor_stats(t).tolist()
    assert math.isnan(absmax) and math.isnan(norm)   # NaN carries; the count says how many
    assert (near, under, bad) == (2.0, 1.0, 2.0)     # big/2 and -inf; the subnormal (0 is not one); nan and -inf
    absmax, norm, near, under, bad = tensor_stats(torch.tensor([[3.0, -4.0]], dtype=torch.bfloat16)).tolist()
    assert (absmax, norm, near, under, bad) == (4.0, 5.0, 0.0, 0.0, 0.0)
    assert tensor_stats(torch.tensor(7, dtype=torch.int64)).tolist()[0] == 7.0


def test_update_ratio_is_the_steps_change_over_the_weights():
    params = [torch.full((3,), 2.0), torch.full((4,), 1.0)]
    before = torch._foreach_mul(params, 1.0)
    params[0].add_(0.5)   # the "step": |delta| = sqrt(3 * 0.25), |w| = sqrt(3 * 4 + 4)
    ratio = update_ratio(before, params)
    assert ratio.dtype == torch.float32 and ratio.item() == pytest.approx(math.sqrt(0.75) / 4.0)


def test_check_stats_rides_the_checks_queue_and_is_read_only_at_a_poll():
    """On the CPU the structure is the proof: check_stats queues a tensor (no .item(), no .tolist()) and nothing
    reaches the detector before the collector's poll; flags and statistics share a batch in order."""
    rows, found = [], []
    mon = NonfiniteMonitor(rank=0, on_found=found.append, on_stats=lambda *a: rows.append(a))
    mon.check("a.b", 1, {"x": torch.tensor(float("inf"))})
    mon.check_stats("a.b", 1, {"x": torch.tensor([1.0, -2.0]), "y": torch.zeros(3)}, jump=True)
    queued = mon._queued[-1]
    assert isinstance(queued[3], torch.Tensor) and queued[3].shape == (2, len(numerics.STATS))
    assert rows == [] and found == [] and mon.pending() == 2
    assert mon.poll() == 2
    (span, step, names, got, meta), = rows
    assert (span, step, names) == ("a.b", 1, ["x", "y"]) and got[0][:2] == [2.0, pytest.approx(math.sqrt(5))]
    assert meta["counts"] == [2, 3] and meta["dtype"] == "float32" and meta["jump"] is True
    assert found[0]["tensor"] == "x"
    with pytest.raises(ValueError, match="at most 8"):
        mon.check_stats("a.b", 1, {str(i): torch.ones(1) for i in range(9)})


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_statistics_add_no_host_sync(tmp_path):
    dev = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(1 << 20, device=dev, dtype=torch.bfloat16)
    with make_profiler(tmp_path, control=False, measure_floors=False, background=False, interval_s=3600.0,
                       device=dev, floors={}) as prof:
        params = [torch.randn(256, device=dev) for _ in range(3)]
        for _ in range(2):   # first launches load their kernels (lazy loading may wait): warm them
            profiler.check_numerics("s.x", {"x": x, "loss": x.float().sum()})
            update_ratio(torch._foreach_mul(params, 1.0), params)
            prof.tick()
            prof.nonfinite.settle(timeout_s=10.0)
        torch.cuda.synchronize()              # the test's own sync, before the checked region
        torch.cuda.set_sync_debug_mode("error")
        try:
            torch.cuda._sleep(2_000_000_000)  # about a second of device work queued ahead
            profiler.check_numerics("s.x", {"x": x, "loss": x.float().sum()})
            profiler.check_numerics("s.y", {"update_ratio": update_ratio(torch._foreach_mul(params, 1.0), params)},
                                    jump=True)
            prof.tick()
            assert prof.nonfinite.pending() == 2   # in flight behind the sleep: nothing waited for it
        finally:
            torch.cuda.set_sync_debug_mode(0)
        prof.nonfinite.settle(timeout_s=30.0)
        assert prof.numerics.section()["numerics"]["stages"]["s.x/x"]["samples"] == 3


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_one_pass_statistics_equal_torchs(dtype):
    """The Triton kernel (profiler/numerics_kernel.py) gives torch's row: a contiguous tensor and a column block
    of a packed one (row-strided), with values planted near overflow, below the smallest normal, NaN and Inf; a
    transposed view is not read in place (None: the torch path)."""
    from profiler.nonfinite import torch_stats
    from profiler.numerics_kernel import fused_stats
    info = torch.finfo(dtype)
    packed = torch.randn(3000, 3 * 1024, device="cuda", dtype=torch.float32).to(dtype)
    flat = packed.view(-1)
    flat[[5, 70001, 2_000_003]] = info.max / 3                       # near overflow, one in the middle block
    flat[[11, 3 * 1024 + 1030]] = info.tiny / 8 if dtype != torch.bfloat16 else info.tiny / 2   # subnormal
    for t in (packed, packed[:, 1024:2048], packed[7:2900, 2048:]):
        want = torch_stats(t, info)
        got = fused_stats(t, info.max * 2.0 ** -numerics.NEAR_MAX_BINADES, info.tiny)
        assert got is not None and got.dtype == torch.float32
        assert got[0].item() == want[0].item()                          # the largest |x|: exact
        assert got[1].item() == pytest.approx(want[1].item(), rel=1e-4)  # the norm: float32 sums, any order
        assert got[2:].tolist() == want[2:].tolist()                    # the counts: exact
    flat[[9, 4096 * 5 + 3]] = torch.tensor([float("nan"), float("-inf")], dtype=dtype, device="cuda")
    got, want = fused_stats(packed, info.max * 2.0 ** -numerics.NEAR_MAX_BINADES, info.tiny), torch_stats(packed, info)
    assert got[0].item() == math.inf and math.isnan(got[1].item())      # non-finite carries (inf for NaN: docstring)
    assert got[2:].tolist() == want[2:].tolist() and got[4].item() == 2.0
    assert fused_stats(packed.t(), 1.0, 1e-30) is None                  # not row-strided: the torch path's
    assert fused_stats(packed[:10, :10], 1.0, 1e-30) is None            # too small to be worth a launch


# ---- the detector --------------------------------------------------------------------------------------------
def test_geometric_growth_warns_within_four_samples_with_a_projection():
    det = NumericsDetector(lambda w: None, quiet_steps=10)
    values = noisy(range(0, 20))
    values.update({s: 4.0 * 4.0 ** (s - 19) for s in range(20, 40)})
    warned = feed(det, values, "target.pack_hidden", "layer3")
    (w,) = warned
    assert (w["span"], w["tensor"], w["rule"], w["statistic"]) == ("target.pack_hidden", "layer3", "growth", "absmax")
    assert 20 <= w["step"] <= 23 and w["growth_per_step"] > 1.19
    assert w["steps_to_overflow"] == math.ceil((F32["log2_max"] - math.log2(values[w["step"]])) /
                                              math.log2(w["growth_per_step"]))
    assert det.first == w and len(w["trend"]) <= numerics.HISTORY


def test_no_warning_in_quiet_steps_for_a_falling_loss_or_a_warmup_that_ends():
    det = NumericsDetector(lambda w: None, quiet_steps=15)
    rising = {s: 0.01 * 2.0 ** s for s in range(0, 15)}                 # lr warm-up: grows fast, then flat
    rising.update(noisy(range(15, 80), level=rising[14]))
    assert feed(det, rising, tensor="layer0") == []
    falling = {s: 11.0 * 0.8 ** s + 2.0 for s in range(0, 80)}          # a loss falling fast from the start
    assert feed(det, falling, tensor="loss") == []
    assert feed(det, noisy(range(0, 80), seed=3), tensor="hidden") == []


def test_a_resume_starts_its_quiet_steps_and_baseline_again():
    """A resumed segment's profiler is a new detector: quiet from its first sample, then a baseline of its own."""
    det = NumericsDetector(lambda w: None, quiet_steps=5)
    values = {s: 40.0 * 1.5 ** (s - 100) for s in range(100, 105)}   # settling after the restart: quiet
    values.update(noisy(range(105, 140), level=values[104]))
    assert feed(det, values) == []


def test_slow_growth_and_a_single_spike_do_not_warn():
    det = NumericsDetector(lambda w: None, quiet_steps=0)
    values = {s: 1.0 * 1.05 ** s for s in range(0, 120)}     # 7% a step: under a quarter binade
    assert feed(det, values, tensor="slow") == []
    spiky = noisy(range(0, 60))
    spiky[30] = 400.0
    assert feed(det, spiky, tensor="spiky") == []


def test_absmax_near_the_dtypes_range_warns():
    det = NumericsDetector(lambda w: None, quiet_steps=0)
    half = {"dtype": "float16", "log2_max": math.log2(65504.0)}
    warned = []
    det._on_warning = warned.append
    for step in range(12):
        v = 10.0 if step < 11 else 600.0   # within 2**8 of 65504
        det.observe("s.x", step, ["h"], [[v, v, 0.0, 0.0, 0.0]], {**half, "counts": [1]})
    assert [(w["rule"], w["step"], w["dtype"]) for w in warned] == [("near_range", 11, "float16")]


def test_a_square_near_overflow_warns_even_in_the_quiet_steps_and_only_for_float32_ranges():
    """A learning rate that blows the first update up (0.04 -> 1e17) does it inside its warm-up, then creeps too
    slowly for a growth warning until its norms' squares overflow float32: the square_range rule needs no
    baseline."""
    values = {0: 0.04, 1: 0.05, **{s: 1e17 * 1.1 ** (s - 2) for s in range(2, 30)}}
    det = NumericsDetector(lambda w: None, quiet_steps=20)
    (w,) = feed(det, values, "drafter.fwd_bwd", "layer0")
    assert (w["rule"], w["step"], w["statistic"]) == ("square_range", 2, "absmax")
    assert "its square overflows" in numerics.drift_line({**w, "policy": "warn"}, 0, "drafter")
    below = {s: 2.0 ** 55 for s in range(0, 30)}   # just under 2^56: nothing healthy comes near, nothing said
    assert feed(NumericsDetector(lambda w: None, quiet_steps=0), below, tensor="big") == []
    half = {"dtype": "float16", "log2_max": math.log2(65504.0)}   # a float16 stage's square is not float32's
    warned = []
    det = NumericsDetector(warned.append, quiet_steps=0)
    for step in range(12):
        det.observe("s.x", step, ["h"], [[10.0, 10.0, 0.0, 0.0, 0.0]], {**half, "counts": [1]})
    assert warned == []


def test_an_update_ratio_jumping_tenfold_warns_only_on_a_jump_stage():
    values = noisy(range(0, 30), level=1e-3, spread=0.2)
    values.update({28: 1.1e-3, 29: 0.9e-3, 30: 2e-2, 31: 2.5e-2})   # a step up, not a run of growth
    assert [w["rule"] for w in feed(NumericsDetector(lambda w: None), dict(values), "d.optim", "update_ratio",
                                    jump=True)] == ["jump"]
    assert feed(NumericsDetector(lambda w: None), dict(values), "d.optim", "grad_norm") == []
    values[31] = 1e-3   # one sample only
    assert feed(NumericsDetector(lambda w: None), values, "d.optim", "update_ratio", jump=True) == []


def test_the_interval_section_sums_the_samples_keeps_a_bounded_trend_and_the_first_nonfinite_step():
    det = NumericsDetector(lambda w: None, quiet_steps=0, every=2)
    feed(det, {s: 2.0 ** (s / 10) for s in range(0, 200, 2)})
    det.observe("s.x", 200, ["t"], [[math.inf, math.inf, 1.0, 0.0, 1.0]], {**F32, "counts": [1000]})
    entry = views.Numerics(det.section()["numerics"]).stages["s.x/t"]
    assert entry.samples == 101 and entry.nonfinite == 1 and entry.first_nonfinite_step == 200
    assert entry.growth_per_step == pytest.approx(2 ** 0.1) and len(entry.trend) <= numerics.TREND_POINTS
    assert entry.trend[-1] == [200, None] and entry.absmax_max == pytest.approx(2.0 ** 19.8)
    assert det.section()["numerics"]["stages"] == {}   # a fresh interval: nothing sampled in it


def test_drift_line_says_stage_trend_projection_and_policy():
    w = {"step": 23, "span": "target.pack_hidden", "tensor": "layer3", "statistic": "absmax", "rule": "growth",
         "value": 1200.0, "baseline": 4.6, "growth_per_step": 4.0, "steps_to_overflow": 58, "window": [20, 23],
         "dtype": "float32", "policy": "warn"}
    assert drift_line(w, 1, "target") == (
        "numerics drift: rank 1 (target) step 23: target.pack_hidden layer3 absmax 1200 (baseline 4.6) grows x4 a "
        "step over steps 20-23; overflow (float32) in ~58 steps; no non-finite value yet (--on-numerics-drift warn)")


# ---- the drift fault --------------------------------------------------------------------------------------------
def test_drift_fault_parses_both_separators_and_scales_from_its_step():
    (f,) = parse_faults("drift@target.pack_hidden:step=20,factor=4")
    assert (f.kind, f.span, f.step, f.factor) == ("drift", "target.pack_hidden", 20, 4.0)
    assert parse_faults("drift@a.b:step=2:factor=1.5:rank=1")[0].rank == 1
    plan = FaultPlan([f], rank=0)
    t = torch.ones(2)
    assert plan.corrupt("target.pack_hidden", 19, t) is t
    assert plan.corrupt("target.pack_hidden", 20, t).tolist() == [4.0, 4.0]
    assert plan.corrupt("target.pack_hidden", 22, t).tolist() == [64.0, 64.0]
    assert plan.corrupt("target.pack_hidden", 22, t, kinds=("nan",)) is t
    assert torch.isinf(plan.corrupt("target.pack_hidden", 5000, t)).all()   # past a float: the product overflows


@pytest.mark.parametrize("text, message", [
    ("drift@a.b:step=2", "drift needs step=S and factor=F"),
    ("drift@a.b:factor=2", "drift needs step=S and factor=F"),
    ("drift@a.b:step=2,factor=1", "factor must be a finite number above 1, got '1'"),
    ("drift@a.b:step=2,factor=inf", "factor must be a finite number above 1, got 'inf'"),
    ("nan@a.b:factor=2", "unknown option 'factor=2' in 'nan@a.b:factor=2' (expected step=N or rank=R)"),
])
def test_drift_fault_errors_name_the_problem(text, message):
    with pytest.raises(ValueError, match="^DFLASH_FAULT: ") as info:
        parse_faults(text)
    assert message in str(info.value)


def test_a_drift_fault_needs_a_drift_point():
    faults = parse_faults("drift@target.fwd:step=1,factor=2")
    with pytest.raises(ValueError, match="target.fwd has no drift injection point"):
        check_injection_points(faults, ("target.fwd",), ("target.pack_hidden",), ("target.pack_hidden",))
    check_injection_points(parse_faults("drift@target.pack_hidden:step=1,factor=2"), ("target.fwd",),
                           ("target.pack_hidden",), ("target.pack_hidden",))


# ---- through the profiler ---------------------------------------------------------------------------------------
def test_profiler_writes_the_event_the_console_line_and_the_interval_part(tmp_path, caplog):
    with make_profiler(tmp_path, control=False, measure_floors=False, background=False, interval_s=3600.0,
                       numerics_quiet_steps=3, rank=2, role="target") as prof:
        for step in range(30):
            prof.set_step(step)
            scale = 1.0 if step < 20 else 3.0 ** (step - 19)
            profiler.check_numerics("target.pack_hidden", {"layer1": torch.linspace(-1, 1, 64) * scale,
                                                           "layer2": torch.ones(8) * scale}, policy="warn")
            with caplog.at_level(logging.WARNING, logger="profiler"):
                prof.tick()
        assert profiler.numerics_drift()["step"] <= 23
        rec = prof.close_interval()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("numerics drift:")]
    assert len(lines) == 1 and "rank 2 (target)" in lines[0] and "target.pack_hidden layer" in lines[0]
    logged = [json.loads(line) for line in (tmp_path / "profile" / "rank2.jsonl").read_text().splitlines()]
    events = [views.event(r) for r in logged if r.get("kind") == "numerics_drift"]
    assert {e.tensor for e in events} == {"layer1", "layer2"} and all(e.policy == "warn" for e in events)
    part = views.Interval(rec).numerics
    assert part.every == 1 and part.warnings == 2 and part.stages["target.pack_hidden/layer1"].samples == 30


def test_numerics_off_or_an_unsampled_step_takes_nothing(tmp_path):
    with make_profiler(tmp_path, control=False, measure_floors=False, background=False, interval_s=3600.0,
                       numerics_every=4) as prof:
        prof.set_step(3)
        assert not profiler.numerics_due()
        profiler.check_numerics("s.x", {"t": torch.ones(2)})
        assert prof.nonfinite.pending() == 0
        prof.set_step(4)
        assert profiler.numerics_due()
    (tmp_path / "b").mkdir()
    with make_profiler(tmp_path / "b", control=False, measure_floors=False, background=False, numerics=False) as prof:
        profiler.check_numerics("s.x", {"t": torch.ones(2)})
        assert prof.nonfinite.pending() == 0 and not profiler.numerics_due()
    assert not profiler.numerics_due() and profiler.numerics_drift() is None   # no active profiler
