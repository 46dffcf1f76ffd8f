"""Keeps Inductor's FX graph cache from replaying code built from stale decisions.

On an FX-graph-cache hit, lowerings do not run: the kernel choice baked into the cached code replays
(notes/pytorch-internals.md). The cache key hashes the ``uuid()`` of custom graph passes, so we sit in
``post_grad_custom_post_pass`` with a pass that changes nothing in the graph and whose uuid hashes what
the baked choices depend on: the decision store's generation token (changes on every write or clear),
the backends' sources, the package version, the tuning mode and the simulated device. A pass the user
had already put in that slot is kept and run first; its uuid is part of ours.
"""

from __future__ import annotations

import hashlib
import os
import uuid

from .._compat import custom_graph_pass_base, inductor_config

_GuardBase = custom_graph_pass_base()


class DecisionCacheGuard(_GuardBase):
    def __init__(self, chained=None):
        self.chained = chained

    def __call__(self, graph) -> None:
        if self.chained is not None:
            self.chained(graph)

    def uuid(self):
        from .. import backends
        from .._version import __version__
        from ..device import ENV_VAR as DEVICE_ENV
        from ..store.db import get_store
        from ..tuning.modes import ENV_VAR as MODE_ENV
        from ..tuning.modes import current_mode

        store = get_store()
        generation = store.generation()
        if store.broken:  # decisions are not persisted: never let a cached graph stand in for a tune
            return uuid.uuid4().hex
        parts = [__version__, generation, current_mode("cuda"), os.environ.get(MODE_ENV, ""),
                 os.environ.get(DEVICE_ENV, "")]
        parts += [f"{b.name}={b.source_hash()}" for b in backends.backends()]
        if self.chained is not None:
            chained_uuid = getattr(self.chained, "uuid", lambda: None)()
            if chained_uuid is None:
                return None  # the user's pass cannot be cached: neither can the graph
            parts.append(repr(chained_uuid))
        return hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()


def install() -> None:
    """Put the guard in ``post_grad_custom_post_pass`` (chaining what is there), once."""
    config = inductor_config()
    current = config.post_grad_custom_post_pass
    if not isinstance(current, DecisionCacheGuard):
        config.post_grad_custom_post_pass = DecisionCacheGuard(current)


def active() -> bool:
    return isinstance(inductor_config().post_grad_custom_post_pass, DecisionCacheGuard)
