"""The host and device time of a compiled graph's other work, estimated from its FX graph (lowering/graph_cost.py)."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from inductor_attn.device import parse_device_override
from inductor_attn.lowering import graph_cost

H200 = parse_device_override("NVIDIA H200:9.0:132")


def _graph(fn, *shapes, dtype=torch.bfloat16):
    return make_fx(fn, tracing_mode="fake")(*(torch.empty(s, dtype=dtype) for s in shapes)).graph


def test_a_large_matmul_is_charged_its_flops_at_the_matrix_rate():
    graph = _graph(lambda a, b: a @ b, (4096, 4096), (4096, 4096))
    work = graph_cost.graph_work(graph, set(), H200)
    assert work.device_ms == pytest.approx(2 * 4096 ** 3 / 790e12 * 1e3 + graph_cost.DEVICE_PER_NODE_MS, rel=1e-6)
    assert work.host_ms == pytest.approx(graph_cost.GRAPH_CALL_MS + graph_cost.HOST_PER_NODE_MS)


def test_a_decode_matmul_is_charged_the_bytes_of_its_weight():
    graph = _graph(lambda x, w: x @ w, (4, 4096), (4096, 4096))
    work = graph_cost.graph_work(graph, set(), H200)
    nbytes = (4 * 4096 + 4096 * 4096 + 4 * 4096) * 2
    assert work.device_ms == pytest.approx(nbytes / 4.3e12 * 1e3 + graph_cost.DEVICE_PER_NODE_MS, rel=1e-6)


def test_views_and_tuple_items_cost_nothing_and_skipped_calls_are_left_out():
    def fn(x):
        y = x.view(64, 64).t().reshape(-1)
        return torch.split(y, 2048)[0] * 2, torch.exp(y)

    graph = _graph(fn, (4096,), dtype=torch.float32)
    computing = [n for n in graph.nodes if n.op == "call_function" and not graph_cost._folded(n)]
    assert sorted(str(n.target) for n in computing) == ["aten.clone.default", "aten.exp.default", "aten.mul.Tensor"]
    work = graph_cost.graph_work(graph, {computing[0]}, H200)
    assert work.host_ms == pytest.approx(graph_cost.GRAPH_CALL_MS + 2 * graph_cost.HOST_PER_NODE_MS)


def test_a_graph_of_a_training_step_costs_more_host_time_to_call():
    graph = _graph(lambda x: x * 2, (64,), dtype=torch.float32)
    inference, training = (graph_cost.graph_work(graph, set(), H200, t).host_ms for t in (False, True))
    assert training - inference == pytest.approx(graph_cost.TRAINING_GRAPH_CALL_MS - graph_cost.GRAPH_CALL_MS)


def test_an_unknown_gpu_gets_rates_in_proportion_to_its_sms():
    flops, nbytes = graph_cost.device_rates(parse_device_override("NVIDIA RTX 9000:12.0:66"))
    assert flops == pytest.approx(790e12 / 2) and nbytes == pytest.approx(1.5e12)
