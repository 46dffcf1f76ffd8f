"""GPU acceptance check for the core: a compiled function picks the measured best candidate, and a
second process reuses the store with zero benchmarks.

    python benchmarks/gpu_core_check.py --out DIR

Phase "tune" (this process): compiles ``inductor_attn.attention`` on a few shapes, which tunes and
stores decisions; then re-times every candidate that passed the gate, independently of the tuner, with
the same CUDA-graph timer, and reports whether the tuner's winner is the measured best (or within its
CI). Phase "reuse" (a child process): compiles the same shapes with ``tune`` replaced by a counter and
reports the number of benchmarks (must be 0) and whether every winner is the same.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

SHAPES = {
    "dense B4 H32 L1024 D128 full": dict(b=4, hq=32, hkv=32, lq=1024, lk=1024, d=128, causal=False),
    "dense B4 H32 L4096 D128 causal": dict(b=4, hq=32, hkv=32, lq=4096, lk=4096, d=128, causal=True),
    "GQA B4 Hq32 Hkv8 L2048 D128 causal": dict(b=4, hq=32, hkv=8, lq=2048, lk=2048, d=128, causal=True),
    "prefill-with-cache B2 H16 Lq512 Lk2048 D64 causal": dict(b=2, hq=16, hkv=16, lq=512, lk=2048, d=64, causal=True),
    "decode B8 Hq32 Hkv8 Lq1 Lk4096 D128": dict(b=8, hq=32, hkv=8, lq=1, lk=4096, d=128, causal=False),
}


def make_inputs(s, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda h, n, d: torch.randn(s["b"], h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)  # noqa: E731
    return mk(s["hq"], s["lq"], s["d"]), mk(s["hkv"], s["lk"], s["d"]), mk(s["hkv"], s["lk"], s["d"])


def compiled_call(s):
    import inductor_attn

    fn = torch.compile(lambda q, k, v: inductor_attn.attention(q, k, v, causal=s["causal"]), fullgraph=True)
    return fn


def phase_tune(out_dir: str) -> dict:
    import inductor_attn
    from inductor_attn.tuning.stats import paired_bootstrap_speedup
    from inductor_attn.tuning.timing import CudaGraphTimer

    report = {}
    for name, s in SHAPES.items():
        q, k, v = make_inputs(s)
        start = time.perf_counter()
        out = compiled_call(s)(q, k, v)
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - start
        ref = inductor_attn.run_candidate("reference:default", q, k, v, causal=s["causal"])
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        bucket = inductor_attn.api.make_call(q, k, v, causal=s["causal"]).problem.bucket().key()
        row = next((r for r in inductor_attn.cache.get_store().rows()
                    if r["problem"] == bucket and r["op"] == "attention/forward"), None)
        winner = row["winner"] if row else str(inductor_attn.stats())
        # independent re-measurement of every candidate that passed the gate
        passed = [c["name"] for c in inductor_attn.cache.show(row["key"])["record"]["candidates"]
                  if c["status"] == "passed"] if row else []
        timer = CudaGraphTimer()
        runners = {c: timer.prepare([lambda c=c: inductor_attn.run_candidate(c, q, k, v, causal=s["causal"])])
                   for c in passed}
        samples = {c: [] for c in passed}
        for _ in range(30):
            for c, r in runners.items():
                samples[c].append(r.sample())
        medians = {c: sorted(x)[len(x) // 2] for c, x in samples.items()}
        best = min(medians, key=medians.get) if medians else None
        verdict = "winner is the measured best"
        if best and best != winner:
            sp, lo, hi = paired_bootstrap_speedup(samples[winner], samples[best])
            verdict = (f"measured best {best} is {sp:.3f}x the winner (CI {lo:.3f}-{hi:.3f}); "
                       + ("within noise" if lo <= 1.0 else "WINNER NOT BEST"))
        report[name] = {"key": row["key"] if row else None, "winner": winner, "rel_err_vs_reference": err,
                        "compile_and_first_call_s": compile_s, "remeasured_median_ms": medians,
                        "verdict": verdict, "explain": inductor_attn.cache.explain(row["key"]) if row else ""}
        print(f"{name:52s} winner {winner:32s} err {err:.1e}  {verdict}", flush=True)
        torch._dynamo.reset()
    return report


def phase_reuse() -> dict:
    import inductor_attn
    from inductor_attn.tuning import decisions

    benchmarks = []
    decisions.tune = lambda *a, **k: benchmarks.append(a) or (_ for _ in ()).throw(RuntimeError("tuned"))
    winners = {}
    for name, s in SHAPES.items():
        q, k, v = make_inputs(s, seed=1)
        inductor_attn.reset_stats()
        compiled_call(s)(q, k, v)
        winners[name] = list(inductor_attn.stats())
        torch._dynamo.reset()
    return {"benchmarks": len(benchmarks), "stats": winners}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--phase", default="tune", choices=["tune", "reuse"])
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    os.environ.setdefault("INDUCTOR_ATTN_CACHE_DIR", os.path.join(args.out, "store"))
    if args.phase == "reuse":
        print(json.dumps(phase_reuse()))
        return
    env = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "cudnn": torch.backends.cudnn.version()}
    print(env, flush=True)
    report = {"env": env, "tune": phase_tune(args.out)}
    child = subprocess.run([sys.executable, __file__, "--out", args.out, "--phase", "reuse"], capture_output=True,
                           text=True, env={**os.environ})
    last = child.stdout.strip().splitlines()[-1] if child.stdout.strip() else "{}"
    report["reuse"] = json.loads(last) if child.returncode == 0 else {"error": child.stderr[-2000:]}
    print("second process:", json.dumps(report["reuse"])[:1500])
    with open(os.path.join(args.out, "core_check.json"), "w") as f:
        json.dump(report, f, indent=1)
    for name, r in report["tune"].items():
        print(f"\n{name}\n{r['explain']}")


if __name__ == "__main__":
    main()
