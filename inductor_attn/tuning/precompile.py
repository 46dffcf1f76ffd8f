"""Compile every candidate of a stage before its gate, each failure with its reason.

JIT compilation is most of a cold tune (issue 16: seven problems took 140 s with cold kernel caches and
14 s with warm ones, H200), so before a stage's gate (tuner.py):

- plans with ``Plan.compile`` (Triton: ``kernel.warmup``) compile in threads of this process, as Inductor's
  max-autotune precompiles its template choices (select_algorithm.py, ``make_precompile_fn``), while worker
  processes compile the candidates below. Triton's compiler releases the GIL: six Triton flash configs compiled for
  sm_90 in 6.5 s one after another and 3.4 s in two threads on two cores (Triton 3.9, 2026-11-30); on an H200
  (Python 3.12.3, Triton 3.6) the first ``generate_batch`` call of transformers' continuous batching, which tunes
  its buckets, took 30.5 s against 51-65 s one at a time (the paged suite's client). Two threads that compile the
  first configs of one kernel at once may each build Triton's per-device cache of it, and the compiled kernels
  stored in the one that loses are dropped: the gate's first call loads them from Triton's disk cache. On Pythons
  whose ``ast`` parser is not thread-safe (3.11 up to 3.11.8, 3.12.0-3.12.1: cpython#106905, a ``SystemError`` when
  a garbage collection runs Python code during a parse; Inductor's precompile threads are off there too) they
  compile one at a time;
- plans without it, of backends whose library has ``compiles_to_disk`` (FA4: its CuTe DSL front end is Python that
  holds the GIL, and a recorded first launch holds backends/replay.py's lock), compile in worker processes
  (subproc.py), as Inductor compiles its generated kernels in a pool of subprocesses
  (async_compile.py): each worker runs the candidate's first launch, which leaves the kernels in the
  disk cache that this process's first launch then loads. A fresh worker's start (an interpreter, a CUDA
  context, the imports) and its first compile cost more than a few compiles here, so fewer than
  ``MIN_WORKER_JOBS`` jobs compile in this process (their first launch, as the gate would make it)
  unless a worker is idle. A worker takes a job only once it is ready; meanwhile this process compiles
  the jobs left, so a slow start delays nothing. The staged search starts workers while its stage 1 runs
  (tuner.py), and workers stay for ``IDLE_S`` after their last compile, so a burst of problems starts
  them once;
- other plans (SDPA's aten ops, flex's torch.compile) compile at their first call in the gate.

``INDUCTOR_ATTN_COMPILE_WORKERS`` caps the compile threads and, apart, the worker processes (default: the cores
this process may use, split among the ranks of the node, at most 8; 0 compiles every candidate at its first call);
``INDUCTOR_ATTN_COMPILE_TIMEOUT_S`` (default 60 s; a compile took 1-3 s on an H200) bounds each
candidate's compile in a worker: one that times out drops its candidate with that reason and its worker is
killed. A compile in a thread of this process is not bounded (a thread cannot be stopped), as the gate's first
call of a candidate never was.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from .measure import CudaContextLost, raise_if_context_lost
from .settings import env_number
from .subproc import Worker, WorkerError, save_call

log = logging.getLogger(__name__)

WORKERS_ENV = "INDUCTOR_ATTN_COMPILE_WORKERS"
TIMEOUT_ENV = "INDUCTOR_ATTN_COMPILE_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 60.0
MAX_WORKERS = 8
IDLE_S = 60.0  # a worker holds a CUDA context (about 0.5 GB): give it back soon after a burst of tunes
# Fewer process jobs than this compile in this process unless a worker is idle: a fresh worker's start-up
# and first FA4 compile took longer than a few compiles here (H100, 2026-11-26).
MIN_WORKER_JOBS = 4


@dataclass
class Compiled:
    """How one candidate's compile went: ``seconds`` it took; ``error`` the exception it raised (compiled in
    this process); ``reason`` why it failed in a worker or timed out, with ``bug`` true when the worker met an
    error that is not a candidate error (measure.is_candidate_error). ``skipped``: not compiled ahead (no worker could
    start), so the gate's first call compiles it."""

    seconds: float | None = None
    error: BaseException | None = None
    reason: str | None = None
    bug: bool = False
    skipped: str | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None or self.reason is not None


def max_workers() -> int:
    """Worker processes at once: this rank's share of the cores (torchrun's ranks on this node,
    LOCAL_WORLD_SIZE, share them), at most MAX_WORKERS, unless WORKERS_ENV says otherwise; 0: no compile
    ahead at all."""
    default = max(1, min(MAX_WORKERS, _cores() // max(int(os.environ.get("LOCAL_WORLD_SIZE") or 1), 1)))
    return env_number(WORKERS_ENV, default, int, lambda n: n >= 0, "a non-negative number")


def _cores() -> int:
    """Cores this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def timeout_s() -> float:
    return env_number(TIMEOUT_ENV, DEFAULT_TIMEOUT_S, float, lambda x: x > 0, "a positive number of seconds")


def compile_all(compiles: dict[str, Callable[[], object]], processes: dict[str, tuple[str, str]],
                call, here: dict[str, Callable[[], object]] | None = None) -> dict[str, Compiled]:
    """Run the ``compiles`` jobs (name -> compile function) in threads of this process while workers compile the
    ``processes`` jobs (name -> (choice, direction), on inputs like ``call``'s); a Compiled per name compiled
    ahead. A name without one compiles at the gate's first call: all of them when max_workers() is 0, and
    process jobs not in ``here`` when fewer than MIN_WORKER_JOBS leave the workers out. ``here``: for
    process jobs, the same compile in this process (the candidate's first launch): once its own compiles
    are done, this thread takes the process jobs that no ready worker has taken yet, so a worker's start-up
    (an interpreter, a CUDA context, the imports: seconds, more than one compile) delays nothing."""
    workers = max_workers()
    if workers == 0 or not (compiles or processes):
        return {}
    here = here or {}
    worker_processes = workers
    if len(processes) < MIN_WORKER_JOBS and not _POOL.idle:  # this process alone finishes them sooner
        processes, worker_processes = {name: job for name, job in processes.items() if name in here}, 0
    jobs = _ProcessJobs(processes, call, timeout_s(), worker_processes) if processes else None
    try:
        results = _in_threads(compiles, call.q.device, workers if parallel_parse_safe() else 1)
        if jobs is not None:
            results.update(jobs.finish(here))
    except CudaContextLost:
        if jobs is not None:
            jobs.abandon()  # the tune stops: workers take no further jobs of it
        raise
    return results


def parallel_parse_safe() -> bool:
    """Whether threads may parse Python source at once (Triton parses each kernel's source when it compiles it):
    not on 3.11 up to 3.11.8, nor 3.12.0-3.12.1 (cpython#106905; the range Inductor's precompile threads avoid
    for 3.11, torch/_inductor/select_algorithm.py)."""
    version = sys.version_info[:3]
    return not ((3, 11) <= version <= (3, 11, 8) or (3, 12) <= version < (3, 12, 2))


def _in_threads(compiles: dict[str, Callable[[], object]], device: torch.device, threads: int) -> dict[str, Compiled]:
    """Each job in one of ``threads`` threads; a lost CUDA context raises here (CudaContextLost) once the job that
    met it is reached in order, and the jobs not started are dropped. A compile that ran out of device memory beside
    others is left to the gate's first call (``skipped``), which compiles it alone: its outputs with the others'
    may not fit where its own do."""
    if not compiles:
        return {}
    threads = min(threads, len(compiles))
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="inductor_attn-compile")
    try:
        futures = {name: pool.submit(_compile_here, name, fn, device) for name, fn in compiles.items()}
        results = {name: future.result() for name, future in futures.items()}
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    if threads > 1:
        for name, got in results.items():
            if isinstance(got.error, torch.OutOfMemoryError):
                results[name] = Compiled(seconds=got.seconds, skipped="out of device memory compiling beside others")
    return results


def _compile_here(name: str, fn: Callable[[], object], device: torch.device) -> Compiled:
    begin = time.perf_counter()
    try:
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            fn()  # Triton compiles for the current device, which may be another than the call's
    except Exception as err:  # noqa: BLE001 - the tuner sorts candidate errors from bugs
        raise_if_context_lost(name, err, device)
        return Compiled(seconds=time.perf_counter() - begin, error=err)
    return Compiled(seconds=time.perf_counter() - begin)


def _lost(err: Exception, limit: float) -> Compiled:
    """A worker that timed out (it was killed) or died while compiling a candidate: the candidate is
    dropped (a crash there would have crashed this process in the gate)."""
    if isinstance(err, TimeoutError):
        return Compiled(seconds=limit, reason=_timeout_reason(limit))
    return Compiled(reason=f"the compile worker died compiling it: {err}")


def _timeout_reason(limit: float) -> str:
    return f"compile did not finish within {limit:g} s ({TIMEOUT_ENV})"


class _Pool:
    """Idle workers kept for ``IDLE_S``; a timer closes the ones idle longer."""

    def __init__(self):
        self.idle: list[Worker] = []
        self.lock = threading.Lock()

    def prestart(self, n: int) -> None:
        """Start workers until ``n`` are idle, without waiting for them to be ready: a stage that will
        compile in workers finds them started (tuner.py starts them while stage 1 runs)."""
        with self.lock:
            fresh = [Worker() for _ in range(n - len(self.idle))]
            self.idle += fresh
        if fresh:
            self._reap_later()

    def take(self) -> Worker:
        with self.lock:
            while self.idle:
                worker = self.idle.pop()
                if worker.alive:
                    return worker
        return Worker()

    def give_back(self, worker: Worker) -> None:
        if not worker.alive:
            return
        with self.lock:
            self.idle.append(worker)
        self._reap_later()

    def _reap_later(self) -> None:
        timer = threading.Timer(IDLE_S + 1, self.close_idle)
        timer.daemon = True
        timer.start()

    def close_idle(self, older_than_s: float = IDLE_S) -> None:
        now = time.monotonic()
        with self.lock:
            stale = [w for w in self.idle if now - w.idle_since >= older_than_s]
            self.idle = [w for w in self.idle if w not in stale]
        for worker in stale:
            worker.close()


_POOL = _Pool()
# a forked child shares its parent's workers' pipes: its requests and the parent's would interleave on them
os.register_at_fork(after_in_child=_POOL.__init__)


def prestart(candidates: int) -> None:
    """Start workers for ``candidates`` compiles in worker processes to come (at most max_workers()), when
    they are at least MIN_WORKER_JOBS (fewer compile here) and more than one worker may run (with one, this
    rank's share of the cores is one compile at a time, which this process makes itself)."""
    n = min(candidates, max_workers())
    if candidates >= MIN_WORKER_JOBS and n > 1:
        _POOL.prestart(n)


class _ProcessJobs:
    """Process jobs on one list: a driver thread per worker takes the next job once its worker is ready;
    ``finish`` lets the calling thread take jobs too, then waits for the workers' answers."""

    def __init__(self, jobs: dict[str, tuple[str, str]], call, limit: float, workers: int):
        self.todo = list(jobs.items())
        self.limit, self.device = limit, call.q.device
        self.start_error: str | None = None
        self.results: dict[str, Compiled] = {}
        self.lock = threading.Lock()
        self.drivers = [threading.Thread(target=self._drive, daemon=True) for _ in range(min(workers, len(jobs)))]
        self.tmp = tempfile.TemporaryDirectory(prefix="inductor_attn_compile_") if self.drivers else None
        if self.tmp is not None:  # workers read the call from a file; this process has it
            self.path = Path(self.tmp.name) / "call.pt"
            save_call(call, self.path)
        for t in self.drivers:
            t.start()

    def abandon(self) -> None:
        with self.lock:
            self.todo.clear()

    def _next(self) -> tuple[str, tuple[str, str]] | None:
        with self.lock:
            return self.todo.pop(0) if self.todo else None

    def _drive(self) -> None:
        worker = None
        while True:
            if worker is None:
                worker = _POOL.take()
                try:
                    worker.wait_ready()
                except (TimeoutError, WorkerError) as err:
                    log.warning("inductor_attn: a compile worker did not start (%s)", err)
                    self.start_error = f"no compile worker: {err}"
                    return  # its jobs go to the other workers, this process, or the gate's first call
            job = self._next()
            if job is None:
                break
            name, (choice, direction) = job
            try:
                reply = worker.request("compile", self.limit, call=str(self.path), choice=choice, direction=direction)
            except (TimeoutError, WorkerError) as err:
                self.results[name] = _lost(err, self.limit)
                worker = None
                continue
            self.results[name] = (Compiled(reason=reply["error"], bug=reply["bug"]) if "error" in reply
                                  else Compiled(seconds=reply["seconds"]))
            if reply.get("lost"):  # that worker's CUDA context is gone (it exited): the next job takes another
                worker = None
            log.debug("%s compiled by a worker: %s", name, self.results[name])
        if worker is not None:
            _POOL.give_back(worker)

    def finish(self, here: dict[str, Callable[[], object]]) -> dict[str, Compiled]:
        """Compile here the jobs of ``here`` that no worker took yet (their first launch, as the gate would
        make it), then wait for the workers; jobs that nobody took compile at the gate's first call."""
        while True:
            with self.lock:
                i = next((i for i, (name, _) in enumerate(self.todo) if name in here), None)
                job = self.todo.pop(i) if i is not None else None
            if job is None:
                break
            self.results[job[0]] = _compile_here(job[0], here[job[0]], self.device)
            log.debug("%s compiled in this process: %s", job[0], self.results[job[0]])
        for t in self.drivers:
            t.join()
        if self.tmp is not None:
            self.tmp.cleanup()
        for name, _ in self.todo:  # no worker started and this process could not compile it
            self.results[name] = Compiled(skipped=self.start_error or "no compile worker")
        return self.results
