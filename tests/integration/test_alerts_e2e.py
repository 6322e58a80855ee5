"""The shipped alerts end to end: a real Prometheus (Debian's package) loads the generated recording rules and
alerts and sends what fires to a real Alertmanager (Debian's prometheus-alertmanager, on 127.0.0.1, its storage in a
temporary directory), which posts its webhook to a receiver in this test. Real two-rank CPU runs inject a fault
with DFLASH_FAULT, and the matching alert reaches the receiver with the run's and the rank's labels:

- a NaN in the drafter's loss (`nan@drafter.fwd_bwd:step=3`): DFlashNonFiniteValue, rank 0;
- a hang of the target's forward (`hang@target.fwd:step=3:rank=1`, `--hang-timeout-s 4`): DFlashHang, rank 1;
- a slow target stage (`slow=...@target.fetch`): DFlashDrafterStarved, rank 0.

Prometheus scrapes a new file_sd target only seconds after its entry appears (discovery updates reach the scrape
manager every 5 s), and a fault at step 3 fires a second or two into training: a rank that fails before its first
scrape leaves Prometheus nothing but `up == 0` (DFlashRankDown, docs/RUNBOOK.md says so). The NaN and hang runs
therefore start with the target's first fetch held for FIRST_SCRAPE_S (`slow=...@target.fetch:step=0`, before the
hang watchdog arms), as a run of minutes is scraped long before its step 3.

Real `for:` and range windows of minutes cannot fit the suite, so Prometheus loads the rules as
`python -m dflash.grafana rules --time-scale` writes them at tests/conftest.py's ALERT_TIME_SCALE (1/60: a minute of
the shipped rules is a second here; same expressions and thresholds); `promtool test rules`
(tests/exporters/test_alert_rules.py) proves the shipped windows. The shared healthy run raising no alert is
tests/integration/test_exporters_e2e.py's. One Prometheus and Alertmanager pair serves every run here.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.conftest import free_port_pair, start_prometheus, write_scaled_rules

pytestmark = pytest.mark.slow

SMALL = ["--builtin-conversations", "48", "--eval-prompts", "0", "--tokens-per-batch", "1024", "--max-length", "128",
         "--profile-interval", "1", "--device", "cpu"]
ALERT_WAIT_S = 90.0   # from the runs' start to the last alert at the receiver, at most
FIRST_SCRAPE_S = 8    # the first batch held back that long: Prometheus discovers and scrapes both ranks meanwhile
FIRST_SCRAPE = f"slow={FIRST_SCRAPE_S}@target.fetch:step=0"


class Webhook:
    """Alertmanager's webhook receiver: keeps every alert of every notification it is posted (payload version 4)."""

    def __init__(self):
        self.alerts: list[dict] = []
        self.lock = threading.Condition()
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                assert payload["version"] == "4", payload
                with hook.lock:
                    hook.alerts.extend(payload["alerts"])
                    hook.lock.notify_all()
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait_for(self, alertname: str, run: str, rank: str, deadline: float) -> dict | None:
        """The first firing `alertname` of `run` and `rank` received before the monotonic `deadline`, else None."""
        def found():
            return next((a for a in self.alerts if a["status"] == "firing" and a["labels"]["alertname"] == alertname
                         and a["labels"].get("run") == run and a["labels"].get("rank") == rank), None)
        with self.lock:
            self.lock.wait_for(found, timeout=max(0.0, deadline - time.monotonic()))
            return found()

    def names(self, run: str) -> set:
        with self.lock:
            return {a["labels"]["alertname"] for a in self.alerts if a["labels"].get("run") == run}

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _port() -> int:
    return free_port_pair()   # below the ephemeral range (tests/conftest.py says why)


def _ready(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{url} exited; see {log}"
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"{url} did not become ready")


def start_alertmanager(tmp: Path, webhook: str) -> tuple[subprocess.Popen, str]:
    """A real Alertmanager on 127.0.0.1 posting every alert to `webhook` at once (1 s group wait), no cluster."""
    (tmp / "alertmanager.yml").write_text(
        "route:\n  receiver: hook\n  group_by: [alertname, run, rank]\n  group_wait: 1s\n  group_interval: 1s\n"
        f"  repeat_interval: 1h\nreceivers:\n  - name: hook\n    webhook_configs:\n      - url: '{webhook}'\n")
    address = f"127.0.0.1:{_port()}"
    log = tmp / "alertmanager.log"
    proc = subprocess.Popen([shutil.which("prometheus-alertmanager"), f"--config.file={tmp / 'alertmanager.yml'}",
                             f"--storage.path={tmp / 'am-data'}", f"--web.listen-address={address}",
                             "--cluster.listen-address="], stdout=subprocess.DEVNULL, stderr=open(log, "wb"))
    _ready(f"http://{address}/-/ready", proc, log)
    return proc, address


# run name -> (DFLASH_FAULT, extra arguments, the alert expected, its rank)
FAULTS = {
    "nan": (f"{FIRST_SCRAPE};nan@drafter.fwd_bwd:step=3", ["--max-steps", "8"], "DFlashNonFiniteValue", "0"),
    "hang": (f"{FIRST_SCRAPE};hang@target.fwd:step=3:rank=1", ["--max-steps", "8", "--hang-timeout-s", "4"],
             "DFlashHang", "1"),
    # the target sleeps in every fetch far longer than a drafter step takes (small batches): the drafter waits
    "slow": ("slow=4@target.fetch", ["--max-steps", "40", "--tokens-per-batch", "256", "--max-length", "64"],
             "DFlashDrafterStarved", "0"),
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """{"runs", "prometheus", "webhook"}: one Alertmanager and one Prometheus (scaled rules, 1 s scrapes and
    evaluations) watching every run of FAULTS under `runs` through its file_sd copy."""
    if not all(shutil.which(t) for t in ("prometheus", "prometheus-alertmanager")):
        pytest.skip("prometheus / prometheus-alertmanager not installed (Debian packages)")
    tmp = tmp_path_factory.mktemp("alerts")
    runs = tmp / "runs"
    runs.mkdir()
    webhook = Webhook()
    am, address = start_alertmanager(tmp, webhook.url)
    prom = None
    try:
        # each run in its own directory (its train.log beside it), so one file_sd glob per run
        prom, base = start_prometheus(tmp, [runs / name / "prometheus-sd" / "*.json" for name in FAULTS],
                                      rule_files=write_scaled_rules(tmp), alertmanager=address)
        yield {"runs": runs, "prometheus": base, "webhook": webhook}
    finally:
        for proc in (prom, am):
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=30)
        webhook.close()


@pytest.fixture(scope="module")
def fault_alerts(stack, live_run, prebuilt) -> dict:
    """The three fault runs trained side by side (their faults are timed by steps, not by the clock) until each
    one's expected alert reached the webhook or ALERT_WAIT_S passed: {run name: the alert, or None}. A run still
    going then is stopped with SIGTERM, as a user would."""
    out: dict = {}
    with contextlib.ExitStack() as runs:
        trains = {}
        t0 = time.monotonic()
        for name, (fault, args, _, _) in FAULTS.items():
            run = prebuilt(stack["runs"] / name / name)   # its file_sd copy in its own directory, beside it
            sd = ["--prometheus-sd-dir", str(stack["runs"] / name / "prometheus-sd")]
            trains[name] = runs.enter_context(live_run(run, [*SMALL, "--metrics-port", str(free_port_pair()), *sd,
                                                             *args], {"DFLASH_FAULT": fault}))
        for name, (_, _, alertname, rank) in FAULTS.items():
            label = wait_for_run_id(stack, name, t0 + ALERT_WAIT_S)
            out[name] = label and stack["webhook"].wait_for(alertname, label, rank, t0 + ALERT_WAIT_S)
        for train in trains.values():
            if train.poll() is None:
                os.killpg(train.pid, signal.SIGTERM)
        for train in trains.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                train.wait(timeout=20)   # else live_run kills it
    return out


def alert_of(stack, fault_alerts: dict, name: str) -> dict:
    alert = fault_alerts[name]
    if alert is None:
        log = (stack["runs"] / name / "train.log").read_text()
        pytest.fail(f"no {FAULTS[name][2]} for run {name} within {ALERT_WAIT_S:.0f} s; the webhook got "
                    f"{sorted(stack['webhook'].names(wait_for_run_id(stack, name, 0)))}; a log tail:\n{log[-2000:]}")
    return alert


def run_id(stack, name: str) -> str:
    """The run label of the fault run `name`: its unique id, which its config.json keeps."""
    return json.loads((stack["runs"] / name / name / "config.json").read_text())["run_id"]


def wait_for_run_id(stack, name: str, deadline: float) -> str | None:
    """run_id(), once rank 0 has written config.json (before the monotonic `deadline`), else None."""
    while True:
        with contextlib.suppress(OSError, ValueError, KeyError):
            return run_id(stack, name)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.2)


def check_alert(alert: dict, alertname: str, run: str, rank: str, role: str, severity: str) -> None:
    labels, notes = alert["labels"], alert["annotations"]
    assert (labels["alertname"], labels["run"], labels["rank"], labels["role"]) == (alertname, run, rank, role), labels
    assert labels["severity"] == severity and labels["job"] == "dflash"
    assert f"rank {rank} ({role}) of run {run}" in notes["description"].lower(), notes
    assert notes["runbook_url"] == f"docs/RUNBOOK.md#{alertname.lower()}" and notes["summary"]


def test_a_nan_in_the_drafters_loss_raises_the_nonfinite_alert_for_rank_0(stack, fault_alerts):
    check_alert(alert_of(stack, fault_alerts, "nan"), "DFlashNonFiniteValue", run_id(stack, "nan"), "0", "drafter",
                "critical")


def test_a_hung_target_raises_the_hang_alert_for_rank_1(stack, fault_alerts):
    check_alert(alert_of(stack, fault_alerts, "hang"), "DFlashHang", run_id(stack, "hang"), "1", "target", "critical")


def test_a_slow_target_stage_raises_drafter_starved_and_the_dashboard_shows_it(stack, fault_alerts):
    check_alert(alert_of(stack, fault_alerts, "slow"), "DFlashDrafterStarved", run_id(stack, "slow"), "0", "drafter",
                "warning")
    # the dashboard's alert panel and annotation read the same ALERTS series
    from tests.exporters.grafana_model import panel_queries, substitute_variables

    dashboard = json.loads((Path(__file__).resolve().parents[2] / "grafana" / "dflash.json").read_text())
    values = {"job": ".+", "run": run_id(stack, "slow"), "instance": ".+", "role": ".+", "rank": ".+", "rate_interval": "20s"}
    queries = [e for title, _, e in panel_queries(dashboard) if title == "Firing alerts"]
    queries += [a["expr"] for a in dashboard["annotations"]["list"] if a.get("name") == "Alerts"]
    assert len(queries) == 2
    for expr in queries:
        url = (f"{stack['prometheus']}/api/v1/query_range?" + urllib.parse.urlencode(
            {"query": substitute_variables(expr, values), "start": time.time() - 120, "end": time.time(), "step": "1s"}))
        with urllib.request.urlopen(url, timeout=10) as r:
            result = json.loads(r.read())["data"]["result"]
        assert any(s["metric"].get("alertname") == "DFlashDrafterStarved" for s in result), (expr, result)
