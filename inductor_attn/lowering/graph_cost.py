"""How much host and device time a compiled graph spends besides its attention calls (step_cost.py's ``H`` and
``D``), estimated from the post-grad FX graph while it is compiled.

Host: Inductor's generated code spends about the same CPU time per graph node, whatever the node: a kernel
launch, an allocation or a fused group's share of one. Calibrated on stock ``torch.compile`` of the HF Llama
steps of bench/models.py on an H200 host (2026-11-29): 458 nodes cost 4.30 ms of host per decode step (9.4 us a
node), 411 nodes 4.84 ms per B4 L2048 prefill (11.8 us), plus the graph's own call: 38 us for an inference
graph of one ``q + 1`` (the compiled frame's guards, the wrapper), and about 450 us for each graph of a
training step (AOTAutograd's wrappers around its forward, the autograd engine around its backward: a
one-layer B4 H16/4 L2048 D64 fwd+bwd step of stock compile took 979 us per step on the host for 428 us of
kernels, about 900 us of it outside its two attention launches). A graph is taken for one of a training step
where it holds a backward call or a forward call whose lse it keeps (for the backward). Nodes that Inductor
folds into the outputs' strides (views, ``getitem``) are not counted.

Device: a roofline per node, floating-point work at the device's matrix rate (``torch.utils.flop_counter``'s
formulas: matmuls, convolutions, SDPA) or its output bytes (and a matmul's inputs) at memory bandwidth,
whichever is larger, and a floor per node for a kernel's start and tail: the same steps measured 0.65 ms
(decode) and 5.3 ms (prefill, 0.8 ms of it attention) of kernels, against 0.60 and 4.4 estimated.

Both are rough, and the rule needs them only where a graph is close to balanced; under CUDA graphs no
estimate is made (step_cost.py).
"""

from __future__ import annotations

import operator

import torch
from torch.utils.flop_counter import flop_registry

from .._compat import size_hint
from ..device import DeviceInfo
from ..tuning.step_cost import GraphWork

HOST_PER_NODE_MS = 0.010
GRAPH_CALL_MS = 0.038
TRAINING_GRAPH_CALL_MS = 0.45
DEVICE_PER_NODE_MS = 0.001
# (bf16 matrix FLOP/s, memory bytes/s) measured on this workplace's H200s (a large matmul on random data, a
# device-to-device copy; KINDS.md, 2026-11-04); an H100 SXM has the same matrix rate and 3.35 TB/s of HBM3
# by its datasheet (4.8 for the H200), scaled by that ratio. Other GPUs: the H100's per-SM rates.
RATES = {"H200": (790e12, 4.3e12), "H100": (790e12, 3.0e12)}
_PER_SM = (790e12 / 132, 3.0e12 / 132)


def device_rates(dev: DeviceInfo) -> tuple[float, float]:
    """(FLOP/s, bytes/s) of ``dev`` for the roofline.

    >>> from inductor_attn.device import parse_device_override
    >>> device_rates(parse_device_override("NVIDIA H200:9.0:132"))
    (790000000000000.0, 4300000000000.0)
    """
    for name, rates in RATES.items():
        if name in dev.name:
            return rates
    return _PER_SM[0] * dev.sm_count, _PER_SM[1] * dev.sm_count


def graph_work(graph: torch.fx.Graph, skip: set, dev: DeviceInfo, training: bool = False) -> GraphWork:
    """The estimated host and device ms of ``graph``'s nodes other than ``skip`` (the calls being decided);
    ``training``: a graph of a training step (its call costs more host time)."""
    flops_per_s, bytes_per_s = device_rates(dev)
    nodes, device_ms = 0, 0.0
    for node in graph.nodes:
        if node.op != "call_function" or node in skip or _folded(node):
            continue
        nodes += 1
        flops, nbytes = _flops(node), _bytes(node.meta.get("val"))
        if flops:
            nbytes += sum(_bytes(a.meta.get("val")) for a in node.all_input_nodes)
        device_ms += max(flops / flops_per_s, nbytes / bytes_per_s) * 1e3 + DEVICE_PER_NODE_MS
    call_ms = TRAINING_GRAPH_CALL_MS if training else GRAPH_CALL_MS
    return GraphWork(host_ms=call_ms + nodes * HOST_PER_NODE_MS, device_ms=device_ms)


def _folded(node: torch.fx.Node) -> bool:
    """Nodes generated code turns into no work of its own: views (strides of a buffer; ``_unsafe_view`` is one
    without saying so in its schema) and tuple items."""
    target = node.target
    return (target is operator.getitem or getattr(target, "is_view", False)
            or target is torch.ops.aten._unsafe_view.default)


def _flops(node: torch.fx.Node) -> int:
    formula = flop_registry.get(getattr(node.target, "overloadpacket", None))
    if formula is None:
        return 0
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    try:
        return size_hint(formula(*args, **kwargs, out_val=node.meta.get("val"))) or 0
    except (TypeError, ValueError, AttributeError, IndexError):  # a value the formula cannot read: no estimate
        return 0


def _bytes(val) -> int:
    if isinstance(val, torch.Tensor):
        return (size_hint(val.numel()) or 0) * val.element_size()
    if isinstance(val, (tuple, list)):
        return sum(_bytes(v) for v in val)
    return 0
