"""Deciding which candidate runs a call: memo -> store -> shipped table -> tuning or heuristic, per mode.

Decisions are kept per (direction, bucket, device, mode) in memory, so once a bucket is decided a call
costs one dict lookup. A decision this process did not tune (stored by another process, imported, shipped, or
agreed with other ranks) runs only after its choice passed the tuner's correctness gate here, once per
process and bucket (``_checked_here``): a foreign record cannot vouch for this machine's kernels and
libraries. One that fails counts as failed here, and the bucket is decided again without it.

Decisions are local to the process and never issue a collective: processes that
share a store tune each bucket once (the others wait for it), and ranks agree where they all meet, in
``sync_decisions()`` (below, over ranks.py's collective; independent tunes can disagree: FlashInfer RFC #3920 saw 86
of 191 keys differ).

A decision of the shipped tables (store/priors.py) for the bucket shortens an autotune to the candidates
close to its winner (``priors.shortlist``), is used as it is in cache-only mode, and runs until the tune
lands in background mode (background.py). Background decisions made without a measurement are provisional:
each checks the store at most once a second (``RECHECK_S``) until the tune's decision is there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable

import torch

from .._compat import dynamo_compile_lock, new_dynamo_compile_lock
from ..backends import AttnCall, Candidate, backends, enumerate_candidates, get_backend, source_hash
from ..backends.registry import LOOKUP_ONLY, required_distributions
from ..backends.registry import state as registry_state
from ..device import DeviceInfo, device_info
from ..problem import Problem
from ..store.db import get_store
from ..store.keys import ABSENT, decision_fields, library_versions
from ..store.priors import (SHORTLIST, SHORTLIST_COMPILE_FACTOR, SHORTLIST_COMPILE_FLOOR_S, SHORTLIST_MARGIN,
                            is_shipped, shipped_match, shortlist)
from . import background
from .measure import describe, device_error, gate_once, is_candidate_error
from .modes import current_mode, on_change
from .progress import progress_ticker
from .ranks import agreed_across, on_device, tune_once
from .tuner import NoCandidateRan, default_rounds, tune

log = logging.getLogger(__name__)

_MEMO: dict[tuple, str] = {}
# the store row (with its measurements) behind a memo entry, where a tune backs it: sync_decisions
# prefers measured decisions and copies their rows into other ranks' stores
_ROWS: dict[tuple, dict] = {}
# choices adopted in sync_decisions, checked against this rank's candidates when the bucket is next met
_AGREED: dict[tuple, tuple[str, dict | None]] = {}
# background decisions made without a measurement: memo key -> [next store check (monotonic), decision key]
_PROVISIONAL: dict[tuple, list] = {}
# choices decided here that raised a "cannot run here" error at a real launch (a mode that does not measure
# ran an ungated default, or a winner met another shape of its bucket): memo key -> {choice: reason}. They
# count as pruned for that bucket in this process, so the next runnable candidate takes over.
_FAILED: dict[tuple, dict[str, str]] = {}
# the decisions this process tuned, as (decision key, winner, created) (their candidates passed the gate here: a row
# that another process stored under the same key later is not one of them), and the gate's verdict on choices of
# decisions it did not tune: (decision key, choice) -> None (passed) or why not
_TUNED_HERE: set[tuple[str, str, float]] = set()
_GATED: dict[tuple, str | None] = {}
_LOCK = threading.RLock()
RECHECK_S = 1.0


@contextlib.contextmanager
def _measuring(device_type: str):
    """The locks held while a decision may run candidates (a tune, a gate: the modes that measure): Dynamo's compile
    lock, then ``_LOCK``. A candidate may compile (flex is torch.compile'd at its first call), and a thread compiling
    holds Dynamo's lock when it asks for ``_LOCK`` (the pass's uuid, the lowering's decisions): taken in this one
    order, the two never wait on each other. It also keeps one thread's timings from overlapping another's. Modes
    that never measure take ``_LOCK`` alone: their calls need not wait for another thread's compile."""
    if current_mode(device_type) in ("autotune", "background"):
        with dynamo_compile_lock(), _LOCK:
            yield
    else:
        with _LOCK:
            yield


def _new_locks_in_child() -> None:
    """A process forked while a thread of its parent held the locks of a tune would wait on them for ever."""
    global _LOCK
    _LOCK = threading.RLock()
    new_dynamo_compile_lock()


os.register_at_fork(after_in_child=_new_locks_in_child)
NOT_ENUMERATED = ("not enumerated: the shipped decision names none of its configs "
                  "(enumerating them imports a large library)")


# the store's token (lowering/graph_pass.py) that the remembered choices answer to: compiled code is cached under it
_STORE_TOKEN: list[str | None] = [None]
# memo keys whose choice the ranks agreed on (sync_decisions): no change of the store moves them
_PINNED: set[tuple] = set()


def forget_decisions() -> None:
    """Drop everything this process remembers about decisions (the store is untouched): the choices, and what
    it learned of them (tunes run here, gate verdicts, choices that failed at a launch, ranks' agreement)."""
    with _LOCK:
        forget_choices()
        _AGREED.clear()
        _FAILED.clear()
        _TUNED_HERE.clear()
        _GATED.clear()


def forget_choices() -> None:
    """Drop the remembered choices, so that the next call of each bucket reads the store again; what this process
    learned of them (tunes run here, gate verdicts, failed launches, ranks' agreement) stays: a mode switch or
    another process's write changes no such fact, and forgetting one would gate or fail a choice again."""
    with _LOCK:
        _MEMO.clear()
        _ROWS.clear()
        _PROVISIONAL.clear()
        _PINNED.clear()


on_change(forget_choices)  # a choice made under another tuning mode is not this mode's


def follow_store(read_token: Callable[[], str]) -> str:
    """Compiled code is about to be keyed on the store's token (``read_token()``, read under this module's lock):
    where it moved since the choices were remembered (another process tuned, cleared or imported), forget those
    the store no longer backs, so that what the compile bakes is what the store answers under that key, and what
    a later process replays from Inductor's cache too. Kept: a choice whose row the store still holds as it was
    (this process's own tunes: the next graph of the compile pairs its backward with that forward), and one the
    ranks agreed on. Returns the token."""
    with _LOCK:
        token = read_token()
        if _STORE_TOKEN[0] != token:
            store = get_store()
            for key in [k for k in _MEMO if k not in _PINNED and not _still_stored(store, _ROWS.get(k))]:
                _forget_choice(key)
            _STORE_TOKEN[0] = token
        return token


def _forget_choice(key: tuple) -> None:
    """Drop the choice remembered for memo key ``key``: the next call of its bucket decides again."""
    _MEMO.pop(key, None)
    _ROWS.pop(key, None)
    _PROVISIONAL.pop(key, None)
    _PINNED.discard(key)


def _still_stored(store, row: dict | None) -> bool:
    """Whether the store still answers ``row`` (the one a choice was made from) for its key; False for none (a
    default taken without a decision, or a provisional one: the store may hold one now)."""
    now = None if row is None else store.get(row["key"])
    return now is not None and (now["winner"], now.get("created")) == (row["winner"], row.get("created"))


def failed_here() -> str:
    """The choices that failed at a launch in this process, as text for the FX graph cache key: a graph compiled
    before one failed bakes it, and must not be replayed after."""
    with _LOCK:
        return repr(sorted((repr(key), sorted(failed)) for key, failed in _FAILED.items()))


def default_choice(cands: list[Candidate]) -> str:
    for c in cands:
        if c.pruned is None:
            return c.name
    reasons = "; ".join(f"{c.name}: {c.pruned}" for c in cands)
    raise RuntimeError(f"no backend can run this problem: {reasons}")


def heuristic_choice(p: Problem, dev: DeviceInfo, cands: list[Candidate]) -> str:
    """First backend (prior order) whose hand rule names a runnable config; else the default."""
    runnable = {c.name for c in cands if c.pruned is None}
    for name in dict.fromkeys(c.backend for c in cands):
        backend = get_backend(name)
        cfg = backend.heuristic(p, dev)
        if cfg is not None and f"{backend.name}:{cfg}" in runnable:
            return f"{backend.name}:{cfg}"
    return default_choice(cands)


def _sources(cands: list[Candidate]) -> dict[str, str]:
    return {name: source_hash(get_backend(name)) for name in {c.backend for c in cands}}


def _fields(p: Problem, dev: DeviceInfo, direction: str, cands: list[Candidate], grad_lse: bool = False) -> dict:
    """The decision's row fields and key (store/keys.py): the backends of ``cands`` name the sources, the
    registered backends the library versions."""
    return decision_fields(p.op, _variant(direction, grad_lse), p, dev, _sources(cands), required_distributions())


def _capturing(call: AttnCall) -> bool:
    return call.q.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _variant(direction: str, grad_lse: bool = False) -> str:
    """Backward kernels behave differently under torch.use_deterministic_algorithms (no atomic dQ), and not
    every backward takes a gradient of the lse, so those backward decisions are kept apart."""
    if direction != "backward":
        return direction
    variant = "backward-deterministic" if torch.are_deterministic_algorithms_enabled() else direction
    return variant + "+dlse" if grad_lse else variant


def decide_uncached(call: AttnCall, dev: DeviceInfo, direction: str, grad_lse: bool = False,
                    failed: dict[str, str] | None = None) -> tuple[str, dict | None, str | None]:
    """The choice for ``call``, the store row behind it when a measurement backs it (else None), and the
    decision key when the choice is provisional (background mode, a tune is queued; else None).
    ``grad_lse``: a backward whose loss uses the lse too. ``failed``: choices that failed here (at a launch, or
    the gate of a decision not tuned here), with the reason, which count as pruned."""
    p = call.problem
    mode = current_mode(p.device_type)
    light = None
    if mode == "off" and not failed:
        first = _default_without_costly_imports(p, dev, direction, grad_lse)
        if first is not None:
            return first, None, None
    if mode not in ("off", "heuristic") and not failed:
        light = enumerate_candidates(p, dev, direction, grad_lse, lookup_only=True)
        if not any(c.pruned == LOOKUP_ONLY for c in light):
            light = None  # nothing was left out: the full way does the same work
    if light is not None:
        # the key names backends, not configs, so the lookup-only candidates give the full way's key
        fields = _fields(p, dev, direction, light, grad_lse)
        hit = _stored_without_costly_imports(light, fields)
        if hit is not None:
            return hit
        prior = shipped_match(get_store(), fields)
        if mode == "background" and not grad_lse and prior is not None:
            first = _background_without_costly_imports(call, light, fields, prior, direction)
            if first is not None:
                return first
        light = _shipped_without_costly_imports(call, dev, direction, grad_lse, light, prior)
    cands = light or enumerate_candidates(p, dev, direction, grad_lse)
    if failed:
        cands = [dataclasses.replace(c, pruned=f"failed here: {failed[c.name]}")
                 if c.pruned is None and c.name in failed else c for c in cands]
    if mode == "off":
        return default_choice(cands), None, None
    if mode == "heuristic":
        return heuristic_choice(p, dev, cands), None, None
    runnable = {c.name for c in cands if c.pruned is None}
    if len(runnable) == 1 and light is None:
        return default_choice(cands), None, None
    fields = _fields(p, dev, direction, cands, grad_lse)
    store = get_store()

    def stored() -> dict | None:
        return _usable(store.get(fields["key"]), runnable)

    row = stored()
    if row is not None:
        return row["winner"], row, None
    prior = shipped_match(store, fields)
    if prior is not None and prior["winner"] not in runnable:
        prior = None
    if mode == "cache-only" or _capturing(call):  # never measure inside a CUDA-graph capture
        return (prior["winner"], prior, None) if prior is not None else (default_choice(cands), None, None)
    if mode == "background" and not grad_lse:  # the worker tunes without a lse gradient: tune those here
        _schedule_tune(call, direction, fields["key"])
        choice = prior["winner"] if prior is not None else heuristic_choice(p, dev, cands)
        return choice, prior, fields["key"]
    try:
        row = tune_once(store, fields["key"], call.q.device, lookup=stored,
                        tune=lambda: _measure(call, cands, direction, fields, store, prior, grad_lse=grad_lse))
    except OutOfMemoryWhileTuning as err:
        choice = err.winner if err.winner and not err.winner.startswith("reference") else default_choice(cands)
        log.warning("inductor_attn: %s; nothing stored: %s runs %s in this process, unmeasured (tune it where the "
                    "device has room, e.g. before a server takes its cache)", err, choice, p)
        store.unmeasured()  # code compiled with this choice is not replayed by a later process, which tunes
        return choice, None, None
    return row["winner"], row, None


class OutOfMemoryWhileTuning(Exception):
    """A tune in which the device ran out of memory: what it measured says nothing about the kernels that could
    not run (a server's cache may hold most of the memory), so no decision is stored from it. ``winner``: the
    tune's, when it finished."""

    def __init__(self, message: str, winner: str | None = None):
        super().__init__(message)
        self.winner = winner


def _stored_without_costly_imports(light: list[Candidate], fields: dict) -> tuple[str, dict, None] | None:
    """The stored decision, found with ``light`` (the candidates enumerated without the backends whose
    enumeration imports a large library, FA4), when its winner is another backend's; else None (the full
    way follows). No other backend's pruning depends on theirs, so the answer is the one the full way
    gives, less an import that a process which never runs FA4 does not need. A winner of theirs goes the
    full way: running it imports it."""
    runnable = {c.name for c in light if c.pruned is None}
    row = _usable(get_store().get(fields["key"]), runnable)
    return None if row is None else (row["winner"], row, None)


def _default_without_costly_imports(p: Problem, dev: DeviceInfo, direction: str, grad_lse: bool) -> str | None:
    """The default candidate (first runnable in prior order) when no backend left out of the lookup-only
    enumeration comes before it; else None. ``off`` then imports no FA4 for problems it would not run."""
    for c in enumerate_candidates(p, dev, direction, grad_lse, lookup_only=True):
        if c.pruned == LOOKUP_ONLY:
            return None
        if c.pruned is None:
            return c.name
    return None


def _shipped_without_costly_imports(call: AttnCall, dev: DeviceInfo, direction: str, grad_lse: bool,
                                    light: list[Candidate], prior: dict | None) -> list[Candidate] | None:
    """The candidates to decide among when there is a shipped decision ``prior`` for the bucket: ``light``
    with the left-out backends (costly imports) that the decision names enumerated in full, in its shortlist
    (what an autotune times) or as its winner (what cache-only and background run), and those it never
    measured; the others stay left out. FA4's import (3-4 s on an H100 or H200, 2026-11) then stays out of a
    first compile that runs FA3's prebuilt kernel. None when there is no such decision or its winner cannot
    run here: the full enumeration follows."""
    if prior is None:
        return None
    left_out = {c.backend for c in light if c.pruned == LOOKUP_ONLY}
    named = {name.split(":")[0] for name in (*_shortlist_of(prior), prior["winner"])}
    needed = left_out & (named | _unmeasured_backends(prior))
    if needed:
        light = enumerate_candidates(call.problem, dev, direction, grad_lse, lookup_only=True,
                                     full=frozenset(needed))
    if prior["winner"] not in {c.name for c in light if c.pruned is None}:
        return None
    return [dataclasses.replace(c, pruned=NOT_ENUMERATED) if c.pruned == LOOKUP_ONLY else c for c in light]


def _background_without_costly_imports(call: AttnCall, light: list[Candidate], fields: dict, prior: dict,
                                       direction: str) -> tuple[str, None, str] | None:
    """Background mode's first answer when the shipped decision ``prior``'s winner is of a backend left out
    of ``light`` that compiles its kernels here (FA4): the fastest candidate of its record among the backends
    enumerated here. The first compile then neither imports FA4 nor waits for its JIT (together over 9 s on an
    H100, 2026-11-26); the background tune compiles FA4 in its worker and stores the decision that the next
    compile or process bakes. None when the winner is of a backend enumerated here or a prebuilt one (FA3,
    whose import is all it costs): the shipped winner then runs."""
    left_out = {c.backend for c in light if c.pruned == LOOKUP_ONLY}
    backend = prior["winner"].split(":")[0]
    if backend not in left_out or get_backend(backend).library.prebuilt:
        return None
    runnable = {c.name for c in light if c.pruned is None}
    choice = next((n for n in shortlist(prior, len(prior["record"]["candidates"])) if n in runnable), None)
    if choice is None:
        return None
    if _capturing(call):  # queueing saves the call's tensors (a copy to the host): the next call queues it
        return choice, None, None
    _schedule_tune(call, direction, fields["key"])
    return choice, None, fields["key"]


def _schedule_tune(call: AttnCall, direction: str, key: str) -> None:
    """Queue background mode's tune of ``key``; only buckets without a lse gradient come here, since the
    worker tunes without one."""
    background.schedule(call, direction, key, _variant(direction) == "backward-deterministic")


def _usable(row: dict | None, runnable: set[str]) -> dict | None:
    """``row`` if it is a measured decision (not a shipped one) whose winner can run here, else None."""
    return row if row is not None and not is_shipped(row) and row["winner"] in runnable else None


def _measure(call: AttnCall, cands: list[Candidate], direction: str, fields: dict, store, prior: dict | None,
             search: str | None = None, grad_lse: bool = False) -> dict:
    """Tune and store; with a shipped decision, only its shortlist is measured (the whole search when none of
    the shortlist runs here)."""
    note, every = "", cands
    if prior is not None:
        cands, note = _shortlisted(cands, prior)
    runnable = sum(c.pruned is None for c in cands)
    # autograd runs a bucket's forward before its backward: the backward's gate takes that forward's out and lse
    dev = device_info(call.q.device)
    forward = None if direction == "forward" else _MEMO.get(_memo_key(call, dev, "forward", False))
    with progress_ticker(f"tuning {call.problem.op} {direction}", total=runnable + default_rounds()) as tick:
        try:
            result = tune(call, cands, direction=direction, progress=tick,
                          search="exhaustive" if note else search, note=note, grad_lse=grad_lse, forward=forward)
        except NoCandidateRan:
            if not note:
                raise
            result = None
        except torch.OutOfMemoryError as err:
            raise OutOfMemoryWhileTuning(f"tuning {call.problem} ran out of device memory ({describe(err)})") from err
    short = [c.name for c in (result.candidates if result is not None else ())
             if c.status == "failed" and (c.reason or "").startswith(f"{torch.OutOfMemoryError.__name__}:")]
    if short:
        raise OutOfMemoryWhileTuning(f"tuning {call.problem} ran out of device memory in {', '.join(short)}",
                                     result.winner)
    if result is None:
        log.warning("none of the shipped decision's shortlist ran here; searching every candidate")
        if any(c.pruned == NOT_ENUMERATED for c in every):
            every = enumerate_candidates(call.problem, dev, direction, grad_lse)
        return _measure(call, every, direction, fields, store, None, search, grad_lse)
    row = {**fields, "winner": result.winner, "record": result.to_json(), "created": time.time()}
    store.put(row)
    _TUNED_HERE.add(_tuned_here_key(row))
    return row


def measure(call: AttnCall, direction: str = "forward", search: str | None = None) -> dict | None:
    """Tune ``call``'s bucket now, whatever the store and the shipped tables hold, and store the decision
    (``cache export-priors --tune`` measures the tables this way); None when only one candidate runs."""
    p, dev = call.problem, device_info(call.q.device)
    cands = enumerate_candidates(p, dev, direction)
    if sum(c.pruned is None for c in cands) < 2:
        return None
    fields = _fields(p, dev, direction, cands)
    store = get_store()
    return on_device(store, call.q.device, lambda: _measure(call, cands, direction, fields, store, None, search))


def _shortlisted(cands: list[Candidate], prior: dict) -> tuple[list[Candidate], str]:
    """``cands`` with all but the shipped decision's shortlist (priors.py) pruned, and what was done;
    ``cands`` unchanged when none of the shortlist runs here."""
    origin = prior["record"].get("origin", "a shipped decision")
    top = set(_shortlist_of(prior))
    keep = {c.name for c in cands if c.pruned is None and c.name in top}
    if not keep:
        return cands, ""
    floor_s = SHORTLIST_COMPILE_FACTOR * SHORTLIST_COMPILE_FLOOR_S
    scope = (f"within {SHORTLIST_MARGIN:.0%} of the winner of the shipped decision and compiling within "
             f"{SHORTLIST_COMPILE_FACTOR:g}x its time, at least {floor_s:g} s (at most {SHORTLIST}, and each other "
             f"backend's fastest within {SHORTLIST_MARGIN:.0%} plus the record's noise; {origin})")
    # a table cannot shortlist a backend it never measured (one installed or added after it was made): each
    # such backend's first runnable candidate (its own pick: configs come in its order) is timed too
    unmeasured = _unmeasured_backends(prior)
    new = {}
    for c in cands:
        if c.pruned is None and c.backend in unmeasured:
            new.setdefault(c.backend, c.name)
    if new:
        keep |= set(new.values())
        scope += f", and the first candidate of each backend it never measured ({', '.join(sorted(new))})"
    why = f"not timed again: not {scope}"
    shortened = [c if c.name in keep or c.pruned else dataclasses.replace(c, pruned=why) for c in cands]
    return shortened, f"the candidates {scope}, timed here"


def _unmeasured_backends(prior: dict) -> set[str]:
    """Registered backends whose distributions are installed here and that ``prior`` could not measure: not
    registered where it was made (not among its versions' backend sources; a row without them: not named in its
    record), or with a distribution absent there. A record names such a backend too, as pruned ("not
    importable"): counted as measured, a table made without FA3's wheel would never time FA3 where it is
    installed. Versions are read from package metadata: no backend is imported."""
    versions = prior.get("versions") or {}
    registered = versions.get("sources") or {c["name"].split(":")[0] for c in prior["record"]["candidates"]}
    unmeasured = set()
    for b in backends():
        here = library_versions(b.library.distributions)
        if ABSENT in here.values():
            continue
        if b.name not in registered or any(versions.get(d, ABSENT) == ABSENT for d in b.library.distributions):
            unmeasured.add(b.name)
    return unmeasured


def _shortlist_of(prior: dict) -> list[str]:
    return shortlist(prior, SHORTLIST, SHORTLIST_MARGIN, SHORTLIST_COMPILE_FACTOR, rivals=True)


def tune_in_worker(call: AttnCall, direction: str, key: str, deterministic: bool) -> str:
    """Background mode's tune, in a worker process (worker.py): measure the bucket under the device claim
    (its parent holds the claim on ``key``) and store the decision; returns the winner. Raises
    RuntimeError when this process computes another key than ``key``: its parent registered backends at
    run time, or has other versions."""
    p, dev = call.problem, device_info(call.q.device)
    torch.use_deterministic_algorithms(deterministic)
    cands = enumerate_candidates(p, dev, direction)
    fields = _fields(p, dev, direction, cands)
    if fields["key"] != key:
        raise RuntimeError(f"the worker's decision key differs from the parent's ({fields['key'][:12]} vs "
                           f"{key[:12]}): backends registered at run time, or other library versions, are not "
                           f"seen here (registered: {', '.join(sorted(_sources(cands)))})")
    store = get_store()
    row = store.get(key)
    if row is None or is_shipped(row):
        prior = shipped_match(store, fields)
        row = on_device(store, call.q.device, lambda: _measure(call, cands, direction, fields, store, prior))
    return row["winner"]


def decide(call: AttnCall, dev: DeviceInfo, direction: str, grad_lse: bool = False) -> str:
    """The candidate (``backend:config``) that runs ``call``; see the module doc. ``grad_lse``: a backward whose
    loss uses the lse too."""
    key = _memo_key(call, dev, direction, grad_lse)
    choice = _MEMO.get(key)
    if choice is not None and key not in _PROVISIONAL:
        return choice
    with _measuring(call.problem.device_type):
        if key in _PROVISIONAL:
            _recheck(key)
        if key not in _MEMO:
            agreed = _adopted(call, dev, direction, grad_lse, key)
            choice, row, pending = ((*agreed, None) if agreed
                                    else decide_uncached(call, dev, direction, grad_lse, _FAILED.get(key)))
            while row is not None and (reason := _checked_here(call, direction, grad_lse, choice, row)):
                if reason is _NOT_NOW:  # inside a CUDA-graph capture: not remembered, checked at the next call
                    if agreed:
                        _AGREED[key] = agreed  # what the ranks agreed on still answers that call
                    return choice
                _FAILED.setdefault(key, {})[choice] = reason
                log.warning("inductor_attn: %s, decided for %s by a decision not tuned in this process, is not "
                            "used here: %s", choice, call.problem, reason)
                choice, row, pending = decide_uncached(call, dev, direction, grad_lse, _FAILED[key])
            if row is None and pending is None and not agreed and _capturing(call):
                return choice  # nothing measured may run inside a capture: not remembered, decided at the next call
            if row is not None:
                _ROWS[key] = row
            if pending is not None:
                _PROVISIONAL[key] = [time.monotonic() + RECHECK_S, pending]
            if agreed and choice == agreed[0]:
                _PINNED.add(key)
            _MEMO[key] = choice
        return _MEMO[key]


def decide_with_record(call: AttnCall, dev: DeviceInfo, direction: str,
                       grad_lse: bool = False) -> tuple[str, dict | None]:
    """``decide``'s choice and the tune record behind it (None where nothing was measured): compiled code
    weighs the record's device and host times for its graph (step_cost.py)."""
    choice = decide(call, dev, direction, grad_lse)
    row = _ROWS.get(_memo_key(call, dev, direction, grad_lse))
    return choice, None if row is None or row["winner"] != choice else row["record"]


def check_choice(call: AttnCall, dev: DeviceInfo, direction: str, choice: str, grad_lse: bool = False) -> str | None:
    """Why ``choice``, another candidate of the record behind ``call``'s decision (compiled code's pick for its
    graph), must not run here, or None: a record not tuned in this process is gated here first."""
    with _measuring(call.problem.device_type):  # the gate runs candidates
        row = _ROWS.get(_memo_key(call, dev, direction, grad_lse))
        reason = None if row is None else _checked_here(call, direction, grad_lse, choice, row)
    return None if reason is _NOT_NOW else reason


_NOT_NOW = "inside a CUDA-graph capture: not gated now"


def _checked_here(call: AttnCall, direction: str, grad_lse: bool, choice: str, row: dict) -> str | None:
    """None if ``choice`` of decision ``row`` may run here: the row was tuned in this process, or the choice
    passed the gate here (once per process); else why not (``_NOT_NOW`` inside a CUDA-graph capture, where
    nothing can be run to check it)."""
    if _tuned_here_key(row) in _TUNED_HERE:
        return None
    verdict_key = (row["key"], choice)
    if verdict_key not in _GATED:
        if _capturing(call):
            return _NOT_NOW
        start = time.perf_counter()
        result = gate_once(call, choice, direction, grad_lse)
        _GATED[verdict_key] = None if result.status == "passed" else f"the correctness check: {result.reason}"
        log.info("inductor_attn: gated %s for %s (decision %s, not tuned in this process) in %.2f s: %s", choice,
                 call.problem, row["key"][:12], time.perf_counter() - start, result.status)
    return _GATED[verdict_key]


def _tuned_here_key(row: dict) -> tuple:
    return row["key"], row["winner"], row.get("created")


def _memo_key(call: AttnCall, dev: DeviceInfo, direction: str, grad_lse: bool) -> tuple:
    # the registry's generation: a choice remembered before a backend was registered or removed is not one now
    return (_variant(direction, grad_lse), call.problem.bucket(), dev.key(), current_mode(call.problem.device_type),
            registry_state["generation"])


def give_way(call: AttnCall, dev: DeviceInfo, direction: str, choice: str, err: Exception,
             grad_lse: bool = False) -> bool:
    """``choice``, decided here for ``call``, raised ``err`` at its launch. If ``err`` is one of the errors
    that mean "cannot run here" for its backend, the choice is dropped for its bucket in this process (one
    warning) and True is returned: the caller decides again and gets the next runnable candidate. False
    for any other error (a bug, to raise), for the reference, which has no successor, for running out of
    device memory, which says nothing about the kernel, and for an error that left the CUDA context unusable
    (every candidate after it would fail the same way)."""
    try:
        backend = get_backend(choice.partition(":")[0])
    except ValueError:  # no longer registered: the error the caller got says so, and nothing here can recover
        return False
    if (backend.name == "reference" or isinstance(err, torch.OutOfMemoryError)
            or not is_candidate_error(err, backend) or device_error(call.q.device) is not None):
        return False
    with _LOCK:
        key = _memo_key(call, dev, direction, grad_lse)
        _FAILED.setdefault(key, {})[choice] = f"at a launch: {describe(err)}"
        if _MEMO.get(key) == choice:
            _forget_choice(key)
    log.warning("inductor_attn: %s failed at its launch on %s (%s); the next candidate runs this bucket in this "
                "process", choice, call.problem, describe(err))
    return True


def _recheck(key: tuple) -> None:
    """A provisional decision gives way once its tune has landed in the store: the bucket is decided again from the
    stored row, whose winner is gated here first (a worker, or another process, tuned it)."""
    due, decision_key = _PROVISIONAL[key]
    if time.monotonic() < due:
        return
    row = get_store().get(decision_key)
    if row is None or is_shipped(row):
        _PROVISIONAL[key][0] = time.monotonic() + RECHECK_S
        return
    _forget_choice(key)


def _adopted(call: AttnCall, dev: DeviceInfo, direction: str, grad_lse: bool,
             key: tuple) -> tuple[str, dict | None] | None:
    """The choice sync_decisions agreed on for ``key``, if this rank can run it."""
    agreed = _AGREED.pop(key, None)
    if agreed is None:
        return None
    runnable = {c.name for c in enumerate_candidates(call.problem, dev, direction, grad_lse) if c.pruned is None}
    if agreed[0] in runnable:
        return agreed
    log.warning("inductor_attn: the choice the ranks agreed on, %s, cannot run %s here; this rank decides "
                "on its own", agreed[0], call.problem)
    return None


def sync_decisions(group=None) -> int:
    """Make every rank of ``group`` (default: the world) run the same kernel for every bucket that any
    rank has decided so far. A collective: call it at a point that every rank reaches, such as after a
    warm-up step. Under NCCL, set each rank's CUDA device first, as for any object collective.

    Each rank's in-memory decisions are all-gathered, and for each bucket every rank adopts the one of
    the lowest rank whose decision a measurement backs (else of the lowest rank; see ``ranks.agree``). The
    adopted row is written to this rank's store when the store holds another winner, so the next
    process on this node starts from it.

    Run-time decisions (eager calls, dynamic shapes, varlen, block masks, kv_seqlens) follow the agreed
    choice from the next call, on ranks that meet the bucket only later too. Code already compiled with
    another choice baked in keeps it until it is recompiled; the recompile bakes the agreed one, and the
    FX-graph-cache guard, which hashes the store's revision, never replays the old code after the
    store changed. A rank where the agreed kernel cannot run (another set of libraries installed)
    keeps its own decision and logs a warning.

    Returns how many of this rank's decisions changed. Without torch.distributed, or with one rank,
    does nothing and returns 0.
    """
    agreed = agreed_across(decision_entries(), group)
    return 0 if agreed is None else adopt_decisions(agreed)


def decision_entries() -> list[tuple]:
    """This process's decisions as ``(memo key, choice, row or None)``, for sync_decisions: a row only where a
    tune backs the choice (a shipped table's is a guess from another machine, and lives in its table only)."""
    with _LOCK:
        entries = [(key, choice, _ROWS.get(key)) for key, choice in _MEMO.items()]
        entries += [(key, choice, row) for key, (choice, row) in _AGREED.items()]
        return [(key, choice, None if row is None or is_shipped(row) else row) for key, choice, row in entries]


def adopt_decisions(agreed: dict[tuple, tuple[str, dict | None]]) -> int:
    """Make ``agreed`` (memo key -> choice, row) this process's decisions, and write each row to the
    store where the store holds another winner. Returns how many decisions of this process changed."""
    store = get_store()
    changed = set()
    with _LOCK:
        for key, (choice, row) in agreed.items():
            if row is not None and (store.get(row["key"]) or {}).get("winner") != row["winner"]:
                store.put(row)
            if _MEMO.get(key) == choice:
                if row is not None:
                    _ROWS[key] = row
                _PROVISIONAL.pop(key, None)  # as below: a background tune's later result must not move it
                _PINNED.add(key)
                continue
            if key in _MEMO:
                changed.add(key)
            _forget_choice(key)  # the agreed choice stands, not a background tune's later result
            _AGREED[key] = (choice, row)
    return len(changed)
