"""Benchmark workloads, as data: the shapes the five context threads measured, and how to build them.

- dense: head dims 64/128/256, causal or not, MHA/GQA/MQA, L 512 to 32k, sliding windows; the anchors'
  shapes (shared/anchors/README.md) are among them, so numbers can be compared with those of 2026-11-22.
- decode: the three configurations of the ExecuTorch split-K thread (pytorch/executorch#20142): D256 with
  16 kv heads ("gemma sliding"), D256 with 2 kv heads ("qwen"), D128; L_kv 64 to 32k, batch 1 to 64,
  L_q 1 to 4 (speculative steps are causal, lower-right), always with ``kv_seqlens`` (a KV cache whose
  rows hold different lengths).
- varlen: packed sequences in the five length patterns of the FA4 CLC thread (flash-attention #2455):
  uniform, staircase, long tail, bimodal, spiky; lengths are drawn from a seed, so every run packs the
  same batch.
- block_sparse: the mask families of attention-gym and the NSA thread: block-causal, sliding window,
  document (block-diagonal), prefix-LM and NSA-style top-k block selection, built as flex BlockMasks with
  ``create_block_mask`` and converted with ``BlockSparseMask.from_block_mask``; both times are kept,
  because mask construction can cost more than the attention (NSA thread).
- backward: dense problems timed as a training step's attention, forward and backward (``direction``
  "backward"); the two shapes of the backward script these suites replaced, plus GQA and D64. Not part
  of ``all``: ``all`` is the four forward suites.

``quick`` marks the representative subset that ``bench --quick`` runs (3 dense, 3 decode, 2 varlen, 2
block-sparse). Every workload of a suite falls in its own decision bucket (problem.py), so each one's
tuning time is a real tune and not a hit on the previous workload's decision.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import time
from dataclasses import dataclass

import torch

from ..tuning.measure import sync

KINDS = ("dense", "decode", "varlen", "block_sparse")
DIRECTIONS = ("forward", "backward")
PATTERNS = ("uniform", "staircase", "longtail", "bimodal", "spiky")
MASKS = ("block_causal", "sliding_window", "document", "prefix_lm", "nsa_topk")
# Above this many mask elements (B' x H' x Lq x Lk), create_block_mask's eager path, which materialises
# the whole mask (about 10 bytes of peak scratch per element: 640 MB for 16 heads x 2k x 2k, measured
# on the CPU with torch 2.13), is replaced by torch.compile(create_block_mask), which never does.
EAGER_MASK_LIMIT = 1 << 28


@dataclass(frozen=True)
class Workload:
    """One benchmark problem. Lengths: dense/decode/block_sparse per sequence; varlen ``len_q`` =
    ``len_k`` = total packed tokens and ``batch`` = number of sequences. ``pattern`` is the varlen
    length pattern or the block-sparse mask family; ``param`` is the mask's number (window, prefix
    length, document count, top-k blocks); ``window`` is a dense causal sliding window; ``direction``
    "backward" times forward + backward (the backward suite)."""

    kind: str
    batch: int
    heads_q: int
    heads_kv: int
    len_q: int
    len_k: int
    head_dim: int
    causal: bool = False
    window: int | None = None
    pattern: str = ""
    param: int = 0
    block: int = 128
    seed: int = 0
    quick: bool = False
    dtype: str = "bfloat16"
    label: str = ""  # overrides the generated name (smoke versions keep their full-size name)
    direction: str = "forward"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Workload.kind must be one of {KINDS}, got {self.kind!r}")
        if self.direction not in DIRECTIONS:
            raise ValueError(f"Workload.direction must be one of {DIRECTIONS}, got {self.direction!r}")
        if self.direction == "backward" and self.kind != "dense":
            raise ValueError(f"backward workloads are dense, got kind {self.kind!r}")
        if self.kind == "varlen" and self.pattern not in PATTERNS:
            raise ValueError(f"varlen pattern must be one of {PATTERNS}, got {self.pattern!r}")
        if self.kind == "block_sparse" and self.pattern not in MASKS:
            raise ValueError(f"block_sparse mask must be one of {MASKS}, got {self.pattern!r}")

    @property
    def name(self) -> str:
        """A short unique label, e.g. ``dense B4 H32/8 L4k D128 causal``."""
        if self.label:
            return self.label
        heads = f"H{self.heads_q}" + (f"/{self.heads_kv}" if self.heads_kv != self.heads_q else "")
        mask = " causal" if self.causal else ""
        if self.kind == "dense":
            lens = f"L{_k(self.len_q)}" if self.len_q == self.len_k else f"Lq{_k(self.len_q)} Lk{_k(self.len_k)}"
            mask = (" causal" if self.causal else " full") + (f" window{self.window}" if self.window else "")
            text = f"dense B{self.batch} {heads} {lens} D{self.head_dim}{mask}"
        elif self.kind == "decode":
            text = f"decode B{self.batch} {heads} Lq{self.len_q} Lkv{_k(self.len_k)} D{self.head_dim}{mask}"
        elif self.kind == "varlen":
            text = f"varlen {self.pattern} n{self.batch} T{_k(self.len_q)} {heads} D{self.head_dim}{mask}"
        else:
            family = self.pattern + (f"({self.param})" if self.param else "")
            text = f"{family} B{self.batch} {heads} L{_k(self.len_q)} D{self.head_dim}"
        return text + (" fwd+bwd" if self.direction == "backward" else "")

    @property
    def suite(self) -> str:
        """The suite (and report section) it belongs to: its kind, or "backward"."""
        return "backward" if self.direction == "backward" else self.kind

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> Workload:
        return cls(**d)


def _k(n: int) -> str:
    """``16384 -> '16k'``; lengths that are not whole kibi-tokens stay as they are.

    >>> _k(16384), _k(1000), _k(512)
    ('16k', '1000', '512')
    """
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


# ------------------------------------------------------------------------------------------ suites
def _dense(b, hq, hkv, l, d, causal, quick=False, lk=None, window=None) -> Workload:  # noqa: E741
    return Workload("dense", b, hq, hkv, l, lk or l, d, causal=causal, window=window, quick=quick)


def _decode(b, hq, hkv, lk, d, lq=1, quick=False) -> Workload:
    # a speculative step of lq > 1 tokens sees the cache and its own earlier tokens: lower-right causal
    return Workload("decode", b, hq, hkv, lq, lk, d, causal=lq > 1, seed=lk + b, quick=quick)


def _varlen(pattern, n, total, hq, hkv, d, causal, quick=False) -> Workload:
    return Workload("varlen", n, hq, hkv, total, total, d, causal=causal, pattern=pattern, seed=n, quick=quick)


def _sparse(mask, param, b, hq, hkv, l, d, quick=False, block=128) -> Workload:  # noqa: E741
    return Workload("block_sparse", b, hq, hkv, l, l, d, pattern=mask, param=param, block=block, quick=quick)


def _backward(b, hq, hkv, l, d, causal, quick=False) -> Workload:  # noqa: E741
    return Workload("dense", b, hq, hkv, l, l, d, causal=causal, quick=quick, direction="backward")


SUITES: dict[str, tuple[Workload, ...]] = {
    "dense": (
        _dense(4, 32, 32, 1024, 128, False, quick=True),  # anchors: cuDNN ahead of FA4 at 1k
        _dense(4, 32, 32, 1024, 128, True),
        _dense(4, 32, 32, 4096, 128, True),
        _dense(2, 32, 32, 16384, 128, False),
        _dense(2, 32, 32, 16384, 128, True, quick=True),  # anchors: FA4 ahead from 4k up
        _dense(1, 32, 32, 32768, 128, True),
        _dense(8, 32, 32, 512, 64, False),
        _dense(4, 32, 32, 4096, 64, False),
        _dense(2, 16, 16, 4096, 256, True),
        _dense(4, 32, 8, 4096, 128, True, quick=True),  # GQA
        _dense(4, 32, 4, 8192, 64, False),  # GQA 8
        _dense(4, 32, 1, 2048, 128, True),  # MQA
        _dense(2, 16, 16, 512, 64, True, lk=2048),  # prefill with a cache: Lq != Lk, lower-right
        _dense(2, 32, 32, 16384, 128, True, window=1024),  # anchors' sliding windows
        _dense(4, 32, 32, 4096, 128, True, window=256),
    ),
    "decode": (
        _decode(1, 32, 16, 64, 256),
        _decode(1, 32, 16, 256, 256),  # the ExecuTorch split-K threshold
        _decode(1, 32, 16, 2048, 256),
        _decode(1, 32, 16, 16384, 256, quick=True),
        _decode(1, 32, 16, 32768, 256),
        _decode(1, 16, 2, 256, 256),
        _decode(1, 16, 2, 2048, 256, quick=True),  # 2 CTAs without split-K
        _decode(1, 16, 2, 16384, 256),
        _decode(8, 16, 2, 8192, 256),
        _decode(8, 32, 8, 8192, 128),
        _decode(8, 32, 8, 8192, 128, lq=4, quick=True),
        _decode(64, 32, 8, 2048, 128),
        _decode(16, 32, 16, 4096, 128, lq=2),
        _decode(32, 32, 8, 32768, 128),
    ),
    "varlen": (
        _varlen("uniform", 16, 32768, 32, 8, 128, True),
        _varlen("staircase", 16, 32768, 32, 8, 128, True),
        _varlen("longtail", 16, 32768, 32, 8, 128, True, quick=True),
        _varlen("bimodal", 16, 32768, 32, 8, 128, True),
        _varlen("spiky", 16, 32768, 32, 8, 128, True),
        _varlen("bimodal", 32, 16384, 16, 16, 128, True, quick=True),  # MHA: CLC loses on varlen MHA
        _varlen("uniform", 32, 16384, 16, 16, 128, False),
        _varlen("longtail", 8, 16384, 32, 1, 128, True),  # MQA
    ),
    "block_sparse": (
        _sparse("block_causal", 0, 2, 32, 32, 8192, 128),
        _sparse("sliding_window", 1024, 2, 32, 32, 16384, 128, quick=True),  # anchors: flex FLASH 509 vs 361
        _sparse("sliding_window", 256, 4, 32, 32, 4096, 128),
        _sparse("document", 12, 1, 32, 32, 16384, 128),
        _sparse("prefix_lm", 2048, 2, 16, 16, 8192, 128),
        _sparse("nsa_topk", 16, 1, 16, 2, 8192, 128, quick=True),
        _sparse("nsa_topk", 16, 1, 16, 2, 32768, 128),
        _sparse("sliding_window", 512, 2, 16, 16, 8192, 64, block=64),
    ),
    "backward": (
        _backward(4, 32, 32, 4096, 128, True, quick=True),  # the replaced backward script's two shapes
        _backward(2, 32, 32, 8192, 128, False),
        _backward(4, 32, 8, 4096, 128, True, quick=True),  # GQA: dK/dV sum over the query heads of a group
        _backward(4, 16, 16, 4096, 64, True),
    ),
}
SUITE_NAMES = (*KINDS, "backward", "all")


def select(suite: str, quick: bool = False, shard: tuple[int, int] = (1, 1), smoke: bool = False) -> list[Workload]:
    """The workloads one run measures: a suite (or all four forward suites, their kinds in turns), its quick
    subset, one shard of it (``(k, n)``: every n-th workload from the k-th, 1-based), each shrunk to a smoke
    size if asked."""
    if suite not in SUITE_NAMES:
        raise ValueError(f"suite must be one of {', '.join(SUITE_NAMES)}, got {suite!r}")
    k, n = shard
    if not 1 <= k <= n:
        raise ValueError(f"shard must be K/N with 1 <= K <= N, got {k}/{n}")
    kinds = KINDS if suite == "all" else (suite,)
    per_kind = [[w for w in SUITES[kind] if w.quick or not quick] for kind in kinds]
    # kinds take turns, so a run that its time budget cuts short still measured some of each kind
    chosen = [w for turn in itertools.zip_longest(*per_kind) for w in turn if w is not None]
    chosen = chosen[k - 1 :: n]
    return [smoke_size(w) for w in chosen] if smoke else chosen


def smoke_size(w: Workload) -> Workload:
    """The same workload shrunk to a few hundred tokens and 4 query heads (keeping MHA/GQA/MQA), in
    float32: runs the whole pipeline on a CPU in seconds. Its numbers mean nothing, and its name says so:
    ``[smoke] <its own shape> <- <the workload it stands for>``."""
    hkv = 4 if w.heads_kv == w.heads_q else (1 if w.heads_kv == 1 else 2)
    lq, lk = min(w.len_q, 128), min(w.len_k, 256 if w.kind != "dense" else 128)
    if w.kind in ("varlen", "block_sparse"):
        lq = lk = 256
    if w.kind == "dense" and w.len_q != w.len_k:
        lq = 64
    small = dataclasses.replace(
        w, batch=min(w.batch, 4 if w.kind == "varlen" else 2), heads_q=4, heads_kv=hkv, len_q=lq, len_k=lk,
        window=min(w.window, 32) if w.window else None, param=_smoke_param(w), block=min(w.block, 64),
        dtype="float32", label="")
    return dataclasses.replace(small, label=f"[smoke] {small.name} <- {w.name}")


def _smoke_param(w: Workload) -> int:
    return {"sliding_window": 48, "document": 3, "prefix_lm": 64, "nsa_topk": 2}.get(w.pattern, w.param)


# ---------------------------------------------------------------------------------------- lengths
def seq_lengths(pattern: str, count: int, total: int, seed: int) -> list[int]:
    """``count`` sequence lengths, each >= 1, summing exactly to ``total``, shaped by ``pattern``:

    uniform (equal), staircase (1, 2, ..., count parts, ascending), longtail (Zipf-like weights
    1/rank^1.2 in seeded order: a few long sequences, many short), bimodal (half short, half 8x longer),
    spiky (short, with about one in eight 24x longer). The seed shuffles and jitters (+-15%) the last
    three, so runs with one seed pack the same batch.

    >>> seq_lengths("uniform", 4, 10, 0), seq_lengths("staircase", 4, 20, 0)
    ([3, 3, 2, 2], [3, 4, 6, 7])
    >>> sum(seq_lengths("longtail", 16, 32768, 3)) == 32768
    True
    """
    if pattern not in PATTERNS:
        raise ValueError(f"pattern must be one of {PATTERNS}, got {pattern!r}")
    if not 1 <= count <= total:
        raise ValueError(f"need 1 <= count <= total, got count={count}, total={total}")
    rng = random.Random(f"{pattern}-{count}-{total}-{seed}")  # str seeds hash with sha512: stable
    if pattern == "uniform":
        weights = [1.0] * count
    elif pattern == "staircase":
        weights = [float(i + 1) for i in range(count)]
    else:
        if pattern == "longtail":
            weights = [1.0 / (i + 1) ** 1.2 for i in range(count)]
        elif pattern == "bimodal":
            weights = [1.0 if i < count // 2 else 8.0 for i in range(count)]
        else:
            spikes = set(rng.sample(range(count), max(1, count // 8)))
            weights = [24.0 if i in spikes else 1.0 for i in range(count)]
        rng.shuffle(weights)
        weights = [w * rng.uniform(0.85, 1.15) for w in weights]
    return _apportion(weights, total)


def _apportion(weights: list[float], total: int) -> list[int]:
    """Integer parts proportional to ``weights``, each >= 1, summing to ``total`` (largest remainder;
    ties go to the earlier part)."""
    spare = total - len(weights)
    scale = spare / sum(weights)
    raw = [w * scale for w in weights]
    parts = [int(r) for r in raw]
    order = sorted(range(len(raw)), key=lambda i: (-(raw[i] - parts[i]), i))
    for i in order[: spare - sum(parts)]:
        parts[i] += 1
    return [p + 1 for p in parts]


def cu_seqlens(lengths: list[int], device="cpu") -> torch.Tensor:
    """int32 offsets ``[0, l0, l0 + l1, ...]``.

    >>> cu_seqlens([3, 1, 2]).tolist()
    [0, 3, 4, 6]
    """
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return torch.tensor(offsets, dtype=torch.int32, device=device)


def kv_lengths(batch: int, capacity: int, seed: int) -> list[int]:
    """Valid KV-cache lengths per row: the first row full (so the cache length is the bucket's), the
    others drawn from [capacity / 2, capacity].

    >>> kv_lengths(1, 4096, 0)
    [4096]
    >>> all(2048 <= n <= 4096 for n in kv_lengths(8, 4096, 0))
    True
    """
    rng = random.Random(f"kv-{batch}-{capacity}-{seed}")
    return [capacity] + [rng.randint(max(1, capacity // 2), capacity) for _ in range(batch - 1)]


# ------------------------------------------------------------------------------------------- masks
def mask_mod_for(w: Workload, device):
    """The flex mask_mod of a block-sparse workload, and its head count (1 when it is the same for
    every head, else heads_q)."""
    p, n = w.param, w.len_q
    if w.pattern == "block_causal":
        bs = w.block
        return (lambda b, h, q, kv: (q // bs) >= (kv // bs)), 1
    if w.pattern == "sliding_window":
        return (lambda b, h, q, kv: (q >= kv) & (q - kv <= p)), 1
    if w.pattern == "prefix_lm":
        return (lambda b, h, q, kv: (kv < p) | (q >= kv)), 1
    if w.pattern == "document":
        docs = torch.repeat_interleave(torch.arange(p), torch.tensor(seq_lengths("bimodal", p, n, w.seed))).to(device)
        return (lambda b, h, q, kv: docs[q] == docs[kv]), 1
    selected = nsa_selection(w.heads_q, n, w.block, p, w.seed).to(device)
    bs = w.block
    return (lambda b, h, q, kv: selected[h, q // bs, kv // bs] & (q >= kv)), w.heads_q


def nsa_selection(heads: int, length: int, block: int, top_k: int, seed: int) -> torch.Tensor:
    """Bool [heads, M, M] (M = ceil(length / block)): per head and query block, the kv blocks an NSA
    selection branch attends to: its own (diagonal) block plus the ``top_k - 1`` earlier blocks with the
    highest seeded random scores (NSA scores blocks by compressed attention; random scores give the same
    irregular, per-head pattern).

    >>> sel = nsa_selection(2, 1024, 128, 3, 0)
    >>> sel.shape, sel.sum(-1)[0].tolist()
    (torch.Size([2, 8, 8]), [1, 2, 3, 3, 3, 3, 3, 3])
    """
    m = -(-length // block)
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(heads, m, m, generator=gen)
    earlier = torch.ones(m, m, dtype=torch.bool).tril(-1)
    scores = scores.masked_fill(~earlier, -1.0)
    k = min(max(top_k - 1, 0), max(m - 1, 0))
    chosen = torch.zeros(heads, m, m, dtype=torch.bool)
    if k:
        top = scores.topk(k, dim=-1)
        chosen.scatter_(-1, top.indices, top.values >= 0)
    return chosen | torch.eye(m, dtype=torch.bool)


# ------------------------------------------------------------------------------------------- build
@dataclass
class Built:
    """A workload's tensors as inductor_attn runs them (``call``), and what the user baselines need."""

    call: object  # inductor_attn.backends.AttnCall
    block_mask: object | None = None  # the flex BlockMask (block-sparse)
    lengths: list[int] | None = None  # varlen sequence lengths, or decode kv_seqlens
    setup_s: dict = dataclasses.field(default_factory=dict)


def build(w: Workload, device) -> Built:
    """Random inputs (seeded) and the AttnCall of ``w`` on ``device``; checks every argument the way
    the public API does."""
    from ..api import make_call

    device = torch.device(device)
    dtype = getattr(torch, w.dtype)
    gen = torch.Generator(device=device).manual_seed(w.seed + 1)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    if w.kind == "varlen":
        return _build_varlen(w, randn, device)
    q = randn(w.batch, w.heads_q, w.len_q, w.head_dim)
    k = randn(w.batch, w.heads_kv, w.len_k, w.head_dim)
    v = randn(w.batch, w.heads_kv, w.len_k, w.head_dim)
    if w.kind == "dense":
        return Built(make_call(q, k, v, causal=w.causal, window=w.window))
    if w.kind == "decode":
        lengths = kv_lengths(w.batch, w.len_k, w.seed)
        seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
        return Built(make_call(q, k, v, causal=w.causal, kv_seqlens=seqlens), lengths=lengths)
    return _build_sparse(w, q, k, v, device)


def _build_varlen(w: Workload, randn, device) -> Built:
    from ..backends import AttnCall

    lengths = seq_lengths(w.pattern, w.batch, w.len_q, w.seed)
    cu = cu_seqlens(lengths, device)
    q = randn(w.len_q, w.heads_q, w.head_dim)
    k, v = randn(w.len_k, w.heads_kv, w.head_dim), randn(w.len_k, w.heads_kv, w.head_dim)
    left, right = (w.window, 0) if w.window else (-1, -1)
    call = AttnCall("varlen", q, k, v, w.head_dim ** -0.5, w.causal, left, right, None, cu, cu, max(lengths),
                    max(lengths))
    return Built(call, lengths=lengths)


def _build_sparse(w: Workload, q, k, v, device) -> Built:
    from torch.nn.attention.flex_attention import create_block_mask

    from ..api import make_call
    from ..ops import BlockSparseMask

    mask_mod, heads = mask_mod_for(w, device)
    compiled = heads * w.len_q * w.len_k > EAGER_MASK_LIMIT
    create = torch.compile(create_block_mask) if compiled else create_block_mask
    start = time.perf_counter()
    block_mask = create(mask_mod, 1, heads, w.len_q, w.len_k, device=device, BLOCK_SIZE=w.block)
    sync(device)
    created = time.perf_counter()
    sparse = BlockSparseMask.from_block_mask(block_mask)
    sync(device)
    setup = {"create_block_mask_s": created - start, "create_block_mask_compiled": compiled,
             "convert_s": time.perf_counter() - created}
    return Built(make_call(q, k, v, block_mask=sparse), block_mask=block_mask, setup_s=setup)


