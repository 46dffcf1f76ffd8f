"""Outputs follow q's stride order in eager and compiled code (Inductor asserts the fake impl's strides)."""

import itertools

import torch

import inductor_attn
from inductor_attn.layout import conform, empty_like_layout, layout_strides, stride_order


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
