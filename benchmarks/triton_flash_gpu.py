"""Our Triton flash forward, every listed config, against SDPA (cuDNN, flash), FA4 and compiled flex attention.

    PYTHONPATH=. python benchmarks/triton_flash_gpu.py --out DIR      (under 4 minutes on an H100)

Problems (bf16, D = 128): dense B2 H32 L16k non-causal and causal, B4 H32 L4k causal, B4 H32 L1k
non-causal; block-sparse sliding window 256 (causal) B4 H32 L4096 against
``torch.compile(flex_attention, mode="max-autotune-no-cudagraphs")``, plus our dense kernel on the same
window given analytically (no bitmaps), to show what the block-sparse path costs.

Timing: ``triton.testing.do_bench`` (warm-up, L2 flushed before every call, median of the repeats),
after one untimed call that compiles. TFLOP/s count 4 * kept (query, key) pairs * D: causal pairs
lower-right aligned, the window by its kept pairs. Each of our outputs is compared with SDPA's flash
output (for the sparse problem: flex's, else SDPA's with the mask as a bool tensor); a config that
fails to compile, run or match is recorded with its error and never stops the run. A time budget skips
what is left, recorded as skipped.

Writes DIR/triton_flash_gpu.json and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from inductor_attn.backends.base import AttnCall, Config
from inductor_attn.backends.triton_flash.flash import BACKEND
from inductor_attn.bench.runner import git_commit  # noqa: E402  (one helper for every script)
from inductor_attn.block_mask import BlockSparseMask
from inductor_attn.device import device_info
from inductor_attn.problem import kept_pairs
from inductor_attn.tuning.correctness import TOLERANCES, rel_err

DTYPE = torch.bfloat16
D = 128
WINDOW = 256
PROBLEMS = [  # name, B, H, L, causal, op
    ("dense B2 H32 L16k D128", 2, 32, 16384, False, "attention"),
    ("dense B2 H32 L16k D128 causal", 2, 32, 16384, True, "attention"),
    ("dense B4 H32 L4k D128 causal", 4, 32, 4096, True, "attention"),
    ("dense B4 H32 L1k D128", 4, 32, 1024, False, "attention"),
    ("sparse sliding-window 256 B4 H32 L4096 D128", 4, 32, 4096, True, "block_sparse"),
]


class Budget:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def bench_ms(fn) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def kernel_ms(fns, calls: int = 20) -> dict[str, float]:
    """Device time per call of each kernel that ``fns`` launch, from the profiler (plain launches, cycling
    through ``fns``: give copies of the inputs larger than L2 together). Against a CUDA-event time this
    separates the kernels from launch gaps and host time that the GPU waits for."""
    from torch.profiler import ProfilerActivity, profile

    for fn in fns:
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            fns[i % len(fns)]()
        torch.cuda.synchronize()
    per_kernel: dict[str, float] = {}
    for e in prof.events():
        if str(e.device_type).endswith("CUDA"):
            per_kernel[e.name] = per_kernel.get(e.name, 0.0) + e.time_range.elapsed_us() / 1e3 / calls
    return per_kernel


def back_to_back_ms(fn, calls: int = 50) -> float:
    """Wall time per call of ``calls`` calls launched back to back (no flush, one sync at the end): the
    larger of the host's time per call and the GPU's. Above the kernels' device time, the host is the
    bottleneck."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / calls


def measure(row: dict, fn, ref: torch.Tensor | None, flops: float, budget: Budget, reserve_s: float = 0.0,
            profile: bool = False) -> dict:
    """Run ``fn`` once (compile), check it against ``ref``, time it; errors go into the row. With
    ``profile`` (inputs larger than L2) the row also gets each kernel's device time, ``kernel_ms``, and
    ``back_to_back_ms``.
    Broad catch on purpose: one broken candidate must not end a benchmark run."""
    if budget.left() < reserve_s:
        return {**row, "status": "skipped", "error": "time budget spent"}
    try:
        start = time.monotonic()
        out = fn()
        torch.cuda.synchronize()
        row["first_call_s"] = round(time.monotonic() - start, 2)
        row["rel_err"] = None if ref is None else rel_err(out, ref)  # None: nothing to compare with
        if ref is not None and not row["rel_err"] <= TOLERANCES[DTYPE]:
            return {**row, "status": "wrong"}
        ms = bench_ms(fn)
        if profile:
            row["kernel_ms"] = kernel_ms([fn])
            row["back_to_back_ms"] = back_to_back_ms(fn)
        return {**row, "status": "ok", "ms": ms, "tflops": flops / ms / 1e9}
    except Exception as e:  # noqa: BLE001 - recorded, see docstring
        torch.cuda.synchronize()
        return {**row, "status": "error", "error": f"{type(e).__name__}: {str(e)[:300]}"}


def sdpa_rows(q, k, v, causal, flops, budget) -> tuple[list[dict], torch.Tensor | None]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows, ref = [], None
    for name, backend in (("sdpa-flash", SDPBackend.FLASH_ATTENTION), ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION)):
        def fn(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        row = measure({"impl": name, "config": "-"}, fn, ref, flops, budget)
        if ref is None and row["status"] == "ok":
            ref = fn()
        rows.append(row)
    return rows, ref


def fa4_row(call: AttnCall, ref, flops, budget) -> dict:
    """FA4 with its own default config (anchors: its fastest on sm_90): the ratio issue #4 asks for."""
    from inductor_attn.backends import fa4

    reason = fa4.BACKEND.supports(call.problem, device_info(call.q.device))
    if reason:
        return {"impl": "fa4", "config": "default", "status": "unsupported", "error": reason}
    return measure({"impl": "fa4", "config": "default"}, lambda: fa4.BACKEND.run(call, Config())[0], ref, flops,
                   budget)


def ours_rows(call: AttnCall, ref, flops, budget, impl="triton", limit=None, profile=False,
              extra=()) -> list[dict]:
    """One row per listed config (the first ``limit``), then per ``extra`` config (not listed: trials,
    timed even where ``prune`` would drop them, with its reason kept in the row)."""
    p, dev = call.problem, device_info(call.q.device)
    reason = BACKEND.supports(p, dev)
    if reason:
        return [{"impl": impl, "config": "-", "status": "unsupported", "error": reason}]
    rows = []
    listed = BACKEND.configs(p, dev)[:limit]
    for cfg in listed + list(extra):
        row = {"impl": impl, "config": str(cfg)}
        pruned = BACKEND.prune(p, dev, cfg)
        if pruned and cfg in listed:
            rows.append({**row, "status": "pruned", "error": pruned})
            continue
        if pruned:
            row["prune_would_drop"] = pruned
        rows.append(measure(row, lambda cfg=cfg: BACKEND.run(call, cfg)[0], ref, flops, budget, profile=profile))
    return rows


def flex_rows(q, k, v, block_mask, flops, budget, profile=False) -> tuple[list[dict], torch.Tensor | None]:
    from torch.nn.attention.flex_attention import flex_attention

    compiled = torch.compile(flex_attention, mode="max-autotune-no-cudagraphs")

    def fn():
        return compiled(q, k, v, block_mask=block_mask)

    # max-autotune compiles and times many templates: keep a minute for it
    row = measure({"impl": "flex max-autotune", "config": "-"}, fn, None, flops, budget, reserve_s=60,
                  profile=profile)
    return [row], (fn() if row["status"] == "ok" else None)


def window_block_mask(seq: int, window: int = WINDOW):
    """flex's BlockMask (128x128 blocks) of the causal window (each query sees itself and the ``window``
    keys before it), and our BlockSparseMask of it."""
    from torch.nn.attention.flex_attention import create_block_mask

    def sliding_window(b_, h_, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= window)

    block_mask = create_block_mask(sliding_window, None, None, seq, seq, device="cuda")
    return block_mask, BlockSparseMask.from_block_mask(block_mask)


def run_problem(name, b, h, seq, causal, op, budget, profile=False, extra=()) -> dict:
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, seq, D, device="cuda", dtype=DTYPE) for _ in range(3))
    scale = D**-0.5
    if op == "attention":
        flops = 4.0 * b * h * kept_pairs(seq, seq, causal) * D
        rows, ref = sdpa_rows(q, k, v, causal, flops, budget)
        call = AttnCall("attention", q, k, v, scale, causal)
        rows.append(fa4_row(call, ref, flops, budget))
        rows += ours_rows(call, ref, flops, budget, extra=extra)
        return {"problem": name, "flops": flops, "rows": rows}

    block_mask, sparse = window_block_mask(seq)
    flops = 4.0 * b * h * kept_pairs(seq, seq, True, WINDOW) * D
    rows, ref = flex_rows(q, k, v, block_mask, flops, budget, profile)
    dense_mask = sparse.dense_mask()  # (1, 1, L, L) bool: SDPA's memory-efficient kernel takes it

    def sdpa_masked():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask)

    rows.append(measure({"impl": "sdpa + bool mask", "config": "-"}, sdpa_masked, ref, flops, budget))
    if ref is None and rows[-1]["status"] == "ok":
        ref = sdpa_masked()
    rows += ours_rows(AttnCall("block_sparse", q, k, v, scale, sparse=sparse), ref, flops, budget, profile=profile,
                      extra=extra)
    window = AttnCall("attention", q, k, v, scale, True, WINDOW, 0)
    rows += ours_rows(window, ref, flops, budget, impl="triton dense-window", limit=3, profile=profile)
    return {"problem": name, "flops": flops, "density": sparse.density, "rows": rows}


def summarize(result: dict) -> dict:
    ok = [r for r in result["rows"] if r["status"] == "ok"]
    best = lambda rows: min(rows, key=lambda r: r["ms"]) if rows else None  # noqa: E731
    ours = best([r for r in ok if r["impl"].startswith("triton")])
    base = best([r for r in ok if not r["impl"].startswith("triton")])
    fa4 = best([r for r in ok if r["impl"] == "fa4"])
    return {"best_ours": ours and f"{ours['impl']}:{ours['config']}", "best_ours_ms": ours and ours["ms"],
            "best_baseline": base and base["impl"], "best_baseline_ms": base and base["ms"],
            "speedup_vs_best_baseline": (base["ms"] / ours["ms"]) if ours and base else None,
            "fraction_of_fa4": (fa4["ms"] / ours["ms"]) if ours and fa4 else None}


def print_table(results: list[dict], flops_label: str = "TFLOP", config_width: int = 78) -> None:
    """One table per problem, fastest first; also used by flash_bwd_gpu.py, whose rows may carry
    ``bitwise_repeatable``."""
    for res in results:
        print(f"\n== {res['problem']}  ({res['flops'] / 1e12:.2f} {flops_label})")
        print(f"{'impl':<22} {'config':<{config_width}} {'ms':>8} {'TFLOP/s':>8}  status")
        for r in sorted(res["rows"], key=lambda r: r.get("ms", float("inf"))):
            ms = f"{r['ms']:.3f}" if "ms" in r else "-"
            tf = f"{r['tflops']:.0f}" if "tflops" in r else "-"
            extra = f"  {r['error']}" if r.get("error") else ""
            extra += f"  bitwise repeatable: {r['bitwise_repeatable']}" if "bitwise_repeatable" in r else ""
            extra += "".join(f"  [{k[:40]} {t:.3f} ms]" for k, t in r.get("kernel_ms", {}).items())
            print(f"{r['impl']:<22} {r['config']:<{config_width}} {ms:>8} {tf:>8}  {r['status']}{extra}")
        s = res["summary"]
        if s["speedup_vs_best_baseline"]:
            print(f"best ours {s['best_ours']} {s['best_ours_ms']:.3f} ms vs {s['best_baseline']} "
                  f"{s['best_baseline_ms']:.3f} ms: x{s['speedup_vs_best_baseline']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for triton_flash_gpu.json")
    parser.add_argument("--budget-s", type=float, default=200, help="stop starting new runs after this long")
    parser.add_argument("--only", default="", help="run only the problems whose name contains this text")
    parser.add_argument("--kernel-times", action="store_true",
                        help="block-sparse problem: also record each kernel's device time (profiler)")
    parser.add_argument("--extra-config", action="append", default=[], type=Config.parse,
                        help="also time this config of ours (repeatable; as printed, e.g. "
                             "block_m=64,block_n=32,num_stages=3,num_warps=4,schedule=tile,tma=True)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    import triton

    budget = Budget(args.budget_s)
    results = {}
    # the sparse problem first: flex's max-autotune is the slowest single step, and the budget must not
    # run out before it; the table keeps the listed order
    problems = [spec for spec in PROBLEMS if args.only in spec[0]]
    for spec in sorted(problems, key=lambda s: s[-1] != "block_sparse"):
        res = run_problem(*spec, budget, profile=args.kernel_times, extra=args.extra_config)
        res["summary"] = summarize(res)
        results[spec[0]] = res
        torch.cuda.empty_cache()
    results = [results[spec[0]] for spec in problems]
    print_table(results)
    meta = {"device": torch.cuda.get_device_name(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "commit": git_commit(), "torch": torch.__version__, "triton": triton.__version__,
            "dtype": str(DTYPE), "timing": "triton.testing.do_bench median, warmup 25 ms, rep 100 ms, L2 flushed"}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "triton_flash_gpu.json"
    path.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
