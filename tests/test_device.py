"""Simulated devices (``INDUCTOR_ATTN_DEVICE``): candidates of other GPUs are listed and pruned on a machine
without CUDA, as the sm_100 paths (CLC, split-KV) are tested here."""

from __future__ import annotations

import pytest
import torch
from test_fa4 import fake_fa4

from inductor_attn.backends import backends, enumerate_candidates, fa4
from inductor_attn.device import device_info
from inductor_attn.problem import Problem

PROBLEMS = {
    "dense causal gqa": Problem("attention", "bfloat16", "cuda", 2, 16, 4, 2048, 2048, 128, 128, causal=True),
    "decode": Problem("attention", "bfloat16", "cuda", 4, 32, 8, 1, 8192, 128, 128, has_kv_seqlens=True),
    "key mask": Problem("attention", "float16", "cuda", 2, 8, 8, 512, 512, 64, 64, has_key_mask=True),
    "varlen": Problem("varlen", "bfloat16", "cuda", 3, 8, 8, 1024, 1024, 128, 128, causal=True, total_q=2048,
                      total_k=2048),
    "block sparse": Problem("block_sparse", "bfloat16", "cuda", 1, 8, 8, 4096, 4096, 128, 128, block_q=128,
                            block_kv=128, density=0.2, partial_fraction=0.5),
}


@pytest.fixture
def no_cuda(monkeypatch):
    """Any CUDA call fails, as on a machine without a GPU (also when these tests run on one)."""
    def refuse(*args, **kwargs):
        raise AssertionError("a simulated device must not touch CUDA")

    monkeypatch.setattr(torch.cuda, "_lazy_init", refuse)
    monkeypatch.setattr(torch.cuda, "get_device_properties", refuse)


@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("simulated", ["sm_90", "sm_100"])
@pytest.mark.parametrize("problem", PROBLEMS)
def test_a_simulated_gpu_lists_every_backends_candidates_without_touching_cuda(problem, simulated, direction,
                                                                               monkeypatch, no_cuda):
    monkeypatch.setenv("INDUCTOR_ATTN_DEVICE", simulated)
    monkeypatch.setattr(fa4.loading, "load", lambda: fake_fa4())  # FA4 "installed": its enumeration runs too
    dev = device_info("cuda")
    cands = enumerate_candidates(PROBLEMS[problem], dev, direction)
    listed = {c.backend for c in cands}
    assert listed == {b.name for b in backends() if PROBLEMS[problem].op in b.takes.ops}
    assert any(c.pruned is None for c in cands)
