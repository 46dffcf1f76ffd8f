"""flash-attn-4 through the fa4 backend on a GPU, against the reference backend (fp16 and bf16).

Run on a CUDA machine with FA4 installed (``pip install ".[fa4]"``): ``pytest -m gpu tests/test_fa4_gpu.py``.
Skipped when flash-attn-4 cannot be imported there (the reason is shown).
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from inductor_attn.backends import Config, fa4, reference, run_backend, run_backend_backward
from inductor_attn.backends.base import AttnCall
from inductor_attn.block_mask import BlockSparseMask
from inductor_attn.device import device_info
from inductor_attn.tuning.correctness import check_output, check_tensor

pytestmark = pytest.mark.gpu
DTYPES = [torch.bfloat16, torch.float16]
FA4, REF = fa4.BACKEND, reference.BACKEND


@pytest.fixture(scope="module")
def dev():
    loaded = fa4.loading.load()
    if isinstance(loaded, str):
        pytest.skip(f'{loaded} (pip install ".[fa4]" on a CUDA machine)')
    return device_info("cuda")


def rand(*shape, dtype, gen):
    return torch.randn(*shape, device="cuda", dtype=dtype, generator=gen)


def dense_call(b, hq, hkv, lq, lk, d, dtype, causal=False, left=-1, right=-1, kv_seqlens=None, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = rand(b, hq, lq, d, dtype=dtype, gen=gen), rand(b, hkv, lk, d, dtype=dtype, gen=gen), \
        rand(b, hkv, lk, d, dtype=dtype, gen=gen)
    return AttnCall("attention", q, k, v, d ** -0.5, causal, left, right, kv_seqlens)


def assert_matches_reference(call: AttnCall, cfg=Config()):
    out, lse = run_backend(FA4, call, cfg)
    ref_out, ref_lse = run_backend(REF, call, Config())
    reason = check_output(out, lse, ref_out, ref_lse, call.q.dtype)
    assert reason is None, f"{cfg}: {reason}"
    return out, lse


DENSE = [
    dict(b=2, hq=8, hkv=8, lq=300, lk=300, d=128),
    dict(b=2, hq=8, hkv=8, lq=300, lk=300, d=128, causal=True),
    dict(b=2, hq=8, hkv=2, lq=128, lk=512, d=128, causal=True),  # GQA, lower-right causal
    dict(b=1, hq=8, hkv=8, lq=512, lk=512, d=64, causal=True, left=64),  # sliding window
    dict(b=1, hq=4, hkv=4, lq=256, lk=384, d=256, causal=True),
    dict(b=2, hq=6, hkv=2, lq=200, lk=200, d=96),
]


@pytest.mark.parametrize("case", DENSE, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_forward_matches_reference(dev, case, dtype):
    call = dense_call(dtype=dtype, **case)
    assert FA4.supports(call.problem, dev) is None
    assert_matches_reference(call)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_with_kv_seqlens_matches_reference(dev, causal, dtype):
    lens = torch.tensor([1000, 37, 512], device="cuda", dtype=torch.int32)
    call = dense_call(3, 16, 4, 1, 1000, 128, dtype, causal=causal, kv_seqlens=lens)
    for cfg in (Config(), Config.of(pack_gqa=False)):
        assert_matches_reference(call, cfg)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hkv", [8, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_forward_matches_reference(dev, causal, hkv, dtype):
    gen = torch.Generator(device="cuda").manual_seed(1)
    cu = torch.tensor([0, 100, 357, 512], device="cuda", dtype=torch.int32)
    q = rand(512, 8, 128, dtype=dtype, gen=gen)
    k, v = rand(512, hkv, 128, dtype=dtype, gen=gen), rand(512, hkv, 128, dtype=dtype, gen=gen)
    call = AttnCall("varlen", q, k, v, 128 ** -0.5, causal, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=257,
                    max_seqlen_k=257)
    assert_matches_reference(call)


def _sparse_call(mask_mod, heads, d, dtype, length=512, block=128, hkv=None):
    bm = create_block_mask(mask_mod, 2, heads, length, length, device="cuda", BLOCK_SIZE=block)
    sparse = BlockSparseMask.from_block_mask(bm)
    gen = torch.Generator(device="cuda").manual_seed(2)
    hq = 8
    q = rand(2, hq, length, d, dtype=dtype, gen=gen)
    k, v = (rand(2, hkv or hq, length, d, dtype=dtype, gen=gen) for _ in range(2))
    return AttnCall("block_sparse", q, k, v, d ** -0.5, sparse=sparse)


def doc_mask(b, h, q, kv):  # per-batch documents and a per-head window: partial, full and empty blocks
    return ((q // (150 + 60 * b)) == (kv // (150 + 60 * b))) & (q - kv <= 200 + 16 * h) & (kv <= q)


def block_causal(b, h, q, kv):  # whole blocks only: no partial block, no mask_mod
    return kv // 128 <= q // 128


@pytest.mark.parametrize("mask_mod, heads", [(doc_mask, 8), (doc_mask, None), (block_causal, None)],
                         ids=["partial-per-head", "partial-shared", "full-blocks-only"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_block_sparse_forward_matches_reference(dev, mask_mod, heads, d, dtype):
    call = _sparse_call(mask_mod, heads, d, dtype)
    for cand in [c.config for c in fa4.BACKEND.configs(call.problem, dev)]:
        if FA4._pruned(call.problem, dev, cand) is None:
            assert_matches_reference(call, cand)


def test_block_sparse_gqa_with_a_shared_mask(dev):
    assert_matches_reference(_sparse_call(doc_mask, None, 128, torch.bfloat16, hkv=2))


@pytest.mark.parametrize("case", [dict(b=2, hq=8, hkv=8, lq=1024, lk=1024, d=128, causal=True),
                                  dict(b=2, hq=8, hkv=2, lq=1024, lk=1024, d=64)], ids=["d128-causal", "d64-gqa"])
def test_every_runnable_config_matches_or_fails_softly(dev, case):
    """A candidate that compiles but cannot launch must surface as RuntimeError (the tuner drops it),
    never as another exception type."""
    call = dense_call(dtype=torch.bfloat16, **case)
    ran, failed = [], []
    for cfg in [c.config for c in FA4.configs(call.problem, dev)]:
        if FA4._pruned(call.problem, dev, cfg) is not None:
            continue
        try:
            assert_matches_reference(call, cfg)
            ran.append(str(cfg))
        except RuntimeError as err:
            failed.append(f"{cfg}: {err}")
    print("ran:", ran, "\nfailed:", failed)
    assert "default" in ran and len(ran) >= len(failed)


def test_heuristic_config_runs_where_fa4_has_a_hand_rule(dev):
    call = dense_call(2, 8, 2, 512, 512, 128, torch.bfloat16, causal=True)
    cfg = FA4.heuristic(call.problem, dev)
    if dev.arch // 10 == 9:  # no FA4 hand rule on Hopper: the heuristic mode keeps the default candidate
        assert cfg is None
    else:
        assert_matches_reference(call, cfg)


def test_native_fa4_layout_is_not_copied(dev):
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (rand(2, 256, 8, 64, dtype=torch.bfloat16, gen=gen).transpose(1, 2) for _ in range(3))
    before = sum(fa4.COPIES.values())
    call = AttnCall("attention", q, k, v, 0.125, causal=True)
    assert_matches_reference(call)
    assert_matches_reference(call, Config.of(intra_wg_overlap=False))
    assert sum(fa4.COPIES.values()) == before


def test_sm90_default_tile_matches_fa4_functions(dev):
    from flash_attn.cute import interface

    for d, dv in ((64, 64), (96, 96), (128, 128), (192, 128), (256, 256)):
        for causal, local in ((False, False), (True, False), (False, True)):
            cfg = interface._tile_size_fwd_sm90(d, dv, causal, local)
            assert fa4.sm90_default_tile(d, dv, causal, local) == (cfg.m_block_size, cfg.n_block_size)


BACKWARD = [
    dict(b=2, hq=8, hkv=8, lq=300, lk=300, d=128),
    dict(b=2, hq=8, hkv=8, lq=256, lk=256, d=64, causal=True),
    dict(b=2, hq=8, hkv=2, lq=128, lk=384, d=128, causal=True),  # GQA, lower-right causal
    dict(b=1, hq=4, hkv=4, lq=512, lk=512, d=128, causal=True, left=100),
]


def _grads_match(call, out, lse, grad_out, grad_lse):
    got = run_backend_backward(FA4, call, Config(), out, lse, grad_out, grad_lse)
    want = run_backend_backward(REF, call, Config(), out, lse, grad_out, grad_lse)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert g.shape == w.shape, name
        reason = check_tensor(name, g, w, call.q.dtype)
        assert reason is None, reason


@pytest.mark.parametrize("case", BACKWARD, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_grad_lse", [False, True])
def test_dense_backward_matches_reference(dev, case, dtype, with_grad_lse):
    call = dense_call(dtype=dtype, **case)
    assert FA4.supports(call.problem, dev, "backward") is None
    out, lse = run_backend(FA4, call, Config())
    gen = torch.Generator(device="cuda").manual_seed(4)
    grad_out = torch.randn(out.shape, device="cuda", dtype=dtype, generator=gen)
    grad_lse = torch.randn(lse.shape, device="cuda", generator=gen) if with_grad_lse else None
    _grads_match(call, out, lse, grad_out, grad_lse)


@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_and_kv_seqlens_backward_match_reference(dev, dtype):
    gen = torch.Generator(device="cuda").manual_seed(5)
    cu = torch.tensor([0, 100, 357, 512], device="cuda", dtype=torch.int32)
    q, k, v = (rand(512, 4, 64, dtype=dtype, gen=gen) for _ in range(3))
    call = AttnCall("varlen", q, k, v, 0.125, True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=257,
                    max_seqlen_k=257)
    out, lse = run_backend(FA4, call, Config())
    _grads_match(call, out, lse, torch.randn_like(out), None)
    lens = torch.tensor([300, 77], device="cuda", dtype=torch.int32)
    call = dense_call(2, 4, 4, 64, 300, 64, dtype, causal=True, kv_seqlens=lens)
    out, lse = run_backend(FA4, call, Config())
    _grads_match(call, out, lse, torch.randn_like(out), None)


def _poison(*like: torch.Tensor, value: float = float("nan")) -> None:
    """``value`` where the next allocations will likely land: one large block (the caching allocator's large pool
    hands freed blocks out again) and a block of each size in ``like`` (small ones come from another pool)."""
    torch.full((64 << 20,), value, device="cuda")
    for t in like:
        torch.full(t.shape, value, dtype=t.dtype, device=t.device)


def test_varlen_replays_match_the_reference_with_new_documents(dev):
    """Packed documents (one cu_seqlens tensor for q and k, as the document rewrite passes them): after the
    first call the forward and the backward replay FA4's kernels on sm_90 with each call's own boundaries and
    inputs."""
    dtype = torch.bfloat16
    fwd = bwd = None
    for i, bounds in enumerate(([0, 100, 357, 512], [0, 7, 300, 512], [0, 250, 251, 512])):
        gen = torch.Generator(device="cuda").manual_seed(10 + i)
        cu = torch.tensor(bounds, device="cuda", dtype=torch.int32)
        q, k, v = (rand(512, 4, 64, dtype=dtype, gen=gen) for _ in range(3))
        call = AttnCall("varlen", q, k, v, 0.125, True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=300,
                        max_seqlen_k=300)
        fwd = fwd or FA4.plan(call.problem, dev, Config(), "forward").launch
        bwd = bwd or FA4.plan(call.problem, dev, Config(), "backward").launch
        _poison(call.q, call.q[..., 0].float().t())
        out, lse = fwd(call)
        ref_out, ref_lse = run_backend(REF, call, Config())
        assert check_output(out, lse, ref_out, ref_lse, dtype) is None, f"call {i}"
        grad_out = torch.randn_like(out)
        _poison(call.q, call.k, call.v)
        got = bwd(call, out, lse, grad_out, None)
        want = run_backend_backward(REF, call, Config(), out, lse, grad_out, None)
        for name, g, w in zip(("dq", "dk", "dv"), got, want):
            assert check_tensor(name, g, w, dtype) is None, f"backward, call {i}: {check_tensor(name, g, w, dtype)}"
    if fa4.family(dev.arch) == "sm90":
        assert fwd.replays.by_layout and all(fwd.replays.by_layout.values()), "sm_90 varlen forward plans replay"
        assert bwd.replays.by_layout and all(bwd.replays.by_layout.values()), "sm_90 varlen backward plans replay"


REPLAYED = BACKWARD[:3] + [dict(b=2, hq=4, hkv=4, lq=64, lk=300, d=64, causal=True, lens=((300, 77), (251, 300),
                                                                                       (64, 150)))]


@pytest.mark.parametrize("case", REPLAYED, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("with_grad_lse", [False, True])
def test_recorded_kernel_replays_match_the_reference_on_new_inputs(dev, case, deterministic, with_grad_lse):
    """One plan per direction, as compiled code holds it: the forward's first call goes through FA4's
    interface and is recorded; on sm_90 it then replays the recorded kernels (no interface call), the
    backward's with its scratch buffers allocated again, and every later call, forward and backward,
    on new inputs (new kv_seqlens values, a new grad_lse), still matches the float64 reference. Memory the
    plans allocate comes from NaN-filled blocks, so an unwritten output shows."""
    case = dict(case)
    lens = case.pop("lens", None) or (None,) * 3
    dtype = torch.bfloat16
    calls = [dense_call(dtype=dtype, seed=s, **case,
                        kv_seqlens=None if n is None else torch.tensor(n, device="cuda", dtype=torch.int32))
             for s, n in enumerate(lens)]
    fwd = FA4.plan(calls[0].problem, dev, Config(), "forward").launch
    bwd = FA4.plan(calls[0].problem, dev, Config.of(deterministic=deterministic), "backward").launch
    for i, call in enumerate(calls):
        _poison(call.q, call.q[..., 0].float())
        out, lse = fwd(call)
        ref_out, ref_lse = run_backend(REF, call, Config())
        assert check_output(out, lse, ref_out, ref_lse, dtype) is None, f"forward, call {i}"
        grad_out = torch.randn_like(out)
        grad_lse = torch.randn_like(lse) if with_grad_lse else None
        _poison(call.q, call.k, call.v)
        got = bwd(call, out, lse, grad_out, grad_lse)
        want = run_backend_backward(REF, call, Config(), out, lse, grad_out, grad_lse)
        for name, g, w in zip(("dq", "dk", "dv"), got, want):
            assert check_tensor(name, g, w, dtype) is None, f"backward, call {i}: {check_tensor(name, g, w, dtype)}"
        if fa4.family(dev.arch) == "sm90":
            assert fwd.replays.by_layout and all(fwd.replays.by_layout.values()), "sm_90 forward plans replay"
            assert bwd.replays.by_layout and all(bwd.replays.by_layout.values()), "sm_90 backward plans replay"


@pytest.mark.parametrize("hkv", [4, 1], ids=["mha", "gqa"])
def test_a_backward_replay_recorded_over_zeroed_memory_zeroes_only_what_fa4s_kernels_need(dev, hkv):
    """The recording's memory reads all zeros (fresh from the allocator, as in a new process), so FA4's
    ``torch.empty`` buffers look zeroed; the check tries each poisoned, and the replay zeroes only what b36
    allocates with ``torch.zeros`` (GQA's dK/dV accumulators), not dq's accumulator, which its preprocess
    clears. Later calls, over NaN-filled memory, still match the float64 reference."""
    dtype = torch.bfloat16
    calls = [dense_call(2, 4, hkv, 128, 128, 64, dtype, causal=True, seed=s) for s in range(3)]
    fwd = FA4.plan(calls[0].problem, dev, Config(), "forward").launch
    bwd = FA4.plan(calls[0].problem, dev, Config.of(deterministic=False), "backward").launch
    for i, call in enumerate(calls):
        out, lse = fwd(call)
        grad_out = torch.randn_like(out)
        _poison(call.q, call.k, call.v, value=0.0 if i == 0 else float("nan"))
        got = bwd(call, out, lse, grad_out, None)
        want = run_backend_backward(REF, call, Config(), out, lse, grad_out, None)
        for name, g, w in zip(("dq", "dk", "dv"), got, want):
            assert check_tensor(name, g, w, dtype) is None, f"backward, call {i}: {check_tensor(name, g, w, dtype)}"
    if fa4.family(dev.arch) == "sm90":
        (replay,) = bwd.replays.by_layout.values()
        zeroed = [zeroed for _, _, dtype, zeroed in replay.scratch if dtype.is_floating_point]
        assert sum(zeroed) == (0 if hkv == 4 else 2), replay.scratch
        # each kernel is called through its tvm-ffi function, not a CuTe DSL compiled object's Python __call__ (a
        # kernel loaded from FA4's disk cache is such a function already)
        kernels = [fn for fn, _ in replay._picks[1]]
        assert all(type(fn).__module__ == "tvm_ffi.core" or getattr(fn, "func", None).__objclass__.__module__
                   == "tvm_ffi.core" for fn in kernels), kernels
