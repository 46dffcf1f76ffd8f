"""Reading a BlockSparseMask's partial-block bitmaps from inside a kernel's mask function.

Shared by the fa4 and flex backends, which both evaluate the mask per (query, key) inside partial blocks
and look the answer up instead of calling the user's mask_mod: ``slot_of[b, h, m, n]`` finds kv block
n's place in q block m's partial list, and ``partial_bits`` holds that block's bits (layout in
``block_mask.py``). fa4 does the lookup in CuTe, flex in torch (:func:`bitmap_lookup`).
"""

from __future__ import annotations

import torch

from ..block_mask import BlockSparseMask


def slot_table(sparse: BlockSparseMask) -> torch.Tensor:
    """int32 [B', H', M, N]: the partial-list slot of kv block n for q block m (0 where not partial,
    so a lookup there stays in range; kernels never ask, they skip full and unlisted blocks).

    >>> cnt = torch.tensor([[[1, 2]]], dtype=torch.int32)  # q block 0 lists kv block 1; q block 1 both
    >>> idx = torch.tensor([[[[1, 0], [0, 1]]]], dtype=torch.int32)
    >>> bits = torch.zeros(1, 1, 2, 2, 32, 1, dtype=torch.int32)
    >>> slot_table(BlockSparseMask((64, 64), 32, 32, cnt, idx, None, None, bits, 1.0, 1.0)).tolist()
    [[[[0, 0], [0, 1]]]]
    """
    cnt, idx = sparse.kv_num_blocks, sparse.kv_indices
    n_kv = -(-sparse.seq_lengths[1] // sparse.block_kv)
    slots = torch.arange(idx.shape[-1], device=idx.device, dtype=torch.int32).expand_as(idx)
    target = torch.where(slots < cnt[..., None], idx.long(), n_kv)  # unlisted slots -> spare column
    table = torch.zeros(*idx.shape[:-1], n_kv + 1, dtype=torch.int32, device=idx.device)
    table.scatter_(-1, target, slots.contiguous())
    return table[..., :n_kv].contiguous()


def bitmap_lookup(slot_of: torch.Tensor, bits: torch.Tensor, block_q: int, block_kv: int,
                  b, h, q_idx, kv_idx):
    """Whether query ``q_idx`` sees key ``kv_idx``, read from the bitmap of their (partial) block.

    Index arguments are tensors (a flex mask_mod's, or broadcastable grids); batch/head dims of size 1
    broadcast. Block indices are capped, so padded positions past the sequence ends read a valid word.

    Written with the operations flex's FLASH (CuTe DSL) template lowers in torch 2.11: ``torch.clamp``
    (its ``minimum``), ``&`` with a constant (an i32 vector the DSL rejects) and an index that is a
    constant failed there on an H100 (a probe script: ``git show 9bf7835^:benchmarks/flex_flash_probe.py``),
    so the cap is arithmetic, the bit test a remainder (C-style or floored, ``!= 0`` reads the bit either
    way) and broadcast batch/head dims are dropped instead of indexed with 0.
    """
    lead = []  # batch/head indices of the dims that are not broadcast; broadcast ones are dropped
    for index in (b, h):
        dim = len(lead)  # where this dim sits once the dims before it were kept or dropped
        if slot_of.shape[dim] == 1:
            slot_of, bits = slot_of.select(dim, 0), bits.select(dim, 0)
        else:
            lead.append(index)
    m, n = q_idx // block_q, kv_idx // block_kv
    last_m, last_n = slot_of.shape[-2] - 1, slot_of.shape[-1] - 1
    m = m - (m - last_m) * (m > last_m)
    n = n - (n - last_n) * (n > last_n)
    slot = slot_of[(*lead, m, n)]
    word = bits[(*lead, m, slot, q_idx % block_q, (kv_idx % block_kv) // 32)]
    return (word >> (kv_idx % 32)) % 2 != 0
