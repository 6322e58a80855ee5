"""Fixtures shared across test packages: a real OTLP/HTTP receiver, the built-ins of the small CPU
runs, built once per session, `dflash.cli.main` called in-process for the cases refused with exit 2,
a forkserver for tests' own rank processes, and ONE healthy default run (watched live by Prometheus
and the receiver) that every check which only reads a healthy run reads: started with the session,
in the background, and read by those checks, run last."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


class _QuietServer(ThreadingHTTPServer):
    """The receiver's server: a client that hung up before its reply (an exporter past its own timeout on a busy
    machine) is the client's business, not a traceback on this process's stderr, which a test capturing the
    process's file descriptors (capfd) would read as its own output."""

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


class OtlpReceiver:
    """An OTLP/HTTP collector stand-in: decodes POST /v1/traces and /v1/metrics and answers 200."""

    def __init__(self):
        from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

        self.traces, self.metrics = [], []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.path == "/v1/traces":
                    receiver.traces.append(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
                    reply = trace_service_pb2.ExportTraceServiceResponse()
                elif self.path == "/v1/metrics":
                    receiver.metrics.append(metrics_service_pb2.ExportMetricsServiceRequest.FromString(body))
                    reply = metrics_service_pb2.ExportMetricsServiceResponse()
                else:
                    self.send_error(404)
                    return
                data = reply.SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = _QuietServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    def spans(self) -> list:
        """[(resource attributes {key: AnyValue}, span)] of every span received so far."""
        return [({a.key: a.value for a in rs.resource.attributes}, s)
                for req in self.traces for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]


@pytest.fixture(scope="session")
def otlp_receiver_cls():
    """The receiver class (for fixtures of any scope): OtlpReceiver() starts one on 127.0.0.1."""
    return OtlpReceiver


def pytest_configure(config):
    """The session's own user cache: XDG_CACHE_HOME points at a fresh private directory (made before any
    fixture, so every run the suite starts inherits it), so no test reads or writes the real ~/.cache and the
    runs share the built-ins they build (dflash/builtin.py) and their compile cache."""
    import tempfile

    config._dflash_cache_home = tempfile.mkdtemp(prefix="dflash-test-cache-")
    config._dflash_saved_cache_home = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = config._dflash_cache_home


def pytest_unconfigure(config):
    home = getattr(config, "_dflash_cache_home", None)
    if home is None:
        return
    shutil.rmtree(home, ignore_errors=True)
    saved = config._dflash_saved_cache_home
    if saved is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = saved


@pytest.fixture(scope="session")
def small_builtin() -> Path:
    """The built-ins of a run with `--builtin-conversations 48` (seed 0, up to 16 eval prompts): the tiny
    target and both corpora, built once into the session's user cache by dflash.builtin.cached_build, the
    function rank 0 calls, so a small run that finds no built-ins in its run directory copies these. Read only."""
    from dflash.builtin import builtin_cache_dir, cached_build
    from dflash.tiny import builtin_settings

    return cached_build(builtin_cache_dir(), builtin_settings(0, 48, 16))


@pytest.fixture(scope="session")
def prebuilt(small_builtin):
    """prebuilt(run_dir) -> run_dir: a new run directory that already holds those built-ins, as one
    that a run (or a --resume) left. Rank 0 keeps a matching build (builtin_complete checks its markers);
    a small run without it copies them from the session's cache instead. Tests of the built-ins
    themselves, of the run directory's creation (its mode) or of the default run do not use it."""
    def seed(run_dir: Path) -> Path:
        shutil.copytree(small_builtin, Path(run_dir) / "builtin")
        return Path(run_dir)

    return seed


@pytest.fixture(scope="session")
def rank_processes():
    """torch.multiprocessing's context for tests that start rank processes of their own: each is forked
    from one forkserver that imported torch once for the session, where a spawned interpreter would
    import it again for every rank of every test (seconds of CPU each). Still separate processes with
    nothing of pytest's threads or state: the server is a fresh interpreter."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])   # taken when the server first starts
    return ctx


@pytest.fixture(autouse=True)
def _keep_bytecode_settings():
    """dflash.launch, called in-process by CLI tests, may point this interpreter's bytecode at the
    compile cache (launch.use_bytecode_cache); put it back after every test."""
    saved = sys.pycache_prefix, sys.dont_write_bytecode
    yield
    sys.pycache_prefix, sys.dont_write_bytecode = saved


@pytest.fixture
def train_main(capfd, monkeypatch):
    """train_main(args, env=None) -> CompletedProcess of `dflash-train ARGS` run as dflash.cli.main(ARGS)
    in this process, `env` added to os.environ for the call. For the cases refused before any rank
    trains (exit 2): the launcher still starts its gated ranks, so the captured stdout/stderr are this
    process's and theirs (file descriptors, not sys.stdout), as a subprocess's would be."""
    from dflash import cli

    def call(args: list, env: dict | None = None) -> subprocess.CompletedProcess:
        with monkeypatch.context() as m:
            for var, value in (env or {}).items():
                m.setenv(var, value)
            capfd.readouterr()
            try:
                code = cli.main([str(a) for a in args])
            except SystemExit as e:   # argparse: --help, a bad flag
                code = e.code
            out, err = capfd.readouterr()
        return subprocess.CompletedProcess(args, code, out, err)

    return call


_HANDED_OUT_PORTS: set = set()


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux: ip_local_port_range; 32768 where unreadable)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    return 32768


def free_port_pair() -> int:
    """A base port P with P and P + 1 free on loopback (one metrics endpoint per rank), taken below the kernel's
    ephemeral range and never twice in a session. A port from bind(0) lies in that range, where the local end of
    any outgoing connection (Prometheus' scrapes, the ranks' rendezvous) can take it between this check and the
    run's own bind: the run then refused its --metrics-port as in use (seen in CI, three runs started at once)."""
    low = min(_ephemeral_low(), 65535)
    for _ in range(200):
        p = random.randrange(10000, max(low - 1, 10001))
        if p in _HANDED_OUT_PORTS or p + 1 in _HANDED_OUT_PORTS:
            continue
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", p))
                b.bind(("127.0.0.1", p + 1))
        except OSError:
            continue
        _HANDED_OUT_PORTS.update((p, p + 1))
        return p
    raise RuntimeError("no two adjacent free ports")


ALERT_TIME_SCALE = 1 / 60
"""The time scale of the rule files the suite's Prometheus servers load (dflash.grafana rules --time-scale): every
window, `for:` and time threshold of the shipped rules divided by 60, a minute becoming a second, so that alerts
meant for minutes of a real run fire within the seconds of a test run; expressions and thresholds unchanged.
`promtool test rules` (tests/exporters/test_alert_rules.py) proves the shipped files' real windows."""


def write_scaled_rules(directory: Path) -> list[Path]:
    """The shipped recording rules and alerts at ALERT_TIME_SCALE, written to `directory`: [the rule file]."""
    from dflash import grafana

    path = directory / "dflash.rules.yml"
    assert grafana.main(["rules", "--out", str(path), "--time-scale", repr(ALERT_TIME_SCALE)]) == 0
    return [path]


def start_prometheus(tmp: Path, sd_glob, rule_files=(), alertmanager: str | None = None
                     ) -> tuple[subprocess.Popen, str]:
    """A real Prometheus scraping every target in the file_sd files `sd_glob` (a path, or a list of them) each
    second and evaluating `rule_files` each second, sending alerts to `alertmanager` (host:port) when given;
    (process, base URL) once it answers /-/ready."""
    config = tmp / "prometheus.yml"
    rules = "".join(f"\n  - '{path}'" for path in rule_files)
    sd_glob = ", ".join(f"'{path}'" for path in (sd_glob if isinstance(sd_glob, (list, tuple)) else [sd_glob]))
    alerting = (f"alerting:\n  alertmanagers:\n    - static_configs:\n        - targets: ['{alertmanager}']\n"
                if alertmanager else "")
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        + (f"rule_files:{rules}\n" if rules else "") + alerting
        + "scrape_configs:\n  - job_name: dflash\n    file_sd_configs:\n"
        f"      - files: [{sd_glob}]\n        refresh_interval: 1s\n")
    return serve_prometheus(config, tmp)


def serve_prometheus(config: Path, tmp: Path) -> tuple[subprocess.Popen, str]:
    """A real Prometheus on `config`, its TSDB and log under `tmp`; (process, base URL) once it answers /-/ready."""
    port = free_port_pair()   # below the ephemeral range: no outgoing connection takes it before Prometheus binds
    proc = subprocess.Popen([shutil.which("prometheus"), f"--config.file={config}",
                             f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=open(tmp / "prometheus.log", "wb"))
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"prometheus exited; see {tmp / 'prometheus.log'}"
        try:
            with urllib.request.urlopen(f"{base}/-/ready", timeout=1):
                return proc, base
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise TimeoutError("prometheus did not become ready")


@dataclasses.dataclass
class HealthyRun:
    """The session's shared run, finished: the README default run (`dflash-train --run-dir RUN` on the
    built-ins, every default) with 5 s profile intervals (HEALTHY_ARGS), metrics on a chosen port and OTLP export to a
    live receiver, so that the default-run, Prometheus, dashboard-panel, OTLP and trace checks read one run."""

    run: Path
    """Its run directory, RUNS/run (its Prometheus file_sd copy is RUNS/prometheus-sd/RUN_ID.json while it runs)."""
    returncode: int
    stdout: str
    stderr: str
    wall_seconds: float
    """From the command's start to its exit."""
    started_unix: float
    port: int
    """The metrics base port it was given: rank r served on port + r."""
    scrapes: dict
    """{rank: /metrics text} fetched while training, from the last scrape whose intervals carried tokens."""
    receiver: OtlpReceiver
    """The OTLP/HTTP receiver its ranks exported to (still open, for the session)."""
    prometheus: str | None
    """Base URL of the real Prometheus that scraped it (still up), None where none is installed. It evaluated the
    shipped recording rules and alerts at ALERT_TIME_SCALE all along."""


HEALTHY_ARGS = ["--profile-interval", "1", "--sinks", "tensorboard"]
"""Short intervals, many within the dashboard's 20 s rate windows, and shorter than a step beside the rest of
the suite (several seconds): a span kept by the detail window is written in the interval it ends in, so the
trace and OTLP checks see whole drafter.fwd_bwd spans however long a step is. With the TensorBoard sink, which
tests/exporters/test_tensorboard.py reads back."""
HEALTHY_LIMIT_S = 900
"""How long the shared run may take before it is killed: the README default run took 198 s on the 2-core VM
(2026-12-04), and a busy machine may double or triple that; the suite must pass there too."""
HEALTHY_USERS = {"healthy_run", "live"}   # `live`: test_exporters_e2e's view of the run


def _uses_healthy_run(item) -> bool:
    """Whether the test will read the shared run. test_exporters_e2e's `live` asks for it only where
    Prometheus and promtool are installed (it skips before asking otherwise)."""
    names = set(getattr(item, "fixturenames", ()))
    if "healthy_run" in names:
        return True
    return "live" in names and shutil.which("prometheus") is not None and shutil.which("promtool") is not None


def pytest_collection_modifyitems(items):
    """The tests that read the shared healthy run go last, in their order: the run starts with the
    session (`_healthy_run_started`) and trains while every other test runs, so they find it finished
    instead of waiting for it. Each may still pay for the rest of it (its setup): it gets the run's limit
    on top of the per-test timeout, not the 300 s every other test has."""
    readers = [item for item in items if HEALTHY_USERS & set(getattr(item, "fixturenames", ()))]
    for item in readers:
        item.add_marker(pytest.mark.timeout(HEALTHY_LIMIT_S + 300))
    final = [item for item in items if item.nodeid.startswith("tests/test_zz_")]   # checks every run made
    items[:] = [item for item in items if item not in readers and item not in final] + readers + final


def _run_watched(run: Path, port: int, receiver: OtlpReceiver, prometheus: str | None,
                 stop: threading.Event) -> HealthyRun:
    """The healthy run, its ranks' /metrics fetched each second while it trains; returns once it exits,
    or kills it with its ranks once `stop` is set or it passes HEALTHY_LIMIT_S."""
    out, err = run.parent / "train.out", run.parent / "train.err"
    started, t0 = time.time(), time.monotonic()
    with open(out, "w") as o, open(err, "w") as e:
        train = subprocess.Popen([sys.executable, "-m", "dflash.cli", "--run-dir", str(run), *HEALTHY_ARGS,
                                  "--metrics-port", str(port), "--prometheus-sd-dir", str(run.parent / "prometheus-sd")],
                                 cwd=REPO, stdout=o, stderr=e,
                                 env=dict(os.environ, OTEL_EXPORTER_OTLP_ENDPOINT=receiver.url),
                                 start_new_session=True)
        scrapes: dict = {}
        try:
            while train.poll() is None and not stop.is_set() and time.monotonic() - t0 < HEALTHY_LIMIT_S:
                for rank in (0, 1):
                    try:
                        text = urllib.request.urlopen(f"http://127.0.0.1:{port + rank}/metrics",
                                                      timeout=2).read().decode()
                    except OSError:
                        continue
                    if "dflash_tokens_total{" in text and "dflash_span_seconds_bucket{" in text:
                        scrapes[rank] = text
                stop.wait(1.0)
        finally:
            if train.poll() is None:   # past its time, or the session ends first: kill it with its ranks
                os.killpg(train.pid, signal.SIGKILL)
            train.wait()
    return HealthyRun(run, train.returncode, out.read_text(), err.read_text(), time.monotonic() - t0, started,
                      port, scrapes, receiver, prometheus)


class HealthyRunner:
    """The shared healthy run made in a background thread: Prometheus (when installed) started, then the
    run watched by `_run_watched`, while the tests that do not read it go on. `result()` waits for it."""

    def __init__(self, tmp: Path):
        self.tmp, self.runs = tmp, tmp / "runs"
        self.runs.mkdir()
        self.receiver = OtlpReceiver()
        self.prometheus: subprocess.Popen | None = None
        self.stop = threading.Event()
        self._outcome: HealthyRun | BaseException | None = None
        self.thread = threading.Thread(target=self._make, name="healthy-run", daemon=True)
        self.thread.start()

    def _make(self) -> None:
        try:
            base = None
            if shutil.which("prometheus"):
                self.prometheus, base = start_prometheus(self.tmp, self.runs / "prometheus-sd" / "*.json",
                                                         rule_files=write_scaled_rules(self.tmp))
            self._outcome = _run_watched(self.runs / "run", free_port_pair(), self.receiver, base, self.stop)
        except BaseException as e:   # handed to the test that reads the run, as if it had made it
            self._outcome = e

    def result(self) -> HealthyRun:
        """The finished run (waits for it); what went wrong making it is raised here."""
        self.thread.join()
        if isinstance(self._outcome, BaseException):
            raise self._outcome
        return self._outcome

    def close(self) -> None:
        """Kill the run if it is still going; stop Prometheus and the receiver."""
        self.stop.set()
        self.thread.join()
        if self.prometheus is not None:
            self.prometheus.terminate()
            self.prometheus.wait(timeout=30)
        self.receiver.close()


@pytest.fixture(scope="session", autouse=True)
def _healthy_run_started(request, tmp_path_factory):
    """Starts the shared healthy run with the session, only when a selected test will read it (a `-k` or
    file subset that does not pays nothing); None otherwise."""
    if not any(_uses_healthy_run(item) for item in request.session.items):
        yield None
        return
    runner = HealthyRunner(tmp_path_factory.mktemp("healthy"))
    try:
        yield runner
    finally:
        runner.close()


@pytest.fixture(scope="session")
def healthy_run(_healthy_run_started, tmp_path_factory) -> HealthyRun:
    """The shared healthy run (HealthyRun), finished before any test reads it: started with the session,
    or here where no test was known to need it; Prometheus, when installed, scraped it through its
    file_sd targets and stays up for queries."""
    if _healthy_run_started is not None:
        yield _healthy_run_started.result()
        return
    runner = HealthyRunner(tmp_path_factory.mktemp("healthy"))
    try:
        yield runner.result()
    finally:
        runner.close()
