"""Every listed candidate is a distinct launch: two configs of one backend never run the same kernel with
the same arguments (issue: FA4's backward "configs" were one kernel timed under several names)."""

from __future__ import annotations

import dataclasses

import pytest

from inductor_attn.backends import fa4, flex, sdpa, triton_decode
from inductor_attn.backends.triton_flash import flash, flash_bwd
from inductor_attn.device import parse_device_override
from inductor_attn.problem import Problem

DEVICES = {"H100": parse_device_override("sm_90"), "B200": parse_device_override("sm_100")}
PROBLEMS = {
    "dense causal gqa": Problem("attention", "bfloat16", "cuda", 2, 16, 4, 2048, 2048, 128, 128, causal=True),
    "dense d64": Problem("attention", "bfloat16", "cuda", 4, 8, 8, 1024, 1024, 64, 64),
    "decode": Problem("attention", "bfloat16", "cuda", 1, 32, 8, 1, 8192, 128, 128, has_kv_seqlens=True),
    "window": Problem("attention", "bfloat16", "cuda", 1, 8, 8, 4096, 4096, 128, 128, causal=True, window_left=256,
                      window_right=0),
    "block sparse": Problem("block_sparse", "bfloat16", "cuda", 1, 8, 8, 4096, 4096, 128, 128, block_q=128,
                            block_kv=128, density=0.2, partial_fraction=0.5),
}


def _signature(backend, p: Problem, dev, cfg, direction: str):
    """What a config's launch depends on: two configs with one signature would be one kernel twice."""
    if backend is flash.BACKEND:
        if direction == "backward":
            return dataclasses.astuple(flash_bwd.plan_for(max(p.head_dim, p.head_dim_v), cfg, p.dtype))
        return tuple(sorted(flash.kernel_constexprs(p, cfg).items()))
    if backend is triton_decode.BACKEND:
        return triton_decode._knobs(p, dev, cfg)
    if backend is fa4.BACKEND:
        knobs = tuple(sorted(fa4.launch.knob_kwargs(cfg).items()))
        return knobs + (cfg.get("clc"), cfg.get("deterministic"))
    if backend is flex.BACKEND:
        return tuple(sorted(flex.kernel_options(cfg).items()))
    if backend is sdpa.BACKEND:
        return cfg["kernel"]
    raise AssertionError(f"no signature for backend {backend.name}")


@pytest.fixture(autouse=True)
def _fa4_installed(monkeypatch):
    from test_fa4 import fake_fa4

    monkeypatch.setattr(fa4.loading, "load", lambda: fake_fa4())
    monkeypatch.setattr(sdpa, "sdpa_default_kernel", lambda p, dev: "cudnn")  # asks the GPU otherwise


@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("problem", PROBLEMS)
def test_no_two_runnable_configs_of_a_backend_launch_the_same_kernel(problem, device, direction):
    p, dev = PROBLEMS[problem], DEVICES[device]
    for backend in (flash.BACKEND, triton_decode.BACKEND, fa4.BACKEND, flex.BACKEND, sdpa.BACKEND):
        if direction == "backward" and not backend.takes.backward:
            continue
        if backend.supports(p, dev, direction) is not None:
            continue
        runnable = [c.config for c in backend.configs(p, dev, direction) if c.pruned is None]
        signatures = [_signature(backend, p, dev, cfg, direction) for cfg in runnable]
        twins = {str(c) for c, s in zip(runnable, signatures) if signatures.count(s) > 1}
        assert not twins, f"{backend.name} {direction}: these configs launch the same kernel: {sorted(twins)}"
