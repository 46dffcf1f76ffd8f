"""Compile-time decisions and plan emission for the op calls whose choice shapes alone can make.

Dense ``attention`` and ``attention_backward`` calls and ``paged_attention`` calls with static shapes are
decided here, while the graph is compiled: a store hit, or tuning on fresh random inputs of the exact shapes and
strides. A ``kv_seqlens`` or ``key_mask`` argument gets representative values (random lengths over the whole
cache, a mostly-open mask), a paged call a block table naming the pool's pages in random order and queries
spread evenly over its sequences: the kernels' relative speed depends on the shapes, not on those values (a
serving loop's lengths change every step, its shapes never). Which candidate runs is decided for the whole graph
from each candidate's device and host time (tuning/step_cost.py): the tuner's winner under CUDA graphs, the one
that makes this graph's estimated step fastest with plain launches (graph_cost.py). Each call is then replaced
by its plan:

- a plan with ``traced`` (Triton kernels through ``wrap_triton``, SDPA's aten ops): its kernels and torch
  ops, traced with ``make_fx``, so Inductor's generated code launches them: no Python of ours per call (a
  forward whose lse nothing reads traces ``traced_out_only`` where the plan has it: no lse computed);
- otherwise one call of the thin ``inductor_attn::launch`` op (ops/launch.py), whose string argument
  names the plan; the op runs the plan's launch (for FA4 on sm_90, the compiled kernel directly).

The API's compiled checks of index values (``kv_seqlens`` in range; a paged call's lengths and the block ids
they reach) are device-side asserts in the graph, each a reduction kernel of its own or part of one. Where every
op call reading the tensors an assert checks got a plan whose kernel makes that check itself
(``Plan.checks_indices``: split-K decode), the kernels assert instead, with the same text, and the graph's
assert goes: one launch less per call.

Varlen and block-sparse calls are decided at run time, on their real lengths and masks, at one cached lookup
per call (runtime.py). With static shapes their problem is known while compiling (a mask's density is a
constant of the graph), and they go through the thin ``inductor_attn::launch`` op with the choice
``CHECKED``, which spares the custom op's autograd dispatch and the problem's construction per call
(ops/launch.py). Calls with dynamic shapes keep their op call.
"""

from __future__ import annotations

import functools
import logging
import operator
from collections import defaultdict

import torch

from .._compat import cudagraphs_enabled, eager_mode, fake_mode_of, trace_functional
from ..backends import AttnCall
from ..device import device_info, on_device_of
from ..layout import filled_like
from ..ops import (BACKWARD_OPS, FORWARD_OPS, attention_backward_op, attention_op,
                   block_sparse_attention_backward_op, block_sparse_attention_op, paged_attention_op,
                   varlen_attention_backward_op, varlen_attention_op)
from ..ops.attention import sparse_mask
from ..ops.paged import paged_call
from ..messages import KV_SEQLENS_VALUES, PAGED_BLOCK_IDS, PAGED_KV_SEQLENS_VALUES, device_message
from ..ops.launch import GRAD_TENSORS, OWN_TENSORS, SHARED_TENSORS, launch_op, plan_key
from ..runtime import CHECKED, count_compiled, plan_for
from ..tuning.measure import describe, fresh_pool, strict
from ..tuning.step_cost import Bucket, choose_for_graph, launch_costs
from .graph_cost import graph_work

log = logging.getLogger(__name__)

_ALL_OPS = {op._opoverload for op in FORWARD_OPS + BACKWARD_OPS}
# ops decided while compiling where their shapes are static: op -> (op kind, direction)
_COMPILE_TIME = {attention_op._opoverload: ("attention", "forward"),
                 attention_backward_op._opoverload: ("attention", "backward"),
                 paged_attention_op._opoverload: ("paged", "forward")}
# ops decided at run time, whose problem static shapes fix while compiling: op -> (op kind, direction)
_RUN_TIME = {block_sparse_attention_op._opoverload: ("block_sparse", "forward"),
             block_sparse_attention_backward_op._opoverload: ("block_sparse", "backward"),
             varlen_attention_op._opoverload: ("varlen", "forward"),
             varlen_attention_backward_op._opoverload: ("varlen", "backward")}


def emit_plans(graph: torch.fx.Graph, is_inference: bool | None = None) -> None:
    readers, asserts = _index_checks(graph)
    static = []  # (node, args, vals, call, op, direction, bucket key or None for a named choice)
    buckets: dict[tuple, Bucket] = {}
    first_calls: dict[tuple, AttnCall] = {}
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _ALL_OPS:
            continue
        args = _bind(node)
        vals = {name: a.meta.get("val") if isinstance(a, torch.fx.Node) else a for name, a in args.items()}
        if node.target not in _COMPILE_TIME or not _static(vals):
            if not args["choice"] and node.target in _RUN_TIME and _static(vals):
                op, direction = _RUN_TIME[node.target]
                key = plan_key(direction, CHECKED, _run_time_call(op, vals))
                outputs = _emit_launch(graph, node, key, args, vals, _tensor_names(op, direction))
                _replace_outputs(graph, node, outputs)
            elif not args["choice"]:  # decided at run time; the fake impl has checked the arguments
                _set_choice(node, CHECKED)
            continue
        op, direction = _COMPILE_TIME[node.target]
        call = _concrete_call(op, vals)
        key = None
        if not args["choice"]:
            grad_lse = args.get("grad_lse") is not None
            key = (direction, grad_lse, call.problem.bucket())
            if key not in buckets:
                winner, record = _decide(call, direction, grad_lse)
                buckets[key] = Bucket(winner, launch_costs(record) if record else [], calls=0)
                first_calls[key] = call
            buckets[key].calls += 1
        static.append((node, args, vals, call, op, direction, key))
    # a training step's graph runs AOTAutograd's wrappers (graph_cost.py); a user's return_lse in inference does not
    training = (not is_inference if is_inference is not None
                else any(direction == "backward" or _lse_read(node) for node, _, _, _, _, direction, _ in static))
    # the calls whose launches choose_for_graph adds back: those of buckets with measured costs (the winner's among
    # them); the rest of the graph counts the others (a named choice, a record without host times) as it counts
    # any node, not as nothing
    costed = {node for node, *_, key in static
              if key is not None and any(c.name == buckets[key].winner for c in buckets[key].costs)}
    chosen = _choose(graph, buckets, first_calls, costed, training)
    checked_in_kernel = {}  # op node -> (the checks its kernel makes, the index tensors it reads)
    for node, args, vals, call, op, direction, key in static:
        # bound again: an argument may be an output of an op replaced above (a backward reading the out and lse of
        # a forward recomputed in its graph, activation checkpointing; one op's output fed to the next)
        args = _bind(node)
        choice = args["choice"] or chosen[key]
        plan = plan_for(call.problem, choice, device_info(call.q.device), direction)
        names = _tensor_names(op, direction)
        outputs = None
        if plan.traced is not None:
            if plan.warm:
                _warm(plan, call, direction)
            lse_read = direction == "backward" or _lse_read(node)
            traced = plan.traced if lse_read or plan.traced_out_only is None else plan.traced_out_only
            reads = {args.get(name) for name in _INDEX_ARGS} - {None}
            checks = any(message in plan.checks_indices and sources <= reads for _, message, sources in asserts)
            if checks:
                traced = functools.partial(traced, check_indices=True)
            outputs = _inline_traced(graph, node, traced, op, args, vals, names, direction, choice)
            if outputs is not None:
                count_compiled(op, direction, choice)
                if checks:
                    checked_in_kernel[node] = (plan.checks_indices, reads)
        if outputs is None:
            outputs = _emit_launch(graph, node, plan_key(direction, choice, call), args, vals, names)
        _replace_outputs(graph, node, outputs)
    for check, message, sources in asserts:
        done = [checked_in_kernel.get(reader) for source in sources for reader in readers[source]]
        if all(d is not None and message in d[0] and sources <= d[1] for d in done):
            _erase_with_dead_inputs(graph, check)


def _lse_read(node: torch.fx.Node) -> bool:
    """Whether anything reads a forward call's lse (its backward, or the user's ``return_lse``)."""
    return any(user.target is not operator.getitem or user.args[1] == 1 for user in node.users)


def _choose(graph: torch.fx.Graph, buckets: dict, first_calls: dict, nodes: set, training: bool) -> dict:
    """What compiled code runs for each bucket of this graph (step_cost.py): by device time under CUDA graphs,
    by the estimated step time of this graph with plain launches (the rest of the graph: all but ``nodes``, the
    calls whose measured launches are added back;
    ``training``: a graph of a training step). A candidate other than the winner, of a decision not tuned in
    this process, passes the gate here first."""
    if not buckets:
        return {}
    device = next(iter(first_calls.values())).q.device
    rest = None if cudagraphs_enabled() else graph_work(graph, nodes, device_info(device), training)
    chosen = {}
    for key, (choice, why) in choose_for_graph(buckets, rest).items():
        if choice != buckets[key].winner:
            refused = _check_choice(first_calls[key], key[0], choice, key[1])
            if refused:
                choice, why = buckets[key].winner, f"the winner: {choice} failed {refused}"
        log.info("inductor_attn: compiled code runs %s for %s %s: %s", choice, key[0], key[2], why)
        chosen[key] = choice
    return chosen


def _index_checks(graph: torch.fx.Graph):
    """({index tensor node: the op calls that read it as one of ``_INDEX_ARGS``}, [(a device assert of the API's
    index checks, its message (messages.py), the index tensor nodes its condition is computed from)]). An assert
    is the API's when it has one of those checks' texts (through device_message) and its condition is computed
    from index tensors of our op calls alone."""
    readers = defaultdict(set)
    for node in graph.nodes:
        if node.op == "call_function" and node.target in _ALL_OPS:
            bound = _bind(node)
            for name in _INDEX_ARGS:
                if isinstance(bound.get(name), torch.fx.Node):
                    readers[bound[name]].add(node)
    asserts = []
    for node in graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten._assert_async.msg:
            message = _KERNEL_CHECKABLE.get(node.args[1])
            sources = _sources(node.args[0], readers) if message else None
            if sources:
                asserts.append((node, message, sources))
    return readers, asserts


# The API's compiled index checks that a kernel can make instead (Plan.checks_indices), by their asserts' texts,
# and the op arguments they check
_KERNEL_CHECKABLE = {device_message(m): m for m in (KV_SEQLENS_VALUES, PAGED_KV_SEQLENS_VALUES, PAGED_BLOCK_IDS)}
_INDEX_ARGS = ("kv_seqlens", "block_table")


def _sources(node: torch.fx.Node, sources) -> frozenset | None:
    """The nodes of ``sources`` that ``node`` is computed from (walking up through computed nodes), or None
    where it reads another graph input too."""
    found, todo, seen = set(), [node], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in sources:
            found.add(n)
        elif n.op == "call_function":
            todo.extend(n.all_input_nodes)
        else:
            return None
    return frozenset(found)


def _erase_with_dead_inputs(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    inputs = node.all_input_nodes
    graph.erase_node(node)
    for n in inputs:
        if n.op == "call_function" and not n.users:
            _erase_with_dead_inputs(graph, n)


def _bind(node: torch.fx.Node) -> dict:
    schema = node.target._schema
    bound = dict(zip((a.name for a in schema.arguments), node.args)) | dict(node.kwargs)
    for a in schema.arguments:
        if a.name not in bound and a.has_default_value():
            bound[a.name] = a.default_value
    return bound


def _set_choice(node: torch.fx.Node, choice: str) -> None:
    index = [a.name for a in node.target._schema.arguments].index("choice")
    if index < len(node.args):
        node.update_arg(index, choice)
    else:
        node.update_kwarg("choice", choice)


def _static(vals: dict) -> bool:
    """Every shape and scalar argument known while compiling (no SymInt or SymFloat): the problem, and with it the
    choice, can be baked. A paged call's lengths and block ids are values, never shapes."""
    return all(isinstance(s, int) for v in vals.values() if isinstance(v, torch.Tensor) for s in v.shape) and all(
        type(v) in (int, float, bool, str) for v in vals.values() if v is not None and not isinstance(v, torch.Tensor))


def _tensor_names(op: str, direction: str) -> tuple[str, ...]:
    """The op's tensor arguments in the launch op's order (ops/launch.py): q, k, v (a paged call's pools),
    kv_seqlens, key_mask (absent from ops without one), a backward's out, lse, grad_out, grad_lse, then the op's
    own."""
    qkv = ("q", "k_cache", "v_cache") if op == "paged" else SHARED_TENSORS[:3]
    grads = GRAD_TENSORS if direction == "backward" else ()
    return (*qkv, *SHARED_TENSORS[3:], *grads, *OWN_TENSORS[op])


def _run_time_call(op: str, vals: dict) -> AttnCall:
    """The call, on the graph's fake tensors, whose problem names a run-time decided plan."""
    q, k, v = vals["q"], vals["k"], vals["v"]
    if op == "varlen":
        return AttnCall("varlen", q, k, v, vals["scale"], vals["causal"], vals["window_left"], vals["window_right"],
                        cu_seqlens_q=vals["cu_seqlens_q"], cu_seqlens_k=vals["cu_seqlens_k"],
                        max_seqlen_q=vals["max_seqlen_q"], max_seqlen_k=vals["max_seqlen_k"])
    sparse = sparse_mask(q, k, *(vals[n] for n in OWN_TENSORS["block_sparse"]), vals["block_q"], vals["block_kv"],
                         vals["density"], vals["partial_fraction"])
    return AttnCall("block_sparse", q, k, v, vals["scale"], sparse=sparse)


def _concrete_call(op: str, vals: dict) -> AttnCall:
    """Real tensors with the call's shapes, strides and dtypes: fresh normal q/k/v (the tuner makes its own
    copies), lengths drawn over the whole cache (a paged call's: up to max_seqlen_k), a key mask with 90% of keys
    open; a paged call's pools and block table from ``measure.fresh_pool``, its query runs spread evenly."""
    q = vals["q"]
    capacity = vals["max_seqlen_k"] if op == "paged" else vals["k"].shape[2]
    with eager_mode():
        gen = torch.Generator(device=q.device).manual_seed(0)

        def like(x):
            if x.dtype == torch.bool:
                return filled_like(x, lambda t: t.copy_(torch.rand(t.shape, generator=gen, device=t.device) < 0.9))
            if not x.dtype.is_floating_point:
                return filled_like(x, lambda t: t.copy_(torch.randint(1, capacity + 1, t.shape, generator=gen,
                                                                      device=t.device)))
            return filled_like(x, lambda t: t.normal_(generator=gen))

        tensors = {name: like(vals[name]) for name in _tensor_names(op, "forward")
                   if vals.get(name) is not None and name not in (*OWN_TENSORS[op], "k_cache", "v_cache")}
        if op == "paged":
            # pools of the pages the table can name, plus one, as the tuner's own, at most the server's: a server's
            # pool is most of the GPU's memory, and a copy of it while compiling could exhaust it
            num_seqs, width = vals["block_table"].shape
            tensors["k_cache"], tensors["v_cache"], tensors["block_table"] = fresh_pool(
                vals["k_cache"], vals["v_cache"], num_seqs, width, gen, most=vals["k_cache"].shape[0])
            if vals["cu_seqlens_q"] is not None:  # the queries spread evenly, none over max_seqlen_q (check_paged)
                starts = torch.arange(num_seqs + 1, device=q.device) * q.shape[0] // num_seqs
                tensors["cu_seqlens_q"] = starts.int()
        return _call_of(op, vals, tensors)


def _decide(call: AttnCall, direction: str, grad_lse: bool) -> tuple[str, dict | None]:
    from ..tuning import decide_with_record

    with eager_mode(), on_device_of(call.q):  # a graph's device need not be the current one while it compiles
        return decide_with_record(call, device_info(call.q.device), direction, grad_lse=grad_lse)


def _check_choice(call: AttnCall, direction: str, choice: str, grad_lse: bool) -> str | None:
    from ..tuning.decisions import check_choice

    with eager_mode(), on_device_of(call.q):
        return check_choice(call, device_info(call.q.device), direction, choice, grad_lse)


def _warm(plan, call: AttnCall, direction: str) -> None:
    """One eager launch: what the traced launch reads from it (e.g. a persistent grid's programs per SM)."""
    with eager_mode(), on_device_of(call.q):
        if direction == "forward":
            plan.launch(call)
        else:
            out = torch.zeros((*call.q.shape[:-1], call.v.shape[-1]), dtype=call.q.dtype, device=call.q.device)
            plan.launch(call, out, torch.zeros(call.q.shape[:-1], device=call.q.device), torch.zeros_like(out), None)


def _call_of(op: str, args: dict, tensors: dict) -> AttnCall:
    """The call of op ``op`` with the scalars of ``args`` and ``tensors`` (by argument name; absent: None)."""
    scalars = float(args["scale"]), bool(args["causal"]), int(args["window_left"]), int(args["window_right"])
    if op == "paged":
        return paged_call(tensors["q"], tensors["k_cache"], tensors["v_cache"], tensors["block_table"],
                          tensors["kv_seqlens"], tensors.get("cu_seqlens_q"), int(args["max_seqlen_q"]),
                          int(args["max_seqlen_k"]), *scalars, float(args["softcap"]))
    return AttnCall("attention", tensors["q"], tensors["k"], tensors["v"], *scalars, tensors.get("kv_seqlens"),
                    key_mask=tensors.get("key_mask"))


def _inline_traced(graph, node, traced, op: str, args: dict, vals: dict, names, direction: str, choice: str):
    """The traced launch's nodes inserted before ``node``; its outputs. None, with nothing inserted, where the traced
    form cannot be traced (a bug of ours: it raises in strict mode): compiled code then calls the plan's launch
    through the launch op, the path eager calls take, rather than failing the user's compile."""
    present = [n for n in names if args.get(n) is not None]

    def launch(*tensors):
        t = dict(zip(present, tensors))
        call = _call_of(op, args, t)
        if direction == "forward":
            return tuple(traced(call))
        return tuple(traced(call, t["out"], t["lse"], t.get("grad_out"), t.get("grad_lse")))

    try:
        sub = trace_functional(launch, [vals[n] for n in present])
    except Exception as err:
        if strict():
            raise
        log.warning("inductor_attn: the traced form of %s (%s %s) could not be traced (%s); compiled code calls its "
                    "launch through the launch op", choice, op, direction, describe(err))
        return None
    env = dict(zip((p for p in sub.graph.nodes if p.op == "placeholder"), (args[n] for n in present)))
    with graph.inserting_before(node):
        for sub_node in sub.graph.nodes:
            if sub_node.op == "placeholder":
                continue
            if sub_node.op == "output":
                return [env[o] for o in sub_node.args[0]]
            if sub_node.op == "get_attr":  # a tensor constant of the launch: keep it on the graph's module
                name = _unique_attr(graph.owning_module, sub_node.target)
                setattr(graph.owning_module, name, getattr(sub, sub_node.target))
                env[sub_node] = graph.get_attr(name)
                env[sub_node].meta = dict(sub_node.meta)
                continue
            env[sub_node] = graph.node_copy(sub_node, lambda n: env[n])
    raise AssertionError("traced launch has no output")


def _unique_attr(module, base: str) -> str:
    name, i = f"_inductor_attn_{base}", 0
    while hasattr(module, f"{name}_{i}"):
        i += 1
    return f"{name}_{i}"


def _emit_launch(graph, node, key: str, args: dict, vals: dict, names):
    with fake_mode_of([v for v in vals.values() if isinstance(v, torch.Tensor)]):
        fakes = launch_op([vals.get(n) for n in names], key)
    with graph.inserting_before(node):
        launch = graph.call_function(launch_op, ([args.get(n) for n in names], key))
        launch.meta["val"] = list(fakes)
        outputs = []
        for i, fake in enumerate(fakes):
            item = graph.call_function(operator.getitem, (launch, i))
            item.meta["val"] = fake
            outputs.append(item)
    return outputs


def _replace_outputs(graph, node, outputs) -> None:
    for user in list(node.users):
        if user.op == "call_function" and user.target is operator.getitem:
            user.replace_all_uses_with(outputs[user.args[1]])
            graph.erase_node(user)
    if node.users:
        raise AssertionError(f"{node.format_node()} has users other than getitem: {list(node.users)}")
    graph.erase_node(node)
