"""Draft-block attention: which keys each block query sees, and two backends with the same math.

Layout of one drafter forward (all draft blocks of a packed batch at once):

    keys   = [context tokens (N, padded to Np) ; block tokens (M*B, padded to Mp*B)]
    queries = block tokens only (Mp*B rows)

Query row q belongs to block j = q // B. It sees context key c iff c is in the block's document,
c < limit[j] (for training limit = the anchor's flat index, so positions < a), and, on sliding
layers, (anchor_pos[j] + q % B) - pos[c] < window (the reference's key-index window at absolute
positions). It sees the B keys of its own block (bidirectional; on sliding layers only those less
than `window` positions away, as the reference's non-causal window) and nothing else. Padding anchors
use document -2 and padding context tokens document -1, so padding never matches anything but a
padding block's own keys: no query row is fully masked, so neither backend produces NaNs.

`flex` runs flex_attention with a BlockMask (compiled on CUDA); `dense` runs SDPA with a boolean
[Q, KV] mask. One compile serves every batch: the varying lengths are declared dynamic before the
first call (`maybe_mark_dynamic` on tensors, DYNAMIC_INTS for the BlockMask's ints).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

PAD_MULTIPLE = 128
"""Row padding for context and query lengths: flex_attention's default tile is 128x128, and an
aligned layout puts each 8-anchor query tile on exactly one tile of block keys."""
MIN_QUERY_TILES = 2
"""Queries are padded to at least this many tiles: a BlockMask with one query tile has size-1 dims,
which dynamo specialises, so a batch of few anchors would compile a graph of its own."""
DYNAMIC_INTS = ("L['block_mask'].seq_lengths[0]", "L['block_mask'].seq_lengths[1]", "L['Q_LEN']", "L['KV_LEN']")
"""The varying ints the compiled functions read (flex_attention's BlockMask lengths, create_block_mask's
arguments), by dynamo's source names."""

BACKENDS = ("auto", "flex", "dense")


@dataclass
class BlockLayout:
    """Device tensors describing one drafter forward's keys and queries (padded)."""

    block_size: int
    """Tokens per draft block (B)."""
    num_ctx: int
    """Real context tokens N (rows >= N are padding)."""
    num_anchors: int
    """Real draft blocks M (blocks >= M are padding)."""
    kv_doc: torch.Tensor
    """[Np + Mp*B] int32: document of each context key; -1 for padding and for block keys."""
    kv_pos: torch.Tensor
    """[Np + Mp*B] int64: absolute position of every key (context then block tokens), for RoPE."""
    kv_block: torch.Tensor
    """[Np + Mp*B] int64: block index of each block key; -1 for context keys."""
    anchor_doc: torch.Tensor
    """[Mp] int32: document of each block; -2 for padding blocks."""
    anchor_limit: torch.Tensor
    """[Mp] int64: context keys with flat index < limit are visible (same document only)."""
    anchor_pos: torch.Tensor
    """[Mp] int64: absolute position of each block's first token (token[a])."""

    @property
    def num_ctx_padded(self) -> int:
        return self.kv_doc.shape[0] - self.anchor_doc.shape[0] * self.block_size

    @property
    def num_queries(self) -> int:
        return self.anchor_doc.shape[0] * self.block_size


def _round_up(n: int, multiple: int) -> int:
    return max(multiple, -(-n // multiple) * multiple)


def build_layout(ctx_doc: torch.Tensor, ctx_pos: torch.Tensor, anchor_doc: torch.Tensor,
                 anchor_limit: torch.Tensor, anchor_pos: torch.Tensor, block_size: int) -> BlockLayout:
    """Pad the per-token [N] and per-anchor [M] tables, on their device; no host-device sync."""
    device = ctx_doc.device
    n, m = ctx_doc.shape[0], anchor_doc.shape[0]
    # Anchor padding so that the query length Mp*B is a multiple of 128 for any block size: flex
    # then never evaluates mask_mod on a query row outside the per-anchor tables.
    np_ = _round_up(n, PAD_MULTIPLE)
    anchor_step = PAD_MULTIPLE // math.gcd(PAD_MULTIPLE, block_size)
    mp = _round_up(max(m, -(-MIN_QUERY_TILES * PAD_MULTIPLE // block_size)), anchor_step)
    q = mp * block_size
    i32, i64 = torch.int32, torch.int64

    def padded(t: torch.Tensor, size: int, fill: int, dtype) -> torch.Tensor:
        out = torch.full((size,), fill, dtype=dtype, device=device)
        out[:t.shape[0]] = t.to(dtype)
        return out

    a_doc, a_lim = padded(anchor_doc, mp, -2, i32), padded(anchor_limit, mp, 0, i64)
    a_pos = padded(anchor_pos, mp, 0, i64)
    kv_doc, kv_pos = padded(ctx_doc, np_ + q, -1, i32), padded(ctx_pos, np_ + q, 0, i64)
    kv_pos[np_:] = (a_pos[:, None] + torch.arange(block_size, device=device, dtype=i64)[None, :]).reshape(q)
    kv_block = torch.full((np_ + q,), -1, dtype=i64, device=device)
    kv_block[np_:] = torch.arange(q, device=device, dtype=i64) // block_size
    return BlockLayout(block_size, n, m, kv_doc, kv_pos, kv_block, a_doc, a_lim, a_pos)


def make_mask_mod(layout: BlockLayout, sliding_window: int | None):
    """The mask as a flex mask_mod; also evaluated with broadcasting for the dense backend."""
    bs = layout.block_size
    kv_doc, kv_pos, kv_block = layout.kv_doc, layout.kv_pos, layout.kv_block
    a_doc, a_lim, a_pos = layout.anchor_doc, layout.anchor_limit, layout.anchor_pos

    def mask_mod(b, h, q_idx, kv_idx):
        j = q_idx // bs
        ctx = (kv_doc[kv_idx] == a_doc[j]) & (kv_idx < a_lim[j])
        own = kv_block[kv_idx] == j
        if sliding_window is not None:
            dist = a_pos[j] + q_idx % bs - kv_pos[kv_idx]
            ctx = ctx & (dist < sliding_window)
            own = own & (dist < sliding_window) & (-dist < sliding_window)
        return ctx | own

    return mask_mod


def dense_mask(layout: BlockLayout, sliding_window: int | None) -> torch.Tensor:
    """Boolean [Q, KV] mask (True = attend), built without [Q, KV] integer intermediates."""
    bs, np_, mp = layout.block_size, layout.num_ctx_padded, layout.anchor_doc.shape[0]
    q = mp * bs
    device = layout.kv_doc.device
    ctx_idx = torch.arange(np_, device=device)
    # Per block (not per query row): same document and before the limit -> [Mp, Np].
    ctx = (layout.kv_doc[None, :np_] == layout.anchor_doc[:, None]) & (
        ctx_idx[None, :] < layout.anchor_limit[:, None])
    ctx = ctx[:, None, :].expand(mp, bs, np_)
    q_block = torch.arange(q, device=device) // bs
    own = q_block[:, None] == layout.kv_block[None, np_:]
    if sliding_window is not None:
        q_pos = layout.kv_pos[np_:].view(mp, bs)
        ctx = ctx & ((q_pos[:, :, None] - layout.kv_pos[None, None, :np_]) < sliding_window)
        dist = q_pos.reshape(q, 1) - layout.kv_pos[None, np_:]
        own = own & (dist.abs() < sliding_window)
    return torch.cat([ctx.reshape(q, np_), own], dim=1)


def flex_block_mask(layout: BlockLayout, sliding_window: int | None, compile: bool | None = None):
    """The layout's BlockMask, its varying dims dynamic: read off the tables when the block size divides
    the tile, else create_block_mask (compiled when `compile`, None: on CUDA)."""
    for table in (layout.kv_doc, layout.kv_pos, layout.kv_block, layout.anchor_doc, layout.anchor_limit,
                  layout.anchor_pos):
        torch._dynamo.maybe_mark_dynamic(table, 0)
    mask_mod = make_mask_mod(layout, sliding_window)
    if PAD_MULTIPLE % layout.block_size == 0:
        mask = tile_block_mask(layout, sliding_window, mask_mod)
    else:
        from torch.nn.attention.flex_attention import create_block_mask

        device = layout.kv_doc.device
        build = compiled(create_block_mask) if (device.type == "cuda" if compile is None else compile) \
            else create_block_mask
        mask = build(mask_mod, None, None, layout.num_queries, layout.kv_doc.shape[0], device=device)
    mark_block_mask_dynamic(mask)
    return mask


def tile_block_mask(layout: BlockLayout, sliding_window: int | None, mask_mod):
    """The BlockMask create_block_mask would build for `mask_mod`, from the tables (device ops only), for
    a block size that divides the tile: rows 0 and B-1 decide a block's window."""
    from torch.nn.attention.flex_attention import BlockMask

    bs, tile = layout.block_size, PAD_MULTIPLE
    qt, ct = layout.num_queries // tile, layout.num_ctx_padded // tile
    seen, full = _context_tiles(layout, sliding_window)                 # [qt, ct] each
    own_seen, own_full = _own_tile(bs, sliding_window)
    diag = torch.eye(qt, dtype=torch.int32, device=seen.device)
    tiles = torch.stack([torch.cat([seen & ~full, diag * (own_seen and not own_full)], dim=1),
                         torch.cat([full, diag * own_full], dim=1)])           # [partial/full, qt, kvt]
    kv_num, kv_idx = _dense_to_ordered(tiles)
    q_num, q_idx = _dense_to_ordered(tiles.transpose(1, 2))
    # The constructor, not from_kv_blocks (which derives the query side through host-side vmaps).
    return BlockMask(seq_lengths=(qt * tile, (ct + qt) * tile), kv_num_blocks=kv_num[0], kv_indices=kv_idx[0],
                     full_kv_num_blocks=kv_num[1], full_kv_indices=kv_idx[1], q_num_blocks=q_num[0],
                     q_indices=q_idx[0], full_q_num_blocks=q_num[1], full_q_indices=q_idx[1],
                     BLOCK_SIZE=(tile, tile), mask_mod=mask_mod)


TILE_CHUNK_ELEMS = 1 << 24
"""Block-key pairs evaluated at once by tile_block_mask (bounds its temporaries: ~16M pairs, ~0.2 GB)."""


def _context_tiles(layout: BlockLayout, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(some key of the tile is seen by some row, every key by every row): [query tiles, context tiles]."""
    bs, tile, np_ = layout.block_size, PAD_MULTIPLE, layout.num_ctx_padded
    per_tile, qt = tile // bs, layout.num_queries // PAD_MULTIPLE
    c = torch.arange(np_, device=layout.kv_doc.device)
    doc, pos = layout.kv_doc[None, :np_], layout.kv_pos[None, :np_]
    step = max(1, TILE_CHUNK_ELEMS // (per_tile * max(np_, 1)))       # query tiles per chunk
    seen, full = [], []
    for t0 in range(0, qt, step):
        j = slice(t0 * per_tile, min(qt, t0 + step) * per_tile)
        some = (doc == layout.anchor_doc[j, None]) & (c[None, :] < layout.anchor_limit[j, None])
        every = some
        if window is not None:
            gap = layout.anchor_pos[j, None] - pos                    # row r's distance is gap + r
            some, every = some & (gap < window), some & (gap + (bs - 1) < window)
        shape = (-1, per_tile, np_ // tile, tile)
        seen.append(some.view(shape).any(3).any(1))
        full.append(every.view(shape).all(3).all(1))
    return torch.cat(seen), torch.cat(full)


def _own_tile(block_size: int, window: int | None) -> tuple[bool, bool]:
    """(any, all) of a query tile's diagonal key tile: row r and key r' see each other iff they are in one
    block and |r - r'| < window. Within a block the offsets d = r - r' occur B - |d| times."""
    seen = sum(block_size - abs(d) for d in range(1 - block_size, block_size) if window is None or abs(d) < window)
    return seen > 0, PAD_MULTIPLE == block_size and seen == block_size * block_size


def _dense_to_ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, rows, cols] 0/1 tiles -> ([N, 1, 1, rows] counts, [N, 1, 1, rows, cols] column indices, set
    ones first), as torch's own conversion orders them (a stable descending sort)."""
    dense = dense.to(torch.int32)[:, None, None]
    order = torch.argsort(dense, dim=-1, descending=True, stable=True)
    fmt = torch.contiguous_format
    return dense.sum(dim=-1).to(torch.int32, memory_format=fmt), order.to(torch.int32, memory_format=fmt)


def mark_block_mask_dynamic(mask) -> None:
    """Declare a BlockMask's tile dims dynamic ([B, H, tiles(, tiles)]; B and H stay 1)."""
    for side in ("kv", "full_kv", "q", "full_q"):
        for name, dims in ((f"{side}_num_blocks", (2,)), (f"{side}_indices", (2, 3))):
            t = getattr(mask, name, None)
            for dim in dims if t is not None else ():
                torch._dynamo.maybe_mark_dynamic(t, dim)


def mark_lengths_dynamic(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Declare the query and key lengths ([1, H, L, D] dim 2) dynamic before a compiled flex call."""
    for t in (q, k, v):
        torch._dynamo.maybe_mark_dynamic(t, 2)


_compiled: dict = {}


def compiled(fn, backend: str = "inductor"):
    """torch.compile(fn), made once per process and backend, after DYNAMIC_INTS are declared."""
    key = (fn, backend)
    if key not in _compiled:
        _declare_dynamic_ints()
        _compiled[key] = torch.compile(fn, backend=backend)
    return _compiled[key]


def _declare_dynamic_ints() -> None:
    """Add DYNAMIC_INTS to torch.compiler.config.dynamic_sources (a torch without it recompiles once)."""
    config = torch.compiler.config
    if not hasattr(config, "dynamic_sources"):
        return
    have = [s for s in config.dynamic_sources.replace(" ", "").split(",") if s]
    config.dynamic_sources = ",".join(have + [s for s in DYNAMIC_INTS if s not in have])


def _flex_fn(device: torch.device):
    """flex_attention, compiled on CUDA; eager on CPU (inductor's CPU flex cannot take a dynamic length)."""
    from torch.nn.attention.flex_attention import flex_attention

    return compiled(flex_attention) if device.type == "cuda" else flex_attention


def resolve_backend(name: str, device: torch.device) -> str:
    if name not in BACKENDS:
        raise ValueError(f"attn_backend: {name!r} is not one of {', '.join(BACKENDS)}")
    return ("flex" if device.type == "cuda" else "dense") if name == "auto" else name


class MaskSet:
    """Per-forward masks, one per distinct sliding window, built once and shared by all layers."""

    def __init__(self, layout: BlockLayout, backend: str, windows: set[int | None]):
        self.backend = backend
        build = flex_block_mask if backend == "flex" else dense_mask
        self.masks = {w: build(layout, w) for w in windows}

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               sliding_window: int | None) -> torch.Tensor:
        """q: [1, Hq, Q, D]; k, v: [1, Hkv, KV, D] -> [1, Hq, Q, D]."""
        mask = self.masks[sliding_window]
        # Under autocast the q/k RMSNorms (float32 weights) return float32 while v is bf16; both
        # kernels need one dtype, and v's is the one autocast chose.
        q, k = q.to(v.dtype), k.to(v.dtype)
        if self.backend == "flex":
            mark_lengths_dynamic(q, k, v)
            return _flex_fn(q.device)(q, k, v, block_mask=mask, scale=scale, enable_gqa=True)
        # Explicit repeat instead of enable_gqa: keeps SDPA on its masked memory-efficient kernel.
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None], scale=scale)
