"""flex_attention routed to our block-sparse op on a GPU, forward and backward, against float64 autograd.

Run on the device machine: ``python -m pytest -q tests/test_flex_route_gpu.py``. Each case compiles one
function with ``backend="inductor_attn"`` and ``fullgraph=True``; outputs and the gradients of q, k, v
are compared with float64 attention over flex's own dense mask (``create_mask``), per dtype tolerance.
The tuning mode is "heuristic" (no measurement: the first runnable candidate) to keep compile time down;
candidates chosen by tuning are checked the same way inside the tuner.
"""

from __future__ import annotations

import pytest
import torch
from naive import attend
from torch.nn.attention.flex_attention import create_block_mask, create_mask, flex_attention

import inductor_attn
from inductor_attn.tuning.correctness import TOLERANCES, rel_err

pytestmark = pytest.mark.gpu


def document_causal(batch, length):
    gen = torch.Generator(device="cuda").manual_seed(5)
    docs = (torch.rand(batch, length, generator=gen, device="cuda") < 0.005).cumsum(-1)
    return lambda b, h, q, kv: (docs[b, q] == docs[b, kv]) & (q >= kv), batch


CASES = {  # name: (mask_mod factory -> (mask_mod, mask batch or None), B, Hq, Hkv, L)
    "sliding window 128, GQA 4": (lambda b, l: ((lambda b_, h, q, kv: (q >= kv) & (q - kv <= 128)), None),
                                  2, 8, 2, 1000),
    "document causal": (document_causal, 2, 4, 4, 777),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_routed_flex_forward_and_backward_match_float64(name, dtype, monkeypatch):
    factory, batch, hq, hkv, length = CASES[name]
    mask_mod, mask_batch = factory(batch, length)
    block_mask = create_block_mask(mask_mod, mask_batch, None, length, length, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, hq, length, 128, device="cuda", generator=gen).to(dtype).requires_grad_()
    k, v = (torch.randn(batch, hkv, length, 128, device="cuda", generator=gen).to(dtype).requires_grad_()
            for _ in range(2))
    grad_out = torch.randn(batch, hq, length, 128, device="cuda", generator=gen).to(dtype)

    def fn(q, k, v):
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=hq != hkv)

    monkeypatch.setenv("INDUCTOR_ATTN_ROUTE_FLEX", "1")
    torch._dynamo.reset()
    inductor_attn.reset_routing_report()
    inductor_attn.reset_stats()
    with inductor_attn.tuning_mode("heuristic"):
        out = torch.compile(fn, backend="inductor_attn", fullgraph=True)(q, k, v)
        out.backward(grad_out)
    assert inductor_attn.routing_report() == {"flex_attention: routed (block-sparse)": 1}
    stats = inductor_attn.stats()
    assert [key.split(" -> ")[0] for key in stats] == ["block_sparse/backward", "block_sparse/forward"], stats

    dense = create_mask(mask_mod, batch, hq, length, length, device="cuda")
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = attend(q64, k64, v64, dense, 128 ** -0.5)
    ref.backward(grad_out.double())
    tol = TOLERANCES[dtype]
    for what, got, want in (("out", out, ref), ("dq", q.grad, q64.grad), ("dk", k.grad, k64.grad),
                            ("dv", v.grad, v64.grad)):
        assert not torch.isnan(got).any(), f"{what} has NaN"
        assert rel_err(got, want) <= tol, f"{what}: rel. error {rel_err(got, want):.2e} > {tol:.0e} ({stats})"
