"""Timers: how one sample of a candidate's run time is taken.

A timer turns zero-argument callables (the same kernel on rotating copies of the inputs, so that small
problems are not timed out of a warm L2) into a *runner* whose ``sample()`` returns the mean time of
one call in milliseconds. The tuner interleaves samples of all candidates round by round. A timer's
``host_ms_each(launches, device)`` gives the CPU time of one launch of each, taking turns too (:func:`host_ms_each`).

- ``CudaGraphTimer`` (GPU default): captures ``fn`` into a CUDA graph and times replays with CUDA
  events, flushing L2 before each sample, less the replay's own fixed cost. Seed 001 (ExecuTorch): the decode
  threshold moved from 2048 to 256 once timed under graph replay, because eager launches hide the kernel behind
  launch overhead.
  A kernel that cannot be captured is timed with plain launches and says so in ``note``.
- ``WallClockTimer``: CPU problems (perf_counter around the call).
- Tests use their own fake timers with known distributions (see tests/test_tuner.py).

A call's device time split by kernel (torch.profiler) is bench/wallclock.py's ``kernel_ms``, not a timer.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch

from .._compat import end_failed_capture
from .measure import sync
from .step_cost import WALL_CLOCK

L2_FLUSH_BYTES = 256 << 20  # > 50 MB L2 of an H100 / 60 MB of an H200


def host_ms(launch, device: torch.device, warmup: int = 10, bursts: int = 5, calls: int = 40) -> float:
    """CPU time of one launch in steady state (:func:`host_ms_each` of this launch alone)."""
    return host_ms_each({None: launch}, device, warmup, bursts, calls)[None]


# A host probe's burst queues at most this much device work (ms) where the launch's device time is known, and takes
# at least MIN_BURST_CALLS launches: the device drains each burst before the next, so 210 launches of a 3 ms kernel
# cost a tune 0.6 s (a first compile of B2 H32 L16k D128 causal spent 4.4 s probing its three candidates, H200,
# 2026-11-30). Only kernels over 0.5 ms get shorter bursts, which read high (host_ms_each), and their launch costs
# 0.03-0.15 ms: a few percent of the step at most, where no choice turns on it.
BURST_DEVICE_MS = 20.0
MIN_BURST_CALLS = 10


def burst_calls(device_ms: float | None, calls: int = 40) -> int:
    """Launches per host-probe burst for a launch whose kernels take ``device_ms`` (None: unknown): ``calls``, fewer
    where they would queue more than ``BURST_DEVICE_MS`` of device work, never fewer than ``MIN_BURST_CALLS``.

    >>> burst_calls(None), burst_calls(0.08), burst_calls(1.0), burst_calls(3.0), burst_calls(3.0, calls=4)
    (40, 40, 20, 10, 4)
    """
    if not device_ms or device_ms <= 0:
        return calls
    return min(calls, max(MIN_BURST_CALLS, math.ceil(BURST_DEVICE_MS / device_ms)))


def host_ms_each(launches: dict, device: torch.device, warmup: int = 10, bursts: int = 5, calls: int = 40,
                 failed: Callable[[object, BaseException], None] | None = None,
                 device_ms: dict | None = None) -> dict:
    """CPU time of one launch of each of ``launches`` (name -> launch) in steady state: ``warmup`` calls of each
    first (a plan records its replay, Triton specializes), then ``bursts`` rounds in which each takes one burst of
    ``calls`` launches back to back, as a loop of compiled calls makes them (bursts of 10, each after a
    synchronize, read 1.3-1.85x the per-call time of bursts of 50 for every candidate, H200, 2026-11-29), short
    enough for the launch queue so the CPU never waits; the median burst of each. Taking turns, as the device
    timings do: the host's speed drifts within a process (a first tune's probes read 1.2-2.0x a later loop of
    the same launches for every candidate, and the same probe taken later in turns with the loop 0.8-1.1x, H200,
    2026-11-29; on an idle host, two levels 1.5x apart in spells of 0.2-2 s, benchmarks/tools/host_speed.py),
    and a drift then falls on all alike. Timed by this thread's CPU clock, so that what other threads
    and processes take of the cores meanwhile (compile workers, Inductor's) is not charged to a launch; the
    median, not the best burst, because a launch's CPU time itself moves between bursts (FA4's through the launch
    op: 49-84 us per burst on an H200, 2026-11-29). ``device_ms`` (name -> ms, where known): a launch whose kernels
    take long gets shorter bursts (:func:`burst_calls`), each launch its own size: the high reading of short bursts
    then falls only on launches whose kernels outlast their host time several times over, where it decides nothing,
    and not on a fast kernel probed beside a slow one, whose host time may decide its step.
    ``failed(name, err)`` is told which launch raised, before
    the error propagates; each candidate's launches are synchronized before the next one's start, so that a kernel
    fault the device reports late is charged to its own launch."""
    name, per_call = None, {name: [] for name in launches}
    try:
        for name, launch in launches.items():
            for _ in range(warmup):
                launch()
            sync(device)
        sizes = {name: burst_calls((device_ms or {}).get(name), calls) for name in launches}
        for _ in range(bursts):
            for name, launch in launches.items():
                per_call[name].append(burst_cpu_s(launch, device, sizes[name]) / sizes[name])
    except Exception as err:
        if failed is not None:
            failed(name, err)
        raise
    sync(device)
    return {name: statistics.median(xs) * 1e3 for name, xs in per_call.items()}


def burst_cpu_s(launch, device: torch.device | None, calls: int) -> float:
    """This thread's CPU seconds for ``calls`` launches back to back, started on an idle device and synchronized
    after (untimed): the loop of one burst, which the tuner's host probe and the benchmarks' burst figures
    aggregate their own ways. The sync after is what names a kernel that faults: the device reports it late."""
    sync(device)
    start = time.thread_time()
    for _ in range(calls):
        launch()
    elapsed = time.thread_time() - start
    sync(device)
    return elapsed


class Runner:
    def __init__(self, sample: Callable[[], float], note: str = ""):
        self.sample = sample
        self.note = note


class WallClockTimer:
    name = WALL_CLOCK
    host_ms_each = staticmethod(host_ms_each)

    def __init__(self, inner_repeats: int = 1):
        self.inner_repeats = inner_repeats

    def prepare(self, fns: list[Callable[[], object]]) -> Runner:
        for fn in fns:  # warm-up
            fn()

        def sample() -> float:
            start = time.perf_counter()
            for _ in range(self.inner_repeats):
                for fn in fns:
                    fn()
            return (time.perf_counter() - start) * 1e3 / (self.inner_repeats * len(fns))

        return Runner(sample)


# Graphs of trivial kernels that measure a replay's fixed cost (CudaGraphTimer.replay_cost_ms): their sizes, samples
REPLAY_COST_KERNELS = (2, 32)
REPLAY_COST_SAMPLES = 25
_REPLAY_COST_MS: dict[int, float] = {}  # per device index, measured once per process


class CudaGraphTimer:
    """One sample = one replay of a graph that calls the kernel once per input copy, after an L2 flush, less the
    replay's own fixed cost (:meth:`replay_cost_ms`), divided by the number of copies.

    The fixed cost (the graph's start and the events around it: about 2 us on an H200) is no part of a call in a
    user's program, where a step's kernels run back to back; a sample holds one per replay, and a replay holds as
    many calls as input copies, which are few where inputs are large (two at a B1 D256 decode over a 16k cache):
    left in, it would add a microsecond to a call of 14 and pull every ratio of such a problem towards 1."""

    name = "cuda-graph"
    host_ms_each = staticmethod(host_ms_each)

    def __init__(self, warmup: int = 3):
        self.warmup = warmup
        self._flush = None

    def _flush_l2(self) -> None:
        # Read, not written: a written flush leaves L2 full of dirty lines whose write-back the first call after it
        # pays (up to what L2 holds, ~7 us on a 14 us B1 decode of an H200). In a user's step L2 before attention
        # holds mostly what the projection before it read (its weights), which leaves without a write-back.
        if self._flush is None or self._flush.get_device() != torch.cuda.current_device():
            self._flush = torch.zeros(L2_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
        self._flush.sum()

    def replay_cost_ms(self) -> float:
        """The device time a timed replay takes beyond its calls, on the current device, measured once per process:
        graphs of n trivial kernels take T(n) = F + n t a sample, so F = (n2 T(n1) - n1 T(n2)) / (n2 - n1)."""
        device = torch.cuda.current_device()
        if device not in _REPLAY_COST_MS:
            trivial = _trivial_kernel()
            totals = []
            for n in REPLAY_COST_KERNELS:
                sample, graph, _ = self._replay_sampler([trivial] * n)
                totals.append(statistics.median(sample() for _ in range(REPLAY_COST_SAMPLES)) if graph else None)
            (n1, n2), (t1, t2) = REPLAY_COST_KERNELS, totals
            _REPLAY_COST_MS[device] = 0.0 if t1 is None or t2 is None else max(0.0, (n2 * t1 - n1 * t2) / (n2 - n1))
        return _REPLAY_COST_MS[device]

    def prepare(self, fns: list[Callable[[], object]]) -> Runner:
        fixed = self.replay_cost_ms()
        sample_total, graph, note = self._replay_sampler(fns)

        def sample() -> float:
            total = sample_total()
            # plain launches (a kernel that cannot be captured) carry no replay; the floor keeps a sample positive
            # however the estimate errs
            return (max(total - fixed, total / 2) if graph is not None else total) / len(fns)

        # keep the graph (and the memory pool it captured) alive as long as the runner
        runner = Runner(sample, note)
        runner.graph = graph
        return runner

    def _replay_sampler(self, fns: list[Callable[[], object]]):
        """(a function timing one L2 flush-then-replay of ``fns`` in ms, the graph or None, a note)."""
        def run_all():
            for fn in fns:
                fn()

        stream = torch.cuda.Stream()  # on the current device: the caller's (runtime and the lowering see to it)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up off the capture: compiles, autotunes, allocates
            for _ in range(self.warmup):
                run_all()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph, pool = torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle()
        note = ""
        try:
            _capture(graph, pool, stream, run_all)
            launch = graph.replay
        except RuntimeError as err:  # not capturable (host sync, unsupported API): time plain launches
            end_failed_capture(stream.device.index, pool)
            torch.cuda.synchronize()
            note = f"timed without CUDA graph: {str(err).splitlines()[0][:120]}"
            launch, graph = run_all, None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def sample_total() -> float:
            self._flush_l2()
            start.record()
            launch()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)

        return sample_total, graph, note


def _trivial_kernel() -> Callable[[], object]:
    """A launch of one tiny kernel on the current device (a one-element fill)."""
    return torch.zeros(1, device="cuda").zero_


def _capture(graph: torch.cuda.CUDAGraph, pool, stream: torch.cuda.Stream, fn: Callable[[], object]) -> None:
    """``fn``'s launches captured into ``graph`` on ``stream``, in ``thread_local`` mode. A tune runs inside the
    user's program: torch.cuda.graph's default ``global`` mode makes unsafe CUDA calls of every other thread fail
    while a capture runs (a DataLoader's pin-memory thread pinning the next batch would end a training run, and
    spoil this capture), as Inductor's own CUDA graphs avoid by this mode. Unlike torch.cuda.graph, whose exit
    skips restoring the stream when ending the capture raises, the caller's stream and device are current again
    however the capture ends."""
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            fn()
        finally:
            graph.capture_end()


def default_timer(device_type: str):
    return CudaGraphTimer() if device_type == "cuda" else WallClockTimer()
