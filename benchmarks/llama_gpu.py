"""A mid-size transformers Llama on one GPU: stock ``torch.compile`` against ``torch.compile`` + inductor_attn.

    PYTHONPATH=. python benchmarks/llama_gpu.py --out DIR            (aimed at < 5 minutes on an H100)

Model: LlamaForCausalLM from a LlamaConfig with random weights (no download), bf16: hidden 2048, 16 layers,
16 heads, 4 KV heads (head_dim 128), intermediate 5632, vocab 32000. Both variants compile the same
model object; the only difference is ``backend="inductor"`` vs ``backend="inductor_attn"``.

1. Prefill: batch 4 x 2048 tokens, ``logits_to_keep=1`` (serving computes the last position only).
   SDPA runs with is_causal (transformers skips the mask under torch.compile, or builds a causal one
   that the rewrite proves): routed as causal attention.
2. Decode: a static KV cache of 2048 + 128 slots, prefill eagerly, then 128 greedy steps, one token per
   call of the model compiled with mode="reduce-overhead" (CUDA graphs, as generate() does). The decode
   mask is built in the graph from the cache position: routed with kv_seqlens.
2b. generate(): ``model.generate(cache_implementation="static", compile_config=...)`` with the second
   sequence left-padded by 64 tokens, greedy, ``--decode`` new tokens. generate() prefills eagerly and
   passes its decode mask into the compiled forward as a graph input: routed as a key_mask (with
   kv_seqlens up to the last visible key). Wall time of a whole generate() call after a first one.
3. Timing: CUDA events around each call after warm-up, median of the samples. The first call of each
   variant (compile, and for inductor_attn also the tuning of every new attention shape) is timed on its
   own; tuning is the first call with an empty decision store minus a recompile with the stored
   decisions (fresh Dynamo, FX graph cache off).
4. Correctness: relative error of prefill logits and of every decode step's logits (teacher-forced on
   the stock run's tokens) against stock compile, and the fraction of greedy tokens that agree.

Writes DIR/llama_gpu.json and prints a summary.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch._functorch.config
import torch._inductor.config

import inductor_attn
from inductor_attn.bench.runner import git_commit  # noqa: E402  (one helper for every script)


def build_model(args):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=32000,
        max_position_embeddings=args.prefill + args.decode, attn_implementation="sdpa")
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config)
    return model.to(torch.bfloat16).eval()


def cuda_time(fn, samples: int) -> list[float]:
    """Milliseconds of ``samples`` calls, each between its own pair of CUDA events."""
    times = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def wall(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# ------------------------------------------------------------------------------------------ prefill
def prefill(model, ids, backend: str, samples: int) -> dict:
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True)

    def call():
        return compiled(input_ids=ids, logits_to_keep=1).logits

    with torch.no_grad():
        logits, first_s = wall(call)
        call()
        times = cuda_time(call, samples)
    return {"first_call_s": first_s, "median_ms": statistics.median(times), "samples_ms": times,
            "logits": logits}


# ------------------------------------------------------------------------------------------ decode
def decode_steps(compiled, model, ids, cache, steps: int, forced=None):
    """Eager prefill into ``cache``, then ``steps`` compiled one-token calls (greedy, or fed ``forced``).
    Returns the tokens fed and each step's logits."""
    cache.reset()
    with torch.no_grad():
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        all_logits, tokens = [], []
        token = logits.argmax(-1, keepdim=True)
        for step in range(steps):
            if forced is not None:
                token = forced[:, step:step + 1]
            tokens.append(token)
            logits = compiled(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1]
            all_logits.append(logits.clone())
            token = logits.argmax(-1, keepdim=True)
    return torch.cat(tokens, 1), all_logits


def decode(model, ids, backend: str, args, forced=None) -> dict:
    import transformers

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True, mode="reduce-overhead")
    cache = transformers.StaticCache(config=model.config, max_cache_len=args.prefill + args.decode)

    def one_run():
        return decode_steps(compiled, model, ids, cache, args.decode, forced)

    _, first_s = wall(lambda: decode_steps(compiled, model, ids, cache, 3, forced))
    one_run()  # warm-up: CUDA-graph recording
    per_token = []
    for _ in range(args.decode_repeats):
        _, run_s = wall(one_run)
        per_token.append(1e3 * run_s / args.decode)
    tokens, logits = one_run()
    return {"first_calls_s": first_s, "ms_per_token_with_eager_prefill": statistics.median(per_token),
            "runs_ms_per_token": per_token, "ms_per_step": step_ms(compiled, model, ids, cache, args.decode),
            "tokens": tokens, "logits": logits}


def step_ms(compiled, model, ids, cache, steps: int) -> float:
    """Median ms of one compiled decode call between CUDA events, the cache position advancing."""
    cache.reset()
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        token = ids[:, -1:]
        events = []
        for _ in range(steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            compiled(input_ids=token, past_key_values=cache, use_cache=True)
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


# ------------------------------------------------------------------------------------------ generate
def generate(model, ids, backend: str, args) -> dict:
    import transformers

    torch._dynamo.reset()
    padding = torch.ones_like(ids)
    padding[1, :64] = 0
    kwargs = dict(attention_mask=padding, max_new_tokens=args.decode, do_sample=False,
                  cache_implementation="static",
                  compile_config=transformers.CompileConfig(backend=backend, fullgraph=True, mode="reduce-overhead"))
    with torch.no_grad():
        _, first_s = wall(lambda: model.generate(ids, **kwargs))
        runs = [wall(lambda: model.generate(ids, **kwargs)) for _ in range(args.decode_repeats)]
    return {"first_call_s": first_s, "median_s": statistics.median(s for _, s in runs),
            "tokens": runs[-1][0][:, ids.shape[1]:]}


def compare_generate(model, ids, args) -> dict:
    """generate() under stock torch.compile and under inductor_attn: times and token agreement."""
    stock, ours = generate(model, ids, "inductor", args), generate(model, ids, "inductor_attn", args)
    return {
        "stock_s": stock["median_s"], "inductor_attn_s": ours["median_s"],
        "speedup": stock["median_s"] / ours["median_s"],
        "stock_first_call_s": stock["first_call_s"], "inductor_attn_first_call_s": ours["first_call_s"],
        "greedy_token_agreement": (stock["tokens"] == ours["tokens"]).float().mean().item(),
    }


# ------------------------------------------------------------------------------------------ tuning
def tuning_seconds(model, ids) -> dict:
    """A recompile of the prefill with its decisions already stored (no tuning)."""
    torch._dynamo.reset()
    with torch.no_grad():
        _, warm = wall(lambda: torch.compile(model, backend="inductor_attn", fullgraph=True)(
            input_ids=ids, logits_to_keep=1))
    return {"recompile_with_stored_decisions_s": warm}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prefill", type=int, default=2048)
    parser.add_argument("--decode", type=int, default=128)
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--decode-repeats", type=int, default=3)
    parser.add_argument("--only-generate", action="store_true", help="run the generate() comparison only")
    parser.add_argument("--store", type=Path, default=None,
                        help="decision store dir (default: a fresh one, so tuning is measured)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ["INDUCTOR_ATTN_CACHE_DIR"] = str(args.store or tempfile.mkdtemp(prefix="inductor_attn_store_"))
    # compile for real every time, so first-call times compare compilations, not cache hits
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False

    model = build_model(args)
    ids = torch.randint(0, 32000, (args.batch, args.prefill), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(1))
    started = time.perf_counter()
    inductor_attn.reset_routing_report()
    if args.only_generate:
        result = {"device": torch.cuda.get_device_name(), "commit": git_commit(),
                  "generate": compare_generate(model, ids, args),
                  "routing_report": inductor_attn.routing_report(), "kernel_calls": inductor_attn.stats(),
                  "decisions": inductor_attn.cache.list_decisions()}
        (args.out / "llama_generate.json").write_text(json.dumps(result, indent=2))
        print(json.dumps(result, indent=2))
        return

    stock_p = prefill(model, ids, "inductor", args.samples)
    ours_p = prefill(model, ids, "inductor_attn", args.samples)
    tuning = tuning_seconds(model, ids)
    tuning["prefill_first_call_s"] = ours_p["first_call_s"]
    tuning["prefill_tuning_s"] = ours_p["first_call_s"] - tuning["recompile_with_stored_decisions_s"]

    stock_d = decode(model, ids, "inductor", args)
    ours_d = decode(model, ids, "inductor_attn", args, forced=stock_d["tokens"])
    stock_step, ours_step = stock_d["ms_per_step"], ours_d["ms_per_step"]
    generated = compare_generate(model, ids, args)

    step_errors = [rel_err(o, s) for o, s in zip(ours_d["logits"], stock_d["logits"])]
    agree = (torch.stack([lo.argmax(-1) for lo in ours_d["logits"]])
             == torch.stack([lo.argmax(-1) for lo in stock_d["logits"]])).float().mean().item()
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "commit": git_commit(),
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "prefill": {
            "stock_ms": stock_p["median_ms"], "inductor_attn_ms": ours_p["median_ms"],
            "speedup": stock_p["median_ms"] / ours_p["median_ms"],
            "stock_first_call_s": stock_p["first_call_s"], "inductor_attn_first_call_s": ours_p["first_call_s"],
            "logits_rel_err_vs_stock": rel_err(ours_p["logits"], stock_p["logits"]),
        },
        "decode": {
            "stock_ms_per_step": stock_step, "inductor_attn_ms_per_step": ours_step,
            "speedup": stock_step / ours_step,
            "stock_ms_per_token_with_eager_prefill": stock_d["ms_per_token_with_eager_prefill"],
            "inductor_attn_ms_per_token_with_eager_prefill": ours_d["ms_per_token_with_eager_prefill"],
            "stock_first_calls_s": stock_d["first_calls_s"], "inductor_attn_first_calls_s": ours_d["first_calls_s"],
            "max_step_logits_rel_err_vs_stock": max(step_errors),
            "argmax_agreement_teacher_forced": agree,
        },
        "generate": generated,
        "tuning": tuning,
        "routing_report": inductor_attn.routing_report(),
        "kernel_calls": inductor_attn.stats(),
        "decisions": inductor_attn.cache.list_decisions(),
        "total_s": time.perf_counter() - started,
    }
    (args.out / "llama_gpu.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({k: result[k] for k in ("device", "prefill", "decode", "generate", "tuning", "routing_report",
                                              "total_s")}, indent=2))


if __name__ == "__main__":
    main()
