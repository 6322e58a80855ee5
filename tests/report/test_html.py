"""`dflash-report html` (issue 51): one self-contained page of hotspots' sections and plots. Hostile text from a log
is escaped, the page's size stays bounded as the log grows, an output it cannot write is one line and exit 2, and
the shared real run's page, opened in a real headless Chromium (over the DevTools protocol on a pipe), renders every
section with no console error and no network request; its screenshot is kept as a test artifact."""
from __future__ import annotations

import base64
import copy
import fcntl
import json
import os
import re
import select
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from dflash import report_cli
from profiler.report.html import write_html
from profiler.report.html_series import MAX_POINTS
from tests.report.longlog import write_long_run
from tests.report.test_check import clean, find, write

HOSTILE = "<script>alert(1)</script>"
SECTIONS = ("steady", "verdict", "findings", "spans", "plots", "bandwidth", "memory", "margin", "events", "ranks",
            "split", "links", "text")
NVML = {"available": True, "gpus": [{"index": 0, "name": "H200", "total_bytes": 140 * 2**30,
                                     "used_bytes_peak": 60 * 2**30, "headroom_bytes": 80 * 2**30,
                                     "util_percent_mean": 97.0, "sm_active_percent_mean": 41.0}]}


def _hostile_run() -> dict:
    """The clean crafted run with markup wherever a log carries text: a span name, a thread, a config value, the
    run id, an event's fields, the GPU's name."""
    run = copy.deepcopy(clean())
    drafter = run["logs"][0]
    find(drafter, "run_start")["run_id"] = HOSTILE
    find(drafter, "run_start")["config"] = {"note": HOSTILE}
    iv = find(drafter, "interval", 1)
    iv["spans"][HOSTILE] = copy.deepcopy(iv["spans"]["drafter.recv"])
    iv["spans"][HOSTILE]["threads"] = [HOSTILE]
    iv["memory"] = copy.deepcopy(NVML)
    iv["memory"]["gpus"][0]["name"] = HOSTILE
    drafter.insert(3, {"type": "event", "kind": "stop", "rank": 0, "role": "drafter", "time_unix": iv["time_unix"],
                       "reason": HOSTILE})
    return run


def test_hostile_strings_from_the_log_are_escaped(tmp_path):
    run_dir = write(tmp_path / "run", _hostile_run())
    page = Path(write_html(run_dir, tmp_path / "r.html")["out"]).read_text()
    assert "<script" not in page.lower()
    assert page.count("&lt;script&gt;alert(1)&lt;/script&gt;") >= 4   # the span, its plot, the event, the run id
    assert "default-src 'none'" in page   # and a page that loads nothing even were markup to slip through


def test_gpu_memory_counters_and_links_where_the_run_has_them(tmp_path):
    run = copy.deepcopy(clean())
    for recs in run["logs"].values():
        for r in recs:
            if r["type"] == "interval":
                r["memory"] = copy.deepcopy(NVML)
    run_dir = write(tmp_path / "run", run)
    (run_dir / "trace").mkdir()
    (run_dir / "trace" / "merged.json").write_text("{}")
    (run_dir / "kineto").mkdir()
    (run_dir / "kineto" / "rank0-step5.json.gz").write_bytes(b"")
    page = Path(write_html(run_dir)["out"]).read_text()   # RUN_DIR/report.html: its links relative to RUN_DIR
    assert 'href="trace/merged.json"' in page and 'href="kineto/rank0-step5.json.gz"' in page
    for fig in ("plot-headroom", "plot-gpu-util_percent_mean", "plot-gpu-sm_active_percent_mean"):
        assert f'id="{fig}"' in page
    assert 'id="plot-gpu-tensor_active_percent_mean"' not in page   # not measured: no plot
    assert "5% of a 140 GiB GPU" in page


def _points(page: str) -> int:
    return page.count("<circle")


def test_the_page_stays_bounded_as_the_log_grows(tmp_path):
    sizes, points = [], []
    for n in (MAX_POINTS * 2, MAX_POINTS * 8):
        run_dir = write_long_run(tmp_path / f"run{n}", n)
        s = write_html(run_dir, tmp_path / f"r{n}.html")
        page = Path(s["out"]).read_text()
        sizes.append(s["bytes"])
        points.append(_points(page))
        assert re.search(r"each point the mean of \d+ consecutive samples", page)
    assert points[1] <= points[0] * 1.05, points   # 4x the intervals, not more points
    assert sizes[1] <= sizes[0] * 1.1, sizes


def test_an_output_it_cannot_write_is_one_line_and_exit_2(tmp_path, capsys):
    run_dir = write(tmp_path / "run", clean())
    for out in (tmp_path / "missing" / "r.html", tmp_path):
        assert report_cli.main(["html", str(run_dir), "-o", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("dflash-report: error: cannot write"), err
    assert report_cli.main(["html", str(run_dir), "--compare", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err == f"dflash-report: error: {tmp_path / 'nope'}: no such directory\n"
    assert not (run_dir / "report.html").exists()   # refused before any work
    assert report_cli.main(["html", str(run_dir)]) == 0   # the default: RUN_DIR/report.html
    assert (run_dir / "report.html").stat().st_size > 0
    assert "report.html" in capsys.readouterr().out


# ---- the real page in a real browser ------------------------------------------------------------------

class DevTools:
    """Headless Chromium driven over the DevTools protocol on a pipe (--remote-debugging-pipe: it reads commands,
    NUL-terminated JSON, on fd 3 and answers on fd 4); every event kept for the test to read."""

    def __init__(self, exe: str, profile: Path):
        cmd_r, self._cmd_w = os.pipe()
        self._res_r, res_w = os.pipe()
        hi_r, hi_w = (fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in (cmd_r, res_w))
        for fd in (cmd_r, res_w):
            os.close(fd)
        args = ["--headless", "--disable-gpu", "--no-sandbox", "--remote-debugging-pipe", "--no-first-run",
                f"--user-data-dir={profile}", "about:blank"]
        self.proc = subprocess.Popen(["bash", "-c", f'exec "$0" "$@" 3<&{hi_r} 4>&{hi_w}', exe, *args],
                                     pass_fds=(hi_r, hi_w), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(hi_r)
        os.close(hi_w)
        self.events, self._buf, self._id, self.session = [], b"", 0, None

    def send(self, method: str, timeout_s: float = 30.0, **params) -> dict:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params}
        if self.session and not method.startswith(("Target.", "Browser.")):
            msg["sessionId"] = self.session
        os.write(self._cmd_w, json.dumps(msg).encode() + b"\0")
        reply = self.wait(lambda m: m.get("id") == self._id, timeout_s)
        assert "error" not in reply, (method, reply["error"])
        return reply.get("result", {})

    def wait(self, pred, timeout_s: float) -> dict:
        """The first message `pred` accepts (events read meanwhile are kept in `events`)."""
        deadline = time.monotonic() + timeout_s
        while True:
            while b"\0" in self._buf:
                raw, self._buf = self._buf.split(b"\0", 1)
                m = json.loads(raw)
                if "method" in m:
                    self.events.append(m)
                if pred(m):
                    return m
            left = deadline - time.monotonic()
            assert left > 0, "no answer from chromium"
            if select.select([self._res_r], [], [], left)[0]:
                chunk = os.read(self._res_r, 1 << 20)
                assert chunk, "chromium closed the pipe"
                self._buf += chunk

    def close(self) -> None:
        try:
            os.write(self._cmd_w, json.dumps({"id": 0, "method": "Browser.close"}).encode() + b"\0")
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        os.close(self._cmd_w)
        os.close(self._res_r)


def _open(dt: DevTools, url: str) -> None:
    target = dt.send("Target.createTarget", url="about:blank")["targetId"]
    dt.session = dt.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
    for domain in ("Runtime", "Log", "Network", "Page"):
        dt.send(f"{domain}.enable")
    dt.send("Page.navigate", url=url)
    dt.wait(lambda m: m.get("method") == "Page.loadEventFired", 30.0)


def _problems(events: list) -> list:
    """Console errors and warnings, uncaught exceptions, and the browser's own error entries (a CSP refusal)."""
    out = []
    for e in events:
        p = e.get("params", {})
        if e["method"] == "Runtime.exceptionThrown" or (e["method"] == "Runtime.consoleAPICalled"
                                                         and p.get("type") in ("error", "warning", "assert")):
            out.append(e)
        elif e["method"] == "Log.entryAdded" and p["entry"]["level"] in ("error", "warning"):
            out.append(e)
    return out


def _screenshot(dt: DevTools, png: Path) -> None:
    """The whole page at 1400 px wide (its height measured at that width)."""
    for height in (900, None):
        height = height or dt.send("Runtime.evaluate",
                                   expression="document.documentElement.scrollHeight")["result"]["value"]
        dt.send("Emulation.setDeviceMetricsOverride", width=1400, height=min(int(height), 16000), deviceScaleFactor=1,
                mobile=False)
    png.write_bytes(base64.b64decode(dt.send("Page.captureScreenshot", format="png")["data"]))


def test_the_real_runs_page_renders_in_chromium(healthy_run, tmp_path):
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("chromium is not installed (scripts/test.sh installs Debian's chromium)")
    assert healthy_run.returncode == 0, healthy_run.stderr[-3000:]
    out = tmp_path / "report.html"
    assert report_cli.main(["html", str(healthy_run.run), "-o", str(out), "--compare", str(healthy_run.run)]) == 0
    assert out.stat().st_size < 5e6
    dt = DevTools(exe, tmp_path / "profile")
    try:
        _open(dt, out.as_uri())
        found = dt.send("Runtime.evaluate", returnByValue=True, expression=(
            "({sections: [...document.querySelectorAll('section')].map(s => s.id), "
            "svgs: document.querySelectorAll('figure svg').length, "
            "scripts: document.scripts.length})"))["result"]["value"]
        _screenshot(dt, tmp_path / "report.png")
    finally:
        dt.close()
    assert set(SECTIONS) | {"compare"} <= set(found["sections"]), found
    assert found["svgs"] >= 4 and found["scripts"] == 0, found   # span stacks per role, tokens/s, loss, tau
    requests = [e["params"]["request"]["url"] for e in dt.events if e["method"] == "Network.requestWillBeSent"]
    assert requests == [out.as_uri()], requests   # the page itself, nothing else
    assert _problems(dt.events) == []
    png = (tmp_path / "report.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 20_000
    shutil.copyfile(tmp_path / "report.png", "/tmp/html_report_screenshot.png")
