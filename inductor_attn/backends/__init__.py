"""Backend registry. Order is the stable prior: ties between candidates go to the earlier backend, and
the first runnable candidate is the "default" that others must beat with a confident speedup.

Built-in order: ``sdpa`` first (what F.scaled_dot_product_attention gives users today is the baseline
for dense problems), then ``flex`` (the baseline for block masks), the kernels that must beat them, and
``reference`` last (always runs, slowest)."""

from __future__ import annotations

import contextlib

from ..device import DeviceInfo
from ..problem import Problem
from .base import AttnCall, Backend, Candidate, Config
from .fa4 import BACKEND as FA4
from .flex import BACKEND as FLEX
from .reference import BACKEND as REFERENCE
from .sdpa import BACKEND as SDPA
from .triton_decode import BACKEND as TRITON_DECODE
from .triton_flash.flash import BACKEND as TRITON_FLASH

_REGISTRY: dict[str, Backend] = {}


def register_backend(backend: Backend, *, first: bool = False) -> None:
    """Add (or replace) a backend; ``first=True`` puts it ahead in the prior order."""
    _REGISTRY.pop(backend.name, None)
    if first:
        items = list(_REGISTRY.items())
        _REGISTRY.clear()
        _REGISTRY[backend.name] = backend
        _REGISTRY.update(items)
    else:
        _REGISTRY[backend.name] = backend


def unregister_backend(name: str) -> None:
    _REGISTRY.pop(name, None)


@contextlib.contextmanager
def only_backends(*backends: Backend):
    """Replace the whole registry inside a ``with`` block (tests, experiments)."""
    saved = dict(_REGISTRY)
    _REGISTRY.clear()
    for b in backends:
        _REGISTRY[b.name] = b
    try:
        yield
    finally:
        _REGISTRY.clear()
        _REGISTRY.update(saved)


def get_backend(name: str) -> Backend:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; registered: {', '.join(_REGISTRY)}") from None


def backends() -> list[Backend]:
    return list(_REGISTRY.values())


def enumerate_candidates(p: Problem, dev: DeviceInfo, direction: str = "forward") -> list[Candidate]:
    """Every (backend, config) for ``p`` in prior order, each with its pruned reason or None.
    For ``direction="backward"`` the backends' backward support and backward configs are used."""
    out: list[Candidate] = []
    for backend in _REGISTRY.values():
        reason = backend.supports(p, dev)
        if reason is None and p.has_key_mask and not backend.takes_key_mask:
            reason = f"{backend.name} does not take key_mask (per-batch key masks run on {_key_mask_backends()})"
        if reason is None and direction == "backward":
            reason = backend.supports_backward(p, dev)
        if reason is not None:
            out.append(Candidate(backend.name, None, reason))
            continue
        if direction == "backward":
            out.extend(Candidate(backend.name, cfg) for cfg in backend.backward_configs(p, dev))
            continue
        for cfg in backend.configs(p, dev):
            out.append(Candidate(backend.name, cfg, backend.prune(p, dev, cfg)))
    names = [c.name for c in out]
    duplicates = {n for n in names if names.count(n) > 1}
    if duplicates:
        raise RuntimeError(f"candidate names must be unique, duplicated: {sorted(duplicates)}")
    return out


def _key_mask_backends() -> str:
    return ", ".join(b.name for b in _REGISTRY.values() if b.takes_key_mask)


def _register_builtin() -> None:
    for backend in (SDPA, FLEX, FA4, TRITON_FLASH, TRITON_DECODE, REFERENCE):
        register_backend(backend)


_register_builtin()

__all__ = ["AttnCall", "Backend", "Candidate", "Config", "register_backend", "unregister_backend",
           "only_backends", "get_backend", "backends", "enumerate_candidates", "REFERENCE"]
