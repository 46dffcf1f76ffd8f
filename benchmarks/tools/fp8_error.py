"""The error distribution of FA3's fp8 forward against float64 of the dequantised inputs, to confirm the fp8 bound
(tuning/correctness.py, TOLERANCES[torch.float8_e4m3fn]).

On the GPU machine: ``source .devfa3/install.sh && python benchmarks/tools/fp8_error.py [seeds]``. For each shape
(dense D64-D256, causal or not, GQA, decode) and seed, every fa3 fp8 candidate runs on fresh N(0, 1) inputs
rounded to e4m3, with per-tensor descales (and per (batch, kv head) ones on every other seed); it prints the
relative Frobenius error of out and lse per shape (min, median, max over seeds and candidates) and overall, with
the bound and the largest error's margin to it.
"""

from __future__ import annotations

import statistics
import sys

import torch

from inductor_attn.backends import REFERENCE, AttnCall, enumerate_candidates, fa3, run_backend
from inductor_attn.backends.reference import dequantised
from inductor_attn.device import device_info
from inductor_attn.tuning.correctness import LSE_TOLERANCE, TOLERANCES, rel_err

SHAPES = [  # (b, hq, hkv, lq, lk, d, causal)
    (2, 16, 16, 1024, 1024, 64, False), (2, 16, 16, 4096, 4096, 128, False), (2, 16, 16, 4096, 4096, 128, True),
    (2, 32, 8, 2048, 2048, 128, True), (1, 16, 16, 2048, 2048, 192, True), (1, 16, 16, 2048, 2048, 256, False),
    (4, 32, 8, 1, 8192, 128, False), (1, 16, 2, 4, 16384, 256, True),
]


def fp8_call(b, hq, hkv, lq, lk, d, causal, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", generator=gen).to(torch.float8_e4m3fn)
               for h, n in ((hq, lq), (hkv, lk), (hkv, lk)))
    shape = (b, hkv) if seed % 2 else (1,)
    descale = tuple((torch.rand(shape, device="cuda", generator=gen) + 0.5).expand(b, hkv) for _ in range(3))
    return AttnCall("attention", q, k, v, d ** -0.5, causal, descale=descale, out_dtype=torch.bfloat16)


def main(seeds: int) -> None:
    dev = device_info("cuda")
    loaded = fa3._load()
    if isinstance(loaded, str):
        sys.exit(loaded)
    bound, lse_bound = TOLERANCES[torch.float8_e4m3fn], LSE_TOLERANCE[torch.float8_e4m3fn]
    print(f"tokenspeed-fa3 {loaded.version}, {torch.cuda.get_device_name()}, torch {torch.__version__}, {seeds} "
          f"seeds; bound out {bound:.0e}, lse {lse_bound:.0e}")
    every = []
    for shape in SHAPES:
        errors, lse_errors = [], []
        for seed in range(seeds):
            call = fp8_call(*shape, seed)
            q, k, v = (x.double() for x in dequantised(call))
            ref_out, ref_lse = run_backend(REFERENCE, AttnCall("attention", q, k, v, call.scale, call.causal), None)
            for cand in enumerate_candidates(call.problem, dev):
                if cand.backend == "fa3" and cand.pruned is None:
                    out, lse = fa3.BACKEND.plan(call.problem, dev, cand.config, "forward").launch(call)
                    errors.append(rel_err(out, ref_out))
                    lse_errors.append(rel_err(lse, ref_lse))
        every += errors
        print(f"B{shape[0]} H{shape[1]}/{shape[2]} Lq{shape[3]} Lk{shape[4]} D{shape[5]} causal={shape[6]}: out "
              f"min {min(errors):.4f} median {statistics.median(errors):.4f} max {max(errors):.4f}; lse max "
              f"{max(lse_errors):.2e} ({len(errors)} runs)")
    print(f"overall: out median {statistics.median(every):.4f}, max {max(every):.4f} = {max(every) / bound:.2f}x the "
          f"bound")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8)
