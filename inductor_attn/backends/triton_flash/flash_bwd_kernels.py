"""Triton kernels of the attention backward pass; the launcher is ``flash_bwd.py``.

The structure follows the FlashAttention-2 paper (Dao, 2023, Algorithm 2) and Triton's fused-attention
tutorial (06): a preprocess kernel computes ``delta_i = rowsum(dO_i * O_i)``; a dK/dV kernel keeps one
tile of keys resident and walks the query tiles that can see it; dQ comes either from atomics in that
kernel or from a separate pass that keeps a query tile resident and walks its keys (no atomics, fixed
summation order: the deterministic option).

Conventions shared by every kernel here:
- Scores live in the log2 domain: ``s = q.k * scale * log2(e)`` and ``lse2 = lse * log2(e)``, so
  ``P = exp2(s - lse2)``. A fully masked row has ``lse = -inf``; the preprocess stores ``lse2 = +inf``
  for it, so ``P = exp2(s - inf) = 0`` for every key and no NaN appears.
- ``grad_lse`` is folded into delta: ``dS = P * (dP - delta + dlse) = P * (dP - (delta - dlse))``.
- Rows outside the sequence load ``lse2 = +inf`` (P = 0) and ``dO = 0``, so they need no score mask;
  keys outside it do need one (their P would not be 0).
- One kernel serves dense, varlen and block-sparse calls: varlen reads the sequence's offset and length
  from ``cu_seqlens`` (batch stride 0); dense reads them from ``kv_seqlens`` or the full lengths.
- Loops are split into masked and mask-free ranges of tiles, so interior tiles skip the mask math
  (the tutorial splits its causal loop the same way).
- Scalar arithmetic avoids negative ``//`` (compiled Triton truncates, the interpreter floors).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .flash_kernel import _expand_bits

LOG2E = tl.constexpr(1.4426950408889634)  # a plain float global is refused inside @jit


@triton.jit
def _visible(r, c, lk, off, left, right, BITS, s_bi, s_bw, partial, q_blk0, k_blk0,
             SPARSE: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Which (row r, key c) pairs are visible; r and c are broadcastable index tensors.

    Dense: lower-right aligned causal/window (key c is visible to row r iff
    r + off - left <= c <= r + off + right, off = keys - rows). Block-sparse: bit (r - q_blk0,
    c - k_blk0) of the block's bitmap when ``partial``, else the whole block.
    """
    ok = c < lk
    if SPARSE:
        j = c - k_blk0
        # a full block loads nothing and reads all-ones (-1); where(), not `ok & partial`: the
        # interpreter turns a block & scalar of bools into int32
        words = tl.load(BITS + (r - q_blk0) * s_bi + (j // 32) * s_bw, mask=tl.where(partial, ok, False),
                        other=-1)
        ok = ok & (((words >> (j % 32)) & 1) != 0)
    else:
        if HAS_RIGHT:
            ok = ok & (c <= r + off + right)
        if HAS_LEFT:
            ok = ok & (c >= r + off - left)
    return ok


@triton.jit
def _bitmap_bits(BITS, rows, first_key, k_blk0, s_bi, s_bw, partial, q_blk0, KEYS: tl.constexpr):
    """int32 0/1 [rows, KEYS]: the bitmap of keys ``first_key + [0, KEYS)`` (KEYS and first_key - k_blk0
    multiples of 32) for each row; one load per 32-key word, expanded in registers by the forward's
    _expand_bits, instead of _visible's gather of one word per element. All ones where not ``partial``."""
    w0 = (first_key - k_blk0) // 32
    words = tl.load(BITS + (rows - q_blk0)[:, None] * s_bi + (w0 + tl.arange(0, KEYS // 32))[None, :] * s_bw,
                    mask=tl.where(partial, rows[:, None] >= 0, False), other=-1)
    return _expand_bits(words, KEYS)


@triton.jit
def bwd_preprocess(O, DO, LSE, DLSE, DELTA, LSE2,
                   s_ob, s_oh, s_om, s_od, s_gb, s_gh, s_gm, s_gd,
                   s_lb, s_lh, s_lm, s_db, s_dh, s_dm,
                   H, L, DV,
                   HAS_DLSE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr):
    """delta = rowsum(dO * O) - dlse and lse2 = lse * log2(e) (+inf where lse = -inf), as [B*H, L]."""
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ok = rows < L
    cols = tl.arange(0, BLOCK_DV)
    tile_ok = ok[:, None] & (cols[None, :] < DV)
    o = tl.load(O + b * s_ob + h * s_oh + rows[:, None] * s_om + cols[None, :] * s_od, mask=tile_ok, other=0.0)
    do = tl.load(DO + b * s_gb + h * s_gh + rows[:, None] * s_gm + cols[None, :] * s_gd, mask=tile_ok, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + b * s_db + h * s_dh + rows * s_dm, mask=ok, other=0.0).to(tl.float32)
    lse = tl.load(LSE + b * s_lb + h * s_lh + rows * s_lm, mask=ok, other=0.0).to(tl.float32)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    tl.store(DELTA + bh.to(tl.int64) * L + rows, delta, mask=ok)
    tl.store(LSE2 + bh.to(tl.int64) * L + rows, lse2, mask=ok)


@triton.jit
def _dkdv_rows(dk, dv, k, v, lo, hi, Qh, DOh, DQh, LSE2h, DELTAh,
               s_qm, s_qd, s_om, s_od, s_dqm, s_dqd, s_rm,
               cols, offs_d, offs_dv, lq, lk, off, left, right,
               BITSh, s_bi, s_bw, partial, q_blk0, k_blk0, qk_scale, sm_scale, D, DV,
               MASK: tl.constexpr, SPARSE: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
               ATOMIC_DQ: tl.constexpr, BLOCK_M: tl.constexpr, DOT_PREC: tl.constexpr):
    """Add the query tiles starting in [lo, hi) to the resident keys' dK, dV (transposed tiles,
    (keys, rows), as in the tutorial, so P and dS need no transpose)."""
    for m0 in range(lo, hi, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < lq
        q_t = tl.load(Qh + rows[None, :] * s_qm + offs_d[:, None] * s_qd,
                      mask=row_ok[None, :] & (offs_d[:, None] < D), other=0.0).to(k.dtype)
        lse2 = tl.load(LSE2h + rows * s_rm, mask=row_ok, other=float("inf"))
        s_t = tl.dot(k, q_t, input_precision=DOT_PREC) * qk_scale
        if MASK:
            if SPARSE and cols.shape[0] % 32 == 0:  # the resident keys start at k_blk0 (_dkdv_sparse_head)
                bits = _bitmap_bits(BITSh, rows, k_blk0, k_blk0, s_bi, s_bw, partial, q_blk0, cols.shape[0])
                ok = (tl.trans(bits) != 0) & (cols[:, None] < lk)
            else:
                ok = _visible(rows[None, :], cols[:, None], lk, off, left, right, BITSh, s_bi, s_bw, partial,
                              q_blk0, k_blk0, SPARSE, HAS_LEFT, HAS_RIGHT)
            s_t = tl.where(ok, s_t, float("-inf"))
        p_t = tl.exp2(s_t - lse2[None, :])
        do = tl.load(DOh + rows[:, None] * s_om + offs_dv[None, :] * s_od,
                     mask=row_ok[:, None] & (offs_dv[None, :] < DV), other=0.0).to(k.dtype)
        dv += tl.dot(p_t.to(k.dtype), do, input_precision=DOT_PREC)
        delta = tl.load(DELTAh + rows * s_rm, mask=row_ok, other=0.0)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
        ds_t = (p_t * (dp_t - delta[None, :])).to(k.dtype)
        dk += tl.dot(ds_t, tl.trans(q_t), input_precision=DOT_PREC)
        if ATOMIC_DQ:
            dq = tl.dot(tl.trans(ds_t), k, input_precision=DOT_PREC) * sm_scale
            tl.atomic_add(DQh + rows[:, None] * s_dqm + offs_d[None, :] * s_dqd, dq,
                          mask=row_ok[:, None] & (offs_d[None, :] < D))
    return dk, dv


@triton.jit
def _dense_row_ranges(n0, lq, lk, off, left, right, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Query tiles that see keys [n0, n0 + BLOCK_N): masked [lo, a), mask-free [a, b), masked [b, hi)."""
    q_lo = lq * 0
    q_hi = lq
    if HAS_RIGHT:  # row i sees key j only if j <= i + off + right
        q_lo = tl.maximum(n0 - off - right, 0)
    if HAS_LEFT:  # ... and j >= i + off - left
        q_hi = tl.minimum(lq, n0 + BLOCK_N - off + left)
    q_hi = tl.where(n0 >= lk, q_lo, q_hi)
    lo = tl.minimum(q_lo, lq) // BLOCK_M * BLOCK_M
    hi = tl.maximum(q_hi, lo)
    a = lo
    if HAS_RIGHT:  # first tile whose top row sees the tile's last key
        a = tl.maximum(lo, tl.cdiv(tl.maximum(n0 + BLOCK_N - 1 - off - right, 0), BLOCK_M) * BLOCK_M)
    a = tl.where(n0 + BLOCK_N > lk, hi, tl.minimum(a, hi))
    b = hi
    if HAS_LEFT:  # last tile whose bottom row still sees the tile's first key
        y = n0 - off + left - BLOCK_M + 1
        b = tl.where(y < 0, a, (tl.maximum(y, 0) // BLOCK_M + 1) * BLOCK_M)
    b = tl.minimum(tl.maximum(b, a), hi)
    return lo, a, b, hi


@triton.jit
def bwd_dkdv(Q, K, V, DO, DQ, GRAD_K, GRAD_V, LSE2, DELTA, CU_Q, CU_K, KV_LENS, ROW_START, CODES, BITS,
             s_qb, s_qh, s_qm, s_qd, s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd,
             s_ob, s_oh, s_om, s_od, s_dqb, s_dqh, s_dqm, s_dqd,
             s_dks, s_dkb, s_dkh, s_dkn, s_dkd, s_dvs, s_dvb, s_dvh, s_dvn, s_dvd,
             s_rb, s_rh, s_rm, s_csb, s_csh, s_cdb, s_cdh, s_bb, s_bh, s_bm, s_bs, s_bi, s_bw,
             HKV, GROUP, GROUP_PER_SPLIT, SPLIT, LQ, LK, D, DV, qk_scale, sm_scale, left, right,
             block_q, block_kv, slots1,
             VARLEN: tl.constexpr, HAS_KV_LENS: tl.constexpr, SPARSE: tl.constexpr,
             HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, ATOMIC_DQ: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
             DOT_PREC: tl.constexpr):
    """dK, dV of one tile of BLOCK_N keys of one kv head, summed over (a split of) its query heads.

    The sum over the group's heads happens in registers, so GQA needs neither atomics nor an
    expanded dK; ``SPLIT > 1`` gives each split its own partial output (summed by the launcher).
    """
    # Inductor's launcher types a Python float argument as fp64 (eager Triton: fp32); keep the math fp32
    qk_scale, sm_scale = tl.cast(qk_scale, tl.float32), tl.cast(sm_scale, tl.float32)
    pid_n = tl.program_id(0)
    pid = tl.program_id(1)
    split = pid % SPLIT
    b = pid // SPLIT // HKV
    hkv = (pid // SPLIT % HKV).to(tl.int64)
    # (first row, rows, first key, keys) of sequence b, loaded in the kernel itself: torch's analysis of what a
    # user kernel writes (wrap_triton) counts every pointer handed to a helper whose results address a store as
    # written: a helper loading CU_Q, CU_K and KV_LENS would make compiled code copy them at each launch
    q0, lq, k0, lk = b * 0, b * 0 + LQ, b * 0, b * 0 + LK
    if VARLEN:
        q0, k0 = tl.load(CU_Q + b), tl.load(CU_K + b)
        lq, lk = tl.load(CU_Q + b + 1) - q0, tl.load(CU_K + b + 1) - k0
    elif HAS_KV_LENS:
        lk = tl.load(KV_LENS + b)
    q0, k0 = q0.to(tl.int64), k0.to(tl.int64)  # int64 offsets for big packed tensors
    b64 = b.to(tl.int64)
    n0 = pid_n * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    if VARLEN:
        store_len = lk
    else:  # dense kv_seqlens: keys past the length are stored too, as zero gradients
        store_len = lk * 0 + LK
    col_ok = cols < store_len
    # keys past the length read as zeros: p is 0 there, but 0 times what they hold is NaN where they hold NaN
    # (an unwritten cache slot), through dP = V dO^T into dS and with it dK and an atomic dQ
    key_ok = cols < lk
    k = tl.load(K + b64 * s_kb + hkv * s_kh + (k0 + cols[:, None]) * s_kn + offs_d[None, :] * s_kd,
                mask=key_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    v = tl.load(V + b64 * s_vb + hkv * s_vh + (k0 + cols[:, None]) * s_vn + offs_dv[None, :] * s_vd,
                mask=key_ok[:, None] & (offs_dv[None, :] < DV), other=0.0).to(k.dtype)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    off = lk - lq
    g_hi = tl.minimum(GROUP, (split + 1) * GROUP_PER_SPLIT)
    for g in range(split * GROUP_PER_SPLIT, g_hi):
        hq = (hkv * GROUP + g).to(tl.int64)
        Qh = Q + b64 * s_qb + hq * s_qh + q0 * s_qm
        DOh = DO + b64 * s_ob + hq * s_oh + q0 * s_om
        DQh = DQ + b64 * s_dqb + hq * s_dqh + q0 * s_dqm
        LSE2h = LSE2 + b64 * s_rb + hq * s_rh + q0 * s_rm
        DELTAh = DELTA + b64 * s_rb + hq * s_rh + q0 * s_rm
        if SPARSE:
            dk, dv = _dkdv_sparse_head(dk, dv, k, v, Qh, DOh, DQh, LSE2h, DELTAh, s_qm, s_qd, s_om, s_od,
                                       s_dqm, s_dqd, s_rm, cols, offs_d, offs_dv, lq, lk,
                                       ROW_START + b64 * s_csb + hq * s_csh, CODES + b64 * s_cdb + hq * s_cdh,
                                       BITS + b64 * s_bb + hq * s_bh, s_bm, s_bs, s_bi, s_bw,
                                       n0, block_q, block_kv, slots1, qk_scale, sm_scale, D, DV,
                                       ATOMIC_DQ, BLOCK_M, DOT_PREC)
        else:
            lo, a, bb, hi = _dense_row_ranges(n0, lq, lk, off, left, right, HAS_LEFT, HAS_RIGHT, BLOCK_M, BLOCK_N)
            dk, dv = _dkdv_rows(dk, dv, k, v, lo, a, Qh, DOh, DQh, LSE2h, DELTAh, s_qm, s_qd, s_om, s_od, s_dqm,
                                s_dqd, s_rm, cols, offs_d, offs_dv, lq, lk, off, left, right, BITS, 0, 0, False,
                                0, 0, qk_scale, sm_scale, D, DV, True, False, HAS_LEFT, HAS_RIGHT, ATOMIC_DQ,
                                BLOCK_M, DOT_PREC)
            dk, dv = _dkdv_rows(dk, dv, k, v, a, bb, Qh, DOh, DQh, LSE2h, DELTAh, s_qm, s_qd, s_om, s_od, s_dqm,
                                s_dqd, s_rm, cols, offs_d, offs_dv, lq, lk, off, left, right, BITS, 0, 0, False,
                                0, 0, qk_scale, sm_scale, D, DV, False, False, HAS_LEFT, HAS_RIGHT, ATOMIC_DQ,
                                BLOCK_M, DOT_PREC)
            dk, dv = _dkdv_rows(dk, dv, k, v, bb, hi, Qh, DOh, DQh, LSE2h, DELTAh, s_qm, s_qd, s_om, s_od, s_dqm,
                                s_dqd, s_rm, cols, offs_d, offs_dv, lq, lk, off, left, right, BITS, 0, 0, False,
                                0, 0, qk_scale, sm_scale, D, DV, True, False, HAS_LEFT, HAS_RIGHT, ATOMIC_DQ,
                                BLOCK_M, DOT_PREC)
    dk *= sm_scale
    kv_row = split * s_dks + b64 * s_dkb + hkv * s_dkh + (k0 + cols[:, None]) * s_dkn
    tl.store(GRAD_K + kv_row + offs_d[None, :] * s_dkd, dk.to(GRAD_K.dtype.element_ty),
             mask=col_ok[:, None] & (offs_d[None, :] < D))
    vv_row = split * s_dvs + b64 * s_dvb + hkv * s_dvh + (k0 + cols[:, None]) * s_dvn
    tl.store(GRAD_V + vv_row + offs_dv[None, :] * s_dvd, dv.to(GRAD_V.dtype.element_ty),
             mask=col_ok[:, None] & (offs_dv[None, :] < DV))


@triton.jit
def _dkdv_sparse_head(dk, dv, k, v, Qh, DOh, DQh, LSE2h, DELTAh, s_qm, s_qd, s_om, s_od, s_dqm, s_dqd, s_rm,
                      cols, offs_d, offs_dv, lq, lk, ROW_START, CODES, BITS, s_bm, s_bs, s_bi, s_bw,
                      n0, block_q, block_kv, slots1, qk_scale, sm_scale, D, DV,
                      ATOMIC_DQ: tl.constexpr, BLOCK_M: tl.constexpr, DOT_PREC: tl.constexpr):
    """One query head's contribution through the transposed block list: the q blocks that list the
    resident kv block, in ascending order (code = q_block * slots1 + slot + 1, slot -1 = full block)."""
    nb = n0 // block_kv
    # the 32-key word holding the resident keys' first: bitmap pointers and k_blk0 start there, so that
    # resident keys are keys [0, BLOCK_N) (or [0 | 16, +16) for 16-key tiles) of the rebased bitmap
    word0 = (n0 - nb * block_kv) // 32 * 32
    k_blk0 = nb * block_kv + word0
    edge = (nb + 1) * block_kv > lk  # the last kv block may run past the keys
    e_lo = tl.load(ROW_START + nb)
    e_hi = tl.load(ROW_START + nb + 1)
    for e in range(e_lo, e_hi):
        code = tl.load(CODES + e)
        m = code // slots1
        slot = code % slots1 - 1
        partial = slot >= 0
        q_blk0 = m * block_q
        lo = q_blk0
        hi = tl.minimum(q_blk0 + block_q, lq)
        mid = tl.where(partial | edge, hi, lo)
        bits = BITS + m.to(tl.int64) * s_bm + tl.maximum(slot, 0) * s_bs + (word0 // 32) * s_bw
        dk, dv = _dkdv_rows(dk, dv, k, v, lo, mid, Qh, DOh, DQh, LSE2h, DELTAh, s_qm, s_qd, s_om, s_od,
                            s_dqm, s_dqd, s_rm, cols, offs_d, offs_dv, lq, lk, 0, 0, 0,
                            bits, s_bi, s_bw, partial, q_blk0, k_blk0, qk_scale, sm_scale, D, DV,
                            True, True, False, False, ATOMIC_DQ, BLOCK_M, DOT_PREC)
        dk, dv = _dkdv_rows(dk, dv, k, v, mid, hi, Qh, DOh, DQh, LSE2h, DELTAh, s_qm, s_qd, s_om, s_od,
                            s_dqm, s_dqd, s_rm, cols, offs_d, offs_dv, lq, lk, 0, 0, 0,
                            bits, s_bi, s_bw, partial, q_blk0, k_blk0, qk_scale, sm_scale, D, DV,
                            False, True, False, False, ATOMIC_DQ, BLOCK_M, DOT_PREC)
    return dk, dv


@triton.jit
def _dq_cols(dq, q, do, lse2, delta, rows, lo, hi, Kh, Vh, s_kn, s_kd, s_vn, s_vd, offs_d, offs_dv,
             lk, off, left, right, BITS, s_bi, s_bw, partial, q_blk0, k_blk0, qk_scale, D, DV,
             MASK: tl.constexpr, SPARSE: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
             BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr):
    """Add the key tiles starting in [lo, hi) to the resident rows' dQ (unscaled)."""
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < lk
        k_t = tl.load(Kh + cols[None, :] * s_kn + offs_d[:, None] * s_kd,
                      mask=col_ok[None, :] & (offs_d[:, None] < D), other=0.0)
        v_t = tl.load(Vh + cols[None, :] * s_vn + offs_dv[:, None] * s_vd,
                      mask=col_ok[None, :] & (offs_dv[:, None] < DV), other=0.0).to(q.dtype)
        s = tl.dot(q, k_t, input_precision=DOT_PREC) * qk_scale
        if MASK:
            if SPARSE and BLOCK_N % 32 == 0:  # key tiles step from the kv block's start (bwd_dq)
                bits = _bitmap_bits(BITS, rows, n0, k_blk0, s_bi, s_bw, partial, q_blk0, BLOCK_N)
                ok = (bits != 0) & (cols[None, :] < lk)
            else:
                ok = _visible(rows[:, None], cols[None, :], lk, off, left, right, BITS, s_bi, s_bw, partial,
                              q_blk0, k_blk0, SPARSE, HAS_LEFT, HAS_RIGHT)
            s = tl.where(ok, s, float("-inf"))
        p = tl.exp2(s - lse2[:, None])
        dp = tl.dot(do, v_t, input_precision=DOT_PREC)
        ds = (p * (dp - delta[:, None])).to(q.dtype)
        dq += tl.dot(ds, tl.trans(k_t), input_precision=DOT_PREC)
    return dq


@triton.jit
def _dense_col_ranges(m0, lq, lk, off, left, right, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key tiles seen by rows [m0, m0 + BLOCK_M): masked [lo, a), mask-free [a, b), masked [b, hi)."""
    k_lo = lk * 0
    k_hi = lk
    if HAS_LEFT:
        k_lo = tl.maximum(m0 + off - left, 0)
    if HAS_RIGHT:
        k_hi = tl.minimum(lk, m0 + BLOCK_M + off + right)
    k_hi = tl.where(m0 >= lq, k_lo, k_hi)
    lo = tl.minimum(k_lo, lk) // BLOCK_N * BLOCK_N
    hi = tl.maximum(k_hi, lo)
    a = lo
    if HAS_LEFT:  # first tile whose first key is seen by the bottom row's window
        a = tl.maximum(lo, tl.cdiv(tl.maximum(m0 + BLOCK_M - 1 + off - left, 0), BLOCK_N) * BLOCK_N)
    a = tl.minimum(a, hi)
    # (a key past the end loads as zero and adds nothing to dQ, so this edge is only for symmetry with
    # dK/dV, where keys past a kv_seqlens length are real data)
    z = lk - BLOCK_N  # last mask-free tile start: inside the keys ...
    if HAS_RIGHT:  # ... and its last key seen by the top row
        z = tl.minimum(z, m0 + off + right - BLOCK_N + 1)
    b = tl.where(z < 0, a, (tl.maximum(z, 0) // BLOCK_N + 1) * BLOCK_N)
    b = tl.minimum(tl.maximum(b, a), hi)
    return lo, a, b, hi


@triton.jit
def bwd_dq(Q, K, V, DO, DQ, LSE2, DELTA, CU_Q, CU_K, KV_LENS, CNT, IDX, FULL_CNT, FULL_IDX, BITS,
           s_qb, s_qh, s_qm, s_qd, s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd,
           s_ob, s_oh, s_om, s_od, s_dqb, s_dqh, s_dqm, s_dqd, s_rb, s_rh, s_rm,
           s_cb, s_ch, s_cm, s_ib, s_ih, s_im, s_is, s_fcb, s_fch, s_fcm, s_fib, s_fih, s_fim, s_fis,
           s_bb, s_bh, s_bm, s_bs, s_bi, s_bw,
           HQ, GROUP, LQ, LK, D, DV, qk_scale, sm_scale, left, right, block_q, block_kv,
           VARLEN: tl.constexpr, HAS_KV_LENS: tl.constexpr, SPARSE: tl.constexpr, HAS_FULL: tl.constexpr,
           HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
           DOT_PREC: tl.constexpr):
    """dQ of one tile of BLOCK_M rows of one query head: the atomic-free pass."""
    # Inductor's launcher types a Python float argument as fp64 (eager Triton: fp32); keep the math fp32
    qk_scale, sm_scale = tl.cast(qk_scale, tl.float32), tl.cast(sm_scale, tl.float32)
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HQ
    hq = (bh % HQ).to(tl.int64)
    hkv = hq // GROUP
    # (first row, rows, first key, keys) of sequence b, loaded here as in bwd_dkdv (why there)
    q0, lq, k0, lk = b * 0, b * 0 + LQ, b * 0, b * 0 + LK
    if VARLEN:
        q0, k0 = tl.load(CU_Q + b), tl.load(CU_K + b)
        lq, lk = tl.load(CU_Q + b + 1) - q0, tl.load(CU_K + b + 1) - k0
    elif HAS_KV_LENS:
        lk = tl.load(KV_LENS + b)
    q0, k0 = q0.to(tl.int64), k0.to(tl.int64)  # int64 offsets for big packed tensors
    b64 = b.to(tl.int64)
    m0 = pid_m * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)
    row_ok = rows < lq
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + b64 * s_qb + hq * s_qh + (q0 + rows[:, None]) * s_qm + offs_d[None, :] * s_qd,
                mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    do = tl.load(DO + b64 * s_ob + hq * s_oh + (q0 + rows[:, None]) * s_om + offs_dv[None, :] * s_od,
                 mask=row_ok[:, None] & (offs_dv[None, :] < DV), other=0.0).to(q.dtype)
    r_off = b64 * s_rb + hq * s_rh + (q0 + rows) * s_rm
    lse2 = tl.load(LSE2 + r_off, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + r_off, mask=row_ok, other=0.0)
    Kh = K + b64 * s_kb + hkv * s_kh + k0 * s_kn
    Vh = V + b64 * s_vb + hkv * s_vh + k0 * s_vn
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    off = lk - lq
    if SPARSE:
        mb = m0 // block_q
        bits = BITS + b64 * s_bb + hq * s_bh + mb * s_bm
        n_full = 0
        if HAS_FULL:
            n_full = tl.load(FULL_CNT + b64 * s_fcb + hq * s_fch + mb * s_fcm)
        for e in range(n_full):
            nb = tl.load(FULL_IDX + b64 * s_fib + hq * s_fih + mb * s_fim + e * s_fis)
            lo = nb * block_kv
            hi = tl.minimum(lo + block_kv, lk)
            mid = tl.where(lo + block_kv > lk, hi, lo)
            # a full block needs a mask only where it runs past the keys: the dense mask, no window
            dq = _dq_cols(dq, q, do, lse2, delta, rows, lo, mid, Kh, Vh, s_kn, s_kd, s_vn, s_vd, offs_d, offs_dv,
                          lk, 0, 0, 0, bits, 0, 0, False, 0, 0, qk_scale, D, DV,
                          True, False, False, False, BLOCK_N, DOT_PREC)
            dq = _dq_cols(dq, q, do, lse2, delta, rows, mid, hi, Kh, Vh, s_kn, s_kd, s_vn, s_vd, offs_d, offs_dv,
                          lk, 0, 0, 0, bits, 0, 0, False, 0, 0, qk_scale, D, DV,
                          False, False, False, False, BLOCK_N, DOT_PREC)
        n_part = tl.load(CNT + b64 * s_cb + hq * s_ch + mb * s_cm)
        for s in range(n_part):
            nb = tl.load(IDX + b64 * s_ib + hq * s_ih + mb * s_im + s * s_is)
            lo = nb * block_kv
            hi = tl.minimum(lo + block_kv, lk)
            dq = _dq_cols(dq, q, do, lse2, delta, rows, lo, hi, Kh, Vh, s_kn, s_kd, s_vn, s_vd, offs_d, offs_dv,
                          lk, 0, 0, 0, bits + s * s_bs, s_bi, s_bw, True, mb * block_q, lo, qk_scale, D, DV,
                          True, True, False, False, BLOCK_N, DOT_PREC)
    else:
        lo, a, bb, hi = _dense_col_ranges(m0, lq, lk, off, left, right, HAS_LEFT, HAS_RIGHT, BLOCK_M, BLOCK_N)
        dq = _dq_cols(dq, q, do, lse2, delta, rows, lo, a, Kh, Vh, s_kn, s_kd, s_vn, s_vd, offs_d, offs_dv,
                      lk, off, left, right, BITS, 0, 0, False, 0, 0, qk_scale, D, DV,
                      True, False, HAS_LEFT, HAS_RIGHT, BLOCK_N, DOT_PREC)
        dq = _dq_cols(dq, q, do, lse2, delta, rows, a, bb, Kh, Vh, s_kn, s_kd, s_vn, s_vd, offs_d, offs_dv,
                      lk, off, left, right, BITS, 0, 0, False, 0, 0, qk_scale, D, DV,
                      False, False, HAS_LEFT, HAS_RIGHT, BLOCK_N, DOT_PREC)
        dq = _dq_cols(dq, q, do, lse2, delta, rows, bb, hi, Kh, Vh, s_kn, s_kd, s_vn, s_vd, offs_d, offs_dv,
                      lk, off, left, right, BITS, 0, 0, False, 0, 0, qk_scale, D, DV,
                      True, False, HAS_LEFT, HAS_RIGHT, BLOCK_N, DOT_PREC)
    dq *= sm_scale
    tl.store(DQ + b64 * s_dqb + hq * s_dqh + (q0 + rows[:, None]) * s_dqm + offs_d[None, :] * s_dqd,
             dq.to(DQ.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < D))
