"""``inductor_attn::paged_attention``: attention over a KV cache kept in pages, for serving.

Forward only: serving runs no backward, and no candidate has one (the public function refuses inputs that
require grad). The layout is vLLM's and FlashAttention's: queries packed (total_q, Hq, D) by ``cu_seqlens_q``
(None: one query per sequence, decode), pools ``k_cache``/``v_cache`` (num_blocks, page_size, Hkv, D) with any
strides (FlashInfer's HND pools arrive as transposed views), ``block_table`` int32 (num_seqs, pages per
sequence), ``kv_seqlens`` int32 (num_seqs,). Returns ``(out, lse)``: out (total_q, Hq, Dv) in q's stride order,
lse float32 (Hq, total_q) as varlen's. ``softcap`` > 0: a logit softcap (0: none). ``choice`` as for the other
ops (ops/attention.py). Compiled code with static shapes decides while compiling and replaces this op call by the
chosen plan (lowering/emit.py); with dynamic shapes it keeps the call and decides at run time, per bucket (choice
``CHECKED``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import runtime
from ..backends import AttnCall
from ..layout import new_outputs
from ..runtime import CHECKED
from . import checks
from .attention import LIB, _on_trace


def paged_call(q, k_cache, v_cache, block_table, kv_seqlens, cu_seqlens_q, max_seqlen_q, max_seqlen_k, scale,
               causal, window_left, window_right, softcap=0.0) -> AttnCall:
    """The call; ``max_seqlen_q``, a bound on any sequence's queries, clamped to the step's query tokens (no
    sequence has more), so that the kernels and the problem see the longest run the step can hold."""
    return AttnCall("paged", q, k_cache, v_cache, scale, causal, window_left, window_right, kv_seqlens,
                    cu_seqlens_q=cu_seqlens_q, max_seqlen_q=min(max_seqlen_q, q.shape[0]), max_seqlen_k=max_seqlen_k,
                    block_table=block_table, softcap=float(softcap))


@torch.library.custom_op(f"{LIB}::paged_attention", mutates_args=())
def paged_attention_op(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, kv_seqlens: Tensor,
                       cu_seqlens_q: Tensor | None, max_seqlen_q: int, max_seqlen_k: int, scale: float, causal: bool,
                       window_left: int, window_right: int, softcap: float, choice: str) -> tuple[Tensor, Tensor]:
    args = (q, k_cache, v_cache, block_table, kv_seqlens, cu_seqlens_q, max_seqlen_q, max_seqlen_k, scale, causal,
            window_left, window_right, softcap)
    if choice != CHECKED:
        checks.check_paged(*args[:9], window_left, window_right, softcap)
    return runtime.forward(paged_call(*args), choice)


@paged_attention_op.register_fake
def _(q, k_cache, v_cache, block_table, kv_seqlens, cu_seqlens_q, max_seqlen_q, max_seqlen_k, scale, causal,
      window_left, window_right, softcap, choice):
    checks.check_paged(q, k_cache, v_cache, block_table, kv_seqlens, cu_seqlens_q, max_seqlen_q, max_seqlen_k, scale,
                       window_left, window_right, softcap)
    _on_trace()
    return new_outputs("paged", q, v_cache)
