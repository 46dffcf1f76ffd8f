"""Split-K decode on one GPU: bandwidth of every ``triton_decode`` config against SDPA and compiled flex decode.

    PYTHONPATH=. python benchmarks/decode_gpu.py --out DIR      (under 3 minutes on an H100)

1. Copy bandwidth: a 1 GiB device-to-device copy, counting bytes read + written; the ceiling that decode
   numbers are compared with.
2. Each decode shape (Lq = 1, bf16) on: every config of ``triton_decode`` (all num_splits x block_n x
   num_warps; pruned ones are listed with their reason), ``F.scaled_dot_product_attention(...,
   enable_gqa=True)`` as users call it, and ``torch.compile(flex_attention)`` (its decode kernel).
   Timing is the tuner's: CUDA-graph replay of the call on rotating copies of the inputs, L2 flushed
   before each replay, median of many replays (inductor_attn.tuning.timing.CudaGraphTimer). ExecuTorch
   (pytorch/executorch#20142) saw plain launches move the split-K crossover from 256 to 2048 tokens.
3. GB/s counts K and V of the kv heads read once, plus q and out; ``frac_copy`` divides by step 1.
4. Each output is checked against the float64 reference; a wrong, failing or skipped candidate is
   recorded with its reason, never raised. Flex is timed last, when time is left (its compile is slow).

Writes DIR/decode_gpu.json (rows, best per num_splits, summary, targets) and prints a table.
Targets (from the issue): B1 Hq32 Hkv16 D256 Lkv >= 4096 at >= 85% of copy bandwidth; B1 Hq16 Hkv2 D256
Lkv 16384 at >= 2.5x SDPA default.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from inductor_attn.bench.runner import git_commit  # noqa: E402  (one helper for every script)

SHAPES = [  # (B, Hq, Hkv, D, Lkv)
    (1, 32, 16, 256, 256), (1, 32, 16, 256, 4096), (1, 32, 16, 256, 16384),
    (1, 16, 2, 256, 2048), (1, 16, 2, 256, 16384),
    (8, 32, 8, 128, 8192),
]
DTYPE = torch.bfloat16
SAMPLES = 40
COPY_BYTES = 1 << 30
ROTATE_BYTES = 256 << 20  # enough copies of small problems that the kernel never reads a warm L2 alone
MIN_COPIES = 2  # one replay carries ~10 us of fixed cost (graph launch, events): never pin it on one call


def case_name(shape) -> str:
    b, hq, hkv, d, lk = shape
    return f"B{b} Hq{hq} Hkv{hkv} D{d} Lkv{lk}"


def moved_bytes(shape) -> int:
    b, hq, hkv, d, lk = shape
    elem = torch.finfo(DTYPE).bits // 8
    return (2 * b * hkv * lk * d + 2 * b * hq * 1 * d) * elem


def copy_bandwidth_gbps() -> float:
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(12):
        start.record()
        for _ in range(5):
            dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 2:  # the first rounds warm the clocks up
            times.append(start.elapsed_time(end) / 5)
    del src, dst
    return 2 * COPY_BYTES / (statistics.median(times) * 1e-3) / 1e9


def input_copies(shape) -> int:
    """Input copies one graph replay rotates through: enough to read ROTATE_BYTES, at least MIN_COPIES.
    With one copy (Lkv 16k at D256, 268 MB) each call carried the replay's whole fixed cost: ~10-12 us
    on an H100 and an H200, from a read-only kernel's 88 us of device time against 100 us per replay."""
    return max(MIN_COPIES, min(32, math.ceil(ROTATE_BYTES / moved_bytes(shape))))


def make_inputs(shape, copies: int, seed: int = 0, device: str = "cuda"):
    b, hq, hkv, d, lk = shape
    gen = torch.Generator(device=device).manual_seed(seed)
    mk = lambda h, n: torch.randn(b, h, n, d, generator=gen, device=device, dtype=DTYPE)  # noqa: E731
    return [(mk(hq, 1), mk(hkv, lk), mk(hkv, lk)) for _ in range(copies)]


def time_ms(fns) -> tuple[float, str]:
    from inductor_attn.tuning.timing import CudaGraphTimer

    runner = CudaGraphTimer().prepare(fns)
    return statistics.median(runner.sample() for _ in range(SAMPLES)), runner.note


class Bench:
    def __init__(self, copy_gbps: float, budget_s: float):
        self.copy_gbps = copy_gbps
        self.deadline = time.monotonic() + budget_s
        self.rows: list[dict] = []

    def measure(self, shape, backend: str, config: str, make_fn, inputs, ref) -> dict:
        """Time ``make_fn(q, k, v)`` on every copy of the inputs; record any failure instead of raising."""
        from inductor_attn.tuning.correctness import TOLERANCES, rel_err

        row = dict(case=case_name(shape), backend=backend, config=config, copies=len(inputs))
        if time.monotonic() > self.deadline:
            self.rows.append(row | dict(status="skipped", reason="time budget spent"))
            return self.rows[-1]
        try:
            fns = [make_fn(*x) for x in inputs]
            out = fns[0]()
            out = out[0] if isinstance(out, tuple) else out
            err = rel_err(out.float(), ref)
            ms, note = time_ms(fns)
        except Exception as exc:  # noqa: BLE001 -- a benchmark records every failure (compile, launch, OOM)
            self.rows.append(row | dict(status="failed", reason=f"{type(exc).__name__}: {str(exc)[:300]}"))
            return self.rows[-1]
        gbps = moved_bytes(shape) / (ms * 1e-3) / 1e9
        status = "ok" if err <= TOLERANCES[DTYPE] else "wrong"
        self.rows.append(row | dict(status=status, ms=ms, gbps=gbps, frac_copy=gbps / self.copy_gbps, err=err,
                                    note=note))
        return self.rows[-1]


def reference(q, k, v) -> torch.Tensor:
    from inductor_attn.backends.reference import forward

    return forward(q.double(), k.double(), v.double(), q.shape[-1] ** -0.5, None)[0].float()


def stage_sweep(configs) -> list:
    """The tuned configs' splits x block_n {32, 64} x warps {4, 8} x num_stages {2, 3, 4}, for the best
    split counts of the first run (16..128): what a deeper pipeline or more warps would buy."""
    from inductor_attn.backends import Config

    splits = sorted({int(c["num_splits"]) for c in configs if int(c["num_splits"]) >= 16})
    return [Config.of(block_n=n, num_splits=s, num_warps=w, num_stages=st)
            for s in splits for n in (32, 64) for w in (4, 8) for st in (2, 3, 4)]


def bench_ours(bench: Bench, shape, inputs, ref, stages: bool = False) -> None:
    from inductor_attn.backends import AttnCall
    from inductor_attn.backends.triton_decode import BACKEND
    from inductor_attn.device import device_info

    dev = device_info("cuda")
    problem = AttnCall("attention", *inputs[0], inputs[0][0].shape[-1] ** -0.5).problem
    configs = BACKEND.configs(problem, dev)
    if stages:
        configs = stage_sweep(configs)
    for cfg in sorted(configs, key=lambda c: (c["num_splits"], str(c))):
        reason = BACKEND.prune(problem, dev, cfg)
        if reason is not None:
            bench.rows.append(dict(case=case_name(shape), backend="triton_decode", config=str(cfg), status="pruned",
                                   reason=reason))
            continue

        def make_fn(q, k, v, cfg=cfg):
            call = AttnCall("attention", q, k, v, q.shape[-1] ** -0.5)
            return lambda: BACKEND.run(call, cfg)

        bench.measure(shape, "triton_decode", str(cfg), make_fn, inputs, ref)


def bench_sdpa(bench: Bench, shape, inputs, ref) -> None:
    bench.measure(shape, "sdpa_default", "enable_gqa=True",
                  lambda q, k, v: lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), inputs, ref)


def bench_flex(bench: Bench, shape, inputs, ref) -> None:
    from torch.nn.attention.flex_attention import flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)
    bench.measure(shape, "flex_decode", "torch.compile, enable_gqa=True",
                  lambda q, k, v: lambda: compiled(q, k, v, enable_gqa=True), inputs, ref)


def summarize(rows: list[dict], copy_gbps: float) -> tuple[dict, dict, list[dict]]:
    ok = [r for r in rows if r.get("status") == "ok"]
    per_split: dict[str, dict] = {}
    for r in ok:
        if r["backend"] == "triton_decode":
            splits = r["config"].split("num_splits=")[1].split(",")[0]
            best = per_split.setdefault(r["case"], {}).get(splits)
            if best is None or r["ms"] < best["ms"]:
                per_split[r["case"]][splits] = dict(config=r["config"], ms=r["ms"], gbps=r["gbps"],
                                                    frac_copy=r["frac_copy"])
    summary = {}
    measured = {r["case"] for r in rows}
    shapes = [shape for shape in SHAPES if case_name(shape) in measured]
    for shape in shapes:
        name = case_name(shape)
        best = {}
        for backend in ("triton_decode", "sdpa_default", "flex_decode"):
            mine = [r for r in ok if r["case"] == name and r["backend"] == backend]
            if mine:
                top = min(mine, key=lambda r: r["ms"])
                best[backend] = {k: top[k] for k in ("config", "ms", "gbps", "frac_copy")}
        if "triton_decode" in best and "sdpa_default" in best:
            best["speedup_vs_sdpa"] = best["sdpa_default"]["ms"] / best["triton_decode"]["ms"]
        summary[name] = best
    targets = []
    for shape in shapes:
        b, hq, hkv, d, lk = shape
        s = summary[case_name(shape)]
        if (b, hq, hkv, d) == (1, 32, 16, 256) and lk >= 4096:
            value = s.get("triton_decode", {}).get("frac_copy")
            targets.append(dict(case=case_name(shape), target="frac_copy >= 0.85", value=value,
                                passed=value is not None and value >= 0.85))
        if (b, hq, hkv, d, lk) == (1, 16, 2, 256, 16384):
            value = s.get("speedup_vs_sdpa")
            targets.append(dict(case=case_name(shape), target="speedup_vs_sdpa >= 2.5", value=value,
                                passed=value is not None and value >= 2.5))
    return per_split, summary, targets


def print_table(summary: dict, targets: list[dict], copy_gbps: float) -> None:
    print(f"\ncopy bandwidth {copy_gbps:.0f} GB/s")
    print(f"{'case':34} {'ours GB/s':>10} {'of copy':>8} {'SDPA GB/s':>10} {'flex GB/s':>10} {'x SDPA':>7}  best config")
    for name, s in summary.items():
        g = lambda k: s.get(k, {}).get("gbps", math.nan)  # noqa: E731
        print(f"{name:34} {g('triton_decode'):10.0f} {s.get('triton_decode', {}).get('frac_copy', math.nan):8.2f} "
              f"{g('sdpa_default'):10.0f} {g('flex_decode'):10.0f} {s.get('speedup_vs_sdpa', math.nan):7.2f}  "
              f"{s.get('triton_decode', {}).get('config', '-')}")
    for t in targets:
        print(f"target {t['case']}: {t['target']}: {t['value']} -> {'PASS' if t['passed'] else 'FAIL'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="directory for decode_gpu.json")
    parser.add_argument("--budget-s", type=float, default=140.0,
                        help="start no new measurement after this many seconds (default 140: one flex compile "
                             "started just before still ends within 3 minutes)")
    parser.add_argument("--no-flex", action="store_true", help="skip compiled flex_attention")
    parser.add_argument("--shapes", default=None,
                        help="indices into SHAPES to run, comma-separated (default: all)")
    parser.add_argument("--stages", action="store_true",
                        help="time the num_stages x block_n x warps sweep (stage_sweep) instead of the tuned configs")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_gpu.py needs a CUDA GPU")
    import triton

    started = time.monotonic()
    props = torch.cuda.get_device_properties(0)
    copy_gbps = copy_bandwidth_gbps()
    bench = Bench(copy_gbps, args.budget_s)
    prepared = []
    shapes = SHAPES if args.shapes is None else [SHAPES[int(i)] for i in args.shapes.split(",")]
    for shape in shapes:
        inputs = make_inputs(shape, input_copies(shape))
        ref = reference(*inputs[0])
        bench_sdpa(bench, shape, inputs, ref)
        bench_ours(bench, shape, inputs, ref, args.stages)
        prepared.append((shape, inputs, ref))
        print(f"{case_name(shape)}: done at {time.monotonic() - started:.0f} s", flush=True)
    if not args.no_flex:
        for shape, inputs, ref in prepared:
            bench_flex(bench, shape, inputs, ref)
    per_split, summary, targets = summarize(bench.rows, copy_gbps)
    result = dict(
        device=props.name, sm_count=props.multi_processor_count, torch=torch.__version__,
        triton=triton.__version__, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        commit=git_commit(), dtype=str(DTYPE), copy_gbps=copy_gbps, samples=SAMPLES,
        timing="CUDA-graph replay over rotating input copies, L2 flushed before each replay, median",
        wall_s=time.monotonic() - started, targets=targets, summary=summary, best_per_num_splits=per_split,
        rows=bench.rows,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_gpu.json").write_text(json.dumps(result, indent=1))
    print_table(summary, targets, copy_gbps)
    print(f"wrote {out / 'decode_gpu.json'} in {result['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
