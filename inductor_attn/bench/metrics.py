"""What one call of a workload computes and moves: exact kept (query, key) pairs, FLOPs and bytes.

FLOPs are 4 * (head_dim + head_dim_v) / 2 per kept pair and query head (two matmuls), as in
Problem.flops(). The pairs are counted exactly per call, where Problem.flops() has to estimate:
- causal and windows are lower-right aligned (query i sees keys j <= i + Lk - Lq), per sequence for
  varlen and per batch row's own length with kv_seqlens;
- block-sparse masks count full blocks (clipped at the sequence ends) plus the set bits of the partial
  blocks' bitmaps, not density x Lq x Lk.
Decode is memory-bound, so it is reported as bytes moved / time: K and V of the kv heads read once (the
valid ``kv_seqlens`` rows only), plus q read and out written once.

A training step's attention (the backward suite) counts the forward's FLOPs and 2.5 times them for the
backward (five matmuls against the forward's two), as FlashAttention's benchmarks count them.
"""

from __future__ import annotations

import torch

from ..backends import AttnCall
from ..ops import BlockSparseMask
from ..problem import kept_pairs

TRAINING_FLOPS = 3.5  # forward + backward, in forward FLOPs


def call_pairs(call: AttnCall) -> int:
    """Kept (query, key) pairs of one call, summed over batch rows (or sequences) and query heads."""
    hq = call.q.shape[1]  # (B, H, L, D) and varlen's (T, H, D) alike
    right = call.window_right
    if call.op == "block_sparse":
        return sparse_pairs(call.sparse, call.q.shape[0], hq)
    if call.op == "paged":  # sequence b: its queries (one each without cu_seqlens_q), kv_seqlens[b] keys
        lens_k = call.kv_seqlens.tolist()
        starts = call.cu_seqlens_q.tolist() if call.cu_seqlens_q is not None else range(len(lens_k) + 1)
        lens_q = [b - a for a, b in zip(starts, starts[1:])]
        return hq * sum(kept_pairs(lq, lk, call.causal, call.window_left, right) for lq, lk in zip(lens_q, lens_k))
    if call.op == "varlen":
        starts_q, starts_k = call.cu_seqlens_q.tolist(), call.cu_seqlens_k.tolist()
        lens = zip((b - a for a, b in zip(starts_q, starts_q[1:])), (b - a for a, b in zip(starts_k, starts_k[1:])))
        pairs = sum(kept_pairs(lq, lk, call.causal, call.window_left, right) for lq, lk in lens)
        return hq * pairs
    b, _, lq, _ = call.q.shape
    lk = call.k.shape[2]
    if call.kv_seqlens is None:
        return b * hq * kept_pairs(lq, lk, call.causal, call.window_left, right)
    # each row aligns to its own length (lower-right): that is a problem of Lk = n_b
    return hq * sum(kept_pairs(lq, n, call.causal, call.window_left, right) for n in call.kv_seqlens.tolist())


def call_flops(call: AttnCall) -> float:
    d = (call.q.shape[-1] + call.v.shape[-1]) / 2
    return 4.0 * call_pairs(call) * d


def decode_bytes(call: AttnCall) -> int:
    """Bytes a decode call must move at least: valid K and V rows of the kv heads once, q and out once.

    >>> q, k = torch.zeros(2, 4, 1, 8), torch.zeros(2, 2, 16, 8)
    >>> decode_bytes(AttnCall("attention", q, k, k, 1.0, kv_seqlens=torch.tensor([16, 8])))
    3584
    """
    b, hq, lq, d = call.q.shape
    hkv, lk, dv = call.k.shape[1], call.k.shape[2], call.v.shape[-1]
    es = call.q.element_size()
    rows = sum(call.kv_seqlens.tolist()) if call.kv_seqlens is not None else b * lk
    return rows * hkv * (d + dv) * es + b * hq * lq * (d + dv) * es


def sparse_pairs(mask: BlockSparseMask, batch: int, heads_q: int) -> int:
    """Exact kept pairs of a block-sparse mask over ``batch`` rows and ``heads_q`` query heads: every
    listed full block counts its in-range rows x columns, every listed partial block its set bits (the
    bitmaps hold in-range bits only). A mask that broadcasts over batch or heads counts once per row/head.
    """
    per = _sparse_pairs_per_row(mask)  # [B', H']
    b_rep = batch // per.shape[0]
    h_rep = heads_q // per.shape[1]
    return int(per.sum().item()) * b_rep * h_rep


def _sparse_pairs_per_row(mask: BlockSparseMask) -> torch.Tensor:
    lq, lk = mask.seq_lengths
    bq, bk = mask.block_q, mask.block_kv
    device = mask.kv_num_blocks.device
    m = mask.num_q_blocks
    rows = (lq - torch.arange(m, device=device) * bq).clamp(0, bq).to(torch.int64)  # [M]
    total = torch.zeros(mask.kv_num_blocks.shape[:2], dtype=torch.int64, device=device)
    if mask.full_kv_num_blocks is not None:
        idx = mask.full_kv_indices.to(torch.int64)  # [B', H', M, F]
        listed = torch.arange(idx.shape[-1], device=device) < mask.full_kv_num_blocks[..., None]
        cols = (lk - idx * bk).clamp(0, bk)
        total += (cols * listed * rows[:, None]).sum((-1, -2))
    listed = torch.arange(mask.kv_indices.shape[-1], device=device) < mask.kv_num_blocks[..., None]  # [B',H',M,S]
    for start in range(0, m, 64):  # bounded scratch: popcount in int64 on 64 q blocks at a time
        bits = popcount32(mask.partial_bits[:, :, start : start + 64]).sum((-1, -2))  # [B', H', m', S]
        total += (bits * listed[:, :, start : start + 64]).sum((-1, -2))
    return total


def popcount32(words: torch.Tensor) -> torch.Tensor:
    """Set bits of each int32 word (as int64), by the SWAR bit-count: exact and branch-free.

    >>> popcount32(torch.tensor([0, 1, 3, -1, -2147483648], dtype=torch.int32)).tolist()
    [0, 1, 2, 32, 1]
    """
    x = words.to(torch.int64) & 0xFFFFFFFF
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    return ((x * 0x01010101) & 0xFFFFFFFF) >> 24
