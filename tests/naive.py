"""Naive float64 attention for tests: materialises the full (Lq, Lk) mask, no chunking, plain autograd.

Deliberately independent of inductor_attn.backends.reference so the two can check each other.
"""

from __future__ import annotations

import torch


def dense_mask(lq: int, lk: int, causal=False, window_left=-1, window_right=-1, kv_len=None) -> torch.Tensor:
    n = lk if kv_len is None else kv_len
    i = torch.arange(lq)[:, None] + (n - lq)
    j = torch.arange(lk)[None, :]
    ok = j < n
    right = 0 if causal else window_right
    if right >= 0:
        ok = ok & (j <= i + right)
    if window_left >= 0:
        ok = ok & (j >= i - window_left)
    return ok


def attend(q, k, v, mask, scale, softcap=0.0):
    """q (B,Hq,Lq,D), k/v (B,Hkv,Lk,*), mask broadcastable to (B,Hq,Lq,Lk); float64 out and lse. ``softcap`` > 0:
    scores capped as softcap * tanh(s / softcap) before the mask."""
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return p @ v, lse


def dense(q, k, v, scale, causal=False, window_left=-1, window_right=-1, kv_seqlens=None, key_mask=None):
    lq, lk = q.shape[2], k.shape[2]
    if kv_seqlens is None:
        mask = dense_mask(lq, lk, causal, window_left, window_right)
    else:
        mask = torch.stack([dense_mask(lq, lk, causal, window_left, window_right, int(n)) for n in kv_seqlens])
        mask = mask[:, None]
    if key_mask is not None:  # (B, Lk): per batch, per key
        mask = mask & key_mask.cpu()[:, None, None, :]
    return attend(q, k, v, mask.to(q.device), scale)


def varlen(q, k, v, cu_q, cu_k, scale, causal=False, window_left=-1, window_right=-1):
    outs, lses = [], []
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    for i in range(len(cu_q) - 1):
        qs = q[cu_q[i]:cu_q[i + 1]].transpose(0, 1)[None]
        ks = k[cu_k[i]:cu_k[i + 1]].transpose(0, 1)[None]
        vs = v[cu_k[i]:cu_k[i + 1]].transpose(0, 1)[None]
        mask = dense_mask(qs.shape[2], ks.shape[2], causal, window_left, window_right).to(q.device)
        o, l = attend(qs, ks, vs, mask, scale)
        outs.append(o[0].transpose(0, 1))
        lses.append(l[0])
    return torch.cat(outs), torch.cat(lses, dim=1)
