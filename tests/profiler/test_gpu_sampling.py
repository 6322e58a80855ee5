"""GPU timing on sampled steps (profiler/cuda_timing.py GpuSampler, `--profile-gpu-steps-per-s`), on CPU with the
fake events and device timeline of test_cuda_sharing.py: the chance follows the last interval's step rate,
untimed steps record no event and log CPU spans, the interval entry says how many spans carry GPU times and
scales its share, detail windows are timed whole, and a span keeps the mode it was entered in across a step
change or a fault."""
from __future__ import annotations

import random

import pytest

import profiler
from profiler.cuda_timing import EventPool, GpuSampler
from profiler.faults import FaultPlan, InjectedFault, parse_faults
from tests.profiler.test_cuda_sharing import Event, Gpu
from tests.profiler.build import make_profiler


class Scripted(random.Random):
    """random() answers from a list, in order, then 0.99 (untimed at every > 1)."""

    def __init__(self, values):
        super().__init__(0)
        self.values = list(values)

    def random(self):
        return self.values.pop(0) if self.values else 0.99


def steps(sampler, n):
    out = []
    for _ in range(n):
        sampler.next_step()
        out.append(sampler.timed[0])
    return out


def test_the_chance_follows_the_last_intervals_step_rate_and_bursts_come_first():
    s = GpuSampler(5.0, rng=Scripted([0.05, 0.3, 0.2, 0.9]))
    assert steps(s, 40) == [True] * 40            # the first interval: no rate yet, every step
    s.interval_closed(2.0, burst=2)               # 40 steps in 2 s: 20 a second, so p = 5 / 20
    assert s.p == 0.25 and s.steps == 0
    # the burst's two steps; then timed where random() < 0.25: 0.05 and 0.2 yes, 0.3 and 0.9 no
    assert steps(s, 6) == [True, True, True, False, True, False]
    s.steps = 3
    s.interval_closed(1.0, burst=0)               # 3 steps a second: slower than 5 a second, every step
    assert s.p == 1.0 and steps(s, 3) == [True] * 3
    s.interval_closed(60.0, burst=0)              # no step at all: every step again
    assert s.p == 1.0


def test_zero_times_every_step_whatever_the_rate():
    s = GpuSampler(0.0, rng=Scripted([]))
    steps(s, 1000)
    s.interval_closed(1.0, burst=0)
    assert s.p == 1.0 and steps(s, 5) == [True] * 5


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), True, "4", None])
def test_a_bad_gpu_steps_per_s_is_refused_with_its_value(bad):
    with pytest.raises(ValueError, match=r"gpu_steps_per_s must be a finite number >= 0, got "):
        GpuSampler(bad)


def run(tmp_path, body, p, rng_values, detail_steps=0, fault_plan=None):
    """`body(gpu, prof)` under a profiler with fake events and a scripted sampler whose chance is `p` (as if the
    last interval ran 10 steps a second); (gpu, pool, interval, spans)."""
    gpu = Gpu()
    pool = EventPool(lambda: Event(gpu), prealloc=0)
    with make_profiler(tmp_path, control=False, background=False, measure_floors=False,
                           interval_s=3600.0, event_pool=pool, detail_steps=detail_steps, gpu_steps_per_s=10.0 * p,
                           rng=Scripted(rng_values), fault_plan=fault_plan) as prof:
        prof.gpu_sampler.steps = 10
        prof.gpu_sampler.interval_closed(1.0, prof.gpu_sampler.burst)
        body(gpu, prof)
        interval = prof.close_interval()
    recs, _ = profiler.read_records(prof.log_path)
    assert [r["gpu_steps_per_s"] for r in recs if r["type"] == "run_start"] == [10.0 * p]
    return gpu, pool, interval, [s for r in recs if r["type"] == "spans" for s in r["spans"]]


def eight_steps(gpu, prof):
    for step in range(8):
        prof.set_step(step)
        with profiler.span("drafter.fwd_bwd"):
            gpu.now_ms += 2.0
        with profiler.span("h2d_copy", bytes=1000):
            gpu.now_ms += 0.5


def test_untimed_steps_record_no_events_and_the_entry_scales_its_share(tmp_path):
    # steps 0, 3 and 6 timed (random() < 0.25), the other five not
    gpu, pool, interval, _ = run(tmp_path, eight_steps, 0.25, [0.1, 0.5, 0.5, 0.2, 0.5, 0.5, 0.0, 0.5])
    assert gpu.records == 3 * 3          # per timed step: a start and two ends (the copy shares the boundary)
    e, c = interval["spans"]["drafter.fwd_bwd"], interval["spans"]["h2d_copy"]
    assert (e["count"], e["gpu_count"], c["count"], c["gpu_count"]) == (8, 3, 8, 3)
    assert e["gpu"]["total_seconds"] == pytest.approx(0.006) and sum(e["gpu"]["buckets"]) == 3
    assert sum(e["cpu"]["buckets"]) == 8 and "gpu_unresolved" not in e
    assert c["bandwidth_bytes_per_s"] == pytest.approx(3000 / 0.0015)   # timed spans' bytes over their GPU time
    assert c["bytes"] == 8000
    assert pool.created == pool.free                                    # every event back
    from exporters.console import format_interval
    assert "  gpu times from sampled steps: 6 of 16 spans" in format_interval(interval)


def test_the_share_estimate_is_scaled_and_capped_at_the_span_threads(tmp_path):
    from profiler.intervals import sampled_share
    assert sampled_share(0.1, 8, 8, 1) == 0.1           # every span timed: unscaled (and uncapped)
    assert sampled_share(0.1, 8, 2, 1) == pytest.approx(0.4)
    assert sampled_share(0.4, 8, 2, 1) == 1.0           # one thread: at most its whole wall
    assert sampled_share(0.4, 8, 2, 2) == pytest.approx(1.6)


def test_detail_window_steps_are_timed_whole(tmp_path):
    # detail_steps=2: a burst of 2 + 8 steps from the start, then never (0.99)
    gpu, _, interval, spans = run(tmp_path, eight_steps, 0.01, [], detail_steps=2)
    assert interval["spans"]["drafter.fwd_bwd"]["gpu_count"] == 8
    kept = [s for s in spans if s["name"] == "drafter.fwd_bwd"]
    assert len(kept) == 2 and all(s["gpu_seconds"] == pytest.approx(0.002) for s in kept)


def test_a_span_keeps_the_mode_it_was_entered_in(tmp_path):
    def steps(gpu, prof):
        prof.set_step(0)                                 # timed (0.0)
        with profiler.span("drafter.step"):
            prof.set_step(1)                             # untimed (0.99): the inner spans are CPU spans
            for _ in range(2):
                with profiler.span("drafter.fwd_bwd"):
                    with profiler.span("drafter.fwd_bwd"):   # one name nested: each exit matches its enter
                        gpu.now_ms += 1.0
    gpu, pool, interval, _ = run(tmp_path, steps, 0.5, [0.0])
    outer, inner = interval["spans"]["drafter.step"], interval["spans"]["drafter.fwd_bwd"]
    assert outer["gpu_count"] == 1 and outer["gpu"]["total_seconds"] == pytest.approx(0.002)
    assert inner["count"] == 4 and inner["gpu"] is None and "gpu_count" not in inner
    assert gpu.records == 2 and pool.created == pool.free


def test_a_fault_raised_on_enter_leaves_the_span_usable(tmp_path):
    plan = FaultPlan(parse_faults("crash@drafter.fwd_bwd:step=1"), rank=0)

    def steps(gpu, prof):
        for step in range(3):
            prof.set_step(step)
            with pytest.raises(InjectedFault) if step == 1 else _nothing():
                with profiler.span("drafter.fwd_bwd"):
                    gpu.now_ms += 1.0
        assert profiler.span("drafter.fwd_bwd")._modes == []   # the cancelled enter's mode went with it
    gpu, pool, interval, _ = run(tmp_path, steps, 0.5, [0.0, 0.0, 0.9], fault_plan=plan)
    e = interval["spans"]["drafter.fwd_bwd"]
    assert (e["count"], e["gpu_count"]) == (2, 1)      # step 0 timed; step 1 cancelled; step 2 untimed: CPU
    assert e["gpu"]["total_seconds"] == pytest.approx(0.001) and sum(e["cpu"]["buckets"]) == 2
    assert pool.created == pool.free


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_an_interval_close_sets_the_next_intervals_chance(tmp_path):
    from tests.profiler.test_intervals import FakeClock, make_prof
    clock = FakeClock()
    with make_prof(tmp_path, clock, gpu_steps_per_s=2.0, detail_steps=3) as prof:
        for step in range(20):
            prof.set_step(step)
        clock.t += 2.0                              # 20 steps in 2 s: 10 a second
        prof.close_interval()
        assert (prof.gpu_sampler.p, prof.gpu_sampler.burst) == (0.2, 3 + 8)
