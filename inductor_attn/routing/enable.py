"""Make plain ``torch.compile`` route attention through inductor_attn.

Two ways, both installing the rewrite (routing/rewrite.py) as Inductor's ``pre_grad_custom_pass`` and
chaining whatever pass was there:

- ``enable()`` / ``disable()`` / ``with enabled():`` patch ``torch._inductor.config`` for every
  compilation that *happens* meanwhile. torch.compile compiles at the first call (and recompiles on new
  shapes), so calls must run inside the scope, not just the ``torch.compile(...)`` line.
- ``torch.compile(model, backend="inductor_attn")``: Inductor with the rewrite patched in for that
  compilation only (registered through the ``torch_dynamo_backends`` entry point in pyproject.toml,
  which torch reads lazily: torch/_dynamo/backends/registry.py ``_discover_entrypoint_backends``).

``enable(fp8=True)`` also has the rewrite run inference calls as fp8 (rewrite.py, "fp8"); the setting is the
pass's own, so it enters the pass's ``uuid()`` and a graph cached without it is not reused with it.

Importing this module changes nothing.
"""

from __future__ import annotations

import contextlib

from .._compat import compile_fx, inductor_compile_patches, inductor_config, launch_user_triton_kernels_statically
from .rewrite import RewritePass

__all__ = ["enable", "disable", "enabled", "is_enabled", "compile_backend"]


def is_enabled() -> bool:
    return isinstance(inductor_config().pre_grad_custom_pass, RewritePass)


def enable(fp8: bool = False) -> None:
    """Install the rewrite for all later Inductor compilations (idempotent: a second call only sets ``fp8``).
    Also has Inductor launch user-defined Triton kernels with its static launcher
    (``launch_user_triton_kernels_statically``: ours are traced into the generated code), a process-wide
    setting that ``disable()`` leaves on.

    ``fp8=True``: routed calls that need no gradient and take no kv_seqlens or key mask run as fp8: q, k, v are
    quantised to float8_e4m3fn per (batch, kv head) in the graph and ``fp8_attention`` returns the model's
    dtype (docs/using.md, "fp8 for a model's attention", says what it costs in accuracy). A bool, not a
    format: e4m3 is the only fp8 that FA3's kernels read."""
    if not isinstance(fp8, bool):
        raise TypeError(f"fp8 must be a bool (True: e4m3, the only fp8 FA3 reads), got {fp8!r}")
    launch_user_triton_kernels_statically()
    config = inductor_config()
    current = config.pre_grad_custom_pass
    if not isinstance(current, RewritePass):
        config.pre_grad_custom_pass = RewritePass(chained=current, fp8=fp8)
    elif current.fp8 != fp8:
        config.pre_grad_custom_pass = RewritePass(chained=current.chained, fp8=fp8)


def disable() -> None:
    """Put back exactly the ``pre_grad_custom_pass`` that ``enable()`` found (no-op if not enabled)."""
    config = inductor_config()
    current = config.pre_grad_custom_pass
    if isinstance(current, RewritePass):
        config.pre_grad_custom_pass = current.chained


@contextlib.contextmanager
def enabled(fp8: bool = False):
    """``enable(fp8)`` for the duration of the block; then the pass that was installed before is back, an
    enclosing ``enable()`` (with its own ``fp8``) included."""
    config = inductor_config()
    before = config.pre_grad_custom_pass
    enable(fp8)
    try:
        yield
    finally:
        config.pre_grad_custom_pass = before


def compile_backend(gm, example_inputs, mode: str | None = None, options: dict | None = None):
    """The ``"inductor_attn"`` dynamo backend: Inductor (same ``mode``/``options`` handling as
    ``backend="inductor"``) with the rewrite installed for this compilation."""
    launch_user_triton_kernels_statically()
    patches = inductor_compile_patches(mode, options)
    current = patches.get("pre_grad_custom_pass", inductor_config().pre_grad_custom_pass)
    if not isinstance(current, RewritePass):
        patches["pre_grad_custom_pass"] = RewritePass(chained=current)
    return compile_fx()(gm, example_inputs, config_patches=patches)
