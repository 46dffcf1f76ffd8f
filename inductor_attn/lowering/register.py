"""Inductor lowerings for the ``inductor_attn`` ops: decide at compile time, emit a direct call.

Registered the first time a fake impl runs (i.e. while tracing for torch.compile), not at import.
"""

from __future__ import annotations

import threading

from .._compat import inductor_lowering
from ..ops import BACKWARD_OPS, FORWARD_OPS

_LOCK = threading.Lock()
_REGISTERED = False


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
        _REGISTERED = True


def _make_lowering(overload, fallback_handler):
    emit = fallback_handler(overload, add_to_fallback_set=False)

    def lower(*args, **kwargs):
        return emit(*args, **kwargs)

    return lower
