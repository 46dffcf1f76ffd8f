"""The backend contract (backends/base.py): a new backend is one class and one registration, and the
registry holds every backend to its declared knobs."""

from __future__ import annotations

import pytest
import torch

import inductor_attn
from inductor_attn.backends import REFERENCE, Backend, Config, Plan, only_backends, register_backend, unregister_backend
from inductor_attn.backends.base import check_knobs
from inductor_attn.backends.reference import run_forward


class Toy(Backend):
    """A whole backend: math through the reference's torch code, one knob."""

    name = "toy"
    knobs = {"unroll": int}

    def supports(self, p, dev, direction="forward"):
        return None if p.op == "attention" else "toy runs dense attention only"

    def configs(self, p, dev, direction="forward"):
        return [self.candidate(Config.of(unroll=1)), self.candidate(Config.of(unroll=2), "unroll 2 is for show")]

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
