"""`dflash-report stacks`: flame graphs of host time from the stack samples' whole stacks (profiler/report/stacks.py).

On a hand-made log: the folded lines and their counts exactly, speedscope's schema and import rules, the profiler's
threads left out unless asked, --running-only, --role, --snapshots, logs written before whole stacks, and the
one-line errors (exit 2). On a real two-rank CPU run with --stack-samples-per-interval: a speedscope file valid
against the vendored schema, folded counts equal to each thread's samples in the logs, whole stacks agreeing with
the hot frames recorded beside them, and `dflash-report check` holding."""
from __future__ import annotations

import copy
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from dflash import report_cli
from profiler.schema import views
from profiler.schema.records import read_records
from profiler.report.check import check, check_run
from profiler.report.stacks import IDLE, MISSING, NO_FRAMES, OTHER, frame_object
from tests.profiler.test_views import read_all
from tests.report.speedscope_schema import SCHEMA, import_errors, validate
from tests.report.test_check import clean
from tests.report.test_check import write as write_crafted

REPO = Path(__file__).resolve().parents[2]
T0 = 1_000_000.0
MAIN = ["<module> (m.py:1)", "loop (m.py:5)", "step (m.py:9)", "recv (t.py:3)", "Thread._bootstrap (threading.py:1)",
        "Collector._run (profiler/collector.py:61)"]


def _stack_samples(frames: list, *threads) -> dict:
    return {"samples": max(t["samples"] for t in threads), "failed": 0, "frames": frames, "threads": list(threads)}


def _thread(name: str, samples: int, idle: int, stacks: list, other: int = 0, other_idle: int = 0) -> dict:
    return {"name": name, "native_id": 7, "samples": samples, "idle_samples": idle, "top_frames": [],
            "stacks": [{"frames": f, "count": n, "idle_samples": i} for f, n, i in stacks],
            "other_samples": other, "other_idle_samples": other_idle}


def _interval(rank: int, role: str, index: int, stack_samples: dict | None) -> dict:
    rec = {"type": "interval", "time_unix": T0 + index + 1, "rank": rank, "role": role, "index": index, "step": index,
           "duration_seconds": 1.0, "spans": {}, "counters": {}}
    return rec if stack_samples is None else dict(rec, stack_samples=stack_samples)


def _run(tmp_path: Path, logs: dict) -> Path:
    """A run directory of {rank: (role, [records after its run_start])}."""
    run = tmp_path / "run"
    (run / "profile").mkdir(parents=True)
    for rank, (role, recs) in logs.items():
        start = {"type": "run_start", "time_unix": T0, "rank": rank, "role": role, "schema": 1, "run_id": "r",
                 "interval_s": 1.0}
        (run / "profile" / f"rank{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (start, *recs)))
    return run


def hand_made(tmp_path: Path, drafter_role: str = "drafter") -> Path:
    """Rank 0: drafter.main in two intervals (their frame tables in different orders, an index outside its table,
    idle samples and samples of stacks not kept), profiler.collector, an interval of an older log (hot frames only)
    and a snapshot; rank 1: target.main without Python frames."""
    first = _stack_samples(MAIN, _thread("drafter.main", 10, 3, [([0, 1, 2], 6, 1), ([0, 1, 3], 2, 2)], other=2),
                           _thread("profiler.collector", 10, 10, [([4, 5], 10, 10)]))
    order = [MAIN[2], MAIN[0], MAIN[1]]
    second = _stack_samples(order, _thread("drafter.main", 4, 0, [([1, 2, 0], 3, 0), ([1, 99], 1, 0)]))
    older = {"samples": 5, "failed": 0, "threads": [{"name": "drafter.main", "native_id": 7, "idle_samples": 0,
                                                     "top_frames": [{"frame": MAIN[2], "count": 5}]}]}
    snap = {"type": "snapshot", "time_unix": T0 + 2.5, "rank": 0, "role": drafter_role, "pid": 1, "step": 2,
            "threads": [{"name": "drafter.main", "native_id": 7, "frames": [MAIN[2], MAIN[1], MAIN[0]]}]}
    target = _stack_samples([], _thread("target.main", 2, 0, [([], 2, 0)]))
    return _run(tmp_path, {0: (drafter_role, [_interval(0, drafter_role, 0, first), snap,
                                              _interval(0, drafter_role, 1, second),
                                              _interval(0, drafter_role, 2, older)]),
                           1: ("target", [_interval(1, "target", 0, target)])})


def stacks_cli(*args) -> tuple[int, str]:
    """(exit status, what the command wrote to -o -) of `dflash-report stacks ARGS -o -`."""
    import io
    from contextlib import redirect_stdout

    out = io.StringIO()
    with redirect_stdout(out):
        code = report_cli.main(["stacks", *map(str, args), "-o", "-"])
    return code, out.getvalue()


def folded_totals(text: str) -> Counter:
    """{(first frame, thread frame): summed count} of folded lines, each checked to be `frames count`."""
    totals: Counter = Counter()
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        assert len(frames) >= 3 and count.isdigit() and int(count) > 0, line
        totals[frames[0], frames[1]] += int(count)
    return totals


# ---- the hand-made log -------------------------------------------------------------------------------------------

M, L, S, R = MAIN[:4]


def test_folded_lines_hold_each_threads_stacks_root_first_with_their_counts(tmp_path, capsys):
    code, text = stacks_cli(hand_made(tmp_path), "--folded")
    assert code == 0
    assert text == "".join(line + "\n" for line in [
        f"rank0 drafter;drafter.main;{OTHER} 2",
        f"rank0 drafter;drafter.main;{M};{MISSING} 1",
        f"rank0 drafter;drafter.main;{M};{L};{R};{IDLE} 2",
        f"rank0 drafter;drafter.main;{M};{L};{S} 8",
        f"rank0 drafter;drafter.main;{M};{L};{S};{IDLE} 1",
        f"rank1 target;target.main;{NO_FRAMES} 2"])
    assert folded_totals(text) == {("rank0 drafter", "drafter.main"): 14, ("rank1 target", "target.main"): 2}
    err = capsys.readouterr().err
    assert "2 profiles of 2 ranks: 16 thread samples from 16 dumps over 3 intervals (whole run)" in err
    assert "1 profiler threads left out (--profiler-threads)" in err


def test_running_only_leaves_the_waits_out_and_profiler_threads_come_marked_when_asked(tmp_path):
    run = hand_made(tmp_path)
    code, text = stacks_cli(run, "--folded", "--running-only")
    assert code == 0 and IDLE not in text
    assert folded_totals(text) == {("rank0 drafter", "drafter.main"): 14 - 3, ("rank1 target", "target.main"): 2}
    code, text = stacks_cli(run, "--folded", "--profiler-threads")
    assert code == 0 and (f"rank0 drafter;profiler.collector [profiler];{MAIN[4]};{MAIN[5]};{IDLE} 10"
                          in text.splitlines())
    code, text = stacks_cli(run, "--profiler-threads", "--running-only")
    assert code == 0 and "[profiler]" not in text   # it only waited: nothing of it runs


def test_the_speedscope_file_is_valid_one_profile_per_thread_the_hottest_shown(tmp_path):
    code, text = stacks_cli(hand_made(tmp_path), "--profiler-threads")
    doc = json.loads(text)
    assert code == 0 and validate(doc) == [] and import_errors(doc) == []
    names = [p["name"] for p in doc["profiles"]]
    assert names == ["rank0 drafter / drafter.main (14 samples, whole run)",
                     "rank0 drafter / profiler.collector [profiler] (10 samples, whole run)",
                     "rank1 target / target.main (2 samples, whole run)"]
    assert doc["activeProfileIndex"] == 0 and doc["$schema"] == "https://www.speedscope.app/file-format-schema.json"
    frames = doc["shared"]["frames"]
    main = doc["profiles"][0]
    got = {tuple(frames[i]["name"] for i in s): w for s, w in zip(main["samples"], main["weights"])}
    assert got == {("(other stacks)",): 2, ("<module>", MISSING): 1, ("<module>", "loop", "recv", IDLE): 2,
                   ("<module>", "loop", "step"): 8, ("<module>", "loop", "step", IDLE): 1}
    assert {"name": "step", "file": "m.py", "line": 9} in frames and main["unit"] == "none"
    assert frame_object("f (x.py:?)") == {"name": "f", "file": "x.py"} and frame_object(IDLE) == {"name": IDLE}


def test_role_and_snapshots(tmp_path):
    run = hand_made(tmp_path)
    code, text = stacks_cli(run, "--folded", "--role", "target")
    assert code == 0 and folded_totals(text) == {("rank1 target", "target.main"): 2}
    code, text = stacks_cli(run, "--folded", "--snapshots")
    assert code == 0 and f"rank0 drafter (snapshots);drafter.main;{M};{L};{S} 1" in text.splitlines()
    code, text = stacks_cli(run, "--snapshots")
    names = [p["name"] for p in json.loads(text)["profiles"]]
    assert "rank0 drafter / drafter.main (1 snapshots, whole run)" in names and validate(json.loads(text)) == []


def test_the_default_file_lands_in_the_run_directory_and_an_unwritable_one_is_exit_1(tmp_path, capsys):
    run = hand_made(tmp_path)
    assert report_cli.main(["stacks", str(run)]) == 0
    path = run / "stacks" / "stacks.speedscope.json"
    assert validate(json.loads(path.read_text())) == []
    assert capsys.readouterr().out.startswith(f"wrote {path}: 2 profiles of 2 ranks")
    assert report_cli.main(["stacks", str(run), "--folded"]) == 0 and (run / "stacks" / "stacks.folded").exists()
    (tmp_path / "file").write_text("")
    assert report_cli.main(["stacks", str(run), "-o", str(tmp_path / "file" / "out.json")]) == 1
    assert capsys.readouterr().err.startswith("dflash-report: error: cannot write the stacks: ")


def _error(*args) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, "-m", "dflash.report_cli", "stacks", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    return proc.returncode, proc.stderr


def test_a_run_without_whole_stacks_is_one_line_naming_the_flag_exit_2(tmp_path):
    bare = _run(tmp_path / "a", {0: ("drafter", [_interval(0, "drafter", 0, None)])})
    older = hand_made(tmp_path / "b")
    lines = (older / "profile" / "rank0.jsonl").read_text().splitlines()
    (older / "profile" / "rank0.jsonl").write_text(lines[0] + "\n" + lines[-1] + "\n")   # only the older interval
    (older / "profile" / "rank1.jsonl").unlink()
    loop = _run(tmp_path / "c", {0: ("trainer", [_interval(0, "trainer", 0, None)])})
    for run, says in ((bare, "no stack samples in the run logs, nothing to draw: run dflash-train with "
                             "--stack-samples-per-interval K"),
                      (older, "its 1 intervals' stack_samples predate whole stacks"),
                      (loop, "ProfilerDeps(stack_sampler=profiler.stacks.make_stack_sampler(")):
        code, err = _error(run)
        assert (code, err.count("\n")) == (2, 1) and says in err and "Traceback" not in err, err
    code, err = _error(hand_made(tmp_path / "d"), "--role", "nope")
    assert (code, err) == (2, f"dflash-report: error: {tmp_path / 'd' / 'run'}: no rank has role 'nope' "
                              "(its roles: drafter, target)\n")
    code, err = _error(tmp_path / "missing")
    assert code == 2 and err.count("\n") == 1


def test_the_command_never_imports_torch(tmp_path):
    run = hand_made(tmp_path)
    code = ("import sys; from dflash import report_cli; "
            f"rc = report_cli.main(['stacks', {str(run)!r}, '-o', {str(tmp_path / 'o.json')!r}]); "
            "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', rc)")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.stdout.strip().splitlines()[-1] == "NO-TORCH 0", r.stderr


# ---- the schema check itself -----------------------------------------------------------------------------------

def test_the_vendored_schema_is_speedscopes_and_the_validator_refuses_what_speedscope_would(tmp_path):
    assert SCHEMA["$ref"] == "#/definitions/FileFormat.File"
    assert sorted(SCHEMA["definitions"]["FileFormat.SampledProfile"]["required"]) == [
        "endValue", "name", "samples", "startValue", "type", "unit", "weights"]
    _, text = stacks_cli(hand_made(tmp_path))
    good = json.loads(text)
    breaks = {"unit": lambda d: d["profiles"][0].update(unit="samples"),
              "weights": lambda d: d["profiles"][0]["weights"].__setitem__(0, "2"),
              "type": lambda d: d["profiles"][0].update(type="sample"),
              "frames": lambda d: d["shared"].pop("frames"),
              "name": lambda d: d["shared"]["frames"][0].pop("name"),
              "line": lambda d: d["shared"]["frames"][0].update(line="9"),
              "schema": lambda d: d.update({"$schema": "speedscope"})}
    for what, damage in breaks.items():
        doc = copy.deepcopy(good)
        damage(doc)
        assert validate(doc) != [], what
    for damage in (lambda d: d["profiles"][0]["weights"].pop(), lambda d: d["profiles"][0]["samples"][0].append(999),
                   lambda d: d["profiles"][0].update(endValue=1)):
        doc = copy.deepcopy(good)
        damage(doc)
        assert import_errors(doc) != []
    with pytest.raises(ValueError, match="does not implement"):
        validate({}, {"oneOf": []})


def test_check_keeps_every_invariant_of_a_crafted_run_whose_intervals_carry_whole_stacks(tmp_path):
    run = clean()
    for recs in run["logs"].values():
        for rec in recs:
            if rec.get("type") == "interval":
                rec["stack_samples"] = _stack_samples(MAIN, _thread(f"{rec['role']}.main", 4, 1, [([0, 1, 2], 4, 1)]))
    res = check(write_crafted(tmp_path / "run", run))
    assert [str(v) for v in res.violations] == []


# ---- a real run ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sampled_run(tmp_path_factory, prebuilt) -> Path:
    """A real two-rank CPU run of 8 steps at 1 s intervals, each rank sampling its stacks 4 times an interval."""
    run = prebuilt(tmp_path_factory.mktemp("stacks") / "run")
    proc = subprocess.run([sys.executable, "-m", "dflash.cli", "--run-dir", str(run), "--builtin-conversations", "48",
                           "--max-steps", "8", "--profile-interval", "1", "--eval-prompts", "0", "--device", "cpu",
                           "--metrics-port", "0", "--stack-samples-per-interval", "4"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


def _logged_threads(run: Path) -> tuple[Counter, Counter, list]:
    """({(rank root, thread): samples}, the same of idle samples, every interval's stack_samples view) from the logs."""
    samples, idle, seen = Counter(), Counter(), []
    for path in sorted((run / "profile").glob("rank*.jsonl")):
        for rec in map(views.interval, (r for r in read_records(path)[0] if r["type"] == "interval")):
            ss = rec.stack_samples
            if ss.samples is not None:
                seen.append(ss)
                for t in ss.threads:
                    samples[f"rank{rec.rank} {rec.role}", t.name] += t.samples
                    idle[f"rank{rec.rank} {rec.role}", t.name] += t.idle_samples
    return samples, idle, seen


@pytest.mark.slow
def test_a_real_runs_flame_graphs_count_every_sample_and_read_as_speedscope_says(sampled_run, tmp_path):
    samples, idle, seen = _logged_threads(sampled_run)
    assert sum(ss.samples for ss in seen) >= 8 and samples[("rank0 drafter", "drafter.main")] > 0
    assert [u for ss in seen for u in read_all(ss)] == []       # every field the sampler wrote has a view
    assert report_cli.main(["stacks", str(sampled_run), "--folded", "--profiler-threads",
                            "-o", str(tmp_path / "all.folded")]) == 0
    assert folded_totals((tmp_path / "all.folded").read_text()) == {
        (root, t + (" [profiler]" if t.startswith("profiler.") else "")): n for (root, t), n in samples.items()}
    assert report_cli.main(["stacks", str(sampled_run), "--folded", "--running-only", "-o", str(tmp_path / "r")]) == 0
    running = {k: samples[k] - idle[k] for k in samples if not k[1].startswith("profiler.") and samples[k] > idle[k]}
    assert folded_totals((tmp_path / "r").read_text()) == running
    assert report_cli.main(["stacks", str(sampled_run), "-o", str(tmp_path / "s.json")]) == 0
    doc = json.loads((tmp_path / "s.json").read_text())
    assert validate(doc) == [] and import_errors(doc) == []
    shown = tuple(doc["profiles"][doc["activeProfileIndex"]]["name"].split(" (")[0].split(" / "))
    assert running[shown] == max(running.values())   # the busiest training thread is the one shown first
    assert not any("[profiler]" in p["name"] for p in doc["profiles"])
    assert [str(v) for v in check_run(sampled_run)] == []


@pytest.mark.slow
def test_a_real_runs_whole_stacks_end_in_the_hot_frames_recorded_beside_them(sampled_run):
    """Where an interval kept every stack of a thread and its running leaves fit the top frames, the running
    samples' leaves are exactly the hot frames; the training threads' stacks start at the process's root (nearly
    all: a non-blocking dump may catch a thread with no frames, at its start or end, or mid-change)."""
    _, _, seen = _logged_threads(sampled_run)
    compared, rooted = 0, Counter()
    for ss in seen:
        for t in ss.threads:
            leaves = Counter()
            for s in (s for s in t.stacks if s.frames):
                if s.count > s.idle_samples:
                    leaves[ss.frames[s.frames[-1]]] += s.count - s.idle_samples
                if t.name.endswith(".main"):
                    rooted[ss.frames[s.frames[0]].startswith(("_run_module_as_main ", "<module> "))] += s.count
            if t.other_samples == 0 and len(leaves) <= 5:
                assert leaves == {f.frame: f.count for f in t.top_frames}, (t.raw, ss.frames)
                compared += bool(leaves)
    assert compared > 0 and rooted[True] >= 0.9 * (rooted[True] + rooted[False]) > 0, rooted
