"""flash-attn-4 (CuTe DSL) as a candidate, with the scheduler knobs it has on each architecture.

Modules: ``loading`` (importing FA4 and guarding the private API we use), ``rules`` (what FA4 takes and picks,
restated so pruning needs no import), ``launch`` (a plan's calls, replayed through backends/replay.py after the
first), and the backend here.

What is tuned (all facts from the flash-attn-4 4.0.0b36 source, ``flash_attn/cute/interface.py``):
- sm_90: FA4's own default plus the few tile/MMA alternatives measured in
  shared/anchors/h200-fa4-knobs-2026-11-22.json (``tile_mn``, ``mma_pv_is_rs``, ``intra_wg_overlap``),
  and ``pack_gqa=False`` for GQA. Those are private keyword arguments of ``_flash_attn_fwd``: they are
  checked with ``inspect.signature`` at first use and configs that need a moved one are pruned.
- sm_100/sm_110: the CLC tile scheduler on/off and ``num_splits`` (split-KV). CLC is not a parameter:
  see :func:`loading.clc_scheduler` for how one call gets it. Unmeasured here (no Blackwell GPU); the code
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
CuTe function that reads our per-block bitmaps through ``aux_tensors`` (``launch._bitmap_mask_mod``).

Compilation: FA4 JIT-compiles each configuration on first use (1-3 s on an H200, anchors README). Its
disk cache is switched on before the first import unless the user configured it (:func:`loading.load`).

Backward: ``_flash_attn_bwd`` on sm_90 picks its tiles itself, so ``deterministic`` is its only knob.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...device import DeviceInfo
from ...problem import Problem
from .. import replay
from ..base import Backend, Candidate, Config, Library, Plan, Takes
from . import loading
from .launch import COPIES, BackwardLaunch, ForwardLaunch, knob_kwargs
from .loading import (BWD_KWARGS, CLC_SWITCH, FWD_KWARGS, KNOB_KWARGS, bwd_compile_cache_owners,
                      fwd_compile_cache_owners, missing_kwargs)
from .rules import (LAUNCH_FAILURE, SM90_ALTERNATIVES, fa4_clc_off_reason, family, head_dim_reason, parse_tile,
                    sm90_default_tile, sm90_sparse_reason, sm100_sparse_reason, split_candidates)


def _errors() -> tuple[type[BaseException], ...]:
    """CuTe DSL's compile and launch errors, which do not derive from RuntimeError."""
    fa = loading.load()
    return () if isinstance(fa, str) else fa.dsl_errors


# ------------------------------------------------------------------------------------------ backend
class FA4Backend(Backend):
    """Not traced into compiled graphs (CuTe DSL kernels): compiled code calls the plan's launch through
    one thin op, and on sm_90 that launch calls FA4's compiled kernel directly (:class:`ForwardLaunch`)."""

    name = "fa4"
    # every module of this package, and what they import from outside it that runs FA4's kernels
    sources = (*sorted(Path(__file__).parent.glob("*.py")), Path(__file__).parent.with_name("block_bitmap.py"),
               Path(replay.__file__))
    knobs = {"tile_mn": str, "mma_pv_is_rs": bool, "intra_wg_overlap": bool, "pack_gqa": bool, "clc": bool,
             "num_splits": int, "deterministic": bool}
    takes = Takes(backward=True)
    # supports() imports flash_attn.cute, and with it the CuTe DSL (costly_import); load() turns FA4's disk
    # cache on unless the user set it either way (compiles_to_disk)
    library = Library(distributions=("flash-attn-4", "nvidia-cutlass-dsl"), errors=_errors,
                      costly_import=True, load=loading.load, compiles_to_disk=True)

    # ---------------------------------------------------------------- enumeration (imports FA4 once)
    def supports(self, p: Problem, dev: DeviceInfo, direction: str = "forward") -> str | None:
        if p.device_type != "cuda":
            return "needs a CUDA device"
        if p.dtype not in ("float16", "bfloat16"):
            return f"flash-attn-4 takes float16 and bfloat16 only, got {p.dtype}"
        if family(dev.arch) is None:
            return f"flash-attn-4 backend covers sm_90 and sm_100/sm_110, got sm_{dev.arch}"
        reason = head_dim_reason(p, dev.arch)
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
        fa = loading.load()
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
        return [Candidate(self.name, c, self._pruned(p, dev, c)) for c in cfgs]

    def _backward_configs(self) -> list[Candidate]:
        """The backward's one real knob. b36's ``_flash_attn_bwd`` replaces its tile arguments with its
        own per-arch choice (``_tile_size_bwd_sm90`` on sm_90), so tiles are no candidates; only
        ``deterministic`` (no atomics in dK/dV across GQA heads, fixed dQ order) changes the kernel. It is
        the one config under ``torch.use_deterministic_algorithms(True)``, and otherwise left out: it
        is the slower variant of the same kernel."""
        return [Candidate(self.name, Config.of(deterministic=torch.are_deterministic_algorithms_enabled()))]

    def _splits(self, p: Problem, dev: DeviceInfo) -> list[int]:
        return [1] if p.op == "block_sparse" else split_candidates(p, dev.sm_count)

    def _pruned(self, p: Problem, dev: DeviceInfo, cfg: Config) -> str | None:
        arch = dev.arch
        if cfg.get("clc") and arch < 100:
            return "CLC needs sm_100"
        if cfg.get("num_splits", 1) > 1 and family(arch) == "sm90":
            return "split-KV not supported on sm_90 by flash-attn-4"
        fa = loading.load()
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
        launch = LAUNCH_FAILURE.get((tile_text, cfg.get("mma_pv_is_rs"), p.head_dim))
        if launch:
            return launch
        if p.op == "block_sparse":
            if family(arch) != "sm90":
                return sm100_sparse_reason(p)
            # FA4 runs masks with causal and local off, and fits only its default tile to the blocks
            tile = (parse_tile(tile_text) if tile_text else
                    sm90_default_tile(p.head_dim, p.head_dim_v, False, False, p.block_q, p.block_kv))
            return sm90_sparse_reason(p, tile)
        return None

    def heuristic(self, p: Problem, dev: DeviceInfo) -> Config | None:
        """FA4's hand rule without measuring: on sm_100 CLC on except where FA4 itself turns it off
        (varlen MHA, dense non-causal; from the CLC heuristic PR, flash-attention #2455) and no split.
        On sm_90 there is no FA4 rule to reproduce: today's rule there is SDPA's own priority (cuDNN
        first), so the heuristic mode keeps the default candidate."""
        if family(dev.arch) == "sm100":
            return Config.of(clc=fa4_clc_off_reason(p) is None, num_splits=1)
        return None

    # ------------------------------------------------------------------------------------ plans
    def plan(self, p: Problem, dev: DeviceInfo, cfg: Config, direction: str) -> Plan:
        if direction == "backward" and p.op == "block_sparse":
            raise NotImplementedError("flash-attn-4 block-sparse backward is not wired (see supports())")
        thin = family(dev.arch) == "sm90" and p.op in ("attention", "varlen")
        if direction == "backward":
            return Plan(BackwardLaunch(bool(cfg.get("deterministic", False)), str(cfg), thin))
        return Plan(ForwardLaunch(knob_kwargs(cfg), cfg.get("clc"), str(cfg), thin))


BACKEND = FA4Backend()

__all__ = ["FA4Backend", "BACKEND", "COPIES", "fa4_clc_off_reason", "split_candidates",
           "sm90_default_tile", "missing_kwargs", "family", "fwd_compile_cache_owners",
           "bwd_compile_cache_owners"]
