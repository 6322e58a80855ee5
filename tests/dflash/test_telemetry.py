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
