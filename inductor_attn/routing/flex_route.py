"""Graph rewrite of ``flex_attention`` calls with a block mask and no score_mod to
``inductor_attn::block_sparse_attention``.

In the Dynamo graph a flex call is ``torch.ops.higher_order.flex_attention(q, k, v, score_mod_graph,
block_mask_tuple, scale, kernel_options, score_mod_buffers, mask_mod_buffers)``. The block-mask tuple is
``(Q_LEN, KV_LEN, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, ..., Q_BLOCK_SIZE,
KV_BLOCK_SIZE, mask_mod_graph)``: 13 items in torch 2.11, 17 in 2.13 (dq_write_order fields inserted
before the block sizes; torch/nn/attention/flex_attention.py ``BlockMask.as_tuple``), so it is read from
both ends.

Our op needs the bitmaps of the partial blocks. They are computed in the graph, from the mask_mod's own
subgraph inlined on index tensors shaped ``[B', H', q_blocks, slots, block_q, block_kv]`` and packed 32
keys per int32 word. flex lists every kv block in ``kv_indices`` (its last dim is the number of kv
blocks), so this evaluates the mask_mod ``B' * H' * Lq * Lk`` times per call and keeps ``1/8`` byte per
pair; calls whose bitmaps would pass :data:`MAX_BITMAP_BYTES` stay flex. Calls that share a block mask
and mask_mod (every layer of a model) share one bitmap build: neither AOTAutograd nor Inductor merged the
copies in a two-layer test on torch 2.13.

The mask's density is run-time data here, so the op gets ``density = partial_fraction = -1``
("unknown"): the decision is per shape, tuned on the first call's real block mask.

Only with ``INDUCTOR_ATTN_ROUTE_FLEX=1`` (see :data:`ROUTE_ENV`). Left alone, with the reason counted: a score_mod,
captured score_mod buffers, a read of flex's max-score output, a mask built for other lengths, a mask_mod that reads
its batch/head index while the block mask broadcasts over that dim, mask_mods that call anything but known
elementwise ops and indexing by index tensors (they were traced on scalars; on index tensors a reduction would
change meaning), and calls our op's checks refuse (head dims outside [8, 256], index tensors not int32, a block mask
with Hkv heads under GQA). The bitmap limit is checked at the compiled sizes: under dynamic shapes, larger lengths
run with the same graph.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx
from torch.fx.node import map_arg

from .._compat import size_hint, statically_known_true
from ..tuning.settings import env_flag
from . import mask_proof
from .graph_edit import Emitter, Skip, ev, failures_skip

# Opt-in: in training, our block-sparse kernels plus the per-call bitmaps ran slower than compiled flex on
# sliding-window and document masks (forward and backward 0.77-0.78x on an H200, forward alone 1.08-1.24x;
# `bench --suite flex_route`, benchmarks/RESULTS.md), and which of the two wins cannot be measured at compile time
# (the mask is run-time data), so flex keeps its calls by default.
ROUTE_ENV = "INDUCTOR_ATTN_ROUTE_FLEX"

# Bitmaps above this size (B' * H' * Lq * Lk / 8 bytes) are not built per call: 256 MiB is Lq = Lk = 46k
# for a mask shared by batch and heads.
MAX_BITMAP_BYTES = 256 << 20

_FULL = slice(None, None, None)
_FLEX_PARAMS = ("query", "key", "value", "score_mod", "block_mask", "scale", "kernel_options",
                "score_mod_other_buffers", "mask_mod_other_buffers")


def is_flex(node: torch.fx.Node) -> bool:
    hop = getattr(torch.ops.higher_order, "flex_attention", None)
    return node.op == "call_function" and hop is not None and node.target is hop


def _bound_args(node: torch.fx.Node) -> dict:
    bound = dict(zip(_FLEX_PARAMS, node.args)) | dict(node.kwargs)
    bound.setdefault("score_mod_other_buffers", ())
    bound.setdefault("mask_mod_other_buffers", ())
    if set(bound) != set(_FLEX_PARAMS):
        raise Skip("unexpected flex_attention arguments")
    return bound


def _is_identity(score_mod) -> bool:
    """A score_mod subgraph that returns its first input (flex's default when no score_mod is given)."""
    graph = getattr(score_mod, "graph", None)
    if graph is None:
        return False
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    output = next(n for n in graph.nodes if n.op == "output")
    result = output.args[0]
    result = result[0] if isinstance(result, (tuple, list)) and len(result) == 1 else result
    return bool(placeholders) and result is placeholders[0]


def _outputs(node: torch.fx.Node) -> dict[int, torch.fx.Node]:
    """getitem users of the flex call by index: 0 out, 1 lse (log2 based), 2 max scores."""
    outs = {}
    for user in node.users:
        if user.op != "call_function" or user.target is not operator.getitem or not isinstance(user.args[1], int):
            raise Skip("flex_attention's result is used other than by indexing")
        outs[user.args[1]] = user
    if 2 in outs and outs[2].users:
        raise Skip("flex_attention's max-score output is read (our kernels do not produce it)")
    return outs


def routing_requested() -> bool:
    return env_flag(ROUTE_ENV)


def plan_flex(node: torch.fx.Node) -> dict:
    """What the emitter needs, or :class:`Skip` with the reason the call stays flex."""
    if not routing_requested():
        raise Skip(f"not routed unless {ROUTE_ENV}=1: measured slower than flex's own kernel on an H100 "
                   "(benchmarks/RESULTS.md)")
    args = _bound_args(node)
    q, k, v = args["query"], args["key"], args["value"]
    qe, ke, ve = (ev(t) for t in (q, k, v))
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (qe, ke, ve)):
        raise Skip("q/k/v are not 4-D tensors with example values")
    if qe.dtype not in (torch.float16, torch.bfloat16, torch.float32) or not qe.dtype == ke.dtype == ve.dtype:
        raise Skip(f"dtypes {qe.dtype}/{ke.dtype}/{ve.dtype}: routed are fp16, bf16 and fp32, one dtype")
    if not _is_identity(ev(args["score_mod"])) or args["score_mod_other_buffers"]:
        raise Skip("a score_mod is given (only block masks are routed)")
    scale = args["scale"]  # a float, or a node computing it from a symbolic head_dim under dynamic=True
    if not isinstance(ev(scale), (float, torch.SymFloat)) or (isinstance(scale, float) and not math.isfinite(scale)):
        raise Skip("scale is not a float")
    mask = args["block_mask"]
    if not isinstance(mask, (tuple, list)) or len(mask) < 13:
        raise Skip("unexpected block-mask tuple")
    len_q, len_k, cnt, idx, full_cnt, full_idx = mask[:6]
    block_q, block_kv, mask_mod = mask[-3:]
    if not (statically_known_true(ev(len_q) == qe.shape[2]) and statically_known_true(ev(len_k) == ke.shape[2])):
        raise Skip("the block mask was built for other sequence lengths than q/k")
    if not (isinstance(block_q, int) and isinstance(block_kv, int) and block_kv % 32 == 0):
        raise Skip(f"block sizes ({block_q}, {block_kv}): the kv block size must be a multiple of 32")
    cnt_e = ev(cnt)
    if not isinstance(cnt_e, torch.Tensor) or cnt_e.dtype != torch.int32 or cnt_e.dim() != 3:
        raise Skip("kv_num_blocks is not an int32 [B, H, q_blocks] tensor")
    if full_cnt is not None and not isinstance(ev(full_cnt), torch.Tensor):
        raise Skip("full_kv_num_blocks is not a tensor")
    hints = [size_hint(s) for s in (*cnt_e.shape[:2], qe.shape[2], ke.shape[2])]
    if None in hints:
        raise Skip("a size is data-dependent")
    bitmap_bytes = math.prod(hints) // 8  # sizes of this compilation: no guard, so dynamic shapes stay dynamic
    if bitmap_bytes > MAX_BITMAP_BYTES:
        raise Skip(f"its bitmaps would take {bitmap_bytes >> 20} MiB per call (limit {MAX_BITMAP_BYTES >> 20} MiB)")
    subgraph = ev(mask_mod)
    if not isinstance(subgraph, torch.fx.GraphModule):
        raise Skip("the mask_mod is not a subgraph")
    for dim, (placeholder, name) in enumerate(zip(_placeholders(subgraph)[:2], ("batch", "head"))):
        if placeholder.users and not statically_known_true(cnt_e.shape[dim] == qe.shape[dim]):
            raise Skip(f"the mask_mod reads its {name} index but the block mask is shared over that dim")
    outs = _outputs(node)
    lse_base2 = dict(args["kernel_options"]).get("BACKEND", "AUTO") != "FLASH"
    if 1 in outs and outs[1].users and not lse_base2:
        raise Skip("the lse of flex's FLASH backend is read (its base is not pinned down here)")
    return dict(q=q, k=k, v=v, scale=scale, cnt=cnt, idx=idx, full_cnt=full_cnt, full_idx=full_idx,
                len_q=len_q, len_k=len_k,
                block_q=block_q, block_kv=block_kv, mask_mod=mask_mod,
                buffers=tuple(args["mask_mod_other_buffers"]), outs=outs, score_mod=args["score_mod"])


def _placeholders(subgraph: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in subgraph.graph.nodes if n.op == "placeholder"]


# What a mask_mod may do to be evaluated on index tensors instead of scalars with the same meaning: each
# output element depends only on the same element of the inputs (a reduction or a slice would not).
_ELEMENTWISE_FUNCTIONS = frozenset({
    operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge, operator.and_, operator.or_,
    operator.xor, operator.invert, operator.not_, operator.add, operator.sub, operator.mul, operator.floordiv,
    operator.mod, operator.neg, operator.abs, operator.lshift, operator.rshift,
    torch.where, torch.logical_and, torch.logical_or, torch.logical_not, torch.logical_xor, torch.remainder,
    torch.abs, torch.minimum, torch.maximum, torch.clamp, torch.eq, torch.ne, torch.lt, torch.le, torch.gt,
    torch.ge, torch.bitwise_and, torch.bitwise_or, torch.bitwise_xor, torch.bitwise_not,
})
# Tensor methods, called as methods or, as Dynamo in torch 2.11 records ``docs[b, q] == docs[b, kv]``, as
# ``Tensor.__eq__`` (an H100 run routed nothing else)
_ELEMENTWISE_METHODS = frozenset(
    {f"__{op}__" for op in ("eq", "ne", "lt", "le", "gt", "ge", "and", "or", "xor", "invert", "add", "sub", "mul",
                            "floordiv", "mod", "neg", "abs", "lshift", "rshift", "rand", "ror", "rxor", "radd",
                            "rsub", "rmul")}
    | {"to", "int", "long", "bool", "clamp", "remainder", "abs", "eq", "ne", "lt", "le", "gt", "ge",
       "logical_and", "logical_or", "logical_not", "bitwise_and", "bitwise_or", "bitwise_not"})


def _check_elementwise(n: torch.fx.Node) -> None:
    if n.op == "call_function" and n.target is operator.getitem:
        # a gather of one element (a 0-d result in the scalar trace Dynamo recorded); ``docs[b][q]`` or
        # ``valid[b]`` would take a whole row, which on index tensors means something else
        value = n.meta.get("example_value")
        if isinstance(value, torch.Tensor) and value.dim() == 0:
            return
        raise Skip("the mask_mod indexes a whole row or slice of a tensor (only single-element gathers are routed)")
    if n.op == "call_function" and n.target in _ELEMENTWISE_FUNCTIONS:
        return
    name = n.target if n.op == "call_method" else getattr(n.target, "__name__", "")
    is_tensor_method = n.op == "call_method" or getattr(torch.Tensor, name, None) is n.target
    if is_tensor_method and name in _ELEMENTWISE_METHODS:
        return
    raise Skip(f"the mask_mod calls {getattr(n.target, '__name__', n.target)}, not known to be elementwise")


def _inline(emit: Emitter, subgraph: torch.fx.GraphModule, inputs: list) -> torch.fx.Node:
    """Copy the mask_mod's nodes before the call, its placeholders bound to ``inputs``."""
    env = {}
    placeholders = _placeholders(subgraph)
    if len(placeholders) != len(inputs):
        raise Skip(f"the mask_mod subgraph takes {len(placeholders)} inputs, expected {len(inputs)}")
    env.update(zip(placeholders, inputs))
    for n in subgraph.graph.nodes:
        if n.op == "placeholder":
            continue
        if n.op == "output":
            result = map_arg(n.args[0], env.__getitem__)
            return result[0] if isinstance(result, (tuple, list)) else result
        _check_elementwise(n)
        env[n] = emit(n.op, n.target, *map_arg(n.args, env.__getitem__), **map_arg(n.kwargs, env.__getitem__))
    raise Skip("the mask_mod subgraph has no output")


def _partial_bits(emit: Emitter, plan: dict) -> torch.fx.Node:
    """int32 ``[B', H', q_blocks, slots, block_q, block_kv // 32]`` (block_mask.py's layout): the
    mask_mod at every (query, key) of every listed slot, False past the sequence ends and in unlisted
    slots. Positions are clamped before the mask_mod sees them, as flex does (mods that index a length-L
    tensor would read out of range)."""
    fn, method = emit.fn, emit.method
    bq, bk = plan["block_q"], plan["block_kv"]
    cnt, idx = plan["cnt"], plan["idx"]
    device = ev(plan["q"]).device
    len_q, len_k = method("size", plan["q"], 2), method("size", plan["k"], 2)
    sizes = [method("size", idx, d) for d in range(4)]  # B', H', q blocks, slots

    def arange(n):
        return fn(torch.arange, n, dtype=torch.int32, device=device)

    q_pos = fn(operator.getitem, method("unflatten", arange(fn(operator.mul, sizes[2], bq)), 0, (-1, bq)),
               (None, None, _FULL, None, _FULL, None))
    kv_pos = fn(operator.add, fn(operator.mul, fn(operator.getitem, idx, (Ellipsis, None, None)), bk),
                arange(bk))
    batch = fn(operator.getitem, arange(sizes[0]), (_FULL,) + (None,) * 5)
    head = fn(operator.getitem, arange(sizes[1]), (None, _FULL) + (None,) * 4)
    last_q, last_k = fn(operator.sub, len_q, 1), fn(operator.sub, len_k, 1)
    keep = _inline(emit, ev(plan["mask_mod"]), [batch, head, method("clamp", q_pos, max=last_q),
                                                method("clamp", kv_pos, max=last_k), *plan["buffers"]])
    keep_e = ev(keep)
    if not isinstance(keep_e, torch.Tensor) or keep_e.dtype != torch.bool:
        raise Skip("the mask_mod does not give a bool tensor on index tensors")
    slot = fn(operator.getitem, arange(sizes[3]), (_FULL, None, None))
    listed = fn(operator.lt, slot, fn(operator.getitem, cnt, (Ellipsis, None, None, None)))
    in_range = fn(operator.and_, fn(operator.lt, q_pos, len_q), fn(operator.lt, kv_pos, len_k))
    keep = fn(operator.and_, fn(operator.and_, keep, in_range), listed)
    bits = method("to", method("unflatten", keep, -1, (bk // 32, 32)), torch.int32)
    shifts = fn(torch.arange, 32, dtype=torch.int32, device=device)
    # distinct bits: an int32 sum is their OR, bit 31 the sign (no partial sum overflows)
    return method("sum", fn(operator.lshift, bits, shifts), -1, dtype=torch.int32)


def _bits_key(plan: dict) -> tuple:
    """Calls with the same block-mask tensors, lengths (``BlockMask.from_kv_blocks`` can give one set of
    block tensors several ``seq_lengths``) and mask_mod code get the same bitmaps."""
    return (plan["cnt"], plan["idx"], plan["len_q"], plan["len_k"], plan["block_q"], plan["block_kv"],
            ev(plan["mask_mod"]).code, plan["buffers"])


def emit_flex(graph: torch.fx.Graph, node: torch.fx.Node, plan: dict, *, bits_memo: dict) -> None:
    """Replace the call; ``bits_memo`` (one per graph) lets later calls reuse bitmaps already built for
    the same block mask, as every layer of a model reuses one mask (nothing downstream merges them)."""
    out = ev(plan["outs"].get(0))
    if isinstance(out, torch.Tensor) and out.dtype != ev(plan["q"]).dtype:
        raise Skip(f"flex_attention returns {out.dtype} for {ev(plan['q']).dtype} inputs here (autocast)")
    emit = Emitter(graph, node, getattr(ev(plan["q"]), "fake_mode", None))
    # bitmaps are the mask_mod's values when they are built: shared only while nothing writes into what they are
    # built from (a buffer the mask_mod reads, the block mask's tensors), anywhere in the graph; flex calls only
    # read theirs
    read = {x for x in (plan["cnt"], plan["idx"], *plan["buffers"]) if isinstance(x, torch.fx.Node)}
    flex_calls = {n for n in graph.nodes if is_flex(n)}
    key = _bits_key(plan) if mask_proof.mutation_free(read, stop=flex_calls) else None
    with failures_skip(emit):  # whatever fails in the fake evaluation, flex keeps the call
        bits = bits_memo[key] if key in bits_memo else _partial_bits(emit, plan)
        # the op's fake impl checks what flex accepts and we do not (head dims, index dtypes, the block
        # mask's head count): a refusal leaves the call to flex
        result = emit.fn(torch.ops.inductor_attn.block_sparse_attention.default, plan["q"], plan["k"], plan["v"],
                         plan["cnt"], plan["idx"], plan["full_cnt"], plan["full_idx"], bits, plan["block_q"],
                         plan["block_kv"], plan["scale"], -1.0, -1.0, "")
    if key is not None:
        bits_memo[key] = bits
    outs = plan["outs"]
    if 0 in outs:
        outs[0].replace_all_uses_with(emit.fn(operator.getitem, result, 0))
    if 1 in outs:  # flex's lse is base 2 (torch's flex_attention multiplies it by ln 2 when returned)
        lse = emit.fn(operator.getitem, result, 1)
        outs[1].replace_all_uses_with(emit.fn(operator.mul, lse, 1 / math.log(2)))
    for user in list(node.users):
        graph.erase_node(user)
    graph.erase_node(node)
    for subgraph in (plan["score_mod"], plan["mask_mod"]):
        if isinstance(subgraph, torch.fx.Node) and subgraph.op == "get_attr" and not subgraph.users:
            graph.erase_node(subgraph)
