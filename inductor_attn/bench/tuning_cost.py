"""``bench --suite tuning-cost``: what tuning adds to a compile, whether two fresh tunes agree, and what the
staged search loses against the exhaustive one (issue 16).

Workloads: the kernel suites' (suites.py) quick subset with ``--quick``, all of them otherwise, kinds
taking turns, each shrunk to a float32 smoke size with ``--smoke``; no phase starts a workload after its
share of ``BUDGET_S``. Every measurement runs in a fresh process (``python -m
inductor_attn.bench.tuning_cost VERB``) with the shipped decision tables off, so the search itself is
measured (``--part shipped``: only cold and warm, with the package's tables on, what a user gets;
``--part background``: the same with the cold first call in background mode, which also reports when its
background tune stored a decision and which; ``--part search``: only agreement and regret, which then share
the whole budget):

- stock: per dense or decode workload without a window, a process on empty caches times the first call of
  what a user has without us, ``F.scaled_dot_product_attention`` (the overhead suite's ``sdpa_user``) under
  ``torch.compile``: cold vs stock = our cold autotune call - this (the issues' "stock + N s" targets).
- cold: per workload, a process whose Triton, FA4 and Inductor caches (``TRITON_CACHE_DIR``,
  ``FLASH_ATTENTION_CUTE_DSL_CACHE_DIR``, ``TORCHINDUCTOR_CACHE_DIR``) and decision store are empty
  directories times the first call in autotune mode (dense and decode: ``torch.compile`` of
  ``inductor_attn.attention`` and its first call, which decides while compiling; varlen and block-sparse:
  the first call, which decides at run time), then the same in ``off`` mode (no decision, kernels now
  warm). Added cold seconds = autotune - off: an upper bound, since the default kernel's own first
  compile counts as tuning. Targets: <= 5 s per dense problem, <= 10 s per varlen or block-sparse one.
- warm: per workload, a new process on the directories the cold one left (a store hit, kernels on disk),
  which imports every backend (what enumerating candidates imports: flash-attn-4's CuTe DSL among them),
  calls in ``off`` mode, then in autotune mode: autotune - off is what a store hit adds per problem (target:
  <= 0.5 s). The imports and the ``off`` call go first so that they, not the problem, pay the process's
  one-time costs (Inductor's start-up is paid before any timing); both are reported ("warm imports s",
  "warm first call s"), since a user pays them once per process. The imports come first because an off
  call whose default is SDPA imports no FA4, which a store hit on an FA4 winner would then pay.
- agreement: two processes with separate empty stores (sharing one kernel cache, so only the first
  compiles) tune every workload. A differing pair is inside the noise when, in both records, the two
  choices' medians differ by no more than that record's tie margin (the larger of tuner.TIE_MARGIN and
  its measured noise). Targets: >= 95% agree, every disagreement inside the noise.
- regret: in one process, the staged and the exhaustive search of each workload, then their two winners
  timed against each other: regret = staged winner's median / exhaustive winner's - 1 (target: <= 1%
  median, <= 3% worst). ``needed_margin``: the largest stage-1 ratio (a backend's default over the best
  default) among backends whose best config is within 1% of the best: the stage margin that would have
  found it.

``--smoke`` runs the pipeline with eager first calls on any machine (no torch.compile on a CPU, where it
costs minutes); its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from ..tuning.measure import sync
from . import suites
from .quality import compare_tunes
from .records import whole_record
from .suites import Workload

BUDGET_S = 540.0  # stays under a 10-minute job limit
SHARES = {"cold": 0.45, "agreement": 0.3, "regret": 0.25}  # of the budget, per phase
FIRST_TUNE_SHARE = 0.75  # of agreement's: the second tune finds the first one's kernels compiled
CACHE_ENV = ("TRITON_CACHE_DIR", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR",
             "INDUCTOR_ATTN_CACHE_DIR")
WORKER_MIN_S = 120  # imports, a CUDA context and one cold tune (10-55 s on an H200 without shipped tables)
LANDED_TIMEOUT_S = 120  # how long a background tune may take to store its decision


def run(smoke: bool, quick: bool, device: torch.device, part: str = "all", budget_s: float | None = None,
        shard: tuple[int, int] = (1, 1), save: Callable[[dict], None] | None = None) -> dict:
    """The phases of the module doc over the selected workloads (every ``n``-th from the ``k``-th, for
    ``shard`` (k, n)), within ``budget_s`` (default ``BUDGET_S``); results as one dict, also handed to
    ``save`` after each workload's cold and warm processes and after each later phase, so that a run killed
    from outside leaves what it finished. ``part`` "shipped": the cold and warm phase only, with the
    package's shipped decision tables on (what a user gets); "background": the same with the cold first
    call in background mode; "search": agreement and regret only, so that a call's budget reaches more
    workloads."""
    workloads = suites.select("all", quick=quick, shard=shard, smoke=smoke)
    deadline = time.monotonic() + (budget_s or BUDGET_S)
    shipped = part in ("shipped", "background")
    out: dict = {"workloads": [w.name for w in workloads], "notes": [], "shipped_tables": shipped, "cold": [],
                 "agreement": [], "regret": []}

    def finished_so_far() -> dict:
        out["summary"] = summarize(out)
        if save is not None:
            save(out)
        return out

    with tempfile.TemporaryDirectory(prefix="inductor_attn_tuning_cost_") as tmp:
        root = Path(tmp)
        if part != "search":
            for row in _cold_rows(workloads, root, deadline, smoke, out["notes"], shipped, part == "background"):
                out["cold"].append(row)
                finished_so_far()
        if shipped:
            return finished_so_far()
        shared = _cache_env(root / "agreement")
        tunes = [_worker("tune", workloads, {**shared, "INDUCTOR_ATTN_CACHE_DIR": str(root / f"store{i}")},
                         _phase_deadline(deadline, "agreement", fraction), smoke, out["notes"])
                 for i, fraction in ((1, FIRST_TUNE_SHARE), (2, 1.0))]
        out["agreement"] = compare_tunes(*tunes)
        finished_so_far()
        out["regret"] = list(_worker("regret", workloads, shared, deadline, smoke, out["notes"]).values())
    return finished_so_far()


def _cold_rows(workloads: list[Workload], root: Path, deadline: float, smoke: bool, notes: list, shipped: bool,
               background: bool):
    """Each workload's cold and warm row, as it is measured (none for a workload that did not start)."""
    share = deadline if shipped else _phase_deadline(deadline, "cold")
    verb = "background-first-call" if background else "first-call"
    for i, w in enumerate(workloads):
        if row := _cold_and_warm(w, root / f"w{i}", share, deadline, smoke, notes, shipped, verb):
            yield row


def _phase_deadline(deadline: float, phase: str, fraction: float = 1.0) -> float:
    """When ``phase`` (or the first ``fraction`` of it) must end: phases split what is left by their shares."""
    left = deadline - time.monotonic()
    later = list(SHARES)[list(SHARES).index(phase):]
    return time.monotonic() + fraction * left * SHARES[phase] / sum(SHARES[p] for p in later)


def _cache_env(directory: Path) -> dict[str, str]:
    return {env: str(directory / env.lower()) for env in CACHE_ENV}


SKIPPED_PREFIX, SKIPPED_SUFFIX = "cold/warm: ", " skipped (time budget)"  # a workload's note; table() counts them


def _cold_and_warm(w: Workload, directory: Path, deadline: float, end: float, smoke: bool, notes: list,
                   shipped: bool, cold_verb: str) -> dict | None:
    """Two processes on ``directory``'s empty caches, both with the shipped decision tables when ``shipped``:
    the cold one (``cold_verb``), then the warm one. None starts after the phase's ``deadline``; none runs
    past the run's ``end``."""
    if time.monotonic() > deadline:
        notes.append(f"{SKIPPED_PREFIX}{w.name}{SKIPPED_SUFFIX}")
        return None
    env = _cache_env(directory)
    row = {"name": w.name, "kind": w.kind}
    if w.kind in ("dense", "decode") and w.window is None:
        stock = _worker("stock-first-call", [w], _cache_env(directory / "stock"), end, smoke, notes).get(w.name)
        if stock is not None:
            row["stock_s"] = stock["stock_s"]
    for phase, verb in (("cold", cold_verb), ("warm", "warm-call")):
        # a started workload gets the time a cold tune needs, even past the phase's share
        got = _worker(verb, [w], env, min(end, max(deadline, time.monotonic() + WORKER_MIN_S)), smoke, notes,
                      shipped).get(w.name)
        if got is None:
            return row if phase == "warm" else None
        row[phase] = got
        first_s = got.get("autotune_s", got.get("background_s"))
        row[f"{phase}_added_s"] = first_s - got["off_s"]
        if phase == "cold" and "stock_s" in row:
            row["cold_vs_stock_s"] = first_s - row["stock_s"]
    return row


def _worker(verb: str, workloads: list[Workload], env: dict, deadline: float, smoke: bool,
            notes: list, shipped: bool = False) -> dict[str, dict]:
    """Run one worker process until ``deadline``; {workload name: its JSON line}. The shipped decision
    tables are off unless ``shipped``."""
    budget = deadline - time.monotonic()
    if budget < 5:
        notes.append(f"{verb}: skipped ({max(budget, 0):.0f} s of the time budget left)")
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "workloads.json", Path(tmp) / "out.jsonl"
        spec.write_text(json.dumps([w.to_json() for w in workloads]))
        root = str(Path(__file__).resolve().parents[2])
        full_env = {**os.environ, **env, **({} if shipped else {"INDUCTOR_ATTN_PRIORS": "off"}),
                    "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        cmd = [sys.executable, "-m", "inductor_attn.bench.tuning_cost", verb, "--workloads", str(spec),
               "--out", str(out)] + (["--smoke"] if smoke else [])
        try:
            proc = subprocess.run(cmd, env=full_env, cwd=root, capture_output=True, text=True, timeout=budget,
                                  check=False)
            if proc.returncode != 0:
                tail = [ln for ln in proc.stderr.splitlines() if ln.strip()][-1:] or ["(no output)"]
                notes.append(f"{verb}: worker exited {proc.returncode}: {tail[0][:200]}")
        except subprocess.TimeoutExpired:
            notes.append(f"{verb}: stopped at its deadline ({budget:.0f} s); the workloads it finished are kept")
        lines = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return {d["name"]: d for d in lines}


def summarize(result: dict) -> dict:
    """The numbers the issue's targets name."""
    summary: dict = {}
    for kind in ("dense", "decode", "varlen", "block_sparse"):
        rows = [r for r in result["cold"] if r["kind"] == kind]
        for field in ("cold_added_s", "cold_vs_stock_s", "warm_added_s"):
            added = [r[field] for r in rows if field in r]
            if added:
                summary[f"{field}_max[{kind}]"] = max(added)
    tunes = result["agreement"]
    if tunes:
        summary["agreement"] = sum(t["same"] for t in tunes) / len(tunes)
        summary["disagreements_inside_noise"] = sum(t.get("inside_noise", False) for t in tunes if not t["same"])
        summary["disagreements"] = sum(not t["same"] for t in tunes)
    regrets = [r["regret"] for r in result["regret"] if r.get("regret") is not None]
    if regrets:
        summary["regret_median"], summary["regret_worst"] = statistics.median(regrets), max(regrets)
        summary["needed_margin"] = max((r["needed_margin"] for r in result["regret"] if r.get("needed_margin")),
                                       default=None)
    return summary


def table(result: dict) -> str:
    """Markdown: per workload measured, the cold and warm added seconds, agreement and regret; then the summary,
    with the workloads the time budget left out counted in one line (a run on one device call measures a few)."""
    tunes = {t["name"]: t for t in result["agreement"]}
    regret = {r["name"]: r for r in result["regret"]}
    colds = {r["name"]: r for r in result["cold"]}
    measured = [name for name in result["workloads"] if name in colds or name in tunes or name in regret]
    lines = [("| workload | stock first call s | cold vs stock s | cold added s | cold tune s (compile / gate / "
              "timing; timed) | warm added s | warm imports s | warm first call s | fresh tunes | regret staged vs "
              "exhaustive | staged / exhaustive tune s |"), "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in measured:
        cold = colds.get(name, {})
        t, r = tunes.get(name), regret.get(name, {})
        agree = "" if t is None else "agree" if t["same"] else \
            f"differ ({'inside' if t.get('inside_noise') else 'OUTSIDE'} the noise)"
        seconds = f"{r['staged_s']:.1f} / {r['exhaustive_s']:.1f}" if "staged_s" in r else ""
        warm = cold.get("warm", {})
        lines.append(f"| {name} | {_fmt(cold.get('stock_s'))} | {_fmt(cold.get('cold_vs_stock_s'))} | "
                     f"{_fmt(cold.get('cold_added_s'))} | {_tune_seconds(cold.get('cold', {}))} | "
                     f"{_fmt(cold.get('warm_added_s'))} | "
                     f"{_fmt(warm.get('imports_s'))} | {_fmt(warm.get('off_s'))} | {agree} | "
                     f"{_fmt(r.get('regret'), '.2%')} | {seconds} |")
    summary = "; ".join(f"{k}: {_fmt(v, '.3f')}" for k, v in result["summary"].items())
    lines += ["", *([f"- {summary}"] if summary else [])]
    if result.get("shipped_tables"):
        lines.append("- shipped decision tables: on (cold and warm only)")
    for cold in result["cold"]:
        first = cold.get("cold", {})
        if "landed_s" in first:
            lines.append(f"- {cold['name']}: cold first call in background mode; its tune "
                         f"{'stored ' + str(first.get('landed_winner')) if first['landed'] else 'had not landed'} "
                         f"{first['landed_s']:.1f} s after it")
    skipped = [n for n in result["notes"] if n.startswith(SKIPPED_PREFIX) and n.endswith(SKIPPED_SUFFIX)]
    if skipped:
        lines.append(f"- cold and warm first calls: {len(skipped)} of {len(result['workloads'])} workloads not "
                     "started within the time budget")
    lines += [f"- note: {n}" for n in result["notes"] if n not in skipped]
    return "\n".join(lines)


summary = table  # RESULTS.md's section (report.py ``update_summary_sections``)


def merge(results: list[dict]) -> dict:
    """One result from the files of several shards and parts of one device (report.py ``_merged``): their rows in
    turn (a workload that several files measured keeps the last file's row), the summary over all of them. The
    shipped tables are on where every file with cold rows had them on; files that differ say so in a note."""
    merged = {key: [x for r in results for x in r.get(key, ())] for key in ("notes", "cold", "agreement", "regret")}
    merged["workloads"] = list(dict.fromkeys(w for r in results for w in r.get("workloads", ())))
    for key in ("cold", "agreement", "regret"):
        merged[key] = list({row["name"]: row for row in merged[key]}.values())
    shipped = {bool(r.get("shipped_tables")) for r in results if r.get("cold")}
    merged["shipped_tables"] = shipped == {True}
    if len(shipped) > 1:
        merged["notes"].append("cold and warm rows of several files: shipped decision tables on in some, off in others")
    merged["summary"] = summarize(merged)
    return merged


def bars(result: dict) -> dict | None:
    """The figure (report.py ``_summary_plot``): per workload, the seconds of the first compiled call: stock
    ``torch.compile``'s, and ours with empty caches (cold) and with the decision stored (warm)."""
    rows = [r for r in result["cold"] if "cold" in r]
    if not rows:
        return None

    def first_s(r: dict, phase: str) -> float | None:
        got = r.get(phase) or {}
        return got.get("autotune_s", got.get("background_s"))
    return {"xlabel": "first compiled call, s (shorter is faster)", "labels": [r["name"] for r in rows],
            "series": {"stock torch.compile": [r.get("stock_s") for r in rows],
                       "ours, cold": [first_s(r, "cold") for r in rows],
                       "ours, warm": [first_s(r, "warm") for r in rows]}}


def _tune_seconds(first: dict) -> str:
    """``total (compile / gate / timing; N timed)`` of a first call's tune, or "" where none was stored."""
    sec = first.get("tune_seconds")
    if not sec:
        return ""
    phases = " / ".join(_fmt(sec.get(p, 0.0), ".1f") for p in ("compile", "gate", "timing"))
    return f"{_fmt(sec.get('total'), '.1f')} ({phases}; {first.get('timed', '?')})"


def _fmt(x, spec: str = ".2f") -> str:
    return "" if x is None else format(x, spec) if isinstance(x, float) else str(x)


# ------------------------------------------------------------------------------------------- workers
def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def first_call(w: Workload, call, compiled: bool):
    """A function that makes the user's first call of ``w`` (built as ``call``): compiled (dense, decode) or
    eager."""
    import inductor_attn

    if call.op == "varlen":
        return lambda: inductor_attn.varlen_attention(call.q, call.k, call.v, call.cu_seqlens_q, call.cu_seqlens_k,
                                                      call.max_seqlen_q, call.max_seqlen_k, causal=call.causal)
    if call.op == "block_sparse":
        return lambda: inductor_attn.attention(call.q, call.k, call.v, block_mask=call.sparse)

    def attend(q, k, v, kv_seqlens):
        return inductor_attn.attention(q, k, v, causal=w.causal, window=w.window, kv_seqlens=kv_seqlens)

    fn = torch.compile(attend, fullgraph=True, dynamic=False) if compiled else attend
    return lambda: fn(call.q, call.k, call.v, call.kv_seqlens)


def _timed(fn, device: torch.device) -> float:
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def _first_call_worker(w: Workload, device: torch.device, smoke: bool,
                       modes: tuple[str, str] = ("autotune", "off"), imports_first: bool = False) -> dict:
    """The first call's seconds in each of ``modes``, in that order, in this process; with ``imports_first``,
    first the seconds that importing every backend takes (``imports_s``). Where the autotune call tuned,
    what its tune spent (the stored record's seconds by phase, and how many candidates it timed): where a
    cold first call's time goes, next to the compile around it."""
    from ..tuning.decisions import forget_decisions
    from ..tuning.modes import tuning_mode

    out = {}
    if imports_first:
        out["imports_s"] = _timed(lambda: import_backends(w, device), device)
    compiled = not smoke and w.kind in ("dense", "decode")
    call = suites.build(w, device).call
    for mode in modes:
        torch._dynamo.reset()  # compile afresh: the second mode must not replay the first one's graph
        forget_decisions()
        started = time.time()
        with tuning_mode(mode):
            out[f"{mode}_s"] = _timed(first_call(w, call, compiled), device)
        record = whole_record(call.problem) if mode == "autotune" else None
        if record is not None and record.get("tuned_at", 0.0) >= started:  # not a store hit
            out["tune_seconds"] = record.get("seconds")
            out["timed"] = sum(c.get("median_ms") is not None for c in record.get("candidates", []))
    return out


def _background_first_call_worker(w: Workload, device: torch.device, smoke: bool) -> dict:
    """The first call in background mode, then the seconds until its background tune has stored a decision
    (``landed_s``) and that decision's winner, then the ``off`` call (after the tune, which would share the
    GPU and the cores with it)."""
    from ..tuning import background

    out = _first_call_worker(w, device, smoke, modes=("background",))
    start = time.perf_counter()
    out["landed"] = background.wait(timeout_s=LANDED_TIMEOUT_S)
    out["landed_s"] = time.perf_counter() - start
    record = whole_record(suites.build(w, device).call.problem)
    out["landed_winner"] = None if record is None else record.get("winner")
    return {**out, **_first_call_worker(w, device, smoke, modes=("off",))}


def import_backends(w: Workload, device: torch.device) -> None:
    """What enumerating ``w``'s candidates imports (every backend's module; FA4's brings the CuTe DSL, the
    largest): a cost of the process, paid once whatever it runs, not of a problem."""
    from ..backends import enumerate_candidates
    from ..device import device_info

    enumerate_candidates(suites.build(w, device).call.problem, device_info(device), "forward")


def _stock_first_call_worker(w: Workload, device: torch.device, smoke: bool) -> dict:
    """The first call of the user's code without inductor_attn (module doc, stock), compiled unless ``smoke``."""
    from .overhead import sdpa_user

    call = suites.build(w, device).call
    fn = sdpa_user(w) if smoke else torch.compile(sdpa_user(w), fullgraph=True, dynamic=False)
    return {"stock_s": _timed(lambda: fn(call.q, call.k, call.v, call.kv_seqlens), device)}


def _tune_worker(w: Workload, device: torch.device, smoke: bool) -> dict:
    from ..device import device_info
    from ..tuning.decisions import decide
    from ..tuning.modes import tuning_mode

    call = suites.build(w, device).call
    with tuning_mode("autotune"):
        seconds = _timed(lambda: decide(call, device_info(device), "forward"), device)
        choice = decide(call, device_info(device), "forward")
    return {"choice": choice, "tune_s": seconds, "record": whole_record(call.problem)}


def _regret_worker(w: Workload, device: torch.device, smoke: bool) -> dict:
    from ..backends import enumerate_candidates
    from ..device import device_info
    from ..tuning.tuner import tune

    call = suites.build(w, device).call
    dev = device_info(device)
    cands = enumerate_candidates(call.problem, dev)
    if sum(c.pruned is None for c in cands) < 2:
        return {"regret": 0.0, "note": "one runnable candidate"}
    runs = {}
    for search in ("staged", "exhaustive"):
        start = time.perf_counter()
        runs[search] = tune(call, cands, search=search)
        runs[f"{search}_s"] = time.perf_counter() - start
    staged, exhaustive = runs["staged"].winner, runs["exhaustive"].winner
    out = {"staged": staged, "exhaustive": exhaustive, "staged_s": runs["staged_s"],
           "exhaustive_s": runs["exhaustive_s"], "needed_margin": needed_margin(runs["exhaustive"], dev)}
    if staged == exhaustive:
        return {**out, "regret": 0.0}
    pair = [c if c.name in (staged, exhaustive) else dataclasses.replace(c, pruned="not in this comparison")
            for c in cands]
    head = {c.name: c for c in tune(call, pair, search="exhaustive").candidates}
    return {**out, "regret": head[staged].median_ms / head[exhaustive].median_ms - 1}


def needed_margin(record, dev) -> float | None:
    """From an exhaustive tune: the largest stage-1 ratio (group default / best default) among the groups stage 1
    times (a backend, or one of its entry points: step_cost.entry_point) whose best config is within 1% of the
    best; the stage margin that finds all of them. A group's default is the one stage 1 times (tuner.py
    ``_groups``/``_representatives``): its backend's hand rule's config, else its first candidate, in prior order,
    that passed."""
    from ..backends import get_backend
    from ..tuning.step_cost import entry_point

    timed = [c for c in record.candidates if c.status == "passed" and c.median_ms is not None]
    if not timed:
        return None
    per_group: dict[str, list] = {}
    for c in timed:
        per_group.setdefault(entry_point(c.name), []).append(c)
    defaults = {}
    for group, mine in per_group.items():
        backend = group.partition(":")[0]
        rule = get_backend(backend).heuristic(record.problem, dev)
        defaults[group] = next((c for c in mine if rule is not None and c.name == f"{backend}:{rule}"), mine[0])
    best_default = min(c.median_ms for c in defaults.values())
    best = min(c.median_ms for c in timed)
    found = [defaults[b].median_ms / best_default for b, mine in per_group.items()
             if min(c.median_ms for c in mine) <= best * 1.01]
    return max(found)


def tune_suites(suite_names: list[str], quick: bool, smoke: bool, shard: tuple[int, int] = (1, 1)) -> int:
    """Tune every workload of ``suite_names`` (forward, exhaustive search, whatever the shipped tables
    say; one ``shard`` of them) into the current store, for ``cache export-priors --tune``; returns how
    many were tuned."""
    from ..tuning.decisions import measure

    device = _device()
    workloads = [w for name in suite_names for w in suites.select(name, quick=quick, shard=shard, smoke=smoke)]
    for w in workloads:
        call = suites.build(w, device).call
        row = measure(call, "forward", search="exhaustive")
        print(f"  {w.name}: {row['winner'] if row else 'one runnable candidate: nothing to store'}", flush=True)
        del call
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return len(workloads)


_WORKERS = {"first-call": _first_call_worker, "background-first-call": _background_first_call_worker,
            "warm-call": functools.partial(_first_call_worker, modes=("off", "autotune"), imports_first=True),
            "stock-first-call": _stock_first_call_worker, "tune": _tune_worker, "regret": _regret_worker}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inductor_attn.bench.tuning_cost",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("verb", choices=sorted(_WORKERS))
    parser.add_argument("--workloads", required=True, type=Path, help="JSON list of workloads")
    parser.add_argument("--out", required=True, type=Path, help="JSON-lines file, one line per workload")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    workloads = [Workload.from_json(d) for d in json.loads(args.workloads.read_text())]
    device = _device()
    if not args.smoke:  # Inductor's one-time start-up (imports, worker pools), outside every timing
        torch.compile(lambda x: x * 2 + 1)(torch.ones(8, device=device))
    for w in workloads:
        line = {"name": w.name, **_WORKERS[args.verb](w, device, args.smoke)}
        with args.out.open("a") as f:
            f.write(json.dumps(line, default=str) + "\n")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
