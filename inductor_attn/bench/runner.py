"""``python -m inductor_attn bench``: measure what inductor_attn decides against what users get today.

Per workload (suites.py), in one process:
1. Decisions. What inductor_attn picks in each tuning mode: ``autotune`` (a fresh decision store, so it
   really tunes; its wall time is the tuning time), ``heuristic`` (today's hand rules: FA4's CLC rule,
   split-K iff L_kv >= 256) and ``off`` (the first runnable candidate in prior order). Backward
   workloads decide the backward, after the forward's autotuned choice.
2. Gate. Every runnable candidate (every backend config) and every user baseline runs once on fresh
   inputs and is checked against the reference: the tuner's own gate (tuning/measure.py) with its
   tolerances (tuning/correctness.py); a wrong or failing one is reported with its reason and never
   timed, so it can never be the oracle.
3. Timing. Everything that passed is timed with the tuner's timing loop and timer (CUDA-graph replay,
   L2 flushed, rotating input copies; tuning/measure.py, tuning/timing.py) in interleaved rounds: one
   sample of each per round, so all share the same clock and thermal drift and paired statistics apply.
4. Numbers. TFLOP/s from exact kept pairs (metrics.py) or, for decode, GB/s against the copy bandwidth
   measured at the start of the run; the speedup of each over the baseline with its paired bootstrap 95%
   CI (tuning/stats.py); the oracle (the fastest candidate that passed); regret = autotuned time /
   oracle time - 1.

Candidates run through their plans, the code that ships. Baselines (``user:*``, entries.py) are called
directly, not through our backends: SDPA for dense and decode (forward and, in the backward suite,
forward + backward), torch's ``varlen_attn`` for varlen, ``torch.compile(flex_attention)`` for
block-sparse.

Robustness: a failing candidate or baseline is recorded with its reason; a workload that would not fit
in free GPU memory is skipped with the estimate; a workload that raises anything else is recorded as an
error with its traceback and the run goes on (the run exits 1), except under INDUCTOR_ATTN_STRICT=1.
Results are rewritten after every workload, so a run cut off at the device's time limit keeps what it
measured, and no workload starts after the time budget is spent. They go to ``--out`` or beside the
decision store (:func:`default_out_dir`), never into the source tree.
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
from ..backends.registry import required_distributions
from ..device import DeviceInfo, device_info
from ..store.db import default_path
from ..store.keys import library_versions
from ..tuning.decisions import decide, forget_decisions
from ..tuning.measure import (Direction, describe, device_error, fresh_inputs, gate, input_copies, strict, sync,
                              time_trials)
from ..tuning.modes import tuning_mode
from ..tuning.stats import median, paired_bootstrap_speedup
from ..tuning.timing import default_timer
from . import flex_route, metrics, report, suites
from .entries import BASELINES, Entry, candidate_entry, user_entries
from .quality import run_quality
from .records import stored_record
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
    ("fa3 unsplit", "fa3", {"num_splits": 1}),
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
    budget_s: float  # the whole call's, quality phase included
    flex_max_autotune: bool
    copy_gbps: float | None = None
    # (op, bucket key) -> the first workload tuned in it: a later workload of the same bucket reuses
    # that decision, as it would in a user's process (varlen patterns differ only in their max length)
    bucket_owner: dict = field(default_factory=dict)
    # set when a kernel left the CUDA context unusable (illegal address, ...): every later call in this
    # process fails, so later workloads are not started and the reason says where it happened
    device_lost: str | None = None


# ------------------------------------------------------------------------------------- measurement
def memory_reason(call: AttnCall, n_timed: int, device: torch.device, direction: str = "forward") -> str | None:
    """Why this workload would not fit in free GPU memory (None if it fits). Counts the timed input
    copies, the gate's inputs and outputs, one output per captured graph and input copy (backward: out,
    lse and the three gradients), two GQA expansions of K/V (the SDPA baseline's math path and our sdpa
    backend's efficient kernel each copy them inside their graphs) and 2 GiB of scratch (the reference's
    chunks, the L2 flush buffer, masks)."""
    if device.type != "cuda":
        return None
    io = sum(t.numel() * t.element_size() for t in (call.q, call.k, call.v))
    out = call.q[..., :1].numel() * call.v.shape[-1] * call.q.element_size() * 2  # out + fp32 lse, roughly
    if direction == "backward":
        out += io
    kv = sum(t.numel() * t.element_size() for t in (call.k, call.v))
    group = call.q.shape[1] // call.k.shape[1]
    copies = input_copies(call)
    need = io * (copies + 3) + out * (n_timed * copies + 4) + (2 * kv * group if group > 1 else 0) + (2 << 30)
    free, _ = torch.cuda.mem_get_info(device)
    if need > 0.9 * free:
        return f"needs about {need / 2**30:.1f} GiB of GPU memory, {free / 2**30:.1f} GiB free"
    return None


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def gate_entry(e: Entry, call: AttnCall, expected, direction: Direction) -> None:
    """The tuner's gate (tuning/measure.py): one run on ``call`` after the allocator was poisoned, checked
    against the reference; sets status passed/wrong/failed, the error and the first call's seconds."""
    if e.trial is None:
        return
    result = gate(e.trial, call, expected, lambda got: direction.check(got, expected, call.q.dtype))
    e.status, e.reason, e.error, e.first_call_s = result.status, result.reason, result.error, result.first_call_s


def time_entries(entries: list[Entry], call: AttnCall, ctx: Context) -> None:
    """The tuner's timing loop (tuning/measure.py): interleaved rounds with one timer; an entry that fails
    while timing is marked failed with the reason."""
    timed = time_trials([e.trial for e in entries], call, ctx.timer, ctx.rounds)
    for e, t in zip(entries, timed):
        e.samples = t.samples
        e.note = "; ".join(x for x in (e.note, t.note) if x)
        if t.failed:
            e.status, e.reason = "failed", t.failed


def measure_copy_gbps(device: torch.device, timer, samples: int = 10) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second), median of ``samples`` of ``timer``."""
    n = COPY_BYTES.get(device.type, COPY_BYTES["cpu"])
    src = torch.empty(n // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    # an elementwise kernel, not dst.copy_(src): captured in a CUDA graph a same-dtype copy becomes a
    # memcpy node run by the copy engine, which measured 2758 GB/s on an H200 against ~4230 GB/s for a
    # copy kernel (2026-11-22), and would overstate every "% of copy" figure
    runner = timer.prepare([lambda: torch.neg(src, out=dst)])
    ms = median([runner.sample() for _ in range(samples)])
    return 2 * n / (ms * 1e-3) / 1e9


# ---------------------------------------------------------------------------------------- decisions
def decisions(call: AttnCall, dev: DeviceInfo, direction: str = "forward") -> dict:
    """The choice of each tuning mode; autotune with its wall time and the tuner's record."""
    out = {}
    for mode in ("off", "heuristic", "autotune"):
        with tuning_mode(mode):
            start = time.perf_counter()
            try:
                choice, reason = decide(call, dev, direction), None
            except RuntimeError as err:  # no candidate at all could run: decide says which and why
                choice, reason = None, describe(err)
            sync(call.q.device)
            out[mode] = {"choice": choice, "reason": reason}
            if mode == "autotune":
                out[mode]["tune_s"] = time.perf_counter() - start
                out[mode]["record"] = stored_record(call.problem, direction)
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
        elif not mine:  # the registry lists a backend only for the ops it takes
            item["reason"] = f"takes no {p.op} problems"
        elif mine[0].config is None:
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
    cands = enumerate_candidates(p, ctx.dev, w.direction)
    row = _row_head(w, built, ctx)
    # every runnable candidate and at most two user baselines get a graph per input copy
    reason = memory_reason(call, sum(c.pruned is None for c in cands) + 2, ctx.device, w.direction)
    if reason:
        return {**row, "status": "skipped", "reason": reason}
    forward_choice = None
    if w.direction == "backward":  # the forward a training step runs before each backward candidate
        with tuning_mode("autotune"):
            forward_choice = row["forward_choice"] = decide(call, ctx.dev, "forward")
    row["decisions"] = decisions(call, ctx.dev, w.direction)
    owner = ctx.bucket_owner.setdefault((w.direction, p.op, p.bucket().key()), w.name)
    if owner != w.name:
        row["decisions"]["autotune"]["reused_from"] = owner
    row["defaults"] = backend_defaults(cands, p, ctx.dev)
    _free(ctx.device)
    gate_call = fresh_inputs(call, seed=GATE_SEED)
    direction = Direction(w.direction, gate_call)
    expected = direction.reference(gate_call)
    entries = [candidate_entry(c, direction, forward_choice) for c in cands]
    entries += user_entries(w, built, direction, ctx.flex_max_autotune)
    for e in entries:
        gate_entry(e, gate_call, expected, direction)
    del gate_call, expected
    _free(ctx.device)
    chosen = {d["choice"] for d in row["decisions"].values()}
    to_time = [e for e in entries if e.status == "passed" and _worth_timing(e, entries, chosen, ctx)]
    for e in entries:
        if e.status == "passed" and e not in to_time:
            e.status, e.reason = "untimed", "the reference: the oracle of correctness, never a contender on a GPU"
    time_entries(to_time, call, ctx)
    _summarise(row, entries, ctx)
    return row


def _worth_timing(e: Entry, entries: list[Entry], chosen: set, ctx: Context) -> bool:
    if not e.name.startswith("reference:") or ctx.device.type != "cuda" or e.name in chosen:
        return True
    return not any(o.status == "passed" and o.kind == "candidate" and o is not e for o in entries)


def _row_head(w: Workload, built: suites.Built, ctx: Context) -> dict:
    call = built.call
    decode = w.kind == "decode"
    flops = metrics.call_flops(call) * (metrics.TRAINING_FLOPS if w.direction == "backward" else 1)
    row = {"name": w.name, "kind": w.suite, "workload": w.to_json(), "status": "ok", "reason": None,
           "problem": call.problem.key(), "pairs": metrics.call_pairs(call), "flops": flops,
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


def _summarise(row: dict, entries: list[Entry], ctx: Context) -> None:
    by_name = {e.name: e for e in entries}
    user_name, label = BASELINES[row["kind"]]
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
    ctx = _context(opts)
    if ctx is None:
        return 2
    if opts.suite == "flex_route":
        return run_flex_route(opts, ctx)
    workloads = suites.select(opts.suite, opts.quick, opts.shard, opts.smoke)
    started = time.perf_counter()
    result = {"schema": 1, "meta": run_meta(opts, ctx), "rows": [], "quality": None}
    out_dir = opts.out or default_out_dir(opts.suite, ctx.dev.name, opts.smoke)
    print(f"inductor_attn bench: {len(workloads)} workloads on {ctx.dev.name}, writing {out_dir}", flush=True)
    with fresh_store() as store_dir:
        ctx.copy_gbps = measure_copy_gbps(ctx.device, ctx.timer, max(ctx.rounds, 10))
        _free(ctx.device)
        result["meta"]["copy_gbps"] = ctx.copy_gbps
        for w in workloads:
            result["rows"].append(measure_safely(w, ctx))
            _print_row(result["rows"][-1])
            report.write_results(result, out_dir, plots=False)
        if opts.quality:
            deadline = started + ctx.budget_s
            result["quality"] = run_quality(workloads, result["rows"], ctx, store_dir, deadline)
    result["meta"]["elapsed_s"] = time.perf_counter() - started
    report.write_results(result, out_dir, plots=True)
    print(f"wrote {out_dir}", flush=True)
    return 1 if any(r["status"] == "error" for r in result["rows"]) else 0


def run_flex_route(opts: Options, ctx: Context) -> int:
    """``--suite flex_route`` (flex_route.py), on a fresh decision store so the routed calls really tune."""
    out_dir = opts.out or default_out_dir(opts.suite, ctx.dev.name, opts.smoke)
    started = time.perf_counter()
    result = {"schema": 1, "meta": run_meta(opts, ctx), "quality": None}
    print(f"inductor_attn bench --suite flex_route on {ctx.dev.name}, writing {out_dir}", flush=True)
    with fresh_store():
        result.update(flex_route.run(opts.size, ctx.device, ctx.timer, ctx.rounds))
    result["meta"]["elapsed_s"] = time.perf_counter() - started
    report.write_results(result, out_dir, plots=False)
    print(("SMOKE RUN, tiny shapes: these numbers mean nothing\n" if opts.smoke else "")
          + flex_route.table(result["rows"]) + f"\nwrote {out_dir}", flush=True)
    return 0


def _context(opts: Options) -> Context | None:
    """The run's device, timer, rounds and deadline; None (after saying why) when no GPU is visible and
    this is not a smoke run."""
    if not opts.smoke and not torch.cuda.is_available():
        print("error: bench measures GPU kernels and needs a CUDA GPU; none is visible here "
              f"(torch {torch.__version__}).\n       For a tiny CPU run of the whole pipeline (its numbers mean "
              "nothing) add --smoke.", file=sys.stderr)
        return None
    if opts.smoke:
        print("SMOKE RUN: tiny float32 shapes; it tests the harness, its numbers mean nothing", flush=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    budget = opts.budget_s or BUDGET_S[opts.size]
    share = MEASURE_SHARE[opts.size] if opts.quality else 0.9
    return Context(device, device_info(device), default_timer(device.type), opts.rounds or ROUNDS[opts.size],
                   time.perf_counter() + share * budget, budget, flex_max_autotune=opts.size == "full")


def measure_safely(w: Workload, ctx: Context) -> dict:
    """measure_workload, but a workload never ends the run: past the deadline it is not started, and
    anything it raises is recorded (re-raised under INDUCTOR_ATTN_STRICT=1)."""
    if ctx.device_lost or time.perf_counter() > ctx.deadline:
        return {"name": w.name, "kind": w.suite, "workload": w.to_json(), "status": "not_run",
                "reason": ctx.device_lost or "the time budget (--budget-s) was spent before it started"}
    try:
        return measure_workload(w, ctx)
    except torch.OutOfMemoryError as err:
        return {"name": w.name, "kind": w.suite, "workload": w.to_json(), "status": "skipped",
                "reason": f"out of GPU memory: {describe(err)}"}
    except Exception as err:  # noqa: BLE001 - one broken workload must not lose a 10-minute GPU run
        if strict():
            raise
        return {"name": w.name, "kind": w.suite, "workload": w.to_json(), "status": "error",
                "reason": describe(err), "traceback": traceback.format_exc(limit=8)}
    finally:
        forget_decisions()
        lost = device_error(ctx.device)
        if lost:
            ctx.device_lost = (f"the CUDA context became unusable during {w.name} ({lost}); rerun the rest in a "
                               "new process (--suite/--shard)")
        else:
            _free(ctx.device)



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


def default_out_dir(suite: str, device_name: str, smoke: bool) -> Path:
    """``<decision store dir>/bench/<suite>-<device>-<UTC time>[-smoke]``: never the source tree."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d-%H%M%S")
    slug = "".join(ch if ch.isalnum() else "-" for ch in device_name.lower()).strip("-")
    return default_path().parent / "bench" / f"{suite}-{slug}-{stamp}{'-smoke' if smoke else ''}"


def run_stamp(commit: str | None) -> dict:
    """When, at which commit (``commit``, else :func:`git_commit`) and with which libraries a run measures: the
    ``date`` (UTC, to the minute), ``commit`` and ``versions`` of every results file."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": commit or git_commit(), "versions": dict(library_versions(required_distributions()))}


def run_meta(opts: Options, ctx: Context) -> dict:
    stamp = run_stamp(opts.commit)
    if ctx.device.type == "cuda":
        stamp["versions"]["cudnn"] = str(torch.backends.cudnn.version())
    return {
        "device": ctx.dev.name, "capability": f"sm_{ctx.dev.arch}", "sm_count": ctx.dev.sm_count,
        **stamp, "command": opts.command,
        "python": sys.version.split()[0], "suite": opts.suite, "size": opts.size,
        "shard": f"{opts.shard[0]}/{opts.shard[1]}", "rounds": ctx.rounds, "timer": ctx.timer.name,
        "budget_s": ctx.budget_s, "registry": [b.name for b in backends()], "smoke": opts.smoke,
        "flex_baseline_compile": "max-autotune-no-cudagraphs" if ctx.flex_max_autotune else "default",
    }


__all__ = ["Options", "Context", "run", "measure_workload", "DEFAULT_COLUMNS"]
