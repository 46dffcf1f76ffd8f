"""Public functions: argument normalisation and value checks in front of the custom ops."""

from __future__ import annotations

import torch

from . import _compat
from .backends import AttnCall, Candidate, enumerate_candidates
from .device import device_info
from .layout import conform
from .ops import BlockSparseMask, attention_op, block_sparse_attention_op, varlen_attention_op
# The checks by name, not through their module: Dynamo reaches the module from the checks' own globals too, and
# one object reached two ways gets a guard evaluated in Python on every compiled call.
from .ops.checks import (KV_SEQLENS_VALUES, MAX_INT32, PAGED_BLOCK_IDS, PAGED_KV_SEQLENS_VALUES, assert_cu_seqlens,
                         check_attention, check_attention_values, check_block_sparse, check_block_sparse_values,
                         check_bool, check_kv_seqlens, check_paged, check_paged_values, check_scale, check_softcap,
                         check_varlen, check_varlen_values, check_window, device_message, fail, refuse_forward_ad,
                         refuse_grad, refuse_to_trace)
from .problem import default_scale
from .runtime import CHECKED

# The compiled kv_seqlens check as the traced path writes it: the builtin and its text, read from this module alone.
_device_assert = _compat.assert_async
_KV_SEQLENS_ASSERT = device_message(KV_SEQLENS_VALUES)
_PAGED_SEQLENS_ASSERT, _PAGED_IDS_ASSERT = (device_message(m) for m in (PAGED_KV_SEQLENS_VALUES, PAGED_BLOCK_IDS))
# The op's overload, one guard where its CustomOpDef (attention_op) costs Dynamo four
_ATTENTION = torch.ops.inductor_attn.attention.default
_PAGED = torch.ops.inductor_attn.paged_attention.default
_VARLEN = torch.ops.inductor_attn.varlen_attention.default
# The ops' SymInt arguments are int64: a traced fast path sends a larger int to the checked path, whose message
# names it (_decided: a size read with .item() has no value while tracing).
_INT64_BOUND = 2 ** 63
# Page layouts: how a pool's dims are ordered. HND pools (FlashInfer's) are viewed as NHD: the kernels take strides.
PAGE_LAYOUTS = {"NHD": "(num_blocks, page_size, kv_heads, head_dim)",
                "HND": "(num_blocks, kv_heads, page_size, head_dim)"}


def _decided(expr) -> bool:
    """_compat.guard_or_false for the traced fast paths, where Dynamo has imported it: reached through this module's
    ``torch`` (through _compat's, Dynamo would guard the two paths' sameness in Python on every call)."""
    return torch.fx.experimental.symbolic_shapes.guard_or_false(expr)


def checked() -> str:
    """The op's ``choice`` for a call whose arguments this module has checked: eagerly ``CHECKED``, so that the op
    does not check them a second time (about 6 us of Python per paged call on a fast CPU); while Dynamo traces,
    ``""``, a user call that the lowering decides (the fake impl checks it then)."""
    return "" if torch.compiler.is_compiling() else CHECKED


def _window(window, causal: bool) -> tuple[int, int]:
    """``None`` -> unbounded; ``w`` -> (w, 0) if causal else (w, w); ``(left, right)`` as given."""
    if window is None:
        return -1, -1
    if isinstance(window, int) and not isinstance(window, bool):
        if window < 0:
            fail(ValueError, f"window must be >= 0 (or None for unbounded), got {window}")
        if window > MAX_INT32:
            fail(ValueError, f"window must be at most {MAX_INT32} (None is unbounded), got {window}")
        return (window, 0) if causal else (window, window)
    if isinstance(window, (tuple, list)) and len(window) == 2:
        left, right = window
        # plain ints in range need no check_window, whose `torch` would cost a traced call a guard in Python
        if not (type(left) is int and type(right) is int and -1 <= left <= MAX_INT32 and -1 <= right <= MAX_INT32):
            check_window(left, right)
        return left, right
    # torch.compile traces a NumPy scalar as an array, whose repr it cannot take
    traced_numpy = torch.compiler.is_compiling() and type(window).__module__ == "numpy"
    traced_tensor = torch.compiler.is_compiling() and isinstance(window, torch.Tensor)  # no repr while traced
    got = (f"{type(window).__name__}; in compiled code pass int(window)" if traced_numpy
           else "a Tensor" if traced_tensor else repr(window))
    fail(TypeError, f"window must be None, an int or a (left, right) pair of ints, got {got}")


def _traced_arguments(causal, return_lse, check_indices, scale, window) -> tuple[int, int]:
    """The traced fast paths' checks of what no fake impl sees (the flags, a scale that is not a float: a float's
    value is the fake impl's to check) and the window as (left, right). A flag that is a bool and the default window
    call no helper: each helper is a guard on every compiled call."""
    for name, flag in (("causal", causal), ("return_lse", return_lse), ("check_indices", check_indices)):
        if flag is not True and flag is not False:
            check_bool(name, flag)
    if scale is not None and type(scale) is not float:
        check_scale(scale)
    return (-1, -1) if window is None else _window(window, causal)


def _scale(scale, q) -> float:
    """The checked ``scale`` (check_scale) as a float; None -> default_scale(head_dim)."""
    if scale is None:
        return default_scale(q.shape[-1])
    return scale if isinstance(scale, torch.SymFloat) else float(scale)


def _longest(cu_seqlens: torch.Tensor, name: str) -> int:
    """The longest sequence of packed offsets (a read of the device where they live): for ``name`` (max_seqlen_q
    or max_seqlen_k) not given, which compiled code cannot read without a graph break."""
    refuse_to_trace(ValueError, f"{name} is None: it is read from the cu_seqlens values, a graph break in compiled "
                                f"code; under fullgraph=True pass {name}")
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max())


# What a fullgraph compile of a call with a BlockMask reads first (a graph break is what Dynamo would say)
_BLOCK_MASK_TRACED = ("block_mask: a flex_attention BlockMask is converted by running its mask_mod, a graph break; "
                      "under fullgraph=True convert it first, outside the compiled function: "
                      "inductor_attn.BlockSparseMask.from_block_mask(block_mask, batch=B, heads=H) with q's batch "
                      "and head counts")


@torch.compiler.disable
def _convert_block_mask(block_mask, batch: int, heads: int) -> BlockSparseMask:
    # A graph break under torch.compile (refused under fullgraph=True with _BLOCK_MASK_TRACED): the bitmaps
    # come from running the mask_mod. The result is kept on the BlockMask, so a mask reused across layers is
    # converted once; a mask shared over a dim its mask_mod reads (BlockSparseMask.from_block_mask) once per
    # batch and head count as well, built per row or head.
    converted = getattr(block_mask, "_inductor_attn_sparse", None)
    if converted is None:
        converted = block_mask._inductor_attn_sparse = {None: BlockSparseMask.from_block_mask(block_mask)}
    if not converted[None].shared_but_read:
        return converted[None]
    if (batch, heads) not in converted:
        converted[(batch, heads)] = BlockSparseMask.from_block_mask(block_mask, batch, heads)
    return converted[(batch, heads)]


def _as_sparse(block_mask, q, k) -> BlockSparseMask:
    from torch.nn.attention.flex_attention import BlockMask

    if not isinstance(block_mask, (BlockMask, BlockSparseMask)):
        fail(
            TypeError,
            f"block_mask must be a torch.nn.attention.flex_attention.BlockMask or an inductor_attn.BlockSparseMask, "
            f"got {type(block_mask).__name__}"
        )
    lengths = block_mask.seq_lengths
    if not (isinstance(lengths, (tuple, list)) and len(lengths) == 2
            and all(isinstance(x, (int, torch.SymInt)) and not isinstance(x, bool) for x in lengths)):
        fail(TypeError, f"block_mask.seq_lengths must be a (Q_LEN, KV_LEN) pair of ints, got {lengths!r}")
    lengths = tuple(lengths)
    if lengths != (q.shape[2], k.shape[2]):
        fail(
            ValueError,
            f"block_mask was built for (Q_LEN, KV_LEN) = {lengths}, but q/k have lengths ({q.shape[2]}, {k.shape[2]})"
        )
    if isinstance(block_mask, BlockMask):
        refuse_to_trace(TypeError, _BLOCK_MASK_TRACED)
        return _convert_block_mask(block_mask, q.shape[0], q.shape[1])
    return block_mask


def make_call(q, k, v, *, causal: bool = False, scale: float | None = None, window=None,
              kv_seqlens: torch.Tensor | None = None, key_mask: torch.Tensor | None = None,
              block_mask=None, check_indices: bool = True) -> AttnCall:
    """Check and normalise :func:`attention`'s arguments into the call that backends run."""
    check_bool("causal", causal)
    if block_mask is not None:
        if causal or window is not None or kv_seqlens is not None or key_mask is not None:
            fail(ValueError, "block_mask already encodes the mask: leave causal, window, kv_seqlens and "
                             "key_mask unset")
        check_attention(q, k, v, scale, -1, -1, None, allow_empty=True)
        scale = _scale(scale, q)
        if _zero_size(q.shape[:3] + k.shape[2:3]):  # attention() answers it with no kernel: nothing to mask
            return AttnCall("attention", q, k, v, scale)
        sparse = _as_sparse(block_mask, q, k)
        check_block_sparse(q, k, v, sparse, scale)
        if check_indices:
            check_block_sparse_values(k, sparse)
        return AttnCall("block_sparse", q, k, v, scale, sparse=sparse)
    left, right = _window(window, causal)
    check_attention(q, k, v, scale, left, right, kv_seqlens, key_mask, allow_empty=True)
    scale = _scale(scale, q)
    if check_indices:
        check_attention_values(k, kv_seqlens)
    return AttnCall("attention", q, k, v, scale, causal, left, right, kv_seqlens, key_mask=key_mask)


def attention(q, k, v, *, causal: bool = False, scale: float | None = None, window=None,
              kv_seqlens: torch.Tensor | None = None, key_mask: torch.Tensor | None = None, block_mask=None,
              return_lse: bool = False, check_indices: bool = True):
    """Scaled dot-product attention on the fastest correct kernel for this shape.

    Args:
        q: (B, Hq, Lq, D); k: (B, Hkv, Lk, D); v: (B, Hkv, Lk, Dv). Any strides. Hq must be a multiple
            of Hkv (GQA/MQA). fp16, bf16, fp32 (fp64 runs on the reference only). 8 <= D, Dv <= 256.
        causal: lower-right aligned when Lq != Lk: query i sees keys j <= i + Lk - Lq (FlashAttention's
            convention; with ``kv_seqlens`` the alignment uses each batch's own length).
        scale: softmax scale, default ``1 / sqrt(D)``: a float, int or NumPy real scalar.
        window: sliding window. ``w`` keeps keys within w positions before the (aligned) diagonal, and
            after it too unless causal; ``(left, right)`` sets both sides, -1 = unbounded (with ``causal``
            the right side is 0 whatever is given, as in FlashAttention).
        kv_seqlens: int32 (B,): only the first ``kv_seqlens[b]`` keys of batch b are valid (KV cache). Keys
            and values past a length never reach an output or a gradient, whatever they hold (NaN in an
            unwritten cache slot included), and get zero gradients; backends that cannot keep this are pruned.
        key_mask: bool (B, Lk), any strides: key j of batch b may be attended only where True (a padding
            mask, or a decode mask with left padding). Combines with the arguments above; it does not
            move the causal/window alignment. Runs on sdpa, triton_decode and reference. Masked keys and
            values must hold finite values, as in SDPA (a left-padded batch's pad tokens do): the output is
            the same whatever finite values they hold, but a NaN or inf there may reach it (masked keys
            still get weight 0 in P @ V). For memory that may hold anything, use ``kv_seqlens``.
        block_mask: a flex_attention ``BlockMask`` (or ``BlockSparseMask``); it carries the whole mask,
            so causal/window/kv_seqlens/key_mask must be left unset.
        return_lse: also return the float32 log-sum-exp (B, Hq, Lq).
        check_indices: check the values of ``kv_seqlens`` (in [0, Lk]) and of a ``BlockSparseMask``'s block
            lists (counts within their slots, listed kv blocks within Lk): eagerly with a device sync and a
            ValueError, in compiled code with device-side asserts. False skips both.

    Fully masked query rows give zeros and lse = -inf. Zero sizes (B, Hq, Lq or Lk of 0) run no kernel:
    empty outputs, or with Lk = 0 zeros and lse = -inf.
    """
    if (block_mask is None and torch.compiler.is_compiling() and isinstance(q, torch.Tensor)
            and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) and q.dim() == k.dim() == v.dim() == 4
            and q.layout == k.layout == v.layout == torch.strided  # nested ones: their sizes are no ints
            and q.is_floating_point() and q.element_size() > 1 and q.dtype == k.dtype == v.dtype
            and (kv_seqlens is None or isinstance(kv_seqlens, torch.Tensor))
            and (key_mask is None or isinstance(key_mask, torch.Tensor) and key_mask.dtype == torch.bool)
            and q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] != 0):
        # Traced by Dynamo, which guards every global and function a compiled call passes through and checks
        # those guards on every call, in Python where one object is reached two ways (ops/checks.py's `torch` and
        # this module's): the op's fake impl makes the structural checks (check_attention, with the same
        # messages), and _traced_arguments the rest. Zero sizes (which never reach the op), and arguments of the
        # wrong type, rank or dtype (fp8 among them: one byte), take the checked path: a TypeError raised in a fake
        # impl is logged with a traceback by FakeTensorMode before it reaches the user, and a rank below 3 cannot
        # be indexed.
        left, right = _traced_arguments(causal, return_lse, check_indices, scale, window)
        if kv_seqlens is not None and check_indices:  # the values' device-side assert goes before the kernel
            if kv_seqlens.dtype != torch.int32 or kv_seqlens.shape != (q.shape[0],) or kv_seqlens.device != q.device:
                # its message while tracing, before the assert exists: a graph break at the op would run an
                # already compiled assert on lengths of the wrong kind first (and stop a CUDA context)
                check_kv_seqlens(q, kv_seqlens)
            _device_assert(((kv_seqlens >= 0) & (kv_seqlens <= k.shape[2])).all(), _KV_SEQLENS_ASSERT)
        out, lse = _ATTENTION(q, k, v, _scale(scale, q), causal, left, right, kv_seqlens, key_mask, "")
        return (out, lse) if return_lse else out
    check_bool("return_lse", return_lse)
    check_bool("check_indices", check_indices)
    refuse_forward_ad("attention", {"q": q, "k": k, "v": v})
    call = make_call(q, k, v, causal=causal, scale=scale, window=window, kv_seqlens=kv_seqlens,
                     key_mask=key_mask, block_mask=block_mask, check_indices=check_indices)
    if _zero_size(q.shape[:3] + k.shape[2:3]):
        out, lse = _zero_size_result(q, k, v)
    else:
        out, lse = _run(call, checked())
    return (out, lse) if return_lse else out


def _as_documents(call: AttnCall) -> AttnCall | None:
    """A block-sparse call whose mask is packed documents (``BlockSparseMask.documents``) as varlen attention
    over (B * L, H, D) views of q, k, v; None where the mask is not, or a view cannot pack a tensor (its
    batch stride is not L rows). Varlen kernels then run the same tiles without loading the partial blocks'
    bitmaps, and FA4 has a varlen backward but no block-sparse one here."""
    docs = call.sparse.documents if call.op == "block_sparse" else None
    if docs is None:
        return None
    batch, length = call.q.shape[0], call.q.shape[2]
    if any(batch > 1 and x.stride(0) != length * x.stride(2) for x in (call.q, call.k, call.v)):
        return None
    q, k, v = (x.transpose(1, 2).flatten(0, 1) for x in (call.q, call.k, call.v))
    cu = docs.cu_seqlens
    if call.sparse.kv_num_blocks.shape[0] < batch:  # one mask row for every batch row
        starts = cu[:-1] + length * torch.arange(batch, device=cu.device, dtype=cu.dtype)[:, None]
        cu = torch.cat([starts.flatten(), cu.new_tensor([batch * length])])
    return AttnCall("varlen", q, k, v, call.scale, docs.causal, cu_seqlens_q=cu, cu_seqlens_k=cu,
                    max_seqlen_q=docs.max_seqlen, max_seqlen_k=docs.max_seqlen)


def _run(call: AttnCall, choice: str = ""):
    """(out, lse) of the call, packed documents run as varlen (:func:`_as_documents`)."""
    packed = _as_documents(call)
    if packed is None:
        return _call_op(call, choice)
    out, lse = _call_op(packed, choice)
    b, h, length = call.q.shape[:3]
    # lse (H, B * L) -> (B, H, L), contiguous as every other call's (a copy of B * H * L floats when B > 1)
    return out.unflatten(0, (b, length)).transpose(1, 2), lse.unflatten(1, (b, length)).transpose(0, 1).contiguous()


def _zero_size(sizes) -> bool:
    return any(size == 0 for size in sizes)


def _zero_size_result(q, k, v):
    """(out, lse) of a call with a zero size: the output is empty, or with no keys every row is fully masked
    (zeros, lse = -inf). The two matmuls contract over a zero-size dim or produce an empty tensor, so they
    cost nothing and keep autograd connected to q, k and v (whose gradients are zeros); the lse too, as the sum
    of no scores, so that a loss on it alone can be differentiated as with ``kv_seqlens`` of 0."""
    b, hq, lq, _ = q.shape
    hkv = k.shape[1]
    groups = hq // hkv if hkv else 1
    scores = q.reshape(b, hkv, groups, lq, q.shape[-1]) @ k.unsqueeze(2).transpose(-1, -2)
    out = conform((scores @ v.unsqueeze(2)).reshape(b, hq, lq, v.shape[-1]), q)
    return out, scores.float().sum(-1).reshape(b, hq, lq) + float("-inf")


def _call_op(call: AttnCall, choice: str = ""):
    if call.op == "varlen":
        return varlen_attention_op(call.q, call.k, call.v, call.cu_seqlens_q, call.cu_seqlens_k, call.max_seqlen_q,
                                   call.max_seqlen_k, call.scale, call.causal, call.window_left,
                                   call.window_right, choice)
    if call.op == "block_sparse":
        s = call.sparse
        return block_sparse_attention_op(call.q, call.k, call.v, s.kv_num_blocks, s.kv_indices,
                                         s.full_kv_num_blocks, s.full_kv_indices, s.partial_bits, s.block_q,
                                         s.block_kv, call.scale, s.density, s.partial_fraction, choice)
    return attention_op(call.q, call.k, call.v, call.scale, call.causal, call.window_left, call.window_right,
                        call.kv_seqlens, call.key_mask, choice)


def candidates(q, k, v, **kwargs) -> list[Candidate]:
    """Every candidate for this call (same keyword arguments as :func:`attention`), in prior order,
    each with its backend name, config string and pruned reason (None if it can run here)."""
    call = make_call(q, k, v, **kwargs)
    return enumerate_candidates((_as_documents(call) or call).problem, device_info(q.device))


def run_candidate(candidate: Candidate | str, q, k, v, *, return_lse: bool = False, **kwargs):
    """Run exactly one candidate (a :class:`Candidate` or its ``"backend:config"`` name) on this call's
    forward. Its backward, if autograd asks for one, is decided at run time like any call's: backward
    candidates have configs of their own."""
    name = candidate.name if isinstance(candidate, Candidate) else candidate
    if not isinstance(name, str):
        raise TypeError(f"candidate must be a Candidate or a 'backend:config' string, got {type(candidate).__name__}")
    refuse_forward_ad("run_candidate", {"q": q, "k": k, "v": v})
    call = make_call(q, k, v, **kwargs)
    listed = {c.name: c for c in enumerate_candidates((_as_documents(call) or call).problem, device_info(q.device))}
    if name not in listed:
        raise ValueError(f"candidate {name!r} is not a candidate for this call; candidates: {', '.join(listed)}")
    if listed[name].pruned:
        raise ValueError(f"candidate {name!r} cannot run this call: {listed[name].pruned}")
    out, lse = _run(call, name)
    return (out, lse) if return_lse else out


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int | None = None,
                     max_seqlen_k: int | None = None, *, causal: bool = False, scale: float | None = None,
                     window=None, return_lse: bool = False, check_indices: bool = True):
    """Attention over packed variable-length sequences.

    Args:
        q: (total_q, Hq, D); k: (total_k, Hkv, D); v: (total_k, Hkv, Dv).
        cu_seqlens_q, cu_seqlens_k: int32 (num_seqs + 1,), starting at 0, non-decreasing, ending at
            the totals. Sequence i is ``q[cu_seqlens_q[i]:cu_seqlens_q[i+1]]``. A sequence's keys never
            reach another sequence's outputs or gradients, whatever they hold (a padding sequence of no
            queries may hold NaN).
        max_seqlen_q, max_seqlen_k: longest sequence; computed from cu_seqlens (a device sync) if None, which
            compiled code cannot hold: a graph break, and an error under ``fullgraph=True``. Pass them there.
        causal, scale, window: as in :func:`attention`, aligned per sequence (lower-right).
        return_lse: also return the float32 lse of shape (Hq, total_q).
        check_indices: check cu_seqlens_q/k (start at 0, non-decreasing, end at the totals) and that
            max_seqlen_q/k cover the longest sequence: eagerly with a device sync and a ValueError, in
            compiled code with device-side asserts. False skips both.

    total_q, Hq or total_k of 0 run no kernel: empty outputs, or with no keys zeros and lse = -inf.
    """
    if (torch.compiler.is_compiling() and isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
            and isinstance(v, torch.Tensor) and q.dim() == k.dim() == v.dim() == 3
            and q.layout == k.layout == v.layout == torch.strided
            and q.is_floating_point() and q.element_size() > 1 and q.dtype == k.dtype == v.dtype
            and isinstance(cu_seqlens_q, torch.Tensor) and isinstance(cu_seqlens_k, torch.Tensor)
            and cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32 and cu_seqlens_q.dim() == 1
            and cu_seqlens_q.shape == cu_seqlens_k.shape and q.device == cu_seqlens_q.device == cu_seqlens_k.device
            and type(max_seqlen_q) is int and type(max_seqlen_k) is int  # (a traced SymInt's type reads int too)
            and not _decided(max_seqlen_q >= _INT64_BOUND) and not _decided(max_seqlen_k >= _INT64_BOUND)
            and q.shape[0] * q.shape[1] * k.shape[0] != 0):
        # Traced by Dynamo: as attention()'s fast path (why there). The op's fake impl makes check_varlen's checks;
        # max_seqlen_q/k to read from the lengths (a graph break), zero sizes and arguments of the wrong type, rank
        # or dtype take the checked path.
        left, right = _traced_arguments(causal, return_lse, check_indices, scale, window)
        if check_indices:
            assert_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q)
            assert_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k)
        out, lse = _VARLEN(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, _scale(scale, q), causal,
                           left, right, "")
        return (out, lse) if return_lse else out
    for name, flag in (("causal", causal), ("return_lse", return_lse), ("check_indices", check_indices)):
        check_bool(name, flag)
    refuse_forward_ad("varlen_attention", {"q": q, "k": k, "v": v})
    left, right = _window(window, causal)
    check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, left, right,
                 allow_empty=True)
    scale = _scale(scale, q)
    if max_seqlen_q is None or max_seqlen_k is None:
        max_seqlen_q = _longest(cu_seqlens_q, "max_seqlen_q") if max_seqlen_q is None else max_seqlen_q
        max_seqlen_k = _longest(cu_seqlens_k, "max_seqlen_k") if max_seqlen_k is None else max_seqlen_k
    if check_indices:
        check_varlen_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if _zero_size((q.shape[0], q.shape[1], k.shape[0])):
        out, lse = _zero_size_result(_bhld(q), _bhld(k), _bhld(v))
        out, lse = out[0].transpose(0, 1), lse[0]
    else:
        out, lse = varlen_attention_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                                       causal, left, right, checked())
    return (out, lse) if return_lse else out


def _bhld(x: torch.Tensor) -> torch.Tensor:
    """Packed (total, H, D) as one (1, H, total, D) sequence."""
    return x.transpose(0, 1).unsqueeze(0)


def paged_attention(q, k_cache, v_cache, block_table, kv_seqlens, *, cu_seqlens_q=None, max_seqlen_q: int | None = None,
                    max_seqlen_k: int | None = None, causal: bool = True, scale: float | None = None, window=None,
                    softcap: float | None = None, layout: str = "NHD", return_lse: bool = False,
                    check_indices: bool = True):
    """Attention over a KV cache kept in pages (serving: decode and chunked prefill), forward only.

    Args:
        q: (total_q, Hq, D), the new tokens of every sequence packed by ``cu_seqlens_q``.
        k_cache, v_cache: the page pools, (num_blocks, page_size, Hkv, D) and (..., Dv) for ``layout="NHD"``
            (vLLM, FlashAttention), (num_blocks, Hkv, page_size, D) for ``"HND"`` (FlashInfer); any strides.
            1 <= page_size <= 256; Hq a multiple of Hkv (GQA/MQA).
        block_table: int32 (num_seqs, pages per sequence): key j of sequence b is slot ``j % page_size`` of page
            ``block_table[b, j // page_size]``. Entries past a sequence's last page are never read (may hold -1).
        kv_seqlens: int32 (num_seqs,): sequence b's keys, its new tokens included (FlashAttention's
            ``seqused_k``; ``cache_seqlens`` after the append). Keys past it and pages the table does not reach
            never reach an output, whatever they hold.
        cu_seqlens_q: int32 (num_seqs + 1,) as in :func:`varlen_attention`; None: one query per sequence (decode).
        max_seqlen_q: at least the most queries of one sequence (a bound, as in FlashAttention: one bound for
            chunks of any size keeps compiled code on one graph); None: 1 for decode, else read from cu_seqlens_q
            (a host sync, and a graph break in compiled code: pass it there).
        max_seqlen_k: the longest kv length, which picks the tuning bucket (powers of two); None: the table's
            capacity, ``block_table.shape[1] * page_size`` (no host sync). In compiled code leave it None or
            pass a fixed bound: a value that grows every step is a dynamic int, decided per call at run time.
        causal: queries are the last tokens of their sequence: query i of a sequence with n queries and L keys sees
            keys j <= i + L - n (lower-right, per sequence). Decode is the same either way.
        scale, window: as in :func:`attention`, aligned per sequence.
        softcap: a logit softcap (Gemma 2, Grok): each scaled score s becomes ``softcap * tanh(s / softcap)`` before
            the mask and softmax, as FlashAttention's ``softcap`` does; None or 0: none.
        return_lse: also return the float32 lse of shape (Hq, total_q).
        check_indices: check kv_seqlens (in [0, max_seqlen_k]), the block ids of the pages they reach (in
            [0, num_blocks)) and cu_seqlens_q: eagerly with a device sync and a ValueError, in compiled code with
            device-side asserts. False skips them.

    Returns out (total_q, Hq, Dv). A query row that sees no key gives zeros (lse -inf).
    """
    if (torch.compiler.is_compiling() and layout in ("NHD", "HND") and isinstance(q, torch.Tensor)
            and isinstance(k_cache, torch.Tensor) and isinstance(v_cache, torch.Tensor)
            and isinstance(block_table, torch.Tensor) and isinstance(kv_seqlens, torch.Tensor)
            and q.dim() == 3 and k_cache.dim() == v_cache.dim() == 4 and block_table.dim() == 2
            and q.layout == k_cache.layout == v_cache.layout == torch.strided
            and q.is_floating_point() and q.element_size() > 1 and q.dtype == k_cache.dtype == v_cache.dtype
            and block_table.dtype == kv_seqlens.dtype == torch.int32 and kv_seqlens.shape == block_table.shape[:1]
            and q.device == block_table.device == kv_seqlens.device
            and not (q.requires_grad or k_cache.requires_grad or v_cache.requires_grad)
            and (cu_seqlens_q is None or isinstance(cu_seqlens_q, torch.Tensor) and cu_seqlens_q.dtype == torch.int32
                 and cu_seqlens_q.shape == (block_table.shape[0] + 1,) and max_seqlen_q is not None)
            and (max_seqlen_q is None or type(max_seqlen_q) is int and not _decided(max_seqlen_q >= _INT64_BOUND))
            and (max_seqlen_k is None or type(max_seqlen_k) is int and not _decided(max_seqlen_k >= _INT64_BOUND))):
        # Traced by Dynamo, as attention()'s fast path: every global and helper a compiled call passes through is a
        # guard checked on every call (the checked path below made a serving loop's paged step 83 guards against the
        # contiguous decode's 21). The op's fake impl makes check_paged's structural checks, with the same messages;
        # arguments of the wrong type, rank or dtype, a gradient to refuse and a max_seqlen_q to read take the
        # checked path, as do fp8 (one byte; the message names fp8_attention) and lengths or a table that the
        # value checks could not index. Those checks are check_paged_values' device asserts, the table's and the
        # lengths' from this module's names and cu_seqlens_q's from assert_cu_seqlens (which names no torch), ahead
        # of the op in the graph (the lowering drops them where the kernel asserts the same).
        left, right = _traced_arguments(causal, return_lse, check_indices, scale, window)
        if softcap is not None and type(softcap) is not float:
            check_softcap(softcap)
        if layout == "HND":
            k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
        page_size = k_cache.shape[1]
        max_seqlen_q = 1 if max_seqlen_q is None else max_seqlen_q
        max_seqlen_k = block_table.shape[1] * page_size if max_seqlen_k is None else max_seqlen_k
        if check_indices:
            reached = torch.arange(block_table.shape[1], device=block_table.device) * page_size < kv_seqlens[:, None]
            ids = torch.where(reached, block_table, 0)
            _device_assert(((kv_seqlens >= 0) & (kv_seqlens <= min(max_seqlen_k, MAX_INT32))).all(),
                           _PAGED_SEQLENS_ASSERT)  # min: past int32, the op's checks refuse it while tracing
            _device_assert(((ids >= 0) & (ids < k_cache.shape[0])).all(), _PAGED_IDS_ASSERT)
            if cu_seqlens_q is not None:
                assert_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q)
        out, lse = _PAGED(q, k_cache, v_cache, block_table, kv_seqlens, cu_seqlens_q, max_seqlen_q, max_seqlen_k,
                          _scale(scale, q), causal, left, right, 0.0 if softcap is None else softcap, "")
        return (out, lse) if return_lse else out
    for name, flag in (("causal", causal), ("return_lse", return_lse), ("check_indices", check_indices)):
        check_bool(name, flag)
    if layout not in PAGE_LAYOUTS:
        fail(ValueError, f"layout must be one of {', '.join(f'{k!r} {v}' for k, v in PAGE_LAYOUTS.items())}, "
                         f"got {layout!r}")
    if layout == "HND":
        k_cache, v_cache = (x.transpose(1, 2) if isinstance(x, torch.Tensor) and x.dim() == 4 else x
                            for x in (k_cache, v_cache))
    left, right = _window(window, causal)
    softcap = 0.0 if softcap is None else softcap
    check_paged(q, k_cache, v_cache, block_table, kv_seqlens, cu_seqlens_q, max_seqlen_q, max_seqlen_k, scale, left,
                right, softcap)
    refuse_grad("paged_attention", {"q": q, "k_cache": k_cache, "v_cache": v_cache})
    refuse_forward_ad("paged_attention", {"q": q, "k_cache": k_cache, "v_cache": v_cache})
    if max_seqlen_q is None:
        max_seqlen_q = 1 if cu_seqlens_q is None else _longest(cu_seqlens_q, "max_seqlen_q")
    if max_seqlen_k is None:
        max_seqlen_k = block_table.shape[1] * k_cache.shape[1]
    if check_indices:
        check_paged_values(k_cache, block_table, kv_seqlens, cu_seqlens_q, q, max_seqlen_q, max_seqlen_k)
    out, lse = _PAGED(q, k_cache, v_cache, block_table, kv_seqlens, cu_seqlens_q, max_seqlen_q, max_seqlen_k,
                      _scale(scale, q), causal, left, right, softcap, checked())
    return (out, lse) if return_lse else out
