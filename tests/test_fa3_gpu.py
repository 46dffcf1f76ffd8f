"""FlashAttention-3 (tokenspeed-fa3) through the fa3 backend on an H100/H200, against float64 references.

Run on the GPU machine with the wheel: ``source .devfa3/install.sh && pytest -m gpu tests/test_fa3_gpu.py``
(with FA4 too, for the pairing with FA4's backward: ``source .devdeps/unpack.sh`` first). Skipped without sm_90 or
without the wheel (the reason is shown).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import inductor_attn
from inductor_attn.backends import (REFERENCE, AttnCall, Config, enumerate_candidates, fa3, fa4, get_backend,
                                    only_backends, run_backend, run_backend_backward)
from inductor_attn.backends.reference import dequantised
from inductor_attn.device import device_info
from inductor_attn.tuning.correctness import TOLERANCES, check_output, check_tensor, rel_err

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def dev():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    info = device_info("cuda")
    if info.arch != 90:
        pytest.skip(f"tokenspeed-fa3 runs on sm_90 only, this is sm_{info.arch}")
    loaded = fa3._load()
    if isinstance(loaded, str):
        pytest.skip(f"{loaded} (source .devfa3/install.sh on the GPU machine)")
    return info


def _poison(*like: torch.Tensor) -> None:
    """NaN where the next allocations will likely land: a large block and a block of each size in ``like``."""
    torch.full((64 << 20,), float("nan"), device="cuda")
    for t in like:
        torch.full(t.shape, float("nan"), dtype=t.dtype, device=t.device)


def _dequantised64(call: AttnCall):
    """An fp8 call's inputs times their descales, in float64 (exact: see reference.dequantised)."""
    return tuple(x.double() for x in dequantised(call))


def _float64(call: AttnCall) -> AttnCall:
    return dataclasses.replace(call, q=call.q.double(), k=call.k.double(), v=call.v.double(), _problem=None)


def dense_call(b, hq, hkv, lq, lk, d, dtype=torch.bfloat16, causal=False, left=-1, right=-1, kv_seqlens=None,
               seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, hq, lq, d, device="cuda", dtype=dtype, generator=gen)
    k, v = (torch.randn(b, hkv, lk, d, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
    return AttnCall("attention", q, k, v, d ** -0.5, causal, left, right, kv_seqlens)


def _every_candidate_matches_float64(call: AttnCall, dev) -> list[str]:
    """Run every runnable fa3 candidate for ``call`` on poisoned memory; each must match the float64 reference
    (out and lse, lse in our layout: -inf on empty rows). Returns the candidates run."""
    ref_out, ref_lse = run_backend(REFERENCE, _float64(call), None)
    ran = []
    for cand in enumerate_candidates(call.problem, dev):
        if cand.backend != "fa3":
            continue
        assert cand.pruned is None, cand
        _poison(call.q, call.q[..., 0].float())
        out, lse = fa3.BACKEND.plan(call.problem, dev, cand.config, "forward").launch(call)
        assert out.dtype == call.q.dtype and lse.shape == ref_lse.shape and lse.is_contiguous()
        reason = check_output(out, lse, ref_out, ref_lse.float(), call.q.dtype)
        assert reason is None, f"{cand.name}: {reason}"
        ran.append(cand.name)
    assert ran
    return ran


DENSE = [
    dict(b=2, hq=8, hkv=8, lq=1024, lk=1024, d=128),
    dict(b=2, hq=8, hkv=2, lq=512, lk=512, d=64, causal=True),  # GQA
    dict(b=1, hq=8, hkv=1, lq=256, lk=256, d=256),  # MQA
    dict(b=2, hq=4, hkv=4, lq=100, lk=300, d=128, causal=True),  # causal Lq < Lk, lower-right
    dict(b=2, hq=4, hkv=4, lq=300, lk=100, d=192, causal=True),  # Lq > Lk: empty rows, lse -inf
    dict(b=2, hq=8, hkv=2, lq=512, lk=512, d=128, causal=True, left=64, right=0),  # sliding window
    dict(b=1, hq=4, hkv=4, lq=200, lk=400, d=64, left=32, right=16),  # two-sided window
    dict(b=1, hq=32, hkv=8, lq=1, lk=8192, d=128),  # decode: splits
    dict(b=1, hq=16, hkv=2, lq=4, lk=16384, d=256, causal=True),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", DENSE, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_every_fa3_candidate_matches_float64(dev, case, dtype):
    _every_candidate_matches_float64(dense_call(**case, dtype=dtype), dev)


def test_decode_tries_splits_and_packing(dev):
    ran = _every_candidate_matches_float64(dense_call(1, 16, 2, 1, 16384, 256), dev)
    assert "fa3:num_splits=1,pack_gqa=False" in ran and any("num_splits=1," not in n for n in ran)


def _leaks(call: AttnCall, dev) -> bool:
    """Whether fa3's unsplit plan, run anyway, lets the NaN in ``call``'s unused keys into the output."""
    out, _ = fa3.BACKEND.plan(call.problem, dev, Config.of(num_splits=1), "forward").launch(call)
    return bool(out.isnan().any())


@pytest.mark.parametrize("lq", [1, 64, 300])
def test_kv_seqlens_calls_prune_fa3_which_reads_keys_past_a_length(dev, lq):
    lens = torch.tensor([1000, 0, 37], device="cuda", dtype=torch.int32)
    call = dense_call(3, 8, 2, lq, 1024, 128, causal=True, kv_seqlens=lens)
    for x in (call.k, call.v):
        x.masked_fill_((torch.arange(1024, device="cuda") >= lens[:, None])[:, None, :, None], float("nan"))
    (cand,) = [c for c in enumerate_candidates(call.problem, dev) if c.backend == "fa3"]
    assert "past kv_seqlens" in cand.pruned
    assert _leaks(call, dev), "tokenspeed-fa3 no longer leaks NaN past kv_seqlens: lift fa3's prune"


def test_varlen_calls_prune_fa3_which_reads_a_padding_sequence(dev):
    gen = torch.Generator(device="cuda").manual_seed(3)
    cu = torch.tensor([0, 100, 357, 357, 512], device="cuda", dtype=torch.int32)
    cu_k = torch.tensor([0, 100, 357, 420, 575], device="cuda", dtype=torch.int32)
    q = torch.randn(512, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(575, 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    k[357:420] = float("nan")  # a sequence with keys and no queries: padding
    v[357:420] = float("nan")
    call = AttnCall("varlen", q, k, v, 128 ** -0.5, True, cu_seqlens_q=cu, cu_seqlens_k=cu_k, max_seqlen_q=257,
                    max_seqlen_k=257)
    (cand,) = [c for c in enumerate_candidates(call.problem, dev) if c.backend == "fa3"]
    assert "varlen" in cand.pruned
    assert _leaks(call, dev), "tokenspeed-fa3's varlen no longer leaks a padding sequence's NaN: lift fa3's prune"


def _backwards():
    names = ["sdpa", "triton"]
    if not isinstance(fa4.loading.load(), str):
        names.append("fa4")
    return names


@pytest.mark.parametrize("backward", ["sdpa", "triton", "fa4"])
@pytest.mark.parametrize("case", [dict(b=2, hq=8, hkv=2, lq=512, lk=512, d=128, causal=True),
                                  dict(b=2, hq=4, hkv=4, lq=256, lk=256, d=64)], ids=["gqa-causal", "mha"])
def test_other_backends_backward_takes_fa3s_out_and_lse(dev, backward, case):
    if backward not in _backwards():
        pytest.skip("flash-attn-4 not importable here")
    call = dense_call(**case)
    first = next(c for c in enumerate_candidates(call.problem, dev) if c.backend == "fa3")
    out, lse = fa3.BACKEND.plan(call.problem, dev, first.config, "forward").launch(call)
    grad_out = torch.randn_like(out)
    ref = _float64(call)
    ref_out, ref_lse = run_backend(REFERENCE, ref, None)
    want = run_backend_backward(REFERENCE, ref, None, ref_out, ref_lse, grad_out.double(), None)
    cands = [c for c in enumerate_candidates(call.problem, dev, "backward") if c.backend == backward and not c.pruned]
    if not cands:
        pytest.skip(f"no {backward} backward runs this problem here")
    for cand in cands:
        _poison(call.q, call.k, call.v)
        got = get_backend(backward).plan(call.problem, dev, cand.config, "backward").launch(call, out, lse, grad_out,
                                                                                          None)
        for name, g, w in zip(("dq", "dk", "dv"), got, want):
            reason = check_tensor(name, g, w, call.q.dtype)
            assert reason is None, f"{cand.name}: {reason}"


def test_compiled_attention_with_fa3_forced_goes_through_the_launch_op(dev):
    call = dense_call(2, 8, 2, 1024, 1024, 128, causal=True)
    with only_backends(fa3.BACKEND, REFERENCE), inductor_attn.tuning_mode("autotune"):
        fn = torch.compile(lambda q, k, v: inductor_attn.attention(q, k, v, causal=True), fullgraph=True)
        out, (code,) = run_and_get_code(fn, call.q, call.k, call.v)
        stats = inductor_attn.stats()
    assert "inductor_attn.launch.default" in code
    assert any("-> fa3:" in key for key in stats), stats
    ref_out, _ = run_backend(REFERENCE, _float64(call), None)
    assert rel_err(out, ref_out) < TOLERANCES[torch.bfloat16]


# ----------------------------------------------------------------------------------------------------- fp8
def fp8_call(b, hq, hkv, lq, lk, d, causal=False, per_head=False, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", generator=gen).to(torch.float8_e4m3fn)
               for h, n in ((hq, lq), (hkv, lk), (hkv, lk)))
    shape = (b, hkv) if per_head else (1,)
    descale = tuple((torch.rand(shape, device="cuda", generator=gen) + 0.5).expand(b, hkv) for _ in range(3))
    return AttnCall("attention", q, k, v, d ** -0.5, causal, descale=descale, out_dtype=torch.bfloat16)


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("case", [dict(b=2, hq=8, hkv=8, lq=1024, lk=1024, d=128),
                                  dict(b=2, hq=8, hkv=2, lq=512, lk=700, d=64, causal=True),
                                  dict(b=1, hq=16, hkv=2, lq=1, lk=8192, d=256)],
                         ids=["mha", "gqa-causal", "decode"])
def test_fp8_candidates_are_within_the_fp8_bound_of_float64(dev, case, per_head):
    call = fp8_call(**case, per_head=per_head)
    q, k, v = _dequantised64(call)
    ref_out, ref_lse = run_backend(REFERENCE, AttnCall("attention", q, k, v, call.scale, call.causal), None)
    for cand in enumerate_candidates(call.problem, dev):
        if cand.backend != "fa3":
            continue
        _poison(call.q.float())
        out, lse = fa3.BACKEND.plan(call.problem, dev, cand.config, "forward").launch(call)
        assert out.dtype == torch.bfloat16
        reason = check_output(out, lse, ref_out, ref_lse.float(), torch.float8_e4m3fn)
        assert reason is None, f"{cand.name}: {reason}"


def test_fp8_attention_public_call_runs_fa3(dev):
    call = fp8_call(2, 8, 2, 1024, 1024, 128, causal=True)
    descales = dict(zip(("q_descale", "k_descale", "v_descale"), (d[:1, :1].reshape(1) for d in call.descale)))
    with inductor_attn.tuning_mode("autotune"):
        inductor_attn.reset_stats()
        out = inductor_attn.fp8_attention(call.q, call.k, call.v, **descales, causal=True)
        assert any("-> fa3:" in key for key in inductor_attn.stats()), inductor_attn.stats()
    q, k, v = _dequantised64(call)
    ref_out, _ = run_backend(REFERENCE, AttnCall("attention", q, k, v, call.scale, True), None)
    assert rel_err(out, ref_out) < TOLERANCES[torch.float8_e4m3fn]


_FIRST_COMPILE = """
import json, sys
import torch
import inductor_attn
from inductor_attn.store.db import get_store
shape = json.loads(sys.argv[1])
heads = (shape["heads_q"], shape["heads_kv"], shape["heads_kv"])
q, k, v = (torch.randn(shape["batch"], h, shape["len_q" if i == 0 else "len_k"], shape["head_dim"], device="cuda",
                       dtype=torch.bfloat16) for i, h in enumerate(heads))
fn = torch.compile(lambda q, k, v: inductor_attn.attention(q, k, v, causal=shape["causal"]), fullgraph=True)
fn(q, k, v)
torch.cuda.synchronize()
passed = [c["name"] for row in get_store().writable.rows() for c in row["record"]["candidates"]
          if c["status"] == "passed"]
print(json.dumps({"fa4_imported": "flash_attn.cute" in sys.modules, "measured": passed}))
"""


def test_a_first_compile_whose_shipped_winner_is_fa3_neither_imports_nor_compiles_fa4(dev, tmp_path):
    """With FA4 installed too, a fresh process and store compiling a dense problem that this GPU's shipped table
    gives to FA3 (the H200's: B4 H32 L1k D128 full, B4 H32/8 L4k D128 causal) imports no CuTe DSL and measures no
    FA4 config: FA3 tied or beat them, and its first compile costs its import only (issue 53's cold-compile target)."""
    import importlib.util
    import json
    import os
    import subprocess
    import sys

    from inductor_attn.store.priors import PACKAGE_DIR, device_slug

    if importlib.util.find_spec("flash_attn") is None or importlib.util.find_spec("flash_attn.cute") is None:
        pytest.skip("flash-attn-4 is not installed: nothing to keep out (source .devdeps/unpack.sh first)")
    table = PACKAGE_DIR / f"{device_slug(torch.cuda.get_device_name())}.json"
    if not table.exists():
        pytest.skip(f"no shipped table for {torch.cuda.get_device_name()}")
    rows = [row for row in json.loads(table.read_text())["decisions"]
            if row["op"] == "attention/forward" and row["winner"].startswith("fa3:") and "has_kv_seqlens=False" in
            row["problem"]]
    if not rows:
        pytest.skip(f"{table.name} gives no dense problem to FA3")
    fields = dict(item.split("=", 1) for item in rows[0]["problem"].split(","))
    shape = {name: int(fields[name]) for name in ("batch", "heads_q", "heads_kv", "len_q", "len_k", "head_dim")}
    shape["causal"] = fields["causal"] == "True"
    # the shipped tables on (conftest turns them off for every test), as a user's process has them
    env = {name: value for name, value in os.environ.items() if name != "INDUCTOR_ATTN_PRIORS"}
    env |= {"INDUCTOR_ATTN_CACHE_DIR": str(tmp_path / "store"), "INDUCTOR_ATTN_MODE": "autotune"}
    done = subprocess.run([sys.executable, "-c", _FIRST_COMPILE, json.dumps(shape)], env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert not got["fa4_imported"] and got["measured"], got
    assert not any(name.startswith("fa4:") for name in got["measured"]), got
