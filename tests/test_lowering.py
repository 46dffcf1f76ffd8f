"""The compile-time pass: static shapes are decided while compiling and the call is replaced by its plan
(traced kernels, or the thin launch op), dynamic shapes dispatch per bucket, and Inductor's FX graph cache
never replays code built from stale decisions. CPU, fake backends."""

import dataclasses
import re

import pytest
import torch
from fakes import FAKE_KERNEL_CHECK, AtenCpuFlash, FakeBackend, timed_with_fakes
from torch._inductor.utils import run_and_get_code

import inductor_attn
from inductor_attn import lowering
from inductor_attn.backends import REFERENCE, only_backends
from inductor_attn.lowering.graph_pass import DecisionPass
from inductor_attn.ops import attention as attention_ops
from inductor_attn.messages import KV_SEQLENS_VALUES


def _fakes(monkeypatch, traceable=False):
    a = FakeBackend("a", {"default": (1.0, 0.01)}, traceable=traceable)
    b = FakeBackend("b", {"x=1": (0.5, 0.01)}, traceable=traceable)
    timed_with_fakes(monkeypatch, a, b)
    return a, b


@pytest.fixture
def fakes(monkeypatch):
    a, b = _fakes(monkeypatch)
    torch._dynamo.reset()
    with only_backends(a, b, REFERENCE), inductor_attn.tuning_mode("autotune"):
        yield a, b
    torch._dynamo.reset()


def _qkv(length, heads_kv=2, requires_grad=False):
    return tuple(torch.randn(1, h, length, 16, requires_grad=requires_grad) for h in (4, heads_kv, heads_kv))


def _attn(q, k, v):
    return inductor_attn.attention(q, k, v, causal=True)


def test_static_shapes_decide_while_compiling_and_call_the_plan_through_the_launch_op(fakes):
    q, k, v = _qkv(24)
    out, (code,) = run_and_get_code(torch.compile(_attn, fullgraph=True), q, k, v)
    assert "torch.ops.inductor_attn.launch.default(" in code and "'forward|b:x=1|" in code
    assert "inductor_attn.attention.default(" not in code  # no decision and no checks per call
    torch.testing.assert_close(out, _attn(q, k, v))
    assert lowering.active()


def test_a_traceable_plan_is_put_into_the_graph_and_no_op_of_ours_runs(monkeypatch):
    a, b = _fakes(monkeypatch, traceable=True)
    torch._dynamo.reset()
    with only_backends(a, b, REFERENCE), inductor_attn.tuning_mode("autotune"):
        q, k, v = _qkv(24, requires_grad=True)

        def step(q, k, v):
            torch.compile(_attn, fullgraph=True)(q, k, v).sum().backward()

        inductor_attn.reset_stats()
        _, codes = run_and_get_code(step, q, k, v)
        assert len(codes) == 2 and not any("inductor_attn" in code for code in codes)  # forward and backward
        assert inductor_attn.stats() == {
            "attention/backward -> b:x=1 (launched by compiled code, per graph)": 1,
            "attention/forward -> b:x=1 (launched by compiled code, per graph)": 1}
        grads = [x.grad for x in (q, k, v)]
        for x in (q, k, v):
            x.grad = None
        _attn(q, k, v).sum().backward()
        for got, x in zip(grads, (q, k, v)):
            torch.testing.assert_close(got, x.grad)
    torch._dynamo.reset()


def test_a_forward_whose_lse_nothing_reads_traces_the_plans_out_only_form(monkeypatch):
    """Inference compiles the plan's ``traced_out_only`` (SDPA's asks cuDNN for no lse, as SDPA does itself);
    training, whose backward reads the lse, compiles the full traced form."""
    a, b = _fakes(monkeypatch, traceable=True)
    forms = []
    make_plan = b.plan

    def plan(p, dev, cfg, direction):
        made = make_plan(p, dev, cfg, direction)
        if direction == "backward":
            return made

        def full(call):
            forms.append("full")
            return made.traced(call)

        def out_only(call):
            forms.append("out only")
            return made.traced(call)[:1]
        return dataclasses.replace(made, traced=full, traced_out_only=out_only)

    monkeypatch.setattr(b, "plan", plan)
    torch._dynamo.reset()
    with only_backends(a, b, REFERENCE), inductor_attn.tuning_mode("autotune"):
        q, k, v = _qkv(24)
        out = torch.compile(_attn, fullgraph=True)(q, k, v)
        assert forms == ["out only"]
        torch.testing.assert_close(out, _attn(q, k, v))
        forms.clear()
        torch._dynamo.reset()
        q, k, v = _qkv(24, requires_grad=True)
        torch.compile(_attn, fullgraph=True)(q, k, v).sum().backward()
        assert forms == ["full"]
    torch._dynamo.reset()


def _block_sparse_call():
    from torch.nn.attention.flex_attention import create_block_mask

    block_mask = create_block_mask(lambda b, h, q, kv: (kv <= q) & (q - kv < 40), None, None, 96, 96,
                                   device="cpu", BLOCK_SIZE=32)
    sparse = inductor_attn.BlockSparseMask.from_block_mask(block_mask)
    return _qkv(96, heads_kv=4, requires_grad=True), lambda q, k, v: inductor_attn.attention(q, k, v, block_mask=sparse)


def _varlen_call():
    cu = torch.tensor([0, 30, 31, 80], dtype=torch.int32)
    qkv = tuple(torch.randn(80, h, 16, requires_grad=True) for h in (4, 2, 2))
    return qkv, lambda q, k, v: inductor_attn.varlen_attention(q, k, v, cu, cu, 49, 49, causal=True)


@pytest.mark.parametrize("op, make", [("block_sparse", _block_sparse_call), ("varlen", _varlen_call)])
def test_a_static_run_time_decided_call_goes_through_the_launch_op_not_the_custom_op(fakes, op, make):
    (q, k, v), attn = make()

    def step(q, k, v):
        out = torch.compile(attn, fullgraph=True)(q, k, v)
        return torch.autograd.grad(out.sum(), (q, k, v))

    inductor_attn.reset_stats()
    grads, codes = run_and_get_code(step, q, k, v)
    assert len(codes) == 2  # forward and backward
    for code in codes:
        assert "torch.ops.inductor_attn.launch.default(" in code and "|*|" in code
        assert f"inductor_attn.{op}_attention" not in code
    # decided per call on the real mask or lengths, and counted there
    assert inductor_attn.stats() == {f"{op}/backward -> b:x=1": 1, f"{op}/forward -> b:x=1": 1}
    want = torch.autograd.grad(attn(q, k, v).sum(), (q, k, v))
    for got, w in zip(grads, want):
        torch.testing.assert_close(got, w)


def test_tunes_while_compiling_run_without_the_python_dispatcher_or_fake_mode(fakes, monkeypatch):
    """AOTAutograd compiles a forward graph with the Python dispatcher on; a tune under it would time every aten
    call through Python, and step 7 of tuner.py would weigh those host times."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from inductor_attn.tuning import decisions as decide_mod

    seen, real_tune = [], decide_mod.tune

    def tune(call, *args, **kwargs):
        python_dispatcher = torch._C._dispatch_tls_is_dispatch_key_included(torch._C.DispatchKey.PythonDispatcher)
        fake = any(isinstance(m, FakeTensorMode) for m in _get_current_dispatch_mode_stack())
        seen.append((kwargs.get("direction"), python_dispatcher, fake))
        return real_tune(call, *args, **kwargs)

    monkeypatch.setattr(decide_mod, "tune", tune)
    q, k, v = _qkv(24, requires_grad=True)
    torch.compile(_attn, fullgraph=True)(q, k, v).sum().backward()
    assert sorted(d for d, _, _ in seen) == ["backward", "forward"]
    assert all(not python_dispatcher and not fake for _, python_dispatcher, fake in seen), seen


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
        assert "|b:x=1|" in code
        # the decisions change (cleared, and now "a" is measured faster): recompiling must not replay 'b:x=1'
        inductor_attn.cache.clear()
        b.times["x=1"] = (2.0, 0.01)
        torch._dynamo.reset()
        _, (code,) = run_and_get_code(torch.compile(_attn, fullgraph=True), q, k, v)
        assert "|a:default|" in code and "|b:x=1|" not in code


def test_the_compile_after_a_cold_tune_finds_the_code_that_tune_compiled(fakes, tmp_path, monkeypatch):
    # the cold compile's key is taken before its tune writes the store: a new decision must not change it
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    counters = torch._dynamo.utils.counters
    q, k, v = _qkv(24)
    with torch._inductor.config.patch(fx_graph_cache=True, force_disable_caches=False):
        counters.clear()
        torch.compile(_attn, fullgraph=True)(q, k, v)
        assert len(inductor_attn.cache.list_decisions()) == 1
        torch._dynamo.reset()
        torch.compile(_attn, fullgraph=True)(q, k, v)
    assert counters["inductor"]["fxgraph_cache_hit"] == 1


def test_a_compile_after_another_process_wrote_the_store_bakes_what_the_store_answers(fakes):
    """The cache key holds the store's token, and this process's remembered choice was made under an older one:
    compiled under the new key, the stale choice would be replayed from Inductor's cache by every later process."""
    from inductor_attn.store.db import get_store

    q, k, v = _qkv(24)
    _attn(q, k, v)  # a tune (autotune): b wins
    (row,) = get_store().rows()
    get_store().clear()  # the store as another process will find it, then write
    with inductor_attn.tuning_mode("cache-only"):
        assert "'forward|a:default|" in run_and_get_code(torch.compile(_attn, fullgraph=True), q, k, v)[1][0]
        get_store().put(row)  # another process's tune lands
        torch._dynamo.reset()
        assert "'forward|b:x=1|" in run_and_get_code(torch.compile(_attn, fullgraph=True), q, k, v)[1][0]


@pytest.mark.parametrize("mode", ["cache-only", "heuristic"])
def test_a_baked_choice_that_cannot_run_here_gives_way_as_an_eager_one_does(monkeypatch, mode):
    """A mode that does not measure bakes an ungated default; when it fails at its launch (cannot run here), the
    compiled call runs the next candidate instead of failing, and the next compile bakes that one."""
    a = FakeBackend("a", {"default": (1.0, 0.01)}, fail={"default"})
    b = FakeBackend("b", {"x=1": (0.5, 0.01)})
    timed_with_fakes(monkeypatch, a, b)
    torch._dynamo.reset()
    q, k, v = _qkv(24)
    with only_backends(a, b, REFERENCE), inductor_attn.tuning_mode(mode):
        compiled = torch.compile(_attn, fullgraph=True)
        out, (code,) = run_and_get_code(compiled, q, k, v)
        assert "'forward|a:default|" in code and b.calls == 1
        torch.testing.assert_close(out, _attn(q, k, v))
        compiled(q, k, v)
        assert a.calls == 1  # later calls of the graph go straight to b: no failing launch, no warning, each time
        torch._dynamo.reset()
        assert "'forward|b:x=1|" in run_and_get_code(torch.compile(_attn, fullgraph=True), q, k, v)[1][0]
    torch._dynamo.reset()


@pytest.mark.parametrize("mode", ["off", "heuristic"])
def test_a_store_write_moves_no_guard_of_a_mode_that_reads_no_store(mode):
    from test_store import decision_row

    from inductor_attn.store.db import get_store

    with inductor_attn.tuning_mode(mode):
        before = DecisionPass().uuid()
        get_store().put(decision_row(1))
        assert DecisionPass().uuid() == before


@pytest.mark.parametrize("mode, moves", [("autotune", False), ("cache-only", True)])
def test_a_new_decision_moves_the_guard_only_where_compiles_bake_guesses(mode, moves):
    # autotune measures a problem it has no decision for; cache-only bakes a guess that a new decision overrides
    from test_store import decision_row

    from inductor_attn.store.db import get_store

    with inductor_attn.tuning_mode(mode):
        before = DecisionPass().uuid()
        get_store().put(decision_row(1))
        assert (DecisionPass().uuid() != before) == moves
        get_store().put(decision_row(1, winner="a:default"))  # another winner: an answer changed
        assert DecisionPass().uuid() != before


def test_without_the_pass_nothing_is_decided_while_compiling(fakes):
    q, k, v = _qkv(24)
    torch._dynamo.reset()
    # the pass is installed once per process, at its first trace: that must not be this one (under pytest-xdist
    # it may be), whose emptied slot would take the pass and leave it uninstalled for the process's later tests
    attention_ops._on_trace()
    # with the slot emptied the op decides at run time
    with torch._inductor.config.patch(post_grad_custom_post_pass=None):
        out, (code,) = run_and_get_code(torch.compile(_attn, fullgraph=True), q, k, v)
    assert "torch.ops.inductor_attn.attention.default(" in code and "b:x=1" not in code
    torch.testing.assert_close(out, _attn(q, k, v))


def test_the_pass_chains_a_pass_the_user_already_set_and_uninstall_restores_it():
    from inductor_attn._compat import custom_graph_pass_base

    seen = []

    class UserPass(custom_graph_pass_base()):
        def __call__(self, graph):
            seen.append(graph)

        def uuid(self):
            return "user-pass-v1"

    user = UserPass()
    with torch._inductor.config.patch(post_grad_custom_post_pass=user):
        lowering.install()
        installed = torch._inductor.config.post_grad_custom_post_pass
        assert isinstance(installed, DecisionPass) and installed.chained is user
        graph = torch.fx.Graph()
        graph.output(None)
        installed(graph)
        assert seen == [graph] and installed.uuid() is not None
        lowering.uninstall()
        assert torch._inductor.config.post_grad_custom_post_pass is user


def _meta_attention_tensor(heads: int, layout: str = "BLHD") -> torch.Tensor:
    """A bf16 (2, heads, 256, 64) meta tensor over (B, L, H, D) memory, or (B, H, L, D) memory for "BHLD"."""
    if layout == "BHLD":
        return torch.empty(2, heads, 256, 64, dtype=torch.bfloat16, device="meta")
    return torch.empty(2, 256, heads, 64, dtype=torch.bfloat16, device="meta").transpose(1, 2)


@pytest.mark.parametrize("direction", ["forward", "inference", "backward"])
def test_a_traced_sdpa_plan_keeps_views_and_copies_nothing(direction):
    # functionalizing views away made a copy kernel of the lse per call in compiled code (HF Llama, H100)
    from torch._subclasses.fake_tensor import FakeTensorMode

    from inductor_attn._compat import trace_functional
    from inductor_attn.backends import sdpa
    from inductor_attn.ops.attention import AttnCall

    with FakeTensorMode():  # meta tensors: the cuDNN ops' shape functions run on this CPU-only machine
        blhd = _meta_attention_tensor
        q, k, v, out, grad = blhd(8), blhd(2), blhd(2), blhd(8), blhd(8)
        lse = torch.empty(2, 8, 256, device="meta")

    def launch(q, k, v, out, lse, grad):
        call = AttnCall("attention", q, k, v, 0.125, True, -1, -1, None)
        if direction != "backward":
            return tuple(sdpa._launch("cudnn", False, False, call, with_lse=direction == "forward"))
        return tuple(sdpa._launch_backward("cudnn", False, False, call, out, lse, grad, None))

    graph = trace_functional(launch, [q, k, v, out, lse, grad]).graph
    targets = {str(n.target) for n in graph.nodes if n.op == "call_function"}
    assert not {t for t in targets if "clone" in t or "copy" in t}, targets
    if direction == "inference":  # cuDNN computes no lse, as in stock compiled SDPA's inference graph
        (cudnn,) = [n for n in graph.nodes if n.target == torch.ops.aten._scaled_dot_product_cudnn_attention.default]
        assert cudnn.args[4] is False and len(graph.output_node().args[0]) == 1


def _traced_sdpa_backward_args(kernel: str, layouts: dict) -> list:
    """The arguments of the aten backward op that a traced SDPA ``kernel`` backward plan calls, its q, k, v, out
    and grad_out being bf16 meta tensors of the given layouts ("BLHD" or "BHLD"; GQA: 8 query, 2 kv heads)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from inductor_attn._compat import trace_functional
    from inductor_attn.backends import sdpa
    from inductor_attn.ops.attention import AttnCall

    with FakeTensorMode():  # meta tensors: the ops' shape functions run on this CPU-only machine
        heads = {"q": 8, "k": 2, "v": 2, "out": 8, "grad_out": 8}
        q, k, v, out, grad = (_meta_attention_tensor(heads[name], layouts[name]) for name in heads)
        lse = torch.empty(2, 8, 256, device="meta")

    def launch(q, k, v, out, lse, grad):
        call = AttnCall("attention", q, k, v, 0.125, True, -1, -1, None)
        return tuple(sdpa._launch_backward(kernel, False, False, call, out, lse, grad, None))

    graph = trace_functional(launch, [q, k, v, out, lse, grad]).graph
    (bwd,) = [n for n in graph.nodes if f"{kernel}_attention_backward" in str(n.target)]
    return [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in bwd.args]


@pytest.mark.parametrize("out_layout", ["BLHD", "BHLD"])
def test_the_efficient_backward_gets_out_in_the_layout_its_kernel_assumes(out_layout):
    # its kernel reads out's rows at a stride of H * D whatever out's strides say (kernel_backward.h, o_strideM)
    layouts = {"q": "BLHD", "k": "BLHD", "v": "BLHD", "out": out_layout, "grad_out": "BLHD"}
    given = _traced_sdpa_backward_args("efficient", layouts)[5]
    assert given.shape == (2, 8, 256, 64) and given.stride(3) == 1 and given.stride(2) == 8 * 64


@pytest.mark.parametrize("q_layout, other_layout", [("BHLD", "BLHD"), ("BLHD", "BHLD"), ("BHLD", "BHLD")])
def test_the_cudnn_backward_gets_out_and_grad_out_in_qs_layout(q_layout, other_layout):
    # out or grad_out laid out unlike q gave a wrong dq (tests/test_sdpa_gpu.py, torch 2.11, H100)
    from inductor_attn.layout import stride_order

    layouts = {"q": q_layout, "k": q_layout, "v": q_layout, "out": other_layout, "grad_out": other_layout}
    args = _traced_sdpa_backward_args("cudnn", layouts)
    want = stride_order(args[1])
    assert stride_order(args[0]) == want and stride_order(args[4]) == want


@pytest.mark.parametrize("scale", [0.125, 0.3])
def test_a_traced_sdpa_call_names_the_scale_only_where_it_is_not_the_ops_default(scale):
    # a keyword argument costs every compiled call host time in the aten op's argument parsing; stock passes none
    from torch._subclasses.fake_tensor import FakeTensorMode

    from inductor_attn._compat import trace_functional
    from inductor_attn.backends import sdpa
    from inductor_attn.ops.attention import AttnCall

    with FakeTensorMode():
        q, k, v = (torch.empty(2, 8, 256, 64, dtype=torch.bfloat16, device="meta") for _ in range(3))

    def launch(q, k, v):
        return tuple(sdpa._launch("cudnn", False, False, AttnCall("attention", q, k, v, scale, True, -1, -1, None)))

    (cudnn,) = [n for n in trace_functional(launch, [q, k, v]).graph.nodes if "cudnn" in str(n.target)]
    assert cudnn.kwargs == ({} if scale == 64 ** -0.5 else {"scale": scale})



def _call_bodies(codes: list[str]) -> list[list[str]]:
    """Each generated module's ``call`` without comments, its kernels' names reduced to their index."""
    import re

    bodies = []
    for code in codes:
        body = code[code.index("    def call(self, args):"):code.index("\nrunner = Runner(")]
        lines = [re.sub(r"cpp_fused_\w*?_(\d+)\(", r"cpp_fused_\1(", x) for x in body.splitlines()]
        bodies.append([x for x in lines if x.strip() and not x.strip().startswith("#")])
    return bodies


@pytest.mark.parametrize("training", [False, True])
def test_compiled_code_of_ours_is_stocks_when_the_plan_calls_the_kernels_stock_calls(training):
    # A plan tracing the aten kernels that stock compiled SDPA calls here: our forward and backward graphs must be
    # stock's, line for line (no copy, no saved tensor, no op of ours, no keyword more), so that what a compiled
    # call of ours costs beyond stock's is Dynamo's guards on the arguments' checks alone.
    import torch.nn.functional as F

    q, k, v, grad = (torch.randn(1, 64, 4, 32).transpose(1, 2) for _ in range(4))
    inputs = [x.requires_grad_(training) for x in (q, k, v)]

    def step(fn):
        compiled = torch.compile(fn, fullgraph=True)
        if training:
            return lambda: torch.autograd.grad(compiled(*inputs), inputs, grad)
        return lambda: compiled(*inputs)

    codes = {}
    with only_backends(AtenCpuFlash(), REFERENCE), inductor_attn.tuning_mode("off"):
        for name, fn in (("stock", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
                         ("ours", lambda q, k, v: inductor_attn.attention(q, k, v, causal=True))):
            codes[name] = run_and_get_code(step(fn))[1]  # resets Dynamo first
    assert len(codes["ours"]) == (2 if training else 1)
    assert _call_bodies(codes["ours"]) == _call_bodies(codes["stock"])


def test_another_version_of_a_backend_library_moves_the_guard(monkeypatch):
    """Decisions are keyed on the backends' library versions: a graph compiled under FA4 x must not be
    replayed under FA4 y, whose decisions are new rows that leave the store's revision as it was."""
    from inductor_attn.store import keys

    before = DecisionPass().uuid()
    monkeypatch.setattr(keys, "library_versions", lambda requires: {"torch": "9.9.9", "flash-attn-4": "9.9.9"})
    assert DecisionPass().uuid() != before


def test_the_warm_launch_of_a_backward_plan_gets_an_out_as_wide_as_v():
    from inductor_attn.backends import AttnCall
    from inductor_attn.lowering import emit

    seen = []

    class Plan:
        def launch(self, call, out, lse, grad_out, grad_lse):
            seen.append((out.shape, lse.shape, grad_out.shape))

    q, k, v = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 32)
    emit._warm(Plan(), AttnCall("attention", q, k, v, 0.25), "backward")
    assert seen == [((1, 2, 8, 32), (1, 2, 8), (1, 2, 8, 32))]


def _decode_inputs(lengths):
    q = torch.randn(2, 4, 1, 16)
    k, v = torch.randn(2, 2, 24, 16), torch.randn(2, 2, 24, 16)
    return q, k, v, torch.tensor(lengths, dtype=torch.int32)


def _checking_fakes(monkeypatch):
    a = FakeBackend("a", {"default": (1.0, 0.01)}, traceable=True)
    b = FakeBackend("b", {"x=1": (0.5, 0.01)}, traceable=True, checks_indices=True)
    timed_with_fakes(monkeypatch, a, b)
    return only_backends(a, b, REFERENCE)


def test_a_plan_whose_kernel_checks_kv_seqlens_replaces_the_graphs_assert(monkeypatch):
    """The API's compiled kv_seqlens check is a device assert of its own (one more kernel per call); where the
    chosen plan's kernel makes the check itself (split-K decode), only the kernel's check is left."""
    torch._dynamo.reset()
    with _checking_fakes(monkeypatch), inductor_attn.tuning_mode("autotune"):
        for check_indices in (True, False):
            fn = torch.compile(lambda q, k, v, n: inductor_attn.attention(q, k, v, kv_seqlens=n,
                                                                          check_indices=check_indices),
                               fullgraph=True)
            q, k, v, lengths = _decode_inputs([5, 24])
            out, (code,) = run_and_get_code(fn, q, k, v, lengths)
            torch.testing.assert_close(out, inductor_attn.attention(q, k, v, kv_seqlens=lengths))
            assert KV_SEQLENS_VALUES not in code
            assert (FAKE_KERNEL_CHECK in code) == check_indices
        with pytest.raises(RuntimeError, match=FAKE_KERNEL_CHECK):
            torch.compile(lambda q, k, v, n: inductor_attn.attention(q, k, v, kv_seqlens=n),
                          fullgraph=True)(*_decode_inputs([5, 25]))
    torch._dynamo.reset()


def test_the_graphs_kv_seqlens_assert_stays_while_one_reader_of_those_lengths_does_not_check_them(monkeypatch):
    op = torch.ops.inductor_attn.attention

    def two_calls(q, k, v, n):  # b (checks in its kernel) is decided; a (does not) is named as the choice
        checked = inductor_attn.attention(q, k, v, kv_seqlens=n)
        named = op(q, k, v, 0.25, False, -1, -1, n, None, "a:default")[0]
        return checked + named

    torch._dynamo.reset()
    with _checking_fakes(monkeypatch), inductor_attn.tuning_mode("autotune"):
        _, (code,) = run_and_get_code(torch.compile(two_calls, fullgraph=True), *_decode_inputs([5, 24]))
        assert KV_SEQLENS_VALUES in code and FAKE_KERNEL_CHECK in code
        with pytest.raises(RuntimeError, match=re.escape(KV_SEQLENS_VALUES)):
            torch.compile(two_calls, fullgraph=True)(*_decode_inputs([5, -1]))
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def copies_of_traced_triton_plans():
    """tests/traced_copies.py's report, run in a process of its own: torch's analysis reads a kernel's TTIR,
    which the interpreter these tests run Triton in (TRITON_INTERPRET=1) does not make."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # a script's path starts at tests/
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "traced_copies.py")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kernels", ["triton backward", "triton backward, kv_seqlens", "triton forward",
                                     "triton_decode forward, kv_seqlens", "triton_decode paged forward",
                                     "triton_decode paged forward, cu_seqlens_q"])
def test_traced_triton_plans_write_only_their_own_buffers_so_compiled_code_copies_nothing(
        kernels, copies_of_traced_triton_plans):
    """torch's analysis of what a user kernel writes decides which of its tensors compiled code copies before
    the launch (``tensors_to_clone``, where Inductor cannot reuse the buffer in place): a kernel that seems to
    write an input, or one tensor passed as two arguments, costs a copy kernel per launch (four per layer of
    an HF Llama training step, H200, 2026-11-28). Inductor's in-place pass must leave nothing to copy, and no
    input may read as written: a pointer handed to a Triton helper whose results address a store counts as written
    (cu_seqlens_q, read by a helper of the split-K kernels, once did)."""
    assert copies_of_traced_triton_plans[kernels] == {}


@pytest.fixture
def dear_launch(monkeypatch):
    """``a``: a traced plan whose kernel is slower; ``b``: a faster kernel behind a dear Python launch (FA4's
    shape: ~14 us of kernel for ~80 us of launch at B1 L512, H200)."""
    a = FakeBackend("a", {"default": (60.0, 0.01)}, traceable=True, host_s=0.001)
    b = FakeBackend("b", {"default": (50.0, 0.01)}, host_s=0.02)
    timed_with_fakes(monkeypatch, a, b)
    torch._dynamo.reset()
    inductor_attn.reset_stats()
    with only_backends(a, b), inductor_attn.tuning_mode("autotune"):
        yield
    torch._dynamo.reset()


@pytest.mark.parametrize("graph, runs", [
    ("host-bound", "attention/forward -> a:default (launched by compiled code, per graph)"),
    ("device-bound", "attention/forward -> b:default"),
    ("cuda graphs", "attention/forward -> b:default"),
])
def test_compiled_code_runs_the_candidate_that_makes_its_graph_fastest(dear_launch, monkeypatch, graph, runs):
    from inductor_attn.lowering import emit
    from inductor_attn.tuning.step_cost import GraphWork

    seen = []
    work = {"host-bound": GraphWork(host_ms=200.0, device_ms=0.0),
            "device-bound": GraphWork(host_ms=0.0, device_ms=500.0)}.get(graph)
    monkeypatch.setattr(emit, "graph_work", lambda g, calls, dev, training: seen.append(training) or work)
    monkeypatch.setattr(emit, "cudagraphs_enabled", lambda: graph == "cuda graphs")
    q, k, v = _qkv(24)
    out = torch.compile(_attn, fullgraph=True)(q, k, v)
    torch.testing.assert_close(out, _attn(q, k, v))
    assert runs in inductor_attn.stats()
    assert seen == ([] if graph == "cuda graphs" else [False])  # estimated once, as an inference graph


def test_stats_say_what_compiled_code_runs_also_when_the_fx_graph_cache_replays_it(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    a, b = _fakes(monkeypatch, traceable=True)
    counters = torch._dynamo.utils.counters
    q, k, v = _qkv(24)
    torch._dynamo.reset()
    with only_backends(a, b, REFERENCE), inductor_attn.tuning_mode("autotune"), \
            torch._inductor.config.patch(fx_graph_cache=True, force_disable_caches=False):
        torch.compile(_attn, fullgraph=True)(q, k, v)
        torch._dynamo.reset()
        inductor_attn.reset_stats()
        counters["inductor"]["fxgraph_cache_hit"] = 0
        torch.compile(_attn, fullgraph=True)(q, k, v)
        assert counters["inductor"]["fxgraph_cache_hit"] == 1
        assert inductor_attn.stats() == {"attention/forward -> b:x=1 (launched by compiled code, per graph)": 1}
    torch._dynamo.reset()


def test_a_traced_form_that_cannot_be_traced_runs_through_the_launch_op_and_raises_in_strict_mode(monkeypatch):
    """A traced form that fails to trace is a bug of ours: the test suite's strict mode raises it; a user's
    compile instead runs the plan's launch through the launch op, with the same outputs."""
    a, b = _fakes(monkeypatch, traceable=True)
    make_plan = b.plan

    def plan(p, dev, cfg, direction):
        made = make_plan(p, dev, cfg, direction)

        def untraceable(call, *rest):
            raise RuntimeError("cannot trace this")
        return dataclasses.replace(made, traced=untraceable, traced_out_only=None)

    monkeypatch.setattr(b, "plan", plan)
    q, k, v = _qkv(24)
    for strict_mode in ("1", "0"):
        monkeypatch.setenv("INDUCTOR_ATTN_STRICT", strict_mode)
        torch._dynamo.reset()
        with only_backends(a, b, REFERENCE), inductor_attn.tuning_mode("autotune"):
            compiled = torch.compile(_attn, fullgraph=True)
            if strict_mode == "1":
                with pytest.raises(Exception, match="cannot trace this"):
                    compiled(q, k, v)
                continue
            out, (code,) = run_and_get_code(compiled, q, k, v)
            assert "torch.ops.inductor_attn.launch.default(" in code and "'forward|b:x=1|" in code
            torch.testing.assert_close(out, _attn(q, k, v))
    torch._dynamo.reset()


def test_the_ops_the_lowering_decides_while_compiling_are_the_ones_the_tuner_probes_as_such():
    from inductor_attn.lowering import emit
    from inductor_attn.problem import DECIDED_AT_COMPILE_TIME

    assert {op for op, _ in emit._COMPILE_TIME.values()} == set(DECIDED_AT_COMPILE_TIME)
    assert not {op for op, _ in emit._RUN_TIME.values()} & set(DECIDED_AT_COMPILE_TIME)


def test_calls_without_measured_launches_count_in_the_rest_of_the_graph(monkeypatch):
    """choose_for_graph adds back the launches of buckets whose record holds host times; a bucket without them
    (a record from before host times, a named choice) was left out of the graph's host and device time
    altogether, as if its calls cost nothing."""
    from inductor_attn.lowering import emit

    a = FakeBackend("a", {"default": (0.12, 0.0)}, traceable=True)
    b = FakeBackend("b", {"default": (0.02, 0.0)})
    unmeasured = {"timer": "cuda-graph", "candidates": [{"name": "a:default", "status": "passed", "median_ms": 0.12,
                                                          "host_ms": None}]}
    measured = {"timer": "cuda-graph", "candidates": [
        {"name": "b:default", "status": "passed", "median_ms": 0.02, "host_ms": 0.045, "traced": False},
        {"name": "a:default", "status": "passed", "median_ms": 0.045, "host_ms": 0.02, "traced": True}]}
    monkeypatch.setattr(emit, "_decide", lambda call, direction, grad_lse: ("a:default", unmeasured)
                        if call.q.shape[2] == 8 else ("b:default", measured))
    monkeypatch.setattr(emit, "cudagraphs_enabled", lambda: False)
    skipped = []
    real = emit.graph_work
    monkeypatch.setattr(emit, "graph_work", lambda graph, skip, dev, training: skipped.append(len(skip)) or
                        real(graph, skip, dev, training))
    torch._dynamo.reset()
    with only_backends(a, b, REFERENCE), inductor_attn.tuning_mode("autotune"):
        torch.compile(lambda x, y: (inductor_attn.attention(x, x, x), inductor_attn.attention(y, y, y)),
                      fullgraph=True)(torch.randn(1, 2, 8, 16), torch.randn(1, 2, 24, 16))
    torch._dynamo.reset()
    assert skipped == [1]  # the measured bucket's call; the other counts as any node of the graph


@pytest.mark.parametrize("grad", [False, True])
def test_a_graph_is_costed_as_a_training_steps_only_when_aotautograd_compiles_one(fakes, monkeypatch, grad):
    """An inference graph that returns the lse (cascade or ring attention merge it) was costed as a training
    step's, whose wrappers add 0.41 ms of host: the cheap launch of a 20% slower kernel won there."""
    from inductor_attn.lowering import emit

    seen = []
    real = emit.graph_work
    monkeypatch.setattr(emit, "graph_work", lambda graph, skip, dev, training: seen.append(training) or
                        real(graph, skip, dev, training))
    monkeypatch.setattr(emit, "cudagraphs_enabled", lambda: False)
    q, k, v = _qkv(24, requires_grad=grad)
    with torch.set_grad_enabled(grad):
        torch.compile(lambda q, k, v: inductor_attn.attention(q, k, v, return_lse=True), fullgraph=True)(q, k, v)
    assert seen and set(seen) == {grad}
