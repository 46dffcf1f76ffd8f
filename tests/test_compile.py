"""torch.compile(fullgraph=True) of functions calling each op runs on the CPU and matches eager, forward
and backward. Each test compiles one function (a forward and a backward graph, ~10-20 s on a CPU)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

import inductor_attn

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def rand(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).requires_grad_()


def eager_and_compiled(fn, make_inputs):
    """Run ``fn`` eagerly and compiled (fullgraph) on the same fresh inputs: outputs and input gradients of
    <outputs, random cotangents> from each. Non-finite lse entries get a zero cotangent."""
    compiled = torch.compile(fn, fullgraph=True)
    results = []
    for run in (fn, compiled):
        inputs = make_inputs()
        outs = run(*inputs)
        gen = torch.Generator().manual_seed(99)
        cotangents = [torch.randn(o.shape, generator=gen).masked_fill(~torch.isfinite(o), 0) for o in outs]
        leaves = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
        grads = torch.autograd.grad(outs, leaves, cotangents)
        results.append((outs, grads))
    return results


def assert_same(eager, compiled):
    for e, c in zip(eager[0] + eager[1], compiled[0] + compiled[1]):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-5)


def test_compiled_dense_attention_matches_eager_forward_and_backward():
    def fn(q, k, v, kv_seqlens):
        out, lse = inductor_attn.attention(q, k, v, causal=True, window=(6, -1), kv_seqlens=kv_seqlens,
                                           return_lse=True)
        return torch.nn.functional.gelu(out), lse

    def make_inputs():
        gen = torch.Generator().manual_seed(0)
        return rand(gen, 2, 4, 20, 16), rand(gen, 2, 2, 30, 16), rand(gen, 2, 2, 30, 16), \
            torch.tensor([30, 0], dtype=torch.int32)

    inductor_attn.reset_stats()
    eager, compiled = eager_and_compiled(fn, make_inputs)
    assert_same(eager, compiled)
    assert torch.isneginf(compiled[0][1][1]).all()  # kv_seqlens 0: fully masked rows stay -inf when compiled
    # the compiled graph calls the op (once eager, once compiled), it does not inline or decompose it
    assert sum(n for key, n in inductor_attn.stats().items() if key.startswith("attention/forward")) == 2


@pytest.mark.parametrize("how", ["checkpointed", "chained"])
def test_an_op_reading_another_ops_output_in_one_graph_compiles_and_matches_eager(how):
    """A backward reading the out and lse of a forward recomputed in its graph (activation checkpointing), or one
    call's output fed to the next: each op's arguments must be read after the ops before it were replaced (the
    lowering kept them from before, and Inductor failed on the erased nodes)."""
    from torch.utils.checkpoint import checkpoint

    def block(x):
        return inductor_attn.attention(x * 2, x, x, causal=True)

    def fn(x):
        if how == "checkpointed":
            return (checkpoint(block, x, use_reentrant=False),)
        return (inductor_attn.attention(block(x), x, x),)

    assert_same(*eager_and_compiled(fn, lambda: [rand(torch.Generator().manual_seed(0), 1, 2, 8, 16)]))


def test_compiled_varlen_attention_matches_eager_forward_and_backward():
    cu_q, cu_k = torch.tensor([0, 5, 12], dtype=torch.int32), torch.tensor([0, 9, 20], dtype=torch.int32)

    def fn(q, k, v):
        out, lse = inductor_attn.varlen_attention(q, k, v, cu_q, cu_k, 7, 11, causal=True, window=4,
                                                  return_lse=True)
        return out * 2, lse

    def make_inputs():
        gen = torch.Generator().manual_seed(1)
        return rand(gen, 12, 4, 16), rand(gen, 20, 1, 16), rand(gen, 20, 1, 16)

    assert_same(*eager_and_compiled(fn, make_inputs))


def test_compiled_block_sparse_attention_matches_eager_forward_and_backward():
    docs = torch.tensor([0] * 30 + [1] * 45 + [2] * 25)
    block_mask = create_block_mask(lambda b, h, q, k: (docs[q] == docs[k]) & (k <= q), None, None, 100, 100,
                                   device="cpu", BLOCK_SIZE=64)
    sparse = inductor_attn.BlockSparseMask.from_block_mask(block_mask)  # outside: conversion runs the mask_mod

    def fn(q, k, v, mask):
        out, lse = inductor_attn.attention(q, k, v, block_mask=mask, return_lse=True)
        return out.sum(-1), lse

    def make_inputs():
        gen = torch.Generator().manual_seed(2)
        return rand(gen, 2, 2, 100, 16), rand(gen, 2, 2, 100, 16), rand(gen, 2, 2, 100, 16), sparse

    assert_same(*eager_and_compiled(fn, make_inputs))


def test_one_compiled_function_takes_block_masks_of_other_block_sizes_after_a_recompile():
    """The third mask recompiles with Dynamo's automatic dynamic shapes, which makes the block sizes SymInts
    (issue 17: a fullgraph compile failed only in a process that had compiled other masks)."""
    compiled = torch.compile(lambda q, k, v, m: inductor_attn.attention(q, k, v, block_mask=m), fullgraph=True)
    for length, block in ((256, 128), (192, 64), (320, 64)):
        bm = create_block_mask(lambda b, h, q, kv: kv <= q, 1, None, length, length, device="cpu", BLOCK_SIZE=block)
        gen = torch.Generator().manual_seed(length)
        q, k, v = (torch.randn(1, 2, length, 16, generator=gen) for _ in range(3))
        out = compiled(q, k, v, inductor_attn.BlockSparseMask.from_block_mask(bm))
        torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
                                   rtol=1e-5, atol=1e-5)


def test_a_window_size_that_changes_between_calls_compiles_and_matches_eager():
    """After a second window size torch.compile makes the size symbolic; the call then decides at run time."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 32, 16, generator=gen) for _ in range(3))
    per_int = torch.compile(lambda q, k, v, w: inductor_attn.attention(q, k, v, window=w), fullgraph=True)
    per_pair = torch.compile(lambda q, k, v, w: inductor_attn.attention(q, k, v, window=(w, 0)), fullgraph=True)
    for w in (2, 4, 6):
        expected = inductor_attn.attention(q, k, v, window=w)
        torch.testing.assert_close(per_int(q, k, v, w), expected)
        torch.testing.assert_close(per_pair(q, k, v, w), inductor_attn.attention(q, k, v, window=(w, 0)))


@pytest.mark.parametrize("mode", ["autotune", "heuristic"])
def test_expanded_inputs_compile_and_match_eager(mode):
    """K/V and a key mask that ``expand`` broadcast (stride 0): the compile's made-up inputs keep the layout."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 16, 16, generator=gen)
    k, v = (torch.randn(1, 2, 32, 16, generator=gen).expand(2, 2, 32, 16) for _ in range(2))
    keys_open = torch.rand(32, generator=gen) < 0.8
    keys_open[0] = True
    mask = keys_open.unsqueeze(0).expand(2, 32)
    with inductor_attn.tuning_mode(mode):
        compiled = torch.compile(lambda q, k, v, m: inductor_attn.attention(q, k, v, key_mask=m), fullgraph=True)
        torch.testing.assert_close(compiled(q, k, v, mask), inductor_attn.attention(q, k, v, key_mask=mask))


def test_a_compiled_call_is_guarded_in_cpp_only_as_compiled_sdpa_is():
    """Dynamo checks a compiled frame's guards before every call. Reaching one object through two paths (a
    module imported by name and through a package, or ``torch`` through two of our modules) makes it add an
    aliasing guard that runs as Python on every call; compiled SDPA has none, and neither may
    ``inductor_attn.attention``, with or without ``kv_seqlens``. Reads Dynamo's private cache entries: this
    fails loudly if they move."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 64, 32, generator=gen) for h in (4, 2, 2))
    lens = torch.tensor([40], dtype=torch.int32)

    def ours(q, k, v):
        return inductor_attn.attention(q, k, v, causal=True)

    def ours_decode(q, k, v):
        return inductor_attn.attention(q[:, :, :1], k, v, kv_seqlens=lens, scale=0.125)

    def sdpa(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    table = torch.arange(4, dtype=torch.int32)[None]  # k and v as one sequence's pool of four 16-key pages
    cu_seqlens_q = torch.tensor([0, 64], dtype=torch.int32)

    def ours_paged(q, k, v):  # a chunk of 64 queries, a scale and a softcap
        return inductor_attn.paged_attention(q[0].transpose(0, 1), k[0].unflatten(1, (4, 16)).permute(1, 2, 0, 3),
                                             v[0].unflatten(1, (4, 16)).permute(1, 2, 0, 3), table, lens,
                                             cu_seqlens_q=cu_seqlens_q, max_seqlen_q=64, scale=0.125, softcap=30.0)

    cu_seqlens = torch.tensor([0, 24, 64], dtype=torch.int32)

    def ours_varlen(q, k, v):  # two packed sequences, a window given as a pair
        return inductor_attn.varlen_attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
                                              cu_seqlens, cu_seqlens, 40, 40, causal=True, scale=0.125,
                                              window=(16, 0))

    python_guards, guarded = {}, {}
    for fn in (ours, ours_decode, ours_paged, ours_varlen, sdpa):
        torch.compile(fn, backend="eager", fullgraph=True)(q, k, v)
        (entry,) = _debug_get_cache_entry_list(fn.__code__)
        python_guards[fn.__name__] = entry.guard_manager.root.get_epilogue_lambda_guards()
        guarded[fn.__name__] = entry.guard_manager.code_parts
    assert python_guards == {"ours": [], "ours_decode": [], "ours_paged": [], "ours_varlen": [], "sdpa": []}
    # Every function and global Dynamo reads is guarded on every call: the op's fake impl checks the arguments
    # while tracing, so a traced dense call does not pass through the API's copy of those checks; a float scale
    # skips check_scale and the default window calls no helper (a pair of ints calls _window, not check_window); the
    # op is reached as its overload (one guard, where the CustomOpDef costs four). The paged and varlen calls' value
    # checks are device asserts made from api.py's own names and checks.assert_cu_seqlens (assert_on_device), which
    # reaches no torch of its own.
    ours_checks = ("check_attention", "check_kv_seqlens", "check_index_tensor", "assert_on_device", "make_call",
                   "check_scale", "_window", "check_window", "attention_op", "_zero_size", "check_paged", "refuse_grad",
                   "check_bool", "PAGE_LAYOUTS", "check_softcap", "check_cu_seqlens", "check_varlen",
                   "varlen_attention_op")
    called = {"ours_paged": ("assert_on_device",), "ours_varlen": ("assert_on_device", "_window")}
    for name in ("ours", "ours_decode", "ours_paged", "ours_varlen"):
        refused = [c for c in ours_checks if c not in called.get(name, ())]
        assert not [part for part in guarded[name] if any(check in part for check in refused)], name
