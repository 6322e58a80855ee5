"""Rank 0's progress line: loss and tau as EMAs with their span, the lr, the rate over a recent window with its
length, and an ETA at that window's step rate."""

from __future__ import annotations

import io
import math
import re

import pytest
import torch

from dflash.progress import EMA_SPAN_STEPS, RECENT_S, Progress, short_duration


class Clock:
    def __init__(self):
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def feed(progress: Progress, clock: Clock, losses, step_s: float = 1.0, tokens_per_step: int = 100, first: int = 0):
    for i, loss in enumerate(losses, first + 1):
        clock.now_s += step_s
        progress.observe(torch.tensor(float(loss)), torch.tensor(2.0), 1e-3)
        progress.update(i, i * tokens_per_step)


def test_the_loss_is_an_ema_over_every_step_with_its_span_and_a_nan_step_left_out():
    clock, out = Clock(), io.StringIO()
    p = Progress(100, stream=out, every_s=0.0, clock=clock, refresh_s=0.0)
    losses = [10.0, 8.0, float("nan"), 6.0, 4.0]
    feed(p, clock, losses)
    expected, alpha = None, 2 / (EMA_SPAN_STEPS + 1)
    for x in losses:
        if math.isfinite(x):
            expected = x if expected is None else expected + alpha * (x - expected)
    last = out.getvalue().splitlines()[-1]
    assert f"loss {expected:.3f} tau 2.00 (EMA, span {EMA_SPAN_STEPS} steps)" in last, last
    assert "lr 1.00e-03" in last


def test_the_rate_and_eta_come_from_the_recent_window_labelled_with_its_length():
    clock, out = Clock(), io.StringIO()
    p = Progress(200, stream=out, every_s=0.0, clock=clock, refresh_s=0.0)
    feed(p, clock, [5.0] * 40, step_s=2.0, tokens_per_step=100)           # 80 s at 0.5 step/s, 50 tok/s
    feed(p, clock, [5.0] * 40, step_s=0.5, tokens_per_step=100, first=40)  # then 20 s at 2 steps/s
    last = out.getvalue().splitlines()[-1]
    window = int(re.search(r"\(last (\d+) s\)", last).group(1))
    assert RECENT_S - 1 <= window <= RECENT_S                                # the window, not the whole run
    rate = float(re.search(r"\| ([\d,]+) tok/s", last).group(1).replace(",", ""))
    assert 50 < rate < 200                                                    # recent: faster than the run's mean
    assert "step 80/200" in last and "ETA 1m" in last, last                   # 120 steps at about 1.3 step/s


def test_a_resumed_run_counts_its_rate_from_where_it_resumed_and_the_end_says_done():
    clock, out = Clock(), io.StringIO()
    p = Progress(10, stream=out, every_s=0.0, clock=clock, refresh_s=0.0, start_step=8)
    feed(p, clock, [3.0, 3.0], step_s=1.0, first=8)
    lines = out.getvalue().splitlines()
    assert "step 9/10" in lines[0] and "ETA 1s" in lines[0], lines[0]
    assert lines[-1].endswith(", done")


def test_nothing_is_shown_before_the_first_copy_lands_and_a_pipe_gets_a_line_every_few_seconds():
    clock, out = Clock(), io.StringIO()
    p = Progress(1000, stream=out, every_s=10.0, clock=clock, refresh_s=0.0)
    p.update(0, 0, force=True)
    assert "loss  -  tau  -" in out.getvalue()
    feed(p, clock, [1.0] * 30, step_s=1.0)
    assert len(out.getvalue().splitlines()) == 4       # the forced one, then one every 10 s over 30 s


@pytest.mark.parametrize("seconds,text", [(0.4, "0s"), (59.4, "59s"), (65, "1m05s"), (7322, "2h02m")])
def test_short_durations(seconds, text):
    assert short_duration(seconds) == text


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_observing_a_cuda_loss_never_syncs_the_host():
    p = Progress(10, stream=io.StringIO(), every_s=0.0, refresh_s=0.0)
    loss, tau = torch.tensor(3.0, device="cuda"), torch.tensor(2.0, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(1, 6):
            p.observe(loss * step, tau, 1e-3)
            p.update(step, step * 10)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    p.observe(loss, tau, 1e-3)
    p.update(6, 60, force=True)
