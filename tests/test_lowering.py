"""The Inductor lowering: baked choices for static shapes, per-bucket dispatch for dynamic shapes, and
an FX graph cache that never replays code built from stale decisions. CPU, fake backends."""

import pytest
import torch
from fakes import FakeBackend, FakeTimer
from torch._inductor.utils import run_and_get_code

import inductor_attn
from inductor_attn.backends import REFERENCE, only_backends
from inductor_attn.lowering import cache_guard


@pytest.fixture
def fakes(monkeypatch):
    a = FakeBackend("a", {"default": (1.0, 0.01)})
    b = FakeBackend("b", {"x=1": (0.5, 0.01)})
    monkeypatch.setattr("inductor_attn.tuning.tuner.default_timer", lambda device_type: FakeTimer([a, b]))
    torch._dynamo.reset()
    with only_backends(a, b, REFERENCE), inductor_attn.tuning_mode("autotune"):
        yield a, b
    torch._dynamo.reset()


def _qkv(length, heads_kv=2):
    return torch.randn(1, 4, length, 16), torch.randn(1, heads_kv, length, 16), torch.randn(1, heads_kv, length, 16)


def _attn(q, k, v):
    return inductor_attn.attention(q, k, v, causal=True)


def test_static_shapes_bake_the_tuned_choice_into_the_generated_call(fakes):
    q, k, v = _qkv(24)
    out, (code,) = run_and_get_code(torch.compile(_attn, fullgraph=True), q, k, v)
    assert "torch.ops.inductor_attn.attention.default(" in code and "'b:x=1'" in code
    torch.testing.assert_close(out, _attn(q, k, v))
    assert cache_guard.active()


def test_dynamic_lengths_compile_once_and_tune_each_new_bucket_once(fakes, monkeypatch):
    a, b = fakes
    tuned = []
    from inductor_attn.tuning import decisions as decide_mod

    real_tune = decide_mod.tune
    monkeypatch.setattr(decide_mod, "tune", lambda call, *a_, **kw: tuned.append(call.problem.len_q)
                        or real_tune(call, *a_, **kw))
    compiled = torch.compile(_attn, dynamic=True, fullgraph=True)
    frames_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for length in (17, 20, 31, 40, 50, 64):
        q, k, v = _qkv(length)
        torch.testing.assert_close(compiled(q, k, v), _attn(q, k, v))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - frames_before == 1
    assert tuned == [17, 40]  # buckets 32 and 64, each tuned once, on the first length seen
    assert len(inductor_attn.cache.list_decisions()) == 2


def test_fx_graph_cache_does_not_replay_a_choice_after_the_decisions_changed(fakes, tmp_path, monkeypatch):
    a, b = fakes
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    q, k, v = _qkv(24)
    with torch._inductor.config.patch(fx_graph_cache=True, force_disable_caches=False):
        _, (code,) = run_and_get_code(torch.compile(_attn, fullgraph=True), q, k, v)
        assert "'b:x=1'" in code
        # the decisions change (cleared, and now "a" is measured faster): recompiling must not replay 'b:x=1'
        inductor_attn.cache.clear()
        b.times["x=1"] = (2.0, 0.01)
        torch._dynamo.reset()
        _, (code,) = run_and_get_code(torch.compile(_attn, fullgraph=True), q, k, v)
        assert "'a:default'" in code and "'b:x=1'" not in code


def test_without_the_guard_nothing_is_baked(fakes):
    torch._inductor.config.post_grad_custom_post_pass = None
    try:
        q, k, v = _qkv(24)
        torch._dynamo.reset()
        with torch._inductor.config.patch(post_grad_custom_post_pass=None):
            # our lowering is already registered, so the guard is not re-installed in this compile
            out, (code,) = run_and_get_code(torch.compile(_attn, fullgraph=True), q, k, v)
        assert "torch.ops.inductor_attn.attention.default(" in code and "'b:x=1'" not in code
        torch.testing.assert_close(out, _attn(q, k, v))
    finally:
        cache_guard.install()


def test_guard_chains_a_pass_the_user_already_set():
    from inductor_attn._compat import custom_graph_pass_base

    seen = []

    class UserPass(custom_graph_pass_base()):
        def __call__(self, graph):
            seen.append(graph)

        def uuid(self):
            return "user-pass-v1"

    with torch._inductor.config.patch(post_grad_custom_post_pass=UserPass()):
        cache_guard.install()
        guard = torch._inductor.config.post_grad_custom_post_pass
        assert isinstance(guard, cache_guard.DecisionCacheGuard) and isinstance(guard.chained, UserPass)
        guard("graph")
        assert seen == ["graph"] and guard.uuid() is not None
    cache_guard.install()
