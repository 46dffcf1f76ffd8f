"""BlockSparseMask: conversion from flex BlockMasks, bit packing, and memory that grows with listed blocks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_reference import BLOCK_SIZES, MASK_KINDS, mask_mods
from torch.nn.attention.flex_attention import create_block_mask, create_mask

import inductor_attn
from inductor_attn import BlockSparseMask
from inductor_attn.block_mask import pack_bits, unpack_bits

RANDOM = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def convert(mask_mod, b, h, lq, lk, block):
    block_mask = create_block_mask(mask_mod, b, h, lq, lk, device="cpu", BLOCK_SIZE=block)
    return BlockSparseMask.from_block_mask(block_mask), create_mask(mask_mod, b, h, lq, lk, device="cpu")


@RANDOM
@given(st.sampled_from(MASK_KINDS), st.sampled_from(BLOCK_SIZES), st.integers(2, 300), st.integers(2, 300),
       st.integers(0, 2**31))
def test_dense_mask_equals_flex_create_mask(kind, block, lq, lk, seed):
    mod, b, h = mask_mods(kind, torch.Generator().manual_seed(seed), max(lq, lk), heads=3)
    sparse, expected = convert(mod, b, h, lq, lk, block)
    assert sparse.seq_lengths == (lq, lk)
    assert torch.equal(sparse.dense_mask(), expected)


def test_document_mask_converts_when_lengths_are_not_block_multiples():
    # the mask_mod indexes docs, so it must never see the padding positions past Lq/Lk
    docs = torch.tensor([0] * 40 + [1] * 57 + [2] * 3)
    sparse, expected = convert(lambda b, h, q, k: docs[q] == docs[k], None, None, 100, 100, 64)
    assert torch.equal(sparse.dense_mask(), expected)


def test_sliding_window_mask_stores_only_listed_blocks():
    length, window, block = 4000, 400, 128
    sparse, expected = convert(lambda b, h, q, k: (q >= k) & (q - k <= window), None, None, length, length, block)
    n_kv_blocks = -(-length // block)
    n_partial, n_full = int(sparse.kv_num_blocks.max()), int(sparse.full_kv_num_blocks.max())
    # index and bitmap tensors are as wide as the longest row of listed blocks, not as all kv blocks
    assert sparse.kv_indices.shape[-1] == n_partial
    assert sparse.full_kv_indices.shape[-1] == n_full
    assert sparse.partial_bits.shape == (1, 1, n_kv_blocks, n_partial, block, block // 32)
    # a row lists ~(window / block + 2) blocks (the last q block more: flex calls padded blocks partial)
    assert n_partial + n_full < n_kv_blocks / 4
    assert torch.equal(sparse.dense_mask(), expected)


def test_density_and_partial_fraction_count_listed_blocks():
    sparse, _ = convert(lambda b, h, q, k: q >= k, None, None, 256, 256, 64)
    # 4 x 4 blocks: 4 diagonal (partial) + 6 below it (full) are listed
    assert sparse.density == pytest.approx(10 / 16)
    assert sparse.partial_fraction == pytest.approx(4 / 10)


def test_q_blocks_that_see_nothing_list_no_kv_block():
    sparse, expected = convert(lambda b, h, q, k: (q >= 70) & (k <= q), None, None, 100, 100, 32)
    assert sparse.kv_num_blocks[..., :2].eq(0).all() and sparse.full_kv_num_blocks[..., :2].eq(0).all()
    dense = sparse.dense_mask()
    assert not dense[..., :70, :].any()
    assert torch.equal(dense, expected)


def test_mask_mod_that_needs_scalar_indices_is_evaluated_through_vmap():
    # torch.stack refuses broadcast index shapes: vmap evaluates one index at a time
    sparse, expected = convert(lambda b, h, q, k: torch.stack([q, k]).amax(0) == q, None, None, 90, 70, 32)
    assert torch.equal(sparse.dense_mask(), expected)


def test_a_mask_mod_that_reduces_over_an_index_converts_as_create_mask_evaluates_it():
    # valid[b].any() is per sequence; called on a chunk of blocks at once it would reduce over every b of the chunk
    valid = torch.ones(2, 128, dtype=torch.bool)
    valid[1] = False

    def mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | (valid[b].any() & (kv_idx % 2 == 0))

    converted = BlockSparseMask.from_block_mask(create_block_mask(mod, 2, None, 128, 128, device="cpu",
                                                                  BLOCK_SIZE=32))
    assert torch.equal(converted.dense_mask(), create_mask(mod, 2, None, 128, 128, device="cpu"))


def test_kv_block_size_not_a_multiple_of_32_is_refused():
    block_mask = create_block_mask(lambda b, h, q, k: q >= k, None, None, 64, 64, device="cpu", BLOCK_SIZE=(32, 16))
    with pytest.raises(ValueError, match="kv block size must be a multiple of 32, got 16"):
        BlockSparseMask.from_block_mask(block_mask)


def test_attention_converts_a_block_mask_once(monkeypatch):
    block_mask = create_block_mask(lambda b, h, q, k: q >= k, None, None, 40, 40, device="cpu", BLOCK_SIZE=32)
    calls = []
    convert_once = BlockSparseMask.from_block_mask
    monkeypatch.setattr(BlockSparseMask, "from_block_mask",
                        lambda bm, *sizes: calls.append(bm) or convert_once(bm, *sizes))
    q = torch.randn(1, 2, 40, 16)
    first = inductor_attn.attention(q, q, q, block_mask=block_mask)
    second = inductor_attn.attention(q, q, q, block_mask=block_mask)
    assert len(calls) == 1 and torch.equal(first, second)


def _per_row_documents(batch, length):
    """Causal documents that differ per batch row with one block structure (blocks of 128): flex's result is exact
    for a mask shared over the batch (B=None) whose mask_mod reads b."""
    ids = torch.zeros(batch, length, dtype=torch.long)
    for b in range(batch):
        ids[b, 100 - 40 * b:] = 1
    return lambda b, h, q, k: (ids[b, q] == ids[b, k]) & (k <= q)


@pytest.mark.parametrize("shared", ["batch", "head"])
def test_a_mask_shared_over_a_dim_its_mask_mod_reads_is_built_per_row_or_head_as_flex_runs_it(shared):
    b, h, n, d = 2, 3, 256, 16
    if shared == "batch":
        mod, sizes = _per_row_documents(b, n), (None, None)
    else:  # a sliding window per head
        mod, sizes = (lambda b, h, q, k: (k <= q) & (q - k < 8 * (h + 1))), (b, None)
    block_mask = create_block_mask(mod, *sizes, n, n, device="cpu")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, generator=g) for _ in range(3))
    dense = create_mask(mod, b, h, n, n, device="cpu")
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=dense)
    got = inductor_attn.attention(q, k, v, block_mask=block_mask)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    # converted without the call's sizes, the mask holds index 0's bitmaps only: a call with more is refused
    sparse = BlockSparseMask.from_block_mask(block_mask)
    assert sparse.shared_but_read == (shared,)
    with pytest.raises(ValueError, match=f"block_mask: its mask_mod reads the {shared} index, but the mask is shared"):
        inductor_attn.attention(q, k, v, block_mask=sparse)
    first = (slice(0, 1),) if shared == "batch" else (slice(None), slice(0, 1))  # index 0 of that dim: right
    one = inductor_attn.attention(*(x[first] for x in (q, k, v)), block_mask=sparse)
    torch.testing.assert_close(one.double(), want[first], rtol=1e-4, atol=1e-4)


def test_a_shared_mask_whose_mask_mod_reads_neither_index_stays_shared():
    block_mask = create_block_mask(lambda b, h, q, k: q >= k, None, None, 64, 64, device="cpu", BLOCK_SIZE=32)
    sparse = BlockSparseMask.from_block_mask(block_mask, batch=4, heads=8)
    assert sparse.kv_num_blocks.shape[:2] == (1, 1) and sparse.shared_but_read == ()


@settings(RANDOM, max_examples=25)
@given(st.integers(1, 4), st.integers(0, 2**31))
def test_unpack_bits_inverts_pack_bits(words, seed):
    mask = torch.rand(3, words * 32, generator=torch.Generator().manual_seed(seed)) < 0.5
    packed = pack_bits(mask)
    assert packed.dtype == torch.int32 and packed.shape == (3, words)
    assert torch.equal(unpack_bits(packed, words * 32), mask)


def test_pack_bits_sets_bit_j_mod_32_of_word_j_div_32():
    mask = torch.zeros(64, dtype=torch.bool)
    mask[[0, 5, 31, 33]] = True
    assert pack_bits(mask).tolist() == [1 + (1 << 5) - (1 << 31), 1 << 1]
