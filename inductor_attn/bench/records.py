"""The tuner's records in the current decision store, as the suites read them."""

from __future__ import annotations

from ..store.db import get_store


def whole_record(problem, direction: str = "forward") -> dict | None:
    """The tuner's record of this problem's bucket in the current store."""
    key = problem.bucket().key()
    return next((row["record"] for row in get_store().rows()
                 if row["op"] == f"{problem.op}/{direction}" and row["problem"] == key), None)


def stored_record(problem, direction: str = "forward") -> dict | None:
    """The tuner's record of this problem's bucket in the current store, without its samples."""
    rec = whole_record(problem, direction)
    if rec is None:
        return None
    cands = [{k: c.get(k) for k in ("name", "status", "reason", "median_ms", "speedup", "ci_low", "ci_high",
                                     "compile_s")} for c in rec["candidates"]]
    # the noise too: quality.inside_noise reads it (the tie margin the tuner itself applied)
    return {"winner": rec["winner"], "default": rec["default"], "why": rec["why"], "timer": rec["timer"],
            "noise": rec.get("noise"), "candidates": cands}
