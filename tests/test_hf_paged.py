"""transformers' continuous batching (generate_batch) on inductor_attn, on the CPU: a tiny random Llama's greedy
tokens match eager generate's, through varlen calls (transformers' own path for a custom attention) and through
paged calls (its decode fast path, which it turns on for FlashAttention 2/3 on CUDA only, turned on here), with the
page pool full of NaN where nothing was written, and with the padded batches that transformers builds for CUDA
graphs (sequences of no keys, query rows past the last sequence). Runs on transformers 5.24 and 5.17
(``PYTHONPATH=<a transformers 5.17 install> python -m pytest tests/test_hf_paged.py``; 5.17's cache on a CPU needs
psutil, which reads the host's free memory)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
continuous = pytest.importorskip("transformers.generation.continuous_batching.initialization")
cache_module = pytest.importorskip("transformers.generation.continuous_batching.cache")
runner_module = pytest.importorskip("transformers.generation.continuous_batching.model_runner")

import inductor_attn  # noqa: E402
from inductor_attn import hf_paged  # noqa: E402

PROMPTS = [[5, 8, 13, 21, 34], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [7, 7], list(range(40, 60)), [11, 12, 13]]
NEW_TOKENS = 8
PAGE = 8  # sequences of 10 to 28 keys: tables of 2 to 4 pages


def _model():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      eos_token_id=None, bos_token_id=None, pad_token_id=0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    return model


def _greedy():
    return transformers.GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)


def _cache_config():
    """A small cache of small pages (on a CPU, transformers would size it from the host's memory; 5.17 needs
    psutil for that). 5.24 calls the page size ``page_size``, 5.17 ``block_size``."""
    fields = {f.name for f in dataclasses.fields(transformers.ContinuousBatchingConfig)}
    page = "page_size" if "page_size" in fields else "block_size"
    return transformers.ContinuousBatchingConfig(num_blocks=32, max_batch_tokens=64, max_requests_per_batch=8,
                                                 **{page: PAGE})


def _eager_tokens(model):
    model.set_attn_implementation("eager")
    return [model.generate(torch.tensor([p]), generation_config=_greedy())[0, len(p):].tolist() for p in PROMPTS]


def _poison(cache) -> int:
    """Fill every page of a new PagedAttentionCache with NaN: 5.17 keeps a tensor per layer of a group
    (``key_cache``/``value_cache``), 5.24 one byte tensor for all (``cache_tensor``; bytes 0xff are NaN in every
    float dtype). Returns the number of tensors filled."""
    pools = [*getattr(cache, "key_cache", []), *getattr(cache, "value_cache", [])]
    for pool in pools:
        pool.fill_(math.nan)
    if isinstance(getattr(cache, "cache_tensor", None), torch.Tensor):
        cache.cache_tensor.fill_(0xFF)
        pools.append(cache.cache_tensor)
    return len(pools)


@pytest.mark.parametrize("padded", [False, True], ids=["exact", "padded"])
@pytest.mark.parametrize("fast_path", [False, True], ids=["varlen", "paged_decode"])
def test_generate_batch_matches_eager_greedy_tokens(fast_path, padded, monkeypatch):
    """NaN in every slot nothing wrote never reaches a token. ``padded``: the batches transformers builds where it
    captures CUDA graphs (here run eagerly), decode batches of 5 sequences padded to 8 among them."""
    model = _model()
    expected = _eager_tokens(model)
    if fast_path:  # keep the block table that transformers would switch off for a name other than FA2/3 on CUDA
        monkeypatch.setattr(continuous, "ensure_decode_fast_path_is_available", lambda *args: None)
    poisoned = []
    cache_init = cache_module.PagedAttentionCache.__init__

    def poisoned_init(self, *args, **kwargs):
        cache_init(self, *args, **kwargs)
        poisoned.append(_poison(self))

    monkeypatch.setattr(cache_module.PagedAttentionCache, "__init__", poisoned_init)
    if padded:
        runner_init = runner_module.ModelRunner.__init__

        def padding_init(self, *args, **kwargs):
            runner_init(self, *args, **kwargs)
            self.pad_inputs = True

        monkeypatch.setattr(runner_module.ModelRunner, "__init__", padding_init)
    inductor_attn.reset_stats()
    results = hf_paged.use(model).generate_batch(inputs=PROMPTS, generation_config=_greedy(),
                                                 continuous_batching_config=_cache_config())
    assert poisoned and poisoned[0] > 0
    got = {tuple(r.prompt_ids): r.generated_tokens for r in results.values()}
    assert [got.get(tuple(p)) for p in PROMPTS] == expected
    ran = {key.split(" -> ")[0] for key in inductor_attn.stats()}
    assert ran == ({"varlen/forward", "paged/forward"} if fast_path else {"varlen/forward"})


def test_the_config_holds_the_name_continuous_batching_runs_under():
    """5.17 runs custom attention as "paged|<name>" (where it registers paged|sdpa), 5.24 as the name."""
    name = hf_paged.use(_model()).config._attn_implementation
    prefixed = "paged|sdpa" in transformers.AttentionInterface()
    assert name == ("paged|" if prefixed else "") + hf_paged.NAME
    assert transformers.AttentionInterface()[name] is hf_paged.attention


def _pool(pages=6, page=4, heads=2, dim=8):
    return (torch.full((pages, page, heads, dim), math.nan), torch.full((pages, page, heads, dim), math.nan))


def _unchanged(before, after):
    return torch.equal(before.isnan(), after.isnan()) and torch.equal(before.nan_to_num(), after.nan_to_num())


# the CUDA path's kernel runs in Triton's interpreter here
APPENDS = [hf_paged._append_by_index,
           pytest.param(hf_paged._append_in_kernel,
                        marks=pytest.mark.skipif(hf_paged.triton is None, reason="Triton is not installed"))]


@pytest.mark.parametrize("append", APPENDS)
def test_append_writes_each_sequences_slot_and_nothing_for_sequences_of_no_keys(append):
    """Rows 0 and 3 have no keys (padding): row 0's table is -1 (position -1 would write the pool's last page),
    row 3's holds row 1's pages (another step's): neither writes; rows 1 and 2 write their slot, nothing else.
    The values' pool is a (pages, heads, page, dim) memory viewed as (pages, page, heads, dim), FlashInfer's HND."""
    k_pool, _ = _pool()
    v_pool = torch.full((6, 2, 4, 8), math.nan).transpose(1, 2)
    table = torch.tensor([[-1, -1], [0, 2], [4, -1], [0, 2]], dtype=torch.int32)
    lengths = torch.tensor([0, 6, 1, 0], dtype=torch.int32)
    k_new, v_new = torch.randn(4, 2, 8), torch.randn(2, 4, 8).transpose(0, 1)
    append(k_pool, v_pool, table, lengths, k_new, v_new)
    for pool, new in ((k_pool, k_new), (v_pool, v_new)):
        assert torch.equal(pool[2, 1], new[1]) and torch.equal(pool[4, 0], new[2])
        written = torch.zeros(pool.shape[:2], dtype=torch.bool)
        written[2, 1] = written[4, 0] = True
        assert pool[~written].isnan().all()  # the last page (slot -1) and every other slot untouched


@pytest.mark.parametrize("append", APPENDS)
def test_append_with_no_sequence_of_keys_changes_no_page(append):
    k_pool, v_pool = _pool()
    before = k_pool.clone(), v_pool.clone()
    table = torch.full((3, 2), -1, dtype=torch.int32)
    append(k_pool, v_pool, table, torch.zeros(3, dtype=torch.int32), torch.randn(3, 2, 8), torch.randn(3, 2, 8))
    assert _unchanged(before[0], k_pool) and _unchanged(before[1], v_pool)


@pytest.mark.skipif(hf_paged.triton is None, reason="Triton is not installed")
def test_the_append_kernel_writes_nothing_out_of_bounds_for_indices_that_are_wrong():
    """A position past the table row (row 0: 3 pages' worth of keys, 2 entries) and page ids past the pool (row 1)
    or below 0 (row 2) write nothing; row 3 is right and writes its slot."""
    k_pool, v_pool = _pool()
    table = torch.tensor([[0, 1], [6, 7], [-2, 3], [5, 3]], dtype=torch.int32)
    lengths = torch.tensor([9, 2, 1, 6], dtype=torch.int32)
    k_new, v_new = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    hf_paged._append_in_kernel(k_pool, v_pool, table, lengths, k_new, v_new)
    for pool, new in ((k_pool, k_new), (v_pool, v_new)):
        assert torch.equal(pool[3, 1], new[3])
        pool[3, 1] = math.nan
        assert pool.isnan().all()


@pytest.mark.gpu
def test_append_on_cuda_writes_what_the_host_indexed_append_writes():
    """The CUDA path (one kernel) against the host-indexed one, on pools of NaN with padding rows, GQA heads and a
    page size that does not divide the lengths."""
    gen = torch.Generator().manual_seed(0)
    pages, page, heads, dim, n = 40, 16, 4, 128, 9
    table = torch.randperm(pages, generator=gen)[:n * 4].view(n, 4).int()
    lengths = torch.randint(1, 4 * page + 1, (n,), generator=gen).int()
    lengths[[2, 7]] = 0
    table[2] = -1
    k_new, v_new = (torch.randn(n, heads, dim, generator=gen).bfloat16() for _ in range(2))
    want = [torch.full((pages, page, heads, dim), math.nan, dtype=torch.bfloat16) for _ in range(2)]
    got = [pool.cuda() for pool in want]
    hf_paged._append_by_index(*want, table, lengths, k_new, v_new)
    hf_paged._append(*got, table.cuda(), lengths.cuda(), k_new.cuda(), v_new.cuda())
    for w, g in zip(want, got):
        assert _unchanged(w, g.cpu())


def test_names_without_flash_are_refused():
    with pytest.raises(ValueError, match="must contain 'flash'"):
        hf_paged.register("inductor_attn_paged")


def _varlen_arguments(n_tokens: int = 6):
    """What transformers' flash path hands the attention function for two packed sequences of 2 and 4 tokens."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, h, n_tokens, 16) for h in (4, 2, 2))
    cu = torch.tensor([0, 2, n_tokens], dtype=torch.int32)
    return (torch.nn.Module(), q, k, v, None), dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu)


@pytest.mark.parametrize("is_causal", [True, False])
def test_is_causal_is_read_as_transformers_flash_function_reads_it(is_causal):
    """A vision encoder (Qwen2-VL's) passes is_causal=False with cu_seq_lens: the sequences see every key."""
    args, kwargs = _varlen_arguments()
    out, _ = hf_paged.attention(*args, **kwargs, max_length_q=4, max_length_k=4, is_causal=is_causal)
    q, k, v = (x[0].transpose(0, 1) for x in args[1:4])
    want = inductor_attn.varlen_attention(q, k, v, kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"], 4, 4,
                                          causal=is_causal)
    torch.testing.assert_close(out[0], want)


def test_lengths_not_given_are_read_from_cu_seq_lens():
    args, kwargs = _varlen_arguments()
    torch.testing.assert_close(hf_paged.attention(*args, **kwargs)[0],
                               hf_paged.attention(*args, **kwargs, max_length_q=4, max_length_k=4)[0])


@pytest.mark.parametrize("name", ["s_aux", "sinks"])
def test_attention_sinks_are_refused_not_dropped(name):
    # GPT-OSS passes s_aux: a learned column in every softmax; ignoring it changed the greedy tokens
    args, kwargs = _varlen_arguments()
    with pytest.raises(ValueError, match=f"has no attention sinks \\(got {name}\\)"):
        hf_paged.attention(*args, **kwargs, max_length_q=4, max_length_k=4, **{name: torch.zeros(4)})


def test_the_fast_paths_cache_write_runs_outside_compiled_code():
    """transformers 5.24 keeps a layer's K and V pools as overlapping views of one buffer (V a page after K).
    Compiled, the append's in-place writes into those aliased inputs put one of them in the wrong slots once the
    shapes turned dynamic (found in review: wrong tokens from a compiled decode step); it runs eagerly now."""
    heads, dim, page = 2, 16, 4
    buffers = [torch.full((50688,), math.nan) for _ in range(2)]

    def pools(buffer, layer):
        flat = buffer.view(-1, heads, dim)
        k, v = (flat[(2 * layer + i) * page:].view(-1, page, heads, dim) for i in (0, 1))
        n = min(k.shape[0], v.shape[0])
        return k[:n], v[:n]

    gen = torch.Generator().manual_seed(0)
    compiled = torch.compile(lambda *a: hf_paged._append(*a), backend="aot_eager")  # as a compiled step calls it
    for rows in ([[390, 384, -1]], [[378, 372, -1], [366, 360, -1]]):
        for layer in range(3):  # as generate_batch's warm-up calls it: three layers of one sequence, then of two
            table = torch.tensor(rows, dtype=torch.int32)
            new = [torch.randn(len(rows), heads, dim, generator=gen) for _ in range(2)]
            args = (table, torch.full((len(rows),), 5, dtype=torch.int32), *new)
            hf_paged._append(*pools(buffers[0], layer), *args)
            compiled(*pools(buffers[1], layer), *args)
            assert torch.equal(buffers[0].nan_to_num(7.0), buffers[1].nan_to_num(7.0))


def test_use_refuses_a_model_with_a_logit_softcap_or_attention_sinks():
    """Inside generate_batch the refusal would reach only each request's error and the log: use() says it."""
    model = _model()
    model.config.attn_logit_softcapping = 50.0  # Gemma 2's
    with pytest.raises(ValueError, match="no logit softcap .*attn_logit_softcapping=50.0"):
        hf_paged.use(model)
    model = _model()
    model.model.layers[0].self_attn.sinks = torch.nn.Parameter(torch.zeros(4))  # GPT-OSS's
    with pytest.raises(ValueError, match="no attention sinks .*layers.0.self_attn.sinks"):
        hf_paged.use(model)
    assert hf_paged.use(_model()).config._attn_implementation.endswith(hf_paged.NAME)
