"""Host time of our Triton forward launch, piece by piece (H100/H200; about a minute).

    PYTHONPATH=. python benchmarks/launch_cost_gpu.py --out $OUT

Tiny problems (B1 H1 L256 D128 bf16; the block-sparse one with a causal 64-window mask in 128x128 blocks)
whose kernels take microseconds, so the time per call of calls launched back to back is the host's
(``back_to_back_ms``). For each config: the whole ``BACKEND.run``, then its pieces on their own: the
output allocations, the two TMA descriptors, the tile-list kernel (block-sparse ``tile_list`` configs),
the forward kernel's launch through ``kernel[grid](...)`` (Triton's argument binding and specialization,
then the launch), and the same compiled kernel launched through ``CompiledKernel[grid](...)`` and its
``run`` with the arguments already bound (the floor of any launch from Python; a launch cache keyed in
Python has to beat Triton's binding by more than its key costs).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from triton_flash_gpu import back_to_back_ms, window_block_mask

from inductor_attn.backends import Config
from inductor_attn.backends.base import AttnCall
from inductor_attn.backends.triton_flash import flash, flash_kernel
from inductor_attn.bench.runner import git_commit

SPARSE = dict(block_m=64, block_n=32, num_stages=3, num_warps=4, schedule="tile", tma=True)
WAYS = [  # name, op, config
    ("dense 64x64 TMA", "attention", Config.of(block_m=64, block_n=64, num_stages=3, num_warps=4, schedule="tile",
                                               tma=True)),
    ("dense 64x64 pointer loads", "attention", Config.of(block_m=64, block_n=64, num_stages=3, num_warps=4,
                                                         schedule="tile", tma=False)),
    ("block-sparse 64x32 by blocks", "block_sparse", Config.of(**SPARSE)),
    ("block-sparse 64x32 tile list", "block_sparse", Config.of(**SPARSE, tile_list=True)),
]


def tiny_call(op: str) -> AttnCall:
    q, k, v = (torch.randn(1, 1, 256, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    if op == "attention":
        return AttnCall("attention", q, k, v, 128**-0.5, True)
    return AttnCall("block_sparse", q, k, v, 128**-0.5, sparse=window_block_mask(256, 64)[1])


def captured_launch(call: AttnCall, cfg: Config):
    """The forward kernel's (grid, args, kwargs) of one ``BACKEND.run``, caught on their way to Triton."""
    seen = {}
    real = flash_kernel.flash_fwd_kernel

    class Catch:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.update(grid=grid, args=args, kwargs=kwargs)
                return real[grid](*args, **kwargs)
            return launch

    flash_kernel.flash_fwd_kernel = Catch()
    try:
        flash.BACKEND.run(call, cfg)
    finally:
        flash_kernel.flash_fwd_kernel = real
    return seen["grid"], seen["args"], seen["kwargs"]


def pieces(call: AttnCall, cfg: Config) -> dict[str, float]:
    kernel = flash_kernel.flash_fwd_kernel
    grid, args, kwargs = captured_launch(call, cfg)
    times = {"BACKEND.run": back_to_back_ms(lambda: flash.BACKEND.run(call, cfg)),
             "new_outputs": back_to_back_ms(lambda: flash.new_outputs(call))}
    if cfg.get("tma"):
        times["TMA descriptors"] = back_to_back_ms(lambda: flash._kv_descriptors(call, cfg))
    meta = flash.kernel_constexprs(call.problem, cfg, call.op == "block_sparse"
                                   and call.sparse.full_kv_num_blocks is not None)  # as forward() does
    if meta["TILE_LIST"]:
        shape = flash._tile_list_shape(call.sparse, call.problem.len_q, meta)
        times["tile-list kernel"] = back_to_back_ms(lambda: flash._tile_list(call.sparse, shape, meta))
    times["kernel[grid](...)"] = back_to_back_ms(lambda: kernel[grid](*args, **kwargs))
    compiled = kernel[grid](*args, **kwargs)
    # the compiled kernel takes every argument, constexpr ones included, in the signature's order
    full = list(args) + [kwargs[n] for n in list(kernel.arg_names)[len(args):]]
    grid3 = (*grid, 1, 1)[:3]
    stream = torch.cuda.current_stream().cuda_stream
    for name, fn in (("CompiledKernel[grid](...)", lambda: compiled[grid3](*full, stream=stream)),
                     ("CompiledKernel.run(...)", lambda: compiled.run(*grid3, stream, compiled.function,
                                                                      compiled.packed_metadata, None, None, None,
                                                                      *full))):
        try:
            fn()
            torch.cuda.synchronize()
            times[name] = back_to_back_ms(fn)
        except Exception as err:  # noqa: BLE001  (an API this Triton lacks is a finding, not a failure)
            times[name] = f"unavailable: {type(err).__name__}: {str(err)[:160]}"
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import triton

    results = {}
    for name, op, cfg in WAYS:
        results[name] = pieces(tiny_call(op), cfg)
        print(f"\n{name} ({cfg})")
        for piece, t in results[name].items():
            print(f"  {piece:<28} {t if isinstance(t, str) else f'{t * 1e3:8.1f} us'}")
    meta = {"device": torch.cuda.get_device_name(), "commit": git_commit(), "torch": torch.__version__,
            "triton": triton.__version__, "timing": "back_to_back_ms: 50 calls, host time per call"}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "launch_cost_gpu.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))


if __name__ == "__main__":
    main()
