"""The backend contract (backends/base.py): a new backend is one class and one registration, and the
registry holds every backend to its declared knobs."""

from __future__ import annotations

import pytest
import torch
from fakes import ComputingOps, stub_triton_compile

import inductor_attn
from inductor_attn.backends import (REFERENCE, Backend, Candidate, Config, Plan, only_backends, register_backend,
                                    unregister_backend)
from inductor_attn.backends.base import AttnCall, check_knobs
from inductor_attn.backends.reference import run_forward


class Toy(Backend):
    """A whole backend: math through the reference's torch code, one knob."""

    name = "toy"
    knobs = {"unroll": int}

    def supports(self, p, dev, direction="forward"):
        return None if p.op == "attention" else "toy runs dense attention only"

    def configs(self, p, dev, direction="forward"):
        return [Candidate(self.name, Config.of(unroll=1)),
                Candidate(self.name, Config.of(unroll=2), "unroll 2 is for show")]

    def plan(self, p, dev, cfg, direction):
        return Plan(run_forward, traced=run_forward)


def test_a_new_backend_is_one_class_and_one_registration():
    register_backend(Toy(), first=True)
    try:
        q = torch.randn(1, 2, 8, 16)
        listed = {c.name: c.pruned for c in inductor_attn.candidates(q, q, q)}
        assert listed["toy:unroll=1"] is None and listed["toy:unroll=2"] == "unroll 2 is for show"
        out = inductor_attn.run_candidate("toy:unroll=1", q, q, q)
        with only_backends(REFERENCE):
            torch.testing.assert_close(out, inductor_attn.attention(q, q, q))
    finally:
        unregister_backend("toy")


def test_a_config_key_a_backend_does_not_declare_is_an_error_not_a_default():
    with pytest.raises(ValueError, match=r"backend 'toy' has no knob 'unrol'"):
        check_knobs(Toy(), Config.of(unrol=1))
    with pytest.raises(ValueError, match=r"knob unroll='2' .* accepted: int"):
        check_knobs(Toy(), Config.of(unroll="2"))


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_a_plans_compile_runs_nothing_but_the_compiler(monkeypatch, direction):
    """``Plan.compile`` compiles a launch's kernels and runs none (base.py's Plan contract). With Triton's
    compile stubbed, every aten op that each registered backend's compile dispatches allocates or views, for
    each of its unpruned configs (simulated sm_90), on a dense GQA call, a decode call with kv_seqlens and a
    key mask, and a varlen call."""
    pytest.importorskip("triton")
    from inductor_attn.backends import enumerate_candidates, plan_for
    from inductor_attn.device import parse_device_override

    compiled = stub_triton_compile(monkeypatch)
    dev = parse_device_override("sm_90")
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    k, v = rand(2, 2, 64, 16), rand(2, 2, 64, 16)
    cu = torch.tensor([0, 20, 64], dtype=torch.int32)
    calls = [AttnCall("attention", rand(2, 4, 64, 16), k, v, 0.25, causal=True),
             AttnCall("attention", rand(2, 4, 1, 16), k, v, 0.25, kv_seqlens=torch.tensor([30, 64], dtype=torch.int32),
                      key_mask=torch.ones(2, 64, dtype=torch.bool)),
             AttnCall("varlen", rand(64, 4, 16), rand(64, 2, 16), rand(64, 2, 16), 0.25, True, cu_seqlens_q=cu,
                      cu_seqlens_k=cu, max_seqlen_q=44, max_seqlen_k=44)]
    checked = set()
    for call in calls:
        grads = () if direction == "forward" else (*run_forward(call), None, None)
        for cand in enumerate_candidates(call.problem, dev, direction):
            plan = None if cand.pruned else plan_for(call.problem, cand.name, dev, direction)
            if plan is None or plan.compile is None:
                continue
            with ComputingOps() as rec:
                plan.compile(call, *grads)
            assert rec.ops == [], f"{cand.name} on {call.op}: {rec.ops}"
            checked.add(cand.backend)
    assert compiled and checked, "no plan with a compile was checked"
