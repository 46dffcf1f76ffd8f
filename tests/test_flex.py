"""The flex backend on the CPU: what it supports and prunes, and that the BlockMask it rebuilds from our
BlockSparseMask (or from a window) means the same mask, checked element by element and, once, through
torch.compile(flex_attention) against the reference backend."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from blocked_imports import run_without
from torch.nn.attention.flex_attention import create_block_mask, create_mask

from inductor_attn.backends import Config, enumerate_candidates, flex, only_backends, reference, run_backend
from inductor_attn.backends.base import AttnCall
from inductor_attn.block_mask import BlockSparseMask
from inductor_attn.device import parse_device_override
from inductor_attn.problem import Problem

SM90 = parse_device_override("sm_90")


def prob(op="block_sparse", **kw) -> Problem:
    base = dict(op=op, dtype="bfloat16", device_type="cuda", batch=2, heads_q=8, heads_kv=8, len_q=1024,
                len_k=1024, head_dim=64, head_dim_v=64)
    if op == "block_sparse":
        base.update(block_q=128, block_kv=128, density=0.4, partial_fraction=0.25)
    base.update(kw)
    return Problem(**base)


def candidates(p: Problem) -> dict[str, str | None]:
    with only_backends(flex.BACKEND):
        return {c.name: c.pruned for c in enumerate_candidates(p, SM90)}


@pytest.mark.parametrize("p, reason", [
    (prob(device_type="cpu"), "needs a CUDA device"),
    (prob("varlen", total_q=4096, total_k=4096), "flex backend does not take packed varlen problems"),
    (prob("attention", causal=True, has_kv_seqlens=True), "flex backend does not take kv_seqlens"),
    (prob("attention"), "unmasked and plain causal attention are covered by sdpa, fa4 and triton at less tuning cost"),
    (prob("attention", causal=True), "unmasked and plain causal attention are covered by sdpa, fa4 and triton at less tuning cost"),
    (prob(dtype="float64"), "flex takes float16, bfloat16 and float32, got float64"),
    (prob(), None),
    (prob("attention", window_left=256, window_right=0), None),
])
def test_supports(p, reason):
    assert flex.BACKEND.supports(p, SM90) == reason


def test_configs_are_triton_tiles_and_flash(monkeypatch):
    monkeypatch.setattr(flex, "flash_attn_available", lambda: True)
    cands = candidates(prob())
    assert set(cands) == {"flex:backend=TRITON", "flex:backend=FLASH",
                          "flex:backend=TRITON,block_m=128,block_n=64,num_stages=3,num_warps=4",
                          "flex:backend=TRITON,block_m=64,block_n=64,num_stages=2,num_warps=4"}
    assert all(reason is None for name, reason in cands.items() if name != "flex:backend=FLASH")
    # measured: flex FLASH fails on our block masks, with or without partial blocks (torch 2.11, H100)
    assert cands["flex:backend=FLASH"] == flex._FLASH_BLOCK_MASK_REASON
    assert candidates(prob(partial_fraction=0.0))["flex:backend=FLASH"] == flex._FLASH_BLOCK_MASK_REASON


def test_flash_is_pruned_without_flash_attn_4(monkeypatch):
    monkeypatch.setattr(flex, "flash_attn_available", lambda: False)
    assert candidates(prob())["flex:backend=FLASH"] == "flex FLASH needs flash-attn-4, not installed"
    monkeypatch.setattr(flex, "flash_attn_available", lambda: True)
    assert candidates(prob(dtype="float32"))["flex:backend=FLASH"] == "flex FLASH takes float16 and bfloat16 only"


def test_triton_tiles_must_divide_the_sparse_blocks():
    cands = candidates(prob(block_q=64, block_kv=64))
    assert cands["flex:backend=TRITON,block_m=128,block_n=64,num_stages=3,num_warps=4"] == (
        "flex needs the q block size (64) to be a multiple of BLOCK_M (128)")
    assert cands["flex:backend=TRITON,block_m=64,block_n=64,num_stages=2,num_warps=4"] is None
    assert candidates(prob(head_dim=8, head_dim_v=8))["flex:backend=TRITON"] == (
        "flex Triton needs head dims >= 16, got (8, 8)")


def test_flex_own_tile_is_pruned_where_it_does_not_divide_the_blocks(monkeypatch):
    """On a real device, the config that leaves the tile to flex is asked of torch's own heuristic first
    (issue 17: flex's default tile was compiled, then failed on 64-blocks)."""
    real_h100 = dataclasses.replace(SM90, simulated=False)
    monkeypatch.setattr(flex, "flex_default_fwd_tiles", lambda head_dim, dtype: [(128, 64)])
    with only_backends(flex.BACKEND):
        on_64 = {c.name: c.pruned for c in enumerate_candidates(prob(block_q=64, block_kv=64), real_h100)}
        on_128 = {c.name: c.pruned for c in enumerate_candidates(prob(), real_h100)}
    assert on_64["flex:backend=TRITON"] == "flex's own tiles here (128x64) do not divide the 64x64 mask blocks"
    assert on_128["flex:backend=TRITON"] is None
    assert candidates(prob(block_q=64, block_kv=64))["flex:backend=TRITON"] is None  # simulated: not asked


def test_kernel_options_round_trip_through_the_config_string():
    for cfg in [c.config for c in flex.BACKEND.configs(prob(), SM90)]:
        assert flex.kernel_options(Config.parse(str(cfg))) == flex.kernel_options(cfg)


# ------------------------------------------------------------------------ mask conversion semantics
def flex_dense_mask(bm, batch: int, heads: int) -> torch.Tensor:
    """What a flex kernel computes for a BlockMask: mask_mod inside partial blocks, all of a full block,
    nothing elsewhere; bool [B, H, Lq, Lk]."""
    lq, lk = bm.seq_lengths
    bq, bk = bm.BLOCK_SIZE

    def blocks(cnt, idx):
        n = -(-lk // bk)
        slots = torch.arange(idx.shape[-1])
        target = torch.where(slots < cnt[..., None], idx.long(), n)
        grid = torch.zeros(*idx.shape[:-1], n + 1, dtype=torch.bool)
        grid.scatter_(-1, target, True)
        grid = grid[..., :n].expand(batch, heads, -1, -1)
        return grid.repeat_interleave(bq, 2).repeat_interleave(bk, 3)[:, :, :lq, :lk]

    partial = blocks(bm.kv_num_blocks, bm.kv_indices)
    full = blocks(bm.full_kv_num_blocks, bm.full_kv_indices)
    return (partial & create_mask(bm.mask_mod, batch, heads, lq, lk, device="cpu")) | full


def doc_mask(b, h, q, kv):  # per-batch documents plus a per-head window: partial, full and empty blocks
    return ((q // (37 + 20 * b)) == (kv // (37 + 20 * b))) & (q - kv <= 40 + 8 * h) & (kv <= q)


@pytest.mark.parametrize("batch, heads, lq, lk, block", [(2, 3, 200, 200, 64), (None, None, 256, 320, 128),
                                                        (1, 2, 100, 300, 32)])
def test_block_mask_from_our_mask_reproduces_the_dense_mask(batch, heads, lq, lk, block):
    sparse = BlockSparseMask.from_block_mask(create_block_mask(doc_mask, batch, heads, lq, lk, device="cpu",
                                                               BLOCK_SIZE=block))
    bm = flex.to_flex_block_mask(sparse)
    want = sparse.dense_mask()
    got = flex_dense_mask(bm, want.shape[0], want.shape[1])
    assert torch.equal(got, want)


def test_block_mask_without_full_blocks_gets_empty_full_lists():
    sparse = BlockSparseMask.from_block_mask(create_block_mask(doc_mask, 1, 1, 128, 128, device="cpu",
                                                               BLOCK_SIZE=64))
    sparse.full_kv_num_blocks = sparse.full_kv_indices = None  # as if every listed block were partial
    bm = flex.to_flex_block_mask(sparse)
    assert int(bm.full_kv_num_blocks.sum()) == 0 and bm.full_kv_indices.shape[-1] == 2


@pytest.mark.parametrize("lq, lk, causal, left, right", [
    (300, 300, True, -1, -1), (100, 400, True, -1, -1), (400, 300, True, -1, -1), (512, 512, True, 100, -1),
    (300, 500, False, 64, 200), (256, 256, False, -1, 0), (384, 384, False, 0, 0),
])
def test_window_block_mask_reproduces_the_lower_right_window(lq, lk, causal, left, right):
    bm = flex.window_block_mask(lq, lk, causal, left, right, torch.device("cpu"))
    got = flex_dense_mask(bm, 1, 1)[0, 0]
    d = torch.arange(lq)[:, None] + (lk - lq)
    j = torch.arange(lk)[None, :]
    r = 0 if causal else right
    want = torch.ones(lq, lk, dtype=torch.bool)
    if r >= 0:
        want &= j <= d + r
    if left >= 0:
        want &= j >= d - left
    assert torch.equal(got, want)
    partial, full = flex.window_blocks(lq, lk, causal, left, right)
    assert not bool((partial & full).any())


@pytest.mark.slow
def test_compiled_flex_with_our_block_mask_matches_the_reference():
    """torch.compile(flex_attention) with the bitmap mask_mod (CPU inductor: ~25 s on 2 cores; its CPU
    lowering has no lse, so only the output is compared here; tests/test_fa4_gpu.py covers lse on GPU)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 256, 16, generator=gen) for _ in range(3))
    sparse = BlockSparseMask.from_block_mask(create_block_mask(doc_mask, 1, 2, 256, 256, device="cpu",
                                                               BLOCK_SIZE=64))
    out = flex._compiled()(q, k, v, block_mask=flex.to_flex_block_mask(sparse), scale=0.25)
    want, _ = run_backend(reference.BACKEND, AttnCall("block_sparse", q, k, v, 0.25, sparse=sparse), Config())
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_importing_the_flex_backend_needs_no_optional_dependency():
    """STYLE pattern 2: backends import optional deps lazily (triton, cutlass, flash_attn blocked here)."""
    run_without(("triton", "cutlass", "flash_attn", "quack"), "import inductor_attn.backends.flex\n")


# ------------------------------------------------------------------------------------------- GPU
def _gpu_sparse_call(dtype, heads, hkv, d=64):
    from inductor_attn.backends.base import AttnCall

    sparse = BlockSparseMask.from_block_mask(create_block_mask(doc_mask, 2, heads, 512, 512, device="cuda",
                                                               BLOCK_SIZE=128))
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 6, 512, d, device="cuda", dtype=dtype, generator=gen)
    k, v = (torch.randn(2, hkv, 512, d, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
    return AttnCall("block_sparse", q, k, v, d ** -0.5, sparse=sparse)


def _assert_matches_reference(call, cfg):
    from inductor_attn.tuning.correctness import check_output

    out, lse = run_backend(flex.BACKEND, call, cfg)
    want = run_backend(reference.BACKEND, call, Config())
    reason = check_output(out, lse, *want, call.q.dtype)
    assert reason is None, f"{cfg}: {reason}"


TRITON_CONFIGS = [Config.of(backend="TRITON"), *flex.TRITON_TILES]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # each config compiles per dtype (~10 s)
@pytest.mark.parametrize("heads, hkv", [(6, 6), (None, 2)], ids=["per-head-mask", "shared-mask-gqa"])
def test_gpu_flex_triton_on_our_block_mask_matches_reference(dtype, heads, hkv):
    call = _gpu_sparse_call(dtype, heads=heads, hkv=hkv)
    for cfg in TRITON_CONFIGS:
        _assert_matches_reference(call, cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("causal, left, right, lq, lk", [(True, -1, -1, 384, 512), (True, 256, -1, 1024, 1024),
                                                         (False, 100, 50, 600, 600)])
def test_gpu_flex_on_dense_windows_matches_reference(causal, left, right, lq, lk):
    from inductor_attn.backends.base import AttnCall

    gen = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(2, 4, lq, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(2, 2, lk, 64, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    call = AttnCall("attention", q, k, v, 0.125, causal, left, right)
    configs = TRITON_CONFIGS + ([Config.of(backend="FLASH")] if flex.flash_attn_available() else [])
    for cfg in configs:
        _assert_matches_reference(call, cfg)


