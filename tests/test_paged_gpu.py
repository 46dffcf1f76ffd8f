"""paged_attention on a GPU: every candidate against a float64 oracle on fresh random inputs, outputs poisoned
with NaN, NaN in every pool slot that holds no key; page sizes 1 to 256, GQA, chunked prefill; the tuner's choice;
a compiled serving loop that never recompiles; a static compiled call runs split-K decode from generated code."""

from __future__ import annotations

import dataclasses

import paged_inputs as pi
import pytest
import torch

import inductor_attn
from inductor_attn.backends import enumerate_candidates, plan_for
from inductor_attn.device import device_info
from inductor_attn.ops.paged import paged_call
from inductor_attn.tuning.correctness import check_output

pytestmark = pytest.mark.gpu

CASES = {
    "decode_page1_gqa": pi.PagedCase(kv_lens=(70, 3, 0, 129), page_size=1, hq=8, hkv=2, d=64, dtype=torch.bfloat16),
    "decode_page16_mqa_d128": pi.PagedCase(kv_lens=(1000, 17, 512), page_size=16, hq=16, hkv=1, d=128),
    "decode_page64_d256": pi.PagedCase(kv_lens=(4097, 64, 1), page_size=64, hq=16, hkv=2, d=256,
                                       dtype=torch.bfloat16),
    "decode_page256_hnd": pi.PagedCase(kv_lens=(3000, 255, 257), page_size=256, hq=32, hkv=8, d=128,
                                       layout="HND", dtype=torch.bfloat16),
    "prefill_equal_chunks_page16": pi.PagedCase(kv_lens=(300, 40, 16), q_lens=(8, 8, 8), page_size=16, hq=8, hkv=2,
                                                d=128, dtype=torch.bfloat16),
    "prefill_ragged_chunks_window_page64": pi.PagedCase(kv_lens=(500, 90), q_lens=(16, 3), page_size=64, hq=4,
                                                        hkv=4, d=64, window=(100, 0)),
    "prefill_chunk64_page16": pi.PagedCase(kv_lens=(700, 64), q_lens=(64, 64), page_size=16, hq=8, hkv=2, d=128,
                                           dtype=torch.bfloat16),
    "decode_softcap_page16": pi.PagedCase(kv_lens=(900, 33, 0), page_size=16, hq=16, hkv=2, d=128,
                                          dtype=torch.bfloat16, softcap=1.5),
    "prefill_softcap_window_page64": pi.PagedCase(kv_lens=(500, 90), q_lens=(16, 3), page_size=64, hq=8, hkv=2, d=64,
                                                  window=(100, 0), softcap=3.0),
}


def _call(case, x):
    k, v = (c.transpose(1, 2) if case.layout == "HND" else c for c in (x.k_cache, x.v_cache))
    return paged_call(x.q, k, v, x.block_table, x.kv_seqlens, x.cu_seqlens_q, case.max_seqlen_q,
                      x.block_table.shape[1] * case.page_size, case.d ** -0.5, case.causal, *case.window, case.softcap)


@pytest.mark.parametrize("name", CASES)
def test_every_candidate_matches_float64(name):
    case = CASES[name]
    x = pi.make(case, device="cuda")
    call = _call(case, x)
    ref_out, ref_lse = pi.oracle(case, x, case.d ** -0.5)
    dev = device_info(call.q.device)
    ran = []
    for cand in enumerate_candidates(call.problem, dev):
        if cand.pruned is not None:
            continue
        torch.full((1 << 26,), float("nan"), device="cuda")  # freed memory the outputs may be given: NaN
        out, lse = plan_for(call.problem, cand.name, dev, "forward").launch(call)
        reason = check_output(out.cpu(), lse.cpu(), ref_out, ref_lse, case.dtype)
        assert reason is None, f"{cand.name}: {reason}"
        ran.append(cand.backend)
    assert "reference" in ran
    if case.max_seqlen_q <= 16:
        assert "triton_decode" in ran
    if len(set(case.q_lens or (1,))) == 1 and case.dtype != torch.float32 and not case.softcap:  # SDPA: no softcap
        assert "paged_gather" in ran
    if _fa3_takes(case):
        assert "fa3" in ran


def _fa3_takes(case) -> bool:
    """Whether FA3's paged path is a candidate for ``case`` here: the wheel on an sm_90 GPU, a 16-bit dtype, one of
    its head dims, at most 128 query rows per sequence (backends/fa3.py), and no softcap (the build has none)."""
    from inductor_attn.backends import fa3
    from inductor_attn.problem import next_power_of_two

    return (fa3.unavailable("cuda", device_info(torch.device("cuda"))) is None and case.dtype != torch.float32
            and case.d in fa3.HEAD_DIMS and next_power_of_two(case.max_seqlen_q) * (case.hq // case.hkv) <= 128
            and not case.softcap)


@pytest.mark.parametrize("name", ["decode_page16_mqa_d128", "prefill_equal_chunks_page16"])
def test_the_tuned_choice_matches_float64(name, monkeypatch):
    monkeypatch.setenv("INDUCTOR_ATTN_MODE", "autotune")
    case = CASES[name]
    x = pi.make(case, device="cuda")
    out, lse = inductor_attn.paged_attention(x.q, x.k_cache, x.v_cache, x.block_table, x.kv_seqlens,
                                             return_lse=True, **x.kwargs(case))
    ref_out, ref_lse = pi.oracle(case, x, case.d ** -0.5)
    assert check_output(out.cpu(), lse.cpu(), ref_out, ref_lse, case.dtype) is None
    assert any(key.startswith("paged/forward") for key in inductor_attn.stats())


def test_a_compiled_serving_loop_never_recompiles_nor_retunes(monkeypatch, fresh_compile):
    from torch._dynamo.testing import CompileCounterWithBackend

    from inductor_attn.tuning import decisions

    monkeypatch.setenv("INDUCTOR_ATTN_MODE", "autotune")
    counter = CompileCounterWithBackend("inductor")

    @torch.compile(backend=counter, fullgraph=True)
    def step(q, k, v, table, lens):
        return inductor_attn.paged_attention(q, k, v, table, lens)

    base = pi.PagedCase(kv_lens=(600, 100), page_size=16, hq=16, hkv=2, d=128, dtype=torch.bfloat16, width=64,
                        num_blocks=140)
    x = pi.make(base, device="cuda")
    for i in range(40):  # lengths grow by one token per step; pool and table keep their sizes
        case = dataclasses.replace(base, kv_lens=(600 + i, 100 + i))
        x = pi.make(case, device="cuda", seed=i)
        out = step(x.q, x.k_cache, x.v_cache, x.block_table, x.kv_seqlens)
        if i % 13 == 0:
            ref = pi.oracle(case, x, case.d ** -0.5)[0]
            assert (out.cpu().double() - ref).norm() / ref.norm() < 2e-2
    assert counter.frame_count == 1
    assert len([key for key in decisions._MEMO if key[1].op == "paged"]) == 1  # one bucket, tuned once


def _compiled_two_steps(case, backend: str, return_lse: bool):
    """``paged_attention`` compiled once (fullgraph) and decided with ``backend`` alone (and the reference), run at
    two steps of ``case`` whose lengths grow by 5 with the same shapes, outputs checked against the float64 oracle
    with NaN in every pool slot that holds no key and in freed memory. Returns the first step's generated code and
    inputs."""
    from torch._inductor.utils import run_and_get_code

    from inductor_attn.backends import REFERENCE, get_backend, only_backends
    from inductor_attn.tuning.correctness import check_tensor

    grown = tuple(n + 5 for n in case.kv_lens)
    pages = [-(-n // case.page_size) for n in grown]
    steps = [dataclasses.replace(case, kv_lens=lens, width=max(pages) + 1, num_blocks=sum(pages) + 3)
             for lens in (case.kv_lens, grown)]  # the same shapes at both steps
    inputs = [pi.make(step_case, device="cuda", seed=i) for i, step_case in enumerate(steps)]
    kwargs = {key: value for key, value in inputs[0].kwargs(case).items() if key != "cu_seqlens_q"}

    def fn(q, k, v, table, lens, cu):
        return inductor_attn.paged_attention(q, k, v, table, lens, cu_seqlens_q=cu, return_lse=return_lse, **kwargs)

    compiled = torch.compile(fn, fullgraph=True)
    with only_backends(get_backend(backend), REFERENCE), inductor_attn.tuning_mode("autotune"):
        for i, (step_case, x) in enumerate(zip(steps, inputs)):
            args = (x.q, x.k_cache, x.v_cache, x.block_table, x.kv_seqlens, x.cu_seqlens_q)
            torch.full((1 << 26,), float("nan"), device="cuda")  # freed memory the outputs may be given: NaN
            if i == 0:
                result, (code,) = run_and_get_code(compiled, *args)
            else:
                result = compiled(*args)
            ref_out, ref_lse = pi.oracle(step_case, x, case.d ** -0.5)
            if return_lse:
                assert check_output(result[0].cpu(), result[1].cpu(), ref_out, ref_lse, case.dtype) is None, i
            else:
                assert check_tensor("output", result.cpu(), ref_out, case.dtype) is None, i
    return code, inputs[0]


@pytest.mark.parametrize("name, return_lse", [("decode_page16_mqa_d128", False), ("decode_page256_hnd", True),
                                              ("prefill_ragged_chunks_window_page64", True)])
def test_a_static_compiled_paged_call_launches_split_k_decode_from_generated_code(name, return_lse, fresh_compile):
    """Decided while compiling and traced into the graph: no paged op and no launch op left, the kernels of the
    chosen split-K config launched by Inductor's code (an inference call: no lse buffer), outputs right with NaN
    in every pool slot that holds no key, also at a later step whose lengths grew (no recompile)."""
    case = CASES[name]
    code, first = _compiled_two_steps(case, "triton_decode", return_lse)
    assert "torch.ops.inductor_attn" not in code and "_decode_partial" in code, code
    if not return_lse:  # traced_out_only: no (Hq, total_q) lse buffer
        assert f"empty_strided_cuda(({case.hq}, {first.q.shape[0]}), " not in code, code
    (ran, graphs), = inductor_attn.stats().items()
    assert ran.startswith("paged/forward -> triton_decode:"), ran
    assert ran.endswith("(launched by compiled code, per graph)") and graphs == 1, ran


@pytest.mark.parametrize("name", ["decode_page1_gqa", "decode_page256_hnd", "prefill_ragged_chunks_window_page64"])
def test_a_compiled_paged_call_whose_winner_is_fa3_runs_it_with_nan_in_unused_slots(name, fresh_compile):
    """FA3's paged path decided while compiling (no traced form: compiled code calls its launch through the thin
    op), right with NaN in every slot that holds no key and -1 past each sequence's last page, at two steps."""
    case = dataclasses.replace(CASES[name], dtype=torch.bfloat16)
    if not _fa3_takes(case):
        pytest.skip("FA3's paged path cannot run here (tokenspeed-fa3 on an sm_90 GPU)")
    inductor_attn.reset_stats()
    _compiled_two_steps(case, "fa3", return_lse=True)
    assert any(key.startswith("paged/forward -> fa3:") for key in inductor_attn.stats()), inductor_attn.stats()
