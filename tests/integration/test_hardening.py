"""Issue #13 over real processes on the CPU: no code from checkpoints, no port beyond loopback, bad
input refused before any rank starts (exit 2, one line, nothing created), a full disk said and
survived, nothing left behind, a resumed run summarised per rank. docs/RELIABILITY.md lists these."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import uuid
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from exporters.console import format_hotspots
from profiler.runlog import read_records

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "dflash" / "data" / "openai.jsonl"   # 3 conversations in the tiny vocabulary
SMALL = ["--builtin-conversations", "48", "--eval-prompts", "0", "--tokens-per-batch", "1024",
         "--max-length", "128", "--profile-interval", "2", "--device", "cpu"]


def train(args: list[str], env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, **(env or {})))


@pytest.fixture
def refused(train_main):
    """refused(args, env=None, code=2): run dflash-train in-process, expect `code` and exactly one
    stderr line (no traceback); return that line. No process of the run outlives it (the launcher
    starts its ranks behind a gate before its preflight)."""
    def call(args: list, env: dict | None = None, code: int = 2) -> str:
        mark = uuid.uuid4().hex
        r = train_main(args, dict(env or {}, DFLASH_TEST_MARK=mark))
        lines = r.stderr.strip().splitlines()
        assert r.returncode == code and len(lines) == 1, (r.returncode, r.stderr[-3000:])
        assert not set(processes_with(f"DFLASH_TEST_MARK={mark}".encode())) - {os.getpid()}
        return lines[0]

    return call


def processes_with(env_entry: bytes) -> list[int]:
    """Live pids whose environment holds `env_entry` (KEY=VALUE)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if env_entry in environ.read_bytes().split(b"\0"):
                found.append(int(environ.parent.name))
        except OSError:                      # gone meanwhile, or not ours to read
            pass
    return found


def tree(path: Path) -> dict:
    return {str(p.relative_to(path)): p.stat().st_size for p in sorted(path.rglob("*"))}


def in_mount_namespace(script: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """Run a sh script in a private mount namespace (its tmpfs mounts vanish with it)."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1)")
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs -o size=64k tmpfs /mnt"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a mount namespace: {probe.stderr.decode().strip()}")
    return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script, *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tiny_target(small_builtin) -> Path:
    """The built-in tiny target (seed 0) of the session's small built-ins; read only (variants copy it)."""
    return small_builtin / "tiny-target"


def target_variant(tiny_target: Path, where: Path, edit) -> Path:
    out = where / "target"
    shutil.copytree(tiny_target, out)
    edit(out)
    return out


# ------------------------------------------------------------------------------------- security
class RunsCode:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def saved_config(run: Path, args: list) -> None:
    """RUN_DIR/config.json as rank 0 writes it for a run made with `args` (what a --resume restores)."""
    from dflash.cli import build_parser
    from dflash.config import config_from_args

    cfg = config_from_args(build_parser().parse_args(args), env={})
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.json").write_text(json.dumps(dict(cfg.to_dict(), run_dir=str(run), run_id="run-1")))


def test_resume_refuses_a_training_state_that_would_run_code(tmp_path, refused):
    run, marker = tmp_path / "run", tmp_path / "pwned"
    ckpt = run / "checkpoints" / "step_0000004"
    ckpt.mkdir(parents=True)
    saved_config(run, SMALL)
    (run / "checkpoints" / "latest").write_text("step_0000004\n")
    save_file({"fc.weight": torch.zeros(2, 2)}, str(ckpt / "model.safetensors"))
    torch.save({"step": 4, "consumed": {1: 4}, "optimizer": RunsCode(marker), "scheduler": {}},
               ckpt / "training_state.pt")
    before = tree(run)
    line = refused(["--run-dir", str(run), "--resume", *SMALL])
    assert line.startswith(f"dflash-train: error: {ckpt / 'training_state.pt'}: refused: it references ")
    assert "system" in line
    assert not marker.exists() and tree(run) == before


def test_resume_refuses_a_checkpoint_whose_weights_header_is_bad_in_one_line_before_any_rank(tmp_path, refused):
    """Issue 46: a bad model.safetensors header was found by each rank after they started: two lines, exit 2."""
    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step_0000004"
    ckpt.mkdir(parents=True)
    saved_config(run, SMALL)
    (run / "checkpoints" / "latest").write_text("step_0000004\n")
    torch.save({"step": 4, "consumed": {1: 4}, "optimizer": {}, "scheduler": {}}, ckpt / "training_state.pt")
    save_file({"fc.weight": torch.zeros(64, 64)}, str(ckpt / "model.safetensors"))
    whole = (ckpt / "model.safetensors").read_bytes()
    for bad, why in ((whole[:len(whole) // 2], "file not fully covered"), (b"\xff" * 8 + b"{", "header too large")):
        (ckpt / "model.safetensors").write_bytes(bad)
        before = tree(run)
        line = refused(["--run-dir", str(run), "--resume"])
        assert line.startswith(f"dflash-train: error: {ckpt / 'model.safetensors'}: unreadable: ") and why in line
        assert tree(run) == before


def test_a_resume_without_the_runs_flags_trains_with_its_settings_and_keeps_an_override_history(tmp_path,
                                                                                                prebuilt):
    """Issue 46: `--resume --run-dir D --max-steps N` without the run's other flags trained on with the defaults
    (num_anchors 8, max_length 256, tokens_per_batch 2048) and overwrote config.json with them."""
    run = prebuilt(tmp_path / "run")
    first = ["--run-dir", str(run), *SMALL, "--num-anchors", "16", "--max-steps", "2"]
    r = train(first)
    assert r.returncode == 0, r.stderr[-3000:]
    r = train(["--resume", "--run-dir", str(run), "--max-steps", "4"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_0000004"
    saved = json.loads((run / "config.json").read_text())
    assert (saved["optim"]["num_anchors"], saved["data"]["max_length"], saved["data"]["tokens_per_batch"],
            saved["data"]["builtin_conversations"], saved["optim"]["max_steps"]) == (16, 128, 1024, 48, 4)
    assert [o["changed"] for o in saved["overrides"]] == [{"max_steps": {"from": 2, "to": 4}}]
    starts = [x for x in read_records(run / "profile" / "rank0.jsonl")[0] if x["type"] == "run_start"]
    assert len(starts) == 2 and starts[1]["config"]["num_anchors"] == 16   # the resumed segment trained so
    assert (starts[1]["config"]["tokens_per_batch"], starts[1]["config"]["max_length"]) == (1024, 128)
    check = subprocess.run([sys.executable, "-m", "dflash.report_cli", "check", str(run)], cwd=REPO,
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout[-3000:]


def test_a_run_with_a_target_model_resumes_without_repeating_it(tmp_path, small_builtin):
    """Issue 46: on the GPU a --target-model run resumed without its flags built the default target: a 40-line
    load_state_dict size-mismatch traceback, exit 1. The built-in target's directory serves as a local target."""
    run = tmp_path / "run"
    given = ["--target-model", str(small_builtin / "tiny-target"), "--data", str(small_builtin / "train.jsonl")]
    r = train(["--run-dir", str(run), *given, *SMALL, "--max-steps", "2"])
    assert r.returncode == 0, r.stderr[-3000:]
    r = train(["--resume", "--run-dir", str(run), "--max-steps", "3"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_0000003" and not (run / "builtin").exists()
    saved = json.loads((run / "config.json").read_text())
    assert saved["model"]["target_model"] == str(small_builtin / "tiny-target")
    line = refused_line(["--resume", "--run-dir", str(run), "--target-model", str(tmp_path)])
    assert line.startswith("dflash-train: error: --resume: config field 'model.target_model' cannot change from ")


def refused_line(args: list) -> str:
    r = train(args, timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, (r.returncode, r.stderr[-3000:])
    return lines[0]


def listeners(pids: list[int]) -> list[tuple[str, int]]:
    """(address, port) of every listening TCP socket the processes hold, from /proc."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                link = os.readlink(fd)
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    found = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for row in Path(table).read_text().splitlines()[1:]:
            cols = row.split()
            if cols[3] != "0A" or cols[9] not in inodes:   # 0A: LISTEN
                continue
            hex_ip, hex_port = cols[1].split(":")
            raw = bytes.fromhex(hex_ip)
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))   # per-word host order
            found.append((socket.inet_ntop(family, raw), int(hex_port, 16)))
    return found


def children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(k) for k in (task / "children").read_text().split()]
    return kids


def test_a_live_run_listens_on_loopback_only_keeps_its_files_private_and_records_sigint(tmp_path):
    run = tmp_path / "run"
    # The flag wins over an invalid env value it overrides.
    p = subprocess.Popen([sys.executable, "-m", "dflash.cli", "--run-dir", str(run), "--max-steps", "10000",
                          *SMALL], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, DFLASH_PROFILE_INTERVAL="abc"))
    try:
        log = run / "profile" / "rank1.jsonl"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not (
                log.is_file() and any(x["type"] == "interval" for x in read_records(log)[0])):
            time.sleep(0.5)
        ranks = children(p.pid)
        assert len(ranks) == 2, ranks
        found = listeners([p.pid, *ranks])
        master_port = int(dict(v.split("=", 1) for v in Path(f"/proc/{ranks[0]}/environ").read_text()
                               .split("\0") if "=" in v)["MASTER_PORT"])
        assert ("127.0.0.1", master_port) in found   # the rendezvous store, on rank 0
        assert len(found) > 1 and {addr for addr, _ in found} <= {"127.0.0.1", "::1"}, found
        assert (run.stat().st_mode & 0o777) == 0o700
        for f in (run / "config.json", log, run / "control" / "rank0.sock"):
            assert (f.stat().st_mode & 0o777) == 0o600, f
    finally:
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-3000:]
    for rank in (0, 1):
        sig = [x["signal"] for x in read_records(run / "profile" / f"rank{rank}.jsonl")[0]
               if x["type"] == "event" and x["kind"] == "signal"]
        assert sig == ["SIGINT"], (rank, sig)
    latest = (run / "checkpoints" / "latest").read_text().strip()
    assert all((f.stat().st_mode & 0o777) == 0o600 for f in (run / "checkpoints" / latest).iterdir())


# ---------------------------------------------------------------------- bad input before any work
def test_target_with_an_unknown_model_type_is_refused_before_any_rank(tmp_path, tiny_target, refused):
    def unknown(d):
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps(dict(cfg, model_type="not_a_model")))

    target = target_variant(tiny_target, tmp_path, unknown)
    line = refused(["--run-dir", str(tmp_path / "run"), "--target-model", str(target), "--data", str(DATA), *SMALL])
    assert line == (f"dflash-train: error: {target / 'config.json'}: unknown model_type 'not_a_model' "
                    "(this transformers has no such architecture)")
    assert not (tmp_path / "run").exists()


def test_target_without_weights_is_refused_before_any_rank(tmp_path, tiny_target, refused):
    target = target_variant(tiny_target, tmp_path, lambda d: (d / "model.safetensors").unlink())
    args = ["--run-dir", str(tmp_path / "run"), "--target-model", str(target), "--data", str(DATA), *SMALL]
    assert refused(args) == (f"dflash-train: error: --target-model {target}: no model.safetensors or "
                             "model.safetensors.index.json (weights load from safetensors only)")
    (target / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}))
    assert refused(args) == (f"dflash-train: error: {target / 'model.safetensors.index.json'}: names "
                             "model-00001-of-00002.safetensors, which does not exist")
    assert not (tmp_path / "run").exists()


def test_a_valid_target_directory_passes_preflight(tmp_path, tiny_target):
    from dflash import preflight
    from dflash.config import resolve_config

    cfg = resolve_config({}, {}, {"target_model": str(tiny_target), "data": str(DATA), "device": "cpu",
                                  "run_dir": str(tmp_path / "run")})
    preflight.check(cfg, 2, 2)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flags,line", [
    (["--attn-backend", "flex"], "--attn-backend flex: FlexAttention has no backward pass on the CPU; "
                                 "use dense (auto picks it there)"),
    (["--transfer", "nccl"], "--transfer nccl: needs CUDA devices; this run is on the CPU"),
    (["--profile-interval", "inf"], "config field 'profile.interval_s': must be a finite number (got inf)"),
])
def test_impossible_choices_on_this_machine_are_refused_before_any_rank(tmp_path, flags, line, refused):
    assert refused(["--run-dir", str(tmp_path / "run"), *SMALL, *flags]) == f"dflash-train: error: {line}"
    assert not (tmp_path / "run").exists()


def test_a_read_only_run_directory_is_refused_before_any_rank(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    r = in_mount_namespace('mount -t tmpfs -o ro,size=64k tmpfs "$0" && exec "$1" -m dflash.cli --run-dir "$0/run" '
                           + " ".join(SMALL), str(ro), sys.executable)
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.strip().splitlines() == [f"dflash-train: error: --run-dir {ro / 'run'}: not writable: "
                                             f"read-only file system (nearest existing directory {ro})"]


def test_bad_bytes_and_huge_lines_are_named_by_file_and_line_before_any_rank(tmp_path, refused):
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(good.replace("yo", "y\u00f6").encode("latin-1") + b"\n" + good.encode() + b"\n")
    line = refused(["--run-dir", str(tmp_path / "run"), "--data", str(latin1), "--on-bad-record", "fail", *SMALL])
    assert line.startswith(f"dflash-train: error: {latin1}:1: not valid UTF-8 (byte 0xf6 at column ")
    huge = tmp_path / "huge.jsonl"
    with open(huge, "w") as f:   # one 17 MB record: a bad record, read past, never tokenised
        f.write(good.replace('"yo"', '"' + "yo " * 5_800_000 + '"') + "\n" + good + "\n")
    line = refused(["--run-dir", str(tmp_path / "run"), "--data", str(huge), "--on-bad-record", "fail", *SMALL])
    assert line == f"dflash-train: error: {huge}:1: line longer than 16777216 bytes"
    assert not (tmp_path / "run").exists()


def test_resume_no_resume_is_documented_the_last_wins(train_main):
    r = train_main(["--help"])
    assert r.returncode == 0 and "(--resume --no-resume), the last one wins" in " ".join(r.stdout.split())


# ------------------------------------------------------------------------------------ rendezvous
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_rendezvous_missing_a_rank_says_what_it_waits_for_and_times_out(tmp_path):
    port = free_port()
    env = dict(os.environ, RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    p = subprocess.Popen([sys.executable, "-m", "dflash.cli", "--run-dir", str(tmp_path / "run"),
                          "--rendezvous-timeout-s", "6", *SMALL], cwd=REPO, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    seen: list = []
    deadline = time.monotonic() + 60
    while p.poll() is None and not seen and time.monotonic() < deadline:
        seen = [a for a in listeners([p.pid]) if a[1] == port]
        time.sleep(0.2)
    out, err = p.communicate(timeout=120)
    assert seen == [("127.0.0.1", port)]   # MASTER_ADDR, not every interface
    assert p.returncode == 1
    waiting, error = err.strip().splitlines()
    assert waiting == ("dflash-train: rank 0: waiting up to 6 s for all 2 ranks (WORLD_SIZE) to join at "
                       f"127.0.0.1:{port}")
    assert error.startswith(f"dflash-train: error: rank 0: rendezvous at 127.0.0.1:{port}: Timed out after ")
    assert error.endswith("1/2 clients joined. (WORLD_SIZE=2, --rendezvous-timeout-s 6)")
    assert not (tmp_path / "run").exists()
    env.update(RANK="1")
    r = subprocess.run([sys.executable, "-m", "dflash.cli", "--rendezvous-timeout-s", "3", *SMALL], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == (f"dflash-train: error: rank 1: rendezvous at 127.0.0.1:{port}: "
                                                 "nothing listened there within 3 s (--rendezvous-timeout-s)")


# -------------------------------------------------------------------- a full disk, nothing behind
def test_a_full_disk_says_so_keeps_the_previous_checkpoint_and_exits_1(tmp_path, prebuilt):
    run = prebuilt(tmp_path / "run")
    (run / "checkpoints").mkdir(parents=True)
    # One checkpoint of the built-in run is about 4.5 MB: the first fits, the second does not.
    script = ('mount -t tmpfs -o size=6m tmpfs "$0/checkpoints" && "$1" -m dflash.cli --run-dir "$0" --max-steps 8 '
              '--checkpoint-every 4 ' + " ".join(SMALL) + '; rc=$?; echo listing: $(ls -A "$0/checkpoints"); '
              'echo "latest: $(cat "$0/checkpoints/latest")"; exit $rc')
    r = in_mount_namespace(script, str(run), sys.executable)
    assert r.returncode == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    ckpts = run / "checkpoints"
    assert (f"dflash-train: error: rank 0: checkpoint {ckpts / 'step_0000008'} not written: no space left on "
            f"device (ENOSPC); kept {ckpts / 'step_0000004'} as latest") in r.stderr.splitlines()
    assert "listing: latest step_0000004" in r.stdout.splitlines()   # no partial step_0000008.tmp-PID
    assert "latest: step_0000004" in r.stdout.splitlines()
    end = [x for x in read_records(run / "profile" / "rank0.jsonl")[0] if x["type"] == "run_end"][-1]
    assert end["status"] == "CheckpointWriteError"


# A run on an 8 MB tmpfs (the built-ins take 5 of it) until its third interval, then the rest filled by `dd`;
# the run directory is copied out (less the built-ins and the filler) before the namespace and its tmpfs go.
FILL_MID_RUN = """mount -t tmpfs -o size=8m tmpfs "$0" && cp -r "$3" "$0/builtin" || exit 99
timeout 200 "$1" -m dflash.cli --run-dir "$0" --max-steps 100000 --profile-interval 1 $2 &
train=$!
for i in $(seq 800); do
  n=$(grep -c '"type": "interval"' "$0/profile/rank0.jsonl" 2>/dev/null)
  [ "${n:-0}" -ge 3 ] && break
  sleep 0.25
done
dd if=/dev/zero of="$0/fill" bs=64k 2>/dev/null
wait $train; rc=$?
mkdir -p "$0.out" && tar -C "$0" --exclude=./builtin --exclude=./fill -cf - . | tar -C "$0.out" -xf -
exit $rc"""


def test_a_disk_that_fills_mid_run_stops_each_rank_in_one_line_with_whole_logs_ending_in_run_end(tmp_path,
                                                                                                  small_builtin):
    """Issue 34 row 7: before, 223 stderr lines, 15 tracebacks, torn last lines and no run_end. Each rank's run
    log keeps room past its end for its run_end; when a write (its own, or the throughput file's) finds the disk
    full, the rank stops at its next step boundary, ends its transfers, writes run_end there and says why in one
    line naming the file; the other writers stay quiet (the trace's rewrite, the final checkpoint is not tried)."""
    run = tmp_path / "run"
    run.mkdir()
    args = " ".join(a for a in SMALL if a not in ("--profile-interval", "2"))
    r = in_mount_namespace(FILL_MID_RUN, str(run), sys.executable, args, str(small_builtin))
    # a busy default metrics port (another run on the machine) is said in a line of its own, before any step
    lines = [x for x in r.stderr.strip().splitlines() if not re.search(r": metrics port \d+ is busy; serving ", x)]
    assert r.returncode == 1 and lines and "Traceback" not in r.stderr, r.stderr[-3000:]
    said = {}
    for line in lines:   # one line per rank that found the disk full, naming the file it could not write
        head, _, rest = line.partition(": no space left on device: ")
        assert head.startswith("dflash-train: error: rank ") and rest.startswith(f"{run}/"), r.stderr[-3000:]
        said[int(head.rsplit(" ", 1)[1])] = rest
    assert len(said) == len(lines) and all(" could not be written; stopped " in x for x in said.values()), lines
    out = run.parent / "run.out"
    for rank in (0, 1):
        log = out / "profile" / f"rank{rank}.jsonl"
        recs, bad = read_records(log)
        assert bad == 0 and log.read_bytes().endswith(b"\n")   # whole lines only, none torn
        [end] = [x for x in recs if x["type"] == "run_end"]
        # a rank that found the disk full stops on it; its peer may first end on the protocol's END it sent (a
        # loaded machine orders them so), its own log full all the same, and then finds it only as its last
        # records go in: it ended ok, and says the disk filled "as the run ended"
        stopped_on_it = rank in said and not said[rank].endswith("stopped as the run ended")
        assert recs[-1] is end and end["status"] == ("DiskFullStop" if stopped_on_it else "ok"), (rank, said)
        assert end["run_log"]["error"] == "No space left on device" and end["run_log"]["dropped_records"] >= 1
    assert said   # at least one rank found the disk full and said so
    assert not [p.name for p in out.rglob("*") if ".tmp" in p.name]   # no half-written file left
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").glob("step_*"))
    from profiler.report.check import check_run
    assert check_run(out) == []


def test_resume_cleans_partials_and_summarises_per_rank_and_skipped_eval_is_said(tmp_path, prebuilt):
    run = prebuilt(tmp_path / "run")
    common = ["--run-dir", str(run), "--data", str(DATA), *SMALL, "--eval-prompts", "8"]
    r = train([*common, "--max-steps", "4", "--checkpoint-every", "2"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert (f"dflash-train: evaluation skipped: {DATA} has 3 usable records, too few to hold out --eval-prompts 8 "
            "and train on the rest") in r.stderr.splitlines()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    partial = run / "checkpoints" / f"step_0000006.tmp-{dead}"   # a writer that died mid-save
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"half")
    r = train([*common, "--max-steps", "8", "--resume"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert not partial.exists() and (run / "checkpoints" / "step_0000008").is_dir()
    ends = [x for rank in (0, 1) for x in read_records(run / "profile" / f"rank{rank}.jsonl")[0]
            if x["type"] == "run_end"]
    assert len(ends) == 4   # two segments per rank
    target = [x for x in ends if x["role"] == "target"]
    wall = sum(x["duration_seconds"] for x in target)
    tokens = sum(x["counters"]["tokens"]["total"] for x in target)
    line = next(x for x in r.stdout.splitlines() if x.startswith("target ("))
    assert line.startswith(f"target (1 rank, {wall:.1f} s, whole run):") and f"tokens {tokens / wall:.1f}/s" in line
    assert any(x.startswith("drafter (1 rank, ") for x in r.stdout.splitlines())


def test_summary_of_segments_counts_ranks_once_and_rates_per_rank():
    """Unit-level twin of the test above: 2 segments of one rank are one rank at its overall rate."""
    seg = [{"type": "run_end", "rank": 1, "role": "target", "duration_seconds": d, "spans": {},
            "counters": {"tokens": {"total": n, "per_second": n / d}}} for d, n in ((10.0, 1000), (30.0, 1000))]
    other = {"type": "run_end", "rank": 2, "role": "target", "duration_seconds": 20.0, "spans": {},
             "counters": {"tokens": {"total": 400, "per_second": 20.0}}}
    assert "target (1 rank, 40.0 s, whole run): tokens 50.0/s" in format_hotspots(seg)
    assert "target (2 ranks, 60.0 s, whole run): tokens 70.0/s" in format_hotspots([*seg, other])
