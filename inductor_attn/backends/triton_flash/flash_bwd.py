"""Backward of the Triton flash-attention backend: dQ, dK, dV for dense, varlen and block-sparse calls.

Three launches (FlashAttention-2 paper, Algorithm 2; Triton tutorial 06): a preprocess writes
``delta = rowsum(dO * O) - dlse`` and ``lse * log2(e)``; a dK/dV kernel keeps BLOCK_N keys resident and
walks the query tiles that see them (summing GQA groups in registers); dQ comes from atomics inside
that kernel (``bwd_dq=atomic``) or from a second kernel that keeps a query tile resident
(``bwd_dq=separate``). The separate pass sums in a fixed order, so it is the deterministic path: it is
forced when ``torch.are_deterministic_algorithms_enabled()`` or the config says ``deterministic=True``.

Config keys carry a ``bwd_`` prefix so they can sit beside the forward's keys in one Config; unknown
keys are ignored and missing ones take the defaults below. Importing this module needs only torch:
Triton is imported at the first launch.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import os
import threading

import torch

from ...device import DeviceInfo, device_info
from ...layout import broadcast_strides, empty_like_layout
from ...problem import Problem
from ..base import AttnCall, Config
from ..triton_common import warmup_launcher

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
_MIN_TILE = 16  # tl.dot needs every dimension >= 16
_DQ_MIN_KEYS = 32  # keys per step of the dQ pass (see BwdPlan)


@dataclasses.dataclass(frozen=True)
class BwdPlan:
    """Launch parameters. ``block_n`` keys stay resident in the dK/dV kernel while it walks
    ``block_m`` rows at a time; the dQ pass swaps the roles, as the tutorial's BLOCK_M1/BLOCK_N1 vs
    BLOCK_M2/BLOCK_N2 do: ``block_n`` rows resident, ``max(block_m, 32)`` keys a step (16-key steps
    would leave its dots tiny; 128 x 32 compiles for sm_90 at d=128 without spills)."""

    block_m: int
    block_n: int
    warps: int
    stages: int
    atomic_dq: bool
    kv_split: int  # programs per (batch, kv head) sharing the GQA group; 0 = pick from the SM count


def deterministic_requested(cfg: Config) -> bool:
    return bool(cfg.get("deterministic", False)) or torch.are_deterministic_algorithms_enabled()


def plan_for(head_dim: int, cfg: Config, dtype: str = "float16") -> BwdPlan:
    """Read the ``bwd_*`` keys of ``cfg`` (a backward or a forward config), defaults for the rest: the
    first listed tile for this head dim and dtype."""
    bm, bn, warps, stages, _ = _tile_list(head_dim, dtype)[0]
    atomic = cfg.get("bwd_dq", "separate") == "atomic" and not deterministic_requested(cfg)
    return BwdPlan(int(cfg.get("bwd_block_m", bm)), int(cfg.get("bwd_block_n", bn)),
                   int(cfg.get("bwd_warps", warps)), int(cfg.get("bwd_stages", stages)), atomic,
                   int(cfg.get("bwd_kv_split", 0)))


def _fit_tile(tile: int, block: int) -> int:
    """Largest power of two <= ``tile`` (>= 16) that divides the mask block size, or 0.

    >>> _fit_tile(128, 128), _fit_tile(128, 96), _fit_tile(64, 48), _fit_tile(32, 8)
    (128, 32, 16, 0)
    """
    t = 1 << (max(tile, 1).bit_length() - 1)
    while t >= _MIN_TILE and block % t:
        t //= 2
    return t if t >= _MIN_TILE else 0


def unsupported_reason(p: Problem) -> str | None:
    """Why this backward cannot run ``p``, in words, or None."""
    if p.dtype not in {str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES}:
        return f"Triton backward supports float16, bfloat16 and float32, not {p.dtype}"
    if max(p.head_dim, p.head_dim_v) > MAX_HEAD_DIM:
        return f"Triton backward supports head dims up to {MAX_HEAD_DIM}, got {max(p.head_dim, p.head_dim_v)}"
    if p.device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "Triton kernels need a CUDA GPU (or TRITON_INTERPRET=1 on the CPU)"
    if p.device_type == "cpu" and p.dtype == "bfloat16":  # triton 3.9: errors ~1e10
        return "bfloat16 dots are wrong in Triton's interpreter (it multiplies the raw bits)"
    if p.op == "block_sparse" and not _fit_tile(_MIN_TILE, math.gcd(p.block_q, p.block_kv)):
        return f"block-sparse backward needs block_q and block_kv multiples of 16, got {p.block_q}, {p.block_kv}"
    return None


# (block_m, block_n, warps, stages, also list atomic dQ) per padded head dim, most promising first.
# Starting points from Triton tutorial 06 (32 x 128 for dK/dV, swapped for dQ), cut to tiles whose dK/dV
# kernel compiles for sm_90 without spilling: compiled with triton 3.9 + ptxas 13 on a CPU machine by
# benchmarks/tools/flash_bwd_compile_sm90.py (bf16 causal GQA). d=128: 16x128 8 warps 0 B (atomic 0 B), 32x128
# 20 B (atomic 180 B), 32x64 8 warps 0 B (atomic 28 B), while 64x64 spills 248 B and any 4-warp 128-key
# tile spills > 2 KiB; d=256: only 32-key tiles with 8 warps stay at 0 B (16x64: 164 B). Speed is
# unmeasured: the tuner measures these; the list only bounds the search.
_TILES = {
    64: [(32, 128, 4, 3, False), (64, 128, 8, 3, True), (32, 128, 8, 2, True), (64, 64, 4, 2, False),
         (32, 64, 4, 3, False)],
    128: [(16, 128, 8, 2, True), (32, 128, 8, 2, False), (32, 64, 8, 2, True), (16, 128, 8, 3, False)],
    256: [(32, 32, 8, 2, False), (16, 32, 8, 2, True), (32, 32, 8, 1, False)],
}
# fp32 runs tf32x3 dots (three tf32 products: about fp32 accuracy on tensor cores), which hold every
# operand twice: at d=128 the 16x32 8-warp tile spills 72 B, 32x32 304 B, 16x64 1.4 KiB. fp32 is the
# accuracy path, not a speed target, so it gets the two smallest tiles at every head dim.
_FP32_TILES = [(16, 32, 8, 2, False), (32, 32, 8, 2, False)]


def _tile_list(head_dim: int, dtype: str):
    if dtype == "float32":
        return _FP32_TILES
    return _TILES[64 if head_dim <= 64 else 128 if head_dim <= 128 else 256]


def backward_candidates(p: Problem, dev: DeviceInfo) -> list[tuple[Config, str | None]]:
    """Backward configs for ``p`` with their pruned reasons: each tile with the atomic-free dQ pass, and the
    marked tiles with atomic dQ too (fewer FLOPs: no recomputation of QK^T and dO V^T for dQ)."""
    tiles = _tile_list(max(p.head_dim, p.head_dim_v), p.dtype)
    if dev.arch == 0:  # the CPU interpreter runs tests, not timings: one config
        tiles = tiles[:1]
    out: dict[Config, str | None] = {}
    for bm, bn, w, s, atomic in tiles:
        reason = None
        if p.op == "block_sparse":
            g = math.gcd(p.block_q, p.block_kv)
            bm, bn = _fit_tile(bm, g), _fit_tile(bn, g)
            if not (bm and bn):
                reason = f"no tile of >= {_MIN_TILE} divides the mask blocks ({p.block_q}, {p.block_kv})"
        for mode in ("separate", "atomic") if atomic and dev.arch else ("separate",):
            cfg = Config.of(bwd_block_m=bm, bwd_block_n=bn, bwd_warps=w, bwd_stages=s, bwd_dq=mode)
            if mode == "atomic" and torch.are_deterministic_algorithms_enabled():
                reason = reason or "atomic dQ adds in any order: not deterministic (torch.use_deterministic_algorithms)"
            out.setdefault(cfg, reason)
    return list(out.items())


def _kernels():
    from . import flash_bwd_kernels  # lazy: importing triton costs time and needs the package

    return flash_bwd_kernels


def _layout(x: torch.Tensor, varlen: bool) -> tuple[int, int, int, int]:
    """(batch, head, row, dim) strides of a (B, H, L, D) tensor, or of a packed (T, H, D) one."""
    if varlen:
        return 0, x.stride(1), x.stride(0), x.stride(2)
    return x.stride()


def _row_layout(x: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    """(batch, head, row) strides of an lse-like (B, H, L) tensor, or of a packed (H, T) one."""
    if varlen:
        return 0, x.stride(0), x.stride(1)
    return x.stride()


@dataclasses.dataclass
class _Shape:
    varlen: bool
    batch: int
    heads_q: int
    heads_kv: int
    len_q: int  # max rows per sequence (the grid)
    len_k: int
    rows_total: int  # rows of delta/lse2 per (batch, head) slot as the preprocess sees them

    @classmethod
    def of(cls, call: AttnCall) -> _Shape:
        q, k = call.q, call.k
        if call.op == "varlen":
            return cls(True, call.cu_seqlens_q.shape[0] - 1, q.shape[1], k.shape[1], call.max_seqlen_q,
                       call.max_seqlen_k, q.shape[0])
        return cls(False, q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[2])


def _preprocess(launcher, kern, shape: _Shape, out, lse, grad_out, grad_lse):
    """delta and lse2 as contiguous float32 [B*H, L] (varlen: [H, T]) plus their (b, h, row) strides."""
    batch = 1 if shape.varlen else shape.batch
    rows, heads = shape.rows_total, shape.heads_q
    delta = torch.empty(batch * heads * rows, dtype=torch.float32, device=out.device)
    lse2 = torch.empty_like(delta)
    block_dv = max(_MIN_TILE, _next_pow2(out.shape[-1]))
    block_m = max(1, min(64, 8192 // block_dv))
    dlse = grad_lse if grad_lse is not None else lse
    grid = (-(-rows // block_m), batch * heads)
    launcher(kern.bwd_preprocess)[grid](out, grad_out, lse, dlse, delta, lse2,
                              *_layout(out, shape.varlen), *_layout(grad_out, shape.varlen),
                              *_row_layout(lse, shape.varlen), *_row_layout(dlse, shape.varlen),
                              heads, rows, out.shape[-1],
                              HAS_DLSE=grad_lse is not None, BLOCK_M=block_m, BLOCK_DV=block_dv)
    strides = (0, rows, 1) if shape.varlen else (heads * rows, rows, 1)
    return delta, lse2, strides


def _next_pow2(n: int) -> int:
    """Tile width covering ``n`` (Triton blocks are powers of two).

    >>> _next_pow2(80), _next_pow2(64), _next_pow2(1)
    (128, 64, 1)
    """
    return 1 << max(n - 1, 0).bit_length()


def _kv_split(plan: BwdPlan, shape: _Shape, device: torch.device) -> int:
    """Split a GQA group over several dK/dV programs when there are too few (batch x kv head x key tile)
    programs to fill the GPU (MQA with a small batch); the partial sums are added afterwards."""
    group = shape.heads_q // shape.heads_kv
    if plan.kv_split:
        return max(1, min(plan.kv_split, group))
    programs = shape.batch * shape.heads_kv * -(-shape.len_k // plan.block_n)
    target = 2 * device_info(device).sm_count
    return max(1, min(group, -(-target // max(programs, 1)))) if programs < target else 1


def _seq_tensors(call: AttnCall, dummy: torch.Tensor):
    """cu_seqlens_q, cu_seqlens_k, kv_seqlens (int32), with ``dummy`` where the kernel never reads."""
    if call.op == "varlen":
        return call.cu_seqlens_q, call.cu_seqlens_k, dummy
    if call.kv_seqlens is not None:
        return dummy, dummy, call.kv_seqlens.to(torch.int32)
    return dummy, dummy, dummy


def transpose_block_lists(sparse, num_kv_blocks: int):
    """Per (mask batch, mask head, kv block), the q blocks that list it: the dK/dV kernel's loop.

    Returns ``row_start`` int32 [B', H', n_kv + 1] and ``codes`` int32 [B', H', E] in CSR form: the
    entries of kv block n are ``codes[..., row_start[n]:row_start[n + 1]]``, ascending in q block, each
    ``q_block * slots1 + slot + 1`` (slot = -1 for a full block, else its bitmap slot). E is the listed
    width (q blocks x slots), so memory grows with the listed blocks, never with Lq x Lk; no host sync,
    so the backward stays CUDA-graph capturable. flex builds its transposed lists the same way
    conceptually (q_num_blocks/q_indices), but through a dense block matrix.

    >>> from inductor_attn.block_mask import BlockSparseMask
    >>> t = lambda x: torch.tensor(x, dtype=torch.int32)
    >>> m = BlockSparseMask((64, 64), 32, 32, t([[[1, 1]]]), t([[[[0], [1]]]]), t([[[0, 1]]]),
    ...                     t([[[[0], [0]]]]), torch.zeros(1, 1, 2, 1, 32, 1, dtype=torch.int32), 0.75, 0.67)
    >>> row_start, codes, slots1 = transpose_block_lists(m, 2)
    >>> row_start.tolist(), codes[..., :3].tolist(), slots1
    ([[[0, 2, 3]]], [[[1, 2, 3]]], 2)
    """
    cnt, idx = sparse.kv_num_blocks, sparse.kv_indices
    bp, hp, nq = cnt.shape
    dev = cnt.device
    slots1 = idx.shape[-1] + 1
    m = torch.arange(nq, device=dev).view(1, 1, nq, 1)
    lists = [(idx, cnt, m * slots1 + 1 + torch.arange(idx.shape[-1], device=dev))]
    if sparse.full_kv_num_blocks is not None:
        lists.append((sparse.full_kv_indices, sparse.full_kv_num_blocks, m * slots1))
    kv, code, valid = [], [], []
    for indices, count, c in lists:
        slot = torch.arange(indices.shape[-1], device=dev)
        kv.append(indices.long().expand(bp, hp, nq, -1))
        code.append(c.expand(bp, hp, nq, indices.shape[-1]))
        valid.append(slot < count[..., None].long())
    kv, code, valid = (torch.cat(x, dim=-1).reshape(bp, hp, -1) for x in (kv, code, valid))
    m_of = (code // slots1)
    # sort by (kv block, q block); unlisted slots get a key past every bound, so they sort last
    key = torch.where(valid, kv * nq + m_of, num_kv_blocks * nq)
    key, order = torch.sort(key, dim=-1, stable=True)
    codes = torch.gather(code, -1, order).to(torch.int32).contiguous()
    bounds = (torch.arange(num_kv_blocks + 1, device=dev) * nq).expand(bp, hp, -1).contiguous()
    row_start = torch.searchsorted(key.contiguous(), bounds).to(torch.int32)
    return row_start, codes, slots1


_TRANSPOSED: collections.OrderedDict = collections.OrderedDict()  # mask tensors' identity -> transpose_block_lists
_TRANSPOSED_KEPT = 8  # masks; a model has one or a few
_TRANSPOSED_LOCK = threading.Lock()


def transposed_block_lists(sparse, num_kv_blocks: int):
    """``transpose_block_lists``, computed once per mask: it is about 35 small kernel launches, which cost a
    block-sparse backward more host time than its own three kernels (host_profile --training "document
    ...", H100). Keyed by the mask tensors' storage, layout and version counter; an entry holds the tensors
    themselves, so their memory cannot be reused by another mask while it is kept. Not cached for fake
    tensors, nor during CUDA-graph capture (a graph must not read a tensor the cache may free)."""
    tensors = [t for t in (sparse.kv_num_blocks, sparse.kv_indices, sparse.full_kv_num_blocks,
                           sparse.full_kv_indices) if t is not None]
    if any(type(t) is not torch.Tensor for t in tensors) or (
            tensors[0].is_cuda and torch.cuda.is_current_stream_capturing()):
        return transpose_block_lists(sparse, num_kv_blocks)
    # per stream: an entry is written on the stream that made it, and the allocator reuses its memory once it is
    # evicted as soon as that stream is done with it, not another's
    stream = torch.cuda.current_stream(tensors[0].device).cuda_stream if tensors[0].is_cuda else 0
    key = (num_kv_blocks, sparse.full_kv_num_blocks is None, stream,
           *((t.data_ptr(), t.device, t.shape, t.stride(), t.dtype, t._version) for t in tensors))
    with _TRANSPOSED_LOCK:  # autograd runs backward in a thread per device
        found = _TRANSPOSED.get(key)
        if found is not None:
            _TRANSPOSED.move_to_end(key)
            return found[0]
    found = (transpose_block_lists(sparse, num_kv_blocks), tensors)
    with _TRANSPOSED_LOCK:
        _TRANSPOSED[key] = found
        while len(_TRANSPOSED) > _TRANSPOSED_KEPT:
            _TRANSPOSED.popitem(last=False)
    return found[0]


def _unfilled_block_lists(sparse, num_kv_blocks: int):
    """:func:`transpose_block_lists`' outputs allocated, not computed: what a compile passes the kernels."""
    bp, hp, nq = sparse.kv_num_blocks.shape
    width = sparse.kv_indices.shape[-1] + (0 if sparse.full_kv_indices is None else sparse.full_kv_indices.shape[-1])
    empty = functools.partial(torch.empty, dtype=torch.int32, device=sparse.kv_num_blocks.device)
    return empty(bp, hp, num_kv_blocks + 1), empty(bp, hp, nq * width), sparse.kv_indices.shape[-1] + 1


def _sparse_dkdv_args(call: AttnCall, shape: _Shape, dummy, compiling: bool):
    """Kernel arguments for the block-sparse lists of the dK/dV kernel (zeros when dense); ``compiling``:
    the lists allocated only."""
    if call.op != "block_sparse":
        return dict(ROW_START=dummy, CODES=dummy, BITS=dummy, s_csb=0, s_csh=0, s_cdb=0, s_cdh=0, s_bb=0,
                    s_bh=0, s_bm=0, s_bs=0, s_bi=0, s_bw=0, block_q=1, block_kv=1, slots1=1)
    sp = call.sparse
    lists = _unfilled_block_lists if compiling else transposed_block_lists
    row_start, codes, slots1 = lists(sp, -(-shape.len_k // sp.block_kv))
    b, h = shape.batch, shape.heads_q
    s_bb, s_bh, s_bm, s_bs, s_bi, s_bw = broadcast_strides(sp.partial_bits, b, h)
    (s_csb, s_csh, _), (s_cdb, s_cdh, _) = broadcast_strides(row_start, b, h), broadcast_strides(codes, b, h)
    return dict(ROW_START=row_start, CODES=codes, BITS=sp.partial_bits, s_csb=s_csb, s_csh=s_csh, s_cdb=s_cdb,
                s_cdh=s_cdh, s_bb=s_bb, s_bh=s_bh, s_bm=s_bm, s_bs=s_bs, s_bi=s_bi, s_bw=s_bw,
                block_q=sp.block_q, block_kv=sp.block_kv, slots1=slots1)


def _sparse_dq_args(call: AttnCall, shape: _Shape, dummy):
    """Kernel arguments for the block-sparse lists of the dQ kernel (zeros when dense)."""
    names = ("s_cb", "s_ch", "s_cm", "s_ib", "s_ih", "s_im", "s_is", "s_fcb", "s_fch", "s_fcm",
             "s_fib", "s_fih", "s_fim", "s_fis", "s_bb", "s_bh", "s_bm", "s_bs", "s_bi", "s_bw")
    if call.op != "block_sparse":
        return dict(CNT=dummy, IDX=dummy, FULL_CNT=dummy, FULL_IDX=dummy, BITS=dummy, block_q=1, block_kv=1,
                    HAS_FULL=False, **dict.fromkeys(names, 0))
    sp = call.sparse
    b, h = shape.batch, shape.heads_q
    has_full = sp.full_kv_num_blocks is not None
    full_cnt = sp.full_kv_num_blocks if has_full else sp.kv_num_blocks
    full_idx = sp.full_kv_indices if has_full else sp.kv_indices
    strides = [st for t in (sp.kv_num_blocks, sp.kv_indices, full_cnt, full_idx, sp.partial_bits)
               for st in broadcast_strides(t, b, h)]
    return dict(CNT=sp.kv_num_blocks, IDX=sp.kv_indices, FULL_CNT=full_cnt, FULL_IDX=full_idx,
                BITS=sp.partial_bits, block_q=sp.block_q, block_kv=sp.block_kv, HAS_FULL=has_full,
                **dict(zip(names, strides)))


def _tiles(call: AttnCall, plan: BwdPlan) -> tuple[int, int]:
    """(block_m, block_n) fitted to the problem: block-sparse tiles must divide both mask block sizes,
    so a tile never straddles two mask blocks."""
    if call.op != "block_sparse":
        return max(_MIN_TILE, plan.block_m), max(_MIN_TILE, plan.block_n)
    g = math.gcd(call.sparse.block_q, call.sparse.block_kv)
    bm, bn = _fit_tile(plan.block_m, g), _fit_tile(plan.block_n, g)
    if not (bm and bn):
        raise ValueError(f"block-sparse backward needs block_q and block_kv multiples of 16, got "
                         f"{call.sparse.block_q}, {call.sparse.block_kv}")
    return bm, bn


def _window(call: AttnCall) -> tuple[int, int]:
    """(left, right) bounds, -1 = unbounded; causal is a right bound of 0."""
    if call.op == "block_sparse":
        return -1, -1
    return call.window_left, 0 if call.causal else call.window_right


def _common_args(call: AttnCall, shape: _Shape, grad_out, delta, lse2, row_strides):
    """Arguments that the dK/dV and dQ kernels share (tensors, strides, sizes, mask bounds)."""
    q, k, v = call.q, call.k, call.v
    left, right = _window(call)
    cu_q, cu_k, kv_lens = _seq_tensors(call, lse2)
    return dict(Q=q, K=k, V=v, DO=grad_out, LSE2=lse2, DELTA=delta, CU_Q=cu_q, CU_K=cu_k, KV_LENS=kv_lens,
                **dict(zip(("s_qb", "s_qh", "s_qm", "s_qd"), _layout(q, shape.varlen))),
                **dict(zip(("s_kb", "s_kh", "s_kn", "s_kd"), _layout(k, shape.varlen))),
                **dict(zip(("s_vb", "s_vh", "s_vn", "s_vd"), _layout(v, shape.varlen))),
                **dict(zip(("s_ob", "s_oh", "s_om", "s_od"), _layout(grad_out, shape.varlen))),
                **dict(zip(("s_rb", "s_rh", "s_rm"), row_strides)),
                LQ=shape.len_q, LK=shape.len_k, D=q.shape[-1], DV=v.shape[-1],
                qk_scale=call.scale * math.log2(math.e), sm_scale=call.scale,
                left=max(left, 0), right=max(right, 0), VARLEN=shape.varlen,
                HAS_KV_LENS=call.kv_seqlens is not None and call.op == "attention",
                SPARSE=call.op == "block_sparse", HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0,
                BLOCK_D=max(_MIN_TILE, _next_pow2(q.shape[-1])),
                BLOCK_DV=max(_MIN_TILE, _next_pow2(v.shape[-1])),
                DOT_PREC="tf32x3" if q.dtype == torch.float32 else "tf32")


def _launch_dkdv(launcher, kern, call, shape, plan, common, dq_acc, dk_out, dv_out, split, dummy):
    bm, bn = _tiles(call, plan)
    dk_s = (dk_out.stride(0), *_layout(dk_out[0], shape.varlen)) if split > 1 else (0, *_layout(dk_out, shape.varlen))
    dv_s = (dv_out.stride(0), *_layout(dv_out[0], shape.varlen)) if split > 1 else (0, *_layout(dv_out, shape.varlen))
    group = shape.heads_q // shape.heads_kv
    grid = (-(-shape.len_k // bn), shape.batch * shape.heads_kv * split)
    launcher(kern.bwd_dkdv)[grid](**common, DQ=dq_acc, GRAD_K=dk_out, GRAD_V=dv_out,
                        **dict(zip(("s_dqb", "s_dqh", "s_dqm", "s_dqd"), _layout(dq_acc, shape.varlen))),
                        **dict(zip(("s_dks", "s_dkb", "s_dkh", "s_dkn", "s_dkd"), dk_s)),
                        **dict(zip(("s_dvs", "s_dvb", "s_dvh", "s_dvn", "s_dvd"), dv_s)),
                        **_sparse_dkdv_args(call, shape, dummy, launcher is warmup_launcher),
                        HKV=shape.heads_kv, GROUP=group, GROUP_PER_SPLIT=-(-group // split), SPLIT=split,
                        ATOMIC_DQ=plan.atomic_dq, BLOCK_M=bm, BLOCK_N=bn, num_warps=plan.warps,
                        num_stages=plan.stages)


def _launch_dq(launcher, kern, call, shape, plan, common, dq, dummy):
    bm, bn = _tiles(call, dataclasses.replace(plan, block_m=max(plan.block_m, _DQ_MIN_KEYS)))
    grid = (-(-shape.len_q // bn), shape.batch * shape.heads_q)
    dq_strides = dict(zip(("s_dqb", "s_dqh", "s_dqm", "s_dqd"), _layout(dq, shape.varlen)))
    launcher(kern.bwd_dq)[grid](**common, DQ=dq, **dq_strides,
                      **_sparse_dq_args(call, shape, dummy), HQ=shape.heads_q,
                      GROUP=shape.heads_q // shape.heads_kv, BLOCK_M=bn, BLOCK_N=bm, num_warps=plan.warps,
                      num_stages=plan.stages)


def _grad_buffers(call: AttnCall, plan: BwdPlan, split: int, zeroed: bool = True):
    """(dq, dq accumulator for atomics, dk/dv outputs, dk/dv kernel targets). Outputs follow the inputs'
    stride order (the ops' layout contract); varlen outputs start at zero because tokens outside every
    sequence get no gradient from the kernels. ``zeroed=False``: none is zeroed (for a compile, which runs
    no kernel on them)."""
    q, k, v = call.q, call.k, call.v
    full, full_like = (torch.zeros, torch.zeros_like) if zeroed else (torch.empty, torch.empty_like)

    def new(x: torch.Tensor) -> torch.Tensor:
        grad = empty_like_layout(x, x.shape)
        return grad.zero_() if call.op == "varlen" and zeroed else grad

    dq, dk, dv = new(q), new(k), new(v)
    dq_acc = dq
    if plan.atomic_dq:
        dq_acc = full_like(q) if q.dtype == torch.float32 else full(q.shape, dtype=torch.float32, device=q.device)
        dq = dq_acc if q.dtype == torch.float32 else dq
    dk_t, dv_t = dk, dv
    if split > 1:  # per-split fp32 partial sums, added in a fixed order afterwards
        dk_t = full((split, *k.shape), dtype=torch.float32, device=k.device)
        dv_t = full((split, *v.shape), dtype=torch.float32, device=v.device)
    return dq, dq_acc, dk, dv, dk_t, dv_t


def backward(cfg: Config, launcher, call: AttnCall, out: torch.Tensor, lse: torch.Tensor,
             grad_out: torch.Tensor | None, grad_lse: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """dq, dk, dv of ``call`` given the forward's (out, lse) and the gradients of both (either may be
    None). Outputs have the inputs' shapes, dtypes and (dense) strides; any input strides work.
    ``launcher`` is triton_common's eager, graph or warmup launcher (the last compiles, runs nothing and
    returns unwritten outputs)."""
    q, k, v = call.q, call.k, call.v
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"Triton backward supports q dtypes float16, bfloat16, float32; got {q.dtype}")
    if max(q.shape[-1], v.shape[-1]) > MAX_HEAD_DIM:
        raise ValueError(f"Triton backward supports head dims up to {MAX_HEAD_DIM}, got {q.shape[-1]}, "
                         f"{v.shape[-1]}")
    # Plan.compile's launcher compiles the Triton kernels and runs none; nothing else runs either (Plan's
    # compile-only contract: the compile allocates what the kernels are specialized on, and leaves it unwritten)
    compiling = launcher is warmup_launcher
    shape = _Shape.of(call)
    plan = plan_for(max(q.shape[-1], v.shape[-1]), cfg, str(q.dtype).removeprefix("torch."))
    split = _kv_split(plan, shape, q.device)
    dq, dq_acc, dk, dv, dk_t, dv_t = _grad_buffers(call, plan, split, zeroed=not compiling)
    if min(q.numel(), k.numel(), shape.batch, shape.len_q, shape.len_k) == 0:
        return (dq, dk, dv) if compiling else (dq.zero_(), dk.zero_(), dv.zero_())
    if grad_out is None:
        grad_out = torch.empty_like(out) if compiling else torch.zeros_like(out)
    kern = _kernels()
    delta, lse2, row_strides = _preprocess(launcher, kern, shape, out, lse, grad_out, grad_lse)
    common = _common_args(call, shape, grad_out, delta, lse2, row_strides)
    _launch_dkdv(launcher, kern, call, shape, plan, common, dq_acc, dk_t, dv_t, split, lse2)
    if not plan.atomic_dq:
        _launch_dq(launcher, kern, call, shape, plan, common, dq, lse2)
    if compiling:
        return dq, dk, dv
    if plan.atomic_dq and dq is not dq_acc:
        dq.copy_(dq_acc)
    if split > 1:
        dk.copy_(dk_t.sum(0))
        dv.copy_(dv_t.sum(0))
    return dq, dk, dv
