"""What the benchmark gates and times: candidates (``backend:config``) and user baselines.

Candidates run through their plans, as the tuner runs them (tuning/measure.py). In the backward suite a
candidate is a backward config run after the forward that the tuner picked for the problem: a training
step's attention, forward and backward kernels.

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
- backward: SDPA's forward and, through autograd, its backward with the same output gradient as ours.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..backends import AttnCall, Candidate, get_backend, plan_for
from ..backends.masks import dense_mask_fn
from ..tuning.measure import Direction, Trial, candidate_trial, is_candidate_error
from .suites import Built, Workload

# The baseline of each suite, and its label in the report.
BASELINES = {"dense": ("user:sdpa", "SDPA default"), "decode": ("user:sdpa", "SDPA default"),
             "varlen": ("user:varlen_attn", "torch varlen_attn"), "block_sparse": ("user:flex", "flex_attention"),
             "backward": ("user:sdpa", "SDPA default")}


@dataclass
class Entry:
    """One thing that gets gated and timed: a candidate (``backend:config``) or a user baseline, with
    what the gate and the timer found."""

    name: str
    kind: str  # "candidate" | "user"
    trial: Trial | None  # None: pruned, never run
    status: str = "untested"  # pruned | failed | wrong | passed | untimed
    reason: str | None = None
    error: float | None = None
    first_call_s: float | None = None
    note: str = ""
    samples: list[float] = field(default_factory=list)

    @property
    def timed(self) -> bool:
        return bool(self.samples)


def candidate_entry(c: Candidate, direction: Direction, forward_choice: str | None = None) -> Entry:
    """A candidate run through its plan in ``direction``, as the tuner runs it; a backward candidate after
    the forward ``forward_choice`` (see the module docstring)."""
    if c.pruned is not None:
        return Entry(c.name, "candidate", None, status="pruned", reason=c.pruned)
    if direction.direction == "forward":
        return Entry(c.name, "candidate", candidate_trial(c.name, direction))
    backends = (get_backend(c.backend), get_backend(forward_choice.partition(":")[0]))
    grad_out = direction.grads[2]

    def bind(call: AttnCall):
        forward = plan_for(call.problem, forward_choice, direction.dev, "forward")
        backward = direction.plan(call, c.name)

        def step():
            out, lse = forward.launch(call)
            return backward.launch(call, out, lse, grad_out, None)

        return step

    def cannot_run(err: BaseException) -> bool:
        return any(is_candidate_error(err, b) for b in backends)

    return Entry(c.name, "candidate", Trial(c.name, bind, cannot_run))


def user_entry(name: str, make: Callable[[AttnCall], Callable[[], object]]) -> Entry:
    """A user baseline: torch's code, so anything it raises means it cannot run here (never our bug)."""
    return Entry(name, "user", Trial(name, make, cannot_run=lambda err: True, ours=False))


def pruned_user_entry(name: str, reason: str) -> Entry:
    return Entry(name, "user", None, status="pruned", reason=reason)


def user_entries(w: Workload, built: Built, direction: Direction, flex_max_autotune: bool) -> list[Entry]:
    """The user baselines of a workload (see the module docstring)."""
    call = built.call
    if call.op == "varlen":
        return [varlen_user_entry(call)]
    if call.op == "block_sparse":
        return [flex_user_entry(call, built.block_mask, flex_max_autotune)]
    if direction.direction == "backward":
        return [sdpa_training_entry(call, direction.grads[2])]
    out = [sdpa_user_entry(call)]
    # max-autotune compiles and benchmarks several flex tile configs per shape: only the sliding-window
    # rows, where flex is what users reach for (the anchors' flex columns), get it
    if flex_max_autotune and w.kind == "dense" and call.window_left >= 0:
        out.append(flex_user_entry(call, _dense_block_mask(call), flex_max_autotune))
    return out


def sdpa_user_entry(call: AttnCall) -> Entry:
    sdpa = _sdpa_as_users_call_it(call)
    return user_entry("user:sdpa", lambda c: lambda: sdpa(c.q, c.k, c.v, c.scale))


def sdpa_training_entry(call: AttnCall, grad_out: torch.Tensor) -> Entry:
    """SDPA's forward, then its backward through autograd with ``grad_out``: returns (dq, dk, dv)."""
    sdpa = _sdpa_as_users_call_it(call)
    return user_entry("user:sdpa", autograd_step(lambda q, k, v: sdpa(q, k, v, call.scale), grad_out))


def autograd_step(forward: Callable[..., torch.Tensor], grad_out: torch.Tensor):
    """``bind`` of a user's forward and backward: ``forward(q, k, v)`` on leaves that require grad, then
    ``torch.autograd.grad`` with ``grad_out``; the run returns (dq, dk, dv)."""
    def bind(c: AttnCall):
        leaves = [x.detach().requires_grad_() for x in (c.q, c.k, c.v)]
        return lambda: torch.autograd.grad(forward(*leaves), leaves, grad_out)

    return bind


def _sdpa_as_users_call_it(call: AttnCall):
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

    def sdpa(q, k, v, scale):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=gqa)

    return sdpa


def varlen_user_entry(call: AttnCall) -> Entry:
    """torch.nn.attention.varlen.varlen_attn; its keyword arguments changed between torch releases
    (first ``is_causal`` and no scale or GQA; later ``window_size``, ``scale``, ``enable_gqa``), so they
    are read from its signature and what it cannot express is pruned with the reason."""
    name = "user:varlen_attn"
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return pruned_user_entry(name, "this torch has no torch.nn.attention.varlen")
    params = inspect.signature(varlen_attn).parameters
    kw = {}
    if "scale" in params:
        kw["scale"] = call.scale
    elif abs(call.scale - call.q.shape[-1] ** -0.5) > 1e-12 * call.scale:
        return pruned_user_entry(name, "this torch's varlen_attn takes no scale")
    windowed = call.window_left >= 0 or (call.window_right >= 0 and not call.causal)
    if "window_size" in params:
        kw["window_size"] = (call.window_left, 0 if call.causal else call.window_right)
    elif windowed:
        return pruned_user_entry(name, "this torch's varlen_attn takes no window")
    elif "is_causal" in params:
        kw["is_causal"] = call.causal
    if call.q.shape[1] != call.k.shape[1]:
        if "enable_gqa" not in params:
            return pruned_user_entry(name, "this torch's varlen_attn takes no GQA")
        kw["enable_gqa"] = True

    def make(c: AttnCall):
        return lambda: varlen_attn(c.q, c.k, c.v, c.cu_seqlens_q, c.cu_seqlens_k, c.max_seqlen_q, c.max_seqlen_k,
                                   **kw)

    return user_entry(name, make)


def flex_user_entry(call: AttnCall, block_mask, max_autotune: bool) -> Entry:
    """torch.compile(flex_attention) with the user's BlockMask (its own mask_mod, not our bitmaps)."""
    if call.q.device.type != "cuda":
        return pruned_user_entry("user:flex", "compiled flex_attention is benchmarked on CUDA only")
    from torch.nn.attention.flex_attention import flex_attention

    mode = "max-autotune-no-cudagraphs" if max_autotune else None
    compiled = torch.compile(flex_attention, fullgraph=True, dynamic=False, mode=mode)
    gqa = call.q.shape[1] != call.k.shape[1]

    def make(c: AttnCall):
        def run():
            with recompile_room():
                return compiled(c.q, c.k, c.v, block_mask=block_mask, scale=c.scale, enable_gqa=gqa)

        return run

    entry = user_entry("user:flex", make)
    entry.note = f"torch.compile mode={mode or 'default'}"
    return entry


def recompile_room():
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
