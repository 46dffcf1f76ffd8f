"""Graph rewrite: send ``F.scaled_dot_product_attention`` (and flex_attention) calls in a Dynamo graph to our ops.

It runs as Inductor's ``pre_grad_custom_pass``, on the graph Dynamo captured and before AOTAutograd, so
the autograd formula of our op (ops/attention.py) gives the backward: training routes too. An SDPA call
is rewritten only when the result is provably the same; everything else stays SDPA, with the reason
counted in :func:`routing_report`.

Routed (a call on a CUDA device, with ``dropout_p == 0``, 4-D q/k/v of one dtype and device, the batch shared,
head dims in [8, 256], ``scale`` a constant or default, GQA only through ``enable_gqa`` or a repeat we undo):

- no mask, ``is_causal=False``: dense attention.
- no mask, ``is_causal=True`` with Lq == Lk provable from shapes. SDPA's causal is upper-left aligned and
  ours lower-right (DESIGN.md); they agree only for square scores, so other shapes stay SDPA.
- a boolean ``attn_mask`` that mask_proof.py proves, from how the graph builds it, to be a conjunction of
  upper bounds on the key index, and that does not vary over heads:
  * rows that do not depend on the query (any Lq), or one query row (decode, Lq == 1): every row is a
    prefix of the keys, so ``kv_seqlens`` = the row's count of True, read from the mask itself at the
    call (so it is exact for any run-time offset, and mutation of the offset tensors cannot matter).
    This is how a static KV cache decode step builds its mask when the model runs under torch.compile
    (transformers masking_utils.sdpa_mask: ``kv_idx <= q_idx + cache_offset``).
  * rows ``j <= i + d`` with d a compile-time constant: causal (with a constant ``kv_seqlens`` when
    d != Lk - Lq and 0 <= d <= Lk - Lq).
- any other boolean ``attn_mask`` (a graph input included) that is the same for every head and query row
  by its shape: (B or 1, 1, 1, Lk), or Lq == 1, with Lq <= 16. Whatever its values, it is a per-batch
  key mask and runs as ``key_mask``, with ``kv_seqlens`` = 1 + its last True key so kernels skip the
  unfilled cache tail. This is how transformers ``generate()`` passes its decode mask (built eagerly,
  left padding included) into the compiled forward. Not when q/k/v need gradients: only the reference
  kernel has a key-mask backward.
- ``k``/``v`` made by repeating KV heads (transformers ``repeat_kv``: ``x[:, :, None].expand(...).reshape``,
  or ``repeat_interleave`` on dim 1): the unrepeated tensor is passed and our op does GQA, as long as
  nothing may mutate between the repeat and the call.

Left alone: calls on other devices (only the reference kernel runs there, slower than SDPA's own kernels;
``INDUCTOR_ATTN_ROUTE_DEVICES=cuda,cpu`` routes CPU calls too, as the CPU tests do), masks that vary over query
rows and cannot be proven (graph inputs with Lq > 1, causal masks combined with a padding mask), additive float
masks, lower bounds (sliding windows) with Lq > 1, dropout, non-constant scales.

``flex_attention`` calls with a block mask and no score_mod go to our block-sparse op (flex_route.py) when
``INDUCTOR_ATTN_ROUTE_FLEX=1``: opt-in, since flex's own kernels measured faster on an H100.

One documented difference: a query row the mask leaves empty gives zeros (our convention, api.py); SDPA's
math kernel gives NaN there.

fp8, only with ``enable(fp8=True)``: a routed call becomes q, k, v quantised to float8_e4m3fn in the graph, one
descale per (batch, kv head) (fp8.quantize), and ``fp8_attention`` with the call's dtype as its out_dtype, unless
(said in the report's "not fp8: ..."):
- q, k or v requires grad: fp8_attention is forward only. Decided per call from Dynamo's example values, which
  carry requires_grad as eager would (False under ``torch.no_grad()``/``inference_mode``), so a training graph
  keeps every call in its own dtype and an inference graph quantises;
- it takes kv_seqlens or a key mask (fp8_attention takes neither);
- the device has kernels for the call's own dtype but none but the reference for its fp8 form (no FA3 wheel, not
  sm_90, a head dim FA3 lacks): the reference dequantises to float32, far slower than what the call had.
Per (batch, kv head) rather than per tensor: each sequence's scales come from its own values, so a sequence's
result does not depend on what else is in the batch, and one head's outliers cost the other heads no precision.
The amax costs the same, and FA3 takes (B, Hkv) descales as they are.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import logging
import math
import operator
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.fx

from .._compat import (contiguous_strides, custom_graph_pass_base, functorch_wrapped, op_types, sdpa_kernel_nodes,
                       size_hint, statically_known_true, wrapper_subclass)
from ..backends import REFERENCE, enumerate_candidates
from ..device import DeviceInfo, device_info
from .. import fp8 as fp8_entry
from ..fp8 import quantize
from ..problem import Problem, default_scale
from . import flex_route, graph_edit, mask_proof
from .graph_edit import Emitter, Skip, ev, failures_skip

log = logging.getLogger(__name__)

SDPA_TARGETS = frozenset({torch._C._nn.scaled_dot_product_attention,
                          torch.nn.functional.scaled_dot_product_attention})
_SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}

_REPORT: collections.Counter = collections.Counter()

ROUTE_DEVICES_ENV = "INDUCTOR_ATTN_ROUTE_DEVICES"


def routed_device_types() -> frozenset[str]:
    """Device types whose SDPA calls are routed: ``cuda``, or the comma-separated list in
    ``INDUCTOR_ATTN_ROUTE_DEVICES``. Elsewhere the reference is the only kernel (backends/), and a routed call
    would run it instead of SDPA's own kernels."""
    listed = {d.strip() for d in os.environ.get(ROUTE_DEVICES_ENV, "").split(",")} - {""}
    for name in listed:
        try:
            known = torch.device(name).type == name
        except RuntimeError:
            known = False
        if not known:  # a device type no tensor has would route nothing, silently
            raise ValueError(f"{ROUTE_DEVICES_ENV} must list device types (cuda, cpu, ...) separated by commas, got "
                             f"{name!r} in {os.environ[ROUTE_DEVICES_ENV]!r}")
    return frozenset(listed or {"cuda"})


def routing_report() -> dict[str, int]:
    """Attention calls seen by the rewrite since start (or the last reset), by outcome:
    ``{"sdpa: routed (causal)": 4, "sdpa: left alone (attn_mask ...)": 2, ...}``. Counted when the pass
    runs, i.e. at compile time; an FX-graph-cache hit replays compiled code without running it."""
    return dict(sorted(_REPORT.items()))


def reset_routing_report() -> None:
    _REPORT.clear()


@dataclass
class _Plan:
    q: torch.fx.Node
    k: torch.fx.Node
    v: torch.fx.Node
    scale: float | None
    causal: bool
    kv_from_mask: torch.fx.Node | None = None  # kv_seqlens = count of True in the mask's first row
    kv_constant: int | None = None
    key_mask: torch.fx.Node | None = None  # a mask the same for every query and head: passed as key_mask
    what: str = "dense"
    fp8: bool = False  # run as fp8_attention on quantised q, k, v (enable(fp8=True), _with_fp8)


# ------------------------------------------------------------------------------------------ analysis
def _sdpa_args(node: torch.fx.Node) -> dict:
    if len(node.args) > len(_SDPA_PARAMS) or set(node.kwargs) - set(_SDPA_PARAMS):
        raise Skip("unexpected SDPA arguments")
    bound = dict(_SDPA_DEFAULTS) | dict(zip(_SDPA_PARAMS, node.args)) | dict(node.kwargs)
    if any(p not in bound for p in _SDPA_PARAMS[:3]):
        raise Skip("unexpected SDPA arguments")
    return bound


def _known(expr) -> bool:
    return statically_known_true(expr)


def _hint(size) -> int:
    value = size_hint(size)
    if value is None:
        raise Skip("a size is data-dependent")
    return value


def _check_tensors(q, k, v) -> tuple:
    """Example values of q/k/v. Properties that ops/checks.py check_attention verifies in our op's fake
    impl are tested on this compilation's sizes: under dynamic shapes that check guards them."""
    evs = [ev(t) for t in (q, k, v)]
    if not all(isinstance(t, torch.Tensor) for t in evs):
        raise Skip("no example values for q/k/v in the graph")
    qe, ke, ve = evs
    subclass = next((type(t).__name__ for t in evs if wrapper_subclass(t)), None)
    if subclass is not None:
        raise Skip(f"q/k/v include a {subclass}: our ops have no sharding rule for it")
    if any(functorch_wrapped(t) for t in evs):
        raise Skip("q/k/v are under a torch.func transform (vmap, grad): our ops have no batching rule")
    if not all(t.dim() == 4 for t in evs):
        raise Skip("q/k/v are not 4-D (batch, heads, seq, head_dim)")
    if not (qe.dtype == ke.dtype == ve.dtype) or qe.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise Skip(f"dtypes {qe.dtype}/{ke.dtype}/{ve.dtype}: routed are fp16, bf16 and fp32, one dtype")
    if not (qe.device == ke.device == ve.device):
        raise Skip("q/k/v on different devices")
    routed = routed_device_types()
    if qe.device.type not in routed:
        raise Skip(f"on {qe.device.type}, where only the reference kernel runs (routed: {', '.join(sorted(routed))};"
                   f" {ROUTE_DEVICES_ENV} adds others)")
    qs, ks, vs = ([_hint(s) for s in t.shape] for t in evs)
    if not qs[0] == ks[0] == vs[0]:
        raise Skip("batch sizes of q/k/v differ (SDPA broadcasts them, our op does not)")
    if ks[2] != vs[2]:
        raise Skip("k and v sequence lengths differ")
    if qs[3] != ks[3]:
        raise Skip("q and k head_dims differ")
    for name, size in (("q/k head_dim", qs[3]), ("v head_dim", vs[3])):
        if not 8 <= size <= 256:
            raise Skip(f"{name} {size} is outside [8, 256]")
    if 0 in (qs[0], qs[1], qs[2], ks[1], ks[2]):
        raise Skip("a zero-size batch, head count or sequence (SDPA returns an empty or zero result)")
    return qe, ke, ve


def _unrepeat_kv(node: torch.fx.Node, sdpa: torch.fx.Node) -> torch.fx.Node | None:
    """The tensor before a KV-head repeat, if ``node`` is one and undoing it reads the same values."""
    src = None
    if node.op == "call_method" and node.target == "reshape" and isinstance(node.args[0], torch.fx.Node):
        expand = node.args[0]
        if expand.op == "call_method" and expand.target == "expand" and isinstance(expand.args[0], torch.fx.Node):
            item = expand.args[0]
            full = slice(None, None, None)
            if (item.op == "call_function" and item.target is operator.getitem
                    and item.args[1] == (full, full, None, full, full)):
                src = item.args[0]
                ex, out, s = ev(expand), ev(node), ev(src)
                if not (isinstance(s, torch.Tensor) and s.dim() == 4 and isinstance(ex, torch.Tensor)
                        and ex.dim() == 5 and all(_known(ex.shape[d] == s.shape[d]) for d in (0, 1))
                        and all(_known(ex.shape[d + 1] == s.shape[d]) for d in (2, 3))
                        and isinstance(out, torch.Tensor) and out.dim() == 4
                        and all(_known(out.shape[d] == s.shape[d]) for d in (0, 2, 3))
                        and _known(out.shape[1] == ex.shape[1] * ex.shape[2])):
                    return None
    elif (node.op == "call_method" and node.target == "repeat_interleave" and len(node.args) == 2
          and isinstance(node.args[1], int) and node.kwargs in ({"dim": 1}, {"dim": -3})):
        src = node.args[0]
    elif (node.op == "call_function" and node.target is torch.repeat_interleave and len(node.args) == 2
          and isinstance(node.args[1], int) and node.kwargs in ({"dim": 1}, {"dim": -3})):
        src = node.args[0]
    if not isinstance(src, torch.fx.Node) or not isinstance(ev(src), torch.Tensor) or ev(src).dim() != 4:
        return None
    # the repeat copied src where it stands; the call would read src later
    if mask_proof.may_mutate(node) or mask_proof.mutation_between(node, sdpa):
        return None
    return src


def _heads(q, k, v, enable_gqa: bool, sdpa) -> tuple:
    qe, ke, _ = _check_tensors(q, k, v)
    if _known(qe.shape[1] == ke.shape[1]):
        k2, v2 = _unrepeat_kv(k, sdpa), _unrepeat_kv(v, sdpa)
        if k2 is not None and v2 is not None and _known(ev(k2).shape[1] == ev(v2).shape[1]):
            k, v = k2, v2
    elif not enable_gqa:
        raise Skip("q and k head counts may differ without enable_gqa (SDPA would fail)")
    qe, ke, ve = _check_tensors(q, k, v)
    hq, hk, hv = (_hint(t.shape[1]) for t in (qe, ke, ve))
    if not (hk >= 1 and hq % hk == 0 and hv == hk):
        raise Skip(f"head counts q={hq} k={hk} v={hv}: q must be a multiple of k, and v equal to k")
    return k, v


def _scale(value) -> float | None:
    """The constant scale, or None for SDPA's default 1/sqrt(head_dim) (emitted from q's size)."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    raise Skip("scale is not a compile-time constant")


def _mask_shape(mask: torch.fx.Node, qe, ke) -> tuple:
    """The bool mask's shape padded to 4 dims, once it provably broadcasts to (B, H, Lq, Lk)."""
    me = ev(mask)
    if not isinstance(me, torch.Tensor) or me.dtype != torch.bool:
        raise Skip("attn_mask is not a bool tensor (additive masks are not routed)")
    if me.device != qe.device or me.dim() > 4:
        raise Skip("attn_mask device or rank differs from q")
    target = (qe.shape[0], qe.shape[1], qe.shape[2], ke.shape[2])
    shape = (1,) * (4 - me.dim()) + tuple(me.shape)
    if not all(_known(s == 1) or _known(s == t) for s, t in zip(shape, target)):
        raise Skip("attn_mask shape does not provably broadcast to (B, H, Lq, Lk)")
    return shape


def _mask_plan(mask: torch.fx.Node, shape: tuple, sdpa: torch.fx.Node, qe, ke,
               analysis: mask_proof.MaskAnalysis) -> dict:
    value = analysis.value(mask)
    if isinstance(value, mask_proof.Unknown):
        raise Skip(f"attn_mask cannot be proven: {value.reason}")
    if not isinstance(value, mask_proof.Mask):
        raise Skip("attn_mask is not a proven bool mask")
    if not mask_proof.mutation_free(analysis.cone(mask), stop={sdpa}):
        raise Skip("attn_mask: a tensor it is built from may be mutated in place")
    bounds = []
    for b in mask_proof.realign(value, shape).bounds:
        if not any(b.coefs) and not b.free_dims and b.base is not None:
            if b.base > 0:
                raise Skip("attn_mask is all False")
            continue  # always true
        if b.coefs[1] != 0 or 1 in b.free_dims:
            raise Skip("attn_mask varies over heads (our kv_seqlens is per batch)")
        if b.coefs[3] != 1 or 3 in b.free_dims:  # an unknown part that varies over keys: any set of keys
            raise Skip("attn_mask has a bound that is not an upper bound on the key index "
                        "(a sliding window, a suffix or a whole-row switch)")
        bounds.append(b)
    if not bounds:
        return {"causal": False, "what": "dense (mask proven all True)"}
    row_dependent = any(b.coefs[2] != 0 or 2 in b.free_dims for b in bounds)
    if not row_dependent:
        return {"causal": False, "kv_from_mask": mask, "what": "kv_seqlens from a proven prefix mask"}
    lq, lk = qe.shape[2], ke.shape[2]
    if any(b.coefs[0] != 0 or b.coefs[2] != -1 or b.free_dims or b.base is None for b in bounds):
        raise Skip("attn_mask rows depend on the query through a run-time offset with Lq > 1")
    d = min(-b.base for b in bounds)  # key j visible iff j <= i + d
    if _known(lk - lq == d):
        return {"causal": True, "what": "causal (proven mask)"}
    if isinstance(lq, int) and isinstance(lk, int) and 0 <= d <= lk - lq:
        return {"causal": True, "kv_constant": d + lq, "what": "causal with constant kv_seqlens (proven mask)"}
    raise Skip("attn_mask is causal with a diagonal our lower-right causal cannot express")


# Key masks are routed for decode-sized queries only: the split-K decode kernel takes them; for longer
# query blocks only SDPA (with the mask materialised as a (B, 1, Lq, Lk) bias) or the reference would.
KEY_MASK_MAX_LEN_Q = 16


def _key_mask_plan(mask: torch.fx.Node, shape: tuple, qe, ke, ve, unproven: Skip) -> dict:
    """A bool mask that is the same for every head and query row is a per-batch key mask, whatever its
    values: exact by its shape alone. Used for masks the proof cannot read (a graph input, such as the
    decode mask transformers' generate() builds eagerly, with any left padding)."""
    if not (_known(shape[1] == 1) and (_known(shape[2] == 1) or _known(qe.shape[2] == 1))):
        raise Skip(f"{unproven}; not a key mask either (it may vary over heads or query rows)")
    if not _known(qe.shape[2] <= KEY_MASK_MAX_LEN_Q):
        raise Skip(f"{unproven}; as a key mask only the decode kernel (Lq <= {KEY_MASK_MAX_LEN_Q}) would gain")
    if any(t.requires_grad for t in (qe, ke, ve)):
        raise Skip(f"{unproven}; as a key mask its backward would run on the reference kernel only")
    return {"causal": False, "key_mask": mask, "what": "key_mask from an unproven mask the same for every query"}


_SDPA_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")


def _sdpa_backends_allowed_globally() -> set[str]:
    """The SDPA backends the global flags enable (``sdpa_kernel`` around the compiled function sets them)."""
    flags = torch.backends.cuda
    on = {"FLASH_ATTENTION": flags.flash_sdp_enabled(), "EFFICIENT_ATTENTION": flags.mem_efficient_sdp_enabled(),
          "CUDNN_ATTENTION": flags.cudnn_sdp_enabled(), "MATH": flags.math_sdp_enabled()}
    return {name for name, enabled in on.items() if enabled}


def _sdpa_backends_allowed(node: torch.fx.Node) -> set[str] | None:
    """The SDPA backends a user's ``sdpa_kernel([...])`` allows for this call (the last such block entered before it
    in the graph, else the flags set while compiling); None where it allows all of them."""
    setter, from_string = sdpa_kernel_nodes()
    n = node.prev
    while n.op != "root" and not (n.op == "call_function" and n.target is setter):
        n = n.prev
    if n.op == "root":
        allowed = _sdpa_backends_allowed_globally()
    else:
        allowed = {b.args[0] if isinstance(b, torch.fx.Node) and b.target is from_string else getattr(b, "name", b)
                   for b in n.args[0]}
    return None if allowed >= set(_SDPA_BACKENDS) else allowed


def plan_sdpa(node: torch.fx.Node, analysis: mask_proof.MaskAnalysis) -> _Plan:
    allowed = _sdpa_backends_allowed(node)
    if allowed is not None:
        raise Skip(f"sdpa_kernel allows SDPA's {', '.join(sorted(allowed)) or 'no backend'} only: the user chose "
                   "its kernel")
    args = _sdpa_args(node)
    if args["dropout_p"] not in (0, 0.0):
        raise Skip("dropout_p is not 0")
    q = args["query"]
    k, v = _heads(q, args["key"], args["value"], bool(args["enable_gqa"]), node)
    qe, ke, ve = _check_tensors(q, k, v)
    scale = _scale(args["scale"])
    mask, causal = args["attn_mask"], args["is_causal"]
    if not isinstance(causal, bool):
        raise Skip("is_causal is not a constant")
    if mask is None:
        if causal and not _known(qe.shape[2] == ke.shape[2]):
            raise Skip("is_causal with Lq != Lk (SDPA aligns upper-left, our causal lower-right)")
        return _Plan(q, k, v, scale, causal, what="causal" if causal else "dense")
    if causal:
        raise Skip("both attn_mask and is_causal: no route takes the two together")
    if not isinstance(mask, torch.fx.Node):
        raise Skip("attn_mask is not a tensor")
    shape = _mask_shape(mask, qe, ke)
    try:
        return _Plan(q, k, v, scale, **_mask_plan(mask, shape, node, qe, ke, analysis))
    except Skip as unproven:
        return _Plan(q, k, v, scale, **_key_mask_plan(mask, shape, qe, ke, ve, unproven))


def _with_fp8(plan: _Plan) -> _Plan:
    """``plan`` run as fp8 where it can be, else with the reason it is not in ``what``."""
    refusal = _fp8_refusal(plan)
    plan.fp8 = refusal is None
    plan.what += ", fp8" if plan.fp8 else f"; not fp8: {refusal}"
    return plan


def _fp8_refusal(plan: _Plan) -> str | None:
    if any(ev(t).requires_grad for t in (plan.q, plan.k, plan.v)):
        return "q/k/v require grad and fp8_attention is forward only"
    if plan.key_mask is not None:
        return "fp8_attention takes no key mask"
    if plan.kv_from_mask is not None or plan.kv_constant is not None:
        return "fp8_attention takes no kv_seqlens"
    qe, ke, ve = (ev(t) for t in (plan.q, plan.k, plan.v))
    p = Problem("attention", str(qe.dtype).removeprefix("torch."), qe.device.type, _hint(qe.shape[0]),
                _hint(qe.shape[1]), _hint(ke.shape[1]), _hint(qe.shape[2]), _hint(ke.shape[2]), _hint(qe.shape[3]),
                _hint(ve.shape[3]), causal=plan.causal)
    return fp8_kernel_missing(p, device_info(qe.device))


def fp8_kernel_missing(p: Problem, dev: DeviceInfo) -> str | None:
    """Why ``p`` (a call in its own dtype) should not run as fp8 on ``dev``: a kernel other than the reference runs
    it, and none but the reference runs its fp8 form; None otherwise (on a CPU the reference is all either has)."""
    def fast(problem, lookup_only):
        cands = enumerate_candidates(problem, dev, lookup_only=lookup_only)
        return [c for c in cands if c.backend != REFERENCE.name and c.pruned is None], cands

    # the call's own dtype: backends that are cheap to import answer (sdpa runs wherever CUDA does), and a compile
    # imports no FA4 for it; fp8's only fast kernel is FA3's, whose library the fp8 call loads anyway
    if not fast(p, lookup_only=True)[0]:
        return None
    runnable, cands = fast(dataclasses.replace(p, dtype="float8_e4m3fn"), lookup_only=False)
    if runnable:
        return None
    why = "; ".join(f"{c.backend}: {c.pruned}" for c in cands if c.backend != REFERENCE.name)
    return f"no fp8 kernel but the reference here ({why or 'no fp8 backend registered'})"


# ------------------------------------------------------------------------------------------ emission
def _as_4d(emit: Emitter, mask: torch.fx.Node) -> torch.fx.Node:
    ndim = ev(mask).dim()
    return mask if ndim == 4 else emit("call_function", operator.getitem, mask, (None,) * (4 - ndim) + (Ellipsis,))


def _key_mask(emit: Emitter, plan: _Plan) -> tuple[torch.fx.Node, torch.fx.Node]:
    """(key_mask (B, Lk), kv_seqlens = 1 + the last True key per batch): the kernels then read only the
    keys up to the last visible one, as with a proven prefix, and the mask does the rest."""
    batch, len_k = emit("call_method", "size", plan.q, 0), emit("call_method", "size", plan.k, 2)
    rows = emit("call_function", operator.getitem, _as_4d(emit, plan.key_mask), (slice(None, None, None), 0, 0))
    key_mask = emit("call_method", "expand", rows, batch, len_k)
    positions = emit("call_function", torch.arange, 1, emit("call_function", operator.add, len_k, 1),
                     dtype=torch.int32, device=ev(plan.q).device)
    last = emit("call_function", torch.where, key_mask, positions, 0)
    return key_mask, emit("call_method", "amax", last, -1)


def _kv_seqlens(emit: Emitter, plan: _Plan) -> torch.fx.Node | None:
    if plan.kv_from_mask is None and plan.kv_constant is None:
        return None
    batch = emit("call_method", "size", plan.q, 0)
    if plan.kv_constant is not None:
        device = ev(plan.q).device
        return emit("call_function", torch.full, (batch,), plan.kv_constant, dtype=torch.int32, device=device)
    # (B or 1, H or 1, Lq or 1)
    counts = emit("call_method", "sum", _as_4d(emit, plan.kv_from_mask), -1, dtype=torch.int32)
    row = emit("call_function", operator.getitem, counts, (slice(None, None, None), 0, 0))
    row = emit("call_method", "expand", row, batch)
    return emit("call_method", "contiguous", row)


class _Ref(str):
    def __repr__(self) -> str:
        return f"<{str.__str__(self)}>"


def structure(node, seen: dict) -> str | None:
    """A key (a hash) that two nodes share when they compute the same value: the same ops on the same
    arguments, down to the graph's inputs; None when an op on the way may have side effects (then no two
    nodes share it). ``seen`` memoizes per node.

    >>> g = torch.fx.Graph()
    >>> x = g.placeholder("x")
    >>> a, b = (g.call_function(operator.getitem, (x, (slice(None), slice(None, 4)))) for _ in range(2))
    >>> c = g.call_function(operator.getitem, (x, (slice(None), slice(None, 5))))
    >>> seen = {}
    >>> structure(a, seen) == structure(b, seen) != structure(c, seen)
    True
    """
    if not isinstance(node, torch.fx.Node):
        return repr(node)
    stack = [node]  # a loop, not recursion: a mask may be built at the end of a chain of thousands of ops
    while stack:
        n = stack[-1]
        if n in seen:
            stack.pop()
            continue
        if n.op in ("placeholder", "get_attr"):
            seen[stack.pop()] = f"{n.op}:{n.name}"
            continue
        if n.op not in ("call_function", "call_method") or n.is_impure() or (
                n.op == "call_method" and n.target.endswith("_")) or _draws_random_numbers(n):
            seen[stack.pop()] = None
            continue
        todo = [m for m in n.all_input_nodes if m not in seen]
        if todo:
            stack.extend(todo)
            continue
        stack.pop()
        refs = []
        args = torch.fx.node.map_arg((n.args, n.kwargs), lambda m: refs.append(seen[m]) or _Ref(refs[-1]))
        # hashed: a shared subexpression would otherwise be spelled out per use
        seen[n] = None if None in refs else hashlib.sha256(
            f"{n.op}:{getattr(n.target, '__qualname__', n.target)}{args!r}".encode()).hexdigest()
    return seen[node]


def _draws_random_numbers(node: torch.fx.Node) -> bool:
    """Whether ``node`` gives another value at each run on the same inputs (``x.bernoulli()``, ``F.dropout``):
    fx's ``is_impure`` says so for ``torch.rand`` but not for methods or torch.nn.functional's Python functions.
    An aten op says so by its tag; another function by its name."""
    overload, overload_packet, _ = op_types()
    target = node.target
    if isinstance(target, overload):
        return torch.Tag.nondeterministic_seeded in target.tags
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    packet = getattr(torch.ops.aten, name, None) if name else None
    if isinstance(packet, overload_packet):
        return any(torch.Tag.nondeterministic_seeded in getattr(packet, o).tags for o in packet.overloads())
    return "dropout" in name or "rand" in name


def _emit(graph: torch.fx.Graph, node: torch.fx.Node, plan: _Plan, emitted: dict, seen: dict) -> None:
    """``emitted``: the key masks and kv_seqlens emitted so far in this graph, by what they are computed from
    (``structure``, memoized in ``seen``): the calls of a model's layers take one mask, and each would
    otherwise reduce it again (a kernel per layer: HF Llama's static-cache decode step ran 8 of them)."""
    emit = Emitter(graph, node, getattr(ev(plan.q), "fake_mode", None))
    with failures_skip(emit):  # what our op's fake impl refuses of what SDPA takes stays SDPA
        out, key, shared = _emit_call(emit, node, plan, emitted, seen)
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    if key is not None:  # the latest emission: a later call sharing it reads it after any write before this one
        emitted[key] = shared


def _emit_call(emit: Emitter, node: torch.fx.Node, plan: _Plan, emitted: dict, seen: dict) -> tuple:
    """(the routed call's output node, the key its key mask / kv_seqlens are shared under or None, those two)."""
    plan = _as_sdpa_computes(emit, node, plan)
    # Two masks of one structure are one value only if nothing writes into what either is computed from (a write
    # into one copy, or between the two builds, makes them differ): a value written in place is never shared;
    # and a key mask is read where it is used, so its reuse needs nothing to write in place between the two calls
    # either (HF's static cache does, once per layer)
    key = _shared_key(plan, seen) if mask_proof.mutation_free(_sources(plan), stop=set()) else None
    reused = key in emitted and not (
        plan.key_mask is not None and mask_proof.mutation_between(emitted[key][1], node))
    if reused:
        key_mask, kv = emitted[key]
    else:
        key_mask, kv = _key_mask(emit, plan) if plan.key_mask is not None else (None, _kv_seqlens(emit, plan))
    scale = plan.scale
    if scale is None:
        head_dim = ev(plan.q).shape[3]
        if isinstance(head_dim, int):
            scale = default_scale(head_dim)
        else:  # dynamic head_dim: SDPA's default scale, computed from the size at run time
            root = emit("call_function", operator.pow, emit("call_method", "size", plan.q, 3), 0.5)
            scale = emit("call_function", operator.truediv, 1.0, root)
    if plan.fp8:
        result = _emit_fp8(emit, plan, scale)
    else:
        op = torch.ops.inductor_attn.attention.default
        result = emit("call_function", op, plan.q, plan.k, plan.v, scale, plan.causal, -1, -1, kv, key_mask, "")
    return _laid_out_as_sdpa(emit, node, emit("call_function", operator.getitem, result, 0)), key, (key_mask, kv)


def _laid_out_as_sdpa(emit: Emitter, node: torch.fx.Node, out: torch.fx.Node) -> torch.fx.Node:
    """``out`` laid out as the SDPA call's output, which the code after it was traced against (a ``view`` there may
    need it). Our ops' output follows q's stride order (layout.py); SDPA's may not: the CPU's math kernel returns a
    contiguous output for an expanded q, a q whose last dim is strided or a value head dim other than q's, and
    CUDA's efficient kernel always a (B, L, H, Dv) one. Where the two differ beyond dims of size 1 (whose strides
    no view reads), a copy into SDPA's dim order, if its output is dense; else the call stays SDPA."""
    want, got = ev(node), ev(out)
    sizes = want.shape
    if _same(want.stride(), got.stride(), sizes):
        return out
    order = sorted(range(want.dim()), key=lambda d: -size_hint(want.stride(d)))  # SDPA's dims, outermost first
    dense = contiguous_strides([sizes[d] for d in order])
    if not _same([want.stride(d) for d in order], dense, [sizes[d] for d in order]):
        raise Skip(f"SDPA's output is not dense (strides {tuple(want.stride())}): not ours {tuple(got.stride())}")
    back = sorted(range(want.dim()), key=order.index)
    permuted = emit("call_method", "permute", out, *order)
    return emit("call_method", "permute", emit("call_method", "contiguous", permuted), *back)


def _same(a, b, sizes) -> bool:
    """Whether two stride tuples agree on every dim of more than one element, for every size the graph may see
    (symbolic ones too), without a guard."""
    return len(a) == len(b) and all(statically_known_true(n <= 1) or statically_known_true(x == y)
                                    for x, y, n in zip(a, b, sizes))


def _as_sdpa_computes(emit: Emitter, node: torch.fx.Node, plan: _Plan) -> _Plan:
    """``plan`` with q, k and v cast to the dtype the SDPA call ran in. Autocast (a region in the graph, or on
    around the compiled call) casts SDPA's float32 inputs to its lower precision; our ops are not autocast ops,
    and would run and return float32 where SDPA returns bfloat16."""
    dtype = getattr(ev(node), "dtype", None)
    cast = {name: getattr(plan, name) for name in ("q", "k", "v")
            if dtype is not None and ev(getattr(plan, name)).dtype != dtype}
    if not cast:
        return plan
    return dataclasses.replace(plan, **{name: emit("call_method", "to", x, dtype) for name, x in cast.items()})


def _emit_fp8(emit: Emitter, plan: _Plan, scale) -> torch.fx.Node:
    """fp8_attention on q, k, v quantised per (batch, kv head), out in q's dtype. The descales' values are not
    checked (no device assert): they are amaxes, finite and >= 0 unless the inputs hold inf or NaN, which the
    unquantised call would have spread into its output as well."""
    heads_kv = emit("call_method", "size", plan.k, 1)
    quantised = [emit("call_function", quantize, x, heads_kv) for x in (plan.q, plan.k, plan.v)]
    x8, descales = ([emit("call_function", operator.getitem, t, i) for t in quantised] for i in (0, 1))
    op = torch.ops.inductor_attn.fp8_attention.default
    return emit("call_function", op, *x8, *descales, scale, plan.causal, -1, -1, ev(plan.q).dtype, "")


def _sources(plan: _Plan) -> set[torch.fx.Node]:
    """Every node the call's key mask or mask is computed from, itself included."""
    source = plan.key_mask if plan.key_mask is not None else plan.kv_from_mask
    found, stack = set(), [] if source is None else [source]
    while stack:
        node = stack.pop()
        if node not in found:
            found.add(node)
            stack.extend(node.all_input_nodes)
    return found


def _shared_key(plan: _Plan, seen: dict) -> tuple | None:
    """What the call's key mask / kv_seqlens are computed from, for ``_emit``; None when nothing is computed or
    its source has no ``structure``."""
    source = plan.key_mask if plan.key_mask is not None else plan.kv_from_mask
    if source is None and plan.kv_constant is None:
        return None
    built_from = structure(source, seen)
    if built_from is None:
        return None
    return (plan.key_mask is not None, built_from, plan.kv_constant, str(ev(plan.q).shape[0]), str(ev(plan.k).shape[2]),
            str(ev(plan.q).device))


# ------------------------------------------------------------------------------------------ the pass
def rewrite_graph(graph: torch.fx.Graph, fp8: bool = False) -> int:
    """Rewrite provably equivalent SDPA and flex_attention calls in ``graph``; returns how many. ``fp8``: SDPA
    calls that can run as fp8 do (the module docstring says which)."""
    from .. import ops  # noqa: F401  (registers torch.ops.inductor_attn.*)

    analysis = mask_proof.MaskAnalysis()
    bits_memo: dict = {}  # flex calls sharing a block mask share its bitmaps
    emitted, seen = {}, {}  # SDPA calls sharing a mask share its kv_seqlens (_emit)
    rewritten = 0
    for node in list(graph.nodes):
        if flex_route.is_flex(node):
            kind, plan_fn = "flex_attention", flex_route.plan_flex
            emit_fn = functools.partial(flex_route.emit_flex, bits_memo=bits_memo)
        elif node.op == "call_function" and node.target in SDPA_TARGETS:
            kind = "sdpa"
            plan_fn = (lambda n: _with_fp8(plan_sdpa(n, analysis))) if fp8 else (lambda n: plan_sdpa(n, analysis))
            emit_fn = functools.partial(_emit, emitted=emitted, seen=seen)
        else:
            continue
        try:
            with failures_skip(why="the analysis failed: "):  # a mask in a form it does not read, a chain too deep
                plan = plan_fn(node)
            emit_fn(graph, node, plan)
        except Skip as skip:
            _REPORT[f"{kind}: left alone ({skip})"] += 1
            log.debug("inductor_attn: %s stays %s: %s", node.name, kind, skip)
            continue
        what = plan.what if kind == "sdpa" else "block-sparse"
        _REPORT[f"{kind}: routed ({what})"] += 1
        rewritten += 1
    return rewritten


# what the rewritten graph is made of (fp8_entry: the quantisation it emits)
_SOURCES = tuple(Path(m.__file__) for m in (mask_proof, graph_edit, flex_route, fp8_entry)) + (Path(__file__),)


class RewritePass(custom_graph_pass_base()):
    """``pre_grad_custom_pass`` that runs the pass it replaced (``chained``: None, a pass, or a list of
    passes), then :func:`rewrite_graph` (with ``fp8``)."""

    def __init__(self, chained=None, fp8: bool = False):
        self.chained = chained
        self.fp8 = fp8

    def _chain(self) -> tuple:
        if self.chained is None:
            return ()
        return tuple(self.chained) if isinstance(self.chained, (list, tuple)) else (self.chained,)

    def __call__(self, graph: torch.fx.Graph) -> None:
        for p in self._chain():
            p(graph)
        rewrite_graph(graph, self.fp8)

    def uuid(self):
        """Changes with this rewrite's source and the chained passes' uuids; None (no FX graph caching)
        when a chained pass has no uuid, as Inductor requires."""
        from .._version import __version__

        h = hashlib.sha256(__version__.encode())
        h.update(str(flex_route.routing_requested()).encode())  # the settings change the rewritten graph
        h.update(",".join(sorted(routed_device_types())).encode())
        h.update(f"fp8={self.fp8}".encode())
        h.update(repr(sorted(_sdpa_backends_allowed_globally())).encode())  # calls it leaves to SDPA
        for path in _SOURCES:
            h.update(path.read_bytes())
        for p in self._chain():
            chained_uuid = getattr(p, "uuid", lambda: None)()
            if chained_uuid is None:
                return None
            h.update(repr(chained_uuid).encode())
        return h.hexdigest()
