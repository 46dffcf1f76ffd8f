"""``python -m inductor_attn bench``: measure what inductor_attn decides against what users get today.

Per workload (suites.py), in one process:
1. Decisions. What inductor_attn picks in each tuning mode: ``autotune`` (a fresh decision store, so it
   really tunes; its wall time is the tuning time), ``heuristic`` (today's hand rules: FA4's CLC rule,
   split-K iff L_kv >= 256) and ``off`` (the first runnable candidate in prior order).
2. Gate. Every runnable candidate (every backend config) and every user baseline runs once on fresh
   inputs and is checked against the reference with the tuner's tolerances (tuning/correctness.py); a
   wrong or failing one is reported with its reason and never timed, so it can never be the oracle.
3. Timing. Everything that passed is timed with one timer (CUDA-graph replay, L2 flushed, rotating
   input copies; tuning/timing.py) in interleaved rounds: one sample of each per round, so all share the
   same clock and thermal drift and paired statistics apply.
4. Numbers. TFLOP/s from exact kept pairs (metrics.py) or, for decode, GB/s against the copy bandwidth
   measured at the start of the run; the speedup of each over the baseline with its paired bootstrap 95%
   CI (tuning/stats.py); the oracle (the fastest candidate that passed); regret = autotuned time /
   oracle time - 1.

Baselines (``user:*``, entries.py) are called directly, not through our backends: SDPA for dense and
decode, torch's ``varlen_attn`` for varlen, ``torch.compile(flex_attention)`` for block-sparse.

Robustness: a failing candidate or baseline is recorded with its reason; a workload that would not fit
in free GPU memory is skipped with the estimate; a workload that raises anything else is recorded as an
error with its traceback and the run goes on (the run exits 1), except under INDUCTOR_ATTN_STRICT=1.
Results are rewritten after every workload, so a run cut off at the device's time limit keeps what it
measured, and no workload starts after the time budget is spent.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..backends import AttnCall, Candidate, Config, backends, enumerate_candidates
from ..backends.reference import BACKEND as REFERENCE
from ..device import DeviceInfo, device_info
from ..store.db import get_store
from ..store.keys import library_versions
from ..tuning.correctness import POISON, check_output, check_tensor, rel_err
from ..tuning.decisions import decide, forget_decisions
from ..tuning.modes import tuning_mode
from ..tuning.stats import median, paired_bootstrap_speedup
from ..tuning.timing import default_timer
from ..tuning.tuner import CANDIDATE_ERRORS, fresh_inputs, strict
from . import metrics, report, suites
from .entries import BASELINES, Entry, candidate_entry, user_entries
from .suites import Workload

ROUNDS = {"full": 30, "quick": 20, "smoke": 5}
# Seconds one call may run: the device machine stops a command at 600 s; leave room to start and write.
BUDGET_S = {"full": 480, "quick": 450, "smoke": 300}
# Share of the budget the measurement phase may start workloads in; the rest is for the quality phase,
# whose second tune finds the kernels compiled on disk and needs less.
MEASURE_SHARE = {"full": 0.6, "quick": 0.7, "smoke": 0.6}
COPY_BYTES = {"cuda": 1 << 30, "cpu": 64 << 20}
GATE_SEED = 11  # not the tuner's gate seed (1): the bench's gate is an independent check
# Columns of the "backend defaults" table: (label, backend, config keys a candidate must have). No keys:
# the backend's own default (its ``default_config``, else its ``Config()``, else its first config).
DEFAULT_COLUMNS = (
    ("sdpa cudnn", "sdpa", {"kernel": "cudnn"}),
    ("sdpa flash", "sdpa", {"kernel": "flash"}),
    ("sdpa efficient", "sdpa", {"kernel": "efficient"}),
    ("fa4 default", "fa4", None),
    ("flex Triton", "flex", {"backend": "TRITON"}),
    ("flex FLASH", "flex", {"backend": "FLASH"}),
    ("triton default", "triton", None),
    ("triton_decode default", "triton_decode", None),
)


@dataclass
class Options:
    suite: str = "all"
    quick: bool = False
    smoke: bool = False
    out: Path | None = None
    rounds: int | None = None
    budget_s: float | None = None
    quality: bool = True
    shard: tuple[int, int] = (1, 1)
    commit: str | None = None
    command: str = "python -m inductor_attn bench"

    @property
    def size(self) -> str:
        return "smoke" if self.smoke else "quick" if self.quick else "full"


@dataclass
class Context:
    device: torch.device
    dev: DeviceInfo
    timer: object
    rounds: int
    deadline: float  # time.perf_counter() after which no workload starts
    flex_max_autotune: bool
    copy_gbps: float | None = None
    # (op, bucket key) -> the first workload tuned in it: a later workload of the same bucket reuses
    # that decision, as it would in a user's process (varlen patterns differ only in their max length)
    bucket_owner: dict = field(default_factory=dict)
    # set when a kernel left the CUDA context unusable (illegal address, ...): every later call in this
    # process fails, so later workloads are not started and the reason says where it happened
    device_lost: str | None = None


# ------------------------------------------------------------------------------------- measurement
def input_copies(call: AttnCall) -> int:
    """Input copies to rotate through, the tuner's rule: enough that one graph replay reads > 2 x 60 MB
    (an H200's L2) of inputs, at most 8, so a small problem is not timed out of a warm L2."""
    if call.q.device.type != "cuda":
        return 1
    per_call = sum(t.numel() * t.element_size() for t in (call.q, call.k, call.v)) * 2
    return int(min(8, max(1, -(-(2 * 60 << 20) // max(per_call, 1)))))


def memory_reason(call: AttnCall, n_timed: int, device: torch.device) -> str | None:
    """Why this workload would not fit in free GPU memory (None if it fits). Counts the timed input
    copies, the gate's inputs and outputs, one output per captured graph and input copy, two GQA
    expansions of K/V (the SDPA baseline's math path and our sdpa backend's efficient kernel each copy
    them inside their graphs) and 2 GiB of scratch (the reference's chunks, the L2 flush buffer, masks)."""
    if device.type != "cuda":
        return None
    io = sum(t.numel() * t.element_size() for t in (call.q, call.k, call.v))
    out = call.q[..., :1].numel() * call.v.shape[-1] * call.q.element_size() * 2  # out + fp32 lse, roughly
    kv = sum(t.numel() * t.element_size() for t in (call.k, call.v))
    group = call.q.shape[1] // call.k.shape[1]
    copies = input_copies(call)
    need = io * (copies + 3) + out * (n_timed * copies + 4) + (2 * kv * group if group > 1 else 0) + (2 << 30)
    free, _ = torch.cuda.mem_get_info(device)
    if need > 0.9 * free:
        return f"needs about {need / 2**30:.1f} GiB of GPU memory, {free / 2**30:.1f} GiB free"
    return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def describe(err: BaseException) -> str:
    first = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
    return f"{type(err).__name__}: {first[:200]}"


def gate(entry: Entry, call: AttnCall, expected) -> None:
    """Run once on ``call`` (NaN-poisoned allocator first, so unwritten outputs show) and compare with
    the reference; sets status passed/wrong/failed, the error and the first call's seconds."""
    if entry.make is None:
        return
    try:
        if call.q.device.type == "cuda":
            torch.full((max(expected[0].numel(), 1),), POISON, dtype=torch.float32, device=call.q.device)
        start = time.perf_counter()
        got = entry.make(call)()
        _sync(call.q.device)
        entry.first_call_s = time.perf_counter() - start
    except CANDIDATE_ERRORS as err:
        entry.status, entry.reason = "failed", describe(err)
        return
    except Exception as err:  # noqa: BLE001 - user baselines run torch's code; a candidate bug is reported
        if strict() and entry.kind == "candidate":
            raise
        entry.status, entry.reason = "failed", describe(err)
        return
    dtype = call.q.dtype
    if entry.kind == "user":
        entry.reason = check_tensor("output", got, expected[0], dtype)
        entry.error = rel_err(got, expected[0])
    else:
        entry.reason = check_output(got[0], got[1], expected[0], expected[1], dtype)
        entry.error = rel_err(got[0], expected[0])
    entry.status = "wrong" if entry.reason else "passed"


def time_entries(entries: list[Entry], call: AttnCall, ctx: Context) -> None:
    """Interleaved rounds with one timer: prepare each (warm-up, graph capture), then one sample of each
    per round. An entry that fails here is marked failed with the reason and dropped."""
    copies = [fresh_inputs(call, seed=100 + i) for i in range(input_copies(call))]
    runners = []
    for e in entries:
        try:
            runner = ctx.timer.prepare([e.make(c) for c in copies])
        except (*CANDIDATE_ERRORS, torch.OutOfMemoryError) as err:
            e.status, e.reason = "failed", f"while timing: {describe(err)}"
            _free(ctx.device)
            continue
        e.note = "; ".join(x for x in (e.note, runner.note) if x)
        runners.append((e, runner))
    for _ in range(ctx.rounds):
        for e, runner in runners:
            if e.status == "passed":
                try:
                    e.samples.append(runner.sample())
                except CANDIDATE_ERRORS as err:
                    e.status, e.reason, e.samples = "failed", f"while timing: {describe(err)}", []
    runners.clear()  # drops the graphs and their memory pools


def measure_copy_gbps(ctx: Context) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second), with the benchmark's timer."""
    n = COPY_BYTES.get(ctx.device.type, COPY_BYTES["cpu"])
    src = torch.empty(n // 4, dtype=torch.float32, device=ctx.device).fill_(1.0)
    dst = torch.empty_like(src)
    # an elementwise kernel, not dst.copy_(src): captured in a CUDA graph a same-dtype copy becomes a
    # memcpy node run by the copy engine, which measured 2758 GB/s on an H200 against ~4230 GB/s for a
    # copy kernel (2026-11-22), and would overstate every "% of copy" figure
    runner = ctx.timer.prepare([lambda: torch.neg(src, out=dst)])
    ms = median([runner.sample() for _ in range(max(ctx.rounds, 10))])
    del runner, src, dst
    _free(ctx.device)
    return 2 * n / (ms * 1e-3) / 1e9


# ---------------------------------------------------------------------------------------- decisions
def stored_record(problem) -> dict | None:
    """The tuner's record of this problem's bucket in the current store, without its samples."""
    key = problem.bucket().key()
    for row in get_store().rows():
        if row["op"] == f"{problem.op}/forward" and row["problem"] == key:
            rec = row["record"]
            cands = [{k: c.get(k) for k in ("name", "status", "reason", "median_ms", "speedup", "ci_low", "ci_high",
                                             "compile_s")} for c in rec["candidates"]]
            return {"winner": rec["winner"], "default": rec["default"], "why": rec["why"], "timer": rec["timer"],
                    "candidates": cands}
    return None


def decisions(call: AttnCall, dev: DeviceInfo) -> dict:
    """The choice of each tuning mode; autotune with its wall time and the tuner's record."""
    out = {}
    for mode in ("off", "heuristic", "autotune"):
        with tuning_mode(mode):
            start = time.perf_counter()
            try:
                choice, reason = decide(call, dev, "forward"), None
            except RuntimeError as err:  # no candidate at all could run: decide says which and why
                choice, reason = None, describe(err)
            _sync(call.q.device)
            out[mode] = {"choice": choice, "reason": reason}
            if mode == "autotune":
                out[mode]["tune_s"] = time.perf_counter() - start
                out[mode]["record"] = stored_record(call.problem)
    return out


def backend_defaults(cands: list[Candidate], p, dev: DeviceInfo) -> list[dict]:
    """For each DEFAULT_COLUMNS label: the candidate that is that backend's own default, or why none."""
    registered = {b.name: b for b in backends()}
    out = []
    for label, name, keys in DEFAULT_COLUMNS:
        mine = [c for c in cands if c.backend == name]
        item = {"label": label, "choice": None, "reason": None}
        if name not in registered:
            item["reason"] = "backend not registered"
        elif mine and mine[0].config is None:
            item["reason"] = mine[0].pruned
        elif keys:
            match = next((c for c in mine if all(c.config.get(k) == v for k, v in keys.items())), None)
            item["choice"] = match.name if match else None
            item["reason"] = None if match else "no such config for this problem"
        else:
            item["choice"] = _own_default(registered[name], mine, p, dev)
        out.append(item)
    return out


def _own_default(backend, mine: list[Candidate], p, dev) -> str | None:
    """The backend's hand rule if it has one for ``p``, else its ``Config()``, else its first config (backends
    list their untuned default first)."""
    names = {c.name for c in mine}
    cfg = backend.heuristic(p, dev)
    if cfg is not None and f"{backend.name}:{cfg}" in names:
        return f"{backend.name}:{cfg}"
    if f"{backend.name}:{Config()}" in names:
        return f"{backend.name}:{Config()}"
    return mine[0].name if mine else None


# ------------------------------------------------------------------------------------------ workload
def measure_workload(w: Workload, ctx: Context) -> dict:
    """One row of results; see the module docstring for the steps."""
    built = suites.build(w, ctx.device)
    call = built.call
    p = call.problem
    cands = enumerate_candidates(p, ctx.dev, "forward")
    entries = [candidate_entry(c) for c in cands] + user_entries(w, built, ctx.flex_max_autotune)
    row = _row_head(w, built, ctx)
    runnable = sum(e.make is not None for e in entries)
    reason = memory_reason(call, runnable, ctx.device)
    if reason:
        return {**row, "status": "skipped", "reason": reason}
    row["decisions"] = decisions(call, ctx.dev)
    owner = ctx.bucket_owner.setdefault((p.op, p.bucket().key()), w.name)
    if owner != w.name:
        row["decisions"]["autotune"]["reused_from"] = owner
    row["defaults"] = backend_defaults(cands, p, ctx.dev)
    _free(ctx.device)
    gate_call = fresh_inputs(call, seed=GATE_SEED)
    expected = REFERENCE.run(gate_call, None)
    for e in entries:
        gate(e, gate_call, expected)
    del gate_call, expected
    _free(ctx.device)
    chosen = {d["choice"] for d in row["decisions"].values()}
    to_time = [e for e in entries if e.status == "passed" and _worth_timing(e, entries, chosen, ctx)]
    for e in entries:
        if e.status == "passed" and e not in to_time:
            e.status, e.reason = "untimed", "the reference: the oracle of correctness, never a contender on a GPU"
    time_entries(to_time, call, ctx)
    _summarise(row, entries, call, ctx)
    return row


def _worth_timing(e: Entry, entries: list[Entry], chosen: set, ctx: Context) -> bool:
    if not e.name.startswith("reference:") or ctx.device.type != "cuda" or e.name in chosen:
        return True
    return not any(o.status == "passed" and o.kind == "candidate" and o is not e for o in entries)


def _row_head(w: Workload, built: suites.Built, ctx: Context) -> dict:
    call = built.call
    decode = w.kind == "decode"
    row = {"name": w.name, "kind": w.kind, "workload": w.to_json(), "status": "ok", "reason": None,
           "problem": call.problem.key(), "pairs": metrics.call_pairs(call), "flops": metrics.call_flops(call),
           "bytes": metrics.decode_bytes(call) if decode else None, "metric": "GB/s" if decode else "TF/s",
           "setup_s": built.setup_s}
    if built.lengths is not None:
        row["lengths"] = built.lengths
    return row


def _value(row: dict, ms: float, copy_gbps: float | None) -> dict:
    out = {"tflops": row["flops"] / (ms * 1e-3) / 1e12}
    if row["bytes"] is not None:
        out["gbps"] = row["bytes"] / (ms * 1e-3) / 1e9
        out["frac_copy"] = out["gbps"] / copy_gbps if copy_gbps else None
    return out


def _summarise(row: dict, entries: list[Entry], call: AttnCall, ctx: Context) -> None:
    by_name = {e.name: e for e in entries}
    user_name, label = BASELINES[call.op]
    baseline = by_name.get(user_name)
    if baseline is None or not baseline.timed:
        off = row["decisions"]["off"]["choice"]
        baseline, label = by_name.get(off), "off choice"
    if baseline is not None and not baseline.timed:
        baseline = None
    row["baseline"] = {"name": baseline.name, "label": label} if baseline else None
    row["entries"] = [_entry_json(e, row, baseline, ctx) for e in entries]
    results = {e["name"]: e for e in row["entries"]}
    timed = [e for e in entries if e.kind == "candidate" and e.timed]
    oracle = min(timed, key=lambda e: median(e.samples)) if timed else None
    picks = {mode: d["choice"] for mode, d in row["decisions"].items()}
    picks["oracle"] = oracle.name if oracle else None
    row["choices"] = {mode: _choice_json(name, results) for mode, name in picks.items()}
    for key in ("tune_s", "reused_from"):
        row["choices"]["autotune"][key] = row["decisions"]["autotune"].get(key)
    auto = by_name.get(picks["autotune"])
    row["regret"] = row["regret_ci"] = None
    if auto is not None and auto.timed and oracle is not None:
        # the oracle's speedup over the autotuned choice is median(autotuned) / median(oracle)
        ratio, lo, hi = paired_bootstrap_speedup(auto.samples, oracle.samples)
        row["regret"], row["regret_ci"] = ratio - 1, [lo - 1, hi - 1]
    for d in row["defaults"]:
        d.update(_choice_json(d["choice"], results) if d["choice"] else {"status": "n/a"})


def _entry_json(e: Entry, row: dict, baseline: Entry | None, ctx: Context) -> dict:
    d = {"name": e.name, "kind": e.kind, "status": e.status, "reason": e.reason, "error": e.error,
         "first_call_s": e.first_call_s, "note": e.note}
    if e.timed:
        d["median_ms"] = median(e.samples)
        d.update(_value(row, d["median_ms"], ctx.copy_gbps))
        if baseline is not None:
            d["speedup"], d["ci_low"], d["ci_high"] = paired_bootstrap_speedup(baseline.samples, e.samples)
        d["samples"] = [float(f"{s:.5g}") for s in e.samples]
    return d


def _choice_json(name: str | None, results: dict) -> dict:
    if name is None:
        return {"choice": None, "status": "none"}
    e = results.get(name, {})
    keys = ("status", "reason", "median_ms", "tflops", "gbps", "frac_copy", "speedup", "ci_low", "ci_high")
    return {"choice": name, **{k: e.get(k) for k in keys}}


# ----------------------------------------------------------------------------------------------- run
def run(opts: Options) -> int:
    """The whole command; returns the exit status (0 ok, 1 some workload raised, 2 no GPU)."""
    if not opts.smoke and not torch.cuda.is_available():
        print("error: bench measures GPU kernels and needs a CUDA GPU; none is visible here "
              f"(torch {torch.__version__}).\n       For a tiny CPU run of the whole pipeline (its numbers mean "
              "nothing) add --smoke.", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    workloads = suites.select(opts.suite, opts.quick, opts.shard, opts.smoke)
    started = time.perf_counter()
    budget = opts.budget_s or BUDGET_S[opts.size]
    share = MEASURE_SHARE[opts.size] if opts.quality else 0.9
    ctx = Context(device, device_info(device), default_timer(device.type), opts.rounds or ROUNDS[opts.size],
                  started + share * budget, flex_max_autotune=opts.size == "full")
    result = {"schema": 1, "meta": run_meta(opts, ctx, budget), "rows": [], "quality": None}
    out_dir = opts.out or default_out_dir(ctx, opts.smoke)
    print(f"inductor_attn bench: {len(workloads)} workloads on {ctx.dev.name}, writing {out_dir}", flush=True)
    with fresh_store() as store_dir:
        ctx.copy_gbps = measure_copy_gbps(ctx)
        result["meta"]["copy_gbps"] = ctx.copy_gbps
        for w in workloads:
            result["rows"].append(measure_safely(w, ctx))
            _print_row(result["rows"][-1])
            report.write_results(result, out_dir, plots=False)
        if opts.quality:
            from .quality import run_quality

            deadline = started + budget
            result["quality"] = run_quality(workloads, result["rows"], ctx, store_dir, deadline)
    result["meta"]["elapsed_s"] = time.perf_counter() - started
    report.write_results(result, out_dir, plots=True)
    if opts.out is None and not opts.smoke:
        report.write_results_md(result, repo_root() / "benchmarks" / "RESULTS.md")
    print(f"wrote {out_dir}", flush=True)
    return 1 if any(r["status"] == "error" for r in result["rows"]) else 0


def measure_safely(w: Workload, ctx: Context) -> dict:
    """measure_workload, but a workload never ends the run: past the deadline it is not started, and
    anything it raises is recorded (re-raised under INDUCTOR_ATTN_STRICT=1)."""
    if ctx.device_lost or time.perf_counter() > ctx.deadline:
        return {"name": w.name, "kind": w.kind, "workload": w.to_json(), "status": "not_run",
                "reason": ctx.device_lost or "the time budget (--budget-s) was spent before it started"}
    try:
        return measure_workload(w, ctx)
    except torch.OutOfMemoryError as err:
        return {"name": w.name, "kind": w.kind, "workload": w.to_json(), "status": "skipped",
                "reason": f"out of GPU memory: {describe(err)}"}
    except Exception as err:  # noqa: BLE001 - one broken workload must not lose a 10-minute GPU run
        if strict():
            raise
        return {"name": w.name, "kind": w.kind, "workload": w.to_json(), "status": "error",
                "reason": describe(err), "traceback": traceback.format_exc(limit=8)}
    finally:
        forget_decisions()
        lost = device_error(ctx.device)
        if lost:
            ctx.device_lost = (f"the CUDA context became unusable during {w.name} ({lost}); rerun the rest in a "
                               "new process (--suite/--shard)")
        else:
            _free(ctx.device)


def device_error(device: torch.device) -> str | None:
    """Why the device no longer runs anything (a sticky CUDA error), or None if it does."""
    if device.type != "cuda":
        return None
    try:
        torch.cuda.synchronize(device)
        torch.ones(1, device=device).add_(1).item()
    except RuntimeError as err:
        return describe(err)
    return None


def _print_row(row: dict) -> None:
    if row["status"] != "ok":
        print(f"  {row['name']}: {row['status']} ({row['reason']})", flush=True)
        return
    auto, oracle = row["choices"]["autotune"], row["choices"]["oracle"]
    speed = "" if auto.get("speedup") is None else f"{auto['speedup']:.2f}x vs {row['baseline']['label']}, "
    regret = "" if row["regret"] is None else f"regret {100 * row['regret']:.1f}%, "
    print(f"  {row['name']}: autotuned {auto['choice']} ({speed}{regret}tuned in "
          f"{auto.get('tune_s') or 0:.1f} s); oracle {oracle['choice']}", flush=True)


@contextlib.contextmanager
def fresh_store():
    """A new, empty decision store for this run (so autotune really tunes); yields its directory, which
    stays until the quality phase has used it as the warm store of a second process."""
    saved = os.environ.get("INDUCTOR_ATTN_CACHE_DIR")
    path = tempfile.mkdtemp(prefix="inductor_attn_bench_")
    os.environ["INDUCTOR_ATTN_CACHE_DIR"] = path
    forget_decisions()
    try:
        yield path
    finally:
        if saved is None:
            os.environ.pop("INDUCTOR_ATTN_CACHE_DIR", None)
        else:
            os.environ["INDUCTOR_ATTN_CACHE_DIR"] = saved
        forget_decisions()
        shutil.rmtree(path, ignore_errors=True)


def repo_root() -> Path:
    """The checkout this package runs from (benchmarks/ beside inductor_attn/), else the current dir."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "benchmarks").is_dir() else Path.cwd()


def git_commit() -> str:
    """The commit the results belong to: ``$INDUCTOR_ATTN_COMMIT`` if set, else git's HEAD with
    "-dirty" when tracked files differ from it (the device machine receives the working tree with a
    .git that can lag behind it: its HEAD alone named an older commit on 2026-11-22)."""
    if os.environ.get("INDUCTOR_ATTN_COMMIT"):
        return os.environ["INDUCTOR_ATTN_COMMIT"]

    def git(*args) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=repo_root(), capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return "unknown"
    return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def default_out_dir(ctx: Context, smoke: bool) -> Path:
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    slug = "".join(ch if ch.isalnum() else "-" for ch in ctx.dev.name.lower()).strip("-")
    return repo_root() / "benchmarks" / "results" / f"{'cpu-smoke' if smoke else slug}-{date}"


def run_meta(opts: Options, ctx: Context, budget: float) -> dict:
    versions = dict(library_versions())
    if ctx.device.type == "cuda":
        versions["cudnn"] = str(torch.backends.cudnn.version())
    return {
        "device": ctx.dev.name, "capability": f"sm_{ctx.dev.arch}", "sm_count": ctx.dev.sm_count,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": opts.commit or git_commit(), "command": opts.command, "versions": versions,
        "python": sys.version.split()[0], "suite": opts.suite, "size": opts.size,
        "shard": f"{opts.shard[0]}/{opts.shard[1]}", "rounds": ctx.rounds, "timer": ctx.timer.name,
        "budget_s": budget, "registry": [b.name for b in backends()], "smoke": opts.smoke,
        "flex_baseline_compile": "max-autotune-no-cudagraphs" if ctx.flex_max_autotune else "default",
    }


__all__ = ["Options", "Context", "run", "measure_workload", "DEFAULT_COLUMNS"]
