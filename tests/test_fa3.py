"""The fa3 backend and fp8 attention on the CPU: enumeration and pruning on simulated devices (with the wheel
absent, and with its loader replaced by a stand-in that holds no kernels), the decision key, the fp8 API's
errors, the fp8 reference against float64, fp8_attention under torch.compile, and what ``cache explain`` says
about a backward gated with another library's forward."""

from __future__ import annotations

import math

import pytest
import torch
from fakes import FakeBackend, small_call, timed_with_fakes

import inductor_attn
from inductor_attn import cache
from inductor_attn.backends import Config, Library, Takes, enumerate_candidates, fa3, only_backends, registry
from inductor_attn.device import DeviceInfo, parse_device_override
from inductor_attn.problem import Problem
from inductor_attn.store.db import get_store
from inductor_attn.tuning.decisions import decide

H200 = parse_device_override("NVIDIA H200:9.0:132")
B200 = parse_device_override("sm_100")
BUILD = {"FLASHATTENTION_DISABLE_BACKWARD": True, "FLASHATTENTION_DISABLE_SPLIT": False,
         "FLASHATTENTION_DISABLE_PACKGQA": False, "FLASHATTENTION_DISABLE_FP8": False}


def prob(**kw) -> Problem:
    base = dict(op="attention", dtype="bfloat16", device_type="cuda", batch=2, heads_q=16, heads_kv=16, len_q=4096,
                len_k=4096, head_dim=128, head_dim_v=128)
    return Problem(**{**base, **kw})


@pytest.fixture
def installed(monkeypatch):
    """fa3's loader answers as with the wheel installed (3.0.0.post20260810's build flags), without kernels."""
    loaded = fa3._FA3(fwd=None, version="3.0.0.post20260810", build_flags=dict(BUILD))
    monkeypatch.setattr(fa3, "_load", lambda: loaded)
    return loaded


def fa3_candidates(p: Problem, dev=H200, direction="forward"):
    return [c for c in enumerate_candidates(p, dev, direction) if c.backend == "fa3"]


def test_without_the_wheel_fa3_is_pruned_with_the_install_command():
    (cand,) = fa3_candidates(prob())
    assert cand.pruned == fa3.NOT_INSTALLED == "tokenspeed-fa3 not installed (pip install 'inductor-attn[fa3]')"


@pytest.mark.parametrize("kw, dev, reason", [
    ({}, B200, "built for sm_90a only, got sm_100"),
    ({"device_type": "cpu"}, H200, "needs a CUDA device"),
    ({"head_dim": 96, "head_dim_v": 96}, H200, "head dims 64, 128, 192, 256 with equal q/k and v dims, got (96, 96)"),
    ({"head_dim": 192, "head_dim_v": 128}, H200, "got (192, 128)"),
    ({"dtype": "float32"}, H200, "takes bfloat16, float16, float8_e4m3fn, got float32"),
    ({"op": "block_sparse", "block_q": 128, "block_kv": 128}, H200, "takes no block-sparse masks"),
    ({"has_key_mask": True}, H200, "fa3 does not take key_mask"),
])
def test_fa3_prunes_what_it_cannot_run_with_the_reason(installed, kw, dev, reason):
    (cand,) = fa3_candidates(prob(**kw), dev)
    assert reason in cand.pruned


def test_fa3_has_no_backward(installed):
    (cand,) = fa3_candidates(prob(), direction="backward")
    assert cand.pruned == "fa3 has no backward"


def test_mha_prefill_is_one_unsplit_config_and_gqa_decode_tries_packing_and_splits(installed):
    assert [str(c.config) for c in fa3_candidates(prob())] == ["num_splits=1"]
    decode = prob(batch=1, heads_q=16, heads_kv=2, len_q=1, len_k=16384, head_dim=256, head_dim_v=256)
    names = [str(c.config) for c in fa3_candidates(decode) if c.pruned is None]
    assert names == ["num_splits=0", "num_splits=64,pack_gqa=True", "num_splits=32,pack_gqa=True",
                     "num_splits=16,pack_gqa=True", "num_splits=1,pack_gqa=True", "num_splits=1,pack_gqa=False"]
    # FA3 packs whenever it splits: a split config with pack_gqa=False would be the same kernel


def test_windows_and_fp8_enumerate(installed):
    for p in (prob(causal=True, window_left=256, window_right=0), prob(dtype="float8_e4m3fn")):
        assert all(c.pruned is None for c in fa3_candidates(p)), p


def test_kv_seqlens_and_varlen_prune_fa3_which_reads_the_keys_after_a_length(installed):
    # 0 * NaN of an unwritten cache slot reached FA3's outputs on an H200 (tests/test_fa3_gpu.py)
    (cand,) = fa3_candidates(prob(has_kv_seqlens=True, len_q=1))
    assert "past kv_seqlens" in cand.pruned
    (cand,) = fa3_candidates(prob(op="varlen", total_q=8192, total_k=8192))
    assert "padding between sequences" in cand.pruned


def test_paged_decode_tries_splits_on_the_packed_path_and_long_chunks_are_refused(installed):
    paged = dict(op="paged", batch=1, heads_q=16, heads_kv=2, len_q=1, len_k=16384, head_dim=256, head_dim_v=256,
                 total_q=1, has_kv_seqlens=True, page_size=16)
    names = [str(c.config) for c in fa3_candidates(prob(**paged)) if c.pruned is None]
    assert names == ["num_splits=0", "num_splits=64", "num_splits=32", "num_splits=16", "num_splits=1"]
    # chunks of up to 16 queries x 8 heads per KV head fill one 128-row tile: the predicated path still
    assert all(c.pruned is None for c in fa3_candidates(prob(**{**paged, "heads_kv": 2, "len_q": 9, "total_q": 9,
                                                                 "heads_q": 16})))
    (cand, *_) = fa3_candidates(prob(**{**paged, "len_q": 17, "total_q": 17, "heads_q": 16}))
    assert "over 128 query rows (queries x GQA ratio, up to 256 here)" in cand.pruned


def test_a_build_without_splits_or_fp8_prunes_those_with_the_flag(installed):
    installed.build_flags.update(FLASHATTENTION_DISABLE_SPLIT=True, FLASHATTENTION_DISABLE_FP8=True)
    decode = prob(batch=1, heads_q=16, heads_kv=2, len_q=1, len_k=16384)
    pruned = {str(c.config): c.pruned for c in fa3_candidates(decode)}
    assert pruned["num_splits=1,pack_gqa=True"] is None
    assert pruned["num_splits=16,pack_gqa=True"] == "tokenspeed-fa3 was built with FLASHATTENTION_DISABLE_SPLIT"
    (cand,) = fa3_candidates(prob(dtype="float8_e4m3fn"))
    assert "FLASHATTENTION_DISABLE_FP8" in cand.pruned


def test_a_store_lookup_never_imports_fa3(installed):
    light = [c for c in enumerate_candidates(prob(), H200, lookup_only=True) if c.backend == "fa3"]
    assert light[0].pruned == registry.LOOKUP_ONLY


def test_fa3s_distribution_enters_the_decision_key():
    assert "tokenspeed-fa3" in registry.required_distributions()


def test_fp8_runs_only_on_backends_that_take_it(installed):
    reasons = {c.backend: c.pruned for c in enumerate_candidates(prob(dtype="float8_e4m3fn"), H200)}
    assert reasons["sdpa"] == "sdpa takes no fp8 inputs (fp8 runs on fa3, reference)"
    assert reasons["fa3"] is None and reasons["reference"] is None


# -------------------------------------------------------------------------------------------------- fp8
def fp8_inputs(b=2, hq=4, hkv=2, lq=16, lk=24, d=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=gen).to(torch.float8_e4m3fn) for h, n in ((hq, lq), (hkv, lk),
                                                                                            (hkv, lk)))
    descales = dict(q_descale=torch.tensor([0.5]), k_descale=torch.rand(b, hkv, generator=gen) + 0.5,
                    v_descale=torch.tensor(2.0))
    return q, k, v, descales


def float64_attention(q, k, v, descales, causal):
    """Attention of the dequantised inputs, in float64, written out (lower-right causal)."""
    groups = q.shape[1] // k.shape[1]
    qd = q.double() * descales["q_descale"].double().expand(q.shape[0], k.shape[1]).repeat_interleave(groups, 1)[
        ..., None, None]
    kd = k.double() * descales["k_descale"].double()[..., None, None]
    vd = v.double() * descales["v_descale"].double()
    kd, vd = kd.repeat_interleave(groups, 1), vd.repeat_interleave(groups, 1)
    scores = qd @ kd.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        lq, lk = scores.shape[-2:]
        keep = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + lk - lq
        scores = scores.masked_fill(~keep, float("-inf"))
    return torch.softmax(scores, -1) @ vd, torch.logsumexp(scores, -1)


@pytest.mark.parametrize("causal", [False, True])
def test_fp8_reference_matches_float64_of_the_dequantised_inputs(causal):
    q, k, v, descales = fp8_inputs()
    out, lse = inductor_attn.fp8_attention(q, k, v, **descales, causal=causal, out_dtype=torch.float32,
                                           return_lse=True)
    want, want_lse = float64_attention(q, k, v, descales, causal)
    assert out.dtype == torch.float32 and out.shape == (2, 4, 16, 64)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)


def test_fp8_output_is_bfloat16_by_default():
    q, k, v, descales = fp8_inputs()
    assert inductor_attn.fp8_attention(q, k, v, **descales).dtype == torch.bfloat16


def _bad(name, value):
    q, k, v, descales = fp8_inputs()
    args = {"q": q, "k": k, "v": v, **descales, name: value}
    return args.pop("q"), args.pop("k"), args.pop("v"), args


@pytest.mark.parametrize("name, value, error, message", [
    ("k", torch.zeros(2, 2, 24, 64, dtype=torch.bfloat16), TypeError,
     "k has dtype torch.bfloat16 but q has torch.float8_e4m3fn; q, k and v must share one dtype"),
    ("q", torch.zeros(2, 4, 16, 64, dtype=torch.float8_e5m2), TypeError,
     "q has dtype torch.float8_e5m2; supported dtypes are float8_e4m3fn"),
    ("q", torch.zeros(2, 4, 16, 64, dtype=torch.float8_e4m3fnuz), TypeError,
     "q has dtype torch.float8_e4m3fnuz; supported dtypes are float8_e4m3fn"),
    ("q_descale", torch.tensor([0.5], dtype=torch.bfloat16), TypeError,
     "q_descale must have dtype float32, got torch.bfloat16"),
    ("k_descale", torch.ones(2, 4), ValueError,
     r"k_descale must have shape \(\), \(1,\) or \(batch, kv heads\) = \(2, 2\), got \(2, 4\)"),
    ("v_descale", 2.0, TypeError, "v_descale must be a float32 torch.Tensor of shape"),
    ("v_descale", torch.tensor([-1.0]), ValueError, r"v_descale must be finite and >= 0, got -1.0 at index \(0,\)"),
    ("q_descale", torch.tensor([float("nan")]), ValueError, "q_descale must be finite and >= 0, got nan"),
    ("k_descale", torch.full((2, 2), float("inf")), ValueError, "k_descale must be finite and >= 0, got inf"),
    ("out_dtype", torch.float8_e4m3fn, TypeError,
     "out_dtype must be one of bfloat16, float16, float32, got torch.float8_e4m3fn"),
    # not a hint that attention() answers zero sizes: fp8_attention has no such path
    ("q", torch.zeros(2, 4, 0, 64, dtype=torch.float8_e4m3fn), ValueError,
     r"^q seq_len must be >= 1 for fp8_attention, got 0 \(it runs a kernel for every call\)$"),
])
def test_fp8_errors_name_the_argument_what_was_given_and_what_is_accepted(name, value, error, message):
    q, k, v, kwargs = _bad(name, value)
    with pytest.raises(error, match=message):
        inductor_attn.fp8_attention(q, k, v, **kwargs)


def test_quantize_refuses_what_it_cannot_scale_and_gives_an_empty_tensor_the_smallest_descale():
    from inductor_attn.fp8 import quantize

    with pytest.raises(TypeError, match=r"^x must be a float16, bfloat16, float32 or float64 \(B, H, L, D\) "
                                        r"torch.Tensor, got torch.float8_e4m3fn of shape \(1, 2, 3, 8\)"):
        quantize(torch.zeros(1, 2, 3, 8, dtype=torch.float8_e4m3fn))
    x8, descale = quantize(torch.zeros(2, 4, 0, 8), heads_kv=2)
    assert x8.shape == (2, 4, 0, 8) and descale.tolist() == [[torch.finfo(torch.float32).tiny] * 2] * 2


def test_fp8_refuses_inputs_that_require_grad_while_grad_mode_is_on():
    q, k, v, descales = fp8_inputs()
    descales["q_descale"].requires_grad_(True)
    with pytest.raises(ValueError, match=r"fp8_attention is forward only .*: q_descale requires grad while grad mode "
                                         r"is on; pass q_descale.detach\(\) or call fp8_attention under torch.no_grad"):
        inductor_attn.fp8_attention(q, k, v, **descales)
    with torch.no_grad():
        out = inductor_attn.fp8_attention(q, k, v, **descales)
    assert not out.requires_grad


def test_fp8_attention_compiles_and_matches_eager():
    q, k, v, descales = fp8_inputs()
    compiled = torch.compile(lambda *a, **kw: inductor_attn.fp8_attention(*a, **kw), fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v, **descales, causal=True),
                               inductor_attn.fp8_attention(q, k, v, **descales, causal=True))


def test_fp8_compiled_errors_are_the_eager_ones():
    q, k, v, descales = fp8_inputs()
    compiled = torch.compile(lambda *a, **kw: inductor_attn.fp8_attention(*a, **kw), fullgraph=True)
    with pytest.raises(TypeError, match="q_descale must have dtype float32, got torch.float64"):
        compiled(q, k, v, **{**descales, "q_descale": torch.tensor([0.5], dtype=torch.float64)})
    with pytest.raises(RuntimeError, match="a descale is negative, NaN or infinite"):
        compiled(q, k, v, **{**descales, "v_descale": torch.tensor(-2.0)})


@pytest.mark.parametrize("name, value, message", [
    ("k_descale", torch.ones(3, 2),
     r"^k_descale must have shape \(\), \(1,\) or \(batch, kv heads\) = \(2, 2\), got \(3, 2\)"),
    ("q", torch.zeros(4, 16, 64, dtype=torch.float8_e4m3fn),
     r"^q must have 4 dims \(batch, heads, seq_len, head_dim\), got shape \(4, 16, 64\)"),
], ids=["descale_shape", "q_rank"])
def test_fp8_compiled_shape_errors_under_dynamic_shapes_are_the_eager_ones(name, value, message):
    # symbolic sizes in the message: it must still be a constant while Dynamo traces (checks.shape_text)
    torch._dynamo.reset()
    q, k, v, kwargs = _bad(name, value)
    compiled = torch.compile(lambda q, k, v, kw: inductor_attn.fp8_attention(q, k, v, **kw), fullgraph=True,
                             dynamic=True)
    with pytest.raises(ValueError, match=message):
        compiled(q, k, v, kwargs)


def test_fp8_descale_checks_on_fake_tensors_become_a_device_assert():
    from torch.fx.experimental.proxy_tensor import make_fx

    q, k, v, descales = fp8_inputs()
    graph = make_fx(lambda q, k, v, d: inductor_attn.fp8_attention(q, k, v, **d), tracing_mode="fake")(
        q, k, v, descales).graph
    assert any("_assert_async" in str(node.target) for node in graph.nodes)


def test_the_fp8_module_is_an_attribute_of_the_package_as_docs_use_it():
    import subprocess
    import sys

    code = "import inductor_attn; print(inductor_attn.fp8.quantize.__name__)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout == "quantize\n"


# ------------------------------------------------------------------------- pairing in cache explain
class ForwardOnly(FakeBackend):
    """A forward-only backend of another library, as fa3 is."""

    takes = Takes()
    library = Library(distributions=("tokenspeed-fa3",))


def test_explain_says_a_backward_was_gated_with_another_librarys_forward(monkeypatch):
    fwd = ForwardOnly("f", {"default": (0.2, 0.01)})
    bwd = FakeBackend("g", {"default": (0.5, 0.01)})
    timed_with_fakes(monkeypatch, fwd, bwd)
    dev = DeviceInfo("cpu", (0, 0), 2)
    with only_backends(bwd, fwd, registry.get_backend("reference")), inductor_attn.tuning_mode("autotune"):
        assert decide(small_call(), dev, "forward") == "f:default"
        assert decide(small_call(), dev, "backward") == "g:default"
        (row,) = [r for r in get_store().rows() if r["op"] == "attention/backward"]
        text = cache.explain(row["key"][:16])
    assert row["record"]["paired_with"] == "f:default"
    torch_version = row["versions"]["torch"]
    assert (f"paired with:      forward f:default (tokenspeed-fa3 absent), backward g:default (torch {torch_version}): "
            "out and lse cross libraries; gated as a pair") in text


def test_config_strings_of_fa3_round_trip():
    cfg = Config.of(num_splits=16, pack_gqa=True)
    assert Config.parse(str(cfg)) == cfg


def test_a_paged_decode_launch_gives_the_ops_lse_with_empty_rows_at_minus_inf():
    """The paged plan's decode launch, around a stand-in for ``flash_attn_3::fwd`` (FA3's outputs: out in the
    buffer it is handed, lse (B, H, 1) with +inf for a sequence of no keys): the ops' lse (H, total_q),
    contiguous, -inf there, NaN kept (a leak must still show)."""
    from inductor_attn.ops.paged import paged_call

    batch, heads = 3, 4
    fa3_lse = torch.tensor([[0.5, 1.5, float("inf"), float("nan")]] * batch).unsqueeze(-1)
    fa3_lse[1] = float("inf")  # sequence 1 has no keys

    def fwd(q, k, v, *args):
        args[3].fill_(2.0)  # out, FA3's (B, 1, H, D) view of ours
        return args[3], fa3_lse.clone()

    pool = torch.zeros(4, 16, 2, 8)
    call = paged_call(torch.zeros(batch, heads, 8), pool, pool, torch.zeros(batch, 1, dtype=torch.int32),
                      torch.tensor([5, 0, 3], dtype=torch.int32), None, 1, 16, 0.3, True, -1, 0)
    out, lse = fa3._PagedLaunch(fwd, num_splits=0)(call)
    assert out.shape == (batch, heads, 8) and bool((out == 2.0).all())
    assert lse.shape == (heads, batch) and lse.is_contiguous()
    expected = fa3_lse.squeeze(-1).t().clone()
    expected[expected == float("inf")] = float("-inf")
    assert torch.equal(lse.isnan(), expected.isnan()) and torch.equal(lse.nan_to_num(0.0), expected.nan_to_num(0.0))


def test_a_paged_launch_hands_fa3_a_query_its_tma_loads_take():
    """A query whose pointer is not 16-byte aligned (a view at an odd offset of a fused projection) is copied
    before FA3's paged forward, as the dense launches copy theirs; an aligned one goes as it is."""
    from inductor_attn.ops.paged import paged_call

    handed = []

    def fwd(q, k, v, *args):
        handed.append(q)
        return args[3], torch.zeros(q.shape[0], q.shape[2], 1)

    pool = torch.zeros(4, 16, 2, 8)
    base = torch.randn(3 * 4 * 8 + 1)
    for q in (base[1:].view(3, 4, 8), base[:-1].view(3, 4, 8)):
        lengths = torch.tensor([5, 1, 3], dtype=torch.int32)
        call = paged_call(q, pool, pool, torch.zeros(3, 1, dtype=torch.int32), lengths, None, 1, 16, 0.3, True, -1, 0)
        fa3._PagedLaunch(fwd, num_splits=0)(call)
        assert handed[-1].data_ptr() % 16 == 0 and torch.equal(handed[-1].squeeze(1), q)
    assert handed[-1].data_ptr() == base.data_ptr()  # the aligned query is not copied
