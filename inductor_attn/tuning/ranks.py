"""Many processes, many ranks: tune each bucket once per store, and agree only where every rank meets.

A decision never issues a collective. Ranks meet different problems (varlen lengths, kv_seqlens, block
masks, dynamic shapes) and recompile at different times, so a collective on the decision path pairs
with another rank's collective for another bucket, or waits for a partner that never comes. Instead:

- **Claims** (``tune_once``): processes that share a store file (the ranks of one node) tune each bucket
  once. The first to miss the store claims the bucket's key in the store's ``claims`` table; the others
  wait for its decision to appear and use it, so tuning cost is not multiplied by the ranks per node.
  A claim is ignored when its process is dead (same host; a zombie, killed but not yet reaped, counts as
  dead) or older than ``INDUCTOR_ATTN_CLAIM_TIMEOUT_S`` (default 300 s; one cold tune took 10-55 s on an
  H200, issue 16), and no rank waits longer than that for one claim: then it tunes itself and says so.
- **One measurer per device**: ranks tune different buckets at once when they run on different GPUs,
  but ranks sharing one GPU (same CUDA device UUID) or measuring on the CPU of one host take turns
  through a second claim, ``device:<host>:<uuid>``: concurrent kernels would skew each other's timings.
- **Tie-break**: within a tune, candidates whose CI does not exclude the default, or whose median is
  within the tie margin of the fastest, go by prior order (``tuner._choose``); the margin is the larger
  of ``tuner.TIE_MARGIN`` and the noise measured between timing sessions when the top two are close
  (tuner.py, step 5). So independent tunes on separate stores (separate nodes) mostly agree; they may
  still differ where a lead is just above the noise one of them measured.
- **Background mode** (background.py): a rank that misses the store runs the best known choice at
  once and queues the bucket; the first rank to take the bucket's claim has its worker process tune it
  (under the device claim), while the others skip it (``try_claim``) and read the decision from the
  shared store once it lands, at their next run-time decision or compile. Until then ranks may run
  different kernels for a bucket, all checked against the reference; ``sync_decisions()`` aligns them.
- **sync_decisions()** (decisions.py, over :func:`agreed_across`): an explicit collective that users call where
  every rank provably arrives; afterwards every rank runs the same choice for every bucket that any rank had
  decided.
"""

from __future__ import annotations

import logging
import os
import socket
import time

import torch

from .settings import env_number

log = logging.getLogger(__name__)

TIMEOUT_ENV = "INDUCTOR_ATTN_CLAIM_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0
POLL_S = 0.1  # a read and a short write transaction per poll: negligible next to a tune (seconds on a GPU)
_HOST = socket.gethostname()


def claim_timeout_s() -> float:
    return env_number(TIMEOUT_ENV, DEFAULT_TIMEOUT_S, float, lambda x: x > 0, "a positive number of seconds")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        pass
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    """Killed or exited, but not yet reaped by its parent: ``kill(pid, 0)`` still finds it (Linux's /proc
    says so; elsewhere it counts as alive until the claim times out)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:][:1] == b"Z"  # the state follows the command name, which may hold ")"


def _stale(holder: dict, timeout_s: float) -> bool:
    """A holder that can no longer deliver: past the timeout, or dead (checkable on this host only)."""
    if time.time() - holder["created"] >= timeout_s:
        return True
    return holder["host"] == _HOST and not _alive(holder["pid"])


def _acquire(store, name: str, what: str, found=lambda: None):
    """Wait until the claim ``name`` is ours (returns None) or ``found()`` returns a decision while a live
    process holds it (returns that decision). Never longer than the claim timeout in total."""
    timeout_s = claim_timeout_s()
    deadline = time.monotonic() + timeout_s
    holder = store.claim(name, _HOST, os.getpid(), lambda h: _stale(h, timeout_s))
    if holder is None:
        return None
    log.info("inductor_attn: waiting for %s, which pid %d on %s started %.1f s ago (at most %.0f s, %s)",
             what, holder["pid"], holder["host"], time.time() - holder["created"], timeout_s, TIMEOUT_ENV)
    while True:
        decision = found()
        if decision is not None:
            return decision
        time.sleep(POLL_S)
        gave_up = time.monotonic() >= deadline
        if store.claim(name, _HOST, os.getpid(), lambda h: gave_up or _stale(h, timeout_s)) is None:
            if gave_up:
                log.warning("inductor_attn: waited %.1f s (%s) for %s by pid %d on %s; going ahead here",
                            timeout_s, TIMEOUT_ENV, what, holder["pid"], holder["host"])
            return None


def device_token(device: torch.device) -> str:
    """Names the hardware that timings on ``device`` share: the GPU's UUID (the same under any
    CUDA_VISIBLE_DEVICES numbering), or this host's CPU."""
    if device.type != "cuda":
        return f"{_HOST}:{device.type}"
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    if uuid is None:  # every GPU of the host counts as one: slower (turns), never skewed
        return f"{_HOST}:cuda"
    # str() is nvidia-smi's UUID without "GPU-", the same in every process (torch 2.11, H100)
    return f"{_HOST}:{uuid}"


def tune_once(store, key: str, device: torch.device, lookup, tune):
    """The decision for ``key``: ``lookup()``'s (the store's) when it has one or another process stores
    one while we wait; else ``tune()``'s, measured while this process holds the claims on ``key`` and on
    the device."""
    decision = _acquire(store, key, f"the tune of decision {key[:12]}", found=lookup)
    if decision is not None:
        return decision
    try:
        decision = lookup()  # the last tuner may have stored it between our last look and our claim
        if decision is not None:
            return decision
        return on_device(store, device, tune)
    finally:
        store.release(key, _HOST, os.getpid())


def on_device(store, device: torch.device, measure):
    """``measure()``'s result, called while this process holds the claim on ``device``'s hardware."""
    token = f"device:{device_token(device)}"
    _acquire(store, token, f"measurements on {token}")
    try:
        return measure()
    finally:
        store.release(token, _HOST, os.getpid())


def try_claim(store, key: str) -> bool:
    """Take the claim on ``key`` unless a live process holds it; never waits (background tuning: the
    holder's decision will land in the store). Release it with ``release_claim``."""
    timeout_s = claim_timeout_s()
    return store.claim(key, _HOST, os.getpid(), lambda h: _stale(h, timeout_s)) is None


def release_claim(store, key: str) -> None:
    store.release(key, _HOST, os.getpid())


def agree(per_rank: list[list[tuple]]) -> dict:
    """One ``(choice, row)`` per memo key from every rank's ``(key, choice, row)`` entries (index = rank):
    the lowest rank whose decision a stored measurement backs (``row`` not None), else the lowest rank.

    Measured before unmeasured, so a default taken without a tune (cache-only miss, CUDA-graph capture)
    never outvotes a tune. Among measured ones, rank order and not timings: each rank timed its own GPU
    under its own load, and a record's speedups are relative to its own default, so comparing them
    across ranks would pick on noise; any fixed order is as good and is visibly the same on every rank.

    >>> agree([[("k", "b:x", None)], [("k", "a:y", {"winner": "a:y"}), ("j", "c:z", None)]])
    {'k': ('a:y', {'winner': 'a:y'}), 'j': ('c:z', None)}
    """
    agreed: dict = {}
    for entries in per_rank:
        for key, choice, row in entries:
            if key not in agreed or (agreed[key][1] is None and row is not None):
                agreed[key] = (choice, row)
    return agreed


def agreed_across(entries: list[tuple], group=None) -> dict | None:
    """What every rank of ``group`` (default: the world) adopts: each rank's ``(key, choice, row)`` entries,
    all-gathered, then :func:`agree`. A collective (decisions.sync_decisions calls it); None without
    torch.distributed or with one rank."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return None
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, entries, group=group)
    return agree(gathered)
