"""The start-up timeline: phases from the launch (or the process start), bad environment ignored."""

from __future__ import annotations

from dflash import startup

S = 10**9


def test_phases_from_the_launch_add_up_in_order():
    tl = startup.StartupTimeline(101 * S, {startup.ENV_LAUNCH_NS: str(100 * S)})
    for phase, t in (("imports", 109), ("preflight", 109), ("device", 111), ("rendezvous", 111.5),
                     ("profiler", 112)):
        tl.mark(phase, int(t * S))
    f = tl.fields()
    assert f["origin"] == "launch" and f["origin_unix_ns"] == 100 * S and f["total_seconds"] == 12.0
    assert f["phases_seconds"] == {"spawn": 1.0, "imports": 8.0, "preflight": 0.0, "device": 2.0,
                                   "rendezvous": 0.5, "profiler": 0.5}
    line = startup.format_line(f)
    assert line.startswith("dflash-train: start-up 12.0 s from launch to the first step: spawn 1.0, imports 8.0")


def test_without_a_launcher_or_with_nonsense_the_origin_is_the_process():
    for env in ({}, {startup.ENV_LAUNCH_NS: "soon"}, {startup.ENV_LAUNCH_NS: "-5"},
                {startup.ENV_LAUNCH_NS: str(200 * S)}):          # a launch after the process: stale, ignored
        tl = startup.StartupTimeline(105 * S, env)
        tl.mark("imports", 107 * S)
        assert tl.fields()["origin"] == "process"
        assert tl.fields()["phases_seconds"] == {"imports": 2.0}


def test_a_wall_clock_step_back_never_gives_a_negative_phase():
    tl = startup.StartupTimeline(105 * S, {startup.ENV_LAUNCH_NS: str(100 * S)})
    tl.mark("imports", 104 * S)                              # the wall clock stepped back
    tl.mark("device", 106 * S)
    assert tl.fields()["phases_seconds"] == {"spawn": 5.0, "imports": 0.0, "device": 1.0}


def test_bytecode_says_where_compiled_modules_are_kept(monkeypatch):
    monkeypatch.setattr("sys.pycache_prefix", "/c/pycache")
    assert startup.StartupTimeline(S, {}).fields()["bytecode"] == "/c/pycache"
    monkeypatch.setattr("sys.pycache_prefix", None)
    monkeypatch.setattr("sys.dont_write_bytecode", True)
    assert startup.bytecode_source() == "not written"
    monkeypatch.setattr("sys.dont_write_bytecode", False)
    assert startup.bytecode_source() == "beside sources"


def test_start_up_ends_as_the_first_step_begins_with_the_model_build_counted(monkeypatch):
    """The model's build and the loop's set-up are phases of start-up (issue 45: an 8B-shaped drafter's build
    was left out, 'start-up 5.7 s' for a first step at launch + 15.1 s): the event comes once, at begin()."""
    clock = iter([112, 120, 121, 130]).__next__
    monkeypatch.setattr(startup.time, "time_ns", lambda: int(clock() * S))
    tl = startup.StartupTimeline(101 * S, {startup.ENV_LAUNCH_NS: str(100 * S)})
    tl.mark("imports", 109 * S)
    tl.mark("profiler")                                              # 112
    said = []
    first = startup.FirstStep(tl, said.append)
    first.mark("model")                                              # 120: 8 s of model build
    first.begin()                                                    # 121: the first step begins
    first.begin()
    first.mark("model")                                              # after the first step: nothing
    (f,) = said
    assert f["total_seconds"] == 21.0
    assert f["phases_seconds"] == {"spawn": 1.0, "imports": 8.0, "profiler": 3.0, "model": 8.0,
                                   startup.LOOP_PHASE: 1.0}
    assert sum(f["phases_seconds"].values()) == f["total_seconds"]
    assert "start-up 21.0 s from launch to the first step" in startup.format_line(f)
    startup.NoFirstStep().mark("model")
    startup.NoFirstStep().begin()
