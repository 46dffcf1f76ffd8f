"""Where the host time of one compiled attention call goes, per forced backend (a calibration tool).

    PYTHONPATH=. python benchmarks/tools/host_profile.py [--calls 500] [--backends sdpa fa4 triton]
    PYTHONPATH=. python benchmarks/tools/host_profile.py --llama-decode [--calls 100]
    PYTHONPATH=. python benchmarks/tools/host_profile.py --training "document B1 H16 L8k D128" [--calls 100]
    PYTHONPATH=. python benchmarks/tools/host_profile.py --llama-training "B4 L2048" [--calls 20] [--only fa4]
    PYTHONPATH=. python benchmarks/tools/host_profile.py --output-code DIR [--case CASE] [--mode MODE]
    PYTHONPATH=. python benchmarks/tools/host_profile.py --output-code DIR --training SHAPE
    PYTHONPATH=. python benchmarks/tools/host_profile.py --output-code DIR --llama-decode
    PYTHONPATH=. python benchmarks/tools/host_profile.py --loop [--case CASE] [--mode MODE]
    PYTHONPATH=. python benchmarks/tools/host_profile.py --guards [--case CASE] [--mode MODE]
    PYTHONPATH=. python benchmarks/tools/host_profile.py --continuous-batching IMPLEMENTATION
    PYTHONPATH=. python benchmarks/tools/host_profile.py --serving-loop B1 [--output-code DIR]

For each backend (only it and the reference are registered, so the tuner must pick it): host us per call
of the compiled function, of the plan's launch called directly, and a cProfile of the compiled calls
(top entries by own time), so a regression in the per-call path shows where it is.

``--llama-decode``: the overhead suite's HF Llama static-cache decode step (bench/models.py), stock
``torch.compile`` and ours in one process: host us per step, kernel launches per step by launcher (Inductor's
static launcher, Triton's own launcher, aten matmuls), wall and kernel us per step, each one's cProfile, and
the GPU kernels (by name, per step) whose counts differ between the two.

``--training SHAPE``: the same for one fwd+bwd step of a training-suite shape (bench/training.py): eager SDPA,
stock compiled SDPA, ours compiled and, for a masked shape, compiled flex; the kernel counts compared between
stock compiled and ours; then ours' host time peeled layer by layer (compiled step, eager step, forward op,
run-time path, plan launches), the parts of each Triton launch, and the synchronizing calls of its compiled
step (``torch.cuda.set_sync_debug_mode``).

``--llama-training SIZE``: the training suite's HF Llama step (forward, backward, AdamW; bench/models.py) at
that size, stock ``torch.compile`` and ours, the same way.

``--only BACKEND`` (with ``--training`` or ``--llama-training``): ours with that backend alone registered (and the
reference), so that two trees compare one backend's launch, whatever their tunes would choose.

``--continuous-batching IMPLEMENTATION``: the paged suite's transformers ``generate_batch`` workload
(bench/models.py) with that attention (``inductor_attn`` or one of transformers' paged paths, e.g.
``flash_attention_3``): seconds per call after a warm-up call, and a cProfile of one call (top entries by own
time, then by cumulative time): where a host-bound serving loop spends its Python, ours against transformers'.

``--serving-loop {B1,B8}``: the paged suite's serving loop of that batch (bench/paged.py ``LOOPS``): its four
paths in the suite's rounds, each round's host us and paged/contiguous per round (the ratio of two loops taken
next to each other); then the two decode ops alone (no cache writes) compared as above, with Dynamo's frame and
guards alone of each, and their generated code written to ``--output-code`` DIR if given: whether the paged op
costs the host more than the contiguous one, and where.

``--output-code DIR``: Inductor's generated code of stock compiled SDPA and of ours, written to DIR (one file
per graph, forward and backward), for one of the overhead suite's calls as the suite writes them (``--case``,
or ``--prefill`` as before; default "prefill B1 H16/4 L512 D64 causal"; compiled in ``--mode``, default or
reduce-overhead; then the two compared, and the call's host time peeled: Dynamo's frame and guards, the
generated module, for prefill the aten call), or
with ``--training`` for that shape's fwd+bwd step, or with ``--llama-decode`` for the decode step (then their
profiles as without it): diff the two where the same kernels cost ours more host time.

``--loop``: one of the overhead suite's calls (``--case``, ``--mode``), stock compiled SDPA, ours and ours
routed (stock's code with ``backend="inductor_attn"``), in the suite's loops of 200 plain launches taking turns:
each call's own host time (median, p90, p99, max), the loop's us per call, the garbage collections the loop ran
(by generation) and their time, and the same loop with the collector off: whether a loop runs slower than the
suite's bursts because of calls that stall now and then.

``--guards``: the ``--case`` call compiled as stock SDPA, ours, ours with ``check_indices=False``, ours routed and
the op called directly, taking turns, and the Dynamo frame and guards alone of the first three: what the API's
own Python (keyword defaults, helpers, the kv_seqlens assert) costs a compiled call.

Each step function also gets the GPU's idle time inside a step, summed by the kernel it waited to start:
where a host-bound step loses its time.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import statistics

import torch

import inductor_attn
from inductor_attn.backends import REFERENCE, get_backend, only_backends, plan_for
from inductor_attn.bench import overhead
from inductor_attn.bench.wallclock import (host_us, interleaved_measure, kernel_events, own_code, settle, wall_us,
                                          warm)
from inductor_attn.device import device_info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=None, help="profiled calls (default 500; 100 with "
                        "--llama-decode or --training, 20 with --llama-training)")
    parser.add_argument("--backends", nargs="+", default=["sdpa", "fa4", "triton", "triton_decode"])
    parser.add_argument("--llama-decode", action="store_true", help="profile the HF Llama decode step instead")
    parser.add_argument("--training", metavar="SHAPE", help="profile a fwd+bwd step of this training-suite shape")
    parser.add_argument("--llama-training", metavar="SIZE",
                        help="profile the HF Llama training step of this size")
    parser.add_argument("--output-code", metavar="DIR", help="write stock's and ours' generated code to DIR")
    parser.add_argument("--case", "--prefill", metavar="CASE", default="prefill B1 H16/4 L512 D64 causal",
                        help=f"with --output-code, the overhead suite's call: one of {OVERHEAD_CASE_NAMES}")
    parser.add_argument("--mode", choices=["default", "reduce-overhead"], default="default",
                        help="with --output-code --case, torch.compile's mode of the compiled calls")
    parser.add_argument("--only", metavar="BACKEND", help="with --training or --llama-training, ours with this "
                        "backend alone (and the reference)")
    parser.add_argument("--loop", action="store_true", help="time the --case call's loops call by call")
    parser.add_argument("--guards", action="store_true", help="the --case call with and without the API's Python, "
                        "and Dynamo's frame and guards alone")
    parser.add_argument("--continuous-batching", metavar="IMPLEMENTATION",
                        help="profile transformers' generate_batch with this attention")
    parser.add_argument("--serving-loop", choices=["B1", "B8"], help="the paged suite's serving loop of this batch")
    args = parser.parse_args()
    if args.continuous_batching:
        continuous_batching(args.continuous_batching)
        return
    if args.serving_loop:
        serving_loop(int(args.serving_loop[1:]), args.calls or 500, args.output_code)
        return
    only = (only_backends(get_backend(args.only), REFERENCE) if args.only else contextlib.nullcontext())
    if args.training:
        with only:
            training(args.training, args.calls or 100, args.output_code)
        return
    if args.llama_decode:
        if (args.calls or 100) > LLAMA_MAX_CALLS:
            parser.error(f"--llama-decode profiles at most {LLAMA_MAX_CALLS} steps "
                         "(the room bench/models.py gives the cache)")
        llama_decode(args.calls or 100, args.output_code)
        return
    if args.loop or args.guards or args.output_code:
        if args.case not in OVERHEAD_CASE_NAMES:
            parser.error(f"--case takes one of {OVERHEAD_CASE_NAMES}, got {args.case!r}")
        if args.loop:
            loops(args.case, args.mode)
        elif args.guards:
            guard_peel(args.case, args.mode)
        else:
            case_code(args.output_code, args.case, args.mode)
        return
    if args.llama_training:
        from inductor_attn.bench.models import TRAIN_SIZES, training_steps

        if args.llama_training not in TRAIN_SIZES:
            parser.error(f"--llama-training takes one of {sorted(TRAIN_SIZES)}, got {args.llama_training!r}")
        with only:
            compare(training_steps(args.llama_training, "default")[0], args.calls or 20)
        return
    args.calls = args.calls or 500
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
            text = io.StringIO()
            _profiled(call, args.calls, text).sort_stats("tottime").print_stats(18)
        print(f"== {name}: {choice}\n   compiled call {compiled:.1f} us host; plan.launch alone {direct:.1f} us; "
              f"stats {stats}")
        print("\n".join(text.getvalue().splitlines()[6:30]))


def continuous_batching(implementation: str) -> None:
    from inductor_attn.bench.models import OURS, cb_session, fast_path

    generate, asked, ran = cb_session(implementation, smoke=False)
    with fast_path(implementation == OURS):
        first = generate()[1]
        timed = sorted(generate()[1] for _ in range(3))
        text = io.StringIO()
        stats = _profiled(generate, 1, text)
    print(f"== {implementation} (asked {asked}, ran {sorted(ran)}): first call {first:.2f} s, then {timed} s; "
          f"stats {inductor_attn.stats()}")
    for order, rows in (("tottime", 30), ("cumulative", 45)):
        stats.sort_stats(order).print_stats(rows)
    print("\n".join(line for line in text.getvalue().splitlines() if line.strip()))


def serving_loop(batch: int, calls: int, out_dir: str | None) -> None:
    """``--serving-loop``: the module doc's serving-loop anatomy."""
    from inductor_attn.bench.paged import LOOP_ROUNDS, LOOPS, loop_paths, run_loop

    loop = next(x for x in LOOPS if x.batch == batch)
    device = torch.device("cuda")
    row = run_loop(loop, device, LOOP_ROUNDS)
    if "error" in row:
        raise SystemExit(f"{loop.name}: {row['error']}")
    paths = row["paths"]
    print(f"== {loop.name}: host us per step in each of {LOOP_ROUNDS} rounds (the suite's loops), paged / contiguous")
    for kind in ("", "op_alone"):
        paged, contiguous = ((paths[n][kind] if kind else paths[n]) for n in ("paged", "contiguous"))
        rounds = list(zip(paged["host_us_rounds"], contiguous["host_us_rounds"]))
        ratios = ", ".join(f"{a / b:.3f}" for a, b in rounds)
        print(f"   {'the ops alone' if kind else 'the steps'}: " + "; ".join(f"{a:.1f}/{b:.1f}" for a, b in rounds)
              + f"\n      ratio per round {ratios}; median {statistics.median(a / b for a, b in rounds):.3f}")

    def restarting(step, restart):
        """The step, put back at the loop's start every ``loop.steps`` calls, so that any number of calls stays
        within the cache."""
        done = [0]
        restart()

        def call():
            if done[0] == loop.steps:
                restart()
                done[0] = 0
            done[0] += 1
            return step()
        return call

    built = loop_paths(loop, device, torch.bfloat16)
    ops = {name: restarting(*built[name]) for name in ("paged op", "contiguous op")}
    if out_dir:
        write_code(out_dir, ops)
    frames = loop_paths(loop, device, torch.bfloat16, compile_step=lambda fn: torch.compile(own_code(fn),
                                                                                             backend=_frozen))
    steps = {**ops, **{f"{name}: Dynamo frame + guards only": restarting(*frames[name])
                       for name in ("paged op", "contiguous op")}}
    compare(steps, calls, taking_turns=True)


LLAMA_MAX_CALLS = 250  # within bench/models.py's DECODE_ROOM (512) less the warm-up's, settle's, host bursts',
# wall run's and kernel profile's steps


def _launcher(key: tuple) -> str | None:
    """Which launcher a cProfile entry is, for the entries that mark one kernel launch each."""
    file, _, name = key
    if file.endswith("static_triton_launcher.py") and name == "run":
        return "Inductor's static launcher"
    if name == "<built-in method __triton_launcher.launch>":
        return "Triton's own launcher"
    if name in ("<built-in method torch.mm>", "<built-in method torch.bmm>", "<built-in method torch.addmm>"):
        return "aten matmuls"
    if name.startswith("<built-in method torch._ops.aten."):
        return "other aten ops"
    return None


def _profiled(fn, calls: int, stream: io.StringIO) -> pstats.Stats:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    return pstats.Stats(prof, stream=stream)


def _launch_counts(stats: pstats.Stats, calls: int) -> dict[str, float]:
    counts: dict[str, float] = {}
    for key, (_, ncalls, *_rest) in stats.stats.items():
        label = _launcher(key)
        if label:
            counts[label] = counts.get(label, 0.0) + ncalls / calls
    return counts


def _kernels_per_step(step, steps: int = 10) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """GPU kernels one step launches by name: count per step, us per step, and the GPU's idle us per step
    before them (gaps between steps left out): where the GPU waited."""
    counts: dict[str, float] = {}
    busy: dict[str, float] = {}
    idle: dict[str, float] = {}
    events = sorted(kernel_events(step, steps), key=lambda e: e.time_range.start)
    per_step = max(1, len(events) // steps)  # every step launches the same kernels
    busy_until = 0.0
    for i, e in enumerate(events):
        name = e.name[:90]
        counts[name] = counts.get(name, 0) + 1 / steps
        busy[name] = busy.get(name, 0.0) + e.device_time_total / steps
        if i % per_step:  # not a step's first kernel
            idle[name] = idle.get(name, 0.0) + max(0.0, e.time_range.start - busy_until) / steps
            busy_until = max(busy_until, e.time_range.end)
        else:
            busy_until = e.time_range.end
    return counts, busy, idle


def llama_decode(calls: int, out_dir: str | None = None) -> None:
    """The HF Llama static-cache decode step, stock against ours (``compare``); with ``out_dir``, each one's
    generated code written there first."""
    from inductor_attn.bench.models import BACKENDS, decode_step, prefill_model

    model, ids = prefill_model()
    with torch.no_grad():
        if out_dir:
            write_code(out_dir, {b: decode_step(model, ids, b, "default") for b in BACKENDS})
        compare({b: decode_step(model, ids, b, "default") for b in BACKENDS}, calls)


TRAINING_PATHS = ("stock compile", "ours", "eager sdpa")  # the first two have their kernels compared


def write_code(out_dir: str, steps: dict) -> dict[str, list]:
    """Each step's generated code (every graph its first call compiles) into out_dir/<name>.<i>.py; the paths
    by step."""
    import pathlib

    from torch._inductor.utils import run_and_get_code

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, step in steps.items():
        codes = run_and_get_code(step)[1]  # resets Dynamo first, so the step compiles afresh
        paths[name] = [out / f"{name.replace(' ', '_')}.{i}.py" for i in range(len(codes))]
        for path, code in zip(paths[name], codes):
            path.write_text(code)
        print(f"== {name}: {len(codes)} generated modules, {sum(c.count(chr(10)) for c in codes)} lines -> {out}")
    return paths


OVERHEAD_CASE_NAMES = tuple(case.name for case in overhead.CASES)


def _on(inputs, fn):
    """``fn`` called on ``inputs``, as a function of nothing (what the timers take)."""
    return lambda: fn(*inputs)


def case_code(out_dir: str, case_name: str, mode: str = "default") -> None:
    """One of the overhead suite's calls, stock compiled SDPA and ours as the suite writes them
    (bench/overhead.py: ``sdpa_user``, ``ours_user``), compiled in ``mode``."""
    from torch._dynamo.utils import counters

    case, inputs, fns = _case(case_name, mode)
    steps = {name: _on(inputs, torch.compile(fn, mode=mode)) for name, fn in fns.items()}
    counters.clear()
    paths = write_code(out_dir, steps)
    print(f"== Inductor's counters while compiling (cudagraph_skips: why a graph was not captured): "
          f"{dict(counters['inductor'])}")
    compare(steps, 200, taking_turns=True)
    call_layers(case, inputs, fns, {name: found[0] for name, found in paths.items()}, mode)


def _case(case_name: str, mode: str) -> tuple:
    """One of the overhead suite's calls: the case, its inputs as the suite's ``mode`` paths take them (static
    for reduce-overhead) and {"stock": SDPA, "ours": attention} as the suite writes them (bench/overhead.py)."""
    case = next(c for c in overhead.CASES if c.name == case_name)
    inputs = overhead.case_inputs(case, torch.device("cuda"), torch.bfloat16)
    if mode == "reduce-overhead":
        inputs = overhead.static_inputs(inputs)
    return case, inputs, {"stock": overhead.sdpa_user(case), "ours": overhead.ours_user(case)}


def _case_steps(case, inputs, mode: str) -> dict:
    """Stock compiled SDPA, ours and ours routed (stock's code with ``backend="inductor_attn"``) for one of the
    overhead suite's calls on ``inputs``, compiled in ``mode`` as the suite compiles them (``overhead.paths``)."""
    suffix = "" if mode == "default" else f" {mode}"
    compiled = overhead.paths(case)
    return {short: _on(inputs, compiled[f"{name} compile{suffix}"])
            for short, name in (("stock", "stock"), ("ours", "ours"), ("routed", "ours routed"))}


def _timed_loop(fn, calls: int, collect: bool) -> dict:
    """One loop of ``calls`` plain launches: each call's host us, the loop's us per call until the device
    finished, and the collections the garbage collector ran in it (by generation) with their ms."""
    import gc
    import statistics
    import time

    runs: dict[int, int] = {}
    gc_ms, started = [0.0], [0.0]

    def watch(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            runs[info["generation"]] = runs.get(info["generation"], 0) + 1
            gc_ms[0] += (time.perf_counter() - started[0]) * 1e3

    per_call = []
    torch.cuda.synchronize()
    gc.callbacks.append(watch)
    if not collect:
        gc.disable()
    try:
        start = time.perf_counter()
        for _ in range(calls):
            t = time.perf_counter()
            fn()
            per_call.append((time.perf_counter() - t) * 1e6)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / calls * 1e6
    finally:
        gc.enable()
        gc.callbacks.remove(watch)
    per_call.sort()
    return {"wall": wall, "median": statistics.median(per_call), "p90": per_call[int(0.9 * calls)],
            "p99": per_call[int(0.99 * calls)], "max": per_call[-1], "gc_runs": runs, "gc_ms": gc_ms[0]}


def loops(case_name: str, mode: str, calls: int = 200, rounds: int = 5) -> None:
    """``--loop``: the module doc's loop anatomy, the three paths taking turns, the collector on and off."""
    case, inputs, _ = _case(case_name, mode)
    steps = {name: warm(step) for name, step in _case_steps(case, inputs, mode).items()}
    print(f"== {case_name}, {mode}: loops of {calls} calls, us per call (each call's host time: median / p90 / "
          f"p99 / max), {rounds} rounds taking turns")
    for r in range(rounds):
        for collect in (True, False):
            for name in (list(steps) if r % 2 == 0 else list(steps)[::-1]):
                x = _timed_loop(steps[name], calls, collect)
                print(f"   round {r} {name:6s} gc {'on ' if collect else 'off'}: loop {x['wall']:7.1f}; call "
                      f"{x['median']:6.1f} / {x['p90']:6.1f} / {x['p99']:7.1f} / {x['max']:8.1f}; collections "
                      f"{x['gc_runs']} in {x['gc_ms']:.2f} ms")


def _frozen(gm, example_inputs):
    """A Dynamo backend whose compiled call returns the first call's outputs: what is left is Dynamo's frame and
    guards."""
    outputs = gm(*example_inputs)
    return lambda *args: outputs


def guard_peel(case_name: str, mode: str, rounds: int = 3) -> None:
    """``--guards``: the case's call compiled in ``mode`` as stock SDPA, ours, ours with ``check_indices=False``,
    ours routed and the op called directly (no API Python), and the Dynamo frame and guards alone (``_frozen``)
    of the first three (routed's frame is stock's); host and wall us, taking turns, ``rounds`` times."""
    from inductor_attn.problem import default_scale

    case, inputs, fns = _case(case_name, mode)
    kv_seqlens = (lambda n: n) if case.kind == "decode" else (lambda n: None)  # as the suite's ours passes them
    op, scale = torch.ops.inductor_attn.attention.default, default_scale(case.head_dim)
    fns["ours, check_indices=False"] = lambda q, k, v, n: inductor_attn.attention(
        q, k, v, causal=case.causal, kv_seqlens=kv_seqlens(n), check_indices=False)
    fns["op called directly"] = lambda q, k, v, n: op(q, k, v, scale, case.causal, -1, -1, kv_seqlens(n), None, "")[0]
    steps = _case_steps(case, inputs, mode)
    for name in ("ours, check_indices=False", "op called directly"):
        steps[name] = _on(inputs, torch.compile(own_code(fns[name]), fullgraph=True,
                                                mode=None if mode == "default" else mode))
    for name in ("stock", "ours", "ours, check_indices=False"):
        steps[f"{name}: Dynamo frame + guards only"] = _on(inputs, torch.compile(own_code(fns[name]), backend=_frozen))
    steps = {name: warm(step) for name, step in steps.items()}
    print(f"== {case_name}, {mode}: host / wall us per call, taking turns")
    for r in range(rounds):
        for name, row in interleaved_measure(steps, rounds=10, kernels=False).items():
            print(f"   round {r} {name:54s} {row['host_us']:7.1f} / {row['wall_us']:7.1f}")


def call_layers(case, inputs, fns: dict, modules: dict, mode: str = "default") -> None:
    """The call's host time peeled: the compiled calls, Dynamo's frame and guards alone (a backend that returns
    the first call's outputs), each generated module's ``call`` alone (plain launches in either mode) and, for
    a prefill case, the aten cuDNN call that both make, with and without the log-sum-exp. Best host burst of
    ten, the functions taking turns."""
    import ast
    import importlib.util
    import re

    def generated(path):
        spec = importlib.util.spec_from_file_location(path.stem.replace(".", "_"), path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        # the graph's inputs are the call's tensors that it reads, in the order ``call`` unpacks them (with graph
        # partitions, as in reduce-overhead's code, each partition unpacks its own order too): matched here by
        # size and stride (the code asserts both), which is all that host time depends on
        source, free, args = path.read_text(), list(inputs), []
        for name in re.search(r"def call\((?:self, )?args\):\n\s+((?:arg\d+_1, )*arg\d+_1),? = args",
                              source).group(1).split(", "):
            size, stride = (ast.literal_eval(t) for t in re.search(
                rf"assert_size_stride\({name}, (\(.*?\)), (\(.*?\))[,)]", source).groups())
            args.append(free.pop(next(i for i, x in enumerate(free) if (x.shape, x.stride()) == (size, stride))))
        return lambda: module.call(list(args))

    torch._dynamo.reset()
    compiled = {name: torch.compile(fn, mode=mode) for name, fn in fns.items()}
    guards = {name: torch.compile(own_code(fn), backend=_frozen) for name, fn in fns.items()}
    steps = {
        **{f"{name} compiled call": _on(inputs, fn) for name, fn in compiled.items()},
        **{f"{name}: Dynamo frame + guards only": _on(inputs, fn) for name, fn in guards.items()},
        **{f"{name}: generated module's call alone": generated(path) for name, path in modules.items()},
    }
    if case.kind != "decode":
        q, k, v, _ = inputs
        cudnn = torch.ops.aten._scaled_dot_product_cudnn_attention.default
        steps["aten cuDNN call, no lse"] = lambda: cudnn(q, k, v, None, False, 0.0, True)
        steps["aten cuDNN call with lse"] = lambda: cudnn(q, k, v, None, True, 0.0, True)
    host = interleaved_measure(steps, rounds=10, kernels=False)
    print(f"== {case.name} call peeled (host us, best burst, taking turns):")
    for name, row in host.items():
        print(f"   {row['host_us']:8.1f}  {name}")


def training(shape_name: str, calls: int, out_dir: str | None = None) -> None:
    """One fwd+bwd step of a training-suite shape (bench/training.py), its paths side by side."""
    from inductor_attn.bench import training as suite

    try:
        shape = suite.shape_named(shape_name)
    except ValueError as err:
        raise SystemExit(f"--training: {err}") from None
    device = torch.device("cuda")
    q, k, v, g = shape.inputs(device, torch.bfloat16)
    fns = suite.paths(shape, device)
    names = TRAINING_PATHS + (("compiled flex",) if shape.mask else ()) + (("ours varlen",) if "ours varlen" in fns
                                                                          else ())
    steps = {name: suite.training_step(fns[name][0], q, k, v, g) for name in names}
    if out_dir:
        write_code(out_dir, {name: steps[name] for name in TRAINING_PATHS[:2]})
    compare(steps, calls, taking_turns=True)
    layers(steps["ours"], suite.training_step(fns["ours eager"][0], q, k, v, g), q, k, v, g, shape, device)


def layers(compiled_step, eager_step, q, k, v, g, shape, device) -> None:
    """Host us of ours' step peeled layer by layer (compiled step, eager step, the forward op, the run-time
    path, the plans' launches), and whether the compiled step synchronizes with the GPU."""
    import warnings

    from inductor_attn import runtime
    from inductor_attn.api import _as_documents, make_call
    from inductor_attn.bench import training as suite

    kw = suite.ours_kwargs(shape, device)
    call = make_call(q.detach(), k.detach(), v.detach(), **kw)
    call = _as_documents(call) or call  # what attention() runs: packed documents as varlen
    if call.op == "varlen":
        g = g.transpose(1, 2).flatten(0, 1)
    dev = device_info(q.device)
    out, lse = runtime.forward(call, runtime.CHECKED)
    fwd_choice = inductor_attn.tuning.decide(call, dev, "forward")
    bwd_choice = inductor_attn.tuning.decide(call, dev, "backward")
    fwd_plan = plan_for(call.problem, fwd_choice, dev, "forward")
    bwd_plan = plan_for(call.problem, bwd_choice, dev, "backward")

    def forward_op():
        with torch.no_grad():
            return inductor_attn.attention(q, k, v, **kw)

    rows = {
        "compiled step (fwd + bwd)": compiled_step,
        "eager step (fwd + bwd, our ops)": eager_step,
        "eager forward op (no grad)": forward_op,
        "runtime.forward (decide + plan + launch)": lambda: runtime.forward(call, runtime.CHECKED),
        f"forward plan launch ({fwd_choice})": lambda: fwd_plan.launch(call),
        "runtime.backward (decide + plan + launch)":
            lambda: runtime.backward(call, runtime.CHECKED, out, lse, g, None),
        f"backward plan launch ({bwd_choice})": lambda: bwd_plan.launch(call, out, lse, g, None),
    }
    print("== ours, layer by layer (host us per call):")
    for name, fn in rows.items():
        print(f"   {host_us(warm(fn), bursts=3):8.1f}  {name}")
    if fwd_choice.startswith("triton:"):
        launch_anatomy("forward", lambda launcher: fwd_plan.launch.__self__._run(call, launcher))
    if bwd_choice.startswith("triton:"):
        from inductor_attn.backends.triton_flash import flash_bwd

        cfg = bwd_plan.launch.args[0]
        launch_anatomy("backward", lambda launcher: flash_bwd.backward(cfg, launcher, call, out, lse, g, None))
    if fwd_choice.startswith("fa4:"):
        fa4_anatomy("forward", fwd_plan.launch, lambda: fwd_plan.launch(call), q)
    if bwd_choice.startswith("fa4:"):
        fa4_anatomy("backward", bwd_plan.launch, lambda: bwd_plan.launch(call, out, lse, g, None), q)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(3):
                compiled_step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = sorted({str(w.message).splitlines()[0][:120] for w in caught})
    print(f"   synchronizing calls in 3 compiled steps: {len(caught)}" + "".join(f"\n      {m}" for m in syncs))


def compare(steps: dict, calls: int, taking_turns: bool = False) -> None:
    """Per step function: host, wall and kernel us, launches by launcher, its cProfile; then the GPU kernels
    (by name, per step) whose counts differ between the first two. ``taking_turns``: host and wall measured
    with the steps taking turns (bench/wallclock.py's interleaved_measure, 10 rounds), so that the host's
    slow spells fall on all of them; it runs ~2,500 calls of each, more than a decode step's cache has room
    for."""
    kernels, kernel_us = {}, {}
    # all steps compiled (and tuned) and settled before any is timed: timed right after its own tune, a step
    # bore the spell of slow calls that follows one (wallclock.settle)
    for step in steps.values():
        warm(step)
    settle(steps)
    if taking_turns:
        timed = interleaved_measure(steps, rounds=10, kernels=False)
    else:
        timed = {name: {"host_us": host_us(step, bursts=3), "wall_us": wall_us(step, calls=50, repeats=1)}
                 for name, step in steps.items()}
    for name, step in steps.items():
        host, wall = timed[name]["host_us"], timed[name]["wall_us"]
        kernels[name], kernel_us[name], idle = _kernels_per_step(step)
        device = sum(kernel_us[name].values())
        text = io.StringIO()
        stats = _profiled(step, calls, text)
        stats.sort_stats("tottime").print_stats(15)
        counts = ", ".join(f"{label} {n:.0f}" for label, n in _launch_counts(stats, calls).items())
        print(f"== {name}: {host:.0f} us of host, {wall:.0f} us of wall, {device:.0f} us of kernels per step "
              f"({sum(kernels[name].values()):.0f} kernels); per step: {counts}; stats {inductor_attn.stats()}")
        print("\n".join(text.getvalue().splitlines()[6:26]))
        text = io.StringIO()
        stats.stream = text
        stats.sort_stats("cumulative").print_stats(25)
        print("   by cumulative time:\n" + "\n".join(text.getvalue().splitlines()[6:34]))
        waits = sorted(idle.items(), key=lambda kv: -kv[1])[:12]
        print(f"   GPU idle inside a step: {sum(idle.values()):.0f} us; most before:\n"
              + "\n".join(f"   {us:8.1f} us  {kernel}" for kernel, us in waits))
    first, second = list(steps)[:2]
    print(f"== kernels per step, where {first} and {second} differ:")
    for kernel in sorted(set(kernels[first]) | set(kernels[second])):
        per = [kernels[n].get(kernel, 0) for n in (first, second)]
        if abs(per[0] - per[1]) > 0.01:
            print(f"   {per[0]:5.1f} / {per[1]:5.1f}  {kernel}")
    names = set(kernel_us[first]) | set(kernel_us[second])
    gaps = sorted(names, key=lambda k: -abs(kernel_us[first].get(k, 0) - kernel_us[second].get(k, 0)))[:15]
    print(f"== kernel us per step, {first} / {second}, the largest differences:")
    for kernel in gaps:
        print(f"   {kernel_us[first].get(kernel, 0):8.1f} / {kernel_us[second].get(kernel, 0):8.1f}  {kernel}")


def fa4_anatomy(direction: str, launch, run, q) -> None:
    """Host us of an FA4 plan's launch (backends/fa4/) that replays its recorded kernel calls: the whole
    launch, its replay, the replay's scratch buffers alone, and each compiled CuTe kernel called with the
    arguments the replay gave it; the launch less the replay is our argument preparation."""
    from inductor_attn.backends.replay import Replay, _direct

    replays = [r for r in launch.replays.by_layout.values() if r is not None]
    if len(replays) != 1:
        print(f"   {direction} FA4 launch: {len(replays)} replays recorded (calls FA4's interface); no anatomy")
        return
    replay, made = replays[0], []
    steps = replay.steps
    replay.steps = [(lambda *args, fn=fn: made.append((fn, args)) or fn(*args), specs) for fn, specs in steps]
    run()
    replay.steps = steps
    scratch = Replay([], replay.scratch)
    zeroed = sum(z for *_, z in replay.scratch)
    rows = {"whole launch": run,
            f"scratch buffers alone ({len(replay.scratch)}, {zeroed} zeroed)": lambda: scratch((q,))}
    for i, (fn, args) in enumerate(made):
        name = f"kernel {i}: {getattr(fn, '__name__', type(fn).__name__)}, {len(args)} args"
        rows[name] = lambda fn=fn, a=args: fn(*a)
        direct = _direct(fn, len(args))
        if direct is not fn:  # what the replay calls (backends/replay.py)
            rows[f"kernel {i}, its tvm-ffi function as the replay calls it"] = lambda fn=direct, a=args: fn(*a)
    print(f"   {direction} FA4 launch (host us):")
    for name, fn in rows.items():
        print(f"      {host_us(warm(fn), bursts=3):8.1f}  {name}")


def launch_anatomy(direction: str, run) -> None:
    """Host us of each Triton launch that ``run(launcher)`` makes: the launch as made (Triton's JIT), its
    argument binding alone, and the compiled kernel launched directly with the bound arguments."""
    from triton import knobs
    from triton.runtime.driver import driver

    made = []

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                made.append((self.kernel, grid, args, kwargs))
                return self.kernel[grid](*args, **kwargs)
            return launch

    run(Recorder)
    device = driver.active.get_current_device()
    stream = driver.active.get_current_stream(device)
    print(f"   {direction} launches (launch_enter_hook {knobs.runtime.launch_enter_hook}):")
    for kernel, grid, args, kwargs in made:
        binder = kernel.device_caches[device][4]
        compiled = kernel[grid](*args, **kwargs)
        bound = list(binder(*args, **kwargs)[0].values())
        g = (*grid, 1, 1)[:3]

        def direct():
            compiled.run(*g, stream, compiled.function, compiled.packed_metadata, None, None, None, *bound)
        try:
            times = [host_us(warm(fn), bursts=3) for fn in (lambda: kernel[grid](*args, **kwargs),
                                                            lambda: binder(*args, **kwargs), direct)]
            print(f"      {kernel.__name__}: {len(bound)} args; JIT launch {times[0]:.1f} us, binding alone "
                  f"{times[1]:.1f} us, compiled kernel direct {times[2]:.1f} us")
        except Exception as err:  # a tool: report and go on
            print(f"      {kernel.__name__}: {type(err).__name__}: {err}")


if __name__ == "__main__":
    main()
