"""The public fp8 entry points: :func:`fp8_attention` and :func:`quantize` (docs/using.md, "fp8 attention")."""

from __future__ import annotations

import torch

from .api import _scale, _window, checked
from .ops.checks import check_bool, refuse_forward_ad, refuse_grad
from .ops.fp8 import check_fp8, check_fp8_values, fp8_attention_op

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
QUANTISED_FROM = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # what quantize() takes


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
        check_values: check the descales' values (eagerly a device sync and a ValueError; compiled or on fake
            tensors, a device-side assert). False skips it.

    Runs on the fastest correct candidate for the shape (FA3's fp8 forward on an H100/H200 with tokenspeed-fa3
    installed; the reference elsewhere), each gated against the reference of the dequantised inputs within
    ``tuning.correctness.TOLERANCES[torch.float8_e4m3fn]``. No autograd: inputs that require grad are refused
    while grad mode is on (under torch.no_grad() or torch.inference_mode() they are taken).
    """
    refuse_grad("fp8_attention", {"q": q, "k": k, "v": v, "q_descale": q_descale, "k_descale": k_descale,
                                  "v_descale": v_descale})
    refuse_forward_ad("fp8_attention", {"q": q, "k": k, "v": v, "q_descale": q_descale, "k_descale": k_descale,
                                        "v_descale": v_descale})
    for name, flag in (("causal", causal), ("return_lse", return_lse), ("check_values", check_values)):
        check_bool(name, flag)
    left, right = _window(window, causal)
    descales = (q_descale, k_descale, v_descale)
    check_fp8(q, k, v, descales, scale, left, right, out_dtype)
    if check_values:
        check_fp8_values(descales)
    out, lse = fp8_attention_op(q, k, v, *descales, _scale(scale, q), causal, left, right, out_dtype, checked())
    return (out, lse) if return_lse else out


def quantize(x: torch.Tensor, heads_kv: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x8, descale)``: ``x`` divided by ``descale = amax(|x|) / 448`` and rounded to float8_e4m3fn, so that its
    largest magnitude lands on e4m3's largest value and ``x8 * descale`` is ``x`` to e4m3's 3 mantissa bits.

    Args:
        x: (B, H, L, D) floating point.
        heads_kv: None: one descale for the whole tensor, shape (). An int: one per (batch, kv head), shape
            (B, heads_kv), each from the amax over the H / heads_kv heads that share a kv head (q's heads of one
            GQA group share one ``q_descale`` in FA3), as :func:`fp8_attention` takes them.

    An all-zero group gets the smallest normal float32 as its descale (not 0: the division would give NaN).
    Infinite or NaN values in ``x`` make their group's descale infinite or NaN, which :func:`fp8_attention`
    refuses when it checks values.

    >>> x = torch.tensor([[[[1.0, -2.0]], [[0.5, 0.25]]]])  # (B=1, H=2, L=1, D=2)
    >>> x8, d = quantize(x, heads_kv=2)
    >>> d.tolist(), (x8.float() * d[:, :, None, None]).tolist() == x.tolist()
    ([[0.004464285913854837, 0.0011160714784637094]], True)
    """
    if not isinstance(x, torch.Tensor) or x.dtype not in QUANTISED_FROM or x.dim() != 4:
        raise TypeError(f"x must be a float16, bfloat16, float32 or float64 (B, H, L, D) torch.Tensor, got "
                        f"{getattr(x, 'dtype', type(x).__name__)} of shape {tuple(getattr(x, 'shape', ()))}")
    batch, heads = x.shape[:2]
    # a SymInt too: the routing pass quantises with k's head count, symbolic under dynamic shapes
    if heads_kv is not None and (isinstance(heads_kv, bool) or not isinstance(heads_kv, (int, torch.SymInt))
                                 or heads_kv < 1 or heads % heads_kv):
        raise ValueError(f"heads_kv must be None or a positive int dividing x's {heads} heads, got {heads_kv!r}")
    if x.shape[2] * x.shape[3] == 0:  # no values: each group is all-zero (amax refuses an empty reduction)
        amax = torch.zeros(batch, heads, dtype=torch.float32, device=x.device)
    else:
        amax = x.abs().amax(dim=(2, 3)).float()  # (B, H): no copy of a strided x
    if heads_kv is None:
        amax = amax.amax()
    else:
        amax = amax.unflatten(1, (heads_kv, heads // heads_kv)).amax(-1)
    descale = (amax / E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    per_head = descale if heads_kv is None else (
        descale[:, :, None].expand(batch, heads_kv, heads // heads_kv).reshape(batch, heads)[:, :, None, None])
    # e4m3fn has no infinity: a value past 448 would become NaN, and the division may round just past it
    x8 = (x.float() / per_head).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return x8, descale
