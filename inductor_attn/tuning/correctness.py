"""Correctness gate: a candidate may win only after matching the reference on the problem.

Tolerances are relative Frobenius errors ||out - ref|| / ||ref|| against a float64-accumulated
reference, per input dtype (bf16 operands land between 1e-3 and 1e-2; the bounds leave room for the
rounding of the output itself). One norm over the whole tensor lets a few wrong rows through (a tail tile
left unwritten: 14 zeroed rows of 4,096 moved the fp8 error from 0.037 to 0.058), so an output's rows are
checked one by one too, each against its own norm, with a bound (``ROW_BOUND``) that rounding never
reaches and a wrong row always does. Not gradients: a key's dk and dv rows sum over every query that sees
it, and their norms and rounding vary too much between rows for one bound.

fp8 (float8_e4m3fn) is measured against the reference of the *dequantised* inputs, so the inputs' own
quantisation is not counted: what is left is the kernel's. FA3 rounds the softmax weights P to e4m3 for the
second GEMM (3 mantissa bits: a relative rounding error uniform in +-2^-4, RMS 2^-4 / sqrt(3) = 3.6%), and
with zero-mean values that error's share of ``P @ V`` stays near that RMS; the bfloat16 output adds 0.4%.
So 3.7% is expected and the bound is 6e-2. To be confirmed on the GPU: benchmarks/tools/fp8_error.py
prints the distribution of FA3 fp8's errors over shapes and seeds. The lse comes from the exact fp8 products
accumulated in float32, so the fp16 bound serves.
"""

from __future__ import annotations

import torch

TOLERANCES = {
    torch.float64: 1e-10,
    torch.float32: 1e-4,   # a tf32 dot (Triton's float32 default on GPUs) lands near 3e-4 of the inputs' scale
    torch.float16: 5e-3,
    torch.bfloat16: 2e-2,
    torch.float8_e4m3fn: 6e-2,
}
LSE_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 1e-3, torch.bfloat16: 1e-2,
                 torch.float8_e4m3fn: 1e-3}
POISON = float("nan")
# a row of an output (one query of one head) may be off by ROW_FACTOR times its dtype's bound, at least ROW_FLOOR:
# a zeroed or garbage row is off by about 1
ROW_FACTOR, ROW_FLOOR = 10, 0.1


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere gives inf, both zero gives 0."""
    out, ref = out.double(), ref.double()
    if torch.isnan(out).any():
        return float("inf")
    finite = torch.isfinite(ref)
    if not torch.equal(finite, torch.isfinite(out)) or not torch.equal(ref[~finite], out[~finite]):
        return float("inf")
    num = (out[finite] - ref[finite]).norm().item()
    den = ref[finite].norm().item()
    return num / den if den > 0 else num


def check_tensor(name: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype,
                 rows: bool = False) -> str | None:
    """None if ``got`` matches ``want`` within the dtype's tolerance (with ``rows``, each row, the last dim, within
    its own: an output's), else the reason in words."""
    tol = TOLERANCES.get(dtype, 2e-2)
    err = rel_err(got, want)
    if not err <= tol:
        return f"{name} rel. error {err:.2e} > {tol:.0e}"
    if not rows:
        return None
    bound = max(ROW_FACTOR * tol, ROW_FLOOR)
    worst, index = worst_row(got, want)
    return None if worst <= bound else f"{name} row {index} rel. error {worst:.2e} > {bound:.0e} (some rows wrong)"


def worst_row(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, int]:
    """(the largest relative error of one row, its index among the flattened rows): each row (the last dim)
    against its own norm, floored at a tenth of the rows' RMS norm (a fully masked row of zeros has none).
    Where rel_err passed them: infinities, if any, stand in the same places in both and count as equal."""
    out, ref = out.double().flatten(0, -2), ref.double().flatten(0, -2)
    finite = torch.isfinite(ref)
    out, ref = torch.where(finite, out, 0.0), torch.where(finite, ref, 0.0)
    if ref.numel() == 0:
        return 0.0, 0
    norms = ref.norm(dim=-1)
    floor = max(0.1 * norms.square().mean().sqrt().item(), torch.finfo(torch.float64).tiny)
    errs = (out - ref).norm(dim=-1) / norms.clamp(min=floor)
    index = int(errs.argmax())
    return errs[index].item(), index


def check_output(out, lse, ref_out, ref_lse, dtype: torch.dtype) -> str | None:
    """None if (out, lse) match the reference within the dtype's tolerance, else the reason in words."""
    reason = check_tensor("output", out, ref_out, dtype, rows=True)
    if reason:
        return reason
    e_lse = rel_err(lse, ref_lse)
    if not e_lse <= LSE_TOLERANCE.get(dtype, 1e-2):
        return f"lse rel. error {e_lse:.2e} > {LSE_TOLERANCE.get(dtype, 1e-2):.0e}"
    return None
