"""How a CPU run shares the host's cores between its ranks."""

from __future__ import annotations

from dflash.launch import threads_env
from dflash.topology import Topology, cpu_threads


def test_a_drafter_takes_a_share_of_all_cores_only_when_waiting_threads_sleep():
    one_each, two_one = Topology(1, 1), Topology(num_targets=2, num_drafters=1)
    assert [cpu_threads(one_each, r, 2, True) for r in (0, 1)] == [2, 1]
    assert [cpu_threads(one_each, r, 2, False) for r in (0, 1)] == [1, 1]   # spinning: an even share
    assert [cpu_threads(two_one, r, 16, True) for r in (0, 1, 2)] == [16, 5, 5]
    assert [cpu_threads(Topology(2, 2), r, 16, True) for r in range(4)] == [8, 8, 4, 4]
    assert [cpu_threads(Topology(3, 2), r, 1, True) for r in range(5)] == [1] * 5   # never below one


def test_the_launcher_asks_cpu_ranks_to_wait_asleep_and_keeps_what_the_user_set():
    assert threads_env(0, {}) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert threads_env(0, {"OMP_WAIT_POLICY": "ACTIVE"}) == {}
    assert threads_env(4, {}) == {}   # a GPU run's CPU threads are left as they were
