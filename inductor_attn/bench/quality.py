"""Tuning quality: do two fresh tunes agree, how long does tuning take, what does compiling cost.

- Agreement: the run's own process tuned every workload on an empty store (the first tune); a second
  process tunes the same workloads on another empty store. Identical decisions count as agreement; for
  a differing one, it is "inside the CIs" when in both tunes' records the two winners' speedup intervals
  (vs the default) overlap, i.e. neither tune could tell them apart. FlashInfer's RFC #3920 found two
  fresh tunes disagreeing on 86 of 191 keys; this is the number to watch.
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
def compare_tunes(first: dict[str, dict], second: dict[str, dict], rows: list[dict]) -> list[dict]:
    """One item per workload that both tunes decided: the two choices and seconds, whether they are the
    same, and for a difference whether it lies inside the CIs (both records) and the bench's own
    interleaved measurement of the two (speedup of the second choice over the first, with CI)."""
    bench = {r["name"]: {e["name"]: e for e in r.get("entries", [])} for r in rows}
    out = []
    for name, a in first.items():
        b = second.get(name)
        if b is None or b.get("choice") is None or a.get("choice") is None:
            continue
        item = {"name": name, "first": a["choice"], "first_s": a.get("tune_s"), "second": b["choice"],
                "second_s": b.get("tune_s"), "same": a["choice"] == b["choice"]}
        if not item["same"]:
            records = (a.get("record"), b.get("record"))
            item["inside_ci"] = all(_overlap(rec, a["choice"], b["choice"]) for rec in records)
            ea, eb = (bench.get(name, {}).get(c, {}) for c in (a["choice"], b["choice"]))
            if ea.get("median_ms") and eb.get("median_ms"):
                item["bench_second_over_first"] = ea["median_ms"] / eb["median_ms"]
        out.append(item)
    return out


def _overlap(record: dict | None, x: str, y: str) -> bool:
    """Whether candidates x and y have overlapping speedup CIs in a tuner record (a record without one
    of them, or without timings, cannot tell them apart either)."""
    if not record:
        return True
    cands = {c["name"]: c for c in record["candidates"]}
    cx, cy = cands.get(x), cands.get(y)
    if not cx or not cy or cx.get("ci_low") is None or cy.get("ci_low") is None:
        return True
    return cx["ci_low"] <= cy["ci_high"] and cy["ci_low"] <= cx["ci_high"]


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
    from .runner import stored_record

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
