"""An interval's `step_rate` (issue 37): how far the loop's set_step advanced the step in it, so any loop that
calls set_step gets steps/s; absent before the first set_step, null when the step went backwards."""
import pytest

from tests.profiler.build import make_profiler


def test_step_rate_counts_set_step_advances_per_interval(tmp_path):
    with make_profiler(tmp_path / "run", background=False, measure_floors=False, control=False) as prof:
        assert "step_rate" not in prof.close_interval()          # no set_step yet: nothing to count
        prof.set_step(5)
        prof.set_step(9)
        first = prof.close_interval()                            # from the first set_step (5) to 9
        assert first["step_rate"]["steps"] == 4
        assert first["step_rate"]["per_second"] == pytest.approx(4 / first["duration_seconds"])
        prof.set_step(12)
        assert prof.close_interval()["step_rate"]["steps"] == 3  # from where the last interval left off
        assert prof.close_interval()["step_rate"] == {"steps": 0, "per_second": 0.0}
        prof.set_step(2)                                         # a loop that restarts its count
        assert prof.close_interval()["step_rate"] == {"steps": None, "per_second": None}
        prof.set_step(6)
        assert prof.close_interval()["step_rate"]["steps"] == 4
