"""What flash-attn-4 takes and picks on each architecture, restated from its source (4.0.0b36,
``flash_attn/cute/interface.py``) so that candidates are enumerated and pruned without importing it; where FA4 is
installed, tests/test_fa4.py checks the restated tile rule against its own functions."""

from __future__ import annotations

from ...problem import Problem
from ..base import Config

# sm_90 alternatives to FA4's default, from shared/anchors/h200-fa4-knobs-2026-11-22.json (H200, bf16,
# D128 L1k-16k and D64 L4k). The default was fastest within noise on all five shapes; these came within
# 1-11% of it (192x128 without intra-WG overlap: 0.99x at L16k). Left out: (128,64) at 0.80-0.95x,
# (64,128) at 0.67-0.76x, and 192x128 with the default MMA settings at 0.54-0.58x (D128).
SM90_ALTERNATIVES = (
    Config.of(mma_pv_is_rs=False),
    Config.of(intra_wg_overlap=False),
    Config.of(tile_mn="128x176"),
    Config.of(tile_mn="192x128", mma_pv_is_rs=False),
    Config.of(tile_mn="192x128", intra_wg_overlap=False),
    Config.of(tile_mn="128x176", mma_pv_is_rs=False),
)
# Measured launch failure (same file): compiled, then CUDA_LAUNCH_INVALID_CONFIG at D128 on all shapes.
LAUNCH_FAILURE = {("128x176", False, 128): "tile_mn=128x176 with mma_pv_is_rs=False failed to launch at "
                                          "head_dim 128 (CUDA_LAUNCH_INVALID_CONFIG, H200, 2026-11-22)"}


def _is_local(p: Problem) -> bool:
    """FA4's "local" (interface._resolve_causal_local_window): a left window, or a right one without causal."""
    return p.window_left >= 0 or (p.window_right >= 0 and not p.causal)


def parse_tile(text: str) -> tuple[int, int]:
    m, n = text.split("x")
    return int(m), int(n)


def sm90_default_tile(head_dim: int, head_dim_v: int, causal: bool, local: bool,
                      block_q: int | None = None, block_kv: int | None = None) -> tuple[int, int]:
    """The forward tile FA4 picks on sm_90 when ``tile_mn`` is not given.

    Restated from b36's ``_tile_size_fwd_sm90`` and ``_fit_sm90_fwd_tile_to_block_sparsity`` so that
    pruning works without importing FA4; tests/test_fa4_gpu.py checks it against FA4's own functions.

    >>> sm90_default_tile(128, 128, True, False), sm90_default_tile(64, 64, False, False, 128, 128)
    ((128, 128), (128, 128))
    """
    if head_dim <= 96:
        tall = block_q is None or block_q % 192 == 0  # 192-row tiles only when they nest in the q block
        if not tall:
            tile = (128, 128)
        elif head_dim <= 64 or causal or local:
            tile = (192, 128)
        else:
            tile = (192, 144)
    elif head_dim <= 128:
        tile = (128, 128)
    elif head_dim <= 192:
        tile = (128, 96 if local else 128 if head_dim_v <= 128 else 112)
    else:
        tile = (128, 64 if local else 80)
    if block_q is None:
        return tile
    m, n = tile
    if block_q % m != 0 and block_q % 64 == 0:
        m = 64
    if block_kv is not None and block_kv < n and block_kv % 16 == 0:
        n = block_kv
    return m, n


def split_candidates(p: Problem, sm_count: int) -> list[int]:
    """``num_splits`` values worth measuring on sm_100: 1, plus FA4's own estimate and half of it when
    the grid of (batch, kv head, m-block) tiles leaves SMs idle.

    The estimate follows b36's ``num_splits_heuristic``: SMs per tile, capped by the kv blocks and 128,
    none when there are 4 kv blocks or fewer. Tiles are 128 x 128; FA4 packs GQA heads into the m
    dimension and runs two q tiles per CTA once the packed rows exceed 128.

    >>> import dataclasses
    >>> dec = Problem("attention", "bfloat16", "cuda", 1, 32, 8, 1, 8192, 128, 128)
    >>> split_candidates(dec, 148), split_candidates(dataclasses.replace(dec, len_q=1024, len_k=1024), 148)
    ([1, 9, 18], [1])
    """
    pack = p.gqa_ratio > 1
    rows = p.len_q * (p.gqa_ratio if pack else 1)
    q_stage = 2 if rows > 128 else 1
    tiles = p.batch * p.heads_kv * (1 if pack else p.gqa_ratio) * -(-rows // (128 * q_stage))
    n_blocks = -(-p.len_k // 128)
    if n_blocks <= 4 or tiles >= sm_count:
        return [1]
    best = min(sm_count // tiles, n_blocks, 128)
    return sorted({1, best, max(2, best // 2)}) if best >= 2 else [1]


def fa4_clc_off_reason(p: Problem) -> str | None:
    """Why FA4 would run CLC off whatever is requested (b36 interface.py: "CLC regressed for varlen MHA
    and dense noncausal"), or None when a CLC request takes effect. FA4 runs block-sparse masks with causal
    off. (It counts ``seqused_k``, our kv_seqlens, as varlen too, but it is pruned for those.)"""
    if p.op == "block_sparse":
        return "flash-attn-4 turns CLC off for block-sparse masks (it runs them as dense non-causal)"
    varlen = p.op == "varlen"
    if varlen and p.gqa_ratio == 1:
        return "flash-attn-4 turns CLC off for varlen MHA"
    if not varlen and not p.causal and not _is_local(p):
        return "flash-attn-4 turns CLC off for dense non-causal problems"
    return None


def head_dim_reason(p: Problem, arch: int) -> str | None:
    d, dv = p.head_dim, p.head_dim_v
    if d % 8 or dv % 8:
        return f"flash-attn-4 needs head dims that are multiples of 8, got ({d}, {dv})"
    if family(arch) == "sm90" and not (8 <= d <= 256 and 8 <= dv <= 256):
        return f"flash-attn-4 on sm_90 takes head dims 8..256, got ({d}, {dv})"
    if family(arch) == "sm100" and not (max(d, dv) <= 128 or (d, dv) in ((192, 128), (256, 256))):
        return f"flash-attn-4 on sm_100 takes head dims up to 128, (192, 128) or (256, 256), got ({d}, {dv})"
    return None


def sm90_sparse_reason(p: Problem, tile: tuple[int, int]) -> str | None:
    """Block sizes FA4 rejects on sm_90 for a tile (block_sparsity.normalize_block_sparse_config)."""
    m, n = tile
    if p.block_kv != n:
        return f"on sm_90 flash-attn-4 needs the kv block size ({p.block_kv}) to equal tile_n ({n})"
    if p.block_q % m:
        return f"flash-attn-4 needs the q block size ({p.block_q}) to be a multiple of tile_m ({m})"
    return None


def sm100_sparse_reason(p: Problem) -> str | None:
    """sm_100 tiles are 128 x 128 and a kv block may span several; q blocks must cover whole CTAs, which
    hold two q tiles (q_stage 2) once the rows exceed one tile, except at head_dim_v 256. Rows are
    counted without GQA packing, which FA4 turns off for per-head masks; with a mask shared by all heads
    and a short Lq FA4 may still want 256 (then the tuner drops the candidate)."""
    m_eff = 256 if p.len_q > 128 and p.head_dim_v != 256 else 128
    if p.block_kv % 128:
        return f"on sm_100 flash-attn-4 needs the kv block size ({p.block_kv}) to be a multiple of 128"
    if p.block_q % m_eff:
        return f"on sm_100 flash-attn-4 needs the q block size ({p.block_q}) to be a multiple of {m_eff}"
    return None


def family(arch: int) -> str | None:
    """FA4's kernel family for a compute capability (interface.py dispatches on ``arch // 10`` the same
    way): "sm90", "sm100" (sm_100 and sm_110), or None where this backend does not run FA4.

    >>> family(90), family(100), family(110), family(80)
    ('sm90', 'sm100', 'sm100', None)
    """
    return {9: "sm90", 10: "sm100", 11: "sm100"}.get(arch // 10)
