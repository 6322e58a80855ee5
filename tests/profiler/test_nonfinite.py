"""Non-finite checks read back off the training thread, the forensics
registry. The CUDA tests (skipped without a GPU) run under set_sync_debug_mode("error")."""
import pytest
import torch

import profiler
from profiler.nonfinite import NonfiniteMonitor
from tests.profiler.build import make_profiler


def make_prof(tmp_path, **kw):
    kw.setdefault("interval_s", 3600.0)
    return make_profiler(tmp_path, control=False, measure_floors=False, background=False,
                             **kw)


def test_monitor_names_the_first_bad_tensor_and_keeps_the_first_finding():
    found = []
    mon = NonfiniteMonitor(rank=3, on_found=found.append)
    mon.check("target.pack_hidden", 1, {"hidden": torch.ones(4)})
    mon.check("drafter.fwd_bwd", 2, {"loss": torch.tensor(1.0), "grad_norm": torch.tensor(float("inf"))})
    mon.check("drafter.fwd_bwd", 5, {"loss": torch.tensor(float("nan"))}, action="skipped_step")
    assert found == [] and mon.pending() == 3          # nothing is read before a poll
    assert mon.poll() == 3 and mon.pending() == 0
    assert found == [{"span": "drafter.fwd_bwd", "step": 2, "rank": 3, "tensor": "grad_norm",
                      "tensors": ["grad_norm"]},
                     {"span": "drafter.fwd_bwd", "step": 5, "rank": 3, "tensor": "loss", "tensors": ["loss"],
                      "action": "skipped_step"}]
    assert mon.first == found[0] and mon.found == 2 and mon.checks == 3


def test_a_failing_reporter_never_reaches_the_caller():
    def boom(finding):
        raise OSError("disk gone")
    mon = NonfiniteMonitor(rank=0, on_found=boom)
    mon.check("x.y", 0, {"t": torch.tensor([1.0, float("nan")])})
    assert mon.poll() == 1 and mon.first["tensor"] == "t"


def test_profiler_writes_the_nonfinite_event_and_counts_it(tmp_path):
    with make_prof(tmp_path, rank=1, role="drafter") as prof:
        profiler.set_step(7)
        profiler.check_finite("drafter.fwd_bwd", {"loss": torch.tensor(float("nan"))}, action="skipped_step")
        assert profiler.nonfinite_found() is None      # not read back yet: no sync on this thread
        prof.tick()
        assert profiler.nonfinite_found()["step"] == 7
        profiler.check_finite("drafter.fwd_bwd", {"loss": torch.tensor(1.0)})   # still pending at exit
    recs, _ = profiler.read_records(tmp_path / "profile" / "rank1.jsonl")
    events = [r for r in recs if r["type"] == "event" and r["kind"] == "nonfinite"]
    assert len(events) == 1
    ev = events[0]
    assert (ev["span"], ev["step"], ev["rank"], ev["tensor"], ev["action"], ev["count"]) == (
        "drafter.fwd_bwd", 7, 1, "loss", "skipped_step", 1)
    end = recs[-1]
    assert end["counters"]["nonfinite"]["total"] == 1 and end["counters"]["nonfinite_skipped_steps"]["total"] == 1
    assert profiler.nonfinite_found() is None          # no active profiler: nothing


def test_forensics_registry_reports_each_source_and_survives_a_failing_one(tmp_path):
    assert profiler.api.forensics() == {}
    with make_prof(tmp_path):
        profiler.api.register_forensics("transfer_ring", lambda: [{"kind": "send"}])
        profiler.api.register_forensics("broken", lambda: 1 / 0)
        dump = profiler.api.forensics()
        with pytest.raises(ValueError, match="bad forensics name"):
            profiler.api.register_forensics("Bad Name", list)
    assert dump == {"transfer_ring": [{"kind": "send"}],
                    "broken": {"error": "ZeroDivisionError: division by zero"}}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_checks_never_sync_and_come_back_through_the_collector(tmp_path):
    dev = torch.device("cuda", torch.cuda.current_device())
    x = torch.ones(1 << 20, device=dev)
    with make_prof(tmp_path, device=dev, floors={}) as prof:
        # First launches load their kernels (CUDA lazy loading may wait for the device): warm them,
        # and make the NaN outside the timed region.
        loss = x.sum() * float("nan")
        profiler.check_finite("drafter.fwd_bwd", {"loss": x.sum(), "ok": x})
        prof.tick()
        prof.nonfinite.settle(timeout_s=10.0)
        torch.cuda.synchronize()              # the test's own sync, before the checked region
        torch.cuda.set_sync_debug_mode("error")
        try:
            torch.cuda._sleep(2_000_000_000)  # about a second of device work queued ahead
            profiler.check_finite("drafter.fwd_bwd", {"loss": loss, "ok": x})
            prof.tick()
            assert profiler.nonfinite_found() is None and prof.nonfinite.pending() == 1
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert prof.nonfinite.settle(timeout_s=30.0)["tensors"] == ["loss"]
        assert prof.nonfinite.dropped == 0

def test_settle_reads_back_everything_issued_so_far():
    mon = NonfiniteMonitor(rank=0, on_found=lambda f: None)
    mon.check("drafter.fwd_bwd", 4, {"loss": torch.tensor(float("inf"))})
    assert mon.settle(timeout_s=1.0)["step"] == 4 and mon.pending() == 0


@pytest.mark.parametrize("fused", [False, True])
def test_step_unless_skips_the_update_and_its_step_count(fused):
    from profiler.nonfinite import step_unless
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([w], lr=0.1, fused=fused)
    w.grad = torch.full((3,), float("nan"))
    step_unless(opt, ~torch.isfinite(w.grad).all())
    assert torch.equal(w.detach(), torch.ones(3))                  # skipped: still the old weights
    assert not opt.state or opt.state[w]["step"].item() == 0       # and the step was not counted
    w.grad = torch.full((3,), 0.5)
    step_unless(opt, ~torch.isfinite(w.grad).all())
    assert (w.detach() < 1).all() and opt.state[w]["step"].item() == 1
    assert not hasattr(opt, "found_inf")


class StandInReadback:
    """CudaReadback's contract on the CPU: every flags tensor counts as a device one made on stream "s"; a
    batch is done when the test says so; `buffers` bounds the batches in flight."""

    def __init__(self, buffers=4):
        self.buffers, self.issued, self.done_ids = buffers, [], set()

    def stream_of(self, flags):
        return "s"

    def available(self):
        return self.buffers > 0

    def issue(self, flags, streams):
        self.buffers -= 1
        self.issued.append((len(flags), streams))
        return len(self.issued) - 1, torch.cat([f.reshape(-1) for f in flags]).tolist()

    def done(self, handle):
        return handle[0] in self.done_ids

    def read(self, handle):
        self.buffers += 1
        return handle[1]


def test_device_checks_go_back_as_one_batch_per_poll_in_order_and_never_before_they_land():
    found, rb = [], StandInReadback()
    mon = NonfiniteMonitor(rank=2, on_found=found.append, readback=rb)
    mon.check_flags("target.pack_hidden", 1, ["packed.hidden"], torch.tensor([False]))
    mon.check_flags("drafter.recv", 1, ["payload.packed", "payload.transfer"], torch.tensor([False, True]))
    mon.check("drafter.fwd_bwd", 1, {"loss": torch.tensor(float("nan")), "grad_norm": torch.tensor(1.0)})
    assert rb.issued == [] and mon.pending() == 3       # the training thread only queues
    assert mon.poll() == 0 and rb.issued == [(3, ["s"])] and mon.pending() == 3 and found == []
    mon.check("drafter.fwd_bwd", 2, {"loss": torch.tensor(float("inf"))})
    assert mon.poll() == 0 and len(rb.issued) == 2       # a second batch; the first still in flight
    rb.done_ids.add(1)
    assert mon.poll() == 0                               # the later batch waits for the earlier one
    rb.done_ids.add(0)
    assert mon.poll() == 4 and mon.pending() == 0 and rb.buffers == 4
    assert [(f["span"], f["step"], f["tensors"]) for f in found] == [
        ("drafter.recv", 1, ["payload.transfer"]), ("drafter.fwd_bwd", 1, ["loss"]), ("drafter.fwd_bwd", 2, ["loss"])]


def test_batches_are_bounded_by_buffer_size_and_count_and_nothing_waits(monkeypatch):
    from profiler import nonfinite
    monkeypatch.setattr(nonfinite, "BATCH_FLAGS", 3)
    rb = StandInReadback(buffers=2)
    mon = NonfiniteMonitor(rank=0, on_found=lambda f: None, readback=rb)
    for step in range(4):
        mon.check_flags("drafter.recv", step, ["a", "b"], torch.tensor([False, False]))
    mon.poll()
    assert rb.issued == [(1, ["s"]), (1, ["s"])] and mon.pending() == 4   # 2 flags a batch; no third buffer
    rb.done_ids.update({0, 1})
    assert mon.poll() == 2 and len(rb.issued) == 4                        # read, which frees both, then sent
    rb.done_ids.update({2, 3})
    assert mon.settle(timeout_s=1.0) is None and mon.pending() == 0 and mon.dropped == 0


def test_a_stalled_collector_drops_checks_and_counts_them(monkeypatch):
    from profiler import nonfinite
    monkeypatch.setattr(nonfinite, "QUEUE_MAX", 2)
    mon = NonfiniteMonitor(rank=0, on_found=lambda f: None, readback=StandInReadback())
    for step in range(3):
        mon.check_flags("drafter.recv", step, ["a"], torch.tensor([True]))
    assert mon.checks == 3 and mon.dropped == 1 and mon.pending() == 2
    with pytest.raises(ValueError, match="2 flags for 1 names"):
        mon.check_flags("drafter.recv", 4, ["a"], torch.tensor([True, False]))


def test_a_batch_that_cannot_be_sent_is_counted_lost_and_the_next_one_goes(caplog):
    rb = StandInReadback()
    real_issue, calls = rb.issue, []

    def issue(flags, streams):
        calls.append(len(flags))
        if len(calls) == 1:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real_issue(flags, streams)
    rb.issue = issue
    found = []
    mon = NonfiniteMonitor(rank=0, on_found=found.append, readback=rb)
    mon.check_flags("drafter.recv", 0, ["a", "b"], torch.tensor([True, False]))
    assert mon.poll() == 0 and mon.dropped == 1 and mon.pending() == 0
    assert "sending 1 non-finite checks to the host failed" in caplog.text
    mon.check_flags("drafter.recv", 1, ["a"], torch.tensor([True]))
    rb.done_ids.add(0)
    assert mon.poll() == 1 and found[0]["step"] == 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_batches_wait_for_every_stream_and_hold_the_flags_until_read(tmp_path):
    """100 checks on two streams behind a second of queued device work, each flags tensor dropped by its
    caller at once and its memory offered to new tensors: the one bad check (step 57, on the side stream)
    is found, every other is clean, nothing is dropped, and the training thread never syncs."""
    dev = torch.device("cuda", torch.cuda.current_device())
    side = torch.cuda.Stream(dev)
    bad = torch.zeros(100, device=dev)
    bad[57] = 1.0
    with make_prof(tmp_path, device=dev, floors={}) as prof:
        profiler.check_flags("warm", ["w"], bad[:1] != 0, step=-1)   # first launches load their kernels
        prof.nonfinite.settle(timeout_s=10.0)
        torch.cuda.synchronize()              # the test's own sync, before the checked region
        torch.cuda.set_sync_debug_mode("error")
        try:
            torch.cuda._sleep(2_000_000_000)  # about a second of device work queued ahead
            side.wait_stream(torch.cuda.current_stream(dev))
            for step in range(100):
                with torch.cuda.stream(side if step % 2 else torch.cuda.current_stream(dev)):
                    profiler.check_flags("drafter.recv", ["payload.packed"], bad[step:step + 1] != 0, step=step)
                    torch.ones(1, dtype=torch.bool, device=dev).logical_not_()   # reuses a freed block, if any
                if step == 50:
                    prof.tick()               # a batch sent mid-way, the rest at the next poll
            prof.tick()
            assert profiler.nonfinite_found() is None and prof.nonfinite.pending() == 100
        finally:
            torch.cuda.set_sync_debug_mode(0)
        found = prof.nonfinite.settle(timeout_s=30.0)
        assert (found["step"], found["tensors"]) == (57, ["payload.packed"])
        assert prof.nonfinite.found == 1 and prof.nonfinite.dropped == 0 and prof.nonfinite.pending() == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_flags_of_any_shape_share_one_batch_and_are_read_in_order():
    """0-dim, 1-D and 2-D flags (one per name) in one batch: each check reads its own flags, in order."""
    from profiler.cuda_timing import EventPool
    from profiler.nonfinite import CudaReadback
    dev = torch.device("cuda", torch.cuda.current_device())
    found = []
    mon = NonfiniteMonitor(0, found.append, readback=CudaReadback(dev, EventPool(prealloc=0).current))
    checks = [("a", ["x"], torch.tensor(True, device=dev)),
              ("b", ["y", "z"], torch.tensor([False, True], device=dev)),
              ("c", ["u", "v"], torch.tensor([[True], [True]], device=dev)),
              ("d", ["w"], torch.tensor(False, device=dev))]
    for step, (span, names, flags) in enumerate(checks):
        mon.check_flags(span, step, names, flags)
    mon.poll()
    assert mon.settle(timeout_s=10.0) is not None and mon.pending() == 0
    assert [(f["span"], f["tensors"]) for f in found] == [("a", ["x"]), ("b", ["z"]), ("c", ["u", "v"])]
