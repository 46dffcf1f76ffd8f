"""A document block mask on the GPU: eager and compiled calls run as varlen on whichever kernels the tuner
picks, and match the float64 reference, forward and backward."""

from __future__ import annotations

import pytest
import torch
from naive import attend
from torch.nn.attention.flex_attention import create_block_mask

import inductor_attn
from inductor_attn import BlockSparseMask

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_document_mask_runs_varlen_and_matches_float64(compiled, causal):
    length, dtype = 1024, torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.repeat_interleave(torch.arange(4, device="cuda"), torch.tensor([100, 500, 3, 421], device="cuda"))

    def mod(b, h, q, k):
        same = ids[q] == ids[k]
        return same & (k <= q) if causal else same

    sparse = BlockSparseMask.from_block_mask(create_block_mask(mod, None, None, length, length, device="cuda"))
    assert sparse.documents is not None and sparse.documents.causal == causal
    q, k, v = (torch.randn(1, h, length, 128, device="cuda", dtype=dtype, generator=gen).requires_grad_()
               for h in (8, 2, 2))
    grad = torch.randn(1, 8, length, 128, device="cuda", dtype=dtype, generator=gen)
    fn = torch.compile(inductor_attn.attention, fullgraph=True) if compiled else inductor_attn.attention
    inductor_attn.reset_stats()
    for _ in range(2):  # a second call runs the plans the first one made
        out = fn(q, k, v, block_mask=sparse)
        grads = torch.autograd.grad(out, (q, k, v), grad)
    assert {key.split("/")[0] for key in inductor_attn.stats()} == {"varlen"}

    exact = [x.detach().double().requires_grad_() for x in (q, k, v)]
    want, _ = attend(exact[0], exact[1], exact[2], sparse.dense_mask(), 128 ** -0.5)
    want_grads = torch.autograd.grad(want, exact, grad.double())
    for got, ref in [(out, want), *zip(grads, want_grads)]:
        assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-2
