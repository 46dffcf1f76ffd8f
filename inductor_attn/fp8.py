"""The public fp8 entry point: :func:`fp8_attention` (docs/using.md, "fp8 attention")."""

from __future__ import annotations

import torch

from .api import _scale, _window
from .ops.checks import check_bool
from .ops.fp8 import check_fp8, check_fp8_values, fp8_attention_op, refuse_grad


def fp8_attention(q, k, v, *, q_descale, k_descale, v_descale, causal: bool = False, scale: float | None = None,
                  window=None, out_dtype: torch.dtype = torch.bfloat16, return_lse: bool = False,
                  check_values: bool = True):
    """Attention of the dequantised inputs ``q * q_descale``, ``k * k_descale``, ``v * v_descale``, forward only.

    Args:
        q: (B, Hq, Lq, D); k: (B, Hkv, Lk, D); v: (B, Hkv, Lk, D); all torch.float8_e4m3fn, any strides.
        q_descale, k_descale, v_descale: float32, shape () or (1,) (one per tensor) or (B, Hkv) (one per batch
            and kv head; q head h takes its kv head's), finite and >= 0.
        causal, scale, window: as in :func:`inductor_attn.attention` (scale applies to the dequantised scores).
        out_dtype: bfloat16 (what FA3 writes), float16 or float32.
        return_lse: also return the float32 lse (B, Hq, Lq).
        check_values: check the descales' values (eagerly a device sync and a ValueError; compiled, a device-side
            assert). False skips it.

    Runs on the fastest correct candidate for the shape (FA3's fp8 forward on an H100/H200 with tokenspeed-fa3
    installed; the reference elsewhere), each gated against the reference of the dequantised inputs within
    ``tuning.correctness.TOLERANCES[torch.float8_e4m3fn]``. No autograd: inputs that require grad are refused.
    """
    refuse_grad({"q": q, "k": k, "v": v, "q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale})
    for name, flag in (("causal", causal), ("return_lse", return_lse), ("check_values", check_values)):
        check_bool(name, flag)
    left, right = _window(window, causal)
    descales = (q_descale, k_descale, v_descale)
    check_fp8(q, k, v, descales, scale, left, right, out_dtype)
    if check_values:
        check_fp8_values(descales)
    out, lse = fp8_attention_op(q, k, v, *descales, _scale(scale, q), causal, left, right, out_dtype, "")
    return (out, lse) if return_lse else out
