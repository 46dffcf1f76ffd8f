"""Deciding which candidate runs a call: memo -> store -> tuning or heuristic, per mode.

Decisions are kept per (direction, bucket, device) in memory, so once a bucket is decided a call costs
one dict lookup. Under torch.distributed, rank 0 decides and broadcasts, so every rank runs the same
kernel (independent tunes can disagree: FlashInfer RFC #3920 saw 86 of 191 keys differ).
"""

from __future__ import annotations

import threading

import torch

from ..backends import AttnCall, Candidate, enumerate_candidates, get_backend
from ..device import DeviceInfo
from ..problem import Problem
from ..store.db import get_store
from ..store.keys import decision_fields
from .modes import current_mode
from .progress import progress_ticker
from .tuner import default_rounds, tune

_MEMO: dict[tuple, str] = {}
_LOCK = threading.RLock()


def forget_decisions() -> None:
    """Drop the in-memory decisions (the store is untouched)."""
    _MEMO.clear()


def default_choice(cands: list[Candidate]) -> str:
    for c in cands:
        if c.pruned is None:
            return c.name
    reasons = "; ".join(f"{c.name}: {c.pruned}" for c in cands)
    raise RuntimeError(f"no backend can run this problem: {reasons}")


def heuristic_choice(p: Problem, dev: DeviceInfo, cands: list[Candidate]) -> str:
    """First backend (prior order) whose hand rule names a runnable config; else the default."""
    runnable = {c.name for c in cands if c.pruned is None}
    for c in cands:
        backend = get_backend(c.backend)
        cfg = backend.heuristic(p, dev)
        if cfg is not None and f"{backend.name}:{cfg}" in runnable:
            return f"{backend.name}:{cfg}"
    return default_choice(cands)


def _sources(cands: list[Candidate]) -> dict[str, str]:
    return {name: get_backend(name).source_hash() for name in {c.backend for c in cands}}


def _capturing(call: AttnCall) -> bool:
    return call.q.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _variant(direction: str) -> str:
    """Backward kernels behave differently under torch.use_deterministic_algorithms (no atomic dQ), so
    deterministic backward decisions are kept apart."""
    if direction == "backward" and torch.are_deterministic_algorithms_enabled():
        return "backward-deterministic"
    return direction


def decide_uncached(call: AttnCall, dev: DeviceInfo, direction: str) -> str:
    p = call.problem
    cands = enumerate_candidates(p, dev, direction)
    mode = current_mode(p.device_type)
    if mode == "off":
        return default_choice(cands)
    if mode == "heuristic":
        return heuristic_choice(p, dev, cands)
    runnable = {c.name for c in cands if c.pruned is None}
    if len(runnable) == 1:
        return default_choice(cands)
    fields = decision_fields(p.op, _variant(direction), p, dev, _sources(cands))
    store = get_store()
    row = store.get(fields["key"])
    if row is not None and row["winner"] in runnable:
        return row["winner"]
    if mode == "cache-only" or _capturing(call):  # never measure inside a CUDA-graph capture
        return default_choice(cands)
    with progress_ticker(f"tuning {p.op} {direction}", total=len(runnable) + default_rounds()) as tick:
        result = tune(call, cands, direction=direction, progress=tick)
    store.put({**fields, "winner": result.winner, "record": result.to_json()})
    return result.winner


def decide(call: AttnCall, dev: DeviceInfo, direction: str) -> str:
    """The candidate (``backend:config``) that runs ``call``; see the module doc."""
    key = (_variant(direction), call.problem.bucket(), dev.key(), current_mode(call.problem.device_type))
    choice = _MEMO.get(key)
    if choice is not None:
        return choice
    with _LOCK:
        if key not in _MEMO:
            _MEMO[key] = _agree(lambda: decide_uncached(call, dev, direction))
        return _MEMO[key]


def _agree(decide_fn) -> str:
    """Rank 0's decision on every rank when torch.distributed runs with more than one process."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return decide_fn()
    box = [decide_fn() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]
