"""Paged KV caches for tests: a fragmented pool with NaN wherever no key of a sequence lives (unreferenced pages,
slots past a length, a table's tail of -1), and a naive float64 oracle that reads the pages independently of
inductor_attn.backends.pages."""

from __future__ import annotations

import dataclasses
import itertools

import naive
import torch


@dataclasses.dataclass(frozen=True)
class PagedCase:
    kv_lens: tuple[int, ...] = (37, 5)
    q_lens: tuple[int, ...] | None = None  # None: decode, one query per sequence and no cu_seqlens_q
    page_size: int = 16
    hq: int = 4
    hkv: int = 2
    d: int = 32
    dtype: torch.dtype = torch.float16
    causal: bool = True
    window: tuple[int, int] = (-1, -1)
    layout: str = "NHD"
    spare_pages: int = 1  # table entries past the longest sequence's last page (-1, never read)
    width: int | None = None  # pages per table row; None: the longest sequence's pages + spare_pages
    num_blocks: int | None = None  # pages in the pool; None: the sequences' pages + 3 that no row names
    softcap: float = 0.0

    @property
    def max_seqlen_q(self) -> int:
        return 1 if self.q_lens is None else max(self.q_lens)


@dataclasses.dataclass
class PagedInputs:
    q: torch.Tensor
    k_cache: torch.Tensor  # as the user passes it (NHD, or HND memory order)
    v_cache: torch.Tensor
    block_table: torch.Tensor
    kv_seqlens: torch.Tensor
    cu_seqlens_q: torch.Tensor | None

    def kwargs(self, case: PagedCase) -> dict:
        return dict(cu_seqlens_q=self.cu_seqlens_q, max_seqlen_q=case.max_seqlen_q, causal=case.causal,
                    window=case.window if case.window != (-1, -1) else None, layout=case.layout,
                    softcap=case.softcap)


def make(case: PagedCase, device="cpu", seed: int = 0) -> PagedInputs:
    gen = torch.Generator().manual_seed(seed)
    ps = case.page_size
    pages = [-(-n // ps) for n in case.kv_lens]
    width = case.width or max(pages) + case.spare_pages
    num_blocks = case.num_blocks or sum(pages) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.full((len(case.kv_lens), width), -1, dtype=torch.int32)
    used = torch.zeros(num_blocks, ps, dtype=torch.bool)
    for b, (n, count) in enumerate(zip(case.kv_lens, pages)):
        for p in range(count):
            block = order.pop()
            table[b, p] = block
            used[block, : min(ps, n - p * ps)] = True
    shape = (num_blocks, ps, case.hkv, case.d)
    k, v = (torch.randn(shape, generator=gen).masked_fill(~used[:, :, None, None], float("nan")).to(case.dtype)
            for _ in range(2))
    if case.layout == "HND":
        k, v = (x.transpose(1, 2).contiguous() for x in (k, v))
    total_q = len(case.kv_lens) if case.q_lens is None else sum(case.q_lens)
    q = torch.randn(total_q, case.hq, case.d, generator=gen).to(case.dtype)
    cu = None if case.q_lens is None else torch.tensor([0, *itertools.accumulate(case.q_lens)], dtype=torch.int32)
    lens = torch.tensor(case.kv_lens, dtype=torch.int32)
    move = lambda x: None if x is None else x.to(device)  # noqa: E731
    return PagedInputs(move(q), move(k), move(v), move(table), move(lens), move(cu))


def oracle(case: PagedCase, x: PagedInputs, scale: float):
    """float64 (out (total_q, Hq, D), lse (Hq, total_q)): each sequence's keys read page by page in Python."""
    k, v = (c.transpose(1, 2) if case.layout == "HND" else c for c in (x.k_cache, x.v_cache))
    q_lens = case.q_lens or (1,) * len(case.kv_lens)
    outs, lses, start = [], [], 0
    for b, (n, lq) in enumerate(zip(case.kv_lens, q_lens)):
        rows = [(int(x.block_table[b, j // case.page_size]), j % case.page_size) for j in range(n)]
        kb = torch.stack([k[blk, slot] for blk, slot in rows]) if rows else k.new_zeros(0, *k.shape[2:])
        vb = torch.stack([v[blk, slot] for blk, slot in rows]) if rows else v.new_zeros(0, *v.shape[2:])
        qb = x.q[start: start + lq]
        start += lq
        mask = naive.dense_mask(lq, n, case.causal, *case.window)
        out, lse = naive.attend(qb.cpu().transpose(0, 1)[None], kb.cpu().transpose(0, 1)[None],
                                vb.cpu().transpose(0, 1)[None], mask, scale, case.softcap)
        outs.append(torch.nan_to_num(out[0].transpose(0, 1)))  # a row that sees no key: zeros
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)
