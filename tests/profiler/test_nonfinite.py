"""Non-finite checks read back off the training thread, the packed-batch fingerprint, the forensics
registry. The CUDA test (skipped without a GPU) runs under set_sync_debug_mode("error")."""
import pytest
import torch

import profiler
from profiler.nonfinite import NonfiniteMonitor, fingerprint, fingerprint_flags


def make_prof(tmp_path, **kw):
    kw.setdefault("interval_s", 3600.0)
    return profiler.Profiler(tmp_path, console=False, control=False, measure_floors=False, background=False,
                             **kw)


def test_monitor_names_the_first_bad_tensor_and_keeps_the_first_finding():
    found = []
    mon = NonfiniteMonitor(rank=3, on_found=found.append, is_cuda=False)
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
    mon = NonfiniteMonitor(rank=0, on_found=boom, is_cuda=False)
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


def test_fingerprint_attributes_pack_or_transfer():
    h = torch.randn(64, 8, dtype=torch.bfloat16)
    sent = fingerprint(h)
    assert sent[0].item() == h.numel()
    assert fingerprint_flags(sent, fingerprint(h.clone()), h.numel()).tolist() == [False, False]
    changed = h.clone()
    changed[3, 1] += 1
    assert fingerprint_flags(sent, fingerprint(changed), h.numel()).tolist() == [False, True]
    assert fingerprint_flags(sent, fingerprint(h * float("nan")), h.numel()).tolist() == [False, True]
    packed_bad = h.clone()
    packed_bad[0, 0] = float("inf")
    bad_fp = fingerprint(packed_bad)
    assert bad_fp[0].item() == h.numel() - 1
    assert fingerprint_flags(bad_fp, fingerprint(packed_bad.clone()), h.numel()).tolist() == [True, False]


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
    mon = NonfiniteMonitor(rank=0, on_found=lambda f: None, is_cuda=False)
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


def test_fingerprint_temporaries_stay_bounded_whatever_the_payload_size(monkeypatch):
    """A float64 sum casts its input; chunking keeps that temporary to a chunk, and the result equals
    the one-shot count and sum."""
    from profiler import nonfinite

    monkeypatch.setattr(nonfinite, "FINGERPRINT_CHUNK_ELEMENTS", 1 << 16)
    t = torch.randn(1 << 20).to(torch.bfloat16)
    t[12345] = float("inf")
    with torch.profiler.profile(profile_memory=True) as prof:
        fp = nonfinite.fingerprint(t)
    biggest = max(e.cpu_memory_usage for e in prof.events())
    assert biggest <= 8 * (1 << 16), biggest          # one chunk's float64 copy, not 8 MiB for the whole
    assert fp[0] == (1 << 20) - 1 and torch.isinf(fp[1])
    finite = t[torch.isfinite(t)]
    chunked = nonfinite.fingerprint(finite)
    assert torch.isclose(chunked[1], finite.sum(dtype=torch.float64), rtol=1e-12)
    assert nonfinite.fingerprint(torch.empty(0)).tolist() == [0.0, 0.0]
