"""Run training-suite paths of one shape step by step, synchronizing after each: where a CUDA error starts.

    PYTHONPATH=. python benchmarks/tools/training_path.py "B4 H16/4 L2k D64 causal" [--paths ours] [--steps 3]
        [--explain]
    compute-sanitizer --tool memcheck python benchmarks/tools/training_path.py "B4 H16/4 L2k D64 causal"

The paths (bench/training.py's ``paths``, in the suite's order unless ``--paths`` names some) run on a fresh
decision store, so ``ours`` tunes as it does in the suite. Each step is followed by a synchronize and a line
naming the path and step, so an asynchronous error is charged to the step that launched it; under
compute-sanitizer the first report names the kernel. ``--explain`` then prints ``cache explain`` of every
decision the run tuned: each candidate's device and host time, and what compiled code runs and why.
"""

from __future__ import annotations

import argparse
import logging
import traceback

import torch

from inductor_attn.bench import training as suite
from inductor_attn.bench.runner import fresh_store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", help="a training-suite shape name (bench/training.py SHAPES)")
    parser.add_argument("--paths", nargs="+", help="path names (default: all, in the suite's order)")
    parser.add_argument("--steps", type=int, default=3, help="steps per path")
    parser.add_argument("--log", action="store_true", help="log the tuner's steps (compiles, failures)")
    parser.add_argument("--explain", action="store_true",
                        help="print the explanation of every decision this run tuned")
    args = parser.parse_args()
    if args.log:
        logging.basicConfig(format="%(asctime)s %(name)s %(message)s")
        logging.getLogger("inductor_attn").setLevel(logging.DEBUG)
    try:
        shape = suite.shape_named(args.shape)
    except ValueError as err:
        parser.error(str(err))
    device = torch.device("cuda")
    with fresh_store():
        q, k, v, g = shape.inputs(device, torch.bfloat16)
        fns = suite.paths(shape, device)
        for name in args.paths or list(fns):
            fn, deterministic = fns[name]
            if fn is None:
                print(f"{name}: not available here", flush=True)
                continue
            torch.use_deterministic_algorithms(deterministic)
            step = suite.training_step(fn, q, k, v, g)
            for i in range(args.steps):
                try:
                    step()
                    torch.cuda.synchronize()
                except Exception as err:
                    print_chain(err)
                    raise
                print(f"{name}: step {i} ok", flush=True)
            torch.use_deterministic_algorithms(False)
        if args.explain:
            from inductor_attn import cache

            store = cache.get_store()
            for row in cache.list_decisions(store):
                if row["store"] == store.writable.describe():  # tuned by this run, not shipped
                    print(cache.explain(row["key"]), flush=True)


def print_chain(err: BaseException) -> None:
    """Every exception behind ``err``: Inductor re-raises a CUDA error met while restoring its RNG state
    ``from None``, which hides the error that a lowering raised first."""
    seen = []
    while err is not None and err not in seen:
        seen.append(err)
        err = err.__cause__ or err.__context__
    for i, e in enumerate(reversed(seen)):
        print(f"--- exception {i + 1} of {len(seen)} (first raised first) ---", flush=True)
        traceback.print_exception(type(e), e, e.__traceback__, chain=False)


if __name__ == "__main__":
    main()
