"""``bench --suite paged``: attention over a paged KV cache (issue 54), every candidate timed the tuner's way.

Decode rows: GB/s of each candidate (bytes of the keys and values that exist, read once, over its time) against
two floors on the same shape: a copy of those bytes (its GB/s counts the read and the write: what the device's
memory moves) and our own decode over a contiguous cache (``inductor_attn.attention`` with kv_seqlens, decided
as a user's call is). Chunked-prefill rows: TF/s. Pages of a fragmented pool (measure.fresh_inputs: each page
once, in random order), every sequence at the full length. Candidates run the code that ships (their plans,
measure.candidate_trial), timed in interleaved rounds under CUDA graphs (measure.time_trials), after the gate.
"""

from __future__ import annotations

import dataclasses

import torch

from ..backends import enumerate_candidates
from ..backends.pages import gather_padded, key_slots
from ..device import device_info
from ..ops.paged import paged_call
from ..tuning.measure import Direction, Trial, candidate_trial, gate, gate_inputs, time_trials
from ..tuning.stats import median
from ..tuning.timing import default_timer


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
    from .. import api

    def bind(call):
        slots = key_slots(call.block_table, call.kv_seqlens, call.k.shape[1])
        k, v = (gather_padded(x, *slots).transpose(1, 2).contiguous() for x in (call.k, call.v))
        q = call.q.unflatten(0, (call.block_table.shape[0], call.max_seqlen_q)).transpose(1, 2)
        return lambda: api.attention(q, k, v, causal=True, kv_seqlens=call.kv_seqlens, check_indices=False)
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


def table(result: dict) -> str:
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
    """Markdown for RESULTS.md, one line per shape: the fastest candidate and its GB/s (decode) or TF/s (chunked
    prefill), the gather-then-SDPA baseline's best, our decode over a contiguous copy of the same keys, and the
    copy floor's GB/s (read + write)."""
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
