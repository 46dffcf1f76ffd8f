"""Every private PyTorch API we rely on still exists where _compat.py looks for it. If this fails after a
torch upgrade, fix _compat.py (one place), not the callers."""

import inspect

import pytest
import torch

from inductor_attn import _compat


def test_custom_graph_pass_has_uuid_and_config_slot_exists():
    base = _compat.custom_graph_pass_base()
    assert hasattr(base, "uuid") and callable(base.__call__)
    assert hasattr(_compat.inductor_config(), "post_grad_custom_post_pass")


def test_inductor_cache_dir_is_a_path():
    assert isinstance(_compat.inductor_cache_dir(), str)


def test_fused_sdp_choice_accepts_our_arguments():
    q = torch.randn(1, 2, 4, 16)
    assert isinstance(_compat.fused_sdp_choice(q, q, q, is_causal=False, enable_gqa=False), int)


def test_sdpa_aten_ops_keep_the_schemas_the_sdpa_backend_calls():
    aten = torch.ops.aten
    assert "compute_log_sumexp" in str(aten._scaled_dot_product_efficient_attention.default._schema)
    assert "compute_log_sumexp" in str(aten._scaled_dot_product_cudnn_attention.default._schema)
    assert "Tensor logsumexp" in str(aten._scaled_dot_product_flash_attention.default._schema)


def test_flex_block_mask_still_has_the_fields_we_read():
    from torch.nn.attention.flex_attention import BlockMask

    params = inspect.signature(BlockMask.__init__).parameters
    for name in ("seq_lengths", "kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                 "BLOCK_SIZE", "mask_mod"):
        assert name in params


def test_flex_lse_scaling_probe_reads_the_installed_flex_source():
    """torch 2.13 (CI) knows FLASH's lse is natural-log based; the probe must say so here. On torch 2.11
    (the device machine) it says the opposite, checked there by tests/test_flex.py's FLASH lse tests."""
    expected = _compat.TORCH_VERSION < (2, 13)
    assert _compat.flex_flash_lse_scaled_by_ln2() is expected


def test_dynamo_unsupported_takes_a_message_and_a_graph_break_type():
    error = _compat.dynamo_unsupported()("q heads must be ...", gb_type="inductor_attn: ValueError")
    assert str(error) == "q heads must be ..." and isinstance(error, RuntimeError)


def test_dynamo_tracing_is_true_inside_a_fake_impl_while_compiling_only():
    seen = []

    @torch.library.custom_op("inductor_attn_test::probe", mutates_args=())
    def probe(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @probe.register_fake
    def _(x):
        seen.append(_compat.dynamo_tracing())
        return torch.empty_like(x)

    torch.compile(probe, fullgraph=True)(torch.ones(2))
    assert seen and seen[0] and not _compat.dynamo_tracing()


def test_assert_async_is_traced_and_raises_when_compiled_cpu_code_runs():
    fn = torch.compile(lambda x: (_compat.assert_async((x > 0).all(), "x must be positive"), x + 1)[1],
                       fullgraph=True)
    assert fn(torch.ones(2)).tolist() == [2.0, 2.0]
    with pytest.raises(RuntimeError, match="x must be positive"):
        fn(-torch.ones(2))


def test_mark_constant_result_sets_what_assume_constant_result_sets():
    def f():
        return 1

    def g():
        return 1

    marked = torch.compiler.assume_constant_result(f)
    assert set(vars(marked)) == set(vars(_compat.mark_constant_result(g))) == {"_dynamo_marked_constant"}


def test_flex_forward_config_heuristic_is_where_we_read_it():
    from torch._inductor.template_heuristics.triton import CUDAConfigHeuristic, FlexConfig

    assert list(inspect.signature(CUDAConfigHeuristic.get_flex_attn_fwd_configs).parameters) == \
        ["self", "head_dim", "dtype"]
    assert {"block_m", "block_n"} <= set(inspect.signature(FlexConfig).parameters)
    if torch.cuda.is_available():
        assert all(m > 0 and n > 0 for m, n in _compat.flex_default_fwd_tiles(64, torch.bfloat16))


def test_fake_copies_keep_layout_and_trace_with_real_tensors_as_constants():
    base = torch.zeros(4, 6)
    view, bias = base[:, 1:4], torch.ones(3)
    (fake,) = _compat.fake_copies([view])
    assert _compat.is_fake(fake) and fake.shape == view.shape and fake.stride() == view.stride()
    graph = _compat.trace_functional(lambda x: (x + bias,), [fake])
    torch.testing.assert_close(graph(view)[0], view + bias)


def test_the_allocator_call_that_ends_a_failed_capture_exists():
    """``_compat.end_failed_capture`` calls it (CPU builds hold a stand-in under the same name)."""
    import torch.cuda.memory  # noqa: F401  (defines the CPU stand-ins)

    assert callable(torch._C._cuda_endAllocateToPool) and callable(torch.cuda.graph_pool_handle)
    assert "pool" in inspect.signature(torch.cuda.graph).parameters


def test_is_fake_sees_fake_tensors_and_not_real_ones():
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert not _compat.is_fake(torch.zeros(2))
    with FakeTensorMode() as mode:
        assert _compat.is_fake(mode.from_tensor(torch.zeros(2, dtype=torch.bool)).to(torch.uint8))


def test_static_launch_of_user_triton_kernels_is_the_setting_inductor_reads(monkeypatch):
    """The config exists, a new process (a compile worker) reads it from the variable we set, and
    Inductor's launcher choice still reads the config."""
    import os
    import subprocess
    import sys

    import torch._inductor.config as config
    from torch._inductor.runtime import triton_heuristics

    worker = subprocess.run([sys.executable, "-c", "import torch._inductor.config as c; "
                             "print(c.static_launch_user_defined_triton_kernels)"],
                            env={**os.environ, _compat.STATIC_LAUNCH_ENV: "1"}, capture_output=True, text=True)
    assert worker.stdout.strip() == "True", worker.stderr[-500:]
    assert "static_launch_user_defined_triton_kernels" in inspect.getsource(triton_heuristics.StaticTritonCompileResult.can_statically_launch)
    monkeypatch.delenv(_compat.STATIC_LAUNCH_ENV, raising=False)
    with config.patch(static_launch_user_defined_triton_kernels=False):
        _compat.launch_user_triton_kernels_statically()
        assert config.static_launch_user_defined_triton_kernels is True
    assert os.environ[_compat.STATIC_LAUNCH_ENV] == "1"


def test_static_launch_restarts_compile_workers_started_without_it(monkeypatch):
    """A compile worker started before the setting never sees it: after the call, Inductor's pool is a new
    one whose workers read the variable."""
    import functools
    import os
    import time

    import torch._inductor.config as config
    from torch._inductor import async_compile

    assert callable(async_compile.after_fork) and hasattr(async_compile, "_pool_set")  # what we call
    if async_compile.get_compile_threads() <= 1:
        pytest.skip("Inductor compiles in this process here: no workers to restart")
    read_in_worker = functools.partial(os.getenv, _compat.STATIC_LAUNCH_ENV)
    monkeypatch.delenv(_compat.STATIC_LAUNCH_ENV, raising=False)
    try:
        with config.patch(static_launch_user_defined_triton_kernels=False):
            pool = async_compile.AsyncCompile.process_pool()
            assert pool.submit(read_in_worker).result(timeout=300) is None
            started = time.perf_counter()
            _compat.launch_user_triton_kernels_statically()
            assert time.perf_counter() - started < 1.0  # the old pool exits in a thread
            assert pool not in async_compile._pool_set
            assert async_compile.AsyncCompile.process_pool().submit(read_in_worker).result(timeout=300) == "1"
            deadline = time.monotonic() + 300
            while pool.process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            assert pool.process.poll() is not None  # and the old pool did exit
    finally:
        async_compile.shutdown_compile_workers()


def test_static_launch_leaves_a_value_the_user_set(monkeypatch):
    import torch._inductor.config as config

    monkeypatch.setenv(_compat.STATIC_LAUNCH_ENV, "0")
    with config.patch(static_launch_user_defined_triton_kernels=False):
        _compat.launch_user_triton_kernels_statically()
        assert config.static_launch_user_defined_triton_kernels is False


def test_eager_mode_turns_off_the_python_dispatcher_and_fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    def python_dispatcher():
        return torch._C._dispatch_tls_is_dispatch_key_included(torch._C.DispatchKey.PythonDispatcher)

    with FakeTensorMode(), torch._C._EnablePythonDispatcher():
        assert python_dispatcher()
        with _compat.eager_mode():
            assert not python_dispatcher() and not _compat.is_fake(torch.zeros(2))
        assert python_dispatcher()


def test_mark_static_address_marks_the_tensor_for_dynamo():
    x = torch.zeros(2)
    _compat.mark_static_address(x)
    assert getattr(x, "_dynamo_static_input_type", None) == "unguarded"


def test_reduce_overhead_patches_the_cudagraphs_setting_the_lowering_reads():
    with _compat.inductor_config().patch(_compat.inductor_compile_patches("reduce-overhead", None)):
        assert _compat.cudagraphs_enabled()
    assert not _compat.cudagraphs_enabled()


def test_inductors_counters_are_saved_with_a_cached_graph_and_added_again_on_a_hit():
    """The per-graph counts of compiled plans live in these counters because a cache hit replays their deltas."""
    from torch._inductor import codecache, compile_fx

    assert _compat.inductor_counters() is torch._dynamo.utils.counters["inductor"]
    assert 'counters["inductor"] += graph.counter_deltas' in inspect.getsource(codecache.FxGraphCache)
    assert 'counters["inductor"] - inductor_counters' in inspect.getsource(compile_fx)


def test_the_raw_stream_getter_is_in_every_cuda_build():
    """Inductor's generated code reads the current stream through it; the replay's kept scratch is keyed on it."""
    assert hasattr(torch._C, "_cuda_getCurrentRawStream") == (torch.version.cuda is not None)


def test_op_types_are_what_fx_targets_of_aten_and_higher_order_ops_are():
    overload, packet, higher_order = _compat.op_types()
    assert isinstance(torch.ops.aten.add.default, overload) and isinstance(torch.ops.aten.add, packet)
    assert isinstance(torch.ops.higher_order.cond, higher_order)
    assert torch.Tag.nondeterministic_seeded in torch.ops.aten.bernoulli.default.tags  # what routing reads


def test_the_inference_aware_pass_base_is_what_post_grad_passes_is_inference_to():
    # without it the lowering costs a graph that reads the lse as a training step's (emit.py's fallback)
    import torch._inductor.fx_passes.post_grad as post_grad

    base = _compat.inference_aware_pass_base()
    assert base.__name__ == "CustomInferenceAwareGraphPass"
    assert "is_inference=is_inference" in inspect.getsource(post_grad.post_grad_passes)


def test_wrapper_subclasses_and_functorch_wrapped_tensors_are_told_from_plain_and_fake_ones():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.two_tensor import TwoTensor

    plain = [torch.zeros(2)]
    with FakeTensorMode():
        plain.append(torch.zeros(2))
    assert not any(_compat.wrapper_subclass(t) or _compat.functorch_wrapped(t) for t in plain)
    assert _compat.wrapper_subclass(TwoTensor(torch.zeros(2), torch.zeros(2)))
    seen = []
    torch.func.vmap(lambda x: seen.append(_compat.functorch_wrapped(x)) or x)(torch.zeros(3, 2))
    assert seen == [True]


def test_guard_or_false_decides_what_it_can_and_says_false_where_it_cannot():
    assert _compat.guard_or_false(True) and not _compat.guard_or_false(False)
    seen = []

    def f(x, n):
        m = n.max().item()
        seen.append(_compat.guard_or_false(m < 1))  # a size with no value while tracing
        return x * m

    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        torch.compile(f, fullgraph=True)(torch.ones(2), torch.tensor([2, 3]))
    assert seen == [False]


def test_traced_argument_uses_says_which_arguments_a_function_reads_and_none_where_it_cannot_trace():
    ids = torch.tensor([0, 1, 1])
    args = tuple(torch.zeros(1, dtype=torch.int32) for _ in range(3))
    assert _compat.traced_argument_uses(torch.vmap(lambda a, b, c: ids[a] == ids[c]), args) == [True, False, True]
    assert _compat.traced_argument_uses(lambda a, b, c: a if bool(b.sum() > 0) else c, args) is None
    # flex's noop_mask makes its result from the batch index's size alone: no read of its value
    from torch.nn.attention.flex_attention import noop_mask

    index = tuple(torch.zeros(1, dtype=torch.int32) for _ in range(4))
    assert _compat.traced_argument_uses(torch.vmap(noop_mask), index) == [False] * 4


def test_contiguous_strides_are_what_empty_lays_out():
    for shape in ((2, 4, 8, 16), (1, 4, 1, 16), (3,), ()):
        assert _compat.contiguous_strides(shape) == torch.empty(shape).stride()


def test_storage_holders_counts_the_tensors_that_see_a_memory_block():
    t = torch.zeros(8)
    assert _compat.storage_holders(t) == 1
    view = t[2:]
    assert _compat.storage_holders(t) == _compat.storage_holders(view) == 2
    del view
    assert _compat.storage_holders(t) == 1


def test_dual_tensors_of_forward_mode_ad_are_told_from_plain_ones():
    import torch.autograd.forward_ad as fwAD

    x = torch.zeros(3)
    assert not _compat.has_tangent(x)
    with fwAD.dual_level():
        assert _compat.has_tangent(fwAD.make_dual(x, torch.ones(3))) and not _compat.has_tangent(x)
    seen = []
    torch.func.jvp(lambda y: seen.append(_compat.has_tangent(y)) or y, (x,), (x,))
    assert seen == [True]


def test_dynamos_compile_lock_is_a_reentrant_lock_held_while_compiling():
    """decisions._measuring takes it before its own lock, as a compiling thread holds it when it asks for ours."""
    import threading

    lock = _compat.dynamo_compile_lock()
    assert type(lock) is type(threading.RLock())
    held = []

    def backend(gm, inputs):
        held.append(lock._is_owned())
        return gm.forward

    torch.compile(lambda x: x + 1, backend=backend)(torch.zeros(1))
    assert held == [True]


def test_a_compiled_sdpa_kernel_block_is_recorded_as_the_calls_the_rewrite_reads():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    setter, from_string = _compat.sdpa_kernel_nodes()
    graphs = []

    def fn(q):
        with sdpa_kernel([SDPBackend.MATH]):
            return torch.nn.functional.scaled_dot_product_attention(q, q, q)

    torch.compile(fn, backend=lambda gm, inputs: graphs.append(gm) or gm.forward)(torch.randn(1, 1, 4, 8))
    first = next(n for n in graphs[0].graph.nodes if n.target is setter)
    assert [b.target for b in first.args[0]] == [from_string] and first.args[0][0].args == ("MATH",)
