import doctest

import pytest

import inductor_attn.backends.base
import inductor_attn.block_mask
import inductor_attn.cache
import inductor_attn.device
import inductor_attn.layout
import inductor_attn.problem
import inductor_attn.tuning.stats
from inductor_attn.problem import Problem, kept_pairs


@pytest.mark.parametrize("module", [inductor_attn.problem, inductor_attn.device, inductor_attn.backends.base,
                                    inductor_attn.block_mask, inductor_attn.layout, inductor_attn.tuning.stats])
def test_doctest_examples_hold(module):
    assert doctest.testmod(module).failed == 0


def _p(**kw):
    base = dict(op="attention", dtype="bfloat16", device_type="cuda", batch=3, heads_q=32, heads_kv=8, len_q=1000,
                len_k=1000, head_dim=128, head_dim_v=128)
    return Problem(**{**base, **kw})


def test_bucket_rounds_lengths_and_batch_up_to_powers_of_two_and_keeps_the_rest():
    b = _p().bucket()
    assert (b.batch, b.len_q, b.len_k, b.heads_q, b.head_dim) == (4, 1024, 1024, 32, 128)
    assert _p(len_q=1024, len_k=1024, batch=4).bucket() == b
    assert _p(len_q=1025).bucket() != b
    assert _p(causal=True).bucket() != b


def test_decode_lengths_are_their_own_buckets():
    assert [_p(len_q=n).bucket().len_q for n in (1, 2, 3, 16)] == [1, 2, 4, 16]


def test_problem_key_round_trips():
    p = _p(op="block_sparse", block_q=128, block_kv=128, density=0.3125, partial_fraction=0.5)
    assert Problem.from_key(p.key()) == p


def test_unknown_op_is_refused():
    with pytest.raises(ValueError, match="Problem.op must be one of"):
        _p(op="dense")


def test_causal_flops_count_lower_right_pairs():
    assert kept_pairs(2, 5, causal=True) == 4 + 5
    full = _p(len_q=4, len_k=4, batch=1, heads_q=1, heads_kv=1, head_dim=8, head_dim_v=8)
    assert full.flops() == 4 * 16 * 8
    assert _p(len_q=4, len_k=4, batch=1, heads_q=1, heads_kv=1, head_dim=8, head_dim_v=8, causal=True).flops() == 4 * 10 * 8


def test_a_call_with_an_int_causal_gets_a_bool_problem():
    """Buckets are cached and 1 == True: without the coercion a causal=1 call could hand its bucket
    (key "causal=1", read back as False by from_key) to later causal=True calls."""
    import torch

    from inductor_attn.backends.base import AttnCall

    q = torch.zeros(1, 1, 4, 8)
    problem = AttnCall("attention", q, q, q, 1.0, 1, -1, -1).problem
    assert problem.causal is True and Problem.from_key(problem.bucket().key()).causal is True
