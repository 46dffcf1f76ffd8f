"""Reference backend: chunked PyTorch math on any device. The correctness oracle and the CPU default.

Queries are processed in chunks so memory stays O(chunk x Lk) per head; scores accumulate in float32
(float64 inputs stay float64). GQA is computed by viewing q as (B, Hkv, G, Lq, D) against k/v heads,
never by copying k/v. Every mask is a function ``rows(start, end) -> bool`` over the chunk's scores, so
forward and backward share one loop for dense, varlen and block-sparse problems.
"""

from __future__ import annotations

import torch

from ..device import DeviceInfo
from ..layout import conform
from ..problem import Problem
from .base import AttnCall, Backend, Config, Plan, Takes
from .masks import MaskFn, dense_mask_fn
from .pages import gather_packed, key_slots, query_starts

# Bytes of float32 scores one chunk may hold (chunk x Lk x B x Hq x 4).
_CHUNK_BYTES = 1 << 28


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunk_rows(q: torch.Tensor, len_k: int, align: int = 1) -> int:
    per_row = 4 * q.shape[0] * q.shape[1] * max(len_k, 1)
    rows = max(align, (_CHUNK_BYTES // per_row) // align * align)
    return min(rows, -(-q.shape[2] // align) * align)


def block_sparse_mask_fn(call: AttnCall) -> MaskFn:
    sparse, hkv = call.sparse, call.k.shape[1]
    bq, len_k = sparse.block_q, call.k.shape[2]

    def rows(start: int, end: int) -> torch.Tensor:
        blocks = [sparse.block_rows(m) for m in range(start // bq, -(-end // bq))]
        mask = torch.cat(blocks, dim=2)[:, :, : end - start, :len_k]
        b, h = mask.shape[:2]
        # mask heads are query heads (or 1): regroup as (B', Hkv, G, rows, Lk) like q
        return mask.view(b, hkv, h // hkv, *mask.shape[2:]) if h > 1 else mask[:, :, None]

    return rows


def _grouped_matmul(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(B, Hkv, G, R, N) ``x`` @ (B, Hkv, N, M) ``y`` -> (B, Hkv, G, R, M): one matmul of G * R rows per kv head.
    ``torch.matmul(x, y[:, :, None])`` broadcasts y over G by copying it G times (27x the time of this at
    decode, B4 Hq32 Hkv8 Lk4096 D128 on a CPU)."""
    b, h, g, r, n = x.shape
    return torch.matmul(x.reshape(b, h, g * r, n), y).unflatten(2, (g, r))


def _keys(x: torch.Tensor, acc: torch.dtype, lengths: torch.Tensor | None) -> torch.Tensor:
    """(B, Hkv, Lk, D) ``x`` in the accumulation dtype, zeros at and past ``lengths[b]`` (kv_seqlens). The mask
    gives those keys a weight of 0, but 0 times what they hold is NaN where they hold NaN (an unwritten cache
    slot): in P @ V and dS @ K, and in dP = dO @ V^T, which dS multiplies by P. The zeros go into the
    conversion's copy where there is one: one pass over the keys, not two."""
    converted = x.to(acc)
    if lengths is None:
        return converted
    past = (torch.arange(x.shape[2], device=x.device) >= lengths[:, None])[:, None, :, None]
    return converted.masked_fill(past, 0) if converted is x else converted.masked_fill_(past, 0)


def _scores(qc, k, scale, mask, softcap: float = 0.0):
    s = _grouped_matmul(qc, k.transpose(-1, -2)) * scale
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def forward(q, k, v, scale: float, mask_fn: MaskFn | None, align: int = 1, lengths: torch.Tensor | None = None,
            softcap: float = 0.0):
    """(B, H, Lq, D) attention; returns out (q.dtype) and lse (float32, -inf on fully masked rows). What keys at
    and past ``lengths[b]`` hold (kv_seqlens, which ``mask_fn`` masks) never reaches them (:func:`_keys`).
    ``softcap`` > 0: scores softcapped (AttnCall.softcap; forward only, as the paged op that takes one)."""
    acc = _acc_dtype(q.dtype)
    b, hq, lq, _ = q.shape
    hkv, lk, dv = k.shape[1], k.shape[2], v.shape[-1]
    qg = q.to(acc).reshape(b, hkv, hq // hkv, lq, q.shape[-1])
    # keys past the lengths need no zeros here: their scores are masked to -inf before anything reads them
    kf, vf = k.to(acc), _keys(v, acc, lengths)
    # written through grouped views, returned as the tensors themselves: an output that is a view of a buffer
    # reads to autograd as one of several views of it (in-place ops and detach_() on it would be refused)
    out_bhld = torch.empty(b, hq, lq, dv, dtype=acc, device=q.device)
    lse_bhl = torch.empty(b, hq, lq, dtype=acc, device=q.device)
    out, lse = out_bhld.view(b, hkv, hq // hkv, lq, dv), lse_bhl.view(b, hkv, hq // hkv, lq)
    step = _chunk_rows(q, lk, align)
    for s in range(0, lq, step):
        e = min(lq, s + step)
        scores = _scores(qg[:, :, :, s:e], kf, scale, mask_fn(s, e) if mask_fn else None, softcap)
        m = scores.amax(-1, keepdim=True)
        m = torch.where(torch.isinf(m), 0.0, m)
        p = torch.exp(scores - m)
        denom = p.sum(-1, keepdim=True)
        out[:, :, :, s:e] = _grouped_matmul(p, vf) / torch.where(denom == 0, 1.0, denom)
        lse[:, :, :, s:e] = (m + torch.log(denom)).squeeze(-1)
    return out_bhld.to(q.dtype), lse_bhl.to(torch.float32)


def backward(q, k, v, out, lse, grad_out, grad_lse, scale: float, mask_fn: MaskFn | None, align: int = 1,
             lengths: torch.Tensor | None = None):
    """Gradients of :func:`forward` w.r.t. q, k, v given d(out) and d(lse) (either may be None); what keys at and
    past ``lengths[b]`` hold never reaches them, and those keys get zero gradients."""
    acc = _acc_dtype(q.dtype)
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    g = hq // hkv
    qg = q.to(acc).reshape(b, hkv, g, lq, d)
    kf, vf = _keys(k, acc, lengths), _keys(v, acc, lengths)
    do = (torch.zeros_like(out, dtype=acc) if grad_out is None else grad_out.to(acc)).reshape(b, hkv, g, lq, -1)
    dl = None if grad_lse is None else grad_lse.to(acc).reshape(b, hkv, g, lq)
    delta = (do * out.to(acc).reshape(do.shape)).sum(-1)
    lse_g = lse.to(acc).reshape(b, hkv, g, lq)
    dq = torch.empty_like(qg)
    dk = torch.zeros(b, hkv, lk, d, dtype=acc, device=q.device)
    dv = torch.zeros_like(vf)
    step = _chunk_rows(q, lk, align)
    for s in range(0, lq, step):
        e = min(lq, s + step)
        qc = qg[:, :, :, s:e]
        scores = _scores(qc, kf, scale, mask_fn(s, e) if mask_fn else None)
        row_lse = lse_g[:, :, :, s:e, None]
        if acc == torch.float64:
            # the saved lse is float32 (the ops' contract): p = exp(s - lse) from it is off by ~1e-7, so
            # float64 gradients recompute lse from the float64 scores to stay exact
            row_lse = torch.logsumexp(scores, -1, keepdim=True)
        p = torch.where(torch.isinf(row_lse), 0.0, torch.exp(scores - row_lse))
        doc = do[:, :, :, s:e]
        dv += torch.einsum("bhgqk,bhgqd->bhkd", p, doc)
        dp = _grouped_matmul(doc, vf.transpose(-1, -2))
        shift = delta[:, :, :, s:e, None]
        if dl is not None:
            shift = shift - dl[:, :, :, s:e, None]
        ds = p * (dp - shift)
        dq[:, :, :, s:e] = _grouped_matmul(ds, kf) * scale
        dk += torch.einsum("bhgqk,bhgqd->bhkd", ds, qc) * scale
    return dq.reshape(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _varlen_sequences(call: AttnCall):
    """Yield (q slice, k slice, per-sequence mask fn) views in (1, H, L, D) layout for each sequence."""
    cq, ck = call.cu_seqlens_q.tolist(), call.cu_seqlens_k.tolist()
    for i in range(len(cq) - 1):
        (q0, q1), (k0, k1) = (cq[i], cq[i + 1]), (ck[i], ck[i + 1])
        mask = dense_mask_fn(q1 - q0, k1 - k0, call.causal, call.window_left, call.window_right, None,
                             call.q.device)
        yield (q0, q1), (k0, k1), mask


def _bhld(x: torch.Tensor, start: int, end: int) -> torch.Tensor:
    return x[start:end].transpose(0, 1).unsqueeze(0)


def _mask(call: AttnCall):
    if call.op == "block_sparse":
        return block_sparse_mask_fn(call), call.sparse.block_q
    return dense_mask_fn(call.q.shape[2], call.k.shape[2], call.causal, call.window_left, call.window_right,
                         call.kv_seqlens, call.q.device, call.key_mask), 1


def dequantised(call: AttnCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An fp8 call's q, k, v in float32 times their descales ((B, Hkv): q head h takes its kv head's, h // G, as
    FA3 reads ``q_descale``). Exact: an e4m3 value times a float32 descale rounds once, to float32's 24 bits."""
    b, hkv = call.k.shape[:2]
    groups = call.q.shape[1] // hkv
    q_d, k_d, v_d = (d.expand(b, hkv).float()[:, :, None, None] for d in call.descale)
    q = call.q.float() * q_d.repeat_interleave(groups, dim=1)
    return q, call.k.float() * k_d, call.v.float() * v_d


def _paged_as_varlen(call: AttnCall) -> AttnCall:
    """A paged call as varlen attention over the keys that exist, gathered out of the pages: what the pool holds
    anywhere else (unreferenced pages, slots past a length) is never read."""
    blocks, slots, exists = key_slots(call.block_table, call.kv_seqlens, call.k.shape[1])
    k, v = (gather_packed(x, blocks, slots, exists) for x in (call.k, call.v))
    lengths = call.kv_seqlens.to(torch.int32)
    cu_k = torch.cat([lengths.new_zeros(1), lengths.cumsum(0, dtype=torch.int32)])
    cu_q = query_starts(call.cu_seqlens_q, call.block_table.shape[0], call.q.device)
    return AttnCall("varlen", call.q, k, v, call.scale, call.causal, call.window_left, call.window_right,
                    cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=call.max_seqlen_q,
                    max_seqlen_k=call.max_seqlen_k, softcap=call.softcap)


def run_forward(call: AttnCall):
    """(out, lse) of any call, out in q's stride order (the ops' layout contract). fp8 calls run on their
    dequantised inputs (:func:`dequantised`) in float32, and the output is converted to ``call.out_dtype``."""
    if call.op == "paged":
        call = _paged_as_varlen(call)
    if call.op != "varlen":
        q, k, v = (call.q, call.k, call.v) if call.descale is None else dequantised(call)
        mask, align = _mask(call)
        out, lse = forward(q, k, v, call.scale, mask, align, call.kv_seqlens, call.softcap)
        return conform(out if call.descale is None else out.to(call.out_dtype), call.q), lse
    q, v = call.q, call.v
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    for (q0, q1), (k0, k1), mask in _varlen_sequences(call):
        if q1 == q0 or k1 == k0:
            continue
        o, l = forward(_bhld(q, q0, q1), _bhld(call.k, k0, k1), _bhld(v, k0, k1), call.scale, mask,
                       softcap=call.softcap)
        out[q0:q1] = o[0].transpose(0, 1)
        lse[:, q0:q1] = l[0]
    return conform(out, q), lse


def run_backward(call: AttnCall, out, lse, grad_out, grad_lse):
    """(dq, dk, dv) of any call, each in its input's stride order."""
    if call.op != "varlen":
        mask, align = _mask(call)
        grads = backward(call.q, call.k, call.v, out, lse, grad_out, grad_lse, call.scale, mask, align,
                         call.kv_seqlens)
        return tuple(conform(g, x) for g, x in zip(grads, (call.q, call.k, call.v)))
    dq, dk, dv = (torch.zeros_like(x) for x in (call.q, call.k, call.v))
    for (q0, q1), (k0, k1), mask in _varlen_sequences(call):
        if q1 == q0 or k1 == k0:
            continue
        go = None if grad_out is None else _bhld(grad_out, q0, q1)
        gl = None if grad_lse is None else grad_lse[None, :, q0:q1]
        grads = backward(_bhld(call.q, q0, q1), _bhld(call.k, k0, k1), _bhld(call.v, k0, k1),
                         _bhld(out, q0, q1), lse[None, :, q0:q1], go, gl, call.scale, mask)
        for full, part, (a, z) in zip((dq, dk, dv), grads, ((q0, q1), (k0, k1), (k0, k1))):
            full[a:z] = part[0].transpose(0, 1)
    return dq, dk, dv


class ReferenceBackend(Backend):
    """Always runs. Not traced into compiled graphs: varlen reads cu_seqlens on the host, and compiled
    code must give the same numbers as eager, which Inductor's fusion of this math would not."""

    name = "reference"
    takes = Takes(ops=("attention", "varlen", "block_sparse", "paged"), key_mask=True, fp8=True, backward=True,
                  softcap=True)

    def supports(self, p: Problem, dev: DeviceInfo, direction: str = "forward") -> str | None:
        return None

    def plan(self, p: Problem, dev: DeviceInfo, cfg: Config, direction: str) -> Plan:
        return Plan(run_forward if direction == "forward" else run_backward)


BACKEND = ReferenceBackend()
