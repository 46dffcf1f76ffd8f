"""Compile every listed config of the Triton flash forward for sm_90 on any machine (no GPU needed) and
report shared memory (Triton's allocation next to the prune estimate), registers and spills (ptxas -v).

    PYTHONPATH=. python benchmarks/tools/triton_flash_compile_sm90.py [problem ...]

The shared-memory estimate and the register rule in inductor_attn/backends/triton_flash/flash.py were
calibrated with this script (triton 3.9, ptxas 13.4). Pointer and stride arguments are declared
16-divisible and the head-dim strides 1, as Triton's JIT specializes real contiguous inputs; without
those hints the loads are not pipelined. Run it without TRITON_INTERPRET.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from inductor_attn.backends.triton_flash.flash import BACKEND, _acc_regs, _reg_limit, _smem_estimate, kernel_constexprs
from inductor_attn.backends.triton_flash.flash_kernel import flash_fwd_kernel
from inductor_attn.device import parse_device_override
from inductor_attn.problem import Problem

SM90 = parse_device_override("sm_90")
POINTERS = ("Q", "K", "V", "O", "LSE", "KV_LENS", "CU_Q", "CU_K", "FULL_CNT", "FULL_IDX", "PART_CNT", "PART_IDX",
            "BITS", "TILES")
UNIT_STRIDES = ("sq_d", "sk_d", "sv_d", "so_d", "sl_m", "sbt_w")
SIZES = ("len_q", "len_k", "window_left", "window_right", "heads_prog", "num_m", "num_bh", "num_tiles", "lpt_heads")
ELEM = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def problem(**kw) -> Problem:
    base = dict(op="attention", dtype="bfloat16", device_type="cuda", batch=2, heads_q=32, heads_kv=32,
                len_q=4096, len_k=4096, head_dim=128, head_dim_v=128)
    return Problem(**{**base, **kw})


PROBLEMS = {
    "d128_causal": problem(causal=True),
    "d64": problem(head_dim=64, head_dim_v=64),
    "d256_window": problem(head_dim=256, head_dim_v=256, window_left=256, window_right=0),
    "gqa4_causal": problem(heads_kv=8, causal=True),
    "decode_gqa4": problem(len_q=1, heads_kv=8, causal=True),
    "varlen_causal": problem(op="varlen", total_q=8192, total_k=8192, causal=True),
    "sparse_128": problem(op="block_sparse", block_q=128, block_kv=128, density=0.1, partial_fraction=0.5),
    "sparse_64": problem(op="block_sparse", block_q=64, block_kv=64, density=0.1, partial_fraction=0.5),
    "fp32_d128": problem(dtype="float32"),
}


def compile_sm90(p: Problem, cfg) -> triton.compiler.CompiledKernel:
    meta = kernel_constexprs(p, cfg)
    options = dict(num_warps=meta.pop("num_warps"), num_stages=meta.pop("num_stages"))
    names = flash_fwd_kernel.arg_names
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(names):
        if name in meta or name in UNIT_STRIDES:
            signature[name] = "constexpr"
            constexprs[(i,)] = meta.get(name, 1)
            continue
        if name in ("K", "V") and meta["TMA"]:
            block_d = meta["BLOCK_D"] if name == "K" else meta["BLOCK_DV"]
            signature[name] = f"tensordesc<{ELEM[p.dtype]}[1,1,{meta['BLOCK_N']},{block_d}]>"
            continue
        if name in POINTERS:
            elem = ELEM[p.dtype] if name in ("Q", "K", "V", "O") else "fp32" if name == "LSE" else "i32"
            signature[name] = "*" + elem
        else:
            signature[name] = "fp32" if name == "qk_scale" else "i32"
        if name != "qk_scale" and name not in SIZES:
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=flash_fwd_kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def ptxas_report(ptx: str) -> str:
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = get_ptxas(90).path
    except (ImportError, AttributeError):
        return "ptxas not found"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        res = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True)
    regs = re.findall(r"Used (\d+) registers", res.stderr)
    spills = re.findall(r"(\d+) bytes spill stores", res.stderr)
    return f"regs {regs[0] if regs else '?'} spill {spills[0] if spills else '?'} B"


def main(names: list[str]) -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: the interpreter compiles nothing")
    for name in names or PROBLEMS:
        p = PROBLEMS[name]
        for cand in BACKEND.configs(p, SM90):
            cfg = cand.config
            head = f"{name:<14} {str(cfg):<80}"
            if cand.pruned:
                print(f"{head} pruned: {cand.pruned}", flush=True)
                continue
            try:
                kernel = compile_sm90(p, cfg)
            except Exception as e:  # noqa: BLE001 - a report tool: show every failure and go on
                print(f"{head} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            est = _smem_estimate(p, cfg) // 1024
            regs = f"{_acc_regs(p, cfg['block_m'], cfg['block_n'], cfg['num_warps'])}/{_reg_limit(p, cfg['schedule'])}"
            print(f"{head} smem {kernel.metadata.shared // 1024} KiB (est {est}), acc+scores {regs}, "
                  f"{ptxas_report(kernel.asm['ptx'])}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
