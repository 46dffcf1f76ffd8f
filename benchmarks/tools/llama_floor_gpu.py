"""The HF Llama static-cache decode step with its attention taken out: the ceiling of what any attention
kernel can win there with plain launches (GPU).

    PYTHONPATH=. python benchmarks/tools/llama_floor_gpu.py [--decode-config KNOB=VALUE ...]

At least three steps of bench/models.py's decode entry, compiled in one process: stock ``torch.compile``, ours
(``backend="inductor_attn"``) and stock ``torch.compile`` of the same model with an attention function that
returns the queries (registered with transformers' ``AttentionInterface``): no mask, no attention kernel, the
projections, RoPE and cache writes kept. Printed as JSON: wall us per step of the first 40 calls after the
compiles (with the garbage collector's time in them, by generation), then, after ``settle``, the medians of
six rounds of 40 calls taking turns; stock over ours and stock over the attention-free step. Each step writes
into a cache of its own; all calls fit in its room (``DECODE_ROOM``). Each ``--decode-config`` adds a step: ours
tuned with only the ``triton_decode`` configs whose knobs have those values (``num_splits=1``,
``block_n=32,num_warps=8``), to measure a config in the step where the tuner would not pick it.
"""

import argparse
import gc
import json
import statistics
import time

import torch
from transformers import AttentionInterface

import inductor_attn
from inductor_attn.backends import REFERENCE, only_backends
from inductor_attn.backends.triton_decode import TritonDecodeBackend
from inductor_attn.bench.models import DECODE_ROOM, PREFILL, SIZE, build_llama, decode_step, prefill_model
from inductor_attn.bench.wallclock import interleaved_wall_runs, settle, wall_us, warm

CALLS, ROUNDS = 40, 6
NO_ATTENTION = "no attention (stock compile)"


class DecodeConfigsWith(TritonDecodeBackend):
    """triton_decode with only the configs whose knobs have ``values``."""

    def __init__(self, values: dict):
        unknown = set(values) - set(self.knobs)
        if unknown:
            raise ValueError(f"--decode-config: knobs {sorted(unknown)} are not triton_decode's {sorted(self.knobs)}")
        self.values = values

    def configs(self, p, dev, direction="forward"):
        kept = [c for c in super().configs(p, dev, direction)
                if all(str(c.config.get(k)) == v for k, v in self.values.items())]
        if not kept:
            raise ValueError(f"--decode-config: no triton_decode config of {p} has {self.values}")
        return kept


def knob_values(spec: str) -> tuple[str, dict]:
    """``"num_splits=1,num_warps=8"`` -> (spec, {"num_splits": "1", "num_warps": "8"})."""
    items = [item.split("=", 1) for item in spec.split(",")]
    if any(len(item) != 2 or not all(item) for item in items):
        raise argparse.ArgumentTypeError(f"expected KNOB=VALUE[,KNOB=VALUE], got {spec!r}")
    return spec, dict(items)


def queries_only(module, query, key, value, attention_mask, **kwargs):
    return query.transpose(1, 2), None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--decode-config", action="append", default=[], type=knob_values,
                        metavar="KNOB=VALUE[,KNOB=VALUE]",
                        help="also time ours with only the triton_decode configs that have these knob values")
    args = parser.parse_args()
    AttentionInterface.register("queries_only", queries_only)
    model, ids = prefill_model()
    attention_free = build_llama(**SIZE, max_len=PREFILL[1] + DECODE_ROOM).eval()
    attention_free.set_attn_implementation("queries_only")
    gc_s = {0: 0.0, 1: 0.0, 2: 0.0}
    started = {}

    def on_gc(phase, info):
        if phase == "start":
            started["t"] = time.perf_counter()
        else:
            gc_s[info["generation"]] += time.perf_counter() - started["t"]

    with torch.no_grad():
        torch._dynamo.reset()
        fns = {"stock": warm(decode_step(model, ids, "inductor", "default", reset=False))}
        for spec, values in args.decode_config:
            forced_model, _ = prefill_model()
            with only_backends(DecodeConfigsWith(values), REFERENCE), inductor_attn.tuning_mode("autotune"):
                fns[f"ours, {spec}"] = warm(decode_step(forced_model, ids, "inductor_attn", "default", reset=False))
        fns["ours"] = warm(decode_step(model, ids, "inductor_attn", "default", reset=False))
        fns[NO_ATTENTION] = warm(decode_step(attention_free, ids, "inductor", "default", reset=False))
        gc.callbacks.append(on_gc)
        unsettled = {name: round(wall_us(fn, calls=CALLS, repeats=1)) for name, fn in fns.items()}
        gc_unsettled = {g: round(s * 1e3, 1) for g, s in gc_s.items()}
        settle(fns)
        gc_s.update({0: 0.0, 1: 0.0, 2: 0.0})
        runs = interleaved_wall_runs(fns, calls=CALLS, rounds=ROUNDS)
        gc.callbacks.remove(on_gc)
    median = {name: statistics.median(times) for name, times in runs.items()}
    print(json.dumps({
        f"unsettled first {CALLS} calls": unsettled, "gc ms by generation in them": gc_unsettled,
        "gc ms in the rounds": {g: round(s * 1e3, 1) for g, s in gc_s.items()},
        "median_us": {name: round(us) for name, us in median.items()},
        "runs": {name: [round(us) for us in times] for name, times in runs.items()},
        "stock/ours": round(median["stock"] / median["ours"], 3),
        "stock/no attention": round(median["stock"] / median[NO_ATTENTION], 3),
        **{f"stock/ours, {spec}": round(median["stock"] / median[f"ours, {spec}"], 3)
           for spec, _ in args.decode_config}}))


if __name__ == "__main__":
    main()
