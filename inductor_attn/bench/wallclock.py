"""What a user's wall clock sees: host time per call, wall time per call and kernel time, for a function
run eagerly or compiled. Shared by the overhead, training, model and paged suites and by
benchmarks/tools/compiled_choice_gpu.py.

- host_us: the CPU time one call takes to issue its work, measured over a burst of calls that fits in the
  launch queue (so the CPU never waits for the GPU; a model step's burst is one call), best of several bursts;
- wall_us: the time per call of a long run of plain launches, synchronized at the end: max(host, device)
  in steady state, what a loop of such calls costs; with it ``loop_host_us``, the time per call until that
  run's last call returned (where it is near wall_us and well above host_us, the steady loop waited on
  something the bursts do not show); ``interleaved_wall_us`` and ``interleaved_measure``
  time several functions in alternating rounds, so that a slow spell of the host (another process, a
  clock change) falls on all of them rather than on whichever ran then;
- loops whose calls differ (a serving loop's decode steps, each one token longer): ``interleaved_loops``
  runs each loop from its start, once plainly (wall and loop host us) and once in bursts (``burst_host_us``,
  this thread's CPU time per call over every call);
- kernel_us: the summed duration of the GPU kernels one call launches (torch.profiler), the device time;
  ``kernel_ms`` splits it by kernel.
"""

from __future__ import annotations

import gc
import itertools
import statistics
import time
import types
from collections.abc import Callable

import torch

from ..backends.replay import kept_bytes, served_bytes
from ..tuning.measure import sync
from ..tuning.timing import burst_cpu_s

BURST = 50  # calls per host-time burst: under the launch queue depth even at ~10 kernels a call
KERNEL_ROUNDS = 3  # profiles per function in interleaved_measure (each a profiler session of 10 calls)


def host_us(fn: Callable[[], object], bursts: int = 5, calls: int = BURST) -> float:
    """Best of ``bursts`` bursts of ``calls`` calls, each burst started on an idle device; a model step launches
    hundreds of kernels, so its bursts are of one call (``calls=1``): more would fill the launch queue and time
    the device."""
    best = float("inf")
    for _ in range(bursts):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
        sync()
    return best * 1e6


def wall_us(fn: Callable[[], object], calls: int = 200, repeats: int = 3) -> float:
    return _plain_runs(fn, calls, repeats)["wall_us"]


def _plain_runs(fn: Callable[[], object], calls: int = 200, repeats: int = 3) -> dict:
    """``wall_us`` and ``loop_host_us`` of the median of ``repeats`` runs of ``calls`` plain launches."""
    return _median_run([_plain_run(fn, calls) for _ in range(repeats)])


def _plain_run(fn: Callable[[], object], calls: int) -> tuple[float, float]:
    """(wall, loop host) us per call of ``calls`` plain launches: until the device finished, and until the last
    call returned. Loop host near wall with kernels well below it: the run waited on the host, at a rate
    the short bursts of ``host_us`` may not show; loop host well below wall: the device was the bound."""
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    issued = time.perf_counter()
    sync()
    end = time.perf_counter()
    return (end - start) / calls * 1e6, (issued - start) / calls * 1e6


def _turns(names: list[str], rounds: int):
    """``names`` ``rounds`` times over, who goes first rotating from round to round."""
    for r in range(rounds):
        yield from names[r % len(names):] + names[:r % len(names)]


def interleaved_wall_runs(fns: dict[str, Callable[[], object]], calls: int, rounds: int = 5) -> dict[str, list[float]]:
    """``wall_us`` of each function, one run of ``calls`` calls each per round, the functions taking turns: each
    function's ``rounds`` runs in order."""
    runs: dict[str, list[float]] = {name: [] for name in fns}
    for name in _turns(list(fns), rounds):
        runs[name].append(wall_us(fns[name], calls=calls, repeats=1))
    return runs


def interleaved_wall_us(fns: dict[str, Callable[[], object]], calls: int, rounds: int = 5) -> dict[str, float]:
    """The median of each function's ``interleaved_wall_runs``."""
    return {name: statistics.median(times) for name, times in interleaved_wall_runs(fns, calls, rounds).items()}


def interleaved_measure(fns: dict[str, Callable[[], object]], rounds: int = 5,
                        kernels: bool = True) -> dict[str, dict]:
    """``measure`` of each function, after warm-up, with their host bursts, wall runs and profiled kernel
    runs taking turns as in ``interleaved_wall_us``: host us the best burst, wall us the median run of 200
    calls, kernel us the median of ``KERNEL_ROUNDS`` profiles: a drift of the GPU's clocks or of the host
    falls on all of them, not on whichever ran then."""
    for fn in fns.values():
        warm(fn)
    host: dict[str, list[float]] = {name: [] for name in fns}
    wall: dict[str, list[tuple[float, float]]] = {name: [] for name in fns}
    kernel: dict[str, list[float]] = {name: [] for name in fns}
    for name in _turns(list(fns), rounds):
        host[name].append(host_us(fns[name], bursts=1))
        wall[name].append(_plain_run(fns[name], 200))
    if kernels and torch.cuda.is_available():
        for name in _turns(list(fns), KERNEL_ROUNDS):
            kernel[name].append(kernel_us(fns[name]))
    return {name: {"host_us": min(host[name]), **_median_run(wall[name]),
                   "kernel_us": statistics.median(kernel[name]) if kernel[name] else None} for name in fns}


def burst_host_us(fn: Callable[[], object], calls: int) -> float:
    """This thread's CPU time per call over ``calls`` calls of ``fn``, issued in bursts of ``BURST`` with the device
    synchronized between bursts (untimed), so the CPU never waits for the device. The mean over every call, not
    the best burst as in ``host_us``: a loop's calls differ (one adds a page, one crosses a bucket), and a step
    that costs more belongs in its figure. The thread's clock, as the tuner's ``host_ms``, so that what other
    threads and processes take of the cores (compile workers) is not charged to the loop."""
    spent = sum(burst_cpu_s(fn, None, min(BURST, calls - done)) for done in range(0, calls, BURST))
    sync()
    return spent / calls * 1e6


def interleaved_loops(loops: dict[str, tuple[Callable[[], object], Callable[[], object]]], calls: int,
                      rounds: int = 3) -> dict[str, dict]:
    """``loops``: name -> (step, restart), a step that moves its loop on by one call (a decode step) and what
    puts the loop back at its start. Per round, the loops taking turns as in ``interleaved_wall_us``: restart,
    one plain run of ``calls`` steps (``wall_us`` and ``loop_host_us``, :func:`_plain_run`), restart, the same
    steps in bursts (``host_us``: :func:`burst_host_us`); the median round's wall and loop host us, and the median
    host us, with every round's host us in order (``host_us_rounds``: whether two loops differ in every round, or
    in the rounds that met the host's slower spells)."""
    plain: dict[str, list[tuple[float, float]]] = {name: [] for name in loops}
    host: dict[str, list[float]] = {name: [] for name in loops}
    for name in _turns(list(loops), rounds):
        step, restart = loops[name]
        restart()
        plain[name].append(_plain_run(step, calls))
        restart()
        host[name].append(burst_host_us(step, calls))
    return {name: {"host_us": statistics.median(host[name]), "host_us_rounds": host[name], **_median_run(plain[name])}
            for name in loops}


def _median_run(runs: list[tuple[float, float]]) -> dict:
    """The median wall run's wall and loop host us (:func:`_plain_run`)."""
    wall, loop_host = sorted(runs)[(len(runs) - 1) // 2]
    return {"wall_us": wall, "loop_host_us": loop_host}


def kernel_events(fn: Callable[[], object], calls: int = 10) -> list:
    """The GPU kernel events (torch.profiler) of ``calls`` calls of ``fn``."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        sync()
    return [e for e in prof.events() if e.device_type == DeviceType.CUDA]


def kernel_us(fn: Callable[[], object], calls: int = 10) -> float | None:
    """Summed GPU kernel time per call, or None without a GPU."""
    if not torch.cuda.is_available():
        return None
    return sum(e.device_time_total for e in kernel_events(fn, calls)) / calls


def kernel_ms(fns: list[Callable[[], object]], calls: int = 20, warm: bool = True) -> dict[str, float]:
    """Device time per call of each kernel that ``fns`` launch, in ms by kernel name: plain launches cycling
    through ``fns`` (give input copies larger than L2 together), after one warm-up call of each (``warm``; off
    for functions the caller has just run). The calibration tools of benchmarks/tools/ compare it with a
    timer's figure to see launch gaps."""
    for fn in fns if warm else ():
        fn()
    turns = itertools.cycle(fns)
    per_kernel: dict[str, float] = {}
    for e in kernel_events(lambda: next(turns)(), calls):
        per_kernel[e.name] = per_kernel.get(e.name, 0.0) + e.time_range.elapsed_us() / 1e3 / calls
    return per_kernel


def own_code(fn: Callable) -> Callable:
    """``fn`` with a code object of its own, for compiling one function several ways (modes, backends, shapes):
    Dynamo keeps compiled frames per code object, so each call of one compile would also look at the others' cache
    entries, which a user who compiles a function once never pays. The copy has a name of its own too: Dynamo
    keeps what it learnt about a function's shapes by file, line and name (torch/_dynamo/pgo.py ``CodeId``), so a
    copy compiled at other shapes than an earlier one would start with the sizes that differ made dynamic."""
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{next(_COPIES)}")
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


_COPIES = itertools.count()


def warm(fn: Callable[[], object], calls: int = 5) -> Callable[[], object]:
    """Call ``fn`` a few times (compiles, tunes, records CUDA graphs) and return it."""
    for _ in range(calls):
        fn()
    sync()
    return fn


def settle(fns: dict[str, Callable[[], object]], calls: int = 30) -> None:
    """A full garbage collection, then ``calls`` more calls of each function, before any is timed: in a process
    that has just tuned, the next tens to hundreds of calls of a compiled model step ran up to twice as slow as
    later ones, stock's step as well as ours (cause not located), which would charge that spell to whichever
    function runs first."""
    gc.collect()
    for fn in fns.values():
        warm(fn, calls)


def measure(fn: Callable[[], object], kernels: bool = True) -> dict:
    """The three numbers of ``fn``, after warm-up."""
    warm(fn)
    return {"host_us": host_us(fn), **_plain_runs(fn),
            "kernel_us": kernel_us(fn) if kernels else None}


def model_part(wanted: bool, measure_model: Callable[[], dict]) -> dict | None:
    """A suite's HF Llama part when ``wanted``: its result, or the error it stopped on (recorded, so the
    suite's other numbers are kept)."""
    if not wanted:
        return None
    try:
        return measure_model()
    except Exception as err:  # noqa: BLE001 - keep the other numbers when the model part fails
        return {"error": f"{type(err).__name__}: {err}"}


def peak_memory(fn: Callable[[], object]) -> int | None:
    """Peak GPU bytes allocated during one call, above what was allocated before it, plus the scratch that
    replayed kernels took from the allocation they keep between calls (backends/replay.py), made by an earlier
    call: a workspace this call needs. Where the call grew that allocation, the peak holds it already."""
    if not torch.cuda.is_available():
        return None
    sync()
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    kept = kept_bytes(device)
    served_bytes(device, reset=True)
    fn()
    sync()
    served = served_bytes(device, reset=True) if kept_bytes(device) == kept else 0
    return torch.cuda.max_memory_allocated() - before + served
