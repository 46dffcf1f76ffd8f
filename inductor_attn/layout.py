"""Output layout contract of every op, shared by the fake impls and the dispatcher.

``out`` (and ``dq``/``dk``/``dv``) follow the *stride order* of their input (``q``, or ``k``/``v``):
for q given as a transpose view of (B, L, H, D) memory, out is (B, H, L, Dv) with (B, L, H, Dv) memory,
which is what cuDNN and FA4 produce natively, so no copy is needed for them. lse is contiguous.
Inductor asserts the strides the fake impl promised, so a backend returning another layout is copied
into this one by the dispatcher (``conform``).
"""

from __future__ import annotations

import math

import torch


def stride_order(x: torch.Tensor) -> list[int]:
    """Dims from outermost to innermost in memory (ties keep the logical order).

    >>> stride_order(torch.empty(2, 5, 3, 4).transpose(1, 2))
    [0, 2, 1, 3]
    """
    strides = x.stride()  # read once: every launch computes this for its outputs
    # an insertion sort, not sorted(key=...): Dynamo traces comparisons of symbolic strides (dynamic=True) but not
    # a sort by them, and for four dims it takes half the time
    order: list[int] = []
    for d, stride in enumerate(strides):
        i = 0
        while i < d and strides[order[i]] >= stride:
            i += 1
        order.insert(i, d)
    return order


def empty_like_layout(like: torch.Tensor, size, dtype=None) -> torch.Tensor:
    """An uninitialised tensor of ``size`` whose memory follows ``like``'s stride order."""
    return torch.empty_permuted(size, stride_order(like), dtype=dtype or like.dtype, device=like.device)


# ops whose queries come packed, (total_q, H, D) by cu_seqlens_q: their lse is (H, total_q), the others' (B, H, Lq)
PACKED_OPS = ("varlen", "paged")


def new_out(q: torch.Tensor, v: torch.Tensor, dtype=None) -> torch.Tensor:
    """A forward's empty ``out``: q's shape with v's head dim, in q's stride order, q's dtype unless given."""
    return empty_like_layout(q, (*q.shape[:-1], v.shape[-1]), dtype)


def new_outputs(op: str, q: torch.Tensor, v: torch.Tensor, dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
    """A forward's empty ``(out, lse)`` for op ``op`` (:func:`new_out`; lse float32, contiguous)."""
    lse_shape = (q.shape[1], q.shape[0]) if op in PACKED_OPS else q.shape[:-1]
    return new_out(q, v, dtype), torch.empty(lse_shape, dtype=torch.float32, device=q.device)


def new_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
    """A backward's empty ``[dq, dk, dv]``, each in its input's shape and stride order."""
    return [empty_like_layout(x, x.shape) for x in (q, k, v)]


def layout_strides(like: torch.Tensor, size) -> tuple:
    """The strides of ``empty_like_layout(like, size)``, without allocating: contiguous in ``like``'s stride
    order, each dim's stride the product of the sizes inside it, a size of 0 counted as 1 (c10's
    contiguous strides, which ``empty_permuted`` uses)."""
    strides, step = [1] * len(size), 1
    for d in reversed(stride_order(like)):
        strides[d] = step
        n = size[d]
        step = step * (max(n, 1) if type(n) is int else torch.sym_max(n, 1))  # sym_max alone: 3x the time
    return tuple(strides)


def conform(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` itself if it already has the layout ``empty_like_layout(like, t.shape)`` would give, else a copy.
    Runs on every eager launch's outputs: the layout is compared by computed strides, not a test allocation."""
    if layout_strides(like, t.shape) == t.stride():
        return t
    return empty_like_layout(like, t.shape, t.dtype).copy_(t)


def filled_like(like: torch.Tensor, fill) -> torch.Tensor:
    """A new tensor with ``like``'s shape, strides, dtype and device whose memory ``fill`` writes (it gets the
    1-D tensor of every element the strides reach): overlapping strides, as of an ``expand``-ed input, are
    kept, where writing through such a view raises."""
    if like.numel() == 0:
        return torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device=like.device)
    reach = 1 + sum((n - 1) * s for n, s in zip(like.shape, like.stride()))
    base = torch.empty(reach, dtype=like.dtype, device=like.device)
    fill(base)
    return base.as_strided(like.shape, like.stride())


def broadcast_strides(x: torch.Tensor, batch: int, heads: int) -> tuple[int, ...]:
    """The strides of ``x.expand(batch, heads, *x.shape[2:])`` without making the view (a view costs a few
    microseconds per kernel argument on a launch's host path): 0 where a size-1 dim broadcasts.

    >>> broadcast_strides(torch.zeros(1, 3, 4), 2, 3), broadcast_strides(torch.zeros(1, 1, 4), 1, 5)
    ((0, 4, 1), (4, 0, 1))
    """
    size, stride = x.shape, x.stride()
    return ((0 if size[0] == 1 and batch != 1 else stride[0]), (0 if size[1] == 1 and heads != 1 else stride[1]),
            *stride[2:])


# ------------------------------------------------------------------------ inputs of prebuilt CUDA libraries
def tma_aligned(x: torch.Tensor, broadcast_ok: bool) -> bool:
    """Whether FA3's and FA4's TMA loads take ``x`` as it is: its last dim contiguous, its pointer 16-byte aligned
    and every other stride a multiple of 16 bytes (FA4: ``cute_dsl_utils._is_aligned_layout``). A stride of 0 on a
    dim longer than 1 (broadcast) passes only with ``broadcast_ok``: FA4 takes it, FA3 does not."""
    # called for each input of every FA3 and FA4 launch: one gcd and one membership test, not a loop over the dims
    # (0.5 against 1.4 us on a CPU)
    strides = x.stride()
    if strides[-1] != 1 or x.data_ptr() % 16 or math.gcd(*strides[:-1]) % max(1, 16 // x.element_size()):
        return False
    return broadcast_ok or 0 not in strides or all(n == 1 for s, n in zip(strides, x.shape) if s == 0)


def int32_contiguous(x: torch.Tensor | None) -> torch.Tensor | None:
    """An index tensor (lengths, cu_seqlens) as FA3 and FA4 read it: int32 with unit stride (a copy where it is
    not); None stays None."""
    return x if x is None or (x.dtype == torch.int32 and x.stride(0) == 1) else x.to(torch.int32).contiguous()
