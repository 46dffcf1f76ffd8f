"""``bench --suite paged``: attention over a paged KV cache (issue 54), every candidate timed the tuner's way.

Decode rows: GB/s of each candidate (bytes of the keys and values that exist, read once, over its time) against
two floors on the same shape: a copy of those bytes (its GB/s counts the read and the write: what the device's
memory moves) and our own decode over a contiguous cache (``inductor_attn.attention`` with kv_seqlens, decided
as a user's call is). Chunked-prefill rows: TF/s. Pages of a fragmented pool (measure.fresh_inputs: each page
once, in random order), every sequence at the full length. Candidates run the code that ships (their plans,
measure.candidate_trial), timed in interleaved rounds under CUDA graphs (measure.time_trials), after the gate.
"Autotuned" is what ``paged_attention`` runs for the shape in autotune mode (the tuner's decision on the run's
decision store), its time that of the same candidate in the shapes' timing session.

FA3's default split heuristic, a reference column (issue 54's target compares with it): FA3's paged path as its
own interface calls it (``flash_attn_interface.flash_attn_with_kvcache``, ``num_splits=0``), outside our code. The
``fa3`` backend's paged candidates (backends/fa3.py: measured split counts, and FA3's heuristic among them) are
timed with the others where they run; this column stays what the target names, and records whether FA3's paged
path lets NaN past a length through (:data:`FA3_NOTE`). Where FA3 can run (the module imports and the GPU is
sm_90), it is gated on a NaN probe (to record that: :func:`_fa3_gates`), checked against the float64 reference
on the candidates' pages and table with zeros in every slot that holds no key (its error reported), then timed in
the same session as the candidates, its bind writing zeros into the timing copies' slots that hold no key (slots
the candidates' gate proved they ignore); elsewhere the row says why it was skipped. Its row gives its GB/s and
our autotuned choice's speed over it; the summary checks issue 54's target ("paged decode >= 1.5x FA3's default
split heuristic on the few-KV-head shapes, and never below it") on the decode rows with Hkv <= 2.

Serving loops (issue 54's "compiles once, tunes each bucket once, adds no host time per step over the contiguous
decode op"): ``steps`` decode steps of a ``torch.compile``d function calling ``inductor_attn.paged_attention``, the
sequences one key longer each step (the new key written into its slot in the compiled step; the block table, sized
for the last step so shapes stay static, gets each sequence's next page on the host when its last one is full),
against the same loop with the contiguous-cache decode op (``inductor_attn.attention`` with ``kv_seqlens``) over the
same keys; and each decode op alone (the same lengths growing, no cache writes: the paged step's writes gather a
block id before they write a slot, which the contiguous step's do not; the paged op on a table holding every page
from the start, so the host does nothing but the call), reported beside its step. On a fresh
decision store: the first pass's compiles (Dynamo graphs) and tunes (decisions it stored); then, the four loops
taking turns (wallclock.interleaved_loops), host us per step (this thread's CPU time, steps in bursts) and wall us
per step (a plain run of every step). A compile or tune after the first pass is recorded.

transformers' continuous batching (models.continuous_batching): ``generate_batch``'s tokens/s with our attention
(hf_paged.py) against transformers' own paged paths, and their greedy tokens against eager ``generate``.
``--part ops`` runs the shapes and the serving loops, ``--part models`` the continuous batching; with ``--shard``,
the loops and the model run in the first shard.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time

import torch

from ..api import attention, paged_attention
from ..backends import enumerate_candidates, fa3 as fa3_backend
from ..backends.pages import fill_unused, gather_padded, key_slots
from ..device import device_info
from ..ops.paged import paged_call
from ..runtime import reset_stats, stats
from ..store.db import get_store
from ..tuning.correctness import rel_err
from ..tuning.decisions import decide
from ..tuning.measure import (NAN_REACHED, Direction, Trial, candidate_trial, describe, gate, gate_inputs, strict,
                              sync, time_trials)
from ..tuning.modes import tuning_mode
from ..tuning.stats import median
from ..tuning.timing import default_timer
from .metrics import call_flops
from .report import cell
from .records import stored_record
from .wallclock import interleaved_loops, own_code


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    heads_q: int
    heads_kv: int
    head_dim: int
    len_k: int
    page_size: int
    chunk: int = 0  # queries per sequence: 0 decode (one), else chunked prefill
    quick: bool = False

    @property
    def name(self) -> str:
        kind = f"prefill chunk{self.chunk}" if self.chunk else "decode"
        return (f"{kind} B{self.batch} H{self.heads_q}/{self.heads_kv} D{self.head_dim} Lkv{self.len_k} "
                f"page{self.page_size}")


def shapes(quick: bool, smoke: bool) -> list[Shape]:
    if smoke:
        return [Shape(2, 4, 2, 32, 96, 16), Shape(2, 4, 2, 32, 96, 16, chunk=4)]
    out = []
    for page in (16, 64, 256):
        for batch in (1, 8, 32):
            for hq, hkv, d in ((32, 8, 128), (16, 2, 256), (32, 32, 128)):  # GQA, few KV heads, MHA
                for length in (1024, 16384):
                    representative = length == 16384 and (batch, hkv) in ((1, 2), (8, 8), (1, 32))
                    out.append(Shape(batch, hq, hkv, d, length, page, quick=representative))
        out.append(Shape(4, 32, 8, 128, 4096, page, chunk=16, quick=page == 64))
    return [s for s in out if s.quick] if quick else out


def _call(s: Shape, device: torch.device, dtype: torch.dtype):
    width = -(-s.len_k // s.page_size)
    lq = s.chunk or 1
    q = torch.empty(s.batch * lq, s.heads_q, s.head_dim, dtype=dtype, device=device)
    pool = torch.empty(1, s.page_size, s.heads_kv, s.head_dim, dtype=dtype, device=device)  # fresh_inputs sizes it
    table = torch.zeros(s.batch, width, dtype=torch.int32, device=device)
    lens = torch.full((s.batch,), s.len_k, dtype=torch.int32, device=device)
    cu = torch.arange(s.batch + 1, dtype=torch.int32, device=device) * lq if s.chunk else None
    return paged_call(q, pool, pool, table, lens, cu, lq, width * s.page_size, s.head_dim ** -0.5, True, -1, -1)


def _copy_trial() -> Trial:
    """A copy of the keys and values that exist, out of a contiguous buffer: the bandwidth floor."""
    def bind(call):
        # filled without the RNG: the timer may bind while a CUDA graph captures, where a draw from the default
        # generator raised (H200), and a copy's speed does not depend on the values
        src = torch.full((2, call.block_table.shape[0] * int(call.max_seqlen_k), *call.k.shape[2:]), 0.5,
                         dtype=call.k.dtype, device=call.k.device)
        dst = torch.empty_like(src)
        # a kernel, not dst.copy_(src), which a CUDA graph runs on the copy engine (runner.measure_copy_gbps)
        return lambda: torch.neg(src, out=dst)
    return Trial("copy floor", bind, lambda err: isinstance(err, RuntimeError), ours=False)


def _contiguous_trial() -> Trial:
    """Our decode over the same keys in a contiguous (B, Hkv, L, D) cache, decided as a user's call is."""
    def bind(call):
        slots = key_slots(call.block_table, call.kv_seqlens, call.k.shape[1])
        k, v = (gather_padded(x, *slots).transpose(1, 2).contiguous() for x in (call.k, call.v))
        q = call.q.unflatten(0, (call.block_table.shape[0], call.max_seqlen_q)).transpose(1, 2)
        return lambda: attention(q, k, v, causal=True, kv_seqlens=call.kv_seqlens, check_indices=False)
    return Trial("contiguous decode (ours)", bind, lambda err: isinstance(err, RuntimeError), ours=False)


# FA3's paged path with its default split heuristic, called through its interface: a reference column (module doc)
FA3_NAME = "FA3 default splits (reference)"
FA3_NOTE = "FA3 default splits, timed on a zeroed pool: fails the NaN-past-length check"
# where this run's NaN probe did not catch it (the note says what the run saw)
FA3_PASSED_NAN_NOTE = "FA3 default splits, timed on a zeroed pool: passed this run's NaN-past-length probe"


def fa3_interface(device: torch.device):
    """``flash_attn_interface`` where FA3's paged path can run on ``device``, else the reason it cannot (the fa3
    backend's: the same wheel, device and import)."""
    reason = fa3_backend.unavailable(device.type, device_info(device))
    if reason is not None:
        return reason
    import flash_attn_interface
    return flash_attn_interface


def _fa3_trial(fa3, zero_pool: bool) -> Trial:
    """FA3's ``flash_attn_with_kvcache`` on the call's pages and table with its default split heuristic
    (``num_splits=0``, ``pack_gqa=None``): q as (B, Lq, Hq, D) (every sequence has ``max_seqlen_q`` queries here),
    the pools (num_blocks, page_size, Hkv, D), the table and lengths int32; its out (B, Lq, Hq, D) returned packed
    (total_q, Hq, D), as the reference's. ``zero_pool``: first write zeros into the slots that hold no key (in
    place, at bind: outside any capture). Any error means it cannot run the shape (the reason is reported)."""
    def bind(call):
        if zero_pool:
            fill_unused(call.k, call.v, call.block_table, call.kv_seqlens, 0)
        q = call.q.view(call.block_table.shape[0], int(call.max_seqlen_q), *call.q.shape[1:])

        def run():
            out = fa3.flash_attn_with_kvcache(q, call.k, call.v, cache_seqlens=call.kv_seqlens,
                                              page_table=call.block_table, softmax_scale=call.scale,
                                              causal=call.causal, num_splits=0)
            return out.flatten(0, 1)
        return run
    return Trial(FA3_NAME, bind, lambda err: isinstance(err, Exception), ours=False)


def _fa3_gates(fa3, call, expected, check) -> tuple[dict, Trial | None]:
    """FA3's default splits checked twice. The NaN probe: the gate on the shape with every length one key short
    (the suite's lengths fill their last pages, so only there does a slot past a length, holding NaN, sit inside
    a sequence's pages): what keeps it from being a candidate. Then the candidates' gate pages and table with zeros
    in every slot that holds no key, against the float64 reference (its error). The record, and where it passed on
    the zeroed pool, the trial to time."""
    short = gate_inputs(dataclasses.replace(call, kv_seqlens=call.kv_seqlens - 1, _problem=None), seed=1)
    probe_direction = Direction("forward", short)
    probe_expected = probe_direction.reference(short)
    dtype = call.q.dtype
    nan = gate(_fa3_trial(fa3, zero_pool=False), short, probe_expected,
               lambda got: probe_direction.check(got, probe_expected, dtype))
    del short, probe_expected
    trial = _fa3_trial(fa3, zero_pool=True)  # on copies of the pools: the candidates' gate inputs stay as they are
    ok = gate(trial, dataclasses.replace(call, k=call.k.clone(), v=call.v.clone(), _problem=call._problem), expected,
              check)
    note = (FA3_NOTE if nan.status == "wrong" and nan.reason.startswith(NAN_REACHED) else FA3_PASSED_NAN_NOTE
            if nan.status == "passed" else f"FA3 default splits, timed on a zeroed pool: its NaN probe {nan.status}")
    record = {"note": note,
              "nan_probe": {"status": nan.status, "reason": nan.reason},
              "zeroed_pool": {"status": ok.status, "reason": ok.reason, "error": ok.error}}
    return record, trial if ok.status == "passed" else None


def _autotuned(call) -> dict:
    """What ``paged_attention`` runs for ``call`` in autotune mode (the tuner's decision on this run's store,
    tuned now if it holds none), the seconds deciding took, and the tune's own median ms per candidate
    (``tuned_ms``: where the bench's timing and the tune's disagree on which is fastest, both show); any error is
    recorded (raised under INDUCTOR_ATTN_STRICT=1)."""
    start = time.perf_counter()
    try:
        with tuning_mode("autotune"):
            choice = decide(call, device_info(call.q.device), "forward")
    except Exception as err:  # noqa: BLE001 - the shape's other numbers stand without it
        if strict():
            raise
        return {"error": describe(err)}
    seconds = time.perf_counter() - start
    record = stored_record(call.problem) or {"candidates": []}
    tuned = {c["name"]: c["median_ms"] for c in record["candidates"] if c.get("median_ms") is not None}
    return {"choice": choice, "decide_s": seconds, "tuned_ms": tuned}


def run_shape(s: Shape, device: torch.device, rounds: int) -> dict:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    call = gate_inputs(_call(s, device, dtype), seed=1)
    direction = Direction("forward", call)
    expected = direction.reference(call)

    def check(got):
        return direction.check(got, expected, dtype)

    kv_bytes = 2 * s.batch * s.len_k * s.heads_kv * s.head_dim * call.k.element_size()
    # counted from the call's lengths: its problem holds the kv length rounded up to a power of two (the bucket)
    trials, row = [], {"shape": s.name, "heads_kv": s.heads_kv, "kv_bytes": kv_bytes, "flops": call_flops(call),
                       "candidates": {}}
    for cand in enumerate_candidates(call.problem, device_info(device)):
        if cand.pruned is not None:
            continue
        trial = candidate_trial(cand.name, direction)
        result = gate(trial, call, expected, check)
        row["candidates"][cand.name] = {"status": result.status, "reason": result.reason}
        if result.status == "passed":
            trials.append(trial)
    floors = [_copy_trial(), _contiguous_trial()]
    fa3 = fa3_interface(device)
    if isinstance(fa3, str):
        row["fa3_default"] = {"skipped": fa3}
    else:
        row["fa3_default"], fa3_trial = _fa3_gates(fa3, call, expected, check)
        floors += [fa3_trial] if fa3_trial is not None else []
    timed = time_trials(trials + floors, call, default_timer(device.type), rounds)
    for trial, t in zip(trials + floors, timed):
        ms = median(t.samples) if t.samples else None
        if trial.name == FA3_NAME:
            row["fa3_default"].update(ms=ms, failed=t.failed, timer_note=t.note)
            continue
        row["candidates"].setdefault(trial.name, {"status": "floor"}).update(ms=ms, failed=t.failed)
    row["autotuned"] = _autotuned(call)
    return row


@dataclasses.dataclass(frozen=True)
class Loop:
    """A serving loop: ``batch`` sequences of ``start - 1`` keys, each of ``steps`` decode steps one key longer."""
    batch: int
    heads_q: int
    heads_kv: int
    head_dim: int
    page_size: int
    start: int  # keys of each sequence at the first step, its new one included
    steps: int

    @property
    def name(self) -> str:
        return (f"B{self.batch} H{self.heads_q}/{self.heads_kv} D{self.head_dim} page{self.page_size} "
                f"Lkv{self.start}->{self.start + self.steps - 1}")


# issue 54's target: 1,000 steps with growing lengths; a batch of 8 and a single sequence (the host's share is
# largest where the kernel is shortest)
LOOPS = (Loop(8, 32, 8, 128, 16, 4096, 1000), Loop(1, 32, 8, 128, 16, 4096, 1000))
SMOKE_LOOPS = (Loop(2, 4, 2, 32, 16, 44, 8),)  # its keys 43 to 50: the sequences get a page at key 48
# Rounds of the loops taking turns. The host's speed moves between two levels about 1.5x apart in spells of 0.2-2 s
# (benchmarks/tools/host_speed.py), about one loop's turn, so each loop's median needs rounds enough to meet both;
# every round's figure is kept (interleaved_loops' host_us_rounds).
LOOP_ROUNDS = 9


def _paged_step(q, k_new, v_new, k_pool, v_pool, block_table, lens):
    """One decode step over a paged cache, as compiled: every sequence one key longer, its key and value written
    into their slot as a server writes them (vLLM's ``reshape_and_cache`` from a slot mapping; hf_paged's append
    also handles transformers' padding rows of no keys, which this loop has none of), then attention over the
    pages."""
    lens += 1
    page_size = k_pool.shape[1]
    positions = lens.long() - 1
    blocks = block_table[torch.arange(lens.shape[0], device=lens.device), positions // page_size].long()
    slots = positions % page_size
    k_pool[blocks, slots] = k_new
    v_pool[blocks, slots] = v_new
    return paged_attention(q, k_pool, v_pool, block_table, lens)


def _contiguous_step(q, k_new, v_new, k_cache, v_cache, lens):
    """The same step over a contiguous (B, Hkv, L, D) cache: the contiguous decode op."""
    lens += 1
    rows = torch.arange(lens.shape[0], device=lens.device)
    positions = lens.long() - 1
    k_cache[rows, :, positions] = k_new
    v_cache[rows, :, positions] = v_new
    return attention(q, k_cache, v_cache, kv_seqlens=lens)


def _paged_attend(q, k_new, v_new, k_pool, v_pool, block_table, lens):
    """The paged step without its cache writes (``k_new`` and ``v_new`` unread): one key longer, the keys read as
    the pool holds them. Beside :func:`_contiguous_attend` it times the two decode ops alone, which the steps' writes
    (a block id gathered, then a slot written, for the pages) would blur."""
    lens += 1
    return paged_attention(q, k_pool, v_pool, block_table, lens)


def _contiguous_attend(q, k_new, v_new, k_cache, v_cache, lens):
    lens += 1
    return attention(q, k_cache, v_cache, kv_seqlens=lens)


# The loops of a serving loop: (name, the function each step calls compiled, its cache: "contiguous", "paged" (the
# table gets each page when the keys reach it, as a server's does) or "paged, full table" (every page in the table
# from the start: the op alone, with nothing on the host but its call)
LOOP_STEPS = (("paged", _paged_step, "paged"), ("contiguous", _contiguous_step, "contiguous"),
              ("paged op", _paged_attend, "paged, full table"), ("contiguous op", _contiguous_attend, "contiguous"))


def loop_paths(loop: Loop, device: torch.device, dtype: torch.dtype, compile_step=None) -> dict[str, tuple]:
    """{name: (step, restart)} of ``LOOP_STEPS``, each step one call of its own compiled function (``own_code``:
    one compile each; ``compile_step`` compiles them otherwise, as benchmarks/tools/host_profile.py's Dynamo frame
    alone); the pools' pages each used once, in random order (a fragmented pool), and the contiguous
    caches holding the same keys, so the paged and contiguous loops' outputs agree. A paged step's block table gets
    each sequence's next page on the host when its last one is full; the paged op alone reads a full table (entries
    past a sequence's length are never read)."""
    compile_step = compile_step or (lambda fn: torch.compile(own_code(fn), fullgraph=True))
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    width = -(-(loop.start + loop.steps - 1) // loop.page_size)
    pages = torch.randperm(loop.batch * width, generator=gen, device=device).view(loop.batch, width)
    k_pool, v_pool = (randn(loop.batch * width, loop.page_size, loop.heads_kv, loop.head_dim) for _ in range(2))
    k_cache, v_cache = (x[pages].flatten(1, 2).transpose(1, 2).contiguous() for x in (k_pool, v_pool))
    q = randn(loop.batch, loop.heads_q, loop.head_dim)
    k_new, v_new = (randn(loop.batch, loop.heads_kv, loop.head_dim) for _ in range(2))
    held = -(-(loop.start - 1) // loop.page_size)  # the pages that the keys before the first step fill
    first_table = torch.where(torch.arange(width, device=device) < held, pages, -1).to(torch.int32)
    q4 = q[:, :, None]  # (B, Hq, 1, D): attention's layout

    def path(fn, cache: str) -> tuple:
        compiled = compile_step(fn)
        lens = torch.empty(loop.batch, dtype=torch.int32, device=device)

        def restart_lengths():
            lens.fill_(loop.start - 1)

        if cache == "contiguous":
            return (lambda: compiled(q4, k_new, v_new, k_cache, v_cache, lens)), restart_lengths
        if cache == "paged, full table":
            full_table = pages.to(torch.int32)
            return (lambda: compiled(q, k_new, v_new, k_pool, v_pool, full_table, lens)), restart_lengths
        table, new_key = first_table.clone(), [0]  # new_key: the position of the loop's next key

        def restart():
            restart_lengths()
            table.copy_(first_table)
            new_key[0] = loop.start - 1

        def step():
            if new_key[0] % loop.page_size == 0:  # every sequence's last page is full: each gets its next one
                column = new_key[0] // loop.page_size
                table[:, column] = pages[:, column]
            new_key[0] += 1
            return compiled(q, k_new, v_new, k_pool, v_pool, table, lens)

        return step, restart

    return {name: path(fn, cache) for name, fn, cache in LOOP_STEPS}


class _Since:
    """Dynamo graphs compiled and decisions stored (on a fresh store: tunes) since this was made."""

    def __init__(self):
        from torch._dynamo.utils import counters

        self.stats, self.moment = counters["stats"], time.time()
        self.graphs = self.stats["unique_graphs"]

    def counts(self) -> tuple[int, int]:
        """(compiles, tunes) since."""
        return (self.stats["unique_graphs"] - self.graphs,
                sum(row["created"] >= self.moment for row in get_store().rows()))


def _first_pass(step, restart, steps: int) -> tuple[dict, torch.Tensor]:
    """Every step from the start, the first time: seconds, Dynamo graphs compiled, decisions tuned, the kernels our
    ops ran (``inductor_attn.stats()``); and the last step's output."""
    restart()
    reset_stats()
    since, start = _Since(), time.perf_counter()
    for _ in range(steps):
        out = step()
    sync()
    seconds = time.perf_counter() - start
    compiles, tunes = since.counts()
    return {"first_pass_s": seconds, "compiles": compiles, "tunes": tunes, "kernels": stats()}, out


def run_loop(loop: Loop, device: torch.device, rounds: int) -> dict:
    """One serving loop, paged and contiguous (module doc); any error is recorded (raised under
    INDUCTOR_ATTN_STRICT=1)."""
    row = {"loop": loop.name, "steps": loop.steps, "paths": {}}
    try:
        paths = loop_paths(loop, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
        last = {}
        for name, (step, restart) in paths.items():
            row["paths"][name], last[name] = _first_pass(step, restart, loop.steps)
        row["paged_vs_contiguous_err"] = rel_err(last["paged"], last["contiguous"].squeeze(2))
        row["ops_alone_err"] = rel_err(last["paged op"], last["contiguous op"].squeeze(2))
        since = _Since()
        for name, numbers in interleaved_loops(paths, loop.steps, rounds).items():
            row["paths"][name].update(numbers)
        row["compiles_after_first_pass"], row["tunes_after_first_pass"] = since.counts()
        for name in ("paged", "contiguous"):  # the op alone goes beside its step: one row per decode op
            row["paths"][name]["op_alone"] = row["paths"].pop(f"{name} op")
    except Exception as err:  # noqa: BLE001 - one loop's failure must not lose the suite's other numbers
        if strict():
            raise
        row["error"] = describe(err)
    return row


def serving(smoke: bool, device: torch.device) -> list[dict]:
    """Each serving loop, all on one fresh decision store (runner.fresh_store, which also forgets the decisions
    the shapes' contiguous floors made): their first passes tune."""
    from .runner import fresh_store

    with fresh_store():
        return [run_loop(loop, device, 1 if smoke else LOOP_ROUNDS) for loop in (SMOKE_LOOPS if smoke else LOOPS)]


def run_loops_and_model(smoke: bool, part: str, device: torch.device, save) -> dict:
    """The serving loops (``part`` all or ops) and transformers' continuous batching on our attention against its
    own paged paths (all or models; models.continuous_batching), each passed to ``save`` when it ends."""
    from .models import continuous_batching
    from .wallclock import model_part

    out = {}
    if part in ("all", "ops"):
        out["serving"] = serving(smoke, device)
        save(out)
    if part in ("all", "models"):
        out["continuous_batching"] = model_part(True, lambda: continuous_batching(smoke))
        save(out)
    return out


def table(result: dict) -> str:
    """Markdown: the shapes (:func:`shape_table`), the serving loops and continuous batching."""
    return _sections(shape_table(result), result)


def _sections(shapes: str, result: dict) -> str:
    """The shapes' table ``shapes`` where the result holds shapes (``--part models`` measures none), then the
    serving loops' and continuous batching's tables where it holds them."""
    parts = [shapes] if result["rows"] else []
    if result.get("serving"):
        parts.append(serving_table(result["serving"]))
    if result.get("continuous_batching"):
        parts.append(client_table(result["continuous_batching"]))
    return "\n\n".join(parts)


def serving_table(rows: list[dict]) -> str:
    """Markdown: per serving loop and path, what its first pass ran, compiled and tuned and its seconds, then host,
    wall and loop host us per step, and what the timed passes compiled or tuned (nothing, if the targets hold)."""
    lines = ["| serving loop | decode op | ran | compiles | tunes | first pass s | host us / step | wall us / step | "
             "loop host us / step | the op alone: host / wall us per step | paged vs contiguous, after the first "
             "pass |", "|---" * 11 + "|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['loop']}, {row['steps']} steps | | | | | | | | | | {cell(row['error'])} |")
            continue
        alone = f" (the ops alone {row['ops_alone_err']:.1e})" if "ops_alone_err" in row else ""
        note = (f"rel. err {row['paged_vs_contiguous_err']:.1e}{alone}; {row['compiles_after_first_pass']} compiles, "
                f"{row['tunes_after_first_pass']} tunes")
        for name, p in row["paths"].items():
            ran = ", ".join(f"`{k}`" for k in p.get("kernels", ()))
            op = p.get("op_alone")
            op_text = f"{op['host_us']:.1f} / {op['wall_us']:.1f}" if op else ""
            lines.append(f"| {row['loop']}, {row['steps']} steps | {name} | {ran} | {p['compiles']} | {p['tunes']} | "
                         f"{p['first_pass_s']:.1f} | {p['host_us']:.1f} | {p['wall_us']:.1f} | {p['loop_host_us']:.1f} "
                         f"| {op_text} | {note if name == 'paged' else ''} |")
    return "\n".join(lines)


def client_table(cb: dict) -> str:
    """Markdown: transformers' ``generate_batch`` per attention implementation: what was asked for and what ran,
    new tokens per second against the best of transformers' own paths (for ours, when it took turns with one of
    them in one process, against that one, as the median of the turns' ratios: each turn's two calls meet one speed
    of the host), and greedy tokens against eager ``generate``."""
    if "error" in cb or "skipped" in cb:
        return f"transformers continuous batching: {cb.get('error') or cb['skipped']}"
    from .models import BUILT_IN

    impls = cb["implementations"]
    best = max((r["tokens_per_s"] for n, r in impls.items() if n in BUILT_IN and "tokens_per_s" in r), default=None)
    reference = cb["reference"]
    head = (f"transformers continuous batching (`generate_batch`), {cb['prompts']} prompts of "
            f"{cb['prompt_lengths'][0]}-{cb['prompt_lengths'][-1]} tokens, {cb['new_tokens']} new tokens each, "
            f"greedy; transformers {reference.get('transformers', '?')}"
            + (f"; eager reference: {cell(reference['error'])}" if "error" in reference else ""))
    lines = [head, "", "| attention | asked for | ran | new tokens/s: median (range) of the timed calls "
             "| / best built-in | sequences = eager generate (first difference) | first run s | note |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in impls.items():
        if "tokens_per_s" not in r:
            lines.append(f"| {name} | | | | | | | {cell(r.get('skipped') or r.get('error'))} |")
            continue
        same = ""
        if "identical" in r:
            first = r["first_difference"]
            same = f"{r['identical']}/{r['sequences']}" + ("" if first is None else f" (token {first})")
            if r.get("differ_at_near_tie"):
                same += f"; {r['differ_at_near_tie']} of the others first at a near tie"
        ops = ", ".join(sorted({key.split(" -> ")[0] for key in r.get("kernels") or {}}))
        busy = "device_s" in r and f"GPU busy {r['device_s']:.2f} s of a {statistics.median(r['timed_s']):.2f} s call"
        partner = next((impls[n] for n in r.get("taking_turns", ()) if n in BUILT_IN and "tokens_per_s" in impls[n]),
                       None)
        turns = f"calls taking turns with {', '.join(r['taking_turns'])} (one process)" if r.get("taking_turns") else ""
        if partner and "turns_s" in r and "turns_s" in partner:  # each turn's two calls, the same tokens
            each = sorted(p / o for p, o in zip(partner["turns_s"], r["turns_s"]))
            ratio = f"{statistics.median(each):.2f}"
            turns += f"; / best built-in: the median of {len(each)} turns' ratios ({each[0]:.2f}-{each[-1]:.2f})"
        elif partner:
            ratio = f"{r['tokens_per_s'] / partner['tokens_per_s']:.2f}"
        else:
            ratio = f"{r['tokens_per_s'] / best:.2f}" if best else ""
        cells = [name, _code(r["asked"]), ", ".join(map(_code, r["ran"])), _tokens_per_s_text(r),
                 ratio, same, f"{r['first_run_s']:.1f}",
                 "; ".join(filter(None, [busy, f"our ops: {ops}" if ops else "", turns,
                                         r.get("exit_error") and f"after its result: {cell(r['exit_error'])}"]))]
        lines.append("| " + " | ".join(cells) + " |")
    kernels = [f"- {name}: " + ", ".join(f"`{cell(k[:KERNEL_NAME_CHARS])}` {ms:.0f}" for k, ms in r["top_kernels_ms"])
               for name, r in impls.items() if r.get("top_kernels_ms")]
    if kernels:
        lines += ["", "The kernels that took most of one call's device time, in ms (a profiled call after the timed "
                      "ones):", *kernels]
    if "taking_turns_error" in cb:
        lines += ["", f"- Each ran in a process of its own: {cell(cb['taking_turns_error'])}"]
    if any(r.get("differ_at_near_tie") for r in impls.values()):
        from .models import NEAR_TIE

        lines += ["", f"- A near tie: a step where eager's top two logits lie within {NEAR_TIE} units of the model "
                      "dtype's rounding of each other; a sequence that first differs there picked between tokens "
                      "that eager cannot tell apart at that precision."]
    return "\n".join(lines)


KERNEL_NAME_CHARS = 60  # a kernel's name in the client's kernel list (CUTLASS templates run to hundreds)


def _tokens_per_s_text(r: dict) -> str:
    """Tokens/s of the median timed call, and the range over the timed calls where there were several."""
    seconds = r["timed_s"] if isinstance(r["timed_s"], list) else [r["timed_s"]]
    if len(seconds) == 1:
        return f"{r['tokens_per_s']:.0f}"
    tokens = r["tokens_per_s"] * statistics.median(seconds)
    return f"{r['tokens_per_s']:.0f} ({tokens / max(seconds):.0f}-{tokens / min(seconds):.0f})"


def _code(name: str) -> str:
    return f"`{cell(name)}`"


def shape_table(result: dict) -> str:
    """Markdown: per shape, each candidate's time and GB/s (decode) or TF/s (chunked prefill), its share of the
    copy floor's GB/s, the autotuned one marked; then FA3's default splits (a reference, :data:`FA3_NOTE`), or why
    it was skipped, with our autotuned choice against it."""
    lines = ["| shape | candidate | ms | GB/s or TF/s | of copy | note |", "|---|---|---|---|---|---|"]
    for row in result["rows"]:
        cands = row["candidates"]
        copy_ms = cands.get("copy floor", {}).get("ms")
        copy_gbs = 2 * row["kv_bytes"] / copy_ms / 1e6 if copy_ms else None
        chosen = row.get("autotuned", {}).get("choice")
        for name, c in cands.items():
            ms = c.get("ms")
            if ms is None:
                why = c.get("reason") or c.get("failed")
                lines.append(f"| {row['shape']} | {name} | | | | {c.get('status')}: {why} |")
                continue
            if name == "copy floor":
                lines.append(f"| {row['shape']} | {name} | {ms:.4f} | {copy_gbs:.0f} (read + write) | 1.00 | |")
                continue
            note = "autotuned" if name == chosen else ""
            lines.append(f"| {row['shape']} | {name} | {_timed_cells(row, ms, copy_gbs)} | {note} |")
        if "error" in row.get("autotuned", {}):
            lines.append(f"| {row['shape']} | autotuned | | | | {cell(row['autotuned']['error'])} |")
        if "fa3_default" in row:
            lines.append(_fa3_line(row, copy_gbs))
    return "\n".join(lines)


def _fa3_line(row: dict, copy_gbs: float | None) -> str:
    """shape_table's row of FA3's default splits: skipped, refused or wrong with the reason, or timed with its
    error on the zeroed pool, what the NaN pool did, and our autotuned choice against it."""
    fa3, name = row["fa3_default"], FA3_NAME
    if "skipped" in fa3:
        return f"| {row['shape']} | {name} | | | | skipped: {cell(fa3['skipped'])} |"
    zeroed, nan = fa3["zeroed_pool"], fa3["nan_probe"]
    nan_text = ("NaN probe: " + nan["status"] + (f" ({nan['reason']})" if nan["reason"] else ""))
    if zeroed["status"] != "passed" or fa3.get("ms") is None:
        why = (f"{zeroed['status']} on the zeroed pool: {zeroed['reason']}" if zeroed["status"] != "passed"
               else f"timing failed: {fa3.get('failed')}")
        return f"| {row['shape']} | {name} | | | | {cell(why + '; ' + nan_text)} |"
    ratio = fa3_ratio(row)
    notes = [fa3["note"], f"rel. err {zeroed['error']:.1e} on the zeroed pool", nan_text]
    notes += [f"autotuned / FA3 default: {ratio:.2f}"] if ratio is not None else []
    notes += [fa3["timer_note"]] if fa3.get("timer_note") else []
    return f"| {row['shape']} | {name} | {_timed_cells(row, fa3['ms'], copy_gbs)} | {cell('; '.join(notes))} |"


def _timed_cells(row: dict, ms: float, copy_gbs: float | None) -> str:
    """shape_table's ms, rate and share-of-copy cells of a call of ``ms`` (a share for decode rows only)."""
    prefill = row["shape"].startswith("prefill")
    rate = _rate(row, ms)
    share = "" if prefill or not copy_gbs else f"{rate / copy_gbs:.2f}"
    return f"{ms:.4f} | {rate:.{1 if prefill else 0}f} | {share}"


def _rate(row: dict, ms: float) -> float:
    """GB/s (decode: the keys and values that exist, read once) or TF/s (chunked prefill) of a call of ``ms``."""
    return row["flops"] / ms / 1e9 if row["shape"].startswith("prefill") else row["kv_bytes"] / ms / 1e6


def fa3_ratio(row: dict) -> float | None:
    """Our autotuned choice's speed over FA3's default splits on the row's shape (FA3's time over the choice's, in
    one timing session), or None where either has no time."""
    fa3_ms = row.get("fa3_default", {}).get("ms")
    choice = row.get("autotuned", {}).get("choice")
    ours = row["candidates"].get(choice, {}).get("ms") if choice else None
    return fa3_ms / ours if fa3_ms and ours else None


def bars(result: dict) -> dict | None:
    """The plot of a part (report.py ``_summary_plot``): for the ops part, per shape, our autotuned choice's speed
    over each alternative (the gather-then-SDPA baseline, our contiguous-cache decode, FA3's default splits), in
    one timing session; for the models part, each implementation's new tokens/s in continuous batching."""
    if "continuous_batching" in result:
        impls = {n: r for n, r in (result["continuous_batching"] or {}).get("implementations", {}).items()
                 if "tokens_per_s" in r}
        return {"xlabel": "new tokens/s, continuous batching (longer is faster)", "labels": list(impls),
                "series": {"tokens/s": [r["tokens_per_s"] for r in impls.values()]}} if impls else None
    rows, series = [], {"gather + SDPA": [], "contiguous decode (ours)": [], "FA3 default splits": []}
    for row in result["rows"]:
        choice = row.get("autotuned", {}).get("choice")
        ours = row["candidates"].get(choice, {}).get("ms") if choice else None
        if not ours:
            continue
        rows.append(row["shape"])
        gather = [c["ms"] for n, c in row["candidates"].items() if n.startswith("paged_gather") and c.get("ms")]
        alternatives = (min(gather, default=None), row["candidates"].get("contiguous decode (ours)", {}).get("ms"),
                        row.get("fa3_default", {}).get("ms"))
        for name, ms in zip(series, alternatives):
            series[name].append(ms / ours if ms else None)
    if not rows:
        return None
    return {"xlabel": "autotuned choice's speed over each alternative", "ref": 1.0, "labels": rows, "series": series}


# what each ``--part`` measures, by its results' keys (report.py keeps a section's block per part)
PARTS = {"ops": ("rows", "serving", "not_run"), "models": ("continuous_batching",)}


def summary(result: dict) -> str:
    """Markdown for RESULTS.md: :func:`shape_summary`, the serving loops and continuous batching."""
    return _sections(shape_summary(result), result)


def shape_summary(result: dict) -> str:
    """One line per shape: the fastest candidate and its GB/s (decode) or TF/s (chunked prefill), the autotuned
    choice where it is another (with the two as the tune timed them), the gather-then-SDPA baseline's best, our
    decode over a contiguous copy of the same keys, FA3's default splits (a reference timed on a zeroed pool,
    :data:`FA3_NOTE`) with our autotuned choice against it, and the copy floor's GB/s (read + write); then issue
    54's target over the decode rows of Hkv <= 2 (:func:`fa3_target`)."""
    lines = ["| shape | fastest candidate | its GB/s or TF/s | autotuned, if another | gather + SDPA | contiguous "
             "decode (ours) | fastest / contiguous | FA3 default splits (zeroed pool) | autotuned / FA3 default | "
             "copy floor GB/s |", "|---" * 10 + "|"]
    for row in result["rows"]:
        timed = {n: c["ms"] for n, c in row["candidates"].items() if c.get("ms") is not None}
        floors = {n for n, c in row["candidates"].items() if c.get("status") == "floor"}
        ours = {n: ms for n, ms in timed.items() if n not in floors and not n.startswith("reference")}
        if not ours:
            continue
        best = min(ours, key=ours.get)
        gather = min((ms for n, ms in ours.items() if n.startswith("paged_gather")), default=None)
        contiguous = timed.get("contiguous decode (ours)")
        copy = timed.get("copy floor")
        floor = _num(copy and 2 * row["kv_bytes"] / copy / 1e6) if copy or "copy floor" not in floors else "failed"
        auto = row.get("autotuned", {})
        auto_cell = ("failed" if "error" in auto else "" if auto.get("choice") in (None, best)
                     else f"`{auto['choice']}`{_tuned_text(auto, best)}")
        fa3 = row.get("fa3_default", {})
        fa3_cell = (_num(_rate(row, fa3["ms"])) if fa3.get("ms") else "skipped" if "skipped" in fa3
                    else "" if not fa3 else "failed" if fa3["zeroed_pool"]["status"] == "passed"
                    else fa3["zeroed_pool"]["status"])
        ratio = fa3_ratio(row)
        cells = [row["shape"], f"`{best}`", _num(_rate(row, ours[best])), auto_cell,
                 _num(gather and _rate(row, gather)), _num(contiguous and _rate(row, contiguous)),
                 f"{contiguous / ours[best]:.2f}" if contiguous else "", fa3_cell,
                 "" if ratio is None else f"{ratio:.2f}", floor]
        lines.append("| " + " | ".join(cells) + " |")
    fa3s = [row.get("fa3_default", {}) for row in result["rows"]]
    seen = sorted({fa3["note"] for fa3 in fa3s if "note" in fa3})
    skipped = {fa3["skipped"] for fa3 in fa3s if "skipped" in fa3}  # rows our candidates did not run on too
    notes = [f"{note} (per shape, NaN probe: the gate with every length one key short); its inputs are the "
             "candidates' pages and table, zeros in every slot that holds no key; a reference column (the `fa3` "
             "candidates are our plans of the same kernel)." for note in seen]
    notes += [f"FA3 default splits skipped: {cell(reason)}" for reason in sorted(skipped)]
    target = fa3_target(result["rows"])
    notes += [target] if target else []
    return "\n".join(lines) + "\n\n" + "\n".join(f"- {n}" for n in notes)


def _tuned_text(auto: dict, best: str) -> str:
    """Where the autotuned choice is not the bench's fastest: the two as the tune timed them (us), or that the tune
    timed no such candidate.

    >>> _tuned_text({"choice": "a", "tuned_ms": {"a": 0.025, "b": 0.0281}}, "b")
    '; the tune: 25.0 us against 28.1'
    >>> _tuned_text({"choice": "a", "tuned_ms": {"a": 0.025}}, "b")
    '; the tune did not time b'
    """
    tuned = auto.get("tuned_ms")
    if tuned is None:  # a results file from before the tune's timings were recorded
        return ""
    if best not in tuned or auto["choice"] not in tuned:
        return f"; the tune did not time {best if best not in tuned else auto['choice']}"
    return f"; the tune: {tuned[auto['choice']] * 1e3:.1f} us against {tuned[best] * 1e3:.1f}"


# issue 54: paged decode >= 1.5x FA3's default split heuristic on the few-KV-head shapes, and never below it
TARGET_HEADS_KV, TARGET_RATIO = 2, 1.5


def fa3_target(rows: list[dict]) -> str | None:
    """Issue 54's target over the decode rows with Hkv <= 2: our autotuned choice over FA3's default splits, the
    least and the geometric mean, whether every row is >= 1.5 (and none below 1); None without such rows."""
    few = [r for r in rows if not r["shape"].startswith("prefill") and r.get("heads_kv", 99) <= TARGET_HEADS_KV]
    if not few:
        return None
    ratios = {r["shape"]: fa3_ratio(r) for r in few}
    have = {name: x for name, x in ratios.items() if x is not None}
    head = f"Issue 54's target (Hkv <= {TARGET_HEADS_KV} decode: autotuned >= {TARGET_RATIO}x FA3's default splits"
    head += ", never below 1x)"
    if not have:
        return f"{head}: no row has both numbers ({len(few)} rows)"
    worst = min(have, key=have.get)
    mean = math.exp(sum(math.log(x) for x in have.values()) / len(have))
    met = ("met" if len(have) == len(few) and have[worst] >= TARGET_RATIO
           else "not met" if have[worst] < TARGET_RATIO else "met where measured")
    below = [name for name, x in have.items() if x < 1]
    text = (f"{head}: {met}; least {have[worst]:.2f} ({worst}), geomean {mean:.2f} over {len(have)} of {len(few)} "
            "rows")
    return text + (f"; below FA3 on {', '.join(below)}" if below else "")


def _num(x) -> str:
    return "" if x is None else f"{x:.0f}" if x >= 10 else f"{x:.1f}"
