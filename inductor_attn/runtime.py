"""Run one op call on a kernel: the one the Inductor lowering baked in, or the one decided now.

An empty ``choice`` means "decide at run time": eager calls and dynamic-shape compiled code land here,
and the decision (store hit, tuning or heuristic, per the mode) is remembered per bucket in memory, so
the steady state is one dict lookup.
"""

from __future__ import annotations

import collections
import functools

from .backends import AttnCall, Candidate, get_backend
from .device import device_info
from .layout import conform

__all__ = ["AttnCall", "forward", "backward", "stats", "reset_stats"]

_STATS: collections.Counter = collections.Counter()


@functools.lru_cache(maxsize=256)
def _parse(choice: str):
    name, cfg = Candidate.split(choice)
    return get_backend(name), cfg


def _resolve(call: AttnCall, choice: str, direction: str):
    if not choice:
        from .tuning import decide  # lazy: tuning pulls in the store and timers

        choice = decide(call, device_info(call.q.device), direction)
    backend, cfg = _parse(choice)
    _STATS[(call.op, direction, choice)] += 1
    return backend, cfg


def forward(call: AttnCall, choice: str):
    backend, cfg = _resolve(call, choice, "forward")
    out, lse = backend.run(call, cfg)
    return conform(out, call.q), lse.contiguous()


def backward(call: AttnCall, choice: str, out, lse, grad_out, grad_lse):
    backend, cfg = _resolve(call, choice, "backward")
    dq, dk, dv = backend.backward(call, cfg, out, lse, grad_out, grad_lse)
    return conform(dq, call.q), conform(dk, call.k), conform(dv, call.v)


def stats() -> dict[str, int]:
    """How many op calls ran on which kernel since start (or the last ``reset_stats``), as
    ``{"attention/forward -> reference:default": 3, ...}``. Calls replayed inside a CUDA graph run no
    Python and are not counted."""
    return {f"{op}/{direction} -> {choice}": n for (op, direction, choice), n in sorted(_STATS.items())}


def reset_stats() -> None:
    _STATS.clear()
