"""HF transformers Llama end to end: stock ``torch.compile`` against ``torch.compile(backend="inductor_attn")``.

Random weights (no download), bf16, built from a LlamaConfig. Both variants compile the same model
object; attention reaches our ops through the SDPA rewrite (routing/). Wall time per call with plain
launches (``default``) and with CUDA graphs (``reduce-overhead``), after warm-up; each entry (a phase or
size, and a mode) in a fresh process.

Continuous batching (``bench --suite paged``): transformers' ``generate_batch`` on the same model with our attention
(hf_paged.py) and with transformers' own paged paths, tokens per second and greedy tokens against eager ``generate``
(:func:`continuous_batching`), each path in a fresh process too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from .wallclock import host_us, interleaved_wall_us, kernel_ms, kernel_us, peak_memory, settle, warm

# The zero-overhead issue's size: small enough that the host matters at prefill B4 L2048.
SIZE = dict(layers=8, hidden=1024, heads=16, kv_heads=4, intermediate=2816)
PREFILL = (4, 2048)
BACKENDS = ("inductor", "inductor_attn")
MODES = ("default", "reduce-overhead")
ROUNDS = 5  # timed runs per backend, the backends taking turns
PREFILL_CALLS = 20
DECODE_CALLS = 80  # per round; the warm-up's, the settling's, all rounds' and the device and host measures' steps
DECODE_ROOM = 576  # fit in DECODE_ROOM (5 + 100 + 5 x 80 + 3 + 10 = 518)
# calls of each step after both compiled, before the timed rounds: in a process that just tuned, the next ~60-240
# calls of either step ran slow (H200, 2026-11-28; 1.6-1.8x for about 200 calls on 2026-11-29, stock's too)
SETTLE_CALLS = 100
# calls of each step profiled for its device time, after the timed rounds (a host-bound step read 20% slower after a
# profiler session and an idle minute, H200, 2026-11-29)
DEVICE_CALLS = 3
ENTRY_TIMEOUT_S = 300  # a fresh process, a model and two compiles
# max-autotune also benchmarks GEMM templates for both compiles: the B4 L2048 training entry took 507 s on an
# H100 host with 16 cores (2026-11)
MAX_AUTOTUNE_TIMEOUT_S = 1200


def build_llama(layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int, max_len: int,
                device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                                      num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=32000,
                                      max_position_embeddings=max_len, attn_implementation="sdpa")
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    return model.to(dtype)


def _compiled(model, backend: str, mode: str, reset: bool = True):
    from ..routing.enable import compile_backend

    if reset:
        torch._dynamo.reset()
    # the function, not the "inductor_attn" name: the name needs the package installed (its entry point)
    fn = compile_backend if backend == "inductor_attn" else backend
    return torch.compile(model, backend=fn, fullgraph=True, mode=None if mode == "default" else mode)


def llama_overhead() -> dict:
    """Prefill and one static-cache decode step, per mode: wall ms per call, stock against ours, each pair in
    its own process (``isolated``)."""
    out = {"size": dict(SIZE, batch=PREFILL[0], prefill=PREFILL[1])}
    for phase in ("prefill", "decode step"):
        for mode in MODES:
            out[f"{phase} {mode}"] = isolated("overhead", phase, mode)
    return out


def prefill_model() -> tuple[torch.nn.Module, torch.Tensor]:
    """The overhead entries' model (room for ``DECODE_ROOM`` decode steps after the prefill) and prefill ids."""
    batch, length = PREFILL
    model = build_llama(**SIZE, max_len=length + DECODE_ROOM).eval()
    ids = torch.randint(0, 32000, (batch, length), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    return model, ids


def decode_step(model, ids: torch.Tensor, backend: str, mode: str, reset: bool = True):
    """One static-cache decode step after a prefill of ``ids``, compiled with ``backend`` in ``mode``, as a
    function of no arguments. Its steps write into a cache of its own with room for ``DECODE_ROOM`` of them:
    with 64 free slots, stock's graph and ours both hit a device-side assert in the cache's index_copy_
    within 305 steps. Call it under ``torch.no_grad()``."""
    import transformers

    length = ids.shape[1]
    cache = transformers.StaticCache(config=model.config, max_cache_len=length + DECODE_ROOM)
    model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    compiled = _compiled(model, backend, mode, reset)
    token, position = ids[:, -1:], torch.tensor([length], device=ids.device)

    def step():
        return compiled(input_ids=token, past_key_values=cache, cache_position=position, use_cache=True)

    return step


def _overhead_entry(phase: str, mode: str) -> dict:
    """Stock and ours compiled side by side (Dynamo keeps one graph per backend of the same forward), settled
    (``settle``), then timed in alternating rounds (``interleaved_wall_us``): two processes of the same code
    differed by 20% on the device machine, more than the ratio measured. A recompilation while timing is an
    error."""
    from torch._dynamo.utils import counters

    model, ids = prefill_model()
    torch._dynamo.reset()
    with torch.no_grad():
        if phase == "prefill":
            compiled = {b: _compiled(model, b, mode, reset=False) for b in BACKENDS}
            fns = {b: warm(lambda c=c: c(input_ids=ids, logits_to_keep=1)) for b, c in compiled.items()}
            calls = PREFILL_CALLS
        else:
            fns = {b: warm(decode_step(model, ids, b, mode, reset=False)) for b in BACKENDS}
            calls = DECODE_CALLS
        settle(fns, SETTLE_CALLS)
        graphs = counters["stats"]["unique_graphs"]
        times = interleaved_wall_us(fns, calls=calls, rounds=ROUNDS)
        if counters["stats"]["unique_graphs"] != graphs:
            raise RuntimeError("a compiled step recompiled while it was timed")
        device = _device_and_host_ms({"stock": fns["inductor"], "ours": fns["inductor_attn"]})
    return {"stock_ms": times["inductor"] / 1e3, "ours_ms": times["inductor_attn"] / 1e3, "rounds": ROUNDS, **device,
            "ours_ran": _ours_ran(), "ours_why": _CHOICES.lines}


HOST_STEPS = 10  # single steps timed for a step's host time, the best kept (after DEVICE_CALLS)


def _device_and_host_ms(steps: dict) -> dict:
    """``{name}_device_ms``: each step's device time (its kernels' summed time, ``kernel_us``), and ``{name}_host_ms``:
    the CPU time of one step started on an idle device (``host_us`` in bursts of one step), beside its wall time
    (``step_cells`` reads what bounds ours from the three); none without CUDA."""
    if not torch.cuda.is_available():
        return {}
    return {key: value for name, step in steps.items()
            for key, value in ((f"{name}_device_ms", kernel_us(step, DEVICE_CALLS) / 1e3),
                               (f"{name}_host_ms", host_us(step, bursts=HOST_STEPS, calls=1) / 1e3))}


def step_cells(r: dict, digits: int = 2) -> str:
    """A model entry's cells for the tables of RESULTS.md (``STEP_HEADER``): stock and ours ms per step, stock /
    ours, and each one's device ms with what bounds ours (:func:`step_bound`)."""
    cells = [f"{r['stock_ms']:.{digits}f}", f"{r['ours_ms']:.{digits}f}", f"{r['stock_ms'] / r['ours_ms']:.2f}x"]
    if r.get("ours_device_ms"):
        cells.append(f"{r['stock_device_ms']:.{digits}f} / {r['ours_device_ms']:.{digits}f} ({step_bound(r, digits)})")
    else:
        cells.append("")
    return " | ".join(cells)


def step_bound(r: dict, digits: int = 2) -> str:
    """What sets the pace of ours' step: "device" where its wall time is within 5% of its kernels' time; else "host"
    where one step's host time reaches its kernels' time (its launches set the pace), or "idle gaps" where it does
    not: the host issues a whole step faster than the GPU runs it, yet the GPU idles inside the step (a phase of
    the step that is host-bound, or a wait on something other than launches: an H200's HF Llama B4 L2048 training
    step, 2026-11-29, took 17.9 ms of wall for ~17 of kernels and 13.5-15 of host, and the same wall under CUDA
    graphs). An entry without a host time (measured before it was recorded) says "host" for any wall time above
    the kernels'.

    >>> step_bound({"ours_ms": 17.9, "ours_device_ms": 16.7, "ours_host_ms": 13.5})
    'idle gaps; host 13.50'
    >>> step_bound({"ours_ms": 12.5, "ours_device_ms": 4.0, "ours_host_ms": 12.1})
    'host'
    >>> step_bound({"ours_ms": 4.0, "ours_device_ms": 3.9})
    'device'
    """
    if r["ours_ms"] <= 1.05 * r["ours_device_ms"]:
        return "device"
    host = r.get("ours_host_ms")
    if host is None or host >= r["ours_device_ms"]:
        return "host"
    return f"idle gaps; host {host:.{digits}f}"


STEP_HEADER = "stock ms | ours ms | stock / ours | device ms, stock / ours (ours bound by)"


def step_bars(llama: dict | None) -> dict | None:
    """The HF Llama entries' plot (report.py ``_summary_plot``): stock's and ours' ms per step; None without any."""
    entries = {name: r for name, r in (llama or {}).items() if isinstance(r, dict) and "stock_ms" in r}
    if not entries:
        return None
    return {"xlabel": "ms per step, plain launches (shorter is faster)", "labels": list(entries),
            "series": {"stock torch.compile": [r["stock_ms"] for r in entries.values()],
                       "ours": [r["ours_ms"] for r in entries.values()]}}


def _ours_ran() -> dict:
    """What ours' compiled code ran (``inductor_attn.stats()``: only ours calls our ops in an entry's process)."""
    import inductor_attn

    return inductor_attn.stats()


class _Choices(logging.Handler):
    """The lowering's lines saying what compiled code runs for each bucket and why (lowering/emit.py logs them at
    INFO), kept once each: an entry reports them beside what ran (``ours_why``)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        line = record.getMessage()
        if line not in self.lines:
            self.lines.append(line)


TRAIN_SIZES = {"B4 L2048": (4, 2048), "B1 L512": (1, 512)}
TRAIN_MODES = ("default", "max-autotune-no-cudagraphs")
TRAIN_CALLS = 10  # steps per round


def _grads(model, step_loss) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    step_loss().backward()
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def worst_rel_err(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """The largest ||got - want|| / ||want|| over pairs of tensors (parameter gradients)."""
    return max(((g.float() - w.float()).norm() / w.float().norm().clamp_min(1e-30)).item() for g, w in zip(got, want))


def llama_training(sizes=TRAIN_SIZES, modes=TRAIN_MODES) -> dict:
    """Per size and mode, in its own process (``isolated``): wall ms of a training step (forward, backward,
    AdamW) and peak memory, stock against ours, and each one's worst parameter-gradient error against
    eager on the same step."""
    return {f"{label} {mode}": isolated("training", label, mode, timeout_s=_timeout_s(mode))
            for label in sizes for mode in modes}


def _timeout_s(mode: str) -> float:
    return MAX_AUTOTUNE_TIMEOUT_S if mode.startswith("max-autotune") else ENTRY_TIMEOUT_S


def _training_entry(label: str, mode: str) -> dict:
    """Stock and ours, each on its own copy of one model with its own AdamW, compiled side by side and timed
    in alternating rounds (``interleaved_wall_us``) as the overhead entries are: stock's step moved by 14%
    between machines, which one-after-the-other timing would fold into the ratio."""
    steps, row = training_steps(label, mode)
    for name, step in steps.items():
        row[f"{name}_peak_bytes"] = peak_memory(step)
    times = interleaved_wall_us(steps, calls=TRAIN_CALLS, rounds=ROUNDS)
    row.update({f"{name}_ms": us / 1e3 for name, us in times.items()}, **_device_and_host_ms(steps), rounds=ROUNDS,
               ours_ran=_ours_ran(), ours_why=_CHOICES.lines)
    return row


def training_steps(label: str, mode: str) -> tuple[dict, dict]:
    """{"stock": step, "ours": step}, warmed up: each a training step (forward, backward, AdamW) of its own
    copy of one HF Llama of size ``label``, compiled in ``mode``; and each one's worst parameter-gradient
    error against eager on the same step."""
    import copy

    batch, length = TRAIN_SIZES[label]
    base = build_llama(**SIZE, max_len=length).train()
    ids = torch.randint(0, 32000, (batch, length), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    eager = _grads(base, lambda: base(input_ids=ids, labels=ids).loss)
    torch._dynamo.reset()
    row, steps = {}, {}
    for backend in BACKENDS:
        model = copy.deepcopy(base)
        compiled = _compiled(model, backend, mode, reset=False)

        def loss(compiled=compiled):
            return compiled(input_ids=ids, labels=ids).loss

        name = "stock" if backend == "inductor" else "ours"
        row[f"{name}_grad_err"] = worst_rel_err(_grads(model, loss), eager)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6)

        def step(opt=opt, loss=loss):
            opt.zero_grad(set_to_none=True)
            loss().backward()
            opt.step()

        steps[name] = warm(step, 3)
    return steps, row


# transformers' continuous batching (``generate_batch``): a fixed batch of prompts, 4 of each length (the eager
# reference batches equal lengths, unpadded), greedy, no end-of-sequence token (random weights: every request
# generates all its tokens)
CB_LENGTHS = (128, 183, 238, 293, 347, 402, 457, 512)
CB_PER_LENGTH = 4
CB_NEW_TOKENS = 128
# timed generate_batch calls per implementation, after the warm-up one: one call generates 4k tokens in 0.6-0.8 s
# on an H200, and one timed call's tokens/s moved by up to 25% between runs of one implementation (2026-11-29); ours
# and FA3's path, taking turns, 0.69-0.80 against 0.66-0.77 s over three calls each with the same Python per call
# (2026-12-01, benchmarks/tools/host_profile.py --continuous-batching): the turns' ratios need calls enough to
# settle.
CB_TIMED_RUNS = 15
# Timed calls stop once they add up to this many seconds (one at least): transformers' SDPA paged path takes
# ~9 s a call on an H200, 14x ours, and five of them pushed the suite past a device call's time.
CB_TIMED_BUDGET_S = 20.0
CB_TOP_KERNELS = 8
CB_SMOKE = dict(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, lengths=(5, 9), per_length=2,
                new_tokens=4)
CB_SMOKE_CACHE = dict(num_blocks=16, max_batch_tokens=64)
# the full run's cache: room for every request at once (32 x 640 tokens in 256-token blocks is 96 blocks). Left to
# itself transformers takes 80-90% of the free device memory for it (~133 GiB on an H200), and the first compile's
# tune (ours) or autotuning then runs out of memory.
CB_CACHE = dict(num_blocks=128, max_batch_tokens=8192)
# transformers' own paged paths: the names to ask for, in order, and the module the path needs. 5.17 takes the
# "paged|" prefix (without it, continuous batching switches sdpa to a flash path where one is installed); 5.24
# drops it (deprecated) and keeps sdpa when told not to switch (``auto_switch_to_flash``); a later version may
# refuse it, hence the plain name after it. A flash path without its module would fetch a kernel from the Hub.
# FlashAttention 2's module is its compiled extension: FA4 (flash-attn-4) installs a `flash_attn` package too.
BUILT_IN = {"sdpa": (("paged|sdpa", "sdpa"), None), "eager": (("paged|eager",), None),
            "flash_attention_2": (("paged|flash_attention_2", "flash_attention_2"), "flash_attn_2_cuda"),
            "flash_attention_3": (("paged|flash_attention_3", "flash_attention_3"), "flash_attn_interface")}
OURS = "inductor_attn"


def cb_workload(smoke: bool) -> tuple[dict, list[list[int]], int]:
    """The model size, the prompts (seeded token ids, in length order) and the new tokens per prompt."""
    size = {k: v for k, v in CB_SMOKE.items() if k in SIZE} if smoke else SIZE
    lengths = CB_SMOKE["lengths"] if smoke else CB_LENGTHS
    per_length = CB_SMOKE["per_length"] if smoke else CB_PER_LENGTH
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 32000, (n,), generator=gen).tolist() for n in lengths for _ in range(per_length)]
    return size, prompts, CB_SMOKE["new_tokens"] if smoke else CB_NEW_TOKENS


# transformers' paths that ours runs beside, taking turns in one process: the first installed
PAIRED = ("flash_attention_3", "flash_attention_2")
TURNS = "+"  # joins the implementations of one entry that take turns


def continuous_batching(smoke: bool) -> dict:
    """tokens/s of ``generate_batch`` with our attention (hf_paged, its decode fast path turned on) and with each
    of transformers' built-in paged paths, and whether each one's greedy tokens are those of eager ``generate``;
    each in a fresh process (``isolated``; compile state and the fast path's switch stay there), except that ours
    and transformers' FlashAttention path (the first installed of ``PAIRED``) share one process and take turns call
    by call (``taking_turns``): a call is host-bound on transformers' own Python, and the host's speed drifts by
    tens of percent between processes minutes apart (H200, 2026-11-30: FA3's call 0.45 s in one process, 0.66-0.70
    s in another), so only calls taking turns compare the two. Where that shared process fails, each runs in a
    process of its own, and ``taking_turns_error`` says why. A path whose module is not installed is skipped with
    the reason, and all of them without transformers."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        return {"skipped": "transformers is not installed"}
    size = "smoke" if smoke else "full"
    _, prompts, new_tokens = cb_workload(smoke)
    reference = isolated("continuous", "reference", size)
    expected, ties = reference.pop("tokens", None), reference.pop("near_ties", None)
    out = {"prompts": len(prompts), "prompt_lengths": sorted({len(p) for p in prompts}), "new_tokens": new_tokens,
           "reference": reference, "implementations": {}}
    installed = {name: module is None or importlib.util.find_spec(module) is not None
                 for name, (_, module) in BUILT_IN.items()}
    partner = next((name for name in PAIRED if installed[name]), None)
    paired = {}
    if partner is not None:
        pair = isolated("continuous", f"{OURS}{TURNS}{partner}", size)
        if "implementations" in pair:
            paired = pair["implementations"]
            if "exit_error" in pair:  # the process died after printing both results
                for result in paired.values():
                    result.setdefault("exit_error", pair["exit_error"])
        else:
            out["taking_turns_error"] = f"{OURS} and {partner} in one process: {pair.get('error')}"
    for name in (OURS, *BUILT_IN):
        if name in paired:
            result = paired[name]
        elif name != OURS and not installed[name]:
            result = {"skipped": f"{BUILT_IN[name][1]} is not installed"}
        else:
            result = isolated("continuous", name, size)
        tokens = result.pop("tokens", None)
        if tokens is not None and expected is not None:
            result.update(agreement(tokens, expected, ties))
        out["implementations"][name] = result
    return out


def agreement(got: list[list[int]], expected: list[list[int]], near_ties: list[list[int]] | None = None) -> dict:
    """How many sequences are token for token the expected ones, the first position where any differs, and
    (given ``near_ties``, per sequence the positions where the expected greedy choice was a near tie, see
    :data:`NEAR_TIE`) how many of the others first differ at one of their near ties.

    >>> agreement([[1, 2], [3, 4], [5, 6]], [[1, 2], [3, 5], [5, 7]], near_ties=[[], [1], []])
    {'identical': 1, 'sequences': 3, 'first_difference': 1, 'differ_at_near_tie': 1}
    """
    firsts = [next((i for i, (a, b) in enumerate(zip(g, e)) if a != b), None if len(g) == len(e) else
                   min(len(g), len(e))) for g, e in zip(got, expected)]
    differ = [i for i in firsts if i is not None]
    out = {"identical": len(firsts) - len(differ), "sequences": len(expected),
           "first_difference": min(differ, default=None)}
    if near_ties is not None:
        out["differ_at_near_tie"] = sum(first is not None and first in ties for first, ties in zip(firsts, near_ties))
    return out


# A greedy step is a near tie when eager's top two logits differ by at most this many units of the model dtype's
# rounding (eps) relative to the larger: a model of random weights has near-uniform logits, so bf16 kernels that
# are each correct to rounding pick different tokens there (on the H200 no path, transformers' own included,
# matched eager on more than 3 of 32 sequences). A path that first differs from eager at a near tie chose
# between two candidates that eager itself cannot tell apart at this precision.
NEAR_TIE = 8


def _continuous_entry(implementation: str, size: str) -> dict:
    """``reference``: eager ``generate``'s greedy tokens, one batch per prompt length. Else ``generate_batch``
    with ``implementation`` (``OURS`` or a ``BUILT_IN`` key) on one manager: the first call warms up (CUDA graphs,
    compiles, tunes: ``first_run_s``), the next ``CB_TIMED_RUNS`` are timed (fewer where they reach
    ``CB_TIMED_BUDGET_S``): new tokens per second of the median one (``timed_s``: each one's seconds, sorted;
    ``turns_s``: in call order, where implementations take turns), then one profiled call (``_device_kernels``).
    Records the attention implementations that ran (transformers may switch), the tokens, and for ours the
    kernels.

    Several implementations joined by ``TURNS``: a model and manager each, warmed up in that order (the first pays
    the process's start-up in its ``first_run_s``), then their timed calls taking turns, who goes first alternating,
    all stopping when one reaches its count or budget; ``{"implementations": {name: its result}}``, each with
    ``taking_turns`` (the others' names)."""
    import transformers

    smoke = size == "smoke"
    if implementation == "reference":
        model, prompts, greedy = _cb_model(smoke)
        tokens, near_ties = _eager_tokens(model, prompts, greedy)
        return {"tokens": tokens, "near_ties": near_ties, "transformers": transformers.__version__}
    names = implementation.split(TURNS)
    sessions = {name: cb_session(name, smoke) for name in names}
    from .. import reset_stats

    reset_stats()
    runs, first_s = {name: [] for name in names}, {}
    timed_calls = 1 if smoke else CB_TIMED_RUNS
    with fast_path(OURS in names):
        for name in names:
            first_s[name] = sessions[name].generate()[1]
        for turn in itertools.count():
            if any(len(runs[n]) >= timed_calls or sum(s for _, s in runs[n]) >= CB_TIMED_BUDGET_S for n in names):
                break
            for name in names if turn % 2 == 0 else names[::-1]:  # who goes first alternates
                runs[name].append(sessions[name].generate())
        profiled = {name: _device_kernels(sessions[name].generate) if not smoke else {} for name in names}
    results = {}
    for name in names:
        tokens, seconds = runs[name][-1][0], sorted(s for _, s in runs[name])
        results[name] = {
            "asked": sessions[name].asked, "ran": sorted(sessions[name].ran),
            "tokens_per_s": sum(map(len, tokens)) / statistics.median(seconds), "timed_s": seconds,
            "first_run_s": first_s[name], "transformers": transformers.__version__, **profiled[name],
            "kernels": _ours_ran() if name == OURS else None, "tokens": tokens,
            **({"taking_turns": [n for n in names if n != name], "turns_s": [s for _, s in runs[name]]}
               if len(names) > 1 else {})}
    return results[names[0]] if len(names) == 1 else {"implementations": results}


def _cb_model(smoke: bool):
    """The continuous-batching workload's model (random weights), prompts and greedy generation config."""
    import transformers

    model_size, prompts, new_tokens = cb_workload(smoke)
    device, dtype = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    model = build_llama(**model_size, max_len=max(map(len, prompts)) + new_tokens, device=device, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    greedy = transformers.GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                                           pad_token_id=0)
    return model, prompts, greedy


class CBSession(NamedTuple):
    """``generate()`` runs ``generate_batch`` over the workload on one persistent manager and returns each prompt's
    tokens and its seconds; ``asked``: the attention name the model was given; ``ran``: the names its first
    layer's attention ran under (filled as calls run)."""

    generate: Callable[[], tuple[list[list[int]], float]]
    asked: str
    ran: set


def cb_session(implementation: str, smoke: bool) -> CBSession:
    """The workload's model with ``implementation``'s attention and its generate function; call it inside
    ``fast_path(implementation == OURS)``. ``benchmarks/tools/host_profile.py`` profiles it too."""
    import transformers

    model, prompts, greedy = _cb_model(smoke)
    ran = set()
    model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda module, args: ran.add(module.config._attn_implementation))
    asked = _ask_for(model, implementation)
    fields = {f.name for f in dataclasses.fields(transformers.ContinuousBatchingConfig)}
    # on a CPU, transformers sizes the cache from the host's memory (10 s of allocating here): a smoke run's is tiny
    wanted = {"auto_switch_to_flash": False, **(CB_SMOKE_CACHE if smoke else CB_CACHE)}
    config = transformers.ContinuousBatchingConfig(**{k: v for k, v in wanted.items() if k in fields})

    def generate() -> tuple[list[list[int]], float]:
        start = time.perf_counter()
        results = model.generate_batch(inputs=prompts, generation_config=greedy, continuous_batching_config=config,
                                       persistent_manager=True)
        seconds = time.perf_counter() - start
        failed = [r.error for r in results.values() if r.error]
        if failed or len(results) != len(prompts):
            raise RuntimeError(f"{len(failed)} of {len(prompts)} requests failed, {len(prompts) - len(results)} "
                               f"missing: {(failed or ['-'])[0]}")
        by_prompt = {tuple(r.prompt_ids): r.generated_tokens for r in results.values()}
        return [by_prompt[tuple(p)] for p in prompts], seconds

    return CBSession(generate, asked, ran)


def _device_kernels(fn) -> dict:
    """One more call of ``fn`` (a ``generate_batch``; the timed calls were its warm-up), profiled: its kernels'
    summed time (``device_s``, against the call's wall time: how much of it the GPU worked) and
    the ``CB_TOP_KERNELS`` kernels that took most of it, in ms (``top_kernels_ms``): where one attention's step
    spends its device time."""
    per_kernel = kernel_ms([fn], calls=1, warm=False)
    top = sorted(per_kernel.items(), key=lambda item: -item[1])[:CB_TOP_KERNELS]
    return {"device_s": sum(per_kernel.values()) / 1e3, "top_kernels_ms": [[name, ms] for name, ms in top]}


def _ask_for(model, implementation: str) -> str:
    """Make ``implementation`` the model's attention; the name that was taken."""
    if implementation == OURS:
        from ..hf_paged import use

        use(model)
        return model.config._attn_implementation
    errors = []
    for name in BUILT_IN[implementation][0]:
        try:
            model.set_attn_implementation(name)
            return name
        except (ValueError, ImportError) as err:  # this transformers takes another spelling
            errors.append(f"{name}: {err}")
    raise RuntimeError(f"transformers took none of the names of {implementation}: " + "; ".join(errors))


@contextlib.contextmanager
def fast_path(on: bool):
    """transformers turns its decode fast path (block table, paged decode) on only for FlashAttention 2/3 on CUDA
    or XPU; for ours it is turned on here, as tests/test_hf_paged.py does: its check is skipped for a model whose
    attention is ours under its default name (``config``, the check's first argument in 5.17 and 5.24) and made
    as before for the others."""
    if not on:
        yield
        return
    from transformers.generation.continuous_batching import initialization

    from ..hf_paged import NAME

    check = initialization.ensure_decode_fast_path_is_available

    def unless_ours(config, *args, **kwargs):
        if NAME not in str(config._attn_implementation):
            check(config, *args, **kwargs)

    initialization.ensure_decode_fast_path_is_available = unless_ours
    try:
        yield
    finally:
        initialization.ensure_decode_fast_path_is_available = check


def _eager_tokens(model, prompts: list[list[int]], greedy) -> tuple[list[list[int]], list[list[int]]]:
    """Eager ``generate``'s greedy tokens for each prompt, the prompts of one length in one batch (no padding),
    and per prompt the positions whose choice was a near tie (:data:`NEAR_TIE`)."""
    tokens, ties = {}, {}
    tie = NEAR_TIE * torch.finfo(model.dtype).eps
    for length in sorted({len(p) for p in prompts}):
        group = [p for p in prompts if len(p) == length]
        ids = torch.tensor(group, device=model.device)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=greedy,
                                 output_scores=True, return_dict_in_generate=True)
        top2 = torch.stack([s.float().topk(2, dim=-1).values for s in out.scores], dim=1)  # (batch, step, 2)
        near = (top2[..., 0] - top2[..., 1]) <= tie * top2[..., 0].abs()
        for p, row, flags in zip(group, out.sequences, near):
            tokens[tuple(p)] = row[length:].tolist()
            ties[tuple(p)] = flags.nonzero().flatten().tolist()
    return [tokens[tuple(p)] for p in prompts], [ties[tuple(p)] for p in prompts]


_ENTRIES = {"overhead": _overhead_entry, "training": _training_entry, "continuous": _continuous_entry}


def isolated(kind: str, *args: str, timeout_s: float = ENTRY_TIMEOUT_S) -> dict:
    """One model entry measured in a fresh process: a device-side assert (which leaves the CUDA context
    unusable) then costs that entry only, and each entry compiles from a clean Dynamo state. The entry's
    result is its process's last line of output (JSON); a failure is recorded with its last error lines."""
    cmd = [sys.executable, "-m", "inductor_attn.bench.models", kind, *args]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode == 0 and lines:
        return json.loads(lines[-1])
    tail = [line.strip() for line in done.stderr.splitlines()
            if line.strip() and "Warning" not in line and not line.startswith("frame #")]
    # a process that aborts (a CUDA error in a destructor) ends its stderr with C++ stack frames: the error is the
    # last line that names one
    errors = [line for line in tail if "Error" in line or "error:" in line or "FAILED" in line]
    error = f"exit {done.returncode}: " + " | ".join(errors[-2:] or tail[-3:])
    if lines and lines[-1].startswith("{"):  # the entry finished and printed its result; the process died after
        return {**json.loads(lines[-1]), "exit_error": error}
    return {"error": error}


_CHOICES = _Choices()

if __name__ == "__main__":
    kind, *entry_args = sys.argv[1:]
    emit_log = logging.getLogger("inductor_attn.lowering.emit")
    emit_log.setLevel(logging.INFO)
    emit_log.addHandler(_CHOICES)
    print(json.dumps(_ENTRIES[kind](*entry_args)))
