"""What a rank exports besides its run log, made by exporters.build with dflash-train's settings: the Prometheus
endpoint (with the run's file_sd targets), OpenTelemetry when OTEL_EXPORTER_OTLP_ENDPOINT is set, the Perfetto
trace, and on rank 0 the console summary. The endpoint answers until the rank's process exits (the alerts read a
missing rank as a dead one).

`start()` makes the exporters the profiler feeds; `close()` at run end withdraws the run from the
shared file_sd directory so a Prometheus stops scraping endpoints that are gone. Rank 0 writes the
targets once every rank has bound its port (an all-gather over the gloo control group).
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

import exporters
from dflash.compile_cache import foreign_component, resolve_cache_dir
from dflash.config import ConfigError, TrainConfig
from profiler.runlog import is_disk_full

SD_DIR_NAME = "prometheus-sd"   # the shared file_sd directory's name under the user cache (sd_dir)


@dataclass
class Telemetry:
    exporters: list = field(default_factory=list)
    sd_files: list = field(default_factory=list)
    """file_sd copies to remove at run end (rank 0 only)."""

    def close(self) -> None:
        for path in self.sd_files:
            try:
                path.unlink()
            except FileNotFoundError:
                pass


def start(cfg: TrainConfig, run_dir: Path, rank: int, local_rank: int, role: str, ctrl_group,
          run_id: str | None = None) -> Telemetry:
    """The rank's exporters (none under --no-profile); ConfigError (exit 2) when a metrics port the user asked for
    is taken or the metrics host cannot be served. `run_id`: the run's unique id (dflash.worker; default the
    directory's name), the `run` label and OTel's dflash.run_id."""
    if not cfg.profile.enabled:
        return Telemetry()
    run_id = run_id or run_dir.name
    tele = Telemetry(exporters=_make(cfg, exporters.Owner(run_dir, rank, role, run_id), local_rank))
    endpoint = next((e for e in tele.exporters if e.name == "prometheus"), None)
    try:
        _write_targets(cfg, run_dir, run_id, rank, endpoint, ctrl_group, tele)
    except BaseException:
        for exporter in tele.exporters:   # no profiler will close them (OTel has threads running)
            exporter.close(0.0)
        raise
    return tele


def _make(cfg: TrainConfig, owner: exporters.Owner, local_rank: int) -> list:
    """exporters.build with dflash-train's settings: OTel from the environment, the trace, the console on rank 0
    (the worker prints the run's end itself) and, unless --metrics-port 0, the endpoint on base + local rank,
    last: its close waits for a scrape of the final records with what is left of the exporters' deadline."""
    from exporters.prometheus import MetricsBindError, MetricsPortInUse

    tel = cfg.telemetry
    names = (["otel"] if exporters.otel_configured() else []) + ["trace", "console"]
    names += [n.strip() for n in tel.sinks.split(",") if n.strip()]
    names += ["prometheus"] if tel.metrics_port != 0 else []
    make = exporters.build(
        ",".join(names), metrics_host=tel.metrics_host,
        metrics_port=tel.metrics_port if tel.metrics_port is not None else exporters.DEFAULT_METRICS_PORT,
        # a port the user gave is theirs or an error; keep_serving: a rank done before the others still answers
        # (with its final values) until it exits, so `up` stays 1 while its run is listed
        strict_port=tel.metrics_port is not None, port_offset=local_rank, keep_serving=True,
        console_run_end=False, announce=lambda served: _said(served, tel.metrics_host))
    try:
        return make(owner)
    except MetricsPortInUse:
        raise ConfigError(f"--metrics-port {tel.metrics_port}: port {tel.metrics_port + local_rank} on "
                          f"{tel.metrics_host} (rank {owner.rank} = base + local rank) is in use; choose another "
                          "base port, or 0 for no endpoint") from None
    except MetricsBindError as exc:
        raise ConfigError(f"--metrics-host {tel.metrics_host}: cannot serve metrics there: {exc.strerror or exc}") \
            from None


def _said(served: exporters.Served, host: str) -> None:
    """dflash-train's lines about its endpoint: one when it is reachable from the network, one when the default
    port was busy and another serves."""
    if not _loopback(host):
        print(f"dflash-train: rank {served.rank}: warning: the metrics endpoint {served.url} has no authentication "
              "and is reachable from the network (--metrics-host 127.0.0.1 keeps it on this machine)",
              file=sys.stderr, flush=True)
    if served.port != served.asked_port:
        print(f"dflash-train: rank {served.rank}: metrics port {served.asked_port} is busy; serving {served.url} "
              "instead", file=sys.stderr, flush=True)


def _loopback(host: str) -> bool:
    """Whether `host` (a name or an address) resolves to loopback only."""
    import ipaddress
    try:
        addrs = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(addrs) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs)


def sd_dir(cfg: TrainConfig, env=None) -> Path:
    """Where every run writes its shared file_sd copy: --prometheus-sd-dir, else $XDG_CACHE_HOME/dflash/prometheus-sd
    (else ~/.cache/dflash/prometheus-sd): one place per user, whatever --run-dir says."""
    return resolve_cache_dir(cfg.telemetry.prometheus_sd_dir, env, name=SD_DIR_NAME)


def _write_targets(cfg: TrainConfig, run_dir: Path, run_id: str, rank: int, endpoint, ctrl_group,
                   tele: Telemetry) -> None:
    """RUN_DIR/prometheus/targets.json (and the shared copy SD_DIR/RUN_ID.json) listing every rank's endpoint,
    labelled with the run's unique id (`run`) and its directory's name (`run_dir`)."""
    mine = None
    if endpoint is not None:
        addr = endpoint.host if endpoint.host not in ("0.0.0.0", "::", "") else socket.gethostname()
        mine = f"{addr}:{endpoint.port}" if ":" not in addr else f"[{addr}]:{endpoint.port}"
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine, group=ctrl_group)
    targets = [t for t in everyone if t is not None]
    if rank != 0 or not targets:
        return
    text = json.dumps([{"targets": targets, "labels": {"run": run_id, "run_dir": run_dir.name}}], indent=2) + "\n"
    # A full disk: no targets, quietly (the run log finds it too, and the rank stops saying so).
    with _unless_disk_full():
        _write_private(run_dir / "prometheus" / "targets.json", text, 0o700, 0o600)
    # The shared copy holds only endpoint addresses and the run's names, and is made readable on purpose:
    # a Prometheus (a container, a service user) runs as another user. The run's own stays private.
    shared = sd_dir(cfg) / f"{run_id}.json"
    try:
        with _unless_disk_full():
            write_shared(shared, text)
            tele.sd_files.append(shared)
    except OSError as exc:   # PermissionError: another user's directory, a link; or one that cannot be made
        print(f"dflash-train: warning: no shared file_sd copy: {exc}", file=sys.stderr, flush=True)


def write_shared(path: Path, text: str) -> None:
    """The shared file_sd copy, in a directory made 0755: refused (PermissionError) before any mkdir or chmod when
    a component of the way there (a middle symlink included) is neither ours nor root's."""
    foreign = foreign_component(path.parent)
    if foreign:
        raise PermissionError(foreign)
    _write_private(path, text, 0o755, 0o644)


@contextlib.contextmanager
def _unless_disk_full():
    """Skip the rest of the block when a write in it finds the disk full; any other OSError goes on up."""
    try:
        yield
    except OSError as exc:
        if not is_disk_full(exc):
            raise


def _own_dir_fd(path: Path, mode: int) -> int:
    """An open descriptor of directory `path` (created with `mode` when missing), opened without
    following a link and refused (PermissionError) unless it is a real directory of this user; then
    given `mode`. Nothing is written in a directory another user planted or a link points to."""
    path.mkdir(mode=mode, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        raise PermissionError(f"{path} is not a real directory (a symlink or a file): refused") from exc
    st = os.fstat(fd)
    if st.st_uid != os.getuid():
        os.close(fd)
        raise PermissionError(f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.getuid()}): refused")
    os.fchmod(fd, mode)
    return fd


def _write_private(path: Path, text: str, dir_mode: int, file_mode: int) -> None:
    """Write `path` whole: a temporary file created exclusively (O_EXCL, no link followed) in the checked
    directory, then renamed over `path` (Prometheus re-reads file_sd files on change: never half a file)."""
    dir_fd = _own_dir_fd(path.parent, dir_mode)
    tmp = f".{path.name}.tmp-{os.getpid()}"
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dir_fd)   # our own leftover: the directory is ours alone to write
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, file_mode, dir_fd=dir_fd)
        try:
            with os.fdopen(fd, "w") as f:
                os.fchmod(f.fileno(), file_mode)   # past the ranks' umask 077
                f.write(text)
            os.replace(tmp, path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            os.unlink(tmp, dir_fd=dir_fd)   # a failed write (a full disk) leaves nothing behind
            raise
    finally:
        os.close(dir_fd)
