"""Compact block-sparse mask that any kernel can evaluate without calling Python.

Built once from a flex_attention ``BlockMask`` (same meaning of its fields):
- ``kv_num_blocks``/``kv_indices``: per (batch, head, q block) the kv blocks that are *partial* (the
  mask must be evaluated inside them); ``full_kv_num_blocks``/``full_kv_indices``: the kv blocks that are
  fully visible. Batch and head dims are 1 when the mask broadcasts over them.
- ``partial_bits``: int32 ``[B', H', num_q_blocks, max_partial, block_q, block_kv // 32]``: bit ``j % 32``
  of word ``j // 32`` in row ``i`` says whether query ``i`` of the q block sees key ``j`` of the listed
  kv block. Slot ``s`` holds the bitmap of ``kv_indices[..., s]``.

``density`` and ``partial_fraction`` (see ``Problem``) are -1 when unknown: a flex_attention call routed
in a compiled graph (routing/flex_route.py) builds the bitmaps in the graph and never reads them back.

``documents`` is set when the mask is exactly packed documents (each query sees the keys of its own
document, up to itself when causal), found once per conversion: such a mask then runs as varlen attention
(api.py), whose kernels skip the partial blocks' bitmaps. Set it to None to keep the block-sparse kernels.

Index tensors are cut to the longest row (``max(kv_num_blocks)``), so memory grows with the number of
listed blocks, never with Lq x Lk: flex keeps ``kv_indices`` as wide as all kv blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._compat import traced_argument_uses

# Bitmaps are filled this many partial blocks at a time: bounds the bool scratch to
# chunk * block_q * block_kv bytes (64 blocks of 128x128 = 1 MiB).
_BITMAP_CHUNK = 64


@dataclass(frozen=True)
class Documents:
    """Packed documents of Lq == Lk tokens per batch row: query i sees exactly the keys of its own document,
    and only those up to itself when ``causal``. ``cu_seqlens`` (int32) holds every batch row's document
    starts, row b offset by b * L, then B' * L: the varlen ``cu_seqlens`` of the mask's B' rows packed one
    after another; ``max_seqlen`` is the longest document."""
    cu_seqlens: torch.Tensor
    max_seqlen: int
    causal: bool


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
    documents: Documents | None = None
    # dims ("batch", "head") the mask is shared over (size 1) although its mask_mod reads that index: right only
    # for calls of one batch row / one head (check_block_sparse refuses others); see from_block_mask
    shared_but_read: tuple[str, ...] = ()

    @property
    def num_q_blocks(self) -> int:
        return self.kv_num_blocks.shape[-1]

    @classmethod
    def from_block_mask(cls, block_mask, batch: int | None = None, heads: int | None = None) -> BlockSparseMask:
        """Convert a flex ``BlockMask`` (evaluates its mask_mod on the partial blocks only, on its device).

        A BlockMask made with ``B=None`` or ``H=None`` is shared over that dim, while flex still calls its
        mask_mod with each call's real batch and head index. Where the mask_mod reads that index, the bitmaps
        differ per row or head: given the call's ``batch`` / ``heads``, the mask is built per row / head; without
        them it stays shared, noted in ``shared_but_read``, and a call with more than one such row or head is
        refused (``attention`` with a flex BlockMask passes both itself)."""
        return _from_block_mask(block_mask, batch, heads)

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
    """Evaluate a flex mask_mod on broadcastable index tensors, under vmap as flex's ``create_mask`` does: each
    (b, h, q, kv) on its own, so a mod that reduces over an index (``valid[b].any()``) reduces over that one value,
    not over every block of a chunk. A mod vmap cannot run is called on the tensors themselves."""
    shape = torch.broadcast_shapes(b.shape, h.shape, q_idx.shape, kv_idx.shape)
    flat = [t.expand(shape).reshape(-1) for t in (b, h, q_idx, kv_idx)]
    try:
        return torch.vmap(mask_mod)(*flat).bool().reshape(shape)
    except (RuntimeError, TypeError, IndexError, ValueError):
        return torch.as_tensor(mask_mod(b, h, q_idx, kv_idx), device=q_idx.device).bool().expand(shape)


def _index_reads(mask_mod, device) -> list[bool]:
    """Whether ``mask_mod`` reads its batch index and its head index, from its trace under vmap (as flex's
    ``create_mask`` calls it: a mod may index a tensor with them) on one index each; a mod that cannot be traced
    so is taken to read both (its bitmaps are then built per row and head, which is right whatever it reads)."""
    indices = tuple(torch.zeros(1, dtype=torch.int32, device=device) for _ in range(4))
    uses = traced_argument_uses(torch.vmap(mask_mod), indices)
    return [True, True] if uses is None or len(uses) < 2 else uses[:2]


def _from_block_mask(bm, batch: int | None = None, heads: int | None = None) -> BlockSparseMask:
    lq, lk = (int(x) for x in bm.seq_lengths)
    bq, bk = (int(x) for x in bm.BLOCK_SIZE) if isinstance(bm.BLOCK_SIZE, tuple) else (bm.BLOCK_SIZE,) * 2
    if bk % 32 != 0:
        raise ValueError(f"block_mask kv block size must be a multiple of 32, got {bk}")
    lists = [bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices]
    shared_but_read = []
    sizes = (batch, heads)
    for dim, reads in enumerate(_index_reads(bm.mask_mod, bm.kv_num_blocks.device)
                                if 1 in bm.kv_num_blocks.shape[:2] else ()):
        if bm.kv_num_blocks.shape[dim] != 1 or not reads:
            continue
        if sizes[dim] is None or sizes[dim] == 1:
            shared_but_read.append(("batch", "head")[dim])
            continue
        # flex calls the mask_mod with each real index: one mask per row (head), its block lists repeated
        lists = [t if t is None else t.expand(*t.shape[:dim], sizes[dim], *t.shape[dim + 1:]) for t in lists]
    cnt = lists[0].to(torch.int32).contiguous()
    n_partial = int(cnt.max()) if cnt.numel() else 0
    kv_idx = lists[1][..., : max(n_partial, 1)].to(torch.int32).contiguous()
    full_cnt = full_idx = None
    n_full = 0
    if lists[2] is not None:
        full_cnt = lists[2].to(torch.int32).contiguous()
        n_full = int(full_cnt.max()) if full_cnt.numel() else 0
        full_idx = lists[3][..., : max(n_full, 1)].to(torch.int32).contiguous()

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
    mask = BlockSparseMask(
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
        shared_but_read=tuple(shared_but_read),
    )
    mask.documents = find_documents(mask)
    return mask


def _row_spans(mask: BlockSparseMask) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per batch row and query (``[B', Lq]``, int64): how many keys the query sees, the first and the last
    (first Lk and last -1 where it sees none), from the block lists and bitmaps of head 0 (the same for
    every head: :func:`_same_for_every_head`)."""
    lq, lk = mask.seq_lengths
    bq, bk = mask.block_q, mask.block_kv
    cnt = mask.kv_num_blocks[:, 0]
    bsz, n_q = cnt.shape
    device = cnt.device
    count = torch.zeros(bsz, n_q * bq, dtype=torch.int64, device=device)
    first = torch.full_like(count, lk)
    last = torch.full_like(count, -1)
    if mask.full_kv_num_blocks is not None:
        full_cnt, full_idx = mask.full_kv_num_blocks[:, 0], mask.full_kv_indices[:, 0].long()
        listed = torch.arange(full_idx.shape[-1], device=device) < full_cnt[..., None]
        start = full_idx * bk
        stop = (start + bk).clamp(max=lk)
        count += ((stop - start) * listed).sum(-1).repeat_interleave(bq, dim=1)
        first = torch.minimum(first, torch.where(listed, start, lk).amin(-1).repeat_interleave(bq, dim=1))
        last = torch.maximum(last, torch.where(listed, stop - 1, -1).amax(-1).repeat_interleave(bq, dim=1))
    listed = (torch.arange(mask.kv_indices.shape[-1], device=device) < cnt[..., None]).nonzero()
    k_off = torch.arange(bk, device=device)
    q_off = torch.arange(bq, device=device)
    for chunk in listed.split(_BITMAP_CHUNK):
        b, m, s = chunk.unbind(-1)
        seen = unpack_bits(mask.partial_bits[b, 0, m, s], bk)  # [chunk, bq, bk]
        keys = (mask.kv_indices[b, 0, m, s].long() * bk)[:, None, None] + k_off
        rows = (b * n_q * bq + m * bq)[:, None] + q_off  # flat index into [B', n_q * bq]
        count.view(-1).index_add_(0, rows.flatten(), seen.sum(-1).flatten())
        first.view(-1).scatter_reduce_(0, rows.flatten(), torch.where(seen, keys, lk).amin(-1).flatten(), "amin")
        last.view(-1).scatter_reduce_(0, rows.flatten(), torch.where(seen, keys, -1).amax(-1).flatten(), "amax")
    return count[:, :lq], first[:, :lq], last[:, :lq]


def _lists_a_block_twice(mask: BlockSparseMask) -> bool:
    """Whether a q block lists one kv block twice (in one list, or as full and partial): a hand-made mask
    can, and :func:`_row_spans` would then count its keys twice."""
    lists = [(mask.kv_num_blocks, mask.kv_indices)]
    if mask.full_kv_num_blocks is not None:
        lists.append((mask.full_kv_num_blocks, mask.full_kv_indices))
    slots = []
    for cnt, idx in lists:  # unlisted slots get distinct negative values, so they never repeat
        width = idx.shape[-1]
        taken = sum(s.shape[-1] for s in slots)
        unlisted = -1 - taken - torch.arange(width, device=idx.device)
        slots.append(torch.where(torch.arange(width, device=idx.device) < cnt[..., None], idx, unlisted))
    ordered = torch.cat(slots, dim=-1).sort(dim=-1).values
    return bool((ordered[..., 1:] == ordered[..., :-1]).any())


def _same_for_every_head(mask: BlockSparseMask) -> bool:
    """Whether every head lists the blocks and bitmaps of head 0 (a mask built with H heads from a mask_mod
    that ignores the head)."""
    if mask.kv_num_blocks.shape[1] == 1:  # one mask for all heads: nothing to compare (the bitmaps may be large)
        return True
    lists = [(mask.kv_num_blocks, mask.kv_indices, mask.partial_bits)]
    if mask.full_kv_num_blocks is not None:
        lists.append((mask.full_kv_num_blocks, mask.full_kv_indices, None))
    for cnt, idx, bits in lists:
        listed = torch.arange(idx.shape[-1], device=idx.device) < cnt[..., None]
        for t in (cnt, torch.where(listed, idx, -1), None if bits is None else bits * listed[..., None, None]):
            if t is not None and not torch.equal(t, t[:, :1].expand_as(t)):
                return False
    return True


def find_documents(mask: BlockSparseMask) -> Documents | None:
    """The mask's :class:`Documents`, or None unless it is exactly packed documents (Lq == Lk, the same mask
    for every head, no kv block listed twice for a q block). A few device syncs. Query i of a document starting
    at s and ending before e sees keys [s, i] when causal, [s, e) otherwise: every query sees one
    contiguous span; a document starts where a query's span starts at itself, and every query's span
    starts at its document's start."""
    lq, lk = mask.seq_lengths
    if lq != lk or lq == 0 or not _same_for_every_head(mask) or _lists_a_block_twice(mask):
        return None
    count, first, last = _row_spans(mask)
    i = torch.arange(lq, device=count.device)
    starts = first == i
    doc_start = torch.cummax(torch.where(starts, i, 0), dim=1).values  # the start of each query's document
    doc_id = starts.cumsum(1) - 1
    lengths = torch.zeros_like(count).scatter_add_(1, doc_id.clamp(min=0), torch.ones_like(count))
    doc_end = doc_start + lengths.gather(1, doc_id.clamp(min=0))
    spans = (count == last - first + 1) & (first == doc_start) & starts[:, :1]
    causal, full = bool((spans & (last == i)).all()), bool((spans & (last == doc_end - 1)).all())
    if not (causal or full):
        return None
    bsz = count.shape[0]
    cu = torch.cat([(i + lq * torch.arange(bsz, device=i.device)[:, None])[starts], i.new_tensor([bsz * lq])])
    return Documents(cu.to(torch.int32), int(lengths.max()), causal)
