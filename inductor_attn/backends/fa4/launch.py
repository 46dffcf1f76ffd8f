"""A plan's launches: FA4's interface called with our tensors as the views it takes, and after one call of each
layout the compiled kernels it ran replayed directly (backends/replay.py)."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections import Counter

import torch

from ...layout import int32_contiguous, new_grads, new_outputs, tma_aligned
from ..base import AttnCall, Config
from ..block_bitmap import slot_table
from ..replay import Recording, Replay, Replays, checked_replay, quick_key
from . import loading
from .loading import FA4
from .rules import parse_tile

log = logging.getLogger(__name__)

# Input copies made because a tensor's layout did not suit FA4, by tensor name (see module docstring).
COPIES: Counter = Counter()


def _fa4_layout(x: torch.Tensor, name: str, transpose: bool) -> torch.Tensor:
    """(B, H, L, D) -> FA4's (B, L, H, D) as a view; a copy (counted, logged) only when FA4 would make one."""
    view = x.transpose(1, 2) if transpose else x
    if tma_aligned(view, broadcast_ok=True):
        return view
    COPIES[name] += 1
    log.info("flash-attn-4: copying %s %s (strides %s): last dim not contiguous, pointer or strides not "
             "16-byte aligned", name, tuple(x.shape), x.stride())
    return view.clone(memory_format=torch.contiguous_format)  # contiguous() keeps a misaligned pointer


def _as_fa4_takes(x: torch.Tensor | None) -> torch.Tensor | None:
    """``x``, or the copy FA4's ``maybe_contiguous`` (cute_dsl_utils, b36) would make of it (an unaligned
    pointer or layout): made here, so that every tensor a recorded kernel reads is one of our values or a
    buffer of FA4's own, never a copy that a replay would take for scratch."""
    if x is None or (x.is_contiguous() and x.data_ptr() % 16 == 0) or tma_aligned(x, broadcast_ok=True):
        return x
    return x.clone(memory_format=torch.contiguous_format)


def _window(call: AttnCall) -> tuple[int | None, int | None]:
    left = None if call.window_left < 0 else call.window_left
    right = 0 if call.causal else (None if call.window_right < 0 else call.window_right)
    return left, right



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



def knob_kwargs(cfg: Config) -> dict:
    kw = {}
    if cfg.get("tile_mn"):
        kw["tile_mn"] = parse_tile(cfg["tile_mn"])
    for key in ("mma_pv_is_rs", "intra_wg_overlap", "pack_gqa", "num_splits"):
        if cfg.get(key) is not None:
            kw[key] = cfg[key]
    return kw


def _sparse_kwargs(fa: FA4, call: AttnCall) -> dict:
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


def _forward_args(fa: FA4, knobs: dict, call: AttnCall, values: tuple):
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
    from these (:meth:`Recording.replay`)."""
    seqused = int32_contiguous(call.kv_seqlens)
    if call.op != "varlen":
        return (call.q.transpose(1, 2), call.k.transpose(1, 2), call.v.transpose(1, 2), out.transpose(1, 2), lse,
                seqused, None, None, None, None, call.scale)
    return (call.q, call.k, call.v, out, lse, seqused, int32_contiguous(call.cu_seqlens_q),
            int32_contiguous(call.cu_seqlens_k), call.max_seqlen_q, call.max_seqlen_k, call.scale)


def _buffers(call: AttnCall) -> tuple[torch.Tensor, torch.Tensor]:
    """A forward's empty (out, lse): out in q's stride order, lse (B, H, L), or (H, total) for varlen."""
    return new_outputs(call.op, call.q, call.v)


class ForwardLaunch:
    """A forward plan's launch. The first call of each layout goes through FA4's ``_flash_attn_fwd``
    (which compiles the kernel, or loads it from the disk cache) while :class:`Recording` notes the
    compiled object and the arguments it was called with; once that :class:`Replay` has reproduced the
    call (:func:`checked_replay`), it makes later calls: no key building, checks or heuristics per call
    (about 1,300 lines of Python in b36, against about 2 us for a launch of a compiled CuTe kernel,
    tritonbench #1002). A call whose recording holds more than one kernel or a tensor FA4 made itself
    (split-KV's combine, block-sparse and large-batch varlen scheduler tensors) keeps calling
    ``_flash_attn_fwd``."""

    def __init__(self, knobs: dict, clc: bool | None, label: str, thin: bool):
        self.knobs, self.clc, self.label, self.thin = knobs, clc, label, thin
        self.replays = Replays()

    def __call__(self, call: AttnCall):
        # read once: another thread may record a layout while this call runs (plans are shared per problem)
        recorded, known = bool(self.replays.by_layout), None
        if recorded:  # something was recorded (never, for a plan that is not thin): the quick key
            quick = quick_key((call.q, call.k, call.v, call.kv_seqlens, call.cu_seqlens_q, call.cu_seqlens_k),
                              (call.scale, call.max_seqlen_q, call.max_seqlen_k))
            known = self.replays.known.get(quick)
        if known is not None:  # the steady state: allocate, view, launch
            out, lse = known.outputs(call.q.device)
            known.replay(_call_values(call, out, lse))
            return out, lse
        out, lse = _buffers(call)
        values = _call_values(call, out, lse)
        if recorded:  # a layout recorded is one FA4 takes as it is (Replays): no layout checks
            replay = self.replays.get(values)
            if replay is not None:
                replay(values)
                self.replays.know(quick, replay, (out, lse))
                return out, lse
        return self._through_fa4(call, out, lse, values)

    def _through_fa4(self, call: AttnCall, out: torch.Tensor, lse: torch.Tensor, values: tuple):
        fa = loading.loaded()
        args, kw, values = _forward_args(fa, self.knobs, call, values)
        wanted = self.thin and self.replays.wants(values)
        recording = Recording(loading.fwd_compile_cache_owners(fa)) if wanted else None
        with (loading.clc_scheduler(fa.utils, self.clc), loading.dsl_errors(fa, self.label),
              recording or contextlib.nullcontext()):
            result = fa.interface._flash_attn_fwd(*args, **kw)
        # b36 returns (out, lse, ...) and writes the buffers we passed; take FA4's lse if it made its own
        got_lse = result[1] if isinstance(result, tuple) and len(result) > 1 else None
        if got_lse is not None and got_lse.data_ptr() != lse.data_ptr():
            lse = got_lse
        if recording is not None:
            fresh_out, fresh_lse = _buffers(call)
            fresh = (*args, *_call_values(call, fresh_out, fresh_lse)[3:])
            self.replays.add(values, checked_replay(recording.replay(values, scratch=False), fresh, (out, lse),
                                                    (fresh_out, fresh_lse), f"flash-attn-4 [{self.label}]"))
        return out, lse


class BackwardLaunch:
    """A backward plan's launch, recorded and replayed per layout as :class:`ForwardLaunch` does, where FA4
    writes into our dq, dk, dv (their layout suits it). b36's ``_flash_attn_bwd`` runs several compiled
    kernels (preprocess, the main kernel, postprocess conversions of the float32 accumulators) over buffers it
    allocates each call (accumulators, dpsum, lse in log2, semaphores when deterministic): a replay calls the
    same kernels in the same order and allocates those buffers again per call, zeroed where FA4 handed them
    over zeroed (:meth:`Recording.replay`)."""

    def __init__(self, deterministic: bool, label: str, thin: bool):
        self.deterministic, self.label, self.thin = deterministic, label, thin
        self.replays = Replays()

    def __call__(self, call: AttnCall, out, lse, grad_out, grad_lse):
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        recorded, known = bool(self.replays.by_layout), None  # read once, as in the forward
        if recorded:  # as in the forward: no quick key before something was recorded
            quick = quick_key((call.q, call.k, call.v, out, grad_out, lse, grad_lse, call.kv_seqlens,
                               call.cu_seqlens_q, call.cu_seqlens_k),
                              (call.scale, call.max_seqlen_q, call.max_seqlen_k))
            known = self.replays.known.get(quick)
        if known is not None:  # the steady state: allocate, view, launch
            grads = known.outputs(call.q.device)
            known.replay(_backward_values(call, call.q, call.k, call.v, out, grad_out, lse, grad_lse, grads,
                                          checked=False))
            _zero_unused_keys(call, grads)
            return tuple(grads)
        grads = new_grads(call.q, call.k, call.v)
        tensors = (call.q, call.k, call.v, out, grad_out, lse, grad_lse, grads)
        values, replay, into_ours, as_given = self._replayed(call, tensors, recorded)
        if replay is not None:
            replay(values)
            if as_given:
                self.replays.know(quick, replay, grads)
        else:
            self._through_fa4(call, values, grads, into_ours)
        _zero_unused_keys(call, grads)
        return tuple(grads)

    def _replayed(self, call: AttnCall, tensors: tuple, recorded: bool) -> tuple[tuple, Replay | None, bool, bool]:
        """(values, the replay recorded for their layout or None, whether FA4 writes into our grads, whether the
        values are the views of the tensors as given). Where a layout was ``recorded`` when the call began, the
        views alone are looked up first, with no checks: a layout recorded is one FA4 takes as it is. Else the
        values made what FA4 takes (copies where FA4 would make them), whose layout may have been recorded too."""
        if recorded:
            views = _backward_values(call, *tensors, checked=False)
            replay = self.replays.get(views)
            if replay is not None:
                return views, replay, True, True
        values = _backward_values(call, *tensors, checked=True)
        into_ours = all(f.data_ptr() == g.data_ptr() for f, g in zip(values[8:11], tensors[-1]))
        return values, self.replays.get(values) if into_ours and self.replays.by_layout else None, into_ours, False

    def _through_fa4(self, call: AttnCall, values: tuple, grads, into_ours: bool):
        fa = loading.loaded()
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
        recording = Recording(loading.bwd_compile_cache_owners(fa)) if wanted else None
        with loading.dsl_errors(fa, self.label), recording or contextlib.nullcontext():
            got = fa.interface._flash_attn_bwd(q, k, v, o, do, lse, **kw)[:3]
        for grad, fa_grad, result in zip(grads, fa_grads, got):
            if result.data_ptr() != fa_grad.data_ptr():  # FA4 made its own buffer
                grad.copy_(result.transpose(1, 2) if dense else result)
        if recording is not None:
            _zero_unused_keys(call, grads)
            fresh = new_grads(call.q, call.k, call.v)
            fresh_values = (*values[:8], *(_fa4_layout(g, "grad", dense) for g in fresh), *values[11:])
            self.replays.add(values, checked_replay(recording.replay(values, scratch=True), fresh_values, grads, fresh,
                                                    f"flash-attn-4 [{self.label}]",
                                                    after=lambda: _zero_unused_keys(call, fresh)))


def _backward_values(call: AttnCall, q, k, v, out, grad_out, lse, grad_lse, grads, checked: bool) -> tuple:
    """What a backward launch passes FA4: q, k, v, out, grad_out as (B, L, H, D) views (packed (total, H, D)
    for varlen), lse, grad_lse, seqused_k, dq, dk, dv; for varlen cu_seqlens_q/k and max_seqlen_q/k; the scale
    last. ``checked``: each made what FA4 takes, copies where FA4 would make them (:func:`_fa4_layout`,
    :func:`_as_fa4_takes`, :func:`~inductor_attn.layout.int32_contiguous`); else the views as they are, which
    serve where a replay was recorded for their layout (the checks read only what :func:`layout_key` keys on)."""
    dense = call.op != "varlen"
    names = ("q", "k", "v", "out", "grad_out", "grad", "grad", "grad")
    if checked:
        views = [_fa4_layout(x, name, dense) for x, name in zip((q, k, v, out, grad_out, *grads), names)]
        indices = [_as_fa4_takes(int32_contiguous(x)) for x in (call.kv_seqlens, call.cu_seqlens_q, call.cu_seqlens_k)]
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

