"""profiler/overhead.py's phase logic against a scripted run: rates from the run's own step times, ABBA
order, a run that ends after two pairs keeps them, one that ends sooner is an error, and every exit
resumes (the real run and socket: tests/integration/test_overhead_e2e.py)."""
import pytest

from profiler.overhead import SUMMARY_FIELDS, OverheadError, brief, format_result, measure


class ScriptedRun:
    """Rank 0 steps at `rates[arm]` steps/s on a fake clock that `sleep` advances; ends at `end_s`."""

    def __init__(self, rates, end_s=1e9):
        self.rates, self.end_s = rates, end_s
        self.now, self.step, self.t_step = 0.0, 0, 0.0
        self.arm, self.calls, self.part = "on", [], "all"

    def sleep(self, seconds):
        while self.t_step + 1 / self.rates[self.arm] <= self.now + seconds:
            self.t_step += 1 / self.rates[self.arm]
            self.step += 1
        self.now += seconds

    def check(self):
        self.calls.append("check")

    def switch(self, arm):
        self.arm = arm
        self.calls.append(arm)

    def progress(self):
        if self.now > self.end_s:
            raise OverheadError("rank 0 (pid 1): progress: control endpoint gone")
        return self.step, 1000.0 + self.t_step

    def resume_all(self):
        self.calls.append("resume_all")
        return []

    def note(self, summary):
        self.calls.append(("note", summary["pairs"], summary["mean_diff_pct"]))
        return None if self.now <= self.end_s else "rank 0 (pid 1): overhead_result: control endpoint gone"


def test_rates_come_from_the_runs_step_times_in_abba_order():
    run = ScriptedRun({"on": 9.9, "off": 10.0})
    result = measure(run, pairs=4, settle_s=0.5, measure_s=3.0, sleep=run.sleep)
    assert [p["arm"] for p in result["phases"]] == ["on", "off", "off", "on", "on", "off", "off", "on"]
    assert result["on"]["mean"] == pytest.approx(9.9) and result["off"]["mean"] == pytest.approx(10.0)
    assert result["paired"]["mean_diff_pct"] == pytest.approx(-1.0, abs=1e-9)
    assert run.calls[0] == "check" and run.calls[-2] == "resume_all" and result["stopped"] is None
    assert run.calls[-1] == ("note", 4, result["paired"]["mean_diff_pct"]) and result["recorded"] is True
    assert tuple(brief(result)) == SUMMARY_FIELDS   # what the endpoint keeps is what the client sends
    text = format_result({**result, "run_dir": "/r", "ranks": 2})
    assert "on vs off: -1.00%" in text and "4 on/off pairs of 3 s phases" in text


def test_a_run_ending_after_two_pairs_keeps_the_whole_pairs():
    run = ScriptedRun({"on": 5.0, "off": 5.0}, end_s=18.0)   # 3.5 s per phase: ends in pair 3's first phase
    result = measure(run, pairs=10, settle_s=0.5, measure_s=3.0, sleep=run.sleep)
    assert result["pairs"] == 2 and len(result["phases"]) == 4 and "control endpoint gone" in result["stopped"]
    assert run.calls[-2] == "resume_all" and result["recorded"] is False
    assert "not recorded in rank 0's run log: rank 0 (pid 1): overhead_result: control endpoint gone" in \
        format_result({**result, "run_dir": "/r", "ranks": 2})


def test_a_run_ending_before_two_pairs_is_an_error_and_still_resumes():
    run = ScriptedRun({"on": 5.0, "off": 5.0}, end_s=8.0)
    with pytest.raises(OverheadError, match="control endpoint gone") as info:
        measure(run, pairs=10, settle_s=0.5, measure_s=3.0, sleep=run.sleep)
    assert info.value.started and run.calls[-1] == "resume_all"


def test_a_time_budget_begins_no_pair_that_would_end_past_it():
    run = ScriptedRun({"on": 5.0, "off": 5.0})   # 7 s a pair on the scripted clock
    result = measure(run, pairs=10, settle_s=0.5, measure_s=3.0, sleep=run.sleep, clock=lambda: run.now, max_s=30)
    assert result["pairs"] == 4 and result["stopped"] == "time budget of 30 s reached after 4 pairs"
    assert run.now <= 30 and run.calls[-2] == "resume_all" and result["recorded"] is True
    short = ScriptedRun({"on": 5.0, "off": 5.0})   # two pairs run whatever the budget (the CLI refuses less)
    assert measure(short, pairs=10, settle_s=0.5, measure_s=3.0, sleep=short.sleep, clock=lambda: short.now,
                   max_s=1)["pairs"] == 2


def test_a_stop_request_ends_after_the_phase_with_the_whole_pairs_or_none():
    for phases_before_stop, pairs in ((5, 2), (3, None)):
        run = ScriptedRun({"on": 5.0, "off": 5.0})
        done = []

        def stop():
            return "stopped by SIGTERM" if len(done) >= phases_before_stop else None

        if pairs is None:   # fewer than two whole pairs: an error, the ranks resumed
            with pytest.raises(OverheadError, match="^stopped by SIGTERM$") as info:
                measure(run, 10, 0.5, 3.0, sleep=run.sleep, on_phase=lambda i, p: done.append(p), stop_requested=stop)
            assert info.value.started and run.calls[-1] == "resume_all"
            continue
        result = measure(run, 10, 0.5, 3.0, sleep=run.sleep, on_phase=lambda i, p: done.append(p), stop_requested=stop)
        assert len(done) == 5 and result["pairs"] == 2 and result["stopped"] == "stopped by SIGTERM"


def test_a_phase_with_too_few_steps_says_so():
    run = ScriptedRun({"on": 0.5, "off": 0.5})
    with pytest.raises(OverheadError, match=r"an on phase of 3 s saw 1 steps of rank 0 \(fewer than 3\)"):
        measure(run, pairs=2, settle_s=0.5, measure_s=3.0, sleep=run.sleep)
    assert run.calls[-1] == "resume_all"


@pytest.mark.parametrize("argv,says", [
    (["--pairs", "1"], "--pairs: expected a whole number of pairs from 2 to 10000, got '1'"),
    (["--phase-s", "nan"], "--phase-s: expected seconds in [0.05, 600], got 'nan'"),
    (["--settle-s", "-1"], "--settle-s: expected seconds in [0, 600], got '-1'"),
    (["--max-s", "0"], "--max-s: expected seconds in [1, 86400], got '0'")])
def test_bad_numbers_are_refused_before_any_phase(capsys, argv, says):
    from dflash import profile_cli

    with pytest.raises(SystemExit) as info:
        profile_cli.main(["overhead", "--pid", "1", *argv])
    assert info.value.code == 2 and says in capsys.readouterr().err


def test_a_background_part_with_long_phases_is_refused_before_any_phase(capsys):
    from dflash import profile_cli

    assert profile_cli.main(["overhead", "--pid", "1", "--part", "background", "--phase-s", "30"]) == 2
    assert capsys.readouterr().err == (
        "dflash-profile: error: --phase-s 30 and --settle-s 1 need a pause of 72 s, more than a pause of part "
        "'background' may last (60 s: 2 x (phase + settle) + 10 must be at most that)\n")


def test_a_budget_shorter_than_two_pairs_is_refused_before_any_phase(capsys):
    from dflash import profile_cli

    assert profile_cli.main(["overhead", "--pid", "1", "--max-s", "10"]) == 2
    assert capsys.readouterr().err == ("dflash-profile: error: --max-s 10 is shorter than the two pairs a result "
                                       "needs (4 x (phase + settle) = 16 s)\n")


def test_bad_out_and_missing_pid_are_one_line_exit_2(capsys, tmp_path):
    from dflash import profile_cli

    assert profile_cli.main(["overhead", "--pid", "1", "--out", str(tmp_path / "no" / "o.json")]) == 2
    assert capsys.readouterr().err == f"dflash-profile: error: --out {tmp_path / 'no' / 'o.json'}: cannot write in " \
                                      f"{tmp_path / 'no'}\n"
    assert profile_cli.main(["overhead", "--pid", "999999999"]) == 2
    assert capsys.readouterr().err == "dflash-profile: error: no such pid 999999999\n"
