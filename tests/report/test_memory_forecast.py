"""The memory forecast (profiler/report/memory_forecast.py, issue #50) on run logs whose per-step allocator peaks
follow a known law: the largest setting it finds is the law's, the warm-up's transient binds where it is higher,
ranks on one GPU add, and a forecast without a basis says why in one line instead of a number."""
from __future__ import annotations

import json
import random

import pytest

from profiler.report import load_run
from profiler.report.memory_forecast import HEADROOM_SHARE, memory_forecast, nnls

GIB = 2 ** 30
TOTAL = 80 * GIB
OUTSIDE = 2 * GIB            # NVML used beyond the ranks' reserved bytes (contexts)
SIZES = {"target_tokens": {"role": "target", "scales": {"--tokens-per-batch": 1}, "what": "t"},
         "drafter_tokens": {"role": "drafter", "scales": {"--tokens-per-batch": 1}, "what": "d"},
         "block_rows": {"role": "drafter", "scales": {"--num-anchors": 1}, "what": "b"}}
CELLS = {"target_attention_cells": {"role": "target", "scales": {"--tokens-per-batch": 1, "--max-length": 1},
                                    "what": "c"}}
LAW = {"target": (10 * GIB, {"target_tokens": 3 * 2 ** 20, "target_attention_cells": 0}),
       "drafter": (5 * GIB, {"drafter_tokens": 1 * 2 ** 20, "block_rows": 2 * 2 ** 20})}
"""role -> (fixed bytes, {size: bytes per unit})."""
CONFIG = {"tokens_per_batch": 4096, "num_anchors": 64, "max_length": 512}


def step_sizes(role: str, rng: random.Random) -> dict:
    fill = rng.uniform(0.6, 1.0)   # short data fills a batch less
    if role == "target":
        longest = rng.randint(128, 512)   # rows x longest <= the batch's tokens
        rows = int(4096 * fill) // longest
        return {"target_tokens": rows * longest, "target_attention_cells": rows * longest * longest}
    docs = rng.randint(1, 4)
    tokens, rows = int(4096 * fill), int(docs * rng.uniform(0.5, 1.0) * 64 * 16 / 4)
    return {"drafter_tokens": tokens, "block_rows": rows, "drafter_score_cells": rows * (tokens + rows)}


def peak(role: str, sizes: dict, law=LAW) -> float:
    fixed, per = law[role]
    return fixed + sum(per.get(n, 0) * v for n, v in sizes.items())


def write_run(run_dir, steps=40, warm_peak=None, sizes=SIZES, cuda=True, interval_steps=10, caps=None, law=LAW):
    """Two ranks sharing GPU 0 (drafter rank 0, target rank 1); `warm_peak`: {role: bytes} at warm-up step 1."""
    (run_dir / "profile").mkdir(parents=True)
    for rank, role in ((0, "drafter"), (1, "target")):
        rng = random.Random(rank)
        recs = [{"type": "run_start", "schema": 1, "time_unix": 1.0, "rank": rank, "role": role, "run_id": "r",
                 "hostname": "h", "memory_sizes": sizes, "memory_caps": caps or {}, "config": CONFIG, "warmup_steps": interval_steps,
                 "phase_spans": [], "histogram_buckets_seconds": [], "interval_s": 60.0}]
        for k in range(steps // interval_steps):
            rows = []
            for step in range(k * interval_steps, (k + 1) * interval_steps):
                s = {n: v for n, v in step_sizes(role, rng).items() if n in sizes or not sizes}
                p = peak(role, s, law) if not (warm_peak and k == 0 and step == 1) else warm_peak[role]
                rows.append({"step": step, "peak_allocated_bytes": p, "peak_reserved_bytes": p * 1.3,
                             "allocated_bytes": LAW[role][0], "sizes": s})
            reserved = max(r["peak_reserved_bytes"] for r in rows)
            memory = ({"available": True, "gpus": [{"index": 0, "total_bytes": TOTAL,
                                                    "used_bytes_last": OUTSIDE + 2 * reserved,
                                                    "used_bytes_peak": OUTSIDE + 2 * reserved, "samples": 3}],
                       "allocator": {"available": True, "allocated_bytes": LAW[role][0], "reserved_bytes": reserved,
                                     "peak_allocated_bytes": max(r["peak_allocated_bytes"] for r in rows),
                                     "peak_reserved_bytes": reserved},
                       "steps": {"rows": rows, "steps": interval_steps}} if cuda else
                      {"available": False, "reason": "cpu", "allocator": {"available": False, "reason": "cpu"}})
            recs.append({"type": "interval", "time_unix": 2.0 + k, "rank": rank, "role": role, "index": k,
                         "step": (k + 1) * interval_steps, "duration_seconds": 60.0, "warmup": k == 0,
                         "spans": {}, "counters": {}, "memory": memory})
        (run_dir / "profile" / f"rank{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return run_dir


def law_need(flag: str, sizes=SIZES, law=LAW):
    """need(x): both ranks' bytes by the law at the setting scaled by x (each rank's worst step past warm-up)."""
    run_rng = {role: random.Random(rank) for rank, role in ((0, "drafter"), (1, "target"))}
    worst = {}
    for role, rng in run_rng.items():
        rows = [{n: v for n, v in step_sizes(role, rng).items() if n in sizes}
                for _ in range(40)][10:]   # past the warm-up interval
        fixed, per = law[role]
        power = lambda n: sizes[n]["scales"].get(flag, 0) if n in sizes else 0   # noqa: E731
        worst[role] = (fixed, [[(per[n] * v, power(n)) for n, v in s.items()] for s in rows])

    def need(x):
        return sum(f + max(sum(t * x ** e for t, e in row) for row in steps) for f, steps in worst.values())
    return need


def test_nnls_recovers_a_non_negative_law_and_clips_a_negative_one():
    a = [[1.0, 2.0], [2.0, 1.0], [3.0, 5.0], [4.0, 1.0]]
    assert nnls(a, [1 * r[0] + 3 * r[1] for r in a]) == pytest.approx([1.0, 3.0])
    got = nnls(a, [-1 * r[0] + 3 * r[1] for r in a])
    assert min(got) >= 0.0


@pytest.mark.parametrize("flag", ["--tokens-per-batch", "--num-anchors"])
def test_forecast_finds_the_laws_largest_setting(tmp_path, flag):
    run = load_run(write_run(tmp_path / "run"))
    fc = memory_forecast(run)
    assert fc["reason"] is None
    setting = next(s for s in fc["settings"] if s["flag"] == flag)
    # The law's: both ranks' worst steps past warm-up, scaled by x, against the log's own limit.
    need = law_need(flag)
    limit = setting["limit_bytes"]
    lo, hi = 0.0, 1024.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if need(mid) <= limit else (lo, mid)
    current = CONFIG[flag.lstrip("-").replace("-", "_")]
    assert setting["current"] == current and setting["limited_by"]["ranks"] == [0, 1]
    assert setting["largest"] == pytest.approx(lo * current, rel=0.01)
    assert setting["largest"] <= lo * current * 1.001   # never above the law
    assert limit == pytest.approx((1 - HEADROOM_SHARE) * TOTAL - outside_of(run))
    assert setting["transient"] == []


def _bisect(need, limit: float) -> float:
    lo, hi = 0.0, 1024.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if need(mid) <= limit else (lo, mid)
    return lo


def test_max_length_scales_the_targets_score_cells_only_and_is_capped_by_the_batch(tmp_path):
    """At a fixed batch a longer --max-length means fewer, longer rows: an attention that keeps its scores grows
    with it (rows x longest^2 = tokens x longest), its tokens do not; a flash kernel's (no bytes per cell) is not
    limited by memory and stops at --tokens-per-batch, a row as long as a batch."""
    sizes = {**SIZES, **CELLS}
    eager = {**LAW, "target": (10 * GIB, {"target_tokens": 3 * 2 ** 20, "target_attention_cells": 2 ** 11})}
    caps = {"--max-length": "--tokens-per-batch"}
    fc = memory_forecast(load_run(write_run(tmp_path / "eager", sizes=sizes, law=eager, caps=caps)))
    setting = next(s for s in fc["settings"] if s["flag"] == "--max-length")
    want = _bisect(law_need("--max-length", sizes, eager), setting["limit_bytes"]) * CONFIG["max_length"]
    assert setting["largest"] == pytest.approx(want, rel=0.01) and setting["largest"] <= want * 1.001
    assert setting["capped_by"] is None and 512 < setting["largest"] < 4096
    flash = memory_forecast(load_run(write_run(tmp_path / "flash", sizes=sizes, caps=caps)))
    setting = next(s for s in flash["settings"] if s["flag"] == "--max-length")
    assert setting["largest"] == CONFIG["tokens_per_batch"]
    assert setting["capped_by"] == {"flag": "--tokens-per-batch", "value": 4096, "memory_largest": None}
    tokens = next(s for s in flash["settings"] if s["flag"] == "--tokens-per-batch")
    assert tokens["capped_by"] is None   # the cells scale with the batch too: its forecast still counts them


@pytest.mark.parametrize("flag", ["--tokens-per-batch", "--num-anchors"])
def test_dense_attentions_score_cells_grow_as_their_own_power(tmp_path, flag):
    """Under dense attention the drafter names its [block rows, context + block rows] cells, which grow as the
    square of the batch: the fit scales each size's part by its own power, so the forecast is the law's, and the
    square makes it smaller than a law without the cells (flex) would allow."""
    cells = {"drafter_score_cells": {"role": "drafter", "scales": {"--tokens-per-batch": 2, "--num-anchors": 2},
                                     "what": "s"}}
    sizes = {**SIZES, "block_rows": {"role": "drafter", "scales": {"--num-anchors": 1, "--tokens-per-batch": 1},
                                     "what": "b"}, **cells}
    dense = {**LAW, "drafter": (5 * GIB, {"drafter_tokens": 2 ** 20, "block_rows": 2 ** 20,
                                          "drafter_score_cells": 2 ** 9})}
    fc = memory_forecast(load_run(write_run(tmp_path / "dense", sizes=sizes, law=dense)))
    setting = next(s for s in fc["settings"] if s["flag"] == flag)
    current = CONFIG[flag.lstrip("-").replace("-", "_")]
    want = _bisect(law_need(flag, sizes, dense), setting["limit_bytes"]) * current
    assert setting["largest"] == pytest.approx(want, rel=0.01) and setting["largest"] <= want * 1.001
    assert "drafter_score_cells" in setting["basis"]["0"] and "as s^2" in setting["basis"]["0"]
    linear = {**dense, "drafter": (5 * GIB, {**dense["drafter"][1], "drafter_score_cells": 0})}
    flat = memory_forecast(load_run(write_run(tmp_path / "linear", sizes=sizes, law=linear)))
    assert setting["largest"] < next(s for s in flat["settings"] if s["flag"] == flag)["largest"]


def outside_of(run) -> float:
    from profiler.schema import views
    last = {log.rank: views.interval(log.intervals[-1]).memory for log in run.ranks.values()}
    used = max(m.gpus[0].used_bytes_last for m in last.values())
    return max(0.0, used - sum(m.allocator.reserved_bytes for m in last.values()))


def test_a_warm_up_transient_above_the_steady_need_binds_and_is_named(tmp_path):
    calm = memory_forecast(load_run(write_run(tmp_path / "calm")))
    hot = memory_forecast(load_run(write_run(tmp_path / "hot", warm_peak={"target": 40 * GIB, "drafter": 1 * GIB})))
    tok = lambda fc: next(s for s in fc["settings"] if s["flag"] == "--tokens-per-batch")   # noqa: E731
    assert tok(hot)["largest"] < tok(calm)["largest"]
    assert [t["rank"] for t in tok(hot)["transient"]] == [1] and tok(hot)["transient"][0]["step"] == 1
    assert "warm-up" in tok(hot)["basis"]["1"]


@pytest.mark.parametrize("case, why", [
    ("cpu", "a CPU run"), ("no sizes", "names no sizes"), ("short", "too few steps past warm-up")])
def test_a_forecast_without_a_basis_is_one_line_and_no_number(tmp_path, case, why):
    kw = {"cpu": {"cuda": False}, "no sizes": {"sizes": {}}, "short": {"steps": 14, "interval_steps": 7}}[case]
    fc = memory_forecast(load_run(write_run(tmp_path / "run", **kw)))
    assert why in fc["reason"] and "\n" not in fc["reason"] and fc["settings"] == []


def test_hotspots_says_the_forecast_in_its_json_and_text(tmp_path):
    from profiler.report import format_hotspots, hotspots_of
    rep = hotspots_of(load_run(write_run(tmp_path / "run")))
    tokens = next(s for s in rep["memory_forecast"]["settings"] if s["flag"] == "--tokens-per-batch")
    text = format_hotspots(rep)
    assert f"--tokens-per-batch up to {tokens['largest']:,} (now 4096;" in text
    assert "from 60 steps' allocator peaks past warm-up, 2 rank(s)" in text


def test_each_rank_says_its_reserved_over_allocated_at_the_worst_step(tmp_path):
    fc = memory_forecast(load_run(write_run(tmp_path / "run")))
    assert [r["reserved_over_allocated_at_worst"] for r in fc["ranks"]] == [pytest.approx(1.3)] * 2
