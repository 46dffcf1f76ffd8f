"""The SDPA rewrite (routing/rewrite.py, mask_proof.py) and its installation (routing/enable.py).

Most tests capture a Dynamo graph with a recording backend, run the rewrite on it and execute the graph
eagerly (no Inductor, ~1 s each): the rewritten graph must compute what SDPA computed. A few compile
with Inductor end to end (~10-20 s each on a CPU)."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
import torch
import torch._functorch.config
import torch._inductor.config
import torch.nn.functional as F

import inductor_attn
from inductor_attn import _compat
from inductor_attn.routing.rewrite import ROUTE_DEVICES_ENV, RewritePass, rewrite_graph

ATTENTION = torch.ops.inductor_attn.attention.default
TOL = dict(rtol=1e-5, atol=1e-5)  # float32, reference kernel vs SDPA math


pytestmark = pytest.mark.usefixtures("fresh_compile", "reference_only")


def capture(fn, *args) -> torch.fx.GraphModule:
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(fn, backend=record, fullgraph=True)(*args)
    assert len(graphs) == 1
    return graphs[0]


def run_graph(gm, fn, *args):
    """Call a captured graph with ``fn``'s arguments (Dynamo orders its inputs by first use)."""
    by_name = {f"L_{name}_": arg for name, arg in zip(inspect.signature(fn).parameters, args)}
    return gm(*(by_name[n.target] for n in gm.graph.nodes if n.op == "placeholder"))[0]


def rewrite_and_run(fn, *args):
    """(what fn returns eagerly, what the rewritten graph returns, the rewritten graph)."""
    gm = capture(fn, *args)
    rewrite_graph(gm.graph)
    gm.recompile()
    return fn(*args), run_graph(gm, fn, *args), gm


def routed_calls(gm) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.target is ATTENTION]


def only_outcome() -> str:
    report = inductor_attn.routing_report()
    assert len(report) == 1 and sum(report.values()) == 1, report
    return next(iter(report))


def qkv(b=2, hq=4, hk=2, lq=8, lk=8, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, hq, lq, d, generator=g), torch.randn(b, hk, lk, d, generator=g),
            torch.randn(b, hk, lk, d, generator=g))


# ------------------------------------------------------------------------------------------ routed
def test_causal_gqa_without_mask_is_routed_as_causal_and_matches_sdpa():
    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=0.3)

    eager, rewritten, gm = rewrite_and_run(fn, *qkv())
    torch.testing.assert_close(rewritten, eager, **TOL)
    (call,) = routed_calls(gm)
    assert call.args[3:7] == (0.3, True, -1, -1) and call.args[7] is None
    assert only_outcome() == "sdpa: routed (causal)"


@pytest.mark.parametrize("layout", ["expanded q", "strided last dim", "value head dim", "one head"])
def test_a_routed_call_returns_sdpas_output_strides_so_a_view_after_it_compiles(layout):
    """Our op's output follows q's stride order; where SDPA's does not (its math kernel returns a contiguous
    output for these on the CPU), code traced against SDPA's (a ``view``) must still compile and run."""
    b, h, n, d = 2, 1 if layout == "one head" else 4, 16, 32
    dv = 64 if layout == "value head dim" else d  # one head: strides of a size-1 dim differ, which no view reads
    g = torch.Generator().manual_seed(0)
    # learned queries shared by the batch; q stored (B, H, D, L); q (B, L, H, D) as projections give it
    shape = {"expanded q": (1, h, n, d), "strided last dim": (b, h, d, n)}.get(layout, (b, n, h, d))
    x = torch.randn(shape, generator=g)
    k, v = torch.randn(b, h, n, d, generator=g), torch.randn(b, n, h, dv, generator=g)

    def fn(x, k, v):
        q = {"expanded q": lambda: x.expand(b, -1, -1, -1),
             "strided last dim": lambda: x.transpose(2, 3)}.get(layout, lambda: x.transpose(1, 2))()
        out = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=True)
        return out.view(b * h, n, dv)

    eager = fn(x, k, v)
    inductor_attn.enable()
    try:
        compiled = torch.compile(fn, fullgraph=True)(x, k, v)
    finally:
        inductor_attn.disable()
    torch.testing.assert_close(compiled, eager, **TOL)
    assert only_outcome() == "sdpa: routed (causal)"


def test_decode_mask_from_a_runtime_cache_offset_becomes_kv_seqlens():
    # transformers masking_utils.sdpa_mask under torch.compile with a static cache, one query token
    def fn(q, k, v, offset):
        q_idx = (torch.arange(1) + offset)[None, None, :, None]
        kv_idx = torch.arange(k.shape[2])[None, None, None, :]
        mask = (kv_idx <= q_idx).expand(q.shape[0], -1, 1, k.shape[2])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    q, k, v = qkv(lq=1, lk=12)
    gm = capture(fn, q, k, v, torch.tensor([3]))
    rewrite_graph(gm.graph)
    gm.recompile()
    assert only_outcome() == "sdpa: routed (kv_seqlens from a proven prefix mask)"
    (call,) = routed_calls(gm)
    assert call.args[4] is False and call.args[7] is not None
    for offset in (0, 5, 11, 40):  # 40: past the end of the keys, every key visible
        off = torch.tensor([offset])
        torch.testing.assert_close(run_graph(gm, fn, q, k, v, off), fn(q, k, v, off), **TOL)


def test_per_batch_length_mask_becomes_kv_seqlens():
    def fn(q, k, v, lengths):
        mask = torch.arange(k.shape[2])[None, None, None, :] < lengths[:, None, None, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    q, k, v = qkv(hk=4, lq=5, lk=9)
    eager, rewritten, _ = rewrite_and_run(fn, q, k, v, torch.tensor([9, 4]))
    torch.testing.assert_close(rewritten, eager, **TOL)
    assert only_outcome() == "sdpa: routed (kv_seqlens from a proven prefix mask)"


def test_layers_that_take_one_mask_share_its_kv_seqlens():
    # HF's layers each slice the model's one mask to their keys: the same ops on the same inputs
    def fn(q, k, v, lengths):
        mask = torch.arange(k.shape[2])[None, None, None, :] < lengths[:, None, None, None]
        out = q
        for _ in range(3):
            out = F.scaled_dot_product_attention(out, k, v, attn_mask=mask[:, :, :, : k.shape[2]])
        return out

    q, k, v = qkv(hk=4, lq=5, lk=9)
    eager, rewritten, gm = rewrite_and_run(fn, q, k, v, torch.tensor([9, 4]))
    torch.testing.assert_close(rewritten, eager, **TOL)
    calls = routed_calls(gm)
    assert len(calls) == 3 and len({c.args[7] for c in calls}) == 1  # one kv_seqlens node for the three


def test_a_key_mask_is_not_shared_across_an_in_place_write():
    def fn(q, k, v, mask, buf):
        first = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        buf.add_(1)  # any in-place write between the calls: the second reads its key mask afresh
        return F.scaled_dot_product_attention(first, k, v, attn_mask=mask)

    q, k, v = qkv(hk=4, lq=1, lk=9)
    mask = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    mask[1, ..., 6:] = False
    gm = capture(fn, q, k, v, mask, torch.zeros(3))
    rewrite_graph(gm.graph)
    calls = routed_calls(gm)
    assert len(calls) == 2 and calls[0].args[8] is not calls[1].args[8]


def test_masks_of_one_structure_are_not_shared_across_a_write_into_what_they_are_built_from():
    # the same ops on the same inputs, but an input written in place between the two builds: two values
    def fn(q, k, v, n):
        first_mask = torch.arange(k.shape[2])[None, :] < n
        n.add_(4)
        second_mask = torch.arange(k.shape[2])[None, :] < n
        return (F.scaled_dot_product_attention(q, k, v, attn_mask=first_mask),
                F.scaled_dot_product_attention(q, k, v, attn_mask=second_mask))

    q, k, v = qkv(hk=4, lq=5, lk=12)
    gm = capture(fn, q, k, v, torch.tensor(5))
    rewrite_graph(gm.graph)
    gm.recompile()
    by_name = {"L_q_": q, "L_k_": k, "L_v_": v, "L_n_": torch.tensor(5)}
    got = gm(*(by_name[n.target] for n in gm.graph.nodes if n.op == "placeholder"))
    want = fn(q, k, v, torch.tensor(5))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)


def graph_outputs(gm, fn, *args):
    by_name = {f"L_{name}_": arg for name, arg in zip(inspect.signature(fn).parameters, args)}
    return gm(*(by_name[n.target] for n in gm.graph.nodes if n.op == "placeholder"))


def key_masks_one_written_in_place(q, k, v, am):
    first = am.ne(0)[:, None, None, :]
    first[..., 0] = False  # this layer hides key 0
    o1 = F.scaled_dot_product_attention(q, k, v, attn_mask=first)
    return o1, F.scaled_dot_product_attention(q, k, v, attn_mask=am.ne(0)[:, None, None, :])


def prefix_masks_one_written_in_place(q, k, v, n):
    n1 = n * 1
    n1.add_(4)
    o1 = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.arange(k.shape[2])[None, :] < n1)
    return o1, F.scaled_dot_product_attention(q, k, v, attn_mask=torch.arange(k.shape[2])[None, :] < n * 1)


def prefix_mask_punched_by_an_explicit_dunder(q, k, v, n, extra):
    mask = torch.arange(k.shape[2])[None, :] < n
    mask.__iand__(extra)  # written out, Dynamo records a method call, not operator.iand
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask), q


@pytest.mark.parametrize("fn, args", [
    (key_masks_one_written_in_place, (*qkv(hk=4, lq=1, lk=8), torch.ones(2, 8, dtype=torch.long))),
    (prefix_masks_one_written_in_place, (*qkv(hk=4, lq=5, lk=12), torch.tensor(5))),
    (prefix_mask_punched_by_an_explicit_dunder, (*qkv(hk=4, lq=5, lk=12), torch.tensor(9),
                                                 torch.tensor([True, False] * 6))),
])
def test_a_mask_written_in_place_after_it_is_built_is_neither_shared_nor_proven(fn, args):
    """A mask written into after it is built (through a fresh op's result, or by an in-place dunder written
    out) is not the value its ops describe: a second mask of the same ops is not that value, and no proof holds."""
    gm = capture(fn, *args)
    rewrite_graph(gm.graph)
    gm.recompile()
    for got, want in zip(graph_outputs(gm, fn, *args), fn(*args)):
        torch.testing.assert_close(got, want, **TOL)


def test_a_mask_the_analysis_cannot_read_leaves_the_call_alone_not_the_compile_failed():
    def by_keyword(q, k, v):  # torch.tril(input=...): the analysis read args[0]
        mask = torch.tril(input=torch.ones(q.shape[2], k.shape[2], dtype=torch.bool))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def deep(q, k, v, x):  # a key mask at the end of a chain deeper than Python's recursion limit
        for _ in range(1200):
            x = x + 1
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(x > 0)[:, None, None, :])

    assert_left_alone(by_keyword, *qkv(hk=4), reason="the analysis failed: IndexError")
    inductor_attn.reset_routing_report()
    eager, rewritten, gm = rewrite_and_run(deep, *qkv(hk=4, lq=1), torch.randn(2, 8))
    torch.testing.assert_close(rewritten, eager, **TOL)


@pytest.mark.parametrize("where", ["region", "around"])
def test_sdpa_under_autocast_is_routed_in_the_autocast_dtype(where):
    """SDPA is an autocast op: its float32 inputs run and return bfloat16; our op is not one, so the rewrite
    casts them, whether the region is in the graph or autocast is on around the compiled call."""
    import contextlib

    def fn(q, k, v):
        with torch.autocast("cpu", torch.bfloat16) if where == "region" else contextlib.nullcontext():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    q, k, v = qkv(hk=4)
    with torch.autocast("cpu", torch.bfloat16) if where == "around" else contextlib.nullcontext():
        gm = capture(fn, q, k, v)
        rewrite_graph(gm.graph)
        gm.recompile()
        want, got = fn(q, k, v), run_graph(gm, fn, q, k, v)
    assert routed_calls(gm) and got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_tril_mask_on_square_scores_is_routed_as_plain_causal():
    def fn(q, k, v):
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    eager, rewritten, gm = rewrite_and_run(fn, *qkv())
    torch.testing.assert_close(rewritten, eager, **TOL)
    assert only_outcome() == "sdpa: routed (causal (proven mask))"
    assert routed_calls(gm)[0].args[7] is None


def test_upper_left_causal_mask_on_a_longer_cache_uses_a_constant_kv_seqlens():
    # key j visible iff j <= i: a prefill of 6 tokens into a cache of 10 slots
    def fn(q, k, v):
        mask = torch.arange(k.shape[2])[None, :] <= torch.arange(q.shape[2])[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    eager, rewritten, _ = rewrite_and_run(fn, *qkv(lq=6, lk=10))
    torch.testing.assert_close(rewritten, eager, **TOL)
    assert only_outcome() == "sdpa: routed (causal with constant kv_seqlens (proven mask))"


KEY_MASKS = {  # (B, 1, 1, Lk) bool masks as generate() passes them at decode: any values
    "left_padding_and_unfilled_cache": torch.tensor([[0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0],
                                                     [1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0]], dtype=torch.bool),
    "holes_and_an_empty_row": torch.tensor([[1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 1],
                                            [0] * 12], dtype=torch.bool),
    "all_true": torch.ones(2, 12, dtype=torch.bool),
}


@pytest.mark.parametrize("mask", KEY_MASKS.values(), ids=KEY_MASKS.keys())
def test_decode_mask_given_as_a_graph_input_becomes_a_key_mask(mask):
    def fn(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    q, k, v = qkv(lq=1, lk=12)
    gm = capture(fn, q, k, v, mask[:, None, None])
    rewrite_graph(gm.graph)
    gm.recompile()
    assert only_outcome() == "sdpa: routed (key_mask from an unproven mask the same for every query)"
    (call,) = routed_calls(gm)
    assert call.args[7] is not None and call.args[8] is not None  # kv_seqlens up to the last True key
    expected = fn(q, k, v, mask[:, None, None])
    got = run_graph(gm, fn, q, k, v, mask[:, None, None])
    empty = ~mask.any(-1)  # our convention: zeros where SDPA's math kernel gives NaN
    torch.testing.assert_close(got[~empty], expected[~empty], **TOL)
    assert (got[empty] == 0).all()


@pytest.mark.parametrize("draw", [lambda p: p.bernoulli().bool(), lambda p: F.dropout(p, 0.5, True) > 0,
                                  lambda p: torch.rand_like(p) < p],
                         ids=["bernoulli_method", "dropout_function", "rand_like"])
def test_two_masks_drawn_at_random_the_same_way_are_two_masks(draw):
    # one structure, but each draw is another value: fx's is_impure misses methods and F.dropout
    def fn(q, k, v, p):
        first, second = draw(p), draw(p)
        return (F.scaled_dot_product_attention(q, k, v, attn_mask=first),
                F.scaled_dot_product_attention(q, k, v, attn_mask=second))

    gm = capture(fn, *qkv(hk=4, lq=1, lk=24), torch.full((2, 1, 1, 24), 0.5))
    rewrite_graph(gm.graph)
    calls = routed_calls(gm)
    assert len(calls) == 2 and calls[0].args[8] is not calls[1].args[8]


def test_padding_mask_the_same_for_every_query_is_a_key_mask_up_to_16_queries():
    def fn(q, k, v, padding):  # a padding mask, (B, 1, 1, Lk), over a few queries (speculative decoding)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=padding[:, None, None, :], enable_gqa=True)

    padding = torch.tensor([[1] * 6 + [0] * 2, [1] * 8], dtype=torch.bool)
    eager, rewritten, _ = rewrite_and_run(fn, *qkv(lq=5), padding)
    torch.testing.assert_close(rewritten, eager, **TOL)
    assert only_outcome() == "sdpa: routed (key_mask from an unproven mask the same for every query)"
    torch._dynamo.reset()
    inductor_attn.reset_routing_report()
    assert_left_alone(fn, *qkv(lq=17, lk=8), padding, reason="only the decode kernel (Lq <= 16) would gain")


def test_repeated_kv_heads_are_passed_unrepeated():
    def repeat_kv(x, n):  # transformers' repeat_kv
        b, h, s, d = x.shape
        return x[:, :, None, :, :].expand(b, h, n, s, d).reshape(b, h * n, s, d)

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), is_causal=True)

    q, k, v = qkv()
    eager, rewritten, gm = rewrite_and_run(fn, q, k, v)
    torch.testing.assert_close(rewritten, eager, **TOL)
    call = routed_calls(gm)[0]
    assert call.args[1].op == "placeholder" and call.args[2].op == "placeholder"


# ------------------------------------------------------------------------------------------ left alone
def assert_left_alone(fn, *args, reason: str):
    eager, rewritten, gm = rewrite_and_run(fn, *args)
    assert not routed_calls(gm)
    torch.testing.assert_close(rewritten, eager, rtol=0, atol=0)
    outcome = only_outcome()
    assert outcome.startswith("sdpa: left alone") and reason in outcome, outcome


@pytest.mark.parametrize("where", ["inside", "around"])
def test_sdpa_restricted_by_sdpa_kernel_stays_sdpa(where):
    """A user who limits SDPA's backends (MATH to debug, or for reproducibility) chose its kernel: routing it to
    ours would drop that choice. The calls after the block are routed again."""
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    def fn(q, k, v):
        with sdpa_kernel([SDPBackend.MATH]) if where == "inside" else contextlib.nullcontext():
            first = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(first, k, v, is_causal=True)

    with sdpa_kernel([SDPBackend.MATH]) if where == "around" else contextlib.nullcontext():
        eager, rewritten, gm = rewrite_and_run(fn, *qkv(hk=4))
    torch.testing.assert_close(rewritten, eager, **TOL)
    report = inductor_attn.routing_report()
    assert report.get("sdpa: left alone (sdpa_kernel allows SDPA's MATH only: the user chose its kernel)") == \
        (1 if where == "inside" else 2)
    assert len(routed_calls(gm)) == (1 if where == "inside" else 0)


def test_the_sdpa_backends_enabled_while_compiling_are_part_of_the_pass_uuid():
    """A graph routed with every backend enabled must not be replayed from Inductor's cache in a process that
    limits them, nor the other way round."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    default = RewritePass().uuid()
    with sdpa_kernel([SDPBackend.MATH]):
        assert RewritePass().uuid() != default
    assert RewritePass().uuid() == default


def test_sdpa_under_a_torch_func_transform_stays_sdpa():
    def fn(q, k, v):
        return torch.func.vmap(lambda q: F.scaled_dot_product_attention(q, k, v, is_causal=True))(q)

    q, k, v = qkv(hk=4)
    assert_left_alone(fn, q[None].expand(3, -1, -1, -1, -1) + 0, k, v,
                      reason="under a torch.func transform (vmap, grad): our ops have no batching rule")


def test_sdpa_on_a_tensor_subclass_stays_sdpa():
    """DTensor (tensor parallel, context parallel) has sharding rules for SDPA and none for our ops: routing it
    failed the compile. TwoTensor stands for it here (no process group needed)."""
    from torch.testing._internal.two_tensor import TwoTensor

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    q, k, v = (TwoTensor(x, x.clone()) for x in qkv(hk=4))
    gm = capture(fn, q, k, v)
    rewrite_graph(gm.graph)
    assert not routed_calls(gm) and "q/k/v include a TwoTensor: our ops have no sharding rule" in only_outcome()


@pytest.mark.parametrize("listed", ["", "cuda", "cuda, xpu"])
def test_calls_on_a_device_not_routed_stay_sdpa(monkeypatch, listed):
    """By default only CUDA calls are routed: on a CPU the reference would replace SDPA's own kernels."""
    monkeypatch.setenv(ROUTE_DEVICES_ENV, listed)

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    routed = "cuda, xpu" if "xpu" in listed else "cuda"
    assert_left_alone(fn, *qkv(hk=4), reason=f"on cpu, where only the reference kernel runs (routed: {routed};")


def test_mask_given_as_a_graph_input_with_queries_varying_stays_sdpa():
    def fn(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    assert_left_alone(fn, *qkv(lq=8), torch.ones(2, 1, 8, 8, dtype=torch.bool),
                      reason="graph input: its values exist only at run time; not a key mask either")


def test_key_mask_route_is_not_taken_when_gradients_are_needed():
    def fn(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    q, k, v = qkv(lq=1)
    v.requires_grad_()  # a gradient for v alone is enough to stay SDPA
    gm = capture(fn, q, k, v, torch.ones(2, 1, 1, 8, dtype=torch.bool))
    rewrite_graph(gm.graph)
    assert not routed_calls(gm) and "backward would run on the reference kernel only" in only_outcome()


def test_causal_mask_combined_with_a_padding_input_stays_sdpa():
    def fn(q, k, v, padding):
        causal = torch.arange(8)[None, :] <= torch.arange(8)[:, None]
        mask = causal[None, None] & padding[:, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    assert_left_alone(fn, *qkv(), torch.ones(2, 8, dtype=torch.bool), reason="combined (&)")


def test_sliding_window_mask_stays_sdpa():
    def fn(q, k, v):
        i, j = torch.arange(8)[:, None], torch.arange(8)[None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(j <= i) & (j > i - 3), enable_gqa=True)

    assert_left_alone(fn, *qkv(), reason="not an upper bound on the key index")


def test_additive_float_mask_stays_sdpa():
    def fn(q, k, v):
        bias = torch.zeros(8, 8).masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)

    assert_left_alone(fn, *qkv(), reason="additive")


def test_causal_with_fewer_queries_than_keys_stays_sdpa():
    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    assert_left_alone(fn, *qkv(lq=4, lk=8), reason="upper-left")


def test_mask_built_from_a_tensor_mutated_in_place_stays_sdpa():
    def fn(q, k, v):
        kv_idx = torch.arange(8)
        mask = kv_idx[None, :] <= torch.arange(8)[:, None]
        kv_idx.add_(3)  # the mask already holds the old values, but the proof cannot see that
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True) + kv_idx.sum()

    assert_left_alone(fn, *qkv(), reason="mutated in place")


def test_a_bound_whose_run_time_part_varies_over_keys_is_no_prefix():
    # key j visible iff j <= thr[j]: whatever set of keys thr makes, not the first n of them
    def fn(q, k, v, thr):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(torch.arange(k.shape[2]) <= thr)[None, :])

    q, k, v = qkv(hk=4, lq=5, lk=16)
    thr = torch.tensor([3, 0, 9, 2, 15, 1, 7, 0, 12, 4, 0, 2, 15, 3, 0, 1])
    eager, rewritten, _ = rewrite_and_run(fn, q, k, v, thr)
    torch.testing.assert_close(rewritten, eager, **TOL)
    assert "prefix" not in only_outcome()


def test_zero_size_calls_stay_sdpa():
    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v)

    assert_left_alone(fn, *qkv(hk=4, lk=0), reason="zero-size")


def test_a_mask_anded_with_a_size_comparison_compiles_with_dynamic_shapes(monkeypatch):
    monkeypatch.setenv(ROUTE_DEVICES_ENV, "cuda,cpu")

    def fn(q, k, v, lengths):
        mask = (torch.arange(k.shape[2])[None, :] < lengths[:, None]) & (k.shape[2] > 4)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])

    q, k, v = qkv(hk=4, lq=1, lk=16)
    lengths = torch.tensor([16, 9])
    got = torch.compile(fn, backend="inductor_attn", dynamic=True)(q, k, v, lengths)
    torch.testing.assert_close(got, fn(q, k, v, lengths), **TOL)


def test_dropout_stays_sdpa():
    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, enable_gqa=True)

    gm = capture(fn, *qkv())
    rewrite_graph(gm.graph)
    assert not routed_calls(gm) and "dropout_p" in only_outcome()


# ------------------------------------------------------------------------------------------ installing
class UserPass(_compat.custom_graph_pass_base()):
    def __init__(self, tag):
        self.tag, self.calls = tag, 0

    def __call__(self, graph):
        self.calls += 1

    def uuid(self):
        return self.tag


def test_import_changes_no_inductor_config():
    code = ("import torch._inductor.config as c; before = c.get_config_copy(); import inductor_attn; "
            "after = c.get_config_copy(); assert before == after, [k for k in after if after[k] != before[k]]")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_enable_chains_the_users_pass_and_disable_restores_exactly_it():
    # config.patch, not monkeypatch.setattr: pytest >= 9.2's undo deletes attributes that torch's config
    # module keeps outside its __dict__, so the setting would vanish for every later test
    config = _compat.inductor_config()
    user = UserPass("user-v1")
    with config.patch(pre_grad_custom_pass=user):
        inductor_attn.enable()
        inductor_attn.enable()  # idempotent: one wrapper
        installed = config.pre_grad_custom_pass
        assert isinstance(installed, RewritePass) and installed.chained is user
        graph = torch.fx.Graph()
        graph.output(None)
        installed(graph)
        assert user.calls == 1
        first = installed.uuid()
        user.tag = "user-v2"
        assert installed.uuid() != first  # a change of the user's pass changes the FX-graph-cache key
        inductor_attn.disable()
        assert config.pre_grad_custom_pass is user


def test_enabled_context_restores_and_keeps_an_enclosing_enable():
    config = _compat.inductor_config()
    with config.patch(pre_grad_custom_pass=None):
        with inductor_attn.enabled():
            assert inductor_attn.is_enabled()
        assert config.pre_grad_custom_pass is None
        inductor_attn.enable()
        with inductor_attn.enabled():
            pass
        assert inductor_attn.is_enabled()
        inductor_attn.disable()
        assert config.pre_grad_custom_pass is None


def test_private_apis_the_rewrite_uses_are_where_compat_looks():
    assert _compat.statically_known_true(True) and not _compat.statically_known_true(False)
    assert _compat.size_hint(7) == 7
    assert _compat.inductor_compile_patches("max-autotune-no-cudagraphs", {"fx_graph_cache": False})["max_autotune"]
    assert callable(_compat.compile_fx())
    assert hasattr(_compat.inductor_config(), "pre_grad_custom_pass")
    assert callable(torch.ops.higher_order.flex_attention)


def test_the_routed_devices_change_the_pass_uuid(monkeypatch):
    with_cpu = RewritePass().uuid()  # the tests route the CPU too (conftest.py)
    monkeypatch.setenv(ROUTE_DEVICES_ENV, "cuda")
    assert RewritePass().uuid() != with_cpu  # a graph cached with CPU calls routed is not reused without


def test_chained_pass_without_uuid_disables_fx_graph_caching():
    assert RewritePass(chained=lambda graph: None).uuid() is None
    assert RewritePass(chained=[UserPass("a"), UserPass("b")]).uuid() is not None


# ------------------------------------------------------------------------------------------ end to end
def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).requires_grad_()


def forward_backward(fn, *inputs):
    out = fn(*inputs)
    grads = torch.autograd.grad(out.square().sum(), inputs)
    return out, grads


@pytest.mark.slow
def test_backend_name_routes_forward_and_backward_with_fullgraph():
    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).relu()

    inputs = [rand(2, 4, 16, 16, seed=0), rand(2, 2, 16, 16, seed=1), rand(2, 2, 16, 16, seed=2)]
    compiled = torch.compile(fn, backend="inductor_attn", fullgraph=True)
    out, grads = forward_backward(compiled, *inputs)
    ref_out, ref_grads = forward_backward(fn, *inputs)
    torch.testing.assert_close(out, ref_out, **TOL)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, **TOL)
    stats = inductor_attn.stats()
    assert any(key.startswith("attention/forward") for key in stats), stats
    assert any(key.startswith("attention/backward") for key in stats), stats
    assert not inductor_attn.is_enabled()  # the backend patched the config for its compilation only


@pytest.mark.slow
def test_dynamic_sequence_lengths_compile_once():
    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True) * 2

    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled = torch.compile(fn, backend="inductor_attn", fullgraph=True, dynamic=True)
    for length in (20, 28, 44):  # none equal to head_dim 16: duck sizing would tie them
        q, k, v = (t.detach() for t in qkv(lq=length, lk=length))
        torch.testing.assert_close(compiled(q, k, v), fn(q, k, v), **TOL)
    assert counters["stats"]["unique_graphs"] == 1
    assert inductor_attn.routing_report() == {"sdpa: routed (causal)": 1}


@pytest.mark.slow
def test_a_dynamic_head_dims_default_scale_is_sdpas_to_the_last_bit(monkeypatch):
    """SDPA's default scale is 1 / sqrt(D) (aten's calculate_scale); D ** -0.5 differs from it in the last bit
    for D 48, 96 and 128 among others. With a symbolic head_dim the rewrite computes it at run time."""
    import math

    from inductor_attn.backends import reference

    scales = []
    run_forward = reference.run_forward
    monkeypatch.setattr(reference, "run_forward", lambda call: scales.append(call.scale) or run_forward(call))
    compiled = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                             backend="inductor_attn", fullgraph=True, dynamic=True)
    for d in (128, 96, 48):
        compiled(*(t.detach() for t in qkv(b=3, hq=2, hk=2, lq=20, lk=20, d=d)))
        assert scales[-1] == 1.0 / math.sqrt(d) != d ** -0.5, (d, scales)


@pytest.mark.slow
def test_fx_graph_cache_hit_still_runs_our_op(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    functorch_config, inductor_config = torch._functorch.config, torch._inductor.config

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True) + 1

    q, k, v = (t.detach() for t in qkv())
    counters = torch._dynamo.utils.counters
    with inductor_config.patch(fx_graph_cache=True), functorch_config.patch(enable_autograd_cache=True):
        counters.clear()
        torch.compile(fn, backend="inductor_attn")(q, k, v)
        torch._dynamo.reset()
        inductor_attn.reset_routing_report()
        inductor_attn.reset_stats()
        out = torch.compile(fn, backend="inductor_attn")(q, k, v)
    hits = counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]
    assert hits >= 1
    assert inductor_attn.routing_report() == {}  # the pass did not run: the cached code replayed
    assert sum(inductor_attn.stats().values()) == 1  # and the cached code calls our op
    torch.testing.assert_close(out, fn(q, k, v), **TOL)


@pytest.mark.parametrize("env, value, message", [
    (ROUTE_DEVICES_ENV, "cuda,gpu", "INDUCTOR_ATTN_ROUTE_DEVICES must list device types .* got 'gpu' in 'cuda,gpu'"),
    ("INDUCTOR_ATTN_ROUTE_FLEX", "yes", "INDUCTOR_ATTN_ROUTE_FLEX must be 1 \\(on\\) or 0 \\(off\\), got 'yes'"),
])
def test_a_routing_setting_that_would_route_nothing_silently_is_named(monkeypatch, env, value, message):
    from inductor_attn.routing.flex_route import routing_requested
    from inductor_attn.routing.rewrite import routed_device_types

    monkeypatch.setenv(env, value)
    with pytest.raises(ValueError, match=message):
        routed_device_types() if env == ROUTE_DEVICES_ENV else routing_requested()
