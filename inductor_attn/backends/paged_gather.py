"""Gather, then SDPA: the baseline for paged attention, what transformers' SDPA path does today.

Each sequence's keys are copied out of the pages into a dense (num_seqs, Hkv, capacity, D) cache, right-aligned
(the last key at the last position, as in a left-padded batch) with zeros before them, and SDPA's kernels run
on it through the ``sdpa`` backend's plans, with a key mask that keeps each sequence's own keys. Right-aligned,
the dense call's lower-right causal and window rule is each sequence's own: query i of a sequence of L keys and
Lq queries sees key j <= i + L - Lq, at position j + capacity - L <= i + capacity - Lq. The zeros are written,
never multiplied, so what the pool holds outside the keys (NaN in a fresh server's pages) never reaches SDPA,
whose masked keys still enter P @ V with weight 0.

Queries must be as many in every sequence (decode, or equal chunks): the dense kernels take (num_seqs, Hq, Lq, D).
The dense problem has a key mask, so SDPA runs its memory-efficient or cuDNN kernel with an additive bias.
"""

from __future__ import annotations

import torch

from ..device import DeviceInfo
from ..problem import Problem
from .base import AttnCall, Backend, Candidate, Config, Plan, Takes
from ..layout import conform
from .pages import gather_padded, key_slots
from .sdpa import BACKEND as SDPA, dtype_pruned

KERNELS = ("efficient", "cudnn")


def dense_call(call: AttnCall) -> AttnCall:
    """The paged ``call`` as a dense ``attention`` call over right-aligned gathered keys with a key mask."""
    blocks, slots, exists = key_slots(call.block_table, call.kv_seqlens, call.k.shape[1], right_aligned=True)
    k, v = (gather_padded(x, blocks, slots, exists).transpose(1, 2) for x in (call.k, call.v))
    num_seqs, lq = call.block_table.shape[0], call.max_seqlen_q
    q = call.q.unflatten(0, (num_seqs, lq)).transpose(1, 2)
    return AttnCall("attention", q, k, v, call.scale, call.causal, call.window_left, call.window_right,
                    key_mask=exists)


def as_packed(out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor):
    """A dense call's (out (B, Hq, Lq, Dv), lse (B, Hq, Lq)) in the paged op's layout: (B * Lq, Hq, Dv) in the
    stride order of the packed ``q``, and (Hq, B * Lq) contiguous."""
    b, h, lq, dv = out.shape
    return conform(out.transpose(1, 2).reshape(b * lq, h, dv), q), lse.transpose(0, 1).reshape(h, b * lq)


class PagedGatherBackend(Backend):
    name = "paged_gather"
    takes = Takes(ops=("paged",))
    knobs = {"kernel": KERNELS}

    def supports(self, p: Problem, dev: DeviceInfo, direction: str = "forward") -> str | None:
        if p.device_type != "cuda":
            return "needs a CUDA device (SDPA's kernels)"
        if p.dtype == "float64":
            return "float64 runs on the reference only"
        if not p.equal_chunks:  # not total_q == batch * len_q: a bucket rounds the three apart
            return (f"needs as many queries in every sequence (decode, equal chunks): {p.total_q} tokens in {p.batch} "
                    f"sequences of at most {p.len_q}")
        return None

    def configs(self, p: Problem, dev: DeviceInfo, direction: str = "forward") -> list[Candidate]:
        return [Candidate(self.name, Config.of(kernel=k), dtype_pruned(k, p.dtype)) for k in KERNELS]

    def plan(self, p: Problem, dev: DeviceInfo, cfg: Config, direction: str) -> Plan:
        sdpa_cfg = Config.of(kernel=cfg["kernel"])
        # SDPA's plan of the dense call, by pages per sequence: the one size of it that p leaves open. Looked up
        # once, not per launch (a Problem built and hashed per call)
        dense_plans = {}

        def launch(call: AttnCall):
            dense = dense_call(call)
            width = call.block_table.shape[1]
            found = dense_plans.get(width)
            if found is None:
                found = dense_plans[width] = SDPA.plan(dense.problem, dev, sdpa_cfg, "forward")
            return as_packed(*found.launch(dense), call.q)

        return Plan(launch)


BACKEND = PagedGatherBackend()
