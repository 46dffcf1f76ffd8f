"""Kernel families as tuning candidates: the contract (base.py), the registry (registry.py) and one
module (or folder) per backend."""

from .base import (AttnCall, Backend, Candidate, Config, Library, Plan, Takes, run_backend, run_backend_backward,
                   source_hash)
from .registry import (
    REFERENCE,
    backends,
    enumerate_candidates,
    get_backend,
    only_backends,
    plan_for,
    register_backend,
    unregister_backend,
)

__all__ = ["AttnCall", "Backend", "Candidate", "Config", "Library", "Plan", "Takes", "register_backend",
           "unregister_backend", "only_backends", "get_backend", "plan_for", "backends", "enumerate_candidates",
           "REFERENCE", "run_backend", "run_backend_backward", "source_hash"]
