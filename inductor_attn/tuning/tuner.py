"""The tuner: correctness gate, then timing, then a decision on statistics.

For one problem and its candidates (in prior order; steps 1 and 2 are measure.py's, which the benchmark
shares):
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
import os
import time
from dataclasses import dataclass, field

import torch

from ..backends import AttnCall, Candidate
from ..problem import Problem
from .measure import (
    CANDIDATE_ERRORS,
    Direction,
    candidate_trial,
    fresh_inputs,
    gate,
    is_candidate_error,
    strict,
    sync,
    time_trials,
)
from .stats import median, paired_bootstrap_speedup
from .timing import default_timer

TIE_MARGIN = 0.02
DEFAULT_ROUNDS = 15
__all__ = ["CANDIDATE_ERRORS", "CandidateResult", "TuneResult", "default_rounds", "fresh_inputs", "is_candidate_error",
           "strict", "tune"]


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


def _gate(cand: Candidate, direction: Direction, call: AttnCall, expected) -> CandidateResult:
    result = gate(candidate_trial(cand.name, direction), call, expected,
                  lambda got: direction.check(got, expected, call.q.dtype))
    return CandidateResult(cand.name, result.status, result.reason, result.error, result.first_call_s)


def tune(call: AttnCall, candidates: list[Candidate], *, direction: str = "forward",
         timer=None, rounds: int | None = None, progress=None, grad_lse: bool = False) -> TuneResult:
    """Measure ``candidates`` (prior order) on ``call``'s problem and pick one; see the module doc.
    ``grad_lse``: a backward whose loss uses the lse too (the gate then checks that gradient's part)."""
    timer = timer or default_timer(call.q.device.type)
    rounds = rounds or default_rounds()
    gate_call = fresh_inputs(call, seed=1)
    mode = Direction(direction, gate_call, grad_lse)
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


def _time(passing, call: AttnCall, mode: Direction, timer, rounds: int, tick) -> None:
    timed = time_trials([candidate_trial(cand.name, mode) for cand, _ in passing], call, timer, rounds, tick)
    for (cand, res), t in zip(passing, timed):
        if t.failed:  # the rounds are paired: a candidate that stops running leaves no fair comparison
            raise RuntimeError(f"{cand.name} passed the gate but failed {t.failed}")
        res.note, res.samples = t.note, t.samples
    for cand, res in passing:
        plan = mode.plan(call, cand.name)
        res.traced = plan.traced is not None
        if not res.traced:
            res.host_ms = _host_ms(lambda p=plan: mode.run(p, call), call.q.device)
    base = passing[0][1]
    for _, res in passing:
        res.median_ms = median(res.samples)
        res.speedup, res.ci_low, res.ci_high = paired_bootstrap_speedup(base.samples, res.samples)


def _host_ms(launch, device: torch.device, bursts: int = 3, calls: int = 5) -> float:
    """CPU time of one launch: bursts short enough for the launch queue, so the CPU never waits."""
    best = float("inf")
    for _ in range(bursts):
        sync(device)
        start = time.perf_counter()
        for _ in range(calls):
            launch()
        best = min(best, (time.perf_counter() - start) / calls)
        sync(device)
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
