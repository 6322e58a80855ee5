"""dflash/advice.py: every flag, key and variable its findings name is derived from TrainConfig's field (a renamed
field fails at import, not in a sentence) and is one dflash-train accepts; no advice points at a file the package
does not ship; the pipeline's advice keeps the report's rules and adds its own after the straggler's, and leaves a
loop of its own to the report's generic advice."""
from __future__ import annotations

from pathlib import Path

import pytest

from dflash import advice, pipeline
from dflash.cli import build_parser
from dflash.config import TrainConfig
from profiler.report.findings import RULES, Advice, straggler

REPO = Path(__file__).resolve().parents[2]


def test_flags_keys_and_variables_come_from_the_config_fields():
    assert advice.flag("parallel.max_in_flight") == "--max-in-flight"
    assert advice.flag("profile.interval_s") == "--profile-interval"   # a field whose flag key is its own
    assert advice.key("profile.interval_s") == "profile_interval"
    assert advice.flag("parallel.split_fc_layers", off=True) == "--no-split-fc-layers"
    assert advice.flag("run_dir") == "--run-dir"
    assert advice.env_var("parallel.split_fc_layers") == "DFLASH_SPLIT_FC_LAYERS"
    assert advice.env_var("reliability.fault") == "DFLASH_FAULT"
    with pytest.raises(KeyError):
        advice.flag("parallel.max_inflight")   # a renamed field: the advice's import fails
    with pytest.raises(TypeError):
        advice.flag("parallel.max_in_flight", off=True)


def test_every_flag_the_advice_names_is_one_dflash_train_accepts():
    known = set(build_parser()._option_string_actions)
    named = {v for v in vars(advice).values() if isinstance(v, str) and v.startswith("--")}
    assert {"--transfer", "--tokens-per-batch", "--memory-history", "--resume", "--no-split-fc-layers"} <= named
    assert named <= known, named - known
    assert set(advice.KEYS.values()) <= set(TrainConfig().flat_dict())   # the run_start config keys it reads


def test_no_advice_points_at_a_file_the_package_does_not_ship():
    for module in ("dflash/advice.py", "profiler/report/findings.py", "profiler/report/advice.py"):
        assert "bench/" not in (REPO / module).read_text(), module


def test_the_pipelines_rules_are_the_reports_with_its_own_after_the_straggler():
    rules = advice.PipelineAdvice.rules
    assert [r for r in rules if r not in (advice.slot_waits, advice.split)] == list(RULES)
    at = rules.index(straggler)
    assert rules[at + 1:at + 3] == (advice.slot_waits, advice.split)
    assert type(advice.ADVICE.for_report({"pipeline": False})) is Advice
    assert advice.ADVICE.for_report({"pipeline": True}) is advice.ADVICE


def test_spans_the_advice_names_are_rows_of_the_pipeline():
    assert advice.SEND == "transfer.send" and advice.PACK == "target.pack_hidden"
    assert advice.HOST_COPIES == ("d2h_copy", "h2d_copy")
    assert "drafter.compile" in advice.ADVICE.stall_hint and "triton.autotune" in advice.ADVICE.stall_hint
    with pytest.raises(KeyError):
        pipeline.name("drafter.fwd")
