"""Compile the Triton backward kernels for sm_90 on any machine (no GPU) and report shared memory,
registers and spills (ptxas -v) for every config ``backward_candidates`` lists.

    PYTHONPATH=. python benchmarks/tools/flash_bwd_compile_sm90.py [problem ...]

The launcher in flash_bwd.py runs for real on CPU tensors; its kernel launches are captured instead of
run, and each captured argument list is compiled the way Triton's JIT would specialize it on a GPU
(ints equal to 1 become constants, ints and pointers divisible by 16 carry that hint: without it loads
are not pipelined). Run it without TRITON_INTERPRET. The interpreter tests cannot catch what only the
compiler rejects; this does, and it shows which tiles spill.
"""

from __future__ import annotations

import os
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton_flash_compile_sm90 import ptxas_report  # the forward's probe, beside this one

from inductor_attn.backends.base import AttnCall
from inductor_attn.backends.triton_common import eager_launcher
from inductor_attn.backends.triton_flash import flash_bwd, flash_bwd_kernels
from inductor_attn.block_mask import BlockSparseMask
from inductor_attn.device import parse_device_override

SM90 = parse_device_override("sm_90")
ELEM = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.int32: "i32",
        torch.int64: "i64"}


def _dense(dtype, d, causal=True, heads_kv=8, window=-1) -> AttnCall:
    q = torch.empty(2, 32, 1024, d, dtype=dtype)
    k, v = torch.empty(2, heads_kv, 1024, d, dtype=dtype), torch.empty(2, heads_kv, 1024, d, dtype=dtype)
    return AttnCall("attention", q, k, v, d ** -0.5, causal, window, -1 if window < 0 else 0)


def _varlen(dtype, d) -> AttnCall:
    q, k, v = (torch.empty(2048, h, d, dtype=dtype) for h in (32, 8, 8))
    cu = torch.tensor([0, 1000, 2048], dtype=torch.int32)
    return AttnCall("varlen", q, k, v, d ** -0.5, True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1048,
                    max_seqlen_k=1048)


def _sparse(dtype, d, block=128) -> AttnCall:
    q, k, v = (torch.empty(2, 32, 1024, d, dtype=dtype) for _ in range(3))
    n = 1024 // block
    cnt = torch.ones(1, 1, n, dtype=torch.int32)
    idx = torch.zeros(1, 1, n, 1, dtype=torch.int32)
    bits = torch.zeros(1, 1, n, 1, block, block // 32, dtype=torch.int32)
    sparse = BlockSparseMask((1024, 1024), block, block, cnt, idx, cnt, idx + 1, bits, 0.25, 0.5)
    return AttnCall("block_sparse", q, k, v, d ** -0.5, sparse=sparse)


PROBLEMS = {
    "d128_causal_gqa4": lambda: _dense(torch.bfloat16, 128),
    "d64_causal": lambda: _dense(torch.float16, 64, heads_kv=32),
    "d256_window": lambda: _dense(torch.bfloat16, 256, causal=False, window=256),
    "d128_fp32": lambda: _dense(torch.float32, 128, causal=False),
    "varlen_d128": lambda: _varlen(torch.bfloat16, 128),
    "sparse_128": lambda: _sparse(torch.bfloat16, 128),
    "sparse_64": lambda: _sparse(torch.bfloat16, 128, block=64),
}


class _Capture:
    """Stands in for the kernels module: ``kernel[grid](**kw)`` records (kernel, kw)."""

    def __init__(self):
        self.launches = []

    def __getattr__(self, name):
        fn = getattr(flash_bwd_kernels, name)
        launches = self.launches

        class _Launcher:
            def __getitem__(self, grid):
                return lambda *args, **kw: launches.append((fn, {**dict(zip(fn.arg_names, args)), **kw}))

        return _Launcher()


def compile_sm90(fn, kw) -> triton.compiler.CompiledKernel:
    kw = dict(kw)
    options = dict(num_warps=kw.pop("num_warps", 4), num_stages=kw.pop("num_stages", 3))
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        value = kw[p.name]
        if p.is_constexpr or (isinstance(value, int) and not isinstance(value, bool) and value == 1):
            signature[p.name], constexprs[(i,)] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[p.name] = "*" + ELEM[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]  # GPU allocations are 256-byte aligned
        elif isinstance(value, float):
            signature[p.name] = "fp32"
        else:
            signature[p.name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def main(names: list[str]) -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: the interpreter compiles nothing")
    capture = _Capture()
    flash_bwd._kernels = lambda: capture  # a report tool: the launcher runs, the kernels only compile
    for name in names or PROBLEMS:
        call = PROBLEMS[name]()
        p = call.problem
        for cfg, reason in flash_bwd.backward_candidates(p, SM90):
            if reason:
                print(f"{name:<17} {str(cfg):<75} pruned: {reason}", flush=True)
                continue
            capture.launches.clear()
            out_shape = (*call.q.shape[:-1], call.v.shape[-1])
            out = torch.zeros(out_shape, dtype=call.q.dtype)
            lse = torch.zeros(call.q.shape[1], call.q.shape[0]) if p.op == "varlen" else torch.zeros(out_shape[:-1])
            flash_bwd.backward(cfg, eager_launcher, call, out, lse, out, None)
            for fn, kw in capture.launches:
                if fn.__name__ == "bwd_preprocess":
                    continue
                head = f"{name:<17} {str(cfg):<75} {fn.__name__:<5}"
                try:
                    kernel = compile_sm90(fn, kw)
                except Exception as e:  # noqa: BLE001 - a report tool: show every failure and go on
                    print(f"{head} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                    continue
                print(f"{head} smem {kernel.metadata.shared // 1024:>3} KiB, {ptxas_report(kernel.asm['ptx'])}",
                      flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
