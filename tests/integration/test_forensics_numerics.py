"""Issue #12, numerics: non-finite values named (span, step, rank, tensor) under each --on-nonfinite
policy, the payload fingerprint attributing a corruption to the pack or the transfer, faults that
could never fire refused at start-up, the exact checkpoint guard, and the transfer flight recorder.
End-to-end tests are real 2-rank CPU runs of dflash-train over gloo; they assert the run log and the
exit code."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from dflash import checkpoint, transfer
from dflash.transfer import fingerprint
from profiler.runlog import read_records

REPO = Path(__file__).resolve().parents[2]
# tests/integration/test_pipeline.py's SMALL: ~15 s a run on 2 cores, the real default code path.
SMALL = ["--builtin-conversations", "48", "--eval-prompts", "0", "--tokens-per-batch", "1024",
         "--max-length", "128", "--profile-interval", "2", "--device", "cpu", "--max-steps", "8"]


def train(run: Path, args: list[str], fault: str | None) -> subprocess.CompletedProcess:
    env = dict(os.environ, DFLASH_FAULT=fault or "")
    return subprocess.run([sys.executable, "-m", "dflash.cli", "--run-dir", str(run), *SMALL, *args], cwd=REPO,
                          capture_output=True, text=True, timeout=240, env=env)


def nonfinite_events(run: Path, rank: int) -> list[dict]:
    recs, _ = read_records(run / "profile" / f"rank{rank}.jsonl")
    return [r for r in recs if r["type"] == "event" and r["kind"] == "nonfinite"]


def final_counters(run: Path, rank: int) -> dict:
    recs, _ = read_records(run / "profile" / f"rank{rank}.jsonl")
    return [r for r in recs if r["type"] == "run_end"][-1]["counters"]


def checkpoints(run: Path) -> tuple[list[str], str | None]:
    d = run / "checkpoints"
    latest = d / "latest"
    names = sorted(p.name for p in d.iterdir() if p.name.startswith("step_")) if d.is_dir() else []
    return names, latest.read_text().strip() if latest.exists() else None


def all_finite(ckpt: Path) -> bool:
    return all(torch.isfinite(t).all() for t in load_file(str(ckpt / "model.safetensors")).values())


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("dflash-train: error:")]


# ------------------------------------------------------------- nan@drafter.fwd_bwd, three policies
@pytest.mark.slow
def test_nan_loss_under_stop_exits_1_naming_it_with_no_checkpoint_of_that_step(tmp_path, prebuilt):
    run = prebuilt(tmp_path / "run")
    r = train(run, ["--checkpoint-every", "2"], "nan@drafter.fwd_bwd:step=3")
    assert r.returncode == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert error_lines(r.stderr) == ["dflash-train: error: rank 0: non-finite loss in drafter.fwd_bwd at step 3 "
                                     "on rank 0; stopped (--on-nonfinite stop)"], r.stderr[-3000:]
    first = nonfinite_events(run, 0)[0]
    assert (first["span"], first["step"], first["rank"], first["tensor"]) == ("drafter.fwd_bwd", 3, 0, "loss")
    assert first["tensors"] == ["loss", "grad_norm"] and first["policy"] == "stop"
    names, latest = checkpoints(run)
    assert names == ["step_0000002"] and latest == "step_0000002"   # step 3's update never saved
    assert all_finite(run / "checkpoints" / latest)
    assert nonfinite_events(run, 1) == []                             # the target's packs were clean


@pytest.mark.slow
def test_nan_loss_under_skip_step_skips_that_update_and_trains_on(tmp_path, prebuilt):
    run = prebuilt(tmp_path / "run")
    r = train(run, ["--on-nonfinite", "skip-step", "--max-steps", "5"], "nan@drafter.fwd_bwd:step=3")   # and 1 after
    assert r.returncode == 0, r.stderr[-3000:]
    events = nonfinite_events(run, 0)
    assert [(e["span"], e["step"], e["tensor"], e["action"]) for e in events] == [
        ("drafter.fwd_bwd", 3, "loss", "skipped_step")]
    counters = final_counters(run, 0)
    assert counters["nonfinite_skipped_steps"]["total"] == 1 and counters["steps"]["total"] == 5
    names, latest = checkpoints(run)
    assert latest == "step_0000005" and all_finite(run / "checkpoints" / latest)


@pytest.mark.slow
def test_nan_loss_under_warn_goes_on_and_the_guard_refuses_the_nonfinite_checkpoint(tmp_path, prebuilt):
    run = prebuilt(tmp_path / "run")
    r = train(run, ["--on-nonfinite", "warn", "--checkpoint-every", "2"], "nan@drafter.fwd_bwd:step=3")
    assert r.returncode == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    ckpts = run / "checkpoints"
    [line] = error_lines(r.stderr)
    assert line.startswith(f"dflash-train: error: rank 0: checkpoint {ckpts / 'step_0000004'} not written: "
                           "parameter ") and line.endswith(f" holds NaN/Inf; kept {ckpts / 'step_0000002'} as latest")
    first = nonfinite_events(run, 0)[0]
    assert (first["span"], first["step"], first["tensor"], first["action"]) == ("drafter.fwd_bwd", 3, "loss", "applied")
    assert checkpoints(run) == (["step_0000002"], "step_0000002")


# ----------------------------------------------------- nan@target.pack_hidden, nan@transfer.send
@pytest.mark.slow
def test_nan_in_the_pack_is_named_by_the_target_and_attributed_to_the_pack(tmp_path, prebuilt):
    run = prebuilt(tmp_path / "run")
    r = train(run, ["--on-nonfinite", "skip-step", "--max-steps", "4"], "nan@target.pack_hidden:step=2")   # and 1 after
    assert r.returncode == 0, r.stderr[-3000:]
    [target] = nonfinite_events(run, 1)
    assert (target["span"], target["step"], target["rank"], target["tensor"]) == (
        "target.pack_hidden", 2, 1, "packed.hidden")
    drafter = nonfinite_events(run, 0)
    assert [(e["span"], e["step"], e["tensor"]) for e in drafter] == [
        ("drafter.recv", 2, "payload.packed"), ("drafter.fwd_bwd", 2, "loss")]
    assert (drafter[0]["src"], drafter[0]["batch"]) == (1, 2)
    assert all_finite(run / "checkpoints" / checkpoints(run)[1])


@pytest.mark.slow
def test_a_nonfinite_stop_in_the_pack_ends_every_rank_cleanly_run_after_run(tmp_path, prebuilt):
    """Issue 34 row 13: before the fix, 3 runs in 4 ended with `terminate called without an active
    exception` and SIGABRT: the target stopped with its sender thread still inside a gloo send, and the
    send returning during interpreter teardown aborted the process. Three runs: each the abort's chance."""
    for attempt in range(3):
        run = prebuilt(tmp_path / f"run{attempt}")
        r = train(run, ["--checkpoint-every", "2"], "nan@target.pack_hidden:step=3")
        said = f"attempt {attempt}:\n{r.stderr[-3000:]}"
        assert r.returncode == 1, said
        for bad in ("terminate called", "SIGABRT", "Traceback", "did not end within", "another rank is gone"):
            assert bad not in r.stderr, said
        assert ("dflash-train: error: rank 1: non-finite packed.hidden in target.pack_hidden at step 3 on rank 1; "
                "stopped (--on-nonfinite stop)") in error_lines(r.stderr), said
        for rank in (0, 1):
            recs, _ = read_records(run / "profile" / f"rank{rank}.jsonl")
            assert [e["status"] for e in recs if e["type"] == "run_end"] == ["NonfiniteStop"], said


@pytest.mark.slow
def test_nan_in_the_transfer_is_attributed_to_the_transfer_and_stops(tmp_path, prebuilt):
    run = prebuilt(tmp_path / "run")
    r = train(run, [], "nan@transfer.send:step=2")
    assert r.returncode == 1, r.stderr[-3000:]
    assert error_lines(r.stderr) == ["dflash-train: error: rank 0: non-finite payload.transfer in drafter.recv "
                                     "at step 2 on rank 0; stopped (--on-nonfinite stop)"], r.stderr[-3000:]
    first = nonfinite_events(run, 0)[0]
    assert (first["span"], first["step"], first["tensor"], first["src"], first["batch"]) == (
        "drafter.recv", 2, "payload.transfer", 1, 2)
    assert nonfinite_events(run, 1) == []            # the pack was clean: not blamed
    names, latest = checkpoints(run)
    assert latest is None or all_finite(run / "checkpoints" / latest)


@pytest.mark.parametrize("fault, args, line", [
    ("nan@target.fwd", [], "dflash-train: error: DFLASH_FAULT: nan@target.fwd: target.fwd has no nan injection "
                           "point (nan fires at: drafter.fwd_bwd, target.pack_hidden, transfer.send)"),
    ("crash@drafter.fwdbwd", [], "dflash-train: error: DFLASH_FAULT: crash@drafter.fwdbwd: drafter.fwdbwd is not a "
                                 "span of this program (crash fires at: ckpt.save, d2h_copy, drafter.allreduce, "
                                 "drafter.fwd_bwd, drafter.optim, drafter.recv, drafter.unpack, eval.decode, h2d_copy, "
                                 "target.fetch, target.fwd, target.pack_hidden, transfer.send, transfer.wait_slot)"),
    (None, ["--on-nonfinite", "ignore"],
     "dflash-train: error: config field 'reliability.on_nonfinite': must be stop, skip-step or warn (got 'ignore')"),
])
def test_a_fault_that_could_never_fire_or_a_bad_policy_is_refused_before_any_rank(tmp_path, fault, args, line,
                                                                                   train_main):
    r = train_main(["--run-dir", tmp_path / "run", *SMALL, *args], {"DFLASH_FAULT": fault or ""})
    assert r.returncode == 2 and r.stderr.splitlines() == [line], r.stderr[-3000:]
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------ checkpoint guard
def test_the_checkpoint_guard_names_the_parameter_and_keeps_latest(tmp_path):
    from dflash.model import DFlashConfig, DFlashDraftModel
    embed, head = torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32, bias=False)
    cfg = DFlashConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=8, vocab_size=32, block_size=4, target_layer_ids=[0],
                       num_target_layers=1, mask_token_id=1)
    model = DFlashDraftModel(cfg, embed, head)
    ckpts = tmp_path / "checkpoints"
    extra = {"step": 2}
    assert checkpoint.save_run_checkpoint(ckpts, 2, model, extra).name == "step_0000002"
    assert checkpoint.nonfinite_parameter(model) is None
    with torch.no_grad():
        model.fc.weight[0, 0] = float("nan")
    with pytest.raises(checkpoint.NonfiniteCheckpointError) as e:
        checkpoint.save_run_checkpoint(ckpts, 4, model, extra)
    assert str(e.value) == (f"checkpoint {ckpts / 'step_0000004'} not written: parameter fc.weight holds NaN/Inf; "
                            f"kept {ckpts / 'step_0000002'} as latest")
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_0000002"]
    assert (ckpts / "latest").read_text() == "step_0000002\n"


# ------------------------------------------------------------------- fingerprint, flight recorder
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _transfer_worker(rank: int, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    ctrl = dist.new_group(backend="gloo")
    try:
        if rank == 1:
            stop = transfer.StopSignal(0, ctrl)
            sender = transfer.Sender(0, ctrl, max_in_flight=2, device_payload=False)
            for i in range(3):
                sender.acquire()
                payload = torch.full((5, 4), float(i), dtype=torch.bfloat16)
                sender.submit(transfer.Message(payload, torch.zeros(1, 5, dtype=torch.int64), [i],
                                               fingerprint=fingerprint(payload)))
            sender.close()
            stop.wait()
        else:
            rx = transfer.Receiver([1], ctrl, torch.device("cpu"), device_payload=False)
            got = [rx.get() for _ in range(3)]
            transfer.send_stop([1], ctrl)
            assert rx.drain() == 0
            out.put(("fingerprints", [m.fingerprint.tolist() for m in got]))
        out.put((rank, transfer.dump_flight_recorder()))
    finally:
        dist.destroy_process_group()


def test_fingerprints_travel_with_their_payloads_and_each_rank_keeps_a_flight_recorder(rank_processes):
    ctx = rank_processes
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_transfer_worker, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = [out.get(timeout=60) for _ in range(3)]
    for p in procs:
        p.join(timeout=30)
    assert [p.exitcode for p in procs] == [0, 0]
    got = {key: value for key, value in results}
    assert got["fingerprints"] == [[20.0, 0.0], [20.0, 20.0], [20.0, 40.0]]
    target = [(e["kind"], e.get("batch")) for e in got[1]]
    for i in range(3):   # main thread and sender thread interleave; each batch keeps its own order
        assert target.index(("submit", i)) < target.index(("header_sent", i)) < target.index(("completed", i))
    assert {"slot_acquired", "submit", "header_sent", "completed", "end_sent", "stop_received"} <= {
        k for k, _ in target}
    drafter = [(e["kind"], e.get("batch"), e.get("src")) for e in got[0]]
    assert [d for d in drafter if d[0] == "received"] == [("received", i, 1) for i in range(3)]
    assert ("stop_sent", None, None) in drafter
    assert all(isinstance(e["time_unix"], float) and e["thread"] for e in got[0] + got[1])


@pytest.mark.slow
def test_a_hang_dumps_each_ranks_flight_recorder_and_the_rings_line_up(tmp_path, prebuilt):
    run = prebuilt(tmp_path / "run")
    r = train(run, ["--hang-timeout-s", "4"], "hang@drafter.fwd_bwd:step=3:rank=0")
    assert r.returncode == 1, r.stderr[-3000:]
    dumps = {}
    for rank in (0, 1):
        recs, _ = read_records(run / "profile" / f"rank{rank}.jsonl")
        # The target dumps on its own watchdog or the launcher's SIGTERM, or, when its send fails first
        # because the hung drafter has already exited (a loaded machine), as `peer_lost`.
        [dump] = [x for x in recs if x["type"] == "event" and x["kind"] in ("hang", "signal", "peer_lost")
                  and "extra" in x]
        dumps[rank] = dump["extra"]["transfer_ring"]
    drafter, target = dumps[0], dumps[1]
    assert 0 < len(drafter) <= transfer.RING_ENTRIES and 0 < len(target) <= transfer.RING_ENTRIES
    received = [e["batch"] for e in drafter if e["kind"] == "received" and e["src"] == 1]
    completed = [e["batch"] for e in target if e["kind"] == "completed" and e["dst"] == 0]
    assert received[:4] == [0, 1, 2, 3]            # the drafter took batches 0..3, then hung in step 3
    assert completed == received                   # lined up: each send the target completed, it received
    submitted = [e["batch"] for e in target if e["kind"] == "submit"]
    assert submitted[:len(completed)] == completed and len(submitted) <= len(completed) + 2   # max_in_flight
    # dflash-report lines the two rings up from the same logs
    from profiler.report import format_hotspots, hotspots

    rep = hotspots(run)
    [link] = rep["transfer_rings"]["links"]
    assert (link["target"], link["drafter"]) == (1, 0) and link["received"] == max(received)
    assert link["submitted"] == max(submitted) and link["in_flight"] == list(range(max(received) + 1,
                                                                                   max(submitted) + 1))
    assert {d["rank"] for d in rep["transfer_rings"]["dumps"]} == {0, 1}
    assert "Transfer flight recorders" in format_hotspots(rep) and "rank 1 -> rank 0" in format_hotspots(rep)
