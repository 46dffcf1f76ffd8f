"""transformers' continuous batching on inductor_attn: an ``attn_implementation`` for ``generate_batch``.

``use(model)`` registers :func:`attention` with transformers' ``AttentionInterface`` under
``"inductor_attn_flash"`` and makes it the model's attention; then ``model.generate_batch(...)`` runs on it.
An attention function, not the routing pass (``enable()``), because continuous batching never calls
F.scaled_dot_product_attention with what a paged kernel needs: it passes packed queries, ``cu_seq_lens_q/k``
and, on its decode fast path, the block table and the page pools, to the attention function only.

Why "flash" in the name: transformers 5.24's continuous batching accepts ``"paged|eager"``, ``"sdpa"`` and
names containing "flash" (``switch_to_cb_friendly_attn``), and for "flash" names builds no attention mask
(``is_flash_attention_requested``): packed varlen inputs, which is what the ops take. But
``set_attn_implementation`` (and ``from_pretrained(attn_implementation=...)``) takes a "flash" name that is not
``flash_attention_N`` for a kernel of the Hugging Face hub and tries to download it, so :func:`use` sets the
config's ``_attn_implementation`` itself. Two calls reach the function:

- prefill and mixed batches: transformers has written the new keys into its pages and gathered each sequence's
  keys (its ``read_index``) into packed (1, Hkv, total_k, D) tensors: :func:`inductor_attn.varlen_attention`;
- decode batches on its fast path (``block_table`` given): the new tokens' keys and values, the pools
  ``k_cache``/``v_cache`` (num_pages, page_size, Hkv, D) and the table. The new keys are written into their
  slots, then :func:`inductor_attn.paged_attention` reads the pages. transformers turns this path on only for
  ``flash_attention_2``/``_3`` on CUDA or XPU (``ensure_decode_fast_path_is_available``), so for other names it
  runs only where a caller turns it on.
"""

from __future__ import annotations

import torch

NAME = "inductor_attn_flash"


def register(name: str = NAME) -> str:
    """Register :func:`attention` with transformers under ``name`` (it must contain "flash", see above)."""
    from transformers import AttentionInterface

    if "flash" not in name:
        raise ValueError(f"name must contain 'flash' (transformers' continuous batching takes no other custom "
                         f"attention), got {name!r}")
    AttentionInterface.register(name, attention)
    return name


def use(model, name: str = NAME):
    """Register :func:`attention` under ``name`` and make it ``model``'s attention implementation (see above for
    why not through ``set_attn_implementation``). Returns the model."""
    model.config._attn_implementation = register(name)
    return model


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
              softcap=None, cu_seq_lens_q=None, cu_seq_lens_k=None, max_length_q=None, max_length_k=None,
              block_table=None, k_cache=None, v_cache=None, **kwargs):
    """transformers' attention-function signature: query (1, Hq, total_q, D), key and value (1, Hkv, *, D);
    returns ((1, total_q, Hq, Dv), None)."""
    from . import paged_attention, varlen_attention

    if dropout:
        raise ValueError(f"{NAME} runs inference only: dropout must be 0, got {dropout}")
    if softcap is not None:
        raise ValueError(f"{NAME} has no logit softcap (got softcap={softcap})")
    if cu_seq_lens_q is None or cu_seq_lens_k is None:
        raise ValueError(f"{NAME} is for continuous batching (generate_batch), which passes cu_seq_lens_q and "
                         f"cu_seq_lens_k; got none")
    # transformers' sliding window counts the query's own key: FlashAttention's window_size left = w - 1
    window = None if sliding_window is None else sliding_window - 1
    q = query[0].transpose(0, 1)
    if block_table is not None:
        lengths = (cu_seq_lens_k[1:] - cu_seq_lens_k[:-1]).to(torch.int32)
        _append(k_cache, v_cache, block_table, lengths, key[0].transpose(0, 1), value[0].transpose(0, 1))
        out = paged_attention(q, k_cache, v_cache, block_table.to(torch.int32), lengths, causal=True, scale=scaling,
                              window=window)
    else:
        k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)
        out = varlen_attention(q, k, v, cu_seq_lens_q.to(torch.int32), cu_seq_lens_k.to(torch.int32),
                               int(max_length_q), int(max_length_k), causal=True, scale=scaling, window=window)
    return out[None], None


def _append(k_cache, v_cache, block_table, lengths, k_new, v_new) -> None:
    """Write each sequence's new key and value (one per sequence: decode) into the slot of position
    ``lengths[b] - 1``, as flash_attn_with_kvcache does with ``cache_seqlens = lengths - 1``."""
    page_size = k_cache.shape[1]
    position = lengths.long() - 1
    rows = torch.arange(block_table.shape[0], device=block_table.device)
    blocks = block_table[rows, position // page_size].long()
    k_cache[blocks, position % page_size] = k_new
    v_cache[blocks, position % page_size] = v_new
