"""The tuner's decisions on fake backends with known time distributions (no kernels, CPU only)."""

import collections
import contextlib
import dataclasses
import functools
import random
import re
import threading
import time
import types

import pytest
import torch
from fakes import FakeBackend, FakeTimer

from inductor_attn._compat import is_fake
import inductor_attn
from inductor_attn.backends import AttnCall, Library, Takes, enumerate_candidates, only_backends
from inductor_attn.backends.reference import run_forward
from inductor_attn.device import DeviceInfo
from inductor_attn.tuning import measure, precompile, timing
from inductor_attn.tuning.correctness import TOLERANCES
from inductor_attn.tuning.tuner import tune

DEV = DeviceInfo("cpu", (0, 0), 2)


def _call(lq=24, lk=24):
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, lq, 16), torch.randn(1, 2, lk, 16), torch.randn(1, 2, lk, 16)
    return AttnCall("attention", q, k, v, 0.25, causal=True)


def _tune(*backends, seed=0, rounds=20, direction="forward"):
    call = _call()
    with only_backends(*backends):
        cands = enumerate_candidates(call.problem, DEV, direction)
        return tune(call, cands, timer=FakeTimer(list(backends), seed=seed), rounds=rounds, direction=direction)


def test_clearly_faster_candidate_replaces_the_default():
    a = FakeBackend("a", {"default": (1.0, 0.02)})
    b = FakeBackend("b", {"k=1": (0.9, 0.02), "k=2": (0.5, 0.02)})
    result = _tune(a, b)
    assert result.default == "a:default"
    assert result.winner == "b:k=2"
    win = next(c for c in result.candidates if c.name == "b:k=2")
    assert win.ci_low > 1.5 and "faster than the default" in result.why


def test_default_is_kept_when_the_speedup_ci_includes_one():
    a = FakeBackend("a", {"default": (1.0, 0.1)})
    b = FakeBackend("b", {"default": (0.98, 0.1)})
    result = _tune(a, b)
    assert result.winner == "a:default"
    assert "CI of the speedup includes 1" in result.why


def test_near_ties_go_to_the_earlier_backend_so_two_tunes_agree():
    a = FakeBackend("a", {"default": (1.0, 0.01)})
    b = FakeBackend("b", {"default": (0.700, 0.003)})
    c = FakeBackend("c", {"default": (0.695, 0.003)})
    winners = {_tune(a, b, c, seed=s).winner for s in range(4)}
    assert winners == {"b:default"}


def test_wrong_candidate_never_wins_however_fast():
    a = FakeBackend("a", {"default": (1.0, 0.01)})
    b = FakeBackend("b", {"default": (0.1, 0.01)}, wrong={"default"})
    result = _tune(a, b)
    assert result.winner == "a:default"
    bad = next(c for c in result.candidates if c.name == "b:default")
    assert bad.status == "wrong" and "rel. error" in bad.reason and not bad.samples


@pytest.mark.parametrize("search", ["staged", "exhaustive"])
def test_the_oracle_is_neither_timed_nor_probed_where_a_kernel_passed(search):
    """On a device timer the reference is the gate's oracle, far slower than any kernel: where a kernel passes it
    is set aside (timing it and probing its host time took half of a tune); where none does, it runs."""
    a = FakeBackend("a", {"default": (1.0, 0.01), "k=1": (0.8, 0.01)})
    oracle = FakeBackend("reference", {"default": (60.0, 0.1)})
    result = _tune_with(a, oracle, search=search)
    ref = next(c for c in result.candidates if c.name == "reference:default")
    assert result.winner == "a:k=1" and ref.status == "passed" and not ref.samples and ref.host_ms is None
    assert ref.note == "not timed: the oracle runs only where no kernel passes the gate"
    broken = FakeBackend("a", {"default": (1.0, 0.01)}, fail={"default"})
    assert _tune_with(broken, oracle, search=search).winner == "reference:default"


def test_failing_candidate_is_dropped_with_its_reason_not_raised():
    a = FakeBackend("a", {"default": (1.0, 0.01)})
    b = FakeBackend("b", {"default": (0.1, 0.01)}, fail={"default"})
    result = _tune(a, b)
    assert result.winner == "a:default"
    bad = next(c for c in result.candidates if c.name == "b:default")
    assert bad.status == "failed" and "launch failed" in bad.reason


class _FailsAfterItsGate(FakeBackend):
    """Runs right once (the gate), then raises one of its "cannot run here" errors (while being timed)."""

    def _forward(self, cfg, call):
        if self.calls >= 1:
            self.calls += 1
            raise RuntimeError("CUDA error: too many resources requested for launch (simulated)")
        return super()._forward(cfg, call)


def test_a_candidate_that_fails_while_timed_is_dropped_and_the_rest_decide():
    a = FakeBackend("a", {"default": (1.0, 0.01)})
    b = _FailsAfterItsGate("b", {"default": (0.5, 0.01)})
    result = _tune(a, b)
    assert result.winner == "a:default"
    bad = next(c for c in result.candidates if c.name == "b:default")
    assert bad.status == "failed" and bad.reason.startswith("passed the gate but failed while timing")


def test_an_output_a_candidate_leaves_unwritten_never_reads_as_the_previous_candidates_answer():
    """The gate runs candidates one after another: a head that one never writes lands in the block the candidate
    before it freed, and must read as NaN there, not as that candidate's right answer."""
    q = torch.randn(1, 8, 256, 64, dtype=torch.bfloat16)
    gated = measure.gate_inputs(AttnCall("attention", q, q.clone(), q.clone(), 64 ** -0.5), seed=1)
    mode = measure.Direction("forward", gated)
    expected = mode.reference(gated)
    # computed once: a right answer freed inside each trial would be a second block of the output's size that the
    # allocator may hand back instead of the poisoned one
    right_out, right_lse = run_forward(gated)

    def trial(heads_written: int) -> measure.Trial:
        def run(call):
            out = torch.empty(call.q.shape, dtype=call.q.dtype)
            lse = torch.empty(call.q.shape[:-1])
            out[:, :heads_written] = right_out[:, :heads_written]
            lse.copy_(right_lse)
            return out, lse
        return measure.Trial(f"writes {heads_written} heads", lambda call: lambda: run(call), lambda err: False)

    verdicts = [measure.gate(trial(n), gated, expected, lambda got: mode.check(got, expected, q.dtype)).status
                for n in (8, 6, 8, 6)]
    assert verdicts == ["passed", "wrong", "passed", "wrong"]
    # the host's malloc merges and splits free chunks: whatever blocks the heap holds, the unwritten heads are NaN
    gen, kept = random.Random(0), []
    for _ in range(40):
        for _ in range(gen.randint(0, 20)):
            block = torch.empty(gen.choice([1024, 65536, 131072, 262144, 524288, 1 << 20]) // 4)
            if gen.random() < 0.3:
                kept.append(block)
        del kept[:-50]
        assert [measure.gate(trial(n), gated, expected, lambda got: mode.check(got, expected, q.dtype)).status
                for n in (8, 6)] == ["passed", "wrong"]


def test_the_gate_poisons_a_candidates_own_outputs_but_never_memory_it_shares():
    # a wrong candidate returning its input as its output: the input must come out of the gate as it went in
    q = torch.randn(1, 2, 16, 8)
    gated = measure.gate_inputs(AttnCall("attention", q, q.clone(), q.clone(), 8 ** -0.5), seed=1)
    mode = measure.Direction("forward", gated)
    expected = mode.reference(gated)
    before, kept = gated.q.clone(), []

    def run(call):
        out, lse = call.q, torch.zeros(call.q.shape[:-1])
        kept.append(lse.view(-1))  # the candidate keeps a view of one (a cache): not poisoned either
        return out, lse

    trial = measure.Trial("returns q", lambda call: lambda: run(call), lambda err: False)
    assert measure.gate(trial, gated, expected, lambda got: mode.check(got, expected, q.dtype)).status == "wrong"
    assert torch.equal(gated.q, before)
    assert torch.equal(kept[0], torch.zeros(1 * 2 * 16))


def _fp8_call() -> AttnCall:
    """An fp8 call quantised as a user would (per-tensor descales of about amax / 448)."""
    from inductor_attn.fp8 import quantize
    from inductor_attn.ops.fp8 import per_kv_head

    qs = [quantize(torch.randn(2, h, 128, 64) * 3) for h in (8, 2, 2)]
    return AttnCall("attention", *(x8 for x8, _ in qs), 64 ** -0.5, True,
                    descale=tuple(per_kv_head(d, 2, 2) for _, d in qs), out_dtype=torch.bfloat16)


@pytest.mark.parametrize("bug", ["reads descale[0, 0] for every head", "ignores q_descale", "ignores q @ k.T"])
def test_the_gate_of_an_fp8_call_fails_a_kernel_that_gets_its_scores_wrong(bug):
    """With the caller's descales on values of about 1 every score is about 0, and the softmax so flat that
    these passed; its inputs keep the scores of order 1, with a descale per (batch, kv head)."""
    from inductor_attn.tuning.correctness import check_output

    def buggy(call):
        descale = list(call.descale)
        if bug == "reads descale[0, 0] for every head":
            descale = [d[:1, :1].expand_as(d) for d in descale]
        elif bug == "ignores q_descale":
            descale[0] = torch.ones_like(descale[0])
        return run_forward(dataclasses.replace(call, descale=tuple(descale), _problem=call._problem,
                                               scale=0.0 if bug == "ignores q @ k.T" else call.scale))

    gated = measure.gate_inputs(_fp8_call(), seed=1)
    assert check_output(*run_forward(gated), *run_forward(gated), torch.float8_e4m3fn) is None
    assert check_output(*buggy(gated), *run_forward(gated), torch.float8_e4m3fn) is not None


def test_gate_inputs_of_a_varlen_call_hold_nan_in_the_packed_rows_past_its_last_sequence():
    # a CUDA graph's padding rows: no kernel may read them into a sequence's output
    q, k, v = (torch.randn(n, 2, 8) for n in (10, 12, 12))
    cu_q, cu_k = torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([0, 5, 9], dtype=torch.int32)
    call = AttnCall("varlen", q, k, v, 0.35, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=4, max_seqlen_k=5)
    gated = measure.gate_inputs(call, seed=1)
    for x in (gated.k, gated.v):
        assert x[9:].isnan().all() and not x[:9].isnan().any()


def test_two_equally_close_medians_are_timed_again_as_one_group():
    """Whether to time again and which candidates count as close are one test: medians 1.1x apart by one test
    and not by the other once made agree() take a lone contender for a pair."""
    from inductor_attn.store.record import CandidateResult
    from inductor_attn.tuning import tuner

    first, second = 4.95939652004849, 5.45533617205334
    state = tuner._Search.__new__(tuner._Search)
    state.results = {n: CandidateResult(n, "passed") for n in ("x", "y")}
    for name, ms in (("x", first), ("y", second)):
        state.results[name].median_ms, state.results[name].samples = ms, [ms] * 5
    state.seconds = collections.Counter()
    state.sample = lambda names: {n: [state.results[n].median_ms] * 5 for n in names}
    noise, what = state.agree(["x", "y"])
    assert noise == 0.0 and "x, y timed in" in what


LOST = "AcceleratorError: CUDA error: an illegal memory access was encountered"


def test_a_candidate_that_leaves_the_cuda_context_unusable_stops_the_tune_with_its_name(monkeypatch):
    # dropping it would charge the sticky error to the next CUDA call, another candidate's or the user's
    monkeypatch.setattr(measure, "device_error", lambda device: LOST)
    a = FakeBackend("a", {"default": (1.0, 0.01)})
    with pytest.raises(measure.CudaContextLost, match=r"candidate b:default left .*launch failed \(simulated\)"):
        _tune(a, FakeBackend("b", {"default": (0.1, 0.01)}, fail={"default"}))
    b = Compiling("b", {"k=1": (0.5, 0.01)}, compile_errors={"k=1": RuntimeError("CUDA error: illegal memory access")})
    with pytest.raises(measure.CudaContextLost, match="candidate b:k=1"):
        _tune_with(a, b, search="exhaustive")


def test_a_host_probe_that_leaves_the_cuda_context_unusable_names_its_candidate(monkeypatch):
    a, b = FakeBackend("a", {"default": (1.0, 0.01)}), FakeBackend("b", {"default": (0.5, 0.01)})

    def breaking(launch):  # b's launch loses the context
        def run():
            launch()
            if FakeTimer.last == ("b", "default"):
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return run

    def host_ms_each(launches, device, failed=None, device_ms=None):  # the real probe, which takes turns
        return timing.host_ms_each({name: breaking(launch) for name, launch in launches.items()}, device, warmup=0,
                                   bursts=1, calls=1, failed=failed, device_ms=device_ms)

    monkeypatch.setattr(FakeTimer, "host_ms_each", staticmethod(host_ms_each))
    monkeypatch.setattr(measure, "device_error", lambda device: LOST)
    with pytest.raises(measure.CudaContextLost, match="candidate b:default left"):
        _tune(a, b)


@pytest.mark.parametrize("warmup", [0, 10])
def test_a_fault_the_device_reports_at_the_next_sync_is_charged_to_the_launch_that_made_it(monkeypatch, warmup):
    """A kernel's illegal access surfaces at the next synchronize: the probe synced at a burst's start, inside the
    next candidate's turn, and never after a warm-up, so the fault was charged to the candidate after it."""
    fault = []

    def sync(device=None):
        if fault:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def launch_of(name):
        return lambda: fault.append(name) if name == "b" else None

    monkeypatch.setattr(timing, "sync", sync)
    blamed = []
    with pytest.raises(RuntimeError, match="illegal memory access"):
        timing.host_ms_each({n: launch_of(n) for n in "abc"}, torch.device("cpu"), warmup=warmup, bursts=2, calls=3,
                            failed=lambda name, err: blamed.append(name))
    assert blamed == ["b"]


@pytest.mark.parametrize("broken_in", ["prepare", "sample"])
def test_an_error_while_timing_that_leaves_the_cuda_context_unusable_names_its_candidate(monkeypatch, broken_in):
    def broken():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    class Runner:
        note = ""
        sample = staticmethod(broken)

    class Timer:
        def prepare(self, fns):
            return broken() if broken_in == "prepare" else Runner()

    trial = measure.Trial("b:default", lambda call: (lambda: None), lambda err: True)
    assert measure.time_trials([trial], _call(), Timer(), rounds=1)[0].failed.startswith("while timing")
    monkeypatch.setattr(measure, "device_error", lambda device: LOST)
    with pytest.raises(measure.CudaContextLost, match="candidate b:default"):
        measure.time_trials([trial], _call(), Timer(), rounds=1)


def test_failing_default_hands_the_baseline_to_the_next_candidate():
    a = FakeBackend("a", {"default": (1.0, 0.01)}, fail={"default"})
    b = FakeBackend("b", {"default": (2.0, 0.01)})
    result = _tune(a, b)
    assert result.default == result.winner == "b:default"


def test_pruned_and_unsupported_candidates_keep_their_reason():
    a = FakeBackend("a", {"default": (1.0, 0.01)})
    b = FakeBackend("b", {"clc=True": (0.5, 0.01), "clc=False": (0.9, 0.01)}, prune={"clc=True": "CLC needs sm_100"})
    c = FakeBackend("c", {"default": (0.1, 0.01)}, supports_reason="needs a CUDA device")
    result = _tune(a, b, c)
    reasons = {r.name: (r.status, r.reason) for r in result.candidates}
    assert reasons["b:clc=True"] == ("pruned", "CLC needs sm_100")
    assert reasons["c:-"] == ("pruned", "needs a CUDA device")
    assert result.winner == "b:clc=False"


def test_programming_error_in_a_backend_raises_in_strict_mode_and_is_dropped_otherwise(monkeypatch):
    class Buggy(FakeBackend):
        def _forward(self, cfg, call):
            raise TypeError("unexpected keyword argument 'tile'")

    a = FakeBackend("a", {"default": (1.0, 0.01)})
    with pytest.raises(TypeError):
        _tune(a, Buggy("b", {"default": (0.5, 0.01)}))
    monkeypatch.setenv("INDUCTOR_ATTN_STRICT", "0")
    result = _tune(a, Buggy("b", {"default": (0.5, 0.01)}))
    assert result.winner == "a:default"
    assert next(c for c in result.candidates if c.name == "b:default").reason.startswith("TypeError")


def test_first_call_time_is_recorded_apart_from_run_time():
    class SlowFirstCall(FakeBackend):
        def _forward(self, cfg, call):
            if self.calls == 0:
                time.sleep(0.2)  # a JIT compile
            return super()._forward(cfg, call)

    a = FakeBackend("a", {"default": (1.0, 0.01)})
    slow = SlowFirstCall("b", {"default": (0.5, 0.01)})
    result = _tune(a, slow)
    rec = next(c for c in result.candidates if c.name == "b:default")
    assert rec.compile_s >= 0.2
    assert rec.median_ms == pytest.approx(0.5, abs=0.05)


def test_backward_tuning_gates_gradients_and_skips_forward_only_backends():
    class ForwardOnly(FakeBackend):
        takes = Takes()

    a = FakeBackend("a", {"default": (1.0, 0.01)})
    b = ForwardOnly("b", {"default": (0.1, 0.01)})
    result = _tune(a, b, direction="backward")
    assert result.winner == "a:default"
    assert next(c for c in result.candidates if c.name == "b:-").reason == "b has no backward"


def test_tune_result_survives_a_json_round_trip():
    from inductor_attn.tuning.tuner import TuneResult

    result = _tune(FakeBackend("a", {"default": (1.0, 0.01)}), FakeBackend("b", {"default": (0.5, 0.01)}))
    again = TuneResult.from_json(result.to_json())
    assert again == result


def test_errors_a_backend_declares_count_as_failed_candidates_even_in_strict_mode():
    from inductor_attn.tuning.tuner import is_candidate_error

    class OutOfResources(Exception):  # what triton.runtime.errors raises for too much shared memory
        pass

    class Kernels(FakeBackend):
        library = Library(errors=lambda: (OutOfResources,))

    backend = Kernels("k", {"default": (1.0, 0.01)})
    assert is_candidate_error(OutOfResources("shared memory 300000 > 232448"), backend)
    assert is_candidate_error(RuntimeError("CUDA error"), backend)
    assert not is_candidate_error(TypeError("bad argument"), backend)
    assert not is_candidate_error(OutOfResources("shared memory"), FakeBackend("other", {"default": (1.0, 0.01)}))


def test_every_timed_candidate_gets_its_host_time_as_compiled_code_launches_it():
    """Step 7: each candidate that passed and was timed carries the CPU time of its launch as compiled code
    makes it, with autograd off: a traced plan its launch, an untraced plan its launch through the thin op (the
    fake timer gives each the time its backend declares)."""
    traced = FakeBackend("a", {"default": (60.0, 0.01)}, traceable=True, host_s=0.004)
    python = FakeBackend("b", {"default": (50.0, 0.01)}, host_s=0.008)
    grad_modes = []
    real = FakeTimer.host_ms_each

    def noting_grad_mode(launches, device, failed=None, device_ms=None):
        return real({name: (lambda launch=launch: grad_modes.append(torch.is_grad_enabled()) or launch())
                     for name, launch in launches.items()}, device)

    FakeTimer.host_ms_each = staticmethod(noting_grad_mode)
    try:
        result = _tune(traced, python)
    finally:
        FakeTimer.host_ms_each = staticmethod(real)
    by_name = {c.name: c for c in result.candidates}
    assert result.winner == "b:default"
    assert [by_name[n].traced for n in ("a:default", "b:default")] == [True, False]
    assert [by_name[n].host_ms for n in ("a:default", "b:default")] == pytest.approx([4.0, 8.0])
    assert "host" in result.seconds and grad_modes == [False, False]


def test_host_time_is_the_launching_threads_cpu_time_not_time_spent_waiting():
    """Inside a tune, compile workers and other threads share the cores: a launch that waits for them (here,
    sleeps) is charged what it ran, not the wall-clock time it took."""
    from inductor_attn.tuning.timing import host_ms

    def waits():
        time.sleep(0.02)

    def spins():
        spent = time.thread_time() + 0.02
        while time.thread_time() < spent:
            pass

    cpu = torch.device("cpu")
    assert host_ms(waits, cpu, warmup=0, bursts=1, calls=2) < 5.0
    assert host_ms(spins, cpu, warmup=0, bursts=1, calls=2) >= 20.0


def test_host_time_is_the_median_burst_after_the_first_calls():
    """The first launches of a plan record and compile (FA4 records its replay); a burst that a stall hits is
    one of several: neither sets the figure."""
    from inductor_attn.tuning.timing import host_ms

    calls = []

    def launch():
        calls.append(None)
        spent = time.thread_time() + (0.05 if len(calls) in (1, 2, 20) else 0.001)  # warm-up, then one stall
        while time.thread_time() < spent:
            pass

    assert 1.0 <= host_ms(launch, torch.device("cpu"), warmup=2, bursts=5, calls=4) < 5.0
    assert len(calls) == 22


def test_host_probes_of_several_launches_take_turns_burst_by_burst():
    """The host's speed drifts within a process: the tuner's probes of its candidates take turns, one burst of
    each per round after every warm-up, as the device timings do, so a drift falls on all alike."""
    turns = []
    launches = {name: (lambda name=name: turns.append(name)) for name in "ab"}
    times = timing.host_ms_each(launches, torch.device("cpu"), warmup=1, bursts=3, calls=2)
    assert sorted(times) == ["a", "b"] and all(ms >= 0 for ms in times.values())
    assert "".join(turns) == "ab" + "aabb" * 3


def test_a_host_probe_of_a_long_kernel_takes_shorter_bursts_and_the_tuner_says_each_device_time(monkeypatch):
    """A burst queues at most BURST_DEVICE_MS of a launch's device work, never fewer than MIN_BURST_CALLS launches,
    each launch its own size: a 3 ms kernel's bursts are 10 launches, a short kernel's beside it the full count (its
    host time may decide its step, and short bursts read high); the tuner hands each candidate's device time."""
    def probed(device_ms):
        counts = dict.fromkeys(device_ms, 0)
        launches = {name: (lambda name=name: counts.__setitem__(name, counts[name] + 1)) for name in counts}
        timing.host_ms_each(launches, torch.device("cpu"), warmup=0, bursts=2, calls=40, device_ms=device_ms)
        return counts

    assert probed({"short": 0.05, "long": 3.0}) == {"short": 80, "long": 2 * timing.MIN_BURST_CALLS}
    assert probed({"short": 0.05, "unknown": None}) == {"short": 80, "unknown": 80}
    seen = {}
    real = FakeTimer.host_ms_each
    monkeypatch.setattr(FakeTimer, "host_ms_each", staticmethod(
        lambda launches, device, failed=None, device_ms=None: seen.update(device_ms) or real(launches, device)))
    result = _tune(FakeBackend("a", {"default": (1.0, 0.01)}), FakeBackend("b", {"default": (2.0, 0.01)}))
    assert seen == {r.name: r.median_ms for r in result.candidates if r.median_ms is not None} and len(seen) == 2


def test_host_time_of_an_untraced_candidate_goes_through_the_launch_op_and_is_not_counted(monkeypatch):
    from inductor_attn import runtime

    seen = []
    count = runtime.count_call
    monkeypatch.setattr(runtime, "count_call", lambda key: seen.append(key) or count(key))  # the op's impl counts
    runtime.reset_stats()
    _tune(FakeBackend("a", {"default": (100.0, 0.01)}, traceable=True), FakeBackend("b", {"default": (50.0, 0.01)}))
    assert seen and set(seen) == {("attention", "forward", "b:default")}
    assert runtime.stats() == {}


@contextlib.contextmanager
def _in_a_compile():
    """As lowering/emit.py tunes: inside a compile's tracing context and fake mode, under ``eager_mode``."""
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode

    from inductor_attn._compat import eager_mode

    fake_mode = FakeTensorMode()
    with tracing(TracingContext(fake_mode)), fake_mode, eager_mode():
        yield


def test_a_traced_plan_of_aten_ops_is_timed_as_generated_code_calls_them():
    """Compiled code calls the aten ops of a traced plan (SDPA's) by their overloads, not the plan's Python: the
    host probe times those calls (an FX graph's code), which give the plan's outputs, forward and backward. A
    traced form holding anything else (a Triton kernel through wrap_triton, here a higher-order op) is None."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=gen) for _ in range(3))
    call = AttnCall("attention", q, k, v, 8 ** -0.5, causal=True)

    def forward(c):
        s = (c.q @ c.k.transpose(-1, -2) * c.scale).tril()
        return s.softmax(-1) @ c.v, s.logsumexp(-1)

    out, lse = forward(call)
    for got, want in zip(measure._aten_calls_of(forward, call, None)(), (out, lse)):
        torch.testing.assert_close(got, want)
    with _in_a_compile():  # where compile-time decisions tune: the compile's fake mode is not the tensors'
        for got, want in zip(measure._aten_calls_of(forward, call, None)(), (out, lse)):
            torch.testing.assert_close(got, want)

    def backward(c, out, lse, grad_out, grad_lse):
        return grad_out @ c.v.transpose(-1, -2), c.k * 2, c.v + out

    grads = (out, lse, torch.randn(out.shape, generator=gen), None)
    for got, want in zip(measure._aten_calls_of(backward, call, grads)(), backward(call, *grads)):
        torch.testing.assert_close(got, want)

    seen = []

    def branching(c):
        seen.append(is_fake(c.q))
        return (torch.cond(c.q.sum() > 0, lambda x: x * 2, lambda x: x - 1, (c.q,)),)

    assert measure._aten_calls_of(branching, call, None) is None
    assert seen == [True]  # decided on fakes: a graph that is no probe never runs (a Triton plan's kernels)


def test_a_call_decided_per_call_is_probed_by_its_plans_launch_never_traced():
    """Compiled code never inlines the plan of a block-sparse or varlen call (it decides per call, at run time),
    so the host probe times the plan's launch. Tracing such a plan for a probe ran its Triton kernels under
    functionalization on real tensors (its mask's tensors were constants of a failed fake trace): illegal
    addresses on an H200."""
    from torch.nn.attention.flex_attention import create_block_mask

    mask = create_block_mask(lambda b, h, q, kv: kv <= q, None, None, 64, 64, device="cpu", BLOCK_SIZE=32)
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    call = AttnCall("block_sparse", q, k, v, 0.25, sparse=inductor_attn.BlockSparseMask.from_block_mask(mask))
    traced, launched = [], []
    plan = types.SimpleNamespace(traced=lambda c: traced.append(c), launch=lambda c: launched.append(c))
    measure.Direction("forward", call).as_compiled_code_runs(plan, call, "a:default")()
    assert traced == [] and launched == [call]


# --- staged search -------------------------------------------------------------------------------
def _staged_backends():
    a = FakeBackend("a", {"default": (1.0, 0.01)})
    b = FakeBackend("b", {"k=1": (0.95, 0.01), "k=2": (0.5, 0.01)})  # its default is close to the best: searched
    c = FakeBackend("c", {"x=1": (2.0, 0.01), "x=2": (0.3, 0.01)})  # its default is 2.1x the best: not searched
    return a, b, c


def _tune_with(*backends, search, seed=0, timer=None):
    call = _call()
    with only_backends(*backends):
        cands = enumerate_candidates(call.problem, DEV)
        return tune(call, cands, timer=timer or FakeTimer(list(backends), seed=seed), rounds=20, search=search)


def test_staged_search_expands_only_backends_whose_default_is_within_the_margin():
    a, b, c = _staged_backends()
    result = _tune_with(a, b, c, search="staged")
    by_name = {r.name: r for r in result.candidates}
    assert result.winner == "b:k=2"
    assert by_name["b:k=2"].status == "passed"
    assert by_name["c:x=2"].status == "pruned" and by_name["c:x=2"].compile_s is None  # never ran
    assert re.fullmatch(r"stage 1: c default 2\.00\d ms, 2\.1\dx the best \(b:k=1 0\.95\d ms\); margin 1\.25x",
                        by_name["c:x=2"].reason)
    assert re.fullmatch(r"timed in stage 1 only \(2\.1\dx the best\)", by_name["c:x=1"].note)
    assert result.search == "staged (margin 1.25x)"


def test_exhaustive_search_measures_every_candidate():
    result = _tune_with(*_staged_backends(), search="exhaustive")
    assert result.winner == "c:x=2" and result.search == "exhaustive"
    assert all(r.status == "passed" for r in result.candidates)


def test_a_wider_stage_margin_from_the_environment_searches_more_backends(monkeypatch):
    monkeypatch.setenv("INDUCTOR_ATTN_STAGE_MARGIN", "2.5")
    assert _tune_with(*_staged_backends(), search=None).winner == "c:x=2"


@pytest.mark.parametrize("env, value, message", [
    ("INDUCTOR_ATTN_STAGE_MARGIN", "0.9", "INDUCTOR_ATTN_STAGE_MARGIN must be a factor >= 1 .*got '0.9'"),
    ("INDUCTOR_ATTN_SEARCH", "greedy", "INDUCTOR_ATTN_SEARCH must be one of staged, exhaustive, got 'greedy'"),
])
def test_bad_search_settings_are_named_with_what_is_accepted(monkeypatch, env, value, message):
    monkeypatch.setenv(env, value)
    with pytest.raises(ValueError, match=message):
        _tune_with(*_staged_backends(), search=None)


def test_a_strict_setting_other_than_0_or_1_is_named_not_taken_for_off(monkeypatch):
    monkeypatch.setenv("INDUCTOR_ATTN_STRICT", "true")
    with pytest.raises(ValueError, match=r"^INDUCTOR_ATTN_STRICT must be 1 \(on\) or 0 \(off\), got 'true'"):
        measure.strict()


def test_stage_one_times_a_backends_hand_rule_config_as_its_default():
    a = FakeBackend("a", {"default": (1.0, 0.01)})
    c = FakeBackend("c", {"x=1": (2.0, 0.01), "x=2": (0.3, 0.01)}, heuristic="x=2")
    result = _tune_with(a, c, search="staged")
    assert result.winner == "c:x=2" and c.calls >= 2  # x=2 represented c; x=1 was searched after


def test_stage_one_times_each_entry_point_of_a_backend_which_launch_at_their_own_host_cost():
    """SDPA's kernels are one backend, three entry points: a kernel slower than the best by more than the stage
    margin may still make the faster step in a host-bound graph, for its cheaper launch, so each gets its own time
    (and so its host time, which the step rule weighs)."""
    a = FakeBackend("a", {"default": (0.5, 0.01)})
    s = FakeBackend("s", {"kernel=cudnn": (0.7, 0.01), "kernel=flash": (0.8, 0.01), "kernel=efficient": (2.0, 0.01)})
    result = _tune_with(a, s, search="staged")
    by_name = {r.name: r for r in result.candidates}
    assert all(by_name[f"s:kernel={k}"].status == "passed" for k in ("cudnn", "flash", "efficient"))
    assert by_name["s:kernel=flash"].host_ms is not None and result.winner == "a:default"


def test_a_backend_whose_default_fails_is_represented_by_its_next_candidate():
    a = FakeBackend("a", {"default": (1.0, 0.01)})
    b = FakeBackend("b", {"k=1": (0.9, 0.01), "k=2": (0.5, 0.01)}, fail={"k=1"})
    result = _tune_with(a, b, search="staged")
    by_name = {r.name: r for r in result.candidates}
    assert by_name["b:k=1"].status == "failed" and result.winner == "b:k=2"


def test_tune_records_wall_seconds_per_phase():
    result = _tune_with(*_staged_backends(), search="staged")
    assert {"compile", "gate", "timing", "total"} <= set(result.seconds)
    assert result.seconds["total"] >= result.seconds["timing"] > 0


# --- agreement: between-session noise ---------------------------------------------------------------
class SessionTimer(FakeTimer):
    """Each prepared runner (a new timing session) scales its candidate's times by the next factor of
    ``factors[backend]``: how a ratio moves between processes, which the spread inside one session misses."""

    def __init__(self, backends, factors):
        super().__init__(backends)
        self.factors = {b.name: iter(factors.get(b.name, ())) for b in backends}

    def prepare(self, fns):
        runner = super().prepare(fns)
        factor = next(self.factors[FakeTimer.last[0]], 1.0)
        inner = runner.sample
        runner.sample = lambda: inner() * factor
        return runner


def test_close_top_two_are_timed_again_and_a_lead_inside_the_noise_goes_by_prior_order():
    a = FakeBackend("a", {"default": (1.0, 0.002)})
    b = FakeBackend("b", {"default": (0.96, 0.002)})  # 4% faster in the first session
    timer = SessionTimer([a, b], {"a": [1.0, 0.98, 1.03], "b": [1.0, 1.06, 0.97]})
    result = _tune_with(a, b, search="exhaustive", timer=timer)
    # b over a per session: 0.960, 1.038, 0.904 -> the ratio moves by 14.8%
    assert result.noise == pytest.approx(0.148, abs=0.01)
    assert result.winner == "a:default" and "tie margin" in result.why
    assert "a:default, b:default timed in 2 more sessions" in result.noise_note
    assert len(next(r for r in result.candidates if r.name == "b:default").samples) == 60


def test_a_lead_larger_than_the_measured_noise_wins():
    a = FakeBackend("a", {"default": (1.0, 0.002)})
    b = FakeBackend("b", {"default": (0.95, 0.002)})
    timer = SessionTimer([a, b], {"a": [1.0, 1.0, 1.0], "b": [1.0, 1.01, 0.995]})
    result = _tune_with(a, b, search="exhaustive", timer=timer)
    assert result.winner == "b:default" and result.noise == pytest.approx(0.015, abs=0.005)


def test_the_winner_is_the_fastest_by_speedup_when_the_clock_changed_between_sessions():
    """Step 5 times the close group again, in sessions where the GPU ran 25% slower for everyone; b, timed once,
    kept its first session's median and looked faster than c's pooled one: it won while 13% slower than c."""
    a, b = FakeBackend("a", {"default": (2.0, 0.01)}), FakeBackend("b", {"default": (1.08, 0.005)})
    c, d = FakeBackend("c", {"default": (0.95, 0.005)}), FakeBackend("d", {"default": (0.96, 0.005)})
    slower = {name: [1.0, 1.25, 1.25] for name in "abcd"}
    result = _tune_with(a, b, c, d, search="exhaustive", timer=SessionTimer([a, b, c, d], slower))
    assert result.winner == "c:default", result.why


def test_noise_measured_between_two_candidates_ties_no_candidate_that_was_not_timed_again():
    """c and d swap places between sessions (a noise of about 50%); b, 13% slower than both and timed once, must
    not win on prior order inside a tie margin that was never measured for it."""
    a, b = FakeBackend("a", {"default": (2.0, 0.01)}), FakeBackend("b", {"default": (1.08, 0.005)})
    c, d = FakeBackend("c", {"default": (0.95, 0.005)}), FakeBackend("d", {"default": (0.96, 0.005)})
    timer = SessionTimer([a, b, c, d], {"c": [1.0, 0.9, 1.1], "d": [1.0, 1.1, 0.9]})
    result = _tune_with(a, b, c, d, search="exhaustive", timer=timer)
    assert result.noise > 0.2 and result.winner == "c:default", result.why


def test_a_search_run_again_after_a_candidate_failed_searches_what_stage_one_had_pruned_against_it():
    """b:k=1, the best stage-1 default, fails while timed in stage 2; against the new best, c's default is within
    the margin, so c's knobs are searched (its k=2 twice as fast as anything else), not left pruned against
    b:k=1."""
    a = FakeBackend("a", {"default": (2.0, 0.01)})
    b = FakeBackend("b", {"k=1": (0.5, 0.005), "k=2": (0.6, 0.005)})
    c = FakeBackend("c", {"k=1": (0.7, 0.005), "k=2": (0.3, 0.005)})
    timer, sessions = FakeTimer([a, b, c]), collections.Counter()
    prepare = timer.prepare

    def failing_in_stage_two(fns):
        runner = prepare(fns)
        sessions[FakeTimer.last] += 1
        if FakeTimer.last == ("b", "k=1") and sessions[FakeTimer.last] == 2:
            raise RuntimeError("CUDA error: launch failed (simulated)")
        return runner

    timer.prepare = failing_in_stage_two
    result = _tune_with(a, b, c, search="staged", timer=timer)
    assert next(r for r in result.candidates if r.name == "b:k=1").status == "failed"
    assert result.winner == "c:k=2", result.why


def test_every_candidate_within_close_of_the_fastest_is_timed_again():
    """One session can misrank long kernels by more than their gap (H200: a 12 ms FA3 forward read 8% behind an FA4
    config in a tune, 1% ahead in the bench): the third-fastest of a close field gets the more sessions too, and
    how far it moved counts in the noise, so the lead of one session's fastest becomes a tie."""
    a = FakeBackend("a", {"default": (1.0, 0.002)})
    b = FakeBackend("b", {"default": (0.80, 0.002)})
    c = FakeBackend("c", {"default": (0.81, 0.002)})
    d = FakeBackend("d", {"default": (0.86, 0.002)})  # 7.5% behind b in the first session, 9% ahead in the next two
    timer = SessionTimer([a, b, c, d], {"d": [1.0, 0.85, 0.85]})
    result = _tune_with(a, b, c, d, search="exhaustive", timer=timer)
    samples = {r.name: len(r.samples) for r in result.candidates}
    assert samples == {"a:default": 60, "b:default": 60, "c:default": 60, "d:default": 60}
    assert "b:default, c:default, d:default timed in" in result.noise_note
    # d's time over b's per session: 1.075, 0.914, 0.914 -> 17.6%; b is inside that margin of d and earlier in
    # prior order
    assert result.noise == pytest.approx(0.176, abs=0.01) and result.winner == "b:default"


def test_close_configs_that_decide_nothing_do_not_widen_the_noise():
    """Two configs behind the two fastest, moving a lot against each other between sessions, are timed again but
    leave the noise to the ratios that decide: the two fastest (and the default where it is close)."""
    a = FakeBackend("a", {"default": (1.0, 0.002)})
    b = FakeBackend("b", {"default": (0.80, 0.002)})
    c = FakeBackend("c", {"default": (0.81, 0.002)})
    d = FakeBackend("d", {"default": (0.84, 0.002)})
    e = FakeBackend("e", {"default": (0.84, 0.002)})
    timer = SessionTimer([a, b, c, d, e], {"d": [1.0, 1.08, 0.95], "e": [1.0, 0.94, 1.06]})
    result = _tune_with(a, b, c, d, e, search="exhaustive", timer=timer)
    assert len(next(r for r in result.candidates if r.name == "e:default").samples) == 60
    assert result.noise < 0.02 and result.winner == "b:default"


def test_top_two_far_apart_are_not_timed_again():
    a = FakeBackend("a", {"default": (1.0, 0.01)})
    b = FakeBackend("b", {"default": (0.5, 0.01)})
    result = _tune_with(a, b, search="exhaustive")
    assert result.noise is None and "x apart (> 1.10x): not timed again" in result.noise_note
    assert len(next(r for r in result.candidates if r.name == "b:default").samples) == 20


# --- compiling ahead -------------------------------------------------------------------------------
class Compiling(FakeBackend):
    """Plans with ``compile``: each takes ``compile_s`` or raises ``compile_errors[cfg]``."""

    def __init__(self, *args, compile_s=0.0, compile_errors=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.compile_s, self.compile_errors, self.compiled, self.threads = compile_s, compile_errors or {}, [], set()

    def plan(self, p, dev, cfg, direction):
        return dataclasses.replace(super().plan(p, dev, cfg, direction),
                                   compile=functools.partial(self._compile, str(cfg)))

    def _compile(self, cfg, call, *grads):
        self.threads.add(threading.current_thread().name)
        time.sleep(self.compile_s)
        if cfg in self.compile_errors:
            raise self.compile_errors[cfg]
        self.compiled.append(cfg)


def test_candidates_compile_at_once_in_threads_before_their_gate(monkeypatch):
    monkeypatch.setenv("INDUCTOR_ATTN_COMPILE_WORKERS", "4")
    monkeypatch.setattr(precompile, "parallel_parse_safe", lambda: True)
    a = FakeBackend("a", {"default": (1.0, 0.01)})
    b = Compiling("b", {f"k={i}": (0.9, 0.01) for i in range(4)}, compile_s=0.1)
    result = _tune_with(a, b, search="exhaustive")
    assert sorted(b.compiled) == [f"k={i}" for i in range(4)] and threading.main_thread().name not in b.threads
    assert 0.1 <= result.seconds["compile"] < 0.4  # four compiles of 0.1 s at once, not in turn
    assert all(r.compile_s >= 0.1 for r in result.candidates if r.name.startswith("b:"))


def test_a_compile_that_fails_drops_its_candidate_with_the_reason():
    a = FakeBackend("a", {"default": (1.0, 0.01)})
    b = Compiling("b", {"k=1": (0.5, 0.01)}, compile_errors={"k=1": RuntimeError("ptxas fatal: too many registers")})
    result = _tune_with(a, b, search="exhaustive")
    bad = next(r for r in result.candidates if r.name == "b:k=1")
    assert result.winner == "a:default" and bad.status == "failed" and "ptxas fatal" in bad.reason


def test_a_programming_error_in_a_compile_raises_in_strict_mode():
    b = Compiling("b", {"k=1": (0.5, 0.01)}, compile_errors={"k=1": TypeError("warmup() got an unexpected keyword")})
    with pytest.raises(TypeError, match="unexpected keyword"):
        _tune_with(FakeBackend("a", {"default": (1.0, 0.01)}), b, search="exhaustive")


def test_no_compile_workers_means_every_candidate_compiles_at_its_first_call(monkeypatch):
    monkeypatch.setenv("INDUCTOR_ATTN_COMPILE_WORKERS", "0")
    b = Compiling("b", {"k=1": (0.5, 0.01)})
    result = _tune_with(FakeBackend("a", {"default": (1.0, 0.01)}), b, search="exhaustive")
    assert b.compiled == [] and result.winner == "b:k=1"


def test_when_stage_two_adds_nobody_stage_one_decides():
    a = FakeBackend("a", {"k=1": (1.0, 0.01), "k=2": (0.5, 0.01)}, fail={"k=2"})
    c = FakeBackend("c", {"default": (3.0, 0.01)})
    result = _tune_with(a, c, search="staged")
    assert result.winner == "a:k=1" and "faster than the default" not in result.why
    assert next(r for r in result.candidates if r.name == "c:default").median_ms == pytest.approx(3.0, abs=0.1)


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_the_gate_leaves_out_packed_rows_past_the_last_sequence(direction):
    """transformers' batches padded for CUDA graphs pack more rows than cu_seqlens cover (check_indices=False);
    kernels leave those rows unwritten, as FlashAttention does, and no caller reads them: were they compared with
    the reference's zeros, every kernel would fail the gate on such batches and the reference would win."""
    from inductor_attn.tuning.measure import Direction

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 2, 8, generator=gen) for n in (10, 12, 12))
    cu_q, cu_k = torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([0, 5, 9], dtype=torch.int32)
    call = AttnCall("varlen", q, k, v, 0.35, True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=4,
                    max_seqlen_k=5)
    mode = Direction(direction, call)
    want = mode.reference(call)
    got = [x.clone() for x in want]
    if direction == "forward":
        got[0][7:], got[1][:, 7:] = float("nan"), float("nan")
    else:
        got[0][7:], got[1][9:], got[2][9:] = (float("nan"),) * 3
    assert mode.check(tuple(got), want, torch.float32)[0] is None
    got[0][6] += 1.0  # a row of the last sequence
    assert mode.check(tuple(got), want, torch.float32)[0] is not None


@pytest.mark.parametrize("dtype, wrong", [(torch.bfloat16, 1), (torch.float8_e4m3fn, 14)])
def test_the_gate_fails_an_output_with_a_few_wrong_rows_that_one_norm_would_pass(dtype, wrong):
    """A tail tile left unwritten: 14 of 4,096 rows zeroed kept the fp8 output's whole-tensor error under its bound
    (one row, bf16's)."""
    from inductor_attn.tuning.correctness import check_output, rel_err

    torch.manual_seed(0)
    ref, lse = torch.randn(1, 2, 4096, 64), torch.randn(1, 2, 4096)
    assert check_output(ref.to(dtype).float(), lse, ref, lse, dtype) is None  # rounding: far from the row bound
    got = ref.clone()
    got[:, 1, -wrong:] = 0
    assert rel_err(got, ref) < TOLERANCES[dtype]
    assert check_output(got, lse, ref, lse, dtype) == (f"output row {2 * 4096 - wrong} rel. error 1.00e+00 > "
                                                       f"{10 * TOLERANCES[dtype]:.0e} (some rows wrong)")
    masked = ref.clone()
    masked[:, :, :3] = 0  # rows no key reaches: zeros in both, no norm of their own
    assert check_output(masked, lse, masked, lse, dtype) is None


def test_the_cuda_graph_timer_takes_a_replays_fixed_cost_off_each_sample(monkeypatch):
    """A replay of n calls takes F + their times: the timer measures F from graphs of trivial kernels of two sizes,
    once per device, and takes it off each sample of a captured graph, never more than half of it; plain launches
    of a kernel that cannot be captured carry no replay and keep their time."""
    fixed, trivial_ms, measured = 0.011, 0.002, []

    def sampler(self, fns):
        captured = not any(getattr(fn, "uncapturable", False) for fn in fns)
        total = (fixed if captured else 0.0) + sum(getattr(fn, "ms", trivial_ms) for fn in fns)
        measured.append(len(fns))
        return (lambda: total), (object() if captured else None), ""

    def call(ms, uncapturable=False):
        fn = lambda: None  # noqa: E731
        fn.ms, fn.uncapturable = ms, uncapturable
        return fn

    monkeypatch.setattr(timing.CudaGraphTimer, "_replay_sampler", sampler)
    monkeypatch.setattr(timing, "_trivial_kernel", lambda: (lambda: None))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(timing, "_REPLAY_COST_MS", {})
    timer = timing.CudaGraphTimer()
    assert timer.replay_cost_ms() == pytest.approx(fixed)
    assert timer.prepare([call(0.015)] * 2).sample() == pytest.approx(0.015)  # 2 copies: 5.5 us off each
    assert timer.prepare([call(0.080)]).sample() == pytest.approx(0.080)
    assert timer.prepare([call(0.004)]).sample() == pytest.approx(0.0075)  # at most half of a 15 us sample off
    assert timer.prepare([call(0.015, uncapturable=True)]).sample() == pytest.approx(0.015)
    assert measured.count(timing.REPLAY_COST_KERNELS[1]) == 1  # measured once, then remembered
