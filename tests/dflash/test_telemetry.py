"""The file_sd targets are written only into directories the run owns, never through a planted link
(issue 34 row 2)."""
import os
import stat

import pytest

from dflash.telemetry import _write_private


@pytest.fixture
def victim(tmp_path):
    v = tmp_path / "secret"
    v.write_text("root only\n")
    os.chmod(v, 0o600)
    return v


def test_links_planted_in_our_directory_are_replaced_not_followed(tmp_path, victim):
    sd = tmp_path / "prometheus-sd"
    sd.mkdir()
    (sd / f".run.json.tmp-{os.getpid()}").symlink_to(victim)
    (sd / "run.json").symlink_to(victim)
    _write_private(sd / "run.json", "[]\n", 0o755, 0o644)
    assert victim.read_text() == "root only\n" and stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert not (sd / "run.json").is_symlink() and (sd / "run.json").read_text() == "[]\n"
    assert stat.S_IMODE((sd / "run.json").stat().st_mode) == 0o644
    assert sorted(p.name for p in sd.iterdir()) == ["run.json"]


@pytest.mark.parametrize("planted", ["symlink", "other_user"])
def test_a_directory_we_do_not_own_is_refused(tmp_path, victim, planted):
    sd = tmp_path / "prometheus-sd"
    if planted == "symlink":
        target = tmp_path / "elsewhere"
        target.mkdir()
        sd.symlink_to(target)
    else:
        if os.getuid() != 0:
            pytest.skip("chown to another uid needs root")
        sd.mkdir(mode=0o777)
        (sd / f".run.json.tmp-{os.getpid()}").symlink_to(victim)
        os.chown(sd, 65534, 65534)
    with pytest.raises(PermissionError, match="refused"):
        _write_private(sd / "run.json", "[]\n", 0o755, 0o644)
    assert victim.read_text() == "root only\n" and stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert not os.path.lexists(sd / "run.json")


def test_a_metrics_host_beyond_loopback_is_warned_about_once_per_rank(tmp_path, capsys, monkeypatch):
    """Issue 34 row 12: `--metrics-host 0.0.0.0` binds every interface; the rank says so in one line."""
    from dflash import telemetry
    from dflash.config import TrainConfig

    monkeypatch.setattr(telemetry, "_write_targets", lambda *args: None)   # needs the ranks' process group
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    assert telemetry._loopback("127.0.0.1") and telemetry._loopback("localhost") and telemetry._loopback("::1")
    assert not telemetry._loopback("0.0.0.0")
    for host, warned in (("0.0.0.0", True), ("127.0.0.1", False)):
        cfg = TrainConfig()
        cfg.telemetry.metrics_host, cfg.telemetry.metrics_port = host, None   # None: the default port, or a free one
        tele = telemetry.start(cfg, tmp_path / "run", rank=1, local_rank=0, role="target", ctrl_group=None)
        exp = tele.exporters[-1]
        try:
            assert [e.name for e in tele.exporters] == ["trace", "prometheus"]   # console: rank 0 only
            err = capsys.readouterr().err
            assert ("reachable from the network" in err) is warned
            assert f"http://{host}:{exp.port}/metrics" in err or not warned
            assert len(err.splitlines()) <= 2
        finally:
            exp.close(1.0)


def test_the_metrics_endpoint_closes_last_and_serves_until_the_rank_exits(tmp_path, monkeypatch):
    """Its close waits for a scrape of the rank's last records with what the other exporters leave of the
    deadline, and the endpoint stays up (keep_serving) while the rank waits for the others."""
    from dflash import telemetry
    from dflash.config import TrainConfig

    monkeypatch.setattr(telemetry, "_write_targets", lambda *args: None)   # needs the ranks' process group
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    cfg = TrainConfig()
    cfg.telemetry.metrics_port = None
    tele = telemetry.start(cfg, tmp_path / "run", rank=0, local_rank=0, role="drafter", ctrl_group=None)
    endpoint = tele.exporters[-1]
    try:
        assert [e.name for e in tele.exporters] == ["trace", "console", "prometheus"]
        endpoint.close(0.1)
        import urllib.request
        assert b"dflash_events_total" in urllib.request.urlopen(f"http://127.0.0.1:{endpoint.port}/metrics").read()
    finally:
        endpoint.shutdown()


def test_the_trainers_port_rules_through_the_one_assembly(tmp_path, capsys, monkeypatch):
    """The default port (None): base + local rank, a busy one replaced by a free one in one line; a port the user
    gave and a host that cannot be served: ConfigError (exit 2) in one line, nothing left open."""
    import socket

    from dflash import telemetry
    from dflash.config import ConfigError, TrainConfig

    monkeypatch.setattr(telemetry, "_write_targets", lambda *args: None)   # needs the ranks' process group
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        monkeypatch.setattr("exporters.DEFAULT_METRICS_PORT", port - 1)
        cfg = TrainConfig()
        cfg.telemetry.metrics_port = None
        endpoint = telemetry.start(cfg, tmp_path / "run", rank=3, local_rank=1, role="target",
                                   ctrl_group=None).exporters[-1]
        try:
            assert endpoint.port != port
            assert capsys.readouterr().err == (f"dflash-train: rank 3: metrics port {port} is busy; serving "
                                               f"http://127.0.0.1:{endpoint.port}/metrics instead\n")
        finally:
            endpoint.shutdown()
        cfg.telemetry.metrics_port = port - 1
        with pytest.raises(ConfigError, match=rf"--metrics-port {port - 1}: port {port} on 127.0.0.1 \(rank 3 = "
                                              r"base \+ local rank\) is in use"):
            telemetry.start(cfg, tmp_path / "run", rank=3, local_rank=1, role="target", ctrl_group=None)
    cfg = TrainConfig()
    cfg.telemetry.metrics_host = "192.0.2.1"   # TEST-NET-1: an address of no machine here
    with pytest.raises(ConfigError, match="--metrics-host 192.0.2.1: cannot serve metrics there: "):
        telemetry.start(cfg, tmp_path / "run", rank=0, local_rank=0, role="drafter", ctrl_group=None)


def test_the_shared_file_sd_directory_is_one_place_whatever_the_run_directory():
    """Issue 37 item 5: the user cache's prometheus-sd (XDG_CACHE_HOME honoured), or --prometheus-sd-dir; never a
    folder beside the run directory."""
    from pathlib import Path

    from dflash.config import TrainConfig
    from dflash.telemetry import sd_dir

    cfg = TrainConfig()
    assert sd_dir(cfg, {"HOME": "/home/u"}) == Path("/home/u/.cache/dflash/prometheus-sd")
    assert sd_dir(cfg, {"HOME": "/home/u", "XDG_CACHE_HOME": "/xdg"}) == Path("/xdg/dflash/prometheus-sd")
    cfg.telemetry.prometheus_sd_dir = "/srv/sd"
    assert sd_dir(cfg, {"XDG_CACHE_HOME": "/xdg"}) == Path("/srv/sd")
