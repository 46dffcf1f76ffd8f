"""transformers' continuous batching on inductor_attn: an ``attn_implementation`` for ``generate_batch``.

``use(model)`` registers :func:`attention` with transformers' ``AttentionInterface`` and makes it the model's
attention; then ``model.generate_batch(...)`` runs on it. An attention function, not the routing pass
(``enable()``), because continuous batching never calls F.scaled_dot_product_attention with what a paged kernel
needs: it passes packed queries, ``cu_seq_lens_q/k`` and, on its decode fast path, the block table, to the
attention function only.

Supported: transformers 5.17 and 5.24 (tests/test_hf_paged.py runs both). Their continuous batching differs in
three ways, each told apart by what the installed transformers has or passes, not by its version string:

- the name. 5.17 registers its own paged functions under ``"paged|..."`` names (``paged|sdpa``,
  ``paged|flash_attention_2``) and switches the model to ``"paged|<name>"`` for any name without the prefix,
  through ``set_attn_implementation``, which refuses a name it does not know. 5.24 registers ``paged|eager``
  alone and takes flash names as they are (it strips the prefix from others, with a deprecation warning). So
  :func:`register` registers ``"inductor_attn_flash"``, and also ``"paged|inductor_attn_flash"`` where
  ``paged|sdpa`` is registered (5.17), and returns the name the model's config must hold: the prefixed one there.
  Both versions need "flash" in the name: for such names continuous batching builds no attention mask (packed
  varlen inputs, which is what the ops take) and 5.24 takes no other custom name (``switch_to_cb_friendly_attn``).
  ``set_attn_implementation`` (and ``from_pretrained(attn_implementation=...)``) takes a "flash" name that is not
  ``flash_attention_N`` for a kernel of the Hugging Face hub and tries to download it, so :func:`use` sets the
  config's ``_attn_implementation`` itself.
- who writes the cache. 5.24's models call ``cache.update`` before the attention function: it has written the
  new keys and gathered each sequence's keys (varlen), or, on the decode fast path, put this layer's pools
  (``k_cache``/``v_cache``) and its layer group's block table in the kwargs. 5.17 passes the cache itself
  (``cache``, with ``read_index``/``write_index``), and its attention functions update it: :func:`attention` does
  what 5.17's do when it gets ``cache``.
- the arguments. 5.17 names the longest lengths ``max_seqlen_q/k`` (5.24: ``max_length_q/k``), may pass
  ``cu_seq_lens_k``/``max_seqlen_k`` per layer type (a dict of ``full_attention``/``sliding_attention``) and
  passes the block table of every layer group, (groups, num_seqs, pages); 5.24 has picked this layer's. 5.17's
  paged functions take a sliding window from the module (``module.sliding_window``), 5.24's from the argument.

Two calls reach the ops:

- prefill and mixed batches: each sequence's keys gathered into packed tensors: :func:`inductor_attn.varlen_attention`;
- decode batches on the fast path (a block table): the new tokens' keys and values, the pools (num_pages,
  page_size, Hkv, D) and the table. The new keys are written into their slots (:func:`_append`), then
  :func:`inductor_attn.paged_attention` reads the pages. transformers turns this path on only for
  ``flash_attention_2``/``_3`` on CUDA or XPU (``ensure_decode_fast_path_is_available``), so for other names it
  runs only where a caller turns it on (tests/test_hf_paged.py, ``bench --suite paged --part models``).

Both run with ``check_indices=False``: transformers built the indices (cu_seq_lens from its scheduler, block
tables from its allocator), and the checks would do harm here. Eagerly they read the values on the host, a device
sync per layer and step; on CUDA, transformers captures the forward in CUDA graphs for "flash" names, where a sync
is illegal; and its padded batches (CUDA graphs or compile: static shapes) pack more query rows than
``cu_seq_lens_q`` covers and add sequences of no keys, which varlen's check refuses (``cu_seqlens_q[-1]`` must be
the total) though the rows past the last sequence are never read (FlashAttention leaves them unwritten too).
"""

from __future__ import annotations

import torch

from .backends.triton_common import jit
from .device import on_device_of
from .problem import next_power_of_two

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: the cache is written with torch ops (_append)
    triton = tl = None

NAME = "inductor_attn_flash"
_PAGED_PREFIX = "paged|"


def _paged_prefix() -> bool:
    """Whether continuous batching runs custom attention under ``"paged|<name>"`` (5.17): where transformers
    registers its own paged functions under such names (``paged|sdpa``); 5.24 registers ``paged|eager`` alone."""
    from transformers import AttentionInterface

    return f"{_PAGED_PREFIX}sdpa" in AttentionInterface()


def register(name: str = NAME) -> str:
    """Register :func:`attention` with transformers under ``name`` (it must contain "flash", see above), and under
    ``"paged|" + name`` where continuous batching takes that prefix (5.17). Returns the name for the model's config:
    the prefixed one there, else ``name``."""
    from transformers import AttentionInterface

    if "flash" not in name:
        raise ValueError(f"name must contain 'flash' (transformers' continuous batching takes no other custom "
                         f"attention), got {name!r}")
    AttentionInterface.register(name, attention)
    if _paged_prefix() and not name.startswith(_PAGED_PREFIX):
        name = _PAGED_PREFIX + name
        AttentionInterface.register(name, attention)
    return name


def use(model, name: str = NAME):
    """Register :func:`attention` under ``name`` and make it ``model``'s attention implementation (see above for
    why not through ``set_attn_implementation``). Returns the model. A model whose attention takes what ours has
    not (a logit softcap, learned sinks) is refused here: inside ``generate_batch`` the error would only reach
    each request's ``error`` and the log."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap:
        raise ValueError(f"{NAME} has no logit softcap in prefill (varlen_attention takes none; the model's config "
                         f"has attn_logit_softcapping={softcap}); use transformers' own attention for this model")
    sinks = next((f"{n}.{a}" for n, m in model.named_modules() for a in ("sinks", "s_aux")
                  if isinstance(getattr(m, a, None), torch.Tensor)), None)
    if sinks is not None:
        raise ValueError(f"{NAME} has no attention sinks (the model has {sinks}); use transformers' own attention "
                         "for this model")
    model.config._attn_implementation = register(name)
    return model


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
              softcap=None, cu_seq_lens_q=None, cu_seq_lens_k=None, max_length_q=None, max_length_k=None,
              block_table=None, k_cache=None, v_cache=None, cache=None, read_index=None, write_index=None,
              max_seqlen_q=None, max_seqlen_k=None, is_causal=None, s_aux=None, sinks=None, **kwargs):
    """transformers' attention-function signature, as continuous batching calls it (5.17's and 5.24's arguments,
    see above): query (1, Hq, total_q, D), key and value (1, Hkv, *, D); returns ((1, total_q, Hq, Dv), None).
    ``is_causal`` (else the module's) as transformers' flash function reads it: a vision encoder passes False."""
    from . import paged_attention, varlen_attention

    if dropout:
        raise ValueError(f"{NAME} runs inference only: dropout must be 0, got {dropout}")
    if softcap is not None:
        raise ValueError(f"{NAME} has no logit softcap in prefill (varlen_attention takes none; got "
                         f"softcap={softcap})")
    if s_aux is not None or sinks is not None:  # GPT-OSS and others: a learned sink column in every softmax
        raise ValueError(f"{NAME} has no attention sinks (got {'s_aux' if s_aux is not None else 'sinks'}); use "
                         "transformers' own attention for this model")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if cu_seq_lens_q is None or cu_seq_lens_k is None:
        raise ValueError(f"{NAME} is for continuous batching (generate_batch), which passes cu_seq_lens_q and "
                         f"cu_seq_lens_k; got none")
    if cache is not None and sliding_window is None:  # 5.17's paged functions read the module's window
        sliding_window = getattr(module, "sliding_window", None) or None
    # 5.17 may pass the k lengths of each layer type (5.24's cache.update has picked this layer's)
    layer_type = "full_attention" if sliding_window is None else "sliding_attention"
    max_q = max_length_q if max_length_q is not None else max_seqlen_q
    max_k = max_length_k if max_length_k is not None else max_seqlen_k
    if isinstance(cu_seq_lens_k, dict):
        cu_seq_lens_k = cu_seq_lens_k[layer_type]
    if isinstance(max_k, dict):
        max_k = max_k[layer_type]
    # transformers' sliding window counts the query's own key: FlashAttention's window_size left = w - 1
    window = None if sliding_window is None else sliding_window - 1
    q = query[0].transpose(0, 1)
    if block_table is not None:
        if cache is not None:  # 5.17: the pools of this layer, (slots, Hkv, D) as pages
            group, index_in_group = cache.layer_index_to_group_indices[module.layer_idx]
            k_cache, v_cache = (pool[index_in_group].view(-1, cache.block_size, *x.shape[1::2])
                                for pool, x in ((cache.key_cache, key), (cache.value_cache, value)))
            if block_table.dim() == 3:  # every layer group's table
                block_table = block_table[group]
        # decode: one query per sequence; padded batches (CUDA graphs) add sequences of no keys
        n = q.shape[0]
        block_table = block_table[:n].to(torch.int32)
        lengths = (cu_seq_lens_k[1:n + 1] - cu_seq_lens_k[:n]).to(torch.int32)
        _append(k_cache, v_cache, block_table, lengths, key[0].transpose(0, 1), value[0].transpose(0, 1))
        out = paged_attention(q, k_cache, v_cache, block_table, lengths, causal=causal, scale=scaling,
                              window=window, check_indices=False)
    else:
        if cache is not None:  # 5.17: write the new keys, gather each sequence's: (total_k, Hkv, D)
            k, v = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx,
                                read_index=read_index, write_index=write_index)
        else:  # 5.24: cache.update has done both
            k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)
        # lengths not given (a caller other than continuous batching) are read from cu_seq_lens: one sync
        max_q, max_k = (None if m is None else int(m) for m in (max_q, max_k))
        out = varlen_attention(q, k, v, cu_seq_lens_q.to(torch.int32), cu_seq_lens_k.to(torch.int32), max_q, max_k,
                               causal=causal, scale=scaling, window=window, check_indices=False)
    return out[None], None


# Outside compiled code, as transformers keeps its own cache.update: a layer's two pools are overlapping views of
# one buffer (5.24), and AOTAutograd's handling of in-place writes into aliased inputs wrote one of them into the
# wrong slots once shapes were dynamic (torch 2.13, CPU: wrong tokens from the second decode step)
@torch.compiler.disable
def _append(k_cache, v_cache, block_table, lengths, k_new, v_new) -> None:
    """Write each sequence's new key and value (one per sequence: decode) into the slot of position
    ``lengths[b] - 1``, as flash_attn_with_kvcache does with ``cache_seqlens = lengths - 1``. A sequence of no keys
    (``lengths[b] == 0``: the padding rows of transformers' CUDA-graph batches, whose table rows hold -1, or pages
    of another step) has no slot and writes nowhere.

    On CUDA one kernel writes both pools (:func:`_append_kernel`): it skips such rows on the device, so it may run
    inside a CUDA graph, and it is one launch where indexing with torch ops took about 30 small kernels per layer
    and step. Elsewhere (the CPU) the rows are chosen on the host."""
    if k_cache.device.type == "cuda" and triton is not None:
        _append_in_kernel(k_cache, v_cache, block_table, lengths, k_new, v_new)
    else:
        _append_by_index(k_cache, v_cache, block_table, lengths, k_new, v_new)


def _append_by_index(k_cache, v_cache, block_table, lengths, k_new, v_new) -> None:
    rows = (lengths > 0).nonzero().flatten()
    position = lengths[rows].long() - 1
    page_size = k_cache.shape[1]
    blocks = block_table[rows, position // page_size].long()
    for pool, new in ((k_cache, k_new), (v_cache, v_new)):
        pool[blocks, position % page_size] = new[rows]


def _append_in_kernel(k_cache, v_cache, block_table, lengths, k_new, v_new) -> None:
    n, heads = k_new.shape[:2]
    if n == 0:
        return
    with on_device_of(k_cache):  # Triton launches on the current device, not its tensors'
        _append_kernel[(n,)](
            k_cache, v_cache, block_table, lengths, k_new, v_new, *k_cache.stride(), *v_cache.stride(),
            *block_table.stride(), *k_new.stride(), *v_new.stride(), heads, k_new.shape[-1], v_new.shape[-1],
            k_cache.shape[1], block_table.shape[1], k_cache.shape[0], BLOCK_H=next_power_of_two(heads),
            BLOCK_D=next_power_of_two(k_new.shape[-1]), BLOCK_DV=next_power_of_two(v_new.shape[-1]))


# The new keys' strides follow the number of sequences in the step, which changes from step to step: never
# specialise on them, so that a step of a new size (transformers captures a CUDA graph per padded size) launches
# the kernel already compiled rather than compiling another.
@jit(do_not_specialize=["snb", "snh", "smb", "smh"])
def _append_kernel(K_CACHE, V_CACHE, TABLE, LENGTHS, K_NEW, V_NEW, skp, sks, skh, skd, svp, svs, svh, svd, stb, stp,
                   snb, snh, snd, smb, smh, smd, HEADS, D, DV, PAGE_SIZE, TABLE_WIDTH, NUM_PAGES,
                   BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """One program per sequence: its new key and value, (HEADS, D) and (HEADS, DV), into its slot of the pools
    (NUM_PAGES, PAGE_SIZE, HEADS, D), any strides. Nothing for a sequence of no keys, nor where its position lies
    past its table row or its page id outside the pool: indices the caller got wrong write nothing out of bounds
    (torch's indexing on the host raises for them instead)."""
    b = tl.program_id(0)
    length = tl.load(LENGTHS + b)
    position = length - 1
    if (length > 0) & (position // PAGE_SIZE < TABLE_WIDTH):
        page = tl.load(TABLE + b * stb + (position // PAGE_SIZE) * stp).to(tl.int64)
        if (page >= 0) & (page < NUM_PAGES):
            slot = position % PAGE_SIZE
            h = tl.arange(0, BLOCK_H)[:, None]
            d = tl.arange(0, BLOCK_D)[None, :]
            mask = (h < HEADS) & (d < D)
            key = tl.load(K_NEW + b * snb + h * snh + d * snd, mask=mask)
            tl.store(K_CACHE + page * skp + slot * sks + h * skh + d * skd, key, mask=mask)
            d = tl.arange(0, BLOCK_DV)[None, :]
            mask = (h < HEADS) & (d < DV)
            value = tl.load(V_NEW + b * smb + h * smh + d * smd, mask=mask)
            tl.store(V_CACHE + page * svp + slot * svs + h * svh + d * svd, value, mask=mask)
