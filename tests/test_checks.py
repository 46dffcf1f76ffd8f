"""Bad inputs raise TypeError/ValueError naming the argument, what is accepted and what was given: through the
public API, through the ops themselves, and on fake tensors while tracing; under torch.compile that message is
the first line of the error. Zero sizes are answered by the public functions (empty outputs, as SDPA gives)
and refused by the ops. Index values are tested in tests/test_index_checks.py."""

from __future__ import annotations

import dataclasses
import fractions

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention.flex_attention import create_block_mask

from inductor_attn import BlockSparseMask, attention, paged_attention, varlen_attention
from inductor_attn.ops import checks

OPS = torch.ops.inductor_attn


def t(*shape: int, dtype=torch.float32, device="cpu") -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype, device=device)


def i32(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def causal_block_mask(lq: int, lk: int, batch=None) -> object:
    return create_block_mask(lambda b, h, q, k: q >= k, batch, None, lq, lk, device="cpu", BLOCK_SIZE=32)


# q (2, 4, 8, 16), k/v (2, 2, 8, 16) unless a case says otherwise
Q, K, V = t(2, 4, 8, 16), t(2, 2, 8, 16), t(2, 2, 8, 16)

DENSE_CASES = {
    "q_rank": (lambda: attention(t(4, 8, 16), K, V), ValueError,
               r"q must have 4 dims \(batch, heads, seq_len, head_dim\), got shape \(4, 8, 16\)"),
    "k_rank": (lambda: attention(Q, t(1, 2, 2, 8, 16), V), ValueError, r"k must have 4 dims"),
    "batch_mismatch": (lambda: attention(Q, t(3, 2, 8, 16), t(3, 2, 8, 16)), ValueError,
                       r"q, k, v must share the batch size, got 2, 3, 3"),
    "v_heads_mismatch": (lambda: attention(Q, K, t(2, 1, 8, 16)), ValueError,
                         r"v must have as many heads as k \(2\), got 1"),
    "q_heads_not_multiple": (lambda: attention(t(2, 3, 8, 16), K, V), ValueError,
                             r"q heads \(3\) must be a multiple of k/v heads \(2\)"),
    "k_head_dim_mismatch": (lambda: attention(Q, t(2, 2, 8, 32), V), ValueError,
                            r"k head_dim must equal q head_dim \(16\), got 32"),
    "kv_seq_len_mismatch": (lambda: attention(Q, K, t(2, 2, 9, 16)), ValueError,
                            r"k and v must share seq_len, got 8 and 9"),
    "mixed_dtypes": (lambda: attention(Q, K.double(), V), TypeError,
                     r"k has dtype torch.float64 but q has torch.float32"),
    "mixed_devices": (lambda: attention(Q, K, t(2, 2, 8, 16, device="meta")), ValueError,
                      r"v is on meta but q is on cpu"),
    "int_dtype": (lambda: attention(Q.int(), K.int(), V.int()), TypeError,
                  r"q has dtype torch.int32; supported dtypes are float16, bfloat16, float32, float64"),
    "fp8_dtype": (lambda: attention(*(x.to(torch.float8_e4m3fn) for x in (Q, K, V))), TypeError,
                  r"q has dtype torch.float8_e4m3fn; supported dtypes are float16, bfloat16, float32, float64; "
                  r"float8_e4m3fn q, k, v with their descales go to inductor_attn.fp8_attention$"),
    "head_dim_4": (lambda: attention(t(2, 4, 8, 4), t(2, 2, 8, 4), t(2, 2, 8, 4)), ValueError,
                   r"q head_dim must be in \[8, 256\], got 4"),
    "head_dim_512": (lambda: attention(t(2, 4, 8, 512), t(2, 2, 8, 512), t(2, 2, 8, 512)), ValueError,
                     r"q head_dim must be in \[8, 256\], got 512"),
    "v_head_dim_512": (lambda: attention(Q, K, t(2, 2, 8, 512)), ValueError,
                       r"v head_dim must be in \[8, 256\], got 512"),
    "kv_seqlens_negative": (lambda: attention(Q, K, V, kv_seqlens=i32(-1, 3)), ValueError,
                            r"kv_seqlens values must be in \[0, 8\] \(the k seq_len\), got min -1"),
    "kv_seqlens_above_lk": (lambda: attention(Q, K, V, kv_seqlens=i32(8, 9)), ValueError,
                            r"kv_seqlens values must be in \[0, 8\] \(the k seq_len\), got min 8, max 9"),
    "kv_seqlens_int64": (lambda: attention(Q, K, V, kv_seqlens=torch.tensor([1, 2])), TypeError,
                         r"kv_seqlens must have dtype int32, got torch.int64"),
    "kv_seqlens_shape": (lambda: attention(Q, K, V, kv_seqlens=i32(1, 2, 3)), ValueError,
                         r"kv_seqlens must have shape \(2,\) \(batch,\), got \(3,\)"),
    "kv_seqlens_device": (lambda: attention(Q, K, V, kv_seqlens=i32(1, 2).to("meta")), ValueError,
                          r"kv_seqlens is on meta but q is on cpu"),
    "key_mask_dtype": (lambda: attention(Q, K, V, key_mask=torch.ones(2, 8, dtype=torch.int32)), TypeError,
                       r"key_mask must have dtype bool, got torch.int32"),
    "key_mask_shape": (lambda: attention(Q, K, V, key_mask=torch.ones(2, 1, 1, 8, dtype=torch.bool)), ValueError,
                       r"key_mask must have shape \(2, 8\) \(batch, k seq_len\), True = the key may be attended, "
                       r"got \(2, 1, 1, 8\)"),
    "key_mask_not_tensor": (lambda: attention(Q, K, V, key_mask=[True] * 8), TypeError,
                            r"key_mask must be a bool torch.Tensor \(batch, k seq_len\), True = the key may be "
                            r"attended, got list"),
    "window_left_negative": (lambda: attention(Q, K, V, window=(-2, 3)), ValueError,
                             r"window_left must be -1 \(unbounded\) or >= 0, got -2"),
    "window_right_negative": (lambda: attention(Q, K, V, window=(3, -5)), ValueError,
                              r"window_right must be -1 \(unbounded\) or >= 0, got -5"),
    "window_int_negative": (lambda: attention(Q, K, V, window=-1), ValueError,
                            r"window must be >= 0 \(or None for unbounded\), got -1"),
    "window_float": (lambda: attention(Q, K, V, window=(2.0, 1)), TypeError,
                     r"window_left must be an int \(-1 = unbounded\), got float"),
    "window_beyond_int64": (lambda: attention(Q, K, V, window=2**64), ValueError,
                            r"window must be at most 2147483647 \(None is unbounded\), got 18446744073709551616"),
    "window_pair_beyond_int32": (lambda: attention(Q, K, V, window=(2**40, 0)), ValueError,
                                 r"window_left must be at most 2147483647 \(-1 is unbounded\), got 1099511627776"),
    "causal_str": (lambda: attention(Q, K, V, causal="yes"), TypeError,
                   r"causal must be a bool \(True or False\), got str"),
    "causal_none": (lambda: attention(Q, K, V, causal=None), TypeError, r"causal must be a bool .*, got NoneType"),
    "causal_tensor": (lambda: attention(Q, K, V, causal=torch.tensor(True)), TypeError,
                      r"causal must be a bool .*, got Tensor"),
    "return_lse_str": (lambda: attention(Q, K, V, return_lse="no"), TypeError,
                       r"return_lse must be a bool \(True or False\), got str"),
    "check_indices_int": (lambda: attention(Q, K, V, check_indices=0), TypeError,
                          r"check_indices must be a bool \(True or False\), got int"),
    "window_triple": (lambda: attention(Q, K, V, window=(1, 2, 3)), TypeError,
                      r"window must be None, an int or a \(left, right\) pair of ints, got \(1, 2, 3\)"),
    "scale_nan": (lambda: attention(Q, K, V, scale=float("nan")), ValueError, r"scale must be finite, got nan"),
    "scale_int_past_float": (lambda: attention(Q, K, V, scale=10**400), ValueError, r"scale must be finite, got 1000"),
    "scale_past_float32": (lambda: attention(Q, K, V, scale=1e39), ValueError,
                           r"scale must be within float32's range \(\+-3.4e38\), got 1e\+39"),
    "scale_str": (lambda: attention(Q, K, V, scale="0.1"), TypeError, r"scale must be a float, got str"),
    "scale_bool": (lambda: attention(Q, K, V, scale=True), TypeError, r"scale must be a float, got bool"),
    "scale_tensor": (lambda: attention(Q, K, V, scale=torch.tensor(0.5)), TypeError,
                     r"scale must be a float, got a Tensor of shape \(\); pass float\(scale\)"),
    "scale_lossy": (lambda: attention(Q, K, V, scale=fractions.Fraction(1, 3)), ValueError,
                    r"scale must convert to float without loss, got Fraction\(1, 3\)"),
    "q_list": (lambda: attention([[0.0]], K, V), TypeError,
               r"q must be a torch.Tensor of shape \(batch, heads, seq_len, head_dim\), got list"),
    "q_none": (lambda: attention(None, K, V), TypeError, r"q must be a torch.Tensor .*, got NoneType"),
    "v_none": (lambda: attention(Q, K, None), TypeError, r"v must be a torch.Tensor .*, got NoneType"),
    "head_dim_0": (lambda: attention(t(2, 4, 8, 0), t(2, 2, 8, 0), t(2, 2, 8, 0)), ValueError,
                   r"q head_dim must be in \[8, 256\], got 0"),
    "k_heads_0_with_q_heads": (lambda: attention(Q, t(2, 0, 8, 16), t(2, 0, 8, 16)), ValueError,
                               r"q heads \(4\) must be a multiple of k/v heads \(0\)"),
    "block_sparse_mask_density_nan": (
        lambda: attention(Q64, Q64, Q64, block_mask=dataclasses.replace(SPARSE_64, density=float("nan"))),
        ValueError, r"density must be a fraction in \[0, 1\] \(or -1, unknown\), got nan"),
    "block_sparse_mask_density_none": (
        lambda: attention(Q64, Q64, Q64, block_mask=dataclasses.replace(SPARSE_64, density=None)),
        TypeError, r"density must be a fraction in \[0, 1\] \(or -1, unknown\), got None"),
    "block_sparse_mask_kv_indices_none": (
        lambda: attention(Q64, Q64, Q64, block_mask=dataclasses.replace(SPARSE_64, kv_indices=None)),
        TypeError, r"kv_indices must be an int32 tensor, got NoneType"),
    "block_sparse_mask_seq_lengths_str": (
        lambda: attention(Q64, Q64, Q64, block_mask=dataclasses.replace(SPARSE_64, seq_lengths="ab")),
        TypeError, r"block_mask.seq_lengths must be a \(Q_LEN, KV_LEN\) pair of ints, got 'ab'"),
    "q_sparse": (lambda: attention(Q.to_sparse(), K, V), TypeError,
                 r"q must be a dense \(strided\) tensor, got a torch.sparse_coo one"),
    "causal_numpy_bool": (lambda: attention(Q, K, V, causal=np.bool_(True)), TypeError,
                          r"causal must be a bool \(True or False\), got numpy.bool_?$"),
    "block_mask_other_lengths": (lambda: attention(Q, K, V, block_mask=causal_block_mask(16, 8)), ValueError,
                                 r"block_mask was built for \(Q_LEN, KV_LEN\) = \(16, 8\), but q/k have lengths "
                                 r"\(8, 8\)"),
    "block_sparse_mask_other_lengths": (
        lambda: attention(Q, K, V, block_mask=BlockSparseMask.from_block_mask(causal_block_mask(8, 40))),
        ValueError, r"block_mask was built for \(Q_LEN, KV_LEN\) = \(8, 40\)"),
    "block_mask_other_batch": (lambda: attention(Q, K, V, block_mask=causal_block_mask(8, 8, batch=3)), ValueError,
                               r"block mask was built for other lengths or sizes: kv_num_blocks has shape "
                               r"\(3, 1, 1\), expected \(2 or 1, 4 or 1, 1\)"),
    "block_mask_with_causal": (lambda: attention(Q, K, V, causal=True, block_mask=causal_block_mask(8, 8)),
                               ValueError, r"block_mask already encodes the mask: leave causal, window, "
                                           r"kv_seqlens and key_mask unset"),
    "block_mask_with_window": (lambda: attention(Q, K, V, window=4, block_mask=causal_block_mask(8, 8)),
                               ValueError, r"block_mask already encodes the mask"),
    "block_mask_with_kv_seqlens": (lambda: attention(Q, K, V, kv_seqlens=i32(8, 8), block_mask=causal_block_mask(8, 8)),
                                   ValueError, r"block_mask already encodes the mask"),
    "block_mask_wrong_type": (lambda: attention(Q, K, V, block_mask=torch.ones(8, 8, dtype=torch.bool)), TypeError,
                              r"block_mask must be a torch.nn.attention.flex_attention.BlockMask or an "
                              r"inductor_attn.BlockSparseMask, got Tensor"),
}
if hasattr(torch, "float8_e4m3fn"):
    F8 = torch.float8_e4m3fn
    DENSE_CASES["float8_dtype"] = (lambda: attention(Q.to(F8), K.to(F8), V.to(F8)), TypeError,
                                   r"q has dtype torch.float8_e4m3fn; supported dtypes are")


@pytest.mark.parametrize("call, error, message", DENSE_CASES.values(), ids=DENSE_CASES.keys())
def test_attention_refuses_bad_input_naming_the_argument(call, error, message):
    with pytest.raises(error, match=message):
        call()


@pytest.mark.parametrize("q_shape", [(0, 4, 8, 16), (2, 0, 8, 16)], ids=["batch_0", "heads_0"])
def test_a_block_mask_call_of_a_zero_size_gives_the_empty_output_as_other_calls_do(q_shape):
    q, k = t(*q_shape), t(q_shape[0], 2 if q_shape[1] else 0, 8, 16)
    for mask in (causal_block_mask(8, 8), BlockSparseMask.from_block_mask(causal_block_mask(8, 8))):
        assert attention(q, k, k, block_mask=mask).shape == q_shape


# q (10, 4, 16), k/v (12, 2, 16): two sequences, q lengths (4, 6), k lengths (5, 7)
QV, KV, VV = t(10, 4, 16), t(12, 2, 16), t(12, 2, 16)
CU_Q, CU_K = i32(0, 4, 10), i32(0, 5, 12)

VARLEN_CASES = {
    "q_none": (lambda: varlen_attention(None, KV, VV, CU_Q, CU_K), TypeError,
               r"q must be a torch.Tensor of shape \(total_tokens, heads, head_dim\), got NoneType"),
    "k_list": (lambda: varlen_attention(QV, [0.0], VV, CU_Q, CU_K, 6, 7), TypeError,
               r"k must be a torch.Tensor of shape \(total_tokens, heads, head_dim\), got list"),
    "q_rank": (lambda: varlen_attention(QV[None], KV, VV, CU_Q, CU_K), ValueError,
               r"q must have 3 dims \(total_tokens, heads, head_dim\), got shape \(1, 10, 4, 16\)"),
    "kv_total_mismatch": (lambda: varlen_attention(QV, KV, VV[:11], CU_Q, CU_K, 6, 7), ValueError,
                          r"k and v must share total_tokens, got 12 and 11"),
    "q_heads_not_multiple": (lambda: varlen_attention(t(10, 3, 16), KV, VV, CU_Q, CU_K), ValueError,
                             r"q heads \(3\) must be a multiple of k/v heads \(2\)"),
    "head_dim_4": (lambda: varlen_attention(t(10, 4, 4), t(12, 2, 4), t(12, 2, 4), CU_Q, CU_K), ValueError,
                   r"q head_dim must be in \[8, 256\], got 4"),
    "mixed_dtypes": (lambda: varlen_attention(QV, KV.bfloat16(), VV, CU_Q, CU_K), TypeError,
                     r"k has dtype torch.bfloat16 but q has torch.float32"),
    "cu_seqlens_int64": (lambda: varlen_attention(QV, KV, VV, CU_Q.long(), CU_K), TypeError,
                         r"cu_seqlens_q must have dtype int32, got torch.int64"),
    "cu_seqlens_int64_with_max": (lambda: varlen_attention(QV, KV, VV, CU_Q, CU_K.long(), 6, 7), TypeError,
                                  r"cu_seqlens_k must have dtype int32, got torch.int64"),
    "cu_seqlens_list": (lambda: varlen_attention(QV, KV, VV, [0, 4, 10], CU_K), TypeError,
                        r"cu_seqlens_q must be an int32 torch.Tensor of shape \(num_seqs \+ 1,\), got list"),
    "cu_seqlens_2d": (lambda: varlen_attention(QV, KV, VV, CU_Q[None], CU_K[None]), ValueError,
                      r"cu_seqlens_q must have shape \(num_seqs \+ 1,\) with num_seqs >= 1, got \(1, 3\)"),
    "cu_seqlens_one_entry": (lambda: varlen_attention(QV, KV, VV, i32(10), i32(12)), ValueError,
                             r"cu_seqlens_q must have shape \(num_seqs \+ 1,\) with num_seqs >= 1, got \(1,\)"),
    "cu_seqlens_not_monotone": (lambda: varlen_attention(QV, KV, VV, i32(0, 6, 4, 10), i32(0, 5, 6, 12)),
                                ValueError, r"cu_seqlens_q must be non-decreasing \(monotone\), got \[0, 6, 4, 10\]"),
    "cu_seqlens_k_not_monotone": (lambda: varlen_attention(QV, KV, VV, i32(0, 4, 6, 10), i32(0, 7, 5, 12), 4, 7),
                                  ValueError, r"cu_seqlens_k must be non-decreasing"),
    "cu_seqlens_lengths_differ": (lambda: varlen_attention(QV, KV, VV, CU_Q, i32(0, 5, 6, 12)), ValueError,
                                  r"cu_seqlens_q and cu_seqlens_k must have the same length \(num_seqs \+ 1\), "
                                  r"got 3 and 4"),
    "cu_seqlens_q_last_not_total": (lambda: varlen_attention(QV, KV, VV, i32(0, 4, 9), CU_K), ValueError,
                                    r"cu_seqlens_q\[-1\] must equal the total tokens of q \(10\), got 9"),
    "cu_seqlens_k_last_not_total": (lambda: varlen_attention(QV, KV, VV, CU_Q, i32(0, 5, 13)), ValueError,
                                    r"cu_seqlens_k\[-1\] must equal the total tokens of k \(12\), got 13"),
    "cu_seqlens_start_not_zero": (lambda: varlen_attention(QV, KV, VV, i32(1, 4, 10), CU_K), ValueError,
                                  r"cu_seqlens_q must start at 0, got 1"),
    "cu_seqlens_device": (lambda: varlen_attention(QV, KV, VV, CU_Q, CU_K.to("meta"), 6, 7), ValueError,
                          r"cu_seqlens_k is on meta but q is on cpu"),
    "max_seqlen_too_small": (lambda: varlen_attention(QV, KV, VV, CU_Q, CU_K, 3, 7), ValueError,
                             r"max_seqlen_q \(3\) is smaller than the longest sequence \(6\)"),
    "max_seqlen_not_int": (lambda: varlen_attention(QV, KV, VV, CU_Q, CU_K, 6.0, 7), TypeError,
                           r"max_seqlen_q must be an int, got float"),
    "window_beyond_int64": (lambda: varlen_attention(QV, KV, VV, CU_Q, CU_K, window=2**63), ValueError,
                            r"window must be at most 2147483647 \(None is unbounded\), got 9223372036854775808"),
    "max_seqlen_beyond_int64": (lambda: varlen_attention(QV, KV, VV, CU_Q, CU_K, 2**64, 7), ValueError,
                                r"max_seqlen_q must be at most 2147483647 \(cu_seqlens are int32\), got "
                                r"18446744073709551616"),
    "causal_str": (lambda: varlen_attention(QV, KV, VV, CU_Q, CU_K, causal="no"), TypeError,
                   r"causal must be a bool \(True or False\), got str"),
    "return_lse_none": (lambda: varlen_attention(QV, KV, VV, CU_Q, CU_K, return_lse=None), TypeError,
                        r"return_lse must be a bool \(True or False\), got NoneType"),
    "window_negative": (lambda: varlen_attention(QV, KV, VV, CU_Q, CU_K, window=(-3, 0)), ValueError,
                        r"window_left must be -1 \(unbounded\) or >= 0, got -3"),
}


@pytest.mark.parametrize("call, error, message", VARLEN_CASES.values(), ids=VARLEN_CASES.keys())
def test_varlen_attention_refuses_bad_input_naming_the_argument(call, error, message):
    with pytest.raises(error, match=message):
        call()


def sparse_args(sparse: BlockSparseMask):
    return (sparse.kv_num_blocks, sparse.kv_indices, sparse.full_kv_num_blocks, sparse.full_kv_indices,
            sparse.partial_bits, sparse.block_q, sparse.block_kv, 0.25, sparse.density, sparse.partial_fraction, "")


SPARSE_64 = BlockSparseMask.from_block_mask(causal_block_mask(64, 64))
Q64 = t(1, 2, 64, 16)

OP_CASES = {
    "attention_rank": (lambda: OPS.attention(t(4, 8, 16), K, V, 0.25, False, -1, -1, None, None, ""), ValueError,
                       r"q must have 4 dims"),
    "attention_batch_0": (lambda: OPS.attention(t(0, 4, 8, 16), t(0, 2, 8, 16), t(0, 2, 8, 16), 0.25, False, -1, -1,
                                                None, None, ""),
                          ValueError, r"batch must be >= 1 for the inductor_attn ops, got 0 \(inductor_attn.attention "
                                      r"and varlen_attention return empty outputs for zero sizes\)"),
    "attention_k_seq_len_0": (lambda: OPS.attention(Q, t(2, 2, 0, 16), t(2, 2, 0, 16), 0.25, False, -1, -1, None,
                                                    None, ""),
                              ValueError, r"k seq_len must be >= 1 for the inductor_attn ops, got 0"),
    "varlen_heads_0": (lambda: OPS.varlen_attention(t(10, 0, 16), t(12, 0, 16), t(12, 0, 16), CU_Q, CU_K, 6, 7, 0.25,
                                                    False, -1, -1, ""),
                       ValueError, r"q heads must be >= 1 for the inductor_attn ops, got 0"),
    "attention_window": (lambda: OPS.attention(Q, K, V, 0.25, False, -7, -1, None, None, ""), ValueError,
                         r"window_left must be -1 \(unbounded\) or >= 0, got -7"),
    "varlen_cu_dtype": (lambda: OPS.varlen_attention(QV, KV, VV, CU_Q.long(), CU_K, 6, 7, 0.25, False, -1, -1, ""),
                        TypeError, r"cu_seqlens_q must have dtype int32"),
    "block_sparse_q_blocks": (lambda: OPS.block_sparse_attention(t(1, 2, 96, 16), Q64, Q64, *sparse_args(SPARSE_64)),
                              ValueError, r"block mask was built for other lengths or sizes: kv_num_blocks has "
                                          r"shape \(1, 1, 2\), expected \(1 or 1, 2 or 1, 3\) for Lq=96"),
    "block_sparse_kv_block": (
        lambda: OPS.block_sparse_attention(Q64, Q64, Q64, *sparse_args(dataclasses.replace(SPARSE_64, block_kv=16))),
        ValueError, r"block_kv must be a multiple of 32 \(bitmaps pack 32 keys per word\), got 16"),
    "block_sparse_bits_shape": (
        lambda: OPS.block_sparse_attention(Q64, Q64, Q64, *sparse_args(dataclasses.replace(
            SPARSE_64, partial_bits=SPARSE_64.partial_bits[..., :16, :]))),
        ValueError, r"partial_bits must have shape \(1, 1, 2, 1, 32, 1\)"),
    "block_sparse_index_dtype": (
        lambda: OPS.block_sparse_attention(Q64, Q64, Q64, *sparse_args(dataclasses.replace(
            SPARSE_64, kv_indices=SPARSE_64.kv_indices.long()))),
        TypeError, r"kv_indices must have dtype int32, got torch.int64"),
    "block_sparse_half_full_pair": (
        lambda: OPS.block_sparse_attention(Q64, Q64, Q64, *sparse_args(dataclasses.replace(
            SPARSE_64, full_kv_indices=None))),
        ValueError, r"full_kv_num_blocks and full_kv_indices must be given together or both be None"),
}


@pytest.mark.parametrize("call, error, message", OP_CASES.values(), ids=OP_CASES.keys())
def test_ops_refuse_bad_input_when_called_directly(call, error, message):
    with pytest.raises(error, match=message):
        call()


EAGER_CALLS = {
    "attention": ("check_attention", lambda: attention(Q, K, V, causal=True)),
    "varlen_attention": ("check_varlen", lambda: varlen_attention(t(5, 4, 16), t(7, 2, 16), t(7, 2, 16), i32(0, 2, 5),
                                                                  i32(0, 3, 7), 3, 4)),
    "paged_attention": ("check_paged", lambda: paged_attention(t(2, 4, 16), t(3, 4, 2, 16), t(3, 4, 2, 16),
                                                               i32(0, 1, 2, 0).view(2, 2), i32(5, 3))),
}


@pytest.mark.parametrize("name", EAGER_CALLS)
def test_an_eager_call_is_checked_once_by_its_public_function_not_again_by_the_op(name, monkeypatch):
    """The public function checks the arguments and tells the op so (``runtime.CHECKED``): the op's own checks,
    for calls made to it directly, would cost the same Python a second time on every eager call."""
    check, call = EAGER_CALLS[name]
    seen = []
    real = getattr(checks, check)
    monkeypatch.setattr(checks, check, lambda *args, **kwargs: seen.append(args) or real(*args, **kwargs))
    call()
    assert seen == []


@pytest.mark.parametrize("call", [
    lambda q: attention(q, K, V),
    lambda q: varlen_attention(q[0].transpose(0, 1), KV[:8], VV[:8], i32(0, 8), i32(0, 8)),
    lambda q: paged_attention(q[:, :, 0], t(3, 4, 2, 16), t(3, 4, 2, 16), i32(0, 1, 2, 1).view(2, 2), i32(5, 7)),
], ids=["attention", "varlen", "paged"])
def test_forward_mode_ad_is_refused_not_answered_with_a_zero_derivative(call):
    # a custom op drops the tangents of inputs that need no grad: jvp gave a tangent of 0 without an error
    with pytest.raises(NotImplementedError, match=r"has no forward-mode derivative \(torch.func.jvp, jacfwd, "
                                                  r"torch.autograd.forward_ad\): q carries a tangent"):
        torch.func.jvp(call, (Q,), (torch.ones_like(Q),))


def test_the_forward_mode_check_adds_no_guard_to_compiled_calls(fresh_dynamo):
    # read while tracing, the dual level was a guard on every compiled call, and a new graph inside dual_level()
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    call = torch.compile(lambda q, k, v: varlen_attention(q, k, v, CU_Q, CU_K, 6, 7), backend=counter, fullgraph=True)
    call(QV, KV, VV)
    with torch.autograd.forward_ad.dual_level():
        call(QV, KV, VV)
    assert counter.frame_count == 1


def test_checks_run_on_fake_tensors_while_tracing():
    with FakeTensorMode(), pytest.raises(ValueError, match=r"q heads \(6\) must be a multiple of k/v heads \(4\)"):
        OPS.attention(torch.empty(2, 6, 8, 16), torch.empty(2, 4, 8, 16), torch.empty(2, 4, 8, 16), 0.25, True,
                      -1, -1, None, None, "")


@pytest.mark.parametrize("call, args", [
    (lambda q, k, v, lens: attention(q, k, v, kv_seqlens=lens), (Q, K, V, i32(3, 8))),
    (lambda q, k, v, cu_q, cu_k: varlen_attention(q, k, v, cu_q, cu_k, 6, 7), (QV, KV, VV, CU_Q, CU_K)),
    (lambda q, k, v, table, lens: paged_attention(q, k, v, table, lens),
     (QV[:2], t(3, 4, 2, 16), t(3, 4, 2, 16), i32(0, 1, 2, 1).view(2, 2), i32(5, 7))),
], ids=["kv_seqlens", "varlen", "paged"])
@pytest.mark.parametrize("tracing_mode", ["fake", "symbolic"])
def test_value_checks_on_fake_tensors_become_device_asserts_as_in_compiled_code(call, args, tracing_mode):
    # make_fx and FakeTensorMode run the eager path on tensors whose values cannot be read
    from torch.fx.experimental.proxy_tensor import make_fx

    graph = make_fx(call, tracing_mode=tracing_mode)(*args).graph
    assert any("_assert_async" in str(node.target) for node in graph.nodes)


@pytest.mark.parametrize("scale", [np.float32(0.5), np.float64(0.5), np.int64(1), 1, fractions.Fraction(1, 2)],
                         ids=["np_float32", "np_float64", "np_int64", "int", "exact_fraction"])
def test_scale_takes_real_scalars_that_convert_to_float_exactly(scale):
    torch.testing.assert_close(attention(Q, K, V, scale=scale), attention(Q, K, V, scale=float(scale)), rtol=0, atol=0)


# ------------------------------------------------------------------------- zero sizes: answered, not refused
# (q shape, k shape): batch 0, q heads 0 (with and without k/v heads), Lq 0 -> empty outputs; Lk 0 -> no keys
ZERO_SIZES = {
    "batch_0": ((0, 4, 8, 16), (0, 2, 8, 16)),
    "heads_0": ((2, 0, 8, 16), (2, 0, 8, 16)),
    "q_heads_0": ((2, 0, 8, 16), (2, 2, 8, 16)),
    "q_seq_len_0": ((2, 4, 0, 16), (2, 2, 8, 16)),
    "k_seq_len_0": ((2, 4, 8, 16), (2, 2, 0, 16)),
}


@pytest.mark.parametrize("q_shape, k_shape", ZERO_SIZES.values(), ids=ZERO_SIZES.keys())
def test_zero_sizes_give_sdpa_shaped_outputs_with_no_keys_as_fully_masked_rows(q_shape, k_shape):
    q, k, v = t(*q_shape).requires_grad_(), t(*k_shape).requires_grad_(), t(*k_shape[:3], 8).requires_grad_()
    out, lse = attention(q, k, v, causal=True, return_lse=True)
    assert out.shape == (*q_shape[:3], 8) and lse.shape == q_shape[:3] and lse.dtype == torch.float32
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == float("-inf")).all())
    torch.where(lse.isinf(), 0.0, lse).sum().backward(retain_graph=True)  # the lse alone, as with kv_seqlens 0
    out.sum().backward()
    for x in (q, k, v):
        assert torch.equal(x.grad, torch.zeros_like(x))


@pytest.mark.parametrize("q_total, heads, k_total", [(0, 4, 12), (10, 0, 12), (10, 4, 0)],
                         ids=["q_total_0", "heads_0", "k_total_0"])
def test_varlen_zero_sizes_give_empty_outputs_or_fully_masked_rows(q_total, heads, k_total):
    cu_q, cu_k = i32(0, q_total // 2, q_total), i32(0, k_total // 2, k_total)
    q, k, v = t(q_total, heads, 16), t(k_total, heads // 2, 16), t(k_total, heads // 2, 8)
    out, lse = varlen_attention(q, k, v, cu_q, cu_k, 5, 6, return_lse=True)
    assert out.shape == (q_total, heads, 8) and lse.shape == (heads, q_total)
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == float("-inf")).all())
    # the longest sequence of no tokens is 0, as compiled code passes it
    longest = [5 if q_total else 0, 6 if k_total else 0]
    torch.testing.assert_close(varlen_attention(q, k, v, cu_q, cu_k, *longest), out, rtol=0, atol=0)


def test_varlen_max_seqlen_of_0_where_there_are_tokens_is_refused():
    q = t(4, 2, 16)
    with pytest.raises(ValueError, match=r"^max_seqlen_q must be >= 1, or 0 with no tokens, got 0"):
        varlen_attention(q, q, q, i32(0, 2, 4), i32(0, 2, 4), 0, 2, check_indices=False)


# ------------------------------------------------------------------ what a compiled (traced) call reports
@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("fullgraph", [True, False])
def test_compiled_call_reports_our_message_first_as_a_value_error(fullgraph, fresh_dynamo):
    fn = torch.compile(lambda q, k, v: attention(q, k, v), fullgraph=fullgraph)
    with pytest.raises(ValueError) as info:
        fn(t(2, 3, 8, 16), K, V)
    assert str(info.value).splitlines()[0] == "q heads (3) must be a multiple of k/v heads (2) for GQA/MQA"


def test_compiled_call_reports_our_type_error_first(fresh_dynamo):
    fn = torch.compile(lambda q, k, v: attention(q, k, v, window=(1, 2, 3)), fullgraph=True)
    with pytest.raises(TypeError, match=r"^window must be None, an int or a \(left, right\) pair of ints"):
        fn(Q, K, V)


@pytest.mark.parametrize("q, error, message", [
    ([1.0, 2.0], TypeError, r"^q must be a torch.Tensor of shape \(batch, heads, seq_len, head_dim\), got list"),
    (t(2, 4, 8), ValueError, r"^q must have 4 dims \(batch, heads, seq_len, head_dim\), got shape \(2, 4, 8\)"),
    (torch.nested.nested_tensor([t(5, 4, 16), t(3, 4, 16)], layout=torch.jagged).transpose(1, 2), TypeError,
     r"^q must be a dense \(strided\) tensor, got a nested one"),
], ids=["a_list", "three_dims", "nested"])
@pytest.mark.parametrize("dynamic", [None, True], ids=["dynamic_default", "dynamic"])
def test_compiled_call_with_a_wrong_q_reports_our_message_first(q, error, message, dynamic, fresh_dynamo):
    # traced dense calls leave the structural checks to the op's fake impl; a q that is not a tensor never
    # reaches it, and one of the wrong rank reaches it: both must still read as our message, also where its
    # sizes are symbolic (the message is a constant built one size at a time: checks.shape_text)
    fn = torch.compile(lambda q, k, v: attention(q, k, v), fullgraph=True, dynamic=dynamic)
    with pytest.raises(error, match=message):
        fn(q, K, V)


@pytest.mark.parametrize("lens, error, message", [
    ([3, 40], TypeError, r"^kv_seqlens must be an int32 torch.Tensor \(batch,\), got list"),
    (torch.tensor([3, 40]), TypeError, r"^kv_seqlens must have dtype int32, got torch.int64"),
    (torch.tensor([3, 4, 40], dtype=torch.int32), ValueError, r"^kv_seqlens must have shape \(2,\) \(batch,\)"),
], ids=["a_list", "int64", "three_lengths"])
@pytest.mark.parametrize("fullgraph, dynamic", [(True, None), (False, None), (True, True)])
def test_compiled_call_with_a_wrong_kv_seqlens_reports_our_message_first(lens, error, message, fullgraph, dynamic,
                                                                        fresh_dynamo):
    # the traced path writes the values' device assert itself; lengths of the wrong kind get our message
    # while tracing, before that assert exists (without fullgraph a graph break after it would run it first:
    # the lengths here are also out of range); a kv_seqlens that is not a tensor takes the checked path
    fn = torch.compile(lambda q, k, v, lens: attention(q, k, v, kv_seqlens=lens), fullgraph=fullgraph, dynamic=dynamic)
    with pytest.raises(error, match=message):
        fn(Q, K, V, lens)


@pytest.mark.parametrize("call", [
    lambda cu: varlen_attention(QV, KV, VV, CU_Q, cu, None, 7),
    lambda cu: paged_attention(QV, t(3, 4, 2, 16), t(3, 4, 2, 16), i32(0, 1, 2, 1).view(2, 2), i32(5, 7),
                               cu_seqlens_q=cu),
], ids=["varlen", "paged"])
def test_a_longest_sequence_left_to_read_under_fullgraph_says_to_pass_it(call, fresh_dynamo):
    # read from the values, it is a graph break; Dynamo's own error spoke of a data-dependent guard
    with pytest.raises(ValueError, match="^max_seqlen_q is None: it is read from the cu_seqlens values, a graph "
                                         "break in compiled code; under fullgraph=True pass max_seqlen_q"):
        torch.compile(call, fullgraph=True)(CU_Q)


def test_a_max_seqlen_read_from_a_tensor_in_compiled_code_is_checked_at_run_time(fresh_dynamo):
    # under capture_scalar_outputs, .item() gives a size with no value while tracing: `m < 1` raised Dynamo's
    # data-dependent guard error under fullgraph; the device asserts compare it with the lengths when it runs
    def call(q, k, v, cu_q, cu_k):
        longest = int((cu_k[1:] - cu_k[:-1]).max().item())
        return varlen_attention(q, k, v, cu_q, cu_k, 6, longest)

    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        compiled = torch.compile(call, fullgraph=True)(QV, KV, VV, CU_Q, CU_K)
    torch.testing.assert_close(compiled, call(QV, KV, VV, CU_Q, CU_K))


def test_a_max_seqlen_of_0_is_taken_as_given_not_as_unset(fresh_dynamo):
    # with no q tokens 0 is right; the message must name the one left unset (max_seqlen_k), not max_seqlen_q
    call = torch.compile(lambda q, cu_q: varlen_attention(q, KV, VV, cu_q, CU_K, 0, None), fullgraph=True)
    with pytest.raises(ValueError, match="^max_seqlen_k is None: it is read from the cu_seqlens values"):
        call(t(0, 4, 16), i32(0, 0, 0))


def test_fake_impl_of_an_op_called_in_compiled_code_reports_our_message_first(fresh_dynamo):
    fn = torch.compile(lambda q, k, v: OPS.attention(q, k, v, 0.25, False, -7, -1, None, None, ""), fullgraph=True)
    with pytest.raises(ValueError, match=r"^window_left must be -1 \(unbounded\) or >= 0, got -7"):
        fn(Q, K, V)


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_call_with_a_zero_size_matches_eager(dynamic, fresh_dynamo):
    # dynamic: the output's layout follows q's symbolic strides (Dynamo could not sort by them)
    fn = torch.compile(lambda q, k, v: attention(q, k, v, return_lse=True), fullgraph=True, dynamic=dynamic)
    k, v = t(2, 2, 0, 16), t(2, 2, 0, 16)
    for compiled, eager in zip(fn(Q, k, v), attention(Q, k, v, return_lse=True)):
        torch.testing.assert_close(compiled, eager)


COMPILED_CALLS = {
    "attention": lambda s: attention(Q, K, V, scale=s),
    "varlen": lambda s: varlen_attention(QV, KV, VV, CU_Q, CU_K, 6, 7, scale=s),
    "block_mask": lambda s: attention(Q64, Q64, Q64, block_mask=SPARSE_64, scale=s),
}


@pytest.mark.parametrize("kind, scale", [("attention", float("nan")), ("attention", float("inf")),
                                         ("attention", -float("inf")), ("varlen", float("inf")),
                                         ("block_mask", float("nan"))])
@pytest.mark.parametrize("dynamic", [None, True], ids=["dynamic_default", "dynamic"])
@pytest.mark.parametrize("fullgraph", [True, False])
def test_compiled_call_refuses_a_nan_or_infinite_scale_as_eager_calls_do(kind, scale, fullgraph, dynamic,
                                                                         fresh_dynamo):
    fn = torch.compile(COMPILED_CALLS[kind], fullgraph=fullgraph, dynamic=dynamic)
    fn(0.5)
    fn(0.25)  # a second value: automatic dynamic may trace the scale as a symbol from here
    with pytest.raises(ValueError, match=rf"^scale must be finite, got {scale}"):
        fn(scale)


COMPILED_BAD = {
    "causal_str": (lambda q, k, v: attention(q, k, v, causal="yes"), TypeError, r"^causal must be a bool"),
    "causal_tensor": (lambda q, k, v: attention(q, k, v, causal=torch.tensor(True)), TypeError,
                      r"^causal must be a bool .*, got Tensor"),
    "return_lse_str": (lambda q, k, v: attention(q, k, v, return_lse="no"), TypeError, r"^return_lse must be a bool"),
    "window_beyond_int64": (lambda q, k, v: attention(q, k, v, window=2**64), ValueError,
                            r"^window must be at most 2147483647"),
    "window_pair_beyond_int32": (lambda q, k, v: attention(q, k, v, window=(3, 2**40)), ValueError,
                                 r"^window_right must be at most 2147483647"),
    "window_numpy_int": (lambda q, k, v: attention(q, k, v, window=np.int64(3)), TypeError,
                         r"^window must be None, an int or a \(left, right\) pair of ints, got ndarray; in compiled "
                         r"code pass int\(window\)"),
    "varlen_causal_str": (lambda q, k, v: varlen_attention(QV, KV, VV, CU_Q, CU_K, 6, 7, causal="no"), TypeError,
                          r"^causal must be a bool"),
    "varlen_max_seqlen": (lambda q, k, v: varlen_attention(QV, KV, VV, CU_Q, CU_K, 6, 2**64), ValueError,
                          r"^max_seqlen_k must be at most 2147483647"),
    # the traced fast path once indexed q.shape[2], repr()-ed a traced tensor, and left these to the op
    "q_two_dims": (lambda q, k, v: attention(q[0, 0], k, v), ValueError,
                   r"^q must have 4 dims \(batch, heads, seq_len, head_dim\), got shape \(8, 16\)"),
    "key_mask_list": (lambda q, k, v: attention(q, k, v, key_mask=[True] * 8), TypeError,
                      r"^key_mask must be a bool torch.Tensor"),
    "window_tensor": (lambda q, k, v: attention(q, k, v, window=torch.tensor(3)), TypeError,
                      r"^window must be None, an int or a \(left, right\) pair of ints, got a Tensor"),
    "scale_int_past_float": (lambda q, k, v: attention(q, k, v, scale=10**400), ValueError,
                             r"^scale must be finite, got 1000"),
    "scale_int_lossy": (lambda q, k, v: attention(q, k, v, scale=2**53 + 1), ValueError,
                        r"^scale must convert to float without loss, got 9007199254740993"),
}


@pytest.mark.parametrize("call, error, message", COMPILED_BAD.values(), ids=COMPILED_BAD.keys())
def test_compiled_call_refuses_bad_flags_and_out_of_range_sizes_naming_the_argument(call, error, message,
                                                                                    fresh_dynamo):
    with pytest.raises(error, match=message):
        torch.compile(call, fullgraph=True)(Q, K, V)


PAGED_ARGS = (t(2, 4, 16), t(3, 4, 2, 16), t(3, 4, 2, 16), i32(0, 1, 2, 0).view(2, 2), i32(5, 3))
COMPILED_BAD_PAGED = {  # the traced fast path leaves these to the op's fake impl or to the checked path
    "causal_str": (dict(causal="yes"), TypeError, r"^causal must be a bool"),
    "layout": (dict(layout="NDH"), ValueError, r"^layout must be one of 'NHD' \(num_blocks, page_size"),
    "softcap": (dict(softcap=-2.0), ValueError, r"^softcap must be >= 0"),
    "max_seqlen_k_float": (dict(max_seqlen_k=8.0), TypeError, r"^max_seqlen_k must be an int"),
    "max_seqlen_k_past_table": (dict(max_seqlen_k=9), ValueError,
                                r"^max_seqlen_k must be in \[1, block_table.shape\[1\] \* page_size\] = \[1, 8\]"),
    "max_seqlen_q_decode": (dict(max_seqlen_q=2), ValueError, r"^without cu_seqlens_q, each sequence has one query"),
    "q_four_dims": (dict(q=t(2, 4, 1, 16)), ValueError, r"^q must have 3 dims"),
    "heads": (dict(q=t(2, 3, 16)), ValueError, r"^q heads \(3\) must be a multiple of k/v heads \(2\)"),
    "table_int64": (dict(block_table=torch.zeros(2, 2, dtype=torch.int64)), TypeError,
                    r"^block_table must have dtype int32"),
    "lengths_shape": (dict(kv_seqlens=i32(5, 3, 1)), ValueError, r"^kv_seqlens must have shape \(2,\)"),
    "page_size": (dict(k_cache=t(1, 300, 2, 16), v_cache=t(1, 300, 2, 16)), ValueError,
                  r"^page_size \(k_cache.shape\[1\] in the NHD layout\) must be in \[1, 256\]"),
    "mixed_dtypes": (dict(v_cache=t(3, 4, 2, 16).half()), TypeError, r"^v_cache has dtype torch.float16 but q has"),
    "fp8": ({name: x.to(torch.float8_e4m3fn) for name, x in zip(("q", "k_cache", "v_cache"), PAGED_ARGS)}, TypeError,
            r"^q has dtype torch.float8_e4m3fn; supported dtypes are"),
    "grad": (dict(q=t(2, 4, 16).requires_grad_()), ValueError, r"^paged_attention is forward only"),
    "cu_seqlens_q_shape": (dict(cu_seqlens_q=i32(0, 1, 2, 2), max_seqlen_q=1), ValueError,
                           r"^cu_seqlens_q must have shape \(num_seqs \+ 1,\) = \(3,\)"),
    "max_seqlen_q_unread": (dict(cu_seqlens_q=i32(0, 1, 2)), ValueError, r"^max_seqlen_q is None: it is read from"),
}


@pytest.mark.parametrize("change, error, message", COMPILED_BAD_PAGED.values(), ids=COMPILED_BAD_PAGED.keys())
def test_a_compiled_paged_call_refuses_bad_input_naming_the_argument(change, error, message, fresh_dynamo, caplog):
    names = ("q", "k_cache", "v_cache", "block_table", "kv_seqlens")
    given = dict(zip(names, PAGED_ARGS)) | change
    tensors = [given.pop(name) for name in names]
    fn = torch.compile(lambda *args: paged_attention(*args, **given), fullgraph=True)
    with caplog.at_level("ERROR"), pytest.raises(error, match=message):
        fn(*tensors)
    assert not [r for r in caplog.records if r.levelname == "ERROR"]  # no traceback logged before our error


@pytest.mark.parametrize("q, k, message", [
    (Q, K.half(), r"^k has dtype torch.float16 but q has"),
    (Q.to(torch.float8_e4m3fn), K.to(torch.float8_e4m3fn), r"^q has dtype torch.float8_e4m3fn; supported dtypes are "
                                                           r".*go to inductor_attn.fp8_attention"),
], ids=["mixed", "fp8"])
def test_a_compiled_call_of_a_wrong_dtype_reads_as_our_error_alone(q, k, message, fresh_dynamo, caplog):
    # raised in the op's fake impl, a TypeError is first logged with its traceback by FakeTensorMode
    with caplog.at_level("ERROR"), pytest.raises(TypeError, match=message):
        torch.compile(lambda q, k, v: attention(q, k, v), fullgraph=True)(q, k, k)
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


def test_a_block_mask_under_fullgraph_says_to_convert_it_first(fresh_dynamo):
    block_mask = causal_block_mask(64, 64)
    with pytest.raises(TypeError, match=r"^block_mask: a flex_attention BlockMask is converted by running its "
                                        r"mask_mod, a graph break; under fullgraph=True convert it first, outside the "
                                        r"compiled function: inductor_attn.BlockSparseMask.from_block_mask"):
        torch.compile(lambda q, m: attention(q, q, q, block_mask=m), fullgraph=True)(Q64, block_mask)
    # without fullgraph the graph breaks there and the call converts it, as an eager call does
    torch.testing.assert_close(torch.compile(lambda q, m: attention(q, q, q, block_mask=m))(Q64, block_mask),
                               attention(Q64, Q64, Q64, block_mask=block_mask))
