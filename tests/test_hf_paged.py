"""transformers' continuous batching (generate_batch) on inductor_attn, on the CPU: a tiny random Llama's greedy
tokens match eager generate's, through varlen calls (transformers' own path for a custom attention) and through
paged calls (its decode fast path, which it turns on for FlashAttention 2/3 on CUDA only, turned on here)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
continuous = pytest.importorskip("transformers.generation.continuous_batching.initialization")

import inductor_attn  # noqa: E402
from inductor_attn import hf_paged  # noqa: E402

PROMPTS = [[5, 8, 13, 21, 34], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [7, 7], list(range(40, 60))]
NEW_TOKENS = 8


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


def _eager_tokens(model):
    model.set_attn_implementation("eager")
    return [model.generate(torch.tensor([p]), generation_config=_greedy())[0, len(p):].tolist() for p in PROMPTS]


@pytest.mark.parametrize("fast_path", [False, True], ids=["varlen", "paged_decode"])
def test_generate_batch_matches_eager_greedy_tokens(fast_path, monkeypatch):
    model = _model()
    expected = _eager_tokens(model)
    if fast_path:  # keep the block table that transformers would switch off for a name other than FA2/3 on CUDA
        monkeypatch.setattr(continuous, "ensure_decode_fast_path_is_available", lambda *args: None)
    inductor_attn.reset_stats()
    results = hf_paged.use(model).generate_batch(inputs=PROMPTS, generation_config=_greedy())
    got = {tuple(r.prompt_ids): r.generated_tokens for r in results.values()}
    assert [got[tuple(p)] for p in PROMPTS] == expected
    ran = {key.split(" -> ")[0] for key in inductor_attn.stats()}
    assert ran == ({"varlen/forward", "paged/forward"} if fast_path else {"varlen/forward"})


def test_names_without_flash_are_refused():
    with pytest.raises(ValueError, match="must contain 'flash'"):
        hf_paged.register("inductor_attn_paged")
