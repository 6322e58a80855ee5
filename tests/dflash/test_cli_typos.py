"""A mistyped flag or subcommand is one line naming the closest, exit 2; a prefix of a flag is not that flag."""
from __future__ import annotations

import pytest

from dflash import cli, profile_cli, report_cli


def _error(parser, argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        parser.parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err   # one line, no usage block
    return err


def test_a_prefix_is_not_accepted_and_the_flag_it_meant_is_named(capsys):
    err = _error(cli.build_parser(), ["--profile-interv", "60"], capsys)
    assert err == ("dflash-train: error: unknown flag --profile-interv (did you mean --profile-interval?); "
                   "dflash-train --help lists them\n")
    assert "did you mean --profile-interval?" in _error(cli.build_parser(), ["--profile-intervl=60"], capsys)
    assert "did you mean" not in _error(cli.build_parser(), ["--zzzzzz"], capsys)
    assert cli.build_parser().parse_args(["--profile-interval", "60"]).profile_interval == "60"   # a string: config checks it


def test_subcommands_flags_and_names_are_suggested_too(capsys):
    assert "(did you mean --json?)" in _error(report_cli.build_parser(), ["hotspots", "RUN", "--jsn"], capsys)
    assert "(did you mean hotspots?)" in _error(report_cli.build_parser(), ["hotspot", "RUN"], capsys)
    assert "dflash-profile snapshot: error:" in _error(profile_cli.build_parser(), ["snapshot", "--pidd", "1"], capsys)
