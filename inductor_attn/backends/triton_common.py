"""What the two Triton backends (triton_flash/, triton_decode.py) share unchanged: how a plan launches a
kernel eagerly, into a compiled graph or only compiles it, which Triton errors mean "cannot run here", and how a
module of kernels imports without Triton (:func:`jit`, also hf_paged.py's)."""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from .base import Library


@functools.cache
def triton_available() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # an import hook refusing it; a stub module without a spec
        return False


def jit(**options):
    """``triton.jit(**options)``; without Triton the plain function, so that a module of kernels imports anyway (its
    kernels are then never built or run)."""
    try:
        import triton
    except ImportError:
        return lambda fn: fn
    return triton.jit(**options)


def eager_launcher(kernel):
    """Plain ``kernel[grid](...)`` launches: ``wrap_triton`` in eager mode goes through a higher-order op
    dispatch that costs about 1 ms (torch/_library/triton.py, ``set_wrap_triton_enabled``)."""
    return kernel


def graph_launcher(kernel):
    """Launches that ``make_fx`` records as ``triton_kernel_wrapper_*`` nodes, which Inductor's generated
    code launches itself (``torch.library.wrap_triton``, torch 2.11 and 2.13)."""
    return torch.library.wrap_triton(kernel)


def warmup_launcher(kernel):
    """Launches that only compile: ``kernel[grid](...)`` becomes ``kernel.warmup(..., grid=grid)``, which
    compiles the kernel for these arguments (or loads it from Triton's disk cache) and returns the compiled
    kernel without running it (``Plan.compile``)."""
    return _Warmup(kernel)


class _Warmup:
    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        return functools.partial(self.kernel.warmup, grid=grid)


def traceable() -> bool:
    """Whether plans may offer a traced form: not under ``TRITON_INTERPRET=1``, where kernels are Python
    functions run on real tensors (the CPU tests), which ``make_fx`` cannot trace."""
    return os.environ.get("TRITON_INTERPRET") != "1"


def triton_errors() -> tuple[type[BaseException], ...]:
    """Triton's compile and resource errors (they derive from Exception only, not RuntimeError)."""
    if not triton_available():
        return ()
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    return CompilationError, OutOfResources


TRITON = Library(distributions=("triton",), errors=triton_errors)
