"""Outputs follow q's stride order in eager and compiled code (Inductor asserts the fake impl's strides)."""

import itertools

import torch

import inductor_attn
from inductor_attn.layout import (conform, empty_like_layout, int32_contiguous, layout_strides, stride_order,
                                  tma_aligned)


def test_out_follows_the_stride_order_of_a_transposed_q_eager_and_compiled():
    packed = torch.randn(2, 24, 4 + 2 * 2, 16)  # (B, L, Hq + 2 Hkv, D), as a fused qkv projection gives
    q, k, v = (t.transpose(1, 2) for t in packed.split([4, 2, 2], dim=2))
    eager = inductor_attn.attention(q, k, v, causal=True)
    compiled = torch.compile(lambda q, k, v: inductor_attn.attention(q, k, v, causal=True), fullgraph=True)(q, k, v)
    assert stride_order(eager) == stride_order(q) == [0, 2, 1, 3]
    torch.testing.assert_close(compiled, eager)


def test_conform_copies_only_when_the_layout_differs():
    like = torch.empty(2, 5, 3, 4).transpose(1, 2)
    right = torch.empty(2, 5, 3, 4).transpose(1, 2)
    assert conform(right, like) is right
    wrong = torch.randn(2, 3, 5, 4)
    fixed = conform(wrong, like)
    assert fixed.stride() == right.stride() and torch.equal(fixed, wrong)


def test_layout_strides_are_those_of_the_tensor_empty_like_layout_allocates():
    # conform compares by them instead of allocating; sizes 0 and 1 included (c10 counts a 0 as 1)
    for sizes in itertools.product([0, 1, 2, 3], repeat=4):
        for order in itertools.permutations(range(4)):
            like = torch.empty_permuted((2, 3, 4, 5), order)
            assert layout_strides(like, sizes) == empty_like_layout(like, sizes).stride(), (sizes, order)


def test_tma_aligned_takes_broadcast_dims_only_where_asked_and_size_one_dims_of_stride_zero_always():
    x = torch.empty(2, 4, 8, 16, dtype=torch.float16)
    broadcast = torch.empty(2, 1, 8, 16, dtype=torch.float16).expand(2, 4, 8, 16)  # stride 0 over 4 heads
    one_head = torch.empty(2, 1, 8, 16, dtype=torch.float16).as_strided((2, 1, 8, 16), (128, 0, 16, 1))
    misaligned = torch.empty(2 * 4 * 8 * 16 + 4, dtype=torch.float16)[4:].view(2, 4, 8, 16)  # 8 bytes off 16
    for ok in (True, False):
        assert tma_aligned(x, broadcast_ok=ok) and tma_aligned(one_head, broadcast_ok=ok)
        assert not tma_aligned(x.transpose(-1, -2), broadcast_ok=ok)  # last dim not contiguous
        assert not tma_aligned(misaligned, broadcast_ok=ok)
        assert not tma_aligned(torch.empty(2, 4, 8, 12, dtype=torch.float16)[..., :8], broadcast_ok=ok)  # 24 B rows
    assert tma_aligned(broadcast, broadcast_ok=True) and not tma_aligned(broadcast, broadcast_ok=False)


def test_tma_aligned_agrees_with_its_definition_on_random_layouts():
    # the definition: last dim contiguous, pointer 16-byte aligned, every other stride a multiple of 16 bytes, and
    # a stride of 0 on a dim longer than 1 only where broadcasts are taken
    def defined(x, broadcast_ok):
        per16 = max(1, 16 // x.element_size())
        return (x.stride(-1) == 1 and x.data_ptr() % 16 == 0
                and all(s % per16 == 0 and (broadcast_ok or s != 0 or n == 1)
                        for s, n in zip(x.stride()[:-1], x.shape[:-1])))

    gen = torch.Generator().manual_seed(0)
    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    for dtype in (torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.int64):
        base = torch.empty(1 << 16, dtype=dtype)
        for _ in range(400):
            shape = [pick([1, 2, 3, 8]) for _ in range(pick([1, 2, 3, 4]))]
            strides = [pick([0, 1, 2, 4, 8, 16, 24, 48, 128]) for _ in shape]
            x = base.as_strided(shape, strides, pick([0, 1, 2, 4, 8, 16]))
            for ok in (True, False):
                assert tma_aligned(x, broadcast_ok=ok) == defined(x, ok), (dtype, shape, strides, x.storage_offset())


def test_kv_seqlens_of_another_stride_give_the_same_attention():
    """Kernels read a length at index + 1: a strided kv_seqlens (a column of a wider tensor) is made unit stride
    for every backend (AttnCall), here the Triton kernels the CPU tune picks, with NaN past every length."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 4, n, 32, generator=gen) for n in (1, 40, 40))
    lens = torch.tensor([40, 7, 23], dtype=torch.int32)
    for b, n in enumerate(lens.tolist()):
        k[b, :, n:], v[b, :, n:] = float("nan"), float("nan")
    strided = torch.stack([lens, torch.full_like(lens, 99)], 1)[:, 0]
    assert strided.stride(0) == 2
    want = inductor_attn.attention(q, k, v, kv_seqlens=lens)
    torch.testing.assert_close(inductor_attn.attention(q, k, v, kv_seqlens=strided), want)
    assert not want.isnan().any()


def test_a_window_as_long_as_int32_allows_is_no_window_forward_and_backward():
    """2**31 - 1, the largest window accepted, plus a position overflowed the kernels' int32 arithmetic (every row
    came out empty); AttnCall caps windows at a length no sequence has."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 16, generator=gen, requires_grad=True) for n in (20, 24, 24))
    for window, causal in ((2**31 - 1, False), ((5, 2**31 - 2), False), (2**31 - 1, True)):
        got = inductor_attn.attention(q, k, v, window=window, causal=causal)
        left = window[0] if isinstance(window, tuple) else window
        want = inductor_attn.attention(q, k, v, window=(left, -1) if left < 2**30 else None, causal=causal)
        torch.testing.assert_close(got, want)
        grads = torch.autograd.grad(got.sum(), (q, k, v))
        for g, w in zip(grads, torch.autograd.grad(want.sum(), (q, k, v))):
            torch.testing.assert_close(g, w)


def test_int32_contiguous_converts_only_what_is_not_unit_stride_int32():
    lens = torch.tensor([3, 5], dtype=torch.int32)
    assert int32_contiguous(lens) is lens and int32_contiguous(None) is None
    for other in (lens.long(), torch.tensor([3, 0, 5], dtype=torch.int32)[::2]):
        got = int32_contiguous(other)
        assert got.dtype == torch.int32 and got.stride(0) == 1 and got.tolist() == [3, 5]
