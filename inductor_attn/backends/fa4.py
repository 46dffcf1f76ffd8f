"""flash-attn-4 (CuTe DSL) as a candidate, with the scheduler knobs it has on each architecture.

What is tuned (all facts from the flash-attn-4 4.0.0b36 source, ``flash_attn/cute/interface.py``):
- sm_90: FA4's own default plus the few tile/MMA alternatives measured in
  shared/anchors/h200-fa4-knobs-2026-11-22.json (``tile_mn``, ``mma_pv_is_rs``, ``intra_wg_overlap``),
  and ``pack_gqa=False`` for GQA. Those are private keyword arguments of ``_flash_attn_fwd``: they are
  checked with ``inspect.signature`` at first use and configs that need a moved one are pruned.
- sm_100/sm_110: the CLC tile scheduler on/off and ``num_splits`` (split-KV). CLC is not a parameter:
  see :func:`_clc_scheduler` for how one call gets it. Unmeasured here (no Blackwell GPU); the code
  paths are exercised by simulating the device (``INDUCTOR_ATTN_DEVICE=sm_100``).
On sm_90 the CLC and split configs still appear, pruned with "CLC needs sm_100" and
"split-KV not supported on sm_90 by flash-attn-4" (``_flash_attn_fwd`` asserts "SplitKV not supported
on SM 9.0").

Layout: our (B, H, L, D) tensors reach FA4 as (B, L, H, D) transpose views. FA4 takes any strides whose
last dim is contiguous and whose other strides are 16-byte multiples (``cute_dsl_utils._is_aligned_layout``)
and otherwise copies silently (``maybe_contiguous``); we make that copy ourselves, count it in
:data:`COPIES` and log it. ``out``/``lse`` are allocated in our layout and passed in, so results come back
without a copy and the return tuple (5 items in b36, 4 before) is not relied on.

Block-sparse: our :class:`BlockSparseMask` maps onto ``BlockSparseTensorsTorch`` (partial blocks ->
``mask_block_*``, full -> ``full_block_*``). FA4 needs a ``mask_mod`` inside partial blocks; ours is a
CuTe function that reads our per-block bitmaps through ``aux_tensors`` (:func:`_bitmap_mask_mod`).

Compilation: FA4 JIT-compiles each configuration on first use (1-3 s on an H200, anchors README). Its
disk cache is switched on before the first import unless the user configured it (:func:`_load`).

Backward: ``_flash_attn_bwd`` on sm_90 picks its tiles itself, so ``deterministic`` is its only knob.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import inspect
import logging
import os
import sys
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from ..device import DeviceInfo
from ..layout import empty_like_layout
from ..problem import Problem
from .base import AttnCall, Backend, Candidate, Config, Plan
from .block_bitmap import slot_table

log = logging.getLogger(__name__)

# Keyword arguments of interface._flash_attn_fwd / _flash_attn_bwd that every call uses: without them
# the backend cannot run at all.
FWD_KWARGS = frozenset({
    "cu_seqlens_q", "cu_seqlens_k", "seqused_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal",
    "window_size_left", "window_size_right", "mask_mod", "block_sparse_tensors", "aux_tensors", "out", "lse",
    "return_lse",
})
BWD_KWARGS = frozenset({
    "softmax_scale", "causal", "window_size_left", "window_size_right", "cu_seqlens_q", "cu_seqlens_k",
    "seqused_k", "max_seqlen_q", "max_seqlen_k", "dlse",
})
# The private tuning knobs: a config that sets one is pruned if FA4 stops taking it.
KNOB_KWARGS = frozenset({"tile_mn", "mma_pv_is_rs", "intra_wg_overlap", "pack_gqa", "num_splits"})
CLC_SWITCH = "_get_use_clc_scheduler_default"

# Input copies made because a tensor's layout did not suit FA4, by tensor name (see module docstring).
COPIES: Counter = Counter()

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
_LAUNCH_FAILURE = {("128x176", False, 128): "tile_mn=128x176 with mma_pv_is_rs=False failed to launch at "
                                           "head_dim 128 (CUDA_LAUNCH_INVALID_CONFIG, H200, 2026-11-22)"}


# ------------------------------------------------------------------------------------------ loading
@dataclass(frozen=True)
class _FA4:
    """The imported pieces of flash-attn-4 this backend uses, and what its private API offers."""

    interface: object
    utils: object
    block_sparsity: object
    version: str
    fwd_params: frozenset
    bwd_params: frozenset
    has_clc_switch: bool
    has_sparse_block_size: bool
    dsl_errors: tuple


def user_cache_dir() -> Path:
    """``$XDG_CACHE_HOME`` (default ``~/.cache``) / inductor_attn."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "inductor_attn"


def _enable_disk_cache() -> None:
    """Turn on FA4's compiled-kernel disk cache unless the user set it either way.

    ``flash_attn/cute/cache_utils.py`` reads both variables once, at import, so this must run before
    the first import of ``flash_attn.cute``; done lazily (not at our import) so that importing
    inductor_attn changes no global state. Without it every process recompiles (seconds per config,
    flash-attention issue #2635).
    """
    if "flash_attn.cute.cache_utils" in sys.modules:
        log.debug("flash_attn.cute was imported before inductor_attn: its disk-cache settings stand")
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", str(user_cache_dir() / "flash_attn_cute"))


def missing_kwargs(params, required) -> list[str]:
    """The names of ``required`` that a signature's parameter names lack, sorted.

    >>> missing_kwargs({"q", "k", "tile_mn"}, {"tile_mn", "num_splits"})
    ['num_splits']
    """
    return sorted(set(required) - set(params))


@functools.cache
def _load() -> _FA4 | str:
    """Import flash-attn-4 once; the reason in words if it cannot be used."""
    _enable_disk_cache()
    try:
        from flash_attn.cute import block_sparsity, interface
        from flash_attn.cute import utils as fa_utils
    except ModuleNotFoundError as err:
        if err.name and err.name.split(".")[0] in ("flash_attn", "cutlass", "quack"):
            return "flash-attn-4 not installed"
        return f"flash-attn-4 not importable: {err}"
    except (ImportError, OSError, RuntimeError) as err:  # e.g. a wheel built for another Python / CUDA
        return f"flash-attn-4 not importable: {type(err).__name__}: {str(err)[:200]}"
    try:
        from cutlass.base_dsl.common import DSLBaseError  # compile/launch errors are not RuntimeErrors

        dsl_errors = (DSLBaseError,)
    except ImportError:
        dsl_errors = ()
    try:
        version = importlib.metadata.version("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return _FA4(
        interface=interface,
        utils=fa_utils,
        block_sparsity=block_sparsity,
        version=version,
        fwd_params=frozenset(inspect.signature(interface._flash_attn_fwd).parameters),
        bwd_params=frozenset(inspect.signature(interface._flash_attn_bwd).parameters),
        has_clc_switch=callable(getattr(fa_utils, CLC_SWITCH, None)),
        has_sparse_block_size="block_size" in getattr(block_sparsity.BlockSparseTensorsTorch, "_fields", ()),
        dsl_errors=dsl_errors,
    )


# -------------------------------------------------------------------------------- problem geometry
def _is_local(p: Problem) -> bool:
    """FA4's "local" (interface._resolve_causal_local_window): a left window, or a right one without causal."""
    return p.window_left >= 0 or (p.window_right >= 0 and not p.causal)


def _parse_tile(text: str) -> tuple[int, int]:
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


def _head_dim_reason(p: Problem, arch: int) -> str | None:
    d, dv = p.head_dim, p.head_dim_v
    if d % 8 or dv % 8:
        return f"flash-attn-4 needs head dims that are multiples of 8, got ({d}, {dv})"
    if family(arch) == "sm90" and not (8 <= d <= 256 and 8 <= dv <= 256):
        return f"flash-attn-4 on sm_90 takes head dims 8..256, got ({d}, {dv})"
    if family(arch) == "sm100" and not (max(d, dv) <= 128 or (d, dv) in ((192, 128), (256, 256))):
        return f"flash-attn-4 on sm_100 takes head dims up to 128, (192, 128) or (256, 256), got ({d}, {dv})"
    return None


def _sm90_sparse_reason(p: Problem, tile: tuple[int, int]) -> str | None:
    """Block sizes FA4 rejects on sm_90 for a tile (block_sparsity.normalize_block_sparse_config)."""
    m, n = tile
    if p.block_kv != n:
        return f"on sm_90 flash-attn-4 needs the kv block size ({p.block_kv}) to equal tile_n ({n})"
    if p.block_q % m:
        return f"flash-attn-4 needs the q block size ({p.block_q}) to be a multiple of tile_m ({m})"
    return None


def _sm100_sparse_reason(p: Problem) -> str | None:
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


# ------------------------------------------------------------------------------------ call helpers
def _aligned(x: torch.Tensor) -> bool:
    """FA4's layout rule (cute_dsl_utils._is_aligned_layout): contiguous last dim, 16-byte aligned
    pointer, other strides 16-byte multiples (or 0, broadcast)."""
    per16 = max(1, 16 // x.element_size())
    return (x.stride(-1) == 1 and x.data_ptr() % 16 == 0
            and all(s == 0 or s % per16 == 0 for s in x.stride()[:-1]))


def _fa4_layout(x: torch.Tensor, name: str, transpose: bool) -> torch.Tensor:
    """(B, H, L, D) -> FA4's (B, L, H, D) as a view; a copy (counted, logged) only when FA4 would make one."""
    view = x.transpose(1, 2) if transpose else x
    if _aligned(view):
        return view
    COPIES[name] += 1
    log.info("flash-attn-4: copying %s %s (strides %s): last dim not contiguous, pointer or strides not "
             "16-byte aligned", name, tuple(x.shape), x.stride())
    return view.clone(memory_format=torch.contiguous_format)  # contiguous() keeps a misaligned pointer


def _int32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.int32 and x.stride(0) == 1 else x.to(torch.int32).contiguous()


def _as_fa4_takes(x: torch.Tensor | None) -> torch.Tensor | None:
    """``x``, or the copy FA4's ``maybe_contiguous`` (cute_dsl_utils, b36) would make of it (an unaligned
    pointer or layout): made here, so that every tensor a recorded kernel reads is one of our values or a
    buffer of FA4's own, never a copy that a replay would take for scratch."""
    if x is None or (x.is_contiguous() and x.data_ptr() % 16 == 0) or _aligned(x):
        return x
    return x.clone(memory_format=torch.contiguous_format)


def _window(call: AttnCall) -> tuple[int | None, int | None]:
    left = None if call.window_left < 0 else call.window_left
    right = 0 if call.causal else (None if call.window_right < 0 else call.window_right)
    return left, right


@contextlib.contextmanager
def _clc_scheduler(fa_utils, enabled: bool | None):
    """Run one FA4 call with the CLC scheduler requested (True) or not (False); None leaves FA4 alone.

    FA4 has no CLC argument: ``FA_CLC=1`` is read at import into ``flash_attn.cute.utils`` and handed out
    by ``utils._get_use_clc_scheduler_default()``, which ``_flash_attn_fwd`` calls through the module on
    every call (b36 interface.py, "requested_use_clc_scheduler"). So we swap that function for the
    duration of the call, under a lock so concurrent calls cannot see each other's value, and restore
    it in ``finally``. The compile key includes the flag, so both variants stay cached side by side.
    """
    if enabled is None:
        yield
        return
    with _CLC_LOCK:
        saved = getattr(fa_utils, CLC_SWITCH)
        setattr(fa_utils, CLC_SWITCH, lambda: enabled)
        try:
            yield
        finally:
            setattr(fa_utils, CLC_SWITCH, saved)


_CLC_LOCK = threading.Lock()


@functools.cache
def _bitmap_mask_mod(block_q: int, block_kv: int, per_batch: int, per_head: int):
    """A CuTe ``mask_mod`` that reads our partial-block bitmaps (aux_tensors = [slot_of, bits]).

    ``slot_of[b, h, m, n]`` (int32, [B', H', M, N]) is the slot of kv block n in q block m's partial list
    and ``bits`` is BlockSparseMask.partial_bits ([B', H', M, S, block_q, block_kv // 32]); bit j % 32 of
    word j // 32 in row i says whether query i of the block sees key j. FA4 calls mask_mod only inside
    partial blocks (block_sparse_utils.consume_block_sparse_loads passes mask_mod=None for full ones),
    where both lookups are in range: FA4's tiles nest inside our blocks. Signature: b36 mask.call_mask_mod
    (batch, head, q_idx, kv_idx, seqlen_info, aux_tensors), each index a 1-element TensorSSA.
    Cached per block geometry, so FA4's compile key (it hashes the function and its closure) is stable.
    """
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute import utils as fa_utils

    @cute.jit
    def bitmap_mask_mod(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
        slot_of = aux_tensors[0]
        bits = aux_tensors[1]
        q = q_idx[0]
        kv = kv_idx[0]
        b = batch[0] * per_batch  # 0 when the mask broadcasts over batch
        h = head[0] * per_head
        m = q // block_q
        col = kv % block_kv
        slot = slot_of[b, h, m, kv // block_kv]
        word = bits[b, h, m, slot, q % block_q, col // 32]
        bit = (word >> (col % 32)) & 1
        return fa_utils.scalar_to_ssa(bit, cutlass.Int32) == fa_utils.scalar_to_ssa(1, cutlass.Int32)

    return bitmap_mask_mod


def _leading(t: torch.Tensor) -> torch.Tensor:
    # FA4 infers an aux tensor's stride-1 dim and raises when several size-1 dims tie; name it.
    t.__leading_dim__ = t.dim() - 1
    return t


# ------------------------------------------------------------------------------------------ backend
class FA4Backend(Backend):
    """Not traced into compiled graphs (CuTe DSL kernels): compiled code calls the plan's launch through
    one thin op, and on sm_90 that launch calls FA4's compiled kernel directly (:class:`_ForwardLaunch`)."""

    name = "fa4"
    requires = ("flash-attn-4", "nvidia-cutlass-dsl")
    sources = (Path(__file__), Path(__file__).with_name("block_bitmap.py"))
    knobs = {"tile_mn": str, "mma_pv_is_rs": bool, "intra_wg_overlap": bool, "pack_gqa": bool, "clc": bool,
             "num_splits": int, "deterministic": bool}
    has_backward = True
    compiles_to_disk = True  # _enable_disk_cache turns FA4's disk cache on unless the user set it either way
    costly_import = True  # supports() imports flash_attn.cute, and with it the CuTe DSL

    # ---------------------------------------------------------------- enumeration (imports FA4 once)
    def supports(self, p: Problem, dev: DeviceInfo, direction: str = "forward") -> str | None:
        if p.device_type != "cuda":
            return "needs a CUDA device"
        if p.dtype not in ("float16", "bfloat16"):
            return f"flash-attn-4 takes float16 and bfloat16 only, got {p.dtype}"
        if family(dev.arch) is None:
            return f"flash-attn-4 backend covers sm_90 and sm_100/sm_110, got sm_{dev.arch}"
        reason = _head_dim_reason(p, dev.arch)
        if reason:
            return reason
        if p.has_kv_seqlens:
            # measured on an H200 (b36, bf16, NaN written into k and v past each length), decode and prefill,
            # every forward config; the backward multiplies the same zeros by V (in dP), and no gate runs in the
            # off, heuristic and cache-only modes. The seqused_k plumbing stays: lifting this takes one line
            return ("flash-attn-4 is told kv_seqlens as seqused_k, yet its last partial tile multiplies the zero "
                    "weights of keys past kv_seqlens by their values (P @ V, dP = dO @ V^T): 0 * NaN (an unwritten "
                    "cache slot) reaches the output")
        if p.op == "varlen" and family(dev.arch) == "sm90":
            # measured on an H200 (b36, bf16): NaN keys of a sequence between two others (one with no queries:
            # padding) reached the neighbours' outputs, forward and backward (tests/test_kv_seqlens_contract_gpu.py);
            # the sm_100 kernels are unmeasured
            return ("flash-attn-4's sm_90 varlen kernels read the keys after a sequence's end in its last tile: NaN "
                    "in the next sequence (padding between sequences) reaches the output")
        fa = _load()
        if isinstance(fa, str):
            return fa
        lost = missing_kwargs(fa.fwd_params, FWD_KWARGS)
        if lost:
            return f"flash-attn-4 {fa.version}: _flash_attn_fwd no longer takes {', '.join(lost)}"
        if p.op == "block_sparse" and not fa.has_sparse_block_size:
            return f"flash-attn-4 {fa.version}: BlockSparseTensorsTorch has no block_size field"
        if direction == "backward":
            # not block-sparse: FA4 wants q-direction block lists there, and its sm_90 block-sparse
            # backward has known wrong gradients at head_dim 64 (flash-attention #2623)
            if p.op == "block_sparse":
                return "flash-attn-4 block-sparse backward is not wired (needs q-direction blocks; #2623)"
            lost = missing_kwargs(fa.bwd_params, BWD_KWARGS)
            if lost:
                return f"flash-attn-4: _flash_attn_bwd no longer takes {', '.join(lost)}"
        return None

    def configs(self, p: Problem, dev: DeviceInfo, direction: str = "forward") -> list[Candidate]:
        if direction == "backward":
            return self._backward_configs()
        scheduler = [Config.of(clc=clc, num_splits=s) for clc in (False, True) for s in self._splits(p, dev)]
        if family(dev.arch) == "sm100":
            cfgs = scheduler
        else:
            cfgs = [Config()]
            if p.head_dim <= 128 and not p.is_decode:  # the measured range; a decode tile is one m-block
                cfgs += SM90_ALTERNATIVES
            if p.gqa_ratio > 1:
                cfgs.append(Config.of(pack_gqa=False))
            # shown so users see why they are not tried here; the one equal to FA4's default is left out
            cfgs += [c for c in scheduler if c != Config.of(clc=False, num_splits=1)]
        return [self.candidate(c, self._pruned(p, dev, c)) for c in cfgs]

    def _backward_configs(self) -> list[Candidate]:
        """The backward's one real knob. b36's ``_flash_attn_bwd`` replaces its tile arguments with its
        own per-arch choice (``_tile_size_bwd_sm90`` on sm_90), so tiles are no candidates; only
        ``deterministic`` (no atomics in dK/dV across GQA heads, fixed dQ order) changes the kernel. It is
        the one config under ``torch.use_deterministic_algorithms(True)``, and otherwise left out: it
        is the slower variant of the same kernel."""
        return [self.candidate(Config.of(deterministic=torch.are_deterministic_algorithms_enabled()))]

    def _splits(self, p: Problem, dev: DeviceInfo) -> list[int]:
        return [1] if p.op == "block_sparse" else split_candidates(p, dev.sm_count)

    def _pruned(self, p: Problem, dev: DeviceInfo, cfg: Config) -> str | None:
        arch = dev.arch
        if cfg.get("clc") and arch < 100:
            return "CLC needs sm_100"
        if cfg.get("num_splits", 1) > 1 and family(arch) == "sm90":
            return "split-KV not supported on sm_90 by flash-attn-4"
        fa = _load()
        if isinstance(fa, str):
            return fa
        moved = missing_kwargs(fa.fwd_params, KNOB_KWARGS & {k for k, _ in cfg.params})
        if moved:
            return f"flash-attn-4 {fa.version}: _flash_attn_fwd no longer takes {', '.join(moved)}"
        if cfg.get("clc"):
            if not fa.has_clc_switch:
                return f"flash-attn-4 {fa.version}: no utils.{CLC_SWITCH} to switch CLC per call"
            reason = fa4_clc_off_reason(p)
            if reason:
                return reason
        tile_text = cfg.get("tile_mn")
        launch = _LAUNCH_FAILURE.get((tile_text, cfg.get("mma_pv_is_rs"), p.head_dim))
        if launch:
            return launch
        if p.op == "block_sparse":
            if family(arch) != "sm90":
                return _sm100_sparse_reason(p)
            # FA4 runs masks with causal and local off, and fits only its default tile to the blocks
            tile = (_parse_tile(tile_text) if tile_text else
                    sm90_default_tile(p.head_dim, p.head_dim_v, False, False, p.block_q, p.block_kv))
            return _sm90_sparse_reason(p, tile)
        return None

    def heuristic(self, p: Problem, dev: DeviceInfo) -> Config | None:
        """FA4's hand rule without measuring: on sm_100 CLC on except where FA4 itself turns it off
        (varlen MHA, dense non-causal; from the CLC heuristic PR, flash-attention #2455) and no split.
        On sm_90 there is no FA4 rule to reproduce: today's rule there is SDPA's own priority (cuDNN
        first), so the heuristic mode keeps the default candidate."""
        if family(dev.arch) == "sm100":
            return Config.of(clc=fa4_clc_off_reason(p) is None, num_splits=1)
        return None

    def errors(self) -> tuple[type[BaseException], ...]:
        fa = _load()
        return () if isinstance(fa, str) else fa.dsl_errors

    # ------------------------------------------------------------------------------------ plans
    def load(self) -> None:
        _load()

    def plan(self, p: Problem, dev: DeviceInfo, cfg: Config, direction: str) -> Plan:
        if direction == "backward" and p.op == "block_sparse":
            raise NotImplementedError("flash-attn-4 block-sparse backward is not wired (see supports())")
        thin = family(dev.arch) == "sm90" and p.op in ("attention", "varlen")
        if direction == "backward":
            return Plan(_BackwardLaunch(bool(cfg.get("deterministic", False)), str(cfg), thin))
        return Plan(_ForwardLaunch(_knobs(cfg), cfg.get("clc"), str(cfg), thin))


def family(arch: int) -> str | None:
    """FA4's kernel family for a compute capability (interface.py dispatches on ``arch // 10`` the same
    way): "sm90", "sm100" (sm_100 and sm_110), or None where this backend does not run FA4.

    >>> family(90), family(100), family(110), family(80)
    ('sm90', 'sm100', 'sm100', None)
    """
    return {9: "sm90", 10: "sm100", 11: "sm100"}.get(arch // 10)


def _fa4() -> _FA4:
    fa = _load()
    if isinstance(fa, str):
        raise RuntimeError(fa)
    return fa


def _knobs(cfg: Config) -> dict:
    kw = {}
    if cfg.get("tile_mn"):
        kw["tile_mn"] = _parse_tile(cfg["tile_mn"])
    for key in ("mma_pv_is_rs", "intra_wg_overlap", "pack_gqa", "num_splits"):
        if cfg.get(key) is not None:
            kw[key] = cfg[key]
    return kw


def _sparse_kwargs(fa: _FA4, call: AttnCall) -> dict:
    s = call.sparse
    tensors = fa.block_sparsity.BlockSparseTensorsTorch(
        mask_block_cnt=s.kv_num_blocks, mask_block_idx=s.kv_indices,
        full_block_cnt=s.full_kv_num_blocks, full_block_idx=s.full_kv_indices,
        block_size=(s.block_q, s.block_kv))
    kw = {"block_sparse_tensors": tensors}
    if s.partial_fraction != 0:  # exact (not bucketed; -1 unknown) here: no device sync to find partial blocks
        b, h = s.kv_num_blocks.shape[:2]
        kw["mask_mod"] = _bitmap_mask_mod(s.block_q, s.block_kv, int(b > 1), int(h > 1))
        kw["aux_tensors"] = [_leading(slot_table(s)), _leading(s.partial_bits.contiguous())]
    return kw


def _forward_args(fa: _FA4, knobs: dict, call: AttnCall, values: tuple):
    """(positional args, keyword args, values) of one ``_flash_attn_fwd`` call over ``values`` (as
    :func:`_call_values` gives them); the values returned have q, k and v as passed (copies where FA4 would
    make them)."""
    dense = call.op != "varlen"
    args = [_fa4_layout(x, name, dense) for x, name in ((call.q, "q"), (call.k, "k"), (call.v, "v"))]
    values = (*args, *values[3:])
    kw = dict(softmax_scale=call.scale, return_lse=True, **knobs)
    kw.update((name, x) for name, x in zip(_VALUE_KWARGS, values[3:-1]) if x is not None)
    if call.op == "block_sparse":
        kw.update(_sparse_kwargs(fa, call))
    else:
        kw["causal"] = call.causal
        kw["window_size_left"], kw["window_size_right"] = _window(call)
    return args, kw, values


# The keyword arguments of ``_flash_attn_fwd`` that :func:`_call_values` holds after q, k and v.
_VALUE_KWARGS = ("out", "lse", "seqused_k", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")


def _call_values(call: AttnCall, out: torch.Tensor, lse: torch.Tensor) -> tuple:
    """What changes from call to call, as FA4 takes it: q, k, v and out as (B, L, H, D) views (packed
    (total, H, D) for varlen; ``out`` follows q's stride order, the ops' layout contract), lse, seqused_k,
    cu_seqlens_q/k and max_seqlen_q/k (None where unused), the scale last. A replay's arguments are built
    from these (:meth:`_Recording.replay`)."""
    seqused = None if call.kv_seqlens is None else _int32(call.kv_seqlens)
    if call.op != "varlen":
        return (call.q.transpose(1, 2), call.k.transpose(1, 2), call.v.transpose(1, 2), out.transpose(1, 2), lse,
                seqused, None, None, None, None, call.scale)
    return (call.q, call.k, call.v, out, lse, seqused, _int32(call.cu_seqlens_q), _int32(call.cu_seqlens_k),
            call.max_seqlen_q, call.max_seqlen_k, call.scale)


def _buffers(call: AttnCall) -> tuple[torch.Tensor, torch.Tensor]:
    """A forward's empty (out, lse): out in q's stride order, lse (B, H, L), or (H, total) for varlen."""
    q = call.q
    out = empty_like_layout(q, (*q.shape[:-1], call.v.shape[-1]))
    lse_shape = (q.shape[1], q.shape[0]) if call.op == "varlen" else q.shape[:-1]
    return out, torch.empty(lse_shape, dtype=torch.float32, device=q.device)


class _ForwardLaunch:
    """A forward plan's launch. The first call of each layout goes through FA4's ``_flash_attn_fwd``
    (which compiles the kernel, or loads it from the disk cache) while :class:`_Recording` notes the
    compiled object and the arguments it was called with; once that :class:`_Replay` has reproduced the
    call (:func:`_checked_replay`), it makes later calls: no key building, checks or heuristics per call
    (about 1,300 lines of Python in b36, against about 2 us for a launch of a compiled CuTe kernel,
    tritonbench #1002). A call whose recording holds more than one kernel or a tensor FA4 made itself
    (split-KV's combine, block-sparse and large-batch varlen scheduler tensors) keeps calling
    ``_flash_attn_fwd``."""

    def __init__(self, knobs: dict, clc: bool | None, label: str, thin: bool):
        self.knobs, self.clc, self.label, self.thin = knobs, clc, label, thin
        self.replays = _Replays()

    def __call__(self, call: AttnCall):
        quick = _quick_layout((call.q, call.k, call.v, call.kv_seqlens, call.cu_seqlens_q, call.cu_seqlens_k),
                              (call.scale, call.max_seqlen_q, call.max_seqlen_k))
        known = self.replays.known.get(quick)
        if known is not None:  # the steady state: allocate, view, launch
            out, lse = known.outputs(call.q.device)
            known.replay(_call_values(call, out, lse))
            return out, lse
        out, lse = _buffers(call)
        values = _call_values(call, out, lse)
        if self.replays.by_layout:  # a layout recorded is one FA4 takes as it is (_Replays): no layout checks
            replay = self.replays.get(values)
            if replay is not None:
                replay(values)
                self.replays.know(quick, replay, (out, lse))
                return out, lse
        return self._through_fa4(call, out, lse, values)

    def _through_fa4(self, call: AttnCall, out: torch.Tensor, lse: torch.Tensor, values: tuple):
        fa = _fa4()
        args, kw, values = _forward_args(fa, self.knobs, call, values)
        wanted = self.thin and self.replays.wants(values)
        recording = _Recording(fwd_compile_cache_owners(fa)) if wanted else None
        with _clc_scheduler(fa.utils, self.clc), _dsl_errors(fa, self.label), recording or contextlib.nullcontext():
            result = fa.interface._flash_attn_fwd(*args, **kw)
        # b36 returns (out, lse, ...) and writes the buffers we passed; take FA4's lse if it made its own
        got_lse = result[1] if isinstance(result, tuple) and len(result) > 1 else None
        if got_lse is not None and got_lse.data_ptr() != lse.data_ptr():
            lse = got_lse
        if recording is not None:
            fresh_out, fresh_lse = _buffers(call)
            fresh = (*args, *_call_values(call, fresh_out, fresh_lse)[3:])
            self.replays.add(values, _checked_replay(recording.replay(values, scratch=False), fresh, (out, lse),
                                                     (fresh_out, fresh_lse), self.label))
        return out, lse


class _BackwardLaunch:
    """A backward plan's launch, recorded and replayed per layout as :class:`_ForwardLaunch` does, where FA4
    writes into our dq, dk, dv (their layout suits it). b36's ``_flash_attn_bwd`` runs several compiled
    kernels (preprocess, the main kernel, postprocess conversions of the float32 accumulators) over buffers it
    allocates each call (accumulators, dpsum, lse in log2, semaphores when deterministic): a replay calls the
    same kernels in the same order and allocates those buffers again per call, zeroed where FA4 handed them
    over zeroed (:meth:`_Recording.replay`)."""

    def __init__(self, deterministic: bool, label: str, thin: bool):
        self.deterministic, self.label, self.thin = deterministic, label, thin
        self.replays = _Replays()

    def __call__(self, call: AttnCall, out, lse, grad_out, grad_lse):
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        quick = _quick_layout((call.q, call.k, call.v, out, grad_out, lse, grad_lse, call.kv_seqlens,
                               call.cu_seqlens_q, call.cu_seqlens_k),
                              (call.scale, call.max_seqlen_q, call.max_seqlen_k))
        known = self.replays.known.get(quick)
        if known is not None:  # the steady state: allocate, view, launch
            grads = known.outputs(call.q.device)
            known.replay(_backward_values(call, call.q, call.k, call.v, out, grad_out, lse, grad_lse, grads,
                                          checked=False))
            _zero_unused_keys(call, grads)
            return tuple(grads)
        grads = [empty_like_layout(x, x.shape) for x in (call.q, call.k, call.v)]
        tensors = (call.q, call.k, call.v, out, grad_out, lse, grad_lse, grads)
        values, replay, into_ours, as_given = self._replayed(call, tensors)
        if replay is not None:
            replay(values)
            if as_given:
                self.replays.know(quick, replay, grads)
        else:
            self._through_fa4(call, values, grads, into_ours)
        _zero_unused_keys(call, grads)
        return tuple(grads)

    def _replayed(self, call: AttnCall, tensors: tuple) -> tuple[tuple, _Replay | None, bool, bool]:
        """(values, the replay recorded for their layout or None, whether FA4 writes into our grads, whether the
        values are the views of the tensors as given). The views alone are looked up first, with no checks: a
        layout recorded is one FA4 takes as it is. Else the values made what FA4 takes (copies where FA4 would
        make them), whose layout may have been recorded too."""
        if self.replays.by_layout:
            views = _backward_values(call, *tensors, checked=False)
            replay = self.replays.get(views)
            if replay is not None:
                return views, replay, True, True
        values = _backward_values(call, *tensors, checked=True)
        into_ours = all(f.data_ptr() == g.data_ptr() for f, g in zip(values[8:11], tensors[-1]))
        return values, self.replays.get(values) if into_ours and self.replays.by_layout else None, into_ours, False

    def _through_fa4(self, call: AttnCall, values: tuple, grads, into_ours: bool):
        fa = _fa4()
        dense = call.op != "varlen"
        q, k, v, o, do, lse, grad_lse, seqused, *fa_grads = values[:11]
        kw = dict(softmax_scale=call.scale, causal=call.causal, dlse=grad_lse, deterministic=self.deterministic)
        kw["window_size_left"], kw["window_size_right"] = _window(call)
        if not dense:
            kw.update(cu_seqlens_q=values[11], cu_seqlens_k=values[12], max_seqlen_q=values[13],
                      max_seqlen_k=values[14])
        if seqused is not None:
            kw["seqused_k"] = seqused
        if into_ours:
            kw.update(dq=fa_grads[0], dk=fa_grads[1], dv=fa_grads[2])  # FA4 writes into ours: no copy back
        wanted = self.thin and into_ours and self.replays.wants(values)
        recording = _Recording(bwd_compile_cache_owners(fa)) if wanted else None
        with _dsl_errors(fa, self.label), recording or contextlib.nullcontext():
            got = fa.interface._flash_attn_bwd(q, k, v, o, do, lse, **kw)[:3]
        for grad, fa_grad, result in zip(grads, fa_grads, got):
            if result.data_ptr() != fa_grad.data_ptr():  # FA4 made its own buffer
                grad.copy_(result.transpose(1, 2) if dense else result)
        if recording is not None:
            _zero_unused_keys(call, grads)
            fresh = [empty_like_layout(x, x.shape) for x in (call.q, call.k, call.v)]
            fresh_values = (*values[:8], *(_fa4_layout(g, "grad", dense) for g in fresh), *values[11:])
            self.replays.add(values, _checked_replay(recording.replay(values, scratch=True), fresh_values, grads,
                                                     fresh, self.label, after=lambda: _zero_unused_keys(call, fresh)))


def _backward_values(call: AttnCall, q, k, v, out, grad_out, lse, grad_lse, grads, checked: bool) -> tuple:
    """What a backward launch passes FA4: q, k, v, out, grad_out as (B, L, H, D) views (packed (total, H, D)
    for varlen), lse, grad_lse, seqused_k, dq, dk, dv; for varlen cu_seqlens_q/k and max_seqlen_q/k; the scale
    last. ``checked``: each made what FA4 takes, copies where FA4 would make them (:func:`_fa4_layout`,
    :func:`_as_fa4_takes`, :func:`_int32`); else the views as they are, which serve where a replay was recorded
    for their layout (the checks read only what :func:`_layout` keys on)."""
    dense = call.op != "varlen"
    names = ("q", "k", "v", "out", "grad_out", "grad", "grad", "grad")
    if checked:
        views = [_fa4_layout(x, name, dense) for x, name in zip((q, k, v, out, grad_out, *grads), names)]
        indices = [None if x is None else _as_fa4_takes(_int32(x))
                   for x in (call.kv_seqlens, call.cu_seqlens_q, call.cu_seqlens_k)]
        lse, grad_lse = _as_fa4_takes(lse), _as_fa4_takes(grad_lse)
    else:
        views = [x.transpose(1, 2) if dense else x for x in (q, k, v, out, grad_out, *grads)]
        indices = [call.kv_seqlens, call.cu_seqlens_q, call.cu_seqlens_k]
    values = (*views[:5], lse, grad_lse, indices[0], *views[5:])
    if not dense:
        values += (indices[1], indices[2], call.max_seqlen_q, call.max_seqlen_k)
    return values + (call.scale,)


def _zero_unused_keys(call: AttnCall, grads) -> None:
    """FA4 leaves dk/dv of keys past seqused_k unwritten (garbage of order 1e19 on an H100, b36); those keys
    are masked, so their gradients are 0."""
    if call.kv_seqlens is not None:
        _, dk, dv = grads
        unused = torch.arange(dk.shape[2], device=dk.device)[None, :] >= call.kv_seqlens[:, None]
        dk.masked_fill_(unused[:, None, :, None], 0)
        dv.masked_fill_(unused[:, None, :, None], 0)


class _Replays:
    """A plan's recorded replays, one per layout of the values (each tensor's shape, strides, dtype and
    16-byte alignment, and the scale): FA4 compiles a kernel per broadcast pattern (zero strides,
    cute_dsl_utils ``get_broadcast_dims``) and alignment, so a replay serves only values laid out as the
    call it recorded; and with the scale in the key, every float it passes is replayed as recorded. A
    layout is recorded at its first call, never while a CUDA graph is being captured (the check reads
    results back), and at most ``LIMIT`` of them; a layout whose recording was refused keeps going through
    FA4's interface. The key holds all that the layout checks read (:func:`_aligned`, :func:`_as_fa4_takes`,
    :func:`_int32`), and only values FA4 takes as they are get recorded, so the launches look their views up
    unchecked."""

    LIMIT = 8

    def __init__(self):
        self.by_layout: dict[tuple, _Replay | None] = {}
        self.known: dict[tuple, _Known] = {}  # _quick_layout of a call's own tensors -> its replay, once replayed

    def get(self, values: tuple) -> _Replay | None:
        return self.by_layout.get(_layout(values))

    def wants(self, values: tuple) -> bool:
        capturing = values[0].is_cuda and _capturing(values[0].device)
        return not capturing and len(self.by_layout) < self.LIMIT and _layout(values) not in self.by_layout

    def add(self, values: tuple, replay: _Replay | None) -> None:
        self.by_layout[_layout(values)] = replay

    def know(self, quick: tuple, replay: _Replay, outputs) -> None:
        """Remember that calls keyed ``quick`` (:func:`_quick_layout`) replay ``replay`` into outputs laid out as
        ``outputs``: their next calls skip building the values' full layout key and computing output layouts."""
        if len(self.known) < self.LIMIT:
            self.known[quick] = _Known(replay, tuple((t.shape, t.stride(), t.dtype) for t in outputs))


class _Known:
    """A replay found for a call's own tensors, and the layouts of the outputs it writes."""

    def __init__(self, replay: _Replay, layouts: tuple):
        self.replay, self.layouts = replay, layouts

    def outputs(self, device: torch.device) -> list[torch.Tensor]:
        return [torch.empty_strided(shape, stride, dtype=dtype, device=device) for shape, stride, dtype in self.layouts]


def _quick_layout(tensors: tuple, scalars: tuple) -> tuple:
    """The key of :attr:`_Replays.known`: each tensor's strides, dtype, 16-byte alignment and the first of the
    tensors it is (their shapes are the plan's problem's), and the scalars. Calls with one key build values of
    one :func:`_layout` (the outputs a launch allocates are laid out from q's strides, and an index tensor is
    converted by dtype and stride alone), at a fraction of its cost: no views, fewer tensors."""
    key, first = [], {}
    for i, t in enumerate(tensors):
        if t is None:
            key.append(None)
        else:
            ptr = t.data_ptr()
            key.append((t.stride(), t.dtype, ptr % 16 == 0, first.setdefault(ptr, i)))
    return (*key, *scalars)


def _capturing(device: torch.device) -> bool:
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()


def _layout(values: tuple) -> tuple:
    """Each tensor's shape, strides, dtype, 16-byte alignment and the first value it is (cu_seqlens_q and
    cu_seqlens_k are often one tensor: a replay recorded so reads both from one role); any other value as
    it is. The first value at the same address stands for "the same tensor": with every value's shape,
    strides and dtype in the key too, that is :func:`_identity`. Runs once per replayed call, hence the plain
    loop."""
    key, first = [], {}
    for i, t in enumerate(values):
        if isinstance(t, torch.Tensor):
            ptr = t.data_ptr()
            key.append((t.shape, t.stride(), t.dtype, ptr % 16 == 0, first.setdefault(ptr, i)))
        else:
            key.append(t)
    return tuple(key)


_CONST, _ROLE, _SCRATCH = range(3)


class _Replay:
    """FA4's compiled kernels called in the recorded order, each argument a role (an index into the values a
    launch builds), a scratch buffer (allocated per call as recorded: shape, strides, dtype, and zeroed or
    not) or a recorded constant."""

    def __init__(self, steps: list, scratch: list):
        self.steps, self.scratch = steps, scratch

    def __call__(self, values: tuple, poison: float | None = None):
        buffers = []
        for shape, stride, dtype, zeroed in self.scratch:
            buf = torch.empty_strided(shape, stride, dtype=dtype, device=values[0].device)
            buffers.append(buf.zero_() if zeroed else buf.fill_(poison) if poison is not None else buf)
        for fn, specs in self.steps:
            fn(*[values[x] if kind == _ROLE else buffers[x] if kind == _SCRATCH else x for kind, x in specs])

    def without_zeroing(self, j: int) -> _Replay:
        """This replay with scratch buffer ``j`` allocated as it comes, not zeroed."""
        scratch = list(self.scratch)
        scratch[j] = (*scratch[j][:3], False)
        return _Replay(self.steps, scratch)


# What a check fills the scratch buffers a replay does not zero with: NaN spreads through sums, a large finite
# value shows through a max or a min, which NaN may pass unseen.
_POISONS = (float("nan"), 1e4)


def _checked_replay(replay: _Replay | None, fresh_values: tuple, expected, got, label: str,
                    after=None) -> _Replay | None:
    """``replay`` if it reproduced FA4's ``expected`` outputs, run on ``fresh_values`` (the recorded call's inputs,
    new outputs ``got``; then ``after()``) with every scratch buffer it does not zero poisoned (all of them
    floating point, :data:`_POISONS`); else None, logged. A buffer that FA4 filled on the host, not in a
    recorded kernel, shows here. Then each floating-point buffer handed over zeroed (a recording sees only that
    it was all zeros: fresh memory from the allocator often is) is tried poisoned too, outputs NaN first; where
    the outputs still come out right, a kernel clears it (b36's preprocess clears dq's accumulator) and the
    replay stops zeroing it: one fill kernel less per call."""
    if replay is None:
        return None
    poisoned = any(not zeroed for *_, zeroed in replay.scratch)
    for poison in _POISONS if poisoned else _POISONS[:1]:
        err = _replayed_error(replay, fresh_values, expected, got, poison, after)
        if not err <= 1e-2:  # NaN fails too
            log.warning("flash-attn-4 [%s]: the recorded kernel calls did not reproduce the call (relative "
                        "error %.3g); this plan keeps calling flash-attn-4's interface", label, err)
            return None
    for j, (_, _, dtype, zeroed) in enumerate(replay.scratch):
        if zeroed and dtype.is_floating_point:
            trial = replay.without_zeroing(j)
            if all(_replayed_error(trial, fresh_values, expected, got, poison, after) <= 1e-2 for poison in _POISONS):
                replay = trial
    return replay


def _replayed_error(replay: _Replay, fresh_values: tuple, expected, got, poison: float, after) -> float:
    """The largest relative error of ``got`` against ``expected`` after ``replay`` ran with ``poison``, from
    outputs filled with NaN (what a run leaves must be its own, not the run before's); NaN where their non-finite
    entries differ. Within 1% counts as reproduced: FA4's backward adds dq up with atomics, in no fixed order."""
    for out in got:
        out.fill_(float("nan"))
    replay(fresh_values, poison=poison)
    if after is not None:
        after()
    errors = []
    for want, have in zip(expected, got):
        finite = want.isfinite()
        if not torch.equal(finite, have.isfinite()):
            return float("nan")
        want, have = want[finite].float(), have[finite].float()
        errors.append(((have - want).norm() / want.norm().clamp_min(1e-30)).item())
    return float("nan") if any(e != e for e in errors) else max(errors, default=0.0)


class _Recording:
    """Swaps the ``compile_cache`` of FA4's kernel owners for one call (under a lock) to see which compiled
    objects run, in which order, with which arguments, and which of those tensors were all zeros when first
    handed over. The owners come from :func:`fwd_compile_cache_owners` / :func:`bwd_compile_cache_owners`,
    whose tests fail when the attributes move."""

    _LOCK = threading.Lock()

    def __init__(self, owners: list):
        self.owners = owners
        self.calls: list = []
        self.zeroed: dict[int, bool] = {}  # data_ptr -> all zeros when first passed

    def __enter__(self):
        self._LOCK.acquire()
        self.thread = threading.get_ident()
        self.real = [owner.compile_cache for owner in self.owners]
        for owner, real in zip(self.owners, self.real):
            owner.compile_cache = _RecordingCache(real, self)
        return self

    def __exit__(self, *exc):
        for owner, real in zip(self.owners, self.real):
            owner.compile_cache = real
        self._LOCK.release()

    def note(self, fn, args: tuple) -> None:
        for a in args:
            if isinstance(a, torch.Tensor) and a.data_ptr() not in self.zeroed:
                self.zeroed[a.data_ptr()] = not bool(a.any()) if a.numel() else True
        self.calls.append((fn, args))

    def replay(self, values: tuple, scratch: bool) -> _Replay | None:
        """The recorded calls as a :class:`_Replay` over ``values``, or None when they cannot be rebuilt from
        them. Without ``scratch``: one call whose every tensor is one of ``values``. With it, any number of
        calls, and tensors FA4 made become scratch buffers, unless one has q's dtype (a copy of an input
        rather than a buffer of FA4's own), overlaps a value without being it, is an integer tensor handed
        over non-zero (an index or counter filled from the inputs, which no poison can check), or is passed
        with two layouts. Always None for a tensor hidden in a container. A tensor that is several values gets
        the first one's role (:func:`_layout` keys on which values are one tensor); other arguments (the
        scale among them: :func:`_layout` keys on it) are constants."""
        if not self.calls or (not scratch and len(self.calls) != 1):
            return None
        roles: dict[tuple, int] = {}
        spans = []
        for i, t in enumerate(values):
            if isinstance(t, torch.Tensor):
                roles.setdefault(_identity(t), i)
                spans.append(_span(t))
        buffers: list = []
        buffer_at: dict[int, int] = {}
        steps = []
        for fn, args in self.calls:
            specs = []
            for arg in args:
                if not isinstance(arg, torch.Tensor):
                    if _holds_tensor(arg):
                        return None
                    specs.append((_CONST, arg))
                    continue
                role = roles.get(_identity(arg))
                if role is not None:
                    specs.append((_ROLE, role))
                    continue
                lo, hi = _span(arg)
                if (not scratch or arg.dtype == values[0].dtype or any(lo < end and start < hi for start, end in spans)
                        or not (arg.dtype.is_floating_point or self.zeroed[arg.data_ptr()])):
                    return None
                layout = (tuple(arg.shape), tuple(arg.stride()), arg.dtype)
                j = buffer_at.setdefault(arg.data_ptr(), len(buffers))
                if j == len(buffers):
                    buffers.append((*layout, self.zeroed[arg.data_ptr()]))
                elif buffers[j][:3] != layout:
                    return None
                specs.append((_SCRATCH, j))
            steps.append((fn, specs))
        return _Replay(steps, buffers)


class _RecordingCache:
    """A stand-in for one FA4 compile cache: lookups and inserts go to the real one; the compiled objects it
    hands out to the recording thread note each call with the recording before running."""

    def __init__(self, real, recording: _Recording):
        self.real, self.recording = real, recording

    def __contains__(self, key):
        return key in self.real

    def __setitem__(self, key, fn):
        self.real[key] = fn

    def __getitem__(self, key):
        fn = self.real[key]
        if threading.get_ident() != self.recording.thread:  # another thread's FA4 call: not the one recorded
            return fn
        return lambda *args: self.recording.note(fn, args) or fn(*args)


def _identity(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The byte range a tensor's elements can reach (0-size tensors reach nothing)."""
    if t.numel() == 0:
        return (0, 0)
    reach = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
    start = t.data_ptr()
    return start, start + (reach + 1) * t.element_size()


def _holds_tensor(x) -> bool:
    if isinstance(x, torch.Tensor):
        return True
    if isinstance(x, (tuple, list)):
        return any(_holds_tensor(y) for y in x)
    fields = getattr(x, "_fields", None) or getattr(x, "__dataclass_fields__", None)
    return bool(fields) and any(_holds_tensor(getattr(x, f)) for f in fields)


def fwd_compile_cache_owners(fa: _FA4) -> list:
    """The objects whose ``compile_cache`` holds FA4's compiled forward kernels (b36:
    ``interface._flash_attn_fwd``)."""
    return [fa.interface._flash_attn_fwd]


def bwd_compile_cache_owners(fa: _FA4) -> list:
    """The objects whose ``compile_cache`` holds the kernels ``_flash_attn_bwd`` runs (b36: its preprocess,
    itself, and the postprocess conversion)."""
    i = fa.interface
    return [i._bwd_preprocess, i._flash_attn_bwd, i._bwd_postprocess_convert]


@contextlib.contextmanager
def _dsl_errors(fa: _FA4, label: str):
    """CuTe DSL compile/launch errors (e.g. CUDA_LAUNCH_INVALID_CONFIG) do not derive from RuntimeError;
    re-raise them as one so the tuner drops the candidate instead of treating it as our bug."""
    try:
        yield
    except fa.dsl_errors as err:
        first = next((ln.strip() for ln in str(err).splitlines() if ln.strip()), "")
        raise RuntimeError(f"flash-attn-4 [{label}] {type(err).__name__}: {first[:200]}") from err


BACKEND = FA4Backend()

__all__ = ["FA4Backend", "BACKEND", "COPIES", "fa4_clc_off_reason", "split_candidates",
           "sm90_default_tile", "missing_kwargs", "family", "fwd_compile_cache_owners",
           "bwd_compile_cache_owners"]
