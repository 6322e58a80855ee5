"""dflash.builtin's user cache of the built-in target and corpus: one entry per content, copied into the
run directory, built atomically (two builders at once), refused when another user could have filled it."""

from __future__ import annotations

import filecmp
import os
from pathlib import Path

import pytest

from dflash import builtin
from dflash.config import ConfigError, TrainConfig
from dflash.tiny import builtin_complete, builtin_settings


def same_tree(a: Path, b: Path) -> bool:
    """Whether two directories hold the same names with the same bytes, recursively."""
    cmp = filecmp.dircmp(a, b)
    if cmp.left_only or cmp.right_only or cmp.funny_files:
        return False
    _, mismatch, errors = filecmp.cmpfiles(a, b, cmp.common_files, shallow=False)
    return not mismatch and not errors and all(same_tree(a / d, b / d) for d in cmp.common_dirs)


def test_the_cached_build_is_copied_into_each_run_and_a_changed_setting_is_a_new_entry(small_builtin, tmp_path):
    """A run's RUN_DIR/builtin is a copy of the entry (the run carries its target); a second run copies the same
    entry without building (the entry's files untouched); a different seed makes its own entry."""
    root = builtin.builtin_cache_dir()
    settings = builtin_settings(0, 48, 16)
    assert small_builtin == root / builtin.cache_key(settings)   # the session's build is that entry
    stamp = (small_builtin / "tiny-target" / "model.safetensors").stat().st_mtime_ns
    runs = [builtin.copy_from_cache(root, tmp_path / name / "builtin", settings) for name in ("a", "b")]
    for data in runs:
        assert builtin_complete(data.train_path.parent, settings)
        assert same_tree(data.train_path.parent, small_builtin)
        assert data.target_dir.resolve() != (small_builtin / "tiny-target").resolve()   # a copy, not a link
    assert (small_builtin / "tiny-target" / "model.safetensors").stat().st_mtime_ns == stamp
    assert not list(tmp_path.glob("*/.builtin.tmp-*"))
    other = builtin_settings(1, 16, 16)
    assert builtin.cache_key(other) != builtin.cache_key(settings)
    entry = builtin.cached_build(tmp_path / "cache", other)
    assert entry.name == builtin.cache_key(other) and builtin_complete(entry, other)
    assert not filecmp.cmp(entry / "train.jsonl", small_builtin / "train.jsonl", shallow=False)


def _build_in_child(root: str, settings: dict, barrier, out) -> None:
    """A builder process: build, then wait at the barrier so that both have built before either publishes."""
    out.put(str(builtin.cached_build(Path(root), settings, before_publish=lambda: barrier.wait(120))))


def test_two_processes_building_the_same_entry_at_once_leave_one_whole_entry(tmp_path, rank_processes):
    """Both build in their own temporary directory and reach the rename together: the first rename wins, the
    other's build is dropped, and the entry is whole, with no temporary directory left."""
    root, settings = tmp_path / "cache", builtin_settings(2, 16, 16)
    barrier, out = rank_processes.Barrier(2), rank_processes.Queue()
    procs = [rank_processes.Process(target=_build_in_child, args=(str(root), settings, barrier, out))
             for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    assert [p.exitcode for p in procs] == [0, 0]
    entry = root / builtin.cache_key(settings)
    assert {out.get(timeout=5) for _ in procs} == {str(entry)}
    assert builtin_complete(entry, settings)
    assert sorted(p.name for p in root.iterdir()) == [entry.name]
    assert builtin.cached_build(root, settings, before_publish=lambda: pytest.fail("rebuilt")) == entry


def test_a_broken_entry_is_rebuilt_and_dead_builders_partials_are_removed(tmp_path):
    root, settings = tmp_path / "cache", builtin_settings(3, 16, 16)
    entry = root / builtin.cache_key(settings)
    (entry / "tiny-target").mkdir(parents=True)          # half an entry (copied in by hand, say)
    dead = root / f".{entry.name}.tmp-999999999"          # a builder that died
    (dead / "tiny-target").mkdir(parents=True)
    assert builtin.cached_build(root, settings) == entry
    assert builtin_complete(entry, settings)
    assert sorted(p.name for p in root.iterdir()) == [entry.name]


@pytest.mark.parametrize("plant", ["group-writable", "symlink", "others-parent"])
def test_an_unsafe_cache_is_refused_in_one_line_before_any_rank(tmp_path, train_main, plant):
    """The compile cache's rules: the cache and every directory above it must be yours (or root's) and writable
    by nobody else unless sticky; the preflight refuses it with exit 2 and creates nothing."""
    xdg = tmp_path / "xdg"
    cache = xdg / "dflash" / "builtin"
    if plant == "symlink":
        (tmp_path / "elsewhere").mkdir()
        cache.parent.mkdir(parents=True)
        cache.symlink_to(tmp_path / "elsewhere")
    else:
        cache.mkdir(parents=True, mode=0o700)
        os.chmod(cache if plant == "group-writable" else cache.parent,
                 0o770 if plant == "group-writable" else 0o777)
    r = train_main(["--run-dir", tmp_path / "run", "--max-steps", "1", "--compile-cache-dir", tmp_path / "cc"],
                   env={"XDG_CACHE_HOME": str(xdg)})
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"dflash-train: error: built-in cache {cache}: "), r.stderr
    assert "--no-cache" in lines[0] and "Traceback" not in r.stderr
    assert not (tmp_path / "run").exists()


def test_no_cache_builds_in_the_run_directory_and_leaves_the_cache_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    cfg = TrainConfig()
    cfg.data.builtin_conversations, cfg.data.eval_prompts, cfg.data.builtin_cache = 16, 0, False
    paths = builtin._prepare_local(cfg, tmp_path / "run")
    assert paths.target_dir == tmp_path / "run" / "builtin" / "tiny-target"
    assert builtin_complete(tmp_path / "run" / "builtin", builtin_settings(0, 16, 16))
    assert not (tmp_path / "xdg").exists()


def test_a_run_directory_holding_something_else_under_builtin_is_refused(small_builtin, tmp_path):
    dest = tmp_path / "run" / "builtin"
    dest.mkdir(parents=True)
    (dest / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="not a built-in build"):
        builtin.copy_from_cache(builtin.builtin_cache_dir(), dest, builtin_settings(0, 48, 16))
    assert (dest / "notes.txt").read_text() == "keep me"
    assert not list(dest.parent.glob(".builtin.tmp-*"))


@pytest.mark.parametrize("damaged", ["tiny-target/model.safetensors", "train.jsonl"])
def test_a_truncated_file_in_a_cache_entry_is_named_set_aside_and_rebuilt(tmp_path, damaged, capsys):
    """Issue 46: a truncated model.safetensors in the cache was two SafetensorError tracebacks at every run until
    the entry was deleted by hand; a truncated train.jsonl trained on 8 of 48 conversations, the line naming the
    run's copy, not the cache. The manifest written at build (sizes and sha256) finds both at the next use."""
    root, settings = tmp_path / "cache", builtin_settings(4, 16, 16)
    entry = builtin.cached_build(root, settings)
    whole = (entry / damaged).read_bytes()
    run = builtin.copy_from_cache(root, tmp_path / "run" / "builtin", settings).train_path.parent
    assert builtin.manifest_problem(run) is None   # the run's copy carries the manifest too
    (entry / damaged).write_bytes(whole[: len(whole) // 3])
    again = builtin.cached_build(root, settings)
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("dflash-train:")]
    assert err == [f"dflash-train: built-in cache entry {entry}: {damaged} is {len(whole) // 3} bytes, {len(whole)} "
                   f"as built (truncated or changed); set aside as .{entry.name}.damaged-{os.getpid()} and built "
                   "again"]
    assert again == entry and (entry / damaged).read_bytes() == whole and builtin.manifest_problem(entry) is None
    assert (root / f".{entry.name}.damaged-{os.getpid()}").is_dir()   # kept aside, removed by a later build
    (run / damaged).write_bytes(whole[:10])        # the run's own copy damaged: copied again from the cache
    builtin.copy_from_cache(root, run, settings)
    assert (run / damaged).read_bytes() == whole
