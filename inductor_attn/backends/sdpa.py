"""PyTorch SDPA's CUDA kernels as candidates: cuDNN, FA2 ("flash") and memory-efficient.

They are called through the aten ops that F.scaled_dot_product_attention dispatches to, because those
also return the log-sum-exp. The first config is the kernel SDPA itself would pick for the problem
(``torch._fused_sdp_choice``), so with this backend first in the registry "SDPA default" is the
baseline every other candidate must beat.

Masks: the aten ops' ``is_causal`` is upper-left aligned, so it is used only when Lq == Lk. Lower-right
causal with Lq != Lk, windows and key_mask become an additive bias (B or 1, 1, Lq, Lk), which the flash kernel
cannot take (pruned) and which is capped in size. Calls with kv_seqlens are pruned: keys masked by a bias still
enter P @ V (:data:`KV_SEQLENS_LEAK`). GQA: flash and cuDNN get k/v as they are; the efficient kernel gets them
expanded (a copy, as SDPA's own enable_gqa path does for it).
"""

from __future__ import annotations

import functools

import torch

from .._compat import fused_sdp_choice
from ..device import DeviceInfo
from ..layout import conform
from ..problem import Problem, default_scale
from .base import AttnCall, Backend, Candidate, Config, Plan, Takes
from .masks import dense_mask_fn

KERNELS = ("cudnn", "flash", "efficient")
_SDP_CHOICE = {1: "flash", 2: "efficient", 3: "cudnn"}  # torch.nn.attention.SDPBackend values
MAX_BIAS_BYTES = 1 << 30
# Measured on an H200 (bf16, NaN written into k and v past each length): the efficient and cuDNN kernels gave
# NaN outputs at decode (Lq 1 and 4) and prefill. The backward multiplies the same zeros by V (in dP), and no
# gate runs in the off, heuristic and cache-only modes: pruned for both directions.
KV_SEQLENS_LEAK = ("SDPA's kernels would be told kv_seqlens as an additive -inf bias, but keys past kv_seqlens still "
                   "enter P @ V (and dP = dO @ V^T) with weight 0, and 0 * NaN (an unwritten cache slot) reaches "
                   "the output")


def _needs_bias(p: Problem) -> bool:
    lower_right_causal = p.causal and p.len_q != p.len_k
    return lower_right_causal or p.window_left >= 0 or p.window_right >= 0 or p.has_key_mask


def sdpa_default_kernel(p: Problem, dev: DeviceInfo) -> str:
    """The kernel F.scaled_dot_product_attention picks for this problem on the current GPU; for a simulated
    device, :func:`simulated_default_kernel` (no CUDA call: simulating is how other GPUs are tested on a
    machine without one)."""
    if _needs_bias(p):
        return "efficient"  # the kernel SDPA takes for an arbitrary additive mask
    return simulated_default_kernel(p, dev) if dev.simulated else _fused_choice(p)


@functools.lru_cache(maxsize=256)
def _fused_choice(p: Problem) -> str:
    dtype = getattr(torch, p.dtype)
    q = torch.empty(1, p.heads_q, p.len_q, p.head_dim, dtype=dtype, device="cuda")
    k = torch.empty(1, p.heads_kv, p.len_k, p.head_dim, dtype=dtype, device="cuda")
    v = torch.empty(1, p.heads_kv, p.len_k, p.head_dim_v, dtype=dtype, device="cuda")
    choice = fused_sdp_choice(q, k, v, is_causal=p.causal, enable_gqa=p.heads_q != p.heads_kv)
    return _SDP_CHOICE.get(choice, "efficient")


def simulated_default_kernel(p: Problem, dev: DeviceInfo) -> str:
    """SDPA's pick on a device described, not present: cuDNN for fp16/bf16 from sm_90 on (what
    ``torch._fused_sdp_choice`` returned on an H200 with torch 2.11 and cuDNN 9.19 for D 64-256, causal or not),
    flash for fp16/bf16 before that, efficient otherwise.

    >>> from inductor_attn.device import parse_device_override
    >>> p = Problem("attention", "bfloat16", "cuda", 1, 8, 8, 128, 128, 128, 128)
    >>> simulated_default_kernel(p, parse_device_override("sm_100"))
    'cudnn'
    """
    if p.dtype not in ("float16", "bfloat16"):
        return "efficient"
    return "cudnn" if dev.arch >= 90 else "flash"


def _bias(call: AttnCall) -> torch.Tensor:
    """Additive float mask (B or 1, 1, Lq, Lk) with -inf where the reference mask forbids; the last dim
    is padded to a multiple of 16 in memory (the efficient kernel wants aligned rows)."""
    lq, lk = call.q.shape[2], call.k.shape[2]
    allowed = dense_mask_fn(lq, lk, call.causal, call.window_left, call.window_right, None, call.q.device,
                            call.key_mask)(0, lq)[:, 0]  # (B or 1, 1, Lq, Lk)
    padded = torch.empty(*allowed.shape[:-1], -(-lk // 16) * 16, dtype=call.q.dtype, device=call.q.device)
    bias = padded[..., :lk]
    bias.copy_(torch.where(allowed, 0.0, float("-inf")))
    return bias.expand(call.q.shape[0], call.q.shape[1], lq, lk)


def _scale_kwargs(call: AttnCall) -> dict:
    """The aten ops' ``scale`` keyword, left out where ``call.scale`` is their own default (default_scale), so
    that compiled code calls them with no keyword argument: Python's keyword parsing of an aten op call costs
    host time on every call (about 1 us on the CI CPU); stock compiled SDPA passes none."""
    d = call.q.shape[-1]
    if isinstance(call.scale, float) and isinstance(d, int) and call.scale == default_scale(d):
        return {}
    return {"scale": call.scale}


def _launch(kernel: str, needs_bias: bool, empty_rows: bool, call: AttnCall, with_lse: bool = True):
    """(out, lse); ``with_lse=False``: (out,) alone, cuDNN and efficient told not to compute the lse (flash always
    does), as SDPA itself calls them for inference."""
    q, k, v = call.q, call.k, call.v
    bias = _bias(call) if needs_bias else None
    is_causal = call.causal and bias is None
    aten = torch.ops.aten  # the ops' overloads, as generated code calls them: an overload packet resolves per call
    kw = _scale_kwargs(call)
    if kernel == "flash":
        out, lse = aten._scaled_dot_product_flash_attention.default(q, k, v, 0.0, is_causal, False, **kw)[:2]
    elif kernel == "cudnn":
        out, lse = aten._scaled_dot_product_cudnn_attention.default(q, k, v, bias, with_lse, 0.0, is_causal, False,
                                                                    **kw)[:2]
    else:
        group = q.shape[1] // k.shape[1]
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out, lse = aten._scaled_dot_product_efficient_attention.default(q, k, v, bias, with_lse, 0.0, is_causal,
                                                                        **kw)[:2]
    if not with_lse:
        return (conform(out, q),)
    b, h, lq = q.shape[:3]
    # lse layouts differ: flash (B, H, Lq), cuDNN (B, H, Lq, 1), efficient padded to 32 rows
    lse = lse.reshape(b, h, -1)[..., :lq].float()
    if kernel == "efficient" and empty_rows:
        # a row whose every key is masked: the efficient kernel's lse there is not -inf, our contract's (and the
        # reference's) value (a paged sequence of length 0 showed it, H200); its out there is 0
        lse = lse.masked_fill(bias[:, :1].isneginf().all(-1), float("-inf"))
    return conform(out, q), lse.contiguous()


def _launch_backward(kernel: str, needs_bias: bool, empty_rows: bool, call: AttnCall, out, lse, grad_out,
                     grad_lse):
    """dq, dk, dv from SDPA's backward kernels, fed with whichever forward made ``out`` and ``lse`` (any
    backend's: our lse contract is the natural-log float32 (B, H, Lq) these kernels take). Placeholders
    are None, which the op call passes as undefined tensors (no dropout: no RNG state; dense: no
    cumulative lengths). A gradient of the lse is not something these kernels take (``Takes.grad_lse``)."""
    q, k, v = call.q, call.k, call.v
    bias = _bias(call) if needs_bias else None
    is_causal = call.causal and bias is None
    lq, lk = q.shape[2], k.shape[2]
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    aten = torch.ops.aten
    kw = _scale_kwargs(call)
    group = q.shape[1] // k.shape[1]
    if kernel == "flash":
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward.default(
            grad_out, q, k, v, out, lse, None, None, lq, lk, 0.0, is_causal, None, None, **kw)
    elif kernel == "cudnn":
        # aten's cuDNN backward reuses a graph built for another grad_out layout: on torch 2.11 (H100) stock eager
        # SDPA's dq is off by 1.4 (rel.) for a BLHD grad_out after a BHLD one, and for BHLD after BLHD. With out
        # and grad_out always in q's layout (aten's own forward writes out so, pytorch #138354) it sees one
        grad_out, out = conform(grad_out, q), conform(out, q)
        dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward.default(
            grad_out, q, k, v, out, lse.unsqueeze(-1), None, None, bias, None, None, lq, lk, 0.0, is_causal, **kw)
    else:
        kr, vr = (k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)) if group > 1 else (k, v)
        # the efficient kernels keep the lse padded to whole 32-row blocks (its forward returns it so)
        padded = lse.new_zeros(*lse.shape[:-1], -(-lq // 32) * 32)
        # rows with no key: +inf makes the kernel's exp(s - lse) 0 there, where -inf - (-inf) would give NaN
        padded[..., :lq] = lse.masked_fill(lse == float("-inf"), float("inf")) if empty_rows else lse
        dq, dk, dv = aten._scaled_dot_product_efficient_attention_backward.default(
            grad_out, q, kr, vr, bias, _rows_heads_interleaved(out), padded, None, None, 0.0,
            [True, True, True, False], is_causal, **kw)[:3]
        if group > 1:  # gradients of the repeated heads, summed back onto each kv head
            dk, dv = (g.unflatten(1, (k.shape[1], group)).sum(2) for g in (dk, dv))
    return conform(dq, q), conform(dk, k), conform(dv, v)


def _rows_heads_interleaved(out: torch.Tensor) -> torch.Tensor:
    """``out`` (B, H, L, D) in the memory layout (B, L, H, D) its forward writes, copied if it has another.
    The efficient backward kernel takes every stride of out but the row's, which it assumes to be H * D
    (PyTorch's mem_eff_attention/kernel_backward.h, ``o_strideM``). From another layout, such as the
    (B, H, L, D)-contiguous out of another forward, it reads wrong rows and, at long L, past the tensor's
    end: an illegal memory access that leaves the process's CUDA context unusable."""
    heads, dim = out.shape[1], out.shape[3]
    if out.stride(3) == 1 and out.stride(2) == heads * dim:
        return out
    return out.transpose(1, 2).contiguous().transpose(1, 2)


class SdpaBackend(Backend):
    name = "sdpa"
    knobs = {"kernel": KERNELS}
    takes = Takes(key_mask=True, backward=True, grad_lse=False)

    def supports(self, p: Problem, dev: DeviceInfo, direction: str = "forward") -> str | None:
        if p.device_type != "cuda":
            return "needs a CUDA device"
        if p.op != "attention":
            return f"SDPA has no {p.op} entry point (a dense mask would be O(Lq x Lk))"
        if p.dtype == "float64":
            return "float64 runs on the reference only"
        if p.has_kv_seqlens:
            return KV_SEQLENS_LEAK
        bias_bytes = (p.batch if p.has_key_mask else 1) * p.len_q * p.len_k * 2
        if _needs_bias(p) and bias_bytes > MAX_BIAS_BYTES:
            return f"this mask needs an additive bias of {bias_bytes >> 20} MiB (cap {MAX_BIAS_BYTES >> 20} MiB)"
        return None

    def configs(self, p: Problem, dev: DeviceInfo, direction: str = "forward") -> list[Candidate]:
        first = sdpa_default_kernel(p, dev)
        cfgs = [Config.of(kernel=k) for k in (first, *(k for k in KERNELS if k != first))]
        return [Candidate(self.name, c, _pruned(p, c["kernel"], direction)) for c in cfgs]

    def plan(self, p: Problem, dev: DeviceInfo, cfg: Config, direction: str) -> Plan:
        # aten ops and the bias's torch ops: the graph can hold them
        if direction == "backward":
            launch = functools.partial(_launch_backward, cfg["kernel"], _needs_bias(p), p.may_have_empty_rows)
            return Plan(launch, traced=launch)
        launch = functools.partial(_launch, cfg["kernel"], _needs_bias(p), p.may_have_empty_rows)
        return Plan(launch, traced=launch, traced_out_only=functools.partial(launch, with_lse=False))


def dtype_pruned(kernel: str, dtype: str) -> str | None:
    """Why SDPA's ``kernel`` cannot take ``dtype`` (flash and cuDNN take fp16/bf16 only), or None. Shared with
    paged_gather, whose dense calls run these kernels."""
    if kernel in ("flash", "cudnn") and dtype == "float32":
        return f"SDPA {kernel} needs fp16/bf16"
    return None


def _pruned(p: Problem, kernel: str, direction: str = "forward") -> str | None:
    if direction == "backward" and torch.are_deterministic_algorithms_enabled():
        return f"SDPA {kernel} backward is not a deterministic algorithm in torch (atomic adds)"
    reason = dtype_pruned(kernel, p.dtype)
    if reason is not None:
        return reason
    if kernel == "flash" and _needs_bias(p):
        return "SDPA flash takes no mask: lower-right causal (Lq != Lk), windows and key_mask need one"
    if kernel == "flash" and p.head_dim != p.head_dim_v:
        return "SDPA flash needs the same head dim for q/k and v"
    return None


BACKEND = SdpaBackend()
