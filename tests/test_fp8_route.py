"""``enable(fp8=True)`` on the CPU: which routed SDPA calls become fp8_attention on quantised inputs, why the others
stay in their dtype, the pass setting, and a small model compiled end to end against float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_fa3 import H200, installed, prob  # noqa: F401  (installed: a fixture)
from test_rewrite import ATTENTION, capture, only_outcome, qkv, run_graph

import inductor_attn
from inductor_attn import _compat
from inductor_attn.backends import REFERENCE, only_backends, reference, registry
from inductor_attn.fp8 import quantize
from inductor_attn.routing.rewrite import RewritePass, fp8_kernel_missing, rewrite_graph

FP8 = torch.ops.inductor_attn.fp8_attention.default
# docs/using.md, "fp8 for a model's attention": the routed call on the reference (the inputs' quantisation alone)
# against float64 of the unquantised inputs measured 0.044 median, 0.049 max on random data
ROUTED_FP8_BOUND = 6e-2

pytestmark = pytest.mark.usefixtures("fresh_compile", "reference_only")


def rel_to_float64(out, fn, *inputs) -> float:
    want = fn(*(x.double() for x in inputs))
    return ((out.double() - want).norm() / want.norm()).item()


def rewrite_fp8(fn, *args):
    gm = capture(fn, *args)
    rewrite_graph(gm.graph, fp8=True)
    gm.recompile()
    return gm


def test_a_routed_inference_call_becomes_fp8_attention_on_inputs_quantised_per_kv_head():
    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    q, k, v = qkv(lq=64, lk=64, d=32)
    gm = rewrite_fp8(fn, q, k, v)
    assert only_outcome() == "sdpa: routed (causal, fp8)"
    (call,) = [n for n in gm.graph.nodes if n.target is FP8]
    assert not [n for n in gm.graph.nodes if n.target is ATTENTION]
    assert call.args[6:11] == (1.0 / 32 ** 0.5, True, -1, -1, torch.float32)  # scale, causal, window, out_dtype
    out = run_graph(gm, fn, q, k, v)
    assert out.dtype == torch.float32 and 0 < rel_to_float64(out, fn, q, k, v) < ROUTED_FP8_BOUND
    # what the graph computes is fp8_attention of quantize(x, Hkv), nothing else
    (q8, qs), (k8, ks), (v8, vs) = (quantize(x, 2) for x in (q, k, v))
    assert qs.shape == ks.shape == (2, 2)
    want = inductor_attn.fp8_attention(q8, k8, v8, q_descale=qs, k_descale=ks, v_descale=vs, causal=True,
                                       out_dtype=torch.float32)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_without_fp8_the_rewrite_is_what_it_was():
    gm = capture(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), *qkv())
    rewrite_graph(gm.graph)
    assert only_outcome() == "sdpa: routed (causal)"
    assert not [n for n in gm.graph.nodes if n.target is FP8]


def test_calls_that_need_grad_or_take_lengths_or_a_key_mask_stay_in_their_dtype_with_the_reason():
    def lengths_fn(q, k, v, lengths):
        mask = torch.arange(k.shape[2])[None, None, None, :] < lengths[:, None, None, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def key_mask_fn(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    q, k, v = qkv(hk=4, lq=1, lk=9)
    cases = [(lengths_fn, (q, k, v, torch.tensor([9, 4])), "kv_seqlens from a proven prefix mask; not fp8: "
                                                           "fp8_attention takes no kv_seqlens"),
             (key_mask_fn, (q, k, v, torch.ones(2, 1, 1, 9, dtype=torch.bool)),
              "key_mask from an unproven mask the same for every query; not fp8: fp8_attention takes no key mask")]
    for fn, args, what in cases:
        inductor_attn.reset_routing_report()
        gm = rewrite_fp8(fn, *args)
        assert only_outcome() == f"sdpa: routed ({what})"
        assert [n for n in gm.graph.nodes if n.target is ATTENTION] and not [
            n for n in gm.graph.nodes if n.target is FP8]
        torch.testing.assert_close(run_graph(gm, fn, *args), fn(*args), rtol=1e-5, atol=1e-5)

    inductor_attn.reset_routing_report()
    q, k, v = qkv(hk=4)
    gm = rewrite_fp8(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), q, k, v.requires_grad_())
    assert only_outcome() == "sdpa: routed (dense; not fp8: q/k/v require grad and fp8_attention is forward only)"


def test_fp8_needs_a_kernel_other_than_the_reference_where_the_calls_dtype_has_one():
    with only_backends(REFERENCE, registry.SDPA, registry.FA3):
        assert fp8_kernel_missing(prob(), H200) == ("no fp8 kernel but the reference here (sdpa: sdpa takes no fp8 "
                                                    "inputs (fp8 runs on reference, fa3); fa3: tokenspeed-fa3 not "
                                                    "installed (pip install 'inductor-attn[fa3]'))")
        assert fp8_kernel_missing(prob(device_type="cpu"), H200) is None  # the reference is all either has


def test_with_fa3_installed_fp8_has_its_kernel(installed):  # noqa: F811
    with only_backends(REFERENCE, registry.SDPA, registry.FA3):
        assert fp8_kernel_missing(prob(), H200) is None


def test_enable_fp8_is_a_bool_of_the_pass_and_in_its_uuid():
    config = _compat.inductor_config()
    with config.patch(pre_grad_custom_pass=None):
        with pytest.raises(TypeError, match="fp8 must be a bool .* got 'e4m3'"):
            inductor_attn.enable(fp8="e4m3")
        inductor_attn.enable()
        plain = config.pre_grad_custom_pass
        inductor_attn.enable(fp8=True)
        fp8 = config.pre_grad_custom_pass
        assert fp8.fp8 and not plain.fp8 and fp8.chained is None and fp8.uuid() != plain.uuid()
        with inductor_attn.enabled():
            assert not config.pre_grad_custom_pass.fp8
        assert config.pre_grad_custom_pass is fp8  # the enclosing enable(fp8=True) is back
        inductor_attn.disable()
        assert config.pre_grad_custom_pass is None
    assert RewritePass(fp8=True).uuid() != RewritePass().uuid()


class Block(torch.nn.Module):
    """Attention as a model writes it: projections, GQA heads, causal SDPA."""

    def __init__(self, dim=64, heads=4, heads_kv=2):
        super().__init__()
        self.heads, self.heads_kv, self.d = heads, heads_kv, dim // heads
        self.q = torch.nn.Linear(dim, dim)
        self.kv = torch.nn.Linear(dim, 2 * heads_kv * self.d)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.heads, self.d).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, self.heads_kv, self.d).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2).flatten(2)


@pytest.mark.slow
def test_a_model_compiled_with_enable_fp8_runs_inference_in_fp8_and_training_in_its_dtype(monkeypatch):
    descales = []
    run_forward = reference.run_forward
    monkeypatch.setattr(reference, "run_forward", lambda call: descales.append(call.descale) or run_forward(call))
    torch.manual_seed(0)
    model, x = Block(), torch.randn(2, 48, 64)
    with torch.no_grad():
        want = model.double()(x.double())
        model.float()
    with inductor_attn.enabled(fp8=True):
        compiled = torch.compile(model, fullgraph=True)
        with torch.no_grad():
            out = compiled(x)
        assert inductor_attn.routing_report() == {"sdpa: routed (causal, fp8)": 1}
        assert len(descales) == 1 and descales[0] is not None  # the fp8 op ran
        assert 0 < ((out.double() - want).norm() / want.norm()).item() < ROUTED_FP8_BOUND

        inductor_attn.reset_routing_report()
        compiled(x).square().sum().backward()  # grad enabled: the call needs its backward
        assert inductor_attn.routing_report() == {
            "sdpa: routed (causal; not fp8: q/k/v require grad and fp8_attention is forward only)": 1}
        assert descales[-1] is None and model.q.weight.grad is not None
