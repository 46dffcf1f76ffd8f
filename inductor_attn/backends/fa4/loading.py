"""Importing flash-attn-4 and the private API this backend relies on: each name it passes, the CLC switch, the
objects that own its compiled kernels. Every guard here has a test that reads the installed FA4's source
(tests/test_fa4.py), so a release that moves one prunes candidates instead of failing at launch."""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import inspect
import logging
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# Keyword arguments of interface._flash_attn_fwd / _flash_attn_bwd that every call uses: without them
# the backend cannot run at all.
FWD_KWARGS = frozenset({
    "cu_seqlens_q", "cu_seqlens_k", "seqused_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal",
    "window_size_left", "window_size_right", "mask_mod", "block_sparse_tensors", "aux_tensors", "out", "lse",
    "return_lse",
})
BWD_KWARGS = frozenset({
    "softmax_scale", "causal", "window_size_left", "window_size_right", "cu_seqlens_q", "cu_seqlens_k",
    "seqused_k", "max_seqlen_q", "max_seqlen_k", "dlse",
})
# The private tuning knobs: a config that sets one is pruned if FA4 stops taking it.
KNOB_KWARGS = frozenset({"tile_mn", "mma_pv_is_rs", "intra_wg_overlap", "pack_gqa", "num_splits"})
CLC_SWITCH = "_get_use_clc_scheduler_default"


@dataclass(frozen=True)
class FA4:
    """The imported pieces of flash-attn-4 this backend uses, and what its private API offers."""

    interface: object
    utils: object
    block_sparsity: object
    version: str
    fwd_params: frozenset
    bwd_params: frozenset
    has_clc_switch: bool
    has_sparse_block_size: bool
    dsl_errors: tuple


def user_cache_dir() -> Path:
    """``$XDG_CACHE_HOME`` (default ``~/.cache``) / inductor_attn."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "inductor_attn"


def _enable_disk_cache() -> None:
    """Turn on FA4's compiled-kernel disk cache unless the user set it either way.

    ``flash_attn/cute/cache_utils.py`` reads both variables once, at import, so this must run before
    the first import of ``flash_attn.cute``; done lazily (not at our import) so that importing
    inductor_attn changes no global state. Without it every process recompiles (seconds per config,
    flash-attention issue #2635).
    """
    if "flash_attn.cute.cache_utils" in sys.modules:
        log.debug("flash_attn.cute was imported before inductor_attn: its disk-cache settings stand")
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", str(user_cache_dir() / "flash_attn_cute"))


def missing_kwargs(params, required) -> list[str]:
    """The names of ``required`` that a signature's parameter names lack, sorted.

    >>> missing_kwargs({"q", "k", "tile_mn"}, {"tile_mn", "num_splits"})
    ['num_splits']
    """
    return sorted(set(required) - set(params))


@functools.cache
def load() -> FA4 | str:
    """Import flash-attn-4 once; the reason in words if it cannot be used."""
    _enable_disk_cache()
    try:
        from flash_attn.cute import block_sparsity, interface
        from flash_attn.cute import utils as fa_utils
    except ModuleNotFoundError as err:
        if err.name and err.name.split(".")[0] in ("flash_attn", "cutlass", "quack"):
            return "flash-attn-4 not installed"
        return f"flash-attn-4 not importable: {err}"
    except (ImportError, OSError, RuntimeError) as err:  # e.g. a wheel built for another Python / CUDA
        return f"flash-attn-4 not importable: {type(err).__name__}: {str(err)[:200]}"
    try:
        from cutlass.base_dsl.common import DSLBaseError  # compile/launch errors are not RuntimeErrors

        dsl_errors = (DSLBaseError,)
    except ImportError:
        dsl_errors = ()
    try:
        version = importlib.metadata.version("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return FA4(
        interface=interface,
        utils=fa_utils,
        block_sparsity=block_sparsity,
        version=version,
        fwd_params=frozenset(inspect.signature(interface._flash_attn_fwd).parameters),
        bwd_params=frozenset(inspect.signature(interface._flash_attn_bwd).parameters),
        has_clc_switch=callable(getattr(fa_utils, CLC_SWITCH, None)),
        has_sparse_block_size="block_size" in getattr(block_sparsity.BlockSparseTensorsTorch, "_fields", ()),
        dsl_errors=dsl_errors,
    )


def loaded() -> FA4:
    """The imported library, for a plan's launch: enumeration pruned every candidate where :func:`load` failed."""
    fa = load()
    if isinstance(fa, str):
        raise RuntimeError(fa)
    return fa


@contextlib.contextmanager
def clc_scheduler(fa_utils, enabled: bool | None):
    """Run one FA4 call with the CLC scheduler requested (True) or not (False); None leaves FA4 alone.

    FA4 has no CLC argument: ``FA_CLC=1`` is read at import into ``flash_attn.cute.utils`` and handed out
    by ``utils._get_use_clc_scheduler_default()``, which ``_flash_attn_fwd`` calls through the module on
    every call (b36 interface.py, "requested_use_clc_scheduler"). So we swap that function for the
    duration of the call, under a lock so concurrent calls cannot see each other's value, and restore
    it in ``finally``. The compile key includes the flag, so both variants stay cached side by side.
    """
    if enabled is None:
        yield
        return
    with _CLC_LOCK:
        saved = getattr(fa_utils, CLC_SWITCH)
        setattr(fa_utils, CLC_SWITCH, lambda: enabled)
        try:
            yield
        finally:
            setattr(fa_utils, CLC_SWITCH, saved)


_CLC_LOCK = threading.Lock()


def fwd_compile_cache_owners(fa: FA4) -> list:
    """The objects whose ``compile_cache`` holds FA4's compiled forward kernels (b36:
    ``interface._flash_attn_fwd``)."""
    return [fa.interface._flash_attn_fwd]


def bwd_compile_cache_owners(fa: FA4) -> list:
    """The objects whose ``compile_cache`` holds the kernels ``_flash_attn_bwd`` runs (b36: its preprocess,
    itself, and the postprocess conversion)."""
    i = fa.interface
    return [i._bwd_preprocess, i._flash_attn_bwd, i._bwd_postprocess_convert]


@contextlib.contextmanager
def dsl_errors(fa: FA4, label: str):
    """CuTe DSL compile/launch errors (e.g. CUDA_LAUNCH_INVALID_CONFIG) do not derive from RuntimeError;
    re-raise them as one so the tuner drops the candidate instead of treating it as our bug."""
    try:
        yield
    except fa.dsl_errors as err:
        first = next((ln.strip() for ln in str(err).splitlines() if ln.strip()), "")
        raise RuntimeError(f"flash-attn-4 [{label}] {type(err).__name__}: {first[:200]}") from err
