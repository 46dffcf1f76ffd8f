"""The reference backend against the naive float64 oracle (tests/naive.py) on random shapes and masks.

Inputs are drawn in float64 from a seeded generator and cast to the dtype under test; the oracle sees
the same (rounded) values upcast to float64, so only the backend's own arithmetic is measured.
"""

from __future__ import annotations

import naive
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_block_mask, create_mask

import inductor_attn
from inductor_attn.backends import only_backends, reference
from inductor_attn.tuning.correctness import LSE_TOLERANCE, TOLERANCES, rel_err

# The per-test autouse store fixture (conftest) is safe to share between examples.
RANDOM = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
LOW_PRECISION = (torch.float32, torch.bfloat16, torch.float16)
# lse is float32 whatever the input dtype: a float64-exact lse still carries float32 rounding.
LSE_FLOAT32_ROUNDING = 1e-6


@pytest.fixture(autouse=True)
def _reference_only():
    """Every call here runs on the reference backend, whatever else is registered for the CPU."""
    with only_backends(reference.BACKEND):
        yield


def rand(gen: torch.Generator, *shape: int, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


def assert_close(out, lse, ref_out, ref_lse, dtype):
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert lse.dtype == torch.float32
    assert rel_err(out, ref_out) <= TOLERANCES[dtype], f"out rel. error {rel_err(out, ref_out):.2e}"
    lse_tol = LSE_FLOAT32_ROUNDING if dtype == torch.float64 else LSE_TOLERANCE[dtype]
    assert rel_err(lse, ref_lse) <= lse_tol, f"lse rel. error {rel_err(lse, ref_lse):.2e}"


# --------------------------------------------------------------------------------------------- dense
@st.composite
def dense_problems(draw):
    batch, heads_kv, group = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.sampled_from([1, 2, 4]))
    lq, lk = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    causal = draw(st.booleans())
    window = (draw(st.integers(-1, 12)), draw(st.integers(-1, 12)))
    kv_seqlens = draw(st.none() | st.lists(st.integers(0, lk), min_size=batch, max_size=batch))
    key_mask = draw(st.none() | st.lists(st.lists(st.booleans(), min_size=lk, max_size=lk), min_size=batch,
                                         max_size=batch))
    return dict(shape=(batch, heads_kv * group, heads_kv, lq, lk), head_dims=draw(st.sampled_from([(8, 8), (16, 16),
                (32, 16)])), causal=causal, window=window, kv_seqlens=kv_seqlens, key_mask=key_mask,
                seed=draw(st.integers(0, 2**31)))


def run_dense(p, dtype):
    batch, hq, hkv, lq, lk = p["shape"]
    d, dv = p["head_dims"]
    gen = torch.Generator().manual_seed(p["seed"])
    q, k, v = rand(gen, batch, hq, lq, d, dtype=dtype), rand(gen, batch, hkv, lk, d, dtype=dtype), \
        rand(gen, batch, hkv, lk, dv, dtype=dtype)
    kv_seqlens = None if p["kv_seqlens"] is None else torch.tensor(p["kv_seqlens"], dtype=torch.int32)
    key_mask = None if p["key_mask"] is None else torch.tensor(p["key_mask"], dtype=torch.bool)
    out, lse = inductor_attn.attention(q, k, v, causal=p["causal"], window=p["window"], kv_seqlens=kv_seqlens,
                                       key_mask=key_mask, scale=0.3, return_lse=True)
    ref_out, ref_lse = naive.dense(q, k, v, 0.3, p["causal"], *p["window"], kv_seqlens, key_mask)
    return out, lse, ref_out, ref_lse


@RANDOM
@given(dense_problems())
def test_dense_matches_naive_exactly_in_float64(p):
    out, lse, ref_out, ref_lse = run_dense(p, torch.float64)
    assert out.dtype == torch.float64
    assert_close(out, lse, ref_out, ref_lse, torch.float64)


@RANDOM
@given(dense_problems(), st.sampled_from(LOW_PRECISION))
def test_dense_matches_naive_within_dtype_tolerance(p, dtype):
    out, lse, ref_out, ref_lse = run_dense(p, dtype)
    assert out.dtype == dtype
    assert_close(out, lse, ref_out, ref_lse, dtype)


def unmasked_rows(q, k, v, scale, key_range):
    """Row-by-row attention of q over k[..., lo:hi] with no mask: the oracle of the mask semantics."""
    rows = []
    for i in range(q.shape[2]):
        lo, hi = key_range(i)
        lo, hi = max(lo, 0), min(hi, k.shape[2])
        if hi <= lo:
            rows.append(torch.zeros(*q.shape[:2], 1, v.shape[-1], dtype=torch.float64))
            continue
        full = torch.ones(1, hi - lo, dtype=torch.bool)
        rows.append(naive.attend(q[:, :, i : i + 1], k[:, :, lo:hi], v[:, :, lo:hi], full, scale)[0])
    return torch.cat(rows, dim=2)


@pytest.mark.parametrize("lq, lk", [(5, 13), (13, 5), (1, 9), (9, 9)])
def test_causal_is_lower_right_aligned_when_lq_differs_from_lk(lq, lk):
    gen = torch.Generator().manual_seed(lq * 100 + lk)
    q, k, v = rand(gen, 1, 2, lq, 16), rand(gen, 1, 2, lk, 16), rand(gen, 1, 2, lk, 16)
    out = inductor_attn.attention(q, k, v, causal=True)
    # query i sees keys j <= i + Lk - Lq; the first Lq - Lk rows (Lq > Lk) see nothing
    expected = unmasked_rows(q, k, v, 16**-0.5, lambda i: (0, i + lk - lq + 1))
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal, window, key_range", [
    (False, (2, 1), lambda i, off: (i + off - 2, i + off + 2)),
    (False, (0, -1), lambda i, off: (i + off, 10**9)),
    (False, (-1, 0), lambda i, off: (0, i + off + 1)),
    (True, 3, lambda i, off: (i + off - 3, i + off + 1)),
    (False, 3, lambda i, off: (i + off - 3, i + off + 4)),
])
def test_window_keeps_keys_between_left_and_right_of_the_aligned_diagonal(causal, window, key_range):
    lq, lk = 7, 11
    gen = torch.Generator().manual_seed(7)
    q, k, v = rand(gen, 2, 2, lq, 16), rand(gen, 2, 2, lk, 16), rand(gen, 2, 2, lk, 16)
    out = inductor_attn.attention(q, k, v, causal=causal, window=window)
    expected = unmasked_rows(q, k, v, 16**-0.5, lambda i: key_range(i, lk - lq))
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_kv_seqlens_aligns_causal_to_each_batch_length():
    lq, lk, lengths = 4, 12, [12, 7, 4]
    gen = torch.Generator().manual_seed(3)
    q, k, v = rand(gen, 3, 2, lq, 16), rand(gen, 3, 2, lk, 16), rand(gen, 3, 2, lk, 16)
    out = inductor_attn.attention(q, k, v, causal=True, kv_seqlens=torch.tensor(lengths, dtype=torch.int32))
    for b, n in enumerate(lengths):
        alone = inductor_attn.attention(q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n], causal=True)
        torch.testing.assert_close(out[b : b + 1], alone, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("heads_kv", [1, 2], ids=["mqa", "gqa"])
def test_grouped_kv_heads_match_repeated_kv_heads(heads_kv):
    gen = torch.Generator().manual_seed(heads_kv)
    q, k, v = rand(gen, 2, 4, 9, 16), rand(gen, 2, heads_kv, 11, 16), rand(gen, 2, heads_kv, 11, 16)
    out, lse = inductor_attn.attention(q, k, v, causal=True, return_lse=True)
    group = 4 // heads_kv
    rep_out, rep_lse = inductor_attn.attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                               causal=True, return_lse=True)
    torch.testing.assert_close(out, rep_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, rep_lse)


def test_non_contiguous_inputs_give_the_same_result():
    gen = torch.Generator().manual_seed(5)
    q, k, v = rand(gen, 2, 10, 4, 16), rand(gen, 2, 12, 2, 16), rand(gen, 2, 12, 2, 16)  # (B, L, H, D)
    strided = inductor_attn.attention(*(x.transpose(1, 2) for x in (q, k, v)), causal=True)
    dense = inductor_attn.attention(*(x.transpose(1, 2).contiguous() for x in (q, k, v)), causal=True)
    torch.testing.assert_close(strided, dense, rtol=1e-12, atol=1e-12)


# -------------------------------------------------------------------------------------------- varlen
@st.composite
def varlen_problems(draw):
    n_seqs = draw(st.integers(1, 4))
    lens_q = draw(st.lists(st.integers(0, 20), min_size=n_seqs, max_size=n_seqs))
    lens_k = draw(st.lists(st.integers(0, 20), min_size=n_seqs, max_size=n_seqs))
    assume(max(lens_q) > 0 and max(lens_k) > 0)
    heads_kv, group = draw(st.integers(1, 2)), draw(st.sampled_from([1, 2, 3]))
    return dict(lens=(lens_q, lens_k), heads=(heads_kv * group, heads_kv), causal=draw(st.booleans()),
                window=(draw(st.integers(-1, 8)), draw(st.integers(-1, 8))), pass_max=draw(st.booleans()),
                seed=draw(st.integers(0, 2**31)))


def cu_seqlens(lengths) -> torch.Tensor:
    return torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)


@RANDOM
@given(varlen_problems(), st.sampled_from([torch.float64, torch.float32, torch.bfloat16]))
def test_varlen_matches_naive_per_sequence(p, dtype):
    (lens_q, lens_k), (hq, hkv) = p["lens"], p["heads"]
    gen = torch.Generator().manual_seed(p["seed"])
    q, k, v = rand(gen, sum(lens_q), hq, 16, dtype=dtype), rand(gen, sum(lens_k), hkv, 16, dtype=dtype), \
        rand(gen, sum(lens_k), hkv, 8, dtype=dtype)
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    maxes = (max(lens_q), max(lens_k)) if p["pass_max"] else (None, None)
    out, lse = inductor_attn.varlen_attention(q, k, v, cu_q, cu_k, *maxes, causal=p["causal"], window=p["window"],
                                              scale=0.25, return_lse=True)
    ref_out, ref_lse = naive.varlen(q, k, v, cu_q, cu_k, 0.25, p["causal"], *p["window"])
    assert out.shape == (sum(lens_q), hq, 8) and lse.shape == (hq, sum(lens_q))
    assert_close(out, lse, ref_out, ref_lse, dtype)


# --------------------------------------------------------------------------------------- block masks
def mask_mods(kind: str, gen: torch.Generator, length: int, heads: int):
    """(mask_mod, B, H) for one of the flex masks under test; B/H None = broadcast."""
    if kind == "causal":
        return (lambda b, h, q, k: q >= k), None, None
    if kind == "sliding_window":
        w = int(torch.randint(1, 48, (), generator=gen))
        return (lambda b, h, q, k: (q - k).abs() <= w), None, None
    if kind == "per_head_window":
        return (lambda b, h, q, k: (q >= k) & (q - k <= 8 + 24 * h)), None, heads
    if kind == "document":
        docs = torch.randint(0, 4, (2, length), generator=gen).sort(-1).values  # per batch
        return (lambda b, h, q, k: docs[b, q] == docs[b, k]), 2, None
    if kind == "prefix_lm":
        prefix = int(torch.randint(0, length, (), generator=gen))
        return (lambda b, h, q, k: (k <= q) | (k < prefix)), None, None
    if kind == "late_start":  # q blocks before the start list no kv block at all
        start = int(torch.randint(1, length, (), generator=gen))
        return (lambda b, h, q, k: (q >= start) & (k <= q)), None, None
    raise ValueError(kind)


MASK_KINDS = ["causal", "sliding_window", "per_head_window", "document", "prefix_lm", "late_start"]
BLOCK_SIZES = [32, 64, 128, (32, 64), (128, 32)]


@st.composite
def block_mask_problems(draw):
    block = draw(st.sampled_from(BLOCK_SIZES))
    bq, bk = block if isinstance(block, tuple) else (block, block)
    lq = draw(st.integers(2, 300).filter(lambda n: n % bq != 0))
    lk = draw(st.integers(2, 300).filter(lambda n: n % bk != 0))
    return dict(kind=draw(st.sampled_from(MASK_KINDS)), block=block, lengths=(lq, lk),
                heads=draw(st.sampled_from([(2, 2), (4, 2), (4, 1)])), seed=draw(st.integers(0, 2**31)))


def run_block_mask(p, dtype):
    (lq, lk), (hq, hkv) = p["lengths"], p["heads"]
    gen = torch.Generator().manual_seed(p["seed"])
    mod, mask_b, mask_h = mask_mods(p["kind"], gen, max(lq, lk), hq)
    block_mask = create_block_mask(mod, mask_b, mask_h, lq, lk, device="cpu", BLOCK_SIZE=p["block"])
    q, k, v = rand(gen, 2, hq, lq, 16, dtype=dtype), rand(gen, 2, hkv, lk, 16, dtype=dtype), \
        rand(gen, 2, hkv, lk, 16, dtype=dtype)
    out, lse = inductor_attn.attention(q, k, v, block_mask=block_mask, return_lse=True)
    dense = create_mask(mod, mask_b, mask_h, lq, lk, device="cpu")
    return (out, lse) + naive.attend(q, k, v, dense, 16**-0.5)


@RANDOM
@given(block_mask_problems())
def test_block_mask_matches_naive_with_flex_dense_mask_in_float64(p):
    assert_close(*run_block_mask(p, torch.float64), torch.float64)


@settings(RANDOM, max_examples=20)
@given(block_mask_problems(), st.sampled_from([torch.float32, torch.bfloat16]))
def test_block_mask_matches_naive_within_dtype_tolerance(p, dtype):
    assert_close(*run_block_mask(p, dtype), dtype)


# ----------------------------------------------------------------------------------- fully masked rows
def _dense_case(kv_seqlens=None, window=None, lq=12, lk=12):
    def run(q, k, v):
        return inductor_attn.attention(q, k, v, window=window, kv_seqlens=kv_seqlens, return_lse=True)
    return run, lq, lk


def _late_start_block_mask(lq=96, lk=80):
    block_mask = create_block_mask(lambda b, h, q, k: (q >= 70) & (k <= q), None, None, lq, lk, device="cpu",
                                   BLOCK_SIZE=32)

    def run(q, k, v):
        return inductor_attn.attention(q, k, v, block_mask=block_mask, return_lse=True)
    return run, lq, lk


FULLY_MASKED = {
    "kv_seqlens_zero": (_dense_case(kv_seqlens=torch.tensor([0, 5], dtype=torch.int32)), (0, slice(None))),
    # Lq > Lk with a (1, 1) window: query i sees keys [i - 9, i - 7], nothing for i < 7
    "window_excludes_early_rows": (_dense_case(window=(1, 1), lq=20, lk=12), (slice(None), slice(0, 7))),
    # q blocks 0 and 1 list no kv block; rows 64..69 of block 2 are masked inside a partial block
    "block_mask_empty_rows": (_late_start_block_mask(), (slice(None), slice(0, 70))),
}


@pytest.mark.parametrize("case", FULLY_MASKED.values(), ids=FULLY_MASKED.keys())
def test_fully_masked_rows_give_zeros_and_minus_inf_lse_without_nan_gradients(case):
    (run, lq, lk), (batches, rows) = case
    gen = torch.Generator().manual_seed(11)
    q, k, v = (rand(gen, 2, 2, n, 16).requires_grad_() for n in (lq, lk, lk))
    out, lse = run(q, k, v)
    assert torch.equal(out[batches][..., rows, :], torch.zeros_like(out[batches][..., rows, :]))
    assert torch.isneginf(lse[batches][..., rows]).all()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    # gradients with a random grad_lse on every row, the -inf ones included
    dq, dk, dv = torch.autograd.grad((out, lse), (q, k, v), (rand(gen, *out.shape), rand(gen, *lse.shape).float()))
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    assert torch.equal(dq[batches][..., rows, :], torch.zeros_like(dq[batches][..., rows, :]))


def test_varlen_sequence_without_keys_gives_zeros_and_minus_inf_lse():
    gen = torch.Generator().manual_seed(2)
    q, k, v = rand(gen, 9, 2, 16).requires_grad_(), rand(gen, 6, 2, 16), rand(gen, 6, 2, 16)
    cu_q, cu_k = cu_seqlens([4, 5]), cu_seqlens([0, 6])
    out, lse = inductor_attn.varlen_attention(q, k, v, cu_q, cu_k, causal=True, return_lse=True)
    assert torch.equal(out[:4], torch.zeros_like(out[:4])) and torch.isneginf(lse[:, :4]).all()
    assert torch.isfinite(lse[:, 4:]).all()
    (dq,) = torch.autograd.grad((out, lse), (q,), (rand(gen, *out.shape), rand(gen, *lse.shape).float()))
    assert torch.isfinite(dq).all() and torch.equal(dq[:4], torch.zeros_like(dq[:4]))


# ------------------------------------------------------------------------------------------- chunking
def test_results_do_not_depend_on_how_rows_are_chunked(monkeypatch):
    gen = torch.Generator().manual_seed(4)
    q, k, v = (rand(gen, 2, 4, 100, 16).requires_grad_() for _ in range(3))
    block_mask = create_block_mask(lambda b, h, qi, ki: (qi - ki).abs() <= 40, None, None, 100, 100, device="cpu",
                                   BLOCK_SIZE=32)
    calls = [dict(causal=True, window=17), dict(block_mask=block_mask)]

    def results():
        outs = []
        for kw in calls:
            out, lse = inductor_attn.attention(q, k, v, return_lse=True, **kw)
            outs += [out, lse, *torch.autograd.grad(out.sum() + lse.sum(), (q, k, v))]
        return outs

    whole = results()
    monkeypatch.setattr(reference, "_CHUNK_BYTES", 4 * 2 * 4 * 100 * 5)  # 5 rows a chunk: 20 dense chunks
    assert reference._chunk_rows(q, 100) == 5
    for chunked, one in zip(results(), whole):
        torch.testing.assert_close(chunked, one, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------------------ gradients
GRAD_DTYPES = [torch.float64, torch.float32, torch.bfloat16]


def grads_vs_oracle(inputs, run, oracle, dtype, seed):
    """Gradients of <out, g_out> + <lse, g_lse> from ``run`` (on ``dtype``) and from float64 autograd through
    ``oracle`` (on the same values); g_lse is zero on fully masked rows, where lse = -inf."""
    ours = [x.to(dtype).requires_grad_() for x in inputs]
    out, lse = run(*ours)
    gen = torch.Generator().manual_seed(seed)
    grad_out = rand(gen, *out.shape)
    grad_lse = rand(gen, *lse.shape, dtype=torch.float32).masked_fill(torch.isneginf(lse), 0)
    got = torch.autograd.grad((out, lse), ours, (grad_out.to(dtype), grad_lse))
    exact = [x.to(dtype).double().requires_grad_() for x in inputs]
    ref_out, ref_lse = oracle(*exact)
    want = torch.autograd.grad((ref_out, ref_lse), exact, (grad_out.to(dtype).double(), grad_lse.double()))
    for name, g, w in zip("qkv", got, want):
        assert g.dtype == dtype and not torch.isnan(g).any()
        assert rel_err(g, w) <= TOLERANCES[dtype], f"d{name} rel. error {rel_err(g, w):.2e}"


@RANDOM
@given(dense_problems(), st.sampled_from(GRAD_DTYPES))
def test_dense_gradients_match_naive_autograd_including_lse(p, dtype):
    batch, hq, hkv, lq, lk = p["shape"]
    d, dv = p["head_dims"]
    gen = torch.Generator().manual_seed(p["seed"])
    inputs = rand(gen, batch, hq, lq, d), rand(gen, batch, hkv, lk, d), rand(gen, batch, hkv, lk, dv)
    kv_seqlens = None if p["kv_seqlens"] is None else torch.tensor(p["kv_seqlens"], dtype=torch.int32)
    key_mask = None if p["key_mask"] is None else torch.tensor(p["key_mask"], dtype=torch.bool)

    def run(q, k, v):
        return inductor_attn.attention(q, k, v, causal=p["causal"], window=p["window"], kv_seqlens=kv_seqlens,
                                       key_mask=key_mask, scale=0.3, return_lse=True)

    def oracle(q, k, v):
        return naive.dense(q, k, v, 0.3, p["causal"], *p["window"], kv_seqlens, key_mask)

    grads_vs_oracle(inputs, run, oracle, dtype, p["seed"] + 1)


@settings(RANDOM, max_examples=20)
@given(varlen_problems(), st.sampled_from(GRAD_DTYPES))
def test_varlen_gradients_match_naive_autograd_including_lse(p, dtype):
    (lens_q, lens_k), (hq, hkv) = p["lens"], p["heads"]
    gen = torch.Generator().manual_seed(p["seed"])
    inputs = rand(gen, sum(lens_q), hq, 16), rand(gen, sum(lens_k), hkv, 16), rand(gen, sum(lens_k), hkv, 8)
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)

    def run(q, k, v):
        return inductor_attn.varlen_attention(q, k, v, cu_q, cu_k, causal=p["causal"], window=p["window"],
                                              return_lse=True)

    def oracle(q, k, v):
        return naive.varlen(q, k, v, cu_q, cu_k, 16**-0.5, p["causal"], *p["window"])

    grads_vs_oracle(inputs, run, oracle, dtype, p["seed"] + 1)


@settings(RANDOM, max_examples=20)
@given(block_mask_problems(), st.sampled_from(GRAD_DTYPES))
def test_block_mask_gradients_match_naive_autograd_including_lse(p, dtype):
    (lq, lk), (hq, hkv) = p["lengths"], p["heads"]
    gen = torch.Generator().manual_seed(p["seed"])
    mod, mask_b, mask_h = mask_mods(p["kind"], gen, max(lq, lk), hq)
    block_mask = create_block_mask(mod, mask_b, mask_h, lq, lk, device="cpu", BLOCK_SIZE=p["block"])
    dense = create_mask(mod, mask_b, mask_h, lq, lk, device="cpu")
    inputs = rand(gen, 2, hq, lq, 16), rand(gen, 2, hkv, lk, 16), rand(gen, 2, hkv, lk, 16)

    def run(q, k, v):
        return inductor_attn.attention(q, k, v, block_mask=block_mask, return_lse=True)

    def oracle(q, k, v):
        return naive.attend(q, k, v, dense, 16**-0.5)

    grads_vs_oracle(inputs, run, oracle, dtype, p["seed"] + 1)


# ---------------------------------------------------------------------------------- the kv_seqlens contract
def nan_past(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """A copy of (B, H, Lk, D) ``x`` holding NaN in every key at or past ``lengths[b]``."""
    past = torch.arange(x.shape[2]) >= lengths[:, None]
    return x.masked_fill(past[:, None, :, None], float("nan"))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_nan_past_kv_seqlens_reaches_no_output_and_no_gradient(compiled):
    # 0 * NaN is NaN: a masked key's zero weight times its NaN value (P @ V), or a NaN key times a zero
    # gradient of its score (dS @ K), is enough to leak it
    lengths = torch.tensor([5, 13, 1], dtype=torch.int32)
    gen = torch.Generator().manual_seed(21)
    q, k, v = rand(gen, 3, 4, 4, 16), rand(gen, 3, 2, 13, 16), rand(gen, 3, 2, 13, 8)
    grad_out, grad_lse = rand(gen, 3, 4, 4, 8), rand(gen, 3, 4, 4, dtype=torch.float32)

    def run(q, k, v, lengths):
        return inductor_attn.attention(q, k, v, causal=True, kv_seqlens=lengths, return_lse=True)

    fn = torch.compile(run, fullgraph=True) if compiled else run
    results = []
    for keys, values in ((k, v), (nan_past(k, lengths), nan_past(v, lengths))):
        leaves = [x.clone().requires_grad_() for x in (q, keys, values)]
        out, lse = fn(*leaves, lengths)
        results.append((out, lse, *torch.autograd.grad((out, lse), leaves, (grad_out, grad_lse))))
    for name, clean, poisoned in zip(("out", "lse", "dq", "dk", "dv"), *results):
        assert not poisoned.isnan().any(), f"NaN past kv_seqlens reached {name}"
        torch.testing.assert_close(poisoned, clean, rtol=1e-12, atol=1e-12)
    past = (torch.arange(13) >= lengths[:, None])[:, None, :, None]
    for grad in results[1][3:]:  # keys past the lengths get no gradient
        assert not grad.masked_select(past).any()
