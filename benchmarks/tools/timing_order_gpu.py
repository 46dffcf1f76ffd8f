"""Does a candidate's measured time depend on what ran just before it in the tuner's interleaved rounds? (GPU)

    PYTHONPATH=. python benchmarks/tools/timing_order_gpu.py --out $OUT

For each shape, the same candidates (CUDA-graph timer, as the tuner samples them) are timed in rounds with a fixed
order, in prior order and reversed; in the tuner's own rounds (``measure.time_trials``, an order shuffled every
round); each alone, in a session of its own; and each sample taken as the last of a ~100 ms burst of the
candidate's own replays (the GPU in that candidate's power state). Medians per candidate and scheme go to
timing_order.json. On an H200 (2026-11-29), FA3's 12 ms forward at B2 H32 L16k D128 full read 11.3 ms right
after SDPA's efficient kernel and 12.4 ms right after FA4's in fixed orders, and 13.1-13.7 ms on its own.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from inductor_attn.backends import AttnCall
from inductor_attn.tuning.measure import Direction, candidate_trial, fresh_inputs, input_copies, time_trials
from inductor_attn.tuning.timing import default_timer

SHAPES = {"B2 H32 L16k D128 full": (2, 32, 16384, 128, False), "B4 H32 L4k D128 causal": (4, 32, 4096, 128, True)}
CANDIDATES = ("sdpa:kernel=cudnn", "sdpa:kernel=efficient", "fa3:num_splits=1", "fa4:default",
              "fa4:mma_pv_is_rs=False")
ROUNDS = 20


def _fixed(trials, call, timer, burst_ms: float = 0.0) -> dict[str, float]:
    """Medians over ``ROUNDS`` rounds in the order of ``trials``; with ``burst_ms``, each sample the last of about
    that many milliseconds of the candidate's own replays."""
    copies = [fresh_inputs(call, seed=500 + i) for i in range(input_copies(call))]
    runners = [timer.prepare([t.bind(c) for c in copies]) for t in trials]
    bursts = [max(1, round(burst_ms / runner.sample())) if burst_ms else 1 for runner in runners]
    samples = [[] for _ in trials]
    for _ in range(ROUNDS):
        for i, runner in enumerate(runners):
            for _ in range(bursts[i]):
                x = runner.sample()
            samples[i].append(x)
    return {t.name: statistics.median(xs) for t, xs in zip(trials, samples)}


def shape_row(b: int, h: int, n: int, d: int, causal: bool) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    call = AttnCall("attention", q, k, v, d ** -0.5, causal)
    mode = Direction("forward", call)
    timer = default_timer("cuda")
    trials = [candidate_trial(name, mode) for name in CANDIDATES]
    timed = time_trials(trials, call, timer, 2, seed=50)  # compiles, and drops what cannot run here
    row = {"failed": {t.name: x.failed for t, x in zip(trials, timed) if x.failed}}
    trials = [t for t in trials if t.name not in row["failed"]]
    row["prior order"] = _fixed(trials, call, timer)
    row["reversed"] = _fixed(trials[::-1], call, timer)
    row["shuffled (the tuner's)"] = {t.name: statistics.median(x.samples)
                                     for t, x in zip(trials, time_trials(trials, call, timer, ROUNDS, seed=100))}
    row["alone"] = {t.name: statistics.median(time_trials([t], call, timer, ROUNDS, seed=200)[0].samples)
                    for t in trials}
    row["own 100 ms burst first"] = _fixed(trials, call, timer, burst_ms=100.0)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    result = {}
    for name, shape in SHAPES.items():
        result[name] = shape_row(*shape)
        for scheme, medians in result[name].items():
            print(name, scheme, {c: ms if scheme == "failed" else round(ms, 3) for c, ms in medians.items()},
                  flush=True)
        (out / "timing_order.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
