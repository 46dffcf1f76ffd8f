"""The tuner's decisions on fake backends with known time distributions (no kernels, CPU only)."""

import time

import pytest
import torch
from fakes import FakeBackend, FakeTimer

from inductor_attn.backends import AttnCall, enumerate_candidates, only_backends
from inductor_attn.device import DeviceInfo
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


def test_failing_candidate_is_dropped_with_its_reason_not_raised():
    a = FakeBackend("a", {"default": (1.0, 0.01)})
    b = FakeBackend("b", {"default": (0.1, 0.01)}, fail={"default"})
    result = _tune(a, b)
    assert result.winner == "a:default"
    bad = next(c for c in result.candidates if c.name == "b:default")
    assert bad.status == "failed" and "launch failed" in bad.reason


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
        has_backward = False

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
        def errors(self):
            return (OutOfResources,)

    backend = Kernels("k", {"default": (1.0, 0.01)})
    assert is_candidate_error(OutOfResources("shared memory 300000 > 232448"), backend)
    assert is_candidate_error(RuntimeError("CUDA error"), backend)
    assert not is_candidate_error(TypeError("bad argument"), backend)
    assert not is_candidate_error(OutOfResources("shared memory"), FakeBackend("other", {"default": (1.0, 0.01)}))


@pytest.mark.parametrize("host_s, compiled", [(0.2, "a:default"), (0.0, "b:default")])
def test_compiled_code_takes_a_traced_candidate_when_the_winners_host_time_eats_its_lead(host_s, compiled):
    a = FakeBackend("a", {"default": (100.0, 0.01)}, traceable=True)
    b = FakeBackend("b", {"default": (50.0, 0.01)}, host_s=host_s)  # faster kernel, launched from Python
    result = _tune(a, b)
    assert result.winner == "b:default" and result.compiled_winner == compiled
    host = next(c for c in result.candidates if c.name == "b:default").host_ms
    assert host >= 1e3 * host_s and next(c for c in result.candidates if c.name == "a:default").traced
