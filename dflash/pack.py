"""pack_hidden: drop padding, lay the K captured layers out per token, carry positions/docs/loss mask.

A Batch row is one document, so a token's document id is its row and its position its index among
the row's real tokens. Flat indices are computed on the CPU (boolean indexing on the device would
sync) and gathered with index_select straight into the output (each element read and written once);
the metadata rides to the device in one copy, and CPU copies stay for anchor sampling. Noise is
uniform in [-s, s], drawn in float32 from noise_seed on whichever side concatenates the context.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

META_FIELDS = ("input_ids", "position_ids", "doc_ids", "loss_mask")
"""The per-token metadata of a packed batch, in the order its transfer rows carry them."""
META_DTYPES = (torch.int64, torch.int64, torch.int32, torch.bool)
"""Their dtypes (the rows travel as int64)."""


class WireHeader(NamedTuple):
    """The four integers a packed batch's transfer header carries (Message.ints), in this order."""
    batch_index: int
    noise_seed: int
    """Seed of the hidden-state noise (PackedBatch.noise_seed)."""
    split: int
    """1 when the K layers travel separately (PackedBatch.split)."""
    detail: int
    """1 when the target's detail window holds the batch (profiler.in_detail() as it packed it), so the drafter
    keeps the step that trains on it (profiler.keep_step()) and a trace holds both ends of its transfer."""


def _add_noise(ctx: torch.Tensor, noise_scale: float, noise_seed: int) -> torch.Tensor:
    """In place: ctx += U(-s, s) (float32 draw, rounded once into ctx's dtype)."""
    if noise_scale == 0:
        return ctx
    gen = torch.Generator(device=ctx.device)
    gen.manual_seed(noise_seed)
    noise = torch.empty(ctx.shape, dtype=torch.float32, device=ctx.device)
    noise.uniform_(-noise_scale, noise_scale, generator=gen)
    return ctx.add_(noise)


@dataclass
class PackedBatch:
    hidden: torch.Tensor
    """concat: [N, K*H] with the noise already added; split: [K, N, H] without noise."""
    input_ids: torch.Tensor
    """[N] int64 token ids."""
    position_ids: torch.Tensor
    """[N] int64 position within the token's document."""
    doc_ids: torch.Tensor
    """[N] int32 document index, non-decreasing."""
    loss_mask: torch.Tensor
    """[N] bool, True where the token is trained on (assistant tokens)."""
    noise_seed: int
    """Seed of the hidden-state noise (drawn on the hidden's device)."""
    split: bool
    """True when the K layers travel separately and the drafter concatenates (and adds noise)."""
    cpu: dict[str, torch.Tensor] | None = field(default=None, repr=False)
    """CPU copies of input_ids/position_ids/doc_ids/loss_mask (what anchor sampling reads)."""

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    def to_wire(self, batch_index: int, detail: bool = False) -> tuple[torch.Tensor, "WireHeader"]:
        """What a transfer carries beside the payload (`hidden`): the CPU metadata rows
        [len(META_FIELDS), N] int64, in META_FIELDS order, and the named header (`detail`: WireHeader.detail)."""
        rows = torch.stack([self.meta()[name].to(torch.int64) for name in META_FIELDS])
        return rows, WireHeader(batch_index, self.noise_seed, int(self.split), int(detail))

    @classmethod
    def from_wire(cls, hidden: torch.Tensor, rows: torch.Tensor, header, device) -> tuple["PackedBatch", "WireHeader"]:
        """The batch to_wire() described, from the payload (on `device`), the metadata rows and the header (a
        WireHeader, or its four ints in order); the metadata goes up in one copy."""
        header = header if isinstance(header, WireHeader) else WireHeader._make(header)
        if rows.shape[0] != len(META_FIELDS):
            raise ValueError(f"PackedBatch.from_wire: {rows.shape[0]} metadata rows, expected {len(META_FIELDS)}")
        cpu = {name: rows[i].to(dtype) for i, (name, dtype) in enumerate(zip(META_FIELDS, META_DTYPES))}
        on_dev = rows.to(device, non_blocking=True)
        batch = cls(hidden, *(on_dev[i].to(dtype) for i, dtype in enumerate(META_DTYPES)),
                    noise_seed=header.noise_seed, split=bool(header.split), cpu=cpu)
        return batch, header

    def meta(self) -> dict[str, torch.Tensor]:
        """CPU metadata for anchor sampling (carried from pack_hidden or from_wire)."""
        if self.cpu is None:
            self.cpu = {k: getattr(self, k).cpu() for k in META_FIELDS}  # sync: no CPU copy given
        return self.cpu

    def context(self, noise_scale: float) -> torch.Tensor:
        """[N, K*H] drafter input. split: concatenate here and add the noise; concat: as shipped."""
        if not self.split:
            return self.hidden
        k, n, h = self.hidden.shape
        ctx = self.hidden.permute(1, 0, 2).reshape(n, k * h)
        if ctx.data_ptr() == self.hidden.data_ptr():  # K == 1: reshape was a view; keep hidden intact
            ctx = ctx.clone()
        return _add_noise(ctx, noise_scale, self.noise_seed)


def _flat_indices(attention_mask: torch.Tensor):
    if attention_mask.device.type != "cpu":
        raise ValueError("pack_hidden: batch.attention_mask must be the CPU tensor from the batcher")
    mask = attention_mask.to(torch.bool)
    rows, t = mask.shape
    flat = mask.reshape(-1).nonzero().squeeze(1)
    doc_ids = (flat // t).to(torch.int32)
    position_ids = (mask.to(torch.int64).cumsum(1) - 1).reshape(-1)[flat]
    return flat, doc_ids, position_ids


def pack_hidden(layers: list[torch.Tensor], batch, noise_scale: float, noise_seed: int,
                split: bool) -> PackedBatch:
    """K x [B, T, H] captured layers + the CPU batch -> PackedBatch on the layers' device (on the
    forward's stream, so ordered after it)."""
    if not layers:
        raise ValueError("pack_hidden: no layers given")
    b, t, h = layers[0].shape
    if tuple(batch.attention_mask.shape) != (b, t):
        raise ValueError(f"pack_hidden: attention_mask {tuple(batch.attention_mask.shape)} does not "
                         f"match hidden {(b, t, h)}")
    device, dtype, k = layers[0].device, layers[0].dtype, len(layers)
    flat, doc_ids, position_ids = _flat_indices(batch.attention_mask)
    n = flat.shape[0]
    cpu_meta = {
        "input_ids": batch.input_ids.reshape(-1)[flat].to(torch.int64),
        "position_ids": position_ids,
        "doc_ids": doc_ids,
        "loss_mask": batch.loss_mask.reshape(-1)[flat].to(torch.bool),
    }
    # One H2D copy for the index and all metadata (pageable source: staged at once, no device sync).
    stacked = torch.stack([flat, cpu_meta["input_ids"], position_ids, doc_ids.to(torch.int64),
                           cpu_meta["loss_mask"].to(torch.int64)])
    on_dev = stacked.to(device, non_blocking=True)
    idx = on_dev[0]
    if split:
        hidden = torch.empty((k, n, h), dtype=dtype, device=device)
        for i, layer in enumerate(layers):
            torch.index_select(layer.reshape(b * t, h), 0, idx, out=hidden[i])
    else:
        hidden = torch.empty((n, k * h), dtype=dtype, device=device)
        for i, layer in enumerate(layers):
            # Strided out (a column slice): index_select writes through the view, no temporary.
            torch.index_select(layer.reshape(b * t, h), 0, idx, out=hidden[:, i * h:(i + 1) * h])
        _add_noise(hidden, noise_scale, noise_seed)
    return PackedBatch(hidden, on_dev[1], on_dev[2], on_dev[3].to(torch.int32), on_dev[4].to(torch.bool),
                       noise_seed, split, cpu=cpu_meta)
