"""DFLASH_FAULT parsing and firing."""

import time

import pytest
import torch

from profiler.faults import Fault, FaultPlan, InjectedFault, check_injection_points, parse_faults


def test_parse_good_strings():
    assert parse_faults("nan@drafter.fwd_bwd:step=3") == [Fault("nan", "drafter.fwd_bwd", 3, None, None)]
    assert parse_faults(" slow=0.25@target.fwd:rank=1 ; crash@drafter.optim:step=10:rank=0;") == [
        Fault("slow", "target.fwd", None, 1, 0.25),
        Fault("crash", "drafter.optim", 10, 0, None),
    ]
    assert parse_faults("hang@d2h_copy:rank=2:step=0") == [Fault("hang", "d2h_copy", 0, 2, None)]
    assert parse_faults("oom@target.fwd") == [Fault("oom", "target.fwd", None, None, None)]
    assert parse_faults("") == [] and parse_faults(" ; ") == []


@pytest.mark.parametrize(
    "text, message",
    [
        ("boom@target.fwd",
         "DFLASH_FAULT: unknown fault kind 'boom' in 'boom@target.fwd' "
         "(expected nan, oom, crash, hang, slow=SECONDS, drift)"),
        ("nan",
         "DFLASH_FAULT: bad fault 'nan' (expected KIND@SPAN[:step=N][:rank=R] "
         "with KIND one of nan, oom, crash, hang, slow=SECONDS, drift)"),
        ("slow=abc@target.fwd",
         "DFLASH_FAULT: slow needs a non-negative number of seconds, got 'abc' in 'slow=abc@target.fwd'"),
        ("slow=-1@target.fwd",
         "DFLASH_FAULT: slow needs a non-negative number of seconds, got '-1' in 'slow=-1@target.fwd'"),
        ("slow@target.fwd", "DFLASH_FAULT: slow needs a number of seconds (slow=SECONDS) in 'slow@target.fwd'"),
        ("nan@Target.Fwd",
         "DFLASH_FAULT: bad span name 'Target.Fwd' in 'nan@Target.Fwd' (expected e.g. drafter.fwd_bwd)"),
        ("nan@target.fwd:step=x",
         "DFLASH_FAULT: step must be a non-negative integer, got 'x' in 'nan@target.fwd:step=x'"),
        ("nan@target.fwd:rank=-1",
         "DFLASH_FAULT: rank must be a non-negative integer, got '-1' in 'nan@target.fwd:rank=-1'"),
        ("nan@target.fwd:when=3",
         "DFLASH_FAULT: unknown option 'when=3' in 'nan@target.fwd:when=3' (expected step=N or rank=R)"),
        ("nan@target.fwd:step=1:step=2", "DFLASH_FAULT: step given twice in 'nan@target.fwd:step=1:step=2'"),
    ],
)
def test_parse_bad_strings(text, message):
    with pytest.raises(ValueError) as info:
        parse_faults("crash@ok.span;" + text)
    assert str(info.value) == message


def test_from_spec_and_rank_filter():
    assert FaultPlan.from_spec("", rank=0).empty and FaultPlan.from_spec(None, rank=0).empty
    spec = "crash@drafter.optim:rank=1"
    assert FaultPlan.from_spec(spec, rank=0).empty
    plan = FaultPlan.from_spec(spec, rank=1)
    assert not plan.empty
    with pytest.raises(InjectedFault, match=r"^injected crash at drafter\.optim step 4 rank 1$"):
        plan.on_enter("drafter.optim", 4)


def test_step_matching_and_oom_type():
    plan = FaultPlan(parse_faults("oom@target.fwd:step=2"), rank=0)
    plan.on_enter("target.fwd", 1)  # other step: nothing
    plan.on_enter("drafter.optim", 2)  # other span: nothing
    with pytest.raises(torch.OutOfMemoryError, match="injected oom at target.fwd step 2 rank 0"):
        plan.on_enter("target.fwd", 2)
    plan.on_enter("target.fwd", 3)   # fired once: not again
    assert issubclass(InjectedFault, RuntimeError)


def test_a_one_shot_fault_fires_at_the_first_entry_past_its_step_when_the_span_skipped_it():
    """A sender thread's transfer.send can run at steps 1 and 3 and never at 2 (it lags or leads)."""
    plan = FaultPlan(parse_faults("crash@transfer.send:step=2;slow=0.001@target.fwd:step=2"), rank=1)
    plan.on_enter("transfer.send", 1)
    plan.on_enter("target.fwd", 3)                     # slow: at step 2 only, so not here
    with pytest.raises(InjectedFault, match="injected crash at transfer.send step 3 rank 1"):
        plan.on_enter("transfer.send", 3)
    plan.on_enter("transfer.send", 4)


def test_fault_without_step_fires_every_time():
    plan = FaultPlan(parse_faults("crash@x.y"), rank=3)
    for step in (0, 1, 99):
        with pytest.raises(InjectedFault):
            plan.on_enter("x.y", step)


def test_slow_sleeps_about_seconds():
    plan = FaultPlan(parse_faults("slow=0.2@target.fwd:step=5"), rank=0)
    start = time.perf_counter()
    plan.on_enter("target.fwd", 4)
    assert time.perf_counter() - start < 0.05
    start = time.perf_counter()
    plan.on_enter("target.fwd", 5)
    assert 0.19 <= time.perf_counter() - start < 0.6


def test_hang_blocks_until_killed():
    slept = []

    class Killed(BaseException):
        pass

    def sleep(seconds):
        slept.append(seconds)
        if len(slept) == 50:
            raise Killed  # stands in for the signal that kills the process

    plan = FaultPlan(parse_faults("hang@drafter.recv"), rank=0, sleep=sleep)
    with pytest.raises(Killed):
        plan.on_enter("drafter.recv", 0)
    assert len(slept) == 50


def test_corrupt_only_matching_span_and_step():
    plan = FaultPlan(parse_faults("nan@drafter.fwd_bwd:step=3"), rank=0)
    t = torch.ones(4, dtype=torch.bfloat16)
    assert plan.corrupt("drafter.fwd_bwd", 2, t) is t
    assert plan.corrupt("target.fwd", 3, t) is t
    out = plan.corrupt("drafter.fwd_bwd", 3, t)
    assert out.dtype == torch.bfloat16 and out.device == t.device and out.shape == t.shape
    assert torch.isnan(out).all() and not torch.isnan(t).any()
    plan.on_enter("drafter.fwd_bwd", 3)  # a nan fault does nothing on entry
    with pytest.raises(ValueError, match="nan@drafter.fwd_bwd needs a floating-point tensor, got torch.int64"):
        plan.corrupt("drafter.fwd_bwd", 3, torch.ones(2, dtype=torch.int64))


def test_empty_plan_is_cheap():
    plan = FaultPlan(parse_faults("crash@other.span"), rank=0)
    n = 100_000
    start = time.perf_counter()
    for _ in range(n):
        plan.on_enter("target.fwd", 1)
    per_call_s = (time.perf_counter() - start) / n
    assert per_call_s < 2e-6, per_call_s  # one dict lookup, well under a microsecond normally


def test_a_fault_that_could_never_fire_is_refused_in_one_line():
    spans, nan_spans = ("target.fwd", "target.pack_hidden", "drafter.fwd_bwd"), ("target.pack_hidden",)
    check_injection_points(parse_faults("nan@target.pack_hidden;crash@target.fwd;slow=1@drafter.fwd_bwd"),
                           spans, nan_spans)
    with pytest.raises(ValueError) as e:
        check_injection_points(parse_faults("crash@target.fwd;nan@target.fwd"), spans, nan_spans)
    assert str(e.value) == ("DFLASH_FAULT: nan@target.fwd: target.fwd has no nan injection point "
                            "(nan fires at: target.pack_hidden)")
    with pytest.raises(ValueError) as e:
        check_injection_points(parse_faults("hang@drafter.fwdbwd"), spans, nan_spans)
    assert str(e.value) == ("DFLASH_FAULT: hang@drafter.fwdbwd: drafter.fwdbwd is not a span of this program "
                            "(hang fires at: drafter.fwd_bwd, target.fwd, target.pack_hidden)")
