"""Our Triton attention backward, every listed config, against SDPA's backward (flash, cuDNN).

    PYTHONPATH=. python benchmarks/flash_bwd_gpu.py --out DIR      (under 2 minutes on an H100)

Problems (bf16, D = 128): B4 H32 L4k causal and B2 H32 L8k non-causal. Each problem's (out, lse) come
from SDPA's flash forward (``aten._scaled_dot_product_flash_attention`` returns the logsumexp), so every
backward sees the same inputs. SDPA is timed as ``torch.autograd.grad`` of a retained forward graph
(its backward kernels plus a few microseconds of autograd bookkeeping); ours as
``flash_bwd.backward(call, cfg, out, lse, grad_out, None)`` (preprocess, dK/dV, dQ, allocations).

Timing: ``triton.testing.do_bench`` (warm-up, L2 flushed before every call, median), after one untimed
call that compiles. TFLOP/s count the backward as 2.5x the forward's 4 * kept pairs * D (causal pairs
lower-right aligned). Our gradients are compared with SDPA flash's (rel. error within the bf16 gate); a
config that fails to compile, run or match is recorded with its error and never stops the run. The
fastest correct config is run again in deterministic mode (timed, and checked bitwise over two runs).
A time budget skips what is left, recorded as skipped.

Writes DIR/flash_bwd_gpu.json and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from triton_flash_gpu import Budget, bench_ms, print_table  # the forward's benchmark script, beside this one

from inductor_attn.backends.base import AttnCall, Config
from inductor_attn.backends.triton_flash import flash_bwd
from inductor_attn.bench.runner import git_commit  # noqa: E402  (one helper for every script)
from inductor_attn.device import device_info
from inductor_attn.problem import kept_pairs
from inductor_attn.tuning.correctness import TOLERANCES, rel_err

DTYPE = torch.bfloat16
D = 128
PROBLEMS = [  # name, B, H, L, causal
    ("bwd B4 H32 L4k D128 causal", 4, 32, 4096, True),
    ("bwd B2 H32 L8k D128", 2, 32, 8192, False),
]


def measure(row: dict, fn, ref, flops: float, budget: Budget) -> tuple[dict, tuple | None]:
    """Run ``fn`` once (compiles), compare its grads with ``ref``, time it; errors go into the row.
    Broad catch on purpose: one broken candidate must not end a benchmark run."""
    if budget.left() <= 0:
        return {**row, "status": "skipped", "error": "time budget spent"}, None
    try:
        start = time.monotonic()
        grads = fn()
        torch.cuda.synchronize()
        row["first_call_s"] = round(time.monotonic() - start, 2)
        if ref is not None:
            row["rel_err"] = {n: rel_err(g, r) for n, g, r in zip(("dq", "dk", "dv"), grads, ref)}
            if not max(row["rel_err"].values()) <= TOLERANCES[DTYPE]:
                return {**row, "status": "wrong"}, grads
        ms = bench_ms(fn)
        return {**row, "status": "ok", "ms": ms, "tflops": flops / ms / 1e9}, grads
    except Exception as e:  # noqa: BLE001 - recorded, see docstring
        torch.cuda.synchronize()
        return {**row, "status": "error", "error": f"{type(e).__name__}: {str(e)[:300]}"}, None


def sdpa_rows(q, k, v, grad_out, causal, flops, budget) -> tuple[list[dict], tuple | None]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows, ref = [], None
    for name, backend in (("sdpa-flash", SDPBackend.FLASH_ATTENTION), ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
        except RuntimeError as e:  # backend not available for this shape/build
            rows.append({"impl": name, "config": "-", "status": "error", "error": str(e)[:300]})
            continue

        def fn(out=out, leaves=leaves):
            return torch.autograd.grad(out, leaves, grad_out, retain_graph=True)

        row, grads = measure({"impl": name, "config": "-"}, fn, ref, flops, budget)
        ref = grads if ref is None and row["status"] == "ok" else ref
        rows.append(row)
    return rows, ref


def forward_out_lse(q, k, v, causal):
    """(out, lse) of SDPA's flash forward; lse is float32 (B, H, L), natural log."""
    res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=D**-0.5)
    return res[0], res[1]


def ours_rows(call, out, lse, grad_out, ref, flops, budget) -> list[dict]:
    p, dev = call.problem, device_info(call.q.device)
    reason = flash_bwd.unsupported_reason(p)
    if reason:
        return [{"impl": "triton", "config": "-", "status": "unsupported", "error": reason}]
    rows = []
    for cfg in flash_bwd.backward_configs(p, dev):
        row, _ = measure({"impl": "triton", "config": str(cfg)},
                         lambda cfg=cfg: flash_bwd.backward(call, cfg, out, lse, grad_out, None), ref, flops, budget)
        rows.append(row)
    ok = [r for r in rows if r["status"] == "ok"]
    if ok:
        best = Config.parse(min(ok, key=lambda r: r["ms"])["config"])
        det = Config.of(**dict(best.params), deterministic=True)
        row, grads = measure({"impl": "triton deterministic", "config": str(det)},
                             lambda: flash_bwd.backward(call, det, out, lse, grad_out, None), ref, flops, budget)
        if grads is not None:
            again = flash_bwd.backward(call, det, out, lse, grad_out, None)
            row["bitwise_repeatable"] = all(torch.equal(a, b) for a, b in zip(grads, again))
        rows.append(row)
    return rows


def run_problem(name, b, h, seq, causal, budget) -> dict:
    torch.manual_seed(0)
    q, k, v, grad_out = (torch.randn(b, h, seq, D, device="cuda", dtype=DTYPE) for _ in range(4))
    flops = 2.5 * 4.0 * b * h * kept_pairs(seq, seq, causal) * D
    rows, ref = sdpa_rows(q, k, v, grad_out, causal, flops, budget)
    out, lse = forward_out_lse(q, k, v, causal)
    call = AttnCall("attention", q, k, v, D**-0.5, causal)
    rows += ours_rows(call, out, lse, grad_out, ref, flops, budget)
    return {"problem": name, "flops": flops, "rows": rows}


def summarize(result: dict) -> dict:
    ok = [r for r in result["rows"] if r["status"] == "ok"]
    best = lambda rows: min(rows, key=lambda r: r["ms"]) if rows else None  # noqa: E731
    ours = best([r for r in ok if r["impl"] == "triton"])
    base = best([r for r in ok if r["impl"].startswith("sdpa")])
    return {"best_ours": ours and ours["config"], "best_ours_ms": ours and ours["ms"],
            "best_ours_tflops": ours and ours["tflops"], "best_baseline": base and base["impl"],
            "best_baseline_ms": base and base["ms"], "best_baseline_tflops": base and base["tflops"],
            "speedup_vs_best_baseline": (base["ms"] / ours["ms"]) if ours and base else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for flash_bwd_gpu.json")
    parser.add_argument("--budget-s", type=float, default=100, help="stop starting new runs after this long")
    args = parser.parse_args()
    import triton

    total = Budget(args.budget_s)
    results = []
    for i, (name, *spec) in enumerate(PROBLEMS):
        # each problem gets an equal share of what is left, so a slow compile cannot starve the last one
        res = run_problem(name, *spec, Budget(total.left() / (len(PROBLEMS) - i)))
        res["summary"] = summarize(res)
        results.append(res)
    report = {"device": torch.cuda.get_device_name(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "commit": git_commit(), "torch": torch.__version__, "triton": triton.__version__,
              "dtype": str(DTYPE).removeprefix("torch."), "flops_rule": "backward = 2.5 x forward (4 * kept pairs * D)",
              "problems": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "flash_bwd_gpu.json").write_text(json.dumps(report, indent=2))
    print_table(results, "TFLOP backward", 86)
    print(f"\nwrote {args.out / 'flash_bwd_gpu.json'}")


if __name__ == "__main__":
    main()
