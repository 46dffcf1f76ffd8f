"""``inductor_attn::fp8_attention``: attention on float8_e4m3fn q, k, v with descale factors, forward only.

The descales say what each fp8 tensor stands for: the attention of ``q * q_descale``, ``k * k_descale`` and
``v * v_descale``, as FA3 reads them. Each is a float32 tensor of shape () or (1,) (per tensor) or (B, Hkv) (per
batch and kv head; q head h takes the descale of its kv head, h // (Hq / Hkv)). The op returns ``(out, lse)``:
out in ``out_dtype`` and q's stride order, lse float32 (B, Hq, Lq) of the dequantised scores, as the other ops.

There is no autograd (FA3's fp8 kernels are forward only, and fp8 training needs scaled gradients of its own):
inputs that require grad are refused while grad mode is on (checks.refuse_grad). The choice is made at run time
like the other ops' (``choice`` "" or a candidate's name); compiled code calls this op as it is, and it decides per
bucket (one memo lookup).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import runtime
from ..backends import AttnCall
from ..layout import new_outputs
from ..runtime import CHECKED
from .attention import _on_trace
from .checks import _dtype_names, assert_on_device, check_attention, fail, shape_text, values_deferred

FP8_DTYPES = (torch.float8_e4m3fn,)  # what FA3's fp8 kernels read (its build has no e5m2, no fnuz)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
DESCALES = ("q_descale", "k_descale", "v_descale")
DESCALE_VALUES = "fp8_attention: a descale is negative, NaN or infinite"


def check_fp8(q, k, v, descales, scale, window_left: int, window_right: int, out_dtype) -> None:
    """What the op needs that does not read tensor values: q, k, v all float8_e4m3fn (B, H, L, D) tensors, the
    descales float32 of shape (), (1,) or (B, Hkv) on q's device, and a supported ``out_dtype``."""
    check_attention(q, k, v, scale, window_left, window_right, None, dtypes=FP8_DTYPES,
                    refused_by=("fp8_attention", "it runs a kernel for every call"))
    batch, heads_kv = q.shape[0], k.shape[1]
    for name, d in zip(DESCALES, descales):
        if not isinstance(d, torch.Tensor):
            fail(TypeError, f"{name} must be a float32 torch.Tensor of shape (), (1,) or (batch, kv heads) = "
                            f"({batch}, {heads_kv}), got {type(d).__name__}")
        if d.dtype != torch.float32:
            fail(TypeError, f"{name} must have dtype float32, got {d.dtype}")
        if tuple(d.shape) not in ((), (1,), (batch, heads_kv)):
            fail(ValueError, f"{name} must have shape (), (1,) or (batch, kv heads) = ({batch}, {heads_kv}), got "
                             f"{shape_text(d.shape)}")
        if d.device != q.device:
            fail(ValueError, f"{name} is on {d.device} but q is on {q.device}")
    if out_dtype not in OUT_DTYPES:
        fail(TypeError, f"out_dtype must be one of {_dtype_names(OUT_DTYPES)}, got {out_dtype}")


def check_fp8_values(descales) -> None:
    """Every descale finite and >= 0. Eagerly a device sync and a ValueError naming the tensor; compiled, a
    device-side assert."""
    if values_deferred(*descales):
        ok = torch.stack([(d.isfinite() & (d >= 0)).all() for d in descales]).all()
        assert_on_device(ok, DESCALE_VALUES)
        return
    for name, d in zip(DESCALES, descales):
        bad = ~(d.isfinite() & (d >= 0))
        if bad.any():
            fail(ValueError, f"{name} must be finite and >= 0, got {d[bad].flatten()[0].item()} at index "
                             f"{tuple(i.item() for i in bad.nonzero()[0])} (shape {shape_text(d.shape)})")


def per_kv_head(d: Tensor, batch: int, heads_kv: int) -> Tensor:
    """A descale as a (B, Hkv) view, as FA3 takes it (a per-tensor one broadcast with zero strides)."""
    return d if d.dim() == 2 else d.reshape(1, 1).expand(batch, heads_kv)


@torch.library.custom_op("inductor_attn::fp8_attention", mutates_args=())
def fp8_attention_op(q: Tensor, k: Tensor, v: Tensor, q_descale: Tensor, k_descale: Tensor, v_descale: Tensor,
                     scale: float, causal: bool, window_left: int, window_right: int, out_dtype: torch.dtype,
                     choice: str) -> tuple[Tensor, Tensor]:
    descales = (q_descale, k_descale, v_descale)
    if choice != CHECKED:  # checked already: by the fake impl while tracing, or by fp8_attention
        check_fp8(q, k, v, descales, scale, window_left, window_right, out_dtype)
    batch, heads_kv = q.shape[0], k.shape[1]
    call = AttnCall("attention", q, k, v, scale, causal, window_left, window_right,
                    descale=tuple(per_kv_head(d, batch, heads_kv) for d in descales), out_dtype=out_dtype)
    return runtime.forward(call, choice)


@fp8_attention_op.register_fake
def _(q, k, v, q_descale, k_descale, v_descale, scale, causal, window_left, window_right, out_dtype, choice):
    check_fp8(q, k, v, (q_descale, k_descale, v_descale), scale, window_left, window_right, out_dtype)
    _on_trace()
    return new_outputs("attention", q, v, out_dtype)
