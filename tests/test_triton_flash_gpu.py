"""Triton flash forward on the GPU against the float64 reference: odd lengths, Lq != Lk causal, GQA/MQA,
strided inputs, kv_seqlens, windows, varlen, block masks from several mask_mods, fp16/bf16 (fp32 once),
and every listed config of a few problems (so a config that cannot compile on this GPU shows up here, not
in the tuner). Outputs are poisoned with NaN before each run.

Run on the device machine: ``python -m pytest tests/test_triton_flash_gpu.py -q``.
"""

from __future__ import annotations

import pytest
import torch

from inductor_attn.backends import run_backend
from inductor_attn.backends.base import AttnCall, Config
from inductor_attn.backends.reference import BACKEND as REFERENCE
from inductor_attn.backends.triton_flash import flash
from inductor_attn.block_mask import BlockSparseMask
from inductor_attn.device import device_info
from inductor_attn.layout import empty_like_layout
from inductor_attn.tuning.correctness import check_output

pytestmark = pytest.mark.gpu
DEV = "cuda"
BF16, FP16 = torch.bfloat16, torch.float16


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    real = flash.new_outputs

    def poisoned(call):
        out, lse = real(call)
        return out.fill_(float("nan")), lse.fill_(float("nan"))

    monkeypatch.setattr(flash, "new_outputs", poisoned)


def rand(*shape, dtype):
    return torch.randn(*shape, device=DEV, dtype=dtype)


def as_float64(call: AttnCall) -> AttnCall:
    return AttnCall(call.op, call.q.double(), call.k.double(), call.v.double(), call.scale, call.causal,
                    call.window_left, call.window_right, call.kv_seqlens, call.cu_seqlens_q, call.cu_seqlens_k,
                    call.max_seqlen_q, call.max_seqlen_k, call.sparse)


def runnable_configs(call: AttnCall) -> list[Config]:
    p, dev = call.problem, device_info(call.q.device)
    assert flash.BACKEND.supports(p, dev) is None, flash.BACKEND.supports(p, dev)
    return [c for c in [c.config for c in flash.BACKEND.configs(p, dev)] if flash.BACKEND._pruned(p, dev, c) is None]


def check(call: AttnCall, cfgs: list[Config]):
    ref_out, ref_lse = run_backend(REFERENCE, as_float64(call), Config())
    failures = {}
    for cfg in cfgs:
        out, lse = run_backend(flash.BACKEND, call, cfg)
        assert out.stride() == empty_like_layout(call.q, out.shape).stride() and lse.is_contiguous()
        reason = check_output(out, lse, ref_out, ref_lse, call.q.dtype)
        if reason:
            failures[str(cfg)] = reason
    assert not failures, failures


def first_of_each_schedule(cfgs: list[Config]) -> list[Config]:
    seen, out = set(), []
    for c in cfgs:
        if c["schedule"] not in seen:
            seen.add(c["schedule"])
            out.append(c)
    return out


def dense(b, hq, hkv, lq, lk, d, dv=None, causal=False, wl=-1, wr=-1, kv_lens=None, dtype=BF16, layout="bhld"):
    dv = dv or d
    if layout == "blhd":  # (B, L, H, D) buffers seen as (B, H, L, D): strided, like a fused QKV projection
        q = rand(b, lq, hq, d, dtype=dtype).transpose(1, 2)
        k = rand(b, lk, hkv, d, dtype=dtype).transpose(1, 2)
        v = rand(b, lk, hkv, dv, dtype=dtype).transpose(1, 2)
    elif layout == "misaligned":  # k/v start 2 bytes past an aligned address: TMA configs use pointer loads
        q = rand(b, hq, lq, d, dtype=dtype)
        k = rand(b, hkv, lk, d + 8, dtype=dtype)[..., 1 : d + 1]
        v = rand(b, hkv, lk, dv + 8, dtype=dtype)[..., 1 : dv + 1]
    else:
        q, k, v = rand(b, hq, lq, d, dtype=dtype), rand(b, hkv, lk, d, dtype=dtype), rand(b, hkv, lk, dv, dtype=dtype)
    lens = None if kv_lens is None else torch.tensor(kv_lens, dtype=torch.int32, device=DEV)
    return AttnCall("attention", q, k, v, d**-0.5, causal, wl, wr, lens)


DENSE = {
    "odd_noncausal_d128": dict(b=1, hq=8, hkv=8, lq=1000, lk=1000, d=128),
    "causal_lq_lt_lk": dict(b=2, hq=4, hkv=4, lq=300, lk=1037, d=128, causal=True),
    "causal_lq_gt_lk": dict(b=2, hq=4, hkv=4, lq=1037, lk=300, d=64, causal=True),
    "gqa4_causal": dict(b=2, hq=16, hkv=4, lq=777, lk=777, d=128, causal=True),
    "mqa_causal_d64": dict(b=1, hq=12, hkv=1, lq=513, lk=513, d=64, causal=True),
    "gqa3_noncausal": dict(b=1, hq=6, hkv=2, lq=333, lk=450, d=64),
    "d40_non_pow2": dict(b=1, hq=4, hkv=2, lq=257, lk=300, d=40, causal=True),
    "d96": dict(b=2, hq=4, hkv=4, lq=640, lk=640, d=96),
    "d256_causal": dict(b=1, hq=4, hkv=2, lq=600, lk=600, d=256, causal=True),
    "d192_dv128": dict(b=1, hq=4, hkv=4, lq=400, lk=500, d=192, dv=128, causal=True),
    "d16": dict(b=2, hq=2, hkv=2, lq=100, lk=130, d=16),
    "sliding_window_causal": dict(b=2, hq=8, hkv=2, lq=1500, lk=1500, d=128, causal=True, wl=256),
    "window_both_sides": dict(b=1, hq=4, hkv=4, lq=700, lk=900, d=64, wl=64, wr=100),
    "kv_seqlens_causal": dict(b=4, hq=8, hkv=2, lq=200, lk=1024, d=128, causal=True, kv_lens=[1024, 1, 0, 513]),
    "kv_seqlens_noncausal": dict(b=3, hq=4, hkv=4, lq=333, lk=600, d=64, kv_lens=[600, 77, 300]),
    "strided_blhd_causal": dict(b=2, hq=8, hkv=2, lq=555, lk=555, d=128, causal=True, layout="blhd"),
    "misaligned_kv": dict(b=1, hq=4, hkv=2, lq=300, lk=400, d=64, causal=True, layout="misaligned"),
    "decode_gqa": dict(b=4, hq=32, hkv=8, lq=1, lk=3000, d=128, causal=True),
    "decode_lq4": dict(b=2, hq=16, hkv=2, lq=4, lk=999, d=128, causal=True),
    # sizes equal to 1 are specialized into constexprs by Triton: the bound arithmetic must still compile
    "one_query_one_key": dict(b=2, hq=4, hkv=2, lq=1, lk=1, d=64, causal=True),
    "one_head_one_query_window": dict(b=1, hq=1, hkv=1, lq=1, lk=300, d=64, wl=1, wr=1),
}


# Every case in bf16, these in fp16 too: each (dtype, shape family, schedule) is a separate compile, and
# compiles dominate the run time of this file.
FP16_CASES = ["causal_lq_lt_lk", "gqa4_causal", "d40_non_pow2", "kv_seqlens_causal", "decode_gqa",
              "strided_blhd_causal"]


@pytest.mark.parametrize("case,dtype", [(c, BF16) for c in DENSE] + [(c, FP16) for c in FP16_CASES],
                         ids=[f"{c}-bf16" for c in DENSE] + [f"{c}-fp16" for c in FP16_CASES])
def test_dense_matches_reference(case, dtype):
    torch.manual_seed(0)
    call = dense(**DENSE[case], dtype=dtype)
    check(call, first_of_each_schedule(runnable_configs(call)))


def test_float32_uses_accurate_dots():
    torch.manual_seed(1)
    call = dense(2, 4, 2, 300, 300, 64, causal=True, dtype=torch.float32)
    check(call, first_of_each_schedule(runnable_configs(call)))


@pytest.mark.parametrize("case", ["gqa4_causal", "d256_causal", "mqa_causal_d64"])
def test_every_listed_config_compiles_and_matches(case):
    torch.manual_seed(2)
    call = dense(**DENSE[case], dtype=BF16)
    check(call, runnable_configs(call))


def test_fully_masked_rows_give_zero_and_neg_inf():
    torch.manual_seed(3)
    call = dense(1, 4, 2, 300, 100, 64, causal=True)  # rows 0..199 see no key
    out, lse = run_backend(flash.BACKEND, call, runnable_configs(call)[0])
    assert torch.equal(out[:, :, :200], torch.zeros_like(out[:, :, :200]))
    assert torch.isneginf(lse[:, :, :200]).all() and torch.isfinite(lse[:, :, 200:]).all()


def test_run_allocates_only_out_and_lse():
    torch.manual_seed(4)
    call = dense(2, 8, 2, 1024, 1024, 128, causal=True)
    for cfg in first_of_each_schedule(runnable_configs(call)):
        run_backend(flash.BACKEND, call, cfg)  # compile first
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out, lse = run_backend(flash.BACKEND, call, cfg)
        torch.cuda.synchronize()
        expected = out.numel() * out.element_size() + lse.numel() * lse.element_size()
        assert torch.cuda.max_memory_allocated() - before <= expected + 4096, str(cfg)


# -------------------------------------------------------------------------------------------- varlen
def varlen(lens_q, lens_k, hq, hkv, d, causal=False, wl=-1, wr=-1, dtype=BF16):
    cu = [torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
          for x in (lens_q, lens_k)]
    tq, tk = int(cu[0][-1]), int(cu[1][-1])
    q = rand(tq, hq, d, dtype=dtype)
    k = rand(tk, 2 * hkv, d, dtype=dtype)[:, ::2]  # strided heads
    v = rand(tk, hkv, d, dtype=dtype)
    return AttnCall("varlen", q, k, v, d**-0.5, causal, wl, wr, cu_seqlens_q=cu[0], cu_seqlens_k=cu[1],
                    max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))


VARLEN = {
    "causal_mixed": dict(lens_q=[300, 1, 0, 777, 64], lens_k=[300, 500, 20, 777, 0], hq=8, hkv=2, d=128,
                         causal=True),
    "noncausal_d64": dict(lens_q=[129, 1000, 33], lens_k=[200, 1000, 33], hq=4, hkv=4, d=64),
    "window": dict(lens_q=[600, 300], lens_k=[600, 900], hq=4, hkv=1, d=128, causal=True, wl=128),
    "decode_one_query_each": dict(lens_q=[1] * 8, lens_k=[1, 17, 300, 1024, 5, 999, 64, 128], hq=32, hkv=8,
                                  d=128, causal=True),
}


@pytest.mark.parametrize("case,dtype", [(c, BF16) for c in VARLEN] + [("causal_mixed", FP16)],
                         ids=[f"{c}-bf16" for c in VARLEN] + ["causal_mixed-fp16"])
def test_varlen_matches_reference(case, dtype):
    torch.manual_seed(5)
    call = varlen(**VARLEN[case], dtype=dtype)
    check(call, first_of_each_schedule(runnable_configs(call)))


# -------------------------------------------------------------------------------------- block-sparse
def _causal(b, h, q, kv):
    return q >= kv


def _sliding_256(b, h, q, kv):
    return (q >= kv) & (q - kv <= 256)


def _documents(b, h, q, kv):
    return (q // 300) == (kv // 300)


def _prefix_lm(b, h, q, kv):
    return (kv <= q) | (kv < 200)


def _per_head(b, h, q, kv):
    return (q >= kv) & ((q - kv) < 128 * (h + 1))


SPARSE = {
    "causal_128": dict(mod=_causal, b=2, hq=8, hkv=2, lq=1000, lk=1000, block=128),
    "sliding_256_64": dict(mod=_sliding_256, b=1, hq=4, hkv=4, lq=1100, lk=1100, block=64),
    "documents_q128_kv64": dict(mod=_documents, b=1, hq=4, hkv=1, lq=900, lk=900, block=(128, 64)),
    "prefix_lm_lq_ne_lk": dict(mod=_prefix_lm, b=1, hq=4, hkv=2, lq=700, lk=1000, block=128),
    "per_head_mask": dict(mod=_per_head, b=2, hq=4, hkv=2, lq=640, lk=640, block=64, mask_heads=True),
}


def sparse(mod, b, hq, hkv, lq, lk, block, d=128, mask_heads=False, dtype=BF16):
    from torch.nn.attention.flex_attention import create_block_mask

    bm = create_block_mask(mod, b if mask_heads else None, hq if mask_heads else None, lq, lk, device=DEV,
                           BLOCK_SIZE=block)
    q, k, v = rand(b, hq, lq, d, dtype=dtype), rand(b, hkv, lk, d, dtype=dtype), rand(b, hkv, lk, d, dtype=dtype)
    return AttnCall("block_sparse", q, k, v, d**-0.5, sparse=BlockSparseMask.from_block_mask(bm))


@pytest.mark.parametrize("case,dtype", [(c, BF16) for c in SPARSE] + [("sliding_256_64", FP16)],
                         ids=[f"{c}-bf16" for c in SPARSE] + ["sliding_256_64-fp16"])
def test_block_sparse_matches_reference(case, dtype):
    torch.manual_seed(6)
    call = sparse(**SPARSE[case], dtype=dtype)
    cfgs = runnable_configs(call)
    pointer_loads = [c for c in cfgs if c.get("tma") is False][:1]
    tile_lists = [c for c in cfgs if c.get("tile_list")]
    check(call, first_of_each_schedule(cfgs) + pointer_loads + tile_lists)


def test_persistent_launch_records_occupancy():
    torch.manual_seed(7)
    call = dense(2, 8, 8, 1024, 1024, 64)
    cfg = next(c for c in runnable_configs(call) if c["schedule"] == "persistent")
    run_backend(flash.BACKEND, call, cfg)
    assert flash._PER_SM, "the compiled kernel's registers/shared memory were not read"
    assert all(1 <= n <= 16 for n in flash._PER_SM.values())
