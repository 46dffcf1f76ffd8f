"""A worker process's side of subproc.py: ``python -m inductor_attn.tuning.worker`` answers the parent's
requests (subproc.py's module doc has the protocol) until its stdin closes."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

from ..backends import Candidate, backends, plan_for
from ..device import device_info
from ..store.db import get_store
from .decisions import tune_in_worker
from .measure import Direction, describe, device_error, is_candidate_error, sync
from .subproc import load_call

log = logging.getLogger(__name__)


def _compile(req: dict) -> dict:
    call = load_call(Path(req["call"]))
    mode = Direction(req["direction"], call)
    plan = plan_for(call.problem, req["choice"], device_info(call.q.device), req["direction"])
    start = time.perf_counter()
    if plan.compile is not None:
        mode.compile(plan, call)
    else:
        mode.run(plan, call)
    sync(call.q.device)
    return {"seconds": time.perf_counter() - start}


def _tune(req: dict) -> dict:
    call = load_call(Path(req["call"]))
    winner = tune_in_worker(call, req["direction"], req["key"], req["deterministic"])
    return {"winner": winner, "row": get_store().get(req["key"])}


def _error(err: Exception, req: dict) -> dict:
    """The error reply; with ``lost`` when the error left this worker's CUDA context unusable (it then
    exits, and the parent starts another worker for what comes next)."""
    name = Candidate.split(req["choice"])[0] if req.get("choice") else None
    backend = next((b for b in backends() if b.name == name), None)
    reply = {"error": describe(err), "bug": backend is None or not is_candidate_error(err, backend)}
    if torch.cuda.is_initialized() and device_error(torch.device("cuda", torch.cuda.current_device())):
        reply["lost"] = True
    return reply


def load_costly_libraries() -> None:
    """What a worker imports before it says ready, beyond this module's imports: the backends' costly libraries,
    which its first compile would pay otherwise (FA4's CuTe DSL: about 3 s)."""
    for backend in backends():
        if backend.library.costly_import:
            backend.library.load()


def answer(req: dict) -> dict:
    """One request's reply. The memory the request took and freed goes back to the driver before it
    (``empty_cache``): an idle worker waits beside the user's program (up to a minute: precompile.IDLE_S,
    background.IDLE_S), and should not hold the cached blocks of the largest call it compiled or tuned there.
    What a library keeps on purpose stays (cuBLAS's workspace, a kept FA4 backward scratch: backends/replay.py).
    A CUDA error there (a context lost on another device than the one :func:`_error` looked at) makes the reply
    ``lost``, so that the worker exits after it."""
    try:
        reply = {"compile": _compile, "tune": _tune}[req["op"]](req)
    except Exception as err:  # noqa: BLE001 - reported to the parent, which decides what it means
        reply = _error(err, req)
    if torch.cuda.is_initialized() and not reply.get("lost"):  # a lost context frees nothing more
        try:
            torch.cuda.empty_cache()
        except Exception as err:  # noqa: BLE001 - a sticky CUDA error: every later request would fail too
            log.warning("inductor_attn worker: freeing cached memory failed, exiting after this reply: %s", err)
            reply = {**reply, "lost": True}
    return reply


def main() -> int:
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # print() and C libraries write to stderr
    sys.stdout = sys.stderr
    load_costly_libraries()
    protocol.write(json.dumps({"id": 0, "ready": True}) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        reply = answer(req)
        protocol.write(json.dumps({"id": req["id"], **reply}) + "\n")
        if reply.get("lost"):
            return 1  # every later request would fail with the same sticky CUDA error
    return 0


if __name__ == "__main__":
    sys.exit(main())
