"""Triton flash forward against the naive float64 oracle, in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 without a GPU). Tiny shapes and 16 x 16 tiles so every case still spans several query
and key tiles; outputs are poisoned with NaN so an element the kernel never writes fails the check."""

from __future__ import annotations

import dataclasses
import itertools
import sys
import types

import naive
import pytest
import torch
from blocked_imports import run_without
from interpreter_bounds import bounds_checked

from inductor_attn.backends import (enumerate_candidates, only_backends, run_backend, run_backend_backward,
                                    source_hash)
from inductor_attn.backends.base import AttnCall, Candidate, Config
from inductor_attn.backends.triton_flash import flash
from inductor_attn.block_mask import BlockSparseMask
from inductor_attn.device import DeviceInfo, parse_device_override
from inductor_attn.layout import empty_like_layout
from inductor_attn.problem import Problem
from inductor_attn.tuning.correctness import check_output

SM90 = parse_device_override("sm_90")
SMALL = dict(block_m=16, block_n=16, num_warps=4, num_stages=1)


def small(schedule="tile", **extra) -> Config:
    return Config.of(**SMALL, schedule=schedule, **extra)


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every forward writes into NaN-filled out/lse: unwritten elements show up as errors; and every load and
    store of the kernels stays inside their arguments."""
    real = flash.new_outputs

    def poisoned(call):
        out, lse = real(call)
        return out.fill_(float("nan")), lse.fill_(float("nan"))

    monkeypatch.setattr(flash, "new_outputs", poisoned)
    with bounds_checked():
        yield


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


def assert_matches(out, lse, ref_out, ref_lse, dtype):
    assert out.dtype == dtype and lse.dtype == torch.float32
    reason = check_output(out, lse, ref_out, ref_lse, dtype)
    assert reason is None, reason


def dense_case(b, hq, hkv, lq, lk, d, dv, causal=False, wl=-1, wr=-1, kv_lens=None, dtype=torch.float32):
    q, k, v = rand(b, hq, lq, d, dtype=dtype), rand(b, hkv, lk, d, dtype=dtype), rand(b, hkv, lk, dv, dtype=dtype)
    lens = None if kv_lens is None else torch.tensor(kv_lens, dtype=torch.int32)
    return AttnCall("attention", q, k, v, d**-0.5, causal, wl, wr, lens)


def visible(lq, lk, causal=False, wl=-1, wr=-1, n=None) -> torch.Tensor:
    """Bool (Lq, Lk): query i sees key j iff j < n and diag - wl <= j <= diag + right, diag = i + n - Lq.
    (naive.dense_mask would do, but its in-place ``&=`` cannot broadcast (1, Lk) to (Lq, Lk).)"""
    n = lk if n is None else n
    diag = torch.arange(lq)[:, None] + (n - lq)
    j = torch.arange(lk)[None, :]
    ok = (j < n).expand(lq, lk)
    right = 0 if causal else wr
    if right >= 0:
        ok = ok & (j <= diag + right)
    if wl >= 0:
        ok = ok & (j >= diag - wl)
    return ok


def oracle_dense(q, k, v, scale, causal=False, wl=-1, wr=-1, kv_lens=None):
    lq, lk = q.shape[2], k.shape[2]
    if kv_lens is None:
        return naive.attend(q, k, v, visible(lq, lk, causal, wl, wr), scale)
    mask = torch.stack([visible(lq, lk, causal, wl, wr, int(n)) for n in kv_lens])[:, None]
    return naive.attend(q, k, v, mask, scale)


def oracle_varlen(call: AttnCall):
    outs, lses = [], []
    cu_q, cu_k = call.cu_seqlens_q.tolist(), call.cu_seqlens_k.tolist()
    for (q0, q1), (k0, k1) in zip(zip(cu_q, cu_q[1:]), zip(cu_k, cu_k[1:])):
        qs, ks, vs = (x.transpose(0, 1)[None] for x in (call.q[q0:q1], call.k[k0:k1], call.v[k0:k1]))
        mask = visible(q1 - q0, k1 - k0, call.causal, call.window_left, call.window_right)
        o, lse = naive.attend(qs, ks, vs, mask, call.scale)
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


def check_dense(call: AttnCall, cfg: Config):
    out, lse = run_backend(flash.BACKEND, call, cfg)
    ref = oracle_dense(call.q, call.k, call.v, call.scale, call.causal, call.window_left, call.window_right,
                       call.kv_seqlens)
    assert_matches(out, lse, *ref, call.q.dtype)


DENSE = {
    "plain": dict(b=2, hq=2, hkv=2, lq=20, lk=20, d=16, dv=16),
    "causal_lq_lt_lk_odd": dict(b=1, hq=2, hkv=2, lq=13, lk=37, d=24, dv=24, causal=True),
    "causal_lq_gt_lk_rows_see_nothing": dict(b=1, hq=2, hkv=1, lq=37, lk=13, d=16, dv=16, causal=True),
    "window_left_right": dict(b=2, hq=2, hkv=2, lq=33, lk=33, d=16, dv=16, wl=5, wr=3),
    "causal_window_dv_differs": dict(b=1, hq=4, hkv=2, lq=40, lk=40, d=24, dv=40, causal=True, wl=7),
    "kv_seqlens_causal_with_empty_batch": dict(b=3, hq=2, hkv=2, lq=19, lk=33, d=16, dv=16, causal=True,
                                               kv_lens=[33, 10, 0]),
    "mqa_window_left_only_d64": dict(b=2, hq=6, hkv=1, lq=29, lk=29, d=64, dv=16, wl=9),
    "gqa3_noncausal": dict(b=1, hq=6, hkv=2, lq=17, lk=23, d=16, dv=16),
    "one_query_one_key": dict(b=2, hq=2, hkv=1, lq=1, lk=1, d=16, dv=16, causal=True),
}
VARIANTS = {
    "tile": small("tile"),
    "persistent": small("persistent"),
    "lpt": small("lpt"),
    "tile_unpacked": small("tile", pack_gqa=False),
    "lpt_tma": small("lpt", tma=True),  # the interpreter emulates TMA descriptors
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", DENSE)
def test_dense_matches_naive(case, variant):
    torch.manual_seed(0)
    check_dense(dense_case(**DENSE[case]), VARIANTS[variant])


def test_half_precision_causal_gqa_matches_naive():
    """float16 only: the interpreter's bfloat16 dot is broken, so bfloat16 is covered by the GPU tests."""
    torch.manual_seed(1)
    check_dense(dense_case(2, 4, 2, 23, 31, 24, 24, causal=True, dtype=torch.float16), small("persistent"))


def test_every_listed_config_matches_naive():
    torch.manual_seed(2)
    call = dense_case(1, 4, 2, 40, 40, 16, 16, causal=True, wl=20, dtype=torch.float16)
    cfgs = [c.config for c in flash.BACKEND.configs(call.problem, DeviceInfo("cpu", (0, 0), 2))]
    assert {c["schedule"] for c in cfgs} == {"tile", "persistent", "lpt"}
    for cfg in cfgs:
        check_dense(call, cfg)


def test_strided_inputs_are_read_in_place():
    """q is a (B, L, H, D) buffer seen as (B, H, L, D); k has a non-unit head-dim stride; v is a slice."""
    torch.manual_seed(3)
    b, hq, hkv, lq, lk, d = 2, 4, 2, 21, 26, 24
    q = rand(b, lq, hq, d).transpose(1, 2)
    k = rand(b, hkv, d, lk).transpose(2, 3)
    v = rand(b, hkv, lk, 2 * d)[..., 3 : 3 + d]
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    for causal in (False, True):
        check_dense(AttnCall("attention", q, k, v, 0.3, causal), small("persistent"))


def test_output_follows_q_stride_order_and_lse_is_contiguous():
    torch.manual_seed(3)
    q = rand(2, 9, 4, 16).transpose(1, 2)  # (B, L, H, D) memory
    call = AttnCall("attention", q, rand(2, 2, 11, 16), rand(2, 2, 11, 24), 0.25, True)
    out, lse = run_backend(flash.BACKEND, call, small())
    assert out.shape == (2, 4, 9, 24) and out.stride() == empty_like_layout(q, out.shape).stride()
    assert lse.is_contiguous()
    assert_matches(out, lse, *oracle_dense(call.q, call.k, call.v, 0.25, True), torch.float32)


def test_fully_masked_rows_give_zero_output_and_neg_inf_lse():
    torch.manual_seed(4)
    call = dense_case(1, 2, 2, 20, 8, 16, 16, causal=True)  # rows 0..11 see no key
    out, lse = run_backend(flash.BACKEND, call, small())
    assert torch.equal(out[:, :, :12], torch.zeros_like(out[:, :, :12]))
    assert torch.isneginf(lse[:, :, :12]).all() and torch.isfinite(lse[:, :, 12:]).all()


def test_kv_tiles_outside_the_band_are_never_read():
    """Every row sees keys 44..63 only; NaN in keys 0..31 (two whole 16-key tiles) must never be loaded."""
    torch.manual_seed(5)
    call = dense_case(1, 2, 1, 16, 64, 16, 16, causal=True, wl=4)
    clean = (call.k.clone(), call.v.clone())
    call.k[:, :, :32] = float("nan")
    call.v[:, :, :32] = float("nan")
    out, lse = run_backend(flash.BACKEND, call, small())
    ref = oracle_dense(call.q, *clean, call.scale, True, 4)
    assert_matches(out, lse, *ref, torch.float32)


@pytest.mark.parametrize("tma", [False, True])
def test_nan_keys_past_kv_seqlens_never_reach_the_output(tma):
    """Pointer loads never read them; TMA tiles do read them (whole tiles) and must zero V there."""
    torch.manual_seed(6)
    call = dense_case(2, 2, 2, 9, 40, 16, 16, kv_lens=[5, 20])
    clean = (call.k.clone(), call.v.clone())
    call.k[0, :, 5:] = call.v[0, :, 5:] = float("nan")
    call.k[1, :, 20:] = call.v[1, :, 20:] = float("nan")
    out, lse = run_backend(flash.BACKEND, call, small(tma=tma))
    assert_matches(out, lse, *oracle_dense(call.q, *clean, call.scale, kv_lens=call.kv_seqlens), torch.float32)


def test_tma_configs_fall_back_to_pointer_loads_where_tma_cannot_read(monkeypatch):
    seen = []
    real = flash._kv_descriptors
    monkeypatch.setattr(flash, "_kv_descriptors", lambda call, cfg: seen.append(real(call, cfg)) or seen[-1])
    torch.manual_seed(11)
    aligned = dense_case(1, 2, 1, 17, 20, 16, 16, causal=True)
    check_dense(aligned, small(tma=True))
    misaligned_k = rand(1, 1, 20, 17)[..., 1:]  # base 4 bytes past an aligned address
    check_dense(AttnCall("attention", aligned.q, misaligned_k, aligned.v, 0.25, True), small(tma=True))
    assert seen[0] is not None and seen[1] is None


# ---------------------------------------------------------------------------------------------- varlen
def varlen_case(lens_q, lens_k, hq, hkv, d, causal=False, wl=-1, wr=-1, dtype=torch.float32):
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    q = rand(int(cu_q[-1]), hq, 2 * d, dtype=dtype)[..., :d]  # strided: a slice of a wider buffer
    k, v = rand(int(cu_k[-1]), hkv, d, dtype=dtype), rand(int(cu_k[-1]), hkv, d, dtype=dtype)
    return AttnCall("varlen", q, k, v, d**-0.5, causal, wl, wr, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                    max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))


VARLEN = {
    "causal_mixed_with_empty_sequences": dict(lens_q=[5, 0, 17, 9], lens_k=[7, 3, 17, 0], hq=4, hkv=2, d=16,
                                              causal=True),
    "decode_one_query_per_sequence": dict(lens_q=[1, 1, 1, 1], lens_k=[5, 30, 1, 17], hq=8, hkv=2, d=16,
                                          causal=True),
    "window_noncausal": dict(lens_q=[12, 25], lens_k=[20, 25], hq=2, hkv=2, d=24, wl=3, wr=2),
}


@pytest.mark.parametrize("variant", ["tile", "lpt", "lpt_tma"])
@pytest.mark.parametrize("case", VARLEN)
def test_varlen_matches_naive(case, variant):
    torch.manual_seed(7)
    call = varlen_case(**VARLEN[case])
    out, lse = run_backend(flash.BACKEND, call, VARIANTS[variant])
    assert_matches(out, lse, *oracle_varlen(call), torch.float32)


# ---------------------------------------------------------------------------------------- block-sparse
def _causal(b, h, q, kv):
    return q >= kv


def _sliding_20(b, h, q, kv):
    return (q >= kv) & (q - kv <= 20)


def _per_head_stripes(b, h, q, kv):
    return ((kv + 7 * h + 3 * b) % 5 != 0) & (kv <= q + 40)


def _documents(b, h, q, kv):
    return (q // 50) == (kv // 50)


def _skips_block_1(b, h, q, kv):
    return (kv < 64) | (kv >= 128)


def sparse_case(mod, b, hq, hkv, lq, lk, d, block, mask_b=None, mask_h=None, dtype=torch.float32):
    from torch.nn.attention.flex_attention import create_block_mask

    bm = create_block_mask(mod, mask_b, mask_h, lq, lk, device="cpu", BLOCK_SIZE=block)
    q, k, v = rand(b, hq, lq, d, dtype=dtype), rand(b, hkv, lk, d, dtype=dtype), rand(b, hkv, lk, d, dtype=dtype)
    return AttnCall("block_sparse", q, k, v, d**-0.5, sparse=BlockSparseMask.from_block_mask(bm))


SPARSE = {
    "causal_full_and_partial_blocks_gqa": dict(mod=_causal, b=1, hq=4, hkv=2, lq=130, lk=130, d=16, block=64),
    "sliding_window_lq_ne_lk": dict(mod=_sliding_20, b=1, hq=2, hkv=2, lq=100, lk=150, d=16, block=64),
    "per_batch_and_head_mask": dict(mod=_per_head_stripes, b=2, hq=2, hkv=1, lq=70, lk=90, d=24, block=64,
                                    mask_b=2, mask_h=2),
    "documents_q128_kv64": dict(mod=_documents, b=1, hq=2, hkv=2, lq=140, lk=140, d=16, block=(128, 64)),
    "kv32_blocks": dict(mod=_sliding_20, b=1, hq=2, hkv=1, lq=64, lk=96, d=16, block=(64, 32)),
}


def check_sparse(call: AttnCall, cfg: Config):
    out, lse = run_backend(flash.BACKEND, call, cfg)
    ref = naive.attend(call.q, call.k, call.v, call.sparse.dense_mask(), call.scale)
    assert_matches(out, lse, *ref, call.q.dtype)


@pytest.mark.parametrize("case", SPARSE)
def test_block_sparse_matches_naive(case):
    torch.manual_seed(8)
    call = sparse_case(**SPARSE[case])
    cfgs = [c for c in [c.config for c in flash.BACKEND.configs(call.problem, SM90)] if flash.BACKEND._pruned(call.problem, SM90, c) is None]
    assert cfgs
    largest_tma = Config.of(**{**dict(cfgs[0].params), "tma": True})
    for cfg in (cfgs[0], cfgs[-1], largest_tma):  # largest row block, a persistent one, TMA loads
        check_sparse(call, cfg)


@pytest.mark.parametrize("case", ["causal_gqa_lk_not_a_block_multiple", "documents", "per_batch_and_head_mask"])
def test_block_sparse_with_several_tiles_per_mask_block_matches_naive(case):
    # 128-key mask blocks visited as two 64-key tiles (bitmap words 0-1 then 2-3 of each row) or four
    # 32-key tiles (one word each)
    torch.manual_seed(10)
    spec = {"causal_gqa_lk_not_a_block_multiple": dict(mod=_causal, b=1, hq=4, hkv=2, lq=200, lk=200, d=16),
            "documents": dict(mod=_documents, b=1, hq=2, hkv=2, lq=260, lk=260, d=16),
            "per_batch_and_head_mask": dict(mod=_per_head_stripes, b=2, hq=2, hkv=1, lq=140, lk=170, d=16,
                                            mask_b=2, mask_h=2)}[case]
    call = sparse_case(**spec, block=128)
    sub_tiled = [c for c in [c.config for c in flash.BACKEND.configs(call.problem, SM90)] if c["block_n"] < 128]
    assert {c["block_n"] for c in sub_tiled} == {32, 64}
    assert all(flash.BACKEND._pruned(call.problem, SM90, c) is None for c in sub_tiled)
    for cfg in sub_tiled:
        check_sparse(call, cfg)


def test_block_sparse_half_precision():
    torch.manual_seed(9)
    call = sparse_case(_causal, 1, 2, 1, 96, 128, 16, 64, dtype=torch.float16)
    check_sparse(call, Config.of(block_m=32, block_n=64, num_warps=4, num_stages=2, schedule="tile"))


def test_tma_is_listed_only_where_the_device_has_it():
    p = problem(causal=True)
    assert {c.get("tma") for c in [c.config for c in flash.BACKEND.configs(p, SM90)]} == {True, False}
    a100 = DeviceInfo("NVIDIA A100-SXM4-80GB", (8, 0), 108)
    assert {c.get("tma") for c in [c.config for c in flash.BACKEND.configs(p, a100)]} == {None}
    tma = Config.of(block_m=128, block_n=64, num_warps=8, num_stages=3, schedule="tile", tma=True)
    assert "sm_90" in flash.BACKEND._pruned(p, a100, tma)


def test_unlisted_sparse_blocks_are_never_read():
    torch.manual_seed(10)
    call = sparse_case(_skips_block_1, 1, 2, 2, 64, 192, 16, 64)
    clean = (call.k.clone(), call.v.clone())
    call.k[:, :, 64:128] = call.v[:, :, 64:128] = float("nan")
    out, lse = run_backend(flash.BACKEND, call, Config.of(block_m=64, block_n=64, num_warps=4, num_stages=2,
                                                 schedule="tile"))
    assert_matches(out, lse, *naive.attend(call.q, *clean, call.sparse.dense_mask(), call.scale), torch.float32)


def _skips_first_tile(b, h, q, kv):
    return (kv >= 32) & (kv <= q + 40)


TILE_LIST = Config.of(block_m=64, block_n=32, num_warps=4, num_stages=3, schedule="tile", tile_list=True)


@pytest.mark.parametrize("case", ["sliding", "documents", "per_batch_and_head_mask", "skips_first_tile"])
def test_tile_list_holds_exactly_the_non_empty_tiles_and_marks_the_whole_ones(case):
    spec = {"sliding": dict(mod=_sliding_20, b=1, hq=2, hkv=2, lq=200, lk=260, d=16),
            "documents": dict(mod=_documents, b=1, hq=2, hkv=2, lq=260, lk=260, d=16),
            "per_batch_and_head_mask": dict(mod=_per_head_stripes, b=2, hq=2, hkv=1, lq=140, lk=170, d=16,
                                            mask_b=2, mask_h=2),
            "skips_first_tile": dict(mod=_skips_first_tile, b=1, hq=1, hkv=1, lq=130, lk=128, d=16)}[case]
    call = sparse_case(**spec, block=128)
    meta = flash.kernel_constexprs(call.problem, TILE_LIST, call.sparse.full_kv_num_blocks is not None)
    shape = flash._tile_list_shape(call.sparse, call.problem.len_q, meta)
    tiles = flash._tile_list(call.sparse, shape, meta, flash.eager_launcher)
    lq, lk = call.problem.len_q, call.problem.len_k
    dense = torch.nn.functional.pad(call.sparse.dense_mask(), (0, -lk % 32))  # whole 32-key tiles
    sub = 128 // 32
    for b, h, m in itertools.product(*(range(n) for n in tiles.shape[:3])):
        entries = tiles[b, h, m, 1 : 1 + tiles[b, h, m, 0]].tolist()
        slots = call.sparse.kv_indices[b, h, m * 64 // 128]
        kv_tiles = [e if e >= 0 else int(slots[(-1 - e) // sub]) * sub + (-1 - e) % sub for e in entries]
        rows = dense[b, h, m * 64 : min(lq, m * 64 + 64)].unflatten(-1, (-1, 32))  # [rows, kv tile, 32]
        assert sorted(kv_tiles) == rows.any(-1).any(0).nonzero().flatten().tolist()
        assert len(set(kv_tiles)) == len(kv_tiles)
        whole = {t for e, t in zip(entries, kv_tiles) if e >= 0}
        assert whole == {t for t in kv_tiles if rows[:, t].all() and len(rows) == 64 and (t + 1) * 32 <= lk}
    check_sparse(call, TILE_LIST)


def test_tiles_left_out_of_the_list_are_never_read():
    # kv block 0 is partial, but no query sees its first 32 keys: with NaN there, only a kernel that reads
    # them (the block walk) could turn an output to NaN; the tile list must skip them
    torch.manual_seed(11)
    call = sparse_case(_skips_first_tile, 1, 1, 1, 130, 128, 16, 128)
    clean = (call.k.clone(), call.v.clone())
    call.k[:, :, :32] = call.v[:, :, :32] = float("nan")
    out, lse = run_backend(flash.BACKEND, call, TILE_LIST)
    assert_matches(out, lse, *naive.attend(call.q, *clean, call.sparse.dense_mask(), call.scale), torch.float32)


def test_a_tile_list_over_the_size_cap_walks_the_blocks_instead(monkeypatch):
    torch.manual_seed(12)
    call = sparse_case(_documents, 1, 2, 2, 260, 260, 16, 128)
    monkeypatch.setattr(flash, "_TILE_LIST_MAX_BYTES", 0)
    monkeypatch.setattr(flash, "_tile_list", lambda *a: pytest.fail("built a list over the cap"))
    check_sparse(call, TILE_LIST)


# ------------------------------------------------------------------------------------- protocol pieces
def problem(**kw) -> Problem:
    base = dict(op="attention", dtype="bfloat16", device_type="cuda", batch=2, heads_q=32, heads_kv=32,
                len_q=4096, len_k=4096, head_dim=128, head_dim_v=128)
    return Problem(**{**base, **kw})


TYPICAL = {
    "d128_causal": problem(causal=True),
    "d64_noncausal_gqa": problem(head_dim=64, head_dim_v=64, heads_kv=8),
    "d256_window": problem(head_dim=256, head_dim_v=256, window_left=256, window_right=0),
    "d96_fp16": problem(dtype="float16", head_dim=96, head_dim_v=96),
    "decode_gqa": problem(len_q=1, heads_kv=8, causal=True),
    "varlen_causal": problem(op="varlen", total_q=8000, total_k=8000, causal=True),
    "sparse_128": problem(op="block_sparse", block_q=128, block_kv=128, density=0.1, partial_fraction=0.5),
}


@pytest.mark.parametrize("name", TYPICAL)
def test_configs_are_a_short_unique_mostly_runnable_list(name):
    p = TYPICAL[name]
    assert flash.BACKEND.supports(p, SM90) is None
    cfgs = [c.config for c in flash.BACKEND.configs(p, SM90)]
    names = [str(c) for c in cfgs]
    assert 5 <= len(cfgs) <= 12 and len(set(names)) == len(names)
    assert all(Config.parse(n) == c for n, c in zip(names, cfgs))
    runnable = [c for c in cfgs if flash.BACKEND._pruned(p, SM90, c) is None]
    assert len(runnable) >= 4, {str(c): flash.BACKEND._pruned(p, SM90, c) for c in cfgs}


@pytest.mark.parametrize("blocks", [(128, 128), (64, 64), (128, 64), (64, 32), (128, 32), (32, 128)])
def test_block_sparse_configs_are_unique_and_list_tile_walks_of_small_tiles(blocks):
    p = problem(op="block_sparse", block_q=blocks[0], block_kv=blocks[1])
    cfgs = [c.config for c in flash.BACKEND.configs(p, SM90)]
    assert len({str(c) for c in cfgs}) == len(cfgs) <= 12
    walks = [c for c in cfgs if c.get("tile_list")]
    assert walks and all(c["block_m"] * c["block_n"] < blocks[0] * blocks[1] for c in walks)
    assert all(flash.BACKEND._pruned(p, SM90, c) is None for c in walks)


def test_the_hand_rule_names_the_first_runnable_config_for_block_masks_on_cuda_only():
    from inductor_attn.tuning.decisions import heuristic_choice

    sparse = TYPICAL["sparse_128"]
    first = next(c for c in flash.BACKEND.configs(sparse, SM90) if c.pruned is None)
    assert flash.BACKEND.heuristic(sparse, SM90) == first.config
    assert flash.BACKEND.heuristic(TYPICAL["d128_causal"], SM90) is None
    assert flash.BACKEND.heuristic(dataclasses.replace(sparse, device_type="cpu"), SM90) is None
    flex = Candidate("flex", Config.of(backend="TRITON"))  # ahead in prior order, no rule of its own
    assert heuristic_choice(sparse, SM90, [flex, *flash.BACKEND.configs(sparse, SM90)]) == first.name


@pytest.mark.parametrize("d", [64, 128, 256])
def test_fp32_keeps_a_runnable_one_tile_config_and_prunes_big_tiles_for_shared_memory(d):
    p = problem(dtype="float32", head_dim=d, head_dim_v=d, causal=True)
    cfgs = [c.config for c in flash.BACKEND.configs(p, SM90)]
    reasons = [flash.BACKEND._pruned(p, SM90, c) for c in cfgs]
    assert None in reasons
    assert any(r and "shared memory" in r for r in reasons)
    assert {c["schedule"] for c in cfgs} == {"tile"}


def test_listed_bf16_configs_fit_the_register_and_shared_memory_rules():
    """The rules were calibrated by compiling for sm_90; a listed config that breaks them is a list bug."""
    for p in TYPICAL.values():
        for cfg in [c.config for c in flash.BACKEND.configs(p, SM90)]:
            assert flash.BACKEND._pruned(p, SM90, cfg) is None, (p, str(cfg))


def test_register_rule_prunes_shapes_that_spill():
    d128 = problem()
    spilling = Config.of(block_m=128, block_n=64, num_warps=4, num_stages=3, schedule="tile")
    assert "spill" in flash.BACKEND._pruned(d128, SM90, spilling)
    looping = Config.of(block_m=128, block_n=128, num_warps=8, num_stages=2, schedule="persistent")
    assert "persistent programs spill" in flash.BACKEND._pruned(d128, SM90, looping)
    assert flash.BACKEND._pruned(d128, SM90, Config.of(block_m=128, block_n=128, num_warps=8, num_stages=2,
                                                     schedule="tile")) is None


def test_prune_gives_reasons():
    b = flash.BACKEND
    lpt = Config.of(block_m=128, block_n=64, num_warps=8, num_stages=3, schedule="lpt")
    assert "lpt only helps causal/window" in b._pruned(problem(), SM90, lpt)
    assert b._pruned(problem(causal=True), SM90, lpt) is None
    sparse = problem(op="block_sparse", block_q=64, block_kv=128)
    assert b._pruned(sparse, SM90, Config.of(block_m=64, block_n=64, num_warps=4, num_stages=2, schedule="tile")) is None
    assert "block_kv" in b._pruned(sparse, SM90, Config.of(block_m=64, block_n=16, num_warps=4, num_stages=2,
                                                        schedule="tile"))
    assert "block_q" in b._pruned(sparse, SM90, Config.of(block_m=128, block_n=128, num_warps=8, num_stages=2,
                                                       schedule="tile"))
    huge = Config.of(block_m=128, block_n=128, num_warps=4, num_stages=4, schedule="tile")
    assert "shared memory" in b._pruned(problem(head_dim=256, head_dim_v=256), SM90, huge)


def test_supports_gives_reasons(monkeypatch):
    b = flash.BACKEND
    assert b.supports(problem(dtype="float64"), SM90) == "float64 not supported (float16, bfloat16, float32)"
    assert b.supports(problem(head_dim=8), SM90) == "head_dim 8 < 16"
    assert b.supports(problem(head_dim_v=512), SM90) == "head_dim_v 512 > 256"
    assert "sm_80" in b.supports(problem(), DeviceInfo("Tesla T4", (7, 5), 40))
    assert "block_kv" in b.supports(problem(op="block_sparse", block_q=64, block_kv=16), SM90)
    assert b.supports(problem(device_type="cpu", dtype="float16"), SM90) is None  # conftest: interpreter
    assert "interpreter" in b.supports(problem(device_type="cpu"), SM90)  # bfloat16
    monkeypatch.delenv("TRITON_INTERPRET")
    assert "needs a CUDA device" in b.supports(problem(device_type="cpu", dtype="float16"), SM90)


def test_without_triton_the_backend_imports_and_gives_a_reason():
    """The registry imports this module on every install: with triton's import refused, importing it
    and asking supports() must work (fresh interpreter, no TRITON_INTERPRET)."""
    code = (
        "from inductor_attn.backends import source_hash\n"
        "from inductor_attn.backends.triton_flash import flash\n"
        "from inductor_attn.device import parse_device_override\n"
        "from inductor_attn.problem import Problem\n"
        "p = Problem('attention', 'bfloat16', 'cuda', 1, 8, 2, 512, 512, 128, 128)\n"
        "print(flash.BACKEND.supports(p, parse_device_override('sm_90')), source_hash(flash.BACKEND) != '')\n"
    )
    assert run_without(("triton",), code) == "triton is not installed True"


def test_candidates_enumerate_without_duplicates():
    with only_backends(flash.BACKEND):
        cands = enumerate_candidates(TYPICAL["d128_causal"], SM90)
    assert len(cands) >= 6 and all(c.backend == "triton" for c in cands)


@pytest.mark.parametrize("index", [0, 1, 2])
def test_source_hash_covers_the_forward_and_backward_kernel_modules(monkeypatch, tmp_path, index):
    before = source_hash(flash.BACKEND)
    sources = list(flash.BACKEND.sources)
    at = sources.index(flash.KERNEL_SOURCES[index])
    edited = tmp_path / sources[at].name
    edited.write_bytes(sources[at].read_bytes() + b"# edited\n")
    sources[at] = edited
    monkeypatch.setattr(flash.BACKEND, "sources", tuple(sources))
    assert source_hash(flash.BACKEND) != before


def test_backward_is_delegated_lazily_to_flash_bwd(monkeypatch):
    seen = []
    fake = types.ModuleType("inductor_attn.backends.triton_flash.flash_bwd")
    fake.backward = lambda *args: seen.append(args) or "grads"
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    call = dense_case(1, 1, 1, 4, 4, 16, 16)
    assert flash.BACKEND.takes.backward
    assert run_backend_backward(flash.BACKEND, call, small(), "out", "lse", "dout", None) == "grads"
    assert seen == [(small(), flash.eager_launcher, call, "out", "lse", "dout", None)]
