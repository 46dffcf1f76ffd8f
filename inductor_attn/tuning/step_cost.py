"""What compiled code runs: the candidate that makes the user's step fastest, not the kernel alone.

A tune measures two figures per candidate: its device time (CUDA-graph replays, the kernels alone) and its
host time (the CPU time compiled code spends launching it, ``tuner.host_ms``). Which one matters depends on
the program around the call:

- **Under CUDA graphs** (``torch.compile(mode="reduce-overhead")``, cudagraph trees) a replay launches the
  whole graph at once, so no launch costs host time: device time alone decides, and compiled code runs the
  tuner's winner.
- **With plain launches** the CPU issues kernels ahead of the GPU, so a step costs about the larger of its
  total host time and its total device time, not their sum. A graph with ``n`` calls of a bucket running on
  candidate c, and other work costing ``H`` of host and ``D`` of device time, costs
  ``max(H + n * host_c, D + n * device_c)``. In a device-bound graph a launch's host time hides behind the
  kernels and the fastest kernel wins (or one tied with it and cheaper to launch); in a host-bound one (decode
  steps, small batches) the cheapest launch does. A call through the launch op costs compiled code more than
  the same op called alone, as the tune probes it (``OP_IN_GRAPH_MS``, added to those candidates' probes). A
  tune's probes can all read the host faster or slower than compiled code will meet it (``HOST_SCALES``), and
  each a little more (``HOST_ERROR``), so another candidate replaces the winner only where it wins at every
  host speed in that range, and by more than the tie margin at the probes' own (:func:`_robustly_faster`):
  where the step turns device-bound somewhere in the range, the faster kernel stays.

The lowering estimates ``H`` and ``D`` for each graph it compiles (lowering/graph_cost.py) and decides every
bucket of the graph together (:func:`choose_for_graph`). The tuner's winner stays unless another candidate
makes the step faster by more than the tie margin, so a near-tie never flips between compiles; one exception: a
kernel that ties the winner's within the tie margin and launches cheaper beyond the probes' error takes its
place (:func:`_incumbent`), since which of two tied kernels won is chance, and ``H`` and ``D`` are estimates.
``cache explain`` prints the choice per regime (:func:`explain_choice`). An eager call runs the winner: it pays
its own launch in any case, and a user who captures eager calls into a CUDA graph pays no host time.
"""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass

TIE_MARGIN = 0.02  # the tuner's: a candidate must make the step this much faster to replace the winner
# How far apart two candidates' host probes of one tune may be from what compiled code pays them, relative to
# each other (H200, 2026-11-29: each probe taken again against a loop of its launches, 0.95-1.05): another candidate
# replaces the winner only if it wins with its host time this much higher and the winner's this much lower. It
# does not cover the host's own drift: on an H200 host with nothing else running, the same launch's CPU time
# alternates between two levels 1.45-1.55x apart in spells of 0.2-2 s (benchmarks/tools/host_speed.py,
# 2026-11-30), and a tune's probes read 0.97-1.66x a later loop of the same launches, aten paths 0.97-1.31x and
# launch-op paths 1.36-1.66x in one training tune: within one tune mostly alike, not always.
HOST_ERROR = 0.1
# How much faster or slower than a tune's probes, all alike, the host may run the compiled code: a tune's probes
# read 0.49-2.02x a later loop of the same launches (median 1.06) over 23 launch paths in one run, while the same
# probe taken again, taking turns with that loop, read 0.92-1.11x (H200, 2026-12-01,
# benchmarks/tools/compiled_choice_gpu.py): the error is the moment the tune probes at, which the rule weighs
# against a fixed estimate of the rest of the graph (lowering/graph_cost.py). Within one tune the factor is much the
# same for every path: 0.67-0.75x at L512 causal and 1.51-1.70x at L2048 causal, aten calls and Triton launches
# alike, in one run (the collector took 2.5 ms of those probes: not the cause). A graph that is host-bound at the
# probes' speed can be device-bound at the host's real one, where a cheaper launch of a slower kernel loses.
HOST_SCALES = (0.5, 2.0)
SCALE_STEPS = 17  # host scales checked, geometrically spaced over HOST_SCALES, 1 among them
_SCALES = tuple(HOST_SCALES[0] * (HOST_SCALES[1] / HOST_SCALES[0]) ** (i / (SCALE_STEPS - 1))
                for i in range(SCALE_STEPS))
# What compiled code pays for a call through the launch op beyond the op called alone (the tune's probe): a
# compiled function making one such call against a compiled ``q + 1`` plus the op's probe, B1 H32 D128 L512 and
# L2048 causal on an H200: 15-21 us for FA4, SDPA flash and cuDNN plans through the op (2026-11-29, one run),
# 35-39 us for FA4 in an earlier one, 9-14 us for FA4 in three runs of 2026-11-30 (36 in a slow spell of the host),
# when traced aten calls (cuDNN, flash) cost compiled code 6-12 us less than their probes: the op path 20-22 us more
# than an aten one, against the 30 charged here, which no prefill shape's choice turned on. It grows with
# the Python work of a launch, and much of it looks like that work meeting caches the graph's other code has cooled,
# which a probe's loop keeps warm. On a CPU (2026-11-30): a trivial Python op costs a graph 0.3 us more than alone;
# the reference plan through this op (58 us alone) 17 us more, and 8 us more alone when a compiled ``q + 1`` runs
# between its calls.
OP_IN_GRAPH_MS = 0.03
WALL_CLOCK = "wall-clock"  # timing.WallClockTimer's name


@dataclass(frozen=True)
class LaunchCost:
    """One candidate's measured figures: ms of device time per call and ms of host time per launch."""

    name: str
    device_ms: float
    host_ms: float


@dataclass(frozen=True)
class GraphWork:
    """The host and device time (ms) of the rest of a graph: everything but the calls being decided."""

    host_ms: float
    device_ms: float


def launch_costs(record: dict) -> list[LaunchCost]:
    """The candidates of a tune record that passed the gate and carry both figures, in prior order, each with the
    host time of its launch path (the median of that path's probes, :func:`_launch_path`; through the launch op,
    plus ``OP_IN_GRAPH_MS``). Records
    tuned before host times were measured for every candidate hold them for a few only: those alone compete.
    None from a wall-clock tune (CPU problems): its time already holds the launch, and the winner is best.
    """
    if record.get("timer") == WALL_CLOCK:
        return []
    measured = [c for c in record.get("candidates", ())
                if c.get("status") == "passed" and c.get("median_ms") is not None and c.get("host_ms") is not None]
    paths: dict[tuple, list[float]] = {}
    for c in measured:
        paths.setdefault(_launch_path(c), []).append(c["host_ms"])
    host = {path: statistics.median(probes) + (OP_IN_GRAPH_MS if path[0] is False else 0.0)
            for path, probes in paths.items()}
    return [LaunchCost(c["name"], c["median_ms"], host[_launch_path(c)]) for c in measured]


# Knobs that pick another entry point of a library (SDPA's and the gather baseline's ``kernel``: a different aten
# op; flex's ``backend``), whose launch costs differ (SDPA's cuDNN, flash and efficient: 54, 47 and 98 us of host,
# H200, 2026-11-29): part of a launch path. Other knobs change the kernel, not what launches it.
ENTRY_KNOBS = ("kernel", "backend")


def entry_point(name: str) -> str:
    """A candidate's backend and its ``ENTRY_KNOBS``: the library entry point it is launched through.

    >>> entry_point("sdpa:kernel=flash"), entry_point("fa4:tile_mn=128x176"), entry_point("fa4:default")
    ('sdpa:kernel=flash', 'fa4', 'fa4')
    """
    backend, _, config = name.partition(":")
    entry = [kv for kv in config.split(",") if kv.partition("=")[0] in ENTRY_KNOBS]
    return ":".join([backend, ",".join(entry)]) if entry else backend


def _launch_path(candidate: dict) -> tuple:
    """What a candidate's host time is a property of: whether compiled code launches its traced kernels or calls
    the launch op (first, as ``launch_costs`` reads it) and its :func:`entry_point`. Other knobs change the
    kernel, not the Python that launches it, so the probes of one path are pooled (their median): on one H200 run
    (2026-11-29) FA4 configs' probes of one path spread from 36 to 60 us, and trading the tuner's winner for
    another config on that spread ran a kernel 26% slower.

    >>> _launch_path({"name": "sdpa:kernel=flash", "traced": True}), _launch_path({"name": "fa4:tile_mn=128x176"})
    ((True, 'sdpa:kernel=flash'), (None, 'fa4'))
    """
    return candidate.get("traced"), entry_point(candidate["name"])


def step_ms(cost: LaunchCost, calls: int, rest: GraphWork, host_factor: float = 1.0) -> float:
    """What a graph costs with ``calls`` launches of ``cost`` besides ``rest``: the larger of host and device,
    with ``cost``'s host time scaled by ``host_factor``.

    >>> step_ms(LaunchCost("c", 0.5, 0.1), 2, GraphWork(host_ms=3.0, device_ms=1.0))
    3.2
    """
    return max(rest.host_ms + calls * cost.host_ms * host_factor, rest.device_ms + calls * cost.device_ms)


@dataclass
class Bucket:
    """The calls of one graph that share a decision: the tuner's ``winner``, the ``costs`` of its candidates
    (empty when nothing was measured: the winner runs) and how many ``calls`` the graph makes."""

    winner: str
    costs: list[LaunchCost]
    calls: int = 1


def _robustly_faster(step, challenger, incumbent) -> bool:
    """Whether ``step(challenger, host_factor)`` beats ``step(incumbent, host_factor)`` with the challenger's host
    times ``HOST_ERROR`` higher and the incumbent's that much lower: by more than the tie margin at the probes'
    own host speed, and at least ties at every other scale of ``HOST_SCALES``. The margin only there, because a
    host-bound step's cost shrinks with the host's speed while the margin is a share of the whole step: HF Llama's
    B1 L512 training forward (8 calls, 4.2 ms of other host time) kept FA4's launch, 37 us dearer than cuDNN's per
    call, for a kernel 1.6 us faster, when the margin was asked at half the probes' speed too (H200, 2026-12-01)."""
    def steps(f: float) -> tuple[float, float]:
        return step(challenger, f * (1 + HOST_ERROR)), step(incumbent, f * (1 - HOST_ERROR))

    challenger_ms, incumbent_ms = steps(1.0)
    return (challenger_ms * (1 + TIE_MARGIN) < incumbent_ms
            and all(a <= b for a, b in map(steps, _SCALES)))


def choose_for_graph(buckets: dict, rest: GraphWork | None) -> dict:
    """``{bucket key: (choice, why)}`` for the calls of one compiled graph; ``rest`` is the graph's other work,
    None under CUDA graphs. Buckets are decided one at a time against the others' current choices, repeated
    until none changes (a few rounds: a change only moves the graph toward one bound). That can settle far from
    the best joint choice: the first bucket decided sees a graph host-bound only because the others still run
    their dear launches, takes a cheap launch of a slow kernel, and leaves the graph device-bound for the others.
    So the combination of every bucket's candidates that makes the step cheapest (``_joint``) replaces it where
    it is faster at every host scale, as a single candidate must be (:func:`_robustly_faster`)."""
    if rest is None:
        return {key: (b.winner, "under CUDA graphs a launch costs no host time: the fastest kernel")
                for key, b in buckets.items()}
    chosen = {key: _winner_cost(b) for key, b in buckets.items()}
    whys = {key: "" for key in buckets}
    for _ in range(len(buckets) + 1):
        changed = False
        for key, b in buckets.items():
            if chosen[key] is None:
                continue
            others = _plus(rest, [(c, buckets[k].calls) for k, c in chosen.items() if k != key and c is not None])
            pick, why = _choose(b, others)
            changed |= pick != chosen[key]
            chosen[key], whys[key] = pick, why
        if not changed:
            break
    joint = _joint(buckets, rest, chosen)
    if joint is not None:
        step, alone = joint.pop(None)
        for key, cost in joint.items():
            if cost is not chosen[key]:
                chosen[key] = cost
                whys[key] = (f"chosen with the graph's other buckets: the step costs {step:.3f} ms against "
                             f"{alone:.3f} ms with each bucket decided alone ({cost.device_ms:.4f} + "
                             f"{cost.host_ms:.4f} ms of host, {buckets[key].calls} call(s))")
    return {key: ((c.name if c is not None else b.winner), whys[key] or "no host time measured: the winner")
            for (key, b), c in zip(buckets.items(), chosen.values())}


JOINT_LIMIT = 4096  # combinations tried at most: 2-4 launch paths per bucket, a few buckets per graph


def _joint(buckets: dict, rest: GraphWork, chosen: dict) -> dict | None:
    """The cheapest combination of the measured buckets' candidates, ``{key: cost, None: (its step, the step of
    chosen)}``, where it beats ``chosen`` at every host scale (:func:`_robustly_faster`); else None (or where
    there are more than ``JOINT_LIMIT`` combinations)."""
    keys = [key for key in buckets if chosen[key] is not None and len(buckets[key].costs) > 1]
    if len(keys) < 2 or math.prod(len(buckets[key].costs) for key in keys) > JOINT_LIMIT:
        return None
    fixed = _plus(rest, [(c, buckets[k].calls) for k, c in chosen.items() if k not in keys and c is not None])

    def step(costs, host_factor: float) -> float:
        launches = [(c, buckets[k].calls) for k, c in zip(keys, costs)]
        return max(fixed.host_ms + host_factor * sum(n * c.host_ms for c, n in launches),
                   fixed.device_ms + sum(n * c.device_ms for c, n in launches))

    best = min(itertools.product(*(buckets[key].costs for key in keys)), key=lambda costs: step(costs, 1.0))
    current = [chosen[key] for key in keys]
    if not _robustly_faster(step, best, current):
        return None
    return {**dict(zip(keys, best)), None: (step(best, 1.0), step(current, 1.0))}


def _winner_cost(bucket: Bucket) -> LaunchCost | None:
    return next((c for c in bucket.costs if c.name == bucket.winner), None)


def _plus(rest: GraphWork, launches) -> GraphWork:
    return GraphWork(rest.host_ms + sum(n * c.host_ms for c, n in launches),
                     rest.device_ms + sum(n * c.device_ms for c, n in launches))


def _incumbent(bucket: Bucket) -> tuple[LaunchCost, str]:
    """The candidate the others must beat, and why it is not the winner (or ""): among the candidates whose kernel
    ties the winner's (within the tie margin either way), the one whose launch is cheaper than the winner's beyond
    the probes' error, the cheapest. Within that margin the tuner itself calls two kernels tied (its own margin is
    at least that), so the winner's name there is chance, while a cheaper launch shortens every step that is not
    clearly device-bound: HF Llama's B4 L2048 training step ran FA3's forward (88.5 us of kernel, ~120 us of
    launch) where FA4's (89.5, ~45) tied it, in graphs the estimate called device-bound and the profile showed
    waiting on the host (H200, 2026-11-29). A kernel faster than the winner's by more than the margin is not a
    tie: the step decides whether it runs (:func:`_choose`)."""
    winner = _winner_cost(bucket)
    tied = [c for c in bucket.costs if abs(c.device_ms - winner.device_ms) <= TIE_MARGIN * winner.device_ms
            and c.host_ms * (1 + HOST_ERROR) < winner.host_ms * (1 - HOST_ERROR)]
    if not tied:
        return winner, ""
    cheapest = min(tied, key=lambda c: (c.host_ms, c.device_ms))
    return cheapest, (f"; {cheapest.name} ties the winner {winner.name}'s kernel ({cheapest.device_ms:.4f} against "
                      f"{winner.device_ms:.4f} ms, within the {TIE_MARGIN:.0%} tie margin) with a launch cheaper "
                      f"beyond the probes' error ({cheapest.host_ms:.4f} against {winner.host_ms:.4f} ms)")


def _choose(bucket: Bucket, rest: GraphWork) -> tuple[LaunchCost, str]:
    """The incumbent (:func:`_incumbent`: the winner, or a candidate tied with its kernel and cheaper to launch),
    unless other candidates make the step faster at every host scale (:func:`_robustly_faster`); then the
    fastest of those at the probes' own scale."""
    winner, tie_note = _incumbent(bucket)

    def step(cost, host_factor):
        return step_ms(cost, bucket.calls, rest, host_factor)

    faster = [c for c in bucket.costs if c is not winner and _robustly_faster(step, c, winner)]
    bound = "host" if rest.host_ms - rest.device_ms >= 0 else "device"
    context = (f"the rest of the graph: {rest.host_ms:.3f} ms of host, {rest.device_ms:.3f} ms of device "
               f"({bound}-bound), {bucket.calls} call(s)")
    low, high = HOST_SCALES
    if not faster:
        best = min(bucket.costs, key=lambda c: step(c, 1.0))
        runner_up = "" if best is winner else (
            f"; {best.name} ({best.device_ms:.4f} + {best.host_ms:.4f} ms of host against {winner.device_ms:.4f} + "
            f"{winner.host_ms:.4f}) would cost {step(best, 1.0):.3f} ms: not faster by the {TIE_MARGIN:.0%} tie "
            f"margin, or slower at some host speed from {low:g}x to {high:g}x the probes', each host time "
            f"{HOST_ERROR:.0%} off")
        lead = "" if tie_note else "the winner: "
        return winner, f"{lead}the step costs {step(winner, 1.0):.3f} ms with it ({context}){tie_note}{runner_up}"
    best = min(faster, key=lambda c: step(c, 1.0))
    named = "" if tie_note else "the winner "
    return best, (f"step {step(best, 1.0):.3f} ms against {step(winner, 1.0):.3f} ms with {named}{winner.name} "
                  f"({best.device_ms:.4f} + {best.host_ms:.4f} ms of host against {winner.device_ms:.4f} + "
                  f"{winner.host_ms:.4f}), faster by the {TIE_MARGIN:.0%} tie margin and at every host speed from "
                  f"{low:g}x to {high:g}x the probes', each host time within {HOST_ERROR:.0%}; {context}){tie_note}")


def explain_choice(winner: str, costs: list[LaunchCost]) -> list[str]:
    """Lines that say what compiled code runs for one call of the bucket: under CUDA graphs, and with plain
    launches by how much host time ``H`` the rest of its graph spends beyond its device time ``D`` (very
    negative: device-bound, positive: host-bound).

    >>> for line in explain_choice("fa4", [LaunchCost("fa4", 0.014, 0.045), LaunchCost("sdpa", 0.023, 0.015)]):
    ...     print(line)
    under CUDA graphs: fa4 (device time only)
    plain launches, H - D < 0.003 ms: fa4
    plain launches, H - D >= 0.003 ms: sdpa
    """
    lines = [f"under CUDA graphs: {winner} (device time only)"]
    bucket = Bucket(winner, costs)
    if _winner_cost(bucket) is None:
        return lines + ["plain launches: no host time measured for the winner; it runs"]
    # each candidate's step cost bends where H - D = device - host: the choice can change only near those
    bends = sorted({c.device_ms - c.host_ms for c in costs})
    span = max(c.device_ms + c.host_ms for c in costs)
    probes = [bends[0] - span, *bends, bends[-1] + span]
    switches = []  # (H - D where the choice changes, choice from there on)
    for a, b in zip(probes, probes[1:]):
        if _plain_choice(bucket, a) != _plain_choice(bucket, b):
            for _ in range(40):  # bisect to the switch
                mid = (a + b) / 2
                a, b = (mid, b) if _plain_choice(bucket, mid) == _plain_choice(bucket, a) else (a, mid)
            switches.append((b, _plain_choice(bucket, b)))
    first = _plain_choice(bucket, probes[0])
    if not switches:
        return lines + [f"plain launches: {first} whatever the rest of the graph"]
    runs = [(None, first), *switches]
    for (start, name), (end, _) in zip(runs, [*runs[1:], (None, None)]):
        if start is None:
            lines.append(f"plain launches, H - D < {end:.3f} ms: {name}")
        elif end is None:
            lines.append(f"plain launches, H - D >= {start:.3f} ms: {name}")
        else:
            lines.append(f"plain launches, {start:.3f} <= H - D < {end:.3f} ms: {name}")
    return lines


def _plain_choice(bucket: Bucket, slack: float) -> str:
    """The choice for a graph whose other work spends ``slack`` ms more host than device time."""
    return _choose(bucket, GraphWork(max(slack, 0.0), max(-slack, 0.0)))[0].name
