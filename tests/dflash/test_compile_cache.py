"""dflash.compile_cache and the compiled flex path: one compile for every batch shape, the compile cache
(where it lives, what preflight refuses, that a restart hits it), and compile time as `drafter.compile`."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import profiler
from dflash import preflight
from dflash.attention import BlockLayout, MaskSet, build_layout, compiled, flex_block_mask, mark_lengths_dynamic
from dflash.cli import main
from dflash.compile_cache import (_compiling_frame_name, bytecode_env, bytecode_missing, cache_dir_problem,
                                  _spans, install_compile_spans, resolve_cache_dir, setup_cache)
from dflash.config import ConfigError, resolve_config


def uninstall_compile_spans() -> None:
    """Remove the compile-span callbacks (a no-op when they are not registered)."""
    from torch._dynamo import callback_handler

    for callbacks, fn in ((callback_handler.start_callbacks, _spans.start),
                          (callback_handler.end_callbacks, _spans.end)):
        while fn in callbacks:
            callbacks.remove(fn)


REPO = Path(__file__).resolve().parents[2]


class CompileLog:
    """Every compile torch starts, as (trigger, compile id "frame/recompile", function name or None),
    through its callbacks."""

    def __init__(self):
        from torch._dynamo import callback_handler

        self.handler, self.starts = callback_handler, []
        self.handler.register_start_callback(self._start)

    def _start(self, args=None):
        self.starts.append((args.callback_trigger.name, args.compile_id, _compiling_frame_name()))

    def close(self):
        self.handler.remove_start_callback(self._start)

    def of(self, *frames: str) -> list:
        """The compiles of these functions' frames: their dynamo traces and their lazy backwards."""
        ids = {cid.split("/")[0] for _, cid, frame in self.starts if frame in frames}
        return [(t, cid, frame) for t, cid, frame in self.starts if cid.split("/")[0] in ids]


def _layout(n: int, m: int, block_size: int, seed: int) -> BlockLayout:
    """Two documents over n context tokens, m sorted anchors drawn among them."""
    g = torch.Generator().manual_seed(seed)
    doc = (torch.arange(n) >= n // 2).to(torch.int32)
    pos = torch.arange(n) - torch.where(doc == 1, n // 2, 0)
    anchors = torch.sort(torch.randperm(n - 1, generator=g)[:m] + 1).values
    return build_layout(doc, pos, doc[anchors], anchors, pos[anchors], block_size)


# ---------------------------------------------------------------------------- one compile, any shape
def test_changing_context_and_anchor_counts_compile_flex_once_and_the_mask_never():
    """flex (aot_eager: inductor's CPU flex template cannot compile a dynamic query length in torch 2.13,
    so the CUDA test below covers inductor's flex) over batches whose N and M all differ, including one
    with few anchors (one query tile unpadded): flex is traced once (compile id F/0, never F/1), the
    mask (block 16: read off the tables) is never compiled, and the output equals the dense backend's."""
    block_size, heads, kv_heads, dim = 16, 4, 2, 16
    from torch.nn.attention.flex_attention import flex_attention

    flex = compiled(flex_attention, backend="aot_eager")
    log = CompileLog()
    try:
        for i, (n, m) in enumerate([(300, 20), (100, 5), (700, 41), (513, 9)]):
            lay = _layout(n, m, block_size, seed=i)
            q = torch.randn(1, heads, lay.num_queries, dim)
            k, v = (torch.randn(1, kv_heads, lay.kv_doc.shape[0], dim) for _ in range(2))
            mask = flex_block_mask(lay, None, compile=True)
            mark_lengths_dynamic(q, k, v)
            out = flex(q, k, v, block_mask=mask, scale=dim ** -0.5, enable_gqa=True)
            dense = MaskSet(lay, "dense", {None}).attend(q, k, v, dim ** -0.5, None)
            torch.testing.assert_close(out, dense, atol=2e-5, rtol=1e-5)
    finally:
        log.close()
    assert [frame for _, _, frame in log.starts] == ["flex_attention"], log.starts
    assert all(cid.endswith("/0") for _, cid, _ in log.starts), log.starts


@pytest.mark.slow   # ~15 s on a cold inductor cache: inductor compiles create_block_mask for the CPU
def test_a_block_size_that_splits_tiles_compiles_its_mask_once():
    """Block 12 does not divide the 128-row tile, so create_block_mask evaluates the mask_mod, compiled
    (inductor) once over batches whose N and M all differ."""
    log = CompileLog()
    try:
        for i, (n, m) in enumerate([(300, 20), (100, 5), (700, 41)]):
            lay = _layout(n, m, 12, seed=i)
            want = MaskSet(lay, "dense", {None}).masks[None]
            mask = flex_block_mask(lay, None, compile=True)
            assert torch.equal(mask.to_dense()[0, 0].bool(), _tiles_of(want)), (n, m)
    finally:
        log.close()
    assert [frame for _, _, frame in log.starts] == ["create_block_mask"], log.starts
    assert all(cid.endswith("/0") for _, cid, _ in log.starts), log.starts


def _tiles_of(dense: torch.Tensor) -> torch.Tensor:
    """[Q, KV] bool -> [Q/128, KV/128]: which 128x128 tiles hold a visible pair."""
    q, kv = dense.shape
    return dense.view(q // 128, 128, kv // 128, 128).any(3).any(1)


def test_few_anchors_still_pad_to_two_query_tiles():
    """A size-1 tile dim would be specialised by dynamo (a compile of its own): never one query tile."""
    for block_size in (16, 4, 3):
        lay = _layout(40, 1, block_size, seed=0)
        assert lay.num_queries >= 256 and lay.num_queries % 128 == 0
        assert lay.anchor_doc[1:].eq(-2).all()          # the padding blocks see nothing but themselves


def _cuda_drafter(backend: str):
    """A 2-layer drafter (block 16, 4/2 heads of 16) on CUDA, identical for both backends (seed 0)."""
    from torch import nn
    from transformers import Qwen3Config

    from dflash.model import DFlashDraftModel, draft_config_for_target

    target = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=128)
    torch.manual_seed(0)
    emb, head = nn.Embedding(128, 64), nn.Linear(64, 128, bias=False)
    cfg = draft_config_for_target(target, 2, 16, [1, 3, 5], 127, attn_backend=backend)
    model = DFlashDraftModel(cfg, emb.cuda(), head.cuda()).cuda()
    model.head.embed_tokens.cuda(), model.head.lm_head.cuda()
    return model


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_drafter_compiles_flex_once_over_changing_batches_forward_and_backward():
    """The real drafter (flex on CUDA, bf16 autocast) over batches whose N and M differ: the mask and
    flex (forward and backward) are each compiled once, and the outputs equal the dense backend's."""
    dense, flex = _cuda_drafter("dense"), _cuda_drafter("flex")
    flex.load_state_dict(dense.state_dict())
    log = CompileLog()
    try:
        for i, (n, m) in enumerate([(300, 20), (100, 5), (1500, 90), (513, 9), (2000, 130)]):
            lay = _layout(n, m, 16, seed=i)
            lay = BlockLayout(lay.block_size, lay.num_ctx, lay.num_anchors,
                              *(t.cuda() for t in (lay.kv_doc, lay.kv_pos, lay.kv_block, lay.anchor_doc,
                                                   lay.anchor_limit, lay.anchor_pos)))
            ctx = torch.randn(n, dense.fc.in_features, device="cuda")
            block = torch.full((m, 16), 127, device="cuda")
            block[:, 0] = torch.randint(0, 127, (m,), device="cuda")
            outs = []
            for model in (dense, flex):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    out = model(ctx, block, lay)[: m * 16].float()
                out.square().mean().backward()
                outs.append(out.detach())
            torch.testing.assert_close(outs[1], outs[0], atol=3e-2, rtol=3e-2)
            torch.testing.assert_close(flex.fc.weight.grad, dense.fc.weight.grad, atol=3e-2, rtol=5e-2)
            dense.zero_grad(), flex.zero_grad()
    finally:
        log.close()
    ours = log.of("flex_attention", "create_block_mask")          # the fused elementwise kernels compile too
    assert [frame for t, _, frame in ours if t == "DYNAMO"] == ["flex_attention"], ours   # the mask: no compile
    assert all(cid.endswith("/0") for _, cid, _ in ours), ours   # a backward compiled lazily keeps its forward's id


# ------------------------------------------------------------------------------------------- cache
def test_cache_dir_default_honours_xdg_and_the_flag():
    assert resolve_cache_dir(None, {"HOME": "/home/u"}) == Path("/home/u/.cache/dflash/compile")
    assert resolve_cache_dir(None, {"HOME": "/home/u", "XDG_CACHE_HOME": "/xdg"}) == Path("/xdg/dflash/compile")
    assert resolve_cache_dir(None, {"HOME": "/home/u", "XDG_CACHE_HOME": "rel"}) == Path(
        "/home/u/.cache/dflash/compile")                   # a relative XDG_CACHE_HOME is ignored (XDG spec)
    assert resolve_cache_dir("/c/d", {"XDG_CACHE_HOME": "/xdg"}) == Path("/c/d")
    cfg = resolve_config({}, {}, {"compile_cache_dir": "/c/d"})
    assert cfg.model.compile_cache_dir == "/c/d" and resolve_config({}, {}, {}).model.compile_cache_dir is None


def test_setup_creates_a_private_directory_and_points_inductor_and_triton_there(tmp_path):
    path, env = tmp_path / "a" / "compile", {}
    setup_cache(path, create=True, env=env)
    assert path.is_dir() and (path.stat().st_mode & 0o777) == 0o700
    assert env == {"TORCHINDUCTOR_CACHE_DIR": str(path), "TRITON_CACHE_DIR": str(path / "triton")}
    other, env = tmp_path / "later", {}
    setup_cache(other, create=False, env=env)            # CPU: set, created by the first compile if any
    assert not other.exists() and env["TORCHINDUCTOR_CACHE_DIR"] == str(other)


def _unsafe_dirs(tmp_path: Path) -> dict:
    """{case: (path, expected words)} of cache directories preflight must refuse."""
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    cases = {"symlink": (link, "is a symlink")}
    for name, mode, who in (("group", 0o770, "group"), ("world", 0o707, "others"), ("both", 0o777, "group and others")):
        d = tmp_path / name
        d.mkdir()
        d.chmod(mode)
        cases[name] = (d, f"is writable by {who} (mode 0{mode:o})")
    f = tmp_path / "file"
    f.write_text("")
    cases["file"] = (f, "exists and is not a directory")
    if os.geteuid() == 0:                                 # only root can give a directory away
        foreign = tmp_path / "foreign"
        foreign.mkdir(mode=0o700)
        os.chown(foreign, 65534, 65534)
        cases["foreign"] = (foreign, "is owned by uid 65534, not by you (uid 0)")
    return cases


def test_preflight_refuses_a_cache_dir_that_is_a_link_not_ours_or_writable_by_others(tmp_path):
    cases = _unsafe_dirs(tmp_path)
    for case, (path, words) in cases.items():
        cfg = resolve_config({}, {}, {"compile_cache_dir": str(path), "device": "cpu",
                                      "run_dir": str(tmp_path / "run")})
        with pytest.raises(ConfigError) as e:
            preflight.check(cfg, 2, 2)
        assert str(e.value).startswith(f"--compile-cache-dir {path}: {words}"), (case, str(e.value))
    ok = tmp_path / "ok"
    ok.mkdir(mode=0o700)
    assert cache_dir_problem(ok) is None and cache_dir_problem(tmp_path / "missing") is None
    # The rank checks again after creating it: a directory swapped in since preflight is refused too.
    with pytest.raises(ConfigError, match="is a symlink"):
        setup_cache(cases["symlink"][0], create=True, env={})
    assert not (tmp_path / "run").exists()


def test_cli_refuses_an_unsafe_cache_dir_in_one_line_before_any_rank(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    bad = tmp_path / "shared"
    bad.mkdir()
    bad.chmod(0o777)
    code = main(["--compile-cache-dir", str(bad), "--run-dir", str(tmp_path / "run"), "--device", "cpu"])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"dflash-train: error: --compile-cache-dir {bad}: is writable by group and others (mode 0777); compiled "
        "kernels are loaded from it, so only you may write there (chmod go-w)"]
    assert not (tmp_path / "run").exists()


_RESTART = textwrap.dedent("""
    import sys
    from pathlib import Path
    from dflash.compile_cache import setup_cache
    setup_cache(Path(sys.argv[1]), create=True)   # before torch compiles anything, as the worker does
    import torch
    from torch._dynamo.utils import counters
    f = torch.compile(lambda x: (x * 3).sin() + 1)
    f(torch.ones(8))
    print(counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"])
""")


@pytest.mark.slow   # two processes that import torch and compile (~15 s)
def test_a_restart_loads_its_compiled_graph_from_the_cache_dir(tmp_path):
    cache = tmp_path / "cache"

    def run() -> tuple[int, int]:
        r = subprocess.run([sys.executable, "-c", _RESTART, str(cache)], cwd=REPO, capture_output=True,
                           text=True, timeout=240)
        assert r.returncode == 0, r.stderr[-3000:]
        hit, miss = r.stdout.split()
        return int(hit), int(miss)

    assert run() == (0, 1)                              # cold: compiled, and written to the cache
    assert (cache / "fxgraph").is_dir() and (cache.stat().st_mode & 0o777) == 0o700
    assert run() == (1, 0)                              # warm restart: loaded, not compiled


# -------------------------------------------------------------------------------------------- span
def _make_prof(tmp_path):
    from profiler.config import ProfilerConfig
    return profiler.Profiler(tmp_path, config=ProfilerConfig(interval_s=3600.0, control=False, measure_floors=False,
                                                             detail_steps=4))


def test_a_first_call_compiles_inside_a_drafter_compile_span_and_a_second_does_not(tmp_path):
    """Forward (dynamo) and backward (AOTAutograd's lazy compile) each become a drafter.compile child
    of the drafter.fwd_bwd that triggered them, tagged; the same shapes again compile nothing."""
    def scaled_sine(x):
        return (x * 2).sin()

    f = torch.compile(scaled_sine, backend="aot_eager")
    assert install_compile_spans() and install_compile_spans()   # idempotent
    try:
        with _make_prof(tmp_path) as prof:
            for step in range(2):
                prof.set_step(step)
                with profiler.span("drafter.fwd_bwd"):
                    f(torch.ones(5, requires_grad=True)).sum().backward()
            prof.close_interval()
    finally:
        uninstall_compile_spans()
    recs, _ = profiler.read_records(prof.log_path)
    spans = [s for r in recs if r["type"] == "spans" for s in r["spans"]]
    outer = [s for s in spans if s["name"] == "drafter.fwd_bwd"]
    compiles = [s for s in spans if s["name"] == "drafter.compile"]
    assert len(outer) == 2 and len(compiles) == 2
    assert all(s["parent"] == outer[0]["id"] for s in compiles)      # none under the second step
    assert [s["attrs"]["trigger"] for s in compiles] == ["dynamo", "lazy_backward"]
    assert compiles[0]["attrs"]["frame"] == "scaled_sine" and compiles[0]["attrs"]["compile_id"].endswith("/0")
    assert compiles[0]["start_unix_ns"] >= outer[0]["start_unix_ns"]
    assert compiles[1]["end_unix_ns"] <= outer[0]["end_unix_ns"]
    interval = next(r for r in recs if r["type"] == "interval")
    assert interval["spans"]["drafter.compile"]["count"] == 2


def test_compile_spans_without_a_profiler_are_no_ops_and_uninstall_leaves_nothing():
    from torch._dynamo import callback_handler

    before = (list(callback_handler.start_callbacks), list(callback_handler.end_callbacks))
    install_compile_spans()
    try:
        torch.compile(lambda x: x + 1, backend="eager")(torch.ones(2))   # no profiler: nothing to record
    finally:
        uninstall_compile_spans()
    assert (callback_handler.start_callbacks, callback_handler.end_callbacks) == before


# ---------------------------------------------------------------------------------------- bytecode
def test_bytecode_cache_only_where_python_may_not_write_beside_its_sources(tmp_path):
    cache = tmp_path / "c"
    assert bytecode_env(True, str(cache), {}, dont_write=False) == {}    # Python writes __pycache__ itself
    assert bytecode_env(True, str(cache), {}, dont_write=True, missing=False) == {}   # installed with bytecode
    assert bytecode_env(False, str(cache), {}, dont_write=True, missing=True) == {}    # --no-bytecode-cache
    assert bytecode_env(True, str(cache), {"PYTHONPYCACHEPREFIX": "/x"}, dont_write=True, missing=True) == {}   # the user's own
    assert not cache.exists()
    changes = bytecode_env(True, str(cache), {}, dont_write=True, missing=True)
    assert changes == {"PYTHONPYCACHEPREFIX": str(cache / "pycache"), "PYTHONDONTWRITEBYTECODE": None}
    assert all((p.stat().st_mode & 0o777) == 0o700 for p in (cache, cache / "pycache"))
    assert bytecode_env(True, None, {"HOME": str(tmp_path / "h")}, dont_write=True, missing=True)["PYTHONPYCACHEPREFIX"] == str(
        tmp_path / "h/.cache/dflash/compile/pycache")
    assert resolve_config({}, {}, {}).model.bytecode_cache is True


def test_bytecode_cache_refuses_what_the_compile_cache_refuses(tmp_path):
    unsafe = tmp_path / "u"
    unsafe.mkdir()
    for case, (path, _) in _unsafe_dirs(unsafe).items():
        assert bytecode_env(True, str(path), {}, dont_write=True, missing=True) == {}, case
    good = tmp_path / "good"
    good.mkdir(mode=0o700)
    (good / "pycache").symlink_to(unsafe / "real")              # a good cache, its bytecode folder a link
    assert bytecode_env(True, str(good), {}, dont_write=True, missing=True) == {}


def test_ranks_told_not_to_write_bytecode_keep_it_in_the_cache(tmp_path):
    """The real interpreter with the changes: the module's bytecode lands under the cache and is read
    from there; without them (PYTHONDONTWRITEBYTECODE, as in the H200 image) nothing is written."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "probe_mod.py").write_text("X = 1\n")
    base = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", PYTHONPATH=str(src))
    base.pop("PYTHONPYCACHEPREFIX", None)
    subprocess.run([sys.executable, "-c", "import probe_mod"], env=base, check=True)
    assert not list(tmp_path.rglob("*.pyc"))
    env = dict(base)
    for var, value in bytecode_env(True, str(tmp_path / "c"), {}, dont_write=True, missing=True).items():
        env.pop(var) if value is None else env.update({var: value})
    code = "import probe_mod, sys; print(probe_mod.__cached__.startswith(sys.pycache_prefix))"
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "True"
    written = [p.relative_to(tmp_path / "c" / "pycache") for p in (tmp_path / "c" / "pycache").rglob("probe_mod.*")]
    assert written == [Path(*src.parts[1:], f"probe_mod.{sys.implementation.cache_tag}.pyc")]
    assert not (src / "__pycache__").exists()


def test_bytecode_missing_looks_beside_the_package_sources(tmp_path, monkeypatch):
    pkg = tmp_path / "probe_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert bytecode_missing(("probe_pkg",)) and not bytecode_missing(("no_such_package_here",))
    (pkg / "__pycache__").mkdir()
    (pkg / "__pycache__" / f"__init__.{sys.implementation.cache_tag}.pyc").write_bytes(b"")
    assert not bytecode_missing(("probe_pkg",)) and "probe_pkg" not in sys.modules   # found, never imported


@pytest.mark.parametrize("parent_mode,owner", [(0o777, None), (0o755, 65534), (0o1777, 65534)])
def test_a_cache_under_a_directory_another_user_could_swap_is_refused(tmp_path, parent_mode, owner):
    """Issue 34 row 1: every ancestor must be yours or root's and writable by nobody else unless sticky;
    a world-writable sticky directory of ANOTHER user is refused too (its owner may rename entries)."""
    from dflash.compile_cache import bytecode_env, cache_dir_problem

    if owner is not None and os.getuid() != 0:
        pytest.skip("chown to another uid needs root")
    parent = tmp_path / "shared"
    parent.mkdir()
    cache = parent / "cache"
    cache.mkdir(mode=0o700)
    os.chmod(parent, parent_mode)
    if owner is not None:
        os.chown(parent, owner, owner)
    problem = cache_dir_problem(cache)
    assert problem and str(parent) in problem, problem
    assert cache_dir_problem(cache / "pycache") is not None        # a path below it, not yet made
    assert bytecode_env(True, str(cache), env={}, dont_write=True, missing=True) == {}
    os.chown(parent, os.getuid(), os.getgid())
    os.chmod(parent, 0o1777)                                           # sticky and ours (like /tmp): fine
    assert cache_dir_problem(cache) is None
