"""An unmodified transformers Llama under torch.compile with inductor_attn enabled (CPU, float32).

Tiny random model (hidden 64, 2 layers, 4 heads, 2 KV heads: GQA, vocab 128), no download. Tolerance:
rtol 1e-4, atol 1e-5 (float32; the reference kernel and SDPA's math kernel sum in different orders).
The kernel choice is pinned to the reference backend: routing is the subject here, not kernels.
"""

from __future__ import annotations

import copy

import pytest
import torch

import inductor_attn

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_compile", "reference_only")]

TOL = dict(rtol=1e-4, atol=1e-5)
PROMPT, NEW_TOKENS, CACHE_LEN = 12, 4, 24


def tiny_llama(hidden_size=64, device="cpu", dtype=torch.float32):
    """A 2-layer Llama with GQA (4 query heads, 2 KV heads) and random weights; the GPU tests use a wider one."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=hidden_size, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config).to(device, dtype)


def prompt(batch=2, length=PROMPT, device="cpu"):
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(1)).to(device)


def routed_count(what: str) -> int:
    """Routed SDPA calls whose outcome starts with ``what``. transformers 5.23 skips the causal mask under
    torch.compile and passes is_causal ("causal"); 5.17 builds it in the graph ("causal (proven mask)")."""
    prefix = f"sdpa: routed ({what}"
    return sum(n for key, n in inductor_attn.routing_report().items() if key.startswith(prefix))


def attention_calls(direction: str) -> int:
    return sum(n for key, n in inductor_attn.stats().items() if key.startswith(f"attention/{direction}"))


def test_forward_logits_match_eager_and_every_layer_is_routed_causal():
    model = tiny_llama().eval()
    ids = prompt()
    with torch.no_grad():
        expected = model(ids).logits
        with inductor_attn.enabled():
            logits = torch.compile(model, fullgraph=True)(ids).logits
    torch.testing.assert_close(logits, expected, **TOL)
    assert routed_count("causal") == 2
    assert attention_calls("forward") == 2


def test_training_step_gradients_match_eager():
    model = tiny_llama().train()
    compiled_model = copy.deepcopy(model)
    ids = prompt()
    model(ids, labels=ids).loss.backward()
    compiled = torch.compile(compiled_model, fullgraph=True)
    with inductor_attn.enabled():
        loss = compiled(ids, labels=ids).loss
    loss.backward()
    for (name, p), (_, p_compiled) in zip(model.named_parameters(), compiled_model.named_parameters()):
        torch.testing.assert_close(p_compiled.grad, p.grad, **TOL, msg=lambda m: f"{name}: {m}")
    assert routed_count("causal") == 2
    assert attention_calls("forward") == 2 and attention_calls("backward") == 2


def greedy_with_static_cache(model, ids, steps: int) -> torch.Tensor:
    """Prefill, then one token per call, as generate() does; the model builds each mask itself."""
    cache = transformers.StaticCache(config=model.config, max_cache_len=CACHE_LEN)
    tokens = []
    step_ids = ids
    for _ in range(steps + 1):
        logits = model(input_ids=step_ids, past_key_values=cache, use_cache=True).logits
        step_ids = logits[:, -1:].argmax(-1)
        tokens.append(step_ids)
    return torch.cat(tokens, dim=1)


def test_static_cache_decode_runs_on_our_op_with_kv_seqlens_and_matches_eager():
    model = tiny_llama().eval()
    ids = prompt()
    with torch.no_grad():
        expected = greedy_with_static_cache(model, ids, NEW_TOKENS)
        with inductor_attn.enabled():
            tokens = greedy_with_static_cache(torch.compile(model, fullgraph=True), ids, NEW_TOKENS)
    assert torch.equal(tokens, expected)
    # prefill: no mask, is_causal (keys cut to the prompt); decode: the mask transformers builds in the
    # graph from the cache position, proven to be a prefix -> kv_seqlens
    assert routed_count("causal") == 2
    assert routed_count("kv_seqlens from a proven prefix mask") == 2
    assert attention_calls("forward") == 2 * (NEW_TOKENS + 1)
    assert not any("left alone" in key for key in inductor_attn.routing_report())


def test_generate_with_static_cache_routes_its_input_decode_mask_as_a_key_mask_and_matches_eager():
    # generate() builds the 4-D decode mask eagerly (prepare_inputs_for_generation) and passes it into
    # the compiled forward: its values are unknown at compile time, but it is the same for every head and
    # (one query) row, so it runs as a key_mask on the decode path, left padding included
    model = tiny_llama().eval()
    ids = prompt()
    padding = torch.ones_like(ids)
    padding[1, :3] = 0  # left-padded second sequence
    kwargs = dict(attention_mask=padding, max_new_tokens=NEW_TOKENS, do_sample=False, cache_implementation="static")
    expected = model.generate(ids, disable_compile=True, **kwargs)
    compile_config = transformers.CompileConfig(backend="inductor_attn", fullgraph=True, mode="default")
    compile_config._compile_all_devices = True  # transformers compiles generate() on GPUs only otherwise
    tokens = model.generate(ids, compile_config=compile_config, **kwargs)
    assert torch.equal(tokens, expected)
    report = inductor_attn.routing_report()
    assert report == {"sdpa: routed (key_mask from an unproven mask the same for every query)": 2}, report
    assert attention_calls("forward") == 2 * (NEW_TOKENS - 1)  # the prefill runs eagerly in generate()
