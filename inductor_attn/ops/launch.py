"""``inductor_attn::launch``: how compiled code runs a plan it cannot hold as traced kernels.

lowering/emit.py replaces an op call decided at compile time by this op where the chosen plan has no
traced form (FA4's CuTe DSL kernels, Triton configs with host-side TMA descriptors, the reference). Its
string argument names the plan: direction, choice, scale (and a paged call's max_seqlen_k and softcap) and the
exact problem, so a fresh process that replays the compiled code from Inductor's cache rebuilds the plan from it.
Per call the op parses nothing and checks nothing (the fake impl checked at trace time): one dictionary lookup,
then the plan's launch.

Paged calls decided at compile time whose plan has no traced form (the gather baseline, the reference) come
here too, their block_table and cu_seqlens_q last, as an op's own tensors.

Block-sparse and varlen calls with static shapes have a problem known while compiling (a mask's density is
a constant of the graph) but are decided on their real index tensors: their plan string names the choice
``CHECKED`` and the op decides per call through ``runtime`` (one cached lookup), sparing the custom op's
autograd dispatch and the problem's construction. Their tensors go on with the op's own: the mask's five
(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, partial_bits), or cu_seqlens_q and
cu_seqlens_k.

Defined with ``torch.library.Library`` rather than ``custom_op``: a plain definition dispatches with
fewer Python frames (TensorRT-LLM PR #13149 measured 6.3 us per call against 11.7 us, B200), and this op
needs no autograd: it only appears in graphs after AOTAutograd.
"""

from __future__ import annotations

import torch

from .. import runtime
from ..backends import AttnCall, registry
from ..tuning import measure
from ..device import device_info
from ..layout import new_grads, new_outputs
from ..problem import Problem
from .attention import sparse_mask

_LIB = torch.library.Library("inductor_attn", "FRAGMENT")
_LIB.define("launch(Tensor?[] tensors, str plan) -> Tensor[]")


def plan_key(direction: str, choice: str, call) -> str:
    """The ``plan`` argument: everything the plan and the call's scalars depend on: direction, choice, the scalars
    that the problem does not hold (the scale; a paged call's max_seqlen_k, which its problem holds rounded up to
    a power of two, and its softcap) and the problem.

    Tensors (in order): q, k, v, kv_seqlens, key_mask, for the backward out, lse, grad_out, grad_lse, then
    the op's own (``OWN_TENSORS``).
    """
    paged = f",{int(call.max_seqlen_k)},{float(call.softcap)!r}" if call.op == "paged" else ""
    scalars = repr(float(call.scale)) + paged
    return "|".join((direction, choice, scalars, call.problem.key()))


# The launch op's tensors, in order (plan_key's doc): these fields of an AttnCall, a backward's tensors, then the op's
# own (``OWN_TENSORS``); lowering/emit.py names them by the op's arguments (a paged call's k and v: its pools)
SHARED_TENSORS = ("q", "k", "v", "kv_seqlens", "key_mask")
GRAD_TENSORS = ("out", "lse", "grad_out", "grad_lse")
OWN_TENSORS = {"attention": (), "varlen": ("cu_seqlens_q", "cu_seqlens_k"),
               "block_sparse": ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                                "partial_bits"),
               "paged": ("block_table", "cu_seqlens_q")}
_PLANS: dict[tuple[str, int], tuple] = {}  # (plan string, device index) -> what a call needs


def _resolve(plan: str, device: torch.device) -> tuple:
    direction, choice, scalars, problem = plan.split("|", 3)
    scale, *paged = scalars.split(",")
    max_seqlen_k, softcap = paged or (0, 0.0)  # a paged call's (plan_key)
    p = Problem.from_key(problem)
    launch = None if choice == runtime.CHECKED else runtime.plan_for(p, choice, device_info(device), direction).launch
    return (launch, (float(scale), int(max_seqlen_k), float(softcap)), p, (p.op, direction, choice),
            registry.state["generation"])


def _launch(tensors, plan: str):
    q, k, v, kv_seqlens, key_mask = tensors[:len(SHARED_TENSORS)]
    key = (plan, q.get_device())
    found = _PLANS.get(key)
    if found is None or found[4] != registry.state["generation"]:
        found = _PLANS[key] = _resolve(plan, q.device)
    launch, scalars, p, stat, _ = found
    end = len(tensors) - len(OWN_TENSORS[p.op])  # the op's own tensors come last
    rest, own = tensors[len(SHARED_TENSORS):end], tensors[end:]
    call = _call(p, scalars, q, k, v, kv_seqlens, key_mask, own)
    run = runtime.forward if stat[1] == "forward" else runtime.backward
    if launch is None:  # decided here, per call, on the real tensors
        return list(run(call, runtime.CHECKED, *rest))
    try:
        result = list(launch(call, *rest))
    except Exception as err:
        if not runtime.baked_gives_way(call, stat[1], stat[2], err, len(rest) == 4 and rest[3] is not None):
            raise
        _PLANS[key] = (None, *found[1:])  # later calls of this graph go straight to the next candidate: one warning
        return list(run(call, runtime.CHECKED, *rest))
    runtime.count_call(stat)
    return result


def _call(p: Problem, scalars: tuple[float, int, float], q, k, v, kv_seqlens, key_mask, own) -> AttnCall:
    scale, max_seqlen_k, softcap = scalars
    if p.op == "block_sparse":
        sparse = sparse_mask(q, k, *own, p.block_q, p.block_kv, p.density, p.partial_fraction)
        return AttnCall("block_sparse", q, k, v, scale, sparse=sparse, _problem=p)
    if p.op == "varlen":
        return AttnCall("varlen", q, k, v, scale, p.causal, p.window_left, p.window_right, cu_seqlens_q=own[0],
                        cu_seqlens_k=own[1], max_seqlen_q=p.len_q, max_seqlen_k=p.len_k, _problem=p)
    if p.op == "paged":
        return AttnCall("paged", q, k, v, scale, p.causal, p.window_left, p.window_right, kv_seqlens,
                        cu_seqlens_q=own[1], max_seqlen_q=p.len_q, max_seqlen_k=max_seqlen_k, block_table=own[0],
                        softcap=softcap, _problem=p)
    return AttnCall("attention", q, k, v, scale, p.causal, p.window_left, p.window_right, kv_seqlens,
                    key_mask=key_mask, _problem=p)


def _launch_fake(tensors, plan: str):
    q, k, v = tensors[:3]
    if plan.startswith("forward|"):
        return list(new_outputs(Problem.from_key(plan.split("|", 3)[3]).op, q, v))
    return new_grads(q, k, v)


_LIB.impl("launch", _launch, "CompositeExplicitAutograd")
torch.library.register_fake("inductor_attn::launch", _launch_fake, lib=_LIB)
launch_op = torch.ops.inductor_attn.launch.default


def _as_compiled_code_launches(direction: str, choice: str, call, *grads):
    """A launch of ``choice``'s plan for ``call`` through this op, as compiled code makes it, left out of ``stats``
    (the tuner times a candidate's host cost by it); for calls decided at compile time (``DECIDED_AT_COMPILE_TIME``)
    whose plan has no traced form."""
    tensors = [*(getattr(call, name) for name in SHARED_TENSORS), *grads,
               *(getattr(call, name) for name in OWN_TENSORS[call.op])]
    key = plan_key(direction, choice, call)

    def launch():
        with runtime.uncounted():
            return launch_op(tensors, key)
    return launch


measure.thin_op_launch(_as_compiled_code_launches)
