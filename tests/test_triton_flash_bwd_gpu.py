"""Triton backward on a GPU: a sweep against float64 autograd, every listed config, determinism and
CUDA-graph capture. Run on the device machine: ``python -m pytest -q -m gpu tests/test_triton_flash_bwd_gpu.py``.

Shapes are odd on purpose (lengths that are not tile multiples, head dims that are not powers of two,
Lq != Lk under causal alignment); inputs are fresh random per case and buffers the backward allocates
are NaN-poisoned (``run_ours``).
"""

from __future__ import annotations

import pytest
import torch
from test_triton_flash_bwd import assert_close, dense_mask, flash_bwd, oracle_grads, random_block_mask, run_ours

from inductor_attn.backends import reference, run_backend, run_backend_backward
from inductor_attn.backends.base import AttnCall, Config
from inductor_attn.backends.triton_common import eager_launcher
from inductor_attn.block_mask import BlockSparseMask
from inductor_attn.device import device_info
from inductor_attn.tuning.correctness import TOLERANCES

pytestmark = pytest.mark.gpu


def _inputs(b, hq, hkv, lq, lk, d, dv, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    return (r(b, hq, lq, d).to(dtype), r(b, hkv, lk, d).to(dtype), r(b, hkv, lk, dv).to(dtype),
            r(b, hq, lq, dv).to(dtype), r(b, hq, lq))


def check_dense(monkeypatch, cfg, dtype, b, hq, hkv, lq, lk, d, dv, causal=False, wl=-1, wr=-1, kv_seqlens=None,
                seed=0, use_dlse=True):
    q, k, v, go, gl = _inputs(b, hq, hkv, lq, lk, d, dv, dtype, seed)
    gl = gl if use_dlse else None
    kvl = None if kv_seqlens is None else torch.tensor(kv_seqlens, device="cuda")
    mask = dense_mask(lq, lk, causal, wl, wr, kv_seqlens).cuda()
    out, lse, want = oracle_grads(q, k, v, mask, d ** -0.5, go, gl)
    call = AttnCall("attention", q, k, v, d ** -0.5, causal, wl, wr, kvl)
    got = run_ours(call, cfg, out.to(dtype), lse.float(), go, gl, monkeypatch)
    assert_close(got, want, dtype)
    return call


DENSE = {
    "causal square, odd length": dict(b=2, hq=8, hkv=8, lq=257, lk=257, d=64, dv=64, causal=True),
    "causal Lq < Lk, GQA 4": dict(b=1, hq=8, hkv=2, lq=300, lk=517, d=128, dv=128, causal=True),
    "causal Lq > Lk, rows without keys": dict(b=1, hq=4, hkv=4, lq=517, lk=300, d=128, dv=128, causal=True),
    "MQA non-causal": dict(b=2, hq=8, hkv=1, lq=199, lk=333, d=64, dv=64),
    "sliding window causal": dict(b=1, hq=4, hkv=2, lq=600, lk=600, d=128, dv=128, causal=True, wl=100),
    "two-sided window": dict(b=1, hq=4, hkv=4, lq=300, lk=420, d=64, dv=64, wl=64, wr=32),
    "kv_seqlens with an empty batch": dict(b=3, hq=4, hkv=2, lq=130, lk=517, d=96, dv=96, causal=True,
                                           kv_seqlens=[0, 200, 517]),
    "head dims 80 and 48, no grad_lse": dict(b=1, hq=4, hkv=4, lq=211, lk=211, d=80, dv=48, use_dlse=False),
    "head dim 256": dict(b=1, hq=2, hkv=1, lq=190, lk=250, d=256, dv=256, causal=True),
}


# every case in bf16; fp16 and fp32 on a few, to keep the number of compiled kernel variants down
FP16_CASES = ("causal Lq < Lk, GQA 4", "kv_seqlens with an empty batch", "head dims 80 and 48, no grad_lse")
DENSE_RUNS = [(c, torch.bfloat16) for c in DENSE] + [(c, torch.float16) for c in FP16_CASES] + \
    [(c, torch.float32) for c in ("causal square, odd length", "sliding window causal")]


@pytest.mark.parametrize("case,dtype", DENSE_RUNS, ids=[f"{c}-{str(d)[6:]}" for c, d in DENSE_RUNS])
def test_dense_default_and_atomic_configs_match_float64(case, dtype, monkeypatch):
    for i, cfg in enumerate((Config(), Config.of(bwd_dq="atomic"), Config.of(bwd_kv_split=2))):
        check_dense(monkeypatch, cfg, dtype, seed=i, **DENSE[case])


@pytest.mark.parametrize("case,dtype", [("causal Lq < Lk, GQA 4", torch.bfloat16),
                                        ("causal Lq < Lk, GQA 4", torch.float16),
                                        ("two-sided window", torch.float32), ("head dim 256", torch.bfloat16)],
                         ids=lambda x: str(x).removeprefix("torch."))
def test_every_listed_config_matches_float64(case, dtype, monkeypatch):
    c = DENSE[case]
    q, k, v, *_ = _inputs(c["b"], c["hq"], c["hkv"], c["lq"], c["lk"], c["d"], c["dv"], dtype, 0)
    call = AttnCall("attention", q, k, v, 1.0, c.get("causal", False), c.get("wl", -1), c.get("wr", -1))
    cfgs = [cfg for cfg, reason in flash_bwd.backward_candidates(call.problem, device_info(q.device)) if not reason]
    assert cfgs
    for i, cfg in enumerate(cfgs):
        check_dense(monkeypatch, cfg, dtype, seed=i, **c)


# ------------------------------------------------------------------------------------------- varlen
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
@pytest.mark.parametrize("causal", (False, True))
def test_varlen_matches_reference(dtype, causal, monkeypatch):
    cu_q = torch.tensor([0, 77, 77, 400, 401, 650], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 130, 190, 500, 501, 700], dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(650, 8, 128, generator=gen, device="cuda").to(dtype)
    k, v = (torch.randn(700, 2, 128, generator=gen, device="cuda").to(dtype) for _ in range(2))
    call = AttnCall("varlen", q, k, v, 128 ** -0.5, causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                    max_seqlen_q=323, max_seqlen_k=310)
    f64 = AttnCall("varlen", q.double(), k.double(), v.double(), 128 ** -0.5, causal, cu_seqlens_q=cu_q,
                   cu_seqlens_k=cu_k, max_seqlen_q=323, max_seqlen_k=310)
    out, lse = run_backend(reference.BACKEND, f64, Config())
    go, gl = torch.randn(out.shape, generator=gen, device="cuda"), torch.randn(lse.shape, generator=gen, device="cuda")
    want = run_backend_backward(reference.BACKEND, f64, Config(), out, lse, go, gl)
    for cfg in (Config(), Config.of(bwd_dq="atomic", bwd_kv_split=2)):
        got = run_ours(call, cfg, out.to(dtype), lse.float(), go.to(dtype), gl, monkeypatch)
        assert_close(got, want, dtype)


# ------------------------------------------------------------------------------------- block sparse
def _on_cuda(sparse: BlockSparseMask) -> BlockSparseMask:
    moved = {f: (getattr(sparse, f).cuda() if isinstance(getattr(sparse, f), torch.Tensor) else getattr(sparse, f))
             for f in sparse.__dataclass_fields__}
    return BlockSparseMask(**moved)


def _flex_mask(kind: str, lq: int, lk: int, heads: int, block: int) -> BlockSparseMask:
    from torch.nn.attention.flex_attention import create_block_mask

    def causal(b, h, q, kv):
        return q >= kv

    def doc_window(b, h, q, kv):  # documents of 300 tokens, 200-token window, head-dependent shift
        return (q // 300 == kv // 300) & (q - kv <= 200 + 16 * h) & (q >= kv)

    mod = {"causal": causal, "doc_window": doc_window}[kind]
    bm = create_block_mask(mod, 1, heads, lq, lk, device="cuda", BLOCK_SIZE=block)
    return BlockSparseMask.from_block_mask(bm)


def check_sparse(monkeypatch, sparse, dtype, cfg, b=2, hq=8, hkv=2, d=128, seed=0):
    lq, lk = sparse.seq_lengths
    q, k, v, go, gl = _inputs(b, hq, hkv, lq, lk, d, d, dtype, seed)
    mask = sparse.dense_mask()  # (B' or 1, H' or 1, Lq, Lk): mask heads are query heads
    out, lse, want = oracle_grads(q, k, v, mask, d ** -0.5, go, gl)
    call = AttnCall("block_sparse", q, k, v, d ** -0.5, sparse=sparse)
    got = run_ours(call, cfg, out.to(dtype), lse.float(), go, gl, monkeypatch)
    assert_close(got, want, dtype)


@pytest.mark.parametrize("kind,block,dtype", [("causal", 128, torch.bfloat16), ("doc_window", 128, torch.float16),
                                              ("doc_window", 64, torch.bfloat16)], ids=str)
def test_flex_block_masks_match_float64(kind, block, dtype, monkeypatch):
    sparse = _flex_mask(kind, 1000, 1000, 8, block)
    for cfg in (Config(), Config.of(bwd_dq="atomic"), Config.of(bwd_block_m=32, bwd_block_n=64)):
        check_sparse(monkeypatch, sparse, dtype, cfg)


@pytest.mark.parametrize("mask_bh", [(2, 8), (1, 1), (2, 1)])
def test_random_block_masks_with_partial_bitmaps(mask_bh, monkeypatch):
    for bq, bk in ((64, 128), (128, 64), (48, 32)):
        sparse = _on_cuda(random_block_mask(*mask_bh, 333, 517, bq, bk, seed=bq + bk))
        for cfg in (Config(), Config.of(bwd_dq="atomic")):
            check_sparse(monkeypatch, sparse, torch.float16, cfg)


# ---------------------------------------------------------------------------- determinism, graphs
def _forward(call, dtype):
    gen = torch.Generator(device="cuda").manual_seed(9)
    out, lse = run_backend(reference.BACKEND, call, Config())
    go = torch.randn(out.shape, generator=gen, device="cuda").to(dtype)
    return out, lse, go, torch.randn(lse.shape, generator=gen, device="cuda")


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
def test_deterministic_mode_gives_bitwise_identical_grads(dtype):
    q, k, v, *_ = _inputs(2, 16, 2, 1500, 1500, 128, 128, dtype, 3)
    dense = AttnCall("attention", q, k, v, 128 ** -0.5, True)
    sparse = AttnCall("block_sparse", q, k, v, 128 ** -0.5, sparse=_flex_mask("doc_window", 1500, 1500, 16, 128))
    wanted = Config.of(bwd_dq="atomic", bwd_kv_split=4)  # both would reorder sums if allowed to
    for call in (dense, sparse):
        grads = _forward(call, dtype)  # outside deterministic mode: cuBLAS would want a workspace config
        for det_cfg, flag in ((Config.of(bwd_dq="atomic", bwd_kv_split=4, deterministic=True), False),
                              (wanted, True)):
            torch.use_deterministic_algorithms(flag)
            try:
                first, second = (flash_bwd.backward(det_cfg, eager_launcher, call, *grads) for _ in range(2))
            finally:
                torch.use_deterministic_algorithms(False)
            for a, b in zip(first, second):
                assert torch.equal(a, b)


def test_backward_is_cuda_graph_capturable(monkeypatch):
    """The tuner times kernels by replaying a captured graph: no host sync may hide in the launcher."""
    q, k, v, go, gl = _inputs(1, 8, 2, 700, 700, 64, 64, torch.bfloat16, 4)
    for call in (AttnCall("attention", q, k, v, 0.125, True),
                 AttnCall("block_sparse", q, k, v, 0.125, sparse=_flex_mask("doc_window", 700, 700, 8, 128))):
        out, lse = run_backend(reference.BACKEND, call, Config())
        cfg = Config.of(bwd_dq="atomic", bwd_kv_split=2)
        eager = flash_bwd.backward(cfg, eager_launcher, call, out, lse, go, gl)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            flash_bwd.backward(cfg, eager_launcher, call, out, lse, go, gl)  # warm up (compiles) outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = flash_bwd.backward(cfg, eager_launcher, call, out, lse, go, gl)
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(captured, eager):
            assert (a.float() - b.float()).abs().max() <= TOLERANCES[torch.bfloat16] * b.float().abs().max()
