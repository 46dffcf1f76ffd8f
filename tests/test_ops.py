"""The ``inductor_attn::*`` custom ops: schemas, fake impls and autograd registration (torch.library.opcheck),
and what the ops promise beyond their math (lse dtype, the ``choice`` argument, gradients into lse)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.library import opcheck
from torch.nn.attention.flex_attention import create_block_mask

import inductor_attn
from inductor_attn.backends import REFERENCE, only_backends
from inductor_attn.ops import BACKWARD_OPS, FORWARD_OPS

OPS = torch.ops.inductor_attn
# Every opcheck utility, aot_dispatch_dynamic included (it runs the op, and its backward for inputs that
# require grad, through AOTAutograd with dynamic shapes).
ALL_CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def rand(*shape: int, dtype=torch.float64, grad: bool = False, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + sum(shape))
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).requires_grad_(grad)


def dense_args(dtype, grad, causal=False, window=(-1, -1), kv_seqlens=None, heads=(4, 2), key_mask=None):
    hq, hkv = heads
    q, k, v = rand(2, hq, 5, 16, dtype=dtype, grad=grad), rand(2, hkv, 7, 16, dtype=dtype, grad=grad, seed=1), \
        rand(2, hkv, 7, 8, dtype=dtype, grad=grad, seed=2)
    return (q, k, v, 0.25, causal, *window, kv_seqlens, key_mask, "")


# batch 0 keeps keys 2..6 (left padding), batch 1 keys 0, 3 and 5
KEY_MASK = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 0, 0, 1, 0, 1, 0]], dtype=torch.bool)


def varlen_args(dtype, grad, causal=False, window=(-1, -1)):
    q, k, v = rand(9, 4, 16, dtype=dtype, grad=grad), rand(12, 2, 16, dtype=dtype, grad=grad, seed=1), \
        rand(12, 2, 16, dtype=dtype, grad=grad, seed=2)
    cu_q, cu_k = torch.tensor([0, 4, 4, 9], dtype=torch.int32), torch.tensor([0, 7, 9, 12], dtype=torch.int32)
    return (q, k, v, cu_q, cu_k, 5, 7, 0.25, causal, *window, "")


def sparse_mask(lq=40, lk=70, full_blocks=True, block=32):
    bm = create_block_mask(lambda b, h, q, k: (k <= q + 30) & (q - k <= 40), None, None, lq, lk, device="cpu",
                           BLOCK_SIZE=block)
    sparse = inductor_attn.BlockSparseMask.from_block_mask(bm)
    return sparse if full_blocks else dataclasses.replace(sparse, full_kv_num_blocks=None, full_kv_indices=None)


def sparse_tensors(s):
    return (s.kv_num_blocks, s.kv_indices, s.full_kv_num_blocks, s.full_kv_indices, s.partial_bits, s.block_q,
            s.block_kv)


def block_sparse_args(dtype, grad, full_blocks=True):
    s = sparse_mask(full_blocks=full_blocks)
    q, k, v = rand(1, 2, 40, 16, dtype=dtype, grad=grad), rand(1, 2, 70, 16, dtype=dtype, grad=grad, seed=1), \
        rand(1, 2, 70, 16, dtype=dtype, grad=grad, seed=2)
    return (q, k, v, *sparse_tensors(s), 0.25, s.density, s.partial_fraction, "")


FORWARD_CASES = {
    "attention": (OPS.attention.default, lambda dt, g: dense_args(dt, g)),
    "attention_causal_window_kv_seqlens": (OPS.attention.default, lambda dt, g: dense_args(
        dt, g, causal=True, window=(3, -1), kv_seqlens=torch.tensor([7, 2], dtype=torch.int32))),
    "attention_mqa_window": (OPS.attention.default, lambda dt, g: dense_args(dt, g, window=(2, 1), heads=(4, 1))),
    "attention_causal_key_mask": (OPS.attention.default,
                                  lambda dt, g: dense_args(dt, g, causal=True, key_mask=KEY_MASK)),
    "varlen_attention": (OPS.varlen_attention.default, lambda dt, g: varlen_args(dt, g)),
    "varlen_attention_causal_window": (OPS.varlen_attention.default,
                                       lambda dt, g: varlen_args(dt, g, causal=True, window=(2, -1))),
    "block_sparse_attention": (OPS.block_sparse_attention.default, lambda dt, g: block_sparse_args(dt, g)),
    "block_sparse_attention_no_full_blocks": (OPS.block_sparse_attention.default,
                                              lambda dt, g: block_sparse_args(dt, g, full_blocks=False)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("op, make_args", FORWARD_CASES.values(), ids=FORWARD_CASES.keys())
def test_forward_op_passes_opcheck_with_grad_inputs(op, make_args, dtype):
    opcheck(op, make_args(dtype, True), test_utils=ALL_CHECKS)


def fp8_args(out_dtype):
    """GQA q/k/v rounded to float8_e4m3fn, per-tensor and per-(batch, kv head) descales, causal."""
    q, k, v = (rand(*shape, dtype=torch.float32, seed=seed).to(torch.float8_e4m3fn)
               for shape, seed in (((2, 4, 6, 16), 0), ((2, 2, 9, 16), 1), ((2, 2, 9, 16), 2)))
    descales = (torch.tensor([0.5]), torch.full((2, 2), 0.25), torch.tensor(2.0))
    return (q, k, v, *descales, 0.25, True, -1, -1, out_dtype, "")


def paged_args(dtype, chunked: bool):
    """3 sequences of 7, 0 and 12 keys in pages of 4 (pool of 8 pages; -1 past each sequence's last page); the
    chunked call with a softcap."""
    table = torch.tensor([[5, 0, -1, -1], [-1, -1, -1, -1], [2, 7, 1, -1]], dtype=torch.int32)
    lens = torch.tensor([7, 0, 12], dtype=torch.int32)
    k, v = rand(8, 4, 2, 16, dtype=dtype, seed=1), rand(8, 4, 2, 8, dtype=dtype, seed=2)
    if not chunked:
        return (rand(3, 4, 16, dtype=dtype), k, v, table, lens, None, 1, 16, 0.25, True, -1, -1, 0.0, "")
    cu = torch.tensor([0, 3, 3, 5], dtype=torch.int32)
    return (rand(5, 4, 16, dtype=dtype), k, v, table, lens, cu, 3, 16, 0.25, True, 2, 0, 5.0, "")


# Forward-only ops (serving): checked without inputs that require grad
FORWARD_ONLY_CASES = {
    "paged_attention_decode": (OPS.paged_attention.default, lambda dt: paged_args(dt, chunked=False)),
    "paged_attention_chunked_window": (OPS.paged_attention.default, lambda dt: paged_args(dt, chunked=True)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("op, make_args", FORWARD_ONLY_CASES.values(), ids=FORWARD_ONLY_CASES.keys())
def test_forward_only_op_passes_opcheck(op, make_args, dtype):
    opcheck(op, make_args(dtype), test_utils=ALL_CHECKS)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_fp8_op_passes_opcheck(out_dtype):
    # all but test_schema, which compares the inputs before and after with allclose: not implemented for
    # float8_e4m3fn on the CPU (torch 2.13)
    opcheck(OPS.fp8_attention.default, fp8_args(out_dtype), test_utils=ALL_CHECKS[1:])


def test_forward_op_passes_opcheck_without_grad_inputs():
    opcheck(OPS.attention.default, dense_args(torch.float32, False, causal=True), test_utils=ALL_CHECKS)


BACKWARD_CASES = {
    "attention_backward": (OPS.attention.default, OPS.attention_backward.default, 3,
                           lambda: dense_args(torch.float64, False, causal=True,
                                              kv_seqlens=torch.tensor([7, 0], dtype=torch.int32))),
    "attention_backward_key_mask": (OPS.attention.default, OPS.attention_backward.default, 3,
                                    lambda: dense_args(torch.float64, False, key_mask=KEY_MASK)),
    "varlen_attention_backward": (OPS.varlen_attention.default, OPS.varlen_attention_backward.default, 3,
                                  lambda: varlen_args(torch.float64, False, causal=True)),
    "block_sparse_attention_backward": (OPS.block_sparse_attention.default,
                                        OPS.block_sparse_attention_backward.default, 3,
                                        lambda: block_sparse_args(torch.float64, False)),
}


@pytest.mark.parametrize("with_grad_lse", [True, False], ids=["grad_lse", "no_grad_lse"])
@pytest.mark.parametrize("forward, backward, n_inputs, make_args", BACKWARD_CASES.values(),
                         ids=BACKWARD_CASES.keys())
def test_backward_op_passes_opcheck(forward, backward, n_inputs, make_args, with_grad_lse):
    args = make_args()
    out, lse = forward(*args)
    grad_out, grad_lse = rand(*out.shape, seed=5), rand(*lse.shape, dtype=torch.float32, seed=6)
    # backward schema: grad_out, grad_lse, q, k, v, out, lse, then the forward's remaining arguments
    bwd_args = (grad_out, grad_lse if with_grad_lse else None, *args[:n_inputs], out, lse, *args[n_inputs:])
    opcheck(backward, bwd_args, test_utils=ALL_CHECKS)


def test_every_op_is_covered_by_opcheck():
    forward = {op for op, _ in (*FORWARD_CASES.values(), *FORWARD_ONLY_CASES.values())} | {OPS.fp8_attention.default}
    backward = {bwd for _, bwd, _, _ in BACKWARD_CASES.values()}
    assert forward == {op._opoverload for op in FORWARD_OPS}
    assert backward == {op._opoverload for op in BACKWARD_OPS}


@pytest.mark.parametrize("op, make_args", [FORWARD_CASES["attention_causal_window_kv_seqlens"],
                                           FORWARD_CASES["varlen_attention"],
                                           FORWARD_CASES["block_sparse_attention"]],
                         ids=["attention", "varlen_attention", "block_sparse_attention"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_lse_is_float32_and_out_keeps_the_input_dtype(op, make_args, dtype):
    args = make_args(dtype, False)
    out, lse = op(*args)
    q, v = args[0], args[2]
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert out.shape == (*q.shape[:-1], v.shape[-1])
    expected_lse = (q.shape[1], q.shape[0]) if op is OPS.varlen_attention.default else q.shape[:-1]
    assert lse.shape == expected_lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_outputs_are_tensors_of_their_own_not_views_of_a_buffer(dtype):
    # a view of the reference's grouped buffer read to autograd as one of several views: detach_() and in-place
    # ops on it were refused, as they are not on SDPA's output (and were not for bf16, where a cast copies)
    q = torch.randn(1, 4, 8, 16, dtype=dtype, requires_grad=True)
    k, v = torch.randn(1, 2, 8, 16, dtype=dtype), torch.randn(1, 2, 8, 16, dtype=dtype)
    out, lse = inductor_attn.attention(q, k, v, return_lse=True)
    assert not out._is_view() and not lse._is_view()
    out.detach_()


def test_fake_impl_gives_shapes_and_dtypes_without_running_a_kernel():
    inductor_attn.reset_stats()
    with FakeTensorMode():
        q, k, v = torch.empty(2, 8, 33, 64, dtype=torch.bfloat16), torch.empty(2, 2, 50, 64, dtype=torch.bfloat16), \
            torch.empty(2, 2, 50, 32, dtype=torch.bfloat16)
        out, lse = OPS.attention(q, k, v, 0.125, True, -1, -1, None, None, "")
    assert (out.shape, out.dtype) == ((2, 8, 33, 32), torch.bfloat16)
    assert (lse.shape, lse.dtype) == ((2, 8, 33), torch.float32)
    assert inductor_attn.stats() == {}


def test_choice_argument_runs_the_named_kernel():
    inductor_attn.reset_stats()
    args = dense_args(torch.float32, True, causal=True)
    with only_backends(REFERENCE):  # the backward is decided at run time (choice ""): only one candidate
        out, lse = OPS.attention(*args[:-1], "reference:default")
        (out.sum() + lse.sum()).backward()
    assert inductor_attn.stats() == {"attention/backward -> reference:default": 1,
                                     "attention/forward -> reference:default": 1}


def test_unknown_choice_names_the_registered_backends():
    with pytest.raises(ValueError, match="unknown backend 'nope'.*reference"):
        OPS.attention(*dense_args(torch.float32, False)[:-1], "nope:default")


def test_gradient_flows_from_lse_alone():
    q, k, v, *rest = dense_args(torch.float64, True, causal=True)
    _, lse = OPS.attention(q, k, v, *rest)
    dq, dk, dv = torch.autograd.grad(lse.sum(), (q, k, v))
    # lse does not depend on v; it does on q and k
    assert torch.count_nonzero(dv) == 0
    assert torch.count_nonzero(dq) > 0 and torch.count_nonzero(dk) > 0


@pytest.mark.parametrize("op", ["attention", "varlen_attention", "block_sparse_attention"])
def test_a_second_derivative_is_refused_in_our_words(op):
    # torch's own error asked the caller to register an autograd formula for our backward op
    q, k, v, *rest = {"attention": lambda: dense_args(torch.float64, True, causal=True),
                        "varlen_attention": lambda: varlen_args(torch.float64, True),
                        "block_sparse_attention": lambda: block_sparse_args(torch.float64, True)}[op]()
    out, _ = getattr(OPS, op)(q, k, v, *rest)
    (dq,) = torch.autograd.grad(out.pow(2).sum(), q, create_graph=True)
    with pytest.raises(NotImplementedError, match="has no second derivative"):
        dq.sum().backward()
