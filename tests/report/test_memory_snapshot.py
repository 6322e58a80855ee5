"""`dflash-report memory`: allocator snapshots (the dict torch.cuda.memory._snapshot() returns, pickled as
torch does) summarised offline; a pickle that names any global, such as a `posix.system` reduce, is refused in
one line with exit 2 and nothing in it runs."""
from __future__ import annotations

import json
import os
import pickle

from dflash import report_cli
from profiler.report.memory_snapshot import PlainUnpickler

MIB = 2**20


def frame(filename, line, name):
    return {"filename": filename, "line": line, "name": name}


def snapshot() -> dict:
    """Two segments as torch lays them out: one half used (a live block and a free split), one fully used."""
    alloc = [frame("??", 0, "torch::unwind::unwind()"), frame("CUDACachingAllocator.cpp", 0, "malloc"),
             frame("/x/torch/nn/modules/linear.py", 125, "forward"), frame("/x/dflash/pack.py", 88, "pack_hidden"),
             frame("/x/dflash/loops.py", 150, "target_step")]
    return {"segments": [
        {"device": 0, "address": 1, "total_size": 64 * MIB, "allocated_size": 48 * MIB, "active_size": 48 * MIB,
         "requested_size": 48 * MIB, "stream": 0, "segment_type": "large", "segment_pool_id": (0, 0),
         "is_expandable": False, "frames": [],
         "blocks": [{"address": 1, "size": 48 * MIB, "requested_size": 48 * MIB, "state": "active_allocated",
                     "frames": alloc},
                    {"address": 2, "size": 16 * MIB, "requested_size": 0, "state": "inactive", "frames": []}]},
        {"device": 0, "address": 9, "total_size": 32 * MIB, "allocated_size": 32 * MIB, "active_size": 32 * MIB,
         "requested_size": 30 * MIB, "stream": 0, "segment_type": "large", "segment_pool_id": (0, 0),
         "is_expandable": False, "frames": [],
         "blocks": [{"address": 9, "size": 32 * MIB, "requested_size": 30 * MIB, "state": "active_allocated",
                     "frames": [frame("??", 0, "torch::unwind::unwind()"), frame("??", 0, "at::cuda::blas::gemm")]}]}],
        "device_traces": [[{"action": "alloc", "addr": 1, "size": 48 * MIB, "stream": 0, "time_us": 1,
                            "frames": alloc}]],
        "allocator_settings": {"expandable_segments": False}, "external_annotations": []}


def make_run(tmp_path, snap=None, raw: bytes | None = None):
    run = tmp_path / "run"
    (run / "profile").mkdir(parents=True)
    (run / "forensics").mkdir()
    path = run / "forensics" / "rank1-memory-1700000000000.pickle"
    path.write_bytes(raw if raw is not None else pickle.dumps(snap or snapshot()))
    open_spans = [{"thread": "target.main", "native_id": 5, "spans": [{"name": "target.pack_hidden", "depth": 0,
                                                                      "open_seconds": 0.25}]}]
    lines = [{"type": "run_start", "schema": 1, "rank": 1, "role": "target", "time_unix": 1.0},
             {"type": "event", "kind": "memory_snapshot", "rank": 1, "role": "target", "step": 42, "file": str(path),
              "open_spans": open_spans, "time_unix": 2.0}]
    (run / "profile" / "rank1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return run


def test_a_snapshot_is_summarised_with_its_frames_and_open_spans(tmp_path, capsys):
    assert report_cli.main(["memory", str(make_run(tmp_path)), "--json"]) == 0
    (s,) = json.loads(capsys.readouterr().out)["snapshots"]
    assert s["rank"] == 1 and s["step"] == 42 and s["taken"] == "on demand" and s["segments"] == 2
    assert s["reserved_bytes"] == 96 * MIB and s["allocated_bytes"] == 80 * MIB
    assert s["free_in_used_segments_bytes"] == 16 * MIB and s["fragmentation"] == 16 / 96
    assert s["largest_free_block_bytes"] == 16 * MIB and s["live_blocks"] == 2 and s["history_entries"] == 1
    first, second = s["largest_live_blocks"]
    assert first["bytes"] == 48 * MIB and first["frames"] == ["/x/dflash/pack.py:88 pack_hidden",
                                                              "/x/dflash/loops.py:150 target_step"]
    assert second["frames"] == ["??:0 at::cuda::blas::gemm"]   # no Python frame: the native ones past the allocator
    assert s["open_spans"][0]["spans"][0]["name"] == "target.pack_hidden"
    assert report_cli.main(["memory", str(make_run(tmp_path / "again"))]) == 0
    text = capsys.readouterr().out
    assert "0.08 GiB allocated of 0.09 GiB reserved in 2 segments" in text
    assert "open on target.main: target.pack_hidden 0.25 s" in text and "/x/dflash/pack.py:88 pack_hidden" in text


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch BOOM",))


def test_a_pickle_that_names_a_function_is_refused_and_nothing_runs(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    raw = pickle.dumps({"segments": [], "x": _Boom()})
    assert b"system" in raw
    run = make_run(tmp_path, raw=raw)
    assert report_cli.main(["memory", str(run)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert "refused: the pickle names posix.system" in err and "nothing in it is run" in err
    assert not (tmp_path / "BOOM").exists()


def test_only_plain_containers_come_out():
    import io
    plain = {"a": [1, 2.5, "x", None, True, (1, 2)], "b": {"c": b"bytes"}}
    assert PlainUnpickler(io.BytesIO(pickle.dumps(plain))).load() == plain


def test_no_snapshot_and_not_a_snapshot_are_one_line_exit_2(tmp_path, capsys):
    run = make_run(tmp_path, raw=pickle.dumps([1, 2]))
    assert report_cli.main(["memory", str(run)]) == 2
    assert "not a CUDA allocator snapshot" in capsys.readouterr().err
    for p in (run / "forensics").iterdir():
        p.unlink()
    assert report_cli.main(["memory", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no allocator snapshots in" in err
