"""Background tuning (``INDUCTOR_ATTN_MODE=background``): a compile never waits for a measurement.

On a miss, decisions.py answers at once with the best choice known without measuring (the shipped
decision's winner, or its fastest candidate of another backend when the winner is FA4's, whose import
and JIT compile would hold the compile; else the hand rule, else the default) and queues the bucket here.
One daemon thread per process works through the queue: it claims the bucket's key in the store
(ranks.py) and has a worker process (subproc.py) tune the bucket under the device claim and store the
decision; a bucket that a live process has claimed is left to it, since its decision lands in the same
store, and looked at again after the others queued: where that process lets go without a decision (its
worker died), this one tunes it. A forked child starts its own thread and worker.

The tune runs in another process rather than a thread of this one, so that it holds none of the job's
GIL and never allocates, synchronizes or captures a CUDA graph in it: while this process captures a
graph (``mode="reduce-overhead"``), those calls from another thread would break the capture. Its timings
are taken while the job runs on the same GPU, so they are noisier; the tuner measures that noise and
decides ties by prior order inside it (tuner.py, step 5).

When the decision lands: run-time decisions of this process switch at their next call after the store
shows it (checked at most once a second, decisions.py); compiled code keeps the choice it baked until it
is compiled again, and under this mode the FX-graph-cache guard hashes the store's generation (every
write changes it), so the next compile bakes the new choice instead of replaying the old one; a new
process reads it from the store.

The worker answers with the decision it stored, which this process stores too where its own writable
store lacks it: where no store file can be written, each process keeps new decisions in its own memory.

The worker takes this process's ``INDUCTOR_ATTN_*`` settings when it starts; a tune after they changed
(another store directory) goes to a new worker. It sees the backends that importing inductor_attn
registers. A decision whose candidates include a backend registered at run time (``register_backend``)
gets another key in the worker, which then refuses it with a warning here; such buckets keep their first
choice (use ``autotune`` for them).
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import tempfile
import threading
import time
from pathlib import Path

from ..store.db import get_store
from ..store.priors import is_shipped
from .ranks import claim_timeout_s, release_claim, try_claim
from .subproc import Worker, WorkerError, save_call, settings_env

log = logging.getLogger(__name__)

IDLE_S = 60.0  # the worker holds a CUDA context: it exits when no tune came for this long
RETRY_S = 1.0  # between looks at a bucket another process is tuning

_QUEUE: queue.Queue = queue.Queue()
_SCHEDULED: set[str] = set()  # decision keys queued by this process (each is tuned at most once)
_LOCK = threading.Lock()
_STATE: dict = {"thread": None, "worker": None}


def _after_fork_in_child() -> None:
    """A forked child has no tuning thread (only the forking thread survives a fork) and shares its parent's
    worker pipes: it starts its own of both when it next queues a tune. The parent's queue is the parent's."""
    global _QUEUE, _LOCK
    _QUEUE, _LOCK = queue.Queue(), threading.Lock()
    _SCHEDULED.clear()
    _STATE.update(thread=None, worker=None)


os.register_at_fork(after_in_child=_after_fork_in_child)


def schedule(call, direction: str, key: str, deterministic: bool) -> bool:
    """Queue a background tune of ``call``'s bucket, stored under decision ``key``; False if this process
    had queued it already, or it could not be queued (logged; the caller's call goes on with its first
    choice). The call's index tensors are copied now: the caller may reuse them."""
    with _LOCK:
        if key in _SCHEDULED:
            return False
        _SCHEDULED.add(key)
        if _STATE["thread"] is None:
            _STATE["thread"] = threading.Thread(target=_loop, name="inductor_attn-background-tuning", daemon=True)
            _STATE["thread"].start()
    tmp = None
    try:
        tmp = Path(tempfile.mkdtemp(prefix="inductor_attn_background_"))
        save_call(call, tmp / "call.pt")
    except (OSError, RuntimeError) as err:  # a full disk: torch.save raises RuntimeError ("basic_ios::clear")
        log.warning("inductor_attn: background tune of decision %s could not be queued (%s: %s); this process "
                    "keeps its first choice for the bucket", key[:12], type(err).__name__, err)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        return False
    _QUEUE.put((key, direction, deterministic, tmp))
    return True


def _loop() -> None:
    while True:
        try:
            item = _QUEUE.get(timeout=IDLE_S)
        except queue.Empty:
            _close_worker()
            item = _QUEUE.get()
        key, direction, deterministic, tmp = item
        again = False
        try:
            again = _tune(key, direction, deterministic, tmp / "call.pt")
        except (OSError, TimeoutError, WorkerError) as err:
            log.warning("inductor_attn: background tune of decision %s failed: %s", key[:12], err)
        except Exception:  # noqa: BLE001 - this thread tunes every later bucket of the process: it must go on
            log.exception("inductor_attn: background tune of decision %s failed (a bug, please report)", key[:12])
        finally:
            if again:  # after the others queued: they need not wait for another process's tune
                time.sleep(RETRY_S)
                _QUEUE.put(item)
            else:
                shutil.rmtree(tmp, ignore_errors=True)
            _QUEUE.task_done()


def _tune(key: str, direction: str, deterministic: bool, path: Path) -> bool:
    """Tune ``key`` in the worker and store the row; True where another process holds its claim: it is tried
    again later, since that process may end without storing a decision (its worker died)."""
    store = get_store()
    if not try_claim(store, key):
        row = store.get(key)
        waiting = row is None or is_shipped(row)
        if waiting:
            log.info("inductor_attn: decision %s is being tuned by another process; its result will be used",
                     key[:12])
        return waiting
    try:
        row = store.get(key)
        if row is not None and not is_shipped(row):
            return False
        reply = _worker().request("tune", claim_timeout_s(), call=str(path), direction=direction, key=key,
                                  deterministic=deterministic)
        if reply.get("lost"):
            _STATE["worker"] = None  # it exited with its CUDA context: the next tune starts another
        if "error" in reply:
            log.warning("inductor_attn: background tune of decision %s failed: %s", key[:12], reply["error"])
            return False
        log.info("inductor_attn: background tune of decision %s chose %s", key[:12], reply["winner"])
        if reply["row"] is not None and store.writable.get(key) is None:
            store.put(reply["row"])  # the worker's writable store is not ours: each process's own memory
        return False
    except (TimeoutError, WorkerError):
        _STATE["worker"] = None  # killed or dead: the next tune starts another
        raise
    finally:
        release_claim(store, key)


def _worker():
    worker = _STATE["worker"]
    if worker is not None and worker.alive and worker.settings != settings_env():
        _close_worker()  # started under other settings (another store): its tunes would land there
        worker = None
    if worker is None or not worker.alive:
        worker = _STATE["worker"] = Worker()
    return worker


def _close_worker() -> None:
    worker, _STATE["worker"] = _STATE["worker"], None
    if worker is not None:
        worker.close()


def wait(timeout_s: float | None = None) -> bool:
    """Block until every queued tune of this process is done (tests, benchmarks, scripts that want the
    decisions stored before they exit); False if ``timeout_s`` passed first."""
    done = threading.Event()

    def join():
        _QUEUE.join()
        done.set()

    threading.Thread(target=join, daemon=True).start()
    return done.wait(timeout_s)

