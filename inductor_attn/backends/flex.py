"""torch flex_attention, compiled, as a candidate for block-sparse masks and dense causal/window masks.

The mask reaches flex as a ``BlockMask`` rebuilt from our tensors with ``BlockMask.from_kv_blocks``:
partial blocks -> ``kv_num_blocks``/``kv_indices``, full blocks -> ``full_kv_*``, and a ``mask_mod`` that
looks the answer up in our partial-block bitmaps (block_bitmap.bitmap_lookup) instead of calling the
user's function. Dense causal/window problems get a BlockMask computed from the window geometry.

Configs: ``kernel_options["BACKEND"]`` "TRITON" (flex's own tile choice, plus two fixed tiles) or "FLASH"
(flash-attn-4 through flex's CuTe DSL template; torch never picks it on its own, and the anchors measured
it well ahead of Triton on sliding windows: 509 vs 361 TFLOP/s, B2 H32 L16k D128 window 1024, H200).
Forward only: flex's backward would recompute the forward under autograd.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import math

import torch

from .._compat import flex_default_fwd_tiles, flex_flash_lse_scaled_by_ln2
from ..device import DeviceInfo
from ..layout import conform
from ..problem import Problem
from .base import AttnCall, Backend, Candidate, Config, Plan
from .block_bitmap import bitmap_lookup, slot_table
from .masks import window_visible

# Dense masks are cut into blocks of this size (flex's default sparse block).
DENSE_BLOCK = 128
# Two fixed Triton tiles next to flex's own choice: the big tile flex's max-autotune list starts from,
# and a small one for small sparse blocks and large head dims.
TRITON_TILES = (
    Config.of(backend="TRITON", block_m=128, block_n=64, num_warps=4, num_stages=3),
    Config.of(backend="TRITON", block_m=64, block_n=64, num_warps=4, num_stages=2),
)
# flex FLASH is pruned for every block mask (measured on an H100 with torch 2.11, 2026-11-22): it did not
# lower our partial-block bitmap lookup in any form tried (a probe script, `git show
# 9bf7835^:benchmarks/flex_flash_probe.py`: no `minimum`, a DSL error on `& 1`, "Expected TensorSSA" for a
# constant index, a layout error for a 2-D index into a captured tensor), and on a mask without partial
# blocks (flex's no-op mask_mod) it ran but its output was off by a relative error of 0.72
# (tests/test_flex.py, 064fe16/b862701). It stays a candidate for sliding windows, where it matched. FA4
# runs block masks directly (the fa4 backend).
_FLASH_BLOCK_MASK_REASON = ("flex FLASH (torch 2.11, H100) failed on our block masks: no lowering of the bitmap "
                            "lookup, wrong output without partial blocks; the fa4 backend runs block masks directly")
# flex_attention compiles once per (config, shape); dynamo's default limit of 8 entries per function
# would otherwise make later configs silently fall back to eager flex while tuning.
RECOMPILE_LIMIT = 256


def flash_attn_available() -> bool:
    """What flex's FLASH backend checks (torch/_inductor/kernel/flex/flex_flash_attention.py)."""
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except (ImportError, ValueError):
        return False


def _dense_mask_reason(p: Problem) -> str | None:
    if p.op == "varlen":
        return "flex backend does not take packed varlen problems"
    if p.op == "attention":
        if p.has_kv_seqlens:
            return "flex backend does not take kv_seqlens"
        if p.window_left < 0 and p.window_right < 0:
            # each flex config is a ~10 s Inductor compile on an H200 (measured while tuning the demo)
            return "unmasked and plain causal attention are covered by sdpa, fa4 and triton at less tuning cost"
    return None


class FlexBackend(Backend):
    """Not traced into compiled graphs: flex_attention is compiled here as its own graph, with our mask."""

    name = "flex"
    knobs = {"backend": ("TRITON", "FLASH"), "block_m": int, "block_n": int, "num_warps": int, "num_stages": int}

    def supports(self, p: Problem, dev: DeviceInfo, direction: str = "forward") -> str | None:
        if p.device_type != "cuda":
            return "needs a CUDA device"
        if p.dtype not in ("float16", "bfloat16", "float32"):
            return f"flex takes float16, bfloat16 and float32, got {p.dtype}"
        return _dense_mask_reason(p)

    def configs(self, p: Problem, dev: DeviceInfo, direction: str = "forward") -> list[Candidate]:
        if p.op == "attention":  # sliding windows: flex's own tile and FA4 through flex only
            cfgs = [Config.of(backend="TRITON"), Config.of(backend="FLASH")]
        else:
            cfgs = [Config.of(backend="TRITON"), *TRITON_TILES, Config.of(backend="FLASH")]
        return [Candidate(self.name, c, _pruned(p, dev, c)) for c in cfgs]

    def plan(self, p: Problem, dev: DeviceInfo, cfg: Config, direction: str) -> Plan:
        return Plan(functools.partial(_launch, kernel_options(cfg), cfg["backend"] == "FLASH"))


def _pruned(p: Problem, dev: DeviceInfo, cfg: Config) -> str | None:
    if cfg["backend"] == "FLASH":
        if not flash_attn_available():
            return "flex FLASH needs flash-attn-4, not installed"
        if p.dtype == "float32":
            return "flex FLASH takes float16 and bfloat16 only"
        if p.op == "block_sparse":
            return _FLASH_BLOCK_MASK_REASON
        return None
    if min(p.head_dim, p.head_dim_v) < 16:
        return f"flex Triton needs head dims >= 16, got ({p.head_dim}, {p.head_dim_v})"
    block_q, block_kv = (p.block_q, p.block_kv) if p.op == "block_sparse" else (DENSE_BLOCK, DENSE_BLOCK)
    bm, bn = cfg.get("block_m"), cfg.get("block_n")
    if bm and block_q % bm:
        return f"flex needs the q block size ({block_q}) to be a multiple of BLOCK_M ({bm})"
    if bn and block_kv % bn:
        return f"flex needs the kv block size ({block_kv}) to be a multiple of BLOCK_N ({bn})"
    if bm is None and not dev.simulated:
        tiles = flex_default_fwd_tiles(p.head_dim, getattr(torch, p.dtype))
        if not any(block_q % m == 0 and block_kv % n == 0 for m, n in tiles):
            return (f"flex's own tiles here ({', '.join(f'{m}x{n}' for m, n in tiles)}) do not divide the "
                    f"{block_q}x{block_kv} mask blocks")
    return None


def _launch(options: dict, flash: bool, call: AttnCall):
    block_mask = (to_flex_block_mask(call.sparse) if call.op == "block_sparse" else
                  window_block_mask(call.q.shape[2], call.k.shape[2], call.causal, call.window_left,
                                    call.window_right, call.q.device))
    with _recompile_room():
        out, aux = _compiled()(call.q, call.k, call.v, block_mask=block_mask, scale=call.scale,
                               enable_gqa=call.q.shape[1] != call.k.shape[1], kernel_options=options,
                               **_lse_request())
    lse = getattr(aux, "lse", aux)
    if flash and flex_flash_lse_scaled_by_ln2():
        lse = lse / math.log(2)
    return conform(out, call.q), lse.contiguous()


def kernel_options(cfg: Config) -> dict:
    """flex ``kernel_options`` for a config.

    >>> kernel_options(Config.of(backend="TRITON", block_m=64, block_n=64, num_warps=4, num_stages=2))
    {'BACKEND': 'TRITON', 'BLOCK_M': 64, 'BLOCK_N': 64, 'num_warps': 4, 'num_stages': 2}
    """
    opts = {"BACKEND": cfg["backend"]}
    for key, name in (("block_m", "BLOCK_M"), ("block_n", "BLOCK_N"), ("num_warps", "num_warps"),
                      ("num_stages", "num_stages")):
        if cfg.get(key) is not None:
            opts[name] = cfg[key]
    return opts


def _lse_request() -> dict:
    """Ask for the lse: ``return_aux=AuxRequest(lse=True)`` where it exists (return_lse is deprecated
    there; flex then returns (out, AuxOutput)), else ``return_lse=True`` (returns (out, lse))."""
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:
        return {"return_lse": True}
    return {"return_aux": AuxRequest(lse=True)}


@functools.cache
def _compiled():
    from torch.nn.attention.flex_attention import flex_attention

    # Without torch.compile flex runs its unfused eager path; dynamic=False: shapes are static per bucket.
    return torch.compile(flex_attention, dynamic=False, fullgraph=True)


def _recompile_room():
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    if getattr(config, name) >= RECOMPILE_LIMIT:
        return contextlib.nullcontext()
    return config.patch(**{name: RECOMPILE_LIMIT})


def _from_kv_blocks(cnt, idx, full_cnt, full_idx, block_size, mask_mod, seq_lengths):
    from torch.nn.attention.flex_attention import BlockMask

    kw = {}
    if "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters:
        kw["compute_q_blocks"] = False  # q-direction blocks serve only the backward, which we do not run
    return BlockMask.from_kv_blocks(cnt, idx, full_cnt, full_idx, BLOCK_SIZE=block_size, mask_mod=mask_mod,
                                    seq_lengths=seq_lengths, **kw)


def _pad_blocks(idx: torch.Tensor, n_kv: int) -> torch.Tensor:
    """Our index lists are cut to the longest row; flex wants one column per kv block."""
    if idx.shape[-1] >= n_kv:
        return idx[..., :n_kv].contiguous()
    return torch.nn.functional.pad(idx, (0, n_kv - idx.shape[-1])).contiguous()


def to_flex_block_mask(sparse):
    """A flex ``BlockMask`` with the same meaning as our BlockSparseMask (its mask_mod reads our bitmaps)."""
    n_kv = -(-sparse.seq_lengths[1] // sparse.block_kv)
    slot_of, bits, bq, bk = slot_table(sparse), sparse.partial_bits, sparse.block_q, sparse.block_kv

    def bitmap_mask_mod(b, h, q_idx, kv_idx):
        return bitmap_lookup(slot_of, bits, bq, bk, b, h, q_idx, kv_idx)

    full_cnt, full_idx = sparse.full_kv_num_blocks, sparse.full_kv_indices
    if full_cnt is None:  # flex's FLASH path wants full-block tensors even when there are none
        full_cnt = torch.zeros_like(sparse.kv_num_blocks)
        full_idx = torch.zeros_like(sparse.kv_indices[..., :1])
    return _from_kv_blocks(sparse.kv_num_blocks, _pad_blocks(sparse.kv_indices, n_kv), full_cnt,
                           _pad_blocks(full_idx, n_kv), (bq, bk), bitmap_mask_mod, sparse.seq_lengths)


def window_blocks(len_q: int, len_k: int, causal: bool, window_left: int, window_right: int,
                  block: int = DENSE_BLOCK, device=None):
    """Bool (partial, full) [Mq, Nk] block classes of a lower-right aligned causal/window mask.

    Query i sees key j iff d - left <= j <= d + right with d = i + Lk - Lq (right = 0 if causal, -1
    unbounded). Blocks that cross a sequence end count as partial, so flex checks their bounds.

    >>> partial, full = window_blocks(256, 256, True, -1, -1, block=128)
    >>> partial.int().tolist(), full.int().tolist()
    ([[1, 0], [0, 1]], [[0, 0], [1, 0]])
    """
    right = 0 if causal else window_right
    off = len_k - len_q
    r0 = torch.arange(0, len_q, block, device=device)[:, None]
    r1 = torch.clamp(r0 + block, max=len_q) - 1
    c0 = torch.arange(0, len_k, block, device=device)[None, :]
    c1 = torch.clamp(c0 + block, max=len_k) - 1
    # some (i, j) visible: rows [r0, r1] meet [c0 - off - right, c1 - off + left]
    lo = r0.clone() if right < 0 else torch.maximum(r0, c0 - off - right)
    hi = r1.clone() if window_left < 0 else torch.minimum(r1, c1 - off + window_left)
    lo, hi = torch.broadcast_tensors(lo, hi)
    any_visible = lo <= hi
    every = torch.ones_like(any_visible)
    if right >= 0:
        every = every & (r0 + off + right >= c1)
    if window_left >= 0:
        every = every & (r1 + off - window_left <= c0)
    inside = (r0 + block <= len_q) & (c0 + block <= len_k)
    full = any_visible & every & inside
    return any_visible & ~full, full


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bool [M, N] -> (counts int32 [1, 1, M], listed indices first int32 [1, 1, M, N])."""
    counts = blocks.sum(-1).to(torch.int32)
    order = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return counts[None, None].contiguous(), order[None, None].contiguous()


@functools.lru_cache(maxsize=64)
def window_block_mask(len_q: int, len_k: int, causal: bool, window_left: int, window_right: int, device):
    """The flex BlockMask of a dense causal/window problem (cached: it depends on sizes only)."""
    partial, full = window_blocks(len_q, len_k, causal, window_left, window_right, DENSE_BLOCK, device)

    def window_mask_mod(b, h, q_idx, kv_idx):
        return window_visible(q_idx, kv_idx, len_k - len_q, causal, window_left, window_right)

    return _from_kv_blocks(*_ordered(partial), *_ordered(full), (DENSE_BLOCK, DENSE_BLOCK), window_mask_mod,
                           (len_q, len_k))


BACKEND = FlexBackend()

__all__ = ["FlexBackend", "BACKEND", "to_flex_block_mask", "window_block_mask", "window_blocks", "kernel_options"]
