"""`dflash-report` on a loop of its own (issue 37, item 2): a run whose ranks are neither target nor drafter gets the
sections that apply (ranking, steady rates from its intervals, ranks, memory, events, hot frames, findings) with
no DFlash-only section and no dflash-train flag; the same report keeps the profiler's own threads apart from the
training's hot frames, for any run. Crafted logs (docs/RUNLOG.md), so each rule is seen to fire."""
from __future__ import annotations

import copy
import json
import re

from dflash import report_cli
from dflash.advice import ADVICE
from profiler.report import format_hotspots, hotspots
from profiler.report.check import check
from tests.report.test_check import T0, clean, entry, interval, run_end, write

L = "MainThread"


def _samples(*threads) -> dict:
    """An interval's stack_samples: 4 dumps, each (name, hot frame or None: idle) counted in all of them."""
    return {"samples": 4, "failed": 0, "threads": [
        {"name": n, "native_id": 10 + i, "samples": 4, "idle_samples": 0 if f else 4,
         "top_frames": [{"frame": f, "count": 4}] if f else []} for i, (n, f) in enumerate(threads)]}


def loop_run(ranks: int = 1) -> dict:
    """A loop's run (role `trainer`) on `ranks` ranks: 4 one-second intervals, the first warm-up, the last final;
    set_step's step_rate, a `tokens` counter, stack samples of the training thread and of profiler threads, a
    nonfinite event and a costly profiler."""
    logs = {}
    for rank in range(ranks):
        recs = [interval(rank, "trainer", k, 10 * (k + 1), {"trainer.fwd_bwd": entry([0.08] * 10, L),
                                                            "trainer.optim": entry([0.01] * 10, L)}, 640, T0,
                         step_rate={"steps": 10, "per_second": 10.0}, profiler_share=0.05,
                         stack_samples=_samples((L, "forward (model.py:12)"),
                                                ("profiler.collector", "poll (collector.py:80)"),
                                                ("profiler.control", None)),
                         **({"warmup": True} if k == 0 else {}), **({"final": True} if k == 3 else {}))
                for k in range(4)]
        start = {"type": "run_start", "rank": rank, "role": "trainer", "schema": 1, "run_id": "loop",
                 "hostname": "h", "time_unix": T0, "interval_s": 1.0, "warmup_steps": 5, "phase_spans": [],
                 "device": "cpu", "config": None}
        nan = {"type": "event", "kind": "nonfinite", "rank": rank, "role": "trainer", "time_unix": T0 + 2.5,
               "step": 25, "span": "trainer.fwd_bwd", "tensor": "loss"}
        logs[rank] = [start, *recs[:2], nan, *recs[2:], run_end(rank, "trainer", recs, 40)]
    return {"logs": logs, "files": {}}


def test_a_loop_of_its_own_gets_the_sections_that_apply_without_pipeline_noise(tmp_path, capsys):
    run_dir = write(tmp_path / "run", loop_run(ranks=2))
    rep = hotspots(run_dir, advice=ADVICE)   # as dflash-report asks; a loop gets the report's own advice
    assert rep["findings"] == hotspots(run_dir)["findings"]
    assert rep["pipeline"] is False and rep["verdict"]["applies"] is False and rep["verdict"]["evidence"] == []
    rates = rep["steady"]["roles"]["trainer"]["intervals"]
    # steady intervals 1 and 2 of each rank: 640 tokens/s per rank, summed; 10 steps/s per rank
    assert rates == {"window": "steady intervals (4)", "seconds": 4.0, "ranks": 2, "tokens_per_s": 1280.0,
                     "steps_per_s": 10.0}
    assert all(r["busy_share"] is None and r["capacity_tokens_per_s"] is None for r in rep["ranks"]["ranks"])
    assert rep["ranks"]["straggler"] is None and "no rank has a capacity" in rep["ranks"]["reason"]
    assert rep["split"]["best"] is None and "a loop of its own" in rep["split"]["reason"]
    margin = rep["memory_margin"]
    assert margin["max_tokens_per_batch"] is None and "a loop of its own" in margin["reason"]
    kinds = {f["kind"]: f for f in rep["findings"]}
    assert set(kinds) == {"nonfinite", "profiler_cost"}, kinds
    assert all(f["flags"] == [] for f in rep["findings"])
    assert "profiler.check_finite" in kinds["nonfinite"]["next"]
    assert "ProfilerConfig(interval_s=...)" in kinds["profiler_cost"]["next"]
    text = format_hotspots(rep)
    assert "trainer: 1,280 tokens/s (sum over 2 rank(s)), 10 steps/s (per rank) over steady intervals (4)" in text
    assert "Findings" in text and "Ranks (" in text and "Memory headroom" in text
    assert_no_pipeline_noise(text)
    res = check(run_dir)
    assert res.violations == [] and any("no transfers to match" in n for n in res.notes)
    assert report_cli.main(["check", str(run_dir)]) == 0
    capsys.readouterr()


def test_the_profilers_own_threads_are_apart_from_the_hot_frames(tmp_path):
    rep = hotspots(write(tmp_path / "run", loop_run()))
    hf = rep["hot_frames"]
    assert [t["thread"] for t in hf["threads"]] == [L]
    assert {t["thread"] for t in hf["profiler_threads"]} == {"profiler.collector", "profiler.control"}
    text = format_hotspots(rep)
    frames = text[text.index("Hot frames"):text.index("Ranks (")]
    training, own = frames.split("the profiler's own threads")
    assert "forward (model.py:12)" in training and "profiler." not in training
    assert "rank 0 profiler.collector: 100.0% poll (collector.py:80)" in own
    assert "rank 0 profiler.control: no hot frame (waiting)" in own


def test_a_pipeline_run_keeps_its_sections_and_flags(tmp_path):
    """The same rules on dflash-train's run still speak dflash-train: its verdict, and flags in its findings."""
    run = clean()
    nan = {"type": "event", "kind": "nonfinite", "rank": 0, "role": "drafter", "time_unix": T0 + 1.5, "step": 3}
    run["logs"][0].insert(2, nan)
    rep = hotspots(write(tmp_path / "run", copy.deepcopy(run)), advice=ADVICE)
    assert rep["pipeline"] is True and rep["verdict"]["applies"] is True
    assert "Verdict (" in format_hotspots(rep)
    (f,) = [f for f in rep["findings"] if f["kind"] == "nonfinite"]
    assert "--max-in-flight" in f["flags"]


def test_no_stack_samples_says_how_to_get_them_in_the_loops_terms(tmp_path, capsys):
    run = loop_run()
    for rec in run["logs"][0]:
        rec.pop("stack_samples", None)
    run_dir = write(tmp_path / "run", run)
    assert report_cli.main(["hotspots", "--json", str(run_dir)]) == 0
    reason = json.loads(capsys.readouterr().out)["hot_frames"]["reason"]
    assert "ProfilerDeps(stack_sampler=" in reason and "--stack-samples-per-interval" not in reason


def assert_no_pipeline_noise(text: str) -> None:
    """A loop of its own gets no DFlash-only section and no dflash-train flag in its report."""
    for noise in ("target and a drafter", "Verdict", "Split", "Memory margin", "dflash-train", "this run is on the CPU",
                  "--stack-samples-per-interval", "--profile-interval"):
        assert noise not in text, (noise, text)
    assert not re.search(r"(?<![\w-])--[a-z]", text.replace("dflash-profile snapshot --run-dir", "")), text


def test_a_loops_gpus_keep_their_activity_line_without_a_pipeline_verdict(tmp_path):
    """On a Hopper GPU, GPM's launch-bound reading applies to any loop: it stays, under "GPU activity"."""
    from tests.report.test_gpm_verdict import _gpu

    run = loop_run()
    for rec in run["logs"][0]:
        if rec.get("type") == "interval":
            rec["memory"] = {"available": True, "gpus": [_gpu(97.0, 30.0, 5.0, 10.0)],
                             "allocator": {"available": False, "reason": "-"}}
    rep = hotspots(write(tmp_path / "run", run))
    assert rep["verdict"]["applies"] is False and rep["verdict"]["gpu"]["trainer"]["bound"] == "launch-bound"
    text = format_hotspots(rep)
    block = text[text.index("GPU activity (NVML and GPM)"):].split("\n\n")[0]
    assert "trainer GPUs (GPM, 2 interval x GPU means; steady intervals (2))" in block and "launch-bound" in block
    assert_no_pipeline_noise(text)


def test_a_loop_without_warmup_steps_keeps_its_start_up_out_of_the_steady_state(tmp_path):
    """Issue 45, from the CPU trial: docs/API.md's Trainer example sets no warmup_steps, and its first interval
    (the Trainer's start, before any step) counted as steady: 179 tokens/s against 1,739 reached. The default
    warm-up leaves the start-up and the first steps out; the ranks row shows the steady line's rate, not "-"."""
    import time

    import profiler
    from tests.profiler.build import make_profiler

    with make_profiler(tmp_path / "run", role="trainer", background=False, measure_floors=False,
                       control=False, interval_s=60) as prof:
        time.sleep(0.3)                   # the loop's own start-up: no step yet, no tokens
        prof.close_interval()
        for interval in range(4):
            for step in range(3 * interval, 3 * interval + 3):
                prof.set_step(step)
                with profiler.span("trainer.step"):
                    time.sleep(0.01)
                profiler.count("tokens", 100)
            prof.close_interval()
    assert prof.cfg.warmup_steps == profiler.config.AUTO_WARMUP_STEPS == 2
    recs = [json.loads(x) for x in (tmp_path / "run" / "profile" / "rank0.jsonl").read_text().splitlines()]
    marks = [bool(r.get("warmup")) for r in recs if r["type"] == "interval"]
    assert marks == [True, True, False, False, False, False]   # the start-up; steps 0-2; ...; the final close
    rep = hotspots(tmp_path / "run")
    rates = rep["steady"]["roles"]["trainer"]["intervals"]
    assert rates["window"] == "steady intervals (3)"   # the last interval (the profiler's exit) is final
    steady = [r for r in recs if r["type"] == "interval" and not r.get("warmup") and not r.get("final")]
    want = sum(r["counters"]["tokens"]["total"] for r in steady) / sum(r["duration_seconds"] for r in steady)
    assert rates["tokens_per_s"] == want and want > 5_000   # 300 tokens in ~0.03 s of each steady interval
    (row,) = rep["ranks"]["ranks"]
    assert row["tokens_per_s"] == want and row["tokens_window"] == rates["window"]
    text = format_hotspots(rep)
    (line,) = [x for x in text.splitlines() if x.split()[:2] == ["0", "trainer"]]
    assert f"{want:,.0f}" in line and f"tokens/s over {rates['window']}" in line
    assert check(tmp_path / "run").violations == []


def test_a_loop_that_ends_in_its_first_interval_shows_that_intervals_rate_and_check_agrees(tmp_path):
    """Issue 45, the Hugging Face Trainer on a quiet machine: all 48 steps ran inside the first interval, so the
    only interval is warm-up and final and none is steady. The steady line and the ranks row read that interval,
    labelled "none steady", and check expected "-" for the row (its steady intervals only): exit 1."""
    import time

    import profiler
    from tests.profiler.build import make_profiler

    with make_profiler(tmp_path / "run", role="trainer", background=False, measure_floors=False,
                       control=False, interval_s=60) as prof:
        for step in range(6):
            prof.set_step(step)
            with profiler.span("trainer.step"):
                time.sleep(0.01)
            profiler.count("tokens", 100)
    rep = hotspots(tmp_path / "run")
    rates = rep["steady"]["roles"]["trainer"]["intervals"]
    assert rates["window"] == "the only interval (none steady: warm-up, phases or final)"
    (row,) = rep["ranks"]["ranks"]
    assert row["tokens_per_s"] == rates["tokens_per_s"] > 0 and row["tokens_window"] == rates["window"]
    assert row["capacity_tokens_per_s"] is None
    (line,) = [x for x in format_hotspots(rep).splitlines() if x.split()[:2] == ["0", "trainer"]]
    assert f"{rates['tokens_per_s']:,.0f}" in line and f"tokens/s over {rates['window']}" in line
    res = check(tmp_path / "run")
    assert res.violations == [], res.violations
