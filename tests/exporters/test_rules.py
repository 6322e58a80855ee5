"""The generated rule files, checked statically: the committed files are the generator's output (and `--check`
says when not), promtool accepts them at the shipped and a test time scale, and a port of the monitoring-mixins
lint rules holds (mixtool lint: alert names, severity, summary and description style, runbook links that
exist; recording rule names `level:metric:operations`; every series known). The Prometheus config loads them
and sends alerts to the compose file's Alertmanager, whose config amtool accepts."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import promql_parser
import pytest
import yaml

from dflash import grafana
from dflash.pipeline import wait_spans
from exporters import dashboard as dash
from exporters import rules
from exporters.catalog import FAMILIES, PROCESS_FAMILIES
from tests.exporters.grafana_model import panel_queries, substitute_variables

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "grafana"
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
WAITS = wait_spans()


def loaded(path: Path) -> list[dict]:
    (group,) = yaml.safe_load(path.read_text())["groups"]
    return group["rules"]


RULES = loaded(GRAFANA / "dflash.rules.yml")
ALERTS = [r for r in RULES if "alert" in r]
RECORDS = [r for r in RULES if "record" in r]


def promtool(*args: str) -> subprocess.CompletedProcess:
    tool = shutil.which("promtool")
    if tool is None:
        pytest.skip("promtool is not installed (Debian package prometheus)")
    return subprocess.run([tool, *args], capture_output=True, text=True, timeout=60)


def test_committed_file_is_the_generators_output_records_first(tmp_path):
    assert rules.DEFAULT_OUT == GRAFANA / "dflash.rules.yml"
    assert grafana.main(["rules", "--check", "--out", str(rules.DEFAULT_OUT)]) == 0, "run: python -m dflash.grafana"
    out = tmp_path / "r.yml"
    assert grafana.main(["rules", "--out", str(out)]) == 0 and out.read_text() == rules.DEFAULT_OUT.read_text()
    out.write_text(rules.DEFAULT_OUT.read_text().replace("for: 2m", "for: 3m", 1))
    assert grafana.main(["rules", "--check", "--out", str(out)]) == 1
    assert grafana.main(["rules", "--check", "--out", str(tmp_path / "missing.yml")]) == 1
    # one group, every recording rule before the first alert: each alert reads its evaluation's recordings
    kinds = ["record" if "record" in r else "alert" for r in RULES]
    assert kinds == sorted(kinds, reverse=True) and kinds.count("record") == len(RECORDS) > 0


def test_the_module_runs_as_a_script_with_check(tmp_path):
    import os
    import sys

    done = subprocess.run([sys.executable, "-m", "dflash.grafana", "--check"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 0 and done.stdout.count("up to date") == 2, done.stderr


@pytest.mark.parametrize("factor", [1.0, 1 / 60])
def test_promtool_accepts_the_rules_at_the_shipped_and_a_test_time_scale(tmp_path, factor):
    out = tmp_path / "r.yml"
    assert grafana.main(["rules", "--out", str(out), "--time-scale", str(factor)]) == 0
    done = promtool("check", "rules", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(RULES)} rules found" in done.stdout


def test_the_time_scale_changes_durations_only():
    (scaled,), (shipped,) = (rules.rule_groups(rules.Scale(1 / 60), WAITS)["groups"],
                             rules.rule_groups(rules.Scale(), WAITS)["groups"])
    durations = re.compile(r"\[[0-9a-z]+\]|offset [0-9a-z]+|\b\d+(\.\d+)?\b")
    for s, r in zip(scaled["rules"], shipped["rules"]):
        assert durations.sub("D", s["expr"]) == durations.sub("D", r["expr"]), s
        assert s.get("annotations") == r.get("annotations") and s.get("labels") == r.get("labels")
    s_alerts = {"rules": [r for r in scaled["rules"] if "alert" in r]}
    assert rules.Scale(1 / 60)(600) == "10s" and rules.Scale()(3600) == "1h" and rules.Scale(0.5)(1) == "500ms"
    assert rules.Scale(1 / 60).number(300) == "5"
    with pytest.raises(ValueError, match="rounds to nothing"):
        rules.Scale(1e-6)(60)
    assert "[10s]" in s_alerts["rules"][3]["expr"] and s_alerts["rules"][1]["for"] == "2s"
    # except where a lag outside the rules sets a floor: RankDown waits out Prometheus's discovery at any scale
    assert s_alerts["rules"][0]["alert"] == "DFlashRankDown" and s_alerts["rules"][0]["for"] == "10s"
    assert [r["for"] for r in shipped["rules"] if r.get("alert") == "DFlashRankDown"] == ["2m"]


# ---- monitoring-mixins lint (mixtool lint's rules, ported) -----------------------------------------------------
def test_alert_names_are_camel_case_with_one_prefix_and_unique():
    names = [a["alert"] for a in ALERTS]
    assert len(names) == len(set(names))
    assert all(re.fullmatch(r"DFlash[A-Z][A-Za-z0-9]*", n) for n in names), names


def test_alerts_have_for_severity_and_only_known_labels():
    for a in ALERTS:
        assert re.fullmatch(r"[1-9][0-9]*[smh]", a["for"]), a["alert"]
        assert a["labels"] == {"severity": a["labels"]["severity"]} and a["labels"]["severity"] in rules.SEVERITIES
    assert {a["labels"]["severity"] for a in ALERTS} == set(rules.SEVERITIES)


def test_summary_is_a_static_sentence_and_description_a_templated_one_naming_run_and_rank():
    for a in ALERTS:
        notes = a["annotations"]
        assert set(notes) == {"summary", "description", "runbook_url"}, a["alert"]
        summary, description = notes["summary"], notes["description"]
        assert "{{" not in summary and summary[0].isupper() and summary.endswith("."), summary
        assert description[0].isupper() and description.endswith("."), description
        assert "{{ $labels.run }}" in description and "$labels.rank }}" in description, a["alert"]
        assert description.count("{{") == description.count("}}")


def _slugs(markdown: str) -> list[str]:
    """GitHub's anchors of a Markdown file's headings."""
    return [re.sub(r"[^a-z0-9 _-]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#{1,6} (.+)$", markdown, flags=re.M)]


def test_every_runbook_url_points_at_a_section_of_docs_runbook_and_every_section_at_an_alert():
    runbook = ROOT / rules.RUNBOOK
    slugs = _slugs(runbook.read_text())
    sections = {s for s in slugs if s.startswith("dflash")}
    for a in ALERTS:
        path, _, fragment = a["annotations"]["runbook_url"].partition("#")
        assert path == rules.RUNBOOK and fragment in slugs, a["alert"]
    assert sections == {a["alert"].lower() for a in ALERTS}
    # each section says what the alert means and what to run
    text = runbook.read_text()
    for a in ALERTS:
        body = text.split(f"## {a['alert']}\n", 1)[1].split("\n## ", 1)[0]
        assert "**Means:**" in body and "**Run:**" in body, a["alert"]


def test_recording_rule_names_are_level_metric_operations_and_their_level_is_what_they_keep():
    for r in RECORDS:
        match = re.fullmatch(r"([a-z]+(?:_[a-z]+)*):(dflash_[a-z0-9_]+):([a-z0-9_]+)", r["record"])
        assert match, r["record"]
        level = set(match.group(1).split("_"))
        kept = set()
        for node in _selectors_and_aggregations(r["expr"]):
            if isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
                kept.add(frozenset(node.modifier.labels))
        assert kept <= {frozenset(level)}, (r["record"], kept)
        assert r["record"].split(":")[2].startswith(("rate", "ratio_rate")), r["record"]


def _selectors_and_aggregations(expr: str) -> list:
    out = []
    promql_parser.walk(promql_parser.parse(expr), lambda n: out.append(n), lambda n: None)
    return out


def _names(expr: str) -> set[str]:
    return {n.name for n in _selectors_and_aggregations(expr) if isinstance(n, promql_parser.VectorSelector)}


def test_every_series_a_rule_reads_exists():
    recorded = {r["record"] for r in RECORDS}
    known = {f.name for f in (*FAMILIES.values(), *PROCESS_FAMILIES.values())}
    known |= {f.name + s for f in FAMILIES.values() if f.kind == "histogram" for s in HISTOGRAM_SUFFIXES}
    for rule in (*RECORDS, *ALERTS):
        unknown = _names(rule["expr"]) - known - recorded - {"up"}
        assert not unknown, (rule.get("alert") or rule.get("record"), unknown)
        for node in _selectors_and_aggregations(rule["expr"]):
            if isinstance(node, promql_parser.VectorSelector) and node.name != "up":
                assert ("job", "dflash") in {(m.name, m.value) for m in node.matchers.matchers} or \
                    node.name in recorded, rule


def test_every_recording_rule_is_used_by_an_alert_the_dashboard_or_another_rule():
    used = set().union(*(_names(a["expr"]) for a in ALERTS), *(_names(r["expr"]) for r in RECORDS))
    model = dash.build_dashboard(WAITS)
    values = {v["name"]: "x" for v in model["templating"]["list"]} | {"rate_interval": "1m", "interval": "1m",
                                                                       "range": "1m"}
    used |= set().union(*(_names(substitute_variables(e, values)) for *_, e in panel_queries(model)))
    assert {r["record"] for r in RECORDS} <= used


# ---- where the rules are loaded: Prometheus config, compose, Alertmanager ---------------------------------------
def test_prometheus_loads_both_rule_files_and_alerts_the_compose_alertmanager():
    prom = yaml.safe_load((GRAFANA / "prometheus.yml").read_text())
    assert prom["rule_files"] == ["dflash.rules.yml"]
    (manager,) = prom["alerting"]["alertmanagers"]
    assert manager["static_configs"] == [{"targets": ["127.0.0.1:9093"]}]
    done = promtool("check", "config", str(GRAFANA / "prometheus.yml"))
    assert done.returncode == 0 and "SUCCESS: 1 rule files found" in done.stdout, done.stdout + done.stderr

    services = yaml.safe_load((GRAFANA / "compose.yaml").read_text())["services"]
    volumes = services["prometheus"]["volumes"]
    for name in prom["rule_files"]:
        assert f"./{name}:/etc/prometheus/{name}:ro" in volumes   # beside the config, which names them relatively
    am = services["alertmanager"]
    assert am["image"].startswith("prom/alertmanager:") and am["network_mode"] == "host"
    assert "--web.listen-address=127.0.0.1:9093" in am["command"]
    assert "--cluster.listen-address=" in am["command"]   # no gossip listener on 0.0.0.0:9094
    assert "./alertmanager.yml:/etc/alertmanager/alertmanager.yml:ro" in am["volumes"]


def test_amtool_accepts_the_alertmanager_config():
    amtool = shutil.which("amtool")
    if amtool is None:
        pytest.skip("amtool is not installed (Debian package prometheus-alertmanager)")
    done = subprocess.run([amtool, "check-config", str(GRAFANA / "alertmanager.yml")], capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 0 and "SUCCESS" in done.stdout, done.stdout + done.stderr
