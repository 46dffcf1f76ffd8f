"""The kv_seqlens contract over a GPU's candidates (tests/test_kv_seqlens_contract.py says what it is and runs it
over the CPU's): every runnable candidate, forward and backward, passes the gate with NaN past the lengths
(pruned ones are not run); varlen candidates never read the keys between two sequences; key_mask candidates give
the same output whatever finite values masked keys hold; and what each tuning mode picks, eagerly and compiled,
keeps the contract. Shapes are those the leaks were measured on (H200, bf16). Run on the device machine:
``python -m pytest -q -m gpu tests/test_kv_seqlens_contract_gpu.py``."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_kv_seqlens_contract import (gate_every_candidate, holding, left_padded, packed_with_a_nan_sequence, past,
                                      random_call)

import inductor_attn
from inductor_attn.api import make_call
from inductor_attn.tuning.measure import gate_inputs

pytestmark = pytest.mark.gpu

CASES = {
    "decode_lq1_hq32_hkv8_d128": dict(b=4, hq=32, hkv=8, lq=1, lk=4096, d=128, lengths=[1, 1000, 2049, 4095]),
    "decode_lq4_hq32_hkv8_d128": dict(b=4, hq=32, hkv=8, lq=4, lk=4096, d=128, lengths=[4, 1000, 2049, 4095],
                                      causal=True),
    "decode_lq1_hq16_hkv2_d256": dict(b=2, hq=16, hkv=2, lq=1, lk=2048, d=256, lengths=[77, 2000]),
    "prefill_causal_hq16_hkv2_d128": dict(b=2, hq=16, hkv=2, lq=512, lk=1024, d=128, lengths=[600, 1000],
                                          causal=True),
}


@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_every_runnable_gpu_candidate_passes_the_gate_with_nan_past_kv_seqlens(case, direction):
    torch.manual_seed(0)
    call = random_call(**case, dtype=torch.bfloat16, device="cuda")
    gated, failures = gate_every_candidate(gate_inputs(call, seed=1), direction)
    assert not failures, "\n".join(failures)
    assert len(gated) >= 2, gated  # one besides the reference


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_no_gpu_varlen_candidate_reads_the_keys_between_two_sequences(direction):
    torch.manual_seed(0)
    padded, clean = packed_with_a_nan_sequence("cuda", torch.bfloat16)
    gated, failures = gate_every_candidate(padded, direction, expected_call=clean)
    assert not failures, "\n".join(failures)
    assert len(gated) >= 2, gated


@pytest.mark.parametrize("value", [1e4, -1e4])
@pytest.mark.parametrize("shape", [dict(lq=1, lk=4096, d=128), dict(lq=512, lk=512, d=128)], ids=["decode", "prefill"])
def test_masked_keys_may_hold_any_finite_values_on_every_gpu_key_mask_candidate(shape, value):
    torch.manual_seed(0)
    # HF's left padding: the first 100 keys of batch 0 are pad tokens (no causal mask: no row is fully masked)
    q, k, v, key_mask = left_padded("cuda", torch.bfloat16, b=2, hq=16, hkv=2, pad=(100, 0), **shape)
    call = make_call(q, k, v, key_mask=key_mask)
    held = dataclasses.replace(call, k=holding(k, key_mask, value), v=holding(v, key_mask, value))
    gated, failures = gate_every_candidate(held, "forward", expected_call=call)
    assert not failures, "\n".join(failures)
    assert len(gated) >= 2, gated


@pytest.mark.parametrize("mode", ["off", "heuristic", "cache-only", "autotune"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_what_each_mode_picks_keeps_the_contract_eagerly_and_compiled(mode, compiled):
    """The gate runs only when autotuning: the other modes' picks are kept right by pruning alone."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    call = random_call(**CASES["decode_lq4_hq32_hkv8_d128"], dtype=torch.bfloat16, device="cuda")
    tails = past(call.kv_seqlens, call.k.shape[2])
    leaves = [x.clone().requires_grad_() for x in (call.q, call.k.masked_fill(tails, float("nan")),
                                                    call.v.masked_fill(tails, float("nan")))]

    def step(q, k, v, lengths):
        return inductor_attn.attention(q, k, v, causal=True, kv_seqlens=lengths)

    fn = torch.compile(step, fullgraph=True) if compiled else step
    with inductor_attn.tuning_mode(mode):
        out = fn(*leaves, call.kv_seqlens)
        grads = torch.autograd.grad(out, leaves, torch.randn_like(out))
    assert not out.isnan().any(), f"{mode}: NaN past kv_seqlens reached the output"
    for name, grad in zip("qkv", grads):
        assert not grad.isnan().any(), f"{mode}: NaN past kv_seqlens reached d{name}"
