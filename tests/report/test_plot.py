"""`dflash-report hotspots --plot` (issue 37): loss and tau panels from the interval records' `train` metrics, and
no panel for what the run did not measure (a CPU run's GPU headroom, a loop's tau), in the PNG itself."""
import copy

import pytest

from profiler.report.plot import panels, timeline
from profiler.report.runs import load_run
from tests.report.test_check import clean, write
from tests.report.test_loop_report import loop_run

NVML = {"available": True, "gpus": [{"index": 0, "name": "H200", "total_bytes": 140 * 2**30,
                                     "used_bytes_peak": 60 * 2**30, "headroom_bytes": 80 * 2**30}]}


def _with_metrics(run: dict, role: str, **metrics) -> dict:
    """The run with `metrics` ({name: [a value per interval]}) in each of `role`'s interval records."""
    run = copy.deepcopy(run)
    for recs in run["logs"].values():
        ivs = [r for r in recs if r.get("type") == "interval" and r.get("role") == role]
        for k, rec in enumerate(ivs):
            rec["metrics"] = {n: {"last": v[k], "mean": v[k]} for n, v in metrics.items()}
    return run


def test_loss_and_tau_panels_come_from_the_interval_metrics(tmp_path):
    run = _with_metrics(clean(), "drafter", loss=[9.0, 5.0, 3.0], tau=[1.0, 1.5, 2.5])
    tl = timeline(load_run(write(tmp_path / "run", run)))
    assert tl["roles"]["drafter"]["metrics"] == {"loss": [9.0, 5.0, 3.0], "tau": [1.0, 1.5, 2.5]}
    assert tl["roles"]["target"]["metrics"] == {}
    # a CPU run: no headroom panel
    assert panels(tl) == [("role", "drafter"), ("role", "target"), ("tokens", None), ("metric", "loss"),
                          ("metric", "tau")]


def test_a_panel_only_for_what_was_measured(tmp_path):
    loop = _with_metrics(loop_run(), "trainer", loss=[4.0, 3.0, 2.0, 1.9])
    tl = timeline(load_run(write(tmp_path / "loop", loop)))
    assert panels(tl) == [("role", "trainer"), ("tokens", None), ("metric", "loss")]   # no tau, no GPU
    gpu = copy.deepcopy(loop)
    for r in gpu["logs"][0]:
        if r.get("type") == "interval":
            r["memory"] = NVML
    assert panels(timeline(load_run(write(tmp_path / "gpu", gpu))))[-1] == ("headroom", None)


def test_the_png_holds_one_row_per_panel(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    from profiler import report

    run_dir = write(tmp_path / "run", _with_metrics(clean(), "drafter", loss=[9.0, 5.0, 3.0], tau=[1.0, 1.5, 2.5]))
    png = report.plot(run_dir, tmp_path / "run.png")
    assert imread(png).shape[0] == 5 * 300   # 5 panels of 3 in at 100 dpi: no empty headroom panel
