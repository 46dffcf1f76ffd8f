"""What compiled code would copy before each Triton launch of our traced plans (run by tests/test_lowering.py in a
process without TRITON_INTERPRET, on any machine): each plan traced as the compile-time pass traces it, on meta
tensors, then Inductor's in-place pass (torch/_inductor/fx_passes/reinplace.py) applied; printed as JSON, per plan,
{kernel index: the tensors still to copy}, and under "inputs written" the plan's arguments that the graph copies a
kernel's result back into (an input Inductor must treat as mutated, which also keeps CUDA graphs off). Triton's CUDA
backend targets sm_90 without a GPU: torch's analysis of what a user kernel writes
(torch/_higher_order_ops/triton_kernel_wrap.py) reads the kernel's TTIR, which needs a target, not a device."""

import json

import torch
import triton
from torch._inductor.fx_passes.reinplace import reinplace_inplaceable_ops_core
from torch._subclasses.fake_tensor import FakeTensorMode
from triton.backends.compiler import GPUTarget

from inductor_attn._compat import trace_functional
from inductor_attn.backends import Config, get_backend
from inductor_attn.backends.triton_common import graph_launcher
from inductor_attn.backends.triton_flash.flash_bwd import backward
from inductor_attn.device import DeviceInfo
from inductor_attn.ops.attention import AttnCall
from inductor_attn.ops.paged import paged_call

H100 = DeviceInfo("NVIDIA H100", (9, 0), 132)
CASES = ("triton backward", "triton backward, kv_seqlens", "triton forward", "triton_decode forward, kv_seqlens",
         "triton_decode paged forward", "triton_decode paged forward, cu_seqlens_q")


class Sm90Target:
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


def _bhld(heads: int, length: int) -> torch.Tensor:
    return torch.empty(1, length, heads, 64, dtype=torch.bfloat16, device="meta").transpose(1, 2)


def _traced_forward(backend: str, problem):
    be = get_backend(backend)
    plans = (be.plan(problem, H100, c.config, "forward") for c in be.configs(problem, H100))
    return next(plan.traced for plan in plans if plan.traced is not None)


def _paged_launch(chunks: bool):
    """A paged call's traced split-K launch and its meta arguments: B2 Hq16 Hkv4 D64, a (num_blocks, page_size,
    Hkv, D) pool, 256 keys per sequence; one query each in 16-key pages (a tile spans pages), or with ``chunks`` 8
    query tokens packed by cu_seqlens_q in 64-key pages (a tile lies in one page: one block id a tile)."""
    page = 64 if chunks else 16
    with FakeTensorMode():
        q = torch.empty(8 if chunks else 2, 16, 64, dtype=torch.bfloat16, device="meta")
        k, v = (torch.empty(40, page, 4, 64, dtype=torch.bfloat16, device="meta") for _ in range(2))
        table, lens, cu_q = (torch.empty(*shape, dtype=torch.int32, device="meta")
                             for shape in ((2, 256 // page), (2,), (3,)))

    def call_of(q, k, v, table, lens, cu_q=None):
        return paged_call(q, k, v, table, lens, cu_q, 4 if chunks else 1, 256, 0.125, True, -1, -1)

    args = [q, k, v, table, lens] + ([cu_q] if chunks else [])
    traced = _traced_forward("triton_decode", call_of(*args).problem)
    return (lambda *args: tuple(traced(call_of(*args)))), args


def copies(case: str) -> dict:
    decode, with_lens = case.startswith("triton_decode"), case.endswith("kv_seqlens")
    with FakeTensorMode():
        q, k, v = _bhld(16, 1 if decode else 512), _bhld(4, 512), _bhld(4, 512)
        out, lse = torch.empty_like(q), torch.empty(1, 16, q.shape[2], device="meta")
        grad, lens = torch.empty_like(q), torch.empty(1, dtype=torch.int32, device="meta")

    def call_of(q, k, v, lens):
        return AttnCall("attention", q, k, v, 0.125, not decode, -1, -1, lens if with_lens else None)

    if case.startswith("triton_decode paged"):
        launch, args = _paged_launch(chunks=case.endswith("cu_seqlens_q"))
    elif case.startswith("triton backward"):
        cfg = Config.of(bwd_block_m=32, bwd_block_n=128, bwd_dq="separate", bwd_stages=3, bwd_warps=4)

        def launch(q, k, v, lens, out, lse, grad):
            return tuple(backward(cfg, graph_launcher, call_of(q, k, v, lens), out, lse, grad, None))
        args = [q, k, v, lens, out, lse, grad]
    else:
        traced = _traced_forward(case.split()[0], call_of(q, k, v, lens).problem)

        def launch(q, k, v, lens):
            return tuple(traced(call_of(q, k, v, lens)))
        args = [q, k, v, lens]
    graph = trace_functional(launch, args).graph
    launches = [n for n in graph.nodes if n.target is torch.ops.higher_order.triton_kernel_wrapper_functional]
    if not launches:
        raise AssertionError(f"{case}: no Triton launch traced")
    # the in-place pass turns such a copy back into the launch writing the input itself: look before it
    written = [n.args[0].name for n in graph.nodes
               if n.target is torch.ops.aten.copy_.default and n.args[0].op == "placeholder"]
    reinplace_inplaceable_ops_core(graph)
    found = {n.kwargs["kernel_idx"]: n.kwargs["tensors_to_clone"] for n in launches if n.kwargs["tensors_to_clone"]}
    return {**found, **({"inputs written": written} if written else {})}


if __name__ == "__main__":
    triton.runtime.driver.set_active(Sm90Target())
    print(json.dumps({case: copies(case) for case in CASES}))
