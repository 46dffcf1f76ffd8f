"""Where a paged KV cache keeps each key: the one rule that the reference, the gather baseline and the tuner's
gate (which writes NaN wherever no key lives) share unchanged.

Key j of sequence b is slot ``j % page_size`` of block ``block_table[b, j // page_size]``, and only keys
``j < kv_seqlens[b]`` exist. Table entries past a sequence's last page are never read: servers leave anything
there (transformers' continuous batching writes -1).
"""

from __future__ import annotations

import torch


def query_starts(cu_seqlens_q: torch.Tensor | None, num_seqs: int, device: torch.device) -> torch.Tensor:
    """``cu_seqlens_q``, or for decode (None: one query per sequence) ``0, 1, ..., num_seqs``.

    >>> query_starts(None, 3, torch.device("cpu")).tolist()
    [0, 1, 2, 3]
    """
    if cu_seqlens_q is not None:
        return cu_seqlens_q
    return torch.arange(num_seqs + 1, dtype=torch.int32, device=device)


def key_slots(block_table: torch.Tensor, kv_seqlens: torch.Tensor, page_size: int, right_aligned: bool = False):
    """``(blocks, slots, exists)``, each (num_seqs, pages per sequence * page_size): position p of sequence b holds
    slot ``slots[b, p]`` of block ``blocks[b, p]`` where ``exists[b, p]``; elsewhere ``blocks`` is 0, whatever the
    table holds there. Position p is key p, or with ``right_aligned`` key p - (capacity - kv_seqlens[b]): the last
    key at the last position, as in a left-padded batch.

    >>> table, lengths = torch.tensor([[5, 7, -1]], dtype=torch.int32), torch.tensor([3])
    >>> [x.tolist() for x in key_slots(table, lengths, 2)]
    [[[5, 5, 7, 0, 0, 0]], [[0, 1, 0, 1, 0, 1]], [[True, True, True, False, False, False]]]
    >>> [x.tolist()[0][3:] for x in key_slots(table, lengths, 2, right_aligned=True)]
    [[5, 5, 7], [0, 1, 0], [True, True, True]]
    """
    width = block_table.shape[1] * page_size
    keys = torch.arange(width, device=block_table.device).expand(block_table.shape[0], width)
    if right_aligned:
        keys = keys - (width - kv_seqlens.long())[:, None]
    exists = (keys >= 0) & (keys < kv_seqlens[:, None])
    keys = keys.clamp(min=0)
    pages = (keys // page_size).clamp(max=block_table.shape[1] - 1)
    blocks = torch.where(exists, block_table.long().gather(1, pages), 0)
    return blocks, keys % page_size, exists


def gather_padded(cache: torch.Tensor, blocks: torch.Tensor, slots: torch.Tensor, exists: torch.Tensor):
    """(num_seqs, pages per sequence * page_size, Hkv, D): each sequence's keys in order from the pool ``cache``
    (num_blocks, page_size, Hkv, D), zeros where no key exists (written, never multiplied: the pool may hold
    NaN there)."""
    return cache[blocks, slots].masked_fill_(~exists[:, :, None, None], 0)


def gather_packed(cache: torch.Tensor, blocks: torch.Tensor, slots: torch.Tensor, exists: torch.Tensor):
    """(sum of kv_seqlens, Hkv, D): the keys that exist, sequence after sequence (varlen's packed layout)."""
    return cache[blocks[exists], slots[exists]]


def unused_slots(num_blocks: int, page_size: int, blocks, slots, exists) -> torch.Tensor:
    """bool (num_blocks, page_size): True where no sequence keeps a key (what the gate fills with NaN)."""
    used = torch.zeros(num_blocks, page_size, dtype=torch.bool, device=blocks.device)
    used[blocks[exists], slots[exists]] = True
    return ~used


def fill_unused(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, kv_seqlens: torch.Tensor,
                value: float) -> None:
    """Write ``value`` into every slot of the pools (num_blocks, page_size, Hkv, D) that holds no key of a sequence,
    in place: NaN for the gate, zeros for a kernel that multiplies them (the paged suite's FA3 column)."""
    page_size = k_cache.shape[1]
    unused = unused_slots(k_cache.shape[0], page_size, *key_slots(block_table, kv_seqlens, page_size))
    for x in (k_cache, v_cache):
        x[unused] = value
