"""The tuner: correctness gate, then timing, then a decision on statistics.

For one problem and its candidates (in prior order):
1. Gate: each runnable candidate runs once on fresh random inputs (same shapes, strides and index
   tensors as the call) after the allocator was poisoned with NaN, and must match the reference within
   the dtype's tolerance. That first call also pays for JIT compilation; its wall time is recorded as
   ``compile_s`` and never mixed into run times. A candidate that raises is dropped with its reason.
2. Timing: candidates that passed are timed in interleaved rounds (one sample each per round) with the
   device's timer (CUDA-graph replay on GPUs).
3. Decision: the default is the first passing candidate in prior order. Another candidate replaces it
   only if the paired-bootstrap 95% CI of its speedup over the default lies above 1. Among those, the
   fastest wins, and candidates within ``TIE_MARGIN`` of the fastest median go by prior order, so two
   tunes of the same problem agree.
4. Compiled code: the same winner, unless its plan cannot be traced into the graph (it then runs its
   Python launch through the thin op, see lowering/) and a traced candidate is no slower than
   max(the winner's device time, the CPU time of its launch): a call launched from Python cannot finish
   before its launch does, while a traced one costs Inductor's launcher only. Each candidate's host
   time is measured as the CPU time of its eager launch (``host_ms``). A kernel win that the host eats
   is no win; a long kernel hides its launch, and keeps its win.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field

import torch

from ..backends import REFERENCE, AttnCall, Candidate, Plan, get_backend, plan_for
from ..device import device_info
from ..problem import Problem
from .correctness import POISON, check_output, check_tensor, rel_err
from .stats import median, paired_bootstrap_speedup
from .timing import default_timer

log = logging.getLogger(__name__)

TIE_MARGIN = 0.02
DEFAULT_ROUNDS = 15
# Exceptions that mean "this candidate cannot run this problem here": launch, resource and library
# assertion errors (CUDA errors are RuntimeErrors), plus what each backend declares in ``errors()``
# (Triton's CompilationError and OutOfResources, CuTe DSL's errors: they derive from Exception only).
# Anything else is a bug in our code and is re-raised in strict mode.
CANDIDATE_ERRORS = (RuntimeError, AssertionError, ValueError, NotImplementedError, MemoryError)


def is_candidate_error(err: BaseException, backend) -> bool:
    return isinstance(err, CANDIDATE_ERRORS + tuple(backend.errors()))


@dataclass
class CandidateResult:
    name: str
    status: str  # "pruned" | "failed" | "wrong" | "passed"
    reason: str | None = None
    error: float | None = None  # rel. error vs the reference in the gate
    compile_s: float | None = None  # wall time of the first call (JIT compile + one run)
    median_ms: float | None = None
    speedup: float | None = None  # vs the default: median(default) / median(this)
    ci_low: float | None = None
    ci_high: float | None = None
    samples: list[float] = field(default_factory=list)
    note: str = ""
    host_ms: float | None = None  # CPU time of one eager launch of its plan (best of several bursts)
    traced: bool | None = None  # compiled code launches its kernels itself (else through the launch op)


@dataclass
class TuneResult:
    problem: Problem  # the concrete problem that was measured (decisions are stored per bucket)
    direction: str
    winner: str
    default: str
    why: str
    timer: str
    candidates: list[CandidateResult]
    tuned_at: float = field(default_factory=time.time)
    compiled_winner: str | None = None  # what compiled code runs (step 4 of the module doc); None: winner
    compiled_why: str = ""

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["problem"] = self.problem.key()
        return d

    @classmethod
    def from_json(cls, d: dict) -> TuneResult:
        d = dict(d)
        d["problem"] = Problem.from_key(d["problem"])
        d["candidates"] = [CandidateResult(**c) for c in d["candidates"]]
        return cls(**d)


def default_rounds() -> int:
    return int(os.environ.get("INDUCTOR_ATTN_ROUNDS", DEFAULT_ROUNDS))


def strict() -> bool:
    """INDUCTOR_ATTN_STRICT=1 (the test suite sets it): programming errors in a candidate raise."""
    return os.environ.get("INDUCTOR_ATTN_STRICT") == "1"


def fresh_inputs(call: AttnCall, seed: int) -> AttnCall:
    """Same shapes, strides, dtypes and index tensors as ``call``, new random q/k/v (never zeros)."""
    gen = torch.Generator(device=call.q.device).manual_seed(seed)

    def like(x: torch.Tensor) -> torch.Tensor:
        y = torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device=x.device)
        return y.normal_(generator=gen)

    return dataclasses.replace(call, q=like(call.q), k=like(call.k), v=like(call.v), _problem=call._problem)


def _poison_allocator(device: torch.device, nbytes: int) -> None:
    """Fill soon-to-be-reused allocator blocks with NaN, so an output the kernel never writes shows up
    as NaN in the gate. The caching allocator hands freed blocks of the same size class back first."""
    if device.type == "cuda":
        torch.full((max(nbytes // 4, 1),), POISON, dtype=torch.float32, device=device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Direction:
    """What 'running a candidate' means for forward or backward tuning: its plan's launch, the code that
    ships (the plan is built once and cached, like at run time)."""

    def __init__(self, direction: str, call: AttnCall, grad_lse: bool = False):
        self.direction = direction
        self.dev = device_info(call.q.device)
        self.grads = None
        if direction == "backward":
            out, lse = REFERENCE.run(call, None)
            gen = torch.Generator(device=call.q.device).manual_seed(7)
            grad_out = torch.empty_like(out).normal_(generator=gen)
            dlse = torch.empty_like(lse).normal_(generator=gen) if grad_lse else None
            self.grads = (out, lse, grad_out, dlse)

    def plan(self, call: AttnCall, choice: str) -> Plan:
        return plan_for(call.problem, choice, self.dev, self.direction)

    def run(self, plan: Plan, call: AttnCall):
        return plan.launch(call) if self.grads is None else plan.launch(call, *self.grads)

    def reference(self, call: AttnCall):
        plan = REFERENCE.plan(call.problem, self.dev, None, self.direction)
        return self.run(plan, call)

    def check(self, got, want, dtype) -> tuple[str | None, float]:
        if self.grads is None:
            return check_output(got[0], got[1], want[0], want[1], dtype), rel_err(got[0], want[0])
        reasons = [check_tensor(name, g, w, dtype) for name, g, w in zip(("dq", "dk", "dv"), got, want)]
        return next((r for r in reasons if r), None), max(rel_err(g, w) for g, w in zip(got, want))


def _gate(cand: Candidate, direction: _Direction, call: AttnCall, expected) -> CandidateResult:
    backend = get_backend(cand.backend)
    res = CandidateResult(cand.name, "passed")
    nbytes = sum(t.numel() * t.element_size() for t in expected)
    try:
        _poison_allocator(call.q.device, nbytes)
        start = time.perf_counter()
        got = direction.run(direction.plan(call, cand.name), call)
        _sync(call.q.device)
        res.compile_s = time.perf_counter() - start
    except Exception as err:  # noqa: BLE001 - a failing candidate must not crash the user's compile
        if is_candidate_error(err, backend):
            res.status, res.reason = "failed", _describe(err)
            return res
        if strict():
            raise
        log.warning("candidate %s raised %s (a bug, please report): %s", cand.name, type(err).__name__, err)
        res.status, res.reason = "failed", _describe(err)
        return res
    reason, res.error = direction.check(got, expected, call.q.dtype)
    if reason is not None:
        res.status, res.reason = "wrong", reason
    return res


def _describe(err: BaseException) -> str:
    first = next((line for line in str(err).splitlines() if line.strip()), "")
    return f"{type(err).__name__}: {first.strip()[:200]}"


def _copies(call: AttnCall) -> int:
    """Input copies to rotate through so each timed call starts with its data out of L2."""
    if call.q.device.type != "cuda":
        return 1
    per_call = sum(t.numel() * t.element_size() for t in (call.q, call.k, call.v)) * 2
    return int(min(8, max(1, -(-(2 * 60 << 20) // max(per_call, 1)))))


def tune(call: AttnCall, candidates: list[Candidate], *, direction: str = "forward",
         timer=None, rounds: int | None = None, progress=None, grad_lse: bool = False) -> TuneResult:
    """Measure ``candidates`` (prior order) on ``call``'s problem and pick one; see the module doc.
    ``grad_lse``: a backward whose loss uses the lse too (the gate then checks that gradient's part)."""
    timer = timer or default_timer(call.q.device.type)
    rounds = rounds or default_rounds()
    gate_call = fresh_inputs(call, seed=1)
    mode = _Direction(direction, gate_call, grad_lse)
    expected = mode.reference(gate_call)
    results = [CandidateResult(c.name, "pruned", c.pruned) for c in candidates]
    tick = progress or (lambda: None)
    for cand in (c for c in candidates if c.pruned is None):
        results[candidates.index(cand)] = _gate(cand, mode, gate_call, expected)
        tick()
    passing = [(c, r) for c, r in zip(candidates, results) if r.status == "passed"]
    if not passing:
        reasons = "; ".join(f"{r.name}: {r.reason}" for r in results)
        raise RuntimeError(f"no candidate could run {call.problem}: {reasons}")
    default = passing[0][1]
    if len(passing) == 1:
        return TuneResult(call.problem, direction, default.name, default.name,
                          "the only candidate that ran and matched the reference", timer.name, results)
    _time(passing, call, mode, timer, rounds, tick)
    winner, why = _choose(passing)
    compiled, compiled_why = _choose_compiled(passing, winner)
    return TuneResult(call.problem, direction, winner.name, default.name, why, timer.name, results,
                      compiled_winner=compiled.name, compiled_why=compiled_why)


def _time(passing, call: AttnCall, mode: _Direction, timer, rounds: int, tick) -> None:
    copies = [fresh_inputs(call, seed=100 + i) for i in range(_copies(call))]
    runners = []
    for cand, res in passing:
        plan = mode.plan(call, cand.name)
        fns = [lambda c=c, p=plan: mode.run(p, c) for c in copies]
        runner = timer.prepare(fns)
        res.note = runner.note
        runners.append((runner, res))
    for _ in range(rounds):
        for runner, res in runners:
            res.samples.append(runner.sample())
        tick()
    runners.clear()  # drops the graphs and their memory pools
    for cand, res in passing:
        plan = mode.plan(call, cand.name)
        res.traced = plan.traced is not None
        if not res.traced:
            res.host_ms = _host_ms(lambda p=plan: mode.run(p, copies[0]), call.q.device)
    base = passing[0][1]
    for _, res in passing:
        res.median_ms = median(res.samples)
        res.speedup, res.ci_low, res.ci_high = paired_bootstrap_speedup(base.samples, res.samples)


def _host_ms(launch, device: torch.device, bursts: int = 3, calls: int = 5) -> float:
    """CPU time of one launch: bursts short enough for the launch queue, so the CPU never waits."""
    best = float("inf")
    for _ in range(bursts):
        _sync(device)
        start = time.perf_counter()
        for _ in range(calls):
            launch()
        best = min(best, (time.perf_counter() - start) / calls)
        _sync(device)
    return best * 1e3


def _choose_compiled(passing, winner: CandidateResult) -> tuple[CandidateResult, str]:
    """Step 4 of the module doc: the winner, or the fastest traced candidate where the winner's host time
    in compiled code would eat its device-time lead."""
    if winner.traced is not False:
        return winner, "the winner is launched by compiled code itself"
    traced = [r for _, r in passing if r.traced]
    if not traced:
        return winner, "no candidate can be traced into compiled code"
    best = min(traced, key=lambda r: r.median_ms)
    if best.median_ms <= max(winner.median_ms, winner.host_ms):
        return best, (f"{best.name} ({best.median_ms:.4f} ms, launched by compiled code) is no slower than "
                      f"{winner.name}, whose launch takes {winner.host_ms:.4f} ms of host time "
                      f"for {winner.median_ms:.4f} ms on the device")
    return winner, (f"faster than the fastest traced candidate {best.name} ({best.median_ms:.4f} ms) even with "
                    f"its {winner.host_ms:.4f} ms of host time per launch")


def _choose(passing) -> tuple[CandidateResult, str]:
    default = passing[0][1]
    faster = [r for _, r in passing[1:] if r.ci_low > 1.0]
    if not faster:
        return default, "no candidate beat the default with 95% confidence (CI of the speedup includes 1)"
    best = min(r.median_ms for r in faster)
    winner = next(r for r in faster if r.median_ms <= best * (1 + TIE_MARGIN))
    return winner, (f"{winner.speedup:.3f}x faster than the default {default.name} "
                    f"(95% CI {winner.ci_low:.3f}-{winner.ci_high:.3f})")
