"""``bench --suite training``: forward + backward as a training step sees it, against what users have.

Per shape, in one process and on one device, one step = ``attention`` forward and the gradients of q, k,
v for a fixed random output gradient (``torch.autograd.grad``, so nothing accumulates between steps):
- ``eager sdpa`` and ``stock compile`` (``torch.compile`` of the same function): SDPA with ``is_causal``,
  or for masks the boolean mask a model would pass;
- ``fa4 direct``: flash-attn-4's ``flash_attn_func`` (dense shapes; where installed);
- ``compiled flex``: ``torch.compile(flex_attention)`` with the mask's BlockMask (mask shapes);
- ``ours``: ``inductor_attn.attention`` eagerly and under ``torch.compile``, and compiled under
  ``torch.use_deterministic_algorithms(True)`` (what determinism costs);
- ``ours varlen`` (document masks): the same mask as packed documents through
  ``inductor_attn.varlen_attention``, compiled: the representation FlashAttention users pick for it; and
  ``ours block-sparse``: the mask with its documents dropped, so it runs our block-sparse kernels, as a
  mask that is not packed documents does.
Each gets kernel us (profiler), wall us with plain launches, host us (bursts), loop host us (the wall run's
own issuing time) and peak memory of a step (wallclock.py), and the gradients' relative error against
float64 next to SDPA's own; the paths of a shape are timed taking turns (``run_shape``).

HF Llama training steps (forward, backward, AdamW) at two sizes: models.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..api import attention, varlen_attention
from ..block_mask import BlockSparseMask
from ..tuning.measure import device_error
from .models import STEP_HEADER, llama_training, step_bars, step_cells
from .wallclock import interleaved_measure, measure, model_part, peak_memory

SHAPES = (
    # name, batch, heads_q, heads_kv, length, head_dim, causal, mask ("", "window", "document")
    ("B4 H16/4 L2k D64 causal", 4, 16, 4, 2048, 64, True, ""),
    ("B2 H16 L4k D128", 2, 16, 16, 4096, 128, False, ""),
    ("B1 H32/8 L8k D128 causal", 1, 32, 8, 8192, 128, True, ""),
    ("B2 H16 L2k D256 causal", 2, 16, 16, 2048, 256, True, ""),
    ("B4 H16 L1k D128 causal", 4, 16, 16, 1024, 128, True, ""),
    ("window 1024 B2 H16 L8k D128", 2, 16, 16, 8192, 128, True, "window"),
    ("document B1 H16 L8k D128", 1, 16, 16, 8192, 128, True, "document"),
)
QUICK = (0, 2, 6)
SMOKE = (("B1 H4/2 L64 D16 causal", 1, 4, 2, 64, 16, True, ""), ("document B1 H2 L128 D16", 1, 2, 2, 128, 16, True,
                                                                    "document"))
WINDOW = 1024


@dataclasses.dataclass
class Shape:
    name: str
    batch: int
    heads_q: int
    heads_kv: int
    length: int
    head_dim: int
    causal: bool
    mask: str

    def documents(self, device) -> torch.Tensor:
        """Document id per token: documents of a seeded random length around length / 8."""
        gen = torch.Generator().manual_seed(0)
        cuts = sorted(torch.randint(1, self.length, (7,), generator=gen).tolist())
        ids = torch.zeros(self.length, dtype=torch.int64)
        for c in cuts:
            ids[c:] += 1
        return ids.to(device)

    def cu_seqlens(self, device) -> tuple[torch.Tensor, int]:
        """int32 cu_seqlens of the batch's documents packed one batch after another, and the longest."""
        ids = self.documents("cpu")
        starts = torch.cat([torch.tensor([0]), torch.nonzero(ids[1:] != ids[:-1]).flatten() + 1])
        lengths = torch.diff(torch.cat([starts, torch.tensor([self.length])]))
        per_batch = [starts + b * self.length for b in range(self.batch)]
        cu = torch.cat(per_batch + [torch.tensor([self.batch * self.length])]).to(torch.int32)
        return cu.to(device), int(lengths.max())

    def inputs(self, device, dtype) -> tuple[torch.Tensor, ...]:
        """Seeded q, k, v (requiring grad) and the output gradient g of one step."""
        gen = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(self.batch, h, self.length, self.head_dim, device=device, dtype=dtype, generator=gen)
                   .requires_grad_() for h in (self.heads_q, self.heads_kv, self.heads_kv))
        g = torch.randn(self.batch, self.heads_q, self.length, self.head_dim, device=device, dtype=dtype,
                        generator=gen)
        return q, k, v, g

    def mask_mod(self, device):
        if self.mask == "window":
            return lambda b, h, q, kv: (kv <= q) & (kv >= q - WINDOW)
        docs = self.documents(device)
        return lambda b, h, q, kv: (docs[q] == docs[kv]) & (kv <= q)

    def block_mask(self, device):
        from torch.nn.attention.flex_attention import create_block_mask

        return create_block_mask(self.mask_mod(device), None, None, self.length, self.length, device=device)

    def dense_mask(self, device) -> torch.Tensor:
        i = torch.arange(self.length, device=device)
        return self.mask_mod(device)(None, None, i[:, None], i[None, :])


def shape_named(name: str) -> Shape:
    """The suite's shape called ``name`` (the first column of ``SHAPES``)."""
    found = next((s for s in SHAPES if s[0] == name), None)
    if found is None:
        raise ValueError(f"training-suite shape must be one of {sorted(s[0] for s in SHAPES)}, got {name!r}")
    return Shape(*found)


def _sdpa(shape: Shape, device):
    mask = shape.dense_mask(device) if shape.mask else None

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=shape.causal and mask is None,
                                              enable_gqa=q.shape[1] != k.shape[1])
    return fn


def ours_kwargs(shape: Shape, device) -> dict:
    """The mask arguments of ``inductor_attn.attention`` for the shape."""
    if shape.mask == "window":
        return {"causal": True, "window": WINDOW}
    if shape.mask == "document":
        return {"block_mask": BlockSparseMask.from_block_mask(shape.block_mask(device))}
    return {"causal": shape.causal}


def _ours(shape: Shape, device, documents: bool = True):
    kw = ours_kwargs(shape, device)
    if not documents:
        kw["block_mask"] = dataclasses.replace(kw["block_mask"], documents=None)
    return lambda q, k, v: attention(q, k, v, **kw)


def _ours_varlen(shape: Shape, device):
    """Documents packed as varlen sequences: (B, H, L, D) seen as (B * L, H, D), a copy unless B == 1."""
    cu, longest = shape.cu_seqlens(device)

    def fn(q, k, v):
        packed = [x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3]) for x in (q, k, v)]
        out = varlen_attention(*packed, cu, cu, longest, longest, causal=shape.causal, check_indices=False)
        return out.view(q.shape[0], q.shape[2], q.shape[1], -1).transpose(1, 2)
    return fn


def _flex(shape: Shape, device):
    from torch.nn.attention.flex_attention import flex_attention

    block_mask = shape.block_mask(device)
    compiled = torch.compile(flex_attention, fullgraph=True, dynamic=False)
    return lambda q, k, v: compiled(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])


def _fa4_direct(shape: Shape):
    try:
        from flash_attn.cute import flash_attn_func
    except ImportError:
        return None

    def fn(q, k, v):
        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=shape.causal)
        return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)
    return fn


def paths(shape: Shape, device) -> dict:
    """name -> (function or None where unavailable, run under torch.use_deterministic_algorithms)."""
    out = {"eager sdpa": (_sdpa(shape, device), False),
           "stock compile": (torch.compile(_sdpa(shape, device), fullgraph=True), False)}
    if shape.mask:
        out["compiled flex"] = (_flex(shape, device) if device.type == "cuda" else None, False)
    else:
        out["fa4 direct"] = (_fa4_direct(shape) if device.type == "cuda" else None, False)
    out["ours eager"] = (_ours(shape, device), False)
    out["ours"] = (torch.compile(_ours(shape, device)), False)
    out["ours deterministic"] = (torch.compile(_ours(shape, device)), True)
    if shape.mask == "document":
        out["ours varlen"] = (torch.compile(_ours_varlen(shape, device)), False)
        out["ours block-sparse"] = (torch.compile(_ours(shape, device, documents=False)), False)
    return out


def training_step(fn, q, k, v, g):
    """One step: ``fn``'s forward and the gradients of q, k, v for the output gradient ``g``."""
    def step():
        return torch.autograd.grad(fn(q, k, v), (q, k, v), g)
    return step


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


def run_shape(shape: Shape, device, dtype) -> dict:
    """One shape's row. Each path first runs once (compiling and tuning) and is checked against float64; the
    paths that run under default settings are then timed taking turns (``interleaved_measure``). A
    deterministic path compiles after a reset of Dynamo's caches (a graph compiled under other settings must
    not be reused), so it is checked and timed after them, alone."""
    torch._dynamo.reset()
    q, k, v, g = shape.inputs(device, dtype)
    exact = [x.detach().double().requires_grad_() for x in (q, k, v)]
    want = torch.autograd.grad(_sdpa(shape, device)(*exact), exact, g.double())
    fns = paths(shape, device)
    results = {name: {"status": "not available here"} for name, (fn, _) in fns.items() if fn is None}
    default = {name: fn for name, (fn, det) in fns.items() if fn is not None and not det}
    steps, stopped = _checked_steps(default, (q, k, v, g), want, results, device)
    if steps and not stopped:
        try:
            for name, numbers in interleaved_measure(steps).items():
                results[name].update(numbers)
        except Exception as err:  # noqa: BLE001 - keep the checks' results
            for name in steps:
                results[name]["status"] = f"timing failed: {type(err).__name__}: {str(err)[:200]}"
            if device_error(device):
                stopped = f"timing: {type(err).__name__}: {str(err)[:200]}"
    for name, (fn, det) in fns.items():
        if fn is None or not det or stopped:
            continue
        torch._dynamo.reset()
        torch.use_deterministic_algorithms(True)
        try:
            checked, stopped = _checked_steps({name: fn}, (q, k, v, g), want, results, device)
            if checked:
                results[name].update(measure(checked[name]))
        finally:
            torch.use_deterministic_algorithms(False)
    row = {"shape": shape.name, "paths": {name: results[name] for name in fns if name in results}}
    if stopped:
        row["stopped"] = stopped
    if "ours" in results:
        from .. import runtime

        row["ours_kernels"] = runtime.stats()
    return row


def _checked_steps(fns: dict, inputs: tuple, want, results: dict, device) -> tuple[dict, str | None]:
    """Each function's training step run once: its gradients' error against ``want`` and its peak memory go
    to ``results``, or the error it raised. Returns the steps that ran, and "name: status" of the one that
    left the CUDA context unusable (the paths after it are not run: each would fail with the same sticky
    error)."""
    steps = {}
    for name, fn in fns.items():
        try:
            step = training_step(fn, *inputs)
            grads = step()
            results[name] = {"grad_rel_err": max(_rel(x, w) for x, w in zip(grads, want)),
                             "peak_bytes": peak_memory(step)}
            if device.type == "cuda":
                torch.cuda.synchronize()  # an asynchronous CUDA error belongs to this path, not the next
            steps[name] = step
        except Exception as err:  # noqa: BLE001 - one failing path must not lose the others
            results[name] = {"status": f"failed: {type(err).__name__}: {str(err)[:200]}"}
            if device_error(device):
                return steps, f"{name}: {results[name]['status']}"
    return steps, None


def run(smoke: bool, quick: bool, device: torch.device, part: str = "all",
        save: Callable[[dict], None] | None = None, shard: tuple[int, int] = (1, 1)) -> dict:
    """The shapes (``part`` "ops") and the HF Llama steps (``part`` "models", not with ``quick``); ``save``
    after each shape, so that a run killed from outside keeps the shapes it finished. ``shard`` (k, n): every
    n-th shape from the k-th (1-based), the HF Llama steps with the first shard only, so that n calls of a
    device's time limit cover the suite once."""
    from .. import runtime

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = SMOKE if smoke else [SHAPES[i] for i in QUICK] if quick else SHAPES
    k, n = shard
    shapes = shapes[k - 1::n]
    rows = []
    for s in shapes if part in ("all", "ops") else ():
        runtime.reset_stats()
        rows.append(run_shape(Shape(*s), device, dtype))
        if save is not None:
            save({"rows": rows, "llama": None})
        if rows[-1].get("stopped"):  # the CUDA context is unusable: keep what was measured and stop
            break
    wanted = part in ("all", "models") and not smoke and not quick and device.type == "cuda" and k == 1
    return {"rows": rows, "llama": model_part(wanted, llama_training)}


# ``--part``s: what one device call measures; RESULTS.md keeps a block per part (report.py ``_part_blocks``)
PARTS = {"ops": ("rows",), "models": ("llama",)}


def _best_sdpa_wall(row: dict) -> float | None:
    """The faster of eager and compiled SDPA's wall us on a shape (a stopped suite may lack them)."""
    walls = [row["paths"].get(p, {}).get("wall_us") for p in ("eager sdpa", "stock compile")]
    return min((w for w in walls if w), default=None)


def bars(result: dict) -> dict | None:
    """The plot of a part's result (report.py ``_summary_plot``): each path's speed over the faster SDPA per
    shape (wall time), or the HF Llama steps."""
    best = {row["shape"]: _best_sdpa_wall(row) for row in result["rows"]}
    rows = [row for row in result["rows"] if best[row["shape"]]]
    if not rows:
        return step_bars(result.get("llama"))
    paths = list(dict.fromkeys(name for row in rows for name in row["paths"]))
    walls = [{name: r.get("wall_us") for name, r in row["paths"].items()} for row in rows]
    return {"xlabel": "speed over the faster of eager and compiled SDPA (wall time)", "ref": 1.0,
            "labels": [row["shape"] for row in rows],
            "series": {p: [best[row["shape"]] / wall[p] if wall.get(p) else None for row, wall in zip(rows, walls)]
                       for p in paths}}


def table(result: dict) -> str:
    """Markdown: per shape, each path's kernel, wall and host us, peak memory and gradient error; the HF Llama
    training steps. Each where the result holds it (a ``--part`` measures some)."""
    lines = (["| shape | path | kernel us | wall us | host us | loop host us | peak MiB | grad rel. err "
              "| wall vs best SDPA |", "|---|---|---|---|---|---|---|---|---|"] if result["rows"] else [])
    for row in result["rows"]:
        if row.get("stopped"):
            lines.append(f"| {row['shape']} | suite stopped: the CUDA context was lost in | {row['stopped'][:300]} "
                         "| | | | | | |")
        best = _best_sdpa_wall(row)
        for name, r in row["paths"].items():
            if "wall_us" not in r:
                lines.append(f"| {row['shape']} | {name} | {r.get('status')} | | | | | | |")
                continue
            kernel = "" if r["kernel_us"] is None else f"{r['kernel_us']:.0f}"
            peak = "" if r.get("peak_bytes") is None else f"{r['peak_bytes'] / 2**20:.0f}"
            ratio = f"{best / r['wall_us']:.2f}x" if best else ""
            loop = "" if r.get("loop_host_us") is None else f"{r['loop_host_us']:.0f}"
            lines.append(f"| {row['shape']} | {name} | {kernel} | {r['wall_us']:.0f} | {r['host_us']:.0f} | {loop} | "
                         f"{peak} | {r['grad_rel_err']:.1e} | {ratio} |")
    llama = result.get("llama") or {}
    if llama and "error" not in llama:
        lines += ["", f"| HF Llama training step | {STEP_HEADER} | stock grad err | ours grad err |",
                  "|---|---|---|---|---|---|---|"]
        for name, r in llama.items():
            if isinstance(r, dict) and "stock_ms" in r:
                errors = f"{r.get('stock_grad_err', float('nan')):.1e} | {r.get('ours_grad_err', float('nan')):.1e}"
                lines.append(f"| {name} | {step_cells(r)} | {errors} |")
    elif llama:
        lines += ["", f"HF Llama: {llama['error']}"]
    return "\n".join(lines).strip("\n")


summary = table  # RESULTS.md's section (report.py ``update_summary_sections``)
