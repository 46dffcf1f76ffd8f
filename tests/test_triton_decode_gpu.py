"""Split-K decode backend on a real GPU against the float64 reference: the sweep the interpreter is too slow for.

Lq 1..16, GQA ratios 1/2/8/16 and MQA, head dims 64/128/256, fp16/bf16, kv_seqlens with 0 and Lk, key masks,
non-contiguous K/V cache views, every num_splits and every config that the tuner may pick, CUDA-graph
replay. Outputs and the cached workspace are poisoned with NaN before each run.
Run: ``python -m pytest -q -m gpu tests/test_triton_decode_gpu.py``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
from test_triton_decode import float64_reference, run_poisoned

from inductor_attn.backends import AttnCall, Config, run_backend
from inductor_attn.backends import triton_decode as decode
from inductor_attn.device import device_info
from inductor_attn.tuning.correctness import check_output

pytestmark = pytest.mark.gpu

MASKS = ("none", "causal", "causal_seqlens", "window_left", "window_both", "seqlens", "key_mask_seqlens")


@dataclasses.dataclass(frozen=True)
class Case:
    b: int
    hq: int
    hkv: int
    lq: int
    lk: int
    d: int
    dtype: torch.dtype = torch.bfloat16
    mask: str = "none"
    layout: str = "contiguous"  # "bshd": K/V are (B, L, H, D) caches seen as (B, H, L, D); "cache_slice"
    splits: int = 4
    block_n: int = 32
    num_warps: int = 4

    def cfg(self) -> Config:
        return Config.of(block_n=self.block_n, num_splits=self.splits, num_warps=self.num_warps)


def _kv(c: Case, gen) -> torch.Tensor:
    if c.layout == "bshd":
        return torch.randn(c.b, c.lk, c.hkv, c.d, generator=gen, device="cuda").to(c.dtype).transpose(1, 2)
    if c.layout == "cache_slice":
        cache = torch.randn(c.b, c.hkv, c.lk + 77, c.d, generator=gen, device="cuda").to(c.dtype)
        return cache[:, :, : c.lk]
    return torch.randn(c.b, c.hkv, c.lk, c.d, generator=gen, device="cuda").to(c.dtype)


def _call(c: Case, seed: int = 0) -> AttnCall:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(c.b, c.lq, c.hq, c.d, generator=gen, device="cuda").to(c.dtype).transpose(1, 2)
    k, v = _kv(c, gen), _kv(c, gen)
    causal = c.mask.startswith("causal")
    window = {"window_left": (37, 0), "window_both": (20, 5)}.get(c.mask, (-1, -1))
    seqlens = None
    if c.mask.endswith("seqlens"):
        lens = [0, c.lk, c.lk // 2 + 1][: c.b] if c.b > 1 else [c.lk // 2 + 1]
        seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    key_mask = None
    if c.mask.startswith("key_mask"):  # left padding of 3 * b keys plus random holes, as generate() may pass
        key_mask = ((torch.arange(c.lk, device="cuda")[None, :] >= 3 * torch.arange(c.b, device="cuda")[:, None])
                    & (torch.rand(c.b, c.lk, generator=gen, device="cuda") < 0.9))
    return AttnCall("attention", q, k, v, c.d ** -0.5, causal, *window, kv_seqlens=seqlens, key_mask=key_mask)


def _assert_matches(call: AttnCall, cfg: Config, ref=None):
    out, lse = run_poisoned(call, cfg)
    ref_out, ref_lse = ref if ref is not None else float64_reference(call)
    reason = check_output(out, lse, ref_out, ref_lse, call.q.dtype)
    assert reason is None, f"{call.problem} {cfg}: {reason}"


def _sweep_cases() -> list[Case]:
    """Lq x (Hq, Hkv) x D, with masks, dtypes, layouts, lengths and num_splits cycled so every value of
    each axis meets several values of the others without the full cartesian product."""
    heads = ((8, 8), (8, 4), (16, 2), (32, 2), (8, 1))  # GQA ratios 1, 2, 8, 16 and MQA
    lengths, splits = (1, 37, 300, 1024, 129), (2, 4, 8, 1, 16, 32)
    cases = []
    for n, (lq, (hq, hkv), d) in enumerate(itertools.product((1, 2, 5, 16), heads, (64, 128, 256))):
        mask = MASKS[n % len(MASKS)]
        cases.append(Case(b=3 if "seqlens" in mask else 2, hq=hq, hkv=hkv, lq=lq, lk=lengths[n % len(lengths)],
                          d=d, dtype=(torch.bfloat16, torch.float16)[n % 2], mask=mask,
                          layout=("contiguous", "bshd", "cache_slice")[n % 3], splits=splits[n % len(splits)]))
    return cases


SWEEP = _sweep_cases()


@pytest.mark.parametrize("case", SWEEP, ids=[f"lq{c.lq}-h{c.hq}x{c.hkv}-d{c.d}-lk{c.lk}-{c.mask}-{c.layout}-"
                                             f"s{c.splits}-{str(c.dtype)[6:]}" for c in SWEEP])
def test_sweep_matches_float64_reference(case):
    _assert_matches(_call(case), case.cfg())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_every_config_and_num_splits_matches_reference(dtype, d):
    """Every config the tuner may run, plus splits pruned only for having more splits than KV blocks (the
    kernel must still be right there: those splits see no key and must drop out of the combine)."""
    case = Case(b=3, hq=16, hkv=2, lq=1, lk=1000, d=d, dtype=dtype, mask="causal_seqlens", layout="cache_slice")
    call = _call(case)
    ref = float64_reference(call)
    dev = device_info("cuda")
    for cfg in [c.config for c in decode.BACKEND.configs(call.problem, dev)]:
        reason = decode._pruned(call.problem, dev, cfg)
        if reason is None or reason.startswith("num_splits"):
            _assert_matches(call, cfg, ref)


BENCH_SHAPES = [(1, 32, 16, 256, 256), (1, 32, 16, 256, 4096), (1, 32, 16, 256, 16384), (1, 16, 2, 256, 2048),
                (1, 16, 2, 256, 16384), (8, 32, 8, 128, 8192)]


@pytest.mark.parametrize("shape", BENCH_SHAPES, ids=[f"b{b}-h{hq}x{hkv}-d{d}-lk{lk}" for b, hq, hkv, d, lk in BENCH_SHAPES])
def test_benchmark_shapes_every_runnable_config_compiles_and_matches(shape):
    """Decode shapes of benchmark size: no runnable config may fail to compile (shared memory) or be wrong."""
    b, hq, hkv, d, lk = shape
    call = _call(Case(b=b, hq=hq, hkv=hkv, lq=1, lk=lk, d=d))
    ref = float64_reference(call)
    dev = device_info("cuda")
    runnable = [c for c in [c.config for c in decode.BACKEND.configs(call.problem, dev)] if decode._pruned(call.problem, dev, c) is None]
    assert runnable
    for cfg in runnable:
        _assert_matches(call, cfg, ref)


def test_fully_masked_rows_give_zero_output_and_minus_inf_lse():
    case = Case(b=2, hq=8, hkv=2, lq=4, lk=300, d=128, mask="causal_seqlens", splits=8)
    call = dataclasses.replace(_call(case), kv_seqlens=torch.tensor([0, 2], dtype=torch.int32, device="cuda"))
    out, lse = run_poisoned(call, case.cfg())
    assert not out.isnan().any() and not lse.isnan().any()
    assert (out[0] == 0).all() and (lse[0] == -math.inf).all()
    assert (lse[1, :, :2] == -math.inf).all() and (out[1, :, :2] == 0).all() and torch.isfinite(lse[1, :, 2:]).all()


def test_cuda_graph_replay_matches_a_plain_call():
    case = Case(b=2, hq=16, hkv=2, lq=1, lk=2048, d=128, mask="causal_seqlens", splits=16)
    call = _call(case)
    plain_out, plain_lse = run_backend(decode.BACKEND, call, case.cfg())  # compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = run_backend(decode.BACKEND, call, case.cfg())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, plain_out) and torch.equal(lse, plain_lse)
    for seed in (1, 2):  # new values in the captured tensors: the replay must follow them
        fresh = _call(case, seed)
        for dst, src in ((call.q, fresh.q), (call.k, fresh.k), (call.v, fresh.v)):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert check_output(out, lse, *float64_reference(call), case.dtype) is None


def test_float32_inputs_match_with_ieee_dots():
    case = Case(b=2, hq=8, hkv=2, lq=3, lk=500, d=128, dtype=torch.float32, mask="causal", splits=4)
    _assert_matches(_call(case), case.cfg())
