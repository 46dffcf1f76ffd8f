"""``bench --suite flex_route``: ``flex_attention`` under plain ``torch.compile`` against the same call
routed by inductor_attn (routing/flex_route.py).

One unmodified function, ``flex_attention(q, k, v, block_mask=bm)`` with the BlockMask built outside
(bf16, D128), compiled three ways: Inductor's flex kernel (default mode), ``mode="max-autotune-no-cudagraphs"``
(forward, full runs only: its tile search takes minutes) and ``backend="inductor_attn"`` with
``INDUCTOR_ATTN_ROUTE_FLEX=1`` (routing is opt-in). The routed call builds the partial-block bitmaps in
the graph on every call; its kernel is what our tuner picks at the first call, on a fresh store.

Per mask and pass (forward; forward + backward through autograd with a fixed output gradient):
- gate: the tuner's (tuning/measure.py): one call on fresh inputs, compared with the float64 reference
  on our BlockSparseMask of the same mask (forward: the output; forward + backward: dq, dk, dv);
- kernel time: the tuner's timing loop and timer (CUDA-graph replay, interleaved rounds), and each way's
  speedup over flex's default compile with its paired bootstrap 95% CI;
- wall time per call with plain launches, host included (wallclock.py): where it exceeds the kernel
  time, the host sets the pace (the routed call did in every run of 2026-11-22, RESULTS.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import torch

from ..backends import AttnCall
from ..block_mask import BlockSparseMask
from ..routing.enable import compile_backend
from ..routing.flex_route import ROUTE_ENV
from ..runtime import reset_stats, stats
from ..store.db import get_store
from ..tuning.measure import CANDIDATE_ERRORS, Direction, Trial, fresh_inputs, gate, time_trials
from ..tuning.stats import median, paired_bootstrap_speedup
from .entries import autograd_step, recompile_room
from .wallclock import wall_us

# name, mask, batch, heads, length, head dim, window or mean document length
MASKS = (("sliding window 256 B4 H32 L4k D128", "window", 4, 32, 4096, 128, 256),
         ("document causal B4 H32 L4k D128", "document", 4, 32, 4096, 128, 600))
SMOKE = (("sliding window 48 B1 H2 L256 D16", "window", 1, 2, 256, 16, 48),
         ("document causal B2 H2 L256 D16", "document", 2, 2, 256, 16, 100))
PASSES = ("forward", "forward+backward")
BASELINE = "flex default"


def mask_mod(kind: str, batch: int, length: int, param: int, device):
    """The flex mask_mod and the BlockMask's batch size (None: the same mask for every sequence)."""
    if kind == "window":
        return (lambda b, h, q, kv: (q >= kv) & (q - kv <= param)), None
    gen = torch.Generator(device=device).manual_seed(0)
    docs = (torch.rand(batch, length, generator=gen, device=device) < 1 / param).cumsum(-1)
    return (lambda b, h, q, kv: (docs[b, q] == docs[b, kv]) & (q >= kv)), batch


def ways(size: str) -> dict[str, dict]:
    """torch.compile keyword arguments of each way."""
    out = {BASELINE: {}}
    if size == "full":
        out["flex max-autotune"] = {"mode": "max-autotune-no-cudagraphs"}
    # the function, not the "inductor_attn" name: the name needs the package installed (its entry point)
    out["inductor_attn routed"] = {"backend": compile_backend}
    return out


@contextlib.contextmanager
def routing():
    saved = os.environ.get(ROUTE_ENV)
    os.environ[ROUTE_ENV] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(ROUTE_ENV, None)
        else:
            os.environ[ROUTE_ENV] = saved


def measure_mask(spec: tuple, size: str, device: torch.device, timer, rounds: int) -> list[dict]:
    """The rows (one per pass) of one mask."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    name, kind, batch, heads, length, dim, param = spec
    dtype = torch.float32 if size == "smoke" else torch.bfloat16
    mod, mask_batch = mask_mod(kind, batch, length, param, device)
    block_mask = create_block_mask(mod, mask_batch, None, length, length, device=device)
    gen = torch.Generator(device=device).manual_seed(1)
    q, k, v = (torch.randn(batch, heads, length, dim, device=device, dtype=dtype, generator=gen) for _ in range(3))
    call = AttnCall("block_sparse", q, k, v, dim ** -0.5, sparse=BlockSparseMask.from_block_mask(block_mask))

    def attend(q, k, v):
        return flex_attention(q, k, v, block_mask=block_mask)

    rows = []
    for pass_ in PASSES:
        if pass_ != "forward" and device.type != "cuda":
            rows.append({"kind": "flex_route", "name": name, "pass": pass_, "status": "skipped",
                         "reason": "flex_attention has no CPU backward"})
            continue
        torch._dynamo.reset()
        reset_stats()
        gate_call = fresh_inputs(call, seed=11)
        direction = Direction("forward" if pass_ == "forward" else "backward", gate_call)
        expected = direction.reference(gate_call)
        trials = [_trial(way, torch.compile(attend, fullgraph=True, **kwargs), direction)
                  for way, kwargs in ways(size).items() if pass_ == "forward" or "mode" not in kwargs]
        with recompile_room():
            row = _measure_pass(trials, call, gate_call, expected, direction, timer, rounds)
        row.update(kind="flex_route", name=name, **{"pass": pass_}, kernels=stats())
        rows.append(row)
    return rows


def _trial(way: str, compiled, direction: Direction) -> Trial:
    routed = way.startswith("inductor_attn")
    if direction.direction == "forward":
        def bind(c: AttnCall):
            return lambda: compiled(c.q, c.k, c.v)
    else:
        bind = autograd_step(compiled, direction.grads[2])
    # the routed call runs our code, where a bug must raise in strict mode; whatever flex's own compile or
    # kernel raises means it cannot run here
    return Trial(way, bind, lambda err: not routed or isinstance(err, CANDIDATE_ERRORS), ours=routed)


def _measure_pass(trials, call, gate_call, expected, direction: Direction, timer, rounds: int) -> dict:
    def check(got):
        return direction.check(got, expected, gate_call.q.dtype)

    results = {t.name: {"name": t.name, **dataclasses.asdict(gate(t, gate_call, expected, check))} for t in trials}
    passed = [t for t in trials if results[t.name]["status"] == "passed"]
    for t, timed in zip(passed, time_trials(passed, call, timer, rounds)):
        r = results[t.name]
        r["note"] = timed.note
        if timed.failed:
            r["status"], r["reason"] = "failed", timed.failed
            continue
        r["samples"], r["median_ms"] = timed.samples, median(timed.samples)
        run = t.bind(call)
        r["wall_us"] = wall_us(run, calls=50)
    base = results.get(BASELINE, {})
    for r in results.values():
        if r.get("samples") and base.get("samples"):
            r["speedup"], r["ci_low"], r["ci_high"] = paired_bootstrap_speedup(base["samples"], r["samples"])
    return {"status": "ok", "reason": None, "entries": list(results.values())}


def tuner_records() -> list[dict]:
    """What our tuner measured for the routed calls: each decision's winner and candidates by time."""
    keep = ("name", "status", "reason", "median_ms")
    out = []
    for row in get_store().rows():
        if row["op"].startswith("block_sparse"):
            cands = sorted(row["record"]["candidates"], key=lambda c: c.get("median_ms") or float("inf"))
            out.append({"op": row["op"], "problem": row["problem"], "winner": row["winner"],
                        "candidates": [{k: c.get(k) for k in keep} for c in cands]})
    return out


def run(size: str, device: torch.device, timer, rounds: int) -> dict:
    """Every mask of the suite (its smoke versions with ``size="smoke"``): rows and the tuner's records.
    Runs on the current decision store: the caller gives a fresh one, so the routed calls really tune."""
    with routing():
        rows = [row for spec in (SMOKE if size == "smoke" else MASKS)
                for row in measure_mask(spec, size, device, timer, rounds)]
    torch._dynamo.reset()
    return {"rows": rows, "tuner": tuner_records()}


COLUMNS = ("mask", "pass", "way", "kernel ms", "vs flex default (95% CI)", "wall us per call", "first call s",
           "status")


def table(rows: list[dict]) -> str:
    """Markdown: per mask, pass and way, the kernel time (graph replay) with its speedup over flex's
    default compile, and the wall time per call with plain launches."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        if row["status"] != "ok":
            lines.append(f"| {row['name']} | {row['pass']} | | | | | | {row['status']}: {row['reason']} |")
            continue
        for e in row["entries"]:
            ci = f"{e['speedup']:.2f}x ({e['ci_low']:.2f}-{e['ci_high']:.2f})" if e.get("speedup") else ""
            status = e["status"] + (f": {e['reason']}" if e.get("reason") else "")
            lines.append(f"| {row['name']} | {row['pass']} | {e['name']} | {_num(e.get('median_ms'), '.3f')} | {ci} | "
                         f"{_num(e.get('wall_us'), '.0f')} | {_num(e.get('first_call_s'), '.1f')} | {status} |")
    ran = [f"- {row['name']}, {row['pass']}: " + ", ".join(f"`{k}`" for k in row["kernels"])
           for row in rows if row.get("kernels")]
    return "\n".join(lines) + ("\n\nOur kernels that the routed calls ran:\n\n" + "\n".join(ran) if ran else "")


def bars(rows: list[dict]) -> dict | None:
    """The figure (report.py ``_summary_plot``): per mask and pass, each way's kernel speedup over flex's default
    compile."""
    rows = [row for row in rows if row["status"] == "ok"]
    if not rows:
        return None
    ways = list(dict.fromkeys(e["name"] for row in rows for e in row["entries"]))
    speedups = [{e["name"]: e.get("speedup") for e in row["entries"]} for row in rows]
    return {"xlabel": "kernel speedup over flex_attention's default compile", "ref": 1.0,
            "labels": [f"{row['name']}, {row['pass']}" for row in rows],
            "series": {way: [s.get(way) for s in speedups] for way in ways}}


def _num(x, spec: str) -> str:
    return "" if x is None else format(x, spec)
