"""Host cost of one block-sparse attention call, layer by layer (H100/H200; about a minute).

    PYTHONPATH=. python benchmarks/op_host_cost_gpu.py

The sliding window 256 of flex_route_gpu.py (B4 H32 L4096 D128 bf16, 128x128 blocks), with the kernel
fixed to the 64x32 config, called three ways: the backend directly (``BACKEND.run``), the custom op in
eager mode (``torch.ops.inductor_attn.block_sparse_attention`` with the choice baked), and the custom op
with an empty choice (decided at run time from the store). For each: the time per call of 50 calls
launched back to back (the larger of host and GPU time per call), and the host time alone (a tiny
problem with the same structure, B1 H1 L256, whose kernel takes a few microseconds).
"""

from __future__ import annotations

import torch
from triton_flash_gpu import back_to_back_ms, window_block_mask

import inductor_attn  # noqa: F401  (registers the ops)
from inductor_attn.backends import Config
from inductor_attn.backends.base import AttnCall
from inductor_attn.backends.triton_flash.flash import BACKEND

CFG = Config.of(block_m=64, block_n=32, num_stages=3, num_warps=4, schedule="tile", tma=True)


def ways(b, h, length):
    sparse = window_block_mask(length)[1]
    q, k, v = (torch.randn(b, h, length, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    call = AttnCall("block_sparse", q, k, v, 128 ** -0.5, sparse=sparse)
    op = torch.ops.inductor_attn.block_sparse_attention.default
    args = (q, k, v, sparse.kv_num_blocks, sparse.kv_indices, sparse.full_kv_num_blocks, sparse.full_kv_indices,
            sparse.partial_bits, sparse.block_q, sparse.block_kv, 128 ** -0.5, sparse.density,
            sparse.partial_fraction)
    return {"backend run": lambda: BACKEND.run(call, CFG),
            "op, choice baked": lambda: op(*args, f"triton:{CFG}"),
            "op, decided at run time": lambda: op(*args, "")}


def main() -> None:
    big, tiny = ways(4, 32, 4096), ways(1, 1, 256)
    print(f"{'way':<26} {'B4 H32 L4096 ms/call':>22} {'B1 H1 L256 ms/call (host)':>27}")
    for name in big:
        print(f"{name:<26} {back_to_back_ms(big[name]):22.3f} {back_to_back_ms(tiny[name]):27.3f}")


if __name__ == "__main__":
    main()
