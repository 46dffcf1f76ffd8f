"""Block masks that are packed documents: found on conversion, run as varlen attention over views of q, k, v."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from naive import attend
from test_reference import BLOCK_SIZES, MASK_KINDS, mask_mods
from torch.nn.attention.flex_attention import create_block_mask

import inductor_attn
from inductor_attn import BlockSparseMask

RANDOM = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def document_ids(lengths_per_row: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row))
                        for row in lengths_per_row])


def convert(mask_mod, b, h, length, block=64) -> BlockSparseMask:
    return BlockSparseMask.from_block_mask(create_block_mask(mask_mod, b, h, length, length, device="cpu",
                                                             BLOCK_SIZE=block))


def cu_of(lengths_per_row: list[list[int]], length: int) -> list[int]:
    starts = [b * length + s for b, row in enumerate(lengths_per_row) for s in [0, *torch.tensor(row).cumsum(0)[:-1]]]
    return [int(s) for s in starts] + [len(lengths_per_row) * length]


@RANDOM
@given(st.integers(1, 2), st.integers(40, 300), st.booleans(), st.sampled_from(BLOCK_SIZES), st.integers(0, 2**31))
def test_packed_documents_are_found_with_their_boundaries(rows, length, causal, block, seed):
    gen = torch.Generator().manual_seed(seed)
    lengths = []
    for _ in range(rows):
        cuts = sorted(set(torch.randint(1, length, (int(torch.randint(0, 6, (1,), generator=gen)),),
                                        generator=gen).tolist()))
        bounds = [0, *cuts, length]
        lengths.append([bounds[i + 1] - bounds[i] for i in range(len(bounds) - 1)])
    ids = document_ids(lengths)

    def mod(b, h, q, k):
        same = ids[b, q] == ids[b, k]
        return same & (k <= q) if causal else same

    docs = convert(mod, rows if rows > 1 else None, None, length, block).documents
    assert docs is not None
    assert docs.cu_seqlens.tolist() == cu_of(lengths, length)
    assert docs.cu_seqlens.dtype == torch.int32
    assert docs.max_seqlen == max(max(row) for row in lengths)
    # one document of one token is causal and full at once
    assert docs.causal == causal or max(max(row) for row in lengths) == 1


@RANDOM
@given(st.sampled_from(MASK_KINDS), st.sampled_from(BLOCK_SIZES), st.integers(2, 300), st.integers(0, 2**31))
def test_a_mask_is_called_documents_only_when_their_mask_is_the_same(kind, block, length, seed):
    """Whatever the conversion says: a mask it calls packed documents has exactly those documents' mask, in
    every head."""
    mod, b, h = mask_mods(kind, torch.Generator().manual_seed(seed), length, heads=3)
    sparse = convert(mod, b, h, length, block)
    if sparse.documents is None:
        return
    cu, causal = sparse.documents.cu_seqlens.tolist(), sparse.documents.causal
    want = torch.zeros(length * sparse.kv_num_blocks.shape[0], length * sparse.kv_num_blocks.shape[0],
                       dtype=torch.bool)
    for start, stop in zip(cu[:-1], cu[1:]):
        want[start:stop, start:stop] = torch.ones(stop - start, stop - start).tril().bool() if causal else True
    for head in range(sparse.kv_num_blocks.shape[1]):
        dense = sparse.dense_mask()[:, head]
        got = torch.block_diag(*dense.float()).bool()  # batch rows one after another, as cu_seqlens counts them
        assert torch.equal(got, want)


@pytest.mark.parametrize("name, mod, heads", [
    ("sliding window", lambda b, h, q, k: (k <= q) & (k >= q - 50), None),
    ("prefix LM", lambda b, h, q, k: (k <= q) | (k < 30), None),
    ("one pair missing", lambda b, h, q, k: (q // 70 == k // 70) & (k <= q) & ~((q == 100) & (k == 80)), None),
    ("documents per head", lambda b, h, q, k: (q // (40 + h) == k // (40 + h)) & (k <= q), 2),
    ("a row that sees nothing", lambda b, h, q, k: (q // 70 == k // 70) & (k <= q) & (q != 5), None),
])
def test_other_masks_are_not_documents(name, mod, heads):
    assert convert(mod, None, heads, 200).documents is None


@pytest.mark.parametrize("twice", ["in the full list", "as full and partial"])
def test_a_mask_listing_a_block_twice_is_not_documents(twice):
    """Hand-made block lists can name a kv block twice for one q block (and miss another): counted keys
    would then equal the span although keys are missing."""
    from torch.nn.attention.flex_attention import BlockMask

    length, block = 128, 32
    n = length // block
    full_cnt = torch.full((1, 1, n), n if twice == "in the full list" else n - 1, dtype=torch.int32)
    full_idx = torch.tensor([0, 0, 2, 3] if twice == "in the full list" else [0, 2, 3, 0], dtype=torch.int32)
    cnt = torch.full((1, 1, n), int(twice != "in the full list"), dtype=torch.int32)
    idx = torch.zeros(1, 1, n, n, dtype=torch.int32)  # partial: block 0 again, bits all set by the mask_mod
    bm = BlockMask.from_kv_blocks(cnt, idx, full_cnt, full_idx.expand(1, 1, n, n).contiguous(), BLOCK_SIZE=block,
                                  seq_lengths=(length, length), mask_mod=lambda b, h, q, k: q >= 0)
    sparse = BlockSparseMask.from_block_mask(bm)
    assert not sparse.dense_mask()[..., block:2 * block].any()  # block 1 is never attended
    assert sparse.documents is None


def test_documents_built_for_every_head_are_found():
    """create_block_mask with H heads and a mask_mod that ignores the head: one mask per head, all alike."""
    sparse = convert(lambda b, h, q, k: (q // 70 == k // 70) & (k <= q), None, 3, 200)
    assert sparse.kv_num_blocks.shape[1] == 3
    assert sparse.documents is not None and sparse.documents.cu_seqlens.tolist() == [0, 70, 140, 200]


def test_documents_need_equal_query_and_key_lengths():
    bm = create_block_mask(lambda b, h, q, k: q // 50 == k // 50, None, None, 100, 200, device="cpu")
    assert BlockSparseMask.from_block_mask(bm).documents is None


def _inputs(batch: int, length: int, layout: str, gen):
    def one(heads):
        if layout == "BLHD":  # (B, L, H, D) storage seen as (B, H, L, D), as a model's transposes make
            x = torch.randn(batch, length, heads, 16, generator=gen).transpose(1, 2)
        else:
            x = torch.randn(batch, heads, length, 16, generator=gen)
        return x.requires_grad_()
    return one(4), one(2), one(2)


@pytest.mark.parametrize("batch, mask_rows, layout, packed", [
    (1, 1, "BHLD", True), (2, 2, "BLHD", True), (2, 1, "BLHD", True), (2, 2, "BHLD", False)])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_documents_run_as_varlen_and_match_float64(batch, mask_rows, layout, packed, compiled, reference_only):
    """Where q, k and v pack into (B * L, H, D) views the call runs varlen; a (B, H, L, D) batch of two does
    not pack and stays block-sparse. Both give the float64 result and gradients (on the reference kernel:
    what is tested here is the packing, the layouts and autograd through the views)."""
    gen = torch.Generator().manual_seed(0)
    length = 150
    ids = document_ids([[40, 70, 40], [3, 100, 47]])
    if mask_rows == 1:  # one mask shared by the batch: a mask_mod that reads no batch index
        first = ids[0]
        sparse = convert(lambda b, h, q, k: (first[q] == first[k]) & (k <= q), None, None, length)
    else:
        sparse = convert(lambda b, h, q, k: (ids[b, q] == ids[b, k]) & (k <= q), mask_rows, None, length)
    assert sparse.documents is not None
    q, k, v = _inputs(batch, length, layout, gen)
    grad = torch.randn(batch, 4, length, 16, generator=gen)
    fn = torch.compile(inductor_attn.attention, fullgraph=True) if compiled else inductor_attn.attention
    inductor_attn.reset_stats()
    out, lse = fn(q, k, v, block_mask=sparse, return_lse=True)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    assert out.shape == (batch, 4, length, 16) and lse.shape == (batch, 4, length) and lse.is_contiguous()
    ops = {key.split("/")[0] for key in inductor_attn.stats()}
    assert ops == ({"varlen"} if packed else {"block_sparse"})

    exact = [x.detach().double().requires_grad_() for x in (q, k, v)]
    mask = sparse.dense_mask()
    want, want_lse = attend(exact[0], *(x.repeat_interleave(2, 1) for x in exact[1:]), mask, 16 ** -0.5)
    want_grads = torch.autograd.grad(want, exact, grad.double())
    for got, ref in [(out, want), (lse, want_lse), *zip(grads, want_grads)]:
        assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-5


def test_candidates_and_run_candidate_see_the_varlen_call():
    length = 128
    sparse = convert(lambda b, h, q, k: (q // 50 == k // 50) & (k <= q), None, None, length)
    q, k, v = (torch.randn(1, 2, length, 16) for _ in range(3))
    listed = inductor_attn.candidates(q, k, v, block_mask=sparse)
    by_name = {c.name: c for c in listed}
    assert by_name["reference:default"].pruned is None
    inductor_attn.reset_stats()
    out = inductor_attn.run_candidate("reference:default", q, k, v, block_mask=sparse)
    assert list(inductor_attn.stats()) == ["varlen/forward -> reference:default"]
    torch.testing.assert_close(out, inductor_attn.attention(q, k, v, block_mask=sparse))
