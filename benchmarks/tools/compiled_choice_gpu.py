"""What compiled code runs, against the best candidate and stock compiled SDPA, per prefill shape (GPU).

    PYTHONPATH=. python benchmarks/tools/compiled_choice_gpu.py --out $OUT [--shapes 512c 2048c ...] [--training]
    PYTHONPATH=. python benchmarks/tools/compiled_choice_gpu.py --out $OUT --spell
    PYTHONPATH=. python benchmarks/tools/compiled_choice_gpu.py --out $OUT --llama
    python benchmarks/tools/compiled_choice_gpu.py --report DIR [--commit C] [--date D]

Per shape, in one process with a fresh decision store: ``inductor_attn.attention`` compiled plainly and with
``mode="reduce-overhead"`` (the first compile tunes), and stock compiled SDPA. Reported:

- which candidate each compiled form runs (``inductor_attn.stats()``), its device time from the tune's record
  against the best candidate's (the tuner times every SDPA backend and FA4 config as candidates), and whether
  the call is device-bound (its kernel outlasts the chosen launch's host time);
- wall us per call of the plain forms, ours and stock taking turns (``interleaved_wall_us``);
- the host probe of every candidate the tune timed (``host_ms``, what the rule weighs) against a loop of the same
  launches, and the probe taken again taking turns with that loop (``ROUNDS`` rounds of two bursts of ``BURST``,
  medians), the tune's own procedure taken again (every candidate in turns, as ``tuner.host_times`` probes; each
  of ``ROUNDS`` rounds against a loop of each candidate taken right after it), and against the compiled call's own
  cost for a few forced choices (a compiled call of that choice minus a compiled ``q + 1``): the probe must stand
  for what compiled code pays;
- for the probed shapes and the training step's two directions, FA4's and cuDNN's launches through the launch op,
  called alone and taking turns (``OP_LAUNCHES``): issue 52 asks for FA4's within 1.1x of cuDNN's there.

``--training``: B4 Hq16/Hkv4 L2048 D64 causal, forward and backward compiled as one training step (plain):
the kernels of both directions against each direction's best, and the step's wall time against stock's; then the
same step with each pair of the fastest launch paths' kernels forced (``PAIR_PATHS`` per direction), its kernel,
host, loop host and wall us taking turns with ours and stock's: which pair the step really runs fastest with.

Last, the cost of gating decisions not tuned in this process: the decisions are forgotten (as in a new process
that finds them in the store) and each shape's first decision is timed, the gate of its winner included.

``--spell``: a decode call (B1 H32/8 Lkv2k D128, kv_seqlens) compiled and tuned in a fresh process, then its
first 400 calls in windows of 20 (us per call, the main thread's CPU time, the GPU's SM clock, the CPU time of
this process's children and garbage collections per window) next to stock compiled SDPA's: whether a tune
leaves anything that slows the calls after it.

``--report DIR``: the markdown section of benchmarks/RESULTS.md from a run's files in DIR: compiled_choice.json,
spell.json and llama.json, those it holds. Each file records its date, commit and library versions (``--commit`` and
``--date`` override compiled_choice.json's where the device's git lagged, and ``--commit`` a spell or Llama file's
recorded at the same commit); a spell or Llama file from another run than compiled_choice.json's says so.

``--llama``: the HF Llama entries of ``inductor_attn.bench.models`` (prefill, the B4 L2048 and B1 L512 training
steps, the static-cache decode step; plain launches), each in a fresh process with a fresh store, stock
``torch.compile`` against ours: llama.json, an entry that fails or times out recorded with its reason. The first
three took 270-300 s on an H200 host (2026-11-30), so all four do not fit one 600 s device call with a warm-up:
run the decode entry in a call of its own.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import inductor_attn
from inductor_attn.backends import AttnCall, plan_for
from inductor_attn.bench.models import STEP_HEADER, step_cells
from inductor_attn.bench.report import cell, versions_text
from inductor_attn.bench.records import whole_record
from inductor_attn.bench.runner import fresh_store, run_stamp
from inductor_attn.bench.wallclock import BURST, burst_host_us, interleaved_measure, interleaved_wall_us, own_code, warm
from inductor_attn.device import device_info
from inductor_attn.tuning.measure import Direction
from inductor_attn.tuning.step_cost import entry_point
from inductor_attn.tuning.timing import host_ms, host_ms_each

SHAPES = {f"{n}{'c' if c else 'f'}": (1, 32, 32, n, 128, c) for n in (512, 2048, 8192) for c in (True, False)}
FORCED = ("sdpa:kernel=cudnn", "sdpa:kernel=flash", "fa4:default")


def _inputs(b, hq, hkv, n, d, requires_grad=False, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen,
                             requires_grad=requires_grad) for h in (hq, hkv, hkv))


ROUNDS = 5  # rounds of the interleaved host measures


def _interleaved_host_us(fns: dict) -> dict:
    """Per-call CPU time of each function of ``fns``, the median of ``ROUNDS`` rounds in which they take turns (two
    bursts of ``BURST`` launches each per round, after warm-up): the device machine's CPU drifted within a session
    (a compiled ``q + 1`` read 38, 54 and 64 us in three calls, H200, 2026-11-29); a drift then falls on all
    alike."""
    for fn in fns.values():
        warm(fn)
    samples = {name: [] for name in fns}
    for _ in range(ROUNDS):
        for name, fn in fns.items():
            samples[name].append(burst_host_us(fn, 2 * BURST))
    return {name: statistics.median(xs) for name, xs in samples.items()}


def _choice_of(stats: dict, direction: str) -> str:
    names = [k.split(" -> ")[1].split(" (")[0] for k in stats if k.startswith(f"attention/{direction} -> ")]
    return names[-1] if names else "?"


def _devices(rec: dict, choice: str) -> dict:
    timed = {c["name"]: c for c in rec["candidates"] if c["status"] == "passed" and c.get("median_ms")}
    best = min(timed.values(), key=lambda c: c["median_ms"])
    chosen = timed.get(choice)
    return {"choice": choice, "device_ms": chosen and chosen["median_ms"], "host_ms": chosen and chosen.get("host_ms"),
            "best": best["name"], "best_ms": best["median_ms"],
            "regret": chosen and chosen["median_ms"] / best["median_ms"] - 1}


def probes(rec: dict, call: AttnCall, direction: str) -> list[dict]:
    """Each timed candidate's probe from the record (taken inside the tune) against a loop of the same launches,
    the tuner's probe taken again now, taking turns with the loop (``ROUNDS`` rounds), and the tune's procedure
    again now (all candidates in turns, each round against loops taken right after it): the first ratio is what the
    rule read, the second whether the probe's method agrees with the loop under the same conditions, the third
    whether the tune's procedure does. With autograd off, as the tune probes and compiled code runs (an aten call's
    autograd dispatch doubled a cuDNN forward's host time, tuning/tuner.py)."""
    with torch.no_grad():
        return _probes(rec, call, direction)


def _probes(rec: dict, call: AttnCall, direction: str) -> list[dict]:
    mode = Direction(direction, call)
    dev = device_info(call.q.device)
    rows, launches = [], {}
    for c in rec["candidates"]:
        if c["status"] != "passed" or c.get("host_ms") is None or c["name"].startswith("reference"):
            continue
        launch = launches[c["name"]] = mode.as_compiled_code_runs(plan_for(call.problem, c["name"], dev, direction),
                                                                  call, c["name"])
        warm(launch)
        now, loop = [], []
        for _ in range(ROUNDS):
            now.append(host_ms(launch, call.q.device) * 1e3)
            loop.append(burst_host_us(launch, 2 * BURST))
        loop_us, now_us = statistics.median(loop), statistics.median(now)
        rows.append({"name": c["name"], "device_us": c["median_ms"] * 1e3, "probe_us": c["host_ms"] * 1e3,
                     "probe_now_us": now_us, "loop_us": loop_us, "probe_over_loop": c["host_ms"] * 1e3 / loop_us,
                     "probe_now_over_loop": now_us / loop_us})
    # the tune's own procedure again: every candidate in turns, bursts sized by its device time (timing.host_ms_each
    # as tuner.host_times calls it), each round followed at once by every candidate's loop, the ratio taken per
    # round: beside probe_now (one candidate at a time) it tells whether a tune's probes differ from a loop by the
    # procedure or by the moment (the host runs at two speeds in spells of 0.2-2 s: a loop taken seconds from the
    # procedure may meet the other one)
    device_ms = {r["name"]: r["device_us"] / 1e3 for r in rows}
    ratios: dict[str, list[float]] = {name: [] for name in launches}
    for _ in range(ROUNDS):
        again = host_ms_each(launches, call.q.device, device_ms=device_ms)
        for name, launch in launches.items():
            ratios[name].append(again[name] * 1e3 / burst_host_us(launch, 2 * BURST))
    for row in rows:
        row["tune_procedure_now_over_loop"] = statistics.median(ratios[row["name"]])
    return rows


# Issue 52's launch comparison: FA4's launch through the launch op within 1.1x of cuDNN's through the same op
OP_LAUNCHES = {"forward": ("sdpa:kernel=cudnn", "fa4:default"), "backward": ("sdpa:kernel=cudnn",
                                                                           "fa4:deterministic=False")}


def op_launches(call: AttnCall, direction: str) -> dict:
    """us of host per launch of each of ``OP_LAUNCHES[direction]`` through the launch op, called alone (the thin
    op compiled code calls for a plan it cannot trace; SDPA's plans go there only here), taking turns, with
    autograd off as compiled code runs; a choice that cannot run here says why."""
    from inductor_attn.ops.launch import _as_compiled_code_launches

    mode, dev, fns, out = Direction(direction, call), device_info(call.q.device), {}, {}
    with torch.no_grad():
        for choice in OP_LAUNCHES[direction]:
            try:  # the plan run directly first: through the op, one that fails gives way to the next candidate
                mode.run(plan_for(call.problem, choice, dev, direction), call)
            except Exception as err:  # noqa: BLE001 - FA4 absent or unable: recorded, the other measured
                out[choice] = f"{type(err).__name__}: {str(err)[:120]}"
                continue
            fns[choice] = _as_compiled_code_launches(direction, choice, call, *(mode.grads or ()))
        return out | _interleaved_host_us(fns)


def compiled_costs(call: AttnCall) -> dict:
    """us per compiled call of each forced choice, minus a compiled ``q + 1``'s: what compiled code pays."""
    op = torch.ops.inductor_attn.attention.default
    floor_fn = torch.compile(own_code(lambda q, k, v: q + 1))
    q, k, v = call.q, call.k, call.v
    fns, out = {"floor_us": lambda: floor_fn(q, k, v)}, {}
    for choice in FORCED:
        def f(q, k, v, choice=choice):
            return op(q, k, v, call.scale, call.causal, -1, -1, None, None, choice)[0]
        try:
            fn = torch.compile(own_code(f))
            fn(q, k, v)  # compiles here: a choice that cannot run this shape fails alone
            fns[choice] = lambda fn=fn: fn(q, k, v)
        except Exception as err:  # noqa: BLE001 - a choice that cannot run this shape
            out[choice] = f"{type(err).__name__}: {str(err)[:120]}"
    host = _interleaved_host_us(fns)
    out["floor_us"] = host.pop("floor_us")
    return out | {choice: us - out["floor_us"] for choice, us in host.items()}


class GcInProbes:
    """The garbage collections that ran while a tune probed host times (``tuner._Search.host_times``), per
    generation: count and ms, in ``tunes`` (one dict per tune since the last :meth:`take`). The probes are CPU time,
    so a collection inside a burst is charged to the launch that triggered it: whether the collector explains a
    tune's probes reading far from a later loop (on an H200, 2026-12-01, it ran 4-6 young collections, 2.5 ms in
    all, during a tune's probes: it does not; a full collection first took 0.21-0.23 s inside the compile)."""

    def __init__(self):
        from inductor_attn.tuning import tuner

        self.tunes, self._inside, self._start = [], False, None
        real = tuner._Search.host_times

        def host_times(search, names):
            self.tunes.append({})
            self._inside = True
            try:
                return real(search, names)
            finally:
                self._inside = False

        tuner._Search.host_times = host_times
        gc.callbacks.append(self._note)

    def _note(self, phase: str, info: dict) -> None:
        if not self._inside:
            return
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            n, ms = self.tunes[-1].get(info["generation"], (0, 0.0))
            self.tunes[-1][info["generation"]] = (n + 1, ms + (time.perf_counter() - self._start) * 1e3)
            self._start = None

    def take(self) -> list[dict]:
        taken, self.tunes = self.tunes, []
        return [{f"gen{g}": {"collections": n, "ms": round(ms, 2)} for g, (n, ms) in sorted(t.items())}
                for t in taken]


GC_IN_PROBES: GcInProbes | None = None


def prefill(name: str, b, hq, hkv, n, d, causal, with_probes: bool) -> dict:
    torch._dynamo.reset()
    inductor_attn.reset_stats()
    q, k, v = _inputs(b, hq, hkv, n, d)

    def ours(q, k, v):
        return inductor_attn.attention(q, k, v, causal=causal)

    def stock(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    plain = torch.compile(own_code(ours), fullgraph=True)
    warm(lambda: plain(q, k, v))
    plain_choice = _choice_of(inductor_attn.stats(), "forward")
    inductor_attn.reset_stats()
    graphs = torch.compile(own_code(ours), fullgraph=True, mode="reduce-overhead")
    warm(lambda: graphs(q, k, v))
    graphs_choice = _choice_of(inductor_attn.stats(), "forward")
    stock_fn = torch.compile(own_code(stock), fullgraph=True)
    walls = interleaved_wall_us({"ours": lambda: plain(q, k, v), "stock": lambda: stock_fn(q, k, v)}, calls=200)
    call = AttnCall("attention", q, k, v, d ** -0.5, causal)
    rec = whole_record(call.problem, "forward")
    row = {"shape": name, "plain": _devices(rec, plain_choice), "reduce-overhead": _devices(rec, graphs_choice),
           "wall_us": walls, "wall_ours_over_stock": walls["ours"] / walls["stock"]}
    p = row["plain"]
    row["plain"]["device_bound"] = bool(p["device_ms"] and p["host_ms"] and p["device_ms"] > p["host_ms"])
    row["gc_in_host_probes"] = GC_IN_PROBES.take()
    if with_probes:
        row["probes"] = probes(rec, call, "forward")
        row["compiled_us"] = compiled_costs(call)
        row["op_launch_us"] = op_launches(call, "forward")
    return row


def foreign_gates(shapes: list[str]) -> dict:
    """Seconds of each shape's first decision in a process that did not tune it (the gate of its winner)."""
    from inductor_attn.tuning.decisions import decide, forget_decisions

    forget_decisions()
    out = {}
    for name in shapes:
        b, hq, hkv, n, d, causal = SHAPES[name]
        call = AttnCall("attention", *_inputs(b, hq, hkv, n, d), d ** -0.5, causal)
        torch.cuda.synchronize()
        start = time.perf_counter()
        decide(call, device_info(call.q.device), "forward")
        torch.cuda.synchronize()
        out[name] = time.perf_counter() - start
    return out


def training() -> dict:
    torch._dynamo.reset()
    inductor_attn.reset_stats()
    q, k, v = _inputs(4, 16, 4, 2048, 64, requires_grad=True)
    grad = torch.randn_like(q)

    def ours(q, k, v):
        return inductor_attn.attention(q, k, v, causal=True)

    def stock(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    steps = {}
    for name, fn in (("ours", ours), ("stock", stock)):
        compiled = torch.compile(own_code(fn), fullgraph=True)
        steps[name] = warm(lambda c=compiled: torch.autograd.grad(c(q, k, v), (q, k, v), grad))
        if name == "ours":
            stats = inductor_attn.stats()
    call = AttnCall("attention", q.detach(), k.detach(), v.detach(), 64 ** -0.5, True)
    records = {direction: whole_record(call.problem, direction) for direction in ("forward", "backward")}
    pairs = [(f, b) for f in _fastest_paths(records["forward"]) for b in _fastest_paths(records["backward"])]
    failed = {}
    for pair in pairs:
        compiled = torch.compile(own_code(_forced_pair(*pair, call.scale)), fullgraph=True)
        try:
            steps[" + ".join(pair)] = warm(lambda c=compiled: torch.autograd.grad(c(q, k, v), (q, k, v), grad))
        except Exception as err:  # noqa: BLE001 - a pair that cannot run is recorded, the others measured
            failed[" + ".join(pair)] = f"{type(err).__name__}: {str(err)[:200]}"
    measured = interleaved_measure(steps) | {name: {"error": why} for name, why in failed.items()}
    walls = {name: m["wall_us"] for name, m in measured.items() if "wall_us" in m}
    row = {"stats": stats, "gc_in_host_probes": GC_IN_PROBES.take(),
           "wall_us": {name: walls[name] for name in ("ours", "stock")},
           "wall_ours_over_stock": walls["ours"] / walls["stock"], "steps": measured}
    for direction, rec in records.items():
        row[direction] = _devices(rec, _choice_of(stats, direction))
        row[f"{direction}_probes"] = probes(rec, call, direction)
        row[f"{direction}_op_launch_us"] = op_launches(call, direction)
    return row


PAIR_PATHS = 3  # launch paths per direction whose pairs the training step forces


def _fastest_paths(rec: dict) -> list[str]:
    """The fastest candidate of each of the ``PAIR_PATHS`` launch paths with the fastest kernels in ``rec``."""
    best: dict[str, dict] = {}
    for c in rec["candidates"]:
        if c["status"] != "passed" or not c.get("median_ms") or c["name"].startswith("reference"):
            continue
        path = entry_point(c["name"])
        if path not in best or c["median_ms"] < best[path]["median_ms"]:
            best[path] = c
    return [c["name"] for c in sorted(best.values(), key=lambda c: c["median_ms"])[:PAIR_PATHS]]


def _forced_pair(forward: str, backward: str, scale: float):
    """A causal attention whose compiled forward runs ``forward`` and backward ``backward`` (named choices of the
    ops, which the lowering emits as it emits a decision)."""
    fwd_op, bwd_op = torch.ops.inductor_attn.attention.default, torch.ops.inductor_attn.attention_backward.default

    class Pair(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            out, lse = fwd_op(q, k, v, scale, True, -1, -1, None, None, forward)
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, grad_out):
            q, k, v, out, lse = ctx.saved_tensors
            return bwd_op(grad_out, None, q, k, v, out, lse, scale, True, -1, -1, None, None, backward)

    def step(q, k, v):  # compiling ``Pair.apply`` itself fails on torch 2.11 (Dynamo takes ``cls`` for a tensor)
        return Pair.apply(q, k, v)

    return step


def spell() -> dict:
    """Windows of 20 calls right after a tune, ours and stock taking turns."""
    import psutil

    b, hq, hkv, n, d = 1, 32, 8, 2048, 128
    q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lens = torch.tensor([1500], device="cuda", dtype=torch.int32)
    mask = (torch.arange(n, device="cuda")[None, :] < lens[:, None])[:, None, None, :]
    stock = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True))
    warm(lambda: stock(q, k, v), 20)
    ours = torch.compile(lambda q, k, v: inductor_attn.attention(q, k, v, kv_seqlens=lens))
    start = time.perf_counter()
    ours(q, k, v)
    torch.cuda.synchronize()
    tuned_s = time.perf_counter() - start
    me, gcs = psutil.Process(), []
    gc.callbacks.append(lambda phase, info: phase == "start" and gcs.append(info["generation"]))
    fns = {"ours": lambda: ours(q, k, v), "stock": lambda: stock(q, k, v)}
    windows = []
    for r in range(20):
        for name, fn in fns.items():
            kids = me.children(recursive=True)
            kid_cpu = sum(sum(c.cpu_times()[:2]) for c in kids)
            seen = len(gcs)
            torch.cuda.synchronize()
            wall, cpu = time.perf_counter(), time.thread_time()
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            windows.append({"round": r, "name": name, "us": (time.perf_counter() - wall) / 20 * 1e6,
                            "cpu_us": (time.thread_time() - cpu) / 20 * 1e6, "sm_mhz": _sm_clock(),
                            "children": len(kids),
                            "children_cpu_s": sum(sum(c.cpu_times()[:2]) for c in me.children(recursive=True)
                                                  if c.is_running()) - kid_cpu, "gcs": gcs[seen:]})
    return {"tune_s": tuned_s, "first_200_us": _spell_medians(windows, slice(0, 10)),
            "last_100_us": _spell_medians(windows, slice(-5, None)), "windows": windows}


def _sm_clock() -> int | None:
    """The GPU's SM clock now (NVML), or None where NVML cannot be read."""
    try:
        return torch.cuda.clock_rate()
    except Exception:  # noqa: BLE001 - NVML missing or not permitted: the windows go on without it
        return None


LLAMA = {"prefill B4 L2048": ("overhead", "prefill", "default"),
         "training step B4 L2048": ("training", "B4 L2048", "default"),
         "training step B1 L512": ("training", "B1 L512", "default"),
         "decode step B4 (static cache)": ("overhead", "decode step", "default")}


def llama(labels: list[str], save) -> dict:
    """The entries ``labels`` of :data:`LLAMA`, each in a fresh process (``models.isolated``) on a fresh decision
    store; ``save`` is called after each, so that a run cut short keeps the entries it finished."""
    from inductor_attn.bench import models

    out = {}
    for label in labels:
        kind, *args = LLAMA[label]
        with fresh_store():  # the child process inherits its directory
            out[label] = models.isolated(kind, *args)
        print(json.dumps({label: out[label]}), flush=True)
        save(out)
    return out


def report(run: Path, commit: str | None = None, date: str | None = None) -> str:
    """benchmarks/RESULTS.md's section for one run's files (see the module doc); ``commit`` and ``date`` override
    what compiled_choice.json records, and ``commit`` also what a Llama or spell file records where that is the same
    (the device's git lagged for the whole run). A DIR without compiled_choice.json (a ``--llama`` call of its own)
    gives the parts its files hold."""
    choice_path = run / "compiled_choice.json"
    lines, lagged = [], None  # lagged: the recorded commit that ``commit`` corrects; None: whatever a file recorded
    if choice_path.exists():
        choice = json.loads(choice_path.read_text())
        lagged = choice.get("commit", "")  # "" is no file's commit: nothing to correct
        lines = _choice_lines(choice, commit or choice.get("commit", "?"), date or choice.get("date", "?"))

    def corrected(recorded: str) -> str:
        return commit if commit and lagged in (None, recorded) else recorded
    return "\n".join(lines + _part_lines(run, corrected)).lstrip("\n")


def _choice_lines(choice: dict, commit: str, date: str) -> list[str]:
    """The compiled-choice part of the section: the per-shape table, the training step, probes and costs."""
    shapes = [row["shape"] for row in choice["prefill"]]
    probed = [row["shape"] for row in choice["prefill"] if row.get("probes")]
    command = (f"--shapes {' '.join(shapes)} --probes{''.join(' ' + shape for shape in probed)}"
               + (" --training" if "training" in choice else ""))
    lines = [f"{choice['device']}, torch {choice['torch']}, {date}, commit {commit}; command "
             f"`PYTHONPATH=. python benchmarks/tools/compiled_choice_gpu.py --out $OUT {command}` (a fresh decision "
             "store; bf16, B1 H32 D128, `c` causal).", "",
             "| shape | plain: runs | its kernel / best's | kernel outlasts its launch | wall, ours / stock compile "
             "| reduce-overhead: runs | its kernel / best's |", "|---|---|---|---|---|---|---|"]
    for row in choice["prefill"]:
        plain, graphs = row["plain"], row["reduce-overhead"]
        lines.append(f"| L{row['shape']} | `{plain['choice']}` | {1 + plain['regret']:.2f}x (`{plain['best']}`) | "
                     f"{'yes' if plain['device_bound'] else 'no'} | {row['wall_ours_over_stock']:.2f}x "
                     f"({row['wall_us']['ours']:.0f} / {row['wall_us']['stock']:.0f} us) | `{graphs['choice']}` | "
                     f"{1 + graphs['regret']:.2f}x |")
    if "training" in choice:
        t = choice["training"]
        lines += ["", "One-layer training step, B4 H16/4 L2048 D64 causal, forward and backward compiled (plain): "
                  f"forward `{t['forward']['choice']}` ({1 + t['forward']['regret']:.2f}x the best kernel), "
                  f"backward `{t['backward']['choice']}` ({1 + t['backward']['regret']:.2f}x); wall "
                  f"{t['wall_ours_over_stock']:.2f}x stock compile's ({t['wall_us']['ours']:.0f} / "
                  f"{t['wall_us']['stock']:.0f} us)."]
        if "steps" in t:
            lines += ["", "The same step with each pair of the fastest launch paths' kernels forced (the tune's "
                      f"fastest config of each of the {PAIR_PATHS} paths with the fastest kernels, per direction), "
                      "taking turns with ours and stock's (`bench/wallclock.py`'s `interleaved_measure`):", "",
                      "| step | kernels us | host us (burst) | loop host us | wall us |", "|---|---|---|---|---|"]
            for name, m in sorted(t["steps"].items(), key=lambda item: item[1].get("wall_us", float("inf"))):
                if "error" in m:
                    lines.append(f"| `{name}` | {cell(m['error'][:120])} | | | |")
                    continue
                lines.append(f"| `{name}` | {_fmt_us(m['kernel_us'])} | {m['host_us']:.0f} | "
                             f"{m['loop_host_us']:.0f} | {m['wall_us']:.0f} |")
    probes = [(row["shape"], p) for row in choice["prefill"] for p in row.get("probes", [])]
    if "training" in choice:
        probes += [(f"train {d}", p) for d in ("forward", "backward") for p in choice["training"][f"{d}_probes"]]
    paths: dict[tuple, list[dict]] = {}
    for shape, p in probes:
        paths.setdefault((shape, entry_point(p["name"])), []).append(p)
    ratios = {}  # (call, launch path) -> (probe / loop, probe again / loop), medians over its configs
    for key, group in paths.items():
        probe, loop = (statistics.median(p[k] for p in group) for k in ("probe_us", "loop_us"))
        again, procedure = ([p[k] for p in group if p.get(k) is not None]
                            for k in ("probe_now_over_loop", "tune_procedure_now_over_loop"))
        ratios[key] = (probe / loop, statistics.median(again) if again else None,
                       statistics.median(procedure) if procedure else None)
    if ratios:
        lines += ["", f"Host probe against a loop of the same launches, {len(ratios)} launch paths (configs pooled, "
                  "as the rule pools them, tuning/step_cost.py; per path in compiled_choice.json): "
                  + "; ".join(_ratio_range(ratios, i, what) for i, what in
                              ((0, "the tune's probe / loop"),
                               (1, f"the probe taken again, taking turns with the loop ({ROUNDS} rounds) / loop"),
                               (2, "the tune's procedure again (every candidate in turns) / loop")))
                  + "."]
    costs = ["L{} (its `q + 1` {:.0f} us): {}".format(
        row["shape"], row["compiled_us"]["floor_us"], ", ".join(
            f"`{k}` {v:.0f} us" for k, v in row["compiled_us"].items() if k != "floor_us" and isinstance(v, float)))
        for row in choice["prefill"] if "compiled_us" in row]
    if costs:
        lines += ["", f"What a compiled call of each choice costs over a compiled `q + 1`: {'; '.join(costs)}."]
    launches = [(f"L{row['shape']}", row["op_launch_us"]) for row in choice["prefill"] if "op_launch_us" in row]
    launches += [(f"train {d}", choice["training"][f"{d}_op_launch_us"]) for d in ("forward", "backward")
                 if f"{d}_op_launch_us" in choice.get("training", {})]
    if launches:
        lines += ["Each launch through the launch op, called alone (FA4 against cuDNN through the same op): "
                  + "; ".join(f"{where} {_op_launch_text(us)}" for where, us in launches) + "."]
    if "foreign_gate_s" in choice:
        gates = ", ".join(f"L{k} {v * 1e3:.0f} ms" for k, v in choice["foreign_gate_s"].items())
        # a line of the paragraph above: both say what a call costs besides its kernel
        lines += [f"First decision of a bucket this process did not tune (its winner gated here): {gates}."]
    return lines


def _op_launch_text(us: dict) -> str:
    """``op_launches``' figures of one call: each choice's us, and FA4's over cuDNN's where both ran.

    >>> _op_launch_text({"sdpa:kernel=cudnn": 40.0, "fa4:default": 46.0})
    '`sdpa:kernel=cudnn` 40 us, `fa4:default` 46 us (1.15x)'
    """
    parts = [f"`{k}` {v:.0f} us" if isinstance(v, float) else f"`{k}` did not run ({v})" for k, v in us.items()]
    cudnn = us.get("sdpa:kernel=cudnn")
    fa4 = next((v for k, v in us.items() if k.startswith("fa4:")), None)
    both = isinstance(cudnn, float) and isinstance(fa4, float)
    return ", ".join(parts) + (f" ({fa4 / cudnn:.2f}x)" if both else "")


def _part_lines(run: Path, corrected) -> list[str]:
    """The HF Llama and spell parts of the section, from their files in ``run`` where they exist."""
    lines = []
    llama_path = run / "llama.json"
    if llama_path.exists():
        llama = json.loads(llama_path.read_text())
        lines += ["", "HF Llama (8 layers, hidden 1024, 16/4 heads, bf16, random weights), stock `torch.compile` "
                  "against `backend=\"inductor_attn\"`, each entry in a fresh process and store, plain launches "
                  "(`PYTHONPATH=. python benchmarks/tools/compiled_choice_gpu.py --out $OUT --llama`)"
                  f"{_own_run(llama, corrected)}:",
                  "", f"| entry | {STEP_HEADER} |", "|---|---|---|---|---|"]
        for label, entry in llama["llama"].items():
            lines.append(f"| {label} | {step_cells(entry)} |" if "error" not in entry else
                         f"| {label} | | | {cell(entry['error'][:120])} | |")
    spell_path = run / "spell.json"
    if spell_path.exists():
        spell = json.loads(spell_path.read_text())
        windows = spell["spell"]["windows"]
        first, last = (_spell_medians(windows, part) for part in (slice(0, 10), slice(-5, None)))
        cpu_first, cpu_last = (_spell_medians(windows, part, "cpu_us") for part in (slice(0, 10), slice(-5, None)))
        clocks = sorted({w["sm_mhz"] for w in windows})
        gcs = sum(len(w["gcs"]) for w in windows)
        lines += ["", "Calls right after a tune (decode B1 H32/8 Lkv2k D128, `compiled_choice_gpu.py --out $OUT "
                  f"--spell`{_own_run(spell, corrected)}), median us per call of the first 200 / the last 100 of each: "
                  f"ours {first['ours']:.0f} / "
                  f"{last['ours']:.0f} ({first['ours'] / last['ours']:.2f}x), stock compile {first['stock']:.0f} / "
                  f"{last['stock']:.0f} ({first['stock'] / last['stock']:.2f}x); the main thread's CPU us per call, "
                  f"ours {cpu_first['ours']:.0f} / {cpu_last['ours']:.0f}; SM clock {clocks[0]}-{clocks[-1]} MHz; "
                  f"{gcs} garbage collections."]
    return lines


def _own_run(part: dict, corrected) -> str:
    """Where a part's file was measured in a run of its own (files that record it: date, commit, libraries), as a
    clause, its commit as ``corrected`` gives it; empty for files without it, which the section's first line
    describes."""
    if "commit" not in part:
        return ""
    return (f", measured {part['date']} at commit {corrected(part['commit'])} with "
            + versions_text(part["versions"]))


def _ratio_range(ratios: dict, index: int, what: str) -> str:
    """``what`` from its lowest to its highest over the launch paths of ``ratios``, each end named."""
    got = {key: r[index] for key, r in ratios.items() if r[index] is not None}
    if not got:
        return f"{what}: not measured"
    low, high = min(got, key=got.get), max(got, key=got.get)
    return (f"{what} {got[low]:.2f} (`{low[1]}`, {low[0]}) to {got[high]:.2f} (`{high[1]}`, {high[0]}), "
            f"median {statistics.median(got.values()):.2f}")


def _fmt_us(x) -> str:
    return "" if x is None else f"{x:.0f}"


def _spell_medians(windows: list[dict], part: slice, field: str = "us") -> dict:
    """Median ``field`` per call over the windows ``part`` of each function's own windows (20 calls a window)."""
    names = dict.fromkeys(w["name"] for w in windows)
    return {n: statistics.median(w[field] for w in [w for w in windows if w["name"] == n][part]) for n in names}


def _print_probes(rows: list[dict]) -> None:
    for p in rows:
        print(f"  probe {p['name'][:56]:56s} dev {p['device_us']:8.1f} probe {p['probe_us']:6.1f} "
              f"loop {p['loop_us']:6.1f} ratio {p['probe_over_loop']:.2f} again {p['probe_now_over_loop']:.2f}",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--report", type=Path, metavar="DIR", help="print RESULTS.md's section for a run's files")
    parser.add_argument("--commit", help="the commit measured (default: git's); with --report, overrides the file's")
    parser.add_argument("--date", help="with --report: overrides the date compiled_choice.json records")
    parser.add_argument("--llama", nargs="*", choices=list(LLAMA), metavar="ENTRY",
                        help=f"measure these HF Llama entries (default: all of {', '.join(map(repr, LLAMA))}; llama.json)")
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--probes", nargs="*", default=["512c", "2048c"], help="shapes whose probes are checked")
    parser.add_argument("--training", action="store_true")
    parser.add_argument("--spell", action="store_true")
    args = parser.parse_args()
    if args.report:
        print(report(args.report, args.commit, args.date))
        return
    if args.out is None:
        parser.error("--out is required to measure")
    os.environ.setdefault("INDUCTOR_ATTN_CACHE_DIR", tempfile.mkdtemp())  # a fresh store: every shape tunes
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              **run_stamp(args.commit)}
    name = "llama.json" if args.llama is not None else "spell.json" if args.spell else "compiled_choice.json"
    if args.llama is not None:
        llama(args.llama or list(LLAMA),
              lambda done: (args.out / name).write_text(json.dumps({**result, "llama": done}, indent=1)))
        return
    if args.spell:
        result["spell"] = spell()
        print(json.dumps({k: v for k, v in result["spell"].items() if k != "windows"}), flush=True)
    else:
        global GC_IN_PROBES
        GC_IN_PROBES = GcInProbes()
        result["prefill"] = []
        for shape in args.shapes:
            row = prefill(shape, *SHAPES[shape], with_probes=shape in args.probes)
            result["prefill"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "probes"}), flush=True)
            _print_probes(row.get("probes", []))
        result["foreign_gate_s"] = foreign_gates(args.shapes)
        print(json.dumps({"foreign_gate_s": result["foreign_gate_s"]}), flush=True)
        if args.training:
            result["training"] = row = training()
            print(json.dumps({k: v for k, v in row.items() if not k.endswith("probes")}), flush=True)
            _print_probes(row["forward_probes"] + row["backward_probes"])
    (args.out / name).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
