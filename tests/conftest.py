"""Fixtures shared across test packages: a real OTLP/HTTP receiver, and the built-ins of the small
CPU runs, built once per session."""
from __future__ import annotations

import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest


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

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
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


@pytest.fixture(scope="session")
def small_builtin(tmp_path_factory) -> Path:
    """RUN_DIR/builtin as a run with `--builtin-conversations 48` (seed 0, up to 16 eval prompts) builds
    it: the tiny target and both corpora, from dflash.tiny.ensure_builtin, the function rank 0 calls."""
    from dflash.tiny import ensure_builtin

    built = ensure_builtin(tmp_path_factory.mktemp("small-builtin") / "builtin", seed=0, num_train=48, num_eval=16)
    return built.train_path.parent


@pytest.fixture(scope="session")
def prebuilt(small_builtin):
    """prebuilt(run_dir) -> run_dir: a new run directory that already holds those built-ins, as one
    that a run (or a --resume) left. Rank 0 reuses a matching build (ensure_builtin checks its marker)
    instead of spending ~3.5 s of every small run's start-up building the same ones again. Tests of
    the built-ins themselves, of the run directory's creation (its mode) or of the default run do
    not use it."""
    def seed(run_dir: Path) -> Path:
        shutil.copytree(small_builtin, Path(run_dir) / "builtin")
        return Path(run_dir)

    return seed


@pytest.fixture(autouse=True)
def _keep_bytecode_settings():
    """dflash.launch, called in-process by CLI tests, may point this interpreter's bytecode at the
    compile cache (launch.use_bytecode_cache); put it back after every test."""
    import sys

    saved = sys.pycache_prefix, sys.dont_write_bytecode
    yield
    sys.pycache_prefix, sys.dont_write_bytecode = saved
