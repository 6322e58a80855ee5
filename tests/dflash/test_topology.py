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


def test_a_cpu_runs_preflight_leaves_torch_and_the_trainer_to_the_ranks(tmp_path):
    """The launcher's preflight runs beside the ranks' imports: for --device cpu it imports neither torch
    nor the trainer, and still refuses what it must (the rank split here)."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from dflash import launch, preflight\n"
            "from dflash.config import ConfigError, resolve_config\n"
            f"cfg = resolve_config({{}}, {{}}, {{'device': 'cpu', 'run_dir': {str(tmp_path / 'run')!r}}})\n"
            "gpus = preflight.torch_gpus(cfg)\n"
            "preflight.check(cfg, launch.world_for(cfg, gpus), 2, gpus=gpus)\n"
            "try:\n"
            "    preflight.check(resolve_config({}, {}, {'device': 'cpu', 'drafter_gpus': 2}), 3, 3, gpus=0)\n"
            "except ConfigError as e:\n"
            "    print(e)\n"
            "print(gpus, sorted(m for m in ('torch', 'transformers', 'dflash.worker') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "--drafter-gpus: 2 drafters but only 1 targets; every drafter needs at least one target feeding it", "0 []"]
