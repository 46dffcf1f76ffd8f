"""Triton kernel of the flash-attention forward: online softmax over KV tiles, one query tile at a time.

The algorithm is FlashAttention-2's (Dao, 2023, arXiv:2307.08691): keep a running row max ``m``, row sum
``l`` and an unnormalised accumulator per query row, rescale them when the max grows, and divide once at
the end. Scores are scaled by ``scale * log2(e)`` so the exponentials are ``exp2`` (the same trick as
Triton's tutorial 06), and lse is converted back to natural log on the way out.

One kernel serves three ops through constexpr ``MODE`` (dense, varlen, block-sparse) and three schedules
through ``SCHEDULE``: one tile per program, persistent (grid = resident programs, each strides over the
tile list), and LPT (persistent, heaviest query blocks first within L2-sized groups of heads; the order
of flash-attention's SingleTileLPTScheduler, flash_attn/cute/tile_scheduler.py, which launches one tile
per block in that order instead of looping).

K and V arrive through pointer loads (cp.async, any strides) or, with ``TMA``, as host-side tensor
descriptors over (batch, head, row, dim) that Hopper's TMA unit copies; the same code handles both.

GQA packing (FA3's PackGQA): with ``PACK = G`` a program owns one KV head and its tile rows are
(position, query head) pairs, row r = position * G + head-in-group, so every K/V tile it loads serves all
G query heads. With ``PACK = 1`` rows are positions of one query head.
"""

from __future__ import annotations

import triton
import triton.language as tl

MODE_DENSE, MODE_VARLEN, MODE_SPARSE = 0, 1, 2
SCHEDULES = {"tile": 0, "persistent": 1, "lpt": 2}

LOG2E = 1.4426950408889634  # the host scales by it; inside the kernel constants are literals


@triton.jit
def _tile_coords(tile, num_m, num_bh, lpt_heads, SCHEDULE: tl.constexpr):
    """(batch*head index, query block) of a tile id. LPT walks groups of ``lpt_heads`` heads (sized so
    their K/V stay in L2) and, inside a group, query blocks from the last (heaviest when causal) down."""
    if SCHEDULE == 2:
        per_group = lpt_heads * num_m
        group = tile // per_group
        r = tile - group * per_group
        heads = tl.minimum(lpt_heads, num_bh - group * lpt_heads)
        m = num_m - 1 - r // heads
        bh = group * lpt_heads + r % heads
    else:
        bh = tile // num_m
        m = tile - bh * num_m
    return bh, m


@triton.jit
def _load_2d(ptrs, row_ok, col_ok, CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
    """Load with bounds checks only where the constexpr flags say a bound can be crossed."""
    if CHECK_ROWS:
        if CHECK_COLS:
            x = tl.load(ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        else:
            x = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    else:
        if CHECK_COLS:
            x = tl.load(ptrs, mask=col_ok[None, :], other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def _scores(q, k_base, kv_at, start_n, n_limit, sk_n, sk_d, qk_scale,
            BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr,
            CHECK_N: tl.constexpr, TMA: tl.constexpr, DOT_PREC: tl.constexpr):
    """Scores of the query tile against keys [start_n, start_n + BLOCK_N), in log2 units. With ``TMA``,
    ``k_base`` is a (batch, head, row, dim) tensor descriptor and ``kv_at`` the (batch, head, first row)
    of this sequence in it (rows past the descriptor's shape read as zeros); else ``k_base`` points at
    the sequence's first key."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if TMA:
        k = k_base.load([kv_at[0], kv_at[1], kv_at[2] + start_n, 0])
        kt = tl.trans(tl.reshape(k, (BLOCK_N, BLOCK_D)))
    else:
        offs_d = tl.arange(0, BLOCK_D)
        kt = _load_2d(k_base + offs_d[:, None] * sk_d + offs_n[None, :] * sk_n, offs_d < D, offs_n < n_limit,
                      BLOCK_D != D, CHECK_N)
    return tl.dot(q, kt, input_precision=DOT_PREC) * qk_scale


@triton.jit
def _accumulate(acc, m_i, l_i, s, v_base, kv_at, start_n, n_limit, sv_n, sv_d,
                BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, DV: tl.constexpr,
                CHECK_N: tl.constexpr, SAFE: tl.constexpr, TMA: tl.constexpr, DOT_PREC: tl.constexpr):
    """One online-softmax step. ``SAFE`` handles rows whose scores are all -inf so far (masked tiles):
    their max is taken as 0 so exp2 gives 0 instead of NaN (exp2(-inf - -inf))."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if SAFE:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    p = tl.math.exp2(s - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if TMA:
        v = tl.reshape(v_base.load([kv_at[0], kv_at[1], kv_at[2] + start_n, 0]), (BLOCK_N, BLOCK_DV))
        if CHECK_N:
            # rows past this sequence's keys hold other data (the next sequence, unused cache slots that
            # may be NaN): p is 0 there, but 0 * NaN is not
            v = tl.where((offs_n < n_limit)[:, None], v, 0.0)
    else:
        offs_dv = tl.arange(0, BLOCK_DV)
        v = _load_2d(v_base + offs_n[:, None] * sv_n + offs_dv[None, :] * sv_d, offs_n < n_limit, offs_dv < DV,
                     CHECK_N, BLOCK_DV != DV)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
    return acc, m_new, l_i


@triton.jit
def _dense_span(acc, m_i, l_i, q, k_base, v_base, kv_at, lo, hi, n_valid, diag, window_left, window_right,
                sk_n, sk_d, sv_n, sv_d, qk_scale,
                BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, D: tl.constexpr,
                DV: tl.constexpr, MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                TMA: tl.constexpr, DOT_PREC: tl.constexpr):
    """KV tiles [lo, hi) of a dense/varlen row block. Unmasked spans are tiles every row sees entirely
    (no compare, no select); masked spans apply the key bound and the causal/window band per element.
    ``diag`` is each row's aligned diagonal: position + n_valid - len_q."""
    for start_n in range(lo, hi, BLOCK_N):
        s = _scores(q, k_base, kv_at, start_n, n_valid, sk_n, sk_d, qk_scale, BLOCK_N, BLOCK_D, D, MASKED, TMA,
                    DOT_PREC)
        if MASKED:
            cols = start_n + tl.arange(0, BLOCK_N)
            ok = cols[None, :] < n_valid
            if HAS_RIGHT:
                ok = ok & (cols[None, :] <= diag[:, None] + window_right)
            if HAS_LEFT:
                ok = ok & (cols[None, :] >= diag[:, None] - window_left)
            s = tl.where(ok, s, float("-inf"))
        acc, m_i, l_i = _accumulate(acc, m_i, l_i, s, v_base, kv_at, start_n, n_valid, sv_n, sv_d, BLOCK_N,
                                    BLOCK_DV, DV, MASKED, MASKED, TMA, DOT_PREC)
    return acc, m_i, l_i


@triton.jit
def _dense_rows(acc, m_i, l_i, q, k_base, v_base, kv_at, pos_first, pos_last, len_q, n_valid, diag,
                window_left, window_right, sk_n, sk_d, sv_n, sv_d, qk_scale,
                BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, D: tl.constexpr,
                DV: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, TMA: tl.constexpr,
                DOT_PREC: tl.constexpr):
    """Visit only the KV tiles that some row of the block can see, split into masked edge spans and an
    unmasked middle: [lo, full_lo) masked, [full_lo, full_hi) unmasked, [full_hi, hi) masked."""
    off = n_valid - len_q
    lo = 0
    hi = n_valid
    full_lo = 0
    vis_end = n_valid  # keys below this are visible to every row of the block (upper side)
    if HAS_LEFT:
        lo = tl.maximum(pos_first + off - window_left, 0) // BLOCK_N * BLOCK_N
        full_lo = tl.cdiv(tl.maximum(pos_last + off - window_left, 0), BLOCK_N) * BLOCK_N
    if HAS_RIGHT:
        hi = tl.minimum(n_valid, tl.maximum(pos_last + off + window_right + 1, 0))
        vis_end = tl.minimum(n_valid, tl.maximum(pos_first + off + window_right + 1, 0))
    full_lo = tl.minimum(tl.maximum(full_lo, lo), tl.maximum(hi, lo))
    full_hi = tl.maximum(tl.minimum(vis_end // BLOCK_N * BLOCK_N, hi), full_lo)
    acc, m_i, l_i = _dense_span(acc, m_i, l_i, q, k_base, v_base, kv_at, lo, full_lo, n_valid, diag,
                                window_left, window_right, sk_n, sk_d, sv_n, sv_d, qk_scale, BLOCK_N, BLOCK_D,
                                BLOCK_DV, D, DV, True, HAS_LEFT, HAS_RIGHT, TMA, DOT_PREC)
    acc, m_i, l_i = _dense_span(acc, m_i, l_i, q, k_base, v_base, kv_at, full_lo, full_hi, n_valid, diag,
                                window_left, window_right, sk_n, sk_d, sv_n, sv_d, qk_scale, BLOCK_N, BLOCK_D,
                                BLOCK_DV, D, DV, False, HAS_LEFT, HAS_RIGHT, TMA, DOT_PREC)
    acc, m_i, l_i = _dense_span(acc, m_i, l_i, q, k_base, v_base, kv_at, full_hi, hi, n_valid, diag,
                                window_left, window_right, sk_n, sk_d, sv_n, sv_d, qk_scale, BLOCK_N, BLOCK_D,
                                BLOCK_DV, D, DV, True, HAS_LEFT, HAS_RIGHT, TMA, DOT_PREC)
    return acc, m_i, l_i


@triton.jit
def _bitmap_words(bits_base, slot, sub, sbt_s, sbt_w, BLOCK_N: tl.constexpr, is_partial=None):
    """Each row's BLOCK_N // 32 bitmap words of sub-tile ``sub`` of partial-list slot ``slot``
    (``bits_base``: [rows, 1] pointers at the rows' first word): one load per word, not a gather per
    column. Where a given ``is_partial`` is false nothing is read and every bit is set."""
    ptrs = bits_base + slot * sbt_s + (sub * (BLOCK_N // 32) + tl.arange(0, BLOCK_N // 32))[None, :] * sbt_w
    if is_partial is None:
        words = tl.load(ptrs)
    else:
        # the mask as a full [rows, words] tensor: Triton's interpreter rejects a broadcast scalar mask
        words = tl.load(ptrs, mask=tl.full(ptrs.shape, 1, tl.int1) & is_partial, other=-1)
    return words


@triton.jit
def _expand_bits(words, BLOCK_N: tl.constexpr):
    """[rows, BLOCK_N] int32 0/1 from [rows, BLOCK_N // 32] words, in registers: column j = bit j % 32 of
    word j // 32; callers compare with 0 (the backward after transposing it)."""
    bits = (words[:, :, None] >> tl.arange(0, 32)[None, None, :]) & 1
    return tl.reshape(bits, (words.shape[0], BLOCK_N))


@triton.jit
def _sparse_rows(acc, m_i, l_i, q, k_base, v_base, kv_at, len_k, b, hq, qb, rows_in_block, m,
                 FULL_CNT, FULL_IDX, PART_CNT, PART_IDX, BITS, TILES, sparse_strides,
                 sk_n, sk_d, sv_n, sv_d, qk_scale,
                 BLOCK_N: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_DV: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, HAS_FULL: tl.constexpr,
                 EVEN_N: tl.constexpr, TILE_LIST: tl.constexpr, TMA: tl.constexpr, DOT_PREC: tl.constexpr):
    """Visit the listed KV blocks of q block ``qb`` only: full blocks without a mask (bar the sequence
    end), partial blocks through their bitmaps (bit j%32 of word j//32 per row). A mask block of
    BLOCK_KV keys is visited as SUB = BLOCK_KV // BLOCK_N tiles (a smaller tile than the mask's block can
    be the faster one: 64x64 beat 128x128 by 25% on a dense 256 window, H100). Each loop runs over
    tiles, one per iteration, rather than over blocks with SUB tiles unrolled: the software pipeline
    buffers num_stages iterations, and SUB tiles per iteration took SUB times the shared memory (145 vs
    113 KiB at 64x64, 3 stages, sm_90), one program per SM instead of two.

    With ``TILE_LIST`` the program walks row tile ``m``'s list from :func:`sparse_tile_list_kernel`
    instead: only its non-empty tiles, full and partial in one loop (one pipeline to fill).

    ``sparse_strides`` are the strides of the block lists, bitmaps and tile lists, as the kernel takes them
    (a tuple, so that the kernel and _tile pass them on in one argument)."""
    (sfc_b, sfc_h, sfc_m, sfi_b, sfi_h, sfi_m, sfi_s, spc_b, spc_h, spc_m, spi_b, spi_h, spi_m, spi_s,
     sbt_b, sbt_h, sbt_m, sbt_s, sbt_r, sbt_w, st_b, st_h, st_m) = sparse_strides
    SUB: tl.constexpr = BLOCK_KV // BLOCK_N
    idx_base = PART_IDX + b * spi_b + hq * spi_h + qb * spi_m
    bits_base = BITS + b * sbt_b + hq * sbt_h + qb * sbt_m + rows_in_block[:, None] * sbt_r
    if TILE_LIST:
        list_base = TILES + b * st_b + hq * st_h + m * st_m
        for t in range(0, tl.load(list_base)):
            entry = tl.load(list_base + 1 + t)
            is_partial = entry < 0
            slot_sub = -1 - entry  # partial: slot * SUB + sub-tile of the partial list
            i = slot_sub // SUB
            sub = slot_sub - i * SUB
            block = tl.load(idx_base + i * spi_s, mask=is_partial, other=0)
            start_n = tl.where(is_partial, block * BLOCK_KV + sub * BLOCK_N, entry * BLOCK_N)
            s = _scores(q, k_base, kv_at, start_n, len_k, sk_n, sk_d, qk_scale, BLOCK_N, BLOCK_D, D,
                        not EVEN_N, TMA, DOT_PREC)
            words = _bitmap_words(bits_base, i, sub, sbt_s, sbt_w, BLOCK_N, is_partial)
            if not EVEN_N:
                s = tl.where((start_n + tl.arange(0, BLOCK_N))[None, :] < len_k, s, float("-inf"))
            if is_partial:  # whole tiles skip the expand and select (H100 window 256: 0.296 vs 0.306 ms)
                s = tl.where(_expand_bits(words, BLOCK_N) != 0, s, float("-inf"))
            acc, m_i, l_i = _accumulate(acc, m_i, l_i, s, v_base, kv_at, start_n, len_k, sv_n, sv_d, BLOCK_N,
                                        BLOCK_DV, DV, not EVEN_N, True, TMA, DOT_PREC)
    else:
        if HAS_FULL:
            n_full = tl.load(FULL_CNT + b * sfc_b + hq * sfc_h + qb * sfc_m)
            full_base = FULL_IDX + b * sfi_b + hq * sfi_h + qb * sfi_m
            for t in range(0, n_full * SUB):
                start_n = tl.load(full_base + (t // SUB) * sfi_s) * BLOCK_KV + (t % SUB) * BLOCK_N
                s = _scores(q, k_base, kv_at, start_n, len_k, sk_n, sk_d, qk_scale, BLOCK_N, BLOCK_D, D,
                            not EVEN_N, TMA, DOT_PREC)
                if not EVEN_N:
                    s = tl.where((start_n + tl.arange(0, BLOCK_N))[None, :] < len_k, s, float("-inf"))
                acc, m_i, l_i = _accumulate(acc, m_i, l_i, s, v_base, kv_at, start_n, len_k, sv_n, sv_d,
                                            BLOCK_N, BLOCK_DV, DV, not EVEN_N, not EVEN_N, TMA, DOT_PREC)
        n_part = tl.load(PART_CNT + b * spc_b + hq * spc_h + qb * spc_m)
        for t in range(0, n_part * SUB):
            i = t // SUB
            sub = t % SUB
            start_n = tl.load(idx_base + i * spi_s) * BLOCK_KV + sub * BLOCK_N
            s = _scores(q, k_base, kv_at, start_n, len_k, sk_n, sk_d, qk_scale, BLOCK_N, BLOCK_D, D,
                        not EVEN_N, TMA, DOT_PREC)
            visible = _expand_bits(_bitmap_words(bits_base, i, sub, sbt_s, sbt_w, BLOCK_N), BLOCK_N) != 0
            s = tl.where(visible, s, float("-inf"))
            acc, m_i, l_i = _accumulate(acc, m_i, l_i, s, v_base, kv_at, start_n, len_k, sv_n, sv_d, BLOCK_N,
                                        BLOCK_DV, DV, not EVEN_N, True, TMA, DOT_PREC)
    return acc, m_i, l_i


@triton.jit
def sparse_tile_list_kernel(TILES, FULL_CNT, FULL_IDX, PART_CNT, PART_IDX, BITS,
                            st_b, st_h, st_m, sfc_b, sfc_h, sfc_m, sfi_b, sfi_h, sfi_m, sfi_s,
                            spc_b, spc_h, spc_m, spi_b, spi_h, spi_m, spi_s,
                            sbt_b, sbt_h, sbt_m, sbt_s, sbt_r, sbt_w, heads, num_m,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr,
                            BLOCK_KV: tl.constexpr, HAS_FULL: tl.constexpr):
    """The KV tiles (BLOCK_N keys) row tile m (BLOCK_M queries) of each mask (batch, head) must visit:
    ``TILES[b, h, m, 0]`` is their count, then one int32 per tile: ``n >= 0`` is a tile every row sees
    whole (keys n * BLOCK_N onward: a full block's, or a partial block's whose bits are all set), ``n < 0``
    a tile to mask, ``-1 - n`` = slot * SUB + sub-tile of the q block's partial list. Tiles whose bits
    are all clear (outside a window's band inside a partial 128-block, say) are left out."""
    SUB: tl.constexpr = BLOCK_KV // BLOCK_N
    pid = tl.program_id(0)
    bh = pid // num_m
    m = pid - bh * num_m
    b = bh // heads
    h = bh - b * heads
    qb = m * BLOCK_M // BLOCK_Q
    rows = m * BLOCK_M - qb * BLOCK_Q + tl.arange(0, BLOCK_M)
    out = TILES + b * st_b + h * st_h + m * st_m + 1
    count = 0
    if HAS_FULL:
        full_base = FULL_IDX + b * sfi_b + h * sfi_h + qb * sfi_m
        for t in range(0, tl.load(FULL_CNT + b * sfc_b + h * sfc_h + qb * sfc_m) * SUB):
            tl.store(out + count, tl.load(full_base + (t // SUB) * sfi_s) * SUB + t % SUB)
            count += 1
    n_part = tl.load(PART_CNT + b * spc_b + h * spc_h + qb * spc_m)
    part_base = PART_IDX + b * spi_b + h * spi_h + qb * spi_m
    bits_base = BITS + b * sbt_b + h * sbt_h + qb * sbt_m + rows[:, None] * sbt_r
    for t in range(0, n_part * SUB):
        words = _bitmap_words(bits_base, t // SUB, t % SUB, sbt_s, sbt_w, BLOCK_N)
        seen = tl.max(tl.max((words != 0).to(tl.int32), 1), 0)
        whole = tl.min(tl.min((words == -1).to(tl.int32), 1), 0)
        tile = tl.load(part_base + (t // SUB) * spi_s) * SUB + t % SUB
        tl.store(out + count, tl.where(whole == 1, tile, -1 - t), mask=seen == 1)
        count += seen
    tl.store(out - 1, count)


@triton.jit
def _tile(tile, Q, K, V, O, LSE, KV_LENS, CU_Q, CU_K, FULL_CNT, FULL_IDX, PART_CNT, PART_IDX, BITS, TILES,
          sq_b, sq_h, sq_m, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d, so_b, so_h, so_m, so_d,
          sl_b, sl_h, sl_m, sparse_strides, len_q, len_k, qk_scale, window_left, window_right,
          heads_prog, num_m, num_bh, lpt_heads,
          GROUP: tl.constexpr, PACK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
          MODE: tl.constexpr, SCHEDULE: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
          HAS_KV_LENS: tl.constexpr, HAS_FULL: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr,
          EVEN_N: tl.constexpr, TILE_LIST: tl.constexpr, TMA: tl.constexpr, DOT_PREC: tl.constexpr):
    bh, m = _tile_coords(tile, num_m, num_bh, lpt_heads, SCHEDULE)
    b = bh // heads_prog
    hp = bh - b * heads_prog
    if MODE == 1:  # varlen: batch b is the packed token range cu[b]:cu[b+1]
        q_start = tl.load(CU_Q + b)
        len_q_b = tl.load(CU_Q + b + 1) - q_start
        k_start = tl.load(CU_K + b)
        n_valid = tl.load(CU_K + b + 1) - k_start
        q_off = q_start.to(tl.int64) * sq_m
        o_off = q_start.to(tl.int64) * so_m
        l_off = q_start.to(tl.int64) * sl_m
        k_off = k_start.to(tl.int64) * sk_n
        v_off = k_start.to(tl.int64) * sv_n
    else:
        # "+ 0 * b" keeps both runtime values even when Triton specializes an argument equal to 1 into a
        # constexpr (Lq = 1 decode, Lk = 1), so the bound arithmetic below always works on tensors
        len_q_b = len_q + 0 * b
        n_valid = len_k + 0 * b
        if HAS_KV_LENS:
            n_valid = tl.load(KV_LENS + b)
        b64 = b.to(tl.int64)
        q_off = b64 * sq_b
        o_off = b64 * so_b
        l_off = b64 * sl_b
        k_off = b64 * sk_b
        v_off = b64 * sv_b
    row0 = m * BLOCK_M
    if row0 < len_q_b * PACK:
        rows = row0 + tl.arange(0, BLOCK_M)
        pos = rows // PACK
        head = hp * PACK + rows % PACK  # query head of each row
        hkv32 = hp * PACK // GROUP
        hkv = hkv32.to(tl.int64)
        row_ok = pos < len_q_b
        offs_d = tl.arange(0, BLOCK_D)
        q = _load_2d(Q + q_off + pos[:, None] * sq_m + head[:, None].to(tl.int64) * sq_h + offs_d[None, :] * sq_d,
                     row_ok, offs_d < D, True, BLOCK_D != D)
        if TMA:  # K and V are (batch, head, row, dim) descriptors; varlen packs all sequences in batch 0
            k_base = K
            v_base = V
            if MODE == 1:
                kv_at = (0 * b, hkv32, k_start)
            else:
                kv_at = (b, hkv32, 0 * b)
        else:
            k_base = K + k_off + hkv * sk_h
            v_base = V + v_off + hkv * sv_h
            kv_at = (b, hkv32, b)  # unused by pointer loads
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        if MODE == 2:
            qb = row0 // BLOCK_Q
            acc, m_i, l_i = _sparse_rows(
                acc, m_i, l_i, q, k_base, v_base, kv_at, len_k, b, hp, qb, rows - qb * BLOCK_Q, m,
                FULL_CNT, FULL_IDX, PART_CNT, PART_IDX, BITS, TILES, sparse_strides, sk_n, sk_d, sv_n, sv_d, qk_scale,
                BLOCK_N, BLOCK_KV, BLOCK_D, BLOCK_DV, D, DV, HAS_FULL, EVEN_N, TILE_LIST, TMA, DOT_PREC)
        else:
            pos_last = tl.minimum(row0 + BLOCK_M - 1, len_q_b * PACK - 1) // PACK
            acc, m_i, l_i = _dense_rows(
                acc, m_i, l_i, q, k_base, v_base, kv_at, row0 // PACK, pos_last, len_q_b, n_valid,
                pos + (n_valid - len_q_b), window_left, window_right, sk_n, sk_d, sv_n, sv_d, qk_scale,
                BLOCK_N, BLOCK_D, BLOCK_DV, D, DV, HAS_LEFT, HAS_RIGHT, TMA, DOT_PREC)
        # rows that saw no key: out 0, lse -inf (never 0/0)
        empty = l_i == 0.0
        out = acc / tl.where(empty, 1.0, l_i)[:, None]
        lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
        offs_dv = tl.arange(0, BLOCK_DV)
        o_ptrs = O + o_off + pos[:, None] * so_m + head[:, None].to(tl.int64) * so_h + offs_dv[None, :] * so_d
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_dv < DV)[None, :])
        tl.store(LSE + l_off + head.to(tl.int64) * sl_h + pos * sl_m, lse, mask=row_ok)


@triton.jit
def flash_fwd_kernel(Q, K, V, O, LSE, KV_LENS, CU_Q, CU_K,
                     FULL_CNT, FULL_IDX, PART_CNT, PART_IDX, BITS, TILES,
                     sq_b, sq_h, sq_m, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d,
                     so_b, so_h, so_m, so_d, sl_b, sl_h, sl_m,
                     sfc_b, sfc_h, sfc_m, sfi_b, sfi_h, sfi_m, sfi_s,
                     spc_b, spc_h, spc_m, spi_b, spi_h, spi_m, spi_s,
                     sbt_b, sbt_h, sbt_m, sbt_s, sbt_r, sbt_w, st_b, st_h, st_m,
                     len_q, len_k, qk_scale, window_left, window_right,
                     heads_prog, num_m, num_bh, num_tiles, lpt_heads,
                     GROUP: tl.constexpr, PACK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                     MODE: tl.constexpr, SCHEDULE: tl.constexpr, HAS_LEFT: tl.constexpr,
                     HAS_RIGHT: tl.constexpr, HAS_KV_LENS: tl.constexpr, HAS_FULL: tl.constexpr,
                     BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, EVEN_N: tl.constexpr,
                     TILE_LIST: tl.constexpr, TMA: tl.constexpr, DOT_PREC: tl.constexpr):
    """Forward of every tile assigned to this program; see the module docstring for the layouts."""
    # Inductor's launcher types a Python float argument as fp64 (eager Triton: fp32); keep the math fp32
    qk_scale = tl.cast(qk_scale, tl.float32)
    sparse_strides = (sfc_b, sfc_h, sfc_m, sfi_b, sfi_h, sfi_m, sfi_s, spc_b, spc_h, spc_m, spi_b, spi_h, spi_m,
                      spi_s, sbt_b, sbt_h, sbt_m, sbt_s, sbt_r, sbt_w, st_b, st_h, st_m)
    pid = tl.program_id(0)
    if SCHEDULE == 0:
        _tile(pid, Q, K, V, O, LSE, KV_LENS, CU_Q, CU_K, FULL_CNT, FULL_IDX, PART_CNT, PART_IDX, BITS, TILES,
              sq_b, sq_h, sq_m, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d, so_b, so_h, so_m, so_d,
              sl_b, sl_h, sl_m, sparse_strides, len_q, len_k, qk_scale, window_left, window_right, heads_prog,
              num_m, num_bh, lpt_heads,
              GROUP, PACK, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, D, DV, MODE, SCHEDULE, HAS_LEFT, HAS_RIGHT,
              HAS_KV_LENS, HAS_FULL, BLOCK_Q, BLOCK_KV, EVEN_N, TILE_LIST, TMA, DOT_PREC)
    else:
        # static striding: program p takes tiles p, p + P, ...; with the LPT order each program's first
        # tile is among the heaviest, so the tail of the launch holds the light ones
        for tile in range(pid, num_tiles, tl.num_programs(0)):
            _tile(tile, Q, K, V, O, LSE, KV_LENS, CU_Q, CU_K, FULL_CNT, FULL_IDX, PART_CNT, PART_IDX, BITS, TILES,
                  sq_b, sq_h, sq_m, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d, so_b, so_h, so_m, so_d,
                  sl_b, sl_h, sl_m, sparse_strides, len_q, len_k, qk_scale, window_left, window_right, heads_prog,
              num_m, num_bh, lpt_heads,
                  GROUP, PACK, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, D, DV, MODE, SCHEDULE, HAS_LEFT,
                  HAS_RIGHT, HAS_KV_LENS, HAS_FULL, BLOCK_Q, BLOCK_KV, EVEN_N, TILE_LIST, TMA, DOT_PREC)
