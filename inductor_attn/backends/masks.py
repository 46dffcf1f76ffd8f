"""The lower-right aligned causal/window rule as tensor code, shared by the backends that build masks in
PyTorch (reference, sdpa's additive bias, flex's window mask_mod). Kernels carry their own copy of the
rule in their language.

Query i sees key j iff j < n and d - left <= j <= d + right, where d = i + n - Lq is query i's own
position among the keys (n = Lk, or kv_seqlens[b]), right = 0 if causal else window_right, and -1 means
unbounded (FlashAttention's convention); a key_mask (B, Lk) removes keys on top.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

MaskFn = Callable[[int, int], torch.Tensor | None]


def window_visible(q_pos, k_pos, offset, causal: bool, window_left: int, window_right: int):
    """Bool tensor: whether query position ``q_pos`` sees key ``k_pos`` (broadcasting), ``offset`` = n - Lq.

    >>> i, j = torch.arange(2)[:, None], torch.arange(3)[None, :]
    >>> window_visible(i, j, 1, True, -1, -1).int().tolist()
    [[1, 1, 0], [1, 1, 1]]
    """
    diag = q_pos + offset
    right = 0 if causal else window_right
    ok = k_pos >= 0
    if right >= 0:
        ok = ok & (k_pos <= diag + right)
    if window_left >= 0:
        ok = ok & (k_pos >= diag - window_left)
    return ok


def dense_mask_fn(len_q: int, len_k: int, causal: bool, window_left: int, window_right: int,
                  kv_seqlens: torch.Tensor | None, device, key_mask: torch.Tensor | None = None) -> MaskFn | None:
    """``rows(start, end)``: the bool mask of query rows [start, end) as (B or 1, 1, 1, rows, Lk), or None
    when nothing is masked. With kv_seqlens each batch aligns to its own length."""
    if (window_right < 0 and not causal) and window_left < 0 and kv_seqlens is None and key_mask is None:
        return None
    n = (kv_seqlens.to(device=device, dtype=torch.int64) if kv_seqlens is not None
         else torch.full((1,), len_k, device=device, dtype=torch.int64))
    keys = torch.arange(len_k, device=device)

    def rows(start: int, end: int) -> torch.Tensor:
        q_pos = torch.arange(start, end, device=device)[None, :, None]
        ok = window_visible(q_pos, keys, (n - len_q)[:, None, None], causal, window_left, window_right)
        ok = ok & (keys[None, None, :] < n[:, None, None])
        if key_mask is not None:
            ok = ok & key_mask.to(device)[:, None, :]
        return ok[:, None, None]

    return rows
