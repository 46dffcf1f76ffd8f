"""The ``inductor_attn::*`` custom ops: schemas, fake impls, autograd.

Each op returns ``(out, lse)``; ``lse`` is float32 (B, H, Lq), or (H, total_q) for varlen. The last
argument, ``choice``, is
- ``""`` for user calls: the arguments' structure is checked (types, shapes, dtypes, devices; not the values of
  index tensors, which the public functions check: here that would sync the device on every call, the
  backward's included) and the kernel is decided at run time, per bucket;
- ``CHECKED`` (``"*"``): decided at run time too, unchecked, because the arguments were checked before: by the
  fake impl once while tracing (compiled code with dynamic shapes: lowering/ sets it), or by the public
  functions (api.py), whose eager calls pass it;
- a candidate (``"<backend>:<config>"``, from ``run_candidate``): checked, then run on that candidate.
Backward ops take ``choice`` the same way; autograd calls them with ``""`` (a backward candidate's configs
are not its forward's), so the backward of a ``run_candidate`` call is decided at run time. Compiled code
with static shapes does not call these ops at all: lowering/ replaces those calls by their plans, or by the
thin ``launch`` op (ops/launch.py), which decides varlen and block-sparse calls per call as these ops would.
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor

from .. import runtime
from ..backends import AttnCall
from ..block_mask import BlockSparseMask
from ..layout import new_grads, new_outputs
from ..runtime import CHECKED
from . import checks

LIB = "inductor_attn"

# Called once, the first time a fake impl runs (while tracing for torch.compile or export): the package
# installs its Inductor pass there, so importing inductor_attn changes no Inductor config and stays cheap.
ON_FIRST_TRACE: list = []
_TRACED = threading.Event()


def _on_trace() -> None:
    if not _TRACED.is_set():
        for hook in ON_FIRST_TRACE:
            hook()
        _TRACED.set()


# --------------------------------------------------------------------------------------------- dense
@torch.library.custom_op(f"{LIB}::attention", mutates_args=())
def attention_op(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, window_left: int,
                 window_right: int, kv_seqlens: Tensor | None, key_mask: Tensor | None,
                 choice: str) -> tuple[Tensor, Tensor]:
    if choice != CHECKED:
        checks.check_attention(q, k, v, scale, window_left, window_right, kv_seqlens, key_mask)
    call = AttnCall("attention", q, k, v, scale, causal, window_left, window_right, kv_seqlens,
                                key_mask=key_mask)
    return runtime.forward(call, choice)


@attention_op.register_fake
def _(q, k, v, scale, causal, window_left, window_right, kv_seqlens, key_mask, choice):
    checks.check_attention(q, k, v, scale, window_left, window_right, kv_seqlens, key_mask)
    _on_trace()
    return new_outputs("attention", q, v)


@torch.library.custom_op(f"{LIB}::attention_backward", mutates_args=())
def attention_backward_op(grad_out: Tensor, grad_lse: Tensor | None, q: Tensor, k: Tensor, v: Tensor,
                          out: Tensor, lse: Tensor, scale: float, causal: bool, window_left: int,
                          window_right: int, kv_seqlens: Tensor | None, key_mask: Tensor | None,
                          choice: str) -> tuple[Tensor, Tensor, Tensor]:
    call = AttnCall("attention", q, k, v, scale, causal, window_left, window_right, kv_seqlens,
                                key_mask=key_mask)
    return runtime.backward(call, choice, out, lse, grad_out, grad_lse)


@attention_backward_op.register_fake
def _(grad_out, grad_lse, q, k, v, out, lse, scale, causal, window_left, window_right, kv_seqlens, key_mask,
      choice):
    return tuple(new_grads(q, k, v))


def _attention_setup(ctx, inputs, output):
    ctx.set_materialize_grads(False)  # an unused lse gets None, not zeros: kernels then skip d(lse) work
    q, k, v, scale, causal, wl, wr, kv_seqlens, key_mask, choice = inputs
    ctx.save_for_backward(q, k, v, *output, kv_seqlens, key_mask)
    ctx.args = (scale, causal, wl, wr)


def _attention_grad(ctx, grad_out, grad_lse):
    q, k, v, out, lse, kv_seqlens, key_mask = ctx.saved_tensors
    dq, dk, dv = attention_backward_op(grad_out, grad_lse, q, k, v, out, lse, *ctx.args, kv_seqlens, key_mask,
                                       "")
    return (dq, dk, dv) + (None,) * 7


attention_op.register_autograd(_attention_grad, setup_context=_attention_setup)


# -------------------------------------------------------------------------------------------- varlen
@torch.library.custom_op(f"{LIB}::varlen_attention", mutates_args=())
def varlen_attention_op(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                        max_seqlen_q: int, max_seqlen_k: int, scale: float, causal: bool, window_left: int,
                        window_right: int, choice: str) -> tuple[Tensor, Tensor]:
    if choice != CHECKED:
        checks.check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, window_left,
                            window_right)
    call = AttnCall("varlen", q, k, v, scale, causal, window_left, window_right,
                                cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    return runtime.forward(call, choice)


@varlen_attention_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal, window_left,
      window_right, choice):
    checks.check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, window_left,
                        window_right)
    _on_trace()
    return new_outputs("varlen", q, v)


@torch.library.custom_op(f"{LIB}::varlen_attention_backward", mutates_args=())
def varlen_attention_backward_op(grad_out: Tensor, grad_lse: Tensor | None, q: Tensor, k: Tensor, v: Tensor,
                                 out: Tensor, lse: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                                 max_seqlen_q: int, max_seqlen_k: int, scale: float, causal: bool,
                                 window_left: int, window_right: int,
                                 choice: str) -> tuple[Tensor, Tensor, Tensor]:
    call = AttnCall("varlen", q, k, v, scale, causal, window_left, window_right,
                                cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    return runtime.backward(call, choice, out, lse, grad_out, grad_lse)


@varlen_attention_backward_op.register_fake
def _(grad_out, grad_lse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
      causal, window_left, window_right, choice):
    return tuple(new_grads(q, k, v))


def _varlen_setup(ctx, inputs, output):
    ctx.set_materialize_grads(False)  # an unused lse gets None, not zeros: kernels then skip d(lse) work
    q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, wl, wr, choice = inputs
    ctx.save_for_backward(q, k, v, *output, cu_q, cu_k)
    ctx.args = (max_q, max_k, scale, causal, wl, wr)


def _varlen_grad(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = varlen_attention_backward_op(grad_out, grad_lse, q, k, v, out, lse, cu_q, cu_k, *ctx.args, "")
    return (dq, dk, dv) + (None,) * 9


varlen_attention_op.register_autograd(_varlen_grad, setup_context=_varlen_setup)


# -------------------------------------------------------------------------------------- block-sparse
def sparse_mask(q, k, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, partial_bits,
                block_q, block_kv, density, partial_fraction) -> BlockSparseMask:
    return BlockSparseMask((q.shape[2], k.shape[2]), block_q, block_kv, kv_num_blocks, kv_indices,
                           full_kv_num_blocks, full_kv_indices, partial_bits, density, partial_fraction)


@torch.library.custom_op(f"{LIB}::block_sparse_attention", mutates_args=())
def block_sparse_attention_op(q: Tensor, k: Tensor, v: Tensor, kv_num_blocks: Tensor, kv_indices: Tensor,
                              full_kv_num_blocks: Tensor | None, full_kv_indices: Tensor | None,
                              partial_bits: Tensor, block_q: int, block_kv: int, scale: float, density: float,
                              partial_fraction: float, choice: str) -> tuple[Tensor, Tensor]:
    sparse = sparse_mask(q, k, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, partial_bits,
                         block_q, block_kv, density, partial_fraction)
    if choice != CHECKED:
        checks.check_block_sparse(q, k, v, sparse, scale)
    call = AttnCall("block_sparse", q, k, v, scale, sparse=sparse)
    return runtime.forward(call, choice)


@block_sparse_attention_op.register_fake
def _(q, k, v, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, partial_bits, block_q, block_kv,
      scale, density, partial_fraction, choice):
    sparse = sparse_mask(q, k, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, partial_bits,
                         block_q, block_kv, density, partial_fraction)
    checks.check_block_sparse(q, k, v, sparse, scale)
    _on_trace()
    return new_outputs("block_sparse", q, v)


@torch.library.custom_op(f"{LIB}::block_sparse_attention_backward", mutates_args=())
def block_sparse_attention_backward_op(grad_out: Tensor, grad_lse: Tensor | None, q: Tensor, k: Tensor,
                                       v: Tensor, out: Tensor, lse: Tensor, kv_num_blocks: Tensor,
                                       kv_indices: Tensor, full_kv_num_blocks: Tensor | None,
                                       full_kv_indices: Tensor | None, partial_bits: Tensor, block_q: int,
                                       block_kv: int, scale: float, density: float, partial_fraction: float,
                                       choice: str) -> tuple[Tensor, Tensor, Tensor]:
    sparse = sparse_mask(q, k, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, partial_bits,
                         block_q, block_kv, density, partial_fraction)
    call = AttnCall("block_sparse", q, k, v, scale, sparse=sparse)
    return runtime.backward(call, choice, out, lse, grad_out, grad_lse)


@block_sparse_attention_backward_op.register_fake
def _(grad_out, grad_lse, q, k, v, out, lse, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
      partial_bits, block_q, block_kv, scale, density, partial_fraction, choice):
    return tuple(new_grads(q, k, v))


def _sparse_setup(ctx, inputs, output):
    ctx.set_materialize_grads(False)  # an unused lse gets None, not zeros: kernels then skip d(lse) work
    q, k, v, cnt, idx, full_cnt, full_idx, bits, bq, bk, scale, density, partial, choice = inputs
    ctx.save_for_backward(q, k, v, *output, cnt, idx, full_cnt, full_idx, bits)
    ctx.args = (bq, bk, scale, density, partial)


def _sparse_grad(ctx, grad_out, grad_lse):
    q, k, v, out, lse, *mask_tensors = ctx.saved_tensors
    dq, dk, dv = block_sparse_attention_backward_op(grad_out, grad_lse, q, k, v, out, lse, *mask_tensors,
                                                    *ctx.args, "")
    return (dq, dk, dv) + (None,) * 11


block_sparse_attention_op.register_autograd(_sparse_grad, setup_context=_sparse_setup)

FORWARD_OPS = (attention_op, varlen_attention_op, block_sparse_attention_op)
BACKWARD_OPS = (attention_backward_op, varlen_attention_backward_op, block_sparse_attention_backward_op)


def _no_double_backward(ctx, *grads):
    # without it, torch's own error asks the caller to register an autograd formula
    raise NotImplementedError("inductor_attn's attention has no second derivative: gradients made with "
                              "create_graph=True cannot be differentiated again (double backward)")


for _op in BACKWARD_OPS:
    _op.register_autograd(_no_double_backward)
