"""flex_attention under plain torch.compile vs the same call routed by inductor_attn (issue #6).

    source .devdeps/unpack.sh && PYTHONPATH=. python benchmarks/flex_route_gpu.py --out DIR

One unmodified function, ``flex_attention(q, k, v, block_mask=...)`` with the BlockMask built outside
(bf16, D 128), compiled three ways: Inductor's default flex kernel, ``mode="max-autotune-no-cudagraphs"``
and ``backend="inductor_attn"`` with ``INDUCTOR_ATTN_ROUTE_FLEX=1`` (set here). The routed time includes building the partial-block bitmaps in the
graph on every call; the kernel behind it is whatever our tuner picked at the first call (autotune mode,
recorded from ``inductor_attn.stats()``, with every candidate's time from the decision store; point
``INDUCTOR_ATTN_CACHE_DIR`` at an empty directory to tune afresh). Forward, then forward + backward (default compile modes only).
Outputs are compared with flex's default one. Timing and rows as in triton_flash_gpu.py. Writes
DIR/flex_route_gpu.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import create_block_mask, create_mask, flex_attention
from triton_flash_gpu import Budget, measure

import inductor_attn
from inductor_attn.bench.runner import git_commit
from inductor_attn.routing import flex_route

D = 128
DTYPE = torch.bfloat16


def sliding_window(batch, length):
    return (lambda b, h, q, kv: (q >= kv) & (q - kv <= 256)), None


def document_causal(batch, length):
    gen = torch.Generator(device="cuda").manual_seed(0)
    docs = (torch.rand(batch, length, generator=gen, device="cuda") < 1 / 600).cumsum(-1)  # ~600-token docs
    return (lambda b, h, q, kv: (docs[b, q] == docs[b, kv]) & (q >= kv)), batch


PROBLEMS = [("sliding window 256 B4 H32 L4096", sliding_window, 4, 32, 4096),
            ("document causal B4 H32 L4096", document_causal, 4, 32, 4096)]


def host_profile(fn, calls: int = 50, top: int = 30) -> str:
    """cProfile of ``calls`` back-to-back calls (one sync at the end): where the host's time goes."""
    import cProfile
    import io
    import pstats

    fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def run_problem(name, factory, batch, heads, length, budget, profile=False) -> dict:
    mask_mod, mask_batch = factory(batch, length)
    block_mask = create_block_mask(mask_mod, mask_batch, None, length, length, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(batch, heads, length, D, device="cuda", generator=gen, dtype=DTYPE) for _ in range(3))
    grad = torch.randn_like(q)
    kept = create_mask(mask_mod, mask_batch or 1, 1, length, length, device="cuda").sum().item()
    flops = 4.0 * heads * kept * (batch if mask_batch is None else 1) * D  # kept (query, key) pairs
    def fn(q, k, v):
        return flex_attention(q, k, v, block_mask=block_mask)

    ways = {"flex default": dict(), "flex max-autotune": dict(mode="max-autotune-no-cudagraphs"),
            "inductor_attn": dict(backend="inductor_attn")}
    rows, ref = [], None
    for way, kwargs in ways.items():
        torch._dynamo.reset()
        inductor_attn.reset_stats()
        compiled = torch.compile(fn, fullgraph=True, **kwargs)
        row = measure({"impl": way, "pass": "forward"}, lambda: compiled(q, k, v), ref, flops, budget,
                      reserve_s=30, profile=profile)
        if ref is None and row["status"] == "ok":
            ref = compiled(q, k, v)
        row["kernels"] = inductor_attn.stats()
        if profile and row["status"] == "ok":
            row["host_profile"] = host_profile(lambda: compiled(q, k, v))
        rows.append(row)
    for way in ("flex default", "inductor_attn"):
        torch._dynamo.reset()
        inductor_attn.reset_stats()
        compiled = torch.compile(fn, fullgraph=True, **ways[way])
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

        def train():
            out = compiled(qg, kg, vg)
            out.backward(grad)
            return qg.grad

        row = measure({"impl": way, "pass": "forward+backward"}, train, None, 3.5 * flops, budget, reserve_s=30)
        row["kernels"] = inductor_attn.stats()
        rows.append(row)
    return {"problem": name, "flops_forward": flops, "rows": rows}


def tuner_records() -> list[dict]:
    """What our tuner measured for the routed calls (every candidate, its status and median)."""
    from inductor_attn.store.db import get_store

    keep = ("name", "status", "reason", "median_ms")
    return [{"op": row["op"], "problem": row["problem"], "winner": row["winner"],
             "candidates": [{k: c.get(k) for k in keep} for c in row["record"]["candidates"]]}
            for row in get_store().rows() if row["op"].startswith("block_sparse")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget-s", type=float, default=300)
    parser.add_argument("--kernel-times", action="store_true",
                        help="forward rows also get each kernel's device time, the back-to-back time per call and "
                             "a cProfile of the host (host_profile in the JSON)")
    args = parser.parse_args()
    os.environ[flex_route.ROUTE_ENV] = "1"  # flex routing is opt-in (lowering/flex_route.py)
    budget = Budget(args.budget_s)
    results = [run_problem(*spec, budget, args.kernel_times) for spec in PROBLEMS]
    for res in results:
        print(f"\n== {res['problem']}")
        for r in res["rows"]:
            ms = f"{r['ms']:.3f}" if "ms" in r else "-"
            print(f"{r['impl']:<20} {r['pass']:<18} {ms:>8} ms  {r['status']}  {r.get('error', '')}  {r['kernels']}")
            if "kernel_ms" in r:
                print(f"    back to back {r['back_to_back_ms']:.3f} ms/call; device ms/call: "
                      + ", ".join(f"{k[:50]} {t:.3f}" for k, t in r["kernel_ms"].items()))
    import triton

    meta = {"device": torch.cuda.get_device_name(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "commit": git_commit(), "torch": torch.__version__, "triton": triton.__version__,
            "timing": "triton.testing.do_bench median, warmup 25 ms, rep 100 ms, L2 flushed",
            "flops": "forward 4 * heads * kept (query, key) pairs * D; forward+backward 3.5x that"}
    args.out.mkdir(parents=True, exist_ok=True)
    records = tuner_records()
    for rec in records:
        print(f"\n{rec['op']} winner {rec['winner']}")
        for c in sorted(rec["candidates"], key=lambda c: c.get("median_ms") or float("inf"))[:8]:
            print(f"  {c['name']:<90} {c.get('median_ms')}  {c['status']}  {(c.get('reason') or '')[:80]}")
    (args.out / "flex_route_gpu.json").write_text(json.dumps({"meta": meta, "results": results,
                                                             "tuner": records}, indent=1))


if __name__ == "__main__":
    main()
