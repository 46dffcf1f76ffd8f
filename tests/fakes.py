"""Fake backends and a fake timer: test the tuner's decisions without kernels (FlashInfer's DummyRunner idea).

A FakeBackend computes the right answer (through the reference) unless told to be wrong or to fail, and
each of its configs has a known time distribution that FakeTimer samples from a seeded generator.
"""

from __future__ import annotations

import random

from inductor_attn.backends import REFERENCE, Backend, Config


class FakeBackend(Backend):
    """``times``: {config string: (mean ms, std ms)}; ``wrong``/``fail``: config strings that misbehave."""

    has_backward = True

    def __init__(self, name: str, times: dict[str, tuple[float, float]], wrong=(), fail=(), prune=None,
                 supports_reason=None, heuristic=None):
        self.name = name
        self.times = times
        self.wrong, self.fail = set(wrong), set(fail)
        self.prune_reasons = prune or {}
        self.supports_reason = supports_reason
        self.heuristic = heuristic
        self.calls = 0

    def supports(self, p, dev):
        return self.supports_reason

    def configs(self, p, dev):
        return [Config.parse(c) for c in self.times]

    def prune(self, p, dev, cfg):
        return self.prune_reasons.get(str(cfg))

    def heuristic_config(self, p, dev):
        return None if self.heuristic is None else Config.parse(self.heuristic)

    def run(self, call, cfg):
        self.calls += 1
        FakeTimer.last = (self.name, str(cfg))
        if str(cfg) in self.fail:
            raise RuntimeError("CUDA error: launch failed (simulated)")
        out, lse = REFERENCE.run(call, None)
        return (out + 1.0, lse) if str(cfg) in self.wrong else (out, lse)

    def backward(self, call, cfg, out, lse, grad_out, grad_lse):
        FakeTimer.last = (self.name, str(cfg))
        return REFERENCE.backward(call, None, out, lse, grad_out, grad_lse)

    def source_hash(self) -> str:
        return f"fake-{self.name}"


class FakeTimer:
    """Samples each candidate's time from its backend's declared distribution (seeded per candidate)."""

    name = "fake"
    last: tuple[str, str] | None = None

    def __init__(self, backends: list[FakeBackend], seed: int = 0):
        self.by_name = {b.name: b for b in backends}
        self.seed = seed

    def prepare(self, fns):
        fns[0]()
        backend, cfg = FakeTimer.last
        mean, std = self.by_name[backend].times[cfg]
        rng = random.Random(f"{self.seed}-{backend}-{cfg}")

        class Runner:
            note = ""

            def sample(self):
                return max(1e-6, rng.gauss(mean, std))

        return Runner()
