"""paged_attention on the CPU: the op, its checks, the reference and the gate's NaN, split-K decode through
Triton's interpreter, the gather baseline's rewrite, and compiled serving loops that never recompile.

Every cache holds NaN wherever no key of a sequence lives (tests/paged_inputs.py): a candidate that reads an
unreferenced page, a slot past a length or a table entry past a sequence's last page fails."""

from __future__ import annotations

import dataclasses

from interpreter_bounds import bounds_checked
import paged_inputs as pi
import pytest
import torch

import inductor_attn
from inductor_attn.backends import REFERENCE, Config, enumerate_candidates, run_backend
from inductor_attn.backends import triton_decode as decode
from inductor_attn.backends.pages import key_slots, unused_slots
from inductor_attn.backends.paged_gather import BACKEND as GATHER
from inductor_attn.backends.paged_gather import as_packed, dense_call
from inductor_attn.device import device_info, parse_device_override
from inductor_attn.ops.paged import paged_call
from inductor_attn.problem import Problem
from inductor_attn.tuning.correctness import check_output, check_tensor
from inductor_attn.tuning.measure import gate_inputs, gate_once

CASES = {
    "decode_gqa_page16": pi.PagedCase(),
    "decode_page1_mqa": pi.PagedCase(kv_lens=(9, 3, 1), page_size=1, hq=4, hkv=1),
    "decode_empty_sequence": pi.PagedCase(kv_lens=(20, 0, 7), page_size=8),
    "chunked_prefill_causal": pi.PagedCase(kv_lens=(40, 21, 6), q_lens=(5, 1, 6), page_size=8, hq=6, hkv=3),
    "chunked_prefill_window_hnd": pi.PagedCase(kv_lens=(33, 18), q_lens=(4, 3), page_size=4, window=(6, 0),
                                               layout="HND"),
    "page256_bf16": pi.PagedCase(kv_lens=(300, 2), page_size=256, dtype=torch.bfloat16),
    # one sequence, a pool of exactly its pages (the serving loop whose B1 tune lost its CUDA context on an H200)
    "decode_one_sequence_pool_of_its_pages": pi.PagedCase(kv_lens=(150,), page_size=16, hq=8, hkv=2, spare_pages=4,
                                                          num_blocks=10),
    # softcaps that bend scores of order 1 plainly (Gemma 2's 50 would hardly change them)
    "decode_softcap": pi.PagedCase(kv_lens=(37, 5, 0), page_size=8, softcap=1.0),
    "chunked_prefill_softcap_window": pi.PagedCase(kv_lens=(40, 21, 6), q_lens=(5, 1, 6), page_size=8, hq=6, hkv=3,
                                                   window=(9, 0), softcap=2.5),
}


def _call(case: pi.PagedCase, x: pi.PagedInputs, dtype=None):
    k, v = (c.transpose(1, 2) if case.layout == "HND" else c for c in (x.k_cache, x.v_cache))
    cast = (lambda t: t.to(dtype)) if dtype else (lambda t: t)
    return paged_call(cast(x.q), cast(k), cast(v), x.block_table, x.kv_seqlens, x.cu_seqlens_q, case.max_seqlen_q,
                      x.block_table.shape[1] * case.page_size, case.d ** -0.5, case.causal, *case.window, case.softcap)


def _poisoned(call):
    out, lse = decode.DecodePlan.outputs(call)
    return out.fill_(float("nan")), lse.fill_(float("nan"))


def _check_against_the_oracle(case, x, out, lse):
    ref_out, ref_lse = pi.oracle(case, x, case.d ** -0.5)
    assert check_output(out, lse, ref_out, ref_lse, case.dtype) is None


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("name", CASES)
def test_paged_attention_matches_a_naive_page_by_page_oracle(name, compiled, fresh_compile):
    """Eagerly, and compiled through the API's traced fast path (layouts, windows, softcaps, chunked prefill)."""
    case = CASES[name]
    x = pi.make(case)
    fn = torch.compile(inductor_attn.paged_attention, fullgraph=True) if compiled else inductor_attn.paged_attention
    out, lse = fn(x.q, x.k_cache, x.v_cache, x.block_table, x.kv_seqlens, return_lse=True, **x.kwargs(case))
    _check_against_the_oracle(case, x, out, lse)


@pytest.mark.parametrize("name", CASES)
def test_float64_reference_matches_the_oracle_exactly_enough(name):
    case = CASES[name]
    x = pi.make(case)
    out, lse = run_backend(REFERENCE, _call(case, x, torch.float64), None)
    ref_out, ref_lse = pi.oracle(case, x, case.d ** -0.5)
    assert check_tensor("output", out, ref_out, torch.float64) is None
    torch.testing.assert_close(lse, ref_lse.float())  # the lse is float32 by the ops' contract


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n].max_seqlen_q <= decode.MAX_LEN_Q])
@pytest.mark.parametrize("splits,block_n", [(1, 16), (4, 16), (2, 32), (8, 16)])
def test_split_k_decode_reads_pages_through_the_table(name, splits, block_n):
    """Outputs right with NaN wherever no key lives, and every load and store inside the kernels' arguments."""
    case = CASES[name]
    x = pi.make(case)
    call = _call(case, x)
    out, lse = _poisoned(call)
    with bounds_checked():
        decode.DecodePlan(call.problem, device_info("cpu"), Config.of(block_n=block_n, num_splits=splits,
                                                                      num_warps=4)).run(call, out, lse)
    _check_against_the_oracle(case, x, out, lse)


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("bad", [None, "length", "block id", "block id past the length"])
def test_split_k_decode_asked_by_compiled_code_checks_lengths_and_block_ids_itself(bad, page_size, monkeypatch):
    """With ``check_indices`` the partial kernel stops where a length is outside [0, max_seqlen_k] or a page it
    reads has a block id outside [0, num_blocks), with the API's compiled messages; an id past the lengths is
    never read and never checked. Triton keeps device asserts only with ``debug``, as Inductor compiles. Page 16
    holds whole 16-key tiles (one block id per tile), page 4 splits a tile across pages."""
    import re

    from triton.runtime import interpreter

    from inductor_attn.messages import PAGED_BLOCK_IDS, PAGED_KV_SEQLENS_VALUES, device_message

    builder = interpreter.interpreter_builder
    monkeypatch.setattr(builder, "options", dataclasses.replace(builder.options, debug=True))
    case = pi.PagedCase(kv_lens=(37, 5), page_size=page_size)
    x = pi.make(case)
    if bad == "length":
        x.kv_seqlens[1] = x.block_table.shape[1] * case.page_size + 1
    elif bad == "block id":
        x.block_table[0, 36 // page_size] = x.k_cache.shape[0]  # the page of key 36, the last one
    elif bad == "block id past the length":
        x.block_table[1, 2] = -7
    call = _call(case, x)
    plan = decode.DecodePlan(call.problem, device_info("cpu"), Config.of(block_n=16, num_splits=2, num_warps=4))
    out, lse = _poisoned(call)
    message = {"length": PAGED_KV_SEQLENS_VALUES, "block id": PAGED_BLOCK_IDS}.get(bad)
    if message:
        with pytest.raises(Exception, match=re.escape(device_message(message))):
            plan.run(call, out, lse, check_indices=True)
    else:
        plan.run(call, out, lse, check_indices=True)
        _check_against_the_oracle(case, x, out, lse)


@pytest.mark.parametrize("name", [n for n in CASES if len(set(CASES[n].q_lens or (1,))) == 1 and not CASES[n].softcap])
def test_the_gather_baselines_dense_call_is_the_paged_call(name):  # SDPA has no softcap: the baseline takes none
    # on the CPU the dense call runs on the reference (the baseline's SDPA kernels need CUDA)
    case = CASES[name]
    x = pi.make(case)
    call = _call(case, x, torch.float64)
    out, lse = as_packed(*run_backend(REFERENCE, dense_call(call), None), call.q)
    ref_out, ref_lse = pi.oracle(case, x, case.d ** -0.5)
    assert check_tensor("output", out, ref_out, torch.float64) is None
    torch.testing.assert_close(lse, ref_lse.float())


def test_split_k_decode_rebuilds_a_calls_geometry_only_when_its_strides_change(monkeypatch):
    """A serving loop's steps share one geometry per plan; a pool in another layout (same problem) gets its own."""
    built, build = [], decode._Geometry.of
    monkeypatch.setattr(decode._Geometry, "of", staticmethod(lambda call, out: built.append(1) or build(call, out)))
    plan = None
    for layout, seed in (("NHD", 0), ("NHD", 1), ("HND", 2), ("NHD", 3)):
        case = dataclasses.replace(CASES["decode_gqa_page16"], layout=layout)
        x = pi.make(case, seed=seed)
        call = _call(case, x)
        plan = plan or decode.DecodePlan(call.problem, device_info("cpu"), Config.of(block_n=16, num_splits=2,
                                                                                     num_warps=4))
        out, lse = _poisoned(call)
        plan.run(call, out, lse)
        ref_out, ref_lse = pi.oracle(case, x, case.d ** -0.5)
        assert check_output(out, lse, ref_out, ref_lse, case.dtype) is None, (layout, seed)
    assert len(built) == 3
    # a serving loop's longest length grows every step: the same geometry serves
    grown = dataclasses.replace(call, max_seqlen_k=call.max_seqlen_k + 1)
    out, lse = _poisoned(grown)
    plan.run(grown, out, lse)
    assert check_output(out, lse, ref_out, ref_lse, case.dtype) is None and len(built) == 3


def test_the_gather_baseline_looks_up_sdpas_plan_once_per_table_width(monkeypatch):
    """Per launch, no dense Problem built and no plan looked up; a wider table (a dense call of another length)
    gets its own. SDPA's kernels need CUDA: here the dense call runs on the reference."""
    from inductor_attn.backends import paged_gather

    looked_up = []

    def sdpa_plan(problem, dev, cfg, direction):
        looked_up.append((cfg["kernel"], problem.len_k))
        return REFERENCE.plan(problem, dev, None, direction)

    monkeypatch.setattr(paged_gather.SDPA, "plan", sdpa_plan)
    plan = None
    for width, seed in ((5, 0), (5, 1), (6, 2), (5, 3)):  # 80 and 96 keys: one problem (its len_k is 128)
        case = dataclasses.replace(CASES["decode_gqa_page16"], width=width)
        x = pi.make(case, seed=seed)
        call = _call(case, x)
        plan = plan or GATHER.plan(call.problem, device_info("cpu"), Config.of(kernel="efficient"), "forward")
        out, lse = plan.launch(call)
        _check_against_the_oracle(case, x, out, lse)
    assert looked_up == [("efficient", 80), ("efficient", 96)]


def test_candidates_of_a_paged_decode():
    case = CASES["decode_gqa_page16"]
    call = _call(case, pi.make(case))
    listed = {c.name: c.pruned for c in enumerate_candidates(call.problem, device_info("cpu"))}
    assert listed["reference:default"] is None
    assert listed["paged_gather:-"] == "needs a CUDA device (SDPA's kernels)"
    assert any(name.startswith("triton_decode:") and why is None for name, why in listed.items())
    assert GATHER.supports(dataclasses.replace(call.problem, device_type="cuda", total_q=3, batch=2,
                                               equal_chunks=False),
                           device_info("cpu")).startswith("needs as many queries in every sequence")


def test_a_softcap_runs_on_the_kernels_that_apply_it_and_keeps_its_own_bucket():
    case = CASES["decode_softcap"]
    call = _call(case, pi.make(case))
    plain = _call(dataclasses.replace(case, softcap=0.0), pi.make(case))
    assert call.problem.softcap and not plain.problem.softcap
    assert call.problem.key() == plain.problem.key() + ",softcap=True"  # keys without a softcap are as they were
    assert Problem.from_key(call.problem.key()) == call.problem
    cuda = dataclasses.replace(call.problem, device_type="cuda")
    listed = {c.name: c.pruned for c in enumerate_candidates(cuda, parse_device_override("NVIDIA H200:9.0:132"))}
    assert listed["paged_gather:-"] == "paged_gather has no logit softcap (softcap runs on triton_decode, reference)"
    assert any(name.startswith("triton_decode:") and why is None for name, why in listed.items())


@pytest.mark.parametrize("named", [False, True])
def test_a_compiled_call_with_a_softcap_matches_the_oracle(named, fresh_compile):
    """Decided while compiling (the softcap reaches the plan from the graph's arguments), or a named split-K choice
    through the launch op (the softcap in its plan string); two softcaps."""
    case = CASES["chunked_prefill_softcap_window"]
    x = pi.make(case)
    op = torch.ops.inductor_attn.paged_attention
    choice = "triton_decode:block_n=16,num_splits=2,num_warps=4"

    def fn(q, k, v, table, lens, cu, softcap):
        if named:
            return op(q, k, v, table, lens, cu, case.max_seqlen_q, table.shape[1] * case.page_size, case.d ** -0.5,
                      True, *case.window, softcap, choice)
        return inductor_attn.paged_attention(q, k, v, table, lens, return_lse=True,
                                             **(x.kwargs(case) | {"softcap": softcap}))

    compiled = torch.compile(fn, fullgraph=True)
    with inductor_attn.tuning_mode("autotune"):
        for softcap in (case.softcap, 0.75):
            out, lse = compiled(x.q, x.k_cache, x.v_cache, x.block_table, x.kv_seqlens, x.cu_seqlens_q, softcap)
            _check_against_the_oracle(dataclasses.replace(case, softcap=softcap), x, out, lse)


def test_a_bad_softcap_is_named_in_compiled_code_too(fresh_compile):
    case = CASES["decode_softcap"]
    x = pi.make(case)
    fn = torch.compile(inductor_attn.paged_attention, fullgraph=True)
    with pytest.raises(ValueError, match=r"softcap must be >= 0 \(0 = no softcap\), got -2.0"):
        fn(x.q, x.k_cache, x.v_cache, x.block_table, x.kv_seqlens, softcap=-2.0)


def test_the_gate_uses_a_softcap_that_bends_the_scores():
    case = CASES["decode_softcap"]
    call = _call(dataclasses.replace(case, softcap=50.0), pi.make(case))
    assert gate_inputs(call, seed=1).softcap == 1.0
    assert gate_inputs(_call(case, pi.make(case)), seed=1).softcap == 1.0  # one at most 1 stays
    assert gate_once(call, "reference:default", "forward").status == "passed"


def test_a_bucket_keeps_equal_chunks_apart_from_uneven_ones():
    """Chunks of 2, 2, 2, 2 and of 2, 2, 1 round to one batch, length and token count; the gather baseline runs
    only the first, so they are two buckets, or a decision made for one would run the other."""
    even, uneven = (pi.PagedCase(kv_lens=(9, 9, 9, 9)[:len(q_lens)], q_lens=q_lens, page_size=4)
                    for q_lens in ((2, 2, 2, 2), (2, 2, 1)))
    problems = [_call(case, pi.make(case)).problem for case in (even, uneven)]
    assert problems[0].equal_chunks and not problems[1].equal_chunks
    assert problems[0].bucket() != problems[1].bucket()
    cuda = dataclasses.replace(problems[1].bucket(), device_type="cuda")
    assert GATHER.supports(cuda, device_info("cpu")).startswith("needs as many queries in every sequence")


def test_gate_inputs_hold_nan_wherever_no_key_lives_and_nowhere_else():
    case = CASES["chunked_prefill_causal"]
    call = _call(case, pi.make(case))
    fresh = gate_inputs(call, seed=1)
    blocks, slots, exists = key_slots(fresh.block_table, fresh.kv_seqlens, case.page_size)
    unused = unused_slots(fresh.k.shape[0], case.page_size, blocks, slots, exists)
    assert fresh.k.shape[0] == fresh.block_table.numel() + 1  # a pool of its own, one page named by no row
    for pool in (fresh.k, fresh.v):
        assert pool[unused].isnan().all() and not pool[~unused].isnan().any()
    assert gate_once(call, "reference:default", "forward").status == "passed"


def test_gate_drops_a_candidate_that_reads_past_the_lengths():
    case = CASES["decode_gqa_page16"]
    call = _call(case, pi.make(case))

    class Leaky(type(REFERENCE)):
        name = "leaky"

        def plan(self, p, dev, cfg, direction):
            def launch(c):  # right, but weighs every slot of the pages the table names by 0, as P @ V does
                out, lse = run_backend(REFERENCE, c, None)
                return out + 0 * c.k[c.block_table.clamp(min=0)].sum(), lse
            return dataclasses.replace(REFERENCE.plan(p, dev, cfg, direction), launch=launch)

    from inductor_attn.backends import only_backends

    with only_backends(Leaky(), REFERENCE):
        result = gate_once(call, "leaky:default", "forward")
    assert result.status == "wrong" and "NaN past kv_seqlens" in result.reason


def test_problem_key_and_bucket():
    case = CASES["decode_gqa_page16"]
    p = _call(case, pi.make(case)).problem
    assert (p.op, p.page_size, p.batch, p.len_q, p.len_k, p.total_q) == ("paged", 16, 2, 1, 64, 2)
    assert Problem.from_key(p.key()) == p
    assert "page_size" not in Problem("attention", "float16", "cpu", 1, 4, 2, 1, 64, 32, 32).key()
    grown = dataclasses.replace(p, len_k=50, batch=3)
    assert grown.bucket() == dataclasses.replace(p, batch=4).bucket()


def _raises(error, match, **overrides):
    case = CASES["decode_gqa_page16"]
    x = pi.make(case)
    args = dict(q=x.q, k_cache=x.k_cache, v_cache=x.v_cache, block_table=x.block_table, kv_seqlens=x.kv_seqlens)
    args |= overrides
    with pytest.raises(error, match=match):
        inductor_attn.paged_attention(**args)


def test_bad_arguments_are_named():
    x = pi.make(CASES["decode_gqa_page16"])
    table, lens = x.block_table, x.kv_seqlens
    _raises(TypeError, "block_table must have dtype int32", block_table=table.long())
    _raises(ValueError, r"block_table must be an int32 torch.Tensor of shape \(num_seqs, pages", block_table=table[0])
    _raises(ValueError, r"kv_seqlens must have shape \(2,\)", kv_seqlens=lens[:1])
    _raises(TypeError, "kv_seqlens must have dtype int32", kv_seqlens=lens.long())
    _raises(ValueError, r"kv_seqlens values must be in \[0, 64\]", kv_seqlens=torch.tensor([65, 1], dtype=torch.int32))
    _raises(ValueError, r"kv_seqlens values must be in \[0, 64\].*min -1", kv_seqlens=torch.tensor([3, -1],
                                                                                                   dtype=torch.int32))
    bad = table.clone()
    bad[0, 0] = 10_000
    _raises(ValueError, r"block_table values must be in \[0, 7\).*\[10000\]", block_table=bad)
    _raises(ValueError, r"page_size .* must be in \[1, 256\], got 300", k_cache=torch.zeros(2, 300, 2, 32).half(),
            v_cache=torch.zeros(2, 300, 2, 32).half())
    _raises(ValueError, r"q heads \(4\) must be a multiple of k/v heads \(3\)",
            k_cache=torch.zeros(6, 16, 3, 32).half(), v_cache=torch.zeros(6, 16, 3, 32).half())
    _raises(ValueError, "k_cache and v_cache must share", v_cache=torch.zeros(6, 8, 2, 32).half())
    _raises(ValueError, "q.shape\\[0\\] must equal block_table.shape\\[0\\] \\(2\\)", q=x.q[:1])
    _raises(ValueError, r"q.shape\[0\] \(5\) must be at most num_seqs \* max_seqlen_q \(2 \* 2\)",
            q=torch.cat([x.q, x.q, x.q[:1]]), cu_seqlens_q=torch.tensor([0, 2, 5], dtype=torch.int32), max_seqlen_q=2)
    _raises(ValueError, r"without cu_seqlens_q, each sequence has one query: max_seqlen_q must be 1 .*got 2",
            max_seqlen_q=2)  # a decode kernel would run a second row per sequence into the same output
    _raises(ValueError, "layout must be one of", layout="NDH")
    _raises(ValueError, r"softcap must be >= 0 \(0 = no softcap\), got -1.0", softcap=-1.0)
    _raises(ValueError, "softcap must be finite, got nan", softcap=float("nan"))
    _raises(TypeError, "softcap must be a float, got str", softcap="50")
    _raises(TypeError, r"softcap must be a float, got a Tensor", softcap=torch.tensor(50.0))
    _raises(ValueError, "paged_attention is forward only .*: q requires grad while grad mode is on",
            q=x.q.float().requires_grad_(), k_cache=x.k_cache.float(), v_cache=x.v_cache.float())


def _strided(x: torch.Tensor, how: str) -> torch.Tensor:
    """The same values with another memory layout: a column-major table, or every other element of a wider one."""
    if how == "column-major":
        return x.t().contiguous().t()
    return torch.stack([x, torch.full_like(x, -7)], -1)[..., 0]  # stride 2; the other column holds garbage


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("name, what, how", [
    ("decode_gqa_page16", "block_table", "column-major"), ("decode_gqa_page16", "block_table", "every other"),
    ("decode_empty_sequence", "kv_seqlens", "every other"), ("chunked_prefill_causal", "cu_seqlens_q", "every other"),
])
def test_index_tensors_with_other_strides_give_the_same_attention(name, what, how, compiled, fresh_compile):
    """The kernels read lengths and table rows at index + 1: an index tensor strided otherwise is made unit
    stride for them (AttnCall), eager and compiled."""
    case = CASES[name]
    x = pi.make(case)
    if what == "block_table" and how == "column-major":
        assert _strided(x.block_table, how).stride(-1) != 1
    x = dataclasses.replace(x, **{what: _strided(getattr(x, what), how)})
    fn = inductor_attn.paged_attention
    if compiled:
        fn = torch.compile(fn, fullgraph=True)
    out, lse = fn(x.q, x.k_cache, x.v_cache, x.block_table, x.kv_seqlens, return_lse=True, **x.kwargs(case))
    _check_against_the_oracle(case, x, out, lse)
    assert any("triton_decode" in key for key in inductor_attn.stats())


def test_inputs_that_require_grad_are_taken_under_no_grad():
    x = pi.make(CASES["decode_gqa_page16"])
    k_cache = x.k_cache.clone().requires_grad_()
    with torch.no_grad():
        out = inductor_attn.paged_attention(x.q, k_cache, x.v_cache, x.block_table, x.kv_seqlens)
    torch.testing.assert_close(out, inductor_attn.paged_attention(x.q, x.k_cache, x.v_cache, x.block_table,
                                                                  x.kv_seqlens))


def test_table_entries_past_the_last_page_may_hold_anything():
    case = CASES["decode_gqa_page16"]
    x = pi.make(case)
    assert (x.block_table[:, -1] == -1).all()  # what transformers writes there
    inductor_attn.paged_attention(x.q, x.k_cache, x.v_cache, x.block_table, x.kv_seqlens)


def _serving_loop(fn, steps: int, grow: bool):
    """Decode steps whose lengths grow by one token each step, in a pool and a table of fixed sizes; with ``grow``
    the table gets wider and the pool larger too. Returns the outputs and their float64 oracles."""
    results = []
    for step in range(steps):
        sizes = dict(spare_pages=1) if grow else dict(width=16, num_blocks=40)
        case = pi.PagedCase(kv_lens=(5 + step, 30 + 3 * step), page_size=4, d=16, **sizes)
        x = pi.make(case, seed=step)
        out = fn(x.q, x.k_cache, x.v_cache, x.block_table, x.kv_seqlens)
        results.append((out, pi.oracle(case, x, case.d ** -0.5)[0]))
    return results


@pytest.mark.parametrize("grow,dynamic", [(False, None), (True, True)])
def test_a_compiled_serving_loop_compiles_once(grow, dynamic, fresh_compile):
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("inductor")

    @torch.compile(backend=counter, dynamic=dynamic, fullgraph=True)
    def step(q, k, v, table, lens):
        return inductor_attn.paged_attention(q, k, v, table, lens)

    for out, ref in _serving_loop(step, 6, grow):
        assert (out.double() - ref).norm() / ref.norm() < 5e-3
    assert counter.frame_count == 1


# ------------------------------------------------------------------------- decided while compiling
def _paged_fakes(monkeypatch, traceable: bool):
    """a (slower) and b (faster), both taking paged calls; b's plans traced into graphs where ``traceable``."""
    from fakes import FakeBackend, timed_with_fakes

    from inductor_attn.backends import only_backends

    a = FakeBackend("a", {"default": (1.0, 0.01)}, ops=("attention", "paged"))
    b = FakeBackend("b", {"x=1": (0.5, 0.01)}, traceable=traceable, ops=("attention", "paged"))
    timed_with_fakes(monkeypatch, a, b)
    return only_backends(a, b, REFERENCE)


def _tunes(monkeypatch) -> list:
    """The problems the tuner measures from now on, one entry per tune."""
    from inductor_attn.tuning import decisions

    tuned, real_tune = [], decisions.tune
    monkeypatch.setattr(decisions, "tune", lambda call, *a, **kw: tuned.append(call.problem)
                        or real_tune(call, *a, **kw))
    return tuned


def _paged_step(q, k, v, table, lens):
    return inductor_attn.paged_attention(q, k, v, table, lens, return_lse=True)


@pytest.mark.parametrize("traceable", [False, True])
def test_a_static_paged_call_is_decided_while_compiling(traceable, monkeypatch, fresh_compile):
    """No paged op call is left in compiled code: the plan's traced form is inlined (no op of ours runs), or the
    thin launch op names the plan decided at compile time."""
    from torch._inductor.utils import run_and_get_code

    case = pi.PagedCase(kv_lens=(37, 5, 0), page_size=4, d=16, width=12)
    x = pi.make(case)
    tuned = _tunes(monkeypatch)
    with _paged_fakes(monkeypatch, traceable), inductor_attn.tuning_mode("autotune"):
        (out, lse), (code,) = run_and_get_code(torch.compile(_paged_step, fullgraph=True), x.q, x.k_cache,
                                               x.v_cache, x.block_table, x.kv_seqlens)
    assert "inductor_attn.paged_attention" not in code
    if traceable:
        assert "torch.ops.inductor_attn" not in code
        assert inductor_attn.stats() == {"paged/forward -> b:x=1 (launched by compiled code, per graph)": 1}
    else:
        assert "torch.ops.inductor_attn.launch.default(" in code and "'forward|b:x=1|0.25,48,0.0|op=paged," in code
        assert inductor_attn.stats() == {"paged/forward -> b:x=1": 1}
    assert [p.op for p in tuned] == ["paged"]
    _check_against_the_oracle(case, x, out, lse)


def test_a_plan_whose_kernel_checks_a_paged_calls_indices_replaces_the_graphs_asserts(monkeypatch, fresh_compile):
    """The paged API's compiled checks (lengths, the block ids they reach) are device asserts of the graph; where
    the chosen plan's kernel makes them itself (split-K decode), only the kernel's checks are left."""
    from fakes import FAKE_KERNEL_CHECK, FakeBackend, timed_with_fakes
    from torch._inductor.utils import run_and_get_code

    from inductor_attn.backends import only_backends
    from inductor_attn.messages import PAGED_BLOCK_IDS, PAGED_KV_SEQLENS_VALUES

    b = FakeBackend("b", {"x=1": (0.5, 0.01)}, traceable=True, checks_indices=True, ops=("attention", "paged"))
    timed_with_fakes(monkeypatch, b)
    case = pi.PagedCase(kv_lens=(37, 5, 0), page_size=4, d=16, width=12)
    x = pi.make(case)
    with only_backends(b, REFERENCE), inductor_attn.tuning_mode("autotune"):
        fn = torch.compile(_paged_step, fullgraph=True)
        (out, lse), (code,) = run_and_get_code(fn, x.q, x.k_cache, x.v_cache, x.block_table, x.kv_seqlens)
        assert PAGED_KV_SEQLENS_VALUES not in code and PAGED_BLOCK_IDS not in code and FAKE_KERNEL_CHECK in code
        _check_against_the_oracle(case, x, out, lse)
        x.block_table[0, 0] = x.k_cache.shape[0]
        with pytest.raises(RuntimeError, match=FAKE_KERNEL_CHECK):
            fn(x.q, x.k_cache, x.v_cache, x.block_table, x.kv_seqlens)


def test_the_representative_paged_call_is_valid_and_fills_the_capacity():
    """The call tuned while compiling: a table naming pages of the pool, each once while there are enough,
    lengths in [1, max_seqlen_k], query runs that sum to q's tokens with none over max_seqlen_q."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from inductor_attn.lowering import emit
    from inductor_attn.ops.checks import check_paged_values

    with FakeTensorMode():
        q = torch.empty(12, 4, 16, dtype=torch.float16)
        pools = [torch.empty(n, 8, 2, 16, dtype=torch.float16) for n in (40, 5)]
        table, lens, cu = (torch.empty(3, 5, dtype=torch.int32), torch.empty(3, dtype=torch.int32),
                           torch.empty(4, dtype=torch.int32))
    for pool in pools:
        vals = dict(q=q, k_cache=pool, v_cache=pool, block_table=table, kv_seqlens=lens, cu_seqlens_q=cu,
                    max_seqlen_q=6, max_seqlen_k=37, scale=0.25, causal=True, window_left=-1, window_right=-1,
                    softcap=0.0)
        call = emit._concrete_call("paged", vals)
        check_paged_values(call.k, call.block_table, call.kv_seqlens, call.cu_seqlens_q, call.q, 6, 37)
        assert call.cu_seqlens_q.tolist() == [0, 4, 8, 12]
        if pool.shape[0] >= table.numel():
            assert call.block_table.unique().numel() == table.numel()
        assert (call.problem.op, call.problem.len_k, call.problem.page_size) == ("paged", 64, 8)
        assert (call.kv_seqlens >= 1).all() and (call.kv_seqlens <= 37).all()


def test_a_named_triton_decode_choice_reads_pages_through_the_launch_op(fresh_compile):
    """Under Triton's interpreter split-K decode has no traced form: the launch op runs its paged plan."""
    from torch._inductor.utils import run_and_get_code

    case = pi.PagedCase(kv_lens=(37, 5, 20), page_size=4, hq=4, hkv=2, d=16, q_lens=(2, 1, 2))
    x = pi.make(case)
    choice = "triton_decode:block_n=16,num_splits=2,num_warps=4"
    op = torch.ops.inductor_attn.paged_attention

    def fn(q, k, v, table, lens, cu):
        return op(q, k, v, table, lens, cu, 2, table.shape[1] * 4, case.d ** -0.5, True, -1, -1, 0.0, choice)

    (out, lse), (code,) = run_and_get_code(torch.compile(fn, fullgraph=True), x.q, x.k_cache, x.v_cache,
                                           x.block_table, x.kv_seqlens, x.cu_seqlens_q)
    assert f"'forward|{choice}|" in code and "inductor_attn.paged_attention" not in code
    assert inductor_attn.stats() == {f"paged/forward -> {choice}": 1}
    _check_against_the_oracle(case, x, out, lse)


@pytest.mark.parametrize("traceable", [False, True])
def test_a_compiled_serving_loop_compiles_once_and_tunes_each_bucket_once(traceable, monkeypatch, fresh_compile):
    """50 decode steps whose lengths grow by one token each, over three layers in two buckets (page sizes 4 and 8),
    pools and tables of fixed sizes: one compile, one tune per bucket, every step's outputs right."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("inductor")
    tuned = _tunes(monkeypatch)

    @torch.compile(backend=counter, fullgraph=True)
    def step(q, layers, lens):
        return [inductor_attn.paged_attention(q, k, v, table, lens) for k, v, table in layers]

    with _paged_fakes(monkeypatch, traceable), inductor_attn.tuning_mode("autotune"):
        for i in range(50):
            cases = [pi.PagedCase(kv_lens=(5 + i, 9 + i), page_size=ps, d=16, width=64 // ps,
                                  num_blocks=2 * (64 // ps) + 3) for ps in (4, 8, 4)]
            first = pi.make(cases[0], seed=3 * i)
            inputs = [first] + [dataclasses.replace(pi.make(case, seed=3 * i + j), q=first.q)
                                for j, case in enumerate(cases[1:], 1)]
            outs = step(first.q, [(x.k_cache, x.v_cache, x.block_table) for x in inputs], first.kv_seqlens)
            if i % 7 == 0 or i == 49:
                for case, x, out in zip(cases, inputs, outs):
                    ref = pi.oracle(case, x, case.d ** -0.5)[0]
                    assert check_tensor("output", out, ref, case.dtype) is None
    assert counter.frame_count == 1
    assert sorted(p.page_size for p in tuned) == [4, 8]
    # decided while compiling: the plan runs from generated code, or from the launch op with no decision per call
    assert inductor_attn.stats() == ({"paged/forward -> b:x=1 (launched by compiled code, per graph)": 3}
                                     if traceable else {"paged/forward -> b:x=1": 150})
    assert len(inductor_attn.cache.list_decisions()) == 2


def test_the_representative_paged_call_copies_the_pages_its_table_can_name_not_the_servers_pool():
    """A server's pool is most of the GPU's memory: the call tuned while compiling holds the pages its table can
    name, plus one, as the tuner's own fresh pools do, in the pool's stride order."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from inductor_attn.lowering import emit

    with FakeTensorMode():
        q = torch.empty(3, 4, 16, dtype=torch.float16)
        pool = torch.empty(1000, 2, 8, 16, dtype=torch.float16).transpose(1, 2)  # HND storage, 1,000 pages
        table, lens = torch.empty(3, 5, dtype=torch.int32), torch.empty(3, dtype=torch.int32)
    vals = dict(q=q, k_cache=pool, v_cache=pool, block_table=table, kv_seqlens=lens, cu_seqlens_q=None,
                max_seqlen_q=1, max_seqlen_k=37, scale=0.25, causal=False, window_left=-1, window_right=-1,
                softcap=0.0)
    call = emit._concrete_call("paged", vals)
    assert call.k.shape == call.v.shape == (16, 8, 2, 16)
    assert call.k.stride() == call.v.stride() == (256, 16, 128, 1) and int(call.block_table.max()) < 16


@pytest.mark.parametrize("compiled", [False, True])
def test_max_seqlen_q_is_a_bound_on_any_chunk_not_the_steps_longest(compiled, fresh_compile):
    """As in FlashAttention, a bound: a serving loop passes one for steps of any size (using.md's example passes
    16 for chunks of 5 and 6 queries), which was refused as more than the step's query tokens."""
    case = CASES["chunked_prefill_causal"]
    x = pi.make(case)
    fn = torch.compile(inductor_attn.paged_attention, fullgraph=True) if compiled else inductor_attn.paged_attention
    kwargs = x.kwargs(case) | {"max_seqlen_q": 10_000}
    out, lse = fn(x.q, x.k_cache, x.v_cache, x.block_table, x.kv_seqlens, return_lse=True, **kwargs)
    _check_against_the_oracle(case, x, out, lse)
    assert paged_call(x.q, x.k_cache, x.v_cache, x.block_table, x.kv_seqlens, x.cu_seqlens_q, 10_000, 64, 0.1,
                      True, -1, 0).max_seqlen_q == x.q.shape[0]
