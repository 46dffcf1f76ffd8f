"""Where the block-sparse window's time goes: ours and flex against kernels that only move the same bytes.

    PYTHONPATH=. python benchmarks/tools/sparse_floor_gpu.py --out DIR      (about two minutes on an H100,
                                                                          most of it flex's max-autotune)

Problem of issue #4's block-sparse target: B4 H32 L4096 D128 bf16, causal window of 256 keys, flex's
128x128 BlockMask. A program of BLOCK_M query rows must bring every K and V tile it visits from L2 into
shared memory; which tiles depends on the granularity it skips at: the tile list visits the 32- or 64-key
tiles that hold a visible key, flex visits whole 128-key mask blocks.

Rows, each timed as device time per call from the profiler (``bench.wallclock.kernel_ms``: all kernels of
a call summed, launch gaps and host time excluded):
1. flex_attention compiled with mode max-autotune-no-cudagraphs (the issue's baseline);
2. our runnable block-sparse Triton configs with 64-row tiles (tile list and block walk), through their
   plans;
3. FA4's runnable configs (CuTe DSL; on sm_90 128-row tiles over the mask's blocks), where installed;
4. read floors: one Triton kernel per (BLOCK_M, BLOCK_N, granularity) that loads the Q tile, TMA-loads
   exactly the K and V tiles such a program visits, sums them (so the loads stay) and writes an O tile:
   no dot, no softmax; the fastest of six launch settings (warps, pipeline stages) counts. Its time is
   what a kernel that moves these bytes this way reaches here (a read kernel written differently
   might do somewhat better: it is a measured floor, not a proven one).
"Bytes" are the K and V bytes copied into shared memory plus Q read and O written; bytes / time is the
L2-to-SM rate each row sustains.

Writes DIR/sparse_floor_gpu.json and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from inductor_attn.backends import AttnCall, Config, get_backend, plan_for
from inductor_attn.bench.runner import git_commit
from inductor_attn.bench.wallclock import kernel_ms
from inductor_attn.block_mask import BlockSparseMask
from inductor_attn.device import device_info
from inductor_attn.tuning.correctness import rel_err

DTYPE, D, WINDOW = torch.bfloat16, 128, 256
B, H, L = 4, 32, 4096
# (BLOCK_M, BLOCK_N, granularity): ours (tile list of 32- and 64-key tiles), flex's pattern (64-row
# programs over whole 128-key blocks), and 128-row programs
FLOORS = [(64, 32, 32), (64, 64, 64), (64, 64, 128), (128, 64, 64), (128, 128, 128)]
READ_LAUNCHES = [(4, 2), (4, 3), (4, 4), (8, 2), (8, 3), (8, 4)]  # (num_warps, num_stages): the fastest counts


@triton.jit
def _window_read(Q, O, K, V, seq, window, num_m, heads,  # noqa: E741 (O: the output, as in the kernels)
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GRAIN: tl.constexpr, D: tl.constexpr):
    """Program (batch*head, m): Q rows [m * BLOCK_M, +BLOCK_M), the K/V tiles of the keys its window
    reaches, widened to GRAIN-key boundaries (the first row's window start rounded down, the block
    end rounded up), then one O tile. K and V are TMA descriptors over (batch, head, row, dim)."""
    pid = tl.program_id(0)
    bh = pid // num_m
    m = pid - bh * num_m
    b = bh // heads
    h = bh - b * heads
    q0 = m * BLOCK_M
    lo = tl.maximum(q0 // GRAIN * GRAIN - window, 0) // GRAIN * GRAIN
    hi = tl.minimum(tl.cdiv(q0 + BLOCK_M, GRAIN) * GRAIN, seq)
    offs = (bh.to(tl.int64) * seq + q0 + tl.arange(0, BLOCK_M))[:, None] * D + tl.arange(0, D)[None, :]
    q = tl.load(Q + offs)
    acc = tl.zeros([BLOCK_N, D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        k = tl.reshape(K.load([b, h, start, 0]), (BLOCK_N, D))
        v = tl.reshape(V.load([b, h, start, 0]), (BLOCK_N, D))
        acc += k.to(tl.float32) + v.to(tl.float32)
    tl.store(O + offs, (q.to(tl.float32) + tl.sum(acc, 0)[None, :]).to(O.dtype.element_ty))


def floor_bytes(block_m: int, grain: int) -> int:
    """K and V bytes all programs of a floor kernel load, plus Q and O (same bounds as _window_read)."""
    q0 = torch.arange(0, L, block_m)
    lo = ((q0 // grain * grain - WINDOW).clamp(min=0)) // grain * grain
    hi = ((q0 + block_m + grain - 1) // grain * grain).clamp(max=L)
    keys = int((hi - lo).sum())
    return B * H * (2 * keys + 2 * L) * D * 2  # K + V per key, Q + O per row, bf16


def device_ms(fn) -> tuple[float, dict]:
    per_kernel = kernel_ms([fn])
    return sum(per_kernel.values()), per_kernel


def window_block_mask():
    """flex's BlockMask (128x128 blocks) of the causal window (each query sees itself and the WINDOW keys
    before it), and our BlockSparseMask of it."""
    from torch.nn.attention.flex_attention import create_block_mask

    block_mask = create_block_mask(lambda b, h, q, kv: (q >= kv) & (q - kv <= WINDOW), None, None, L, L,
                                   device="cuda")
    return block_mask, BlockSparseMask.from_block_mask(block_mask)


def listed(backend: str, call: AttnCall) -> dict[str, object]:
    """Plans of ``backend``'s runnable configs for ``call``, by candidate name."""
    dev = device_info(call.q.device)
    return {c.name: plan_for(call.problem, c.name, dev, "forward")
            for c in get_backend(backend).configs(call.problem, dev) if c.pruned is None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    from torch.nn.attention.flex_attention import flex_attention
    from triton.tools.tensor_descriptor import TensorDescriptor

    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=DTYPE) for _ in range(3))
    block_mask, sparse = window_block_mask()
    rows = []

    compiled = torch.compile(flex_attention, mode="max-autotune-no-cudagraphs")
    flex = lambda: compiled(q, k, v, block_mask=block_mask)  # noqa: E731
    ref = flex()
    ms, kernels = device_ms(flex)
    rows.append(dict(name="flex max-autotune", ms=ms, kernels=kernels, bytes=floor_bytes(64, 128)))

    call = AttnCall("block_sparse", q, k, v, D**-0.5, sparse=sparse)
    for name, plan in listed("triton", call).items():
        cfg = Config.parse(name.partition(":")[2])
        if cfg["block_m"] != 64 or cfg["schedule"] != "tile" or not cfg.get("tma"):
            continue
        fn = lambda plan=plan: plan.launch(call)[0]  # noqa: E731
        err = rel_err(fn(), ref)
        ms, kernels = device_ms(fn)
        grain = cfg["block_n"] if cfg.get("tile_list") else 128
        rows.append(dict(name=f"ours {cfg}", ms=ms, kernels=kernels, rel_err=err, bytes=floor_bytes(64, grain)))

    fa4 = get_backend("fa4")
    reason = fa4.supports(call.problem, device_info(q.device))
    for name, plan in ({} if reason else listed("fa4", call)).items():
        fn = lambda plan=plan: plan.launch(call)[0]  # noqa: E731
        try:
            err = rel_err(fn(), ref)
            ms, kernels = device_ms(fn)
        except Exception as e:  # noqa: BLE001 - one failing FA4 config must not end the run
            rows.append(dict(name=name, error=f"{type(e).__name__}: {str(e)[:200]}"))
            continue
        # FA4's sm_90 forward uses 128-row tiles over the mask's 128-key blocks
        rows.append(dict(name=name, ms=ms, kernels=kernels, rel_err=err, bytes=floor_bytes(128, 128)))
    if reason:
        rows.append(dict(name="fa4", error=reason))

    out = torch.empty_like(q)
    for bm, bn, grain in FLOORS:
        descs = [TensorDescriptor(x, list(x.shape), list(x.stride()), [1, 1, bn, D]) for x in (k, v)]
        launch = {}
        for warps, stages in READ_LAUNCHES:
            fn = lambda w=warps, s=stages: _window_read[(B * H * (L // bm),)](  # noqa: E731
                q, out, *descs, L, WINDOW, L // bm, H, BLOCK_M=bm, BLOCK_N=bn, GRAIN=grain, D=D, num_warps=w,
                num_stages=s)
            launch[f"num_warps={warps},num_stages={stages}"] = device_ms(fn)
        best = min(launch, key=lambda name: launch[name][0])
        rows.append(dict(name=f"read floor {bm}x{bn} rows x keys, {grain}-key granularity ({best})",
                         ms=launch[best][0], kernels=launch[best][1], bytes=floor_bytes(bm, grain),
                         every_launch_ms={name: t for name, (t, _) in launch.items()}))

    flex_ms = rows[0]["ms"]
    print(f"{'row':100} {'device ms':>9} {'GB':>6} {'TB/s':>6} {'flex / row':>10}")
    for r in rows:
        if "error" in r:
            print(f"{r['name'][:100]:100} {r['error']}")
            continue
        r["tb_per_s"] = r["bytes"] / (r["ms"] * 1e-3) / 1e12
        r["flex_over_row"] = flex_ms / r["ms"]
        print(f"{r['name'][:100]:100} {r['ms']:9.3f} {r['bytes'] / 1e9:6.2f} {r['tb_per_s']:6.2f} "
              f"{r['flex_over_row']:10.2f}")
    meta = dict(device=torch.cuda.get_device_name(), commit=git_commit(), torch=torch.__version__,
                triton=triton.__version__,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                problem=f"B{B} H{H} L{L} D{D} bf16, causal window {WINDOW}, 128x128 BlockMask")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sparse_floor_gpu.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
