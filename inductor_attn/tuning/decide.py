"""Mode-aware decision for one call: which candidate runs it."""

from __future__ import annotations

from ..backends import AttnCall, enumerate_candidates, get_backend
from ..device import DeviceInfo


def decide(call: AttnCall, dev: DeviceInfo, direction: str) -> str:
    """The candidate name (``backend:config``) that runs ``call``: the first runnable one in prior order."""
    for cand in enumerate_candidates(call.problem, dev):
        if cand.pruned is None and (direction == "forward" or get_backend(cand.backend).has_backward):
            return cand.name
    raise RuntimeError(f"no backend can run {call.problem}")
