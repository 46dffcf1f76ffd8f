"""Deciding which candidate runs a call: memo -> store -> tuning or heuristic, per mode.

Decisions are kept per (direction, bucket, device, mode) in memory, so once a bucket is decided a call
costs one dict lookup. Decisions are local to the process and never issue a collective: processes that
share a store tune each bucket once (the others wait for it), and ranks agree where they all meet, in
``sync_decisions()`` (see ranks.py; independent tunes can disagree: FlashInfer RFC #3920 saw 86 of 191
keys differ).
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from ..backends import AttnCall, Candidate, enumerate_candidates, get_backend
from ..device import DeviceInfo
from ..problem import Problem
from ..store.db import get_store
from ..store.keys import decision_fields
from .modes import current_mode
from .progress import progress_ticker
from .ranks import tune_once
from .tuner import default_rounds, tune

log = logging.getLogger(__name__)

_MEMO: dict[tuple, str] = {}
# the store row (with its measurements) behind a memo entry, where a tune backs it: sync_decisions
# prefers measured decisions and copies their rows into other ranks' stores
_ROWS: dict[tuple, dict] = {}
# choices adopted in sync_decisions, checked against this rank's candidates when the bucket is next met
_AGREED: dict[tuple, tuple[str, dict | None]] = {}
_LOCK = threading.RLock()


def forget_decisions() -> None:
    """Drop the in-memory decisions (the store is untouched)."""
    with _LOCK:
        _MEMO.clear()
        _ROWS.clear()
        _AGREED.clear()


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


def _variant(direction: str, grad_lse: bool = False) -> str:
    """Backward kernels behave differently under torch.use_deterministic_algorithms (no atomic dQ), and not
    every backward takes a gradient of the lse, so those backward decisions are kept apart."""
    if direction != "backward":
        return direction
    variant = "backward-deterministic" if torch.are_deterministic_algorithms_enabled() else direction
    return variant + "+dlse" if grad_lse else variant


def _winner(row: dict, compiled: bool) -> str:
    """The row's winner, or for compiled code the record's ``compiled_winner`` (tuner.py, step 4)."""
    return (compiled and row["record"].get("compiled_winner")) or row["winner"]


def decide_uncached(call: AttnCall, dev: DeviceInfo, direction: str, compiled: bool = False,
                    grad_lse: bool = False) -> tuple[str, dict | None]:
    """The choice for ``call``, and the store row behind it when a tune backs it (else None). ``compiled``:
    the choice for compiled code, which pays a plan's Python launch when it cannot be traced. ``grad_lse``:
    a backward whose loss uses the lse too."""
    p = call.problem
    cands = enumerate_candidates(p, dev, direction, grad_lse)
    mode = current_mode(p.device_type)
    if mode == "off":
        return default_choice(cands), None
    if mode == "heuristic":
        return heuristic_choice(p, dev, cands), None
    runnable = {c.name for c in cands if c.pruned is None}
    if len(runnable) == 1:
        return default_choice(cands), None
    fields = decision_fields(p.op, _variant(direction, grad_lse), p, dev, _sources(cands))
    store = get_store()

    def stored() -> dict | None:
        row = store.get(fields["key"])
        return row if row is not None and _winner(row, compiled) in runnable else None

    row = stored()
    if row is not None:
        return _winner(row, compiled), row
    if mode == "cache-only" or _capturing(call):  # never measure inside a CUDA-graph capture
        return default_choice(cands), None

    def measure() -> dict:
        with progress_ticker(f"tuning {p.op} {direction}", total=len(runnable) + default_rounds()) as tick:
            result = tune(call, cands, direction=direction, progress=tick, grad_lse=grad_lse)
        row = {**fields, "winner": result.winner, "record": result.to_json(), "created": time.time()}
        store.put(row)
        return row

    row = tune_once(store, fields["key"], call.q.device, lookup=stored, tune=measure)
    return _winner(row, compiled), row


def decide(call: AttnCall, dev: DeviceInfo, direction: str, compiled: bool = False, grad_lse: bool = False) -> str:
    """The candidate (``backend:config``) that runs ``call``; see the module doc. ``compiled=True`` asks for
    the choice compiled code makes while compiling (lowering/); ``grad_lse``: a backward whose loss uses the
    lse too."""
    key = (_variant(direction, grad_lse), call.problem.bucket(), dev.key(), current_mode(call.problem.device_type),
           compiled)
    choice = _MEMO.get(key)
    if choice is not None:
        return choice
    with _LOCK:
        if key not in _MEMO:
            choice, row = (_adopted(call, dev, direction, key)
                           or decide_uncached(call, dev, direction, compiled, grad_lse))
            if row is not None:
                _ROWS[key] = row
            _MEMO[key] = choice
        return _MEMO[key]


def _adopted(call: AttnCall, dev: DeviceInfo, direction: str, key: tuple) -> tuple[str, dict | None] | None:
    """The choice sync_decisions agreed on for ``key``, if this rank can run it."""
    agreed = _AGREED.pop(key, None)
    if agreed is None:
        return None
    runnable = {c.name for c in enumerate_candidates(call.problem, dev, direction) if c.pruned is None}
    if agreed[0] in runnable:
        return agreed
    log.warning("inductor_attn: the choice the ranks agreed on, %s, cannot run %s here; this rank decides "
                "on its own", agreed[0], call.problem)
    return None


def decision_entries() -> list[tuple]:
    """This process's decisions as ``(memo key, choice, row or None)``, for sync_decisions."""
    with _LOCK:
        entries = [(key, choice, _ROWS.get(key)) for key, choice in _MEMO.items()]
        return entries + [(key, choice, row) for key, (choice, row) in _AGREED.items()]


def adopt_decisions(agreed: dict[tuple, tuple[str, dict | None]]) -> int:
    """Make ``agreed`` (memo key -> choice, row) this process's decisions, and write each row to the
    store where the store holds another winner. Returns how many decisions of this process changed (one per
    bucket, also where both its run-time and its compiled-code choice changed)."""
    store = get_store()
    changed = set()
    with _LOCK:
        for key, (choice, row) in agreed.items():
            if row is not None and (store.get(row["key"]) or {}).get("winner") != row["winner"]:
                store.put(row)
            if _MEMO.get(key) == choice:
                if row is not None:
                    _ROWS[key] = row
                continue
            if key in _MEMO:
                changed.add(key[:-1])  # the memo key without its compiled-code flag
            _MEMO.pop(key, None)
            _ROWS.pop(key, None)
            _AGREED[key] = (choice, row)
    return len(changed)
