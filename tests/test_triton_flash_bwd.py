"""Triton backward (backends/triton_flash/flash_bwd.py) in Triton's interpreter: tiny shapes, CPU.

The oracle is float64 autograd of a naive masked softmax (tests/naive.py masks) including the lse
output, or the reference backend's backward where masks are easier to state there (varlen, block
sparse). Buffers the backward allocates are poisoned with NaN, so an element it forgets to write fails.
bfloat16 is left to the GPU tests: the interpreter's dot reads bf16 bits as integers.
"""

from __future__ import annotations

import itertools

import naive
import pytest
import torch
from fakes import ComputingOps, stub_triton_compile
from interpreter_bounds import bounds_checked

from inductor_attn.backends import reference, run_backend, run_backend_backward
from inductor_attn.backends.base import AttnCall, Config
from inductor_attn.backends.triton_common import eager_launcher, warmup_launcher
from inductor_attn.block_mask import BlockSparseMask, pack_bits
from inductor_attn.device import DeviceInfo
from inductor_attn.problem import Problem
from inductor_attn.tuning.correctness import TOLERANCES, rel_err

flash_bwd = pytest.importorskip("inductor_attn.backends.triton_flash.flash_bwd")
pytest.importorskip("triton")

# Small tiles make tiny shapes cross several tiles, so masked and mask-free tile ranges both run.
SMALL = Config.of(bwd_block_m=16, bwd_block_n=16)


# ------------------------------------------------------------------------------------------ oracles
def oracle_grads(q, k, v, mask, scale, grad_out, grad_lse):
    """float64 autograd of (out, lse) with ``mask`` broadcastable to (B, Hq, Lq, Lk).

    Fully masked rows give out = 0 and lse = -inf with zero gradients: their scores are replaced by
    zeros before the logsumexp so autograd never sees -inf - -inf.
    Returns (out, lse, (dq, dk, dv)) in float64.
    """
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    g = q.shape[1] // k.shape[1]
    s = (q @ k.repeat_interleave(g, 1).transpose(-1, -2)) * scale
    mask = mask.expand_as(s)
    dead = ~mask.any(-1, keepdim=True)
    s = s.masked_fill(~mask | dead, float("-inf")).masked_fill(dead, 0.0)
    lse = torch.logsumexp(s, -1, keepdim=True)
    out = torch.where(dead, 0.0, torch.exp(s - lse) @ v.repeat_interleave(g, 1))
    lse = lse.squeeze(-1)
    loss = (out * grad_out.double()).sum()
    if grad_lse is not None:
        loss = loss + torch.where(dead.squeeze(-1), 0.0, lse * grad_lse.double()).sum()
    grads = torch.autograd.grad(loss, (q, k, v))
    return out.detach(), torch.where(dead.squeeze(-1), float("-inf"), lse).detach(), grads


def run_ours(call, cfg, out, lse, grad_out, grad_lse, monkeypatch):
    """flash_bwd.backward with every buffer it allocates filled with NaN (dq, dk and dv come from
    torch.empty_permuted: layout.new_grads), so an element a kernel leaves unwritten shows."""
    def poisoned(real):
        return lambda *a, **kw: real(*a, **kw).fill_(float("nan"))

    with monkeypatch.context() as m, bounds_checked():
        for name in ("empty", "empty_like", "empty_permuted", "empty_strided"):
            m.setattr(torch, name, poisoned(getattr(torch, name)))
        return flash_bwd.backward(cfg, eager_launcher, call, out, lse, grad_out, grad_lse)


def assert_close(got, want, dtype, what=("dq", "dk", "dv")):
    tol = TOLERANCES[dtype]
    for name, a, b in zip(what, got, want):
        assert not torch.isnan(a).any(), f"{name} has NaN"
        err = rel_err(a, b)
        assert err <= tol, f"{name}: rel. error {err:.2e} > {tol:.0e}"


def dense_case(b, hq, hkv, lq, lk, d, dv, dtype, causal=False, wl=-1, wr=-1, kv_seqlens=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, lq, d, generator=gen).to(dtype)
    k = torch.randn(b, hkv, lk, d, generator=gen).to(dtype)
    v = torch.randn(b, hkv, lk, dv, generator=gen).to(dtype)
    grad_out = torch.randn(b, hq, lq, dv, generator=gen).to(dtype)
    grad_lse = torch.randn(b, hq, lq, generator=gen)
    return q, k, v, grad_out, grad_lse


def dense_mask(lq, lk, causal, wl, wr, kv_seqlens):
    if kv_seqlens is None:
        return naive.dense_mask(lq, lk, causal, wl, wr)
    return torch.stack([naive.dense_mask(lq, lk, causal, wl, wr, int(n)) for n in kv_seqlens])[:, None]


def check_dense(monkeypatch, cfg=SMALL, dtype=torch.float32, use_dlse=True, nan_past_lengths=False, **case):
    """``nan_past_lengths``: our kernels see NaN in k and v past kv_seqlens (unwritten cache slots), the oracle
    finite values."""
    shape = {k: case.pop(k) for k in ("b", "hq", "hkv", "lq", "lk", "d", "dv")}
    q, k, v, go, gl = dense_case(**shape, dtype=dtype)
    gl = gl if use_dlse else None
    causal, wl, wr, kvl = case.get("causal", False), case.get("wl", -1), case.get("wr", -1), case.get("kv_seqlens")
    mask = dense_mask(shape["lq"], shape["lk"], causal, wl, wr, kvl)
    scale = shape["d"] ** -0.5
    out, lse, want = oracle_grads(q, k, v, mask, scale, go, gl)
    if nan_past_lengths:
        past = (torch.arange(shape["lk"]) >= kvl[:, None])[:, None, :, None]
        k, v = (x.masked_fill(past, float("nan")) for x in (k, v))
    call = AttnCall("attention", q, k, v, scale, causal, wl, wr, kvl)
    got = run_ours(call, cfg, out.to(dtype), lse.float(), go, gl, monkeypatch)
    for g, x in zip(got, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype
    assert_close(got, want, dtype)
    return got


# -------------------------------------------------------------------------------------------- dense
DENSE_CASES = {
    "non-causal odd lengths": dict(b=2, hq=2, hkv=2, lq=37, lk=45, d=24, dv=24),
    "causal Lq < Lk": dict(b=1, hq=2, hkv=1, lq=29, lk=61, d=16, dv=32, causal=True),
    "causal Lq > Lk (top rows see nothing)": dict(b=1, hq=2, hkv=2, lq=50, lk=21, d=16, dv=16, causal=True),
    "sliding window": dict(b=1, hq=3, hkv=1, lq=57, lk=57, d=16, dv=16, wl=9, wr=4),
    "left window only, causal": dict(b=1, hq=2, hkv=1, lq=40, lk=52, d=16, dv=16, causal=True, wl=13),
    "MQA right window": dict(b=2, hq=4, hkv=1, lq=33, lk=40, d=32, dv=16, wr=7),
    "head dim 8 (padded to a 16-wide tile)": dict(b=1, hq=2, hkv=2, lq=20, lk=27, d=8, dv=8, causal=True),
}


@pytest.mark.parametrize("case", DENSE_CASES, ids=list(DENSE_CASES))
def test_dense_grads_match_float64_autograd(case, monkeypatch):
    check_dense(monkeypatch, **DENSE_CASES[case])


def test_window_edges_sweep_matches_reference():
    """100 random (Lk, window) pairs on 16-row tiles: band edges land on every residue of the tile
    grid, where an off-by-one in the mask-free tile ranges shows (each such mutation of the kernels
    was checked to fail here). Errors are scaled by ||dv||: with a one-key window, dq and dk are
    exactly zero and a plain relative error is noise over noise."""
    gen = torch.Generator().manual_seed(6)
    lq = 37
    sizes = torch.randint(-1, 40, (100, 2), generator=gen).tolist()  # window edges; -1 = unbounded
    lks = torch.randint(20, 70, (100,), generator=gen).tolist()
    for lk, (wl, wr), mode in zip(lks, sizes, itertools.cycle(("separate", "atomic"))):
        q, k, v = torch.randn(1, 1, lq, 16, generator=gen), torch.randn(1, 1, lk, 16, generator=gen), \
            torch.randn(1, 1, lk, 16, generator=gen)
        call = AttnCall("attention", q, k, v, 0.25, False, wl, wr)
        out, lse = run_backend(reference.BACKEND, call, Config())
        go, gl = torch.randn(out.shape, generator=gen), torch.randn(lse.shape, generator=gen)
        want = run_backend_backward(reference.BACKEND, call, Config(), out, lse, go, gl)
        cfg = Config.of(bwd_block_m=16, bwd_block_n=16, bwd_dq=mode)
        got = flash_bwd.backward(cfg, eager_launcher, call, out, lse, go, gl)
        floor = 1e-2 * want[2].norm()
        for name, a, b in zip(("dq", "dk", "dv"), got, want):
            err = ((a - b).norm() / torch.maximum(b.norm(), floor)).item()
            assert err <= 1e-4, f"{name} lk={lk} window=({wl}, {wr}) {mode}: {err:.1e}"


def test_kv_seqlens_with_an_empty_sequence_gives_zero_grads_and_no_nan(monkeypatch):
    dq, dk, dv = check_dense(monkeypatch, b=2, hq=2, hkv=1, lq=20, lk=35, d=16, dv=16, causal=True,
                             kv_seqlens=torch.tensor([0, 23]))
    assert dq[0].abs().max() == 0 and dk[0].abs().max() == 0 and dv[0].abs().max() == 0
    assert dk[1, :, 23:].abs().max() == 0 and dv[1, :, 23:].abs().max() == 0  # keys past the length


def test_kv_seqlens_without_causal_masks_keys_past_each_length(monkeypatch):
    """Keys in [kv_seqlens[b], Lk) are real data in the tensor: only the mask keeps them out (a tile
    that straddles the length must be masked even where no causal/window edge crosses it)."""
    for cfg in (SMALL, Config.of(bwd_block_m=16, bwd_block_n=16, bwd_dq="atomic")):
        dq, dk, dv = check_dense(monkeypatch, cfg=cfg, b=3, hq=2, hkv=1, lq=30, lk=45, d=16, dv=16,
                                 kv_seqlens=torch.tensor([0, 17, 45]))
        assert dk[1, :, 17:].abs().max() == 0 and dv[1, :, 17:].abs().max() == 0


def test_nan_past_kv_seqlens_reaches_no_gradient(monkeypatch):
    """p is 0 past a length, but 0 * NaN is not: dP = V dO^T of a NaN value made dS, and with it dK (and an
    atomic dQ), NaN."""
    for cfg in (SMALL, Config.of(bwd_block_m=16, bwd_block_n=16, bwd_dq="atomic")):
        dq, dk, dv = check_dense(monkeypatch, cfg=cfg, nan_past_lengths=True, b=3, hq=2, hkv=1, lq=30, lk=45, d=16,
                                 dv=16, kv_seqlens=torch.tensor([0, 17, 45]))
        assert dk[1, :, 17:].abs().max() == 0 and dv[1, :, 17:].abs().max() == 0


def test_float16_matches_within_the_gate_tolerance(monkeypatch):
    check_dense(monkeypatch, dtype=torch.float16, b=1, hq=2, hkv=1, lq=45, lk=45, d=40, dv=24, causal=True)


def test_grad_lse_none_and_grad_out_none(monkeypatch):
    check_dense(monkeypatch, use_dlse=False, b=1, hq=2, hkv=2, lq=30, lk=30, d=16, dv=16, causal=True)
    q, k, v, _, gl = dense_case(1, 2, 1, 19, 26, 16, 16, torch.float32)
    mask = dense_mask(19, 26, False, -1, -1, None)
    out, lse, want = oracle_grads(q, k, v, mask, 0.25, torch.zeros(1, 2, 19, 16), gl)
    call = AttnCall("attention", q, k, v, 0.25)
    got = run_ours(call, SMALL, out.float(), lse.float(), None, gl, monkeypatch)
    assert_close(got, want, torch.float32)


def test_default_and_large_tiles_match_small_tiles(monkeypatch):
    for cfg in (Config(), Config.of(bwd_block_m=64, bwd_block_n=32, bwd_warps=8, unknown_key=3)):
        check_dense(monkeypatch, cfg=cfg, b=1, hq=2, hkv=1, lq=70, lk=90, d=16, dv=16, causal=True, wl=40)


def test_any_input_strides_and_outputs_keep_them(monkeypatch):
    """(B, L, H, D) storage seen through a transpose, as models produce it; grad_out sliced."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 33, 4, 16, generator=gen).transpose(1, 2)
    k = torch.randn(2, 41, 2, 16, generator=gen).transpose(1, 2)
    v = torch.randn(2, 2, 41, 48, generator=gen)[..., ::2]
    go = torch.randn(2, 4, 33, 48, generator=gen)[..., 8:32]
    gl = torch.randn(2, 33, 4, generator=gen).transpose(1, 2)
    out, lse, want = oracle_grads(q, k, v, naive.dense_mask(33, 41, True), 0.25, go, gl)
    call = AttnCall("attention", q, k, v, 0.25, True)
    got = run_ours(call, SMALL, out.float().transpose(1, 2).contiguous().transpose(1, 2), lse.float(), go, gl,
                   monkeypatch)
    assert_close(got, want, torch.float32)
    assert got[0].stride() == q.stride() and got[1].stride() == k.stride()


# ----------------------------------------------------------------------------------- dQ modes, GQA
def test_atomic_dq_and_gqa_split_match_the_default(monkeypatch):
    for cfg in (Config.of(bwd_block_m=16, bwd_block_n=16, bwd_dq="atomic"),
                Config.of(bwd_block_m=16, bwd_block_n=32, bwd_kv_split=3),
                Config.of(bwd_block_m=32, bwd_block_n=16, bwd_kv_split=2, bwd_dq="atomic")):
        check_dense(monkeypatch, cfg=cfg, b=1, hq=6, hkv=2, lq=41, lk=50, d=16, dv=24, causal=True)


def test_deterministic_mode_uses_the_atomic_free_dq_pass(monkeypatch):
    atomic = Config.of(bwd_dq="atomic")
    assert flash_bwd.plan_for(64, atomic).atomic_dq
    assert not flash_bwd.plan_for(64, Config.of(bwd_dq="atomic", deterministic=True)).atomic_dq
    with monkeypatch.context() as m:
        m.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
        assert not flash_bwd.plan_for(64, atomic).atomic_dq
        runs = [check_dense(monkeypatch, cfg=Config.of(bwd_block_m=16, bwd_block_n=16, bwd_dq="atomic",
                                                       bwd_kv_split=2),
                            b=1, hq=4, hkv=1, lq=24, lk=24, d=16, dv=16, causal=True) for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------- varlen
def test_varlen_matches_reference_including_empty_sequences(monkeypatch):
    gen = torch.Generator().manual_seed(2)
    cu_q = torch.tensor([0, 5, 5, 40, 63], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 20, 20, 60], dtype=torch.int32)  # q-only and k-only sequences included
    q, k, v = (torch.randn(n, h, d, generator=gen) for n, h, d in ((63, 4, 16), (60, 2, 16), (60, 2, 24)))
    for causal, cfg in ((False, SMALL), (True, Config.of(bwd_block_m=16, bwd_block_n=32, bwd_dq="atomic",
                                                         bwd_kv_split=2))):
        call = AttnCall("varlen", q, k, v, 0.3, causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=35,
                        max_seqlen_k=40)
        out, lse = run_backend(reference.BACKEND, call, Config())
        go, gl = torch.randn(out.shape, generator=gen), torch.randn(lse.shape, generator=gen)
        want = run_backend_backward(reference.BACKEND, call, Config(), out, lse, go, gl)
        assert_close(run_ours(call, cfg, out, lse, go, gl, monkeypatch), want, torch.float32)


# ------------------------------------------------------------------------------------- block sparse
def random_block_mask(batch, heads, lq, lk, bq, bk, seed=0, with_full=True) -> BlockSparseMask:
    """Each (q block, kv block) is absent, full or partial (random bits); lists in random order."""
    gen = torch.Generator().manual_seed(seed)
    nq, nk = -(-lq // bq), -(-lk // bk)
    state = torch.randint(0, 3 if with_full else 2, (batch, heads, nq, nk), generator=gen)  # 0 / partial / full
    cnt, fcnt = (state == 1).sum(-1).int(), (state == 2).sum(-1).int()
    idx = torch.zeros(batch, heads, nq, max(int(cnt.max()), 1), dtype=torch.int32)
    fidx = torch.zeros(batch, heads, nq, max(int(fcnt.max()), 1), dtype=torch.int32)
    bits = torch.zeros(*idx.shape, bq, bk // 32, dtype=torch.int32)
    rows, cols = torch.arange(bq)[:, None], torch.arange(bk)[None, :]
    for b in range(batch):
        for h in range(heads):
            for m in range(nq):
                part = (state[b, h, m] == 1).nonzero().flatten()
                full = (state[b, h, m] == 2).nonzero().flatten()
                part = part[torch.randperm(len(part), generator=gen)]
                full = full[torch.randperm(len(full), generator=gen)]
                idx[b, h, m, : len(part)], fidx[b, h, m, : len(full)] = part.int(), full.int()
                for s, n in enumerate(part.tolist()):
                    keep = (torch.rand(bq, bk, generator=gen) < 0.5) & (rows + m * bq < lq) & (cols + n * bk < lk)
                    bits[b, h, m, s] = pack_bits(keep)
    return BlockSparseMask((lq, lk), bq, bk, cnt, idx, fcnt if with_full else None, fidx if with_full else None,
                           bits, 0.5, 0.5)


SPARSE_CASES = {
    "per batch and head": dict(mask_bh=(2, 4), bq=32, bk=32, cfg=SMALL),
    "broadcast over batch and heads, atomic dQ": dict(mask_bh=(1, 1), bq=32, bk=32,
                                                      cfg=Config.of(bwd_block_m=32, bwd_block_n=32, bwd_dq="atomic")),
    "broadcast heads, block_q != block_kv": dict(mask_bh=(2, 1), bq=16, bk=64, cfg=Config()),
    "no full blocks, tiles fitted to gcd 16": dict(mask_bh=(1, 4), bq=48, bk=32, cfg=Config(), with_full=False),
}


@pytest.mark.parametrize("case", SPARSE_CASES, ids=list(SPARSE_CASES))
def test_block_sparse_matches_reference(case, monkeypatch):
    c = SPARSE_CASES[case]
    gen = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(2, 4, 70, 16, generator=gen), torch.randn(2, 2, 75, 16, generator=gen), \
        torch.randn(2, 2, 75, 24, generator=gen)
    sparse = random_block_mask(*c["mask_bh"], 70, 75, c["bq"], c["bk"], with_full=c.get("with_full", True))
    call = AttnCall("block_sparse", q, k, v, 0.3, sparse=sparse)
    out, lse = run_backend(reference.BACKEND, call, Config())
    go, gl = torch.randn(out.shape, generator=gen), torch.randn(lse.shape, generator=gen)
    want = run_backend_backward(reference.BACKEND, call, Config(), out, lse, go, gl)
    assert_close(run_ours(call, c["cfg"], out, lse, go, gl, monkeypatch), want, torch.float32)


def test_transposed_block_lists_are_compact_and_ordered():
    sparse = random_block_mask(2, 3, 100, 130, 16, 32, seed=4)
    row_start, codes, slots1 = flash_bwd.transpose_block_lists(sparse, -(-130 // 32))
    assert codes.shape[-1] == sparse.kv_indices.shape[-1] * sparse.num_q_blocks + \
        sparse.full_kv_indices.shape[-1] * sparse.num_q_blocks  # listed width, not Lq x Lk
    dense = sparse.dense_mask()
    for b in range(2):
        for h in range(3):
            for n in range(row_start.shape[-1] - 1):
                entries = codes[b, h, row_start[b, h, n]: row_start[b, h, n + 1]]
                q_blocks = (entries // slots1).tolist()
                assert q_blocks == sorted(q_blocks)
                cols = slice(n * 32, (n + 1) * 32)
                seen = [m for m in range(sparse.num_q_blocks) if dense[b, h, m * 16:(m + 1) * 16, cols].any()]
                assert set(seen) <= set(q_blocks)  # every q block with a visible pair is listed


def test_transposed_lists_are_computed_once_per_mask_and_again_when_it_changes(monkeypatch):
    made = []
    real = flash_bwd.transpose_block_lists
    monkeypatch.setattr(flash_bwd, "transpose_block_lists", lambda sp, n: made.append(n) or real(sp, n))
    sparse = random_block_mask(2, 3, 100, 130, 16, 32, seed=5)
    first = flash_bwd.transposed_block_lists(sparse, 5)
    again = flash_bwd.transposed_block_lists(sparse, 5)
    assert len(made) == 1 and all(a is b for a, b in zip(first[:2], again[:2]))
    sparse.kv_indices.add_(0)  # written in place: its version counter moves, and the lists are made again
    changed = flash_bwd.transposed_block_lists(sparse, 5)
    assert len(made) == 2 and torch.equal(changed[1], first[1])
    other = random_block_mask(2, 3, 100, 130, 16, 32, seed=6)
    want = real(other, 5)
    got = flash_bwd.transposed_block_lists(other, 5)
    assert len(made) == 3 and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ------------------------------------------------------------------------------- configs, problems
def _problem(**kw) -> Problem:
    base = dict(op="attention", dtype="float16", device_type="cuda", batch=4, heads_q=32, heads_kv=32,
                len_q=4096, len_k=4096, head_dim=128, head_dim_v=128, causal=True)
    return Problem(**{**base, **kw})


def test_backward_configs_are_unique_and_fit_block_sizes():
    h100 = DeviceInfo("NVIDIA H100 80GB HBM3", (9, 0), 132)
    for p in (_problem(), _problem(head_dim=64, head_dim_v=64), _problem(head_dim=256, head_dim_v=256),
              _problem(op="block_sparse", causal=False, block_q=128, block_kv=64)):
        cfgs = [c for c, _ in flash_bwd.backward_candidates(p, h100)]
        names = [str(c) for c in cfgs]
        assert cfgs and len(set(names)) == len(names)
        assert {c["bwd_dq"] for c in cfgs} == {"separate", "atomic"}
        if p.op == "block_sparse":
            assert all(64 % c["bwd_block_m"] == 0 and 64 % c["bwd_block_n"] == 0 for c in cfgs)


def test_unsupported_problems_say_why():
    assert "float64" in flash_bwd.unsupported_reason(_problem(dtype="float64"))
    assert "multiples of 16" in flash_bwd.unsupported_reason(_problem(op="block_sparse", block_q=8, block_kv=32))
    assert "interpreter" in flash_bwd.unsupported_reason(_problem(device_type="cpu", dtype="bfloat16"))
    assert flash_bwd.unsupported_reason(_problem()) is None
    with pytest.raises(TypeError, match="float64"):
        q = torch.randn(1, 1, 4, 16, dtype=torch.float64)
        flash_bwd.backward(Config(), eager_launcher, AttnCall("attention", q, q, q, 1.0), q, q[..., 0].float(), q, None)


@pytest.mark.parametrize("cfg, hq, hkv, op", [
    (SMALL, 4, 2, "attention"),
    (Config.of(bwd_block_m=16, bwd_block_n=16, bwd_dq="atomic", bwd_kv_split=2), 4, 1, "attention"),
    (SMALL, 2, 2, "varlen"),
    (SMALL, 4, 2, "block_sparse"),
], ids=["separate_dq", "atomic_dq_kv_split", "varlen", "block_sparse"])
def test_a_compile_launches_nothing(monkeypatch, cfg, hq, hkv, op):
    """``Plan.compile`` (the warmup launcher) compiles the Triton kernels and runs no kernel at all, zeroing
    and summing included (base.py's Plan contract). Every aten op it dispatches allocates or views."""
    compiled = stub_triton_compile(monkeypatch)
    q, k, v, _, _ = dense_case(1, hq, hkv, 32, 32, 16, 16, torch.float32)
    if op == "varlen":
        q, k, v = (x[0].transpose(0, 1).contiguous() for x in (q, k, v))
        cu = torch.tensor([0, 12, 32], dtype=torch.int32)
        call = AttnCall("varlen", q, k, v, 0.25, True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=20,
                        max_seqlen_k=20)
    elif op == "block_sparse":  # a mask the transposed lists were never made for
        k, v = (torch.randn(1, hkv, 64, 16) for _ in range(2))
        call = AttnCall("block_sparse", q, k, v, 0.25, sparse=random_block_mask(1, 2, 32, 64, 16, 32, seed=9))
    else:
        call = AttnCall("attention", q, k, v, 0.25, causal=True)
    out, lse = reference.run_forward(call)
    with ComputingOps() as rec:
        flash_bwd.backward(cfg, warmup_launcher, call, out, lse, None, None)
    assert compiled and rec.ops == []


@pytest.mark.parametrize("with_full", [True, False])
def test_a_compile_passes_block_lists_laid_out_as_the_computed_ones(with_full):
    sparse = random_block_mask(2, 3, 100, 130, 16, 32, seed=4, with_full=with_full)
    computed = flash_bwd.transpose_block_lists(sparse, 5)
    unfilled = flash_bwd._unfilled_block_lists(sparse, 5)
    assert computed[2] == unfilled[2]
    for a, b in zip(computed[:2], unfilled[:2]):
        assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype)


def test_transposed_lists_are_safe_to_share_between_threads(monkeypatch):
    """Autograd runs backward in a thread per device and servers call from many: one thread's eviction must not
    take the entry another has just made (a KeyError in move_to_end)."""
    import threading
    import time

    real = flash_bwd.transpose_block_lists

    def slow(sparse, n):
        time.sleep(0.001)
        return real(sparse, n)

    monkeypatch.setattr(flash_bwd, "transpose_block_lists", slow)
    monkeypatch.setattr(flash_bwd, "_TRANSPOSED_KEPT", 1)
    masks = [random_block_mask(1, 1, 64, 64, 16, 32, seed=s) for s in range(6)]
    errors = []

    def work():
        try:
            for _ in range(10):
                for sparse in masks:
                    flash_bwd.transposed_block_lists(sparse, 2)
        except Exception as err:  # noqa: BLE001 - what the test reports
            errors.append(err)

    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(flash_bwd._TRANSPOSED) == 1
