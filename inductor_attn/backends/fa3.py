"""FlashAttention-3's prebuilt Hopper forward (the ``tokenspeed-fa3`` wheel) as a candidate, bf16/fp16 and fp8.

What it is: the ``hopper/`` interface of Dao-AILab's FlashAttention-3 (``flash_attn_interface``), built for
sm_90a against torch's stable ABI and CUDA 13 and shipped as the ``tokenspeed-fa3`` wheel (Apache-2.0). Its
kernels are compiled ahead: the first import loads a 300 MB library (4.8 s on an H200, issue #53), and every
shape after that takes 1-12 ms, with no JIT. Its build (``flash_attn_config.CONFIG``, 3.0.0.post20260810) has no
backward, no softcap, head dims 64/128/192/256 with equal q/k and v dims, and fp8 e4m3, varlen, split-KV,
pack-GQA and local windows on. Facts about calls are from that version's ``flash_attn_interface.py``.

Knobs: ``num_splits`` (split-KV: 1, plus a few where the (batch, kv head, m-block) tiles leave SMs idle and the keys
are long, :func:`split_candidates`; there also 0, FA3's own heuristic, which may pick a count between ours or split
dynamically per tile: on an H200 it beat our best fixed FA3 split by 2-8% at B8 paged decode and chunked prefill in
one run, and trailed it by 0-15% at B8 decode in two later ones, 2026-11-29) and ``pack_gqa`` (GQA heads packed into
the m dimension; True and False where Hq != Hkv). FA3 turns packing on whenever it splits (``PackGQA = PackGQA_ ||
... || Split`` in its ``run_mha_fwd``), so a split config with ``pack_gqa=False`` would time the same kernel twice
and is left out.

The call goes straight to the op the interface wraps, ``torch.ops.flash_attn_3.fwd``, with its 35 positional
arguments in the interface's order (checked against the op's schema at load), not through the interface's
``flash_attn_func`` (a custom op inside an autograd Function: 89 us of host per call against the op's 27, H200,
2026-11-30). The launch's own Python costs about as much again: on one H200 host the op took 44 us, this plan's
launch 82 (the transposed views and the out allocation 19 us of it, their TMA checks 15) and the launch op that
compiled code calls 103 (2026-11-30). Compiled code cannot trace the op instead: its schema returns its
``out`` argument aliased (``Tensor(out!)``), which functionalization refuses.
Our out buffer is passed in (FA3 writes it in place, as (B, L, H, D) views of our layout); FA3 allocates the lse,
(B, H, Lq) or (H, total_q) float32 as our ops' contract has it (layout.py), so another library's backward takes it
as it is. One difference: a row that no key may attend gets lse = +inf from FA3's non-split epilogue
(``softmax.h``: ``Split ? -INFINITY : INFINITY``) and -inf in our contract; problems that can have such rows
(causal with Lq > Lk, windows, kv_seqlens, varlen, paged) turn +inf into -inf (:func:`_empty_rows_minus_inf`).

Layout: q, k, v reach FA3 as (B, L, H, D) transpose views (packed (total, H, D) for varlen). FA3 loads them with
TMA, which needs a contiguous last dim, 16-byte aligned pointer and 16-byte multiples for every other stride; a
tensor that is not so is copied (:func:`_as_fa3_takes`).

Paged caches (``paged_attention``): FA3's paged forward (what ``flash_attn_with_kvcache`` with a ``page_table``
calls) takes the pools as they are, (num_blocks, page_size, Hkv, D) with any strides but a contiguous last dim
(FlashInfer's HND is such a view), the block table and ``kv_seqlens`` as ``seqused_k``; decode queries as
(B, 1, H, D), chunks packed by ``cu_seqlens_q``. FA3 reads such pages with TMA only where ``page_size`` is a
multiple of its key tile and a sequence has more than 128 query rows (queries x GQA ratio; ``get_pagedkv_tma``
in its ``flash_api.cpp``); otherwise with predicated loads, which left NaN past a length and -1 in the table past
a sequence's last page out of its outputs (H200: the paged suite's NaN probe, tests/test_paged_gpu.py). The TMA
form is the one whose dense sibling leaks 0 * NaN from its last tile, so problems that could take it (more
than 128 query rows per sequence) are refused. The predicated path always packs GQA heads, so paged configs vary
``num_splits`` only.

Errors: FA3's checks are C++ ``STD_TORCH_CHECK``s, which reach Python as RuntimeError: the tuner's
``CANDIDATE_ERRORS`` already count those as "cannot run here", so its ``library`` declares no errors.
"""

from __future__ import annotations

import functools
import importlib.metadata
from dataclasses import dataclass

import torch

from ..device import DeviceInfo
from ..layout import conform, int32_contiguous, new_out, tma_aligned
from ..problem import Problem, next_power_of_two
from .base import AttnCall, Backend, Candidate, Config, Library, Plan, Takes

DISTRIBUTION = "tokenspeed-fa3"
NOT_INSTALLED = f"{DISTRIBUTION} not installed (pip install 'inductor-attn[fa3]')"
HEAD_DIMS = (64, 128, 192, 256)  # FLASHATTENTION_DISABLE_HDIM96 and both HDIMDIFF flags are set in its build
DTYPES = ("bfloat16", "float16", "float8_e4m3fn")
FWD_ARGUMENTS = 35  # flash_attn_3::fwd as _flash_attn_forward calls it (3.0.0.post20260810), ``sinks`` last
# Tiles of FA3's sm_90 forward, for counting how many CTAs a problem fills (tile_size_fwd_sm90: 128-row m-blocks
# for the head dims here, n-blocks of 80-176 keys; 128 is the middle)
_BLOCK_M, _BLOCK_N = 128, 128
_MAX_SPLITS = 128  # FA3's num_splits_heuristic caps at 128 too


@dataclass(frozen=True)
class _FA3:
    """The loaded library: its forward op, version and build flags (``flash_attn_config.CONFIG``)."""

    fwd: object
    version: str
    build_flags: dict


@functools.cache
def _load() -> _FA3 | str:
    """Import tokenspeed-fa3 once (loads its 300 MB library); the reason in words if it cannot be used."""
    try:
        import flash_attn_interface  # noqa: F401  (registers torch.ops.flash_attn_3)
        from flash_attn_config import CONFIG
    except ModuleNotFoundError as err:
        if err.name and err.name.split(".")[0] in ("flash_attn_interface", "flash_attn_3", "flash_attn_config"):
            return NOT_INSTALLED
        return f"{DISTRIBUTION} not importable: {err}"
    except (ImportError, OSError, RuntimeError) as err:  # a wheel built for another CUDA or torch ABI
        return f"{DISTRIBUTION} not importable: {type(err).__name__}: {str(err)[:200]}"
    try:
        version = importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    fwd = torch.ops.flash_attn_3.fwd.default
    count = len(fwd._schema.arguments)
    if count != FWD_ARGUMENTS:
        return (f"{DISTRIBUTION} {version}: flash_attn_3::fwd takes {count} arguments, this backend passes the "
                f"{FWD_ARGUMENTS} of 3.0.0.post20260810")
    return _FA3(fwd, version, dict(CONFIG.get("build_flags", {})))


def refuses_device(device_type: str, dev: DeviceInfo) -> str | None:
    """Why no FA3 kernel can run on this device (the wheel is built for CUDA sm_90a only), or None."""
    if device_type != "cuda":
        return "needs a CUDA device"
    if dev.arch != 90:
        return f"{DISTRIBUTION} is built for sm_90a only, got sm_{dev.arch}"
    return None


def unavailable(device_type: str, dev: DeviceInfo) -> str | None:
    """Why FA3 cannot run on this device whatever the problem: the device, else the wheel's import (its 300 MB
    load, done once). None means ``flash_attn_interface`` imports."""
    reason = refuses_device(device_type, dev)
    if reason is not None:
        return reason
    loaded = _load()
    return loaded if isinstance(loaded, str) else None


def split_candidates(p: Problem, sm_count: int) -> list[int]:
    """``num_splits`` values worth measuring: 1, plus the split that fills the SMs with the (batch, kv head,
    m-block) tiles (GQA heads packed into the m dimension, as FA3 does when it splits) and its half and quarter,
    when the tiles leave over a fifth of the SMs idle (FA3's own heuristic splits below 80% occupancy) and every
    split keeps two or more n-blocks of keys.

    >>> dec = Problem("attention", "bfloat16", "cuda", 1, 16, 2, 1, 16384, 256, 256)
    >>> split_candidates(dec, 132), split_candidates(Problem("attention", "bfloat16", "cuda", 4, 32, 8, 4096, 4096,
    ...                                                       128, 128), 132)
    ([1, 16, 32, 64], [1])
    """
    tiles = p.batch * p.heads_kv * -(-p.len_q * p.gqa_ratio // _BLOCK_M)
    n_blocks = -(-p.len_k // _BLOCK_N)
    if tiles >= 0.8 * sm_count:
        return [1]
    fill = min(sm_count // tiles, n_blocks // 2, _MAX_SPLITS)
    return sorted({1, *(s for s in (fill, fill // 2, fill // 4) if s >= 2)})


class FA3Backend(Backend):
    """Forward only; compiled code runs the plan's launch through the thin op (no traced form: a C++ op)."""

    name = "fa3"
    knobs = {"num_splits": int, "pack_gqa": bool}
    takes = Takes(ops=("attention", "varlen", "block_sparse", "paged"), fp8=True)
    # supports() imports flash_attn_interface, which loads a 300 MB library: 4 s the first time after installing
    # it, 0.02 s later (H200, 2026-11-29)
    library = Library(distributions=(DISTRIBUTION,), costly_import=True, load=_load, prebuilt=True)

    def supports(self, p: Problem, dev: DeviceInfo, direction: str = "forward") -> str | None:
        reason = refuses_device(p.device_type, dev)
        if reason is not None:
            return reason
        if p.op == "block_sparse":
            return f"{DISTRIBUTION} takes no block-sparse masks"
        if p.dtype not in DTYPES:
            return f"{DISTRIBUTION} takes {', '.join(DTYPES)}, got {p.dtype}"
        if p.op == "paged":
            rows = next_power_of_two(p.len_q) * p.gqa_ratio  # the bucket's most, so every call of it is covered
            if rows > _BLOCK_M:
                return (f"{DISTRIBUTION} may load pages with TMA where a sequence has over {_BLOCK_M} query rows "
                        f"(queries x GQA ratio, up to {rows} here), a form that is not gated against keys past a "
                        "length")
        # measured on an H200 (3.0.0.post20260810, bf16; tests/test_fa3_gpu.py): like FA4's sm_90 kernels, FA3 is
        # told kv_seqlens as seqused_k, yet multiplies the zero weights of its last tile's keys past a length by their
        # values, and its varlen tiles run into the next sequence's keys: 0 * NaN reaches the output
        elif p.has_kv_seqlens:
            return (f"{DISTRIBUTION} multiplies the zero weights of keys past kv_seqlens by their values in its last "
                    "tile: 0 * NaN (an unwritten cache slot) reaches the output")
        if p.op == "varlen":
            return (f"{DISTRIBUTION}'s varlen kernel reads the keys after a sequence's end in its last tile: NaN in "
                    "the next sequence (padding between sequences) reaches the output")
        if p.head_dim != p.head_dim_v or p.head_dim not in HEAD_DIMS:
            return (f"{DISTRIBUTION} is built for head dims {', '.join(map(str, HEAD_DIMS))} with equal q/k and v "
                    f"dims, got ({p.head_dim}, {p.head_dim_v})")
        fa = _load()
        if isinstance(fa, str):
            return fa
        flags = fa.build_flags
        needs = {"FLASHATTENTION_DISABLE_FP8": p.dtype == "float8_e4m3fn",
                 "FLASHATTENTION_DISABLE_FP16": p.dtype == "float16",
                 "FLASHATTENTION_DISABLE_LOCAL": p.window_left >= 0 or p.window_right >= 0}
        lost = [flag for flag, needed in needs.items() if needed and flags.get(flag)]
        if lost:
            return f"{DISTRIBUTION} {fa.version} was built with {', '.join(lost)}"
        return None

    def configs(self, p: Problem, dev: DeviceInfo, direction: str = "forward") -> list[Candidate]:
        # Where the tiles leave SMs idle: FA3's own heuristic first, then the most splits. The staged search
        # measures a backend's first config before it expands the rest, and an unsplit first config read 1.43x the
        # best at B8 H32/8 paged decode, so FA3's faster split forms were never timed (H200)
        splits = sorted(split_candidates(p, dev.sm_count), reverse=True)
        own = [Config.of(num_splits=0)] if len(splits) > 1 else []
        if p.gqa_ratio == 1 or p.op == "paged":  # paged: the predicated path packs GQA heads (module doc)
            cfgs = own + [Config.of(num_splits=s) for s in splits]
        else:
            # unsplit, FA3's own pick first (should_pack_gqa: packing when it fills the m-blocks better, as at decode)
            packs = (True, False) if p.len_q < _BLOCK_M else (False, True)
            cfgs = own + [Config.of(num_splits=s, pack_gqa=True) for s in splits if s > 1]
            cfgs += [Config.of(num_splits=1, pack_gqa=pack) for pack in packs]
        return [Candidate(self.name, c, self._pruned(c)) for c in cfgs]

    def _pruned(self, cfg: Config) -> str | None:
        fa = _load()
        flags = {} if isinstance(fa, str) else fa.build_flags
        if cfg.get("num_splits", 1) != 1 and flags.get("FLASHATTENTION_DISABLE_SPLIT"):
            return f"{DISTRIBUTION} was built with FLASHATTENTION_DISABLE_SPLIT"
        if cfg.get("pack_gqa") and flags.get("FLASHATTENTION_DISABLE_PACKGQA"):
            return f"{DISTRIBUTION} was built with FLASHATTENTION_DISABLE_PACKGQA"
        return None

    def plan(self, p: Problem, dev: DeviceInfo, cfg: Config, direction: str) -> Plan:
        if direction != "forward":
            raise NotImplementedError(f"{DISTRIBUTION} is built without a backward")
        fa = _load()
        if isinstance(fa, str):
            raise RuntimeError(fa)
        num_splits = int(cfg.get("num_splits", 1))
        if p.op == "paged":
            return Plan(_PagedLaunch(fa.fwd, num_splits))
        return Plan(_ForwardLaunch(fa.fwd, p, num_splits, cfg.get("pack_gqa")))


def _as_fa3_takes(x: torch.Tensor, transpose: bool) -> torch.Tensor:
    """(B, H, L, D) -> FA3's (B, L, H, D) as a view (packed tensors as they are), copied where TMA cannot load it:
    the last dim not contiguous, the pointer or another stride not a multiple of 16 bytes, or a broadcast dim."""
    view = x.transpose(1, 2) if transpose else x
    if tma_aligned(view, broadcast_ok=False):
        return view
    return view.clone(memory_format=torch.contiguous_format)  # contiguous() would keep a misaligned pointer


class _ForwardLaunch:
    """One plan's launch: q, k, v (and out) as FA3 takes them, then ``flash_attn_3::fwd`` with the arguments this
    plan fixed. fp8 calls pass the descales (shape (B, Hkv), any strides) and get bfloat16 from FA3, converted to
    the call's ``out_dtype`` where that is another."""

    def __init__(self, fwd, p: Problem, num_splits: int, pack_gqa: bool | None):
        self.fwd, self.num_splits, self.pack_gqa = fwd, num_splits, pack_gqa
        self.dense = p.op != "varlen"
        self.empty_rows = p.may_have_empty_rows  # FA3 gives such rows lse +inf, our contract -inf
        self.fp8 = p.dtype == "float8_e4m3fn"

    def __call__(self, call: AttnCall):
        dense = self.dense
        q, k, v = (_as_fa3_takes(x, dense) for x in (call.q, call.k, call.v))
        out_dtype = torch.bfloat16 if self.fp8 else call.q.dtype  # what FA3 writes
        out = new_out(call.q, call.v, out_dtype)
        fa_out = out.transpose(1, 2) if dense else out
        if fa_out.stride(-1) != 1:
            fa_out = None  # q's layout has no contiguous head dim: FA3 allocates, conform() copies below
        descales = call.descale if self.fp8 else (None, None, None)
        cu_seqlens = (call.cu_seqlens_q, call.cu_seqlens_k)
        varlen = (None, None) if dense else [int32_contiguous(cu) for cu in cu_seqlens]
        lengths = (None, None) if dense else (call.max_seqlen_q, call.max_seqlen_k)
        got, lse = _fwd(self.fwd, call, q, k, v, fa_out, cu_seqlens=varlen, max_seqlens=lengths, descales=descales,
                        num_splits=self.num_splits, pack_gqa=self.pack_gqa)
        if fa_out is None:
            out = conform(got.transpose(1, 2) if dense else got, call.q)
        if self.empty_rows:
            _empty_rows_minus_inf(lse)
        if self.fp8 and call.out_dtype != out_dtype:
            out = out.to(call.out_dtype)
        return out, lse


class _PagedLaunch:
    """A paged call's launch: FA3's paged forward on the call's pools, block table and lengths (module doc). A
    decode call (no ``cu_seqlens_q``) goes as (B, 1, H, D) and its lse, FA3's (B, H, 1), is written into the ops'
    (H, total_q); a pool whose last dim is not contiguous is copied whole (FA3 needs it, and the API takes any
    strides: slow, but such a pool is rare)."""

    def __init__(self, fwd, num_splits: int):
        self.fwd, self.num_splits = fwd, num_splits

    def __call__(self, call: AttnCall):
        decode = call.cu_seqlens_q is None
        k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (call.k, call.v))
        table = call.block_table if call.block_table.stride(-1) == 1 else call.block_table.contiguous()
        out = new_out(call.q, call.v)
        q, fa_out = (x.unsqueeze(1) for x in (call.q, out)) if decode else (call.q, out)
        q = _as_fa3_takes(q, transpose=False)  # FA3 loads q by TMA here too (a view of a fused projection may not suit)
        if fa_out.stride(-1) != 1:
            fa_out = None  # FA3 allocates, conform() copies below
        cu_seqlens_q = None if decode else int32_contiguous(call.cu_seqlens_q)
        max_seqlen_q = None if decode else call.max_seqlen_q
        got, lse = _fwd(self.fwd, call, q, k, v, fa_out, cu_seqlens=(cu_seqlens_q, None),
                        max_seqlens=(max_seqlen_q, None), page_table=table, num_splits=self.num_splits)
        if fa_out is None:
            out = conform(got.squeeze(1) if decode else got, call.q)
        # a sequence of length 0, or a window that leaves a row no key; a decode call's lse, FA3's (B, H, 1), is
        # written as the ops' (H, total_q) by the same kernel: one kernel less per call than a copy, then the fix
        fixed = lse.new_empty(lse.shape[1], lse.shape[0]) if decode else lse
        _empty_rows_minus_inf(lse.squeeze(-1).t() if decode else lse, out=fixed)
        return out, fixed


def _fwd(fwd, call: AttnCall, q, k, v, out, *, cu_seqlens=(None, None), max_seqlens=(None, None), page_table=None,
         descales=(None, None, None), num_splits: int, pack_gqa: bool | None = None):
    """``flash_attn_3::fwd`` with its :data:`FWD_ARGUMENTS` positional arguments in the interface's order (no new
    keys, qv, rotary, kv_batch_idx, leftpad, scheduler metadata, softcap or sinks); ``(out, lse)``."""
    return fwd(q, k, v, None, None, None, out, *cu_seqlens, None, None, int32_contiguous(call.kv_seqlens),
               *max_seqlens, page_table, None, None, None, None, None, *descales, call.scale, call.causal,
               call.window_left, call.window_right, 0, 0.0, True, None, num_splits, pack_gqa, 0, None)[:2]


def _empty_rows_minus_inf(lse: torch.Tensor, out: torch.Tensor | None = None) -> None:
    """FA3's +inf lse of a row that sees no key as the ops' contract has it, -inf, in place or into ``out`` (one
    kernel; NaN and -inf stay as they are, so a leak still shows)."""
    torch.nan_to_num(lse, nan=float("nan"), posinf=float("-inf"), neginf=float("-inf"), out=lse if out is None else out)


BACKEND = FA3Backend()

__all__ = ["FA3Backend", "BACKEND", "DISTRIBUTION", "NOT_INSTALLED", "HEAD_DIMS", "refuses_device", "split_candidates",
           "unavailable"]
