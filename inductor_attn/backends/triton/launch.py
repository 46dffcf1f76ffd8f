"""Launching our Triton kernels without Triton's per-call argument binding.

``kernel[grid](*args)`` works out on every call what the compiled binary was specialized on (each
pointer's 16-byte alignment, each integer's ``== 1``, ``% 16 == 0`` and width, each descriptor's type),
looks the binary up and launches it. On the H100 machine that took 60-115 us of host time per launch
(benchmarks/launch_cost_gpu.py), about what the forward kernel of a 256-window problem takes on the GPU,
so eager calls and do_bench timings became host-bound.

:class:`DirectLaunch` keeps the binary Triton returned for each specialization and launches it through
its own ``run`` on later calls. Its key is computed here from the same properties and errs on the side
of more keys (a descriptor's whole shape and strides, every integer's three properties): an extra key
only costs one more launch through Triton, which finds its cached binary; a missing property would launch
a wrong binary. Without a compiled binary (Triton's interpreter, an API this Triton lacks) every launch
goes through ``kernel[grid]`` as before; so does every launch while a launch hook (a profiler's) is set.
The calling convention of ``CompiledKernel.run`` (grid, stream, function, packed metadata, launch
metadata, enter/exit hooks, then every argument including constexprs) is that of Triton 3.4-3.9
(``triton/runtime/jit.py``, ``JITFunction.run``); tests/test_triton_launch.py fails if it moves.
"""

from __future__ import annotations

import functools
import operator

import torch


_2_31 = 2**31


def _int_key(v: int) -> int:
    """1, 16 (divisible by 16), 0 (neither), or the value's width class past 32 bits."""
    return (1 if v == 1 else 16 if v % 16 == 0 else 0) if -_2_31 <= v < _2_31 else (2 if v >= 0 else 3)


def _arg_key(v):
    """What Triton may specialize a binary on for the runtime argument ``v``."""
    if type(v) is int:
        return _int_key(v)
    if isinstance(v, torch.Tensor):
        return v.dtype, v.data_ptr() % 16 == 0
    if v is None or isinstance(v, bool):
        return v
    if isinstance(v, float):
        return float
    base = getattr(v, "base", None)  # a host-side TensorDescriptor (triton.tools.tensor_descriptor)
    if isinstance(base, torch.Tensor):
        return (type(v), base.dtype, base.data_ptr() % 16 == 0, tuple(v.block_shape), getattr(v, "padding", None),
                tuple(map(_int_key, v.shape)), tuple(map(_int_key, v.strides)))
    raise TypeError(f"no launch key for a {type(v).__name__} argument")


def _hooks_set() -> bool:
    """Whether a launch hook is installed (a profiler's): Triton >= 3.5 keeps them in an always-present
    ``HookChain`` whose ``calls`` list is empty when none is, older ones in a plain None-or-callable."""
    try:
        from triton import knobs
    except ImportError:
        return True
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(hook is not None and getattr(hook, "calls", True) for hook in hooks)


class DirectLaunch:
    """``DirectLaunch(kernel)[grid](*args, **kwargs)`` behaves like ``kernel[grid](...)`` and returns the
    compiled kernel (None under the interpreter)."""

    def __init__(self, kernel):
        from triton.runtime.jit import JITFunction

        self.kernel = kernel
        self.binaries: dict[tuple, object] = {}
        # why launches go through kernel[grid] only: the interpreter compiles nothing
        self.disabled = None if isinstance(kernel, JITFunction) else f"{type(kernel).__name__} has no binaries"
        params = getattr(kernel, "params", [])
        self.names = [p.name for p in params]
        self.param_names = frozenset(self.names)
        self.runtime_at = [i for i, p in enumerate(params) if not p.is_constexpr]
        self.constexpr_at = [i for i, p in enumerate(params) if p.is_constexpr]
        self.runtime_args = operator.itemgetter(*self.runtime_at) if len(self.runtime_at) > 1 else None

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def key(self, values: list, kwargs: dict) -> tuple:
        """Device, constexpr values, launch options (num_warps, ...) and each runtime argument's key."""
        options = tuple(sorted((k, kwargs[k]) for k in kwargs.keys() - self.param_names))
        runtime = self.runtime_args(values) if self.runtime_args else [values[i] for i in self.runtime_at]
        # ints are most of the arguments (strides): their key is inlined, a call each cost ~0.15 us of 10
        return (torch.cuda.current_device(), options, *[values[i] for i in self.constexpr_at],
                *[(1 if v == 1 else 16 if v % 16 == 0 else 0) if type(v) is int and -_2_31 <= v < _2_31
                  else _arg_key(v) for v in runtime])

    def launch(self, grid, args: tuple, kwargs: dict):
        if self.disabled is not None or _hooks_set():
            return self.kernel[grid](*args, **kwargs)
        values = [*args, *map(kwargs.__getitem__, self.names[len(args):])]
        key = self.key(values, kwargs)
        binary = self.binaries.get(key)
        if binary is None:
            binary = self.kernel[grid](*args, **kwargs)
            if hasattr(binary, "run") and hasattr(binary, "packed_metadata"):
                self.binaries[key] = binary
            return binary
        g0, g1, g2 = (*grid, 1, 1)[:3]
        try:
            binary.run(g0, g1, g2, torch.cuda.current_stream().cuda_stream, binary.function,
                       binary.packed_metadata, None, None, None, *values)
        except TypeError as err:  # another calling convention: launch through Triton from now on
            self.disabled = f"CompiledKernel.run refused the arguments: {err}"
            return self.kernel[grid](*args, **kwargs)
        return binary


@functools.cache
def launcher(kernel) -> DirectLaunch:
    """The one :class:`DirectLaunch` of ``kernel`` (its binaries are shared by every caller)."""
    return DirectLaunch(kernel)
