"""Split-K flash-decoding for few query rows (Lq 1..16): two Triton kernels and the ``triton_decode`` backend.

Why split K: at decode the usual grid has one program per (batch, kv head), 2 programs for B1 Hkv2, so a
132-SM H100 leaves most of its bandwidth unused (anchors, H200: SDPA reaches 1.18 TB/s at B1 Hq16 Hkv2
D256 Lkv16k of about 4.3 TB/s copy). Flash-Decoding (Dao, Haziza, Massa, Sizov, 2023) splits the KV
sequence over ``num_splits`` programs per (batch, kv head) and merges their partial results by their
log-sum-exps. ExecuTorch (pytorch/executorch#20142) found split-K 1.2-20x faster from Lkv ~256 up once it
was timed under CUDA-graph replay, after a plain-launch benchmark had put the crossover at 2048, and its
authors asked for the choice to be measured instead of a fixed threshold: here ``num_splits`` is a knob
that the tuner measures.

The work:
- ``_decode_partial``: one program per (row block, split, batch x kv head). Its rows are the G = Hq / Hkv
  query heads of one kv head times the Lq queries (row r = g * Lq + i), so each K/V tile is loaded once
  for the whole group (GQA packing). The split's keys are a balanced run of whole BLOCK_N blocks of the
  keys that any row can see, [lo, n_b), computed in the kernel from each batch's kv_seqlens: a cache
  filled to 2k of its 16k capacity still spreads its 2k keys over all splits. A ``key_mask`` (B, Lk)
  is read as one byte per key next to the tile. It writes a normalised float32 partial output and a log2-domain
  lse per (row, split) to the workspace; with num_splits == 1 it writes out and lse directly and the
  combine is skipped.
- ``_decode_combine``: one program per (output row, 64 columns) merges the splits with weights
  2^(lse_s - max). Splits that saw no key wrote lse = -inf and output 0, so they get weight 0.
- On sm_90+ both kernels use programmatic dependent launch (PDL; Triton's ``launch_pdl`` and
  ``griddepcontrol``): a kernel may be launched while the one before it in the stream still runs and
  waits (``gdc_wait``) before touching memory. At decode sizes the kernels run 3-30 us, so the launch
  gaps were a visible share: on an H100 the two kernels took 26.2 + 2.5 us of device time against 32.1 us
  per call in graph replay (B1 Hq32 Hkv16 D256 Lkv4096, benchmarks/tools/decode_floor_gpu.py).

Workspace (the partial outputs, float32): allocated per call from PyTorch's caching allocator, so the
steady state never calls cudaMalloc and a captured CUDA graph holds it as a static buffer of its pool:
a plain call and a replay do the same work. A module-level cache of buffers was tried first and broke
``torch.compile(mode="reduce-overhead")``: a buffer first allocated during the cudagraph-trees warm-up
lives in the graph's pool without being an output, which cudagraph trees refuse (seen on an H200,
2026-11-22, Llama decode).
"""

from __future__ import annotations

import functools
import math
import os
from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: supports() says so, and no kernel below is ever built or run
    triton = tl = None
try:  # Triton >= 3.4 (test_pdl_helpers_are_where_decode_imports_them fails if they move)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # without them the kernels launch plainly (USE_PDL off)
    gdc_launch_dependents = gdc_wait = None

from .._compat import is_fake
from ..device import DeviceInfo, smem_per_block
from ..layout import new_outputs
from ..messages import KV_SEQLENS_VALUES, PAGED_BLOCK_IDS, PAGED_KV_SEQLENS_VALUES, device_message
from ..problem import Problem, next_power_of_two
from .base import AttnCall, Backend, Candidate, Config, Plan, Takes
from .triton_common import TRITON, eager_launcher, graph_launcher, jit, traceable, warmup_launcher

MAX_LEN_Q = 16
# 1 .. 512: with one or two KV heads at B1 the tuned split count sat at the old top, 128 (H200, 2026-11-30:
# B1 H16/2 D256 Lkv16k, 1.55-1.67 TB/s against a 3.3 TB/s copy), so the search goes past it; the untuned
# default stays at most DEFAULT_MAX_SPLITS, where it was measured. Knobs the search leaves out (2 warps, block_n 16,
# 2-5 pipeline stages, a narrower combine tile) moved nothing there: 15.5-16.8 us a call against 15.7 for the tuned
# config, whose partial kernel takes 12.1 us and combine 2.1, where a kernel that only reads the same bytes takes 11.4
# (H200, 2026-11-30, benchmarks/tools/decode_floor_gpu.py --sweep).
SPLITS = tuple(2 ** i for i in range(10))
DEFAULT_MAX_SPLITS = 128
# Past DEFAULT_MAX_SPLITS, only where that many splits leave fewer programs than this per SM (a B1 call with one
# or two KV heads): elsewhere more splits add workspace (rows x splits x Dv floats: 4 GB at B32 H32 Lq16 D128 and
# 512 splits, enough to fail a tune on a full GPU) and no parallelism the SMs lack.
FILLED_PER_SM = 4
# Floats of partial output one combine program reads at once (32 KiB, 64 registers a thread at 4 warps): its
# column chunk narrows as the split count grows past 128.
_COMBINE_TILE = 8192
BLOCK_NS = (32, 64)
NUM_WARPS = (4, 8)
_DTYPES = ("float16", "bfloat16", "float32")
_ELEM_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
_HEAD_DIMS = (16, 256)
_LOG2E = 1.4426950408889634
# Leave room for Triton's layout-conversion scratch, which the estimate below does not count.
_SMEM_HEADROOM = 0.85


# The texts of the API's compiled index checks (messages.py), for the kernel's own asserts of them.
_KV_SEQLENS_ASSERT, _PAGED_SEQLENS_ASSERT, _PAGED_IDS_ASSERT = (
    (tl.constexpr(device_message(m)) for m in (KV_SEQLENS_VALUES, PAGED_KV_SEQLENS_VALUES, PAGED_BLOCK_IDS))
    if tl is not None else (None, None, None))


@jit()
def _tanh(x):
    """tanh(x) from exp2, which GPUs and Triton's interpreter alike have: sign(x) (1 - e^-2|x|) / (1 + e^-2|x|)."""
    t = tl.exp2(-2.0 * 1.4426950408889634 * tl.abs(x))
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


@jit()
def _tile_page_ids(TABLE_ROW, s0, end, offs_n, PAGE_SIZE: tl.constexpr, TILE_PAGES: tl.constexpr):
    """The block ids of the pages the tile of keys from ``s0`` reads: one where it lies in one page, else each
    key's page's id, chosen by a select (no per-key load); 0 for pages at or past ``end``, which are never read.
    Its results address K/V loads only: torch's write analysis of a kernel (wrap_triton) sees no store through
    TABLE."""
    if TILE_PAGES == 1:
        ids = tl.load(TABLE_ROW + s0 // PAGE_SIZE, mask=s0 < end, other=0)
    else:
        ids = tl.zeros_like(offs_n)
        for nth in tl.static_range(TILE_PAGES):
            page = tl.load(TABLE_ROW + s0 // PAGE_SIZE + nth, mask=s0 + nth * PAGE_SIZE < end, other=0)
            ids = tl.where(offs_n // PAGE_SIZE == nth, page, ids)
    return ids


# Lengths, split counts and windows change between calls (every decode step without kv_seqlens): never
# specialise on their values, or Triton would compile a variant for Lk == 1 and for Lk % 16 == 0. The key
# mask's strides (its batch stride is Lk) likewise.
@jit(do_not_specialize=["LK", "NUM_SPLITS", "NUM_M_BLOCKS", "WINDOW_LEFT", "WINDOW_RIGHT", "NUM_PAGES", "smb", "smn",
                        "slh"])
def _decode_partial(
    Q, K, V, SEQLENS, KEY_MASK, OUT, LSE, TABLE, CU_Q,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, smb, smn, sob, soh, som, sod, slb, slh, slm, stb,
    qk_scale, softcap, HKV, G, LQ, LK, D, DV, NUM_SPLITS, NUM_M_BLOCKS, WINDOW_LEFT, WINDOW_RIGHT, NUM_PAGES,
    HAS_SEQLENS: tl.constexpr, CHECK_SEQLENS: tl.constexpr, CHECK_PAGES: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_CU_Q: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    PAGE_SIZE: tl.constexpr, TILE_PAGES: tl.constexpr, SINGLE: tl.constexpr, WRITE_LSE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    PRECISION: tl.constexpr, DOT_IN_F32: tl.constexpr, USE_PDL: tl.constexpr,
):
    if USE_PDL:
        # Programmatic dependent launch (sm_90+): this kernel may start while the previous kernel of
        # the stream finishes, so wait for its stores before reading q/k/v; then let the combine
        # kernel launch early (its programs wait for ours to finish, see _decode_combine).
        gdc_wait()
        gdc_launch_dependents()
    # Inductor's launcher types a Python float argument as fp64 (eager Triton: fp32); keep the math fp32
    qk_scale, softcap = tl.cast(qk_scale, tl.float32), tl.cast(softcap, tl.float32)
    # Row blocks of one (split, batch, kv head) are adjacent in launch order, so they run together and
    # share the K/V tiles in L2 when G * Lq needs more than one row block.
    pid = tl.program_id(0)
    m_blk = pid % NUM_M_BLOCKS
    split = (pid // NUM_M_BLOCKS) % NUM_SPLITS
    bh = pid // (NUM_M_BLOCKS * NUM_SPLITS)
    b = (bh // HKV).to(tl.int64)  # int64: b * stride overflows int32 for large KV caches
    hkv = (bh % HKV).to(tl.int64)

    if HAS_SEQLENS:
        n = tl.load(SEQLENS + b).to(tl.int32)
        if CHECK_SEQLENS:  # compiled code's check of the values (a no-op unless Triton compiles with debug)
            if PAGE_SIZE > 0:  # LK is the call's max_seqlen_k
                tl.device_assert((n >= 0) & (n <= LK), _PAGED_SEQLENS_ASSERT)
            else:
                tl.device_assert((n >= 0) & (n <= LK), _KV_SEQLENS_ASSERT)
    else:
        n = LK
    # This batch's queries: rows q0 .. q0 + lq - 1 of the packed queries (paged chunked prefill), else all LQ.
    # Loaded here and in _decode_combine, not in a helper: torch's analysis of what a user kernel writes
    # (wrap_triton) counts a pointer handed to a helper whose results address a store as written, and compiled
    # code would then treat cu_seqlens_q as a mutated input (no CUDA graphs).
    q0, lq = 0, LQ
    if HAS_CU_Q:
        q0 = tl.load(CU_Q + b).to(tl.int32)
        lq = tl.load(CU_Q + b + 1).to(tl.int32) - q0
    # Keys any row may see: [lo, n). The left window bound of the first query is the lowest.
    lo = 0
    if HAS_LEFT:
        lo = tl.maximum(n - lq - WINDOW_LEFT, 0)
    # Balanced split of the visible blocks: each split gets floor or ceil(nblk / NUM_SPLITS) blocks,
    # so none is empty while NUM_SPLITS <= nblk; the ones beyond write lse = -inf.
    nblk = tl.cdiv(n - lo, BLOCK_N)
    start = lo + (split * nblk // NUM_SPLITS) * BLOCK_N
    end = tl.minimum(lo + ((split + 1) * nblk // NUM_SPLITS) * BLOCK_N, n)
    offs_n = tl.arange(0, BLOCK_N)
    if TILE_PAGES > 0:  # the first tile's block ids, loaded before q so that the two latencies overlap; each tile
        # then loads the next tile's (the loop), so that no K/V load waits on a table load issued just before it
        next_ids = _tile_page_ids(TABLE + b * stb, start, end, offs_n, PAGE_SIZE, TILE_PAGES)

    rows = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
    g = rows // LQ
    i = rows % LQ
    row_ok = (rows < G * LQ) & (i < lq)
    diag = i + n - lq  # lower-right aligned: query i's own position among the keys
    q_row = (q0 + i).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_ok = offs_d < D
    dv_ok = offs_dv < DV
    h = hkv * G + g
    q = tl.load(Q + b * sqb + h[:, None] * sqh + q_row[:, None] * sqm + offs_d[None, :] * sqd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_IN_F32:  # interpreter only: its tl.dot multiplies the raw bits of bf16 (triton#11584)
        q = q.to(tl.float32)
    k_base = K + hkv * skh
    v_base = V + hkv * svh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for s0 in range(start, end, BLOCK_N):
        keys = s0 + offs_n
        key_ok = keys < end
        if TILE_PAGES > 0:  # a tile lies in one page or holds TILE_PAGES whole pages (_tile_pages): ids per page
            ids = next_ids.to(tl.int64)
            next_ids = _tile_page_ids(TABLE + b * stb, s0 + BLOCK_N, end, offs_n, PAGE_SIZE, TILE_PAGES)
            if CHECK_PAGES:  # every page a length reaches is read here, by one split or another
                tl.device_assert((ids >= 0) & (ids < NUM_PAGES), _PAGED_IDS_ASSERT)
            slot = s0 % PAGE_SIZE + offs_n % PAGE_SIZE  # one page: s0's offset in it; whole pages: s0 starts one
            k_rows = ids * skb + slot * skn
            v_rows = ids * svb + slot * svn
        elif PAGE_SIZE > 0:  # key j in slot j % PAGE_SIZE of its page; pages past the keys are never read
            page = tl.load(TABLE + b * stb + keys // PAGE_SIZE, mask=key_ok, other=0).to(tl.int64)
            if CHECK_PAGES:
                tl.device_assert((page >= 0) & (page < NUM_PAGES), _PAGED_IDS_ASSERT)
            slot = keys % PAGE_SIZE
            k_rows = page * skb + slot * skn
            v_rows = page * svb + slot * svn
        else:
            k_rows = b * skb + keys * skn
            v_rows = b * svb + keys * svn
        k = tl.load(k_base + k_rows[:, None] + offs_d[None, :] * skd,
                    mask=key_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_IN_F32:
            k = k.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if HAS_SOFTCAP:  # qk_scale is scale / softcap and softcap log2(e) * softcap (_score_scales)
            qk = _tanh(qk) * softcap
        ok = key_ok[None, :]
        if HAS_RIGHT:
            ok = ok & (keys[None, :] <= diag[:, None] + WINDOW_RIGHT)
        if HAS_LEFT:
            ok = ok & (keys[None, :] >= diag[:, None] - WINDOW_LEFT)
        if HAS_KEY_MASK:  # one byte per key, next to 2 x D x 2 bytes of K and V
            ok = ok & (tl.load(KEY_MASK + b * smb + keys * smn, mask=key_ok, other=0) != 0)[None, :]
        qk = tl.where(ok, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # a row with no visible key so far keeps m = -inf; shift by 0 there so exp2 gives 0, not NaN
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(qk - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + v_rows[:, None] + offs_dv[None, :] * svd,
                    mask=key_ok[:, None] & dv_ok[None, :], other=0.0)
        p_op = p.to(v.dtype)  # P @ V on the tensor cores in the input dtype, like FlashAttention
        if DOT_IN_F32:  # rounded to the input dtype first, so the interpreter sees the GPU's numerics
            p_op = p_op.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p_op, v, input_precision=PRECISION)
        m_i = m_new

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse2 = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    # (b, hkv, row) -> flat (b, h, i) row of the workspace: (b * Hq + hkv * G + g) * Lq + i
    out_row = (b * HKV + hkv) * G * LQ + rows.to(tl.int64)
    store_ok = row_ok[:, None] & dv_ok[None, :]
    if SINGLE:
        o_ptr = OUT + b * sob + h[:, None] * soh + q_row[:, None] * som + offs_dv[None, :] * sod
        tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=store_ok)
        if WRITE_LSE:
            tl.store(LSE + b * slb + h * slh + q_row * slm, lse2 * 0.6931471805599453, mask=row_ok)
    else:
        ws_row = out_row * NUM_SPLITS + split
        tl.store(OUT + ws_row[:, None] * DV + offs_dv[None, :], out, mask=store_ok)
        tl.store(LSE + ws_row, lse2, mask=row_ok)


@jit(do_not_specialize=["slh"])
def _decode_combine(WS_O, WS_LSE, OUT, LSE, CU_Q, sob, soh, som, sod, slb, slh, slm, HQ, LQ,
                    NUM_SPLITS: tl.constexpr, DV, HAS_CU_Q: tl.constexpr, WRITE_LSE: tl.constexpr,
                    BLOCK_S: tl.constexpr, BLOCK_DC: tl.constexpr, USE_PDL: tl.constexpr):
    # Program (row, chunk) merges BLOCK_DC output columns of one row. Splitting Dv across programs keeps
    # this latency-bound step short: B1 Hq16 Lq1 is only 16 rows, and one program per row would read
    # all num_splits x Dv partials (64 KiB at 64 splits, D256) alone. Every chunk recomputes the row's
    # lse from the num_splits partial lses, which costs nothing next to the outputs. NUM_SPLITS is a
    # constexpr (one compile per split count, BLOCK_S = next power of two): one load of the lses and one
    # of the partials, no loop.
    if USE_PDL:  # launched before the partial kernel ends (see launch()): wait for its stores
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    b = row // (HQ * LQ)
    h = (row // LQ) % HQ
    i = row % LQ
    q0, lq = 0, LQ  # batch b's packed query rows, loaded here as in _decode_partial (why there)
    if HAS_CU_Q:
        q0 = tl.load(CU_Q + b).to(tl.int32)
        lq = tl.load(CU_Q + b + 1).to(tl.int32) - q0
    if i >= lq:  # a padded row of a sequence with fewer queries than LQ
        return
    q_row = q0 + i
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < NUM_SPLITS
    offs_d = chunk * BLOCK_DC + tl.arange(0, BLOCK_DC)
    d_ok = offs_d < DV
    lse_s = tl.load(WS_LSE + row * NUM_SPLITS + offs_s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse_s, 0)
    w = tl.exp2(lse_s - tl.where(m == float("-inf"), 0.0, m))
    o = tl.load(WS_O + (row * NUM_SPLITS + offs_s[:, None]) * DV + offs_d[None, :],
                mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    total = tl.sum(w, 0)
    empty = total == 0.0
    out = tl.sum(w[:, None] * o, 0) / tl.where(empty, 1.0, total)
    o_ptr = OUT + b * sob + h * soh + q_row * som + offs_d * sod
    tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=d_ok)
    if WRITE_LSE:
        if chunk == 0:
            lse = tl.where(empty, float("-inf"), (m + tl.log2(tl.where(empty, 1.0, total))) * 0.6931471805599453)
            tl.store(LSE + b * slb + h * slh + q_row * slm, lse)


# ------------------------------------------------------------------------------------------- sizes
def _score_scales(scale: float, softcap: float) -> tuple[float, float]:
    """The partial kernel's (qk_scale, softcap): it takes scores in log2 units, scale * log2(e) * q.k, or with a
    softcap log2(e) * softcap * tanh(q.k * scale / softcap).

    >>> _score_scales(0.5, 0.0)[0] == 0.5 * _LOG2E, _score_scales(0.5, 10.0) == (0.05, 10.0 * _LOG2E)
    (True, True)
    """
    if softcap > 0:
        return scale / softcap, softcap * _LOG2E
    return scale * _LOG2E, 0.0


def _tile_pages(page_size: int, block_n: int, window_left: int) -> int:
    """How many pages a tile of ``block_n`` keys touches where it touches whole pages or lies inside one (1), so
    that the kernel loads a block id per page; else 0 (a block id per key). Without a left window every tile
    starts at a multiple of block_n (lo = 0); 4 bounds the per-key selects among a tile's pages.

    >>> [_tile_pages(p, n, w) for p, n, w in ((64, 32, -1), (16, 64, -1), (16, 64, 100), (12, 32, -1), (8, 64, -1))]
    [1, 4, 0, 0, 0]
    """
    if page_size == 0 or window_left >= 0:
        return 0
    if page_size % block_n == 0:
        return 1
    return block_n // page_size if block_n % page_size == 0 and block_n // page_size <= 4 else 0


def _block_d(d: int) -> int:
    """Padded head dim (masked loads cover the rest); tl.dot needs >= 16.

    >>> _block_d(40), _block_d(128), _block_d(16)
    (64, 128, 16)
    """
    return max(16, next_power_of_two(d))


def _block_m(group_rows: int, head_dim: int) -> int:
    """Rows per program: all G * Lq rows of a kv head when they fit, else row blocks of 64 (32 at D > 128,
    where a 64 x 256 float32 accumulator would take 128 registers per thread at 4 warps).

    >>> _block_m(1, 128), _block_m(8, 256), _block_m(256, 128), _block_m(256, 256)
    (16, 16, 64, 32)
    """
    cap = 64 if head_dim <= 128 else 32
    return max(16, min(next_power_of_two(group_rows), cap))


def combine_chunk(dv: int, splits: int, tile: int) -> int:
    """Output columns one combine program merges: as many as keep its ``splits`` x columns of float partials within
    ``tile`` floats (``_COMBINE_TILE``), between 16 and 64, and no more than the padded Dv.

    >>> combine_chunk(256, 16, 8192), combine_chunk(256, 256, 8192), combine_chunk(256, 512, 8192)
    (64, 32, 16)
    """
    return min(64, _block_d(dv), max(16, tile // next_power_of_two(splits)))


def _visible_keys(p: Problem) -> int:
    """Keys that some query row can see: a left window bounds them to window_left + Lq.

    >>> import dataclasses; p = Problem("attention", "bfloat16", "cuda", 1, 8, 2, 1, 8192, 128, 128)
    >>> _visible_keys(p), _visible_keys(dataclasses.replace(p, window_left=255))
    (8192, 256)
    """
    return p.len_k if p.window_left < 0 else min(p.len_k, p.window_left + p.len_q)


def _smem_bytes(p: Problem, block_n: int, stages: int) -> int:
    """Estimated shared memory: `stages` buffers of the K and V tiles plus the q and p dot operands."""
    elem = _ELEM_BYTES[p.dtype]
    block_m = _block_m(p.gqa_ratio * p.len_q, p.head_dim)
    tiles = block_n * (_block_d(p.head_dim) + _block_d(p.head_dim_v)) * elem
    return stages * tiles + block_m * (_block_d(p.head_dim) + block_n) * elem


def _smem_limit(dev: DeviceInfo) -> int:
    return int(smem_per_block(dev.arch) * _SMEM_HEADROOM)


def _num_stages(p: Problem, block_n: int, dev: DeviceInfo) -> int:
    """3 pipeline stages (more bytes in flight per SM) when they fit in shared memory, else 2."""
    return 3 if _smem_bytes(p, block_n, 3) <= _smem_limit(dev) else 2


def _programs(p: Problem) -> int:
    """Partial-kernel programs per split: (batch, kv head, row block)."""
    return p.batch * p.heads_kv * -(-p.gqa_ratio * p.len_q // _block_m(p.gqa_ratio * p.len_q, p.head_dim))


def _default_config(p: Problem, dev: DeviceInfo) -> Config:
    """Untuned fallback: enough splits for about two programs per SM, never more than the KV blocks."""
    block_n = 64 if p.head_dim <= 128 and p.dtype != "float32" else 32
    want = next_power_of_two(max(1, math.ceil(2 * max(dev.sm_count, 1) / max(_programs(p), 1))))
    blocks = max(1, -(-_visible_keys(p) // block_n))
    splits = max(s for s in SPLITS if s <= min(want, blocks, DEFAULT_MAX_SPLITS))
    return Config.of(block_n=block_n, num_splits=splits, num_warps=4)


# ---------------------------------------------------------------------------------------- workspace
def workspace(device: torch.device, b: int, hq: int, lq: int, dv: int, splits: int):
    """Fresh (partial out, partial lse) buffers for one call; see the module docstring."""
    rows = b * hq * lq
    return (torch.empty(rows, splits, dv, dtype=torch.float32, device=device),
            torch.empty(rows, splits, dtype=torch.float32, device=device))


# ------------------------------------------------------------------------------------------- launch
@functools.lru_cache(maxsize=1024)
def _knobs(p: Problem, dev: DeviceInfo, cfg: Config) -> tuple[int, int, int, int]:
    """(num_splits, block_n, num_warps, num_stages) of a config; missing knobs come from the default.
    ``num_stages`` is not in the tuned configs (2 or 3 from shared memory), but a config may set it, to
    sweep it by hand."""
    full = dict(_default_config(p, dev).params) | dict(cfg.params)
    block_n = int(full["block_n"])
    stages = int(full.get("num_stages", _num_stages(p, block_n, dev)))
    return int(full["num_splits"]), block_n, int(full["num_warps"]), stages


class DecodePlan:
    """Split count, tiles and grids of one (problem, config), fixed once; a launch reads strides and
    allocates ``out`` (in q's stride order), ``lse`` and, with more than one split, the workspace. The call's
    geometry (:class:`_Geometry`) is kept from one launch to the next while what the problem leaves open of it
    stays the same: a serving loop's steps build it once."""

    def __init__(self, p: Problem, dev: DeviceInfo, cfg: Config):
        self.splits, self.block_n, self.num_warps, self.stages = _knobs(p, dev, cfg)
        g = p.gqa_ratio
        self.block_m = _block_m(g * p.len_q, p.head_dim)
        self.m_blocks = -(-g * p.len_q // self.block_m)
        self.interpret = os.environ.get("TRITON_INTERPRET") == "1"
        self.pdl = not self.interpret and dev.arch >= 90 and gdc_wait is not None
        self._geometry = None  # (_Geometry.open_of the last call, its geometry)

    def launch(self, call: AttnCall):
        out, lse = self.outputs(call)
        self.run(call, out, lse, launcher=eager_launcher, pdl=self.pdl)
        return out, lse

    def traced(self, call: AttnCall, check_indices: bool = False):
        """As :meth:`launch`, without programmatic dependent launch: Inductor launches user kernels without
        it (its ``launch_pdl`` is a compile option of its own kernels, off by default). ``check_indices``: the
        partial kernel asserts each batch's length is in [0, Lk] (a paged call's max_seqlen_k) before reading
        keys, and a paged call's block ids in [0, num_blocks) before reading their pages; Inductor compiles
        the kernels it launches with Triton's ``debug`` on (torch/_inductor/runtime/triton_heuristics.py,
        ``assert_indirect_indexing``), which keeps device asserts."""
        out, lse = self.outputs(call)
        self.run(call, out, lse, launcher=graph_launcher, pdl=False, check_indices=check_indices)
        return out, lse

    def traced_out_only(self, call: AttnCall, check_indices: bool = False):
        """:meth:`traced` for compiled code that never reads the lse (inference): no lse buffer, no lse stores
        but the splits' own."""
        out = self.outputs(call)[0]
        self.run(call, out, None, launcher=graph_launcher, pdl=False, check_indices=check_indices)
        return (out,)

    def compile(self, call: AttnCall):
        out, lse = self.outputs(call)
        self.run(call, out, lse, launcher=warmup_launcher, pdl=self.pdl)

    @staticmethod
    def outputs(call: AttnCall):
        return new_outputs(call.op, call.q, call.v)

    def geometry(self, call: AttnCall, out) -> _Geometry:
        key = _Geometry.open_of(call, out)
        last = self._geometry
        if last is None or last[0] != key:
            last = self._geometry = (key, _Geometry.of(call, out))  # one assignment: threads may share the plan
        return last[1]

    def run(self, call: AttnCall, out, lse, ws=None, *, launcher=None, pdl=None, check_indices=False):
        """Write the attention of ``call`` into ``out`` (B, Hq, Lq, Dv; any strides) and ``lse`` (B, Hq, Lq;
        float32, contiguous; None: not computed). Tests hand in outputs (and a workspace ``ws`` from
        :func:`workspace`) poisoned with NaN."""
        launcher = launcher or eager_launcher
        pdl = self.pdl if pdl is None else pdl
        q, k, v = call.q, call.k, call.v
        g = self.geometry(call, out)
        b, hq, lq, hkv, d, dv = g.b, q.shape[1], g.lq, g.hkv, q.shape[-1], v.shape[-1]
        lk = call.max_seqlen_k if call.op == "paged" else k.shape[2]  # the keys a length may reach
        splits = self.splits
        right = 0 if call.causal else call.window_right
        single = splits == 1
        write_lse = lse is not None
        # A pointer whose flag is off (WRITE_LSE, HAS_SEQLENS, HAS_KEY_MASK, PAGE_SIZE 0, HAS_CU_Q) is None: Triton
        # and Inductor take None as a constant, and the kernels never dereference it. A tensor there is worse: traced
        # into a compiled graph, an unread argument that aliases a written one made Inductor return a clone of the
        # output that nothing wrote, and q there read to Inductor as a mutated input (CUDA graphs skipped).
        target_o, target_lse = (out, lse) if single else (ws or workspace(q.device, b, hq, lq, dv, splits))
        key_mask = _mask_bytes(call.key_mask) if call.key_mask is not None else None
        mask_strides = call.key_mask.stride() if call.key_mask is not None else (0, 0)
        pdl_kw = {"launch_pdl": True} if pdl else {}
        launcher(_decode_partial)[(self.m_blocks * splits * b * hkv,)](
            q, k, v, call.kv_seqlens, key_mask, target_o, target_lse, call.block_table, call.cu_seqlens_q, *g.q,
            *g.k, *g.v,
            *mask_strides, *g.out, *g.lse, g.table, *_score_scales(call.scale, call.softcap), hkv, hq // hkv, lq, lk,
            d, dv, splits,
            self.m_blocks, max(call.window_left, 0), max(right, 0), k.shape[0] if g.page_size else 0,
            HAS_SEQLENS=call.kv_seqlens is not None, CHECK_SEQLENS=check_indices and call.kv_seqlens is not None,
            CHECK_PAGES=check_indices and g.page_size > 0,
            HAS_KEY_MASK=call.key_mask is not None,
            HAS_LEFT=call.window_left >= 0, HAS_RIGHT=right >= 0, HAS_CU_Q=call.cu_seqlens_q is not None,
            HAS_SOFTCAP=call.softcap > 0, PAGE_SIZE=g.page_size,
            TILE_PAGES=_tile_pages(g.page_size, self.block_n, call.window_left),
            SINGLE=single, WRITE_LSE=write_lse,
            BLOCK_M=self.block_m, BLOCK_N=self.block_n, BLOCK_D=_block_d(d), BLOCK_DV=_block_d(dv),
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            DOT_IN_F32=q.dtype == torch.bfloat16 and self.interpret,
            USE_PDL=pdl, num_warps=self.num_warps, num_stages=self.stages, **pdl_kw,
        )
        if not single:
            # all splits x block_dc columns per program, in one pass
            block_dc = combine_chunk(dv, splits, _COMBINE_TILE)
            launcher(_decode_combine)[(b * hq * lq, -(-dv // block_dc))](
                target_o, target_lse, out, lse, call.cu_seqlens_q, *g.out, *g.lse, hq, lq, splits, dv,
                HAS_CU_Q=call.cu_seqlens_q is not None, WRITE_LSE=write_lse, BLOCK_S=next_power_of_two(splits),
                BLOCK_DC=block_dc, USE_PDL=pdl, num_warps=4, **pdl_kw)


class _Geometry(NamedTuple):
    """A call's sizes and the strides the kernels take, (batch, head, query row, dim) for q and out, (batch, head,
    key, dim) for k and v, (batch, head, query row) for the lse. Paged calls: q and out are packed (total_q, Hq, D):
    a decode batch's row is its token (batch stride, query stride 0), a chunked prefill's rows start at
    cu_seqlens_q[b] (batch stride 0); k and v are pools whose "batch" is the page and "key" the slot."""

    b: int
    lq: int
    hkv: int
    page_size: int
    q: tuple
    k: tuple
    v: tuple
    out: tuple
    lse: tuple
    table: int

    @staticmethod
    def open_of(call: AttnCall, out: torch.Tensor) -> tuple:
        """What :meth:`of` reads that a plan's problem leaves open (the problem fixes every size): the strides, and
        for a paged call the table's row stride and whether its queries come in runs (cu_seqlens_q). Equal for
        two calls of one plan: equal geometries. A paged call's max_seqlen_k, which a serving loop grows every
        step, is no part of it (:meth:`DecodePlan.run` reads it per call)."""
        strides = call.q.stride(), call.k.stride(), call.v.stride(), out.stride()
        if call.op != "paged":
            return strides
        return *strides, call.block_table.stride(0), call.cu_seqlens_q is None

    @staticmethod
    def of(call: AttnCall, out: torch.Tensor) -> _Geometry:
        q, k, v = call.q, call.k, call.v
        if call.op != "paged":
            b, hq, lq = q.shape[:3]
            return _Geometry(b, lq, k.shape[1], 0, q.stride(), k.stride(), v.stride(), out.stride(),
                             (hq * lq, lq, 1), 0)
        total = q.shape[0]

        def rows(x: torch.Tensor) -> tuple:
            if call.cu_seqlens_q is None:
                return x.stride(0), x.stride(1), 0, x.stride(2)
            return 0, x.stride(1), x.stride(0), x.stride(2)

        def pool(x: torch.Tensor) -> tuple:
            return x.stride(0), x.stride(2), x.stride(1), x.stride(3)

        lse_strides = (1, total, 0) if call.cu_seqlens_q is None else (0, total, 1)
        return _Geometry(call.block_table.shape[0], call.max_seqlen_q, k.shape[2], k.shape[1],
                         rows(q), pool(k), pool(v), rows(out), lse_strides, call.block_table.stride(0))


def _mask_bytes(key_mask: torch.Tensor) -> torch.Tensor:
    """The bool mask's bytes as uint8, which Triton can point to: a view eagerly; a conversion (fused into the
    mask's producer) where the launch is traced into compiled code, since Inductor (torch 2.11) cannot lower
    a dtype view of a bool tensor ("torch.bool is not supported by torch.iinfo")."""
    return key_mask.to(torch.uint8) if is_fake(key_mask) else key_mask.view(torch.uint8)


# ------------------------------------------------------------------------------------------ backend
class TritonDecodeBackend(Backend):
    """Split-K flash-decoding for Lq <= 16 over a contiguous cache or a paged one (keys read through the block
    table, across page boundaries, so block_n does not depend on the page size); inference only (no backward)."""

    name = "triton_decode"
    knobs = {"block_n": int, "num_splits": int, "num_warps": int, "num_stages": int}
    takes = Takes(ops=("attention", "paged"), key_mask=True, softcap=True)
    library = TRITON

    def supports(self, p: Problem, dev: DeviceInfo, direction: str = "forward") -> str | None:
        if p.len_q > MAX_LEN_Q:
            return f"split-K decode is for Lq <= {MAX_LEN_Q}, got {p.len_q}"
        if triton is None:
            return "needs triton (not installed)"
        if p.device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            return "needs a CUDA device"
        if p.dtype not in _DTYPES:
            return f"dtype {p.dtype} not supported (float16, bfloat16, float32)"
        lo, hi = _HEAD_DIMS
        for name, size in (("head_dim", p.head_dim), ("head_dim_v", p.head_dim_v)):
            if not lo <= size <= hi:
                return f"{name} must be in [{lo}, {hi}], got {size}"
        return None

    def configs(self, p: Problem, dev: DeviceInfo, direction: str = "forward") -> list[Candidate]:
        """The untuned default first, then num_splits searched and block_n and warps only around the
        default (each config is a Triton compile of ~1 s in the gate, and the split count is the knob that
        moves decode time)."""
        base = _default_config(p, dev)
        sweep = [Config.of(block_n=base["block_n"], num_splits=s, num_warps=base["num_warps"]) for s in SPLITS]
        others = [Config.of(block_n=n, num_splits=base["num_splits"], num_warps=w)
                  for n in BLOCK_NS for w in NUM_WARPS]
        return [Candidate(self.name, c, _pruned(p, dev, c)) for c in dict.fromkeys([base, *sweep, *others])]

    def heuristic(self, p: Problem, dev: DeviceInfo) -> Config | None:
        """Today's hand rule (ExecuTorch, seed 001): split-K iff L_kv >= 256, with
        num_splits = min(max(cdiv(L_kv, 256), 1), 128), here rounded down to a power of two."""
        if p.len_k < 256:
            return None
        want = min(max(-(-p.len_k // 256), 1), 128)
        base = _default_config(p, dev)
        return Config.of(block_n=base["block_n"], num_splits=max(s for s in SPLITS if s <= want),
                         num_warps=base["num_warps"])

    def plan(self, p: Problem, dev: DeviceInfo, cfg: Config, direction: str) -> Plan:
        decode = DecodePlan(p, dev, cfg)
        if not traceable():
            return Plan(decode.launch, compile=decode.compile)
        return Plan(decode.launch, traced=decode.traced, traced_out_only=decode.traced_out_only, compile=decode.compile,
                    checks_indices=_checked_in_kernel(p))


def _checked_in_kernel(p: Problem) -> tuple[str, ...]:
    """The API's compiled index checks that the partial kernel makes (``Plan.checks_indices``). A paged call's
    block ids only without a left window: the kernel then reads every page that the lengths reach, the pages the
    API's check covers; with one, it skips the pages before the window."""
    if p.op != "paged":
        return (KV_SEQLENS_VALUES,)
    return (PAGED_KV_SEQLENS_VALUES,) + ((PAGED_BLOCK_IDS,) if p.window_left < 0 else ())


def _pruned(p: Problem, dev: DeviceInfo, cfg: Config) -> str | None:
    block_n, splits = int(cfg["block_n"]), int(cfg["num_splits"])
    blocks = -(-_visible_keys(p) // block_n)
    if splits > blocks:
        return f"num_splits {splits} > kv blocks {blocks}"
    filled = DEFAULT_MAX_SPLITS * _programs(p)
    if splits > DEFAULT_MAX_SPLITS and filled >= FILLED_PER_SM * dev.sm_count:
        return (f"num_splits {splits} > {DEFAULT_MAX_SPLITS}, where {DEFAULT_MAX_SPLITS} splits already make {filled} "
                f"programs ({FILLED_PER_SM} or more per SM) and the workspace grows with the splits")
    need, limit = _smem_bytes(p, block_n, 2), _smem_limit(dev)
    if need > limit:
        return (f"block_n {block_n} at D {p.head_dim} ({p.dtype}) needs ~{need // 1024} KiB shared memory, "
                f"{limit // 1024} KiB usable on sm_{dev.arch}")
    return None


BACKEND = TritonDecodeBackend()
