"""Worker processes, the parent's side: compiling candidates whose compiler holds the GIL, and tuning in the
background. The worker's side, what answers the requests, is worker.py.

A worker is ``python -m inductor_attn.tuning.worker``: a fresh interpreter, not multiprocessing's spawn,
which re-imports the user's ``__main__`` and would rerun a script that lacks a ``__main__`` guard. It
inherits the parent's environment, so it opens the same decision store and the same kernel disk caches,
and it never starts workers of its own (``INDUCTOR_ATTN_COMPILE_WORKERS=0``). It answers ``ready`` once
its imports are done, then one JSON line on stdout per JSON request on stdin; what libraries print goes
to stderr, whose last lines name the cause when a worker dies. It exits when its stdin closes, which
happens when the parent exits. It imports the backends' costly libraries (``Backend.load``) before it says
ready, since the parent gives jobs only to ready workers and compiles the others itself meanwhile.

Requests (``call``: a file written by :func:`save_call`):

- ``{"op": "compile", "call", "choice", "direction"}``: run the candidate's first launch (its
  ``Plan.compile`` where it has one) on inputs like the call's, which leaves the compiled kernels in the
  backend's disk cache; answers ``{"seconds"}``.
- ``{"op": "tune", "call", "direction", "deterministic", "key"}``: tune the call's bucket (under
  ``torch.use_deterministic_algorithms(deterministic)``) and store the decision under ``key``
  (background mode, decisions.py); answers ``{"winner", "row"}``: the stored decision, or null where the
  store could not be read back.

A request that fails answers ``{"error": "Type: message", "bug": bool}``: ``bug`` is false for the errors
that mean "this candidate cannot run here" (measure.is_candidate_error). One whose error left the worker's
CUDA context unusable (an illegal memory access) also has ``"lost": true``, and the worker exits after it:
the parent takes another worker for the next request.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 180.0  # imports torch, triton, the CuTe DSL and a CUDA context: 5-20 s when disks are cold
_ROOT = str(Path(__file__).resolve().parents[2])  # so a checkout that is not installed imports the same code


class WorkerError(RuntimeError):
    """A worker died, or did not start."""


def save_call(call, path: Path) -> None:
    """Write ``call`` for a worker: q, k, v by shape, strides and dtype (a worker fills them with random
    values); lengths, index tensors and masks by value, on their device, since kernels read them."""
    qkv = {name: (tuple(t.shape), tuple(t.stride()), t.dtype) for name, t in
           (("q", call.q), ("k", call.k), ("v", call.v))}
    rest = dataclasses.replace(call, q=None, k=None, v=None, _problem=call.problem)
    torch.save({"call": rest, "qkv": qkv, "device": str(call.q.device)}, path)


def load_call(path: Path):
    """The call :func:`save_call` wrote, with fresh normal q, k, v of the same layouts. Its GPU becomes the current
    device, where kernels compile and where ``worker._error`` looks for a lost context."""
    data = torch.load(path, weights_only=False)
    device = torch.device(data["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    gen = torch.Generator(device=device).manual_seed(0)
    qkv = {name: torch.empty_strided(shape, stride, dtype=dtype, device=device).normal_(generator=gen)
           for name, (shape, stride, dtype) in data["qkv"].items()}
    return dataclasses.replace(data["call"], **qkv, _problem=data["call"]._problem)


def settings_env() -> tuple:
    """The parent's ``INDUCTOR_ATTN_*`` variables (the store's directory among them), which a worker takes at
    its start: a worker whose settings differ from the parent's now would tune into another store."""
    return tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("INDUCTOR_ATTN_")))


class Worker:
    """The parent's handle on one worker process."""

    def __init__(self):
        self.settings = settings_env()
        env = {**os.environ, "INDUCTOR_ATTN_COMPILE_WORKERS": "0",
               "PYTHONPATH": os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen([sys.executable, "-m", "inductor_attn.tuning.worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.replies: queue.Queue = queue.Queue()
        self.stderr: collections.deque = collections.deque(maxlen=20)
        self.ready = False
        self.idle_since = self.started = time.monotonic()
        self._next = 0
        drains = ((self.proc.stdout, self.replies.put, True), (self.proc.stderr, self.stderr.append, False))
        self._drains = [threading.Thread(target=_drain, args=args, daemon=True) for args in drains]
        for thread in self._drains:
            thread.start()

    def request(self, op: str, timeout_s: float, **fields) -> dict:
        """Send one request and wait for its answer. Raises TimeoutError after ``timeout_s`` (the worker is
        then killed: it may be stuck in a compile) and WorkerError if the worker dies or never started."""
        self.wait_ready()
        self._next += 1
        try:
            self.proc.stdin.write(json.dumps({"id": self._next, "op": op, **fields}) + "\n")
            self.proc.stdin.flush()
        except OSError as err:
            raise WorkerError(self._death(f"cannot write to it ({err})")) from None
        reply = self._reply(timeout_s, f"{op} request", self._next)
        self.idle_since = time.monotonic()
        if reply.get("lost"):  # it exits after this reply: no later request may go to it
            self.kill()
        return reply

    def wait_ready(self) -> None:
        """Block until the worker's imports are done; TimeoutError or WorkerError if it does not start."""
        if not self.ready:
            if not self._reply(STARTUP_TIMEOUT_S, "start-up", 0).get("ready"):
                raise WorkerError(self._death("its first line was no ready message"))
            self.ready = True
            log.debug("worker pid %d ready %.1f s after its start", self.proc.pid, time.monotonic() - self.started)

    def _reply(self, timeout_s: float, what: str, request_id: int) -> dict:
        """The reply to request ``request_id`` (0: the ready message). Anything else on the protocol pipe (a line
        some library printed before the worker took its stdout, JSON or not) leaves the worker's state unknown,
        and every later reply one off: the worker goes."""
        try:
            line = self.replies.get(timeout=timeout_s)
        except queue.Empty:
            self.kill()
            raise TimeoutError(f"{what} took longer than {timeout_s:g} s") from None
        if line is None:
            raise WorkerError(self._death("it exited"))
        try:
            reply = json.loads(line)
        except ValueError:
            reply = None
        if not isinstance(reply, dict) or reply.get("id") != request_id:
            raise WorkerError(self._death(f"it sent a line that is not the reply to {what}: {line[:80]!r}"))
        return reply

    def _death(self, what: str) -> str:
        self.kill()
        self._drains[1].join(timeout=5)  # the last lines of stderr name the cause
        tail = next((ln for ln in reversed(self.stderr) if ln.strip()), "no output")
        return f"tuning worker pid {self.proc.pid}: {what} (exit status {self.proc.poll()}; last stderr line: {tail})"

    def close(self) -> None:
        """Close its stdin (it exits after its current request); kill it if it has not within 10 s."""
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


def _drain(stream, sink, mark_end: bool) -> None:
    for line in stream:
        sink(line.rstrip("\n"))
    if mark_end:  # the reply queue learns that no answer will come
        sink(None)
