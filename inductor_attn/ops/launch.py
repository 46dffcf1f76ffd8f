"""``inductor_attn::launch``: how compiled code runs a plan it cannot hold as traced kernels.

lowering/emit.py replaces an op call decided at compile time by this op where the chosen plan has no
traced form (FA4's CuTe DSL kernels, Triton configs with host-side TMA descriptors, the reference). Its
string argument names the plan: direction, choice, scale and the exact problem, so a fresh process that
replays the compiled code from Inductor's cache rebuilds the plan from it. Per call the op parses nothing
and checks nothing (the fake impl checked at trace time): one dictionary lookup, then the plan's launch.

A block-sparse call with static shapes has a problem known while compiling (its density is a constant of
the graph) but is decided on its real mask: its plan string names the choice ``COMPILED`` and the op
decides per call through ``runtime`` (one cached lookup), sparing the custom op's autograd dispatch and the
problem's construction. Its tensors go on with the mask's five (kv_num_blocks, kv_indices,
full_kv_num_blocks, full_kv_indices, partial_bits).

Defined with ``torch.library.Library`` rather than ``custom_op``: a plain definition dispatches with
fewer Python frames (TensorRT-LLM PR #13149 measured 6.3 us per call against 11.7 us, B200), and this op
needs no autograd: it only appears in graphs after AOTAutograd.
"""

from __future__ import annotations

import torch

from .. import runtime
from ..backends import AttnCall, registry
from ..block_mask import BlockSparseMask
from ..device import device_info
from ..layout import empty_like_layout
from ..problem import Problem

_LIB = torch.library.Library("inductor_attn", "FRAGMENT")
_LIB.define("launch(Tensor?[] tensors, str plan) -> Tensor[]")


def plan_key(direction: str, choice: str, call) -> str:
    """The ``plan`` argument: everything the plan and the call's scalars depend on.

    Tensors (in order): q, k, v, kv_seqlens, key_mask, for the backward out, lse, grad_out, grad_lse, and
    for a block-sparse call the mask's five.
    """
    return "|".join((direction, choice, repr(float(call.scale)), call.problem.key()))


_PLANS: dict[tuple[str, int], tuple] = {}  # (plan string, device index) -> what a call needs


def _resolve(plan: str, device: torch.device) -> tuple:
    direction, choice, scale, problem = plan.split("|", 3)
    p = Problem.from_key(problem)
    launch = None if choice == runtime.COMPILED else runtime.plan_for(p, choice, device_info(device), direction).launch
    return launch, float(scale), p, (p.op, direction, choice), registry.state["generation"]


def _launch(tensors, plan: str):
    q, k, v, kv_seqlens, key_mask = tensors[:5]
    key = (plan, q.get_device())
    found = _PLANS.get(key)
    if found is None or found[4] != registry.state["generation"]:
        found = _PLANS[key] = _resolve(plan, q.device)
    launch, scale, p, stat, _ = found
    rest = tensors[5:]
    if p.op == "block_sparse":
        rest, mask = rest[:-5], rest[-5:]
        sparse = BlockSparseMask((p.len_q, p.len_k), p.block_q, p.block_kv, *mask, p.density, p.partial_fraction)
        call = AttnCall("block_sparse", q, k, v, scale, sparse=sparse, _problem=p)
    else:
        call = AttnCall("attention", q, k, v, scale, p.causal, p.window_left, p.window_right, kv_seqlens,
                        key_mask=key_mask, _problem=p)
    if launch is None:  # decided here, per call, on the real tensors
        run = runtime.forward if stat[1] == "forward" else runtime.backward
        return list(run(call, runtime.COMPILED, *rest))
    runtime.count_call(stat)
    return list(launch(call, *rest))


def _launch_fake(tensors, plan: str):
    q, k, v = tensors[:3]
    if plan.startswith("forward|"):
        return [empty_like_layout(q, (*q.shape[:-1], v.shape[-1])), q.new_empty(q.shape[:-1], dtype=torch.float32)]
    return [empty_like_layout(x, x.shape) for x in (q, k, v)]


_LIB.impl("launch", _launch, "CompositeExplicitAutograd")
torch.library.register_fake("inductor_attn::launch", _launch_fake, lib=_LIB)
launch_op = torch.ops.inductor_attn.launch.default
