"""SDPA's kernels as candidates on a GPU: every runnable config matches the reference (bf16/fp16)."""

import pytest
import torch

import inductor_attn
from inductor_attn.tuning.correctness import check_output

pytestmark = pytest.mark.gpu

CASES = [
    dict(b=2, hq=8, hkv=8, lq=256, lk=256, d=64, causal=False),
    dict(b=2, hq=8, hkv=8, lq=300, lk=300, d=128, causal=True),
    dict(b=2, hq=8, hkv=2, lq=128, lk=512, d=128, causal=True),  # GQA, lower-right causal
    dict(b=1, hq=16, hkv=4, lq=1, lk=1000, d=256, causal=False),  # decode
    dict(b=2, hq=8, hkv=8, lq=256, lk=256, d=64, causal=True, window=32),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_runnable_sdpa_config_matches_the_reference(case, dtype):
    torch.manual_seed(0)
    dev = "cuda"
    q = torch.randn(case["b"], case["hq"], case["lq"], case["d"], device=dev, dtype=dtype)
    k = torch.randn(case["b"], case["hkv"], case["lk"], case["d"], device=dev, dtype=dtype)
    v = torch.randn(case["b"], case["hkv"], case["lk"], case["d"], device=dev, dtype=dtype)
    kwargs = dict(causal=case["causal"], window=case.get("window"))
    ref = inductor_attn.run_candidate("reference:default", q, k, v, return_lse=True, **kwargs)
    ran = 0
    for cand in inductor_attn.candidates(q, k, v, **kwargs):
        if cand.backend != "sdpa" or cand.pruned:
            continue
        out, lse = inductor_attn.run_candidate(cand, q, k, v, return_lse=True, **kwargs)
        assert check_output(out, lse, *ref, dtype) is None, cand.name
        ran += 1
    assert ran >= 1
