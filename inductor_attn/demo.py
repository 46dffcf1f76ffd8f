"""``python -m inductor_attn demo``: a small transformer block through torch.compile and our ops."""

from __future__ import annotations

import time

import torch
from torch import nn

from . import runtime as dispatch
from .api import attention


class Block(nn.Module):
    """Pre-norm decoder block with grouped-query causal attention (8 query heads, 2 kv heads)."""

    def __init__(self, dim: int = 256, heads: int = 8, kv_heads: int = 2):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, window: int | None = None) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], -1)
        q, k, v = (t.view(b, n, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))  # strided views
        y = attention(q, k, v, causal=True, window=window)
        x = x + self.proj(y.transpose(1, 2).reshape(b, n, -1))
        return x + self.mlp(self.norm2(x))


def run_demo(device: str | None = None) -> int:
    """Run the demo on ``device`` ("cpu" or "cuda"; None: cuda if available); ValueError for another device,
    or cuda where there is none."""
    if device not in (None, "cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda needs a CUDA GPU, and torch finds none here (torch.cuda.is_available() is "
                         "False)")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    model = Block().to(device, dtype).eval()
    x = torch.randn(2, 256, 256, device=device, dtype=dtype)
    print(f"inductor_attn demo on {device} ({torch.cuda.get_device_name() if device == 'cuda' else 'no GPU'}), "
          f"torch {torch.__version__}, dtype {str(dtype).removeprefix('torch.')}")
    with torch.no_grad():
        expected = [model(x), model(x, window=64)]
        compiled = torch.compile(model, fullgraph=True)
        start = time.perf_counter()
        dispatch.reset_stats()
        got = [compiled(x), compiled(x, window=64)]
        seconds = time.perf_counter() - start
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    ok = True
    for name, e, g in zip(("causal", "causal + window 64"), expected, got):
        err = ((g.float() - e.float()).norm() / e.float().norm()).item()
        ok &= err < tol
        print(f"  {name:20s} compiled vs eager: rel. error {err:.2e} ({'ok' if err < tol else 'MISMATCH'})")
    print(f"  compile + first run: {seconds:.1f} s")
    print("  attention calls, and the kernel that ran each (compiled):")
    ran = dispatch.stats()
    for line, n in ran.items():
        print(f"    {n} x {line}")
    if device == "cpu" and all(line.endswith("-> reference:default") for line in ran):  # else TRITON_INTERPRET=1
        print("  (no GPU here: the reference backend is the only candidate)")
    return 0 if ok else 1
