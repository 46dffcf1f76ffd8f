"""Make plain ``torch.compile`` route attention through inductor_attn.

Two ways, both installing the rewrite (routing/rewrite.py) as Inductor's ``pre_grad_custom_pass`` and
chaining whatever pass was there:

- ``enable()`` / ``disable()`` / ``with enabled():`` patch ``torch._inductor.config`` for every
  compilation that *happens* meanwhile. torch.compile compiles at the first call (and recompiles on new
  shapes), so calls must run inside the scope, not just the ``torch.compile(...)`` line.
- ``torch.compile(model, backend="inductor_attn")``: Inductor with the rewrite patched in for that
  compilation only (registered through the ``torch_dynamo_backends`` entry point in pyproject.toml,
  which torch reads lazily: torch/_dynamo/backends/registry.py ``_discover_entrypoint_backends``).

Importing this module changes nothing.
"""

from __future__ import annotations

import contextlib

from .._compat import compile_fx, inductor_compile_patches, inductor_config, launch_user_triton_kernels_statically
from .rewrite import RewritePass

__all__ = ["enable", "disable", "enabled", "is_enabled", "compile_backend"]


def is_enabled() -> bool:
    return isinstance(inductor_config().pre_grad_custom_pass, RewritePass)


def enable() -> None:
    """Install the rewrite for all later Inductor compilations (idempotent). Also has Inductor launch
    user-defined Triton kernels with its static launcher (``launch_user_triton_kernels_statically``: ours
    are traced into the generated code), a process-wide setting that ``disable()`` leaves on."""
    launch_user_triton_kernels_statically()
    config = inductor_config()
    if not isinstance(config.pre_grad_custom_pass, RewritePass):
        config.pre_grad_custom_pass = RewritePass(chained=config.pre_grad_custom_pass)


def disable() -> None:
    """Put back exactly the ``pre_grad_custom_pass`` that ``enable()`` found (no-op if not enabled)."""
    config = inductor_config()
    current = config.pre_grad_custom_pass
    if isinstance(current, RewritePass):
        config.pre_grad_custom_pass = current.chained


@contextlib.contextmanager
def enabled():
    """``enable()`` for the duration of the block; leaves an enclosing ``enable()`` in place."""
    was_enabled = is_enabled()
    enable()
    try:
        yield
    finally:
        if not was_enabled:
            disable()


def compile_backend(gm, example_inputs, mode: str | None = None, options: dict | None = None):
    """The ``"inductor_attn"`` dynamo backend: Inductor (same ``mode``/``options`` handling as
    ``backend="inductor"``) with the rewrite installed for this compilation."""
    launch_user_triton_kernels_statically()
    patches = inductor_compile_patches(mode, options)
    current = patches.get("pre_grad_custom_pass", inductor_config().pre_grad_custom_pass)
    if not isinstance(current, RewritePass):
        patches["pre_grad_custom_pass"] = RewritePass(chained=current)
    return compile_fx()(gm, example_inputs, config_patches=patches)
