"""Where split-K decode's time goes: ``triton_decode`` against a kernel that only reads the same bytes.

    PYTHONPATH=. python benchmarks/tools/decode_floor_gpu.py --out DIR      (about a minute on an H100)
    PYTHONPATH=. python benchmarks/tools/decode_floor_gpu.py --out DIR --shapes 1,16,2,256,65536 ...
    PYTHONPATH=. python benchmarks/tools/decode_floor_gpu.py --out DIR --sweep
    PYTHONPATH=. python benchmarks/tools/decode_floor_gpu.py --out DIR --replay-cost
    PYTHONPATH=. python benchmarks/tools/decode_floor_gpu.py --out DIR --paged

For each decode target of issue #4 (bf16, Lq 1, no kv_seqlens):
1. every runnable ``triton_decode`` config through its plan, timed with the tuner's timer
   (``CudaGraphTimer``: graph replay over rotating input copies, L2 flushed before each replay); the
   best one also gets each kernel's device time from the profiler (partial and combine apart), which
   shows launch gaps and the combine's share;
2. the read floor: one Triton kernel that reads the same K and V bytes once (summing them) and nothing
   else, on 128..2048 programs, timed the same way: what any decode kernel moving these bytes can reach
   on this device under this timer;
3. SDPA (enable_gqa) as users call it.
Fractions are of the copy bandwidth the benchmark measures (``bench.runner.measure_copy_gbps``), bytes
as the benchmark counts them (``bench.metrics.decode_bytes``). Writes DIR/decode_floor_gpu.json. ``--shapes``
measures others (B,Hq,Hkv,D,Lkv each): the few-KV-head shape at longer caches, say, where its bytes outgrow
the start and end of a kernel.

``--sweep``: the few-KV-head shape (B1 Hq16 Hkv2 D256 Lkv16k) over knobs the tuner does not search (pipeline
stages, block_n 16, 2 warps) and the combine's column tile, each config with its kernels' device times:
where its time goes between the two kernels, to find what a faster default or knob would be.
Writes DIR/decode_sweep_gpu.json.

``--replay-cost``: one config of that shape timed with as many calls per graph replay as the tuner's timer makes
(``measure.input_copies``), as this script makes, and with this script's copies cycled two and four times per
replay; and a trivial kernel per copy. What a replay adds beyond its calls is shared by the calls of one replay, so
a per-call time that falls as the calls per replay grow says how much of a suite's decode time is the timer's (4 us
of 18 on an H200 before the timer took the replay's fixed cost off and made its L2 flush read). Writes
DIR/decode_replay_cost_gpu.json.

``--paged``: that shape's keys read by three configs from a contiguous cache in each row layout and from paged pools
of 16, 64 and 256-token pages, in order and shuffled, NHD and HND, each with its kernels' device times: which of
layout, indirection and page placement costs the paged call its gap to the contiguous one. Writes
DIR/decode_paged_layouts_gpu.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from inductor_attn.backends import AttnCall, get_backend, plan_for
from inductor_attn.bench.metrics import decode_bytes
from inductor_attn.bench.runner import git_commit, measure_copy_gbps
from inductor_attn.bench.wallclock import kernel_ms
from inductor_attn.device import device_info
from inductor_attn.tuning.timing import CudaGraphTimer

SHAPES = [(1, 32, 16, 256, 4096), (1, 32, 16, 256, 16384), (1, 16, 2, 256, 16384)]  # (B, Hq, Hkv, D, Lkv)
READ_PROGRAMS = (128, 256, 512, 1024, 2048)
READ_BLOCK = 4096
SAMPLES = 40
ROTATE_BYTES, MAX_COPIES = 256 << 20, 32


@triton.jit
def _read_sum(X, OUT, per_program, BLOCK: tl.constexpr):
    """Program p sums elements [p * per_program, (p + 1) * per_program) of X: a pure streaming read."""
    base = X + tl.program_id(0).to(tl.int64) * per_program
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(0, per_program, BLOCK):
        acc += tl.load(base + i + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(OUT + tl.program_id(0), tl.sum(acc, 0))


def case_name(shape) -> str:
    b, hq, hkv, d, lk = shape
    return f"B{b} Hq{hq} Hkv{hkv} D{d} Lkv{lk}"


def copies_for(shape) -> int:
    """Input copies of a shape's calls: enough that one replay reads ROTATE_BYTES, at most MAX_COPIES."""
    b, hq, hkv, d, lk = shape
    return min(MAX_COPIES, math.ceil(ROTATE_BYTES / (2 * b * (hkv * lk + hq) * d * 2)))


def calls_for(shape) -> list[AttnCall]:
    b, hq, hkv, d, lk = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    make = lambda h, n: torch.randn(b, h, n, d, generator=gen, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    return [AttnCall("attention", make(hq, 1), make(hkv, lk), make(hkv, lk), d ** -0.5)
            for _ in range(copies_for(shape))]


def time_ms(fns) -> float:
    runner = CudaGraphTimer().prepare(fns)
    return statistics.median(runner.sample() for _ in range(SAMPLES))


def fastest(candidates: dict[str, list]) -> tuple[list[dict], dict]:
    """Time each candidate (name -> one callable per input copy); the fastest also gets its kernels'
    device times. Returns every (name, ms) row and the fastest one."""
    rows = [dict(name=name, ms=time_ms(fns)) for name, fns in candidates.items()]
    best = dict(min(rows, key=lambda r: r["ms"]))
    best["kernel_ms"] = kernel_ms(candidates[best["name"]])
    return rows, best


def read_floor_candidates(kv_copies: list[torch.Tensor]) -> dict[str, list]:
    n = kv_copies[0].numel()
    candidates = {}
    for programs in READ_PROGRAMS:
        if n % (programs * READ_BLOCK):
            continue
        out = torch.empty(programs, device="cuda", dtype=torch.float32)
        candidates[f"programs={programs}"] = [
            lambda x=x, p=programs, o=out: _read_sum[(p,)](x, o, n // p, BLOCK=READ_BLOCK, num_warps=8)
            for x in kv_copies]
    return candidates


def run_shape(shape, copy_gbps: float) -> dict:
    calls = calls_for(shape)
    moved = decode_bytes(calls[0])
    frac_copy = lambda ms: moved / (ms * 1e-3) / 1e9 / copy_gbps  # noqa: E731
    dev, problem = device_info("cuda"), calls[0].problem
    runnable = [c.name for c in get_backend("triton_decode").configs(problem, dev) if c.pruned is None]
    plans = {name: plan_for(problem, name, dev, "forward") for name in runnable}
    ours, best = fastest({name: [lambda c=c, p=plan: p.launch(c) for c in calls] for name, plan in plans.items()})
    sdpa_ms = time_ms([lambda c=c: F.scaled_dot_product_attention(c.q, c.k, c.v, enable_gqa=True) for c in calls])
    kv = [torch.stack([c.k, c.v]) for c in calls]
    del calls, plans
    floor, floor_best = fastest(read_floor_candidates(kv))
    return dict(case=case_name(shape), bytes=moved,
                ours=dict(config=best["name"], ms=best["ms"], frac_copy=frac_copy(best["ms"]),
                          kernel_ms=best["kernel_ms"]),
                read_floor=dict(programs=int(floor_best["name"].split("=")[1]), ms=floor_best["ms"],
                                frac_copy=frac_copy(floor_best["ms"]), kernel_ms=floor_best["kernel_ms"]),
                sdpa=dict(ms=sdpa_ms, frac_copy=frac_copy(sdpa_ms)),
                all_configs=ours, all_read=floor)


SWEEP_SHAPE = (1, 16, 2, 256, 16384)


def sweep() -> list[dict]:
    """Every (splits, block_n, warps, stages) of the grid below that fits shared memory, then the fastest three
    with the combine's tile (floats one combine program reads) narrowed, each width of its column chunk once:
    device time per call, and per kernel for the fastest eight."""
    import itertools

    from inductor_attn.backends import triton_decode
    from inductor_attn.backends.base import Config

    calls = calls_for(SWEEP_SHAPE)
    dev, problem = device_info("cuda"), calls[0].problem
    limit = triton_decode._smem_limit(dev)
    default_tile = triton_decode._COMBINE_TILE
    rows, fns, seen = [], [], set()

    def chunk(cfg: Config, tile: int) -> int:  # the combine's column chunk, as DecodePlan.run sizes it
        return triton_decode.combine_chunk(problem.head_dim_v, int(cfg["num_splits"]), tile)

    def timed(cfg: Config, tile: int) -> None:
        if (str(cfg), chunk(cfg, tile)) in seen:
            return
        seen.add((str(cfg), chunk(cfg, tile)))
        plan = plan_for(problem, f"triton_decode:{cfg}", dev, "forward")
        launches = [lambda c=c: plan.launch(c) for c in calls]
        triton_decode._COMBINE_TILE = tile
        try:
            rows.append(dict(config=str(cfg), combine_tile=tile, combine_chunk=chunk(cfg, tile), ms=time_ms(launches)))
        finally:
            triton_decode._COMBINE_TILE = default_tile
        fns.append(launches)

    for splits, block_n, warps, stages in itertools.product((64, 128, 256), (16, 32, 64), (2, 4, 8), (2, 3, 4, 5)):
        if triton_decode._smem_bytes(problem, block_n, stages) <= limit:
            timed(Config.of(block_n=block_n, num_splits=splits, num_warps=warps, num_stages=stages), default_tile)
    for row in sorted(rows, key=lambda r: r["ms"])[:3]:
        for tile in (1024, 2048, 4096):
            timed(Config.parse(row["config"]), tile)
    for i in sorted(range(len(rows)), key=lambda i: rows[i]["ms"])[:8]:
        triton_decode._COMBINE_TILE = rows[i]["combine_tile"]
        try:
            rows[i]["kernel_ms"] = kernel_ms(fns[i])
        finally:
            triton_decode._COMBINE_TILE = default_tile
    return rows


REPLAY_CONFIG = "triton_decode:block_n=32,num_splits=128,num_warps=4"  # the paged suite's fastest, 2026-11-30


def replay_cost() -> list[dict]:
    """Per-call time of REPLAY_CONFIG on SWEEP_SHAPE (and of a trivial kernel) by calls per replay (module doc)."""
    from inductor_attn.tuning.measure import input_copies

    calls = calls_for(SWEEP_SHAPE)
    plan = plan_for(calls[0].problem, REPLAY_CONFIG, device_info("cuda"), "forward")
    one = torch.zeros(1, device="cuda")
    rows = []
    for copies, passes in ((input_copies(calls[0]), 1), (len(calls), 1), (len(calls), 2), (len(calls), 4)):
        decode = [lambda c=c: plan.launch(c) for c in calls[:copies]] * passes
        trivial = [one.zero_] * len(decode)
        rows.append(dict(copies=copies, passes=passes, calls_per_replay=len(decode), decode_ms=time_ms(decode),
                         trivial_ms=time_ms(trivial)))
    return rows


# block_n 16, which the tuner does not search, is the one whose tiles each lie in one 16-key page
PAGED_CONFIGS = tuple(f"block_n={n},num_splits=128,num_warps=4" for n in (16, 32, 64))
PAGE_SIZES = (16, 64, 256)


def paged_layouts() -> list[dict]:
    """SWEEP_SHAPE's keys read by the same decode configs from: a contiguous (B, Hkv, L, D) cache (the paged suite's
    "contiguous decode"); a contiguous (B, L, Hkv, D) cache, the pool's row layout without pages; pools of each page
    size with pages in order, with pages shuffled (the paged suite's tables), and shuffled in HND memory order. What
    sets the paged call's gap to the contiguous one apart: the row layout, the table's indirection, or where the
    pages lie."""
    from inductor_attn.ops.paged import paged_call

    b, hq, hkv, d, lk = SWEEP_SHAPE
    gen = torch.Generator(device="cuda").manual_seed(0)
    copies = copies_for(SWEEP_SHAPE)
    randn = lambda *shape: torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    qs = [randn(b, hq, 1, d) for _ in range(copies)]
    rows_major = [(randn(b, lk, hkv, d), randn(b, lk, hkv, d)) for _ in range(copies)]  # (B, L, Hkv, D)
    lens = torch.full((b,), lk, dtype=torch.int32, device="cuda")
    # causal with lengths, as the paged calls and the paged suite's contiguous decode are
    contiguous = lambda q, k, v: AttnCall("attention", q, k, v, d ** -0.5, True, kv_seqlens=lens)  # noqa: E731
    heads_major = [tuple(x.transpose(1, 2).contiguous() for x in kv) for kv in rows_major]  # (B, Hkv, L, D)
    layouts = {"contiguous (B, Hkv, L, D)": [contiguous(q, *kv) for q, kv in zip(qs, heads_major)],
               "contiguous (B, L, Hkv, D)": [contiguous(q, k.transpose(1, 2), v.transpose(1, 2))
                                             for q, (k, v) in zip(qs, rows_major)]}
    for page in PAGE_SIZES:
        width = lk // page
        for order, memory in (("in order", "NHD"), ("shuffled", "NHD"), ("shuffled", "HND")):
            calls = []
            for q, (k, v) in zip(qs, rows_major):
                ids = torch.arange(b * width, device="cuda") if order == "in order" else \
                    torch.randperm(b * width, generator=gen, device="cuda")
                # page ids[i] holds the sequence's i-th run of `page` keys; an HND pool keeps each head's keys of a
                # page together, and is handed over as a (num_blocks, page, Hkv, D) view, as FlashInfer users do
                pages = [x.reshape(b * width, page, hkv, d) for x in (k, v)]
                if memory == "HND":
                    pages = [x.transpose(1, 2).contiguous() for x in pages]
                k_pool, v_pool = (torch.empty_like(x) for x in pages)
                k_pool[ids], v_pool[ids] = pages
                if memory == "HND":
                    k_pool, v_pool = (x.transpose(1, 2) for x in (k_pool, v_pool))
                table = ids.view(b, width).to(torch.int32)
                calls.append(paged_call(q.reshape(b, hq, d), k_pool, v_pool, table, lens, None, 1, lk, d ** -0.5,
                                        True, -1, -1))
            layouts[f"paged {page} {memory}, pages {order}"] = calls
    dev, rows = device_info("cuda"), []
    for config in PAGED_CONFIGS:
        for layout, calls in layouts.items():
            plan = plan_for(calls[0].problem, f"triton_decode:{config}", dev, "forward")
            launches = [lambda c=c, p=plan: p.launch(c) for c in calls]
            rows.append(dict(config=config, layout=layout, ms=time_ms(launches), kernel_ms=kernel_ms(launches)))
    return rows


def run_meta(copy_gbps: float | None = None) -> dict:
    """Where and when a run measured: device, commit, versions, date (and the copy bandwidth it measured)."""
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return dict(device=torch.cuda.get_device_name(), commit=git_commit(), torch=torch.__version__,
                triton=triton.__version__, date=date, **({"copy_gbps": copy_gbps} if copy_gbps is not None else {}))


def kernels_text(kernel_ms: dict, width: int = 16) -> str:
    """A timed call's kernels and their device us, names cut to ``width``."""
    return ", ".join(f"{k[:width]} {v * 1e3:.1f}" for k, v in kernel_ms.items())


def write(out: Path, name: str, payload: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps(payload, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--replay-cost", action="store_true")
    parser.add_argument("--paged", action="store_true")
    parser.add_argument("--shapes", nargs="+", metavar="B,Hq,Hkv,D,Lkv",
                        type=lambda text: tuple(int(n) for n in text.split(",")), default=SHAPES)
    args = parser.parse_args()
    if args.replay_cost:
        rows = replay_cost()
        for r in rows:
            print(f"{r['calls_per_replay']:3} calls a replay ({r['copies']} copies x {r['passes']}): decode "
                  f"{r['decode_ms'] * 1e3:6.1f} us a call, a trivial kernel {r['trivial_ms'] * 1e3:5.1f} us a call")
        write(args.out, "decode_replay_cost_gpu.json",
              dict(meta=run_meta(), case=case_name(SWEEP_SHAPE), config=REPLAY_CONFIG, rows=rows))
        return
    if args.paged:
        rows = paged_layouts()
        for r in rows:
            print(f"{r['ms'] * 1e3:6.1f} us  {r['config']:40} {r['layout']:32} {kernels_text(r['kernel_ms'])}")
        write(args.out, "decode_paged_layouts_gpu.json", dict(meta=run_meta(), case=case_name(SWEEP_SHAPE), rows=rows))
        return
    if args.sweep:
        rows = sweep()
        for r in sorted(rows, key=lambda r: r["ms"])[:25]:
            print(f"{r['ms'] * 1e3:6.1f} us  combine chunk {r['combine_chunk']:3}  {r['config']:55} "
                  f"{kernels_text(r.get('kernel_ms', {}))}")
        write(args.out, "decode_sweep_gpu.json", dict(meta=run_meta(), case=case_name(SWEEP_SHAPE), rows=rows))
        return
    copy_gbps = measure_copy_gbps(torch.device("cuda"), CudaGraphTimer())
    results = [run_shape(shape, copy_gbps) for shape in args.shapes]
    print(f"copy bandwidth {copy_gbps:.0f} GB/s")
    print(f"{'case':30} {'ours us':>8} {'of copy':>8} {'read us':>8} {'of copy':>8} {'SDPA us':>8}  ours kernels (us)")
    for r in results:
        kernels = kernels_text(r["ours"]["kernel_ms"], 24)
        print(f"{r['case']:30} {r['ours']['ms'] * 1e3:8.1f} {r['ours']['frac_copy']:8.2f} "
              f"{r['read_floor']['ms'] * 1e3:8.1f} {r['read_floor']['frac_copy']:8.2f} {r['sdpa']['ms'] * 1e3:8.1f}"
              f"  {kernels}  [{r['ours']['config']}]")
    write(args.out, "decode_floor_gpu.json", dict(meta=run_meta(copy_gbps), results=results))


if __name__ == "__main__":
    main()
