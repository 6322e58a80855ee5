"""GPU timing on sampled steps (profiler/cuda_timing.py GpuSampler, `--profile-gpu-every N`), on CPU with the
fake events and device timeline of test_cuda_sharing.py: untimed steps record no event and log CPU spans, the
interval entry says how many spans carry GPU times and scales its share, detail windows are timed whole, and
a span keeps the mode it was entered in across a step change or a fault."""
from __future__ import annotations

import random

import pytest

import profiler
from profiler.cuda_timing import EventPool, GpuSampler
from profiler.faults import FaultPlan, InjectedFault, parse_faults
from tests.profiler.test_cuda_sharing import Event, Gpu


class Scripted(random.Random):
    """random() answers from a list, in order, then 0.99 (untimed at every > 1)."""

    def __init__(self, values):
        super().__init__(0)
        self.values = list(values)

    def random(self):
        return self.values.pop(0) if self.values else 0.99


def test_the_sampler_times_bursts_then_one_step_in_every_at_random():
    s = GpuSampler(4, burst=2, rng=Scripted([0.1, 0.3, 0.2, 0.9]))
    seen = []
    for _ in range(6):
        s.next_step()
        seen.append(s.timed[0])
    # the burst's two steps; then timed where random() * 4 < 1: 0.1 and 0.2 yes, 0.3 and 0.9 no
    assert seen == [True, True, True, False, True, False]
    every_step = GpuSampler(1, rng=Scripted([0.99]))
    every_step.next_step()
    assert every_step.timed == [True]
    assert GpuSampler(8).timed == [True]          # before any set_step: timed (a loop without steps)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "4", None])
def test_a_bad_gpu_every_is_refused_with_its_value(bad):
    with pytest.raises(ValueError, match=f"gpu_every must be an int >= 1, got {bad!r}"):
        GpuSampler(bad)


def run(tmp_path, steps, every, rng_values, detail_steps=0, fault_plan=None):
    """`steps(gpu, prof)` under a profiler with fake events and a scripted sampler; (gpu, pool, interval, spans)."""
    gpu = Gpu()
    pool = EventPool(lambda: Event(gpu), prealloc=0)
    with profiler.Profiler(tmp_path, console=False, control=False, background=False, measure_floors=False,
                           interval_s=3600.0, event_pool=pool, detail_steps=detail_steps, gpu_every=every,
                           gpu_rng=Scripted(rng_values), fault_plan=fault_plan) as prof:
        steps(gpu, prof)
        interval = prof.close_interval()
    recs, _ = profiler.read_records(prof.log_path)
    assert [r["gpu_every"] for r in recs if r["type"] == "run_start"] == [every]
    return gpu, pool, interval, [s for r in recs if r["type"] == "spans" for s in r["spans"]]


def eight_steps(gpu, prof):
    for step in range(8):
        prof.set_step(step)
        with profiler.span("drafter.fwd_bwd"):
            gpu.now_ms += 2.0
        with profiler.span("h2d_copy", bytes=1000):
            gpu.now_ms += 0.5


def test_untimed_steps_record_no_events_and_the_entry_scales_its_share(tmp_path):
    # steps 0, 3 and 6 timed (random() * 4 < 1), the other five not
    gpu, pool, interval, _ = run(tmp_path, eight_steps, 4, [0.1, 0.5, 0.5, 0.2, 0.5, 0.5, 0.0, 0.5])
    assert gpu.records == 3 * 3          # per timed step: a start and two ends (the copy shares the boundary)
    e, c = interval["spans"]["drafter.fwd_bwd"], interval["spans"]["h2d_copy"]
    assert (e["count"], e["gpu_count"], c["count"], c["gpu_count"]) == (8, 3, 8, 3)
    assert e["gpu"]["total_seconds"] == pytest.approx(0.006) and sum(e["gpu"]["buckets"]) == 3
    assert sum(e["cpu"]["buckets"]) == 8 and "gpu_unresolved" not in e
    assert c["bandwidth_bytes_per_s"] == pytest.approx(3000 / 0.0015)   # timed spans' bytes over their GPU time
    assert c["bytes"] == 8000
    assert pool.created == pool.free                                    # every event back


def test_the_share_estimate_is_scaled_and_capped_at_the_span_threads(tmp_path):
    from profiler.intervals import sampled_share
    assert sampled_share(0.1, 8, 8, 1) == 0.1           # every span timed: unscaled (and uncapped)
    assert sampled_share(0.1, 8, 2, 1) == pytest.approx(0.4)
    assert sampled_share(0.4, 8, 2, 1) == 1.0           # one thread: at most its whole wall
    assert sampled_share(0.4, 8, 2, 2) == pytest.approx(1.6)


def test_detail_window_steps_are_timed_whole(tmp_path):
    # detail_steps=2: a burst of 2 + 8 steps from the start, then never (0.99)
    gpu, _, interval, spans = run(tmp_path, eight_steps, 1000, [], detail_steps=2)
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
    gpu, pool, interval, _ = run(tmp_path, steps, 2, [0.0])
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
    gpu, pool, interval, _ = run(tmp_path, steps, 2, [0.0, 0.0, 0.9], fault_plan=plan)
    e = interval["spans"]["drafter.fwd_bwd"]
    assert (e["count"], e["gpu_count"]) == (2, 1)      # step 0 timed; step 1 cancelled; step 2 untimed: CPU
    assert e["gpu"]["total_seconds"] == pytest.approx(0.001) and sum(e["cpu"]["buckets"]) == 2
    assert pool.created == pool.free


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
