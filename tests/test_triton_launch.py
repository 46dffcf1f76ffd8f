"""The direct launch path (backends/triton/launch.py): its keys, and the Triton internals it relies on."""

from __future__ import annotations

import inspect

import pytest
import torch

triton = pytest.importorskip("triton")

from inductor_attn.backends.triton import flash_kernel  # noqa: E402
from inductor_attn.backends.triton.launch import DirectLaunch, _arg_key, launcher  # noqa: E402


def test_keys_tell_apart_what_triton_specializes_on():
    x = torch.zeros(64)
    assert _arg_key(x) != _arg_key(x[1:])  # 16-byte aligned or not
    assert _arg_key(x) != _arg_key(x.half())
    assert len({_arg_key(v) for v in (1, 16, 17, 2**31)}) == 4  # == 1, % 16, neither, 64-bit
    assert _arg_key(32) == _arg_key(48)  # a runtime int: only its properties
    assert _arg_key(None) is None and _arg_key(2.0) is float and _arg_key(True) is True


def test_the_launch_key_holds_constexpr_values_and_options(monkeypatch):
    from types import SimpleNamespace

    kernel = SimpleNamespace(params=[SimpleNamespace(name="X", is_constexpr=False),
                                     SimpleNamespace(name="n", is_constexpr=False),
                                     SimpleNamespace(name="BLOCK", is_constexpr=True)])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    direct = DirectLaunch(kernel)
    x = torch.zeros(64)

    def key(*values, **options):
        return direct.key(list(values), {"BLOCK": values[-1], **options})

    assert key(x, 32, 64, num_warps=4) == key(torch.ones(64), 48, 64, num_warps=4)
    assert len({key(x, 32, 64, num_warps=4), key(x, 32, 128, num_warps=4), key(x, 32, 64, num_warps=8),
                key(x, 1, 64, num_warps=4), key(x[1:], 32, 64, num_warps=4)}) == 5


def test_descriptor_keys_hold_block_shape_and_layout():
    from triton.tools.tensor_descriptor import TensorDescriptor

    x = torch.zeros(2, 4, 64, 32)
    a = TensorDescriptor(x, list(x.shape), list(x.stride()), [1, 1, 16, 32])
    b = TensorDescriptor(x, list(x.shape), list(x.stride()), [1, 1, 32, 32])
    y = x[:, :, :63]
    c = TensorDescriptor(y, list(y.shape), list(y.stride()), [1, 1, 16, 32])
    assert len({_arg_key(d) for d in (a, b, c)}) == 3


def test_unknown_argument_types_are_refused_not_keyed_loosely():
    with pytest.raises(TypeError, match="no launch key"):
        _arg_key(object())


def test_launch_hooks_send_launches_through_triton(monkeypatch):
    from triton import knobs

    from inductor_attn.backends.triton.launch import _hooks_set

    assert not _hooks_set(), "no profiler is attached in tests: direct launches must be possible"
    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):
        monkeypatch.setattr(chain, "calls", [lambda *a: None])
    else:
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)
    assert _hooks_set()


def test_the_interpreter_launches_through_triton():
    # conftest sets TRITON_INTERPRET=1 on machines without a GPU: kernels are InterpretedFunctions
    if torch.cuda.is_available():
        pytest.skip("a GPU machine compiles kernels; tests/test_triton_flash_gpu.py covers direct launches")
    assert launcher(flash_kernel.flash_fwd_kernel).disabled
    assert launcher(flash_kernel.flash_fwd_kernel) is launcher(flash_kernel.flash_fwd_kernel)


def test_triton_internals_direct_launch_relies_on_are_where_it_expects():
    """Fails loudly when Triton moves what DirectLaunch calls: the JIT's call of ``CompiledKernel.run``
    (grid, stream, function, packed metadata, launch metadata, hooks, then every bound argument) and the
    parameter list with constexpr flags."""
    from triton.runtime.jit import JITFunction, KernelParam

    src = inspect.getsource(JITFunction.run)
    assert "kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata" in src
    assert "*bound_args.values())" in src
    assert hasattr(KernelParam, "is_constexpr") and hasattr(KernelParam, "name")
    assert "self.params" in inspect.getsource(JITFunction)
