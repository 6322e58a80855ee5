"""The Weights & Biases sink (exporters/wandb_run.py), offline, read back with wandb's own reader of the run's
`.wandb` transaction log (`wandb leet inspect --json`: wandb 0.31 has no Python reader of it any more): each rank's
run is named `rank{R}-{role}` in the run id's group, its history rows are the fold's scalar samples under
TensorBoard's tags at the records' steps; steps that go back are logged at the highest step so far; the mode
falls back to offline where no credentials are configured; a missing library is one ValueError naming it."""
from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("wandb")

import exporters  # noqa: E402
from exporters.fold import Buckets, Fold  # noqa: E402
from exporters.tensorboard import NOT_SCALARS, tag  # noqa: E402
from exporters.wandb_run import STEP_KEY, WandbExporter, init_mode  # noqa: E402
from tests.exporters.test_fold import T0, stream  # noqa: E402

WANDB_KEYS = ("_step", "_runtime", "_timestamp", STEP_KEY)
"""History keys that are not fold samples: wandb's own, and the step the exporter repeats as the x-axis."""


def _drafter_records() -> list:
    """test_fold's stream (every folded family, at step 10), then two more ticks and intervals (steps 18, 20,
    28, 30; the last one's loss non-finite) and the run's end."""
    start, interval, tick, *events, end = stream()
    out = [start, interval, tick, *events]
    for k in (1, 2):
        t = copy.deepcopy(tick)
        t.update(time_unix=T0 + 60 * k + 50, step=10 * k + 8,
                 counters={"tokens": 40960 * (k + 1), "samples": 40 * (k + 1), "steps": 10 * k + 8})
        i = copy.deepcopy(interval)
        i.update(time_unix=T0 + 60 * (k + 1), step=10 * (k + 1))
        i["counters"]["tokens"]["per_second"] = 682.5 + k
        i["metrics"]["loss"] = {"last": 2.5 - k / 10, "mean": None if k == 2 else 2.75 - k / 10}
        out += [t, i]
    return out + [{**end, "time_unix": T0 + 200, "step": 30}]


def _target_records_going_back() -> list:
    """A rank whose second segment starts over at an earlier step (15 after 20), then goes past it (25)."""
    head = {"rank": 0, "role": "target"}
    start = {**head, "type": "run_start", "time_unix": T0, "schema": 1, "t_s": 0.0}

    def interval(step: int, rate: float) -> dict:
        return {**head, "type": "interval", "time_unix": T0 + step, "step": step, "duration_seconds": 5.0,
                "counters": {"tokens": {"total": 100, "per_second": rate, "run_total": 100 * step}}}
    return [start, interval(10, 1.0), interval(20, 2.0), {**start, "time_unix": T0 + 21}, interval(15, 3.0),
            interval(25, 4.0), {**head, "type": "run_end", "time_unix": T0 + 30, "status": "ok", "step": 25}]


def _read(roots: list) -> list:
    """The one run under each exporter's RUN_DIR/wandb, as wandb's reader gives its records (the readers run at
    once): {"run": the run record, "history": [(step, {key: value})], "config": {...}, "summary": {...}} (config
    and summary: every update merged, wandb.init's config first)."""
    logs = [list(root.glob("offline-run-*/run-*.wandb")) for root in roots]
    assert all(len(found) == 1 for found in logs), logs
    readers = [subprocess.Popen([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(found[0])],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for found in logs]
    return [_records_read(reader.communicate(timeout=60), reader.returncode) for reader in readers]


def _records_read(said: tuple, returncode: int) -> dict:
    out, err = said
    assert returncode == 0, err
    got = {"run": None, "history": [], "config": {}, "summary": {}}
    for line in out.splitlines():
        record = json.loads(line)
        kind, body = record["type"], record.get(record["type"], {})
        if kind == "run":
            got["run"] = body
            got["config"].update(body.get("config", {}).get("update", {}))
        elif kind == "history":
            got["history"].append((body["step"]["num"], body["item"]))
        elif kind in ("config", "summary"):
            got[kind].update(body.get("update", {}))
    return got


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """Two ranks' exporters open at once in this process (one made by exporters.build), offline, fed their
    records interleaved and closed; {rank: (its records, its run read back)}."""
    import wandb

    tmp = tmp_path_factory.mktemp("wandb")
    feeds = {1: _drafter_records(), 0: _target_records_going_back()}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_ERROR_REPORTING", "false")   # and no crash reports: nothing leaves the machine
        mp.delenv("WANDB_API_KEY", raising=False)
        for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
            mp.setenv(name, str(tmp / name.lower()))
        owner = exporters.Owner(tmp / "rank0", 0, "target", "run-7")   # rank 0's made as dflash-train makes it
        sinks = {1: WandbExporter(tmp / "rank1", 1, "drafter", "run-7"), 0: exporters.build("wandb")(owner)[0]}
        for k in range(max(map(len, feeds.values()))):
            for rank, records in feeds.items():
                if k < len(records):
                    sinks[rank].export(records[k])
        for sink in sinks.values():
            sink.close(30.0)
        wandb.teardown()   # the service process ends here, and the next wandb.init reads the environment anew
        runs = _read([tmp / f"rank{rank}" / "wandb" for rank in feeds])
    return {rank: (records, run) for (rank, records), run in zip(feeds.items(), runs)}


def _fold_rows(records) -> dict:
    """{record step: {tag: value}}: the scalar samples the fold gives each record, at the last step a tick or
    interval named (a step's last value of a tag wins, as in one W&B history row)."""
    fold, rows, step = Fold(), {}, 0
    for rec in records:
        step = rec.get("step", step) if rec["type"] in ("tick", "interval") else step
        for s in fold(rec):
            if s.family.key not in NOT_SCALARS and s.value is not None and not isinstance(s.value, Buckets):
                rows.setdefault(step, {})[tag(s)] = float(s.value)   # (no infinity among these records)
    return rows


def _same(got, want) -> bool:
    if isinstance(want, float) and math.isnan(want):
        return got == "NaN"   # JSON has no NaN: wandb writes it as the string
    return got == pytest.approx(want, rel=1e-9)


def test_each_row_is_one_steps_fold_samples_under_tensorboards_tags(logged):
    records, run = logged[1]
    want = _fold_rows(records)
    assert [step for step, _ in run["history"]] == sorted(want) == [10, 18, 20, 28, 30]
    for step, item in run["history"]:
        assert item["_step"] == item[STEP_KEY] == step
        values = {k: v for k, v in item.items() if k not in WANDB_KEYS}
        assert set(values) == set(want[step]), step
        wrong = {k: (values[k], w) for k, w in want[step].items() if not _same(values[k], w)}
        assert not wrong, (step, wrong)
    rows = dict(run["history"])
    assert rows[20]["interval/tokens_rate"] == 683.5 and rows[28]["run/tokens"] == 122880
    assert rows[10]["interval/span_share/drafter.fwd_bwd"] == 0.4 and rows[10]["run/events/nonfinite"] == 1
    assert rows[20]["interval/train_loss"] == pytest.approx(2.65) and rows[30]["interval/train_loss"] == "NaN"


def test_the_run_is_named_by_rank_and_role_in_the_run_ids_group_with_its_build_and_end(logged):
    for rank, role in ((1, "drafter"), (0, "target")):
        run = logged[rank][1]["run"]
        assert (run["display_name"], run["run_group"], run["job_type"]) == (f"rank{rank}-{role}", "run-7", role)
        assert run["project"] == "dflash"
        config, summary = logged[rank][1]["config"], logged[rank][1]["summary"]
        assert {k: config[k] for k in ("rank", "role", "run_id")} == {"rank": rank, "role": role, "run_id": "run-7"}
        assert config["build"]["schema"] == 1
        assert (summary["run_end/status"], summary["run_end/step"]) == ("ok", 30 if rank == 1 else 25)
    assert logged[1][1]["config"]["build"]["version"] == "0.1"


def test_a_step_that_goes_back_is_logged_at_the_highest_step_so_far(logged):
    """Rank 0 logs steps 10, 20, then 15 (a segment starting over): W&B keeps its history going forward, and the
    row of step 20 ends with the later record's values; step 25 is a row of its own."""
    run = logged[0][1]
    assert [step for step, _ in run["history"]] == [10, 20, 25]
    rows = dict(run["history"])
    assert [rows[s]["interval/tokens_rate"] for s in (10, 20, 25)] == [1.0, 3.0, 4.0]
    assert [rows[s]["interval/step"] for s in (10, 20, 25)] == [10, 15, 25]   # the record's own step, as a gauge
    assert [rows[s][STEP_KEY] for s in (10, 20, 25)] == [10, 20, 25]


def _netrc(tmp_path: Path, host: str) -> Path:
    path = tmp_path / "netrc"
    path.write_text(f"machine {host}\n  login user\n  password {'k' * 40}\n")
    path.chmod(0o600)
    return path


def test_the_mode_is_offline_unless_wandb_mode_or_credentials_say_otherwise(tmp_path):
    bare = {"NETRC": str(tmp_path / "absent")}
    assert init_mode(bare) == "offline"
    assert init_mode({**bare, "WANDB_MODE": "online"}) is None          # wandb reads it itself
    assert init_mode({**bare, "WANDB_API_KEY": "x" * 40}) is None
    assert init_mode({"NETRC": str(_netrc(tmp_path, "api.wandb.ai"))}) is None
    other = {"NETRC": str(_netrc(tmp_path, "api.wandb.ai")), "WANDB_BASE_URL": "https://wandb.example.com"}
    assert init_mode(other) == "offline"                                 # a key for another server


def test_a_missing_library_is_a_valueerror_naming_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)   # as where it is not installed: find_spec says None
    with pytest.raises(ValueError, match="pip install wandb"):
        exporters.build("wandb")


def test_dflash_train_refuses_sinks_wandb_without_the_library(tmp_path, train_main, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    r = train_main(["--run-dir", tmp_path / "run", "--sinks", "wandb", "--device", "cpu"])
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "pip install wandb" in lines[0], r.stderr
    assert not (tmp_path / "run").exists()
