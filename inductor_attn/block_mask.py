"""Compact block-sparse mask that any kernel can evaluate without calling Python.

Built once from a flex_attention ``BlockMask`` (same meaning of its fields):
- ``kv_num_blocks``/``kv_indices``: per (batch, head, q block) the kv blocks that are *partial* (the
  mask must be evaluated inside them); ``full_kv_num_blocks``/``full_kv_indices``: the kv blocks that are
  fully visible. Batch and head dims are 1 when the mask broadcasts over them.
- ``partial_bits``: int32 ``[B', H', num_q_blocks, max_partial, block_q, block_kv // 32]``: bit ``j % 32``
  of word ``j // 32`` in row ``i`` says whether query ``i`` of the q block sees key ``j`` of the listed
  kv block. Slot ``s`` holds the bitmap of ``kv_indices[..., s]``.

``density`` and ``partial_fraction`` (see ``Problem``) are -1 when unknown: a flex_attention call routed
in a compiled graph (lowering/flex_route.py) builds the bitmaps in the graph and never reads them back.

Index tensors are cut to the longest row (``max(kv_num_blocks)``), so memory grows with the number of
listed blocks, never with Lq x Lk: flex keeps ``kv_indices`` as wide as all kv blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Bitmaps are filled this many partial blocks at a time: bounds the bool scratch to
# chunk * block_q * block_kv bytes (64 blocks of 128x128 = 1 MiB).
_BITMAP_CHUNK = 64


@dataclass
class BlockSparseMask:
    seq_lengths: tuple[int, int]
    block_q: int
    block_kv: int
    kv_num_blocks: torch.Tensor
    kv_indices: torch.Tensor
    full_kv_num_blocks: torch.Tensor | None
    full_kv_indices: torch.Tensor | None
    partial_bits: torch.Tensor
    density: float
    partial_fraction: float

    @property
    def num_q_blocks(self) -> int:
        return self.kv_num_blocks.shape[-1]

    @classmethod
    def from_block_mask(cls, block_mask) -> BlockSparseMask:
        """Convert a flex ``BlockMask`` (evaluates its mask_mod on the partial blocks only, on its device)."""
        return _from_block_mask(block_mask)

    def dense_mask(self) -> torch.Tensor:
        """Bool ``[B', H', Lq, Lk]`` view of the mask: O(Lq x Lk), for tests and debugging only."""
        rows = [self.block_rows(m) for m in range(self.num_q_blocks)]
        lq, lk = self.seq_lengths
        return torch.cat(rows, dim=2)[:, :, :lq, :lk]

    def block_rows(self, m: int) -> torch.Tensor:
        """Bool ``[B', H', block_q, num_kv_blocks * block_kv]`` mask of q block ``m``."""
        b, h = self.kv_num_blocks.shape[:2]
        n_kv = -(-self.seq_lengths[1] // self.block_kv)
        device = self.kv_num_blocks.device
        # one spare block at index n_kv absorbs the unlisted slots
        grid = torch.zeros(b, h, n_kv + 1, self.block_q, self.block_kv, dtype=torch.bool, device=device)
        if self.full_kv_num_blocks is not None:
            idx = _listed(self.full_kv_num_blocks[..., m], self.full_kv_indices[..., m, :], n_kv)
            ones = torch.ones(*idx.shape, self.block_q, self.block_kv, dtype=torch.bool, device=device)
            grid.scatter_(2, _expand_idx(idx, self.block_q, self.block_kv), ones)
        idx = _listed(self.kv_num_blocks[..., m], self.kv_indices[..., m, :], n_kv)
        bits = unpack_bits(self.partial_bits[:, :, m], self.block_kv)
        grid.scatter_(2, _expand_idx(idx, self.block_q, self.block_kv), bits)
        grid = grid[:, :, :n_kv]
        return grid.permute(0, 1, 3, 2, 4).reshape(b, h, self.block_q, n_kv * self.block_kv)


def _listed(count: torch.Tensor, indices: torch.Tensor, spare: int) -> torch.Tensor:
    """``indices`` with the unlisted slots (slot >= count) redirected to block ``spare``."""
    slots = torch.arange(indices.shape[-1], device=indices.device)
    return torch.where(slots < count[..., None], indices.long(), spare)


def _expand_idx(idx: torch.Tensor, bq: int, bk: int) -> torch.Tensor:
    return idx[..., None, None].expand(*idx.shape, bq, bk)


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Pack a bool ``[..., n]`` (n % 32 == 0) into int32 ``[..., n // 32]``, bit j%32 of word j//32.

    >>> pack_bits(torch.tensor([[True] + [False] * 30 + [True]])).tolist()
    [[-2147483647]]
    """
    words = mask.reshape(*mask.shape[:-1], -1, 32).to(torch.int64)
    shifts = torch.arange(32, device=mask.device, dtype=torch.int64)
    packed = (words << shifts).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_bits(words: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: int32 ``[..., n // 32]`` to bool ``[..., n]``."""
    shifts = torch.arange(32, device=words.device, dtype=torch.int32)
    return ((words[..., None] >> shifts) & 1).bool().reshape(*words.shape[:-1], n)


def _eval_mask_mod(mask_mod, b, h, q_idx, kv_idx) -> torch.Tensor:
    """Evaluate a flex mask_mod on broadcastable index tensors; vmap for mods that need scalars."""
    try:
        out = mask_mod(b, h, q_idx, kv_idx)
        return torch.as_tensor(out, device=q_idx.device).bool().expand(
            torch.broadcast_shapes(b.shape, h.shape, q_idx.shape, kv_idx.shape)
        )
    except (RuntimeError, TypeError, IndexError):
        shape = torch.broadcast_shapes(b.shape, h.shape, q_idx.shape, kv_idx.shape)
        flat = [t.expand(shape).reshape(-1) for t in (b, h, q_idx, kv_idx)]
        return torch.vmap(mask_mod)(*flat).bool().reshape(shape)


def _from_block_mask(bm) -> BlockSparseMask:
    lq, lk = (int(x) for x in bm.seq_lengths)
    bq, bk = (int(x) for x in bm.BLOCK_SIZE) if isinstance(bm.BLOCK_SIZE, tuple) else (bm.BLOCK_SIZE,) * 2
    if bk % 32 != 0:
        raise ValueError(f"block_mask kv block size must be a multiple of 32, got {bk}")
    cnt = bm.kv_num_blocks.to(torch.int32)
    n_partial = int(cnt.max()) if cnt.numel() else 0
    kv_idx = bm.kv_indices[..., : max(n_partial, 1)].to(torch.int32).contiguous()
    full_cnt = full_idx = None
    n_full = 0
    if bm.full_kv_num_blocks is not None:
        full_cnt = bm.full_kv_num_blocks.to(torch.int32)
        n_full = int(full_cnt.max()) if full_cnt.numel() else 0
        full_idx = bm.full_kv_indices[..., : max(n_full, 1)].to(torch.int32).contiguous()

    bsz, heads, n_q = cnt.shape
    bits = torch.zeros(bsz, heads, n_q, kv_idx.shape[-1], bq, bk // 32, dtype=torch.int32, device=cnt.device)
    listed = (torch.arange(kv_idx.shape[-1], device=cnt.device) < cnt[..., None]).nonzero()
    q_off = torch.arange(bq, device=cnt.device)
    k_off = torch.arange(bk, device=cnt.device)
    for start in range(0, listed.shape[0], _BITMAP_CHUNK):
        b, h, m, s = listed[start : start + _BITMAP_CHUNK].unbind(-1)
        q_idx = (m * bq)[:, None, None] + q_off[None, :, None]
        kv_pos = (kv_idx[b, h, m, s].long() * bk)[:, None, None] + k_off[None, None, :]
        # the last blocks run past Lq/Lk: evaluate the mask_mod on in-range (clamped) positions only, as
        # flex does, since mods that index a tensor of length L (document ids) fail beyond it
        mask = _eval_mask_mod(bm.mask_mod, b[:, None, None], h[:, None, None], q_idx.clamp(max=lq - 1),
                              kv_pos.clamp(max=lk - 1))
        mask = mask & (q_idx < lq) & (kv_pos < lk)
        bits[b, h, m, s] = pack_bits(mask)

    n_kv_blocks = -(-lk // bk)
    rows = bsz * heads * n_q
    total_listed = int(cnt.sum()) + (int(full_cnt.sum()) if full_cnt is not None else 0)
    return BlockSparseMask(
        seq_lengths=(lq, lk),
        block_q=bq,
        block_kv=bk,
        kv_num_blocks=cnt.contiguous(),
        kv_indices=kv_idx,
        full_kv_num_blocks=None if full_cnt is None else full_cnt.contiguous(),
        full_kv_indices=full_idx,
        partial_bits=bits,
        density=total_listed / max(rows * n_kv_blocks, 1),
        partial_fraction=int(cnt.sum()) / max(total_listed, 1),
    )
