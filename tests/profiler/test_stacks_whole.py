"""The stack sampler's whole stacks (profiler/stacks.py): root first, counted per thread per interval, bounded to
STACKS_PER_THREAD stacks with the rest in other_samples (so the counts still add up to the samples), at most
MAX_STACK_DEPTH frames deep, interned in the interval's frame table; and a real py-spy sample of this process."""
from __future__ import annotations

import os
import threading

from profiler.schema import views
from profiler.stacks import MAX_STACK_DEPTH, OUTER_FRAMES, STACKS_PER_THREAD, StackSampler, whole_stack
from tests.profiler.test_snapshot import pyspy_thread
from tests.profiler.test_views import read_all


def _sampler(dumps):
    dumps = iter(dumps)
    return StackSampler(1, samples_per_interval=4, interval_s=1.0,
                        runner=lambda pid, native=False, nonblocking=False: next(dumps))


def _stacks_of(summary: dict, thread: dict) -> list:
    """[(labels root first, count, idle)] of a thread's recorded stacks."""
    return [([summary["frames"][i] for i in s["frames"]], s["count"], s["idle_samples"]) for s in thread["stacks"]]


def test_the_most_common_stacks_are_kept_and_the_rest_counted_so_the_counts_add_up():
    hot = [("leaf", "a.py", 1), ("mid", "a.py", 2), ("root", "a.py", 3)]       # innermost first, as py-spy
    rare = [[(f"rare{i}", "b.py", i), ("root", "a.py", 3)] for i in range(STACKS_PER_THREAD + 4)]
    dumps = ([[pyspy_thread("main", 1, hot, active=True)]] * 5 + [[pyspy_thread("main", 1, hot)]] * 2
             + [[pyspy_thread("main", 1, r, active=i % 2 == 0)] for i, r in enumerate(rare)])
    sampler = _sampler(dumps)
    for _ in dumps:
        assert sampler.sample_once()
    summary = sampler.interval_summary()
    (t,) = summary["threads"]
    got = _stacks_of(summary, t)
    assert len(got) == STACKS_PER_THREAD
    assert got[0] == (["root (a.py:3)", "mid (a.py:2)", "leaf (a.py:1)"], 7, 2)      # root first; 2 of 7 waited
    assert sum(n for _, n, _ in got) + t["other_samples"] == t["samples"] == 7 + len(rare)
    assert sum(i for _, _, i in got) + t["other_idle_samples"] == t["idle_samples"]
    assert t["other_samples"] == len(rare) - (STACKS_PER_THREAD - 1) and t["other_idle_samples"] > 0
    assert len(summary["frames"]) == len(set(summary["frames"]))   # each label once in the interval's table
    assert read_all(views.StackSamples(summary)) == []              # every field the sampler writes is documented


def test_a_deep_stack_keeps_its_innermost_frames_under_one_marker():
    frames = [f"f{i} (a.py:{i})" for i in range(MAX_STACK_DEPTH + 10)]   # innermost first
    stack = whole_stack(frames)
    assert len(stack) == MAX_STACK_DEPTH and stack[0] == OUTER_FRAMES
    assert stack[-1] == frames[0] and stack[1] == frames[MAX_STACK_DEPTH - 2]
    assert whole_stack(frames[:3]) == tuple(reversed(frames[:3])) and whole_stack([]) == ()


def test_a_thread_without_frames_is_one_idle_sample_with_an_empty_stack():
    sampler = _sampler([[pyspy_thread("native", 2, [], active=True)]])
    sampler.sample_once()
    summary = sampler.interval_summary()
    assert summary["frames"] == [] and summary["threads"][0]["stacks"] == [
        {"frames": [], "count": 1, "idle_samples": 1}]


def _spin(stop):
    while not stop.is_set():
        sum(i * i for i in range(2000))


def test_real_py_spy_gives_the_spinning_threads_whole_stack_from_its_bootstrap_to_the_loop():
    stop = threading.Event()
    worker = threading.Thread(target=_spin, args=(stop,), name="spinner")
    worker.start()
    try:
        sampler = StackSampler(os.getpid(), samples_per_interval=6, interval_s=10.0)
        for _ in range(6):
            sampler.sample_once()
        summary = sampler.interval_summary()
    finally:
        stop.set()
        worker.join()
    spinner = next(t for t in summary["threads"] if t["native_id"] == worker.native_id)
    stacks = _stacks_of(summary, spinner)
    assert sum(n for _, n, _ in stacks) + spinner["other_samples"] == spinner["samples"] == 6
    # py-spy's non-blocking dump reads the frames while the thread runs: now and then it gets only the innermost
    # (seen once in a CI run: the generator's frame alone). Most samples are whole, and a partial one is the leaf
    # end of a whole one.
    whole = [(labels, n) for labels, n, _ in stacks
             if labels[0].startswith("Thread._bootstrap ") and any(f.startswith("_spin ") for f in labels)]
    assert sum(n for _, n in whole) >= 4, stacks
    for labels, _, _ in stacks:
        assert any(w[len(w) - len(labels):] == labels for w, _ in whole), (labels, whole)
