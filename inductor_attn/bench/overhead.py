"""``bench --suite overhead``: what a compiled attention call costs on the host, against what users have.

Per case (decode with a KV cache, small prefill), in one process and on one device:
- ``eager sdpa``: ``F.scaled_dot_product_attention`` called directly (for decode, the boolean mask a
  model builds from its cache lengths, built in the call);
- ``stock compile``: the same function under ``torch.compile``, default mode and ``reduce-overhead``;
- ``ours``: ``inductor_attn.attention`` under ``torch.compile``, both modes (decode passes the lengths as
  ``kv_seqlens``), and eagerly;
- ``ours routed``: the stock path's own code compiled with ``backend="inductor_attn"``, both modes: what a model
  that calls SDPA gets (the rewrite proves the decode mask a prefix of the keys and passes ``kv_seqlens``). Its
  Dynamo guards are stock's; ``inductor_attn.attention`` adds those of its own Python (its keyword defaults and
  helpers) to a compiled frame. Each records the rewrite's report of its compile (``routing``; empty when
  Inductor's FX graph cache replayed the code without running the rewrite).
Each gets host us per call, wall us per call with plain launches, and kernel us (wallclock.py), the paths
of a case timed in alternating rounds (``interleaved_measure``). Every compiled result is checked against
eager SDPA before it is timed. The reduce-overhead paths take their inputs marked static
(:func:`static_inputs`), as a model's CUDA graph holds its KV cache and activations: unmarked, each replay
copied them first, and those copies were most of both paths' device time on decode.

Run-time decisions: compiled code leaves varlen and block-sparse calls (whose index values matter) to run
time, where each call finds its kernel before launching it: the problem's bucket, the decision memo and the
plan (runtime.py), and where shapes are dynamic (or the call is eager) the problem itself, from a new call
object, as each op call makes one; with static shapes the launch op holds the problem (ops/launch.py). Host
us per call of that lookup once the bucket is decided, both ways, forward and backward, for the quick
suites' varlen and block-sparse workloads (suites.py).

HF Llama (random init, the size of the zero-overhead issue: 8 layers, hidden 1024, 16/4 heads, bf16):
prefill B4 L2048 and one static-cache decode step, stock ``torch.compile`` against
``backend="inductor_attn"``, in both modes (models.py).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from .._compat import mark_static_address
from ..api import attention
from ..backends import AttnCall, plan_for
from ..device import device_info
from ..routing.enable import compile_backend
from ..routing.rewrite import routing_report
from ..tuning import decide
from ..tuning.modes import tuning_mode
from . import suites
from .models import STEP_HEADER, llama_overhead, step_bars, step_cells
from .suites import Workload
from .wallclock import host_us, interleaved_measure, model_part, own_code

CASES = (  # the labels keep the names of earlier results files (Workload.name would add "Lq1" to decode)
    Workload("decode", 1, 32, 8, 1, 2048, 128, label="decode B1 H32/8 Lkv2k D128"),
    Workload("decode", 8, 32, 8, 1, 4096, 128, label="decode B8 H32/8 Lkv4k D128"),
    Workload("decode", 1, 16, 2, 1, 8192, 256, label="decode B1 H16/2 Lkv8k D256"),
    Workload("dense", 1, 16, 4, 512, 512, 64, causal=True, label="prefill B1 H16/4 L512 D64 causal"),
    Workload("dense", 4, 16, 4, 1024, 1024, 128, causal=True, label="prefill B4 H16/4 L1k D128 causal"),
)
SMOKE = (Workload("decode", 1, 4, 2, 1, 64, 16, label="decode B1 H4/2 Lkv64 D16"),
         Workload("dense", 1, 4, 2, 32, 32, 16, causal=True, label="prefill B1 H4/2 L32 D16 causal"))


def case_inputs(case: Workload, device, dtype) -> tuple:
    """q, k, v and the cache lengths of a case (decode passes them as ``kv_seqlens``, prefill ignores them)."""
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(case.batch, h, n, case.head_dim, device=device, dtype=dtype, generator=gen)
               for h, n in ((case.heads_q, case.len_q), (case.heads_kv, case.len_k), (case.heads_kv, case.len_k)))
    # a KV cache filled to different lengths per sequence
    lens = torch.linspace(case.len_k // 2, case.len_k, case.batch, device=device).to(torch.int32)
    return q, k, v, lens


def sdpa_user(case: Workload):
    """What a model does without inductor_attn: SDPA, with the cache mask built from lengths in the call."""
    def fn(q, k, v, lens):
        mask = None
        if case.kind == "decode":
            mask = (torch.arange(k.shape[2], device=q.device)[None, :] < lens[:, None])[:, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=case.causal and mask is None,
                                              enable_gqa=q.shape[1] != k.shape[1])
    return fn


def ours_user(case: Workload):
    def fn(q, k, v, lens):
        return attention(q, k, v, causal=case.causal, kv_seqlens=lens if case.kind == "decode" else None)
    return fn


def paths(case: Workload) -> dict:
    """Each compiled path compiles its own copy of the function (``own_code``), as a user compiles once."""
    sdpa, ours = sdpa_user(case), ours_user(case)
    return {
        "eager sdpa": sdpa,
        "stock compile": torch.compile(own_code(sdpa), fullgraph=True),
        "stock compile reduce-overhead": torch.compile(own_code(sdpa), fullgraph=True, mode="reduce-overhead"),
        "ours eager": ours,
        "ours compile": torch.compile(own_code(ours), fullgraph=True),
        "ours compile reduce-overhead": torch.compile(own_code(ours), fullgraph=True, mode="reduce-overhead"),
        "ours routed compile": torch.compile(own_code(sdpa), backend=compile_backend, fullgraph=True),
        "ours routed compile reduce-overhead": torch.compile(own_code(sdpa), backend=compile_backend, fullgraph=True,
                                                             mode="reduce-overhead"),
    }


def static_inputs(inputs: tuple) -> tuple:
    """Copies of ``inputs`` marked as keeping their address (``mark_static_address``), for the reduce-overhead
    paths: a CUDA-graph replay copies every input it does not own into its buffers, which in a model it owns
    (the KV cache is a static buffer, HF's StaticCache marks it; q, k, v come from inside the graph)."""
    copies = tuple(x.clone() for x in inputs)
    for x in copies:
        mark_static_address(x)
    return copies


def run_case(case: Workload, device, dtype) -> dict:
    torch._dynamo.reset()
    inputs = case_inputs(case, device, dtype)
    pinned = static_inputs(inputs)
    expected = sdpa_user(case)(*inputs).float()
    row = {"case": case.name, "paths": {}}
    right = {}
    for name, fn in paths(case).items():
        args = pinned if name.endswith("reduce-overhead") else inputs
        before = routing_report()
        out = fn(*args)
        err = ((out.float() - expected).norm() / expected.norm()).item()
        row["paths"][name] = {"rel_err_vs_eager_sdpa": err}
        if name.startswith("ours routed"):
            row["paths"][name]["routing"] = {k: n - before.get(k, 0) for k, n in routing_report().items()
                                             if n != before.get(k, 0)}
        if err < 2e-2:
            right[name] = lambda fn=fn, args=args: fn(*args)
        else:
            row["paths"][name]["status"] = "wrong"
    for name, numbers in interleaved_measure(right).items():
        row["paths"][name].update(numbers)
    return row


def run_time_lookups(device, smoke: bool) -> list[dict]:
    """Host us per call of finding a run-time decided call's kernel (module doc), per quick varlen and
    block-sparse workload and direction, with the problem held (static shapes) and built per call. The
    buckets are decided in heuristic mode, without a tune: a decided bucket costs the same lookups whatever
    decided it."""
    rows = []
    for w in suites.select("varlen", quick=True, smoke=smoke) + suites.select("block_sparse", quick=True,
                                                                              smoke=smoke):
        call = suites.build(w, device).call
        dev = device_info(call.q.device)
        args = {f.name: getattr(call, f.name) for f in dataclasses.fields(call) if f.name != "_problem"}
        for direction in ("forward", "backward"):
            def lookup(direction=direction, problem=None):
                fresh = AttnCall(**args, _problem=problem)  # as each op call makes its own
                return plan_for(fresh.problem, decide(fresh, dev, direction), dev, direction)

            with tuning_mode("heuristic"):
                lookup()
                rows.append({"workload": w.name, "direction": direction, "choice": decide(call, dev, direction),
                             "host_us": host_us(lookup),
                             "held_problem_host_us": host_us(lambda d=direction: lookup(d, call.problem))})
    return rows


def run(smoke: bool, quick: bool, device: torch.device, part: str = "all") -> dict:
    """The cases and the run-time lookups (``part`` "ops"); and the HF Llama part (``part`` "models"), not
    with ``quick`` (it compiles the model eight times)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ops = part in ("all", "ops")
    rows = [run_case(c, device, dtype) for c in (SMOKE if smoke else CASES)] if ops else []
    wanted = part in ("all", "models") and not smoke and not quick and device.type == "cuda"
    return {"rows": rows, "run_time_lookups": run_time_lookups(device, smoke) if ops else [],
            "llama": model_part(wanted, llama_overhead)}


# ``--part``s: what one device call measures; RESULTS.md keeps a block per part (report.py ``_part_blocks``)
PARTS = {"ops": ("rows", "run_time_lookups"), "models": ("llama",)}


def _path_cells(r: dict, stock_wall_us: float | None) -> list[str]:
    """host, wall and kernel us of one path's call and its wall time against stock compile's, or its status."""
    if "wall_us" not in r:
        return [str(r.get("status")), "", "", ""]
    kernel = "" if r["kernel_us"] is None else f"{r['kernel_us']:.1f}"
    ratio = f"{stock_wall_us / r['wall_us']:.2f}x" if stock_wall_us else ""
    return [f"{r['host_us']:.1f}", f"{r['wall_us']:.1f}", kernel, ratio]


def bars(result: dict) -> dict | None:
    """The plot of a part's result (report.py ``_summary_plot``): each path's wall us per call per case, or the HF
    Llama steps."""
    if not result["rows"]:
        return step_bars(result.get("llama"))
    paths = list(dict.fromkeys(name for row in result["rows"] for name in row["paths"]))
    return {"xlabel": "wall us per call (shorter is faster)", "labels": [row["case"] for row in result["rows"]],
            "series": {p: [row["paths"].get(p, {}).get("wall_us") for row in result["rows"]] for p in paths}}


_GRAPHS = " reduce-overhead"  # a path's name compiled with mode="reduce-overhead" (CUDA graphs)


def table(result: dict) -> str:
    """Markdown: per case, host and wall us of each path, and ours against stock compile, plain and (beside it)
    in reduce-overhead mode; the run-time lookups; the HF Llama steps. Each where the result holds it (a ``--part``
    measures some)."""
    lines = (["| case | path | host us | wall us | kernel us | vs stock compile (wall) | reduce-overhead: host us "
              "| wall us | kernel us | vs stock compile (wall) |", "|---" * 10 + "|"] if result["rows"] else [])
    for row in result["rows"]:
        paths = row["paths"]
        stock = paths.get("stock compile", {}).get("wall_us")
        for name, r in paths.items():
            if name.endswith(_GRAPHS) and name.removesuffix(_GRAPHS) in paths:
                continue  # beside its plain form
            graphs = paths.get(name + _GRAPHS)
            cells = _path_cells(r, stock) + (_path_cells(graphs, stock) if graphs else [""] * 4)
            lines.append(f"| {row['case']} | {name} | " + " | ".join(cells) + " |")
    routed = [(row["case"], r["routing"]) for row in result["rows"] for r in row["paths"].values() if "routing" in r]
    if routed:  # a line: each distinct report and the cases that gave it (the routed paths mostly say the same)
        reports: dict[str, dict[str, None]] = {}
        for case, report in routed:
            said = ", ".join(f"{k}: {n}" for k, n in report.items()) or "none (FX graph cache hit)"
            reports.setdefault(said, {})[case] = None
        lines += ["", "The rewrite's report of each routed compile: "
                  + "; ".join(f"`{said}` ({', '.join(cases)})" for said, cases in reports.items()) + "."]
    lookups = result.get("run_time_lookups") or []
    if lookups:
        lines += ["", "| run-time decided call | direction | kernel | lookup host us, problem held (static) / built "
                  "(dynamic, eager) |", "|---|---|---|---|"]
        lines += [f"| {r['workload']} | {r['direction']} | `{r['choice']}` | {r['held_problem_host_us']:.1f} / "
                  f"{r['host_us']:.1f} |" for r in lookups]
    llama = result.get("llama") or {}
    if "error" in llama:
        lines += ["", f"HF Llama: {llama['error']}"]
    elif llama:
        lines += ["", f"| HF Llama | {STEP_HEADER} |", "|---|---|---|---|---|"]
        lines += [f"| {name} | {step_cells(r, digits=3)} |" for name, r in llama.items()
                  if isinstance(r, dict) and "stock_ms" in r]
    return "\n".join(lines).strip("\n")


summary = table  # RESULTS.md's section (report.py ``update_summary_sections``)

__all__ = ["CASES", "PARTS", "run", "summary", "table"]
