"""Inductor lowerings for the ``inductor_attn`` ops: decide at compile time, emit a direct call.

For a dense ``attention`` (or its backward) with static shapes and no kv_seqlens or key_mask, the
decision is made while lowering (store hit, or tuning on fresh random inputs of the exact shape) and the
generated code calls the op with ``choice="<backend>:<config>"`` baked in. Everything else (dynamic
shapes, varlen and block-sparse problems, kv_seqlens and key_mask: index tensors whose values matter and
are unknown at compile time) is emitted with ``choice=""``: the op decides at run time per bucket, tuning a new bucket once on the
real index tensors and persisting it, then one dict lookup per call.

Registered the first time a fake impl runs (i.e. while tracing for torch.compile), not at import. The
FX-graph-cache guard is installed at the same moment; if a user later replaces it, nothing is baked.
"""

from __future__ import annotations

import threading

import sympy
import torch

from .._compat import inductor_lowering
from ..backends import AttnCall
from ..device import device_info
from ..ops import BACKWARD_OPS, FORWARD_OPS, attention_backward_op, attention_op
from . import cache_guard

_LOCK = threading.Lock()
_REGISTERED = False
# ops whose choice can be made from shapes alone -> tuning direction
_COMPILE_TIME = {attention_op._opoverload: "forward", attention_backward_op._opoverload: "backward"}


def ensure_registered() -> None:
    global _REGISTERED
    if _REGISTERED:
        return
    with _LOCK:
        if _REGISTERED:
            return
        register_lowering, fallback_handler = inductor_lowering()
        for op in FORWARD_OPS + BACKWARD_OPS:
            overload = op._opoverload
            register_lowering(overload, type_promotion_kind=None)(_make_lowering(overload, fallback_handler))
        cache_guard.install()
        _REGISTERED = True


def _make_lowering(overload, fallback_handler):
    emit = fallback_handler(overload, add_to_fallback_set=False)
    names = [a.name for a in overload._schema.arguments]

    def lower(*args, **kwargs):
        bound = dict(zip(names, args)) | kwargs
        if not bound["choice"] and overload in _COMPILE_TIME and cache_guard.active():
            bound["choice"] = compile_time_choice(overload, bound) or ""
        return emit(*(bound[n] for n in names))

    return lower


def _static_size(node) -> list[int] | None:
    sizes = node.get_size()
    if all(isinstance(s, (int, sympy.Integer)) for s in sizes):
        return [int(s) for s in sizes]
    return None


def compile_time_choice(overload, bound: dict) -> str | None:
    """Decide from shapes alone, or None when that is impossible (dynamic shapes, kv_seqlens, key_mask)."""
    direction = _COMPILE_TIME[overload]
    if bound["kv_seqlens"] is not None or bound["key_mask"] is not None:
        return None
    sizes = [_static_size(bound[n]) for n in ("q", "k", "v")]
    if any(s is None for s in sizes):
        return None
    q_node = bound["q"]
    device, dtype = q_node.get_device(), q_node.get_dtype()
    q, k, v = (torch.randn(s, dtype=dtype, device=device) for s in sizes)
    call = AttnCall("attention", q, k, v, float(bound["scale"]), bool(bound["causal"]),
                    int(bound["window_left"]), int(bound["window_right"]))
    from ..tuning.decisions import decide

    return decide(call, device_info(device), direction)
