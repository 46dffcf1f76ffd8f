"""Tuning quality: do two fresh tunes agree, how long does tuning take, what does compiling cost.

- Agreement: the run's own process tuned every workload on an empty store (the first tune); a second
  process tunes the same workloads on another empty store. Identical decisions count as agreement; a
  differing one is "inside the noise" when in both tunes' records the two winners' medians lie within the
  tuner's own tie margin (the larger of ``TIE_MARGIN`` and the record's measured noise), where the tuner
  goes by prior order, so either answer is what its rule allows (:func:`inside_noise`; the tuning-cost
  suite counts agreement with the same two functions). FlashInfer's RFC #3920 found two fresh tunes
  disagreeing on 86 of 191 keys; this is the number to watch.
- Tuning seconds: both tunes' wall times per workload. The second process finds the kernel caches on
  disk (Triton, FA4, Inductor) warm from the first, so its seconds are timing without compiling.
- Compile time added: in a new process with the store warm, ``torch.compile`` + first call of a small
  function calling ``inductor_attn.attention``, minus the same in ``off`` mode (no decisions at all).
  The FX graph cache is off in both, so both really compile.

Workers run as ``python -m inductor_attn.bench.quality {tune,compile} --workloads FILE --out FILE`` and
append one JSON line per workload, so a worker stopped at its deadline still reports what it did.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ..tuning.measure import sync
from ..tuning.step_cost import TIE_MARGIN
from .suites import Workload

COMPILE_RESERVE_S = 90  # kept for the compile-time step when the second tune gets its deadline
COMPILE_WORKLOADS = 2
MIN_WORKER_S = 30


def run_quality(workloads: list[Workload], rows: list[dict], ctx, store_dir: str, deadline: float) -> dict:
    """Second tune and compile-time measurement, within ``deadline`` (a time.perf_counter() value)."""
    by_name = {w.name: w for w in workloads}
    measured = [r for r in rows if r["status"] == "ok"]
    out = {"tunes": [], "compile": [], "notes": []}
    tuned = [by_name[r["name"]] for r in measured if r["decisions"]["autotune"]["choice"]]
    with tempfile.TemporaryDirectory(prefix="inductor_attn_quality_") as tmp:
        budget = deadline - time.perf_counter() - COMPILE_RESERVE_S
        second, note = _worker("tune", tuned, Path(tmp), budget, {"INDUCTOR_ATTN_CACHE_DIR": str(Path(tmp) / "store")})
        if note:
            out["notes"].append(f"second tune: {note}")
        out["tunes"] = compare_tunes(_first_tunes(measured), second, measured)
        compiled = [by_name[r["name"]] for r in measured if r["kind"] in ("dense", "decode")][:COMPILE_WORKLOADS]
        if not compiled:
            out["notes"].append("compile time: no dense or decode workload was measured")
        results = {}
        for mode in ("autotune", "off"):
            budget = (deadline - time.perf_counter()) / (2 if mode == "autotune" else 1)
            env = {"INDUCTOR_ATTN_CACHE_DIR": store_dir, "INDUCTOR_ATTN_MODE": mode,
                   "TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}
            results[mode], note = _worker("compile", compiled, Path(tmp), budget, env) if compiled else ({}, "")
            if note:
                out["notes"].append(f"compile time ({mode}): {note}")
        out["compile"] = compare_compile(results["autotune"], results["off"])
    return out


def _first_tunes(rows: list[dict]) -> dict[str, dict]:
    return {r["name"]: {"choice": r["decisions"]["autotune"]["choice"], "tune_s": r["decisions"]["autotune"]["tune_s"],
                        "record": r["decisions"]["autotune"]["record"]} for r in rows}


def _worker(verb: str, workloads: list[Workload], tmp: Path, budget_s: float, env: dict) -> tuple[dict, str]:
    """Run one worker process; returns {name: its JSON line} and a note if it did not finish."""
    if not workloads:
        return {}, ""
    if budget_s < MIN_WORKER_S:
        return {}, f"skipped: {max(budget_s, 0):.0f} s of the time budget left"
    spec, out = tmp / f"{verb}-workloads.json", tmp / f"{verb}-{env.get('INDUCTOR_ATTN_MODE', 'autotune')}.jsonl"
    spec.write_text(json.dumps([w.to_json() for w in workloads]))
    out.unlink(missing_ok=True)
    root = str(Path(__file__).resolve().parents[2])
    full_env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "inductor_attn.bench.quality", verb, "--workloads", str(spec), "--out", str(out)]
    note = ""
    try:
        proc = subprocess.run(cmd, env=full_env, cwd=root, capture_output=True, text=True, timeout=budget_s)
        if proc.returncode != 0:
            note = f"worker exited {proc.returncode}: {_last_line(proc.stderr)}"
    except subprocess.TimeoutExpired:
        note = f"stopped at its deadline ({budget_s:.0f} s); results of the workloads it finished are kept"
    lines = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    done = {d["name"]: d for d in lines}
    if len(done) < len(workloads) and not note:
        note = f"finished {len(done)} of {len(workloads)} workloads"
    return done, note


def _last_line(text: str) -> str:
    lines = [ln for ln in (text or "").splitlines() if ln.strip()]
    return lines[-1][:200] if lines else "(no output)"


# ------------------------------------------------------------------------------------------ compare
def compare_tunes(first: dict[str, dict], second: dict[str, dict], rows: list[dict] = ()) -> list[dict]:
    """One item per workload that both tunes decided: the two choices and seconds, whether they are the
    same, both records' measured noise, and for a difference whether it lies inside both records' tie
    margins (:func:`inside_noise`) and, from bench ``rows``, the bench's own interleaved measurement of the
    two (speedup of the second choice over the first)."""
    bench = {r["name"]: {e["name"]: e for e in r.get("entries", [])} for r in rows}
    out = []
    for name, a in first.items():
        b = second.get(name)
        if b is None or b.get("choice") is None or a.get("choice") is None:
            continue
        records = (a.get("record") or {}, b.get("record") or {})  # no record: one candidate ran, nothing was tuned
        item = {"name": name, "first": a["choice"], "second": b["choice"], "same": a["choice"] == b["choice"],
                "first_s": a.get("tune_s"), "second_s": b.get("tune_s"), "noise": [rec.get("noise") for rec in records]}
        if not item["same"]:
            item["inside_noise"] = all(inside_noise(rec, a["choice"], b["choice"]) for rec in records)
            ea, eb = (bench.get(name, {}).get(c, {}) for c in (a["choice"], b["choice"]))
            if ea.get("median_ms") and eb.get("median_ms"):
                item["bench_second_over_first"] = ea["median_ms"] / eb["median_ms"]
        out.append(item)
    return out


def inside_noise(record: dict, x: str, y: str) -> bool:
    """Whether candidates ``x`` and ``y`` are within ``record``'s tie margin of each other: the larger of
    ``TIE_MARGIN`` and the noise the tuner measured, inside which it goes by prior order (tuning/tuner.py).

    >>> rec = {"noise": 0.05, "candidates": [{"name": "a", "median_ms": 1.0}, {"name": "b", "median_ms": 1.04}]}
    >>> inside_noise(rec, "a", "b"), inside_noise({**rec, "noise": None}, "a", "b")
    (True, False)
    """
    medians = {c["name"]: c.get("median_ms") for c in record.get("candidates", [])}
    if not medians.get(x) or not medians.get(y):
        return False
    ratio = max(medians[x], medians[y]) / min(medians[x], medians[y])
    return ratio <= 1 + max(TIE_MARGIN, record.get("noise") or 0.0)


def compare_compile(autotune: dict[str, dict], off: dict[str, dict]) -> list[dict]:
    out = []
    for name, a in autotune.items():
        o = off.get(name, {})
        item = {"name": name, "autotune_s": a.get("compile_s"), "off_s": o.get("compile_s"),
                "new_decisions": a.get("new_decisions")}
        if item["autotune_s"] is not None and item["off_s"] is not None:
            item["added_s"] = item["autotune_s"] - item["off_s"]
        out.append(item)
    return out


# ------------------------------------------------------------------------------------------- workers
def _tune_worker(workloads: list[Workload], out: Path) -> None:
    from ..device import device_info
    from ..tuning.decisions import decide
    from ..tuning.modes import tuning_mode
    from . import suites
    from .records import stored_record

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = device_info(device)
    for w in workloads:
        call = suites.build(w, device).call
        with tuning_mode("autotune"):
            start = time.perf_counter()
            choice = decide(call, dev, w.direction)
            sync(device)
        line = {"name": w.name, "choice": choice, "tune_s": time.perf_counter() - start,
                "record": stored_record(call.problem, w.direction)}
        with out.open("a") as f:
            f.write(json.dumps(line) + "\n")
        del call
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _compile_worker(workloads: list[Workload], out: Path) -> None:
    import inductor_attn

    from ..store.db import get_store
    from . import suites

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # pays Inductor's one-time start-up (imports, worker pools) outside the measured compiles
    torch.compile(lambda x: x * 2 + 1)(torch.ones(8, device=device))
    for w in workloads:
        call = suites.build(w, device).call

        def attend(q, k, v, kv_seqlens, w=w):
            return inductor_attn.attention(q, k, v, causal=w.causal, window=w.window, kv_seqlens=kv_seqlens)

        # a clean compile per workload: without the reset, the second shape would recompile with
        # dynamic shapes (automatic dynamic), which defers the decision to run time
        torch._dynamo.reset()
        before = len(get_store().rows())
        start = time.perf_counter()
        torch.compile(attend, fullgraph=True, dynamic=False)(call.q, call.k, call.v, call.kv_seqlens)
        sync(device)
        line = {"name": w.name, "compile_s": time.perf_counter() - start,
                "new_decisions": len(get_store().rows()) - before}
        with out.open("a") as f:
            f.write(json.dumps(line) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inductor_attn.bench.quality", description=__doc__.split("\n")[0])
    parser.add_argument("verb", choices=("tune", "compile"))
    parser.add_argument("--workloads", required=True, type=Path, help="JSON list of workloads")
    parser.add_argument("--out", required=True, type=Path, help="JSON-lines file, one line per workload")
    args = parser.parse_args(argv)
    workloads = [Workload.from_json(d) for d in json.loads(args.workloads.read_text())]
    (_tune_worker if args.verb == "tune" else _compile_worker)(workloads, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
