"""Where the host time of one compiled attention call goes, per forced backend (a calibration tool).

    PYTHONPATH=. python benchmarks/tools/host_profile.py [--calls 500] [--backends sdpa fa4 triton]

For each backend (only it and the reference are registered, so the tuner must pick it): host us per call
of the compiled function, of the plan's launch called directly, and a cProfile of the compiled calls
(top entries by own time), so a regression in the per-call path shows where it is.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats

import torch

import inductor_attn
from inductor_attn.backends import REFERENCE, get_backend, only_backends, plan_for
from inductor_attn.bench.wallclock import host_us, warm
from inductor_attn.device import device_info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--backends", nargs="+", default=["sdpa", "fa4", "triton", "triton_decode"])
    args = parser.parse_args()
    for name in args.backends:
        decode = name == "triton_decode"
        shape = (1, 32, 8, 1, 2048, 128) if decode else (1, 16, 4, 512, 512, 64)
        b, hq, hkv, lq, lk, d = shape
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)
                   for h, n in ((hq, lq), (hkv, lk), (hkv, lk)))
        lens = torch.full((b,), lk - 3, device="cuda", dtype=torch.int32) if decode else None
        torch._dynamo.reset()
        with only_backends(get_backend(name), REFERENCE), inductor_attn.tuning_mode("autotune"):
            fn = torch.compile(lambda q, k, v: inductor_attn.attention(q, k, v, causal=not decode, kv_seqlens=lens),
                               fullgraph=True)
            call = warm(lambda: fn(q, k, v))
            compiled = host_us(call)
            stats = inductor_attn.stats()
            from inductor_attn.api import make_call

            c = make_call(q, k, v, causal=not decode, kv_seqlens=lens)
            choice = inductor_attn.tuning.decide(c, device_info(q.device), "forward")
            plan = plan_for(c.problem, choice, device_info(q.device), "forward")
            direct = host_us(warm(lambda: plan.launch(c)))
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.calls):
                call()
            prof.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(18)
        print(f"== {name}: {choice}\n   compiled call {compiled:.1f} us host; plan.launch alone {direct:.1f} us; "
              f"stats {stats}")
        print("\n".join(text.getvalue().splitlines()[6:30]))


if __name__ == "__main__":
    main()
