"""Triton flash-attention forward backend: dense, varlen and block-sparse, three tile schedules.

The kernel is in ``flash_kernel.py``; this module holds the backend protocol (supports, a short curated
config list per problem, pruning with reasons) and the launcher, which passes strides instead of copying
and allocates only ``out`` and ``lse``. Backward is delegated to ``flash_bwd.py``.
"""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path

import torch

from ...device import DeviceInfo, device_info, smem_per_block
from ... import layout
from ...layout import broadcast_strides
from ...problem import Problem, next_power_of_two
from ..base import AttnCall, Backend, Candidate, Config, Plan, Takes
from ..triton_common import TRITON, eager_launcher, graph_launcher, traceable, triton_available, warmup_launcher

# kernel files read (not imported) for the decision key: forward kernel and the backward it delegates to
KERNEL_SOURCES = [Path(__file__).with_name(n) for n in ("flash_kernel.py", "flash_bwd.py", "flash_bwd_kernels.py")]
_DTYPES = {"float16": 2, "bfloat16": 2, "float32": 4}
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256  # tl.dot needs K >= 16; beyond 256 the accumulator cannot stay in registers

# (BLOCK_M, BLOCK_N, num_warps, num_stages) per padded head dim, most promising first. Starting points
# from Triton's tutorial 06 autotune space (BLOCK_M 64/128, BLOCK_N 32-128, 4/8 warps, 2-4 stages) and
# FA3's sm_90 forward tiles (hopper/tile_size.h: 128 query rows x 128 keys for causal d = 128; Triton
# needs power-of-two tiles, so its 176-key tile is out), cut to four per head dim that compile for sm_90
# without spilling (checked by compiling each for sm_90 with triton 3.9 and ptxas 13.4 on a CPU machine;
# speed is unmeasured: the tuner measures them, this list only bounds the search).
_DENSE_TILES = {
    64: [(128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 4), (128, 32, 4, 4)],
    128: [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 8, 4)],
    256: [(64, 64, 8, 2), (128, 32, 8, 2), (64, 32, 4, 3), (64, 32, 8, 3)],
}
# fp32 tiles are twice the bytes: a smaller fallback keeps one runnable config for every head dim (at
# d = 256 every fp32 shape spills on sm_90, 16 x 32 least: 584 B). fp32 is the accuracy path, not a speed
# target: its tf32x3 dots hold Q twice and spill in persistent loops, so it runs one tile per program.
_FP32_EXTRA = {64: (64, 32, 4, 2), 128: (64, 32, 4, 2), 256: (16, 32, 4, 2)}
# Decode-shaped problems (<= 64 packed rows per sequence): one 64-row tile holds all G heads of a step.
_DECODE_TILES = [(64, 64, 4, 3), (64, 128, 4, 3), (64, 128, 8, 2)]
_PERSISTENT_SHAPES = 2  # tile shapes that also run persistent (and LPT where it applies)
_TILE_LIST_SHAPES = 2  # block-sparse tile shapes that also run from a list of non-empty tiles
# Beyond this a call walks the mask's blocks instead of allocating the list (same results): a per-head
# mask at 32k tokens with 64x32 tiles could otherwise ask for hundreds of MiB per call.
_TILE_LIST_MAX_BYTES = 64 << 20

# fp32 accumulator + score values per thread, BLOCK_M * (BLOCK_DV + BLOCK_N) / threads, above which ptxas
# spills. Calibrated by compiling for sm_90 (triton 3.9, ptxas 13.4): one-tile programs spill above 144
# (d=128 128x64 4 warps: 192 -> 408 B spilled; d=256 64x64 4 warps: 160 -> 372 B), persistent ones above
# 96 (the outer loop keeps more alive: 128 -> 28..500 B), block-sparse ones 16 earlier (bitmap words:
# persistent 64x64 4 warps at 96 spilled 152 B). fp32 counts the Q tile too (64x64 d=64 4 warps: 96 -> 0 B;
# 128x32: 160 -> 160 B).
_REG_LIMIT = {"tile": 144, "persistent": 96, "lpt": 96}
_SPARSE_REG_MARGIN = 16


def _tile_cfg(tile, schedule: str, pack: bool | None, tma: bool | None) -> Config:
    """A config; ``pack_gqa`` only exists for GQA problems and ``tma`` only on devices that have TMA."""
    bm, bn, w, s = tile
    extra = {k: v for k, v in (("pack_gqa", pack), ("tma", tma)) if v is not None}
    return Config.of(block_m=bm, block_n=bn, num_warps=w, num_stages=s, schedule=schedule, **extra)


def _has_tma(p: Problem, dev: DeviceInfo) -> bool:
    return p.device_type == "cuda" and dev.arch >= 90


def _has_band(p: Problem) -> bool:
    """Causal or windowed: query blocks do unequal work, which is what LPT orders by."""
    return p.causal or p.window_left >= 0 or p.window_right >= 0


def _padded_dims(p: Problem) -> tuple[int, int]:
    return max(16, next_power_of_two(p.head_dim)), max(16, next_power_of_two(p.head_dim_v))


def _smem_estimate(p: Problem, cfg: Config) -> int:
    """Bytes of shared memory: the Q tile plus ``num_stages`` K and V tiles in flight. Matches what Triton
    3.9 allocated for every listed fp16/bf16 config on sm_90; fp32 (tf32x3 dots) holds Q twice; the
    block-sparse loops (indices loaded in the loop, one pipeline stage) buffer max(2, num_stages - 2)
    K/V tiles and their bitmap words (Triton 3.9, sm_90: 81 KiB at 64x64 with 3 or 4 stages, 113 KiB with
    5). TMA configs add under 1 KiB of barriers."""
    bd, bdv = _padded_dims(p)
    bm, bn, stages = cfg["block_m"], cfg["block_n"], cfg["num_stages"]
    es = _DTYPES.get(p.dtype, 4)
    q_bytes = (2 if es == 4 else 1) * bm * bd * es
    if p.op == "block_sparse":
        return q_bytes + max(2, stages - 2) * (bn * (bd + bdv) * es + bm * bn // 8)
    return q_bytes + stages * bn * (bd + bdv) * es


def _acc_regs(p: Problem, block_m: int, block_n: int, num_warps: int) -> int:
    q_dims = _padded_dims(p)[0] if p.dtype == "float32" else 0
    return block_m * (_padded_dims(p)[1] + block_n + q_dims) // (32 * num_warps)


def _reg_limit(p: Problem, schedule: str) -> int:
    return _REG_LIMIT[schedule] - (_SPARSE_REG_MARGIN if p.op == "block_sparse" else 0)


def _fits_registers(p: Problem, tile, schedule: str) -> bool:
    return _acc_regs(p, *tile[:3]) <= _reg_limit(p, schedule)


class TritonFlashBackend(Backend):
    name = "triton"
    # kernel files are read, not imported, so computing a decision key never needs triton
    sources = (Path(__file__), *KERNEL_SOURCES)
    knobs = {"block_m": int, "block_n": int, "num_warps": int, "num_stages": int,
             "schedule": ("tile", "persistent", "lpt"), "pack_gqa": bool, "tma": bool, "tile_list": bool,
             "bwd_block_m": int, "bwd_block_n": int, "bwd_warps": int, "bwd_stages": int,
             "bwd_dq": ("separate", "atomic"), "bwd_kv_split": int, "deterministic": bool}
    takes = Takes(backward=True)
    library = TRITON

    def supports(self, p: Problem, dev: DeviceInfo, direction: str = "forward") -> str | None:
        reason = self._forward_unsupported(p, dev)
        if reason is None and direction == "backward":
            from .flash_bwd import unsupported_reason

            reason = unsupported_reason(p)
        return reason

    def _forward_unsupported(self, p: Problem, dev: DeviceInfo) -> str | None:
        if not triton_available():
            return "triton is not installed"
        if p.device_type != "cuda" and not (p.device_type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"):
            return "needs a CUDA device (CPU only under TRITON_INTERPRET=1)"
        if p.dtype not in _DTYPES:
            return f"{p.dtype} not supported (float16, bfloat16, float32)"
        if p.device_type == "cpu" and p.dtype == "bfloat16":
            # tl.dot on bfloat16 blocks returns garbage in the interpreter (triton 3.9: errors ~1e10)
            return "bfloat16 dots are wrong in Triton's interpreter; use float16/float32 on the CPU"
        if p.device_type == "cuda" and dev.arch < 80:
            return f"needs sm_80 or newer, got sm_{dev.arch}"
        for what, d in (("head_dim", p.head_dim), ("head_dim_v", p.head_dim_v)):
            if d < MIN_HEAD_DIM:
                return f"{what} {d} < {MIN_HEAD_DIM}"
            if d > MAX_HEAD_DIM:
                return f"{what} {d} > {MAX_HEAD_DIM}"
        if p.op == "block_sparse":
            if p.block_kv not in (32, 64, 128):
                return f"block_kv {p.block_kv} not in (32, 64, 128): a mask block is a whole number of KV tiles"
            if not _sparse_block_ms(p.block_q):
                return f"block_q {p.block_q} is not a multiple of 16"
        return None

    def configs(self, p: Problem, dev: DeviceInfo, direction: str = "forward") -> list[Candidate]:
        if direction == "backward":
            from .flash_bwd import backward_candidates

            return [Candidate(self.name, c, reason) for c, reason in backward_candidates(p, dev)]
        return [Candidate(self.name, c, self._pruned(p, dev, c)) for c in self._forward_configs(p, dev)]

    def _forward_configs(self, p: Problem, dev: DeviceInfo) -> list[Config]:
        pack = None if p.op == "block_sparse" or p.gqa_ratio == 1 else True
        d = max(64, next_power_of_two(max(p.head_dim, p.head_dim_v)))
        if p.op == "block_sparse":
            # two row-block sizes: 32-row tiles lost to 64-row ones at every width measured (H100, window
            # 256: 32x128 0.61-0.75 ms, 32x32 0.82 against 64x32 0.34)
            tiles = [(bm, p.block_kv, w, s) for bm in _sparse_block_ms(p.block_q)[:2] for w, s in ((8, 2), (4, 3))]
            if p.block_kv == 128:  # two 64-key tiles per mask block: the dense window's best tile
                tiles += [(bm, 64, 4, 3) for bm in _sparse_block_ms(p.block_q)[:2] if bm <= 64]
            if p.block_q % 64 == 0:
                # 64x32 tiles: 48 KiB of shared memory and 124 registers on sm_90, four programs per SM;
                # the fastest on the H100's block-sparse window (0.337 ms vs 0.374 at 64x64, 0.420 at
                # 128x128), where occupancy hides the latency of a few tiles per program
                tiles = list(dict.fromkeys([*tiles, (64, 32, 4, 3)]))  # a 64x32 mask lists it already
        elif p.len_q * p.gqa_ratio <= 64:
            tiles = list(_DECODE_TILES)
        else:
            tiles = list(_DENSE_TILES[d])
        if p.dtype == "float32" and p.op != "block_sparse":
            tiles.append(_FP32_EXTRA[d])
        # never list a shape that spills: keep the lightest one if none fits (a large d on small blocks)
        fitting = [t for t in tiles if _fits_registers(p, t, "tile")]
        tiles = fitting or [min(tiles, key=lambda t: _acc_regs(p, *t[:3]))]
        schedules = ["persistent", "lpt"] if _has_band(p) and p.op != "block_sparse" else ["persistent"]
        looping = [t for t in tiles if _fits_registers(p, t, "persistent")][:_PERSISTENT_SHAPES]
        if p.dtype == "float32":
            looping = []
        tma = True if _has_tma(p, dev) else None
        out = [_tile_cfg(t, "tile", pack, tma) for t in tiles]
        out += [_tile_cfg(t, s, pack, tma) for s in schedules for t in looping]
        if tma:
            # TMA loads free the registers that pointer loads hold (d=128 128x64: 181 vs 225 on sm_90);
            # the pointer-load twins of the leading shapes stay in the race
            twins = [(tiles[0], "tile")] + [(t, "persistent") for t in looping[:1]]
            out += [_tile_cfg(t, s, pack, False) for t, s in twins]
        if pack:
            # packing trades a wider row block for one K/V read per group; unpacked is the usual layout
            out.append(_tile_cfg(tiles[0], "tile", False, tma))
        if p.op == "block_sparse":
            # the smallest tiles again, walking a per-call list of the non-empty ones (sparse_tile_list_kernel):
            # a 256 window's 128-blocks hold tiles outside the band (H100: 64x32 0.306 ms vs 0.339 by blocks)
            small = [t for t in tiles if t[0] * t[1] < p.block_q * p.block_kv][-_TILE_LIST_SHAPES:]
            out += [Config.of(**dict(_tile_cfg(t, "tile", None, tma).params), tile_list=True) for t in small]
        return out

    def heuristic(self, p: Problem, dev: DeviceInfo) -> Config | None:
        """For block masks on CUDA, the first config this backend lists. The candidate ahead of it in prior order,
        flex through our plan (its mask_mod reads the mask's bitmap), ran 0.25x and 0.65x the user's own
        compiled flex_attention at the block-sparse suite's two masks, this config 1.04x and 1.18x (H200,
        2026-11-29). Elsewhere the default candidate stays the rule."""
        if p.op != "block_sparse" or p.device_type != "cuda":
            return None
        return next((c.config for c in self.configs(p, dev) if c.pruned is None), None)

    def _pruned(self, p: Problem, dev: DeviceInfo, cfg: Config) -> str | None:
        bm, bn, warps = cfg["block_m"], cfg["block_n"], cfg["num_warps"]
        if cfg["schedule"] not in ("tile", "persistent", "lpt"):
            return f"unknown schedule {cfg['schedule']!r}"
        if cfg["schedule"] == "lpt" and (not _has_band(p) or p.op == "block_sparse"):
            return "lpt only helps causal/window problems (every query block does equal work otherwise)"
        if p.op == "block_sparse":
            if p.block_kv % bn or bn < 32:
                return (f"block_n {bn} does not divide the mask's block_kv {p.block_kv} into tiles of >= 32 keys "
                        "(one bitmap word)")
            if p.block_q % bm:
                return f"block_m {bm} does not divide the mask's block_q {p.block_q}"
        if p.device_type != "cuda":
            return None  # the interpreter has no shared-memory or register limits (and emulates TMA)
        if cfg.get("tma") and dev.arch < 90:
            return f"TMA loads need sm_90 or newer, got sm_{dev.arch}"
        smem, limit = _smem_estimate(p, cfg), smem_per_block(dev.arch)
        if smem > limit:
            return f"needs ~{smem // 1024} KiB shared memory, sm_{dev.arch} has {limit // 1024} KiB"
        regs, limit = _acc_regs(p, bm, bn, warps), _reg_limit(p, cfg["schedule"])
        if regs > limit:
            return (f"accumulator + scores hold ~{regs} fp32 values per thread; above {limit} "
                    f"{cfg['schedule']} programs spill registers")
        return None

    def plan(self, p: Problem, dev: DeviceInfo, cfg: Config, direction: str) -> Plan:
        if direction == "backward":
            from .flash_bwd import backward

            return Plan(functools.partial(backward, cfg, eager_launcher),
                        traced=functools.partial(backward, cfg, graph_launcher) if traceable() else None,
                        compile=functools.partial(backward, cfg, warmup_launcher))
        fwd = ForwardPlan(p, cfg)
        # host-side TMA descriptors cannot be traced (torch 2.11's wrap_triton puts them in a side table
        # of constants), so TMA configs run from compiled code through the thin op instead
        can_trace = traceable() and not fwd.meta["TMA"]
        return Plan(fwd.launch, traced=fwd.traced if can_trace else None, warm=fwd.meta["SCHEDULE"] != 0,
                    compile=fwd.compile)


def _sparse_block_ms(block_q: int) -> list[int]:
    """Row-block sizes that tile a mask q block exactly, largest first.

    >>> _sparse_block_ms(128), _sparse_block_ms(48), _sparse_block_ms(40)
    ([128, 64, 32, 16], [16], [])
    """
    return [bm for bm in (128, 64, 32, 16) if block_q % bm == 0]


def new_outputs(call: AttnCall) -> tuple[torch.Tensor, torch.Tensor]:
    """The only allocations of a forward: ``out`` in q's stride order (the ops' layout contract, so the
    dispatcher never copies it; the kernel writes any strides) and a contiguous float32 ``lse``. Tests
    wrap this to poison both."""
    return layout.new_outputs(call.op, call.q, call.v)


def _bhld_strides(x: torch.Tensor, varlen: bool) -> tuple[int, ...]:
    """(batch, head, row, dim) strides; varlen rows are packed tokens and the batch offset comes from
    cu_seqlens, so its batch stride is 0."""
    return (0, x.stride(1), x.stride(0), x.stride(2)) if varlen else tuple(x.stride())


def _kv_descriptors(call: AttnCall, cfg: Config):
    """Host-side TMA descriptors of K and V as (batch, head, row, dim), or None where TMA cannot read the
    layout (head dim not contiguous, a stride or the base not 16-byte aligned): those calls take the
    pointer loads, same results. Varlen's packed (tokens, head, dim) is batch 0 of a one-batch view."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    bd, bdv = _padded_dims(call.problem)
    descs = []
    for x, block_d in ((call.k, bd), (call.v, bdv)):
        if call.op == "varlen":
            shape = [1, x.shape[1], x.shape[0], x.shape[2]]
            strides = [x.shape[0] * x.stride(0), x.stride(1), x.stride(0), x.stride(2)]
        else:
            shape, strides = list(x.shape), list(x.stride())
        if strides[-1] != 1 or x.data_ptr() % 16 or any(st * x.element_size() % 16 for st in strides[:-1]):
            return None
        descs.append(TensorDescriptor(x, shape, strides, [1, 1, cfg["block_n"], block_d]))
    return tuple(descs)


def _mask_tensors(sp, batch: int, heads: int) -> tuple[list, list[int]]:
    """The mask's lists and bitmaps and their strides, at the mask's own batch/head dims (batch and heads
    None) or broadcast (stride 0) over the problem's where the mask is shared."""
    cnt, idx, bits = sp.kv_num_blocks, sp.kv_indices, sp.partial_bits
    if sp.full_kv_num_blocks is not None:
        fcnt, fidx = sp.full_kv_num_blocks, sp.full_kv_indices
    else:
        fcnt, fidx = cnt, idx  # never read: HAS_FULL is False
    tensors = [fcnt, fidx, cnt, idx, bits]
    if batch is None:
        return tensors, [st for t in tensors for st in t.stride()]
    return tensors, [st for t in tensors for st in broadcast_strides(t, batch, heads)]


def _sparse_args(call: AttnCall, list_shape: torch.Size | None, meta: dict, launcher) -> tuple[list, list[int]]:
    """Mask tensors and strides for the forward kernel, followed by the tile list of ``list_shape`` or,
    without one, a placeholder that is never read."""
    p, sp = call.problem, call.sparse
    tensors, strides = _mask_tensors(sp, p.batch, p.heads_q)
    if list_shape is None:
        return [*tensors, tensors[2]], [*strides, 0, 0, 0]
    tiles = _tile_list(sp, list_shape, meta, launcher)
    return [*tensors, tiles], [*strides, *broadcast_strides(tiles, p.batch, p.heads_q)[:3]]


def _tile_list(sp, shape: torch.Size, meta: dict, launcher) -> torch.Tensor:
    """int32 [B', H', row tiles, 1 + tiles]: per row tile of BLOCK_M queries, the count and the list of the
    non-empty KV tiles to visit (layout in ``sparse_tile_list_kernel``). Built per call by one small
    kernel, so the tuner's timing of a ``tile_list`` config includes it."""
    from .flash_kernel import sparse_tile_list_kernel

    tiles = torch.empty(shape, dtype=torch.int32, device=sp.kv_num_blocks.device)
    b, h, num_m = tiles.shape[:3]
    mask_tensors, mask_strides = _mask_tensors(sp, None, None)
    launcher(sparse_tile_list_kernel)[(b * h * num_m,)](
        tiles, *mask_tensors, *tiles.stride()[:3], *mask_strides, h, num_m,
        BLOCK_M=meta["BLOCK_M"], BLOCK_N=meta["BLOCK_N"], BLOCK_Q=meta["BLOCK_Q"], BLOCK_KV=meta["BLOCK_KV"],
        HAS_FULL=meta["HAS_FULL"], num_warps=1,
    )
    return tiles


def _tile_list_shape(sp, len_q: int, meta: dict) -> torch.Size:
    """Shape of :func:`_tile_list`'s int32 list: room for every listed block's tiles per row tile."""
    listed = sp.kv_indices.shape[-1] + (sp.full_kv_indices.shape[-1] if meta["HAS_FULL"] else 0)
    sub = meta["BLOCK_KV"] // meta["BLOCK_N"]
    return torch.Size((*sp.kv_num_blocks.shape[:2], math.ceil(len_q / meta["BLOCK_M"]), 1 + listed * sub))


def kernel_constexprs(p: Problem, cfg: Config, has_full_blocks: bool = True) -> dict:
    """Compile-time parameters of the kernel for ``p`` under ``cfg`` (one compiled variant each)."""
    from .flash_kernel import MODE_DENSE, MODE_SPARSE, MODE_VARLEN, SCHEDULES

    sparse = p.op == "block_sparse"
    right = 0 if p.causal else p.window_right
    bm, bn = cfg["block_m"], cfg["block_n"]
    return dict(
        GROUP=p.gqa_ratio, PACK=p.gqa_ratio if cfg.get("pack_gqa", True) and not sparse else 1,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=_padded_dims(p)[0], BLOCK_DV=_padded_dims(p)[1],
        D=p.head_dim, DV=p.head_dim_v,
        MODE=MODE_SPARSE if sparse else MODE_VARLEN if p.op == "varlen" else MODE_DENSE,
        SCHEDULE=SCHEDULES[cfg["schedule"]],
        HAS_LEFT=p.window_left >= 0 and not sparse, HAS_RIGHT=right >= 0 and not sparse,
        HAS_KV_LENS=p.has_kv_seqlens and p.op == "attention", HAS_FULL=sparse and has_full_blocks,
        # dense/varlen ignore these three; constant values there avoid needless recompiles
        BLOCK_Q=p.block_q if sparse else bm, BLOCK_KV=p.block_kv if sparse else bn,
        EVEN_N=not sparse or p.len_k % p.block_kv == 0, TILE_LIST=sparse and bool(cfg.get("tile_list", False)),
        TMA=bool(cfg.get("tma", False)), DOT_PREC="tf32x3" if p.dtype == "float32" else "tf32",
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


class ForwardPlan:
    """The forward of one (problem, config): constexprs, grid sizes and schedule are fixed here; a launch
    only reads strides and allocates ``out``/``lse``."""

    def __init__(self, p: Problem, cfg: Config):
        bm, bn = cfg["block_m"], cfg["block_n"]
        if p.op == "block_sparse" and (p.block_kv % bn or bn < 32 or p.block_q % bm):
            raise ValueError(f"config {cfg} does not fit block_q={p.block_q}, block_kv={p.block_kv} "
                             "(block_n must divide block_kv and be >= 32, block_m divide block_q)")
        self.p, self.cfg = p, cfg
        self.meta = kernel_constexprs(p, cfg)
        self.heads_prog = p.heads_q // self.meta["PACK"]
        self.num_m = math.ceil(p.len_q * self.meta["PACK"] / cfg["block_m"])
        self.num_bh = p.batch * self.heads_prog
        self.num_tiles = self.num_m * self.num_bh

    def launch(self, call: AttnCall):
        return self._run(call, eager_launcher)

    def traced(self, call: AttnCall):
        return self._run(call, graph_launcher)

    def compile(self, call: AttnCall):
        return self._run(call, warmup_launcher)

    def _run(self, call: AttnCall, launcher):
        from .flash_kernel import LOG2E, flash_fwd_kernel

        p, cfg, q, k, v = self.p, self.cfg, call.q, call.k, call.v
        sparse, varlen = p.op == "block_sparse", p.op == "varlen"
        meta = dict(self.meta, HAS_FULL=sparse and call.sparse.full_kv_num_blocks is not None)
        kv = _kv_descriptors(call, cfg) if meta["TMA"] else None
        meta["TMA"] = kv is not None
        list_shape = _tile_list_shape(call.sparse, p.len_q, meta) if meta["TILE_LIST"] else None
        if list_shape is not None and list_shape.numel() * 4 > _TILE_LIST_MAX_BYTES:
            meta["TILE_LIST"], list_shape = False, None  # walk the blocks instead: same results, no workspace
        k_arg, v_arg = kv or (k, v)
        out, lse = new_outputs(call)
        if self.num_tiles == 0:
            return out.zero_(), lse.fill_(float("-inf"))
        mask_tensors, mask_strides = _sparse_args(call, list_shape, meta, launcher) if sparse else ([q] * 6, [0] * 23)
        key = (q.dtype, *meta.values())
        grid = self.num_tiles if meta["SCHEDULE"] == 0 else _persistent_grid(q.device, key, self.num_tiles)
        lpt_heads = _lpt_group(_device_limits(q.device)[2], p.len_k * (p.head_dim + p.head_dim_v) * k.element_size(),
                               p.gqa_ratio // meta["PACK"])
        lse_strides = (0, lse.stride(0), lse.stride(1)) if varlen else tuple(lse.stride())
        compiled = launcher(flash_fwd_kernel)[(grid,)](
            q, k_arg, v_arg, out, lse,
            q if call.kv_seqlens is None else call.kv_seqlens,  # unused pointers get any tensor
            call.cu_seqlens_q if varlen else q, call.cu_seqlens_k if varlen else q, *mask_tensors,
            *_bhld_strides(q, varlen), *_bhld_strides(k, varlen), *_bhld_strides(v, varlen),
            *_bhld_strides(out, varlen), *lse_strides, *mask_strides,
            p.len_q, p.len_k, call.scale * LOG2E, call.window_left, 0 if call.causal else call.window_right,
            self.heads_prog, self.num_m, self.num_bh, self.num_tiles, lpt_heads, **meta,
        )
        # a warmup's kernel is compiled but not loaded: its register count is known from the first launch
        if meta["SCHEDULE"] != 0 and compiled is not None and launcher is eager_launcher:
            _record_occupancy(compiled, q.device, key, cfg["num_warps"])
        return out, lse


def _lpt_group(l2_bytes: int, kv_bytes_per_head: int, heads_per_kv: int) -> int:
    """How many heads LPT orders together: as many as have their K and V in L2, rounded down to a power
    of two. flash-attention's SingleTileLPTScheduler (flash_attn/cute/tile_scheduler.py) budgets the whole
    50 MB L2 of an H100 for K and V and notes that power-of-two groups ran faster. Unpacked GQA heads of
    one group share K and V, so they count once.

    >>> _lpt_group(50 << 20, 16384 * 256 * 2, 1), _lpt_group(50 << 20, 16384 * 256 * 2, 4), _lpt_group(1, 8, 1)
    (4, 16, 1)
    """
    fit = max(1, l2_bytes // max(1, kv_bytes_per_head))
    return (1 << (fit.bit_length() - 1)) * heads_per_kv


# Programs per SM measured from the compiled kernel (registers, shared memory), keyed by specialization.
_PER_SM: dict[tuple, int] = {}
_REGS_PER_SM, _MAX_WARPS_PER_SM = 65536, 64  # sm_80 .. sm_100


@functools.cache
def _device_limits(device: torch.device) -> tuple[int, int, int]:
    """(SM count, shared memory per SM, L2 bytes) of the device that runs the kernel (not a simulated
    description: a persistent grid must match the real SM count)."""
    if device.type != "cuda":
        return device_info(device).sm_count, 228 * 1024, 50 * 1024 * 1024
    props = torch.cuda.get_device_properties(device)
    return (props.multi_processor_count, getattr(props, "shared_memory_per_multiprocessor", 228 * 1024),
            getattr(props, "L2_cache_size", 50 * 1024 * 1024))


def _persistent_grid(device: torch.device, key: tuple, num_tiles: int) -> int:
    """SMs x resident programs per SM, capped at the tile count. Until the kernel has been compiled once
    the count is 1 per SM, which is always correct, only possibly under-filled."""
    return min(num_tiles, _device_limits(device)[0] * _PER_SM.get(key, 1))


def _record_occupancy(compiled, device: torch.device, key: tuple, num_warps: int) -> None:
    """Remember how many programs of this specialization fit on one SM (Triton's tutorial 02 computes
    occupancy the same way, from ``n_regs`` and ``metadata.shared`` of the compiled kernel)."""
    if key in _PER_SM or device.type != "cuda":
        return
    try:
        regs, shared = compiled.n_regs, compiled.metadata.shared
    except AttributeError:  # the interpreter returns no compiled kernel; other Triton versions may differ
        return
    fit = [_MAX_WARPS_PER_SM // num_warps]
    if regs:
        fit.append(_REGS_PER_SM // (regs * 32 * num_warps))
    if shared:
        fit.append(_device_limits(device)[1] // (shared + 1024))  # the driver reserves 1 KiB per block
    _PER_SM[key] = max(1, min(fit))


BACKEND = TritonFlashBackend()
