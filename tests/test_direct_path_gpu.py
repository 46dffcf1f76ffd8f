"""Compiled calls decided at compile time launch the chosen kernel from Inductor's generated code: Triton
kernels and SDPA's aten ops inline, FA4 through the thin launch op; backward graphs too; CUDA graphs
capture them without skips. Each candidate is forced by leaving only its backend and the reference."""

from __future__ import annotations

import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import inductor_attn
from inductor_attn.backends import REFERENCE, get_backend, only_backends
from inductor_attn.tuning.correctness import TOLERANCES, rel_err

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    inductor_attn.reset_stats()
    yield
    torch._dynamo.reset()


def _inputs(b, hq, hkv, lq, lk, d, requires_grad=False, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_(requires_grad)
            for h, n in ((hq, lq), (hkv, lk), (hkv, lk))]


def _reference(q, k, v, **kw):
    exact = [x.detach().double() for x in (q, k, v)]
    with only_backends(REFERENCE):
        return inductor_attn.attention(*exact, **kw)


def _only(name, q, k, v, **kw):
    """Only ``name`` (and the reference) as candidates; skips where ``name`` cannot run this call."""
    from inductor_attn.api import make_call
    from inductor_attn.device import device_info

    backend = get_backend(name)
    reason = backend.supports(make_call(q, k, v, **kw).problem, device_info("cuda"))
    if reason is not None:
        pytest.skip(f"{name}: {reason}")
    return only_backends(backend, REFERENCE)


@pytest.mark.parametrize("name, inlined", [("sdpa", True), ("fa4", False)])
def test_compiled_forward_launches_the_chosen_kernel_without_our_op(name, inlined):
    q, k, v = _inputs(2, 8, 2, 256, 256, 64)
    with _only(name, q, k, v, causal=True), inductor_attn.tuning_mode("autotune"):
        fn = torch.compile(lambda q, k, v: inductor_attn.attention(q, k, v, causal=True), fullgraph=True)
        out, (code,) = run_and_get_code(fn, q, k, v)
        again = fn(q, k, v)
    assert "inductor_attn.attention.default" not in code  # no op impl, no checks, no decision per call
    assert ("torch.ops.inductor_attn" not in code) if inlined else ("inductor_attn.launch.default" in code)
    if inlined:  # inference: cuDNN and efficient are asked for no lse (args: q, k, v, bias, compute_lse, ...)
        kernel_call = next(line for line in code.splitlines() if "aten._scaled_dot_product_" in line)
        assert "_flash_attention" in kernel_call or ", None, False, 0.0, True" in kernel_call, kernel_call
    assert rel_err(out, _reference(q, k, v, causal=True)) < TOLERANCES[torch.bfloat16]
    torch.testing.assert_close(again, out, rtol=0, atol=0)


@pytest.mark.parametrize("tma", [False, True])
def test_triton_configs_are_launched_by_generated_code_except_host_tma_ones(tma):
    """Pointer-load configs are traced into the graph; host-side TMA descriptors cannot be (torch 2.11's
    wrap_triton keeps them as side-table constants), so those configs go through the launch op."""
    q, k, v = _inputs(2, 8, 2, 256, 256, 64)
    choice = next(c.name for c in inductor_attn.candidates(q, k, v, causal=True)
                  if c.backend == "triton" and c.pruned is None and bool(c.config.get("tma")) == tma)
    op = torch.ops.inductor_attn.attention  # run_candidate's enumeration is eager-only: call the op

    def fn(q, k, v):
        return op(q, k, v, q.shape[-1] ** -0.5, True, -1, -1, None, None, choice)[0]

    out, (code,) = run_and_get_code(torch.compile(fn, fullgraph=True), q, k, v)
    assert "inductor_attn.attention.default" not in code
    inlined = "torch.ops.inductor_attn" not in code and "flash_fwd_kernel" in code
    assert ("inductor_attn.launch.default" in code) if tma else inlined
    assert rel_err(out, _reference(q, k, v, causal=True)) < TOLERANCES[torch.bfloat16]


def test_compiled_decode_with_kv_seqlens_is_decided_while_compiling():
    q, k, v = _inputs(4, 16, 2, 1, 4096, 128)
    lens = torch.tensor([4096, 17, 1000, 2048], device="cuda", dtype=torch.int32)
    with _only("triton_decode", q, k, v, kv_seqlens=lens), inductor_attn.tuning_mode("autotune"):
        fn = torch.compile(lambda q, k, v, n: inductor_attn.attention(q, k, v, kv_seqlens=n), fullgraph=True)
        out, (code,) = run_and_get_code(fn, q, k, v, lens)
    assert "torch.ops.inductor_attn" not in code and "_decode_partial" in code
    # the kv_seqlens check is the partial kernel's own device assert: no kernel of Inductor's launches
    assert not re.search(r"def triton_(per|red|poi)_", code), code
    assert "empty_strided_cuda((4, 16, 1), " not in code, code  # inference: no lse buffer (traced_out_only)
    assert rel_err(out, _reference(q, k, v, kv_seqlens=lens)) < TOLERANCES[torch.bfloat16]


@pytest.mark.parametrize("name", ["sdpa", "triton", "fa4"])
def test_compiled_fwd_bwd_graphs_launch_the_chosen_kernels(name):
    q, k, v = _inputs(2, 8, 2, 256, 256, 64, requires_grad=True)
    with _only(name, q, k, v, causal=True), inductor_attn.tuning_mode("autotune"):
        fn = torch.compile(lambda q, k, v: inductor_attn.attention(q, k, v, causal=True), fullgraph=True)

        def step(q, k, v):
            fn(q, k, v).float().square().sum().backward()

        _, codes = run_and_get_code(step, q, k, v)
    assert len(codes) == 2 and not any("inductor_attn.attention" in c for c in codes)
    exact = [x.detach().double().requires_grad_() for x in (q, k, v)]
    with only_backends(REFERENCE):
        inductor_attn.attention(*exact, causal=True).square().sum().backward()
    for got, want in zip((q.grad, k.grad, v.grad), exact):
        assert rel_err(got, want.grad) < TOLERANCES[torch.bfloat16]


def _sdpa_with_cache_mask(q, k, v, lens):
    mask = (torch.arange(k.shape[2], device=q.device)[None, :] < lens[:, None])[:, None, None, :]
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


@pytest.mark.parametrize("route", ["api", "routed sdpa"])
def test_reduce_overhead_captures_our_calls_without_cudagraph_skips(route, fresh_compile):
    """Both ways to our decode kernel: ``inductor_attn.attention`` and a model's SDPA with a cache mask through
    the rewrite (``backend="inductor_attn"``)."""
    from torch._dynamo.utils import counters

    from inductor_attn.routing.enable import compile_backend

    q, k, v = _inputs(1, 16, 2, 1, 2048, 128)
    lens = torch.tensor([2000], device="cuda", dtype=torch.int32)
    counters.clear()
    if route == "api":
        fn = torch.compile(lambda q, k, v, n: inductor_attn.attention(q, k, v, kv_seqlens=n), mode="reduce-overhead",
                           fullgraph=True)
    else:
        fn = torch.compile(_sdpa_with_cache_mask, backend=compile_backend, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):
        out = fn(q, k, v, lens)
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    if route != "api":
        assert inductor_attn.routing_report() == {"sdpa: routed (kv_seqlens from a proven prefix mask)": 1}
    assert rel_err(out, _reference(q, k, v, kv_seqlens=lens)) < TOLERANCES[torch.bfloat16]


def test_fa4_fwd_bwd_under_reduce_overhead_and_plain_matches_the_reference_step_after_step(fresh_compile,
                                                                                          monkeypatch):
    """FA4's backward replay keeps its scratch allocation on the default stream only: cudagraph trees warm up on a
    stream of their own, allocating into the graph's pool, where a kept buffer would live on without being an
    output (cudagraph trees would fail or skip). Three steps on new inputs each, captured and plain, match the
    float64 reference's grads. (The tune's own host probes run plain launches on the default stream: the kept
    allocation may come from there, outside any graph's pool.)"""
    from torch._dynamo.utils import counters

    from inductor_attn.backends import replay

    monkeypatch.setattr(replay, "_KEPT", {})  # this test's own
    probe = _inputs(2, 8, 2, 256, 256, 64, requires_grad=True)
    for mode in ("reduce-overhead", "default"):
        torch._dynamo.reset()
        counters.clear()
        with _only("fa4", *probe, causal=True), inductor_attn.tuning_mode("autotune"):
            fn = torch.compile(lambda q, k, v: inductor_attn.attention(q, k, v, causal=True), mode=mode,
                               fullgraph=True)
            for seed in range(3):
                q, k, v = _inputs(2, 8, 2, 256, 256, 64, requires_grad=True, seed=seed + 1)
                fn(q, k, v).float().square().sum().backward()
                exact = [x.detach().double().requires_grad_() for x in (q, k, v)]
                with only_backends(REFERENCE):
                    inductor_attn.attention(*exact, causal=True).square().sum().backward()
                for name, got, want in zip("qkv", (q.grad, k.grad, v.grad), exact):
                    assert rel_err(got, want.grad) < TOLERANCES[torch.bfloat16], (mode, seed, name)
        assert not counters["inductor"]["cudagraph_skips"], (mode, dict(counters["inductor"]))
    assert q.device in replay._KEPT  # the plain steps' backward replays ran on the kept allocation
