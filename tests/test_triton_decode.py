"""Split-K decode backend on the CPU, through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET).

Shapes are tiny so the interpreter stays fast; tests/test_triton_decode_gpu.py sweeps real sizes on a GPU.
Every run writes into outputs and a workspace poisoned with NaN, so an element a kernel forgets to write
fails the comparison.
"""

from __future__ import annotations

import dataclasses
import doctest
import math
import os
import re

import naive
import pytest
import torch
from blocked_imports import run_without
from interpreter_bounds import bounds_checked

from inductor_attn.backends import (REFERENCE, AttnCall, Config, enumerate_candidates, only_backends, run_backend,
                                    run_backend_backward)
from inductor_attn.backends import triton_decode as decode
from inductor_attn.device import DeviceInfo, device_info, parse_device_override
from inductor_attn.ops.attention import attention_op
from inductor_attn.messages import KV_SEQLENS_VALUES, device_message
from inductor_attn.problem import Problem
from inductor_attn.tuning.correctness import check_output

H100 = parse_device_override("sm_90")
CPU = DeviceInfo("cpu", (0, 0), 2)


@dataclasses.dataclass(frozen=True)
class Case:
    b: int = 1
    hq: int = 4
    hkv: int = 2
    lq: int = 1
    lk: int = 100
    d: int = 32
    dv: int | None = None
    dtype: torch.dtype = torch.float16
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    seqlens: tuple[int, ...] | None = None
    block_n: int = 32
    splits: int = 4
    layout: str = "contiguous"  # or "bshd" (k/v as transposed views) or "cache_slice"
    key_mask: str | None = None  # "random", "left_pad" or "shared" (one row expanded over the batch)


def _kv(case: Case, dim: int, gen: torch.Generator) -> torch.Tensor:
    shape = (case.b, case.hkv, case.lk, dim)
    if case.layout == "bshd":  # a (B, L, H, D) cache viewed as (B, H, L, D): strides are not BHLD
        return torch.randn(case.b, case.lk, case.hkv, dim, generator=gen).to(case.dtype).transpose(1, 2)
    if case.layout == "cache_slice":  # the first lk positions of a longer, preallocated cache
        return torch.randn(case.b, case.hkv, case.lk + 24, dim, generator=gen).to(case.dtype)[:, :, : case.lk]
    return torch.randn(*shape, generator=gen).to(case.dtype)


def _call(case: Case, seed: int = 0) -> AttnCall:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(case.b, case.lq, case.hq, case.d, generator=gen).to(case.dtype).transpose(1, 2)
    k, v = _kv(case, case.d, gen), _kv(case, case.dv or case.d, gen)
    seqlens = None if case.seqlens is None else torch.tensor(case.seqlens, dtype=torch.int32)
    return AttnCall("attention", q, k, v, case.d ** -0.5, case.causal, *case.window, kv_seqlens=seqlens,
                    key_mask=_key_mask(case, gen))


def _key_mask(case: Case, gen: torch.Generator) -> torch.Tensor | None:
    if case.key_mask == "random":
        return torch.rand(case.b, case.lk, generator=gen) < 0.6
    if case.key_mask == "left_pad":  # what generate() passes for a left-padded batch: batch i skips 7 * i keys
        return torch.arange(case.lk)[None, :] >= 7 * torch.arange(case.b)[:, None]
    if case.key_mask == "shared":
        return (torch.rand(1, case.lk, generator=gen) < 0.5).expand(case.b, case.lk)
    return None


def float64_reference(call: AttnCall):
    exact = dataclasses.replace(call, q=call.q.double(), k=call.k.double(), v=call.v.double(), _problem=None)
    return run_backend(REFERENCE, exact, Config())


def run_poisoned(call: AttnCall, cfg: Config):
    """Launch into NaN-filled outputs and a NaN-filled workspace (tests/test_triton_decode_gpu.py too)."""
    b, hq, lq, _ = call.q.shape
    dv, splits = call.v.shape[-1], int(cfg["num_splits"])
    ws = decode.workspace(call.q.device, b, hq, lq, dv, splits)
    for buf in ws:
        buf.fill_(float("nan"))
    out = torch.full((b, hq, lq, dv), float("nan"), dtype=call.q.dtype, device=call.q.device)
    lse = torch.full((b, hq, lq), float("nan"), dtype=torch.float32, device=call.q.device)
    decode.DecodePlan(call.problem, device_info(call.q.device), cfg).run(call, out, lse, ws)
    return out, lse


def _cfg(case: Case) -> Config:
    return Config.of(block_n=case.block_n, num_splits=case.splits, num_warps=4)


CASES = {
    "mha_lq1": Case(hq=2, hkv=2),
    "gqa4_causal_bf16_nonpow2_d": Case(hq=8, hkv=2, lq=3, lk=130, d=40, dtype=torch.bfloat16, causal=True,
                                       splits=2),
    "mqa_fp32_left_window_more_splits_than_blocks": Case(hq=8, hkv=1, lq=2, lk=96, d=64, dtype=torch.float32,
                                                         window=(16, 0), splits=8),
    "kv_seqlens_0_short_and_full_causal": Case(b=3, lq=4, lk=70, causal=True, seqlens=(0, 2, 70), splits=4),
    "two_row_blocks_g8_lq16": Case(hq=8, hkv=1, lq=16, lk=64, d=16, dtype=torch.bfloat16, causal=True,
                                   splits=2),
    "bshd_views_dv_ne_d_two_sided_window": Case(b=2, lq=2, lk=90, d=48, dv=32, window=(8, 4), layout="bshd"),
    "cache_slice_single_split_seqlens": Case(b=2, hq=4, hkv=1, lq=2, lk=80, causal=True, seqlens=(33, 80),
                                             splits=1, layout="cache_slice"),
    "dv96_two_combine_column_chunks": Case(lq=2, lk=70, d=80, dv=96, causal=True, splits=4),
    "left_window_right_unbounded_block64": Case(lq=3, lk=150, window=(10, -1), block_n=64, splits=2,
                                                dtype=torch.float32),
    "key_mask_random_gqa": Case(b=2, hq=8, hkv=2, lk=130, key_mask="random", splits=4),
    "key_mask_left_pad_with_seqlens_causal": Case(b=3, lq=2, lk=70, causal=True, seqlens=(70, 40, 9),
                                                  key_mask="left_pad", splits=2),
    "key_mask_shared_stride0_single_split": Case(b=2, lk=64, key_mask="shared", splits=1),
}


@pytest.mark.parametrize("name", CASES)
def test_matches_float64_reference(name):
    """Outputs right, and every load and store inside the kernels' arguments."""
    case = CASES[name]
    call = _call(case)
    with bounds_checked():
        out, lse = run_poisoned(call, _cfg(case))
    ref_out, ref_lse = float64_reference(call)
    assert check_output(out, lse, ref_out, ref_lse, case.dtype) is None


def test_matches_naive_oracle_with_kv_seqlens():
    # not causal: naive.dense_mask's in-place `ok &= ...` cannot broadcast (1, Lk) to (Lq, Lk) yet
    case = Case(b=3, hq=4, hkv=1, lq=4, lk=70, seqlens=(0, 2, 70), splits=4)
    call = _call(case, seed=1)
    out, lse = run_poisoned(call, _cfg(case))
    ref_out, ref_lse = naive.dense(call.q, call.k, call.v, call.scale, kv_seqlens=call.kv_seqlens)
    assert check_output(out, lse, ref_out, ref_lse, case.dtype) is None


def test_fully_masked_rows_give_zero_output_and_minus_inf_lse():
    case = Case(b=2, lq=4, lk=40, causal=True, seqlens=(0, 2), splits=2)
    out, lse = run_poisoned(_call(case), _cfg(case))
    assert not out.isnan().any() and not lse.isnan().any()
    assert (out[0] == 0).all() and (lse[0] == -math.inf).all()
    # n = 2 keys and 4 queries, lower-right aligned: queries 0 and 1 see no key, 2 and 3 see some
    assert (lse[1, :, :2] == -math.inf).all() and (out[1, :, :2] == 0).all()
    assert torch.isfinite(lse[1, :, 2:]).all()


@pytest.mark.parametrize("splits", [1, 4])
def test_without_an_lse_the_kernels_write_the_same_output(splits):
    """Compiled inference asks for no lse (``traced_out_only``): the kernels skip its stores, out is unchanged."""
    case = Case(b=2, lq=2, lk=70, causal=True, seqlens=(33, 70), splits=splits)
    call = _call(case)
    want, _ = run_poisoned(call, _cfg(case))
    out = torch.full_like(want, float("nan"))
    decode.DecodePlan(call.problem, device_info(call.q.device), _cfg(case)).run(call, out, None)
    assert torch.equal(out, want)


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("seqlens", [None, (33, 70)])
@pytest.mark.parametrize("with_lse", [True, False])
def test_unread_pointers_are_none_and_no_written_tensor_is_passed_twice(splits, seqlens, with_lse):
    """Traced into a compiled graph (``wrap_triton``), a launch whose unread pointer argument aliases a written
    tensor is made functional wrongly (on an H200 Inductor returned a clone of the output that nothing wrote), and
    a graph input there reads as mutated (CUDA graphs skipped). Unread pointers are None, which Triton and Inductor
    take as a constant."""
    case = Case(b=2, lq=2, lk=70, causal=True, seqlens=seqlens, splits=splits)
    call = _call(case)
    launches = []

    def recording(kernel):
        class Grid:
            def __getitem__(self, grid):
                return lambda *args, **kw: launches.append((kernel, args))
        return Grid()

    out = torch.empty(2, 4, 2, 32, dtype=case.dtype)
    lse = torch.empty(2, 4, 2) if with_lse else None
    decode.DecodePlan(call.problem, device_info(call.q.device), _cfg(case)).run(call, out, lse, launcher=recording)
    assert len(launches) == (1 if splits == 1 else 2)
    reads = {id(t) for t in (call.q, call.k, call.v, call.kv_seqlens) if t is not None}
    for kernel, args in launches:
        names = kernel.arg_names[:len(args)]
        given = dict(zip(names, args))
        for name in ("SEQLENS", "KEY_MASK", "TABLE", "CU_Q"):
            if name in given and not (name == "SEQLENS" and seqlens):
                assert given[name] is None, name
        if not with_lse and (splits == 1 or kernel is decode._decode_combine):
            assert given["LSE"] is None
        written = [id(t) for t in args if isinstance(t, torch.Tensor) and id(t) not in reads]
        assert len(written) == len(set(written)), "a written tensor is also passed as another argument"


@pytest.mark.parametrize("lengths, stops", [((5, 70), False), ((0, 71), True), ((-1, 3), True)])
def test_compiled_codes_kernel_asserts_kv_seqlens_values_itself(monkeypatch, lengths, stops):
    """Asked by compiled code (``check_indices``), the partial kernel stops where a length is outside [0, Lk],
    with the API's message. Triton keeps device asserts only when compiling with ``debug``, as Inductor
    compiles the kernels it launches; the interpreter is told so through its builder's options."""
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    monkeypatch.setattr(builder, "options", dataclasses.replace(builder.options, debug=True))
    call = _call(Case(b=2, lk=70, seqlens=lengths, splits=2))
    plan = decode.DecodePlan(call.problem, device_info(call.q.device), _cfg(Case(splits=2)))
    out, lse = plan.outputs(call)
    plan.run(call, out, lse)  # not asked: no check
    if stops:
        with pytest.raises(Exception, match=re.escape(device_message(KV_SEQLENS_VALUES))):
            plan.run(call, out, lse, check_indices=True)
    else:
        plan.run(call, out, lse, check_indices=True)



@pytest.mark.parametrize("splits", decode.SPLITS)
def test_every_num_splits_matches_reference(splits):
    case = Case(hq=4, hkv=1, lq=2, lk=300, causal=True, splits=splits)
    call = _call(case, seed=2)
    out, lse = run_poisoned(call, _cfg(case))
    assert check_output(out, lse, *float64_reference(call), case.dtype) is None


def test_the_most_splits_each_with_keys_merge_in_narrow_column_chunks():
    """512 splits of one 16-key block each (one sequence shorter, so its last splits see none): the combine
    reads 512 partials per row in 16-column chunks (_COMBINE_TILE), not 64."""
    case = Case(b=2, hq=4, hkv=1, lk=512 * 16, d=64, dtype=torch.bfloat16, block_n=16, splits=512,
                seqlens=(512 * 16, 3000))
    call = _call(case, seed=4)
    out, lse = run_poisoned(call, _cfg(case))
    assert check_output(out, lse, *float64_reference(call), case.dtype) is None


def test_default_config_runs_through_the_custom_op():
    case = Case(b=2, hq=4, hkv=2, lq=1, lk=64, causal=True, seqlens=(64, 17))
    call = _call(case, seed=3)
    with only_backends(REFERENCE, decode.BACKEND):
        out, lse = attention_op(call.q, call.k, call.v, call.scale, True, -1, -1, call.kv_seqlens, None,
                                "triton_decode:default")
    assert check_output(out, lse, *float64_reference(call), case.dtype) is None


# ------------------------------------------------------------------------------------ supports/configs
def _problem(**kw) -> Problem:
    base = dict(op="attention", dtype="bfloat16", device_type="cuda", batch=1, heads_q=32, heads_kv=16,
                len_q=1, len_k=4096, head_dim=256, head_dim_v=256)
    return Problem(**(base | kw))


@pytest.mark.parametrize("kw, reason", [
    (dict(len_q=4096), "split-K decode is for Lq <= 16, got 4096"),
    (dict(dtype="float64"), "dtype float64 not supported (float16, bfloat16, float32)"),
    (dict(head_dim=8, head_dim_v=8), "head_dim must be in [16, 256], got 8"),
    (dict(head_dim_v=512), "head_dim_v must be in [16, 256], got 512"),
])
def test_supports_explains_what_it_cannot_run(kw, reason):
    listed = enumerate_candidates(_problem(**kw), H100)
    assert [c.pruned for c in listed if c.backend == "triton_decode"] == [reason]


def test_a_backend_that_does_not_run_an_op_is_no_candidate_for_it():
    assert not [c for c in enumerate_candidates(_problem(op="varlen"), H100) if c.backend == "triton_decode"]


def test_supports_decode_shapes_including_lq16_and_non_pow2_head_dim():
    assert decode.BACKEND.supports(_problem(len_q=16, head_dim=72, head_dim_v=72), H100) is None


def test_cpu_problems_need_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert decode.BACKEND.supports(_problem(device_type="cpu"), CPU) == "needs a CUDA device"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert decode.BACKEND.supports(_problem(device_type="cpu"), CPU) is None


def test_configs_list_every_num_splits_with_unique_parseable_names():
    cfgs = [c.config for c in decode.BACKEND.configs(_problem(), H100)]
    assert {c["num_splits"] for c in cfgs} == set(decode.SPLITS)
    names = [str(c) for c in cfgs]
    assert len(set(names)) == len(names) and all(Config.parse(n) == c for n, c in zip(names, cfgs))


def test_prune_drops_splits_that_would_get_no_kv_block():
    p = _problem(len_k=512, head_dim=128, head_dim_v=128)
    cfg = Config.of(block_n=64, num_splits=64, num_warps=4)
    assert decode._pruned(p, H100, cfg) == "num_splits 64 > kv blocks 8"
    assert decode._pruned(p, H100, Config.of(block_n=64, num_splits=8, num_warps=4)) is None


def test_prune_counts_only_the_keys_a_window_can_see():
    p = _problem(len_k=16384, window_left=127, head_dim=128, head_dim_v=128)
    assert decode._pruned(p, H100, Config.of(block_n=32, num_splits=8, num_warps=4)) == \
        "num_splits 8 > kv blocks 4"


def test_prune_drops_tiles_that_exceed_shared_memory():
    reason = decode._pruned(_problem(dtype="float32"), H100, Config.of(block_n=64, num_splits=1,
                                                                               num_warps=4))
    assert reason is not None and reason.startswith("block_n 64 at D 256 (float32) needs ~")


def test_candidates_for_a_decode_problem_keep_their_reasons():
    with only_backends(REFERENCE, decode.BACKEND):
        cands = enumerate_candidates(_problem(len_k=256), H100)
    pruned = {c.name: c.pruned for c in cands if c.backend == "triton_decode"}
    assert pruned["triton_decode:block_n=32,num_splits=8,num_warps=4"] is None
    assert pruned["triton_decode:block_n=32,num_splits=16,num_warps=4"] == "num_splits 16 > kv blocks 8"


def test_more_than_128_splits_are_candidates_only_where_128_leave_the_sms_short_of_programs():
    def pruned(**kw):
        with only_backends(REFERENCE, decode.BACKEND):
            cands = enumerate_candidates(_problem(len_k=16384, **kw), H100)
        return {int(c.config["num_splits"]): c.pruned for c in cands if c.backend == "triton_decode"}

    few = pruned(heads_q=16, heads_kv=2)  # 2 programs a split: 256 at 128 splits, under 4 per SM
    assert few[256] is None and few[512] is None
    many = pruned(heads_q=32, heads_kv=16)  # 16 programs a split: 2048 at 128 splits
    assert many[128] is None and many[256].startswith("num_splits 256 > 128, where 128 splits already make 2048")


def test_default_config_fills_the_gpu_with_splits_but_not_past_the_kv_blocks():
    # B1 Hkv2 leaves 2 programs without splitting; ~2 per SM on 132 SMs wants 128 splits
    assert decode._default_config(_problem(heads_q=16, heads_kv=2, len_k=16384), H100)["num_splits"] == 128
    assert decode._default_config(_problem(heads_q=16, heads_kv=2, len_k=256), H100)["num_splits"] == 8


def test_backend_is_inference_only():
    assert decode.BACKEND.takes.backward is False
    with pytest.raises(NotImplementedError):
        run_backend_backward(decode.BACKEND, None, Config(), None, None, None, None)


def test_module_doctests_pass():
    assert doctest.testmod(decode).failed == 0


def test_interpreter_is_on_for_these_tests():
    assert torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def test_module_imports_and_explains_itself_without_triton():
    """The registry imports this backend on every install; a missing Triton must give a reason, not an
    ImportError. Run in a fresh interpreter whose import of triton fails."""
    code = (
        "from inductor_attn.backends import triton_decode as decode\n"
        "from inductor_attn.device import parse_device_override\n"
        "from inductor_attn.problem import Problem\n"
        "p = Problem('attention', 'bfloat16', 'cuda', 1, 8, 2, 1, 4096, 128, 128)\n"
        "print(decode.BACKEND.supports(p, parse_device_override('sm_90')))\n"
    )
    assert run_without(("triton",), code) == "needs triton (not installed)"


def test_configs_sweep_num_splits_around_one_default_tile():
    from inductor_attn.backends.triton_decode import BACKEND, SPLITS
    from inductor_attn.device import DeviceInfo
    from inductor_attn.problem import Problem

    p = Problem("attention", "bfloat16", "cuda", 1, 32, 16, 1, 16384, 256, 256)
    cfgs = [c.config for c in BACKEND.configs(p, DeviceInfo("NVIDIA H100", (9, 0), 132))]
    assert {int(c["num_splits"]) for c in cfgs} == set(SPLITS)
    assert len(cfgs) == len({str(c) for c in cfgs}) <= len(SPLITS) + 4


def test_heuristic_is_the_split_k_hand_rule():
    from inductor_attn.backends.triton_decode import BACKEND
    from inductor_attn.device import DeviceInfo
    from inductor_attn.problem import Problem

    dev = DeviceInfo("NVIDIA H100", (9, 0), 132)
    short = Problem("attention", "bfloat16", "cuda", 1, 32, 16, 1, 255, 128, 128)
    assert BACKEND.heuristic(short, dev) is None
    long = Problem("attention", "bfloat16", "cuda", 1, 32, 16, 1, 4096, 128, 128)
    assert int(BACKEND.heuristic(long, dev)["num_splits"]) == 16  # cdiv(4096, 256)


def test_pdl_helpers_are_where_decode_imports_them():
    # Programmatic dependent launch needs Triton's griddepcontrol helpers; without them decode silently
    # loses PDL on sm_90+ (its launch gaps came back: 32.1 vs 30.4 us per call, H100)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    assert decode.gdc_wait is gdc_wait and decode.gdc_launch_dependents is gdc_launch_dependents
