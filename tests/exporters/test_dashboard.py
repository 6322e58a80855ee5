"""The generated Grafana dashboard, checked statically: the committed JSON is the generator's output,
every query is valid PromQL over catalog metrics, rules ported from grafana/dashboard-linter hold, the
layout is sound, and the provisioning, compose and Prometheus files agree with each other."""
import json
import re
import shutil
import subprocess
from datetime import timedelta
from pathlib import Path

import promql_parser
import pytest
import yaml

from dflash import grafana
from dflash.pipeline import wait_spans
from exporters import dashboard as dash
from exporters import rules
from exporters.catalog import COMMON_LABELS, FAMILIES, PROCESS_FAMILIES, Family
from tests.exporters.grafana_model import iter_panels, panel_queries, substitute_variables

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "grafana"
# Sample durations for Grafana's globals, as dashboard-linter does: odd enough that no literal matches
# (a tenth of the linter's: promql_parser overflows at 2**32 ms).
RATE_INTERVAL = "886999078ms"
GLOBALS = {"rate_interval": RATE_INTERVAL, "interval": "486785661ms", "range": "606977074ms"}
TARGET_LABELS = ("job", "instance", "run")          # added by Prometheus and the file_sd targets
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
RATE_FUNCTIONS = {"rate", "irate", "increase"}
# Units from dashboard-linter's panel-units rule (grafana-data valueFormats), the ones a metric here can have.
VALID_UNITS = {"none", "short", "percent", "percentunit", "sci", "bytes", "decbytes", "Bps", "binBps",
               "bps", "watt", "celsius", "hertz", "ns", "µs", "ms", "s", "m", "h", "d", "ops", "bool",
               "dateTimeAsIso", "flops"}   # flops: grafana-data's FLOP/s (FLOPS_FLOPS)
VARIABLES = {"datasource", "job", "instance", "run", "role", "rank", "gpu", "clock"}


@pytest.fixture(scope="module")
def model():
    return dash.build_dashboard(wait_spans())


def sentinels(model) -> dict:
    """A distinctive value per template variable, plus the linter's sample durations for globals."""
    values = {v["name"]: f"sentinel_{v['name']}" for v in model["templating"]["list"]}
    return {**values, **GLOBALS}


def all_queries(model) -> list[tuple[str, str, str]]:
    """Panel targets and annotation queries: every PromQL expression the dashboard runs."""
    annotations = [(f"annotation {a['name']}", "annotation", a["expr"])
                   for a in model["annotations"]["list"] if "expr" in a]
    return panel_queries(model) + annotations


def parsed(model):
    """(title, refId, expr, AST) per query, variables replaced by sentinels."""
    values = sentinels(model)
    return [(title, ref, expr, promql_parser.parse(substitute_variables(expr, values)))
            for title, ref, expr in all_queries(model)]


def nodes(ast) -> list[tuple[object, tuple]]:
    """Every node of an AST with its ancestors, outermost first."""
    out, stack = [], []

    def pre(node):
        out.append((node, tuple(stack)))
        stack.append(node)

    def post(node):
        stack.pop()

    promql_parser.walk(ast, pre, post)
    return out


# Series the dashboard may read besides the catalog's: recording rules (labels: their level) and Prometheus' ALERTS.
RECORDED = {r.record: Family(r.record, r.record, "gauge", "", tuple(r.record.split(":")[0].split("_")))
            for r in rules.records(rules.Scale(), wait_spans())}
ALERTS = Family("ALERTS", "ALERTS", "gauge", "", ("alertname", "alertstate", "severity"))


def family_of(metric: str):
    """The catalog family a series name belongs to (histograms through _bucket/_sum/_count; process series,
    recording rules and ALERTS too), or None."""
    by_name = {f.name: f for f in (*FAMILIES.values(), *PROCESS_FAMILIES.values(), *RECORDED.values(), ALERTS)}
    if metric in by_name:
        return by_name[metric]
    for suffix in HISTOGRAM_SUFFIXES:
        base = by_name.get(metric.removesuffix(suffix)) if metric.endswith(suffix) else None
        if base is not None and base.kind == "histogram":
            return base
    return None


def series_labels(metric: str) -> set:
    family = family_of(metric)
    if family.name in RECORDED:
        return set(family.labels)
    extra = {"le"} if metric.endswith("_bucket") else set()
    return set(COMMON_LABELS) | set(family.labels) | set(TARGET_LABELS) | extra


def result_labels(node) -> set:
    """Labels a query's result series can carry (what a legend may use)."""
    if isinstance(node, promql_parser.VectorSelector):
        return series_labels(node.name)
    if isinstance(node, promql_parser.MatrixSelector):
        return result_labels(node.vector_selector)
    if isinstance(node, promql_parser.ParenExpr):
        return result_labels(node.expr)
    if isinstance(node, promql_parser.AggregateExpr):
        if str(node.op) in ("topk", "bottomk"):   # keep the series they choose, labels and all
            return result_labels(node.expr)
        if node.modifier is None:
            return set()
        inner = result_labels(node.expr)
        by = node.modifier.type == promql_parser.AggModifierType.By
        return set(node.modifier.labels) if by else inner - set(node.modifier.labels)
    if isinstance(node, promql_parser.Call):
        if node.func.return_type == promql_parser.ValueType.Scalar:
            return set()
        vector_args = [a for a in node.args if not isinstance(a, promql_parser.NumberLiteral)]
        labels = result_labels(vector_args[0])
        return labels - {"le"} if node.func.name == "histogram_quantile" else labels
    if isinstance(node, promql_parser.BinaryExpr):
        lhs, rhs = result_labels(node.lhs), result_labels(node.rhs)
        many_on_the_right = node.modifier is not None and node.modifier.card == \
            promql_parser.VectorMatchCardinality.OneToMany   # group_right: the right side's series, labels and all
        return (rhs or lhs) if many_on_the_right else (lhs or rhs)
    return set()


def test_committed_json_is_the_generators_output(model, tmp_path):
    path = GRAFANA / "dflash.json"
    assert dash.DEFAULT_OUT == path
    assert json.loads(path.read_text()) == model, "run: python -m dflash.grafana"
    assert path.read_text() == dash.render(model)
    assert grafana.main(["dashboard", "--check", "--out", str(path)]) == 0
    stale = tmp_path / "dflash.json"
    stale.write_text(path.read_text().replace('"refresh": "1m"', '"refresh": "5m"'))
    assert grafana.main(["dashboard", "--check", "--out", str(stale)]) == 1
    assert grafana.main(["dashboard", "--out", str(stale)]) == 0 and stale.read_text() == path.read_text()


def test_every_query_is_valid_promql(model):
    values = sentinels(model)
    queries = all_queries(model)
    assert len(queries) >= 40
    for title, ref, expr in queries:
        text = substitute_variables(expr, values)
        assert "$" not in text and "[[" not in text, (title, ref, text)
        promql_parser.parse(text)   # raises ValueError with the position on bad PromQL


def test_datasource_is_templated(model):
    """dashboard-linter template-datasource and panel-datasource rules."""
    sources = [v for v in model["templating"]["list"] if v["type"] == "datasource"]
    assert len(sources) == 1
    source = sources[0]
    assert (source["name"], source["label"], source["query"]) == ("datasource", "Data source", "prometheus")
    assert source["current"]["value"] == dash.DATASOURCE_UID
    templated = {"type": "prometheus", "uid": "${datasource}"}
    for panel in iter_panels(model):
        if panel["type"] != "row":
            assert panel["datasource"] == templated, panel["title"]
            assert panel["targets"] and all(t["datasource"] == templated for t in panel["targets"])
    assert all(a["datasource"] == templated for a in model["annotations"]["list"])


def test_every_panel_has_a_unit_title_and_description(model):
    """dashboard-linter panel-units and panel-title-description rules; titles are unique too."""
    panels = [p for p in iter_panels(model) if p["type"] != "row"]
    for panel in panels:
        assert panel["fieldConfig"]["defaults"].get("unit") in VALID_UNITS, panel["title"]
        assert panel["title"] and panel.get("description"), panel["title"]
    titles = [p["title"] for p in panels]
    assert len(titles) == len(set(titles))


def test_rates_use_rate_interval(model):
    """dashboard-linter target-rate-interval rule, widened to increase: every window is $__rate_interval."""
    window = timedelta(milliseconds=int(RATE_INTERVAL.removesuffix("ms")))
    calls = 0
    for title, ref, expr, ast in parsed(model):
        for node, _ in nodes(ast):
            if isinstance(node, promql_parser.Call) and node.func.name in RATE_FUNCTIONS:
                calls += 1
                ranges = [a.range for a in node.args if isinstance(a, promql_parser.MatrixSelector)]
                assert ranges == [window], (title, ref, expr)
            if isinstance(node, promql_parser.MatrixSelector):
                assert node.range == window, (title, ref, expr)
    assert calls > 10


def test_counters_only_under_rate_or_increase(model):
    """dashboard-linter target-counter-agg rule, extended to histogram series."""
    for title, ref, expr, ast in parsed(model):
        for node, parents in nodes(ast):
            if not isinstance(node, promql_parser.VectorSelector):
                continue
            family = family_of(node.name)
            if family is not None and family.kind in ("counter", "histogram"):
                ok = (len(parents) >= 2 and isinstance(parents[-1], promql_parser.MatrixSelector)
                      and isinstance(parents[-2], promql_parser.Call)
                      and parents[-2].func.name in RATE_FUNCTIONS)
                assert ok, f"{title} {ref}: {node.name} not under rate/increase in {expr}"


def test_every_selector_filters_on_the_variables(model):
    """dashboard-linter target-job and target-instance rules, plus run, role, rank, gpu and clock (or a fixed
    gpu or clock)."""
    values = sentinels(model)
    selectors = 0
    for title, ref, expr, ast in parsed(model):
        for node, _ in nodes(ast):
            if not isinstance(node, promql_parser.VectorSelector):
                continue
            selectors += 1
            family = family_of(node.name)
            required = set(dash.FILTER_VARIABLES) | ({"gpu", "clock"} & set(family.labels))
            if family.name in RECORDED:   # only the labels a recording rule keeps
                required &= set(family.labels)
            regex = {(m.name, m.value.removesuffix("|") if family is ALERTS else m.value)   # ALERTS: or empty
                     for m in node.matchers.matchers if m.op == promql_parser.MatchOp.Re}
            # gpu or clock may be fixed instead (the time-share panels read the CPU clock's span count)
            fixed = {m.name for m in node.matchers.matchers if m.op == promql_parser.MatchOp.Equal} & {"gpu", "clock"}
            missing = {name for name in required if (name, values[name]) not in regex and name not in fixed}
            assert not missing, f"{title} {ref}: {node.name} lacks {sorted(missing)} matchers"
    assert selectors >= 45


def test_metrics_labels_and_legends_come_from_the_catalog(model):
    for title, ref, expr, ast in parsed(model):
        for node, _ in nodes(ast):
            if isinstance(node, promql_parser.VectorSelector):
                assert family_of(node.name) is not None, f"{title}: {node.name} is not in exporters.catalog"
                used = {m.name for m in node.matchers.matchers}
                assert used <= series_labels(node.name), (title, node.name, used)
            if isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
                assert set(node.modifier.labels) <= result_labels(node.expr), (title, expr)
    legends = {(p["title"], t["refId"]): t.get("legendFormat", "")
               for p in iter_panels(model) for t in p.get("targets", [])}
    for title, ref, expr, ast in parsed(model):
        if ref != "annotation":
            legend_labels = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legends[(title, ref)]))
            assert legend_labels <= result_labels(ast), (title, ref, legend_labels, expr)


def test_every_catalog_family_is_on_the_dashboard(model):
    names = {family_of(node.name).name for *_, ast in parsed(model)
             for node, _ in nodes(ast) if isinstance(node, promql_parser.VectorSelector)}
    missing = {f.name for f in (*FAMILIES.values(), *PROCESS_FAMILIES.values())} - names
    assert not missing, f"families without a panel: {sorted(missing)}"


def test_panel_ids_and_grid(model):
    panels = list(iter_panels(model))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) and i > 0 for i in ids)
    boxes = []
    for panel in panels:
        g = panel["gridPos"]
        assert g["x"] >= 0 and g["y"] >= 0 and g["w"] >= 1 and g["h"] >= 1, panel["title"]
        assert g["x"] + g["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            assert (g["x"], g["w"], g["h"]) == (0, 24, 1) and not panel["collapsed"]
        for other, o in boxes:
            overlap = (g["x"] < o["x"] + o["w"] and o["x"] < g["x"] + g["w"]
                       and g["y"] < o["y"] + o["h"] and o["y"] < g["y"] + g["h"])
            assert not overlap, (panel["title"], other)
        boxes.append((panel["title"], g))
    assert [p["title"] for p in panels if p["type"] == "row"] == [title for title, _ in dash.rows(wait_spans())]


def test_template_variables(model):
    """dashboard-linter template-job/-instance, template-label-promql and on-time-change-reload rules."""
    variables = {v["name"]: v for v in model["templating"]["list"]}
    assert set(variables) == VARIABLES
    values = sentinels(model)
    for name in (*dash.FILTER_VARIABLES, "gpu"):
        v = variables[name]
        assert v["type"] == "query" and v["datasource"]["uid"] == "${datasource}", name
        assert v["multi"] and v["includeAll"] and v["allValue"] == ".+" and v["refresh"] == 2, name
        assert v["label"] == dash.VARIABLE_LABELS[name]
        match = re.fullmatch(r"label_values\((.+), (\w+)\)", v["query"])
        assert match and match.group(2) == name, v["query"]
        selector = promql_parser.parse(substitute_variables(match.group(1), values))
        assert name in series_labels(selector.name), v["query"]
    assert variables["job"]["label"] == "Job" and variables["instance"]["label"] == "Instance"
    # the span clock follows the data: the clocks the selected ranks report, gpu first where there is one (the
    # first option is the default), a single value
    clock = variables["clock"]
    assert clock["type"] == "query" and not clock.get("multi") and not clock.get("includeAll")
    assert clock["sort"] == 2 and not clock.get("current") and not clock.get("options")   # alphabetical desc
    match = re.fullmatch(r"label_values\((dflash_span_seconds_count\{.+\}), clock\)", clock["query"])
    assert match and all(f'{v}=~"${v}"' in match.group(1) for v in dash.FILTER_VARIABLES), clock["query"]


def test_substitute_variables_all_syntaxes():
    values = {"job": "dflash", "rank": "0|1", "rate_interval": "10s", "interval": "5s", "__range": "1h"}
    expr = 'rate(x{job=~"$job", rank=~"${rank:regex}", a="[[job]]"}[$__rate_interval]) $__interval $__range'
    assert substitute_variables(expr, values) == \
        'rate(x{job=~"dflash", rank=~"0|1", a="dflash"}[10s]) 5s 1h'
    assert substitute_variables("${job}_x", values) == "dflash_x"
    with pytest.raises(KeyError, match=r"\$instance"):
        substitute_variables('x{instance=~"$instance"}', values)
    with pytest.raises(KeyError, match="__rate_interval"):   # the whole name, never a $__rate prefix
        substitute_variables("x[$__rate_interval]", {"rate": "1m"})


def test_panel_queries_walks_collapsed_rows():
    target = {"refId": "A", "expr": "up"}
    inner = {"type": "stat", "title": "inner", "targets": [{**target, "refId": "B"}]}
    model = {"panels": [{"type": "timeseries", "title": "top", "targets": [target]},
                        {"type": "row", "title": "r", "collapsed": True, "panels": [inner]}]}
    assert panel_queries(model) == [("top", "A", "up"), ("inner", "B", "up")]


def test_selector_rejects_labels_a_family_lacks():
    assert 'span="drafter.recv"' in dash.sel("wait_share", span="drafter.recv")
    with pytest.raises(ValueError, match="no label 'gpu'"):
        dash.sel("tokens", gpu="0")


def test_promtool_accepts_the_prometheus_config():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian package prometheus)")
    done = subprocess.run([promtool, "check", "config", str(GRAFANA / "prometheus.yml")],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_prometheus_provisioning_and_compose_agree():
    prom = yaml.safe_load((GRAFANA / "prometheus.yml").read_text())
    (job,) = prom["scrape_configs"]
    assert job["job_name"] == "dflash" and job["scrape_interval"] == "5s"
    (files,) = [sd["files"] for sd in job["file_sd_configs"]]
    assert files == ["/prometheus-sd/*.json"] and "*" not in files[0].rsplit("/", 1)[0]

    datasources = GRAFANA / "provisioning" / "datasources" / "prometheus.yml"
    (source,) = yaml.safe_load(datasources.read_text())["datasources"]
    assert (source["uid"], source["type"], source["url"]) == (dash.DATASOURCE_UID, "prometheus",
                                                              "http://127.0.0.1:9090")
    assert source["name"] == dash.DATASOURCE_NAME
    (provider,) = yaml.safe_load((GRAFANA / "provisioning/dashboards/dflash.yml").read_text())["providers"]

    services = yaml.safe_load((GRAFANA / "compose.yaml").read_text())["services"]
    assert {s["network_mode"] for s in services.values()} == {"host"}
    prometheus, grafana = services["prometheus"], services["grafana"]
    assert prometheus["image"].startswith("prom/prometheus:")
    assert grafana["image"].startswith("grafana/grafana-oss:")
    assert "--web.listen-address=127.0.0.1:9090" in prometheus["command"]
    config = next(c for c in prometheus["command"] if c.startswith("--config.file="))
    assert f"./prometheus.yml:{config.split('=', 1)[1]}:ro" in prometheus["volumes"]
    # Only the shared targets directory is mounted: the sd glob's directory, nothing else of the runs; by default
    # where dflash-train writes it (dflash.telemetry.sd_dir: ~/.cache/dflash/prometheus-sd)
    mount = "${DFLASH_PROMETHEUS_SD_DIR:-${HOME}/.cache/dflash/prometheus-sd}"
    assert f"{mount}:{files[0].rsplit('/', 1)[0]}:ro" in prometheus["volumes"]
    assert "./provisioning:/etc/grafana/provisioning:ro" in grafana["volumes"]
    assert f"./dflash.json:{provider['options']['path']}/dflash.json:ro" in grafana["volumes"]


def test_time_share_panels_scale_gpu_time_sampled_on_one_step_in_n(tmp_path):
    """The time-share panels' query, evaluated by Prometheus's own engine (`promtool test rules`) on series of
    a drafter that runs one 0.2 s span a second (a share of 0.2) and GPU-times one in four
    (--profile-gpu-steps-per-s 0.25): the GPU clock reads 0.2, not the timed spans' 0.05; the CPU clock is unchanged."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian package prometheus)")
    (expr,) = [e for t, _, e in panel_queries(json.loads((GRAFANA / "dflash.json").read_text()))
               if t.startswith("Drafter time share")]
    labels = 'job="dflash", run="r", instance="h:1", role="drafter", rank="0", span="drafter.fwd_bwd"'
    series = {"dflash_span_self_time_seconds_total": {"gpu": "0+3x20", "cpu": "0+12x20"},
              "dflash_spans_total": {"gpu": "0+15x20", "cpu": "0+60x20"}}
    inputs = [{"series": f"{name}{{{labels}, clock=\"{clock}\"}}", "values": values}
              for name, by_clock in series.items() for clock, values in by_clock.items()]
    inputs.append({"series": f"dflash_profiled_seconds_total{{{labels.rsplit(', span=', 1)[0]}}}",
                   "values": "0+60x20"})   # the rank's intervals cover its wall time
    values = {"datasource": "prometheus", "job": "dflash", "instance": ".*", "run": ".*", "role": ".*",
              "rank": ".*", "gpu": ".*", "rate_interval": "5m", "interval": "1m", "range": "5m"}
    tests = [{"eval_time": "10m", "expr": substitute_variables(expr, {**values, "clock": clock}),
              "exp_samples": [{"labels": '{span="drafter.fwd_bwd"}', "value": 0.2}]} for clock in ("gpu", "cpu")]
    spec = {"rule_files": [], "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": inputs, "promql_expr_test": tests}]}
    path = tmp_path / "share_test.yml"
    path.write_text(yaml.safe_dump(spec))
    done = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
