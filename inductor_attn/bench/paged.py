"""``bench --suite paged``: attention over a paged KV cache (issue 54), every candidate timed the tuner's way.

Decode rows: GB/s of each candidate (bytes of the keys and values that exist, read once, over its time) against
two floors on the same shape: a copy of those bytes (its GB/s counts the read and the write: what the device's
memory moves) and our own decode over a contiguous cache (``inductor_attn.attention`` with kv_seqlens, decided
as a user's call is). Chunked-prefill rows: TF/s. Pages of a fragmented pool (measure.fresh_inputs: each page
once, in random order), every sequence at the full length. Candidates run the code that ships (their plans,
measure.candidate_trial), timed in interleaved rounds under CUDA graphs (measure.time_trials), after the gate.

Serving loops (issue 54's "compiles once, tunes each bucket once, adds no host time per step over the contiguous
decode op"): ``steps`` decode steps of a ``torch.compile``d function calling ``inductor_attn.paged_attention``, the
sequences one key longer each step (the new key written into its slot in the compiled step; the block table, sized
for the last step so shapes stay static, gets each sequence's next page on the host when its last one is full),
against the same loop with the contiguous-cache decode op (``inductor_attn.attention`` with ``kv_seqlens``) over the
same keys. On a fresh decision store: the first pass's compiles (Dynamo graphs) and tunes (decisions it stored);
then, the two loops taking turns (wallclock.interleaved_loops), host us per step (this thread's CPU time, steps in
bursts) and wall us per step (a plain run of every step). A compile or tune after the first pass is recorded.

transformers' continuous batching (models.continuous_batching): ``generate_batch``'s tokens/s with our attention
(hf_paged.py) against transformers' own paged paths, and their greedy tokens against eager ``generate``.
``--part ops`` runs the shapes and the serving loops, ``--part models`` the continuous batching; with ``--shard``,
the loops and the model run in the first shard.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from ..api import attention, paged_attention
from ..backends import enumerate_candidates
from ..backends.pages import gather_padded, key_slots
from ..device import device_info
from ..hf_paged import _append
from ..ops.paged import paged_call
from ..store.db import get_store
from ..tuning.measure import (Direction, Trial, candidate_trial, describe, gate, gate_inputs, strict, sync,
                              time_trials)
from ..tuning.stats import median
from ..tuning.timing import default_timer
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
            for hq, hkv, d in ((32, 8, 128), (16, 2, 256)):
                for length in (1024, 16384):
                    representative = length == 16384 and (batch, hkv) in ((1, 2), (8, 8))
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
        return lambda: dst.copy_(src)
    return Trial("copy floor", bind, lambda err: isinstance(err, RuntimeError), ours=False)


def _contiguous_trial() -> Trial:
    """Our decode over the same keys in a contiguous (B, Hkv, L, D) cache, decided as a user's call is."""
    def bind(call):
        slots = key_slots(call.block_table, call.kv_seqlens, call.k.shape[1])
        k, v = (gather_padded(x, *slots).transpose(1, 2).contiguous() for x in (call.k, call.v))
        q = call.q.unflatten(0, (call.block_table.shape[0], call.max_seqlen_q)).transpose(1, 2)
        return lambda: attention(q, k, v, causal=True, kv_seqlens=call.kv_seqlens, check_indices=False)
    return Trial("contiguous decode (ours)", bind, lambda err: isinstance(err, RuntimeError), ours=False)


def run_shape(s: Shape, device: torch.device, rounds: int) -> dict:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    call = gate_inputs(_call(s, device, dtype), seed=1)
    direction = Direction("forward", call)
    expected = direction.reference(call)
    kv_bytes = 2 * s.batch * s.len_k * s.heads_kv * s.head_dim * call.k.element_size()
    trials, row = [], {"shape": s.name, "kv_bytes": kv_bytes, "flops": call.problem.flops(), "candidates": {}}
    for cand in enumerate_candidates(call.problem, device_info(device)):
        if cand.pruned is not None:
            continue
        trial = candidate_trial(cand.name, direction)
        result = gate(trial, call, expected, lambda got: direction.check(got, expected, dtype))
        row["candidates"][cand.name] = {"status": result.status, "reason": result.reason}
        if result.status == "passed":
            trials.append(trial)
    floors = [_copy_trial(), _contiguous_trial()]
    timed = time_trials(trials + floors, call, default_timer(device.type), rounds)
    for trial, t in zip(trials + floors, timed):
        ms = median(t.samples) if t.samples else None
        row["candidates"].setdefault(trial.name, {"status": "floor"}).update(ms=ms, failed=t.failed)
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
LOOP_ROUNDS = 3


def _paged_step(q, k_new, v_new, k_pool, v_pool, block_table, lens):
    """One decode step over a paged cache, as compiled: every sequence one key longer, its key and value written
    into their slot (hf_paged's append), then attention over the pages."""
    lens += 1
    _append(k_pool, v_pool, block_table, lens, k_new, v_new)
    return paged_attention(q, k_pool, v_pool, block_table, lens)


def _contiguous_step(q, k_new, v_new, k_cache, v_cache, lens):
    """The same step over a contiguous (B, Hkv, L, D) cache: the contiguous decode op."""
    lens += 1
    rows = torch.arange(lens.shape[0], device=lens.device)
    positions = lens.long() - 1
    k_cache[rows, :, positions] = k_new
    v_cache[rows, :, positions] = v_new
    return attention(q, k_cache, v_cache, kv_seqlens=lens)


def loop_paths(loop: Loop, device: torch.device, dtype: torch.dtype) -> dict[str, tuple]:
    """{"paged": (step, restart), "contiguous": (step, restart)}: each step one call of its own compiled function
    (``own_code``: one compile each); the pools' pages each used once, in random order (a fragmented pool), and
    the contiguous caches holding the same keys, so both loops' outputs agree."""
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
    table = first_table.clone()
    lens = {name: torch.empty(loop.batch, dtype=torch.int32, device=device) for name in ("paged", "contiguous")}
    paged = torch.compile(own_code(_paged_step), fullgraph=True)
    contiguous = torch.compile(own_code(_contiguous_step), fullgraph=True)
    new_key = [0]  # the position of the paged loop's next key

    def restart_paged():
        lens["paged"].fill_(loop.start - 1)
        table.copy_(first_table)
        new_key[0] = loop.start - 1

    def paged_step():
        if new_key[0] % loop.page_size == 0:  # every sequence's last page is full: each gets its next one
            column = new_key[0] // loop.page_size
            table[:, column] = pages[:, column]
        new_key[0] += 1
        return paged(q, k_new, v_new, k_pool, v_pool, table, lens["paged"])

    q4 = q[:, :, None]  # (B, Hq, 1, D): attention's layout
    return {"paged": (paged_step, restart_paged),
            "contiguous": (lambda: contiguous(q4, k_new, v_new, k_cache, v_cache, lens["contiguous"]),
                           lambda: lens["contiguous"].fill_(loop.start - 1))}


def _decisions_since(moment: float) -> int:
    """Decisions stored since ``moment`` (time.time()): on a fresh store, the tunes since then."""
    return sum(row["created"] >= moment for row in get_store().rows())


def _first_pass(step, restart, steps: int) -> tuple[dict, torch.Tensor]:
    """Every step from the start, the first time: seconds, Dynamo graphs compiled, decisions tuned; and the last
    step's output."""
    from torch._dynamo.utils import counters

    restart()
    graphs, moment, start = counters["stats"]["unique_graphs"], time.time(), time.perf_counter()
    for _ in range(steps):
        out = step()
    sync()
    return {"first_pass_s": time.perf_counter() - start, "compiles": counters["stats"]["unique_graphs"] - graphs,
            "tunes": _decisions_since(moment)}, out


def run_loop(loop: Loop, device: torch.device, rounds: int) -> dict:
    """One serving loop, paged and contiguous (module doc); any error is recorded (raised under
    INDUCTOR_ATTN_STRICT=1)."""
    from torch._dynamo.utils import counters

    row = {"loop": loop.name, "steps": loop.steps, "paths": {}}
    try:
        paths = loop_paths(loop, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
        last = {}
        for name, (step, restart) in paths.items():
            row["paths"][name], last[name] = _first_pass(step, restart, loop.steps)
        paged, contiguous = last["paged"].float(), last["contiguous"].float().squeeze(2)
        row["paged_vs_contiguous_err"] = ((paged - contiguous).norm() / contiguous.norm()).item()
        graphs, moment = counters["stats"]["unique_graphs"], time.time()
        for name, numbers in interleaved_loops(paths, loop.steps, rounds).items():
            row["paths"][name].update(numbers)
        row["compiles_after_first_pass"] = counters["stats"]["unique_graphs"] - graphs
        row["tunes_after_first_pass"] = _decisions_since(moment)
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
    """Markdown: per serving loop and path, the first pass's compiles, tunes and seconds, then host, wall and loop
    host us per step, and what the timed passes compiled or tuned (nothing, if the targets hold)."""
    lines = ["| serving loop | decode op | compiles | tunes | first pass s | host us / step | wall us / step | "
             "loop host us / step | paged vs contiguous, after the first pass |", "|---" * 9 + "|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['loop']}, {row['steps']} steps | | | | | | | | {_cell(row['error'])} |")
            continue
        note = (f"rel. err {row['paged_vs_contiguous_err']:.1e}; {row['compiles_after_first_pass']} compiles, "
                f"{row['tunes_after_first_pass']} tunes")
        for name, p in row["paths"].items():
            lines.append(f"| {row['loop']}, {row['steps']} steps | {name} | {p['compiles']} | {p['tunes']} | "
                         f"{p['first_pass_s']:.1f} | {p['host_us']:.1f} | {p['wall_us']:.1f} | {p['loop_host_us']:.1f} "
                         f"| {note if name == 'paged' else ''} |")
    return "\n".join(lines)


def client_table(cb: dict) -> str:
    """Markdown: transformers' ``generate_batch`` per attention implementation: what was asked for and what ran,
    new tokens per second against the best of transformers' own paths, and greedy tokens against eager
    ``generate``."""
    if "error" in cb or "skipped" in cb:
        return f"transformers continuous batching: {cb.get('error') or cb['skipped']}"
    from .models import BUILT_IN

    impls = cb["implementations"]
    best = max((r["tokens_per_s"] for n, r in impls.items() if n in BUILT_IN and "tokens_per_s" in r), default=None)
    reference = cb["reference"]
    head = (f"transformers continuous batching (`generate_batch`), {cb['prompts']} prompts of "
            f"{cb['prompt_lengths'][0]}-{cb['prompt_lengths'][-1]} tokens, {cb['new_tokens']} new tokens each, "
            f"greedy; transformers {reference.get('transformers', '?')}"
            + (f"; eager reference: {_cell(reference['error'])}" if "error" in reference else ""))
    lines = [head, "", "| attention | asked for | ran | new tokens/s | / best built-in | sequences = eager generate "
             "(first difference) | first run s | note |", "|---|---|---|---|---|---|---|---|"]
    for name, r in impls.items():
        if "tokens_per_s" not in r:
            lines.append(f"| {name} | | | | | | | {_cell(r.get('skipped') or r.get('error'))} |")
            continue
        same = ""
        if "identical" in r:
            first = r["first_difference"]
            same = f"{r['identical']}/{r['sequences']}" + ("" if first is None else f" (token {first})")
        ops = ", ".join(sorted({key.split(" -> ")[0] for key in r.get("kernels") or {}}))
        cells = [name, _code(r["asked"]), ", ".join(map(_code, r["ran"])), f"{r['tokens_per_s']:.0f}",
                 f"{r['tokens_per_s'] / best:.2f}" if best else "", same, f"{r['first_run_s']:.1f}",
                 f"our ops: {ops}" if ops else ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(text: str) -> str:
    """``text`` for a markdown table cell: its pipes ("paged|sdpa", in names and in errors that quote them) escaped,
    or they would split the cell."""
    return text.replace("|", "\\|")


def _code(name: str) -> str:
    return f"`{_cell(name)}`"


def shape_table(result: dict) -> str:
    """Markdown: per shape, each candidate's time and GB/s (decode) or TF/s (chunked prefill), its share of the
    copy floor's GB/s, and the best candidate against our contiguous decode."""
    lines = ["| shape | candidate | ms | GB/s or TF/s | of copy | note |", "|---|---|---|---|---|---|"]
    for row in result["rows"]:
        cands = row["candidates"]
        copy_ms = cands.get("copy floor", {}).get("ms")
        copy_gbs = 2 * row["kv_bytes"] / copy_ms / 1e6 if copy_ms else None
        prefill = row["shape"].startswith("prefill")
        for name, c in cands.items():
            ms = c.get("ms")
            if ms is None:
                why = c.get("reason") or c.get("failed")
                lines.append(f"| {row['shape']} | {name} | | | | {c.get('status')}: {why} |")
                continue
            if name == "copy floor":
                lines.append(f"| {row['shape']} | {name} | {ms:.4f} | {copy_gbs:.0f} (read + write) | 1.00 | |")
                continue
            rate = row["flops"] / ms / 1e9 if prefill else row["kv_bytes"] / ms / 1e6
            share = "" if prefill or not copy_gbs else f"{rate / copy_gbs:.2f}"
            lines.append(f"| {row['shape']} | {name} | {ms:.4f} | {rate:.{1 if prefill else 0}f} | {share} | |")
    return "\n".join(lines)


def summary(result: dict) -> str:
    """Markdown for RESULTS.md: :func:`shape_summary`, the serving loops and continuous batching."""
    return _sections(shape_summary(result), result)


def shape_summary(result: dict) -> str:
    """One line per shape: the fastest candidate and its GB/s (decode) or TF/s (chunked prefill), the
    gather-then-SDPA baseline's best, our decode over a contiguous copy of the same keys, and the copy floor's
    GB/s (read + write)."""
    lines = ["| shape | fastest candidate | its GB/s or TF/s | gather + SDPA | contiguous decode (ours) | fastest / "
             "contiguous | copy floor GB/s |", "|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        prefill = row["shape"].startswith("prefill")

        def rate(ms):
            return None if ms is None else row["flops"] / ms / 1e9 if prefill else row["kv_bytes"] / ms / 1e6

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
        cells = [row["shape"], f"`{best}`", _num(rate(ours[best])), _num(rate(gather)), _num(rate(contiguous)),
                 f"{contiguous / ours[best]:.2f}" if contiguous else "", floor]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _num(x) -> str:
    return "" if x is None else f"{x:.0f}" if x >= 10 else f"{x:.1f}"
