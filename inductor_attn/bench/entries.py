"""What the benchmark gates and times: candidates (``backend:config``) and user baselines.

A user baseline is what people run today without inductor_attn, called directly and not through our
backends:
- dense and decode: ``F.scaled_dot_product_attention`` (``enable_gqa`` for GQA; ``is_causal`` where it
  means the same, i.e. Lq == Lk, else a boolean mask of exactly our semantics: lower-right causal,
  windows, kv_seqlens). In full runs, dense sliding-window workloads also get the anchors' "flex Triton
  (max-autotune)" column.
- varlen: ``torch.nn.attention.varlen.varlen_attn``.
- block-sparse: ``torch.compile(flex_attention)`` with the workload's own BlockMask (its own mask_mod,
  not our bitmaps): max-autotune in full runs; the default compile in --quick, whose budget cannot hold
  max-autotune's tile search.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..backends import AttnCall, Candidate, plan_for
from ..backends.masks import dense_mask_fn
from ..device import device_info
from .suites import Built, Workload

# The baseline of each op, and its label in the report.
BASELINES = {"attention": ("user:sdpa", "SDPA default"), "varlen": ("user:varlen_attn", "torch varlen_attn"),
             "block_sparse": ("user:flex", "flex_attention")}


@dataclass
class Entry:
    """One thing that gets gated and timed: a candidate (``backend:config``) or a user baseline."""

    name: str
    kind: str  # "candidate" | "user"
    make: Callable[[AttnCall], Callable[[], object]] | None  # binds the thing to one call's tensors
    status: str = "untested"  # pruned | failed | wrong | passed | untimed
    reason: str | None = None
    error: float | None = None
    first_call_s: float | None = None
    note: str = ""
    samples: list[float] = field(default_factory=list)

    @property
    def timed(self) -> bool:
        return bool(self.samples)


def candidate_entry(c: Candidate) -> Entry:
    if c.pruned is not None:
        return Entry(c.name, "candidate", None, status="pruned", reason=c.pruned)
    def make(call: AttnCall):
        plan = plan_for(call.problem, c.name, device_info(call.q.device), "forward")
        return lambda: plan.launch(call)

    return Entry(c.name, "candidate", make)


def user_entries(w: Workload, built: Built, flex_max_autotune: bool) -> list[Entry]:
    """The user baselines of a workload (see the module docstring)."""
    call = built.call
    if call.op == "varlen":
        return [varlen_user_entry(call)]
    if call.op == "block_sparse":
        return [flex_user_entry(call, built.block_mask, flex_max_autotune)]
    out = [sdpa_user_entry(call)]
    # max-autotune compiles and benchmarks several flex tile configs per shape: only the sliding-window
    # rows, where flex is what users reach for (the anchors' flex columns), get it
    if flex_max_autotune and w.kind == "dense" and call.window_left >= 0:
        out.append(flex_user_entry(call, _dense_block_mask(call), flex_max_autotune))
    return out


def sdpa_user_entry(call: AttnCall) -> Entry:
    """F.scaled_dot_product_attention as a user calls it: is_causal when it means the same (Lq == Lk),
    otherwise a boolean mask of exactly our semantics (lower-right causal, window, kv_seqlens)."""
    import torch.nn.functional as F

    lq, lk = call.q.shape[2], call.k.shape[2]
    masked = (call.causal and lq != lk) or call.window_left >= 0 or call.window_right >= 0 or (
        call.kv_seqlens is not None and bool((call.kv_seqlens < lk).any()))
    mask = None
    if masked:
        mask = dense_mask_fn(lq, lk, call.causal, call.window_left, call.window_right, call.kv_seqlens,
                             call.q.device)(0, lq)[:, 0]  # (B or 1, 1, Lq, Lk)
    is_causal = call.causal and mask is None
    gqa = call.q.shape[1] != call.k.shape[1]

    def make(c: AttnCall):
        return lambda: F.scaled_dot_product_attention(c.q, c.k, c.v, attn_mask=mask, is_causal=is_causal,
                                                      scale=c.scale, enable_gqa=gqa)

    return Entry("user:sdpa", "user", make)


def varlen_user_entry(call: AttnCall) -> Entry:
    """torch.nn.attention.varlen.varlen_attn; its keyword arguments changed between torch releases
    (first ``is_causal`` and no scale or GQA; later ``window_size``, ``scale``, ``enable_gqa``), so they
    are read from its signature and what it cannot express is pruned with the reason."""
    name = "user:varlen_attn"
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return Entry(name, "user", None, status="pruned", reason="this torch has no torch.nn.attention.varlen")
    params = inspect.signature(varlen_attn).parameters
    kw = {}
    if "scale" in params:
        kw["scale"] = call.scale
    elif abs(call.scale - call.q.shape[-1] ** -0.5) > 1e-12 * call.scale:
        return Entry(name, "user", None, status="pruned", reason="this torch's varlen_attn takes no scale")
    windowed = call.window_left >= 0 or (call.window_right >= 0 and not call.causal)
    if "window_size" in params:
        kw["window_size"] = (call.window_left, 0 if call.causal else call.window_right)
    elif windowed:
        return Entry(name, "user", None, status="pruned", reason="this torch's varlen_attn takes no window")
    elif "is_causal" in params:
        kw["is_causal"] = call.causal
    if call.q.shape[1] != call.k.shape[1]:
        if "enable_gqa" not in params:
            return Entry(name, "user", None, status="pruned", reason="this torch's varlen_attn takes no GQA")
        kw["enable_gqa"] = True

    def make(c: AttnCall):
        return lambda: varlen_attn(c.q, c.k, c.v, c.cu_seqlens_q, c.cu_seqlens_k, c.max_seqlen_q, c.max_seqlen_k,
                                   **kw)

    return Entry(name, "user", make)


def flex_user_entry(call: AttnCall, block_mask, max_autotune: bool) -> Entry:
    """torch.compile(flex_attention) with the user's BlockMask (its own mask_mod, not our bitmaps)."""
    if call.q.device.type != "cuda":
        return Entry("user:flex", "user", None, status="pruned",
                     reason="compiled flex_attention is benchmarked on CUDA only")
    from torch.nn.attention.flex_attention import flex_attention

    mode = "max-autotune-no-cudagraphs" if max_autotune else None
    compiled = torch.compile(flex_attention, fullgraph=True, dynamic=False, mode=mode)
    gqa = call.q.shape[1] != call.k.shape[1]

    def make(c: AttnCall):
        def run():
            with _recompile_room():
                return compiled(c.q, c.k, c.v, block_mask=block_mask, scale=c.scale, enable_gqa=gqa)

        return run

    entry = Entry("user:flex", "user", make)
    entry.note = f"torch.compile mode={mode or 'default'}"
    return entry


def _recompile_room():
    """Every workload compiles flex_attention for a new shape; dynamo's default of 8 entries per
    function would turn later workloads into eager flex without a word."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    return config.patch(**{name: max(getattr(config, name), 256)})


def _dense_block_mask(call: AttnCall):
    from torch.nn.attention.flex_attention import create_block_mask

    lq, lk = call.q.shape[2], call.k.shape[2]
    off, left = lk - lq, call.window_left

    def mask_mod(b, h, q, kv):
        keep = kv <= q + off
        return keep & (kv >= q + off - left) if left >= 0 else keep

    return create_block_mask(mask_mod, None, None, lq, lk, device=call.q.device)
