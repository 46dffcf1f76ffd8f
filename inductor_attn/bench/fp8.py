"""``bench --suite fp8``: fp8_attention against our own bf16 choice on dense D128 prefill (issue 53).

Per shape, on the same N(0, 1) bf16 inputs: ``inductor_attn.attention`` (our tuned bf16 choice, decided as a
user's call is) and ``inductor_attn.fp8_attention`` on those inputs quantised per tensor (``fp8.quantize``: one
descale each for q, k and v), decided the same way (FA3's fp8 forward on an H100/H200 with the ``fa3`` extra).
Each is timed the tuner's way (measure.time_trials: CUDA-graph replay on rotating input copies, L2 flushed,
interleaved rounds); TF/s count kept pairs with causal aligned lower-right (Problem.flops). Errors are relative
Frobenius errors (correctness.rel_err) of fp8's output against float64 attention of the dequantised inputs (the
kernel's own error, what the gate bounds) and of the original bf16 inputs (with the quantisation: what a model
sees), and of bf16's output against the latter. ``--smoke``: two tiny float32 shapes, on a CPU the reference.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import api
from ..backends import REFERENCE, AttnCall, run_backend
from ..fp8 import fp8_attention, quantize
from ..problem import default_scale
from ..runtime import reset_stats, stats
from ..tuning.correctness import rel_err
from ..tuning.measure import Trial, time_trials
from ..tuning.stats import median
from ..tuning.timing import default_timer

BF16, FP8 = "bf16: attention", "fp8: fp8_attention"


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    heads_q: int
    heads_kv: int
    length: int
    causal: bool
    head_dim: int = 128
    quick: bool = False

    @property
    def name(self) -> str:
        heads = f"H{self.heads_q}" + (f"/{self.heads_kv}" if self.heads_kv != self.heads_q else "")
        length = f"{self.length // 1024}k" if self.length % 1024 == 0 else str(self.length)
        return f"B{self.batch} {heads} L{length} D{self.head_dim} {'causal' if self.causal else 'full'}"


def shapes(quick: bool, smoke: bool) -> list[Shape]:
    if smoke:
        return [Shape(1, 4, 2, 64, True, 32), Shape(1, 2, 2, 96, False, 32)]
    # the dense suite's D128 batches and heads at L 4k, 8k and 16k (the target: L >= 4k)
    out = [Shape(b, hq, hkv, length, causal, quick=(b, hkv, length, causal) in QUICK)
           for b, hq, hkv, length in ((4, 32, 32, 4096), (4, 32, 8, 4096), (2, 32, 32, 8192), (2, 32, 32, 16384))
           for causal in (False, True)]
    return [s for s in out if s.quick] if quick else out


QUICK = {(4, 8, 4096, True), (2, 32, 8192, False), (2, 32, 16384, True)}


def _bf16_trial() -> Trial:
    def bind(call):
        return lambda: api.attention(call.q, call.k, call.v, causal=call.causal)
    return Trial(BF16, bind, lambda err: isinstance(err, RuntimeError), ours=False)


def _fp8_trial() -> Trial:
    def bind(call):  # quantised here, outside the timed call; no value check (a device sync)
        (q, qs), (k, ks), (v, vs) = (quantize(x) for x in (call.q, call.k, call.v))
        return lambda: fp8_attention(q, k, v, q_descale=qs, k_descale=ks, v_descale=vs, causal=call.causal,
                                     out_dtype=call.q.dtype, check_values=False)
    return Trial(FP8, bind, lambda err: isinstance(err, RuntimeError), ours=False)


def _float64(q, k, v, call: AttnCall) -> torch.Tensor:
    call64 = AttnCall("attention", q.double(), k.double(), v.double(), call.scale, call.causal)
    return run_backend(REFERENCE, call64, None)[0]


def run_shape(s: Shape, device: torch.device, rounds: int) -> dict:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(1)
    q, k, v = (torch.randn(s.batch, h, s.length, s.head_dim, generator=gen, device=device).to(dtype)
               for h in (s.heads_q, s.heads_kv, s.heads_kv))
    call = AttnCall("attention", q, k, v, default_scale(s.head_dim), s.causal)
    row = {"shape": s.name, "flops": call.problem.flops(), "trials": {}}
    want = _float64(q, k, v, call)
    quantised = [quantize(x) for x in (q, k, v)]  # per tensor, as the fp8 trial quantises
    want_dequantised = _float64(*(x8.double() * d.double() for x8, d in quantised), call)
    for trial in (_bf16_trial(), _fp8_trial()):
        reset_stats()  # the first call decides (tunes, in autotune mode); stats then name the kernel it ran
        try:
            out = trial.bind(call)()
        except RuntimeError as err:
            row["trials"][trial.name] = {"failed": f"{type(err).__name__}: {err}"}
            continue
        ran = [key.partition(" -> ")[2] for key in stats()]
        entry = {"choice": ran[0] if len(ran) == 1 else ", ".join(ran), "err_vs_bf16_inputs": rel_err(out, want)}
        if trial.name == FP8:
            entry["err_vs_dequantised"] = rel_err(out, want_dequantised)
        row["trials"][trial.name] = entry
    del want, want_dequantised, quantised
    trials = [t for t in (_bf16_trial(), _fp8_trial()) if "failed" not in row["trials"][t.name]]
    for trial, t in zip(trials, time_trials(trials, call, default_timer(device.type), rounds)):
        row["trials"][trial.name].update(ms=median(t.samples) if t.samples else None, failed=t.failed)
    return row


def summary(result: dict) -> str:
    """Markdown, one line per shape: each side's kernel and TF/s, fp8 / bf16, and the errors."""
    lines = ["| shape | bf16 choice | TF/s | fp8 choice | TF/s | fp8 / bf16 | fp8 err vs dequantised | fp8 err vs bf16 "
             "inputs | bf16 err |", "|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        bf16, fp8 = row["trials"][BF16], row["trials"][FP8]
        rate = [row["flops"] / t["ms"] / 1e9 if t.get("ms") else None for t in (bf16, fp8)]
        cells = [row["shape"], *_side(bf16, rate[0]), *_side(fp8, rate[1]),
                 f"{rate[1] / rate[0]:.2f}x" if None not in rate else "",
                 _err(fp8.get("err_vs_dequantised")), _err(fp8.get("err_vs_bf16_inputs")),
                 _err(bf16.get("err_vs_bf16_inputs"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


table = summary  # what host_suites prints after a run: the same one line per shape


def bars(result: dict) -> dict | None:
    """The plot (report.py ``_summary_plot``): per shape, TF/s of our bf16 choice and of our fp8 choice."""
    rows = result["rows"]
    if not rows:
        return None
    return {"xlabel": "TF/s", "labels": [row["shape"] for row in rows],
            "series": {side: [row["flops"] / row["trials"][side]["ms"] / 1e9 if row["trials"][side].get("ms") else None
                              for row in rows] for side in (BF16, FP8)}}


def _side(trial: dict, rate: float | None) -> list[str]:
    if rate is None:
        return [f"failed: {trial.get('failed')}", ""]
    return [f"`{trial['choice']}`", f"{rate:.0f}" if rate >= 10 else f"{rate:.2g}"]


def _err(x: float | None) -> str:
    return "" if x is None else f"{x:.3g}"
