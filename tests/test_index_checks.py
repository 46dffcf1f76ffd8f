"""Index values (kv_seqlens, varlen cu_seqlens_q/k and max_seqlen_q/k) are checked eagerly and in compiled code.

Eagerly a bad value raises ValueError. Compiled (fullgraph), the same conditions are device-side asserts: on
the CPU, Inductor's kernel raises RuntimeError with the message when the call runs, before the op runs.
``check_indices=False`` turns both off. tests/test_index_checks_gpu.py runs the same rows on a CUDA device.

Run as a script, this file prints what the checks cost a compiled call:
``python tests/test_index_checks.py [--device cuda]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import pytest
import torch

import inductor_attn
from inductor_attn.ops import checks


@dataclasses.dataclass(frozen=True)
class Row:
    op: str  # "dense" or "varlen"
    index_args: dict  # replaces entries of the valid call's index arguments (VALID)
    eager: str  # regex of the eager ValueError
    compiled: str  # regex of the compiled call's error: the device-side assert's message


# Valid calls: dense q (2, 4, 8, D), k/v (2, 2, 16, D); varlen q 11 tokens (3, 7, 1), k 21 tokens (5, 7, 9).
VALID = {
    "dense": dict(kv_seqlens=[4, 16]),
    "varlen": dict(cu_seqlens_q=[0, 3, 10, 11], cu_seqlens_k=[0, 5, 12, 21], max_seqlen_q=7, max_seqlen_k=9),
}

# The table of issue 19, every row for both q and k where it has two sides.
ROWS = {
    "kv_seqlens_above_lk": Row("dense", dict(kv_seqlens=[4, 40]),
                               r"kv_seqlens values must be in \[0, 16\] \(the k seq_len\), got min 4, max 40",
                               r"kv_seqlens values must be in \[0, k.shape\[2\]\] \(the k seq_len\)"),
    "kv_seqlens_negative": Row("dense", dict(kv_seqlens=[-3, 5]),
                               r"kv_seqlens values must be in \[0, 16\] \(the k seq_len\), got min -3, max 5",
                               r"kv_seqlens values must be in \[0, k.shape\[2\]\] \(the k seq_len\)"),
    "cu_seqlens_q_not_from_zero": Row("varlen", dict(cu_seqlens_q=[1, 3, 10, 11]),
                                      r"cu_seqlens_q must start at 0, got 1", r"cu_seqlens_q must start at 0"),
    "cu_seqlens_k_not_from_zero": Row("varlen", dict(cu_seqlens_k=[2, 5, 12, 21]),
                                      r"cu_seqlens_k must start at 0, got 2", r"cu_seqlens_k must start at 0"),
    "cu_seqlens_q_decreasing": Row("varlen", dict(cu_seqlens_q=[0, 5, 3, 11], max_seqlen_q=8),
                                   r"cu_seqlens_q must be non-decreasing \(monotone\), got \[0, 5, 3, 11\]",
                                   r"cu_seqlens_q must be non-decreasing"),
    "cu_seqlens_k_decreasing": Row("varlen", dict(cu_seqlens_k=[0, 12, 5, 21], max_seqlen_k=16),
                                   r"cu_seqlens_k must be non-decreasing \(monotone\), got \[0, 12, 5, 21\]",
                                   r"cu_seqlens_k must be non-decreasing"),
    "cu_seqlens_q_short_of_total": Row("varlen", dict(cu_seqlens_q=[0, 3, 10, 10]),
                                       r"cu_seqlens_q\[-1\] must equal the total tokens of q \(11\), got 10",
                                       r"cu_seqlens_q\[-1\] must equal the total tokens of q"),
    "cu_seqlens_k_beyond_total": Row("varlen", dict(cu_seqlens_k=[0, 5, 12, 40], max_seqlen_k=28),
                                     r"cu_seqlens_k\[-1\] must equal the total tokens of k \(21\), got 40",
                                     r"cu_seqlens_k\[-1\] must equal the total tokens of k"),
    "max_seqlen_q_too_small": Row("varlen", dict(max_seqlen_q=2),
                                  r"max_seqlen_q \(2\) is smaller than the longest sequence \(7\)",
                                  r"max_seqlen_q must be >= the longest sequence in cu_seqlens_q"),
    "max_seqlen_k_too_small": Row("varlen", dict(max_seqlen_k=5),
                                  r"max_seqlen_k \(5\) is smaller than the longest sequence \(9\)",
                                  r"max_seqlen_k must be >= the longest sequence in cu_seqlens_k"),
}


def make_inputs(op: str, index_args: dict, device="cpu", dtype=torch.float32, head_dim: int = 16) -> tuple:
    """Positional arguments of ``dense_call`` / ``varlen_call`` with VALID[op] updated by ``index_args``."""
    gen = torch.Generator().manual_seed(0)
    args = VALID[op] | index_args

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    def i32(values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    if op == "dense":
        return rand(2, 4, 8, head_dim), rand(2, 2, 16, head_dim), rand(2, 2, 16, head_dim), i32(args["kv_seqlens"])
    return (rand(11, 4, head_dim), rand(21, 2, head_dim), rand(21, 2, head_dim), i32(args["cu_seqlens_q"]),
            i32(args["cu_seqlens_k"]), args["max_seqlen_q"], args["max_seqlen_k"])


def dense_call(q, k, v, kv_seqlens, check_indices=True):
    return inductor_attn.attention(q, k, v, kv_seqlens=kv_seqlens, check_indices=check_indices)


def varlen_call(q, k, v, cu_q, cu_k, max_q, max_k, check_indices=True):
    return inductor_attn.varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, check_indices=check_indices)


CALLS = {"dense": dense_call, "varlen": varlen_call}


@pytest.fixture(scope="module")
def compiled():
    """One fullgraph compilation per op for the module: the rows change tensor values only (and max_seqlen,
    which recompiles once as a dynamic int)."""
    torch._dynamo.reset()
    yield {op: torch.compile(fn, fullgraph=True) for op, fn in CALLS.items()}
    torch._dynamo.reset()


@pytest.mark.parametrize("row", ROWS.values(), ids=ROWS.keys())
def test_eager_call_refuses_the_bad_index_value_with_a_value_error(row):
    with pytest.raises(ValueError, match=row.eager):
        CALLS[row.op](*make_inputs(row.op, row.index_args))


@pytest.mark.slow
@pytest.mark.parametrize("row", ROWS.values(), ids=ROWS.keys())
def test_compiled_call_stops_before_the_op_runs_with_a_message_naming_the_argument(row, compiled):
    inductor_attn.reset_stats()
    with pytest.raises(RuntimeError, match=row.compiled):
        compiled[row.op](*make_inputs(row.op, row.index_args))
    assert not inductor_attn.stats(), "the op ran before the device-side assert stopped the call"


@pytest.mark.slow
@pytest.mark.parametrize("op", CALLS)
def test_compiled_call_with_valid_indices_matches_eager(op, compiled):
    inputs = make_inputs(op, {})
    torch.testing.assert_close(compiled[op](*inputs), CALLS[op](*inputs))


# Unchecked bad indices reach the kernels: only the reference runs them here (it slices with Python ints, which
# clamp; Triton's interpreter would read out of bounds).
@pytest.mark.parametrize("row", [ROWS["kv_seqlens_above_lk"], ROWS["cu_seqlens_q_short_of_total"]],
                         ids=["dense", "varlen"])
def test_check_indices_false_skips_the_eager_check(row, reference_only):
    CALLS[row.op](*make_inputs(row.op, row.index_args), check_indices=False)


@pytest.mark.slow
def test_check_indices_false_leaves_no_assert_in_compiled_code(reference_only):
    fn = torch.compile(lambda *args: dense_call(*args, check_indices=False), fullgraph=True)
    fn(*make_inputs("dense", ROWS["kv_seqlens_above_lk"].index_args))


# ------------------------------------------------------------------------------- hand-made block masks
def window_mask():
    """A BlockSparseMask (causal, 70-key window: partial and full blocks, not packed documents) of 96 x 96 keys in
    3 kv blocks of 32, and a q (k, v) for it."""
    from torch.nn.attention.flex_attention import create_block_mask

    block_mask = create_block_mask(lambda b, h, q, k: (q >= k) & (q - k < 70), None, None, 96, 96, device="cpu",
                                   BLOCK_SIZE=32)
    sparse = inductor_attn.BlockSparseMask.from_block_mask(block_mask)
    assert sparse.documents is None and sparse.full_kv_num_blocks.sum() > 0
    return sparse, torch.randn(1, 2, 96, 16, generator=torch.Generator().manual_seed(0))


def _edited(field: str, shift: int):
    sparse, q = window_mask()
    return dataclasses.replace(sparse, **{field: getattr(sparse, field) + shift}), q


SPARSE_ROWS = {  # (field, shift, eager message, compiled message)
    "kv_indices_past_lk": ("kv_indices", 7, r"kv_indices values must be in \[0, 3\) \(the kv blocks of k seq_len 96 at "
                           r"block_kv 32\) where kv_num_blocks lists them, got \[7, 8, 9\]",
                           r"kv_indices values must be in \[0, the kv blocks of k\) where kv_num_blocks lists them"),
    "kv_indices_negative": ("kv_indices", -9, r"kv_indices values must be in \[0, 3\) .*got \[-9, -8, -7\]",
                            r"kv_indices values must be in \[0, the kv blocks of k\)"),
    "full_kv_indices_past_lk": ("full_kv_indices", 3, r"full_kv_indices values must be in \[0, 3\) .*where "
                                r"full_kv_num_blocks lists them", r"full_kv_indices values must be in"),
    "kv_num_blocks_past_slots": ("kv_num_blocks", 5, r"kv_num_blocks values must be in \[0, 2\] \(the slots of "
                                 r"kv_indices\), got min 6, max 7",
                                 r"kv_num_blocks values must be in \[0, kv_indices.shape\[-1\]\]"),
    "full_kv_num_blocks_negative": ("full_kv_num_blocks", -2, r"full_kv_num_blocks values must be in \[0, 1\]",
                                    r"full_kv_num_blocks values must be in"),
}


@pytest.mark.parametrize("row", SPARSE_ROWS.values(), ids=SPARSE_ROWS.keys())
def test_a_hand_made_block_mask_with_out_of_range_lists_is_refused_eagerly(row):
    field, shift, eager, _ = row
    sparse, q = _edited(field, shift)
    with pytest.raises(ValueError, match=eager):
        inductor_attn.attention(q, q, q, block_mask=sparse)


@pytest.mark.slow
@pytest.mark.parametrize("row", SPARSE_ROWS.values(), ids=SPARSE_ROWS.keys())
def test_a_hand_made_block_mask_with_out_of_range_lists_stops_a_compiled_call(row):
    field, shift, _, message = row
    sparse, q = _edited(field, shift)
    torch._dynamo.reset()
    inductor_attn.reset_stats()
    with pytest.raises(RuntimeError, match=message):
        torch.compile(lambda q, m: inductor_attn.attention(q, q, q, block_mask=m), fullgraph=True)(q, sparse)
    assert not inductor_attn.stats(), "the op ran before the device-side assert stopped the call"


def test_a_valid_block_mask_passes_the_checks_and_check_indices_false_skips_them(reference_only):
    sparse, q = window_mask()
    inductor_attn.attention(q, q, q, block_mask=sparse)
    bad, q = _edited("kv_indices", 7)
    with pytest.raises(RuntimeError, match="out of bounds"):  # unchecked, the reference's scatter meets it itself
        inductor_attn.attention(q, q, q, block_mask=bad, check_indices=False)


# ------------------------------------------------------------------------------------------ cost script
def _values_only(op: str, check_indices: bool):
    """The index checks of ``op`` and one trivial kernel, without the attention op: the checks' own cost."""
    def fn(q, k, v, *index_args):
        if check_indices and op == "dense":
            checks.check_attention_values(k, index_args[0])
        elif check_indices:
            checks.check_varlen_values(q, k, *index_args)
        return q.flatten()[0] + 1

    return fn


def _per_call_us(fn, inputs, calls: int, sync) -> float:
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn(*inputs)
    sync()
    return (time.perf_counter() - start) / calls * 1e6


def measure_check_cost(device: str, rounds: int = 40, calls: int = 200) -> dict[str, tuple[float, float]]:
    """Median time per compiled call (us) with and without the index checks: the whole call and the checks
    alone, per op. Rounds interleave the variants so drift hits both. On CUDA each timed loop ends with a
    synchronize: launch cost of the assert kernels plus their device time where the GPU is the bottleneck."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    results = {}
    for op, call in CALLS.items():
        inputs = make_inputs(op, {}, device=device, dtype=dtype, head_dim=64)
        for what, make in (("whole call", lambda flag: lambda *a: call(*a, check_indices=flag)),
                           ("checks alone", lambda flag: _values_only(op, flag))):
            variants = [torch.compile(make(flag), fullgraph=True) for flag in (True, False)]
            for fn in variants:
                _per_call_us(fn, inputs, 20, sync)
            samples = [[], []]
            for _ in range(rounds):
                for fn, times in zip(variants, samples):
                    times.append(_per_call_us(fn, inputs, calls, sync))
            results[f"{device} {op}, {what}"] = (statistics.median(samples[0]), statistics.median(samples[1]))
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    device = parser.parse_args().device
    # the reference's small matmuls slow down 30x when two OpenMP threads contend with other processes
    torch.set_num_threads(1)
    for name, (with_checks, without) in measure_check_cost(device).items():
        print(f"{name}: {with_checks:.1f} us per compiled call with the index checks, {without:.1f} us without: "
              f"{with_checks - without:+.1f} us")
