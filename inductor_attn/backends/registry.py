"""Backend registry. Order is the stable prior: ties between candidates go to the earlier backend, and
the first runnable candidate is the "default" that others must beat with a confident speedup.

Built-in order: ``sdpa`` first (what F.scaled_dot_product_attention gives users today is the baseline
for dense problems), ``paged_gather`` (pages gathered, then SDPA: the baseline for paged caches), then ``flex``
(the baseline for block masks), the kernels that must beat them (``fa3`` before ``fa4``: within the noise the
prebuilt kernel wins, and a first compile pays no JIT), and ``reference`` last (always runs, slowest). Adding a
backend is its module plus one line in :data:`BUILTIN`."""

from __future__ import annotations

import contextlib
import functools

from ..device import DeviceInfo
from ..problem import Problem
from .base import DIRECTIONS, Backend, Candidate, Plan, check_knobs
from .fa3 import BACKEND as FA3
from .fa4 import BACKEND as FA4
from .flex import BACKEND as FLEX
from .paged_gather import BACKEND as PAGED_GATHER
from .reference import BACKEND as REFERENCE
from .sdpa import BACKEND as SDPA
from .triton_decode import BACKEND as TRITON_DECODE
from .triton_flash.flash import BACKEND as TRITON_FLASH

BUILTIN = (SDPA, PAGED_GATHER, FLEX, FA3, FA4, TRITON_FLASH, TRITON_DECODE, REFERENCE)

_REGISTRY: dict[str, Backend] = {}
# bumped on every change of the registry, so caches keyed by backend name (ops/launch.py) notice it
state = {"generation": 0}


def register_backend(backend: Backend, *, first: bool = False) -> None:
    """Add (or replace) a backend; ``first=True`` puts it ahead in the prior order."""
    state["generation"] += 1
    _REGISTRY.pop(backend.name, None)
    if first:
        items = list(_REGISTRY.items())
        _REGISTRY.clear()
        _REGISTRY[backend.name] = backend
        _REGISTRY.update(items)
    else:
        _REGISTRY[backend.name] = backend


def unregister_backend(name: str) -> None:
    state["generation"] += 1
    _REGISTRY.pop(name, None)


@contextlib.contextmanager
def only_backends(*backends: Backend):
    """Replace the whole registry inside a ``with`` block (tests, experiments)."""
    saved = dict(_REGISTRY)
    _REGISTRY.clear()
    for b in backends:
        _REGISTRY[b.name] = b
    state["generation"] += 1
    try:
        yield
    finally:
        _REGISTRY.clear()
        _REGISTRY.update(saved)
        state["generation"] += 1


def required_distributions() -> tuple[str, ...]:
    """The distributions of the registered backends' libraries (their versions enter decision keys)."""
    return tuple(sorted({d for b in _REGISTRY.values() for d in b.library.distributions}))


def get_backend(name: str) -> Backend:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; registered: {', '.join(_REGISTRY)}") from None


def backends() -> list[Backend]:
    return list(_REGISTRY.values())


LOOKUP_ONLY = "not enumerated for a store lookup (its enumeration imports a large library)"


def enumerate_candidates(p: Problem, dev: DeviceInfo, direction: str = "forward", grad_lse: bool = False,
                         lookup_only: bool = False, full: frozenset[str] = frozenset()) -> list[Candidate]:
    """Every (backend, config) for ``p`` in prior order, each with its pruned reason or None. ``grad_lse``:
    a backward whose loss uses the lse too. ``lookup_only``: backends whose library has ``costly_import`` are listed
    by name only, pruned with ``LOOKUP_ONLY`` (the decision key names backends, not their configs), except those
    named in ``full``."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    out: list[Candidate] = []
    for backend in _REGISTRY.values():
        if p.op not in backend.takes.ops:  # not a candidate at all: nor listed, nor its source in the decision key
            continue
        if lookup_only and backend.library.costly_import and backend.name not in full:
            out.append(Candidate(backend.name, None, LOOKUP_ONLY))
            continue
        reason = _unsupported(backend, p, dev, direction)
        if reason is None and grad_lse and not backend.takes.grad_lse:
            reason = f"{backend.name}'s backward takes no gradient of the lse (the loss uses the lse here)"
        if reason is not None:
            out.append(Candidate(backend.name, None, reason))
            continue
        for cand in backend.configs(p, dev, direction):
            check_knobs(backend, cand.config)
            out.append(cand)
    names = [c.name for c in out]
    duplicates = {n for n in names if names.count(n) > 1}
    if duplicates:
        raise RuntimeError(f"candidate names must be unique, duplicated: {sorted(duplicates)}")
    return out


def _unsupported(backend: Backend, p: Problem, dev: DeviceInfo, direction: str) -> str | None:
    if direction == "backward" and not backend.takes.backward:
        return f"{backend.name} has no backward"
    if p.dtype.startswith("float8") and not backend.takes.fp8:
        return f"{backend.name} takes no fp8 inputs (fp8 runs on {_backends_taking('fp8')})"
    reason = backend.supports(p, dev, direction)
    if reason is None and p.has_key_mask and not backend.takes.key_mask:
        reason = f"{backend.name} does not take key_mask (per-batch key masks run on {_backends_taking('key_mask')})"
    if reason is None and p.softcap and not backend.takes.softcap:
        reason = f"{backend.name} has no logit softcap (softcap runs on {_backends_taking('softcap')})"
    return reason


def plan_for(problem: Problem, choice: str, dev: DeviceInfo, direction: str) -> Plan:
    """The plan of ``choice`` (``"backend:config"``) for this exact problem, built once per process."""
    name, cfg = _parse(choice)
    return _plan(get_backend(name), problem, cfg, dev, direction)


@functools.lru_cache(maxsize=256)
def _parse(choice: str):
    return Candidate.split(choice)


@functools.lru_cache(maxsize=1024)
def _plan(backend: Backend, problem: Problem, cfg, dev: DeviceInfo, direction: str) -> Plan:
    # keyed by the backend object, not its name: a re-registered backend gets plans of its own
    check_knobs(backend, cfg)
    return backend.plan(problem, dev, cfg, direction)


def _backends_taking(what: str) -> str:
    """The registered backends whose ``takes`` has ``what`` (key_mask, fp8), for a pruned reason's text."""
    return ", ".join(b.name for b in _REGISTRY.values() if getattr(b.takes, what))


for _backend in BUILTIN:
    register_backend(_backend)
