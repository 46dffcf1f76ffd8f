"""The kv_seqlens contract: keys and values past a sequence's length never influence an output or a gradient,
whatever they hold (NaN in an unwritten KV-cache slot included: 0 * NaN is NaN, so a kernel that gives such a
key weight 0 but still multiplies by it leaks). Backends measured to leak are pruned for calls with kv_seqlens,
with the reason; the tuner's gate fills the memory past the lengths with NaN, so any other candidate that reads
it is dropped, saying so. Varlen sequences never read each other's keys, and keys masked by ``key_mask`` may
hold any finite values. Triton's kernels run in its interpreter here; tests/test_kv_seqlens_contract_gpu.py
runs the same checks over a GPU's candidates."""

from __future__ import annotations

import dataclasses

import pytest
from test_fa4 import fake_fa4

from inductor_attn.backends import fa4, sdpa
from inductor_attn.device import parse_device_override
from inductor_attn.problem import Problem

SM90 = parse_device_override("sm_90")


# --------------------------------------------------------------------------------- pruned, with the reason
DECODE = Problem("attention", "bfloat16", "cuda", 8, 32, 8, 1, 4096, 128, 128, has_kv_seqlens=True)
PREFILL = Problem("attention", "bfloat16", "cuda", 2, 16, 2, 512, 2048, 256, 256, causal=True, has_kv_seqlens=True)


@pytest.mark.parametrize("problem", [DECODE, PREFILL], ids=["decode", "prefill"])
@pytest.mark.parametrize("backend", [sdpa.BACKEND, fa4.BACKEND], ids=lambda b: b.name)
def test_backends_measured_to_leak_nan_past_kv_seqlens_are_pruned_for_such_calls(backend, problem, monkeypatch):
    monkeypatch.setattr(fa4, "_load", lambda: fake_fa4())
    reason = backend.supports(problem, SM90)
    assert reason is not None and "past kv_seqlens" in reason and "0 * NaN" in reason, reason
    assert backend.supports(dataclasses.replace(problem, has_kv_seqlens=False), SM90) is None
