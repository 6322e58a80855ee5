"""Issue 45: "a resumed GPU run: transfer.wait_slot at 101.76 % of one interval; dflash-report check exits 1".

Not the resume itself: a CUDA span carried across a boundary (the target's wait through the drafter's first
step, which a resume's warm compile cache still makes long) has its GPU time capped, for `share`, at the host
window it can have run in within the interval: max(begin, interval start) .. min(resolution seen, boundary).
The collector sees a pair resolved only at its next poll, so that window runs past the span's end, over the next
span of the same name on the same thread, whose GPU time is counted too: a target that waits for the rest of the
interval then holds more than all of it. One thread's spans of a name run one after another on its stream, so
their GPU windows are disjoint and together fill at most the interval.
The share of a name is therefore capped at the interval times its threads (`_close_spans`)."""
import time


import profiler
from profiler.cuda_timing import EventPool
from tests.profiler.test_intervals_split import FakeEvent, make_prof

WAIT = "transfer.wait_slot"


def test_a_wait_resolved_late_and_the_next_wait_never_hold_more_than_the_interval(tmp_path):
    gpu = {"now_ms": 0.0, "done_ms": -1.0}
    with make_prof(tmp_path, event_pool=EventPool(lambda: FakeEvent(gpu), prealloc=4)) as prof:
        first_wait = profiler.span(WAIT)
        first_wait.__enter__()
        time.sleep(0.2)
        prof.close_interval()                       # the first wait is open across the boundary
        time.sleep(0.2)
        gpu["now_ms"] += 400.0                      # its GPU window: as long as its host time
        first_wait.__exit__(None, None, None)
        with profiler.span(WAIT):                   # the next wait, at once: the drafter is the bound stage
            time.sleep(0.2)
            gpu["done_ms"] = 400.0
            prof.collector.poll()                   # the first pair is seen resolved only now, 0.2 s after its end
            time.sleep(0.2)
            gpu["now_ms"] += 400.0
        gpu["done_ms"] = 800.0
        second = prof.close_interval()
    share = second["spans"][WAIT]["share"]
    assert share <= 1.0 + 1e-9, f"{WAIT} at {share:.2%} of one interval over one thread"
