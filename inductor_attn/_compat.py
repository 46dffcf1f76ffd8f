"""Every private PyTorch API this package touches, imported in one place with version guards.

tests/test_compat.py imports each name on the installed torch and fails loudly when one moves.
"""

from __future__ import annotations

import contextlib
import functools

import torch

TORCH_VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])


def inductor_cache_dir() -> str:
    """Inductor's cache dir (torch/_inductor/runtime/cache_dir_utils.py, 2.11 and 2.13)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


def custom_graph_pass_base():
    """``CustomGraphPass`` (torch/_inductor/custom_graph_pass.py): passes whose ``uuid()`` enters the FX
    graph cache key."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    return CustomGraphPass


def inference_aware_pass_base():
    """``CustomInferenceAwareGraphPass`` (torch/_inductor/custom_graph_pass.py, 2.13): a custom pass of this kind
    is called with ``is_inference`` (torch/_inductor/fx_passes/post_grad.py), whether AOTAutograd compiles an
    inference graph or one of a training step; the plain base where torch has none."""
    import torch._inductor.custom_graph_pass as passes

    return getattr(passes, "CustomInferenceAwareGraphPass", passes.CustomGraphPass)


def inductor_config():
    """``torch._inductor.config`` (the module whose attributes are Inductor's settings)."""
    import torch._inductor.config as config

    return config


STATIC_LAUNCH_ENV = "TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS"


def launch_user_triton_kernels_statically() -> None:
    """Have Inductor launch user-defined Triton kernels (ours, traced through ``wrap_triton``) with its own
    static launcher, as it does its generated kernels, instead of Triton's Python launcher: config
    ``static_launch_user_defined_triton_kernels`` (torch/_inductor/config.py, 2.11 and 2.13, default False).
    Inductor decides per kernel while compiling it, in its compile worker processes
    (runtime/triton_heuristics.py ``can_statically_launch``), which read this setting from the environment
    variable (``env_name_force``), so the variable is set too: workers started from now on see it. A
    kernel Inductor can't launch statically keeps Triton's launcher, with a logged reason. A value the user
    set for the variable is left alone (it overrides the config anyway).

    Compile workers already running were started without the variable, and Inductor passes their tasks
    only ``use_static_triton_launcher`` (async_compile.py ``extra_config``): they would keep Triton's Python
    launcher for our kernels for the whole process. That happens whenever something was compiled first
    (stock ``torch.compile`` even starts the pool before compiling: torch/_dynamo/backends/inductor.py
    ``maybe_warm_pool``), so those pools are retired here: Inductor forgets them (``async_compile.after_fork``,
    what its ``shutdown_compile_workers`` does after the shutdown, 2.11 and 2.13), so the next compile starts
    new ones and compiles in this process until they are ready, and each is shut down in a thread. A pool's
    ``shutdown`` waits for its workers to exit, 6.5-8.6 s when they were still starting (H200 host,
    2026-11-29), which the compile that traced our op would otherwise wait."""
    import os
    import threading

    if os.environ.get(STATIC_LAUNCH_ENV) is not None:
        return
    os.environ[STATIC_LAUNCH_ENV] = "1"
    inductor_config().static_launch_user_defined_triton_kernels = True
    from torch._inductor import async_compile

    retired = list(async_compile._pool_set)
    if retired:
        async_compile.after_fork()
        threading.Thread(target=lambda: [pool.shutdown() for pool in retired], daemon=True,
                         name="inductor_attn: retire compile workers").start()


def fused_sdp_choice(q, k, v, *, is_causal: bool, enable_gqa: bool) -> int:
    """``torch._fused_sdp_choice``: the SDPBackend value F.scaled_dot_product_attention would use."""
    return torch._fused_sdp_choice(q, k, v, None, 0.0, is_causal, scale=None, enable_gqa=enable_gqa)


def statically_known_true(expr) -> bool:
    """True only if ``expr`` (a bool or SymBool) holds for every value of its symbols; never adds a guard
    (torch/fx/experimental/symbolic_shapes.py, 2.11 and 2.13)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true as known

    return known(expr)


def traced_argument_uses(fn, args: tuple) -> list[bool] | None:
    """Whether each positional argument of ``fn`` has a use that reads its values in its FX trace on ``args`` (make_fx
    on the real tensors, torch/fx/experimental/proxy_tensor, 2.11 and 2.13): an argument the function never reads,
    or reads the size of only (``new_ones``), has none.
    None where the function cannot be traced so (a value read back into Python, a call make_fx refuses)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    try:
        gm = make_fx(fn, tracing_mode="real")(*args)
    except Exception:  # noqa: BLE001 - any failure to trace means: not known
        return None
    return [any(_reads_value(user) for user in n.users) for n in gm.graph.nodes if n.op == "placeholder"]


# ops that read a tensor's sizes, dtype and device only (flex's ``noop_mask`` makes its result with ``new_ones``)
_SHAPE_ONLY = ("new_ones", "new_zeros", "new_full", "new_empty", "empty_like", "ones_like", "zeros_like", "full_like",
               "sym_size")


def _reads_value(node) -> bool:
    target = getattr(node.target, "__name__", str(node.target))
    return target.split(".")[0] not in _SHAPE_ONLY


def contiguous_strides(shape) -> tuple:
    """The strides of a contiguous tensor of ``shape`` (symbolic sizes too), as torch's own ``empty`` lays it out
    (torch/_prims_common, 2.11 and 2.13)."""
    from torch._prims_common import make_contiguous_strides_for

    return tuple(make_contiguous_strides_for(shape))


def guard_or_false(expr) -> bool:
    """``expr`` (a bool or SymBool) where it can be decided, guarding as ``bool()`` would; False where it cannot (a
    size read from a tensor with ``.item()`` under ``capture_scalar_outputs``): no data-dependent guard error
    (torch/fx/experimental/symbolic_shapes.py, 2.11 and 2.13)."""
    # an eager call's plain ints: no import, no call into torch (not while Dynamo traces: its isinstance of a
    # SymBool decides the expression, a guard on it)
    if not torch.compiler.is_compiling() and isinstance(expr, bool):
        return expr
    from torch.fx.experimental.symbolic_shapes import guard_or_false as decided

    return decided(expr)


def inductor_compile_patches(mode: str | None, options: dict | None) -> dict:
    """The Inductor config patches ``torch.compile(mode=..., options=...)`` applies, validated the same way
    (``torch._TorchCompileInductorWrapper``, torch/__init__.py, 2.11 and 2.13)."""
    return dict(torch._TorchCompileInductorWrapper(mode, options, None).config)


def compile_fx():
    """Inductor's entry point for a Dynamo graph (torch/_inductor/compile_fx.py, 2.11 and 2.13)."""
    from torch._inductor.compile_fx import compile_fx as inductor_compile_fx

    return inductor_compile_fx


def size_hint(size) -> int | None:
    """The concrete value a (possibly symbolic) size has in this compilation, or None when it has none
    (data-dependent). ``optimization_hint`` in 2.13, ``hint_int`` before (torch/fx/experimental/
    symbolic_shapes.py)."""
    if isinstance(size, int):
        return size
    from torch.fx.experimental import symbolic_shapes

    hint = getattr(symbolic_shapes, "optimization_hint", None) or symbolic_shapes.hint_int
    try:
        return int(hint(size))
    except RuntimeError:  # GuardOnDataDependentSymNode and friends: no hint
        return None


@functools.cache
def flex_flash_lse_scaled_by_ln2() -> bool:
    """Whether ``flex_attention`` multiplies the lse of its FLASH backend by ln 2 although FA4 returns it in
    natural log already. torch 2.13's ``_finalize_outputs`` takes ``stats_are_log2=BACKEND != "FLASH"``;
    torch 2.11 scales every backend's lse (measured on an H100: FLASH's lse off by exactly 1 - ln 2, 0.307).
    Read from the source of torch/nn/attention/flex_attention.py, since no version attribute says it; by
    version where the source is not shipped."""
    import inspect

    from torch.nn.attention import flex_attention as flex_module

    try:
        return "stats_are_log2" not in inspect.getsource(flex_module)
    except OSError:
        return TORCH_VERSION < (2, 13)


@contextlib.contextmanager
def eager_mode():
    """A context for running real kernels in the middle of a compile (tuning, warm launches): no FakeTensorMode
    (torch/_subclasses/fake_tensor.py ``unset_fake_temporarily``) and no Python dispatcher, which AOTAutograd
    enables while it compiles a forward graph (torch/_dispatch/python.py ``no_python_dispatcher``, 2.11 and
    2.13). Under it every aten call of a tune passes through Python: on the CI CPU an aten add took 2-3x its
    time, and the host times step 7 of tuner.py weighs read several times a lone launch's."""
    from torch._dispatch.python import no_python_dispatcher
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), no_python_dispatcher():
        yield


def mark_static_address(tensor: torch.Tensor) -> None:
    """Tell torch.compile that ``tensor`` keeps its address across calls, so a CUDA-graph replay reads it in
    place instead of copying it into the graph's buffers (torch/_dynamo/decorators.py ``mark_static_address``,
    2.11 and 2.13; HF transformers' StaticCache marks its KV cache with it)."""
    torch._dynamo.mark_static_address(tensor)


def fake_mode_of(values):
    """The FakeTensorMode that made these fake tensors (torch/_guards.py ``detect_fake_mode``)."""
    from torch._guards import detect_fake_mode

    return detect_fake_mode(values)


def fake_copies(tensors):
    """Fake tensors with the sizes, strides, dtypes and devices of ``tensors``, in a new FakeTensorMode that takes
    the real tensors a traced function meets besides them as constants (torch/_subclasses/fake_tensor.py
    ``FakeTensorMode(allow_non_fake_inputs=True)``, ``from_tensor``; 2.11 and 2.13)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    return [mode.from_tensor(t) for t in tensors]


def trace_functional(fn, args):
    """``fn`` traced on ``args`` (fake, or real ones: then it runs) into a functional FX graph, with Inductor's
    decompositions (the way Inductor's pattern matcher traces replacements: torch/_inductor/pattern_matcher.py
    ``fwd_only``).
    ``torch.library.wrap_triton`` launches become ``triton_kernel_wrapper_functional`` nodes. Views stay
    views, as in ``fwd_only``'s graphs: functionalized away, each became a copy kernel in the compiled
    code (the lse of SDPA's plans, once in the forward and once in the backward of every call).
    ``make_fx`` (torch/fx/experimental/proxy_tensor.py) and ``select_decomp_table``
    (torch/_inductor/decomposition.py), 2.11 and 2.13."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    functional = torch.func.functionalize(fn, remove="mutations")
    # fakes are traced in their own mode (a compile's tracing context may hold another); real tensors by running
    mode = next((a.fake_mode for a in args if is_fake(a)), None)
    with mode if mode is not None else contextlib.nullcontext():
        return make_fx(functional, select_decomp_table(), tracing_mode="real")(*args)


def dynamo_unsupported() -> type[Exception]:
    """Dynamo's ``Unsupported`` (torch/_dynamo/exc.py, 2.11 and 2.13), taking ``(msg, gb_type=...)``: the one
    exception that Dynamo re-raises unchanged when code it runs while tracing raises it (``run_node`` and
    ``get_fake_value`` in _dynamo/utils.py, ``break_graph_if_unsupported`` in symbolic_convert.py,
    ``_compile`` in convert_frame.py). Imported on use: importing torch._dynamo costs ~1.4 s on the CPU."""
    from torch._dynamo.exc import Unsupported

    return Unsupported


def dynamo_tracing() -> bool:
    """Whether a torch.compile trace is running, also inside an op's fake impl, which Dynamo runs instead of
    tracing: there ``torch.compiler.is_compiling()`` is True on 2.13 but False on 2.11 (it reads a flag that
    only export sets), while Dynamo's TracingContext is set on both (torch/_guards.py, ``try_get``)."""
    from torch._guards import TracingContext

    return TracingContext.try_get() is not None


# ``assert_async(cond, msg)`` is ``torch._assert_async``: traced by Dynamo (trace_rules), lowered by Inductor to a
# device assert (``aten._assert_async.msg`` in torch/_inductor/lowering.py), kept by dead-code elimination
# (torch/fx/node.py side-effectful functions); 2.11 and 2.13. The builtin itself, not a wrapper: Dynamo then guards
# one builtin, not this module's ``torch`` as well as the caller's (one object reached two ways is guarded in
# Python on every compiled call).
assert_async = torch._assert_async


def mark_constant_result(fn):
    """What ``torch.compiler.assume_constant_result`` does (Dynamo calls ``fn`` instead of tracing it), without
    importing Dynamo, which that function does first (~1 s on a CPU): it sets ``fn._dynamo_marked_constant``
    (torch/_dynamo/decorators.py, 2.11 and 2.13; tests/test_compat.py checks the attribute)."""
    fn._dynamo_marked_constant = True
    return fn


def flex_default_fwd_tiles(head_dim: int, dtype: torch.dtype) -> list[tuple[int, int]]:
    """(BLOCK_M, BLOCK_N) of each forward config flex_attention's lowering tries on this process's CUDA device
    when ``kernel_options`` name no tile: ``CUDAConfigHeuristic.get_flex_attn_fwd_configs``
    (torch/_inductor/template_heuristics/triton.py, 2.11 and 2.13), which reads the current device's
    capability and Inductor's ``max_autotune``. The lowering skips configs that do not divide the mask's
    block sizes and raises when none is left (torch/_inductor/kernel/flex/flex_attention.py)."""
    from torch._inductor.template_heuristics.triton import CUDAConfigHeuristic

    return [(c.block_m, c.block_n) for c in CUDAConfigHeuristic().get_flex_attn_fwd_configs(head_dim, dtype)]


def is_fake(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a FakeTensor, also inside a functional or other wrapper, as while a plan's launch
    is traced into compiled code (torch/_subclasses/fake_tensor.py ``is_fake``, 2.11 and 2.13)."""
    from torch._subclasses.fake_tensor import is_fake as fake

    return fake(tensor)


def dynamo_compile_lock():
    """The re-entrant lock Dynamo holds while it compiles a frame (torch/_dynamo/convert_frame.py ``compile_lock``,
    a ``threading.RLock``, 2.11 and 2.13)."""
    from torch._dynamo.convert_frame import compile_lock

    return compile_lock


def new_dynamo_compile_lock() -> None:
    """In a forked child: a new compile lock for Dynamo, whose parent's may have been held by another thread at the
    fork (a compile, or one of our tunes, which hold it): the child's first compile would wait on it for ever.
    Dynamo reads the module global at each use (``with compile_lock:``)."""
    import sys
    import threading

    convert_frame = sys.modules.get("torch._dynamo.convert_frame")
    if convert_frame is not None:  # not imported in the parent: no lock to replace (and no import in the child)
        convert_frame.compile_lock = threading.RLock()


def sdpa_kernel_nodes() -> tuple:
    """What Dynamo records for ``with sdpa_kernel([...]):`` inside a compiled function: a call of
    ``torch.nn.attention._sdpa_kernel`` whose first argument lists the backends allowed, each an ``SDPBackend``
    or a call of ``_backend_from_string(name)`` (torch/nn/attention/__init__.py, 2.11 and 2.13)."""
    from torch.nn import attention

    return attention._sdpa_kernel, attention._backend_from_string


def wrapper_subclass(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (an example value of a traced graph) is a tensor wrapper subclass such as DTensor, whose
    ops need rules of their own (our ops have no sharding rule); a FakeTensor is not one
    (``is_traceable_wrapper_subclass``, torch/utils/_python_dispatch.py, 2.11 and 2.13)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return is_traceable_wrapper_subclass(tensor)


def functorch_wrapped(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is wrapped by a torch.func transform (vmap, grad), whose ops need a batching rule (ours
    have none): ``torch._C._functorch.is_functorch_wrapped_tensor``, 2.11 and 2.13."""
    return torch._C._functorch.is_functorch_wrapped_tensor(tensor)


def storage_holders(tensor: torch.Tensor) -> int:
    """How many tensors hold ``tensor``'s memory, itself included: 1 where no other tensor can see it. A Python
    ``UntypedStorage`` of it is not counted (torch keeps one such object per storage, the one made here).
    ``torch._C._storage_Use_Count``, less that object's reference (2.11 and 2.13)."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata) - 1


def has_tangent(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a dual tensor of forward-mode AD (``torch.autograd.forward_ad.make_dual``, as
    ``torch.func.jvp`` and ``jacfwd`` make them): ``forward_ad._current_level`` (-1 outside any dual level, read
    first: it costs nothing) and ``unpack_dual``, 2.11 and 2.13."""
    forward_ad = torch.autograd.forward_ad
    return forward_ad._current_level >= 0 and forward_ad.unpack_dual(tensor).tangent is not None


def end_failed_capture(device_index: int, pool) -> None:
    """Tell the CUDA caching allocator that a capture into ``pool`` is over after it failed. On torch 2.11
    ``CUDAGraph::capture_end`` (aten/src/ATen/cuda/CUDAGraph.cpp) checks ``cudaStreamEndCapture``'s error before
    it calls ``endAllocateToPool``, so an invalidated capture (a host sync inside it) stays registered as
    underway: its routing filter, which reads the freed CUDAGraph's capture id, is then asked about every
    allocation made during any later capture, and every ``torch.cuda.MemPool`` destroyed later (transformers'
    continuous batching keeps its CUDA graphs in one) aborts the process on ``captures_underway.empty()``. Where
    capture_end did end it, the allocator says it is not recording to ``pool``: nothing to do.
    ``torch._C._cuda_endAllocateToPool(device, pool)``, as ``torch.cuda.use_mem_pool`` calls it
    (torch/cuda/memory.py, 2.11 and 2.13). The pinned-host allocator's twin entry has no Python binding."""
    try:
        torch._C._cuda_endAllocateToPool(device_index, pool)
    except RuntimeError as err:
        if "not currently recording" not in str(err):
            raise


def cudagraphs_enabled() -> bool:
    """Whether Inductor wraps the graph being compiled in CUDA graphs (``mode="reduce-overhead"`` patches
    ``triton.cudagraphs`` for the whole compile, forward and backward; torch/_inductor/config.py, 2.11 and
    2.13). A graph Inductor then declines to capture (CPU tensors, mutated inputs) runs plain launches."""
    return bool(inductor_config().triton.cudagraphs)


def op_types() -> tuple[type, type, type]:
    """torch's ``(OpOverload, OpOverloadPacket, HigherOrderOperator)`` (torch/_ops.py, 2.11 and 2.13): what an FX
    node's target is when it names an aten op (``aten.add.default``, ``aten.add``) or a higher-order op."""
    from torch._ops import HigherOrderOperator, OpOverload, OpOverloadPacket

    return OpOverload, OpOverloadPacket, HigherOrderOperator


def inductor_counters():
    """Inductor's counters (``torch._dynamo.utils.counters["inductor"]``): what a compile adds to them is kept
    with its FX-graph cache entry and added again on every cache hit (torch/_inductor/codecache.py,
    ``cache_hit_post_compile``, 2.11 and 2.13), so counts made while compiling survive a replayed graph."""
    from torch._dynamo.utils import counters

    return counters["inductor"]


def current_raw_stream(device_index: int) -> int:
    """The current CUDA stream of a device as an int, the way Inductor's generated code reads it
    (``torch._C._cuda_getCurrentRawStream``, torch/_inductor/codegen/wrapper.py, 2.11 and 2.13; absent from CPU
    builds): a C call, where ``torch.cuda.current_stream(i).cuda_stream`` builds a Stream object first."""
    return torch._C._cuda_getCurrentRawStream(device_index)
