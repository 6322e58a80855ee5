"""bench/bench_drafter.py's peer: SpecForge measured in the same process when importable, and a true line when
not (issue 45: the script claimed the peer "cannot be installed on the device machine", where its wheel runs)."""
from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import bench_drafter  # noqa: E402
import peer_specforge  # noqa: E402


def test_the_script_no_longer_claims_the_peer_cannot_be_installed():
    for path in (BENCH / "bench_drafter.py", *sorted((BENCH / "gpu").glob("*"))):
        assert "cannot be installed" not in path.read_text(), path
    assert "--no-deps" in bench_drafter.__doc__ and "same process" in bench_drafter.__doc__


def test_the_last_line_names_the_peer_row_or_why_there_is_none(monkeypatch):
    monkeypatch.setattr(peer_specforge, "version", lambda: "0.2.0")
    line = bench_drafter.peer_line([{"backend": "dense"}, {"backend": "flex", "peer": True}])
    assert line.startswith("peer: the last row is SpecForge 0.2.0") and "flex attention" in line
    assert bench_drafter.peer_line([{"backend": "dense"}]) == "peer (SpecForge): not measured: --no-peer"
    monkeypatch.setattr(peer_specforge, "version", lambda: None)
    assert "not importable here" in bench_drafter.peer_line([{"backend": "dense"}])


def test_the_peer_is_measured_in_the_same_call_when_importable(monkeypatch, capsys):
    """main() appends the peer's row (timed by peer_specforge) and writes its median as peer_ms."""
    calls = []
    monkeypatch.setattr(peer_specforge, "version", lambda: "0.2.0")
    monkeypatch.setattr(bench_drafter, "time_variant", lambda *a: {
        "backend": "dense", "loss_variant": "chunked", "fused": "on", "median_ms": 10.0, "min_ms": 9.0,
        "first_step_s": 1.0, "peak_mem_gib": 0.0, "loss": 8.0, "tau": 1.0})
    monkeypatch.setattr(peer_specforge, "time_peer", lambda *a: calls.append(a) or {
        "backend": "sdpa", "loss_variant": "specforge", "fused": "-", "median_ms": 20.0, "min_ms": 19.0,
        "first_step_s": 2.0, "peak_mem_gib": 0.0, "loss": 8.1, "tau": None, "peer": True})
    written = {}
    monkeypatch.setattr(bench_drafter.common, "write_out", lambda name, doc: written.update(doc))
    assert bench_drafter.main(["--tiny", "--repeats", "1", "--warmup", "0"]) == 0
    assert len(calls) == 1 and written["peer_ms"] == 20.0
    out = capsys.readouterr().out.splitlines()
    assert "specforge" in out[-2] and out[-1].startswith("peer: the last row is SpecForge 0.2.0")
    assert bench_drafter.main(["--tiny", "--repeats", "1", "--warmup", "0", "--no-peer"]) == 0
    assert len(calls) == 1 and written["peer_ms"] is None
