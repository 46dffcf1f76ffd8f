"""Fake backends and a fake timer: test the tuner's decisions without kernels (FlashInfer's DummyRunner idea).

A FakeBackend computes the right answer (through the reference) unless told to be wrong or to fail, and
each of its configs has a known time distribution that FakeTimer samples from a seeded generator.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from inductor_attn.backends import REFERENCE, AttnCall, Backend, Candidate, Config, Plan, Takes, run_backend_backward
from inductor_attn.backends.masks import dense_mask_fn
from inductor_attn.backends.paged_gather import as_packed, dense_call
from inductor_attn.backends.reference import run_backward, run_forward
from inductor_attn.messages import KV_SEQLENS_VALUES, PAGED_BLOCK_IDS, PAGED_KV_SEQLENS_VALUES


class FakeBackend(Backend):
    """``times``: {config string: (mean ms, std ms)}; ``wrong``/``fail``: config strings that misbehave.
    Its plans compute through the reference's torch code; with ``traceable=True`` they offer that code as
    their traced form too, so compiled graphs hold it (a stand-in for Triton and aten plans on the CPU; for paged
    calls :func:`paged_forward`); ``leaks``: configs told the mask as an additive -inf bias, as SDPA's kernels are
    told kv_seqlens (:func:`biased_forward`); ``ops``: the ops it takes (None: ``Takes``'s default)."""

    takes = Takes(backward=True)

    def __init__(self, name: str, times: dict[str, tuple[float, float]], wrong=(), fail=(), prune=None,
                 supports_reason=None, heuristic=None, traceable=False, host_s=0.0, checks_indices=False, leaks=(),
                 ops=None):
        self.name = name
        if ops is not None:
            self.takes = dataclasses.replace(self.takes, ops=ops)
        self.times = times
        self.wrong, self.fail, self.leaks = set(wrong), set(fail), set(leaks)
        self.prune_reasons = prune or {}
        self.supports_reason = supports_reason
        self.rule = heuristic
        self.traceable = traceable
        self.host_s = host_s  # CPU time each eager launch spends (a Python launcher's)
        self.checks_indices = checks_indices  # its traced form asserts index values (FAKE_KERNEL_CHECK)
        self.calls = 0
        self.knobs = {k: (int, str, bool) for c in times for k, _ in Config.parse(c).params}

    def supports(self, p, dev, direction="forward"):
        return self.supports_reason

    def configs(self, p, dev, direction="forward"):
        return [Candidate(self.name, Config.parse(c), self.prune_reasons.get(c)) for c in self.times]

    def heuristic(self, p, dev):
        return None if self.rule is None else Config.parse(self.rule)

    def plan(self, p, dev, cfg, direction):
        if direction == "backward":
            launch = functools.partial(self._backward, str(cfg))
            return Plan(launch, traced=run_backward if self.traceable else None)
        launch = functools.partial(self._forward, str(cfg))
        if not self.traceable or str(cfg) in self.wrong:
            return Plan(launch)
        if self.checks_indices and p.op == "paged":
            return Plan(launch, traced=_paged_forward_checking_indices,
                        checks_indices=(PAGED_KV_SEQLENS_VALUES, PAGED_BLOCK_IDS))
        if self.checks_indices:
            return Plan(launch, traced=_forward_checking_kv_seqlens, checks_indices=(KV_SEQLENS_VALUES,))
        return Plan(launch, traced=paged_forward if p.op == "paged" else run_forward)

    def _forward(self, cfg, call):
        self.calls += 1
        _spin(self.host_s)
        FakeTimer.last, FakeTimer.last_host_s = (self.name, cfg), self.host_s
        if cfg in self.fail:
            raise RuntimeError("CUDA error: launch failed (simulated)")
        out, lse = biased_forward(call) if cfg in self.leaks else run_forward(call)
        return (out + 1.0, lse) if cfg in self.wrong else (out, lse)

    def _backward(self, cfg, call, out, lse, grad_out, grad_lse):
        FakeTimer.last, FakeTimer.last_host_s = (self.name, cfg), self.host_s
        return run_backend_backward(REFERENCE, call, None, out, lse, grad_out, grad_lse)


def biased_forward(call: AttnCall):
    """(out, lse) with the mask as an additive -inf bias on the scores (Hq == Hkv): keys it masks still enter
    P @ V with weight 0, and 0 * NaN is NaN, so NaN past kv_seqlens reaches the output (as in SDPA's kernels)."""
    lq, lk = call.q.shape[2], call.k.shape[2]
    allowed = dense_mask_fn(lq, lk, call.causal, call.window_left, call.window_right, call.kv_seqlens, call.q.device,
                            call.key_mask)(0, lq)[:, 0]
    scores = call.q.float() @ call.k.float().transpose(-1, -2) * call.scale + torch.where(allowed, 0.0, float("-inf"))
    return (torch.softmax(scores, -1) @ call.v.float()).to(call.q.dtype), torch.logsumexp(scores, -1)


def paged_forward(call: AttnCall):
    """A paged call's (out, lse) in torch ops that ``make_fx`` can trace (the reference's gathers the keys that
    exist: a shape from the lengths' values): the gather baseline's dense call, pages gathered right-aligned with
    a key mask (backends/paged_gather.py), through the reference. As many queries in every sequence."""
    return as_packed(*run_forward(dense_call(call)), call.q)


def _spin(seconds: float) -> None:
    spent = time.thread_time() + seconds
    while time.thread_time() < spent:  # busy: the tuner times a launch by its thread's CPU clock
        pass


FAKE_KERNEL_CHECK = "fake kernel: index values out of range"


def _paged_forward_checking_indices(call: AttnCall, check_indices: bool = False):
    """:func:`paged_forward` whose "kernel" checks the lengths and the block ids they reach itself when asked,
    with its own text."""
    if check_indices:
        lengths, table = call.kv_seqlens, call.block_table
        reached = torch.arange(table.shape[1]) * call.k.shape[1] < lengths[:, None]
        ids = torch.where(reached, table, 0)
        ok = ((lengths >= 0) & (lengths <= call.max_seqlen_k)).all() & ((ids >= 0) & (ids < call.k.shape[0])).all()
        torch._assert_async(ok, FAKE_KERNEL_CHECK)
    return paged_forward(call)


def _forward_checking_kv_seqlens(call: AttnCall, check_indices: bool = False):
    """A traced form whose "kernel" checks the kv_seqlens values itself when asked, with its own text."""
    if check_indices:
        torch._assert_async(((call.kv_seqlens >= 0) & (call.kv_seqlens <= call.k.shape[2])).all(), FAKE_KERNEL_CHECK)
    return run_forward(call)


class FakeTimer:
    """Samples each candidate's time from its backend's declared distribution (seeded per candidate), and gives
    a launch the host time its backend declares (``host_s``) rather than
    the CPU time the reference's computation takes on a busy test machine."""

    name = "fake"
    last: tuple[str, str] | None = None
    last_host_s = 0.0

    def __init__(self, backends: list[FakeBackend], seed: int = 0):
        self.by_name = {b.name: b for b in backends}
        self.seed = seed

    @staticmethod
    def host_ms_each(launches: dict, device, failed=None, device_ms=None) -> dict:
        times = {}
        for name, launch in launches.items():
            FakeTimer.last_host_s = 0.0  # a launch of no fake (the reference's) declares none
            launch()
            times[name] = FakeTimer.last_host_s * 1e3
        return times

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


def timed_with_fakes(monkeypatch, *backends) -> None:
    """From now on the tuner times ``backends`` with :class:`FakeTimer` (their configured times)."""
    monkeypatch.setattr("inductor_attn.tuning.tuner.default_timer", lambda device_type: FakeTimer(list(backends)))


def small_call(lq: int = 20) -> AttnCall:
    """A small CPU attention call (B1 H2 D16) on fresh random inputs, for tests of tuning and the store."""
    q = torch.randn(1, 2, lq, 16)
    return AttnCall("attention", q, torch.randn(1, 2, lq, 16), torch.randn(1, 2, lq, 16), 0.25)


class AtenCpuFlash(Backend):
    """The CPU flash kernels that stock compiled SDPA calls on this machine, as a traced plan: with it, ours'
    compiled graphs can be compared line by line with stock's (what our lowering adds, it adds in plain sight).
    Plain MHA, causal, no window or lengths; the kernels return q's layout only for (B, L, H, D) strides."""

    name = "aten_cpu_flash"
    takes = Takes(backward=True)
    knobs = {}

    def supports(self, p, dev, direction="forward"):
        return None

    def configs(self, p, dev, direction="forward"):
        return [Candidate(self.name, Config.of())]

    def plan(self, p, dev, cfg, direction):
        if direction == "backward":
            return Plan(self._backward, traced=self._backward)
        return Plan(self._forward, traced=self._forward, traced_out_only=functools.partial(self._forward, lse=False))

    @staticmethod
    def _forward(call, lse=True):
        out, logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(call.q, call.k, call.v, 0.0,
                                                                                    call.causal)[:2]
        return (out, logsumexp) if lse else (out,)

    @staticmethod
    def _backward(call, out, lse, grad_out, grad_lse):
        return tuple(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, call.q, call.k, call.v, out, lse, 0.0, call.causal))


class ComputingOps(TorchDispatchMode):
    """Inside ``with ComputingOps() as rec``, ``rec.ops`` lists each aten op dispatched that computes: neither
    allocates (``empty*``) nor views. What ``Plan.compile`` must leave empty (it compiles, runs nothing)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not (func.is_view or func.__name__.startswith("empty") or func.__name__ == "detach"):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def stub_triton_compile(monkeypatch) -> list:
    """Triton's compile stubbed where plans call it (triton_common's warmup launcher); returns the list each
    stubbed compile appends its grid to."""
    from inductor_attn.backends import triton_common

    compiled = []
    monkeypatch.setattr(triton_common._Warmup, "__getitem__", lambda self, grid: lambda *a, **kw: compiled.append(grid))
    return compiled
