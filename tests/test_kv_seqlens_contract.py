"""The kv_seqlens contract: keys and values past a sequence's length never influence an output or a gradient,
whatever they hold (NaN in an unwritten KV-cache slot included: 0 * NaN is NaN, so a kernel that gives such a
key weight 0 but still multiplies by it leaks). Backends measured to leak are pruned for calls with kv_seqlens,
with the reason; the tuner's gate fills the memory past the lengths with NaN, so any other candidate that reads
it is dropped, saying so. Varlen sequences never read each other's keys, and keys masked by ``key_mask`` may
hold any finite values. Triton's kernels run in its interpreter here; tests/test_kv_seqlens_contract_gpu.py
runs the same checks over a GPU's candidates."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from fakes import FakeBackend, FakeTimer
from test_fa4 import fake_fa4

from inductor_attn import attention
from inductor_attn.api import make_call
from inductor_attn.backends import AttnCall, enumerate_candidates, fa4, only_backends, sdpa
from inductor_attn.device import device_info, parse_device_override
from inductor_attn.problem import Problem
from inductor_attn.tuning.measure import Direction, candidate_trial, fresh_inputs, gate, gate_inputs
from inductor_attn.tuning.tuner import tune

SM90 = parse_device_override("sm_90")
LEAK_REASON = "NaN past kv_seqlens reached its results: "


def past(lengths: torch.Tensor, len_k: int) -> torch.Tensor:
    """Bool (B, 1, Lk, 1): the keys at or past each batch's length."""
    return (torch.arange(len_k, device=lengths.device) >= lengths[:, None])[:, None, :, None]


def gate_every_candidate(call: AttnCall, direction: str, expected_call: AttnCall | None = None) -> tuple[list, list]:
    """Gate every runnable candidate of ``call`` (the reference's results on ``expected_call``, default ``call``,
    are what each must match); returns (names gated, "name: status reason" of each that did not pass)."""
    runner = Direction(direction, call)
    want = runner.reference(expected_call or call)
    gated, failures = [], []
    for cand in enumerate_candidates(call.problem, device_info(call.q.device), direction):
        if cand.pruned:
            continue
        result = gate(candidate_trial(cand.name, runner), call, want,
                      lambda got: runner.check(got, want, call.q.dtype))
        gated.append(cand.name)
        if result.status != "passed":
            failures.append(f"{cand.name} {direction}: {result.status} {result.reason}")
    return gated, failures


def random_call(b, hq, hkv, lq, lk, d, lengths, dtype=torch.float32, device="cpu", **kw) -> AttnCall:
    q, k, v = (torch.randn(b, h, n, d, dtype=dtype, device=device) for h, n in ((hq, lq), (hkv, lk), (hkv, lk)))
    return make_call(q, k, v, kv_seqlens=torch.tensor(lengths, dtype=torch.int32, device=device), **kw)


# --------------------------------------------------------------------------------- pruned, with the reason
DECODE = Problem("attention", "bfloat16", "cuda", 8, 32, 8, 1, 4096, 128, 128, has_kv_seqlens=True)
PREFILL = Problem("attention", "bfloat16", "cuda", 2, 16, 2, 512, 2048, 256, 256, causal=True, has_kv_seqlens=True)


@pytest.mark.parametrize("problem", [DECODE, PREFILL], ids=["decode", "prefill"])
@pytest.mark.parametrize("backend", [sdpa.BACKEND, fa4.BACKEND], ids=lambda b: b.name)
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_backends_measured_to_leak_nan_past_kv_seqlens_are_pruned_for_such_calls(backend, problem, direction,
                                                                                  monkeypatch):
    # pruned, not left to the gate: the off, heuristic and cache-only modes run no gate
    monkeypatch.setattr(fa4.loading, "load", lambda: fake_fa4())
    reason = backend.supports(problem, SM90, direction)
    assert reason is not None and "past kv_seqlens" in reason and "0 * NaN" in reason, reason
    assert backend.supports(dataclasses.replace(problem, has_kv_seqlens=False), SM90, direction) is None


# -------------------------------------------------------------------------------------------------- the gate
def test_gate_inputs_hold_nan_past_kv_seqlens_and_nowhere_else():
    call = random_call(3, 4, 2, 5, 12, 16, [0, 7, 12])
    gated = gate_inputs(call, seed=1)
    tails = past(call.kv_seqlens, 12)
    for x in (gated.k, gated.v):
        assert x.masked_select(tails).isnan().all() and not x.masked_select(~tails).isnan().any()
    assert not gated.q.isnan().any() and gated.kv_seqlens is call.kv_seqlens
    # timing inputs (and the benchmark's gate, whose stock SDPA baseline does not keep the contract) stay finite
    assert all(x.isfinite().all() for x in (fresh_inputs(call, seed=1).k, fresh_inputs(call, seed=1).v))


def test_gate_inputs_keep_broadcast_strides_and_write_no_tail_over_another_batchs_keys():
    call = random_call(2, 4, 4, 5, 12, 16, [3, 9])
    heads = dataclasses.replace(call, k=call.k[:, :1].expand(2, 4, 12, 16), _problem=None)  # one head for all
    gated = gate_inputs(heads, seed=1)
    assert gated.k.stride() == heads.k.stride() and gated.k.masked_select(past(call.kv_seqlens, 12)).isnan().all()
    batches = dataclasses.replace(call, k=call.k[:1].expand(2, 4, 12, 16), _problem=None)  # one cache for all
    gated = gate_inputs(batches, seed=1)
    # key 5 of the shared cache is past batch 0's length but a key of batch 1: no NaN is written anywhere
    assert gated.k.stride() == batches.k.stride() and not gated.k.isnan().any()
    assert gated.v.masked_select(past(call.kv_seqlens, 12)).isnan().all()


def _tune_fakes(call, *backends):
    with only_backends(*backends):
        cands = enumerate_candidates(call.problem, device_info("cpu"))
        return tune(call, cands, timer=FakeTimer(list(backends)), rounds=10)


def test_the_gate_drops_a_candidate_that_lets_nan_past_kv_seqlens_reach_its_output_and_says_so():
    clean = FakeBackend("clean", {"default": (1.0, 0.01)})
    leaky = FakeBackend("leaky", {"default": (0.1, 0.01)}, leaks={"default"})
    result = _tune_fakes(random_call(2, 2, 2, 3, 12, 16, [5, 9], causal=True), clean, leaky)
    dropped = next(c for c in result.candidates if c.name == "leaky:default")
    assert result.winner == "clean:default" and dropped.status == "wrong"
    assert dropped.reason.startswith(LEAK_REASON + "output rel. error inf"), dropped.reason
    # without lengths nothing is NaN, and the same kernel is right and wins
    unmasked = dataclasses.replace(random_call(2, 2, 2, 3, 12, 16, [5, 9], causal=True), kv_seqlens=None, _problem=None)
    assert _tune_fakes(unmasked, clean, leaky).winner == "leaky:default"


def test_a_candidate_wrong_for_another_reason_keeps_that_reason():
    clean = FakeBackend("clean", {"default": (1.0, 0.01)})
    wrong = FakeBackend("wrong", {"default": (0.1, 0.01)}, wrong={"default"})
    result = _tune_fakes(random_call(2, 2, 2, 3, 12, 16, [5, 9]), clean, wrong)
    dropped = next(c for c in result.candidates if c.name == "wrong:default")
    assert dropped.status == "wrong" and dropped.reason.startswith("output rel. error")


# ------------------------------------------------------------------------ every candidate keeps the contract
CPU_CASES = {
    "decode": dict(b=2, hq=4, hkv=2, lq=3, lk=40, d=16, lengths=[4, 27]),
    "decode_causal_window": dict(b=2, hq=4, hkv=1, lq=4, lk=70, d=16, lengths=[1, 66], causal=True, window=9),
    "prefill_causal": dict(b=2, hq=2, hkv=2, lq=33, lk=48, d=16, lengths=[20, 47], causal=True),
}


@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("case", CPU_CASES.values(), ids=CPU_CASES.keys())
def test_every_runnable_cpu_candidate_passes_the_gate_with_nan_past_kv_seqlens(case, direction):
    torch.manual_seed(0)
    gated, failures = gate_every_candidate(gate_inputs(random_call(**case), seed=1), direction)
    assert not failures, "\n".join(failures)
    assert any(name.startswith("triton") for name in gated), gated  # the interpreter ran Triton's kernels


def packed_with_a_nan_sequence(device="cpu", dtype=torch.float32):
    """Varlen (q lengths 5, 0, 7; k lengths 9, 6, 11) whose middle sequence, queries none, holds NaN keys and
    values: padding between two sequences. Returns (that call, the same call with finite padding)."""
    cu_q = torch.tensor([0, 5, 5, 12], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 9, 15, 26], dtype=torch.int32, device=device)
    q = torch.randn(12, 4, 16, dtype=dtype, device=device)
    k, v = (torch.randn(26, 2, 16, dtype=dtype, device=device) for _ in range(2))
    clean = AttnCall("varlen", q, k, v, 0.25, True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=7,
                     max_seqlen_k=11)
    padded = [x.clone() for x in (k, v)]
    for x in padded:
        x[9:15] = float("nan")
    return dataclasses.replace(clean, k=padded[0], v=padded[1]), clean


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_no_varlen_candidate_reads_the_keys_between_two_sequences(direction):
    torch.manual_seed(0)
    padded, clean = packed_with_a_nan_sequence()
    gated, failures = gate_every_candidate(padded, direction, expected_call=clean)
    assert not failures, "\n".join(failures)
    assert any(name.startswith("triton") for name in gated), gated


# ------------------------------------------------------------------------ key_mask: masked keys hold finite values
def left_padded(device="cpu", dtype=torch.float32, b=2, hq=4, hkv=2, lq=3, lk=40, d=16, pad=(7, 0)):
    """q, k, v and a key_mask that masks each batch's first ``pad[b]`` keys (HF's left padding)."""
    q = torch.randn(b, hq, lq, d, dtype=dtype, device=device)
    k, v = (torch.randn(b, hkv, lk, d, dtype=dtype, device=device) for _ in range(2))
    key_mask = torch.arange(lk, device=device) >= torch.tensor(pad, device=device)[:, None]
    return q, k, v, key_mask


def holding(x: torch.Tensor, key_mask: torch.Tensor, value: float) -> torch.Tensor:
    return x.masked_fill(~key_mask[:, None, :, None], value)


@pytest.mark.parametrize("value", [1e4, -1e4, 0.0])
def test_masked_keys_may_hold_any_finite_values_on_every_key_mask_candidate(value):
    torch.manual_seed(0)
    q, k, v, key_mask = left_padded()
    call = make_call(q, k, v, causal=True, key_mask=key_mask)
    held = dataclasses.replace(call, k=holding(k, key_mask, value), v=holding(v, key_mask, value))
    gated, failures = gate_every_candidate(held, "forward", expected_call=call)
    assert not failures, "\n".join(failures)
    assert any(name.startswith("triton_decode") for name in gated), gated


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_attention_with_a_key_mask_ignores_what_masked_keys_hold(compiled, reference_only):
    torch.manual_seed(0)
    q, k, v, key_mask = left_padded(lq=8)
    fn = torch.compile(attention, fullgraph=True) if compiled else attention
    want = fn(q, k, v, key_mask=key_mask)
    for value in (1e4, -1e4):
        got = fn(q, holding(k, key_mask, value), holding(v, key_mask, value), key_mask=key_mask)
        torch.testing.assert_close(got, want)
