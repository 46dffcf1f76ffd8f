"""The tuner's record of one tune, as the decision store keeps it (a row's ``record``, as JSON).

Here, not in tuning/, because the store checks every record it imports against these fields (schema.py) and the
store sits below the tuner: the tuner writes these, the store reads them.
"""

from __future__ import annotations

import dataclasses
import socket
import time
from dataclasses import dataclass, field

from ..problem import Problem


@dataclass
class CandidateResult:
    name: str
    status: str  # "pruned" | "failed" | "wrong" | "passed"
    reason: str | None = None
    error: float | None = None  # rel. error vs the reference in the gate
    compile_s: float | None = None  # its compile ahead of the gate (if any) + its first call's wall time
    median_ms: float | None = None
    speedup: float | None = None  # vs the default: median(default) / median(this)
    ci_low: float | None = None
    ci_high: float | None = None
    samples: list[float] = field(default_factory=list)
    note: str = ""
    host_ms: float | None = None  # CPU time of one launch as compiled code makes it (step 7, timing.host_ms)
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
    search: str = ""  # how candidates were chosen for measuring (step 1), or what shortened the search
    noise: float | None = None  # between-session change of the top candidates' speedup (step 5); None: not close
    noise_note: str = ""
    seconds: dict[str, float] = field(default_factory=dict)  # wall time per phase: compile, gate, timing, total
    host: str = field(default_factory=socket.gethostname)  # where it was measured (cache explain: "tuned here")
    paired_with: str = ""  # a backward: the forward whose out and lse the gate fed it ("": the reference's)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["problem"] = self.problem.key()
        return d

    @classmethod
    def from_json(cls, d: dict) -> TuneResult:
        d = {k: v for k, v in d.items() if k not in LEGACY_FIELDS}
        d["problem"] = Problem.from_key(d["problem"])
        d["candidates"] = [CandidateResult(**c) for c in d["candidates"]]
        return cls(**d)


# What records tuned before step 7 measured every candidate's host time held, with their types: one choice for
# all compiled code. Read, never used.
LEGACY_FIELDS = {"compiled_winner": str | None, "compiled_why": str}
