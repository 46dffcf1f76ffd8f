"""Decision keys: everything that can change which candidate wins, hashed into one string.

Fields (any change gives a new key, so an old decision is simply never found again):
- op and direction ("attention/forward"): different ops, different kernels;
- the bucketed Problem (problem.py decides what "the same shape" means);
- device name, compute capability and SM count: a decision on an H100 says nothing about a B200;
- versions of torch (SDPA/cuDNN dispatch, Inductor), this package, and the distributions of each
  registered backend's library (triton's code generation, FA4's nvidia-cutlass-dsl and flash-attn-4);
- a hash of each candidate backend's module source (like Inductor's ExternKernelChoice.hash_key):
  editing a kernel invalidates the timings taken with the old one.
"""

from __future__ import annotations

import functools
import hashlib
import json
from importlib import metadata

from ..device import DeviceInfo
from ..problem import Problem


ABSENT = "absent"  # the version recorded for a distribution that is not installed


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return ABSENT


def library_versions(requires) -> dict[str, str]:
    """torch, this package, and the distributions ``requires`` (those the registered backends require:
    backends.registry.required_distributions)."""
    return _versions(tuple(sorted(set(requires))))


def versions_like(recorded: dict) -> dict[str, str]:
    """This process's versions of what a row recorded: torch, this package and the row's distributions
    (the backends registered when it was tuned, which need not be the ones registered now)."""
    return _versions(tuple(sorted(k for k in recorded if k not in ("torch", "inductor_attn", "sources"))))


@functools.cache
def _versions(dists: tuple[str, ...]) -> dict[str, str]:
    import torch

    from .._version import __version__

    return {"torch": torch.__version__, "inductor_attn": __version__, **{d: _version(d) for d in dists}}


def decision_fields(op: str, direction: str, problem: Problem, dev: DeviceInfo, sources: dict[str, str],
                    requires) -> dict:
    """The row fields that identify a decision, and ``key``, their hash; ``requires``: the distributions the
    candidate backends require."""
    fields = {
        "op": f"{op}/{direction}",
        "problem": problem.bucket().key(),
        "device": dev.key(),
        "versions": {**library_versions(requires), "sources": dict(sorted(sources.items()))},
    }
    return {"key": key_of(fields), **fields}


def key_of(fields: dict) -> str:
    """The key of a decision: sha256 of its op, problem, device and versions (as JSON, keys sorted)."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def stale_reason(versions: dict, current: dict[str, str], sources: dict[str, str]) -> str | None:
    """Why a row's ``versions`` no longer match ``current`` library versions and the registered backends'
    source hashes (``sources``), or None. A backend not registered here is not a reason: it may be a
    user's backend that this process never loaded.

    >>> stale_reason({"torch": "2.12", "sources": {"sdpa": "ab"}}, {"torch": "2.13"}, {"sdpa": "ab"})
    'torch 2.12 -> 2.13'
    >>> stale_reason({"torch": "2.13", "sources": {"sdpa": "ab", "mine": "cd"}}, {"torch": "2.13"}, {"sdpa": "ff"})
    'sdpa source changed'
    """
    changed = [f"{name} {versions.get(name, 'absent')} -> {now}" for name, now in current.items()
               if versions.get(name) != now]
    changed += [f"{name} source changed" for name, digest in sorted(versions.get("sources", {}).items())
                if name in sources and sources[name] != digest]
    return ", ".join(changed) or None
